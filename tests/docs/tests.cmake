# The README's and docs' shell commands, extracted from the Markdown and run as printed in a
# fresh clone (run_doc_commands.py; a command block needs a docs-run or docs-skip marker).
# It builds the clone with scripts/example.sh and trains for a few minutes: RUN_SERIAL, so its
# ranks do not take the cores from the timing bounds of other tests (the chaos trials).
find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND AND MOE_HAVE_MPI)
  add_test(NAME test_docs_commands
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/run_doc_commands.py
                   --src ${PROJECT_SOURCE_DIR} --work ${CMAKE_CURRENT_BINARY_DIR}/docs-commands)
  set_tests_properties(test_docs_commands PROPERTIES LABELS docs TIMEOUT 1800 RUN_SERIAL TRUE)
endif()
