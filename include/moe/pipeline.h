/*
 * libmoe pipeline parallelism: the 1F1B schedule and its executor.
 *
 * A model is cut into p stages, one per coordinate of the mesh's pp axis. A global batch is
 * split into m microbatches. On stage s (0-based) the one-forward-one-backward schedule runs
 *
 *   warm-up    w = min(p - s - 1, m) forwards          F0 F1 .. F(w-1)
 *   steady     m - w pairs "forward, then backward"    F(w) B0  F(w+1) B1 ..
 *   cool-down  the w remaining backwards               .. B(m-1)
 *
 * so stage s keeps at most p - s microbatches' activations alive, and the idle ("bubble")
 * fraction with equal stage costs is (p - 1) / (m + p - 1).
 *
 * Two layers of API:
 *   moe_pipeline_schedule_*  the schedule of one stage as a list of actions (compute and
 *                            transfer) that can be inspected and printed. Pure: no runtime,
 *                            no communication.
 *   moe_pipeline_*           the executor: runs that list with user callbacks for the stage's
 *                            forward, backward and (last stage) loss, moves activations
 *                            forward and gradients backward over the mesh's pp communicator
 *                            with non-blocking send/recv (receives posted ahead of use), and
 *                            finishes a global batch with one optimizer step.
 *
 * Microbatch index = slot: callbacks get the microbatch index 0..m-1, which is the slot to pass
 * to moe_layer_forward/backward for libmoe layers inside the stage (create those layers with
 * max_microbatches >= m; at most min(p - s, m) slots of stage s are in use at once).
 *
 * Streams (CUDA backend): callbacks enqueue their work on the runtime's stream; the executor
 * sends a buffer only after the work enqueued on that stream so far (the MPI communicator
 * stages it through a copy on that stream; for other communicators the executor synchronises
 * the stream first), and a received buffer is complete before the callback that consumes it
 * is called.
 */
#ifndef MOE_PIPELINE_H
#define MOE_PIPELINE_H

#include "core.h"
#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- schedule ------------------------------------------------------------------------------ */

typedef enum moe_pipeline_op {
    MOE_PIPELINE_FORWARD = 0,   /* run the stage forward of `microbatch`                     */
    MOE_PIPELINE_BACKWARD = 1,  /* run the stage backward of `microbatch`                    */
    MOE_PIPELINE_SEND_ACT = 2,  /* send the forward output of `microbatch` to stage `peer` (s+1) */
    MOE_PIPELINE_RECV_ACT = 3,  /* the forward input of `microbatch` from `peer` (s-1) is needed */
    MOE_PIPELINE_SEND_GRAD = 4, /* send the input gradient of `microbatch` to `peer` (s-1)    */
    MOE_PIPELINE_RECV_GRAD = 5, /* the output gradient of `microbatch` from `peer` (s+1) is
                                   needed                                                    */
    /* The earlier names, kept as aliases so code written against them still compiles. */
    MOE_PIPE_FORWARD = MOE_PIPELINE_FORWARD,
    MOE_PIPE_BACKWARD = MOE_PIPELINE_BACKWARD,
    MOE_PIPE_SEND_ACT = MOE_PIPELINE_SEND_ACT,
    MOE_PIPE_RECV_ACT = MOE_PIPELINE_RECV_ACT,
    MOE_PIPE_SEND_GRAD = MOE_PIPELINE_SEND_GRAD,
    MOE_PIPE_RECV_GRAD = MOE_PIPELINE_RECV_GRAD
} moe_pipeline_op_t;

typedef struct moe_pipeline_action {
    moe_pipeline_op_t op;
    int32_t microbatch; /* 0 .. m-1 */
    int32_t peer;       /* peer stage of a transfer; -1 for compute */
    int32_t chunk;      /* model chunk on this stage (interleaved); 0 without interleaving.
                            For a transfer: the chunk on this stage that sends or receives. */
} moe_pipeline_action_t;

typedef struct moe_pipeline_schedule moe_pipeline_schedule_t;

/* The 1F1B action list of `stage` for `stages` stages and `microbatches` microbatches.
 * Receives appear where their data is needed (the executor posts them earlier); sends right
 * after the compute that produced their data. Compute actions are exactly 2m.
 * [in] stages >= 1, 0 <= stage < stages, microbatches >= 1 [out] out, destroy with
 * moe_pipeline_schedule_destroy. Not collective. */
