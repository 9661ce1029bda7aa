/*
 * The communicator interface: one table, two implementations.
 *   mpi.c   host buffers; when the runtime's buffers live on a GPU it stages them through
 *           pinned host memory, so several ranks can share one GPU.
 *   nccl.c  device buffers, enqueued on the communicator's own stream.
 *
 * Every operation is started non-blocking and completed by moe_comm_wait, which fails with
 * MOE_STATUS_TIMEOUT (naming the operation, the axis, the members and the world ranks that
 * did not deliver) once the communicator's timeout passes; after a timeout, a failed operation
 * or an abort the communicator is unusable. The communicators of a mesh share a watch
 * (peer_watch.h): the first failure of any of them makes them all unusable and is told to the
 * other ranks, whose waits then fail at once. Blocking helpers below are start + wait.
 * Collectives must be started in the same order on every member.
 * Counts and displacements are in elements.
 */
#ifndef MOE_COMM_H
#define MOE_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <moe/core.h>

#include "backend/backend.h"
#include "comm_base.h"
#include "core/log.h"
#include "peer_watch.h"

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

typedef struct moe_comm_req moe_comm_req_t; /* an operation in flight, owned by its comm */

/* Time blocked in waits: every moe_comm_wait, moe_comm_wait_within and moe_comm_barrier adds
 * its duration. A mesh's communicators share one (moe_runtime_wait_stats reports it), so a
 * rank's step time splits into the time it waited for its peers and the rest, its busy time:
 * in lock-step training every rank's wall step time is the slowest one's, and only the busy
 * time tells which rank is slow. Relaxed atomics: a reader on another thread sees a recent
 * total. */
typedef struct moe_comm_waited {
    _Atomic int64_t ns;
    _Atomic int64_t count;
} moe_comm_waited_t;

typedef struct moe_comm_ops {
    const char *name; /* "mpi" or "nccl" */
    moe_status_t (*allreduce)(moe_comm_t *c, const void *send, void *recv, size_t count,
                              moe_comm_dtype_t dt, moe_reduce_op_t op, moe_comm_req_t **req);
    moe_status_t (*broadcast)(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int root,
                              moe_comm_req_t **req);
    moe_status_t (*alltoallv)(moe_comm_t *c, const void *send, const size_t *send_counts,
                              const size_t *send_displs, void *recv, const size_t *recv_counts,
                              const size_t *recv_displs, moe_comm_dtype_t dt, moe_comm_req_t **req);
    moe_status_t (*send)(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                         int peer, int tag, moe_comm_req_t **req);
    moe_status_t (*recv)(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int peer,
                         int tag, moe_comm_req_t **req);
    /* complete within timeout_ms (or with `test`, poll) an operation; the request is freed on
     * completion */
    moe_status_t (*wait)(moe_comm_t *c, moe_comm_req_t *req, int timeout_ms);
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
    char name[32]; /* axis name for messages: "tp", "ep", "dp", "pp", "edp", "world" */
    int timeout_ms;
    bool device_buffers; /* buffers passed in live on the GPU */
    const moe_logger_t *logger;
    /* The runtime's compute backend (not owned): mpi.c stages device buffers through its
     * pinned host memory and copies; nccl.c orders each operation after the backend's
     * current stream (NULL: after the legacy default stream). */
    const moe_backend_t *backend;
    /* [size] member i's rank in the world the communicator was made from (owned, set by
     * the implementation), and "world ranks 0,2,4,6": the members, for messages. */
    int *world_ranks;
    char members[96];
    /* The mesh's failure detector (not owned; NULL outside a mesh), inherited by splits. */
    moe_comm_watch_t *watch;
    /* The mesh's wait clock (not owned; NULL: waits are not timed). */
    moe_comm_waited_t *waited;
    /* After a timeout, a failed operation or an abort the communicator is dead: every later
     * call fails with ABORTED and names the first cause (moe_comm_mark_dead). */
    bool dead;
    char dead_reason[256];
};

/* Tags of send/recv: 0 <= tag < MOE_COMM_MAX_TAG (larger ones are reserved for libmoe's
 * own traffic). NCCL has no tags: messages between two ranks match in call order. NCCL also
 * runs a communicator's operations one after another on its stream, so a send or recv holds up
 * every operation started after it until the peer reaches the matching call: each rank's start
 * order must be deadlock-free when executed in sequence (a ring exchange: even ranks send
 * first, odd ranks receive first; or alltoallv, which groups them). */
#define MOE_COMM_MAX_TAG 30000

/* ---- constructors ---------------------------------------------------------------------------
 * moe_comm_mpi_create: duplicates `mpi_comm` (a pointer to an MPI_Comm; NULL: MPI_COMM_WORLD)
 * so that libmoe's traffic never matches the caller's, and makes errors return instead of
 * aborting the job. MPI must be initialised. Collective over that communicator.
 * UNSUPPORTED in a build without MPI.
 * [in] backend: staging for device buffers (NULL: host buffers) [in] logger may be NULL. */
