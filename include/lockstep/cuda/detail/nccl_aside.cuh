#pragma once
//! The aside stream of an NcclComm (NcclComm::enqueue_aside): a kernel that reads what a
//! transfer brought runs on a second stream of the communicator, after everything queued on the
//! communication stream so far, so that the next transfer there starts at once instead of
//! queuing behind it. ShardedOptimizer::gather_wire's decodes run there (cuda/nccl_wire.cuh):
//! with the gathers in the forward, unit u's decode overlaps unit u + 1's encode and gather.
//!
//! Each piece of aside work names the device memory it touches. Later work on the
//! communication stream waits for the pieces that touch memory it names (a collective names
//! its buffers), and for all of them when it names none (NcclComm::enqueue(f), barrier()). The
//! aside stream is in order, so waiting for a piece waits for every piece before it. Inside a
//! CUDA graph capture nothing goes aside: the work runs on the communication stream.
//!
//! What this changes for a caller: the work handle of a later collective no longer covers
//! earlier aside work (it did, when everything ran on the communication stream). Another stream
//! — the compute stream, another communicator's — that reads what aside work wrote must wait
//! for that work's own handle, or for enqueue(f), barrier() or synchronize(). A piece that names
//! no ranges is taken as touching everything; one whose f throws is still waited for (what f
//! queued before it threw); inside a capture, aside work first checks, as a collective does,
//! that the pieces from before the capture it touches have finished.
//!
//! Its priority is the lowest (that of a default compute stream), not the communication
//! stream's highest. Measured on bench_sync's MLP over NVLink (bench/RESULTS.md, session 33):
//! with every kernel after a transfer aside, the int8 value gather's step took 3.40 ms at the
//! highest priority, 3.16 at the lowest, 3.32 all on the communication stream; the
//! reduce-scatters' sums aside (double-buffered staging) lowered the step without compute by
//! 0.06–0.17 ms but made it 0.04–0.11 ms slower with its compute at either priority, so they stay
//! on the communication stream, as do the gradient wires' kernels.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <vector>

#include <cuda_runtime_api.h>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"

namespace lockstep {

//! Device memory a piece of work touches (reads or writes): `bytes` from `data`.
struct device_range {
  const void* data = nullptr;
  std::size_t bytes = 0;
};

namespace detail {

class nccl_aside {
 public:
  //! Up to this many ranges per piece of work (the most any of lockstep's names).
  static constexpr std::size_t max_ranges = 4;
  using ranges = std::initializer_list<device_range>;

  nccl_aside() = default;
  nccl_aside(const nccl_aside&) = delete;
  nccl_aside& operator=(const nccl_aside&) = delete;
  //! The caller has made the device current.
  ~nccl_aside() { release(); }

  //! Before work that touches `touched` (empty: unknown, so anything) is queued on `on`:
  //! `on` waits for the pieces of aside work that touch any of it.
  void order(cudaStream_t on, ranges touched) {
    if (pending_.empty()) return;
    const bool capturing = capturing_on(on);
    if (!capturing) prune();
    std::size_t upto = 0;  // pieces [0, upto) to wait for
    for (std::size_t i = pending_.size(); i > 0 && upto == 0; --i)
      if (touched.size() == 0 || overlaps(pending_[i - 1], touched)) upto = i;
    if (upto == 0) return;
    cudaEvent_t done = pending_[upto - 1].done;
    if (capturing) {
      // A graph cannot wait for work outside its capture; StepGraph drains the device before it
      // captures, so the piece has finished and there is nothing to wait for.
      if (query_relaxed(done) == cudaErrorNotReady)
        throw config_error("NcclComm: aside work issued before this CUDA graph capture began is still running, and "
                           "a graph cannot wait for it: drain the device before capturing (cudaDeviceSynchronize; "
                           "StepGraph does)");
    } else {
      LOCKSTEP_TRY_CUDA(cudaStreamWaitEvent(on, done, 0));
    }
    drop(upto);
  }

