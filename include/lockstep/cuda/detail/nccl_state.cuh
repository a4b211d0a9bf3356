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
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/cuda/detail/nccl_aside.cuh"
#include "lockstep/cuda/detail/nccl_seals.cuh"
#include "lockstep/cuda/detail/nccl_work.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/peer_reduce.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::detail {

struct nccl_state;

//! A rank's communicators: the first one and those split from it (weakly held: a destroyed
//! sub-communicator drops out). Once aborted, the family stays aborted: a member that joins
//! later (a split racing abort()) is told so by add() and must abort itself.
struct nccl_family {
  std::mutex m;
  std::vector<std::weak_ptr<nccl_state>> members;
  bool aborted = false;      // under m
  std::string abort_reason;  // under m

  //! Why the family was aborted, if it was: then `s` joined too late and must be aborted.
  std::optional<std::string> add(const std::shared_ptr<nccl_state>& s) {
    std::lock_guard lk(m);
    std::erase_if(members, [](const auto& w) { return w.expired(); });
    members.push_back(s);
    if (aborted) return abort_reason;
    return std::nullopt;
  }
  //! The live members, oldest first (the rank's first communicator leads).
  std::vector<std::shared_ptr<nccl_state>> live() {
    std::lock_guard lk(m);
    return live_locked();
  }
  //! Marks the family aborted and returns the members to abort, under one lock: a member
  //! added concurrently is either among them or told by add().
  std::vector<std::shared_ptr<nccl_state>> abort_all(std::string_view reason) {
    std::lock_guard lk(m);
    if (!aborted) {
      aborted = true;
      try {
        abort_reason.assign(reason);
      } catch (...) {
      }
    }
    return live_locked();
  }
  bool was_aborted() {
    std::lock_guard lk(m);
    return aborted;
  }

 private:
  std::vector<std::shared_ptr<nccl_state>> live_locked() {
    // Reserved first, so nothing throws once a member is locked: a last owner dropped here
    // would run ~nccl_state, which takes m again.
    std::vector<std::shared_ptr<nccl_state>> out;
    out.reserve(members.size());
    for (const auto& w : members)
      if (auto s = w.lock()) out.push_back(std::move(s));
    return out;
  }
};

struct nccl_state {
  //! nullptr in a group of one rank: NCCL's communicator would hold about half a GiB of device
  //! buffers (measured on H100, NCCL 2.28) for collectives with nothing to exchange, so none
  //! is made and each collective is a copy on the communication stream (nccl_local).
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 0;
  int device = 0;
  //! The rank as launched (rank here until regroup() makes a smaller group of the job).
  int job_rank = 0;
  cudaStream_t comm_stream = nullptr;
  //! The second stream, for the kernels after a transfer (cuda/detail/nccl_aside.cuh).
  nccl_aside aside;
  cudaStream_t own_compute = nullptr;
  cudaStream_t compute = nullptr;  // unused while follows_parent
  //! A sub-communicator orders on its parent's compute stream, including one the parent is
  //! given later, until set_compute_stream() gives it its own.
  bool follows_parent = false;
  cudaEvent_t ready = nullptr;  // "compute work so far", re-recorded by each collective
  int* barrier_buf = nullptr;
  std::shared_ptr<event_pool> events;
  std::shared_ptr<nccl_family> family;
  //! A sub-communicator keeps the one it was split from alive (it may use its compute stream).
  std::shared_ptr<nccl_state> parent;
  std::string group_name;             //!< "" for a rank's first communicator, else e.g. "split 1 (colour 0)"
  std::atomic<bool> released{false};  // the comm was destroyed or aborted: exactly once
  std::mutex abort_m;                 // ncclCommAbort vs a watchdog's ncclCommGetAsyncError
  std::atomic<bool> aborted{false};   // set after abort_reason is written
  std::string abort_reason;
  // The order check (comm/order_check.hpp): every collective is preceded by an all-gather of
  // its description, compared behind the training (or, LOCKSTEP_DEBUG=1, at once).
  nccl_seals seals;
  std::uint64_t calls = 0;     // collectives called so far: the "#n" of messages
  std::uint64_t splits = 0;    // split() calls so far, for sub-communicators' names
  std::uint64_t launches = 0;  // tracked_launch() calls so far (graph replays), for messages
  std::string next_label;      // label_next(): the next collective's label
  // track_collectives(): markers of collectives in flight, oldest first. Only the last one
  // may be unrecorded: its NCCL call has not returned yet (nccl_marker).
  struct tracked {
    cudaEvent_t event;
    bool recorded;
    std::chrono::steady_clock::time_point issued;
    collective what;
    bool order_check;  // the order check's all-gather before `what`, not `what` itself
  };
  bool tracking = false;
  std::mutex track_m;
  std::deque<tracked> pending;
  std::vector<cudaEvent_t> spare;
  // The symmetric windows of this communicator (nccl_window.cuh), [start, start + bytes), for
  // telling which collectives the copy engines (in_window) and lockstep's peer all-reduce
  // (peer_args) can do; `bases`, each rank's base of the window as this rank addresses them,
  // is filled in for the peer kernel (peer_add_window; else bases[0] is null).
  struct window_entry {
    std::uintptr_t start;
    std::size_t bytes;
    std::array<char*, cuda::kernels::peer_max_ranks> bases{};
  };
  std::mutex windows_m;
  std::vector<window_entry> windows;  // under windows_m
  // A copy-engine group (NcclComm::copy_engine_group): the staging windows its reduce-scatters
  // receive into, the newest last (an older one may still be read by a reduction in flight:
  // all go with the communicator).
  bool copy_engines = false;
  struct staging_window {
    void* memory;
    void* window;  // ncclWindow_t
    std::size_t bytes;
  };
  std::vector<staging_window> staging;
  // NcclComm::symmetric_kernels(), decided once for the group (nccl_symmetric.cuh): -1 not yet,
  // else 0/1, with the reason.
  int symmetric = -1;
  std::string symmetric_why;
  bool one_process = false;  // one of create_local()'s group: every rank a thread of this process
  // lockstep's peer all-reduce of buffers in symmetric windows (nccl_peer.cuh), set up with
  // symmetric_kernels(): buffers up to max_bytes, grids up to `blocks`; the flags' window (its
  // seal slots too) and each rank's base of it as this rank addresses them; per-block call
  // counters; two words of mapped host memory ([0] abort: set before ncclCommAbort, [1] why a
  // kernel gave up). The windows it reduces in are `windows` with their bases.
  struct peer_reduce {
    std::size_t max_bytes = 0;  // 0: not used
    int blocks = cuda::kernels::peer_default_blocks;
    void* signal = nullptr;
    void* signal_window = nullptr;  // ncclWindow_t
    std::array<unsigned*, cuda::kernels::peer_max_ranks> flags{};
    unsigned* epochs = nullptr;
    int* words = nullptr;
    int* words_device = nullptr;
    std::chrono::milliseconds timeout{0};
  } peer;

