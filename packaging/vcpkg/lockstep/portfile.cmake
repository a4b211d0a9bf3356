# vcpkg overlay port of lockstep, kept in lockstep's own tree (docs/install.md):
#   vcpkg install lockstep[mpi] --overlay-ports=<lockstep>/packaging/vcpkg
# The source is the tree this port lives in. The package is lockstep's own `cmake --install`
# (headers and CMake package), its config moved to share/lockstep as vcpkg lays packages out;
# use it with find_package(lockstep CONFIG REQUIRED COMPONENTS ...).
set(VCPKG_BUILD_TYPE release)  # headers only: no debug variant
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    cuda  LOCKSTEP_ENABLE_CUDA
    mpi   LOCKSTEP_ENABLE_MPI
    torch LOCKSTEP_ENABLE_TORCH)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    -DLOCKSTEP_INSTALL=ON
    -DLOCKSTEP_BUILD_TESTS=OFF
    -DLOCKSTEP_BUILD_EXAMPLES=OFF
    -DLOCKSTEP_BUILD_BENCH=OFF
    -DLOCKSTEP_BUILD_TOOLS=OFF)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH lib/cmake/lockstep)
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/lib")  # empty once the config moved: headers only

vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/packaging/debian/copyright")
