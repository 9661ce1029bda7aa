/* Runtime lifecycle: resolve the backend, join the mesh (the ranks agree on the seed, the
 * determinism and the backend), own logging, count the objects made on it, report the mesh's
 * failure. Also the tensor allocation and copy entry points, which need the backend. */
#include "runtime.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/bf16.h"
#include "core/env.h"
#include "core/error.h"
#include "core/tensor.h"

int moe_version(void) { return MOE_VERSION; }

const char *moe_version_string(void)
{
#define MOE_STR2(x) #x
#define MOE_STR(x) MOE_STR2(x)
    return MOE_STR(MOE_VERSION_MAJOR) "." MOE_STR(MOE_VERSION_MINOR) "." MOE_STR(MOE_VERSION_PATCH);
#undef MOE_STR
#undef MOE_STR2
}

/* The level from MOE_LOG_LEVEL (error|warn|info|debug), or `fallback` when unset or unknown.
 * Read here, not in core/log.c: the environment table logs through a logger, so core/env.c
 * sits above core/log.c, and the runtime is what owns its logger's level. */
static moe_log_level_t log_level_from_env(moe_log_level_t fallback)
{
    /* the choices error|warn|info|debug are the levels in order */
    return (moe_log_level_t)(MOE_LOG_ERROR +
                             moe_env_choice(MOE_ENV_LOG_LEVEL, fallback - MOE_LOG_ERROR, NULL));
}

moe_runtime_config_t moe_runtime_config_default(void)
{
    moe_runtime_config_t c = {
        .struct_size = sizeof c,
        .backend = MOE_BACKEND_AUTO,
        .device_index = -1,
        .deterministic = 1,
        .seed = 1234,
        .log_level = MOE_LOG_WARN,
        .log_fn = NULL,
        .log_user_data = NULL,
        .mesh = NULL,
    };
    return c;
}

/* The local rank from the launcher's environment, for picking a GPU (0 without one). */
static int local_rank_from_env(void)
{
    const moe_env_id_t names[] = {MOE_ENV_OMPI_LOCAL_RANK, MOE_ENV_MV2_LOCAL_RANK,
                                  MOE_ENV_SLURM_LOCALID, MOE_ENV_LOCAL_RANK};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        long v = moe_env_int(names[i], -1, NULL);
        if (v >= 0 && v <= INT_MAX) return (int)v;
    }
    return 0;
}

static moe_status_t create_backend(const moe_runtime_config_t *c, moe_runtime_t *rt)
{
    moe_backend_params_t p = {.deterministic = c->deterministic != 0, .logger = &rt->logger};
    moe_backend_kind_t kind = c->backend;
    int ngpu = moe_backend_cuda_device_count();
    if (kind == MOE_BACKEND_AUTO) kind = ngpu > 0 ? MOE_BACKEND_CUDA : MOE_BACKEND_HOST;
    if (kind == MOE_BACKEND_HOST) return moe_backend_host_create(&p, &rt->backend);
    if (ngpu <= 0)
        return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "the CUDA backend was requested but %s",
                        ngpu < 0 ? "libmoe was built without CUDA" : "no CUDA device is visible");
    int dev = c->device_index >= 0 ? c->device_index : local_rank_from_env() % ngpu;
    MOE_CHECK_ARG(dev < ngpu, "device_index %d but only %d CUDA devices are visible", dev, ngpu);
    p.device_index = dev;
    rt->device_index = dev;
    return moe_backend_cuda_create(&p, &rt->backend);
}

/* Settings that change every rank's numbers and must be the same on all of them: the seed
 * initialises the replicated parameters, determinism picks the reduction order, the backend
 * the activations' dtype on the wire. */
static moe_status_t agree_config(moe_runtime_t *rt, const moe_runtime_config_t *c)
{
    if (rt->mesh->world_size == 1) return MOE_STATUS_SUCCESS;
    moe_agree_field_t f[] = {
        moe_agree_u64("seed", c->seed),
        moe_agree_int("deterministic", c->deterministic != 0),
        moe_agree_int("backend (1 host, 2 cuda)", rt->backend.ops->kind),
    };
    return moe_mesh_agree(rt->mesh, MOE_AXIS_WORLD, "the runtime config", f,
                          (int)(sizeof f / sizeof f[0]), MOE_STATUS_SUCCESS);
}

