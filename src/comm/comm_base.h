/*
 * The bottom of comm/: what comm.c, the MPI and NCCL communicators, the MPI helpers and the
 * peer watch all use, and which itself uses none of them (so that none of those files has to
 * reach into another to name ranks or pause between polls).
 */
#ifndef MOE_COMM_BASE_H
#define MOE_COMM_BASE_H

#include <stddef.h>

/* "world rank 3" or "world ranks 1,3" for ranks[0..n), truncated with "..." to size. */
void moe_comm_format_ranks(char *out, size_t size, const int *ranks, int n);
/* Pause between polls of an operation in flight, growing with the poll count `spin`, so a
 * wait stops burning a core that the peers may need. */
void moe_comm_backoff(unsigned spin);

#endif /* MOE_COMM_BASE_H */
