# CUDA kernels (one file per op family); included by the top-level CMakeLists when CUDA is on.
list(APPEND MOE_CUDA_SOURCES kernels/router.cu kernels/dispatch.cu kernels/swiglu.cu
     kernels/elementwise.cu)
