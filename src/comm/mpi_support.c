/* The MPI helpers of mpi_support.h, below the MPI communicator and the peer watch. */
#include "mpi_support.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "comm_base.h"
#include "core/clock.h"

const char *moe_mpi_describe(int rc)
{
    static _Thread_local char buf[MPI_MAX_ERROR_STRING + 16];
    int len = 0;
    if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS)
        snprintf(buf, sizeof buf, "MPI error %d", rc);
    return buf;
}

int moe_mpi_testall(int n, MPI_Request *reqs, int *flag, MPI_Status *statuses)
{
    MPI_Errhandler prev = MPI_ERRHANDLER_NULL;
    bool swapped = MPI_Comm_get_errhandler(MPI_COMM_WORLD, &prev) == MPI_SUCCESS &&
                   MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) == MPI_SUCCESS;
    int rc = MPI_Testall(n, reqs, flag, statuses);
    if (swapped) MPI_Comm_set_errhandler(MPI_COMM_WORLD, prev);
    if (prev != MPI_ERRHANDLER_NULL) MPI_Errhandler_free(&prev);
    return rc;
}

moe_status_t moe_mpi_dup_within(MPI_Comm parent, int timeout_ms, MPI_Comm *out)
{
    MPI_Comm *slot = malloc(sizeof *slot);
    if (!slot) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "communicator handle");
    MPI_Request req;
    int rc = MPI_Comm_idup(parent, slot, &req);
    if (rc != MPI_SUCCESS) {
        free(slot);
        return MOE_FAIL(MOE_STATUS_COMM_ERROR, "MPI_Comm_idup: %s", moe_mpi_describe(rc));
    }
    double deadline = moe_now_ms() + timeout_ms;
    for (unsigned spin = 0;; spin++) {
        int done = 0;
        rc = moe_mpi_testall(1, &req, &done, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS)
            return MOE_FAIL(MOE_STATUS_COMM_ERROR, "MPI_Comm_idup: %s", moe_mpi_describe(rc));
        if (done) break;
        if (moe_now_ms() > deadline) {
            int size = 0;
            MPI_Comm_size(parent, &size);
            return MOE_FAIL(MOE_STATUS_TIMEOUT,
                            "duplicating the parent communicator (%d ranks) did not complete "
                            "within %d ms: a rank is dead, stalled or never created its mesh",
                            size, timeout_ms);
        }
        moe_comm_backoff(spin);
    }
    *out = *slot;
    free(slot);
    rc = MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        MPI_Comm_free(out);
        return MOE_FAIL(MOE_STATUS_COMM_ERROR, "MPI_Comm_set_errhandler: %s", moe_mpi_describe(rc));
    }
    return MOE_STATUS_SUCCESS;
}
