# The tree's own checks: the module table of docs/architecture.md against the code and its
# includes, tests/ against src/ (a test folder per module), and no development diary in docs,
# comments or results.
add_test(NAME test_house_tree
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/check_tree.py ${CMAKE_SOURCE_DIR})
set_tests_properties(test_house_tree PROPERTIES LABELS house TIMEOUT 60)
# The environment-variable table of src/core/env.h against the code and docs/environment.md.
add_test(NAME test_house_env
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/check_env.py ${CMAKE_SOURCE_DIR})
set_tests_properties(test_house_env PROPERTIES LABELS house TIMEOUT 60)
# Every C and CUDA file formatted as .clang-format says (skipped without clang-format 14).
add_test(NAME test_house_format
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/check_format.py ${CMAKE_SOURCE_DIR})
set_tests_properties(test_house_format PROPERTIES LABELS house TIMEOUT 120 SKIP_RETURN_CODE 77)
