#pragma once
//! NcclComm's handle of a collective in flight (NcclComm::work) and the pool of completion
//! events the handles share.

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::detail {

//! Completion events, reused: a collective takes one and its work handle gives it back, so
//! steady-state training creates none. Shared with the work handles, which may outlive the
//! communicator.
class event_pool {
 public:
  explicit event_pool(int device) : device_(device) { free_.reserve(64); }
  ~event_pool() {
    device_guard g(device_, std::nothrow);
    for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
  }
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;

  int device() const noexcept { return device_; }

  //! The caller has made device() current.
  cudaEvent_t acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    LOCKSTEP_TRY_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  void release(cudaEvent_t e) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      free_.push_back(e);
      return;
    } catch (...) {
    }
    device_guard g(device_, std::nothrow);
    (void)cudaEventDestroy(e);
  }

 private:
  int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

//! The handle of one collective in flight.
//!  - wait(): the compute stream (the one current when the collective was issued) waits for
//!    the collective; returns at once, no host synchronisation. wait(s) does it for stream s.
//!  - synchronize(): the host waits until the collective has finished.
//!  - query(): true once it has finished.
//! A default-constructed work (also what a zero-length collective returns) is complete.
//! Move-only. synchronize() and query() may outlive the communicator; wait() needs the
//! compute stream it orders to still exist.
class nccl_work {
 public:
  nccl_work() = default;
  nccl_work(nccl_work&& o) noexcept
      : pool_(std::move(o.pool_)), event_(std::exchange(o.event_, nullptr)), stream_(o.stream_) {}
  nccl_work& operator=(nccl_work&& o) noexcept {
    if (this != &o) {
      release();
      pool_ = std::move(o.pool_);
      event_ = std::exchange(o.event_, nullptr);
      stream_ = o.stream_;
    }
    return *this;
  }
  nccl_work(const nccl_work&) = delete;
  nccl_work& operator=(const nccl_work&) = delete;
  ~nccl_work() { release(); }

  void wait() { wait(stream_); }

  void wait(cudaStream_t stream) {
    if (event_ == nullptr) return;
    // Stream 0 means the *current* device's default stream: be on ours.
    device_guard g(pool_->device());
    LOCKSTEP_TRY_CUDA(cudaStreamWaitEvent(stream, event_, 0));
  }

  void synchronize() const {
    if (event_ == nullptr) return;
    LOCKSTEP_TRY_CUDA(cudaEventSynchronize(event_));
  }

  bool query() const {
    if (event_ == nullptr) return true;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    check_cuda(e, "cudaEventQuery(event)", __FILE__, __LINE__);
    return true;
  }

  //! For NcclComm: a handle that owns event e of `pool`, recorded after the collective, and
  //! orders `s` (the compute stream) in wait().
  nccl_work(std::shared_ptr<event_pool> pool, cudaEvent_t e, cudaStream_t s) noexcept
      : pool_(std::move(pool)), event_(e), stream_(s) {}
  cudaEvent_t event() const noexcept { return event_; }

 private:
  void release() noexcept {
    if (event_ != nullptr && pool_) pool_->release(event_);
    event_ = nullptr;
    pool_.reset();
  }

  std::shared_ptr<event_pool> pool_;
  cudaEvent_t event_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace lockstep::detail
