add_test(NAME test_install_consumer
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/check_install.sh ${CMAKE_BINARY_DIR} ${CMAKE_SOURCE_DIR})
set_tests_properties(test_install_consumer PROPERTIES LABELS install TIMEOUT 300)
