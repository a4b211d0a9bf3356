#pragma once
// What each program of tests/cuda/dist begins with: the launcher's variables and the GPUs of
// this machine, or why it cannot run here.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <optional>

#include <lockstep/launch/detect.hpp>

namespace lockstep_test {

struct launched {
  lockstep::launch_info info;
  int visible = 0;  // GPUs this process sees
};

// Empty, with `exit_code` set, when `program` cannot run here: 2 without a launcher's
// variables (`how`: how to start it), 0 after "[lockstep-skip]" when this machine has fewer
// GPUs than the launcher started local ranks.
inline std::optional<launched> launched_on_gpus(const char* program, const char* how, int& exit_code) {
  const auto info = lockstep::detect_launcher();
  if (!info) {
    std::fprintf(stderr, "%s: start me with %s\n", program, how);
    exit_code = 2;
    return std::nullopt;
  }
  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess || visible < info->local_world) {
    std::printf("[lockstep-skip] needs %d GPUs, found %d\n", info->local_world, visible);
    exit_code = 0;
    return std::nullopt;
  }
  return launched{*info, visible};
}

}  // namespace lockstep_test