moe_status_t moe_runtime_create(const moe_runtime_config_t *config, moe_runtime_t **out)
{
    moe_error_clear();
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    moe_runtime_config_t c = moe_runtime_config_default();
    MOE_TAKE_CONFIG(c, config, moe_runtime_config_t);
    MOE_CHECK_ARG(c.backend >= MOE_BACKEND_AUTO && c.backend <= MOE_BACKEND_CUDA,
                  "unknown backend %d", (int)c.backend);
    MOE_CHECK_ARG(c.log_level >= MOE_LOG_ERROR && c.log_level <= MOE_LOG_DEBUG,
                  "unknown log level %d", (int)c.log_level);

    moe_runtime_t *rt = calloc(1, sizeof *rt);
    if (!rt) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "runtime allocation");
    rt->logger = (moe_logger_t){log_level_from_env(c.log_level), c.log_fn, c.log_user_data};
    rt->seed = c.seed;
    moe_status_t st;
    MOE_TRY_GOTO(st, create_backend(&c, rt));
    MOE_TRY_GOTO(st,
                 moe_mesh_create(c.mesh, &rt->backend, rt->device_index, &rt->logger, &rt->mesh));
    st = agree_config(rt, &c);
    if (st != MOE_STATUS_SUCCESS) {
        moe_mesh_destroy(rt->mesh); /* the message stays the agreement's unless this fails */
        goto fail;
    }
    rt->magic = MOE_MAGIC_RUNTIME;
    moe_log(&rt->logger, MOE_LOG_INFO, "runtime: backend %s, world %d", rt->backend.ops->name,
            rt->mesh->world_size);
    *out = rt;
    return MOE_STATUS_SUCCESS;
fail:
    if (rt->backend.ops) rt->backend.ops->destroy(rt->backend.ctx);
    free(rt);
    return st;
}

void moe_runtime_adopt(moe_runtime_t *rt, moe_runtime_child_t kind) { rt->children[kind]++; }

void moe_runtime_disown(moe_runtime_t *rt, moe_runtime_child_t kind) { rt->children[kind]--; }

moe_status_t moe_runtime_add_fence(moe_runtime_t *rt, moe_write_fence_fn fn, void *arg)
{
    moe_write_fence_t *f = realloc(rt->fences, sizeof *f * (size_t)(rt->nfences + 1));
    if (!f) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "write fence list");
    f[rt->nfences++] = (moe_write_fence_t){.fn = fn, .arg = arg};
    rt->fences = f;
    return MOE_STATUS_SUCCESS;
}

void moe_runtime_remove_fence(moe_runtime_t *rt, void *arg)
{
    for (int32_t i = 0; i < rt->nfences; i++)
        if (rt->fences[i].arg == arg) {
            rt->fences[i] = rt->fences[--rt->nfences];
            return;
        }
}

moe_status_t moe_runtime_fence_writes(moe_runtime_t *rt, const void *data, size_t bytes)
{
    for (int32_t i = 0; i < rt->nfences; i++)
        MOE_TRY(rt->fences[i].fn(rt->fences[i].arg, data, bytes));
    return MOE_STATUS_SUCCESS;
}

bool moe_runtime_poisoned(const moe_runtime_t *rt)
{
    return moe_mesh_failure(rt->mesh, NULL) != MOE_STATUS_SUCCESS;
}

