/*
 * libmoe core API: versions, status codes and errors, logging, dtypes, tensors, the runtime.
 *
 * Conventions used by every libmoe header:
 *  - Every fallible call returns moe_status_t; results come back through out-pointers.
 *    On failure moe_last_error() holds a thread-local message saying what failed and why.
 *  - Handles are opaque; create/destroy come in pairs and destroy(NULL) is a no-op.
 *  - Config structs start with `size_t struct_size` and have a moe_<x>_config_default()
 *    initialiser: take the default, change fields, pass it. A NULL config means defaults.
 *  - [in]/[out] mark parameters; "collective" means every rank of the named communicator
 *    must make the same call in the same order.
 *
 * Threads:
 *  - Calls that take no handle (versions, moe_status_string, moe_last_error, dtype queries,
 *    the _default() initialisers, moe_tensor_view, moe_tensor_numel) are safe from any thread.
 *  - A runtime and every object made on it (layers, optimizers, pipelines, checkpointers, the
 *    tensors it allocated) are used by one thread at a time: they share the runtime's stream,
 *    workspaces and communicators, so calls on them must not overlap. Threads may take turns
 *    if the program orders their calls (a mutex).
 *  - Different runtimes share nothing and may be used from different threads at once. With
 *    meshes, create them from one thread, and initialise MPI yourself with
 *    MPI_THREAD_MULTIPLE before using two meshed runtimes concurrently (libmoe's own MPI_Init
 *    asks for MPI_THREAD_SERIALIZED).
 *  - libmoe's background threads (checkpoint writer, S3 mirror, the host all-to-all worker)
 *    touch only their own object's state and the log callback, which must be thread-safe.
 */
#ifndef MOE_CORE_H
#define MOE_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(MOE_BUILDING_LIBRARY)
#define MOE_API __attribute__((visibility("default")))
#else
#define MOE_API
#endif

/* ---- version -------------------------------------------------------------------------- */

#define MOE_VERSION_MAJOR 0
#define MOE_VERSION_MINOR 2
#define MOE_VERSION_PATCH 0
#define MOE_VERSION_CODE(major, minor, patch) ((major)*10000 + (minor)*100 + (patch))
#define MOE_VERSION MOE_VERSION_CODE(MOE_VERSION_MAJOR, MOE_VERSION_MINOR, MOE_VERSION_PATCH)

/* The version of the library actually loaded (compare with MOE_VERSION at build time). */
MOE_API int moe_version(void);
MOE_API const char *moe_version_string(void);

/* ---- status and errors ------------------------------------------------------------------ */

typedef enum moe_status {
    MOE_STATUS_SUCCESS = 0,
    MOE_STATUS_INVALID_ARGUMENT = 1, /* NULL pointer, bad size, inconsistent config       */
    MOE_STATUS_INVALID_HANDLE = 2,   /* NULL, destroyed or wrong-kind handle              */
    MOE_STATUS_UNSUPPORTED = 3,      /* valid request this build/backend cannot serve     */
    MOE_STATUS_OUT_OF_MEMORY = 4,    /* host, pinned or device allocation failed          */
    MOE_STATUS_BACKEND_ERROR = 5,    /* CUDA / cuBLAS failure                             */
    MOE_STATUS_COMM_ERROR = 6,       /* MPI / NCCL failure                                */
    MOE_STATUS_TIMEOUT = 7,          /* a peer or service did not answer in time          */
    MOE_STATUS_IO_ERROR = 8,         /* file system failure                               */
    MOE_STATUS_CORRUPT = 9,          /* checksum mismatch, truncated or malformed data    */
    MOE_STATUS_NOT_FOUND = 10,       /* no such checkpoint, tensor or object              */
    MOE_STATUS_REMOTE_ERROR = 11,    /* remote store (S3) refused or failed               */
    MOE_STATUS_IN_PROGRESS = 12,     /* asynchronous work not finished yet (poll)         */
    MOE_STATUS_ABORTED = 13,         /* stopped by abort or by a failure elsewhere        */
    MOE_STATUS_INTERNAL = 14         /* a libmoe bug: please report                       */
} moe_status_t;

/* Static text naming the status; never NULL. */
MOE_API const char *moe_status_string(moe_status_t status);

/* The calling thread's message for its most recent failed libmoe call ("" if none).
 * Valid until the thread's next libmoe call. */
MOE_API const char *moe_last_error(void);

/* ---- logging ------------------------------------------------------------------------------
 * Logging is per runtime (no global state): the runtime config carries the level and an
 * optional callback. Without a callback, messages go to stderr. MOE_LOG_LEVEL=error|warn|info|
 * debug in the environment overrides the configured level. */

typedef enum moe_log_level {
    MOE_LOG_ERROR = 0,
    MOE_LOG_WARN = 1,
    MOE_LOG_INFO = 2,
    MOE_LOG_DEBUG = 3
} moe_log_level_t;

