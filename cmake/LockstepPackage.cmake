# Debian packages of lockstep, made by `cpack -G DEB` in a build directory (docs/install.md):
#   liblockstep-dev  Architecture: all   the headers, the CMake package (every part this build
#                                        directory has: lockstep::cuda, ::mpi, ::torch), docs
#   lockstep-tools   this architecture   lockstep-run and lockstep-info (built first)
# Everything lockstep installs belongs to the component `dev` unless it says otherwise (the
# tools: `tools`). Checked by tests/packaging (packaging_deb): control fields, lintian, and the
# consumer project built against the packages' files unpacked into a throw-away root.

set(CPACK_PACKAGE_NAME lockstep)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "lockstep developers")
# The maintainer field Debian requires: say who builds your packages (-DCPACK_PACKAGE_CONTACT=...).
if(NOT CPACK_PACKAGE_CONTACT)
  set(CPACK_PACKAGE_CONTACT "lockstep developers <lockstep@example.org>")
endif()
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_GENERATOR DEB)
set(CPACK_COMPONENTS_ALL dev tools)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # name_version-release_arch.deb
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)      # the packaging's revision of upstream PROJECT_VERSION
set(CPACK_STRIP_FILES ON)                # the tools, as Debian installs binaries
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)

# Headers need a C++20 compiler and CMake for the package; the optional parts name what they
# need: NCCL and the CUDA toolkit (lockstep::cuda), MPI (lockstep::mpi), libtorch (::torch).
set(CPACK_DEBIAN_DEV_PACKAGE_NAME liblockstep-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_ARCHITECTURE all)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "g++ (>= 4:12) | clang (>= 1:14), cmake (>= 3.25)")
set(CPACK_DEBIAN_DEV_PACKAGE_RECOMMENDS "lockstep-tools")
set(CPACK_DEBIAN_DEV_PACKAGE_SUGGESTS
    "nvidia-cuda-toolkit, libnccl-dev, libopenmpi-dev | mpi-default-dev, libtorch-dev")
# (CPack puts CPACK_PACKAGE_DESCRIPTION_SUMMARY first, as both packages' synopsis.)
set(CPACK_DEBIAN_DEV_DESCRIPTION
    "lockstep is a header-only C++20/CUDA template library: one process driving\n\
every local GPU, or one process per GPU across machines, with gradient\n\
buckets overlapped with the backward pass, sharded optimizer state, mixed\n\
precision and a libtorch adapter. This package holds the headers and the\n\
CMake package: find_package(lockstep CONFIG COMPONENTS cuda mpi torch).")

# The tools: plain C++ (lockstep-run) and lockstep-info, which uses CUDA and NCCL when this
# build has them. Their shared libraries then come from the CUDA toolkit and NCCL, which
# dpkg-shlibdeps cannot map to Debian packages wherever they were not installed by dpkg; so
# the dependencies are named here: the C and C++ runtimes, and NCCL's as a recommendation.
set(CPACK_DEBIAN_TOOLS_PACKAGE_NAME lockstep-tools)
set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION devel)
set(CPACK_DEBIAN_TOOLS_PACKAGE_DEPENDS "libc6 (>= 2.34), libgcc-s1 (>= 3.0), libstdc++6 (>= 12)")
if(LOCKSTEP_HAS_CUDA)
  set(CPACK_DEBIAN_TOOLS_PACKAGE_RECOMMENDS "libnccl2")
  set(_lockstep_tools_gpu "\n.\nlockstep-info was built with CUDA ${CMAKE_CUDA_COMPILER_VERSION}; on GPUs it\n\
needs NCCL's and the CUDA runtime's shared libraries.")
else()
  set(_lockstep_tools_gpu "")
endif()
set(CPACK_DEBIAN_TOOLS_DESCRIPTION
    "The launcher and setup checker of lockstep. lockstep-run starts one\n\
process per GPU (a torchrun-style launch) and ends the job when a rank\n\
fails; lockstep-info checks a machine's GPUs, their links and NCCL, and\n\
estimates the speed-up of data parallelism.${_lockstep_tools_gpu}")
unset(_lockstep_tools_gpu)

# /usr/share/doc/<package>: the copyright statement Debian requires, a Debian changelog, and
# lintian's overrides with the reason for each (packaging/debian/). Only in the packages
# (EXCLUDE_FROM_ALL: cpack installs each component by name; a plain `cmake --install` skips them).
set(_lockstep_pkg_dir ${CMAKE_CURRENT_BINARY_DIR}/debian-package)
string(TIMESTAMP _lockstep_date "%a, %d %b %Y %H:%M:%S +0000" UTC)
foreach(_component dev tools)
  string(TOUPPER ${_component} _upper)
  set(_package ${CPACK_DEBIAN_${_upper}_PACKAGE_NAME})
  file(MAKE_DIRECTORY ${_lockstep_pkg_dir}/${_package})
  file(WRITE ${_lockstep_pkg_dir}/${_package}/changelog.Debian
       "${_package} (${PROJECT_VERSION}-${CPACK_DEBIAN_PACKAGE_RELEASE}) unstable; urgency=medium\n\n"
       "  * lockstep ${PROJECT_VERSION}; see /usr/share/doc/liblockstep-dev/changelog.gz.\n\n"
       " -- ${CPACK_PACKAGE_CONTACT}  ${_lockstep_date}\n")
  file(ARCHIVE_CREATE OUTPUT ${_lockstep_pkg_dir}/${_package}/changelog.Debian.gz
       PATHS ${_lockstep_pkg_dir}/${_package}/changelog.Debian FORMAT raw COMPRESSION GZip
       COMPRESSION_LEVEL 9)
  install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/packaging/debian/copyright
                ${_lockstep_pkg_dir}/${_package}/changelog.Debian.gz
          DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/${_package} COMPONENT ${_component} EXCLUDE_FROM_ALL)
  install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/packaging/debian/${_package}.lintian-overrides
          DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/lintian/overrides RENAME ${_package}
          COMPONENT ${_component} EXCLUDE_FROM_ALL)
endforeach()
# The upstream changelog under Debian's name for it.
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/CHANGELOG.md ${_lockstep_pkg_dir}/changelog COPYONLY)
file(ARCHIVE_CREATE OUTPUT ${_lockstep_pkg_dir}/changelog.gz PATHS ${_lockstep_pkg_dir}/changelog
     FORMAT raw COMPRESSION GZip COMPRESSION_LEVEL 9)
install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/README.md ${_lockstep_pkg_dir}/changelog.gz
        DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/liblockstep-dev COMPONENT dev EXCLUDE_FROM_ALL)
unset(_lockstep_pkg_dir)
unset(_lockstep_date)
unset(_component)
unset(_upper)
unset(_package)

include(CPack)
