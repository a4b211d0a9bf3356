#pragma once
//! A seeded permutation computed on the device (CUB radix sort of hashed indices), for
//! samplers over data sets too large to shuffle on the host.

#include <cuda_runtime_api.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"

namespace lockstep::cuda::kernels {

namespace detail {

//! A bijection of 64-bit integers (splitmix64's finaliser after adding a seed-derived
//! offset): distinct indices get distinct keys, so sorting by key is a uniform-looking
//! permutation without ties.
__device__ __forceinline__ std::uint64_t permutation_key(std::uint64_t i, std::uint64_t seed) {
  std::uint64_t z = i + (seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <int = 0>
__global__ void permutation_init_kernel(std::uint64_t* keys, std::uint64_t* values, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    keys[i] = permutation_key(i, seed);
    values[i] = i;
  }
}

}  // namespace detail

//! d_out[0..n) ← a pseudo-random permutation of 0..n−1 determined by seed (the same on
//! every device and run), for samplers over data sets too large to shuffle on the host.
//! Sorts bijectively hashed indices with cub::DeviceRadixSort; temporary memory (≈ 24·n
//! bytes) comes from cudaMallocAsync on stream s and is freed on it.
inline void device_permutation(std::uint64_t seed, std::size_t n, std::uint64_t* d_out, cudaStream_t s) {
  if (n == 0) return;
  if (d_out == nullptr) throw config_error("device_permutation: d_out is null");
  std::uint64_t *keys_in = nullptr, *keys_out = nullptr, *values_in = nullptr;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
  LOCKSTEP_TRY_CUDA(
      (cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, values_in, d_out, n, 0, 64, s)));
  LOCKSTEP_TRY_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&keys_in), n * sizeof(std::uint64_t), s));
  auto release = [&] {  // best effort on the error path; the first error is the one reported
    for (void* p : {static_cast<void*>(keys_in), static_cast<void*>(keys_out), static_cast<void*>(values_in), temp})
      if (p != nullptr) (void)cudaFreeAsync(p, s);
  };
  try {
    LOCKSTEP_TRY_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&keys_out), n * sizeof(std::uint64_t), s));
    LOCKSTEP_TRY_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&values_in), n * sizeof(std::uint64_t), s));
    LOCKSTEP_TRY_CUDA(cudaMallocAsync(&temp, temp_bytes ? temp_bytes : 1, s));
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 4096));
    detail::permutation_init_kernel<<<blocks, 256, 0, s>>>(keys_in, values_in, n, seed);
    LOCKSTEP_CHECK_LAUNCH();
    LOCKSTEP_TRY_CUDA(
        (cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in, d_out, n, 0, 64, s)));
  } catch (...) {
    release();
    throw;
  }
  release();
}

}  // namespace lockstep::cuda::kernels
