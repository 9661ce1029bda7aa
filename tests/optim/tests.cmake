# The optimizer (src/optim/): AdamW and its controls on one rank, and the gradient reduction
# over the data-parallel groups.
moe_add_test(test_training SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_training.c LABELS moe)
target_link_libraries(test_training PRIVATE moe_test_ref)
moe_add_test(test_optim_controls SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_optim_controls.c LABELS moe)
# Gradient reduction started during the backward equals the one the step makes.
moe_add_test(test_grad_sync SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_grad_sync.c NP 4 TIMEOUT 120
             LABELS moe mesh mpi)
if(TARGET test_grad_sync)
  target_link_libraries(test_grad_sync PRIVATE MPI::MPI_C)
endif()
