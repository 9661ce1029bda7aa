/* The trainer's progress lines and JSON-lines metrics (metrics.h). */
#include "metrics.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "memplan.h"

#define HOST_PEAK_TFLOPS 0.05
#define CUDA_PEAK_TFLOPS 774.0 /* the H200's measured bf16 GEMM rate (bench/results) */

/* A resumed run replays the steps after its checkpoint: drop the file's lines of those steps
 * (written by the run that stopped), so every step appears once. */
static int drop_after(const char *path, int64_t step)
{
    FILE *in = fopen(path, "r");
    if (!in) return 0; /* no file yet */
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *out = fopen(tmp, "w");
    if (!out) {
        perror(tmp);
        fclose(in);
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, in) > 0) {
        cJSON *j = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(j, "step");
        if (!cJSON_IsNumber(s) || s->valuedouble <= (double)step) fputs(line, out);
        cJSON_Delete(j);
    }
    free(line);
    fclose(in);
    if (fclose(out) != 0 || rename(tmp, path) != 0) {
        perror(path);
        return -1;
    }
    return 0;
}

int metrics_open(metrics_t *mx, const trainer_t *t, double unigram_bits)
{
    const trainer_config_t *c = t->cfg;
    memset(mx, 0, sizeof *mx);
    double peak = c->peak_tflops > 0            ? c->peak_tflops
                  : !strcmp(c->backend, "cuda") ? CUDA_PEAK_TFLOPS
                                                : HOST_PEAK_TFLOPS;
    mx->peak_flops = peak * 1e12 * t->plan.world;
    mx->flops_per_token = model_flops_per_token(c);
    mx->tokens_per_step = (double)(c->batch * c->context);
    mx->unigram_bits = unigram_bits;
    mx->world = t->plan.world;
    if (!c->metrics[0]) return 0;
    mx->busy = calloc((size_t)mx->world, sizeof *mx->busy);
    if (!mx->busy) return -1;
    if (t->plan.world_rank != 0) return 0;
    if (c->resume && drop_after(c->metrics, t->step)) return -1;
    mx->jsonl = fopen(c->metrics, c->resume ? "a" : "w");
    if (!mx->jsonl) {
        perror(c->metrics);
        return -1;
    }
    return 0;
}

static double bits(double nats) { return nats / log(2.0); }

/* Max and mean of a layer's expert loads (accepted slots). */
static void load_balance(const double *counts, int64_t E, double *max, double *mean)
{
    double sum = 0, mx = 0;
    for (int64_t e = 0; e < E; e++) {
        sum += counts[e];
        if (counts[e] > mx) mx = counts[e];
    }
    *max = mx;
    *mean = sum / (double)E;
}

