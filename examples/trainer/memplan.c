/* The memory plan (memplan.h): one rank's bytes counted from the config, and the start-up
 * check against the memory the rank can have. The counts follow the allocations of
 * model_host.c / model_cuda.c, the MoE layer (src/layer: routing.c, single_rank.c,
 * expert_parallel.c), AdamW and the checkpointer; tests/trainer/run_trainer.py plan compares
 * the total with a run's peak. */
#include "memplan.h"

#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#ifdef TRAINER_CUDA
#include <cuda_runtime.h>
#endif

#include "model.h"

#define MIB (1024.0 * 1024.0)
#define CKPT_PINNED_BUDGET (2.0 * 1024 * MIB) /* the checkpointer's default pinned budget */
/* The CUDA context, the loaded kernels (libmoe's, cuBLAS's) and cuBLAS's workspace: the device
 * memory in use (total - free) less the other terms came to 820-833 MiB on the H100 and the
 * H200 at 0.1 to 3 G parameters, on top of the 256 MiB workspace reserve */
#define CUDA_FIXED (1088.0 * MIB)
#define FIT_SHARE 0.95 /* of the available memory a plan may take */

static const char *const KNOB_STATE =
    "mesh.ep (shards the experts), mesh.pp (splits the blocks), mesh.tp (splits F)";
static const char *const KNOB_ACT =
    "train.microbatches (smaller microbatches), train.batch or model.context";

static void add(memplan_t *p, const char *name, double bytes, const char *knob)
{
    p->term[p->nterms++] = (memplan_term_t){name, bytes, knob};
}

void memplan_compute(const trainer_config_t *c, int32_t stage, double process_bytes, memplan_t *p)
{
    memset(p, 0, sizeof *p);
    int cuda = !strcmp(c->backend, "cuda");
    double a = cuda ? 2 : 4; /* the model's dtype: bf16 on CUDA, f32 on the host */
    double H = (double)c->hidden, T = (double)c->context, E = (double)c->experts;
    double K = (double)c->top_k, m = (double)c->microbatches, nh = (double)c->heads;
    double El = E / (double)c->ep, Fl = (double)c->ffn_hidden / (double)c->tp;
    double S = (double)(c->batch / (c->microbatches * c->ep * c->dp)), N = S * T;
    double V = MODEL_VOCAB;
    double blocks = (double)(c->layers / c->pp);
    int first = stage == 0, last = stage == c->pp - 1;
    p->stage = stage;

    /* parameters: dense (embeddings on the first stage, head on the last) and MoE shards */
    double dense = blocks * (2 * H + 4 * H * H) + (first ? (V + T) * H : 0) +
                   (last ? H + V * H : 0);
    double moe = blocks * (H * E + El * 3 * H * Fl);
    double params = dense + moe;
    p->params = (int64_t)params;
    add(p, "parameters", params * a + (c->expert_bias ? blocks * E * 4 : 0), KNOB_STATE);
    add(p, "gradients", params * 4, KNOB_STATE);
    add(p, "optimizer", params * 12, KNOB_STATE);

    /* dense activations: a set per block and microbatch, plus the backend's workspaces */
    /* attention keeps its probabilities [S,nh,T,T] on the host, a log-sum-exp per row and
     * head on CUDA (fused: no scores in memory) */
    double kept = cuda ? nh * N * 4 : S * nh * T * T * a;
    double act = blocks * m * (9 * N * H * a + kept + 2 * N * 4);
    if (first) act += m * N * H * a + m * N + (cuda ? m * (N + V + 1) * 4 : 0);
    if (cuda) {
        act += nh * N * 4 + 9 * N * H * 2;
        if (last) act += N * H * 2 + N * V * 6 + N * 9;
    } else {
        act += 7 * N * (3 * H > V ? 3 * H : V) * 4;
        if (last) act += N * H * 4 + N * 4 + N * V * 4;
    }
    add(p, "activations", act, KNOB_ACT);

    /* MoE state held from forward to backward, at the dropless bound */
    int64_t v = c->virtual_stages, pp = c->pp, inflight = pp - stage;
    if (v > 1) inflight = pp * v;
    if (inflight > c->microbatches * v) inflight = c->microbatches * v;
    p->in_flight = inflight;
    double rows_sent = N * K, rows_recv = (double)c->ep * N * K;
    double routing = N * H * a + N * E * 4 + N * K * 16;
    double rows = c->ep == 1 ? rows_sent * (2 * H + 3 * Fl) * a
                             : rows_sent * H * a + rows_recv * (H + 3 * Fl) * a;
    add(p, "moe_saved", (double)inflight * blocks * (routing + rows),
        "train.microbatches (fewer tokens each), train.batch, model.top_k");
    /* one layer's temporaries: backward's gradients of the rows (forward's are smaller) */
    double tmp = N * K * 4 + N * E * 4 +
                 (c->ep == 1 ? rows_sent * (2 * H + 3 * Fl) * a
                             : (rows_sent + rows_recv) * 2 * H * a + rows_recv * 3 * Fl * a);
    add(p, "moe_backward", tmp, "train.microbatches, train.batch, model.top_k");
    add(p, "pipeline", 2 * m * N * H * a, "train.batch or train.microbatches");

    double state = params * (a + 12);
    double staging = c->ckpt_dir[0] ? (state < CKPT_PINNED_BUDGET ? state : CKPT_PINNED_BUDGET) : 0;
    if (cuda)
        add(p, "cuda_fixed", CUDA_FIXED, "fewer ranks per GPU");
    else
        add(p, "process", process_bytes, "fewer ranks per node");
    for (int i = 0; i < p->nterms; i++) p->device_total += p->term[i].bytes;
    add(p, "ckpt_staging", staging, "MOE_CKPT_PINNED_BYTES (the checkpointer's pinned budget)");
    if (cuda)
        p->host_total = staging;
    else
        p->device_total += staging;
}

