#pragma once
//! Helpers for GPU tests: how many GPUs are visible, and a visible skip when too few.

#include <cstdio>

#include <cuda_runtime_api.h>

namespace lockstep::test {

//! Number of visible CUDA devices; 0 when there is no driver or device (never throws, and
//! leaves no error behind for a later cudaGetLastError).
inline int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

//! Why no GPU is visible ("" when the query itself succeeded): a driver too old for this
//! CUDA runtime must read as such in the skip line, not pass for "no GPUs here".
inline const char* gpu_query_error() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess) return "";
  (void)cudaGetLastError();
  return cudaGetErrorName(e);
}

}  // namespace lockstep::test

//! First statement of a test case that needs n GPUs: with fewer visible, prints
//! "[lockstep-skip] needs n GPUs, found k" (ctest's SKIP_REGULAR_EXPRESSION turns that into
//! SKIPPED) and returns from the test case.
#define LOCKSTEP_REQUIRE_GPUS(n)                                                          \
  do {                                                                                    \
    const int lockstep_found_gpus_ = ::lockstep::test::visible_gpus();                    \
    if (lockstep_found_gpus_ < (n)) {                                                     \
      const char* lockstep_why_ = ::lockstep::test::gpu_query_error();                    \
      std::printf("[lockstep-skip] needs %d GPU%s, found %d%s%s%s\n", static_cast<int>(n), \
                  (n) == 1 ? "" : "s", lockstep_found_gpus_,                              \
                  lockstep_why_[0] ? " (cudaGetDeviceCount: " : "", lockstep_why_,        \
                  lockstep_why_[0] ? ")" : "");                                           \
      std::fflush(stdout);                                                                \
      return;                                                                             \
    }                                                                                     \
  } while (0)
