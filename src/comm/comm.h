/*
 * The communicator interface: one table, two implementations.
 *   mpi.c   host buffers; when the runtime's buffers live on a GPU it stages them through
 *           pinned host memory, so several ranks can share one GPU.
 *   nccl.c  device buffers, enqueued on the communicator's own stream.
 *
 * Every operation is started non-blocking and completed by moe_comm_wait, which fails with
 * MOE_STATUS_TIMEOUT (naming the communicator and its ranks) once the communicator's timeout
 * passes; after a timeout or an abort the communicator is unusable. Blocking helpers below
 * are start + wait. Collectives must be started in the same order on every member.
 * Counts and displacements are in elements.
 */
#ifndef MOE_COMM_H
#define MOE_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <moe/mesh.h>

#include "../core/log.h"

typedef enum moe_comm_dtype {
    MOE_COMM_F32 = 0,
    MOE_COMM_BF16 = 1,
    MOE_COMM_I32 = 2,
    MOE_COMM_I64 = 3,
    MOE_COMM_F64 = 4,
    MOE_COMM_U8 = 5
} moe_comm_dtype_t;

typedef enum moe_reduce_op {
    MOE_REDUCE_SUM = 0,
    MOE_REDUCE_MAX = 1,
    MOE_REDUCE_MIN = 2
} moe_reduce_op_t;

size_t moe_comm_dtype_size(moe_comm_dtype_t dt);

typedef struct moe_comm moe_comm_t;
typedef struct moe_comm_req moe_comm_req_t; /* an operation in flight, owned by its comm */

typedef struct moe_comm_ops {
    const char *name; /* "mpi" or "nccl" */
    moe_status_t (*allreduce)(moe_comm_t *c, const void *send, void *recv, size_t count,
                              moe_comm_dtype_t dt, moe_reduce_op_t op, moe_comm_req_t **req);
    moe_status_t (*broadcast)(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                              int root, moe_comm_req_t **req);
    moe_status_t (*alltoallv)(moe_comm_t *c, const void *send, const size_t *send_counts,
                              const size_t *send_displs, void *recv, const size_t *recv_counts,
                              const size_t *recv_displs, moe_comm_dtype_t dt,
                              moe_comm_req_t **req);
    moe_status_t (*send)(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                         int peer, int tag, moe_comm_req_t **req);
    moe_status_t (*recv)(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int peer,
                         int tag, moe_comm_req_t **req);
    /* complete (or with `test`, poll) an operation; the request is freed on completion */
    moe_status_t (*wait)(moe_comm_t *c, moe_comm_req_t *req);
    moe_status_t (*test)(moe_comm_t *c, moe_comm_req_t *req, bool *done);
    moe_status_t (*barrier)(moe_comm_t *c);
    /* ranks with equal color form a new communicator ordered by key; collective */
    moe_status_t (*split)(moe_comm_t *c, int color, int key, const char *name, moe_comm_t **out);
    /* stop in-flight work and make the communicator unusable (peers will time out) */
    void (*abort)(moe_comm_t *c);
    void (*destroy)(moe_comm_t *c);
} moe_comm_ops_t;

struct moe_comm {
    const moe_comm_ops_t *ops;
    void *impl;
    int rank, size;
    char name[32];            /* axis name for messages: "tp", "ep", "dp", "pp", "edp", "world" */
    int timeout_ms;
    bool device_buffers;      /* buffers passed in live on the GPU */
    const moe_logger_t *logger;
};

/* Blocking helpers (start + wait). */
moe_status_t moe_comm_allreduce(moe_comm_t *c, const void *send, void *recv, size_t count,
                                moe_comm_dtype_t dt, moe_reduce_op_t op);
moe_status_t moe_comm_broadcast(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                int root);
moe_status_t moe_comm_alltoallv(moe_comm_t *c, const void *send, const size_t *send_counts,
                                const size_t *send_displs, void *recv, const size_t *recv_counts,
                                const size_t *recv_displs, moe_comm_dtype_t dt);
moe_status_t moe_comm_barrier(moe_comm_t *c);
void moe_comm_destroy(moe_comm_t *c);

#endif /* MOE_COMM_H */
