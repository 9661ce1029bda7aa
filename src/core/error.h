/*
 * Status plumbing shared by every module: the thread-local last-error message and the check
 * macros that translate a failure into a status plus a message naming the call, file and line.
 * Nothing here exits: every macro returns or jumps to the caller's `fail:` block.
 */
#ifndef MOE_CORE_ERROR_H
#define MOE_CORE_ERROR_H

#include <errno.h>
#include <string.h>

#include <moe/core.h>

/* Record `fmt` as this thread's last error (prefixed with file:line) and return `status`. */
moe_status_t moe_error_set(moe_status_t status, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Forget the last error (each public entry point starts with this). */
void moe_error_clear(void);
/* Append context to the existing message ("while loading step-12: ..."). */
moe_status_t moe_error_wrap(moe_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define MOE_FAIL(status, ...) moe_error_set((status), __FILE__, __LINE__, __VA_ARGS__)

/* Return INVALID_ARGUMENT with a message when `cond` is false. */
#define MOE_CHECK_ARG(cond, ...)                                                                   \
    do {                                                                                           \
        if (!(cond)) return MOE_FAIL(MOE_STATUS_INVALID_ARGUMENT, __VA_ARGS__);                    \
    } while (0)

/* Propagate a non-success status. */
#define MOE_TRY(expr)                                                                              \
    do {                                                                                           \
        moe_status_t moe_try_s_ = (expr);                                                          \
        if (moe_try_s_ != MOE_STATUS_SUCCESS) return moe_try_s_;                                   \
    } while (0)

/* Store a non-success status in `st` and jump to `fail`. */
#define MOE_TRY_GOTO(st, expr)                                                                     \
    do {                                                                                           \
        (st) = (expr);                                                                             \
        if ((st) != MOE_STATUS_SUCCESS) goto fail;                                                 \
    } while (0)

/* Generator for library-specific checks (CUDA, cuBLAS, NCCL, MPI, io_uring, curl): evaluate
 * `call` once, and if `ok` (an expression of `rc_`) is false, set the error with the call's
 * text and the library's own description `describe(rc_)`, then return `status`. */
#define MOE_CHECK_GEN(type, call, ok, status, describe)                                            \
    do {                                                                                           \
        type rc_ = (call);                                                                         \
        if (!(ok))                                                                                 \
            return moe_error_set((status), __FILE__, __LINE__, "%s failed: %s", #call,             \
                                 describe(rc_));                                                   \
    } while (0)

#define MOE_CHECK_GEN_GOTO(st, type, call, ok, status, describe)                                   \
    do {                                                                                           \
        type rc_ = (call);                                                                         \
        if (!(ok)) {                                                                               \
            (st) = moe_error_set((status), __FILE__, __LINE__, "%s failed: %s", #call,             \
                                 describe(rc_));                                                   \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* Generators whose message names the call through a printf format and its arguments
 * ("open(%s)", path) in place of the call's source text, for calls whose arguments belong in
 * the message (a path, an offset): "<fmt ...> failed: <describe(rc_)>". */
#define MOE_CHECK_GEN_MSG(type, call, ok, status, describe, fmt, ...)                              \
    do {                                                                                           \
        type rc_ = (call);                                                                         \
        if (!(ok))                                                                                 \
            return moe_error_set((status), __FILE__, __LINE__, fmt " failed: %s", ##__VA_ARGS__,   \
                                 describe(rc_));                                                   \
    } while (0)

#define MOE_CHECK_GEN_MSG_GOTO(st, type, call, ok, status, describe, fmt, ...)                     \
    do {                                                                                           \
        type rc_ = (call);                                                                         \
        if (!(ok)) {                                                                               \
            (st) = moe_error_set((status), __FILE__, __LINE__, fmt " failed: %s", ##__VA_ARGS__,   \
                                 describe(rc_));                                                   \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

/* The system's error conventions: errno (the call returns -1 and sets errno: open, fsync,
 * rename, mkdir, ...) and the error number returned (pthread; liburing returns it negated and
 * its callers decide, through MOE_FAIL_ERRNUM(-rc), below). The wrappers name the call through
 * a format, so paths and sizes land in the message. */
#define MOE_DESCRIBE_ERRNO(rc) strerror(errno)

#define MOE_CHECK_ERRNO_MSG(call, status, fmt, ...)                                                \
    MOE_CHECK_GEN_MSG(long, call, rc_ != -1, status, MOE_DESCRIBE_ERRNO, fmt, ##__VA_ARGS__)
#define MOE_CHECK_ERRNO_MSG_GOTO(st, call, status, fmt, ...)                                       \
    MOE_CHECK_GEN_MSG_GOTO(st, long, call, rc_ != -1, status, MOE_DESCRIBE_ERRNO, fmt,             \
                           ##__VA_ARGS__)
/* Stringifies `call` itself, before its macros (NULL) expand. */
#define MOE_CHECK_PTHREAD_GOTO(st, call, status)                                                   \
    MOE_CHECK_GEN_MSG_GOTO(st, int, call, rc_ == 0, status, strerror, "%s", #call)

/* The same message where the test is the caller's own (a tolerated errno such as EEXIST, the
 * first of several errors kept, errno saved before a cleanup): "<fmt ...> failed: <text>". */
#define MOE_FAIL_ERRNO(status, fmt, ...)                                                           \
    MOE_FAIL(status, fmt " failed: %s", ##__VA_ARGS__, strerror(errno))
#define MOE_FAIL_ERRNUM(status, errnum, fmt, ...)                                                  \
    MOE_FAIL(status, fmt " failed: %s", ##__VA_ARGS__, strerror(errnum))

/* Keep-the-first-error forms, for teardown paths that go on after a failure: a failing call
 * sets the error (and `st`) only while `st` is still SUCCESS, so the first cause survives. */
#define MOE_CHECK_GEN_KEEP(st, type, call, ok, status, describe)                                   \
    do {                                                                                           \
        type rc_ = (call);                                                                         \
        if (!(ok) && (st) == MOE_STATUS_SUCCESS)                                                   \
            (st) = moe_error_set((status), __FILE__, __LINE__, "%s failed: %s", #call,             \
                                 describe(rc_));                                                   \
    } while (0)
/* A libmoe call (its callee set the message): `st` takes its status only while SUCCESS. */
#define MOE_TRY_KEEP(st, expr)                                                                     \
    do {                                                                                           \
        moe_status_t moe_keep_s_ = (expr);                                                         \
        if ((st) == MOE_STATUS_SUCCESS) (st) = moe_keep_s_;                                        \
    } while (0)

/* The libraries' checks, every one from the generators above. Each expands only where it is
 * used, so the library's own header (cuda_runtime.h, cublas_v2.h, nccl.h, mpi.h with
 * comm/mpi_support.h, curl/curl.h) is included there and nowhere here. */
#define MOE_CUDA_CHECK(call)                                                                       \
    MOE_CHECK_GEN(cudaError_t, call, rc_ == cudaSuccess, MOE_STATUS_BACKEND_ERROR,                 \
                  cudaGetErrorString)
#define MOE_CUDA_CHECK_GOTO(st, call)                                                              \
    MOE_CHECK_GEN_GOTO(st, cudaError_t, call, rc_ == cudaSuccess, MOE_STATUS_BACKEND_ERROR,        \
                       cudaGetErrorString)
#define MOE_CUDA_CHECK_KEEP(st, call)                                                              \
    MOE_CHECK_GEN_KEEP(st, cudaError_t, call, rc_ == cudaSuccess, MOE_STATUS_BACKEND_ERROR,        \
                       cudaGetErrorString)
#define MOE_CUBLAS_CHECK(call)                                                                     \
    MOE_CHECK_GEN(cublasStatus_t, call, rc_ == CUBLAS_STATUS_SUCCESS, MOE_STATUS_BACKEND_ERROR,    \
                  cublasGetStatusString)
/* ncclInProgress: a non-blocking communicator's call that is still running */
#define MOE_NCCL_CHECK(call)                                                                       \
    MOE_CHECK_GEN(ncclResult_t, call, rc_ == ncclSuccess || rc_ == ncclInProgress,                 \
                  MOE_STATUS_COMM_ERROR, ncclGetErrorString)
#define MOE_NCCL_CHECK_GOTO(st, call)                                                              \
    MOE_CHECK_GEN_GOTO(st, ncclResult_t, call, rc_ == ncclSuccess || rc_ == ncclInProgress,        \
                       MOE_STATUS_COMM_ERROR, ncclGetErrorString)
#define MOE_MPI_CHECK(call)                                                                        \
    MOE_CHECK_GEN(int, call, rc_ == MPI_SUCCESS, MOE_STATUS_COMM_ERROR, moe_mpi_describe)
#define MOE_MPI_CHECK_GOTO(st, call)                                                               \
    MOE_CHECK_GEN_GOTO(st, int, call, rc_ == MPI_SUCCESS, MOE_STATUS_COMM_ERROR, moe_mpi_describe)
/* A libcurl call returning a CURLcode; `call` is stringified here, before its macros
 * (CURL_GLOBAL_DEFAULT) expand. */
#define MOE_CHECK_CURL(call, status)                                                               \
    MOE_CHECK_GEN_MSG(CURLcode, call, rc_ == CURLE_OK, status, curl_easy_strerror, "%s", #call)
/* (the etcd client's calls: a failure there is INTERNAL) */
#define MOE_CHECK_CURL_GOTO(st, call)                                                              \
    MOE_CHECK_GEN_MSG_GOTO(st, CURLcode, call, rc_ == CURLE_OK, MOE_STATUS_INTERNAL,               \
                           curl_easy_strerror, "%s", #call)

/* Handles carry a magic number so that use after destroy or a wrong handle is caught: every
 * handle kind's is here, eight ASCII bytes each, so no two kinds can share one. A destroyed
 * handle's magic is MOE_MAGIC_DEAD until its memory is freed. */
#define MOE_MAGIC_RUNTIME 0x4d4f4552554e5431ull     /* "MOERUNT1" */
#define MOE_MAGIC_LAYER 0x4d4f454c41595231ull       /* "MOELAYR1" */
#define MOE_MAGIC_ADAMW 0x4d4f4541444d5731ull       /* "MOEADMW1" */
#define MOE_MAGIC_PIPE_SCHED 0x4d4f455343484431ull  /* "MOESCHD1" */
#define MOE_MAGIC_PIPELINE 0x4d4f455049504531ull    /* "MOEPIPE1" */
#define MOE_MAGIC_CKPT 0x4d4f45434b505431ull        /* "MOECKPT1" */
#define MOE_MAGIC_TRAIN_STATE 0x4d4f455354415431ull /* "MOESTAT1" */
#define MOE_MAGIC_MEMBER 0x4d4f454d454d4231ull      /* "MOEMEMB1" */
#define MOE_MAGIC_DEAD 0xdeaddeaddeaddeadull

#define MOE_CHECK_HANDLE(h, magic_value, what)                                                     \
    do {                                                                                           \
        if ((h) == NULL) return MOE_FAIL(MOE_STATUS_INVALID_HANDLE, "%s is NULL", what);           \
        if ((h)->magic != (magic_value))                                                           \
            return MOE_FAIL(MOE_STATUS_INVALID_HANDLE,                                             \
                            "%s is not a live handle (destroyed or wrong kind)", what);            \
    } while (0)

/* The opening of a public call on a handle: the thread's last error cleared, then the handle
 * checked (MOE_CHECK_HANDLE; `what` names it in the message). */
#define MOE_ENTRY(h, magic_value, what)                                                            \
    do {                                                                                           \
        moe_error_clear();                                                                         \
        MOE_CHECK_HANDLE(h, magic_value, what);                                                    \
    } while (0)

/* Checks that the caller's config struct is at least as large as the first ABI version. */
#define MOE_CHECK_STRUCT_SIZE(ptr, type, first_field_end)                                          \
    MOE_CHECK_ARG((ptr)->struct_size >= (first_field_end) &&                                       \
                      (ptr)->struct_size <= sizeof(type) * 4,                                      \
                  #type ".struct_size is %zu; expected %zu (set it from sizeof or the "            \
                        "_default() initialiser)",                                                 \
                  (ptr)->struct_size, sizeof(type))

/* A public create's config (NULL means defaults): c, initialised with the defaults, becomes
 * *config once its struct_size is checked. */
#define MOE_TAKE_CONFIG(c, config, type)                                                           \
    do {                                                                                           \
        if (config) {                                                                              \
            MOE_CHECK_STRUCT_SIZE(config, type, sizeof(type));                                     \
            (c) = *(config);                                                                       \
        }                                                                                          \
    } while (0)

/* A public create's config that has grown: c, initialised with the defaults, takes the first
 * struct_size bytes of *config (not NULL) once struct_size is at least oldest_size, the size of
 * the first release's struct; fields past the caller's struct keep their defaults. */
#define MOE_TAKE_CONFIG_PREFIX(c, config, type, oldest_size)                                       \
    do {                                                                                           \
        MOE_CHECK_STRUCT_SIZE(config, type, oldest_size);                                          \
        memcpy(&(c), config,                                                                       \
               (config)->struct_size < sizeof(type) ? (config)->struct_size : sizeof(type));       \
        (c).struct_size = sizeof(type);                                                            \
    } while (0)

#endif /* MOE_CORE_ERROR_H */
