/*
 * The 1F1B schedule of one pipeline stage as a flat list of actions.
 *
 * Legend: p stages (pp ranks), m microbatches, s this stage, v virtual stages (model chunks)
 * per rank; a "unit" is one (chunk, microbatch) pair, m*v of them per rank.
 *
 * Plain 1F1B (v = 1), w = min(p - s - 1, m) warm-up forwards:
 *   warm-up    for i < w:        [<act i] F i [>act i]
 *   steady     for j < m - w:    [<act w+j] F w+j [>act w+j]   [<grad j] B j [>grad j]
 *   cool-down  for j >= m - w:   [<grad j] B j [>grad j]
 * Bracketed transfers exist only where the peer exists (no <act on stage 0, no >act and no
 * <grad on stage p-1). A receive is placed right before the compute that needs it; the
 * executor posts it earlier. The last stage has w = 0, so its forward of j is followed at once
 * by the loss and backward of j. Stage s holds at most w + 1 <= p - s activations.
 *
 * Interleaved 1F1B (v > 1, as in Megatron-LM): chunk c of rank s is virtual stage c*p + s,
 * so activations go s -> s+1 within a chunk and from rank p-1 chunk c to rank 0 chunk c+1.
 * Forward unit k (k = 0 .. m*v-1) of a rank is microbatch (k / (p*v)) * p + k % p of chunk
 * (k / p) % v; backward unit k the same microbatch of chunk v - 1 - (k / p) % v. Warm-up is
 * min(2 (p - s - 1) + (v - 1) p, m v) forwards (all m v when m = p), then 1F1B over units,
 * then cool-down. Requires m % p == 0 and p >= 2.
 */
#include "pipeline_internal.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

static void push(moe_pipeline_schedule_t *sc, moe_pipeline_op_t op, int32_t mb, int32_t chunk,
                 int32_t peer)
{
    sc->actions[sc->count++] = (moe_pipeline_action_t){
        .op = op, .microbatch = mb, .peer = peer, .chunk = chunk};
}

/* Virtual stage vs = chunk * p + stage; its neighbours as (rank, chunk). */
static void push_forward(moe_pipeline_schedule_t *sc, int32_t mb, int32_t chunk)
{
    int32_t s = sc->stage, p = sc->stages, vs = chunk * p + s, nv = p * sc->virtual_stages;
    if (vs > 0) push(sc, MOE_PIPELINE_RECV_ACT, mb, chunk, (s + p - 1) % p);
    push(sc, MOE_PIPELINE_FORWARD, mb, chunk, -1);
    if (vs < nv - 1) push(sc, MOE_PIPELINE_SEND_ACT, mb, chunk, (s + 1) % p);
}

static void push_backward(moe_pipeline_schedule_t *sc, int32_t mb, int32_t chunk)
{
    int32_t s = sc->stage, p = sc->stages, vs = chunk * p + s, nv = p * sc->virtual_stages;
    if (vs < nv - 1) push(sc, MOE_PIPELINE_RECV_GRAD, mb, chunk, (s + 1) % p);
    push(sc, MOE_PIPELINE_BACKWARD, mb, chunk, -1);
    if (vs > 0) push(sc, MOE_PIPELINE_SEND_GRAD, mb, chunk, (s + p - 1) % p);
}

/* The microbatch and chunk of forward (or backward) unit k of an interleaved schedule. */
static void unit_of(const moe_pipeline_schedule_t *sc, int32_t k, bool forward, int32_t *mb,
                    int32_t *chunk)
{
    int32_t p = sc->stages, v = sc->virtual_stages;
    *mb = (k / (p * v)) * p + k % p;
    *chunk = (k / p) % v;
    if (!forward) *chunk = v - 1 - *chunk;
}

moe_status_t moe_pipeline_schedule_build(int32_t stages, int32_t microbatches, int32_t stage,
                                         int32_t virtual_stages, moe_pipeline_schedule_t **out)
{
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(stages >= 1, "stages is %d; expected >= 1", stages);
    MOE_CHECK_ARG(microbatches >= 1, "microbatches is %d; expected >= 1", microbatches);
    MOE_CHECK_ARG(virtual_stages >= 1, "virtual_stages is %d; expected >= 1", virtual_stages);
    MOE_CHECK_ARG((int64_t)microbatches * virtual_stages <= (1 << 24),
                  "microbatches x virtual_stages is %lld; at most %d supported",
                  (long long)microbatches * virtual_stages, 1 << 24);
    MOE_CHECK_ARG(stage >= 0 && stage < stages, "stage is %d; expected 0..%d", stage, stages - 1);
    if (virtual_stages > 1) {
        MOE_CHECK_ARG(stages >= 2,
                      "interleaving (virtual_stages=%d) needs at least 2 stages, "
                      "not %d",
                      virtual_stages, stages);
        MOE_CHECK_ARG(microbatches % stages == 0,
                      "interleaving needs microbatches (%d) divisible by stages (%d)", microbatches,
                      stages);
    }
    moe_pipeline_schedule_t *sc = calloc(1, sizeof *sc);
    if (!sc) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "schedule allocation");
    int32_t units = microbatches * virtual_stages;
    /* at most 3 actions per compute: receive, compute, send */
    sc->actions = calloc((size_t)units * 6, sizeof *sc->actions);
    if (!sc->actions) {
        free(sc);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "schedule of %d units", units);
    }
    sc->stages = stages;
    sc->microbatches = microbatches;
    sc->stage = stage;
    sc->virtual_stages = virtual_stages;
    int32_t w;
    if (virtual_stages == 1) {
        w = stages - stage - 1;
    } else if (microbatches == stages) {
        w = units;
    } else {
        w = 2 * (stages - stage - 1) + (virtual_stages - 1) * stages;
    }
    if (w > units) w = units;
    sc->warmup = w;

    int32_t mb, chunk;
    for (int32_t i = 0; i < w; i++) {
        unit_of(sc, i, true, &mb, &chunk);
        push_forward(sc, mb, chunk);
    }
    for (int32_t j = 0; j < units - w; j++) {
        unit_of(sc, w + j, true, &mb, &chunk);
        push_forward(sc, mb, chunk);
        unit_of(sc, j, false, &mb, &chunk);
        push_backward(sc, mb, chunk);
    }
    for (int32_t j = units - w; j < units; j++) {
        unit_of(sc, j, false, &mb, &chunk);
        push_backward(sc, mb, chunk);
    }
    sc->magic = MOE_MAGIC_PIPE_SCHED;
    *out = sc;
    return MOE_STATUS_SUCCESS;
}

