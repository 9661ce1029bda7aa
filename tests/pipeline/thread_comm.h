/*
 * An in-process communicator for pipeline tests without MPI: the "ranks" are threads of one
 * process sharing a tc_world. Point-to-point follows MPI's rules (a send completes only when
 * a receive with the same source, tag and destination takes it; matching is in posting order),
 * so an executor that reuses a send buffer too early is caught. (Or, with
 * tc_world_create_ordered, NCCL-like in-order matching.) Collectives (allreduce,
 * broadcast, barrier) are blocking rendezvous. Waits honour the communicator's timeout_ms.
 * abort() makes only this rank's communicator unusable; its peers time out, as with MPI.
 */
#ifndef MOE_TEST_THREAD_COMM_H
#define MOE_TEST_THREAD_COMM_H

#include "comm/comm.h"
#include "runtime/runtime.h"

typedef struct tc_world tc_world_t;

tc_world_t *tc_world_create(int size);
/* NCCL-like point-to-point: no tags, and each rank's operations run strictly in call order,
 * a send completing only together with the receive at the head of its peer's queue (the
 * strictest reading of one in-order stream: a send never completes on its own). */
tc_world_t *tc_world_create_ordered(int size);
void tc_world_destroy(tc_world_t *w);
/* A communicator for `rank` of the world, named `name` (e.g. "pp"). */
moe_comm_t *tc_comm_create(tc_world_t *w, int rank, const char *name, int timeout_ms);

/* Make `rt` (a runtime created without a mesh) look like pp stage `stage` of a pipeline of
 * `stages`, with `pp` as its pp communicator and `world` as its world communicator. */
void tc_attach_pipeline(moe_runtime_t *rt, int stage, int stages, moe_comm_t *pp,
                        moe_comm_t *world);
/* Undo tc_attach_pipeline and destroy the two communicators. */
void tc_detach_pipeline(moe_runtime_t *rt);

#endif
