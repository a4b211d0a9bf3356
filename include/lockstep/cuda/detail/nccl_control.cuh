#pragma once
//! NcclComm's failure handling and order check, a base of it (its members are NcclComm's;
//! cuda/detail/nccl_communicator.cuh says how they fit together): NCCL's asynchronous errors,
//! the order check's verdict, abort() of a rank's communicators, overdue collectives for a watchdog,
//! replays tracked like collectives, and labels.

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/detail/nccl_handle.cuh"
#include "lockstep/cuda/detail/nccl_marker.cuh"
#include "lockstep/cuda/detail/nccl_order.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/detail/nccl_work.cuh"

namespace lockstep::detail {

class nccl_control : protected nccl_handle {
 public:
  //! Throws nccl_error if NCCL has recorded an asynchronous failure on this communicator or
  //! on one split from the same (e.g. a peer's network connection broke). Cheap; meant for
  //! watchdogs and error paths.
  void check_async_error() const {
    if (s_) detail::nccl_check_async_error(*s_->family);
  }

  //! The order check (comm/order_check.hpp): the first mismatch across ranks the seals compared
  //! so far show, here or in a split of the same; never blocks, safe from a watchdog's thread.
  std::optional<std::string> order_failure() const {
    if (!s_) return std::nullopt;
    for (const auto& m : s_->family->live()) {
      if (m->aborted.load(std::memory_order_acquire)) continue;  // its seals died with it
      detail::device_guard g(m->device, std::nothrow);           // a watchdog's thread: no context on GPU 0
      if (auto why = m->seals.poll([&] { return detail::nccl_order_how(*m); })) return why;
    }
    return std::nullopt;
  }
  //! Waits (up to LOCKSTEP_TIMEOUT) for the order check of every collective issued so far on
  //! this communicator and throws mismatch_error if any differed across ranks.
  void verify_order() {
    state& s = live("verify_order");
    detail::device_guard g(s.device);
    if (!s.seals.drain(detail::default_timeout()))
      throw timeout_error("NcclComm::verify_order: " + s.who() +
                          ": the order check of earlier collectives did not "
                          "complete within LOCKSTEP_TIMEOUT (a peer never issued them)");
    live("verify_order");  // aborted meanwhile: that, not what the killed checks left
    if (auto why = order_failure()) throw mismatch_error(*why);
  }
  order_check_mode order_check() const noexcept { return s_ ? s_->seals.mode() : order_check_mode::off; }

  //! Stops this rank's communication now (ncclCommAbort), on this communicator and on every
  //! one split from the same (a failure in one group ends the job): NCCL kernels in flight
  //! quit, a thread blocked in barrier()/synchronize() is released, and every later call
  //! throws aborted_error carrying `reason`. Safe from any thread; idempotent; never throws.
  void abort(std::string_view reason = "aborted") noexcept {
    if (!s_) return;
    std::vector<std::shared_ptr<state>> all;
    try {
      // Marks the family as well: a split() racing this abort is aborted as it joins (and
      // throws aborted_error) instead of being left running, unreachable.
      all = s_->family->abort_all(reason);
    } catch (...) {
    }
    if (std::find(all.begin(), all.end(), s_) == all.end()) detail::nccl_abort(*s_, reason);
    // Newest first: a sub-group's kernel stuck on this device would keep the parent's abort
    // (which frees memory, and so waits for the device) from returning.
    for (auto m = all.rbegin(); m != all.rend(); ++m) detail::nccl_abort(**m, reason);
  }
  bool aborted() const noexcept { return s_ && s_->aborted.load(std::memory_order_acquire); }

  //! From now on remember when each collective was issued, so that overdue() can tell a
  //! collective that never completes (a peer died, hangs, or issued something else) from
  //! one that is merely slow. Costs one event record per collective. Collectives captured
  //! into a CUDA graph are not tracked. Applies to the communicators split from this one too.
  void track_collectives() {
    live("track_collectives");
    for (const auto& m : s_->family->live()) m->tracking = true;
  }

  //! With track_collectives(): a description of the oldest collective still running after
  //! `limit` on this communicator or one split from the same, else nothing. Safe to call
  //! from another thread (a watchdog) while this rank issues collectives.
  std::optional<std::string> overdue(std::chrono::milliseconds limit) const {
    if (!s_) return std::nullopt;
    for (const auto& m : s_->family->live())
      if (auto why = detail::nccl_overdue(*m, limit)) return why;
    return std::nullopt;
  }

  //! Runs launch(), which queues work holding collectives of this communicator on the compute
  //! stream (a CUDA graph replay: StepGraph, libtorch's CUDAGraph::replay()), tracked like a
  //! collective with track_collectives(): overdue() names it, "graph_replay #n of <what>", if
  //! it has not completed in time (a peer died or hangs inside the replay).
  template <class Launch>
  void tracked_launch(std::string what, Launch&& launch) {
    state& s = live("tracked_launch");
    detail::device_guard g(s.device);
    collective c;
    c.kind = collective_kind::graph_replay;
    c.seq = s.launches++;
    c.label = std::move(what);
    detail::nccl_marker mark(s, c, false, s.compute_stream());
    std::forward<Launch>(launch)();
    mark.done();
  }

  //! Labels the next collective (e.g. "bucket 3: 64 f32 at 192"): shown in overdue() and in the
  //! order check's mismatch messages, and compared there. DataParallel labels its buckets.
  void label_next(std::string label) { live("label_next").next_label = std::move(label); }

 protected:
  using nccl_handle::nccl_handle;
};

}  // namespace lockstep::detail