void moe_pipeline_schedule_free(moe_pipeline_schedule_t *sc)
{
    if (!sc) return;
    sc->magic = MOE_MAGIC_DEAD;
    free(sc->actions);
    free(sc->issue);
    free(sc);
}

/* ---- public entry points ------------------------------------------------------------------- */

moe_status_t moe_pipeline_schedule_create(int32_t stages, int32_t microbatches, int32_t stage,
                                          moe_pipeline_schedule_t **out)
{
    moe_error_clear();
    return moe_pipeline_schedule_build(stages, microbatches, stage, 1, out);
}

moe_status_t moe_pipeline_schedule_create_interleaved(int32_t stages, int32_t microbatches,
                                                      int32_t stage, int32_t virtual_stages,
                                                      moe_pipeline_schedule_t **out)
{
    moe_error_clear();
    return moe_pipeline_schedule_build(stages, microbatches, stage, virtual_stages, out);
}

moe_status_t moe_pipeline_schedule_virtual_stages(const moe_pipeline_schedule_t *sc,
                                                  int32_t *virtual_stages)
{
    MOE_ENTRY(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    MOE_CHECK_ARG(virtual_stages != NULL, "virtual_stages is NULL");
    *virtual_stages = sc->virtual_stages;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_schedule_destroy(moe_pipeline_schedule_t *sc)
{
    moe_error_clear();
    if (!sc) return MOE_STATUS_SUCCESS;
    MOE_CHECK_HANDLE(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    moe_pipeline_schedule_free(sc);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_schedule_length(const moe_pipeline_schedule_t *sc, int32_t *count)
{
    MOE_ENTRY(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    MOE_CHECK_ARG(count != NULL, "count is NULL");
    *count = sc->count;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_schedule_action(const moe_pipeline_schedule_t *sc, int32_t index,
                                          moe_pipeline_action_t *action)
{
    MOE_ENTRY(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    MOE_CHECK_ARG(action != NULL, "action is NULL");
    MOE_CHECK_ARG(index >= 0 && index < sc->count, "index %d is outside 0..%d", index,
                  sc->count - 1);
    *action = sc->actions[index];
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_schedule_info(const moe_pipeline_schedule_t *sc, int32_t *stages,
                                        int32_t *microbatches, int32_t *stage, int32_t *warmup)
{
    MOE_ENTRY(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    if (stages) *stages = sc->stages;
    if (microbatches) *microbatches = sc->microbatches;
    if (stage) *stage = sc->stage;
    /* the steady phase opens with a forward, so one more than the warm-up precedes the first
     * backward (all of them when the warm-up is every unit) */
    int32_t units = sc->microbatches * sc->virtual_stages;
    if (warmup) *warmup = sc->warmup < units ? sc->warmup + 1 : units;
    return MOE_STATUS_SUCCESS;
}

const char *moe_pipeline_op_string(moe_pipeline_op_t op)
{
    switch (op) {
    case MOE_PIPELINE_FORWARD: return "forward";
    case MOE_PIPELINE_BACKWARD: return "backward";
    case MOE_PIPELINE_SEND_ACT: return "send_act";
    case MOE_PIPELINE_RECV_ACT: return "recv_act";
    case MOE_PIPELINE_SEND_GRAD: return "send_grad";
    case MOE_PIPELINE_RECV_GRAD: return "recv_grad";
    }
    return "unknown";
}

/* Append to buf like snprintf, counting what the full text needs even past the end. */
static void append(char *buf, size_t size, size_t *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void append(char *buf, size_t size, size_t *len, const char *fmt, ...)
{
    size_t room = *len < size ? size - *len : 0;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(room ? buf + *len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0) *len += (size_t)n;
}

moe_status_t moe_pipeline_schedule_to_string(const moe_pipeline_schedule_t *sc, char *buf,
                                             size_t size, size_t *needed)
{
    MOE_ENTRY(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    MOE_CHECK_ARG(buf != NULL || size == 0, "buf is NULL but size is %zu", size);
    size_t len = 0;
    append(buf, size, &len, "stage %d/%d m=%d", sc->stage, sc->stages, sc->microbatches);
    if (sc->virtual_stages > 1) append(buf, size, &len, " v=%d", sc->virtual_stages);
    append(buf, size, &len, ":");
    for (int32_t i = 0; i < sc->count; i++) {
        const moe_pipeline_action_t *a = &sc->actions[i];
        static const char *const prefix[] = {"F", "B", ">act", "<act", ">grad", "<grad"};
        append(buf, size, &len, " %s%d", prefix[a->op], a->microbatch);
        if (sc->virtual_stages > 1) append(buf, size, &len, ".%d", a->chunk);
        if (a->peer >= 0) append(buf, size, &len, "@%d", a->peer);
    }
    if (size > 0) buf[len < size ? len : size - 1] = '\0';
    if (needed) *needed = len + 1;
    return MOE_STATUS_SUCCESS;
}
