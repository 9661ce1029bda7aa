/* A build without CUDA: the CUDA backend reports itself absent. */
#include "backend.h"

#include "core/error.h"

int moe_backend_cuda_device_count(void) { return -1; }

moe_status_t moe_backend_cuda_create(const moe_backend_params_t *p, moe_backend_t *out)
{
    (void)p;
    (void)out;
    return MOE_FAIL(MOE_STATUS_UNSUPPORTED, "libmoe was built without CUDA");
}
