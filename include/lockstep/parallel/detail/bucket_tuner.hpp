#pragma once
//! Bucket sizes from a cost model (BucketPolicy::tune): during synchronising step
//! BucketPolicy::tune_step (default the third: the first is a cold one, and the second the
//! first in the rebuilt order) the reducer stamps, on the device, when each gradient was
//! reported; when that step ends,
//! every rank times real mean all-reduces of a few sizes (1, 4, 16, 64, 256 MiB, up to the
//! arena) and replays the step on paper for each candidate cap — the buckets cut as the plan
//! would cut them (in the observed order), each all-reduce starting when its last gradient is
//! ready and the previous one is done, taking the probed time for its bytes (interpolated) —
//! and rank 0's choice, the cap whose last all-reduce ends soonest after the last gradient,
//! is broadcast: every rank rebuilds with it. (NCCL's own estimates, ncclGroupSimulateEnd,
//! were tried first: their bandwidth curve is flatter than the measured one, and on the
//! comm-bound MLP they picked a cap 10 % slower than the best; bench/RESULTS.md, session 18.)
//!
//! A communicator takes part through bucket_costs<Comm> (NcclComm's specialisation is in
//! cuda/detail/nccl_costs.cuh): stamp_type, now(comm) → a stamp on its compute stream,
//! elapsed_us(comm, a, b) (waits for b), and probe_us(comm, counts, type) → the µs of a mean
//! all-reduce of each count (a collective). Without one (CPU communicators) the caps stay.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/policies.hpp"
#include "lockstep/parallel/step.hpp"

namespace lockstep::detail {

//! Time of an all-reduce of n elements from the probed (counts, us), counts ascending:
//! piecewise linear between probes, the smallest probe's time below it (latency), and the
//! last segment's slope above the largest.
inline double interpolate(const std::vector<std::size_t>& counts, const std::vector<double>& us, std::size_t n) {
  if (counts.empty()) return 0;
  if (n <= counts.front() || counts.size() == 1)
    return counts.size() == 1 ? us[0] * std::max(1.0, static_cast<double>(n) / static_cast<double>(counts[0])) : us[0];
  std::size_t k = 1;
  while (k + 1 < counts.size() && counts[k] < n) ++k;
  const double x0 = static_cast<double>(counts[k - 1]), x1 = static_cast<double>(counts[k]);
  return us[k - 1] + (us[k] - us[k - 1]) * (static_cast<double>(n) - x0) / (x1 - x0);
}

//! Elements per parameter.
inline std::vector<std::size_t> sizes_of(const std::vector<parameter>& ps) {
  std::vector<std::size_t> sizes(ps.size());
  for (std::size_t i = 0; i < ps.size(); ++i) sizes[i] = ps[i].numel();
  return sizes;
}

//! A tuned cap (0: none) into the policy and the statistics, `why` the tuner's account of it
//! (none: it came from a checkpoint); whether the arena must be cut again for it.
inline bool adopt_tuned_cap(std::size_t cap, BucketPolicy& policy, sync_stats& st, std::string why = {}) {
  if (cap == 0) return false;
  st.tuned_cap_bytes = cap;
  st.tuning = why.empty()
                  ? "cap " + std::to_string(cap >> 20) + " MiB (" + std::to_string(cap) + " bytes), from the checkpoint"
                  : std::move(why);
  const bool changed = cap != policy.cap_bytes || std::min(policy.first_bytes, cap) != policy.first_bytes;
  policy.cap_bytes = cap;
  policy.first_bytes = std::min(policy.first_bytes, cap);
  return changed;
}

template <class Comm>
struct bucket_costs {
  static constexpr bool available = false;
  struct stamp_type {};
};

//! The caps tried (MiB): DDP's 25 beside powers of two, until a cap cuts as the one before.
inline constexpr std::size_t tuner_caps_mib[] = {1, 2, 4, 8, 16, 25, 32, 64, 128, 256};

//! BucketPolicy::tune in a reducer: which synchronising step to time, its device stamps (one
//! at its start, one per reported gradient), and the choice made from them.
template <class Comm>
class bucket_tuner {
  using costs = bucket_costs<Comm>;

 public:
  //! Refuses a BucketPolicy the tuner cannot follow.
  static void check(const BucketPolicy& p) {
    if (p.tune && p.tune_step < 1)
      throw config_error("BucketPolicy::tune_step is " + std::to_string(p.tune_step) +
                         "; give the synchronising step the tuner times, counted from 1 (default 3)");
  }
  //! Whether the tuner has yet to time a step: asked for, on a communicator that gives costs,
  //! more than one rank, a layout that is rebuilt, not tuned (nor given a cap by a checkpoint),
  //! and a model that reports its gradients (`silent`: every rank agreed it does not).
  bool due(const BucketPolicy& p, int ranks, bool silent) const noexcept {
    return costs::available && p.tune && p.rebuild_after_first_step && !done_ && !silent && ranks > 1;
  }
  //! A synchronising micro-step begins: stamps from here on if it is the one to time. Until the
  //! tuning, no step may be captured into a CUDA graph (the communicator's refuse_capture: the
  //! layout the graph would hold is not the final one).
  void begin_sync(Comm& comm, const BucketPolicy& p, bool silent) {
    if (!due(p, comm.size(), silent)) return;
    if constexpr (requires { costs::refuse_capture(comm); }) costs::refuse_capture(comm);
    if (syncs_ + 1 >= static_cast<std::uint64_t>(p.tune_step)) start(comm);
  }
  //! Stamps from now on (begin_sync calls it for the step to time).
  void start(Comm& comm) {
    if constexpr (costs::available) {
      stamps_.clear();
      begin_ = costs::now(comm);
      on_ = true;
    }
  }
  //! A synchronising micro-step ended (before settle).
  void end_sync() noexcept { ++syncs_; }
  void mark(Comm& comm, std::size_t i) {
    if constexpr (costs::available) stamps_.push_back({i, costs::now(comm)});
  }
  bool on() const noexcept { return on_; }
  //! No tuning now (the model reports no gradient, or a checkpoint's plan came); `done`: none
  //! later either (the checkpoint gave the cap).
  void stop(bool done = false) noexcept {
    on_ = false;
    done_ = done_ || done;
    stamps_.clear();
  }

