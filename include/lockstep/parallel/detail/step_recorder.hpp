#pragma once
//! step_recorder — the one place a step's events go. DataParallel and the reduction units
//! say what happens (a micro-step begins, the model's part ends, a unit's collective is issued
//! or waited for, a bucket is handed to the optimizer, the gradients are unscaled or clipped);
//! the recorder feeds every consumer from that: NVTX ranges (observe/detail/nvtx.hpp), the
//! Chrome trace when LOCKSTEP_TRACE is set (observe/detail/trace.hpp), and sync_stats's
//! timings and counters. Listeners see each launch unit just before its collective (the
//! non-finite origin check after a skipped step, nonfinite.hpp, is one).
//!
//! Timing rule: the host time of every `issue` and `wait` scope is communication
//! (sync_stats::comm_seconds); the model's time is a micro-step's step() to its finish(), less
//! the communication meanwhile.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "lockstep/core/dtype.hpp"
#include "lockstep/observe/detail/nvtx.hpp"
#include "lockstep/observe/detail/trace.hpp"
#include "lockstep/parallel/step.hpp"

namespace lockstep::detail {

//! What a step does, as the recorder sees it. issue_* and wait_* are communication.
enum class step_event : int {
  finish,         // finish(): unscaling, checks, clipping, callbacks and the waits in it
  unscale,        // unscale + inf/NaN check
  clip,           // clip by global norm
  callback,       // a bucket (or shard) handed to the optimizer; index: the bucket
  issue_reduce,   // a unit's all-reduce issued; index: its first bucket
  issue_scatter,  // a unit's reduce-scatter issued
  issue_gather,   // a unit's all-gather issued (its values, after the optimizer)
  wait_reduce,    // waiting for a unit's all-reduce
  wait_scatter,   // waiting for a unit's reduce-scatter
  wait_gather,    // waiting for a unit's all-gather
};

//! One launch unit's local gradients, just before its collective (prescaled, packed).
struct unit_launch {
  void* data = nullptr;
  std::size_t count = 0;
  dtype type = dtype::f32;
};

class step_recorder {
 public:
  using clock = trace_log::clock;
  using launch_listener = std::function<void(const unit_launch&)>;

  //! LOCKSTEP_TRACE decides whether this rank keeps a trace (trace_log::from_env).
  explicit step_recorder(int rank) : trace_(trace_log::from_env(rank)) {}

  sync_stats& stats() noexcept { return stats_; }
  const sync_stats& stats() const noexcept { return stats_; }
  trace_log* trace() const noexcept { return trace_.get(); }

  //! An event from construction to destruction (see step_event).
  class scope {
   public:
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() { rec_.end(*this); }

   private:
    friend class step_recorder;
    scope(step_recorder& rec, step_event e, std::int64_t index, std::uint64_t key)
        : rec_(rec), nvtx_(event_name(e), index), e_(e), index_(index), key_(key), t0_(clock::now()) {}
    step_recorder& rec_;
    nvtx_range nvtx_;
    step_event e_;
    std::int64_t index_;
    std::uint64_t key_;
    clock::time_point t0_;
  };

  //! An event with its bucket (index ≥ 0) where it has one.
  [[nodiscard]] scope record(step_event e, std::int64_t index = -1) { return scope(*this, e, index, 0); }
  //! A collective issued: `key` names it until the wait of the same key ends (any number
  //! unique among those in flight); bytes and type go into the trace.
  [[nodiscard]] scope issue(step_event e, std::int64_t index, std::uint64_t key, std::size_t bytes, dtype type) {
    if (trace_) in_flight_[key] = {clock::now(), bytes, type};
    return scope(*this, e, index, key);
  }
  //! Waiting for the collective `key`: the trace shows it from its issue to the end of this.
  [[nodiscard]] scope wait(step_event e, std::int64_t index, std::uint64_t key) { return scope(*this, e, index, key); }
  //! A collective's elements went out (sync_stats's counters).
  void reduced(std::size_t bytes) noexcept {
    ++stats_.buckets_reduced;
    stats_.bytes_reduced += bytes;
  }

  //! listener(unit) before each launch unit's collective; an empty one stops it.
  void listen_launches(launch_listener listener) { launch_ = std::move(listener); }
  void launching(void* data, std::size_t count, dtype type) const {
    if (launch_) launch_(unit_launch{data, count, type});
  }

