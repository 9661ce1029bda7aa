# The Python package (python/libmoe) on the host backend, stdlib only: one CTest entry per
# test_*.py file, each loading this build's libmoe.so through MOE_LIBRARY, and the distributed
# layer under mpirun -np 4; test_elastic.py starts its own etcd (skipped without one). Label ffi
# (not mpi: the sanitizer pass cannot load an ASan libmoe into an unsanitized interpreter).
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  set(_moe_py_env MOE_LIBRARY=$<TARGET_FILE:moe> PYTHONPATH=${PROJECT_SOURCE_DIR}/python
      CC=${CMAKE_C_COMPILER} PYTHONDONTWRITEBYTECODE=1)
  file(GLOB _moe_py_tests ${CMAKE_CURRENT_LIST_DIR}/test_*.py)
  foreach(_file ${_moe_py_tests})
    get_filename_component(_name ${_file} NAME_WE)
    add_test(NAME python_${_name} COMMAND ${Python3_EXECUTABLE} ${_file})
    set_tests_properties(python_${_name} PROPERTIES LABELS ffi TIMEOUT 120
                         ENVIRONMENT "${_moe_py_env}")
  endforeach()
  if(MOE_HAVE_MPI)
    add_executable(moe_python3 IMPORTED)
    set_target_properties(moe_python3 PROPERTIES IMPORTED_LOCATION ${Python3_EXECUTABLE})
    moe_add_mpi_run(python_mpi_layer_np4 TARGET moe_python3 NP 4
                    ARGS ${CMAKE_CURRENT_LIST_DIR}/mpi_layer.py ENV ${_moe_py_env})
    set_tests_properties(python_mpi_layer_np4 PROPERTIES LABELS ffi TIMEOUT 120)
  endif()
endif()