moe_status_t moe_comm_mpi_create(const void *mpi_comm, const char *name, int timeout_ms,
                                 const moe_backend_t *backend, const moe_logger_t *logger,
                                 moe_comm_t **out);
/* moe_comm_mpi_watch: the mesh's watch (peer_watch.h) over `world`, an MPI communicator on
 * host buffers made by moe_comm_mpi_create: created from world's rank, size, timeout, logger
 * and MPI communicator, and set as world->watch (communicators split from world later
 * inherit it). [out] out is owned by the caller (moe_comm_watch_destroy, after the
 * communicators it watches). Collective over world. UNSUPPORTED in a build without MPI. */
moe_status_t moe_comm_mpi_watch(moe_comm_t *world, moe_comm_watch_t **out);
/* moe_comm_nccl_create: an NCCL communicator over the same ranks as `bootstrap` (an MPI
 * communicator made above): rank 0 makes the unique id, broadcast through `bootstrap`; the
 * communicator is created non-blocking and polled until bootstrap->timeout_ms, then aborted
 * (MOE_STATUS_TIMEOUT). Buffers are device buffers on the current CUDA device. Collective.
 * UNSUPPORTED in a build without NCCL. split() on the result uses ncclCommSplit. */
moe_status_t moe_comm_nccl_create(moe_comm_t *bootstrap, const char *name, moe_comm_t **out);
/* MPI's process-wide state, wrapped so that the mesh needs no MPI header.
 * moe_comm_mpi_acquire: initialise MPI (MPI_THREAD_SERIALIZED) unless it already is; every
 * successful acquire is paired with a release, and MPI is finalised by the release that
 * balances the first acquire which initialised it (MPI itself is process-global: this count
 * is the one piece of process-wide state, and MPI cannot be initialised twice). */
moe_status_t moe_comm_mpi_acquire(void);
void moe_comm_mpi_release(void);
/* Release after a mesh lost a peer: MPI_Finalize would wait for it for ever, so MPI is left
 * initialised for the rest of the process (no release finalises it any more). */
void moe_comm_mpi_abandon(void);
/* True when the next release would call MPI_Finalize. */
bool moe_comm_mpi_release_finalizes(void);
/* True when MPI is initialised and not finalised. */
bool moe_comm_mpi_ready(void);
/* True when MPI was initialised with at least MPI_THREAD_FUNNELED (other threads may exist
 * while the main thread calls MPI). */
bool moe_comm_mpi_threads_ok(void);
/* Rank and size of `mpi_comm` (pointer to an MPI_Comm; NULL: MPI_COMM_WORLD). */
moe_status_t moe_comm_mpi_rank_size(const void *mpi_comm, int *rank, int *size);

/* True when this build has the backend. */
bool moe_comm_have_mpi(void);
bool moe_comm_have_nccl(void);

/* State both implementations keep the same way: record the first cause of death
 * (printf-style; returns whether c was live until now), and fail with ABORTED, naming `what`
 * and that cause, once c is dead or its watch has seen a failure. */
