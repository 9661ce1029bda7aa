/*
 * MPI helpers shared by the MPI communicator (mpi.c) and the peer watch (peer_watch.c), defined
 * in mpi_support.c below both: error text for MOE_MPI_CHECK (core/error.h), completion calls
 * whose errors return, and a duplicate under a deadline.
 */
#ifndef MOE_COMM_MPI_SUPPORT_H
#define MOE_COMM_MPI_SUPPORT_H

#include <mpi.h>

#include <moe/core.h>

#include "core/error.h"

/* MPI's text for an error code (thread-local buffer, valid until the thread's next call). */
const char *moe_mpi_describe(int rc);

/* MPI_Testall whose errors return. Open MPI 4.1 raises an error that a non-blocking
 * collective meets (a count mismatch: MPI_ERR_TRUNCATE) on MPI_COMM_WORLD's error handler,
 * whatever the request's communicator, and that handler is fatal by default: the whole job
 * would abort. For the duration of the call the world's handler returns errors; the previous
 * one is put back after (with MPI_THREAD_MULTIPLE another thread's error on MPI_COMM_WORLD in
 * that window returns instead of aborting). */
int moe_mpi_testall(int n, MPI_Request *reqs, int *flag, MPI_Status *statuses);

/* MPI_Comm_idup under the deadline, so that a rank that never comes (it failed before
 * creating its mesh) makes the others time out instead of hanging; the copy returns errors.
 * After a timeout MPI may still write the new handle: its slot is leaked. */
moe_status_t moe_mpi_dup_within(MPI_Comm parent, int timeout_ms, MPI_Comm *out);

#endif /* MOE_COMM_MPI_SUPPORT_H */
