/*
 * Device buffers of the MoE layer's files, on the runtime's backend: a typed-out alloc, and
 * a free that clears the pointer so that every cleanup path may free whatever it holds.
 */
#ifndef MOE_DEVICE_BUFFER_H
#define MOE_DEVICE_BUFFER_H

#include "../runtime/runtime.h"

/* Allocate `bytes` on the backend's device into *(void **)out (0 bytes: NULL, success). */
moe_status_t moe_layer_alloc_dev(moe_runtime_t *rt, size_t bytes, void *out);
/* Free *(void **)pp if not NULL and set it to NULL. */
void moe_layer_free_dev(moe_runtime_t *rt, void *pp);

#endif /* MOE_DEVICE_BUFFER_H */