  nccl_state() = default;
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;
  ~nccl_state() {
    device_guard g(device, std::nothrow);
    // The order check's pinned words go after the communicator, and only where nothing can be
    // stuck (cudaFreeHost waits for the device): after an abort or a timeout they are leaked.
    bool leak_seals = aborted.load();
    if (comm != nullptr && !released.exchange(true)) {
      const bool destroy = drained();
      if (destroy) free_staging();  // else leaked: a copy may still be queued against it
      const ncclResult_t r = destroy ? ncclCommDestroy(comm) : ncclCommAbort(comm);
      if (r != ncclSuccess)
        std::fprintf(stderr, "lockstep: %s on rank %d failed: %s\n", destroy ? "ncclCommDestroy" : "ncclCommAbort",
                     rank, ncclGetErrorString(r));
      leak_seals = leak_seals || !destroy;
    }
    seals.release(leak_seals);
    if (barrier_buf != nullptr) (void)cudaFree(barrier_buf);
    if (ready != nullptr) (void)cudaEventDestroy(ready);
    for (const auto& p : pending) (void)cudaEventDestroy(p.event);
    for (cudaEvent_t e : spare) (void)cudaEventDestroy(e);
    // Streams with queued work are released once it completes (cudaStreamDestroy).
    aside.release();
    if (comm_stream != nullptr) (void)cudaStreamDestroy(comm_stream);
    if (own_compute != nullptr) (void)cudaStreamDestroy(own_compute);
  }

