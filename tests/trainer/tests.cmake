# The bundled trainer (examples/trainer/): its model against finite differences, and the
# trainer run under mpirun by run_trainer.py: equivalence over meshes, resume, flags and a
# short training run. Needs MPI (the trainer is built only with it).
if(TARGET moe_trainer_core)
  set(_trainer_dir ${CMAKE_CURRENT_LIST_DIR})
  moe_add_test(test_trainer_grad SOURCES ${_trainer_dir}/test_trainer_grad.c LABELS trainer
               TIMEOUT 60)
  target_link_libraries(test_trainer_grad PRIVATE moe_trainer_core)
  if(MOE_HAVE_CUDA) # the CUDA model against the host one; skips (77) without a GPU
    moe_add_test(test_trainer_cuda SOURCES ${_trainer_dir}/test_trainer_cuda.c LABELS trainer cuda gpu
                 TIMEOUT 120)
    target_link_libraries(test_trainer_cuda PRIVATE moe_trainer_core)
    # the fused attention kernels against the host attention
    moe_add_test(test_attention_cuda SOURCES ${_trainer_dir}/test_attention_cuda.c
                 LABELS trainer cuda gpu TIMEOUT 60)
    target_link_libraries(test_attention_cuda PRIVATE moe_trainer_core)
  endif()
  add_executable(compare_checkpoints ${_trainer_dir}/compare_checkpoints.c)
  target_link_libraries(compare_checkpoints PRIVATE moe_trainer_core moe_static)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_FOUND)
    # equivalence over meshes, resume, flags: the tiny config; train: the example's config,
    # 250 of the 300 steps of scripts/example.sh; widths: the defaults at H 64..1024; plan:
    # the memory plan against a run's peak. Labels: the mpi ones also run in CI's
    # sanitizer pass; the training run is left to the optimised build.
    foreach(_mode equivalence resume flags train widths plan)
      add_test(NAME test_trainer_${_mode}
               COMMAND ${Python3_EXECUTABLE} ${_trainer_dir}/run_trainer.py ${_mode}
                       --mpirun ${MPIEXEC_EXECUTABLE} --trainer $<TARGET_FILE:moe_train>
                       --compare $<TARGET_FILE:compare_checkpoints>
                       --config ${_trainer_dir}/tiny.json
                       --example-config ${PROJECT_SOURCE_DIR}/examples/trainer/example.json
                       --steps 250 --work ${CMAKE_CURRENT_BINARY_DIR}/trainer-${_mode})
      set(_labels trainer mpi)
      # training runs and the memory plan (peak RSS, which the sanitizers inflate) are left
      # to the optimised build
      if(_mode MATCHES "^(train|widths|plan)$")
        set(_labels trainer example)
      endif()
      set_tests_properties(test_trainer_${_mode} PROPERTIES LABELS "${_labels}" TIMEOUT 600
        ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;OMPI_MCA_orte_tmpdir_base=${CMAKE_BINARY_DIR}/mpi-session/test_trainer_${_mode}")
    endforeach()
  endif()
endif()
