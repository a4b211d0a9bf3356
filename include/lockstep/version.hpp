#pragma once
//! lockstep's version, also written into checkpoints and compared across ranks.

#define LOCKSTEP_VERSION_MAJOR 0
#define LOCKSTEP_VERSION_MINOR 1
#define LOCKSTEP_VERSION_PATCH 0
#define LOCKSTEP_VERSION_STRING "0.1.0"

namespace lockstep {
inline constexpr int version_major = LOCKSTEP_VERSION_MAJOR;
inline constexpr int version_minor = LOCKSTEP_VERSION_MINOR;
inline constexpr int version_patch = LOCKSTEP_VERSION_PATCH;
inline constexpr const char* version_string = LOCKSTEP_VERSION_STRING;
}  // namespace lockstep
