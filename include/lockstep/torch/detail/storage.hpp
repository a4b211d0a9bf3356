#pragma once
//! Device memory between lockstep and libtorch's allocator (TorchModule's model (i) hooks):
//! storage lockstep borrows from it, and what it keeps cached handed back to the device.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#if defined(LOCKSTEP_WITH_CUDA) && __has_include(<c10/cuda/CUDACachingAllocator.h>)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#define LOCKSTEP_TORCH_CUDA 1
#else
#define LOCKSTEP_TORCH_CUDA 0
#endif

#include "lockstep/core/error.hpp"

namespace lockstep::detail {

//! `bytes` of libtorch's memory where `like` lives — on a GPU from its caching allocator, for
//! libtorch's current stream of that device: freed (the shared_ptr's last owner gone) it goes
//! back to that stream's cache, for the next tensor. Out of memory (after libtorch freed its
//! cache and tried again) is a lockstep::error naming `what`, the size and the device.
inline std::shared_ptr<void> torch_storage(const at::Tensor& like, std::size_t bytes, const char* what) {
  at::Tensor t;
  try {
    t = at::empty({static_cast<std::int64_t>(bytes)}, like.options().dtype(at::kByte).requires_grad(false));
  } catch (const c10::Error& e) {
    throw error("TorchModule: libtorch could not allocate " + std::to_string(bytes) + " bytes for " + what + " on " +
                like.device().str() + ": " + e.what_without_backtrace());
  }
  void* p = t.data_ptr();
  return std::shared_ptr<void>(p, [t = std::move(t)](void*) mutable { t.reset(); });
}

//! What libtorch's CUDA allocator keeps of freed storage goes back to the device — only where
//! this process holds libtorch memory on `like`'s device alone (one process per GPU): emptying
//! the cache frees every device's, and a cudaFree waits for its device (with ranks as threads,
//! for another rank's collective that waits for this one). Nothing on CPU.
inline void release_cached([[maybe_unused]] const at::Tensor& like) {
#if LOCKSTEP_TORCH_CUDA
  if (!like.is_cuda()) return;
  const auto mine = like.device().index();
  for (c10::DeviceIndex d = 0; d < static_cast<c10::DeviceIndex>(c10::cuda::device_count()); ++d)
    if (d != mine && c10::cuda::CUDACachingAllocator::getDeviceStats(d).reserved_bytes[0].current > 0) return;
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace lockstep::detail
