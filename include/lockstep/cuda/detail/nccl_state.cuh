#pragma once
//! What one NcclComm owns (its NCCL communicator, streams, events, order-check buffer and the
//! markers of collectives in flight) and the family it belongs to: the communicator a rank
//! was given and every one split from it, so that abort(), the watchdog's overdue() and
//! check_async_error() reach all of them (a failure in one group ends the whole job).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/cuda/detail/nccl_work.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::detail {

struct nccl_state;

//! A rank's communicators: the first one and those split from it (weakly held: a destroyed
//! sub-communicator drops out).
struct nccl_family {
  std::mutex m;
  std::vector<std::weak_ptr<nccl_state>> members;

  void add(const std::shared_ptr<nccl_state>& s) {
    std::lock_guard lk(m);
    std::erase_if(members, [](const auto& w) { return w.expired(); });
    members.push_back(s);
  }
  //! The live members, oldest first (the rank's first communicator leads).
  std::vector<std::shared_ptr<nccl_state>> live() {
    std::lock_guard lk(m);
    std::vector<std::shared_ptr<nccl_state>> out;
    for (const auto& w : members)
      if (auto s = w.lock()) out.push_back(std::move(s));
    return out;
  }
};

struct nccl_state {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 0;
  int device = 0;
  cudaStream_t comm_stream = nullptr;
  cudaStream_t own_compute = nullptr;
  cudaStream_t compute = nullptr;
  cudaEvent_t ready = nullptr;  // "compute work so far", re-recorded by each collective
  int* barrier_buf = nullptr;
  std::shared_ptr<event_pool> events;
  std::shared_ptr<nccl_family> family;
  //! A sub-communicator keeps the one it was split from alive (it may use its compute stream).
  std::shared_ptr<nccl_state> parent;
  std::string group_name;  //!< "" for a rank's first communicator, else e.g. "split 1 (colour 0)"
  std::atomic<bool> released{false};  // the comm was destroyed or aborted: exactly once
  std::mutex abort_m;                 // ncclCommAbort vs a watchdog's ncclCommGetAsyncError
  std::atomic<bool> aborted{false};   // set after abort_reason is written
  std::string abort_reason;
  // LOCKSTEP_DEBUG=1: every collective is preceded by an all-gather of its description.
  bool check_order = false;
  std::uint64_t calls = 0;   // collectives called so far: the "#n" of messages
  std::uint64_t splits = 0;  // split() calls so far, for sub-communicators' names
  std::int64_t* debug_buf = nullptr;  // size × order_words int64 on the device
  std::string next_label;             // label_next(): the next collective's label
  // track_collectives(): markers of collectives in flight, oldest first.
  struct tracked {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point issued;
    collective what;
  };
  bool tracking = false;
  std::mutex track_m;
  std::deque<tracked> pending;
  std::vector<cudaEvent_t> spare;

  nccl_state() = default;
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;
  ~nccl_state() {
    device_guard g(device, std::nothrow);
    if (comm != nullptr && !released.exchange(true)) {
      const ncclResult_t r = ncclCommDestroy(comm);
      if (r != ncclSuccess)
        std::fprintf(stderr, "lockstep: ncclCommDestroy on rank %d failed: %s\n", rank, ncclGetErrorString(r));
    }
    if (barrier_buf != nullptr) (void)cudaFree(barrier_buf);
    if (debug_buf != nullptr) (void)cudaFree(debug_buf);
    if (ready != nullptr) (void)cudaEventDestroy(ready);
    for (const auto& p : pending) (void)cudaEventDestroy(p.event);
    for (cudaEvent_t e : spare) (void)cudaEventDestroy(e);
    // Streams with queued work are released once it completes (cudaStreamDestroy).
    if (comm_stream != nullptr) (void)cudaStreamDestroy(comm_stream);
    if (own_compute != nullptr) (void)cudaStreamDestroy(own_compute);
  }

  //! "rank 1" or "rank 1 (rank 0 of split 2 (colour 1))": who, in messages.
  std::string who() const {
    if (group_name.empty() || !parent) return "rank " + std::to_string(rank);
    return parent->who() + " (rank " + std::to_string(rank) + " of " + group_name + ")";
  }
};

// The order check's words per rank: the descriptor, the label's hash, then the label's text
// (truncated to label_words·8 − 1 bytes, NUL-padded), so a mismatch names both buckets.
inline constexpr std::size_t label_words = 16;
inline constexpr std::size_t order_words = collective::encoded_size + 1 + label_words;

