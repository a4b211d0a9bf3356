#pragma once
//! lockstep::detect() — what this process can run on, and decide() — which mode Auto picks.
//! Adding a mode (GPUs, launcher-started processes) means adding a field here and a case
//! in decide() and in run(Auto).

#include <optional>
#include <string>
#include <thread>

#include "lockstep/detail/env.hpp"
#include "lockstep/error.hpp"

namespace lockstep {

struct environment {
  int hardware_threads = 1;            //!< std::thread::hardware_concurrency (≥ 1)
  std::optional<int> cpu_ranks;        //!< LOCKSTEP_CPU_RANKS, when set
};

inline environment detect() {
  environment e;
  e.hardware_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (auto n = detail::env_long("LOCKSTEP_CPU_RANKS")) {
    if (*n < 1 || *n > 4096)
      throw config_error("LOCKSTEP_CPU_RANKS=" + std::to_string(*n) +
                         " is out of range: give a number of CPU ranks from 1 to 4096");
    e.cpu_ranks = static_cast<int>(*n);
  }
  return e;
}

enum class mode_kind { cpu_threads };

inline const char* name_of(mode_kind k) {
  switch (k) {
    case mode_kind::cpu_threads: return "cpu-threads";
  }
  return "?";
}

//! The mode Auto runs, with the number of ranks and a one-line reason for logs.
struct plan {
  mode_kind kind = mode_kind::cpu_threads;
  int ranks = 1;
  std::string reason;
};

inline plan decide(const environment& e) {
  if (e.cpu_ranks)
    return {mode_kind::cpu_threads, *e.cpu_ranks,
            std::to_string(*e.cpu_ranks) + " CPU ranks (LOCKSTEP_CPU_RANKS)"};
  return {mode_kind::cpu_threads, e.hardware_threads,
          std::to_string(e.hardware_threads) + " CPU ranks (one per hardware thread)"};
}

}  // namespace lockstep
