/*
 * One failure costs one timeout, and its message is the timeout's own: the operation, the
 * axis and the world rank that does not answer.
 *
 * 4 ranks, a dp = 4 mesh (host backend, 2 s timeout), one layer and AdamW. Every rank runs
 * forward and backward; then world rank 3 stalls (sleeps outside libmoe) while the others
 * step the optimizer, whose reductions over the dense and the edp communicators both wait
 * for it. The step must fail once: TIMEOUT (or ABORTED when another survivor's notice comes
 * first) after about one timeout, well before two, naming "world rank 3 does not answer"
 * and an all-reduce on the dense or edp communicator, not a later "unusable" message.
 * moe_runtime_get_async_error then reports it, and the teardown returns at once (the
 * runtime's destroy with ABORTED). Runs under mpirun --enable-recovery.
 */
#include <string.h>
#include <unistd.h>

#include <moe/moe.h>

#include "fault_support.h"

#define TIMEOUT_MS 2000
#define VICTIM 3
#define H 16
#define T 32

int main(int argc, char **argv)
{
    fault_init(&argc, &argv, 4);
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.dp = 4;
    mc.timeout_ms = TIMEOUT_MS;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    moe_layer_t *layer = NULL;
    moe_adamw_t *opt = NULL;
    moe_layer_config_t lc = moe_layer_config_default();
    lc.hidden = H, lc.ffn_hidden = 32, lc.num_experts = 8, lc.top_k = 2;
    moe_status_t st = moe_runtime_create(&rc, &rt);
    if (st == MOE_STATUS_SUCCESS) st = moe_layer_create(rt, &lc, &layer);
    if (st == MOE_STATUS_SUCCESS) st = moe_adamw_create(rt, NULL, &opt);
    if (st == MOE_STATUS_SUCCESS) st = moe_adamw_add_layer(opt, layer, NULL);
    FCHECK(st == MOE_STATUS_SUCCESS, "setup: %s", moe_last_error());
    if (st != MOE_STATUS_SUCCESS) fault_verdict(NULL, 0, 0);

    static float x[T * H], y[T * H], dx[T * H];
    for (int i = 0; i < T * H; i++) x[i] = (float)((i * 7 + fault_rank * 3) % 11 - 5) * 0.1f;
    int64_t shape[2] = {T, H};
    moe_tensor_t tx, ty, tdx;
    moe_tensor_view(x, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tx);
    moe_tensor_view(y, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &ty);
    moe_tensor_view(dx, MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &tdx);
    st = moe_layer_forward(layer, 0, &tx, &ty);
    if (st == MOE_STATUS_SUCCESS) st = moe_layer_backward(layer, 0, &ty, &tdx);
    FCHECK(st == MOE_STATUS_SUCCESS, "forward/backward: %s", moe_last_error());

    const int absent[] = {VICTIM};
    if (fault_rank == VICTIM) {
        sleep(3 * TIMEOUT_MS / 1000);
        _exit(0);
    }
    double t0 = fault_now_s();
    st = moe_adamw_step(opt, 1e-3f, 1.0f);
    double dt = fault_now_s() - t0;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moe_last_error());
    fprintf(stderr, "rank %d: step: %s after %.2f s: %s\n", fault_rank, moe_status_string(st), dt,
            msg);
    FCHECK(st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_ABORTED, "step: %s", moe_status_string(st));
    FCHECK(dt < 1.75 * TIMEOUT_MS * 1e-3, "step took %.2f s: more than one timeout", dt);
    FCHECK(strstr(msg, "world rank 3 does not answer") != NULL, "no culprit named: %s", msg);
    FCHECK(strstr(msg, "allreduce on the dense communicator") ||
               strstr(msg, "allreduce on the edp communicator"),
           "no operation and axis: %s", msg);
    FCHECK(strstr(msg, "unusable") == NULL, "a later message instead of the timeout's: %s", msg);

    char cause[512] = "";
    st = moe_runtime_get_async_error(rt, cause, sizeof cause);
    FCHECK(st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_ABORTED, "async error: %s",
           moe_status_string(st));
    FCHECK(strstr(cause, "world rank 3 does not answer") != NULL, "async cause: %s", cause);

    t0 = fault_now_s();
    FCHECK(moe_adamw_destroy(opt) == MOE_STATUS_SUCCESS, "%s", moe_last_error());
    FCHECK(moe_layer_destroy(layer) == MOE_STATUS_SUCCESS, "%s", moe_last_error());
    st = moe_runtime_destroy(rt);
    dt = fault_now_s() - t0;
    FCHECK(st == MOE_STATUS_ABORTED, "runtime destroy: %s (%s)", moe_status_string(st),
           moe_last_error());
    FCHECK(dt < 1.0, "teardown took %.2f s", dt);
    fault_verdict(absent, 1, 0);
}
