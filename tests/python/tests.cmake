find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME test_ffi_python COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/test_ffi.py
           $<TARGET_FILE:moe>)
  set_tests_properties(test_ffi_python PROPERTIES LABELS ffi)
endif()
