# install(): the shared and static libraries, the public headers, a CMake package
# (find_package(libmoe) -> libmoe::moe) and a pkg-config file (pkg-config --cflags --libs libmoe).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS moe EXPORT libmoeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS moe_static ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY include/moe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT libmoeTargets NAMESPACE libmoe:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libmoe)

configure_package_config_file(cmake/libmoeConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/libmoeConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libmoe)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/libmoeConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/libmoeConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/libmoeConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libmoe)

# The .pc file finds its prefix relative to itself: one "/.." per level of
# ${CMAKE_INSTALL_LIBDIR}/pkgconfig.
string(REGEX MATCHALL "[^/]+" _moe_libdir_parts "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
set(MOE_PC_PREFIX "\${pcfiledir}")
foreach(_part ${_moe_libdir_parts})
  string(APPEND MOE_PC_PREFIX "/..")
endforeach()
configure_file(cmake/libmoe.pc.in ${CMAKE_CURRENT_BINARY_DIR}/libmoe.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/libmoe.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
