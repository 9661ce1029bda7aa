/* Internal tensor helpers: validation with messages that name the tensor and the numbers. */
#ifndef MOE_CORE_TENSOR_H
#define MOE_CORE_TENSOR_H

#include <stdint.h>

#include <moe/core.h>

/* The most elements a tensor may have: its bytes (at most 8 an element) fit an int64_t. Views
 * and descriptors with more are refused; allocations sized from shapes stay within it. */
#define MOE_TENSOR_MAX_ELEMENTS (INT64_MAX / 8)

/* Check a caller's tensor: non-NULL, data non-NULL unless empty, the dtype, the device,
 * ndim, and each expected extent (-1 in `shape` accepts any extent). */
moe_status_t moe_tensor_check(const moe_tensor_t *t, const char *what, moe_dtype_t dtype,
                              moe_device_kind_t device, int32_t ndim, const int64_t *shape);
/* Bytes covered by a valid descriptor. */
size_t moe_tensor_bytes(const moe_tensor_t *t);

#endif /* MOE_CORE_TENSOR_H */
