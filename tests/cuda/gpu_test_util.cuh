#pragma once
//! Helpers for GPU tests: how many GPUs are visible, a visible skip when too few, an owned
//! CUDA stream, and an independent reader of optimizer checkpoints.

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "lockstep/core/dtype.hpp"
#include "lockstep/cuda/error.cuh"

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

//! A non-blocking stream of the current device, destroyed with the object.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void sync() const { LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s)); }  // also surfaces kernel faults
};

//! An independent reader of the optimizers' checkpoint layout (optim/optimizer.hpp, sgd.hpp,
//! adamw.hpp) plus the masters section of the fused optimizers (cuda/detail/fused_state.cuh).
struct parsed_blob {
  std::string magic;
  struct slot {
    int has = 0, type = 0;
    std::uint64_t count = 0;
    std::int64_t step = 0;
    std::vector<double> a, b;  // momentum, or exp_avg and exp_avg_sq
  };
  std::vector<slot> slots;
  std::vector<std::pair<std::uint64_t, std::vector<float>>> masters;
};

inline parsed_blob parse_blob(const std::vector<std::byte>& blob, bool adamw) {
  parsed_blob out;
  std::size_t at = 0;
  auto get = [&]<class V>(V) {
    REQUIRE(at + sizeof(V) <= blob.size());
    V v;
    std::memcpy(&v, blob.data() + at, sizeof v);
    at += sizeof v;
    return v;
  };
  auto array = [&](int type, std::uint64_t n) {
    std::vector<double> v;
    for (std::uint64_t i = 0; i < n; ++i)
      v.push_back(type == static_cast<int>(lockstep::dtype::f64) ? get(double{}) : static_cast<double>(get(float{})));
    return v;
  };
  out.magic.assign(reinterpret_cast<const char*>(blob.data()), 8);
  at = 8;
  for (int i = 0; i < (adamw ? 5 : 4); ++i) (void)get(double{});
  if (!adamw) (void)get(std::uint8_t{});
  const auto n = get(std::uint64_t{});
  for (std::uint64_t i = 0; i < n; ++i) {
    parsed_blob::slot s;
    s.has = get(std::uint8_t{});
    s.type = get(std::uint8_t{});
    s.count = get(std::uint64_t{});
    if (adamw) s.step = get(std::int64_t{});
    if (s.has) {
      s.a = array(s.type, s.count);
      if (adamw) s.b = array(s.type, s.count);
    }
    out.slots.push_back(std::move(s));
  }
  if (out.magic[5] == 'M') {
    const auto m = get(std::uint64_t{});
    for (std::uint64_t j = 0; j < m; ++j) {
      const auto slot = get(std::uint64_t{});
      const auto count = get(std::uint64_t{});
      std::vector<float> v;
      for (std::uint64_t i = 0; i < count; ++i) v.push_back(get(float{}));
      out.masters.emplace_back(slot, std::move(v));
    }
  }
  CHECK(at == blob.size());
  return out;
}

}  // namespace lockstep::test

//! First statement of a test case that needs n GPUs: with fewer visible, prints
//! "[lockstep-skip] needs n GPUs, found k" (ctest's SKIP_REGULAR_EXPRESSION turns that into
//! SKIPPED) and returns from the test case.
#define LOCKSTEP_REQUIRE_GPUS(n)                                                                                \
  do {                                                                                                          \
    const int lockstep_found_gpus_ = ::lockstep::test::visible_gpus();                                          \
    if (lockstep_found_gpus_ < (n)) {                                                                           \
      const char* lockstep_why_ = ::lockstep::test::gpu_query_error();                                          \
      std::printf("[lockstep-skip] needs %d GPU%s, found %d%s%s%s\n", static_cast<int>(n), (n) == 1 ? "" : "s", \
                  lockstep_found_gpus_, lockstep_why_[0] ? " (cudaGetDeviceCount: " : "", lockstep_why_,        \
                  lockstep_why_[0] ? ")" : "");                                                                 \
      std::fflush(stdout);                                                                                      \
      return;                                                                                                   \
    }                                                                                                           \
  } while (0)

namespace lockstep_test {
//! Devices 0 … n − 1 (lockstep::Gpus{first_gpus(n)}).
inline std::vector<int> first_gpus(int n) {
  std::vector<int> d(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d[static_cast<std::size_t>(i)] = i;
  return d;
}
}  // namespace lockstep_test
