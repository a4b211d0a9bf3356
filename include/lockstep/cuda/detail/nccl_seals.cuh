#pragma once
//! NcclComm's order check (comm/order_check.hpp): the seals of one communicator. Each
//! collective's seal is all-gathered on the communication stream ahead of it — this rank's
//! words go up from pinned host memory, every rank's come back into it, an event marks their
//! arrival — and the host compares them without waiting: when a later collective is issued,
//! from the watchdog (NcclComm::order_failure), and at the end of run(). Immediate mode
//! (LOCKSTEP_DEBUG=1) waits for each before its collective instead.

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/order_check.hpp"
#include "lockstep/cuda/error.cuh"

namespace lockstep::detail {

//! This thread in cudaStreamCaptureModeRelaxed while alive: its queries and host allocations
//! must not invalidate a graph capture another thread (another rank of run(Gpus), the rank's
//! own thread seen from a watchdog) is running in global mode.
struct relaxed_capture {
  cudaStreamCaptureMode old = cudaStreamCaptureModeRelaxed;
  relaxed_capture() noexcept { (void)cudaThreadExchangeStreamCaptureMode(&old); }
  ~relaxed_capture() { (void)cudaThreadExchangeStreamCaptureMode(&old); }
  relaxed_capture(const relaxed_capture&) = delete;
  relaxed_capture& operator=(const relaxed_capture&) = delete;
};

class nccl_seals {
 public:
  //! A seal's pinned host words (this rank's, then every rank's, then one more; `device`: the
  //! same words as kernels address them) and the event after their copy back. A seal carried by
  //! lockstep's peer kernel (nccl_peer.cuh) has `arrived`, the last word, which the kernel sets
  //! once every rank's words are there: it is compared from then on, also while the kernel
  //! still runs, and not at all if the kernel ended without (it gave up: a rank never came).
  struct entry {
    std::int64_t* host = nullptr;
    std::int64_t* device = nullptr;
    cudaEvent_t done = nullptr;
    std::int64_t* arrived = nullptr;
  };

  nccl_seals() = default;
  nccl_seals(const nccl_seals&) = delete;
  nccl_seals& operator=(const nccl_seals&) = delete;
  //! Frees everything; the caller has made the device current and drained the stream. With
  //! `leak` (an aborted or stuck communicator) nothing is freed: a copy may still be queued
  //! against the words, and cudaFree/cudaFreeHost would wait for the device.
  void release(bool leak) noexcept {
    std::lock_guard lk(m_);
    if (!leak) {
      for (auto& e : spare_) free(e);
      for (auto& e : pending_) free(e);
      if (gathered_ != nullptr) (void)cudaFree(gathered_);
    }
    spare_.clear();
    pending_.clear();
    gathered_ = nullptr;
  }

  //! Sets the mode; allocates the device words of `ranks` seals.
  void init(int ranks, order_check_mode mode) {
    mode_ = mode;
    ranks_ = static_cast<std::size_t>(ranks);
    if (mode_ != order_check_mode::off)
      LOCKSTEP_TRY_CUDA(cudaMalloc(reinterpret_cast<void**>(&gathered_), sizeof(std::int64_t) * order_words * ranks_));
  }
  order_check_mode mode() const noexcept { return mode_.load(std::memory_order_relaxed); }
  void set_mode(order_check_mode m) noexcept {  // to immediate or deferred only after init in either
    if (m == order_check_mode::off || gathered_ != nullptr) mode_.store(m, std::memory_order_relaxed);
  }
  std::int64_t* gathered() const noexcept { return gathered_; }
  std::size_t ranks() const noexcept { return ranks_; }

  //! A free entry (pinned words for `ranks` seals and an event), to fill and push().
  entry take() {
    {
      std::lock_guard lk(m_);
      if (!spare_.empty()) {
        entry e = spare_.back();
        spare_.pop_back();
        return e;
      }
    }
    const relaxed_capture relaxed;
    entry e;
    const std::size_t bytes = sizeof(std::int64_t) * (order_words * (1 + ranks_) + 1);
    LOCKSTEP_TRY_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&e.host), bytes, cudaHostAllocMapped));
    cudaError_t r = cudaHostGetDevicePointer(reinterpret_cast<void**>(&e.device), e.host, 0);
    if (r == cudaSuccess) r = cudaEventCreateWithFlags(&e.done, cudaEventDisableTiming);
    if (r != cudaSuccess) {
      (void)cudaFreeHost(e.host);
      check_cuda(r, "cudaHostGetDevicePointer / cudaEventCreateWithFlags (seal)", __FILE__, __LINE__);
    }
    return e;
  }
  void push(entry e) {
    std::lock_guard lk(m_);
    pending_.push_back(e);
  }
  void give_back(entry e) noexcept {
    e.arrived = nullptr;
    std::lock_guard lk(m_);
    try {
      spare_.push_back(e);
    } catch (...) {
      free(e);
    }
  }

  //! Compares the seals that have arrived, oldest first; the first mismatch found (kept: it
  //! is returned from then on). Never throws; safe from any thread. how(): who found it, for
  //! the message (called on a mismatch only).
  template <class How>
  std::optional<std::string> poll(How&& how) noexcept {
    try {
      const relaxed_capture relaxed;
      std::lock_guard lk(m_);
      while (mismatch_.empty() && !pending_.empty()) {
        entry e = pending_.front();
        const bool there = e.arrived != nullptr && *static_cast<volatile std::int64_t*>(e.arrived) != 0;
        // Not yet (a failed device is reported elsewhere); a carried seal that never arrived
        // although its kernel ended is dropped.
        if (!there && cudaEventQuery(e.done) != cudaSuccess) break;
        pending_.pop_front();
        auto why = e.arrived == nullptr || there ? compare(e, how) : std::nullopt;
        e.arrived = nullptr;
        spare_.push_back(e);
        if (why) mismatch_ = std::move(*why);
      }
      if (!mismatch_.empty()) return mismatch_;
    } catch (...) {
    }
    return std::nullopt;
  }

  //! The words of entry e, compared (immediate mode: after its event was waited for).
  template <class How>
  std::optional<std::string> compare(const entry& e, How&& how) const {
    return seal_mismatch(std::span<const std::int64_t>(e.host + order_words, order_words * ranks_),
                         static_cast<int>(ranks_), how);
  }

  //! Whether every seal issued so far has arrived; waits for them up to `limit`.
  bool drain(std::chrono::milliseconds limit) const {
    const auto start = std::chrono::steady_clock::now();
    const relaxed_capture relaxed;
    for (;;) {
      {
        std::lock_guard lk(m_);
        bool all = true;
        for (const auto& e : pending_) all = all && cudaEventQuery(e.done) == cudaSuccess;
        if (all) return true;
      }
      if (std::chrono::steady_clock::now() - start >= limit) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  static void free(entry& e) noexcept {
    if (e.done != nullptr) (void)cudaEventDestroy(e.done);
    if (e.host != nullptr) (void)cudaFreeHost(e.host);
    e = {};
  }

  std::atomic<order_check_mode> mode_{order_check_mode::off};  // read by a watchdog's thread too
  std::size_t ranks_ = 0;
  std::int64_t* gathered_ = nullptr;  // device: ranks_ × order_words, this rank's slot in place
  mutable std::mutex m_;              // the rank's thread and a watchdog
  std::deque<entry> pending_;         // issued, not yet compared
  std::vector<entry> spare_;
  std::string mismatch_;  // the first one found
};

}  // namespace lockstep::detail
