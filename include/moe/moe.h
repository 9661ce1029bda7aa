/*
 * libmoe — a native runtime for training sparse Mixture-of-Experts models.
 *
 * A short tour:
 *   moe_runtime_create()      picks a backend (host reference or CUDA) and, with a mesh
 *                             config, joins the 4D process mesh (tp x ep x dp x pp).
 *   moe_layer_create()        a router + SwiGLU experts; forward/backward per microbatch slot.
 *   moe_adamw_create()        fp32-master AdamW over layer and user parameters, with the
 *                             data-parallel gradient all-reduce (moe/optim.h).
 *   moe_pipeline_*            the 1F1B schedule (plain or interleaved) and its executor over
 *                             the pp axis (moe/pipeline.h).
 *   moe_ckpt_*                asynchronous tiered checkpoints: pinned snapshot, O_DIRECT
 *                             NVMe writes through io_uring, S3 mirror; reshardable on load
 *                             (moe/ckpt.h).
 *   moe_train_state_*         a run's whole state (layers, optimizers, user tensors) saved
 *                             and loaded in one call (moe/train_state.h).
 *
 * Every call returns moe_status_t; moe_last_error() says what went wrong on this thread.
 * See each header for ownership, collectivity and streams.
 */
#ifndef MOE_MOE_H
#define MOE_MOE_H

#include "core.h"
#include "elastic.h"
#include "ckpt.h"
#include "train_state.h"
#include "layer.h"
#include "mesh.h"
#include "optim.h"
#include "pipeline.h"

#endif /* MOE_MOE_H */
