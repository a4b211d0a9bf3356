#pragma once
//! What NcclComm is built from: its handle of a collective in flight (NcclComm::work), the
//! pool of completion events the handles share, and creating and destroying raw NCCL
//! communicators on a checked device.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
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
      : pool_(std::move(o.pool_)), event_(std::exchange(o.event_, nullptr)), stream_(o.stream_), capture_(o.capture_) {}
  nccl_work& operator=(nccl_work&& o) noexcept {
    if (this != &o) {
      release();
      pool_ = std::move(o.pool_);
      event_ = std::exchange(o.event_, nullptr);
      stream_ = o.stream_;
      capture_ = o.capture_;
    }
    return *this;
  }
  nccl_work(const nccl_work&) = delete;
  nccl_work& operator=(const nccl_work&) = delete;
  ~nccl_work() { release(); }

  void wait() { wait(stream_); }

  //! Across a CUDA graph capture's edge (a StepGraph): a collective issued outside the capture
  //! that waits for it (a gather the next forward waits for, issued by the eager step before,
  //! or by a graph captured earlier) cannot join the graph — it has completed (StepGraph drains
  //! the device first) and there is nothing to wait for. One captured into a graph and waited
  //! for outside it ran inside that graph's replays on the compute stream: that stream is
  //! ordered already, another one is made to wait for the compute stream's work so far.
  void wait(cudaStream_t stream) {
    if (event_ == nullptr) return;
    // Stream 0 means the *current* device's default stream: be on ours.
    device_guard g(pool_->device());
    const unsigned long long now = capture_id(stream);
    if (now != capture_) {
      if (capture_ != 0) {  // recorded into a graph: its event means nothing outside that capture
        if (now != 0) return;
        if (capture_id(stream_) == capture_)
          throw config_error("a collective captured into a CUDA graph is waited for by a stream outside the "
                             "capture while it is still open; wait inside the captured step");
        if (stream != stream_) join_compute(stream);
        return;
      }
      const cudaError_t q = query_uncaptured();
      if (q == cudaSuccess) return;
      if (q == cudaErrorNotReady)
        throw config_error("a collective issued before this CUDA graph capture began is still running, and a "
                           "graph cannot wait for it: drain the device before capturing (cudaDeviceSynchronize; "
                           "StepGraph does)");
      check_cuda(q, "cudaEventQuery(event)", __FILE__, __LINE__);
    }
    LOCKSTEP_TRY_CUDA(cudaStreamWaitEvent(stream, event_, 0));
  }

  //! Captured into a graph: waits for the stream its replays run on.
  void synchronize() const {
    if (event_ == nullptr) return;
    if (capture_ != 0) LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream_));
    else LOCKSTEP_TRY_CUDA(cudaEventSynchronize(event_));
  }

  bool query() const {
    if (event_ == nullptr) return true;
    const cudaError_t e = capture_ != 0 ? cudaStreamQuery(stream_) : cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    check_cuda(e, "cudaEventQuery(event)", __FILE__, __LINE__);
    return true;
  }

  //! For NcclComm: a handle that owns event e of `pool`, recorded after the collective, and
  //! orders `s` (the compute stream) in wait().
  nccl_work(std::shared_ptr<event_pool> pool, cudaEvent_t e, cudaStream_t s) noexcept
      : pool_(std::move(pool)), event_(e), stream_(s), capture_(capture_id(s)) {}
  cudaEvent_t event() const noexcept { return event_; }

 private:
  void release() noexcept {
    if (event_ != nullptr && pool_) pool_->release(event_);
    event_ = nullptr;
    pool_.reset();
  }

  // The id of the capture s is in (0: none).
  static unsigned long long capture_id(cudaStream_t s) noexcept {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (cudaStreamGetCaptureInfo(s, &cap, &id) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return cap == cudaStreamCaptureStatusActive ? id : 0;
  }
  // `other` waits for the compute stream's work queued so far (a graph's replays among it).
  void join_compute(cudaStream_t other) const {
    cudaEvent_t e = pool_->acquire();
    const cudaError_t r = cudaEventRecord(e, stream_);
    const cudaError_t w = r == cudaSuccess ? cudaStreamWaitEvent(other, e, 0) : r;
    pool_->release(e);
    LOCKSTEP_TRY_CUDA(w);
  }
  // cudaEventQuery of an event recorded outside a capture, from a thread that may capture:
  // in relaxed mode, so that it cannot invalidate the capture.
  cudaError_t query_uncaptured() const noexcept {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t q = cudaEventQuery(event_);
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    return q;
  }

  std::shared_ptr<event_pool> pool_;
  cudaEvent_t event_ = nullptr;
  cudaStream_t stream_ = nullptr;
  unsigned long long capture_ = 0;  // the capture the event was recorded into (0: none), by cudaStreamGetCaptureInfo
};