MOE_API moe_status_t moe_pipeline_schedule_create(int32_t stages, int32_t microbatches,
                                                  int32_t stage, moe_pipeline_schedule_t **out);
/* Interleaved 1F1B: each stage holds `virtual_stages` (v) model chunks; chunk c of stage s is
 * virtual stage c*p + s, so activations also go from stage p-1 (chunk c) to stage 0 (chunk
 * c+1). The bubble shrinks to (p-1)/(v*m + p-1) of a batch at the price of v times the
 * transfers. Warm-up is min(2(p-s-1) + (v-1)p, m v) forward units (all of them when m = p).
 * [in] stages >= 2, microbatches divisible by stages, virtual_stages >= 1 (1: plain 1F1B,
 * where any stages >= 1 and microbatches >= 1 work). Compute actions are exactly 2 m v. */
MOE_API moe_status_t moe_pipeline_schedule_create_interleaved(int32_t stages, int32_t microbatches,
                                                              int32_t stage, int32_t virtual_stages,
                                                              moe_pipeline_schedule_t **out);
MOE_API moe_status_t moe_pipeline_schedule_destroy(moe_pipeline_schedule_t *sched);

/* [out] count: number of actions. */
MOE_API moe_status_t moe_pipeline_schedule_length(const moe_pipeline_schedule_t *sched,
                                                  int32_t *count);
/* [in] index 0..count-1 [out] action. */
MOE_API moe_status_t moe_pipeline_schedule_action(const moe_pipeline_schedule_t *sched,
                                                  int32_t index, moe_pipeline_action_t *action);
/* [out] stages, microbatches, stage, warmup: the forwards that run before the first backward
 * (the w warm-up forwards above and the steady phase's first, or all m v of them when the
 * warm-up covers every unit); any NULL. */
MOE_API moe_status_t moe_pipeline_schedule_info(const moe_pipeline_schedule_t *sched,
                                                int32_t *stages, int32_t *microbatches,
                                                int32_t *stage, int32_t *warmup);

/* [out] virtual_stages: model chunks per stage (1 without interleaving). */
MOE_API moe_status_t moe_pipeline_schedule_virtual_stages(const moe_pipeline_schedule_t *sched,
                                                          int32_t *virtual_stages);

/* Static text for an op ("F", "B", "send_act", ...); never NULL. */
MOE_API const char *moe_pipeline_op_string(moe_pipeline_op_t op);

/* Print the schedule as one line, e.g. for p=2, m=2, stage 0:
 *   "stage 0/2 m=2: F0 >act0@1 F1 >act1@1 <grad0@1 B0 <grad1@1 B1"
 * (F/B: compute; ">x@s": send x to stage s; "<x@s": receive x from stage s). Interleaved
 * schedules add " v=<v>" to the header and ".<chunk>" after each microbatch: "F3.1" is the
 * forward of microbatch 3 on chunk 1.
 * [out] buf of `size` bytes (may be NULL when size is 0), always NUL-terminated when size > 0
 * [out] needed (may be NULL): bytes the full text needs, including the NUL. A too small buffer
 * is not an error: the text is truncated and `needed` says how much to allocate. */
MOE_API moe_status_t moe_pipeline_schedule_to_string(const moe_pipeline_schedule_t *sched,
                                                     char *buf, size_t size, size_t *needed);

/* ---- executor ------------------------------------------------------------------------------ */

typedef struct moe_pipeline moe_pipeline_t;

