# Elastic training (docs/elastic.md): the mesh choice; the etcd client and a rank's membership
# against a real etcd on loopback (skipped without etcd-server); the straggler rule; the
# launcher's failure paths
# with a fake trainer; and the chaos trials of the
# trainer under moe_elastic (chaos_elastic.py: CI runs a few of each kind, the full counts are
# its defaults).
moe_add_test(test_elastic_mesh SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_elastic_mesh.c
             LABELS elastic TIMEOUT 30)
moe_add_test(test_elastic_etcd SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_elastic_etcd.c
             LABELS elastic TIMEOUT 120)
target_link_libraries(test_elastic_etcd PRIVATE moe_elastic_support)
moe_add_test(test_elastic_etcd_cluster SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_elastic_etcd_cluster.c
             LABELS elastic TIMEOUT 120)
target_link_libraries(test_elastic_etcd_cluster PRIVATE moe_elastic_support)
# the launcher's straggler rule on tables of busy times (tools/elastic/straggler.h)
moe_add_test(test_elastic_straggler SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_elastic_straggler.c
             LABELS elastic TIMEOUT 30)
target_link_libraries(test_elastic_straggler PRIVATE moe_elastic_support)
if(TARGET moe_train AND TARGET moe_elastic)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    # the launcher's paths for a hung rank, a rank's own failure and one that never joins
    add_executable(fake_rank ${CMAKE_CURRENT_LIST_DIR}/fake_rank.c)
    target_link_libraries(fake_rank PRIVATE moe)
    add_test(NAME test_elastic_launcher
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/launcher_paths.py
                     --launcher $<TARGET_FILE:moe_elastic> --fake $<TARGET_FILE:fake_rank>
                     --mpirun ${MPIEXEC_EXECUTABLE} --work ${CMAKE_CURRENT_BINARY_DIR}/elastic-paths)
    set_tests_properties(test_elastic_launcher PROPERTIES TIMEOUT 300 LABELS "elastic;chaos"
      SKIP_RETURN_CODE 77)
    # agents on three simulated hosts (simhost.py, sim_rsh.sh): a host, the leader's host and
    # an etcd member lost
    add_test(NAME test_elastic_hosts
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/hosts_trials.py
                     --launcher $<TARGET_FILE:moe_elastic> --fake $<TARGET_FILE:fake_rank>
                     --mpirun ${MPIEXEC_EXECUTABLE} --work ${CMAKE_CURRENT_BINARY_DIR}/elastic-hosts)
    set_tests_properties(test_elastic_hosts PROPERTIES TIMEOUT 300 LABELS "elastic;chaos"
      SKIP_RETURN_CODE 77)
    add_test(NAME test_elastic_chaos
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/chaos_elastic.py
                     --launcher $<TARGET_FILE:moe_elastic> --trainer $<TARGET_FILE:moe_train>
                     --mpirun ${MPIEXEC_EXECUTABLE} --config ${PROJECT_SOURCE_DIR}/tests/trainer/tiny.json
                     --work ${CMAKE_CURRENT_BINARY_DIR}/elastic-chaos
                     --kill 4 --stop 2 --double 1 --recovery 1 --restart 1 --seed 1)
    # a slow rank found and replaced by a spare at a checkpoint, warned about, and a healthy
    # run left alone (straggler_elastic.py)
    add_test(NAME test_elastic_straggler_trials
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/straggler_elastic.py
                     --launcher $<TARGET_FILE:moe_elastic> --trainer $<TARGET_FILE:moe_train>
                     --mpirun ${MPIEXEC_EXECUTABLE} --config ${PROJECT_SOURCE_DIR}/tests/trainer/tiny.json
                     --work ${CMAKE_CURRENT_BINARY_DIR}/elastic-straggler)
    set_tests_properties(test_elastic_straggler_trials PROPERTIES TIMEOUT 300
      LABELS "elastic;chaos" SKIP_RETURN_CODE 77)
    # not labelled mpi: the sanitizer pass (.ci/run) runs the elastic unit tests, and the
    # trials' timing (a stopped rank found within the TTL + 1.5 s) is left to the optimised build
    set_tests_properties(test_elastic_chaos PROPERTIES TIMEOUT 600 LABELS "elastic;chaos"
      SKIP_RETURN_CODE 77)
  endif()
endif()
