# The public ABI against the committed baseline tests/abi/libmoe.abi (check_abi.sh; the rules
# are in docs/api-stability.md), and the check's own test on a small library built in
# compatible and incompatible versions. Both skip (77) without abigail-tools.
# `cmake --build <build> --target abi-baseline` re-records the baseline (a new SONAME).
set(_moe_abi_args $<TARGET_FILE:moe> ${PROJECT_SOURCE_DIR}/include/moe
    ${CMAKE_CURRENT_LIST_DIR}/libmoe.abi)
add_test(NAME test_abi COMMAND ${CMAKE_CURRENT_LIST_DIR}/check_abi.sh ${_moe_abi_args})
add_test(NAME test_abi_checker
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/check_abi_selftest.sh ${CMAKE_C_COMPILER})
set_tests_properties(test_abi test_abi_checker PROPERTIES LABELS abi SKIP_RETURN_CODE 77
                     TIMEOUT 120)
add_custom_target(abi-baseline COMMAND ${CMAKE_CURRENT_LIST_DIR}/check_abi.sh ${_moe_abi_args}
                  --update DEPENDS moe VERBATIM)