bool moe_comm_mark_dead(moe_comm_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
moe_status_t moe_comm_check_live(const moe_comm_t *c, const char *what);
/* Dead itself, or its watch has seen a failure: nothing more may be started or waited for. */
bool moe_comm_is_dead(const moe_comm_t *c);
/* This rank's world rank (c->world_ranks[c->rank]). */
int moe_comm_my_world_rank(const moe_comm_t *c);
/* Every other member's world rank, at most max of them (a moe_comm_late_fn for operations
 * that cannot say which peers are missing). */
int moe_comm_late_members(const moe_comm_t *c, moe_comm_req_t *r, int *late, int max);

/* The failure paths both implementations share (the message is this thread's last error):
 * - moe_comm_poll_watch: answer the watch between polls of an operation; fails with ABORTED
 *   (c marked dead) once another rank reported a failure.
 * - moe_comm_timed_out: `what` ran past timeout_ms waiting for the world ranks late[0..nlate)
 *   (`detail`, e.g. "no rows yet from world ranks 3", may be ""); c is marked dead, the watch
 *   names the ranks that do not answer and tells the others; returns TIMEOUT.
 * - moe_comm_failed: an operation failed locally (status, printf-style message): c is marked
 *   dead and the watch tells the others; returns status. */
moe_status_t moe_comm_poll_watch(moe_comm_t *c, const char *what);
moe_status_t moe_comm_timed_out(moe_comm_t *c, const char *what, int timeout_ms, const int *late,
                                int nlate, const char *detail);
moe_status_t moe_comm_failed(moe_comm_t *c, moe_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Argument checks both implementations make before starting an operation (one wording on
 * MPI and NCCL). `what` names the operation in the message. */
moe_status_t moe_comm_check_peer_tag(const moe_comm_t *c, const char *what, int peer, int tag);
moe_status_t moe_comm_check_root(const moe_comm_t *c, int root);
moe_status_t moe_comm_check_reduce_op(moe_reduce_op_t op);
moe_status_t moe_comm_check_alltoallv(const size_t *send_counts, const size_t *send_displs,
                                      const size_t *recv_counts, const size_t *recv_displs);

/* Write "world ranks a,b,..." (c->world_ranks, truncated with "..." when long) into
 * c->members, for messages. */
void moe_comm_describe_members(moe_comm_t *c);
/* moe_comm_format_ranks ("world ranks 1,3") and moe_comm_backoff (the pause between polls)
 * are in comm_base.h, below this file and the watch. */

/* Blocking helpers (start + wait). */
moe_status_t moe_comm_allreduce(moe_comm_t *c, const void *send, void *recv, size_t count,
                                moe_comm_dtype_t dt, moe_reduce_op_t op);
moe_status_t moe_comm_broadcast(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                int root);
moe_status_t moe_comm_alltoallv(moe_comm_t *c, const void *send, const size_t *send_counts,
                                const size_t *send_displs, void *recv, const size_t *recv_counts,
                                const size_t *recv_displs, moe_comm_dtype_t dt);
moe_status_t moe_comm_barrier(moe_comm_t *c);
moe_status_t moe_comm_send(moe_comm_t *c, const void *buf, size_t count, moe_comm_dtype_t dt,
                           int peer, int tag);
moe_status_t moe_comm_recv(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt, int peer,
                           int tag);

/* The blocking all-reduce and broadcast for small host messages whose buffers may live on
 * the caller's stack (flags, counts, headers): the operation runs on a heap copy that is
 * copied back on success and left to MPI (leaked) when it fails, so that a peer arriving
 * late never writes into a stack frame that is gone. Host buffers only. */
moe_status_t moe_comm_allreduce_copy(moe_comm_t *c, const void *send, void *recv, size_t count,
                                     moe_comm_dtype_t dt, moe_reduce_op_t op);
moe_status_t moe_comm_broadcast_copy(moe_comm_t *c, void *buf, size_t count, moe_comm_dtype_t dt,
                                     int root);

/* Thin wrappers over the table (NULL-safe where noted). wait uses the communicator's
 * timeout, wait_within the given one; both, and barrier, add their time to c->waited. */
moe_status_t moe_comm_wait(moe_comm_t *c, moe_comm_req_t *req);
moe_status_t moe_comm_wait_within(moe_comm_t *c, moe_comm_req_t *req, int timeout_ms);
moe_status_t moe_comm_test(moe_comm_t *c, moe_comm_req_t *req, bool *done);
moe_status_t moe_comm_split(moe_comm_t *c, int color, int key, const char *name, moe_comm_t **out);
/* NULL: no-op. The reason told to the other ranks is the calling thread's last error (the
 * failure that made the caller give up). */
void moe_comm_abort(moe_comm_t *c);
void moe_comm_destroy(moe_comm_t *c); /* NULL: no-op */

/* ---- agreement on a configuration (agree.c) ----------------------------------------------
 * Ranks that must hold the same configuration compare it before they rely on it, so that a
 * difference is an error naming the field on every rank, not a silent divergence, a
 * mismatched collective (which Open MPI turns into a job abort) or a hang. */

typedef enum moe_agree_kind {
    MOE_AGREE_INT = 0, /* value is the integer */
    MOE_AGREE_U64 = 1, /* value holds a uint64_t's bits */
    MOE_AGREE_F32 = 2  /* value holds a float's bits (compared bitwise) */
} moe_agree_kind_t;

typedef struct moe_agree_field {
    const char *name;
    moe_agree_kind_t kind;
    int64_t value;
} moe_agree_field_t;

moe_agree_field_t moe_agree_int(const char *name, int64_t value);
moe_agree_field_t moe_agree_u64(const char *name, uint64_t value);
moe_agree_field_t moe_agree_f32(const char *name, float value);

/* Collective over c (MPI, host buffers): every member passes the same field names in the
 * same order. `local` is this member's own verdict on its configuration: SUCCESS, or the
 * status of the check that rejected it (its message is this thread's last error).
 * Fails with INVALID_ARGUMENT on every other member when a member rejected its own
 * configuration (naming the first such world rank and its message; that member returns
 * `local` with its message unchanged), or on every member when a field differs (naming, for
 * each differing field, a world rank holding the smallest and one holding the largest value,
 * and both values). `what` names the configuration in messages ("the layer config"). One
 * all-reduce when everything agrees. */
moe_status_t moe_comm_agree(moe_comm_t *c, const char *what, const moe_agree_field_t *fields, int n,
                            moe_status_t local);

#endif /* MOE_COMM_H */