/* INVALID_ARGUMENT naming what is still alive on the runtime, or SUCCESS. */
static moe_status_t check_no_children(const moe_runtime_t *rt)
{
    static const char *const names[MOE_CHILD_KINDS][2] = {{"layer", "layers"},
                                                          {"optimizer", "optimizers"},
                                                          {"pipeline", "pipelines"},
                                                          {"checkpointer", "checkpointers"}};
    char alive[256] = "";
    size_t len = 0;
    for (int k = 0; k < MOE_CHILD_KINDS; k++)
        if (rt->children[k] > 0)
            len += (size_t)snprintf(alive + len, sizeof alive - len, "%s%d %s", len ? ", " : "",
                                    rt->children[k], names[k][rt->children[k] != 1]);
    MOE_CHECK_ARG(len == 0,
                  "the runtime still has %s made on it; destroy them first (the "
                  "runtime stays usable)",
                  alive);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_destroy(moe_runtime_t *rt)
{
    moe_error_clear();
    if (!rt) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_TRY(check_no_children(rt));
    moe_status_t st = moe_mesh_destroy(rt->mesh);
    rt->backend.ops->destroy(rt->backend.ctx);
    rt->magic = MOE_MAGIC_DEAD;
    free(rt->fences);
    free(rt);
    return st;
}

moe_status_t moe_runtime_get_async_error(moe_runtime_t *rt, char *message, size_t message_len)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    moe_comm_watch_poll(rt->mesh->watch);
    const char *cause = "";
    moe_status_t st = moe_mesh_failure(rt->mesh, &cause);
    if (message && message_len) snprintf(message, message_len, "%s", cause);
    return st;
}

moe_status_t moe_runtime_wait_stats(const moe_runtime_t *rt, moe_runtime_wait_stats_t *stats)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(stats != NULL, "stats is NULL");
    MOE_CHECK_STRUCT_SIZE(stats, moe_runtime_wait_stats_t, sizeof(moe_runtime_wait_stats_t));
    size_t sz = stats->struct_size < sizeof *stats ? stats->struct_size : sizeof *stats;
    moe_comm_waited_t *w = &rt->mesh->waited;
    moe_runtime_wait_stats_t s = {
        .struct_size = stats->struct_size,
        .wait_seconds = 1e-9 * (double)atomic_load_explicit(&w->ns, memory_order_relaxed),
        .waits = atomic_load_explicit(&w->count, memory_order_relaxed)};
    memcpy(stats, &s, sz);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_backend(const moe_runtime_t *rt, moe_backend_kind_t *out)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = rt->backend.ops->kind;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_device(const moe_runtime_t *rt, moe_device_kind_t *kind,
                                int32_t *device_index)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(kind != NULL, "kind is NULL");
    *kind = rt->backend.ops->device;
    if (device_index) *device_index = rt->device_index;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_compute_dtype(const moe_runtime_t *rt, moe_dtype_t *out)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = rt->backend.ops->compute_dtype;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_set_stream(moe_runtime_t *rt, void *cuda_stream)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    return MOE_OPS(rt)->set_stream(MOE_CTX(rt), cuda_stream);
}

moe_status_t moe_runtime_get_stream(const moe_runtime_t *rt, void **cuda_stream)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(cuda_stream != NULL, "cuda_stream is NULL");
    *cuda_stream = MOE_OPS(rt)->stream(MOE_CTX(rt));
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_runtime_synchronize(moe_runtime_t *rt)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    return MOE_OPS(rt)->synchronize(MOE_CTX(rt));
}

moe_status_t moe_runtime_set_log(moe_runtime_t *rt, moe_log_level_t level, moe_log_fn fn,
                                 void *user_data)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(level >= MOE_LOG_ERROR && level <= MOE_LOG_DEBUG, "unknown log level %d",
                  (int)level);
    rt->logger = (moe_logger_t){level, fn, user_data};
    return MOE_STATUS_SUCCESS;
}

/* ---- tensors owned by libmoe ------------------------------------------------------------ */