void metrics_busy(metrics_t *mx, double busy_s)
{
    if (!mx->busy) return;
    MPI_Gather(&busy_s, 1, MPI_DOUBLE, mx->busy, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* "busy_s": every rank's busy time, and the slowest one over their median. */
static void write_busy(FILE *f, const metrics_t *mx)
{
    double sorted[mx->world];
    fprintf(f, "\"busy_s\":[");
    for (int r = 0; r < mx->world; r++) {
        fprintf(f, "%s%.6f", r ? "," : "", mx->busy[r]);
        sorted[r] = mx->busy[r];
    }
    qsort(sorted, (size_t)mx->world, sizeof *sorted, cmp_double);
    int n = mx->world;
    double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
    fprintf(f, "],\"busy_max_over_median\":%.4f,", median > 0 ? sorted[n - 1] / median : 0);
}

static void write_json(metrics_t *mx, const trainer_t *t, const step_report_t *r, double tps,
                       double mfu)
{
    const trainer_config_t *c = t->cfg;
    FILE *f = mx->jsonl;
    fprintf(f, "{\"step\":%lld,\"loss\":%.17g,\"train_bpb\":%.6f,", (long long)r->step, r->loss,
            bits(r->loss));
    if (r->val_loss >= 0)
        fprintf(f, "\"val_loss\":%.17g,\"val_bpb\":%.6f,", r->val_loss, bits(r->val_loss));
    else
        fprintf(f, "\"val_loss\":null,\"val_bpb\":null,");
    fprintf(f,
            "\"unigram_bpb\":%.6f,\"lr\":%.9g,\"grad_norm\":%.9g,\"tokens_per_s\":%.1f,"
            "\"mfu\":%.6g,\"step_s\":%.6f,",
            mx->unigram_bits, r->lr, r->grad_norm, tps, mfu, r->step_s);
    const phase_times_t *p = &r->times;
    fprintf(f,
            "\"phases_rank0_s\":{\"forward\":%.6f,\"backward\":%.6f,\"loss\":%.6f,"
            "\"optimizer\":%.6f,\"pipeline_wait\":%.6f,\"checkpoint_stall\":%.6f,"
            "\"moe_forward\":%.6f,\"moe_backward\":%.6f},",
            p->forward, p->backward, p->loss, p->optimizer, p->pipeline_wait, r->ckpt_stall_s,
            p->moe_forward, p->moe_backward);
    write_busy(f, mx);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(f, "\"max_rss_mb_rank0\":%.1f,", (double)ru.ru_maxrss / 1024.0);
    if (!strcmp(c->backend, "cuda")) /* the device's memory in use, every process's */
        fprintf(f, "\"device_used_mb_rank0\":%.1f,", memplan_measured(c) / (1024.0 * 1024.0));
    fprintf(f, "\"layers\":[");
    int64_t E = c->experts;
    for (int64_t l = 0; l < c->layers; l++) {
        const double *counts = t->stats.counts + l * E;
        double max, mean;
        load_balance(counts, E, &max, &mean);
        fprintf(f, "%s{\"layer\":%lld,\"tokens_per_expert\":[", l ? "," : "", (long long)l);
        for (int64_t e = 0; e < E; e++) fprintf(f, "%s%.0f", e ? "," : "", counts[e]);
        double slots = t->stats.slots[l];
        fprintf(f,
                "],\"max_load\":%.0f,\"mean_load\":%.3f,\"max_over_mean\":%.4f,"
                "\"entropy\":%.6f,\"dropped_ratio\":%.6f,\"aux\":%.6g,\"z\":%.6g}",
                max, mean, mean > 0 ? max / mean : 0, t->stats.entropy[l],
                slots > 0 ? t->stats.dropped[l] / slots : 0, t->stats.aux[l], t->stats.z[l]);
    }
    fprintf(f, "]}\n");
    fflush(f);
}

void metrics_step(metrics_t *mx, const trainer_t *t, const step_report_t *r)
{
    if (t->plan.world_rank != 0) return;
    const trainer_config_t *c = t->cfg;
    double tps = r->step_s > 0 ? mx->tokens_per_step / r->step_s : 0;
    double mfu = r->step_s > 0
                     ? mx->flops_per_token * mx->tokens_per_step / r->step_s / mx->peak_flops
                     : 0;
    if (mx->jsonl) write_json(mx, t, r, tps, mfu);
    if (r->step % c->progress_every != 0 && r->val_loss < 0 && r->step != c->steps) return;
    /* per layer: the busiest expert over the mean, the routing entropy, the dropped share */
    char load[256] = "", ent[256] = "", drop[256] = "";
    size_t nl = 0, ne = 0, nd = 0;
    for (int64_t l = 0; l < c->layers; l++) {
        double max, mean, slots = t->stats.slots[l];
        load_balance(t->stats.counts + l * c->experts, c->experts, &max, &mean);
        const char *sep = l ? "," : "";
        nl += (size_t)snprintf(load + nl, nl < sizeof load ? sizeof load - nl : 0, "%s%.2f", sep,
                               mean > 0 ? max / mean : 0);
        ne += (size_t)snprintf(ent + ne, ne < sizeof ent ? sizeof ent - ne : 0, "%s%.2f", sep,
                               t->stats.entropy[l]);
        nd += (size_t)snprintf(drop + nd, nd < sizeof drop ? sizeof drop - nd : 0, "%s%.3f", sep,
                               slots > 0 ? t->stats.dropped[l] / slots : 0);
    }
    char val[48] = "";
    if (r->val_loss >= 0) snprintf(val, sizeof val, " | val %.3f bpb", bits(r->val_loss));
    printf("step %5lld/%lld  loss %.4f (%.3f bpb)%s | %.0f tok/s  mfu %.2f%% | load max/mean "
           "%s  entropy %s  dropped %s | %.0f ms\n",
           (long long)r->step, (long long)c->steps, r->loss, bits(r->loss), val, tps, 100 * mfu,
           load, ent, drop, 1e3 * r->step_s);
    fflush(stdout);
}

void metrics_close(metrics_t *mx)
{
    if (mx->jsonl) fclose(mx->jsonl);
    mx->jsonl = NULL;
    free(mx->busy);
    mx->busy = NULL;
}
