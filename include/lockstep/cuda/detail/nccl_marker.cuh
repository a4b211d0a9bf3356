#pragma once
//! The markers of collectives in flight (track_collectives()): nccl_marker, pushed around each
//! NCCL call, and nccl_overdue, which names the oldest one still running after a limit.

#include <cuda_runtime_api.h>

#include <chrono>
#include <mutex>
#include <new>
#include <optional>
#include <string>

#include "lockstep/comm/collective.hpp"
#include "lockstep/cuda/detail/capture_guard.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::detail {

inline std::optional<std::string> nccl_overdue(nccl_state& s, std::chrono::milliseconds limit) {
  if (s.aborted.load(std::memory_order_acquire)) return std::nullopt;
  if (auto why = s.peer_failure()) return why;
  device_guard g(s.device, std::nothrow);
  // A query from this (watchdog) thread must not invalidate a graph capture the rank's own
  // thread may be running in cudaStreamCaptureModeGlobal: relaxed mode for its duration.
  const relaxed_capture relaxed;
  std::lock_guard lk(s.track_m);
  while (!s.pending.empty() && s.pending.front().recorded) {
    const cudaError_t q = cudaEventQuery(s.pending.front().event);
    if (q == cudaErrorNotReady) break;
    if (q != cudaSuccess) return s.who() + ": the GPU failed: " + cudaGetErrorString(q);
    s.spare.push_back(s.pending.front().event);
    s.pending.pop_front();
  }
  if (s.pending.empty()) return std::nullopt;
  const auto& p = s.pending.front();
  const auto age = std::chrono::steady_clock::now() - p.issued;
  if (age < limit) return std::nullopt;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(age).count();
  return s.who() + ": " + (p.order_check ? "the order check of " : "") + p.what.describe() + " has not completed " +
         std::to_string(ms / 1000) + "." + std::to_string(ms % 1000 / 100) + " s after it was issued" +
         (p.recorded ? "" : " (its NCCL call has not returned: NCCL may be waiting there to connect to a peer)") +
         ": a peer never issued it (it died, hangs, or called a different collective)";
}

//! track_collectives(): the marker of one NCCL call. It is pushed, with its issue time,
//! *before* the call: NCCL may block inside it (connecting a communicator's peers at its first
//! collective, NCCL_RUNTIME_CONNECT) waiting for a peer that never comes, and overdue() must
//! see that as it sees a kernel that waits. done() records its event after the call; a call
//! that throws takes the marker back. None while the stream is being captured into a graph
//! (a marker would join the capture). `on`: the stream the call queues on (nullptr: the
//! communication stream; a graph replay's is the compute stream). The caller has made
//! s.device current.
class nccl_marker {
 public:
  nccl_marker(nccl_state& s, const collective& c, bool order_check = false, cudaStream_t on = nullptr)
      : on_(on != nullptr ? on : s.comm_stream) {
    if (!s.tracking) return;
    if (stream_capturing(on_)) return;
    std::lock_guard lk(s.track_m);
    cudaEvent_t e = nullptr;
    if (!s.spare.empty()) {
      e = s.spare.back();
      s.spare.pop_back();
    } else {
      LOCKSTEP_TRY_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    try {
      s.pending.push_back({e, false, std::chrono::steady_clock::now(), c, order_check});
    } catch (...) {
      (void)cudaEventDestroy(e);
      throw;
    }
    s_ = &s;
  }
  nccl_marker(const nccl_marker&) = delete;
  nccl_marker& operator=(const nccl_marker&) = delete;
  ~nccl_marker() {
    if (s_ == nullptr) return;
    std::lock_guard lk(s_->track_m);
    take_back();
  }

  //! The call returned: the marker completes when the stream gets past it.
  void done() {
    if (s_ == nullptr) return;
    std::lock_guard lk(s_->track_m);
    // Ours is the last: one thread issues on a communicator, and overdue() pops only
    // recorded markers from the front.
    auto& p = s_->pending.back();
    const cudaError_t r = cudaEventRecord(p.event, on_);
    if (r != cudaSuccess) {
      take_back();
      check_cuda(r, "cudaEventRecord(marker)", __FILE__, __LINE__);
    }
    p.recorded = true;
    s_ = nullptr;
  }

 private:
  void take_back() noexcept {  // under track_m
    const cudaEvent_t e = s_->pending.back().event;
    s_->pending.pop_back();
    try {
      s_->spare.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
    s_ = nullptr;
  }

  cudaStream_t on_;
  nccl_state* s_ = nullptr;  // null: no marker pushed, or it is done
};

}  // namespace lockstep::detail