moe_status_t moe_tensor_alloc(moe_runtime_t *rt, moe_dtype_t dtype, moe_device_kind_t device,
                              int32_t ndim, const int64_t *shape, moe_tensor_t *out)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    moe_tensor_t t;
    MOE_TRY(moe_tensor_view(NULL, dtype, device, ndim, shape, &t));
    MOE_CHECK_ARG(device == MOE_DEVICE_HOST || device == rt->backend.ops->device,
                  "device %d is not available on the %s backend", (int)device,
                  rt->backend.ops->name);
    t.device_index = device == MOE_DEVICE_CUDA ? rt->device_index : 0;
    size_t bytes = moe_tensor_bytes(&t);
    if (device == rt->backend.ops->device && device != MOE_DEVICE_HOST)
        MOE_TRY(MOE_OPS(rt)->alloc(MOE_CTX(rt), bytes, &t.data));
    else
        MOE_TRY(MOE_OPS(rt)->alloc_pinned(MOE_CTX(rt), bytes, &t.data));
    *out = t;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_tensor_free(moe_runtime_t *rt, moe_tensor_t *t)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(t != NULL, "tensor is NULL");
    if (t->data) {
        if (t->device != MOE_DEVICE_HOST)
            MOE_OPS(rt)->free(MOE_CTX(rt), t->data);
        else
            MOE_OPS(rt)->free_pinned(MOE_CTX(rt), t->data);
    }
    memset(t, 0, sizeof *t);
    return MOE_STATUS_SUCCESS;
}

/* Convert n elements between host buffers to dtype dt from the other one (bf16 <-> f32). */
static void convert_host(void *dst, moe_dtype_t dt, const void *src, int64_t n)
{
    if (dt == MOE_DTYPE_F32) {
        const uint16_t *s = src;
        float *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = moe_bf16_to_f32(s[i]);
    } else {
        const float *s = src;
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = moe_f32_to_bf16(s[i]);
    }
}

moe_status_t moe_tensor_copy(moe_runtime_t *rt, moe_tensor_t *dst, const moe_tensor_t *src)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(src != NULL && dst != NULL, "src or dst is NULL");
    int64_t n = moe_tensor_numel(src);
    MOE_CHECK_ARG(n >= 0 && moe_tensor_numel(dst) == n,
                  "src has %lld elements and dst %lld; they must be equal", (long long)n,
                  (long long)moe_tensor_numel(dst));
    MOE_CHECK_ARG(moe_dtype_size(src->dtype) && moe_dtype_size(dst->dtype), "unknown dtype");
    MOE_CHECK_ARG((src->data && dst->data) || n == 0, "src or dst data is NULL");
    if (n == 0) return MOE_STATUS_SUCCESS;
    size_t sbytes = (size_t)n * moe_dtype_size(src->dtype);
    if (src->dtype == dst->dtype)
        return MOE_OPS(rt)->copy(MOE_CTX(rt), dst->data, src->data, sbytes);
    /* Different dtypes: bring src to the host, convert, send to dst. */
    void *host_src = malloc(sbytes);
    void *host_dst = malloc((size_t)n * moe_dtype_size(dst->dtype));
    moe_status_t st = MOE_STATUS_SUCCESS;
    if (!host_src || !host_dst) {
        st = MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "conversion buffers of %zu bytes", sbytes);
        goto fail;
    }
    MOE_TRY_GOTO(st, MOE_OPS(rt)->copy(MOE_CTX(rt), host_src, src->data, sbytes));
    convert_host(host_dst, dst->dtype, host_src, n);
    MOE_TRY_GOTO(st, MOE_OPS(rt)->copy(MOE_CTX(rt), dst->data, host_dst,
                                       (size_t)n * moe_dtype_size(dst->dtype)));
fail:
    free(host_src);
    free(host_dst);
    return st;
}

moe_status_t moe_runtime_axis(const moe_runtime_t *rt, moe_axis_t axis, int32_t *rank,
                              int32_t *size)
{
    MOE_ENTRY(rt, MOE_MAGIC_RUNTIME, "runtime");
    MOE_CHECK_ARG(rank != NULL && size != NULL, "rank or size is NULL");
    MOE_CHECK_ARG(axis >= MOE_AXIS_TP && axis <= MOE_AXIS_WORLD, "unknown axis %d", (int)axis);
    if (axis == MOE_AXIS_WORLD) {
        *rank = rt->mesh->world_rank;
        *size = rt->mesh->world_size;
    } else {
        *rank = rt->mesh->coord[axis];
        *size = rt->mesh->size[axis];
    }
    return MOE_STATUS_SUCCESS;
}
