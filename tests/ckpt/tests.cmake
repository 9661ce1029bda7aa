# Checkpointer tests (host backend). The S3 tests start s3rver from tests/ckpt/s3/ (installed by
# scripts/setup-deps.sh --tests) behind tests/ckpt/s3/sigv4_front.py (Python with botocore), which
# verifies every request's signature, and skip their S3 parts (test_ckpt_s3: exit 77) when
# node, s3rver or botocore is missing.
set(_ckpt_dir ${CMAKE_CURRENT_SOURCE_DIR}/ckpt)
moe_add_test(test_ckpt_sigv4 SOURCES ${_ckpt_dir}/test_ckpt_sigv4.c LABELS ckpt TIMEOUT 60)
moe_add_test(test_ckpt_local SOURCES ${_ckpt_dir}/test_ckpt_local.c LABELS ckpt TIMEOUT 120)
target_compile_definitions(test_ckpt_local PRIVATE
  MOE_CKPT_HEADER="${PROJECT_SOURCE_DIR}/include/moe/ckpt.h")
moe_add_test(test_ckpt_damage SOURCES ${_ckpt_dir}/test_ckpt_damage.c LABELS ckpt TIMEOUT 120)
moe_add_test(test_ckpt_resume SOURCES ${_ckpt_dir}/test_ckpt_resume.c LABELS ckpt TIMEOUT 60)
moe_add_test(test_train_state SOURCES ${_ckpt_dir}/test_train_state.c LABELS ckpt TIMEOUT 60)
# The expert-bias variant: a loaded bias must survive the next forward (regression test).
add_test(NAME test_ckpt_resume_keeps_expert_bias COMMAND test_ckpt_resume bias)
set_tests_properties(test_ckpt_resume_keeps_expert_bias PROPERTIES LABELS ckpt TIMEOUT 60)
moe_add_test(test_ckpt_cuda SOURCES ${_ckpt_dir}/test_ckpt_cuda.c LABELS ckpt cuda TIMEOUT 120)
moe_add_test(test_ckpt_crash SOURCES ${_ckpt_dir}/test_ckpt_crash.c ${_ckpt_dir}/s3_fixture.c
             LABELS ckpt TIMEOUT 240)
moe_add_test(test_ckpt_s3 SOURCES ${_ckpt_dir}/test_ckpt_s3.c ${_ckpt_dir}/s3_fixture.c
             LABELS ckpt TIMEOUT 240)
# The mirror through an S3 outage of MOE_TEST_S3_OUTAGE_S seconds (default 12).
moe_add_test(test_ckpt_mirror SOURCES ${_ckpt_dir}/test_ckpt_mirror.c ${_ckpt_dir}/s3_fixture.c
             LABELS ckpt TIMEOUT 300)
foreach(_np 4 8)
  moe_add_test(test_ckpt_mpi_np${_np} SOURCES ${_ckpt_dir}/test_ckpt_mpi.c
               ${_ckpt_dir}/s3_fixture.c NP ${_np} LABELS ckpt mpi TIMEOUT 180)
  if(TARGET test_ckpt_mpi_np${_np})
    target_link_libraries(test_ckpt_mpi_np${_np} PRIVATE MPI::MPI_C)
  endif()
endforeach()
foreach(_t test_ckpt_crash test_ckpt_s3 test_ckpt_mirror test_ckpt_mpi_np4 test_ckpt_mpi_np8)
  if(TARGET ${_t})
    target_compile_definitions(${_t} PRIVATE
      MOE_S3RVER_JS="${CMAKE_CURRENT_SOURCE_DIR}/ckpt/s3/node_modules/s3rver/bin/s3rver.js"
      MOE_S3_FRONT_PY="${CMAKE_CURRENT_SOURCE_DIR}/ckpt/s3/sigv4_front.py")
  endif()
endforeach()
