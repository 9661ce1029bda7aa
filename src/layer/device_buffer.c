/* Buffers of the MoE layer (see device_buffer.h). */
#include "device_buffer.h"

#include <stdlib.h>

moe_status_t moe_layer_alloc_dev(moe_runtime_t *rt, size_t bytes, void *out)
{
    return MOE_OPS(rt)->alloc(MOE_CTX(rt), bytes, (void **)out);
}

void moe_layer_free_dev(moe_runtime_t *rt, void *pp)
{
    void **p = pp;
    if (*p && !moe_runtime_poisoned(rt)) MOE_OPS(rt)->free(MOE_CTX(rt), *p);
    *p = NULL;
}

void moe_layer_free_comm_host(const moe_runtime_t *rt, void *p)
{
    if (!moe_runtime_poisoned(rt)) free(p);
}
