/* The CUDA and cuBLAS headers with the check family (MOE_CUDA_CHECK, MOE_CUBLAS_CHECK are in
 * core/error.h). */
#ifndef MOE_CUDA_CHECK_H
#define MOE_CUDA_CHECK_H

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/error.h"

#endif /* MOE_CUDA_CHECK_H */