void memplan_print(FILE *out, const memplan_t *p)
{
    fprintf(out,
            "memory plan, a rank of pipeline stage %d (%lld parameters, MoE state of %lld "
            "microbatches in flight):\n",
            p->stage, (long long)p->params, (long long)p->in_flight);
    for (int i = 0; i < p->nterms; i++)
        fprintf(out, "  %-13s %12.1f MiB\n", p->term[i].name, p->term[i].bytes / MIB);
    fprintf(out, "  %-13s %12.1f MiB", "total", (p->device_total + p->host_total) / MIB);
    if (p->host_total > 0)
        fprintf(out, " (%.1f MiB on the device, %.1f MiB pinned host)", p->device_total / MIB,
                p->host_total / MIB);
    if (p->available > 0)
        fprintf(out, "; available to the rank %.1f MiB\n", p->available / MIB);
    else
        fprintf(out, "; available memory unknown\n");
}

/* This process's resident memory now (Linux; 0 where unknown). */
static double resident_bytes(void)
{
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    int n = fscanf(f, "%ld %ld", &pages, &resident);
    fclose(f);
    return n == 2 ? (double)resident * (double)sysconf(_SC_PAGESIZE) : 0;
}

/* The node's available memory (Linux's MemAvailable; 0 where unknown). */
static double host_available(void)
{
    char line[256];
    double kb = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
    fclose(f);
    return kb * 1024.0;
}

/* The memory this rank may use: the node's (host) or its GPU's free memory (CUDA), shared
 * by the ranks on it. local: the rank among its node's ranks, nlocal: their count. */
static double rank_available(const trainer_config_t *c, int local, int nlocal)
{
#ifdef TRAINER_CUDA
    if (!strcmp(c->backend, "cuda")) {
        int gpus = 0;
        size_t free_b = 0, total_b = 0;
        if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1 ||
            cudaSetDevice(local % gpus) != cudaSuccess ||
            cudaMemGetInfo(&free_b, &total_b) != cudaSuccess)
            return 0;
        int sharing = (nlocal + gpus - 1) / gpus; /* ranks pick local rank modulo the GPUs */
        return (double)free_b / sharing;
    }
#else
    (void)local;
#endif
    (void)c;
    return host_available() / nlocal;
}

int memplan_gate(const trainer_config_t *c, int rank, int world)
{
    MPI_Comm node;
    int local = 0, nlocal = 1;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_size(node, &nlocal);
    MPI_Comm_free(&node);
    (void)world;
    /* the default rank order tp-ep-dp-pp: pp is the slowest axis */
    int32_t stage = (int32_t)(rank / (c->tp * c->ep * c->dp));
    memplan_t p;
    memplan_compute(c, stage, resident_bytes(), &p);
    p.available = rank_available(c, local, nlocal);
    int fits = p.available <= 0 || p.device_total <= FIT_SHARE * p.available;
    if (c->plan) {
        /* the first rank of each stage prints its stage's plan, in stage order */
        for (int64_t s = 0; s < c->pp; s++) {
            if (rank == s * c->tp * c->ep * c->dp) {
                memplan_print(stdout, &p);
                fflush(stdout);
            }
            MPI_Barrier(MPI_COMM_WORLD);
        }
    } else if (rank == 0) {
        printf("memory plan: %.1f MiB a rank of stage 0 (largest: ", p.device_total / MIB);
        int big = 0;
        for (int i = 1; i < p.nterms; i++)
            if (p.term[i].bytes > p.term[big].bytes) big = i;
        printf("%s %.1f MiB); available %.1f MiB (--plan for the terms)\n", p.term[big].name,
               p.term[big].bytes / MIB, p.available / MIB);
    }
    int all_fit = 0;
    MPI_Allreduce(&fits, &all_fit, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!fits) {
        int big = 0;
        for (int i = 1; i < p.nterms; i++)
            if (p.term[i].bytes > p.term[big].bytes) big = i;
        fprintf(stderr,
                "moe_train: rank %d (stage %d) needs %.1f MiB but has %.1f MiB (%.0f%% "
                "of its %.1f MiB available); the largest term is %s, %.1f MiB: shrink it with "
                "%s (moe_train --plan lists the terms)\n",
                rank, stage, p.device_total / MIB, FIT_SHARE * p.available / MIB, 100 * FIT_SHARE,
                p.available / MIB, p.term[big].name, p.term[big].bytes / MIB, p.term[big].knob);
    }
    if (!all_fit) return 2;
    return c->plan ? 1 : 0;
}

double memplan_measured(const trainer_config_t *c)
{
#ifdef TRAINER_CUDA
    if (!strcmp(c->backend, "cuda")) {
        size_t free_b = 0, total_b = 0;
        return cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? (double)(total_b - free_b) : 0;
    }
#endif
    (void)c;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss * 1024.0;
}
