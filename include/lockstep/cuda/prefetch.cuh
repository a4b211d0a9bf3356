#pragma once
//! Prefetcher — input batches made on the host ahead of time, staged in pinned memory and
//! copied to the device on a copy stream of their own while the previous steps compute.
//!
//! A *producer* (any callable `(std::size_t index, std::span<std::byte> host) -> std::size_t`,
//! or returning void for "the whole slot") writes batch `index` into a pinned host slot of
//! slot_bytes and returns how many bytes it wrote; it runs on `workers` helper threads. There
//! are k = `slots` slots, each a pinned host buffer and a device buffer; batch i uses slot
//! i % k. One run (start(count, producer)) yields batches 0..count-1, in order, through next().
//!
//! Ordering (C: the consumer's compute stream, P: the prefetcher's copy stream, non-blocking):
//!  1. Batch i is copied host → device on P (cudaMemcpyAsync from pinned memory), then an
//!     event E_copy is recorded on P.
//!  2. next() returns batch i after making C wait for E_copy (cudaStreamWaitEvent): work
//!     queued on C afterwards sees the whole batch. The host never waits for a copy.
//!  3. The batch stays the caller's until the following next() (or start(), stop(), the
//!     destructor): that call records E_done on C, behind all work queued on C so far. The
//!     slot is refilled only after that: its next host → device copy waits on P for E_done,
//!     and its host buffer is rewritten only once its previous copy has completed. So every
//!     kernel queued on C before the following next() may read the batch, however late it
//!     runs. Work on another stream that reads a batch must itself be made to wait before
//!     C's next E_done, i.e. by an event recorded on that stream and waited for on C.
//!  4. Across runs the same holds: a new run's copies wait for E_done of the last run.
//!  5. Nothing here synchronises C with the host. The helper threads do wait on the host,
//!     for copies they issued (to reuse a pinned buffer), never for C.
//!
//! Threads. The producer runs on the helper threads, several batches at once when workers
//! > 1 (each batch its own buffer): it must be safe to call concurrently then, and must only
//! read data that stays unchanged until the run ends. next(), start() and stop() are for one
//! consumer thread (not to be called concurrently). Every method makes the device current
//! for its duration and restores the caller's.
//!
//! Errors. An exception from the producer for batch j (or a failed CUDA call while copying
//! it) is captured on its helper thread and rethrown by the next() that would return batch
//! j; batches before j come out normally, none after j does, and next() keeps rethrowing it
//! until start() or stop(). Bad configuration is a config_error; a producer that writes more
//! than slot_bytes is one too. The destructor stops the run (waiting for a producer call in
//! progress to return), waits for the copies and for C to finish with the slots, and frees
//! everything; it never throws.
//!
//! \code
//!   lockstep::Prefetcher prefetch(device, compute_stream, batch * row_bytes, {.slots = 2});
//!   auto gather = [&](std::size_t i, std::span<std::byte> host) {
//!     const auto rows = batches[i];  // e.g. sampler.batches(batch): indices into the data
//!     for (std::size_t r = 0; r < rows.size(); ++r)
//!       std::memcpy(host.data() + r * row_bytes, data + rows[r] * row_bytes, row_bytes);
//!     return rows.size() * row_bytes;  // bytes to copy to the device
//!   };
//!   prefetch.start(batches.size(), gather);
//!   for (std::size_t i = 0; i < batches.size(); ++i) {
//!     const lockstep::prefetched_batch b = prefetch.next();  // on the device, ordered on C
//!     step<<<grid, block, 0, compute_stream>>>(b.as<const float>(), b.bytes);
//!   }
//! \endcode

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/detail/prefetch_slot.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep {

//! Tuning values for a Prefetcher.
struct PrefetchOptions {
  //! Batches in flight: the one C is using plus slots − 1 made ahead. 2 overlaps making and
  //! copying batch i+1 with the compute of batch i; more absorbs an uneven producer.
  std::size_t slots = 2;
  //! Helper threads running the producer (each on its own batch).
  std::size_t workers = 1;
  //! next() waits at most this long for a batch (then timeout_error); 0: no limit.
  std::chrono::milliseconds timeout{0};
};

//! One batch on the device, as next() returns it: valid until the following next().
struct prefetched_batch {
  void* data = nullptr;   //!< device memory of the slot (slot_bytes, 256-byte aligned)
  std::size_t bytes = 0;  //!< what the producer wrote (and was copied)
  std::size_t index = 0;  //!< the batch's number in this run
  template <class T>
  T* as(std::size_t byte_offset = 0) const noexcept {
    return reinterpret_cast<T*>(static_cast<std::byte*>(data) + byte_offset);
  }
};

class Prefetcher {
 public:
  //! The producer of batch `index`: writes it into `host` (pinned, slot_bytes) and returns
  //! the number of bytes written, which is what is copied to the device.
  using producer_fn = std::function<std::size_t(std::size_t index, std::span<std::byte> host)>;

  //! Slots of `slot_bytes` (the largest batch) on `device`, consumed on `compute` (a stream
  //! of that device; nullptr is the legacy default stream).
  Prefetcher(int device, cudaStream_t compute, std::size_t slot_bytes, PrefetchOptions opts = {})
      : device_(device), compute_(compute), bytes_(slot_bytes), opts_(opts) {
    if (opts.slots == 0)
      throw config_error("Prefetcher: PrefetchOptions::slots is 0; give at least 1 (2, the default, "
                         "makes batch i+1 while batch i computes)");
    if (opts.workers == 0)
      throw config_error("Prefetcher: PrefetchOptions::workers is 0; give at least 1 helper thread "
                         "to run the producer");
    if (slot_bytes == 0)
      throw config_error("Prefetcher: slot_bytes is 0; give the size in bytes of the largest batch "
                         "the producer writes");
    detail::device_guard g(device_);
    try {
      allocate();
    } catch (...) {
      free_all();  // on our device, which the guard still holds
      throw;
    }
  }

  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  ~Prefetcher() {
    halt();
    detail::device_guard g(device_, std::nothrow);
    if (holding_) (void)cudaEventRecord(slots_[held_].done.e, compute_);
    // Nothing of ours may be in use on the device when it is freed: the copies on P, and C's
    // reads of every slot (each read is followed by that slot's E_done on C).
    if (copy_.s != nullptr) (void)cudaStreamSynchronize(copy_.s);
    for (slot& s : slots_) (void)cudaEventSynchronize(s.done.e);
    free_all();
  }

  //! Begins a run of `count` batches made by `producer` (see the top of this file), after
  //! stopping the previous run. The producer is copied; it may capture by reference what
  //! outlives the run.
  template <class F>
  void start(std::size_t count, F&& producer) {
    using host_span = std::span<std::byte>;
    static_assert(std::is_invocable_v<F&, std::size_t, host_span>,
                  "Prefetcher::start: the producer must be callable as producer(std::size_t index, "
                  "std::span<std::byte> host), writing batch `index` into `host`");
    using R = std::invoke_result_t<F&, std::size_t, host_span>;
    static_assert(std::is_void_v<R> || std::is_convertible_v<R, std::size_t>,
                  "Prefetcher::start: the producer must return the number of bytes it wrote "
                  "(std::size_t), or void for the whole slot");
    if constexpr (std::is_void_v<R>) {
      begin(count, [p = std::forward<F>(producer)](std::size_t i, host_span h) mutable -> std::size_t {
        p(i, h);
        return h.size();
      });
    } else {
      begin(count, producer_fn(std::forward<F>(producer)));
    }
  }

  //! The next batch of the run, on the device, with C made to wait for its copy. Releases the
  //! batch the previous call returned (E_done on C). Throws what the producer threw for this
  //! batch; config_error past the end of the run or before start(); timeout_error after
  //! PrefetchOptions::timeout.
  prefetched_batch next() {
    if (!running_) throw config_error("Prefetcher::next: no run is started; call start(count, producer) first");
    const std::size_t i = taken_;
    if (i >= count_)
      throw config_error("Prefetcher::next: all " + std::to_string(count_) +
                         " batches of this run were taken; call start() for the next run (epoch)");
    detail::device_guard g(device_);
    release();
    const std::size_t s = i % slots_.size();
    std::size_t used = 0;
    {
      std::unique_lock lk(m_);
      const auto ready = [&] { return issued_[s] > i || error_at_ <= i; };
      if (!ready()) {
        const auto t0 = std::chrono::steady_clock::now();
        bool arrived = true;
        if (opts_.timeout.count() > 0) arrived = cv_.wait_for(lk, opts_.timeout, ready);
        else cv_.wait(lk, ready);
        waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!arrived)
          throw timeout_error("Prefetcher::next: batch " + std::to_string(i) + " was not ready after " +
                              std::to_string(opts_.timeout.count()) +
                              " ms; the producer is slower than that or blocked (raise "
                              "PrefetchOptions::timeout, or 0 for no limit)");
      }
      if (error_at_ <= i) std::rethrow_exception(error_);
      used = slots_[s].used;
    }
    LOCKSTEP_TRY_CUDA(cudaStreamWaitEvent(compute_, slots_[s].copied.e, 0));
    holding_ = true;
    held_ = s;
    taken_ = i + 1;
    return {slots_[s].dev.get(), used, i};
  }

  //! Ends the run: batches not yet taken are dropped, the helper threads finish the producer
  //! call they are in and exit, and the batch last returned is released (E_done on C).
  void stop() {
    halt();
    detail::device_guard g(device_);
    release();
    running_ = false;
  }

  //! Batches of this run not yet returned by next().
  std::size_t remaining() const noexcept { return running_ ? count_ - taken_ : 0; }
  //! Host seconds next() spent waiting for batches not ready yet, over this object's life:
  //! near 0 when input keeps up with compute.
  double wait_seconds() const noexcept { return waited_; }
  std::size_t slot_bytes() const noexcept { return bytes_; }
  std::size_t slots() const noexcept { return slots_.size(); }
  const PrefetchOptions& options() const noexcept { return opts_; }
  int device() const noexcept { return device_; }
  cudaStream_t compute_stream() const noexcept { return compute_; }
  cudaStream_t copy_stream() const noexcept { return copy_.s; }

 private:
  using host_free = detail::pinned_free;  // cuda/detail/prefetch_slot.cuh
  using event = detail::owned_event;
  using stream = detail::owned_stream;
  using slot = detail::prefetch_slot;

  static constexpr std::size_t none = std::numeric_limits<std::size_t>::max();

  void allocate() {
    LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&copy_.s, cudaStreamNonBlocking));
    const CudaMemory mem(device_, copy_.s);
    slots_.resize(opts_.slots);
    for (slot& s : slots_)
      detail::allocate_prefetch_slot(s, bytes_, mem, static_cast<std::size_t>(&s - slots_.data()), slots_.size());
    issued_.assign(slots_.size(), 0);
  }

  // Events, buffers and the stream, released while our device is current.
  void free_all() noexcept {
    slots_.clear();
    if (copy_.s != nullptr) (void)cudaStreamDestroy(std::exchange(copy_.s, nullptr));
  }

  void begin(std::size_t count, producer_fn producer) {
    if (!producer) throw config_error("Prefetcher::start: the producer is empty; pass a callable");
    stop();
    {
      std::lock_guard lk(m_);
      producer_ = std::move(producer);
      count_ = count;
      claimed_ = released_ = 0;
      issued_.assign(slots_.size(), 0);
      error_at_ = none;
      error_ = nullptr;
      halting_ = false;
    }
    taken_ = 0;
    running_ = true;
    const std::size_t n = std::min(opts_.workers, count);
    try {
      for (std::size_t w = 0; w < n; ++w) threads_.emplace_back([this] { work(); });
    } catch (...) {
      stop();
      throw;
    }
  }

  // Consumer: the batch last returned goes back, after all the work queued on C so far.
  void release() {
    if (!holding_) return;
    LOCKSTEP_TRY_CUDA(cudaEventRecord(slots_[held_].done.e, compute_));
    holding_ = false;
    {
      std::lock_guard lk(m_);
      released_ = taken_;
    }
    cv_.notify_all();
  }

  // Stops the helper threads and joins them; the run's state stays for the caller to reset.
  void halt() noexcept {
    {
      std::lock_guard lk(m_);
      halting_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    producer_ = nullptr;  // what it captured is let go with the run
  }

  // Waits (holding lk) until `cond` or until batch i will never be taken; false for the latter.
  template <class Cond>
  bool wait_until(std::unique_lock<std::mutex>& lk, std::size_t i, Cond cond) {
    cv_.wait(lk, [&] { return halting_ || error_at_ < i || cond(); });
    return !halting_ && error_at_ >= i;
  }

  // A helper thread: claims batch indices in order and makes, copies and publishes each.
  void work() noexcept {
    const cudaError_t on_device = cudaSetDevice(device_);
    const std::size_t k = slots_.size();
    for (;;) {
      std::size_t i = 0;
      {
        std::lock_guard lk(m_);
        if (halting_ || claimed_ >= count_ || error_at_ < claimed_) return;
        i = claimed_++;
      }
      slot& s = slots_[i % k];
      try {
        detail::check_cuda(on_device, "cudaSetDevice (Prefetcher helper thread)", __FILE__, __LINE__);
        {
          // The host buffer: its copy of batch i - k was issued (this run) ...
          std::unique_lock lk(m_);
          if (!wait_until(lk, i, [&] { return i < k || issued_[i % k] > i - k; })) continue;
        }
        // ... and has completed (this run or an earlier one).
        LOCKSTEP_TRY_CUDA(cudaEventSynchronize(s.copied.e));
        const std::size_t used = producer_(i, std::span<std::byte>(s.host.get(), bytes_));
        if (used > bytes_)
          throw config_error("Prefetcher: the producer wrote " + std::to_string(used) + " bytes for batch " +
                             std::to_string(i) + " into a slot of " + std::to_string(bytes_) +
                             "; construct the Prefetcher with the largest batch's size");
        {
          // The device buffer: the consumer released batch i - k (this run) ...
          std::unique_lock lk(m_);
          if (!wait_until(lk, i, [&] { return i < k || released_ > i - k; })) continue;
        }
        // ... and the copy waits on the device until C is done with it (E_done, any run).
        LOCKSTEP_TRY_CUDA(cudaStreamWaitEvent(copy_.s, s.done.e, 0));
        if (used > 0)
          LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(s.dev.get(), s.host.get(), used, cudaMemcpyHostToDevice, copy_.s));
        LOCKSTEP_TRY_CUDA(cudaEventRecord(s.copied.e, copy_.s));
        {
          std::lock_guard lk(m_);
          s.used = used;
          issued_[i % k] = i + 1;
        }
      } catch (...) {
        std::lock_guard lk(m_);
        if (i < error_at_) {
          error_at_ = i;
          error_ = std::current_exception();
        }
      }
      cv_.notify_all();
    }
  }

  int device_;
  cudaStream_t compute_;
  std::size_t bytes_;
  PrefetchOptions opts_;
  stream copy_;
  std::vector<slot> slots_;

  // Shared with the helper threads, under m_.
  std::mutex m_;
  std::condition_variable cv_;
  std::size_t count_ = 0;            // batches in this run
  std::size_t claimed_ = 0;          // next index a helper thread takes
  std::size_t released_ = 0;         // batches the consumer has given back
  std::vector<std::size_t> issued_;  // per slot: 1 + the batch last copied into it this run
  std::size_t error_at_ = none;      // the first batch that failed, and why
  std::exception_ptr error_;
  bool halting_ = false;
  producer_fn producer_;  // set before the threads start, reset after they are joined

  // The consumer's own.
  std::vector<std::thread> threads_;
  bool running_ = false;
  std::size_t taken_ = 0;
  bool holding_ = false;
  std::size_t held_ = 0;
  double waited_ = 0;
};

}  // namespace lockstep