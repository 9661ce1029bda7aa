/*
 * A rank that finished normally is never blamed: when a rank waits for a peer that already
 * destroyed its runtime and left, the timeout says that the peer left and that the ranks ran
 * different work, not that the peer "does not answer (dead or stalled)".
 *
 * 2 ranks, a pp = 2 pipeline of the test model (tests/pipeline/pipe_model.h, host backend,
 * 2 s timeout). Both stages train two batches. World rank 1 (stage 1) then finishes: it
 * destroys its pipeline, model and runtime (all SUCCESS) and leaves without waiting for rank
 * 0 (as a rank whose run ended would, before MPI_Finalize). World rank 0 trains one batch
 * more, as a rank given more steps does: its wait for stage 1's gradient times out. The batch
 * must fail after about one timeout with a message that names world rank 1 as having left
 * normally and says neither "does not answer" nor "dead or stalled". Runs under mpirun
 * --enable-recovery (rank 1 leaves without MPI_Finalize; rank 0's world lost a peer).
 */
#include <string.h>

#include <moe/moe.h>

#include "fault_support.h"
#include "pipe_model.h"

#define TIMEOUT_MS 2000
#define LEAVER 1

int main(int argc, char **argv)
{
    fault_init(&argc, &argv, 2);
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.pp = 2;
    mc.comm = MOE_COMM_MPI;
    mc.timeout_ms = TIMEOUT_MS;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.seed = 77;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    pm_model_t *pm = NULL;
    moe_pipeline_t *pipe = NULL;
    pm_shape_t sh = {.n = 6,
                     .h = 8,
                     .layers = 4,
                     .moe_every = 0,
                     .experts = 4,
                     .top_k = 2,
                     .ffn = 12,
                     .m = 2,
                     .seed = 4242};
    int32_t stage = 0, stages = 0;
    moe_status_t st = moe_runtime_create(&rc, &rt);
    if (st == MOE_STATUS_SUCCESS) st = moe_runtime_axis(rt, MOE_AXIS_PP, &stage, &stages);
    if (st == MOE_STATUS_SUCCESS) {
        int first, last;
        pm_split(sh.layers, stages, stage, &first, &last);
        st = pm_model_create(rt, &sh, first, last, &pm);
    }
    if (st == MOE_STATUS_SUCCESS) {
        moe_pipeline_config_t pc = moe_pipeline_config_default();
        pc.microbatches = sh.m;
        pc.act_ndim = 2;
        pc.act_shape[0] = sh.n;
        pc.act_shape[1] = sh.h;
        moe_pipeline_callbacks_t cb = pm_callbacks(pm);
        st = moe_pipeline_create(rt, &pc, &cb, &pipe);
    }
    FCHECK(st == MOE_STATUS_SUCCESS, "setup: %s", moe_last_error());
    if (st != MOE_STATUS_SUCCESS) fault_verdict(NULL, 0, 0);

    for (int i = 0; i < 2 && st == MOE_STATUS_SUCCESS; i++)
        st = moe_pipeline_train_step(pipe, NULL);
    FCHECK(st == MOE_STATUS_SUCCESS, "the shared batches: %s", moe_last_error());

    if (fault_rank == LEAVER) { /* the run is over here: a normal teardown, then gone */
        FCHECK(moe_pipeline_destroy(pipe) == MOE_STATUS_SUCCESS, "%s", moe_last_error());
        pm_model_destroy(pm);
        FCHECK(moe_runtime_destroy(rt) == MOE_STATUS_SUCCESS, "%s", moe_last_error());
        fault_verdict(NULL, 0, 0);
    }

    double t0 = fault_now_s();
    st = moe_pipeline_train_step(pipe, NULL);
    double secs = fault_now_s() - t0;
    const char *msg = moe_last_error();
    fprintf(stderr, "rank 0: the extra batch: %s after %.2f s: %s\n", moe_status_string(st), secs,
            msg);
    FCHECK(st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_ABORTED, "got %s", moe_status_string(st));
    FCHECK(strstr(msg, "world rank 1 left") != NULL,
           "the message does not say that world "
           "rank 1 left: %s",
           msg);
    FCHECK(strstr(msg, "does not answer") == NULL && strstr(msg, "dead or stalled") == NULL,
           "world rank 1, which finished normally, is blamed: %s", msg);
    FCHECK(secs < 2.0 * TIMEOUT_MS / 1000.0, "the failure took %.2f s", secs);
    /* the lost peer poisons the runtime: its teardown returns at once without MPI */
    FCHECK(moe_runtime_get_async_error(rt, NULL, 0) != MOE_STATUS_SUCCESS,
           "no asynchronous error on the runtime");
    moe_pipeline_destroy(pipe);
    pm_model_destroy(pm);
    moe_runtime_destroy(rt);
    fault_verdict(NULL, 0, 0);
}
