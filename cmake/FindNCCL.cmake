# FindNCCL — locates NVIDIA's NCCL (nccl.h + libnccl).
#
# Works with NCCL shipped inside a CUDA toolkit (/usr/local/cuda/{include,lib64}) and with the
# distribution packages (libnccl-dev: /usr/include, /usr/lib/<multiarch>).
#
# Hints (searched first, in this order): NCCL_ROOT (CMake or environment variable), NCCL_HOME,
# then the CUDA toolkit's directories (CUDAToolkit_INCLUDE_DIRS / CUDAToolkit_LIBRARY_DIR when
# find_package(CUDAToolkit) ran first), /usr/local/cuda, then the system directories.
# The library is looked for next to the header found first, so a header and a library from two
# different NCCL installations are never paired.
#
# Result variables:
#   NCCL_FOUND, NCCL_INCLUDE_DIRS, NCCL_LIBRARIES, NCCL_VERSION (major.minor.patch),
#   NCCL_VERSION_MAJOR, NCCL_VERSION_MINOR, NCCL_VERSION_PATCH
# Cache variables: NCCL_INCLUDE_DIR, NCCL_LIBRARY
# Imported target: NCCL::NCCL
#
# Usage: find_package(NCCL 2.18 REQUIRED) — honours REQUIRED, QUIET, version and EXACT.

include(FindPackageHandleStandardArgs)

set(_nccl_roots)
foreach(_r IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${NCCL_HOME}" "$ENV{NCCL_HOME}")
  if(_r)
    list(APPEND _nccl_roots "${_r}")
  endif()
endforeach()

# --- header ---------------------------------------------------------------------------------
if(_nccl_roots)
  find_path(NCCL_INCLUDE_DIR nccl.h
    HINTS ${_nccl_roots}
    PATH_SUFFIXES include
    NO_DEFAULT_PATH)
endif()
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include
  PATHS /usr/include /usr/local/include
  DOC "Directory holding nccl.h")

# --- library: first next to the header, then anywhere ----------------------------------------
# libnccl.so.2: NCCL from pip (nvidia-nccl-cu*) ships no unversioned libnccl.so.
set(_nccl_names nccl nccl_static libnccl.so.2)
if(NCCL_INCLUDE_DIR)
  get_filename_component(_nccl_prefix "${NCCL_INCLUDE_DIR}" DIRECTORY)
  set(_nccl_lib_suffixes lib64 lib lib/x86_64-linux-gnu lib/aarch64-linux-gnu lib/sbsa-linux-gnu)
  if(CMAKE_LIBRARY_ARCHITECTURE)
    list(PREPEND _nccl_lib_suffixes lib/${CMAKE_LIBRARY_ARCHITECTURE})
  endif()
  find_library(NCCL_LIBRARY NAMES ${_nccl_names}
    HINTS "${_nccl_prefix}"
    PATH_SUFFIXES ${_nccl_lib_suffixes}
    NO_DEFAULT_PATH)
endif()
if(_nccl_roots)
  find_library(NCCL_LIBRARY NAMES ${_nccl_names}
    HINTS ${_nccl_roots}
    PATH_SUFFIXES lib64 lib
    NO_DEFAULT_PATH)
endif()
find_library(NCCL_LIBRARY NAMES ${_nccl_names}
  HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64 /usr/local/cuda/lib
  PATHS /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib
  DOC "The NCCL library (libnccl)")

# --- version from nccl.h ---------------------------------------------------------------------
unset(NCCL_VERSION)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define[ \t]+NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    set(NCCL_VERSION_${_part} "")
    foreach(_line IN LISTS _nccl_version_lines)
      if(_line MATCHES "^#define[ \t]+NCCL_${_part}[ \t]+([0-9]+)")
        set(NCCL_VERSION_${_part} "${CMAKE_MATCH_1}")
      endif()
    endforeach()
  endforeach()
  if(NOT NCCL_VERSION_MAJOR STREQUAL "" AND NOT NCCL_VERSION_MINOR STREQUAL ""
     AND NOT NCCL_VERSION_PATCH STREQUAL "")
    set(NCCL_VERSION "${NCCL_VERSION_MAJOR}.${NCCL_VERSION_MINOR}.${NCCL_VERSION_PATCH}")
  endif()
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION
  REASON_FAILURE_MESSAGE
    "Install NCCL (Debian/Ubuntu: libnccl-dev, or the NCCL of the CUDA toolkit) or point NCCL_ROOT at it.")

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  set(NCCL_LIBRARIES "${NCCL_LIBRARY}")
  if(NOT TARGET NCCL::NCCL)
    add_library(NCCL::NCCL UNKNOWN IMPORTED)
    set_target_properties(NCCL::NCCL PROPERTIES
      IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()

mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_nccl_roots)
unset(_nccl_names)
unset(_nccl_prefix)
unset(_nccl_lib_suffixes)
unset(_nccl_version_lines)
