/*
 * compare_checkpoints: load the newest checkpoint of two trainer runs into one single-rank
 * model each and compare every tensor of the state (dense parameters, MoE layer parameters,
 * optimizer masters and moments) by relative norm error |a - b| / |b|.
 *
 *   mpirun -np 1 compare_checkpoints DIR_A DIR_B TOLERANCE [trainer flags...]
 *
 * The flags are the runs' model flags (the mesh is forced to one rank): checkpoints written at
 * any mesh load here, resharded by libmoe. Exit 0 when every error is <= TOLERANCE (0: the
 * states must be bitwise equal), 1 otherwise, 2 on a usage or load error.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "config.h"
#include "plan.h"

typedef struct flat {
    int64_t step;
    int count;
    char names[512][128];
    float *data[512];
    int64_t n[512];
} flat_t;

static void add(flat_t *f, const char *name, const float *data, int64_t n)
{
    if (f->count == 512) return;
    snprintf(f->names[f->count], sizeof f->names[0], "%s", name);
    f->data[f->count] = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    memcpy(f->data[f->count], data, sizeof(float) * (size_t)n);
    f->n[f->count++] = n;
}

/* Every tensor of the trainer's state, as loaded. */
static int snapshot(trainer_t *t, const char *dir, flat_t *f)
{
    trainer_ckpt_t ck;
    if (trainer_ckpt_open(&ck, t, dir) || trainer_ckpt_resume(&ck, t) != 0) return -1;
    model_t *m = t->model;
    for (int32_t i = 0; i < m->nparams; i++)
        add(f, m->params[i]->name, m->params[i]->value,
            m->params[i]->shape[0] * m->params[i]->shape[1]);
    for (int64_t b = 0; b < m->chunks * m->blocks_per_chunk; b++) {
        int32_t np;
        moe_layer_num_params(m->blocks[b].moe, &np);
        for (int32_t i = 0; i < np; i++) {
            moe_param_info_t info = {.struct_size = sizeof info};
            moe_layer_param(m->blocks[b].moe, i, &info);
            char name[128];
            snprintf(name, sizeof name, "blocks.%lld.moe.%s", (long long)m->blocks[b].index,
                     info.name);
            add(f, name, info.value.data, moe_tensor_numel(&info.value));
        }
    }
    int32_t ns;
    moe_adamw_num_states(t->opt, &ns);
    for (int32_t i = 0; i < ns; i++) {
        moe_param_info_t info = {.struct_size = sizeof info};
        moe_adamw_state(t->opt, i, &info);
        add(f, info.name, info.value.data, moe_tensor_numel(&info.value));
    }
    f->step = t->step;
    printf("%s: step %lld, %d tensors\n", dir, (long long)t->step, f->count);
    return trainer_ckpt_close(&ck);
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    if (argc < 4) {
        fprintf(stderr, "usage: compare_checkpoints DIR_A DIR_B TOLERANCE [trainer flags]\n");
        return 2;
    }
    double tol = atof(argv[3]);
    trainer_config_t c;
    trainer_config_default(&c);
    char err[512];
    argv[3] = argv[0]; /* the trainer flags start after the tolerance */
    if (trainer_config_parse_args(&c, argc - 3, argv + 3, err, sizeof err)) {
        fprintf(stderr, "compare_checkpoints: %s\n", err);
        return 2;
    }
    c.tp = c.ep = c.dp = c.pp = 1;
    c.virtual_stages = 1;
    c.resume = 1;
    corpus_t none = {0};
    static flat_t a, b;
    flat_t *runs[2] = {&a, &b};
    for (int r = 0; r < 2; r++) {
        trainer_t t;
        if (trainer_setup(&t, &c, &none) || snapshot(&t, argv[1 + r], runs[r])) return 2;
        trainer_teardown(&t);
    }
    int bad = a.step != b.step || a.count != b.count;
    double worst = 0;
    const char *worst_name = "-";
    for (int i = 0; i < a.count && !bad; i++) {
        double diff = 0, ref = 0;
        for (int64_t j = 0; j < a.n[i]; j++) {
            double d = (double)a.data[i][j] - (double)b.data[i][j];
            diff += d * d;
            ref += (double)b.data[i][j] * b.data[i][j];
        }
        double rel = ref > 0 ? sqrt(diff / ref) : sqrt(diff);
        int same_bits = memcmp(a.data[i], b.data[i], sizeof(float) * (size_t)a.n[i]) == 0;
        if (rel > worst || (tol == 0 && !same_bits && worst == 0)) {
            worst = rel;
            worst_name = a.names[i];
        }
        bad |= tol == 0 ? !same_bits : !(rel <= tol);
    }
    printf("compare: steps %lld / %lld, largest relative error %.3e (%s), tolerance %.1e%s: %s\n",
           (long long)a.step, (long long)b.step, worst, worst_name, tol,
           tol == 0 ? " (bitwise)" : "", bad ? "FAIL" : "ok");
    trainer_config_free(&c);
    MPI_Finalize();
    return bad ? 1 : 0;
}
