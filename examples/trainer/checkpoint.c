/* The trainer's checkpoints (checkpoint.h). */
#include "checkpoint.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

static int report(const char *what)
{
    fprintf(stderr, "moe_train: %s: %s\n", what, moe_last_error());
    return -1;
}

static int add_dense(moe_train_state_t *s, const model_t *m, dense_param_t *p)
{
    moe_tensor_t v;
    moe_tensor_view(p->value, m->dtype, m->device, p->ndim, p->shape, &v);
    v.device_index = m->device_index;
    moe_ckpt_tensor_t e = moe_ckpt_tensor_whole(p->name, &v);
    return moe_train_state_add_tensor(s, &e, MOE_PARAM_DENSE) == MOE_STATUS_SUCCESS ? 0 : -1;
}

int trainer_ckpt_open(trainer_ckpt_t *k, trainer_t *t, const char *dir)
{
    memset(k, 0, sizeof *k);
    const trainer_config_t *c = t->cfg;
    k->verbose = t->plan.world_rank == 0;
    snprintf(k->dir, sizeof k->dir, "%s", dir);
    moe_ckpt_config_t cc = moe_ckpt_config_default();
    cc.dir = dir;
    cc.keep_last = (int32_t)c->keep_last;
    cc.chunk_bytes = 1 << 20; /* small states: small staging segments */
    cc.pinned_budget_bytes = 64u << 20;
    if (c->s3_bucket[0]) {
        cc.s3_bucket = c->s3_bucket;
        cc.s3_endpoint = c->s3_endpoint[0] ? c->s3_endpoint : NULL;
        cc.s3_prefix = c->s3_prefix;
        k->s3 = 1;
    }
    if (moe_ckpt_create(t->rt, &cc, &k->ck) != MOE_STATUS_SUCCESS) return report("moe_ckpt_create");
    if (moe_train_state_create(&k->state) != MOE_STATUS_SUCCESS)
        return report("moe_train_state_create");
    model_t *m = t->model;
    for (int32_t i = 0; i < m->nparams; i++)
        if (add_dense(k->state, m, m->params[i])) return report(m->params[i]->name);
    for (int64_t i = 0; i < m->chunks * m->blocks_per_chunk; i++) {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "blocks.%lld.moe.", (long long)m->blocks[i].index);
        if (moe_train_state_add_layer(k->state, m->blocks[i].moe, prefix) != MOE_STATUS_SUCCESS)
            return report(prefix);
    }
    if (moe_train_state_add_adamw(k->state, t->opt, "optim.") != MOE_STATUS_SUCCESS)
        return report("optimizer state");
    int64_t shape[1] = {4};
    moe_tensor_t d;
    moe_tensor_view(k->data, MOE_DTYPE_F32, MOE_DEVICE_HOST, 1, shape, &d);
    moe_ckpt_tensor_t e = moe_ckpt_tensor_whole("trainer.data", &d);
    if (moe_train_state_add_tensor(k->state, &e, MOE_PARAM_BUFFER) != MOE_STATUS_SUCCESS)
        return report("trainer.data");
    return 0;
}

static void seed_limbs(uint64_t seed, float *out)
{
    for (int i = 0; i < 4; i++) out[i] = (float)(seed >> (16 * i) & 0xffffu);
}

int trainer_ckpt_save(trainer_ckpt_t *k, trainer_t *t, int64_t step)
{
    /* the caller's stall: the fence of k->data (an earlier save may still copy it) and the
     * save call; the copy itself runs under the next steps, whose optimizer waits for it */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    moe_status_t st = moe_ckpt_fence(k->ck);
    if (st != MOE_STATUS_SUCCESS) return report("checkpoint fence");
    seed_limbs((uint64_t)t->cfg->seed, k->data);
    st = moe_ckpt_save_train_state(k->ck, step, k->state);
    clock_gettime(CLOCK_MONOTONIC, &b);
    k->last_stall_s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    if (st != MOE_STATUS_SUCCESS) return report("checkpoint save");
    k->uncommitted = 1;
    k->pending = step;
    return 0;
}