  //! The timed step is over: for the element type with the most bytes (order: the settled
  //! order, sizes: elements per parameter), the cap with the earliest simulated end of the
  //! sync; plan(type, order, policy) cuts the arena as the units would. Every rank calls it
  //! (NCCL's estimates are collective); rank 0's answer is broadcast. Sets policy's caps and
  //! st.tuned_cap_bytes / st.tuning; returns whether the cap changed.
  template <class Plan>
  bool settle(Comm& comm, const std::vector<std::size_t>& order, const std::vector<parameter>& params,
              BucketPolicy& policy, Plan&& plan, sync_stats& st) {
    on_ = false;
    done_ = true;
    if constexpr (!costs::available) {
      return false;
    } else {
      std::map<dtype, std::pair<std::size_t, std::vector<std::size_t>>> by_type;  // bytes, order
      for (auto i : order) {
        auto& [bytes, idx] = by_type[params[i].type];
        bytes += params[i].bytes();
        idx.push_back(i);
      }
      if (by_type.empty()) return false;
      const auto& [t, main] = *std::max_element(
          by_type.begin(), by_type.end(), [](const auto& a, const auto& b) { return a.second.first < b.second.first; });
      // The probed sizes: 1, 4, 16, 64, 256 MiB below the arena's bytes, and the arena.
      std::vector<std::size_t> counts;
      const std::size_t total = main.first / size_of(t);
      for (std::size_t mib : {1, 4, 16, 64, 256})
        if ((mib << 20) / size_of(t) < total) counts.push_back((mib << 20) / size_of(t));
      if (counts.empty() || total <= (std::size_t{256} << 20) / size_of(t)) counts.push_back(total);
      const std::vector<double> probed = costs::probe_us(comm, counts, t);
      const auto cost = [&](std::size_t n) { return interpolate(counts, probed, n); };
      std::vector<double> ready(params.size(), -1);  // µs after the step began
      double last = 0;
      for (const auto& [i, s] : stamps_) {
        ready[i] = costs::elapsed_us(comm, begin_, s);
        last = std::max(last, ready[i]);
      }
      std::vector<std::int64_t> best{static_cast<std::int64_t>(policy.cap_bytes)};
      double best_us = -1;
      std::vector<std::pair<std::size_t, double>> tails;  // cap, simulated end after the last gradient
      std::vector<std::size_t> last_cut;                  // the bucket starts of the last cap tried
      std::string table;
      for (std::size_t mib : tuner_caps_mib) {
        BucketPolicy p = policy;
        p.cap_bytes = mib << 20;
        p.first_bytes = std::min(p.first_bytes, p.cap_bytes);
        const bucket_plan cut = plan(t, main.second, p);
        std::vector<std::size_t> begins;
        for (const auto& b : cut.buckets) begins.push_back(b.begin);
        if (begins == last_cut) break;  // larger caps cut the arena as the last one did
        last_cut = std::move(begins);
        double end = 0;
        for (const auto& b : cut.buckets) {
          double at = 0;
          for (const auto& s : b.slices) at = std::max(at, ready[s.param] < 0 ? last : ready[s.param]);
          end = std::max(end, at) + cost(b.end - b.begin);
        }
        const double tail = std::max(0.0, end - last);
        char row[48];
        std::snprintf(row, sizeof row, "%s%zu MiB %.0f", table.empty() ? "" : ", ", mib, tail);
        table += row;
        tails.emplace_back(p.cap_bytes, tail);
        if (best_us < 0 || tail < best_us) best_us = tail;
      }
      for (const auto& [c, tail] : tails)  // within 1% of the best, the largest cap: fewer launches
        if (tail <= best_us * 1.01) best[0] = static_cast<std::int64_t>(c);
      if (stamps_.empty()) best[0] = 0;  // nothing reported here (a Join shadow): no choice
      if (comm.size() > 1) host_broadcast(comm, best, 0);
      const auto cap = static_cast<std::size_t>(best[0]);
      if (cap == 0) {  // rank 0 saw no gradient: time the next synchronising step instead
        done_ = false;
        return false;
      }
      char head[240];
      std::snprintf(head, sizeof head,
                    "cap %zu MiB (rank 0's choice; this rank's timed step: %.0f us from its start to the last "
                    "gradient; a %zu MiB "
                    "all-reduce took %.0f us; the sync ends, per cap, this many us after it: ",
                    cap >> 20, last, counts.back() * size_of(t) >> 20, probed.back());
      return adopt_tuned_cap(cap, policy, st, head + table + ")");
    }
  }

 private:
  struct stamp_at {
    std::size_t param;
    typename costs::stamp_type stamp;
  };
  typename costs::stamp_type begin_{};
  std::vector<stamp_at> stamps_;
  bool on_ = false;
  bool done_ = false;        // timed (or a checkpoint gave the cap): never again
  std::uint64_t syncs_ = 0;  // synchronising micro-steps ended
};

}  // namespace lockstep::detail