inline std::array<std::int64_t, order_words> encode_order(const collective& c) {
  std::array<std::int64_t, order_words> w{};
  const auto e = c.encode();
  std::copy(e.begin(), e.end(), w.begin());
  w[collective::encoded_size] = c.label_hash();
  char text[label_words * 8] = {};
  std::memcpy(text, c.label.data(), std::min(c.label.size(), sizeof text - 1));
  std::memcpy(w.data() + collective::encoded_size + 1, text, sizeof text);
  return w;
}

//! Every rank's call from the gathered words; a label too long for the words ends in "…#<hash>"
//! so that two long labels that differ only past the cut still compare different.
inline std::vector<collective> decode_order(std::span<const std::int64_t> all, int ranks) {
  std::vector<collective> calls;
  for (int r = 0; r < ranks; ++r) {
    const auto w = all.subspan(static_cast<std::size_t>(r) * order_words, order_words);
    collective c = collective::decode(w.first<collective::encoded_size>());
    char text[label_words * 8];
    std::memcpy(text, w.data() + collective::encoded_size + 1, sizeof text);
    text[sizeof text - 1] = '\0';
    c.label = text;
    const std::int64_t hash = w[collective::encoded_size];
    if (c.label.size() == sizeof text - 1 || (hash != 0 && c.label.empty()))
      c.label += "…#" + std::to_string(hash);
    calls.push_back(std::move(c));
  }
  return calls;
}

//! ncclCommAbort of one communicator, once; the reason is what later calls report.
inline void nccl_abort(nccl_state& s, std::string_view reason) noexcept {
  if (s.released.exchange(true)) return;
  try {
    s.abort_reason.assign(reason);
  } catch (...) {
  }
  s.aborted.store(true, std::memory_order_release);
  device_guard g(s.device, std::nothrow);
  std::lock_guard lk(s.abort_m);
  const ncclResult_t r = ncclCommAbort(s.comm);
  if (r != ncclSuccess)
    std::fprintf(stderr, "lockstep: ncclCommAbort on rank %d failed: %s\n", s.rank, ncclGetErrorString(r));
}

inline std::optional<std::string> nccl_overdue(nccl_state& s, std::chrono::milliseconds limit) {
  if (s.aborted.load(std::memory_order_acquire)) return std::nullopt;
  device_guard g(s.device, std::nothrow);
  // A query from this (watchdog) thread must not invalidate a graph capture the rank's own
  // thread may be running in cudaStreamCaptureModeGlobal: relaxed mode for its duration.
  struct relaxed_capture {
    cudaStreamCaptureMode old = cudaStreamCaptureModeRelaxed;
    relaxed_capture() { (void)cudaThreadExchangeStreamCaptureMode(&old); }
    ~relaxed_capture() { (void)cudaThreadExchangeStreamCaptureMode(&old); }
  } relaxed;
  std::lock_guard lk(s.track_m);
  while (!s.pending.empty()) {
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
  return s.who() + ": " + p.what.describe() + " has not completed " + std::to_string(ms / 1000) + "." +
         std::to_string(ms % 1000 / 100) +
         " s after it was issued: a peer never issued it (it died, hangs, or called a different "
         "collective; LOCKSTEP_DEBUG=1 checks the order)";
}

// track_collectives(): a marker event after each collective, with its issue time. Not
// while the stream is being captured into a graph (a marker would join the capture).
inline void nccl_track(nccl_state& s, const collective& c) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  LOCKSTEP_TRY_CUDA(cudaStreamIsCapturing(s.comm_stream, &cap));
  if (cap != cudaStreamCaptureStatusNone) return;
  std::lock_guard lk(s.track_m);
  cudaEvent_t e = nullptr;
  if (!s.spare.empty()) {
    e = s.spare.back();
    s.spare.pop_back();
  } else {
    LOCKSTEP_TRY_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  const cudaError_t r = cudaEventRecord(e, s.comm_stream);
  if (r != cudaSuccess) {
    s.spare.push_back(e);
    check_cuda(r, "cudaEventRecord(marker, comm_stream)", __FILE__, __LINE__);
  }
  s.pending.push_back({e, std::chrono::steady_clock::now(), c});
}

}  // namespace lockstep::detail