static void committed(trainer_ckpt_t *k)
{
    if (k->verbose && k->uncommitted)
        printf("checkpoint: step %lld saved in %s\n", (long long)k->pending, k->dir);
    k->uncommitted = 0;
}

int trainer_ckpt_progress(trainer_ckpt_t *k)
{
    if (!k->ck || !k->uncommitted) return 0;
    /* every rank gets the same SUCCESS or TIMEOUT (the wait agrees), so all keep the flag alike */
    moe_status_t st = moe_ckpt_wait(k->ck, 0, 0);
    if (st == MOE_STATUS_TIMEOUT) return 0; /* still being written somewhere: next step */
    if (st != MOE_STATUS_SUCCESS) return report("checkpoint commit");
    committed(k);
    return 0;
}

int64_t trainer_ckpt_newest(trainer_ckpt_t *k)
{
    int64_t step = -1;
    int32_t count = 0;
    if (moe_ckpt_list(k->ck, MOE_CKPT_TIER_LOCAL, &step, 1, &count) != MOE_STATUS_SUCCESS)
        return -1; /* unreadable: the first save reports it */
    return count > 0 ? step : -1;
}

int trainer_ckpt_resume(trainer_ckpt_t *k, trainer_t *t)
{
    int64_t step = -1;
    moe_status_t st = moe_ckpt_load_train_state(k->ck, -1, k->state, &step);
    if (st == MOE_STATUS_NOT_FOUND) return 1;
    if (st != MOE_STATUS_SUCCESS) return report("resume");
    float want[4];
    seed_limbs((uint64_t)t->cfg->seed, want);
    if (memcmp(want, k->data, sizeof want) != 0) {
        fprintf(stderr,
                "moe_train: resume: the checkpoint of step %lld was written with "
                "another train.seed; pass the same seed to continue its batches\n",
                (long long)step);
        return -1;
    }
    /* complete checkpoints newer than the one loaded failed verification (the loader fell
     * back past them): set aside, so training passes those steps instead of meeting them */
    int32_t aside = 0;
    if (moe_ckpt_set_aside_newer(k->ck, step, &aside) != MOE_STATUS_SUCCESS)
        return report("resume: setting aside the checkpoints newer than the one loaded");
    if (aside > 0 && k->verbose)
        fprintf(stderr,
                "moe_train: resume: %d checkpoint%s newer than step %lld failed "
                "verification; set aside in %s (.rejected-step-<N>-<time>), resuming from step "
                "%lld\n",
                (int)aside, aside == 1 ? "" : "s", (long long)step, k->dir, (long long)step);
    t->step = step;
    return 0;
}

int trainer_ckpt_close(trainer_ckpt_t *k)
{
    int rc = 0;
    /* the local tier first: its failure fails the run */
    if (k->ck && moe_ckpt_wait(k->ck, 0, -1) != MOE_STATUS_SUCCESS)
        rc = report("checkpoint wait");
    else if (k->ck)
        committed(k);
    moe_ckpt_status_t st = {.struct_size = sizeof st, .last_uploaded_step = -1};
    if (k->ck) moe_ckpt_status(k->ck, &st);
    /* destroy waits for the newest step's upload and returns the mirror's error, if any */
    if (moe_ckpt_destroy(k->ck) != MOE_STATUS_SUCCESS && rc == 0) {
        if (!k->s3)
            rc = report("checkpoint close");
        else if (k->verbose) {
            char have[48] = "no step";
            if (st.last_uploaded_step >= 0)
                snprintf(have, sizeof have, "step %lld", (long long)st.last_uploaded_step);
            fprintf(stderr,
                    "moe_train: warning: the S3 mirror failed (%s); the newest steps "
                    "are only in %s (S3 has %s)\n",
                    moe_last_error(), k->dir, have);
        }
    }
    moe_train_state_destroy(k->state);
    memset(k, 0, sizeof *k);
    return rc;
}