/* Called from any libmoe thread (background checkpoint threads too); must be thread-safe. */
typedef void (*moe_log_fn)(moe_log_level_t level, const char *message, void *user_data);

/* ---- dtypes and tensors ------------------------------------------------------------------ */

typedef enum moe_dtype { MOE_DTYPE_F32 = 0, MOE_DTYPE_BF16 = 1 } moe_dtype_t;

/* Bytes per element, or 0 for an unknown dtype. */
MOE_API size_t moe_dtype_size(moe_dtype_t dtype);
MOE_API const char *moe_dtype_name(moe_dtype_t dtype);

typedef enum moe_device_kind { MOE_DEVICE_HOST = 0, MOE_DEVICE_CUDA = 1 } moe_device_kind_t;

/* The router's score function (moe_layer_config_t.score_fn, <moe/layer.h>): here with the
 * other shared vocabulary so that the compute backends see it without the layer's API. */
typedef enum moe_score_fn { MOE_SCORE_SOFTMAX = 0, MOE_SCORE_SIGMOID = 1 } moe_score_fn_t;

#define MOE_MAX_DIMS 4

/* A dense, row-major (last dimension fastest) view of memory the caller or libmoe owns.
 * A descriptor never owns its data; moe_tensor_alloc/moe_tensor_free manage libmoe-owned
 * storage. */
typedef struct moe_tensor {
    void *data;
    moe_dtype_t dtype;
    int32_t ndim;                /* 1..MOE_MAX_DIMS */
    int64_t shape[MOE_MAX_DIMS]; /* entries past ndim are ignored */
    moe_device_kind_t device;
    int32_t device_index; /* CUDA ordinal; 0 for host */
} moe_tensor_t;

/* Fill a descriptor for caller-owned memory (no allocation). ndim 1..4, shape[i] >= 0. */
MOE_API moe_status_t moe_tensor_view(void *data, moe_dtype_t dtype, moe_device_kind_t device,
                                     int32_t ndim, const int64_t *shape, moe_tensor_t *out);
/* Number of elements (product of the shape), or -1 if the descriptor is invalid. */
MOE_API int64_t moe_tensor_numel(const moe_tensor_t *t);

/* ---- runtime ------------------------------------------------------------------------------ */

typedef struct moe_runtime moe_runtime_t;
typedef struct moe_mesh_config moe_mesh_config_t; /* moe/mesh.h */

typedef enum moe_backend_kind {
    MOE_BACKEND_AUTO = 0, /* CUDA when built with it and a GPU is visible, else HOST */
    MOE_BACKEND_HOST = 1, /* plain C reference, fp32 */
    MOE_BACKEND_CUDA = 2  /* CUDA kernels + cuBLAS, bf16 activations/weights */
} moe_backend_kind_t;

typedef struct moe_runtime_config {
    size_t struct_size;
    moe_backend_kind_t backend;
    int32_t device_index;      /* CUDA device; -1: local rank modulo visible devices */
    int32_t deterministic;     /* 1 (default): bitwise-reproducible results run to run */
    uint64_t seed;             /* seeds parameter initialisation of layers on this runtime */
    moe_log_level_t log_level; /* default MOE_LOG_WARN */
    moe_log_fn log_fn;         /* NULL: stderr */
    void *log_user_data;
    /* NULL: a single process, no MPI needed. Otherwise the 4D mesh (moe/mesh.h); creating
     * the runtime is then collective over the mesh's world communicator. */
    const moe_mesh_config_t *mesh;
} moe_runtime_config_t;

MOE_API moe_runtime_config_t moe_runtime_config_default(void);

/* [in] config (NULL: defaults) [out] out. Collective over the world when config->mesh is set:
 * the ranks compare the mesh config, the seed, `deterministic` and the backend, and every
 * rank fails with INVALID_ARGUMENT naming the field, the world ranks and both values when
 * they differ (or naming the rank whose own mesh config is invalid). */
MOE_API moe_status_t moe_runtime_create(const moe_runtime_config_t *config, moe_runtime_t **out);
/* Frees the runtime. Every layer, optimizer, pipeline and checkpointer made on it must be
 * destroyed first: otherwise INVALID_ARGUMENT names what is alive and the runtime stays
 * usable. With a mesh it returns within the mesh's timeout: after a peer failure (see
 * moe_runtime_get_async_error) it returns ABORTED with that failure, leaves MPI unfinalised
 * (MPI_Finalize would wait for the lost peer for ever) and leaks what MPI may still touch:
 * the process should then exit, with MOE_EXIT_PEER_LOST (docs/mesh.md, "When a peer fails").
 * When libmoe initialised MPI, the last runtime's destroy finalises it after the ranks meet
 * in a barrier under the timeout (TIMEOUT, MPI unfinalised, when a peer does not come). */