/* Stage callbacks. Each returns MOE_STATUS_SUCCESS or a failure status (any other value);
 * a failure stops the global batch on every rank (see moe_pipeline_train_step). They run on
 * the thread that called moe_pipeline_train_step. Tensors are libmoe-owned buffers of the
 * configured activation shape and dtype on the runtime's device; do not keep pointers to
 * them past the documented lifetime.
 *
 * chunk:    the model chunk (0..v-1) the call is for: always 0 without interleaving; with
 *           config.virtual_stages = v, chunk c of stage s holds the layers of virtual stage
 *           c*p + s of the model (first = stage 0 chunk 0, last = stage p-1 chunk v-1).
 * forward:  [in] x: the stage input of microbatch mb (received from the previous virtual
 *           stage), or NULL on the first (the stage reads its own data for mb). x stays valid
 *           and unchanged until backward(chunk, mb) returns, so a stage may keep it.
 *           [out] y: the stage output to send on; on the last virtual stage the output buffer
 *           whose content is then given to `loss`.
 * loss:     last virtual stage only. [in] y: the forward output of mb [out] dy: d loss / d y
 *           [out] loss_value: the loss of mb (the step reports the mean over microbatches).
 *           The gradient should be of the loss the optimizer minimises; the executor applies
 *           grad_scale (default 1/m) in the optimizer step, so return per-microbatch losses.
 * backward: [in] dy: the gradient of the stage output of mb (from the next virtual stage,
 *           or from `loss`) [out] dx: the gradient of the stage input, sent back; NULL on the
 *           first virtual stage.
 *           Parameter gradients accumulate (+=) over the microbatches of the batch.
 * zero_grad (optional): called once at the start of each global batch, before any forward.
 * abandon (optional): after a failed batch, called for every microbatch whose forward was
 *           called but whose backward did not complete, so the stage can drop what forward
 *           saved (e.g. moe_layer_release_slot on each of its layers, ignoring slots that are
 *           not in use). Without it, such slots stay in use. Its status is ignored.
 * step (optional): called once at the end of each global batch on every rank after all
 *           stages succeeded, with grad_scale; it must reduce gradients over data-parallel
 *           groups and update parameters (e.g. call moe_adamw_step). When NULL and the config
 *           names an optimizer, the executor calls moe_adamw_step(optimizer, lr, grad_scale). */
typedef struct moe_pipeline_callbacks {
    moe_status_t (*forward)(void *user, int32_t chunk, int32_t microbatch, const moe_tensor_t *x,
                            moe_tensor_t *y);
    moe_status_t (*loss)(void *user, int32_t microbatch, const moe_tensor_t *y, moe_tensor_t *dy,
                         double *loss_value);
    moe_status_t (*backward)(void *user, int32_t chunk, int32_t microbatch, const moe_tensor_t *dy,
                             moe_tensor_t *dx);
    moe_status_t (*zero_grad)(void *user);
    moe_status_t (*step)(void *user, float grad_scale);
    moe_status_t (*abandon)(void *user, int32_t chunk, int32_t microbatch);
    void *user;
} moe_pipeline_callbacks_t;

/* How the executor starts its transfers. */
typedef enum moe_pipeline_issue {
    MOE_PIPELINE_ISSUE_AUTO = 0,    /* PREPOST on the MPI communicator, ORDERED on NCCL      */
    MOE_PIPELINE_ISSUE_PREPOST = 1, /* receives `prepost` actions ahead, sends after their
                                       compute; needs a transport that matches by tag and
                                       progresses each operation on its own (MPI)            */
    MOE_PIPELINE_ISSUE_ORDERED = 2, /* every stage starts its transfers in one global order
                                       (the send time of each message in a unit-cost run of
                                       the whole pipeline), so operations on each pair of
                                       stages line up; safe on transports that run operations
                                       in call order on one stream without tags (NCCL), where
                                       PREPOST would deadlock                                */
    /* The earlier names, kept as aliases so code written against them still compiles. */
    MOE_PIPE_ISSUE_AUTO = MOE_PIPELINE_ISSUE_AUTO,
    MOE_PIPE_ISSUE_PREPOST = MOE_PIPELINE_ISSUE_PREPOST,
    MOE_PIPE_ISSUE_ORDERED = MOE_PIPELINE_ISSUE_ORDERED
} moe_pipeline_issue_t;

