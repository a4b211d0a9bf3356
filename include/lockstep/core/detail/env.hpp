#pragma once
//! The environment variables lockstep reads (LOCKSTEP_TIMEOUT, LOCKSTEP_DEBUG, ...): a
//! malformed value is a config_error naming the variable.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>

#include "lockstep/core/error.hpp"

namespace lockstep::detail {

inline std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

//! Parses a positive integer variable; a malformed value is an error naming it.
inline std::optional<long> env_long(const char* name) {
  auto v = env(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  long x = std::strtol(v->c_str(), &end, 10);
  if (end == v->c_str() || *end != '\0')
    throw config_error(std::string("environment variable ") + name + "='" + *v + "' is not an integer");
  return x;
}

//! An integer variable from lo to hi; a malformed or out-of-range value is an error naming it,
//! the range and `unit` (what the number counts, and what it is for).
inline std::optional<long> env_between(const char* name, long lo, long hi, const std::string& unit) {
  auto v = env(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const long x = std::strtol(v->c_str(), &end, 10);
  if (end == v->c_str() || *end != '\0' || x < lo || x > hi)
    throw config_error(std::string(name) + "='" + *v + "' is not a whole number of " + unit + " from " +
                       std::to_string(lo) + " to " + std::to_string(hi));
  return x;
}

//! How long any wait on another rank may take: LOCKSTEP_TIMEOUT seconds, default 60.
inline std::chrono::milliseconds default_timeout() {
  auto v = env("LOCKSTEP_TIMEOUT");
  if (!v) return std::chrono::seconds(60);
  char* end = nullptr;
  double s = std::strtod(v->c_str(), &end);
  if (end == v->c_str() || *end != '\0' || !(s > 0))
    throw config_error("LOCKSTEP_TIMEOUT='" + *v + "' is not a positive number of seconds (e.g. LOCKSTEP_TIMEOUT=120)");
  return std::chrono::milliseconds(static_cast<long long>(s * 1000.0));
}

//! LOCKSTEP_ABORT_GRACE (seconds, default 2; what is not a number from 0 to 3600 counts as
//! 0 or 3600): how long a rank that failed or saw a failure may take to end — MPI ranks wait
//! that long before MPI_Abort, and a process's teardown after a failure is cut off after it
//! (at least 1 s there: launch/detail/teardown_deadline.hpp).
inline std::chrono::milliseconds abort_grace() {
  double seconds = 2.0;
  if (auto g = env("LOCKSTEP_ABORT_GRACE")) {
    seconds = std::strtod(g->c_str(), nullptr);
    seconds = seconds >= 0.0 ? std::min(seconds, 3600.0) : 0.0;  // NaN: 0
  }
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
}

}  // namespace lockstep::detail