MOE_API moe_status_t moe_runtime_destroy(moe_runtime_t *rt);

/* The mesh's first failure, SUCCESS while every peer answers: TIMEOUT (this rank timed out
 * waiting for a peer), COMM_ERROR (an MPI or NCCL error here), ABORTED (another rank reported
 * a failure, or a communicator was aborted after a local one). From then on the runtime is
 * poisoned: every later collective on it fails at once with ABORTED and that first failure.
 * [out] message (may be NULL) receives its text, which names the world ranks that do not
 * answer, truncated to message_len. Never blocks (it takes in the other ranks' reports);
 * call it from the thread that uses the runtime. */
MOE_API moe_status_t moe_runtime_get_async_error(moe_runtime_t *rt, char *message,
                                                 size_t message_len);

/* The exit status for a program whose runtime lost a peer: EX_TEMPFAIL of <sysexits.h>,
 * "temporary failure, try again", so a launcher restarts the job from its last checkpoint. */
#define MOE_EXIT_PEER_LOST 75

/* Time this rank spent blocked waiting in libmoe's communication, since the runtime was
 * made: every wait for a collective or a transfer of the mesh's communicators to complete (the
 * layer's all-to-all and tensor-parallel sums, the optimizer's reductions, pipeline sends and
 * receives, the checkpointer's agreements). Polls that find an overlapped transfer unfinished
 * do not count. In lock-step training every rank's wall step time is the slowest rank's; a
 * step's wall time minus the growth of wait_seconds over it is the rank's own (busy) time,
 * which tells a slow rank (docs/elastic.md, "Stragglers"). On the CUDA backend a wait is host
 * time and also covers the rank's own device work queued before the collective. */
typedef struct moe_runtime_wait_stats {
    size_t struct_size;
    double wait_seconds; /* total time blocked in waits (0 in a world of one) */
    int64_t waits;       /* waits counted */
} moe_runtime_wait_stats_t;

/* [out] stats (set struct_size first; at most struct_size bytes are written). Never blocks;
 * not collective. */
MOE_API moe_status_t moe_runtime_wait_stats(const moe_runtime_t *rt,
                                            moe_runtime_wait_stats_t *stats);

/* The backend actually in use (AUTO resolved). */
MOE_API moe_status_t moe_runtime_backend(const moe_runtime_t *rt, moe_backend_kind_t *out);
/* Where tensors passed to this runtime's layers must live. */
MOE_API moe_status_t moe_runtime_device(const moe_runtime_t *rt, moe_device_kind_t *kind,
                                        int32_t *device_index);
/* The dtype layers use for activations and weights on this backend (F32 host, BF16 CUDA). */
MOE_API moe_status_t moe_runtime_compute_dtype(const moe_runtime_t *rt, moe_dtype_t *out);

/* CUDA backend: the cudaStream_t (as void *) on which libmoe enqueues work; NULL selects the
 * runtime's own stream. Host backend: ignored. Work is ordered on this stream, so callers
 * must synchronise it (or moe_runtime_synchronize) before reading results on the host. */
MOE_API moe_status_t moe_runtime_set_stream(moe_runtime_t *rt, void *cuda_stream);
/* [out] cuda_stream: the cudaStream_t (as void *) libmoe enqueues on now (the one set, else
 * the runtime's own), so a caller's kernels and cuBLAS calls can be ordered with libmoe's;
 * NULL on the host backend. Not collective. */
MOE_API moe_status_t moe_runtime_get_stream(const moe_runtime_t *rt, void **cuda_stream);
MOE_API moe_status_t moe_runtime_synchronize(moe_runtime_t *rt);

/* Change logging after creation. */
MOE_API moe_status_t moe_runtime_set_log(moe_runtime_t *rt, moe_log_level_t level, moe_log_fn fn,
                                         void *user_data);

/* Allocate storage on the runtime's device (or pinned host memory when `device` is HOST and
 * the backend is CUDA). The descriptor's data is owned by libmoe until moe_tensor_free. */
MOE_API moe_status_t moe_tensor_alloc(moe_runtime_t *rt, moe_dtype_t dtype,
                                      moe_device_kind_t device, int32_t ndim, const int64_t *shape,
                                      moe_tensor_t *out);
/* Free storage from moe_tensor_alloc and clear the descriptor; a cleared one is a no-op. */
MOE_API moe_status_t moe_tensor_free(moe_runtime_t *rt, moe_tensor_t *t);
/* Copy between tensors of equal shape on any devices, converting F32 <-> BF16 if the dtypes
 * differ (round to nearest even). Synchronous with respect to the host. */
MOE_API moe_status_t moe_tensor_copy(moe_runtime_t *rt, moe_tensor_t *dst, const moe_tensor_t *src);

#ifdef __cplusplus
}
#endif
#endif /* MOE_CORE_H */