typedef struct moe_pipeline_config {
    size_t struct_size;
    int32_t microbatches;            /* m >= 1, default 1 */
    int32_t act_ndim;                /* 1..MOE_MAX_DIMS: shape of a stage boundary tensor */
    int64_t act_shape[MOE_MAX_DIMS]; /* per microbatch, e.g. {tokens, hidden}; equal on every
                                          stage boundary and every pp rank */
    moe_dtype_t act_dtype;           /* default: the runtime's compute dtype (set by create
                                          when left at -1, the default) */
    int32_t prepost;                 /* PREPOST mode: receives kept posted ahead of use,
                                          >= 1, default 2 (each holds a buffer) */
    moe_adamw_t *optimizer;          /* used when callbacks.step is NULL; may be NULL */
    float lr;                        /* passed to moe_adamw_step; <= 0: configured rate */
    float grad_scale;                /* <= 0 (default): 1/m */
    int32_t timeout_ms;              /* transfers slower than this fail; <= 0: the pp
                                          communicator's own timeout */
    int32_t virtual_stages;          /* v >= 1 model chunks per stage (interleaved 1F1B when
                                          > 1: needs pp >= 2 and m % pp == 0); default 1.
                                          m * v <= 15000. */
    moe_pipeline_issue_t issue;      /* default AUTO */
} moe_pipeline_config_t;

MOE_API moe_pipeline_config_t moe_pipeline_config_default(void);

/* Build the executor for this rank's pp stage (the runtime's mesh coordinate on MOE_AXIS_PP;
 * a runtime without a mesh, or pp = 1, is a single stage running forward, loss and backward
 * per microbatch). [in] rt, config (act_ndim/act_shape required), callbacks (forward and
 * backward required; loss required on the last stage) [out] out. Collective over the
 * runtime's pp stage (tp x ep x dp): its ranks compare lr and grad_scale, and a difference is
 * INVALID_ARGUMENT on every rank, naming the field and both values. The callbacks struct is
 * copied. */
MOE_API moe_status_t moe_pipeline_create(moe_runtime_t *rt, const moe_pipeline_config_t *config,
                                         const moe_pipeline_callbacks_t *callbacks,
                                         moe_pipeline_t **out);
/* Frees buffers. Not collective. A healthy train_step leaves no transfer in flight; after the
 * mesh lost a peer, the buffers that transfers which never completed may still write are
 * leaked instead (docs/mesh.md, "When a peer fails"). */
MOE_API moe_status_t moe_pipeline_destroy(moe_pipeline_t *pipe);

/* The schedule this rank executes (owned by the pipeline). */
MOE_API moe_status_t moe_pipeline_get_schedule(const moe_pipeline_t *pipe,
                                               const moe_pipeline_schedule_t **out);

/* Run one global batch: zero_grad, the 1F1B schedule over m microbatches, a status exchange
 * over the world, then (only if every rank succeeded) the optimizer step.
 * Collective over the mesh's world communicator (every rank calls it once per batch).
 * [out] loss (may be NULL): mean loss over the microbatches of this pipeline (the last
 * stage's value, broadcast over pp; other dp replicas have their own).
 *
 * Failures: when a callback fails on some rank, that rank keeps executing the transfers of
 * its schedule without computing, sending zeros (so no peer waits for a message that never
 * comes and no peer computes on stale memory), every
 * rank learns of the failure in the status exchange, nobody steps the optimizer, and
 * every rank returns a failure: the failing rank its own status and message, the others
 * MOE_STATUS_ABORTED naming the failing rank and status. Gradients are then partial; call
 * again to retry the batch (zero_grad runs first). A failed transfer (MOE_STATUS_TIMEOUT,
 * whose message names the peer's world rank and whether it answers, or
 * MOE_STATUS_COMM_ERROR) poisons the runtime's mesh (moe_runtime_get_async_error): the call
 * returns that status, the other ranks are told and fail at once (ABORTED), and neither the
 * pipeline nor the mesh can be used again. */
MOE_API moe_status_t moe_pipeline_train_step(moe_pipeline_t *pipe, double *loss);

/* Timings of the most recent train_step on this rank, for measuring the bubble. */
typedef struct moe_pipeline_stats {
    size_t struct_size;
    double schedule_seconds; /* from the start of the schedule to the end of its last action */
    double compute_seconds;  /* inside forward, loss and backward callbacks */
    double wait_seconds;     /* blocked on receives and sends */
    int32_t stage, stages, microbatches;
    int32_t buffers; /* stage boundary tensors allocated so far (the pool only grows:
                                 its size is the peak number in use at once) */
} moe_pipeline_stats_t;

/* [out] stats (set struct_size first). */
MOE_API moe_status_t moe_pipeline_stats(const moe_pipeline_t *pipe, moe_pipeline_stats_t *stats);

#ifdef __cplusplus
}
#endif
#endif /* MOE_PIPELINE_H */
