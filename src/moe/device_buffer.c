/* Device buffers of the MoE layer (see device_buffer.h). */
#include "device_buffer.h"

moe_status_t moe_layer_alloc_dev(moe_runtime_t *rt, size_t bytes, void *out)
{
    return MOE_OPS(rt)->alloc(MOE_CTX(rt), bytes, (void **)out);
}

void moe_layer_free_dev(moe_runtime_t *rt, void *pp)
{
    void **p = pp;
    if (*p) MOE_OPS(rt)->free(MOE_CTX(rt), *p);
    *p = NULL;
}
