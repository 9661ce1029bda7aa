# Checkpoint benchmark (bench/ckpt_bench.c). Include from bench/CMakeLists.txt:
#   include(${CMAKE_CURRENT_SOURCE_DIR}/ckpt.cmake)
add_executable(ckpt_bench ${CMAKE_CURRENT_LIST_DIR}/ckpt_bench.c)
target_link_libraries(ckpt_bench PRIVATE moe)
