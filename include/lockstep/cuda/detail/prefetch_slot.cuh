#pragma once
//! The resources of one Prefetcher slot (cuda/prefetch.cuh): pinned host memory, device memory
//! and its two events, each released by its owner, and their allocation.

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::detail {

struct pinned_free {
  void operator()(std::byte* p) const noexcept { (void)cudaFreeHost(p); }
};
struct owned_event {
  cudaEvent_t e = nullptr;
  owned_event() = default;
  owned_event(owned_event&& o) noexcept : e(std::exchange(o.e, nullptr)) {}
  owned_event& operator=(owned_event&&) = delete;
  ~owned_event() {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
};
struct owned_stream {
  cudaStream_t s = nullptr;
  ~owned_stream() {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
};
struct prefetch_slot {
  std::unique_ptr<std::byte, pinned_free> host;  // pinned, bytes_
  std::shared_ptr<void> dev;                     // bytes_ on device_
  owned_event copied;                            // E_copy: recorded on P after the copy
  owned_event done;                              // E_done: recorded on C at release
  std::size_t used = 0;                          // bytes of the batch in it (under m_)
};

//! Fills slot `index` of `count` with `bytes` of pinned host and device memory (`mem`) and its events.
inline void allocate_prefetch_slot(prefetch_slot& s, std::size_t bytes, const CudaMemory& mem, std::size_t index,
                                   std::size_t count) {
  void* h = nullptr;
  const cudaError_t e = cudaHostAlloc(&h, bytes, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw cuda_error(call_failure("cudaHostAlloc", __FILE__, __LINE__,
                                  describe_cuda(e) + " while pinning " + std::to_string(bytes) + " bytes for slot " +
                                      std::to_string(index) + " of " + std::to_string(count) +
                                      "; give fewer slots or a smaller slot_bytes"));
  }
  s.host.reset(static_cast<std::byte*>(h));
  s.dev = mem.allocate(bytes);
  // Helper threads wait for copies on the host: block rather than spin a core.
  LOCKSTEP_TRY_CUDA(cudaEventCreateWithFlags(&s.copied.e, cudaEventDisableTiming | cudaEventBlockingSync));
  LOCKSTEP_TRY_CUDA(cudaEventCreateWithFlags(&s.done.e, cudaEventDisableTiming | cudaEventBlockingSync));
}

}  // namespace lockstep::detail
