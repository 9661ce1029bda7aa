/*
 * Every environment variable libmoe reads, in one table (NCCL's habit): name, type, default
 * and what it does. Code reads a variable only through the typed getters below, by its id, so
 * each type has one parser, a bad value gets one warning, and a value that is set is logged
 * once per process. docs/environment.md shows the same table; tests/house/check_env.py holds
 * the two together and finds any getenv() outside this file's .c.
 */
#ifndef MOE_CORE_ENV_H
#define MOE_CORE_ENV_H

#include <stdbool.h>
#include <stddef.h>

#include "log.h"

/* X(id, name, type, default, meaning). Types: POSITIVE (an integer > 0), INT (an integer),
 * FLAG (0 or 1), CHOICE (one of the words "a|b|c" that open its meaning, before the colon),
 * STRING, SECRET (a string that is never logged). `default` is text for the docs: what
 * applies when the variable is unset. */
#define MOE_ENV_TABLE(X)                                                                           \
    X(LOG_LEVEL, "MOE_LOG_LEVEL", CHOICE, "the runtime config's log_level",                        \
      "error|warn|info|debug: the runtime's log level")                                            \
    X(INIT_THREADS, "MOE_INIT_THREADS", POSITIVE, "the online CPUs",                               \
      "threads that fill a layer's initial weights")                                               \
    X(A2A_THREAD, "MOE_A2A_THREAD", FLAG, "1 when MPI allows threads",                             \
      "the host backend's all-to-all worker thread, forced on (1) or off (0)")                     \
    X(CHECK_TP_INPUTS, "MOE_CHECK_TP_INPUTS", FLAG, "0",                                           \
      "hash each layer input across the tensor-parallel group and fail on a mismatch")             \
    X(CUDA_EXPERT_GEMM, "MOE_CUDA_EXPERT_GEMM", CHOICE, "auto",                                    \
      "auto|loop|streams|batched|grouped|hopper: the CUDA backend's expert GEMM path")             \
    X(CUDA_ROUTER, "MOE_CUDA_ROUTER", CHOICE, "auto",                                              \
      "auto|gemm|fused: the CUDA backend's router forward")                                        \
    X(CUDA_SWIGLU_GEMM, "MOE_CUDA_SWIGLU_GEMM", FLAG, "0",                                         \
      "SwiGLU inside the expert GEMMs (sm_90a only)")                                              \
    X(CKPT_CHUNK_BYTES, "MOE_CKPT_CHUNK_BYTES", POSITIVE, "the ckpt config's chunk_bytes",         \
      "bytes per checkpoint write chunk")                                                          \
    X(CKPT_PINNED_BYTES, "MOE_CKPT_PINNED_BYTES", POSITIVE,                                        \
      "the ckpt config's pinned_budget_bytes", "pinned host bytes for checkpoint staging")         \
    X(CKPT_S3_MAX_RETRIES, "MOE_CKPT_S3_MAX_RETRIES", POSITIVE,                                    \
      "the ckpt config's s3_max_retries", "attempts per S3 request")                               \
    X(CKPT_S3_RETRY_BASE_MS, "MOE_CKPT_S3_RETRY_BASE_MS", POSITIVE,                                \
      "the ckpt config's s3_retry_base_ms", "first S3 retry back-off (ms)")                        \
    X(CKPT_S3_RETRY_MAX_MS, "MOE_CKPT_S3_RETRY_MAX_MS", POSITIVE,                                  \
      "the ckpt config's s3_retry_max_ms", "longest S3 retry back-off (ms)")                       \
    X(CKPT_DESTROY_TIMEOUT_MS, "MOE_CKPT_DESTROY_TIMEOUT_MS", POSITIVE, "30000",                   \
      "how long moe_ckpt_destroy waits for the newest step's upload (ms)")                         \
    X(CKPT_DEFER_WRITER, "MOE_CKPT_DEFER_WRITER", FLAG, "1",                                       \
      "start the checkpoint writer after the snapshot (0: with it)")                               \
    X(CKPT_NO_URING, "MOE_CKPT_NO_URING", FLAG, "0",                                               \
      "write checkpoints with pwrite instead of io_uring")                                         \
    X(ELASTIC_ENDPOINT, "MOE_ELASTIC_ENDPOINT", STRING, "unset (no membership)",                   \
      "etcd endpoints of the elastic launcher (comma-separated members)")                          \
    X(ELASTIC_PREFIX, "MOE_ELASTIC_PREFIX", STRING, "unset",                                       \
      "the job's etcd key prefix (starts with /)")                                                 \
    X(ELASTIC_SLOTS, "MOE_ELASTIC_SLOTS", STRING, "unset", "world rank -> launcher slot")          \
    X(ELASTIC_TTL_MS, "MOE_ELASTIC_TTL_MS", POSITIVE, "the member config's ttl_ms",                \
      "membership lease (ms); a bad value is an error")                                            \
    X(ELASTIC_LAUNCHER_KEY, "MOE_ELASTIC_LAUNCHER_KEY", STRING, "unset",                           \
      "set by moe_elastic: its lease's key, which ranks watch")                                    \
    X(ELASTIC_ORPHAN_MS, "MOE_ELASTIC_ORPHAN_MS", POSITIVE, "60000",                               \
      "how long a rank outlives its launcher's lease (ms); a bad value is an error")               \
    X(OMPI_ALLOW_ROOT, "OMPI_ALLOW_RUN_AS_ROOT", STRING, "unset",                                  \
      "Open MPI's consent to run as root; moe_elastic names it when missing")                      \
    X(OMPI_LOCAL_RANK, "OMPI_COMM_WORLD_LOCAL_RANK", INT, "unset",                                 \
      "set by Open MPI: picks the GPU")                                                            \
    X(MV2_LOCAL_RANK, "MV2_COMM_WORLD_LOCAL_RANK", INT, "unset", "set by MVAPICH2: picks the GPU") \
    X(SLURM_LOCALID, "SLURM_LOCALID", INT, "unset", "set by Slurm: picks the GPU")                 \
    X(LOCAL_RANK, "LOCAL_RANK", INT, "unset", "set by torchrun and others: picks the GPU")         \
    X(OMPI_WORLD_SIZE, "OMPI_COMM_WORLD_SIZE", INT, "unset",                                       \
      "set by Open MPI: the launched world")                                                       \
    X(PMI_SIZE, "PMI_SIZE", INT, "unset", "set by PMI launchers: the launched world")              \
    X(PMIX_SIZE, "PMIX_SIZE", INT, "unset", "set by PMIx launchers: the launched world")           \
    X(SLURM_NTASKS, "SLURM_NTASKS", INT, "unset", "set by Slurm: the launched world")              \
    X(AWS_REGION, "AWS_REGION", STRING, "unset", "S3 region when the config has none")             \
    X(AWS_DEFAULT_REGION, "AWS_DEFAULT_REGION", STRING, "unset",                                   \
      "S3 region when neither the config nor AWS_REGION has one")                                  \
    X(AWS_ACCESS_KEY_ID, "AWS_ACCESS_KEY_ID", SECRET, "unset",                                     \
      "S3 access key when the config has none")                                                    \
    X(AWS_SECRET_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY", SECRET, "unset",                             \
      "S3 secret key when the config has none")                                                    \
    X(AWS_SESSION_TOKEN, "AWS_SESSION_TOKEN", SECRET, "unset",                                     \
      "S3 session token when the config has none")                                                 \
    X(TMPDIR, "TMPDIR", STRING, "/tmp", "where the elastic launcher's etcd keeps its data")

typedef enum {
#define MOE_ENV_ID_(id, name, type, def, doc) MOE_ENV_##id,
    MOE_ENV_TABLE(MOE_ENV_ID_)
#undef MOE_ENV_ID_
        MOE_ENV_COUNT
} moe_env_id_t;

/* Each getter logs a set value at info level once per process (SECRET values as "set"), and
 * warns once about a value it cannot parse, which then counts as unset. */

/* The value, or NULL when unset or empty (STRING and SECRET variables). */
const char *moe_env_string(moe_env_id_t id, const moe_logger_t *log);
/* A POSITIVE variable, or `fallback`. */
size_t moe_env_positive(moe_env_id_t id, size_t fallback, const moe_logger_t *log);
/* A POSITIVE variable that must be right when set: *value is left alone when it is unset, set
 * when it is a positive integer up to `max`, and anything else is INVALID_ARGUMENT naming it. */
moe_status_t moe_env_positive_checked(moe_env_id_t id, size_t max, size_t *value,
                                      const moe_logger_t *log);
/* An INT variable, or `fallback`. */
long moe_env_int(moe_env_id_t id, long fallback, const moe_logger_t *log);
/* A FLAG variable (0 or 1), or `fallback`. */
bool moe_env_flag(moe_env_id_t id, bool fallback, const moe_logger_t *log);
/* A CHOICE variable: the index of its value among the words of its meaning's "a|b|c" list,
 * or `fallback`. */
int moe_env_choice(moe_env_id_t id, int fallback, const moe_logger_t *log);

#endif /* MOE_CORE_ENV_H */