  //! A micro-step begins (step()) — or, not counted in sync_stats::micro_steps, a shadow
  //! step of a rank in a Join scope.
  void step_begin(bool sync, bool counted = true) {
    nvtx_end(std::exchange(nvtx_step_, 0));  // a step abandoned by an exception
    nvtx_end(std::exchange(nvtx_model_, 0));
    nvtx_step_ = nvtx_start("step");
    nvtx_model_ = nvtx_start(model_name(sync));
    step_t0_ = clock::now();
    comm_at_step_ = stats_.comm_seconds;
    if (counted) ++stats_.micro_steps;
  }
  //! The model's part ends (finish() is called): sync_stats::model_seconds at a cycle's end.
  void model_end(bool sync) {
    const auto t = clock::now();
    nvtx_end(std::exchange(nvtx_model_, 0));
    cycle_model_ += std::chrono::duration<double>(t - step_t0_).count() - (stats_.comm_seconds - comm_at_step_);
    if (sync) stats_.model_seconds = std::exchange(cycle_model_, 0.0);
    if (trace_) trace_->span(model_name(sync), trace_log::host, step_t0_, t);
  }
  //! The micro-step's finish() returns; skipped: its update must be skipped (inf/NaN).
  void step_end(bool skipped) {
    if (trace_) {
      if (skipped) trace_->instant("step skipped: inf/NaN gradients", trace_log::host);
      trace_->span("step", trace_log::host, step_t0_, trace_->now());
    }
    nvtx_end(std::exchange(nvtx_step_, 0));
  }

 private:
  struct flight {
    clock::time_point issued;
    std::size_t bytes = 0;
    dtype type = dtype::f32;
  };

  static const char* model_name(bool sync) { return sync ? "forward + backward" : "forward + backward (accumulating)"; }
  static bool is_comm(step_event e) { return e >= step_event::issue_reduce; }
  static bool is_wait(step_event e) { return e >= step_event::wait_reduce; }
  // The NVTX range's name (docs/observe.md lists them).
  static const char* event_name(step_event e) {
    switch (e) {
      case step_event::finish: return "finish";
      case step_event::unscale: return "unscale + inf/NaN check";
      case step_event::clip: return "clip by global norm";
      case step_event::callback: return "bucket callback";
      case step_event::issue_reduce: return "collective issued";
      case step_event::issue_scatter: return "reduce-scatter issued";
      case step_event::issue_gather: return "all-gather issued";
      case step_event::wait_reduce: return "wait for bucket";
      case step_event::wait_scatter: return "wait for reduce-scatter";
      case step_event::wait_gather: return "wait for all-gather";
    }
    return "";
  }
  // The collective's name on the trace's communication track.
  static std::string collective_name(step_event e, std::int64_t index) {
    const char* what = e == step_event::wait_gather    ? "gather into bucket "
                       : e == step_event::wait_scatter ? "reduce-scatter from bucket "
                                                       : "reduce from bucket ";
    return what + std::to_string(index);
  }

  void end(const scope& s) {
    if (is_comm(s.e_)) stats_.comm_seconds += std::chrono::duration<double>(clock::now() - s.t0_).count();
    if (!trace_) return;
    const auto t = trace_->now();
    if (is_wait(s.e_)) {
      if (const auto f = in_flight_.find(s.key_); f != in_flight_.end()) {
        trace_->span(collective_name(s.e_, s.index_), trace_log::comm, f->second.issued, t,
                     std::to_string(f->second.bytes) + " bytes " + name_of(f->second.type));
        in_flight_.erase(f);
      }
      trace_->span("wait", trace_log::host, s.t0_, t);
    } else if (s.e_ == step_event::callback) {
      trace_->span("bucket " + std::to_string(s.index_) + " callback", trace_log::optimizer, s.t0_, t);
    } else if (!is_comm(s.e_)) {
      trace_->span(event_name(s.e_), trace_log::host, s.t0_, t);
    }
  }

  sync_stats stats_;
  std::unique_ptr<trace_log> trace_;           // LOCKSTEP_TRACE, else null
  std::map<std::uint64_t, flight> in_flight_;  // traced collectives issued, not yet waited for
  launch_listener launch_;
  clock::time_point step_t0_{};  // the current micro-step's step()
  std::uint64_t nvtx_step_ = 0, nvtx_model_ = 0;
  double cycle_model_ = 0;   // model time in this cycle so far
  double comm_at_step_ = 0;  // sync_stats::comm_seconds at step()
};

}  // namespace lockstep::detail
