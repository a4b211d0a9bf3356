#pragma once
//! Test helper: device memory for `count` elements of T (uninitialised), or a copy of a host
//! vector, freed with the object; upload() replaces the first elements.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include <lockstep/cuda/error.cuh>

namespace lockstep_test {

template <class T>
struct device_vector {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_vector(std::size_t count) : n(count) { LOCKSTEP_TRY_CUDA(cudaMalloc(&p, (n ? n : 1) * sizeof(T))); }
  explicit device_vector(const std::vector<T>& h) : device_vector(h.size()) { upload(h); }
  ~device_vector() { cudaFree(p); }
  device_vector(const device_vector&) = delete;
  device_vector& operator=(const device_vector&) = delete;
  //! Blocking; `stream` given: queued there (h must outlive the copy).
  void upload(const std::vector<T>& h, cudaStream_t stream = nullptr, bool async = false) {
    if (h.size() > n)
      throw std::length_error("device_vector::upload: " + std::to_string(h.size()) + " elements into " +
                              std::to_string(n));
    if (async) LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
    else LOCKSTEP_TRY_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
};

}  // namespace lockstep_test
