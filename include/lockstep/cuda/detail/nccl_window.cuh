#pragma once
//! Memory for copy-engine all-gathers (NCCL ≥ 2.28): device memory from ncclMemAlloc (CUDA
//! virtual memory) registered as a symmetric window of a communicator. An all-gather in place
//! into such a window, issued on a communicator whose CTA policy is NCCL_CTA_POLICY_ZERO
//! (NcclComm::copy_engine_group), is done by the GPUs' copy engines: it takes no SMs from the
//! model's kernels (bench/RESULTS.md, session 9, has it measured).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/error.cuh"

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
    if (win != nullptr) (void)ncclCommWindowDeregister(s->comm, win);
    (void)ncclMemFree(p);
  }
};

//! `bytes` of device memory, zeroed on `stream`, registered as a symmetric window of s's
//! communicator. Collective: every rank calls it with the same size, in the same order.
//! .second says whether NCCL returned a window. That the gathers then run on the copy
//! engines is NCCL's choice: it needs GPUs that map each other's memory (NVLink or PCIe peer
//! access), CUDA virtual memory and a driver of CUDA 12.5 or later; else it uses its kernels.
inline std::pair<std::shared_ptr<void>, bool> nccl_window(const std::shared_ptr<nccl_state>& s, std::size_t bytes,
                                                          cudaStream_t stream) {
  device_guard g(s->device);
  constexpr std::size_t align = NCCL_WIN_REQUIRED_ALIGNMENT;
  const std::size_t size = (bytes + align - 1) / align * align + (bytes == 0 ? align : 0);
  void* p = nullptr;
  const ncclResult_t r = ncclMemAlloc(&p, size);
  if (r != ncclSuccess)
    throw nccl_error(call_failure("ncclMemAlloc", __FILE__, __LINE__,
                                  describe_nccl(r) + " while allocating " + std::to_string(size) +
                                      " bytes of window memory on device " + std::to_string(s->device) +
                                      "; turn DataParallelOptions::copy_engine_gather off to use cudaMalloc"));
  std::shared_ptr<void> owner(p, nccl_window_deleter{s, nullptr});
  ncclWindow_t win = nullptr;
  if (const ncclResult_t rr = ncclCommWindowRegister(s->comm, p, size, &win, NCCL_WIN_COLL_SYMMETRIC); rr != ncclSuccess)
    throw nccl_error(call_failure("ncclCommWindowRegister", __FILE__, __LINE__,
                                  describe_nccl(rr) + " while registering " + std::to_string(size) +
                                      " bytes as a symmetric window on device " + std::to_string(s->device) +
                                      "; turn DataParallelOptions::copy_engine_gather off to gather without one"));
  std::get_deleter<nccl_window_deleter>(owner)->win = win;
  LOCKSTEP_TRY_CUDA(cudaMemsetAsync(p, 0, size, stream));
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream));
  return {std::move(owner), win != nullptr};
}

#endif

}  // namespace lockstep::detail
