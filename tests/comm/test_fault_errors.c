/*
 * An MPI error inside one of libmoe's non-blocking collectives becomes a status on every rank,
 * not a job abort. Open MPI 4.1 raises such errors (here a count mismatch: MPI_ERR_TRUNCATE)
 * on MPI_COMM_WORLD's handler, fatal by default, whatever the request's communicator.
 *
 * 4 ranks, an ep = 4 mesh (host backend, 10 s timeout): an all-reduce on the mesh's ep
 * communicator where rank 0 passes 4 elements and the others 8. The rank MPI reports the
 * error to fails with COMM_ERROR naming the operation and the axis; it tells the others,
 * whose waits stop at once with ABORTED naming that rank; nobody waits for the timeout. Then
 * moe_runtime_get_async_error reports the failure and moe_runtime_destroy returns ABORTED.
 * Runs under mpirun --enable-recovery: MPI cannot finish after the failure.
 */
#include <mpi.h>
#include <string.h>

#include <moe/moe.h>

#include "comm/comm.h"
#include "fault_support.h"
#include "runtime/runtime.h"

#define TIMEOUT_MS 10000
#define FAST_S 5.0

int main(int argc, char **argv)
{
    fault_init(&argc, &argv, 4);
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.ep = 4;
    mc.timeout_ms = TIMEOUT_MS;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    moe_runtime_t *rt = NULL;
    moe_status_t st = moe_runtime_create(&rc, &rt);
    FCHECK(st == MOE_STATUS_SUCCESS, "runtime: %s", moe_last_error());
    if (st != MOE_STATUS_SUCCESS) fault_verdict(NULL, 0, 0);
    /* every rank has its runtime before the first one fails (the failure would otherwise stop
     * a rank still finishing its creation, which is right but not this test's point) */
    MPI_Barrier(MPI_COMM_WORLD);

    float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    double t0 = fault_now_s();
    st = moe_comm_allreduce(rt->mesh->comm[MOE_AXIS_EP], v, v, fault_rank == 0 ? 4 : 8,
                            MOE_COMM_F32, MOE_REDUCE_SUM);
    double dt = fault_now_s() - t0;
    const char *msg = moe_last_error();
    fprintf(stderr, "rank %d: mismatched all-reduce: %s after %.2f s: %s\n", fault_rank,
            moe_status_string(st), dt, msg);
    FCHECK(st == MOE_STATUS_COMM_ERROR || st == MOE_STATUS_ABORTED, "status %s",
           moe_status_string(st));
    FCHECK(dt < FAST_S, "took %.2f s", dt);
    FCHECK(strstr(msg, "allreduce on the ep communicator") != NULL, "message: %s", msg);
    if (st == MOE_STATUS_ABORTED)
        FCHECK(strstr(msg, "failed: allreduce on the ep communicator") != NULL,
               "an ABORTED rank's message names the rank that failed: %s", msg);

    char cause[512];
    moe_status_t async = moe_runtime_get_async_error(rt, cause, sizeof cause);
    FCHECK(async != MOE_STATUS_SUCCESS, "get_async_error: success");
    FCHECK(strstr(cause, "allreduce on the ep communicator") != NULL, "cause: %s", cause);
    /* the mesh is poisoned: another collective fails at once */
    t0 = fault_now_s();
    st = moe_comm_barrier(rt->mesh->comm[MOE_AXIS_EP]);
    FCHECK(st == MOE_STATUS_ABORTED && fault_now_s() - t0 < 1.0, "barrier after: %s in %.2f s",
           moe_status_string(st), fault_now_s() - t0);
    t0 = fault_now_s();
    st = moe_runtime_destroy(rt);
    FCHECK(st == MOE_STATUS_ABORTED, "destroy: %s (%s)", moe_status_string(st), moe_last_error());
    FCHECK(fault_now_s() - t0 < 1.0, "destroy took %.2f s", fault_now_s() - t0);
    fault_verdict(NULL, 0, 0);
}
