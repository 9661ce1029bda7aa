/*
 * The 1F1B schedule of one pipeline stage as a flat list of actions.
 *
 * Legend: p stages, m microbatches, s this stage, w = min(p - s - 1, m) warm-up forwards.
 *
 *   warm-up    for i < w:        [<act i] F i [>act i]
 *   steady     for j < m - w:    [<act w+j] F w+j [>act w+j]   [<grad j] B j [>grad j]
 *   cool-down  for j >= m - w:   [<grad j] B j [>grad j]
 *
 * Bracketed transfers exist only where the peer exists (no <act on stage 0, no >act and no
 * <grad on stage p-1). A receive is placed right before the compute that needs it; the
 * executor posts it earlier. The last stage has w = 0, so its forward of j is followed at once
 * by the loss and backward of j. Stage s holds at most w + 1 <= p - s activations.
 */
#include "pipeline_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"

static void push(moe_pipeline_schedule_t *sc, moe_pipeline_op_t op, int32_t mb, int32_t peer)
{
    sc->actions[sc->count++] = (moe_pipeline_action_t){.op = op, .microbatch = mb, .peer = peer};
}

static void push_forward(moe_pipeline_schedule_t *sc, int32_t mb)
{
    int32_t s = sc->stage, p = sc->stages;
    if (s > 0) push(sc, MOE_PIPE_RECV_ACT, mb, s - 1);
    push(sc, MOE_PIPE_FORWARD, mb, -1);
    if (s < p - 1) push(sc, MOE_PIPE_SEND_ACT, mb, s + 1);
}

static void push_backward(moe_pipeline_schedule_t *sc, int32_t mb)
{
    int32_t s = sc->stage, p = sc->stages;
    if (s < p - 1) push(sc, MOE_PIPE_RECV_GRAD, mb, s + 1);
    push(sc, MOE_PIPE_BACKWARD, mb, -1);
    if (s > 0) push(sc, MOE_PIPE_SEND_GRAD, mb, s - 1);
}

moe_status_t moe_pipeline_schedule_build(int32_t stages, int32_t microbatches, int32_t stage,
                                         moe_pipeline_schedule_t **out)
{
    MOE_CHECK_ARG(out != NULL, "out is NULL");
    *out = NULL;
    MOE_CHECK_ARG(stages >= 1, "stages is %d; expected >= 1", stages);
    MOE_CHECK_ARG(microbatches >= 1, "microbatches is %d; expected >= 1", microbatches);
    MOE_CHECK_ARG(microbatches <= (1 << 24), "microbatches is %d; at most %d supported",
                  microbatches, 1 << 24);
    MOE_CHECK_ARG(stage >= 0 && stage < stages, "stage is %d; expected 0..%d", stage,
                  stages - 1);
    moe_pipeline_schedule_t *sc = calloc(1, sizeof *sc);
    if (!sc) return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "schedule allocation");
    /* at most 3 actions per compute: receive, compute, send */
    sc->actions = calloc((size_t)microbatches * 6, sizeof *sc->actions);
    if (!sc->actions) {
        free(sc);
        return MOE_FAIL(MOE_STATUS_OUT_OF_MEMORY, "schedule of %d microbatches", microbatches);
    }
    sc->stages = stages;
    sc->microbatches = microbatches;
    sc->stage = stage;
    int32_t w = stages - stage - 1;
    if (w > microbatches) w = microbatches;
    sc->warmup = w;

    for (int32_t i = 0; i < w; i++) push_forward(sc, i);
    for (int32_t j = 0; j < microbatches - w; j++) {
        push_forward(sc, w + j);
        push_backward(sc, j);
    }
    for (int32_t j = microbatches - w; j < microbatches; j++) push_backward(sc, j);
    sc->magic = MOE_MAGIC_PIPE_SCHED;
    *out = sc;
    return MOE_STATUS_SUCCESS;
}

void moe_pipeline_schedule_free(moe_pipeline_schedule_t *sc)
{
    if (!sc) return;
    sc->magic = MOE_MAGIC_DEAD;
    free(sc->actions);
    free(sc);
}