  //! Queues f(stream) on the aside stream after everything queued on `after` so far and
  //! returns that stream — or, while `after` is being captured, f(after) and `after`.
  //! `touched`: all the memory f reads or writes.
  template <class F>
  cudaStream_t run(cudaStream_t after, ranges touched, F&& f) {
    if (touched.size() > max_ranges) throw config_error("nccl_aside::run: more ranges than max_ranges");
    if (capturing_on(after)) {
      order(after, touched);  // pieces from before the capture: finished, or refused
      f(after);
      return after;
    }
    if (stream_ == nullptr) {
      int least = 0, greatest = 0;  // the lowest priority: see above
      LOCKSTEP_TRY_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      LOCKSTEP_TRY_CUDA(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
      LOCKSTEP_TRY_CUDA(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, least));
    }
    prune();
    pending_.emplace_back();  // first, so that nothing below throws with the event unkept
    piece& p = pending_.back();
    if (!spare_.empty()) {
      p.done = spare_.back();
      spare_.pop_back();
    } else if (const cudaError_t e = cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming); e != cudaSuccess) {
      pending_.pop_back();
      check_cuda(e, "cudaEventCreateWithFlags", __FILE__, __LINE__);
    }
    std::copy(touched.begin(), touched.end(), p.touched.begin());
    p.count = touched.size();
    p.all = touched.size() == 0;  // named nothing: taken as touching everything
    LOCKSTEP_TRY_CUDA(cudaEventRecord(fork_, after));
    LOCKSTEP_TRY_CUDA(cudaStreamWaitEvent(stream_, fork_, 0));
    try {
      f(stream_);
    } catch (...) {  // what f queued before it threw is still waited for by what touches it
      (void)cudaEventRecord(p.done, stream_);
      throw;
    }
    LOCKSTEP_TRY_CUDA(cudaEventRecord(p.done, stream_));
    return stream_;
  }

  //! cudaSuccess once every piece queued so far has finished (cudaErrorNotReady before).
  cudaError_t query() const noexcept { return stream_ == nullptr ? cudaSuccess : cudaStreamQuery(stream_); }
  void synchronize() {
    if (stream_ != nullptr) LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream_));
  }

  //! Destroys the events and the stream (whose queued work still completes). The caller has
  //! made the device current.
  void release() noexcept {
    for (const piece& p : pending_) (void)cudaEventDestroy(p.done);
    for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
    pending_.clear();
    spare_.clear();
    if (fork_ != nullptr) (void)cudaEventDestroy(fork_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    fork_ = nullptr;
    stream_ = nullptr;
  }

 private:
  struct piece {
    cudaEvent_t done = nullptr;
    std::array<device_range, max_ranges> touched{};
    std::size_t count = 0;
    bool all = false;  // named no ranges: touches anything
  };

  static bool capturing_on(cudaStream_t s) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    LOCKSTEP_TRY_CUDA(cudaStreamIsCapturing(s, &cap));
    return cap != cudaStreamCaptureStatusNone;
  }
  // cudaEventQuery from a thread that may be capturing: in relaxed mode, which cannot
  // invalidate the capture.
  static cudaError_t query_relaxed(cudaEvent_t e) noexcept {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t q = cudaEventQuery(e);
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    if (q != cudaErrorNotReady && q != cudaSuccess) check_cuda(q, "cudaEventQuery", __FILE__, __LINE__);
    return q;
  }
  static bool overlaps(const piece& p, ranges touched) {
    if (p.all) return true;
    for (std::size_t i = 0; i < p.count; ++i)
      for (const device_range& r : touched) {
        const auto a = reinterpret_cast<std::uintptr_t>(p.touched[i].data);
        const auto b = reinterpret_cast<std::uintptr_t>(r.data);
        if (a < b + r.bytes && b < a + p.touched[i].bytes) return true;
      }
    return false;
  }
  // Forgets the pieces that have finished (oldest first).
  void prune() {
    std::size_t n = 0;
    while (n < pending_.size() && query_relaxed(pending_[n].done) == cudaSuccess) ++n;
    drop(n);
  }
  void drop(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      spare_.push_back(pending_.front().done);
      pending_.pop_front();
    }
  }

  cudaStream_t stream_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  std::deque<piece> pending_;
  std::vector<cudaEvent_t> spare_;
};

}  // namespace detail
}  // namespace lockstep
