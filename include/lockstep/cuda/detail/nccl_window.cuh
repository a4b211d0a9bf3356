#pragma once
//! Copy-engine collectives (NCCL ≥ 2.28): device memory from ncclMemAlloc (CUDA virtual
//! memory) registered as a symmetric window of a communicator whose CTA policy is
//! NCCL_CTA_POLICY_ZERO (NcclComm::copy_engine_group). There NCCL does an all-gather in place,
//! and an all-to-all between two windows, with the GPUs' copy engines: they take no SMs from
//! the model's kernels (bench/RESULTS.md, session 9, has it measured). NCCL has no copy-engine
//! reduce-scatter; this file makes one: an all-to-all of the blocks into a staging window, then
//! each rank sums the N blocks it received (a short kernel, fp32 accumulation, rank order).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/detail/capture_guard.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/wire_ops.cuh"

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define LOCKSTEP_NCCL_COPY_ENGINE 1
#else
#define LOCKSTEP_NCCL_COPY_ENGINE 0
#endif

namespace lockstep::detail {

#if LOCKSTEP_NCCL_COPY_ENGINE

//! Deregisters the window and frees the memory; the communicator's state stays alive as long
//! as the memory does. The memory is left allocated (not freed, not deregistered) when the
//! communicator was aborted, or when a gather is still running after LOCKSTEP_TIMEOUT
//! (nccl_state::drained): a copy-engine gather waits for its peers with stream memory
//! operations that ncclCommAbort does not end, so a copy may still be queued against it.
struct nccl_window_deleter {
  std::shared_ptr<nccl_state> s;
  ncclWindow_t win = nullptr;
  void operator()(void* p) const noexcept {
    if (s->aborted.load(std::memory_order_acquire) || s->released.load(std::memory_order_acquire)) return;
    device_guard g(s->device, std::nothrow);
    if (!s->drained()) return;
    // Kernels on the compute stream (the optimizer, the forward) may still read the values.
    if (cudaStreamSynchronize(s->compute_stream()) != cudaSuccess) return;
    std::lock_guard lk(s->abort_m);  // nccl_abort marks `released` before it takes this lock
    if (s->released.load(std::memory_order_acquire)) return;
    if (win != nullptr) {
      std::lock_guard wl(s->windows_m);
      std::erase_if(s->windows, [p](const auto& w) { return w.start == reinterpret_cast<std::uintptr_t>(p); });
      (void)ncclCommWindowDeregister(s->comm, win);
    }
    (void)ncclMemFree(p);
  }
};

// ncclMemAlloc'd `bytes` (rounded up to the window alignment) registered as a symmetric window
// of s; throws naming `option`, what to turn off, when either fails. The caller owns both.
inline std::pair<void*, ncclWindow_t> nccl_window_raw(nccl_state& s, std::size_t& bytes, const char* option) {
  refuse_in_capture("ncclMemAlloc (a symmetric window)", bytes, s.device);
  constexpr std::size_t align = NCCL_WIN_REQUIRED_ALIGNMENT;
  bytes = (bytes + align - 1) / align * align + (bytes == 0 ? align : 0);
  void* p = nullptr;
  if (const ncclResult_t r = ncclMemAlloc(&p, bytes); r != ncclSuccess)
    throw nccl_error(call_failure("ncclMemAlloc", __FILE__, __LINE__,
                                  describe_nccl(r) + " while allocating " + std::to_string(bytes) +
                                      " bytes of window memory on device " + std::to_string(s.device) + "; turn " +
                                      option + " off to use cudaMalloc"));
  ncclWindow_t win = nullptr;
  if (const ncclResult_t r = ncclCommWindowRegister(s.comm, p, bytes, &win, NCCL_WIN_COLL_SYMMETRIC);
      r != ncclSuccess) {
    (void)ncclMemFree(p);
    throw nccl_error(call_failure("ncclCommWindowRegister", __FILE__, __LINE__,
                                  describe_nccl(r) + " while registering " + std::to_string(bytes) +
                                      " bytes as a symmetric window on device " + std::to_string(s.device) + "; turn " +
                                      option + " off to run without one"));
  }
  return {p, win};
}

//! `bytes` of device memory, zeroed on `stream`, registered as a symmetric window of s's
//! communicator. Collective: every rank calls it with the same size, in the same order.
//! .second says whether NCCL returned a window. That the gathers then run on the copy
//! engines is NCCL's choice: it needs GPUs that map each other's memory (NVLink or PCIe peer
//! access), CUDA virtual memory and a driver of CUDA 12.5 or later; else it uses its kernels.
//! `handle`, if given, receives the window (nullptr: none).
inline std::pair<std::shared_ptr<void>, bool> nccl_window(const std::shared_ptr<nccl_state>& s, std::size_t bytes,
                                                          cudaStream_t stream, ncclWindow_t* handle = nullptr) {
  device_guard g(s->device);
  if (s->comm == nullptr) {  // one rank, no NCCL communicator: plain memory, no window
    std::shared_ptr<void> owner = CudaMemory(s->device, stream).allocate(bytes == 0 ? 1 : bytes);
    LOCKSTEP_TRY_CUDA(cudaMemsetAsync(owner.get(), 0, bytes, stream));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream));
    return {std::move(owner), false};
  }
  const auto [p, win] = nccl_window_raw(*s, bytes, "ShardedOptimizer::copy_engine_gather/_scatter");
  std::shared_ptr<void> owner(p, nccl_window_deleter{s, win});  // should this throw, it frees p itself
  if (handle != nullptr) *handle = win;
  if (win != nullptr) {
    std::lock_guard wl(s->windows_m);
    s->windows.push_back({reinterpret_cast<std::uintptr_t>(p), bytes});
  }
  LOCKSTEP_TRY_CUDA(cudaMemsetAsync(p, 0, bytes, stream));
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream));
  return {std::move(owner), win != nullptr};
}

