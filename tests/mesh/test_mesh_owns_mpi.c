/*
 * A program that never calls MPI: libmoe initialises MPI for the first mesh and finalises it
 * when the last mesh is destroyed. Run with 2 ranks: two runtimes alive at once, an
 * all-reduce through each, then both destroyed (MPI finalised only after the second).
 */
#include <stdio.h>
#include <string.h>

#include "runtime/runtime.h"
#include "test_support.h"

int main(void)
{
    moe_mesh_config_t mc = moe_mesh_config_default();
    mc.ep = 2;
    moe_runtime_config_t rc = moe_runtime_config_default();
    rc.backend = MOE_BACKEND_HOST;
    rc.mesh = &mc;
    if (moe_comm_mpi_ready()) return 1;
    moe_runtime_t *a = NULL, *b = NULL;
    TEST_OK(moe_runtime_create(&rc, &a));
    if (!moe_comm_mpi_ready()) return 2;
    TEST_OK(moe_runtime_create(&rc, &b));
    int32_t rank, size;
    TEST_OK(moe_runtime_axis(a, MOE_AXIS_EP, &rank, &size));
    float x = (float)rank + 1, y = 0;
    TEST_OK(
        moe_comm_allreduce(a->mesh->comm[MOE_AXIS_EP], &x, &y, 1, MOE_COMM_F32, MOE_REDUCE_SUM));
    if (y != 3) return 3;
    TEST_OK(moe_runtime_destroy(a));
    if (!moe_comm_mpi_ready()) return 4; /* b still holds it */
    TEST_OK(
        moe_comm_allreduce(b->mesh->comm[MOE_AXIS_EP], &x, &y, 1, MOE_COMM_F32, MOE_REDUCE_SUM));
    if (y != 3) return 5;
    TEST_OK(moe_runtime_destroy(b));
    if (moe_comm_mpi_ready()) return 6; /* finalised by the last destroy */
    /* MPI cannot come back: a new mesh says so */
    moe_runtime_t *c = NULL;
    moe_status_t st = moe_runtime_create(&rc, &c);
    if (st != MOE_STATUS_UNSUPPORTED || !strstr(moe_last_error(), "already finalised")) return 7;
    fprintf(stderr, "rank %d: ok\n", rank);
    return 0;
}