  std::size_t staging_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& w : staging) n += w.bytes;
    return n;
  }
  // Deregisters and frees the staging windows and the peer all-reduce's flags, counters and
  // words (only once no collective is in flight).
  void free_staging() noexcept {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    for (const auto& w : staging) {
      (void)ncclCommWindowDeregister(comm, static_cast<ncclWindow_t>(w.window));
      (void)ncclMemFree(w.memory);
    }
#endif
    staging.clear();
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    if (peer.signal_window != nullptr)
      (void)ncclCommWindowDeregister(comm, static_cast<ncclWindow_t>(peer.signal_window));
    if (peer.signal != nullptr) (void)ncclMemFree(peer.signal);
#endif
    if (peer.epochs != nullptr) (void)cudaFree(peer.epochs);
    if (peer.words != nullptr) (void)cudaFreeHost(peer.words);
    peer.signal = peer.signal_window = nullptr;
    peer.epochs = nullptr;
    peer.words = nullptr;
  }

  //! Why a peer all-reduce gave up (it waited LOCKSTEP_TIMEOUT for a rank), if one did.
  std::optional<std::string> peer_failure() const {
    if (peer.words == nullptr) return std::nullopt;
    const int code = static_cast<const volatile int*>(peer.words)[1];
    if (code <= 0) return std::nullopt;  // -1: ended by abort(), which says why itself
    return who() + ": lockstep's peer all-reduce (a buffer in a symmetric window) waited " +
           std::to_string(peer.timeout.count() / 1000) + " s (LOCKSTEP_TIMEOUT + 2 s) for rank " +
           std::to_string(code - 1) +
           ", which never reached it (it died, hangs, or called a different collective); its result is not valid";
  }

  //! "rank 1" or "rank 1 (rank 0 of split 2 (colour 1))": who, in messages.
  std::string who() const {
    if (group_name.empty() || !parent) return "rank " + std::to_string(rank);
    return parent->who() + " (rank " + std::to_string(rank) + " of " + group_name + ")";
  }

  cudaStream_t compute_stream() const noexcept { return follows_parent && parent ? parent->compute_stream() : compute; }

  // Whether ncclCommDestroy may end the communicator (and whether a window's memory may go,
  // nccl_window.cuh). It waits for every collective in flight, and a communicator being
  // destroyed has left its family, so abort() no longer reaches it: one whose peer never
  // comes would hold this thread for ever. So wait here for
  // the communication stream, at most LOCKSTEP_TIMEOUT (a wait on other ranks), and say no
  // (ncclCommAbort) once the family is aborted, NCCL reports an error, or the time is up.
  // Collectives still running are not killed early: their results may yet be read.
  bool drained() const noexcept {
    if (family && family->was_aborted()) return false;
    if (comm_stream == nullptr) return true;  // nothing was issued
    std::chrono::milliseconds limit{60000};
    try {
      limit = default_timeout();
    } catch (...) {  // a malformed LOCKSTEP_TIMEOUT was reported where it was first read
    }
    const auto start = std::chrono::steady_clock::now();
    for (auto pause = std::chrono::milliseconds(1);; pause = std::min(2 * pause, std::chrono::milliseconds(50))) {
      cudaError_t q = cudaStreamQuery(comm_stream);
      if (q == cudaSuccess) q = aside.query();              // its kernels may still read the wires' staging
      if (q != cudaErrorNotReady) return q == cudaSuccess;  // a failed device: abort, do not wait
      ncclResult_t r = ncclSuccess;
      if (comm != nullptr &&
          (ncclCommGetAsyncError(comm, &r) != ncclSuccess || (r != ncclSuccess && r != ncclInProgress)))
        return false;
      if (family && family->was_aborted()) return false;
      if (std::chrono::steady_clock::now() - start >= limit) {
        try {
          std::fprintf(stderr,
                       "lockstep: %s: a collective was still running %lld s after its communicator was destroyed "
                       "(a peer never issued it?); aborting it (ncclCommAbort) instead of waiting for ever\n",
                       who().c_str(), static_cast<long long>(limit.count() / 1000));
        } catch (...) {
        }
        return false;
      }
      std::this_thread::sleep_for(pause);
    }
  }
};

//! A collective of a group of one rank (nccl_state::comm): recv ← send, `bytes` of them, queued
//! on `stream`; nothing when in place.
inline void nccl_local(const void* send, void* recv, std::size_t bytes, cudaStream_t stream) {
  if (send != recv && bytes != 0)
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, stream));
}

// On one rank (a split's group of one has an NCCL communicator), avg is the identity: send it
// as sum (a plain copy). NCCL before 2.29.7 leaves the tail of a one-rank avg unwritten
// (NVIDIA/nccl#1950; seen here with 2.28.9 at 2^20 + 3 elements).
inline ncclRedOp_t nccl_reduction(const nccl_state& s, reduce_op op) {
  return s.size == 1 && op == reduce_op::avg ? ncclSum : to_nccl(op);
}

inline void nccl_require(const void* p, const char* name, const char* what) {
  if (p == nullptr)
    throw config_error(std::string("NcclComm::") + what + ": " + name + " is null but count > 0; pass a device buffer");
}

//! Throws nccl_error if NCCL recorded an asynchronous failure on a member of the family.
inline void nccl_check_async_error(nccl_family& family) {
  for (const auto& m : family.live()) {
    std::lock_guard lk(m->abort_m);                          // not while abort() frees the communicator
    if (m->released.load() || m->comm == nullptr) continue;  // aborted, destroyed, or one rank: nothing to ask
    ncclResult_t r = ncclSuccess;
    LOCKSTEP_TRY_NCCL(ncclCommGetAsyncError(m->comm, &r));
    if (r != ncclSuccess && r != ncclInProgress)
      throw nccl_error(call_failure("ncclCommGetAsyncError", __FILE__, __LINE__, m->who() + ": " + describe_nccl(r)));
  }
}

//! ncclCommAbort of one communicator, once; the reason is what later calls report.
inline void nccl_abort(nccl_state& s, std::string_view reason) noexcept {
  if (s.released.exchange(true)) return;
  try {
    s.abort_reason.assign(reason);
  } catch (...) {
  }
  s.aborted.store(true, std::memory_order_release);
  if (s.peer.words != nullptr) static_cast<volatile int*>(s.peer.words)[0] = 1;  // ends peer kernels' waits
  device_guard g(s.device, std::nothrow);
  std::lock_guard lk(s.abort_m);
  if (s.comm == nullptr) return;  // one rank: its copies end on their own
  const ncclResult_t r = ncclCommAbort(s.comm);
  if (r != ncclSuccess)
    std::fprintf(stderr, "lockstep: ncclCommAbort on rank %d failed: %s\n", s.rank, ncclGetErrorString(r));
}

}  // namespace lockstep::detail
