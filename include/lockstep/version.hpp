#pragma once
//! lockstep's version, also written into checkpoints and compared across ranks. Written here
//! only: CMake reads these three numbers for the project, its package version file and the
//! Debian packages (CMakeLists.txt), and `lockstep-info --version` prints them.

#define LOCKSTEP_VERSION_MAJOR 0
#define LOCKSTEP_VERSION_MINOR 2
#define LOCKSTEP_VERSION_PATCH 0

#define LOCKSTEP_DETAIL_VERSION_TEXT(x) #x
#define LOCKSTEP_DETAIL_VERSION_EXPAND(x) LOCKSTEP_DETAIL_VERSION_TEXT(x)
//! "0.2.0"
#define LOCKSTEP_VERSION_STRING                          \
  LOCKSTEP_DETAIL_VERSION_EXPAND(LOCKSTEP_VERSION_MAJOR) \
  "." LOCKSTEP_DETAIL_VERSION_EXPAND(LOCKSTEP_VERSION_MINOR) "." LOCKSTEP_DETAIL_VERSION_EXPAND(LOCKSTEP_VERSION_PATCH)

namespace lockstep {
inline constexpr int version_major = LOCKSTEP_VERSION_MAJOR;
inline constexpr int version_minor = LOCKSTEP_VERSION_MINOR;
inline constexpr int version_patch = LOCKSTEP_VERSION_PATCH;
inline constexpr const char* version_string = LOCKSTEP_VERSION_STRING;
}  // namespace lockstep