//! Whether [p, p + bytes) lies inside one window of s (one taken by nccl_window).
inline bool in_window(nccl_state& s, const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard wl(s.windows_m);
  return std::any_of(s.windows.begin(), s.windows.end(),
                     [&](const auto& w) { return a >= w.start && a + bytes <= w.start + w.bytes; });
}

//! Makes s's newest staging window hold at least `bytes` (collective when it grows: every rank
//! asks for the same sizes in the same order, as their reduce-scatters are the same). A smaller
//! one it replaces stays until the communicator goes (a sum kernel may still read it), so the
//! staging held is the sum of the sizes it grew through, not only the largest.
inline void* reserve_staging(nccl_state& s, std::size_t bytes) {
  if (!s.staging.empty() && s.staging.back().bytes >= bytes) return s.staging.back().memory;
  s.staging.reserve(s.staging.size() + 1);  // nothing throws once the window is taken
  const auto [p, win] = nccl_window_raw(s, bytes, "ShardedOptimizer::copy_engine_scatter (or pass plain memory)");
  s.staging.push_back({p, win, bytes});
  return p;
}

//! Whether a reduce-scatter of s (count elements per rank) can run on the copy engines: s is a
//! copy-engine group of more than one rank, the reduction a sum or mean of f32 or bf16, and
//! send lies in one of its windows.
inline bool copy_engine_reducible(nccl_state& s, const void* send, std::size_t count, dtype t, reduce_op op) {
  return s.copy_engines && s.size > 1 && (t == dtype::f32 || t == dtype::bf16) &&
         (op == reduce_op::sum || op == reduce_op::avg) &&
         in_window(s, send, count * static_cast<std::size_t>(s.size) * size_of(t));
}

//! The copy-engine reduce-scatter, queued on `stream` (s's communication stream): block j of
//! send goes to rank j's staging window (an all-to-all between windows: copy engines), then
//! recv ← the blocks received, summed in fp32 in rank order (× 1/N for avg), rounded once.
inline void copy_engine_reduce_scatter(nccl_state& s, const void* send, void* recv, std::size_t count, dtype t,
                                       reduce_op op, ncclDataType_t nt, cudaStream_t stream) {
  void* staging = reserve_staging(s, count * static_cast<std::size_t>(s.size) * size_of(t));
  LOCKSTEP_TRY_NCCL(ncclAlltoAll(send, staging, count, nt, s.comm, stream));
  const float scale = op == reduce_op::avg ? 1.0f / static_cast<float>(s.size) : 1.0f;
  cuda::kernels::sum_blocks(staging, t == dtype::bf16, s.size, count, scale, recv, stream);
}

#else

inline bool copy_engine_reducible(nccl_state&, const void*, std::size_t, dtype, reduce_op) { return false; }
inline void copy_engine_reduce_scatter(nccl_state&, const void*, void*, std::size_t, dtype, reduce_op, ncclDataType_t,
                                       cudaStream_t) {}

#endif

}  // namespace lockstep::detail
