# install(): the shared and static libraries, the public headers, a CMake package
# (find_package(libmoe) -> libmoe::moe, and libmoe::moe_static with its dependencies) and a
# pkg-config files (pkg-config --cflags --libs libmoe; pkg-config --static --cflags --libs
# libmoe-static: the static library and its private dependencies). The trainer (moe_train) and
# the elastic launcher (moe_elastic) install as tools in bin/ (examples/, tools/).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS moe EXPORT libmoeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/moe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT libmoeTargets NAMESPACE libmoe:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libmoe)

# The static library has an export set of its own: its consumers link libmoe's private
# dependencies too, so libmoeConfig.cmake loads it only once it has found them.
set(_moe_static_targets moe_static)
if(TARGET moe_nccl)
  list(APPEND _moe_static_targets moe_nccl)
endif()
install(TARGETS ${_moe_static_targets} EXPORT libmoeStaticTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT libmoeStaticTargets NAMESPACE libmoe::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/libmoe)

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
# What a static link needs beyond the Requires.private modules (pkg-config --static).
set(MOE_PC_LIBS_PRIVATE)
if(MOE_HAVE_MPI)
  foreach(_lib ${MPI_C_LIBRARIES})
    list(APPEND MOE_PC_LIBS_PRIVATE "${_lib}")
  endforeach()
endif()
if(MOE_HAVE_CUDA)
  list(APPEND MOE_PC_LIBS_PRIVATE "-L${CUDAToolkit_LIBRARY_DIR}" -lcublasLt -lcublas -lcudart)
endif()
if(MOE_HAVE_NCCL)
  list(APPEND MOE_PC_LIBS_PRIVATE "${MOE_NCCL_LIBRARY}")
endif()
if(MOE_HAVE_CUDA)
  list(APPEND MOE_PC_LIBS_PRIVATE -lstdc++) # the CUDA objects' C++ runtime
endif()
list(APPEND MOE_PC_LIBS_PRIVATE -lpthread -lm)
list(JOIN MOE_PC_LIBS_PRIVATE " " MOE_PC_LIBS_PRIVATE)
# libmoe.pc links the shared library (-lmoe, which the linker prefers to libmoe.a when both are
# installed); libmoe-static.pc names the archive itself, so `pkg-config --static libmoe-static`
# links it statically beside an installed libmoe.so.
set(MOE_PC_NAME libmoe)
set(MOE_PC_LIBS "-L\${libdir} -lmoe")
configure_file(cmake/libmoe.pc.in ${CMAKE_CURRENT_BINARY_DIR}/libmoe.pc @ONLY)
set(MOE_PC_NAME libmoe-static)
set(MOE_PC_LIBS "\${libdir}/libmoe.a")
configure_file(cmake/libmoe.pc.in ${CMAKE_CURRENT_BINARY_DIR}/libmoe-static.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/libmoe.pc ${CMAKE_CURRENT_BINARY_DIR}/libmoe-static.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