inline int visible_devices() {
  int n = 0;
  LOCKSTEP_TRY_CUDA(cudaGetDeviceCount(&n));
  return n;
}

inline void check_device(int device, int visible, const char* who) {
  if (device < 0 || device >= visible)
    throw config_error(std::string(who) + ": device " + std::to_string(device) + " does not exist; this process sees " +
                       std::to_string(visible) + " CUDA device(s) (0.." + std::to_string(visible - 1) +
                       "); check CUDA_VISIBLE_DEVICES");
}

//! One communicator per device of `devices`, rank r on devices[r] (ncclCommInitAll), once the
//! list is checked; for one device nullptr, which needs no NCCL communicator (nccl_state::comm).
inline std::vector<ncclComm_t> nccl_init_local(std::span<const int> devices) {
  const int n = static_cast<int>(devices.size());
  if (n < 1) throw config_error("NcclComm::create_local: the device list is empty; pass one device per rank");
  const int visible = visible_devices();
  for (int i = 0; i < n; ++i) {
    check_device(devices[static_cast<std::size_t>(i)], visible, "NcclComm::create_local");
    for (int j = 0; j < i; ++j)
      if (devices[static_cast<std::size_t>(j)] == devices[static_cast<std::size_t>(i)])
        throw config_error("NcclComm::create_local: device " + std::to_string(devices[static_cast<std::size_t>(i)]) +
                           " is listed twice (ranks " + std::to_string(j) + " and " + std::to_string(i) +
                           "); NCCL needs one device per rank");
  }
  std::vector<ncclComm_t> raw(static_cast<std::size_t>(n), nullptr);
  if (n > 1) {  // one GPU needs no NCCL communicator (detail::nccl_state::comm)
    // ncclCommInitAll switches devices internally; leave the caller's device as it was.
    device_guard g(devices[0]);
    LOCKSTEP_TRY_NCCL(ncclCommInitAll(raw.data(), n, devices.data()));
  }
  return raw;
}

//! Rank `rank` of `world` on `device` (ncclCommInitRank, which returns once all ranks joined);
//! nullptr for a world of one, which needs no NCCL communicator (nccl_state::comm).
inline ncclComm_t nccl_init_rank(const ncclUniqueId& id, int rank, int world, int device) {
  if (world < 1 || rank < 0 || rank >= world)
    throw config_error("NcclComm: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                       " is not a valid rank (need 0 <= rank < world, world >= 1)");
  check_device(device, visible_devices(), "NcclComm");
  if (world == 1) return nullptr;
  device_guard g(device);
  ncclComm_t c = nullptr;
  LOCKSTEP_TRY_NCCL(ncclCommInitRank(&c, world, id, rank));
  return c;
}

inline void nccl_destroy(ncclComm_t c, int device) noexcept {
  if (c == nullptr) return;
  device_guard g(device, std::nothrow);
  (void)ncclCommDestroy(c);
}

}  // namespace lockstep::detail