/* ---- public entry points ------------------------------------------------------------------- */

moe_status_t moe_pipeline_schedule_create(int32_t stages, int32_t microbatches, int32_t stage,
                                          moe_pipeline_schedule_t **out)
{
    moe_error_clear();
    return moe_pipeline_schedule_build(stages, microbatches, stage, out);
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
    moe_error_clear();
    MOE_CHECK_HANDLE(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    MOE_CHECK_ARG(count != NULL, "count is NULL");
    *count = sc->count;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_schedule_action(const moe_pipeline_schedule_t *sc, int32_t index,
                                          moe_pipeline_action_t *action)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    MOE_CHECK_ARG(action != NULL, "action is NULL");
    MOE_CHECK_ARG(index >= 0 && index < sc->count, "index %d is outside 0..%d", index,
                  sc->count - 1);
    *action = sc->actions[index];
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_pipeline_schedule_info(const moe_pipeline_schedule_t *sc, int32_t *stages,
                                        int32_t *microbatches, int32_t *stage, int32_t *warmup)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    if (stages) *stages = sc->stages;
    if (microbatches) *microbatches = sc->microbatches;
    if (stage) *stage = sc->stage;
    if (warmup) *warmup = sc->warmup;
    return MOE_STATUS_SUCCESS;
}

const char *moe_pipeline_op_string(moe_pipeline_op_t op)
{
    switch (op) {
    case MOE_PIPE_FORWARD: return "forward";
    case MOE_PIPE_BACKWARD: return "backward";
    case MOE_PIPE_SEND_ACT: return "send_act";
    case MOE_PIPE_RECV_ACT: return "recv_act";
    case MOE_PIPE_SEND_GRAD: return "send_grad";
    case MOE_PIPE_RECV_GRAD: return "recv_grad";
    }
    return "unknown";
}

/* Append to buf like snprintf, counting what the full text needs even past the end. */
static void append(char *buf, size_t size, size_t *len, const char *fmt, int32_t a, int32_t b)
{
    size_t room = *len < size ? size - *len : 0;
    int n = snprintf(room ? buf + *len : NULL, room, fmt, a, b);
    if (n > 0) *len += (size_t)n;
}

moe_status_t moe_pipeline_schedule_to_string(const moe_pipeline_schedule_t *sc, char *buf,
                                              size_t size, size_t *needed)
{
    moe_error_clear();
    MOE_CHECK_HANDLE(sc, MOE_MAGIC_PIPE_SCHED, "schedule");
    MOE_CHECK_ARG(buf != NULL || size == 0, "buf is NULL but size is %zu", size);
    size_t len = 0;
    append(buf, size, &len, "stage %d/%d", sc->stage, sc->stages);
    append(buf, size, &len, " m=%d:", sc->microbatches, 0);
    for (int32_t i = 0; i < sc->count; i++) {
        const moe_pipeline_action_t *a = &sc->actions[i];
        switch (a->op) {
        case MOE_PIPE_FORWARD: append(buf, size, &len, " F%d", a->microbatch, 0); break;
        case MOE_PIPE_BACKWARD: append(buf, size, &len, " B%d", a->microbatch, 0); break;
        case MOE_PIPE_SEND_ACT: append(buf, size, &len, " >act%d@%d", a->microbatch, a->peer); break;
        case MOE_PIPE_RECV_ACT: append(buf, size, &len, " <act%d@%d", a->microbatch, a->peer); break;
        case MOE_PIPE_SEND_GRAD: append(buf, size, &len, " >grad%d@%d", a->microbatch, a->peer); break;
        case MOE_PIPE_RECV_GRAD: append(buf, size, &len, " <grad%d@%d", a->microbatch, a->peer); break;
        }
    }
    if (size > 0) buf[len < size ? len : size - 1] = '\0';
    if (needed) *needed = len + 1;
    return MOE_STATUS_SUCCESS;
}
