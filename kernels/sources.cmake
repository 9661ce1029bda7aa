# CUDA kernels (one file per op family); included by the top-level CMakeLists when CUDA is on.
list(APPEND MOE_CUDA_SOURCES kernels/router_select.cu kernels/router_fused.cu
     kernels/router_backward.cu kernels/dispatch.cu kernels/swiglu.cu kernels/elementwise.cu
     kernels/adamw.cu kernels/pointer_upload.cu)
# Hopper-only (sm_90a), built as their own object library (see CMakeLists.txt).
list(APPEND MOE_CUDA_SM90A_SOURCES kernels/expert_gemm_sm90.cu)
