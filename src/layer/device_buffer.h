/*
 * Buffers of the MoE layer's files: device buffers on the runtime's backend (a typed-out
 * alloc, and a free that clears the pointer so that every cleanup path may free whatever it
 * holds), and the free of the host tables the layer hands to communicators.
 *
 * After the mesh lost a peer (moe_runtime_poisoned), a buffer may still back a transfer that
 * never completed and that MPI may write into until the process ends: both frees then leak
 * it instead.
 */
#ifndef MOE_DEVICE_BUFFER_H
#define MOE_DEVICE_BUFFER_H

#include "runtime/runtime.h"

/* Allocate `bytes` on the backend's device into *(void **)out (0 bytes: NULL, success). */
moe_status_t moe_layer_alloc_dev(moe_runtime_t *rt, size_t bytes, void *out);
/* Free *(void **)pp if not NULL (leak it after a peer failure) and set it to NULL. */
void moe_layer_free_dev(moe_runtime_t *rt, void *pp);
/* free() a host table that was given to a communicator, or leak it after a peer failure. */
void moe_layer_free_comm_host(const moe_runtime_t *rt, void *p);

#endif /* MOE_DEVICE_BUFFER_H */
