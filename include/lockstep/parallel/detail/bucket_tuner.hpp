#pragma once
//! Bucket sizes from a cost model (BucketPolicy::tune): during the first synchronising step
//! the reducer stamps, on the device, when each gradient was reported; when that step ends,
//! every rank replays the step on paper for each candidate cap — the buckets cut as the plan
//! would cut them (in the observed order), each all-reduce starting when its last gradient is
//! ready and the previous one is done, taking the time NCCL's own model gives for its bytes
//! (ncclGroupSimulateEnd) — and rank 0's choice, the cap whose last all-reduce ends soonest
//! after the last gradient, is broadcast with the order: every rank rebuilds with it.
//!
//! A communicator takes part through bucket_costs<Comm> (NcclComm's specialisation is in
//! cuda/detail/nccl_costs.cuh): stamp_type, now(comm) → a stamp on its compute stream,
//! elapsed_us(comm, a, b) (waits for b), and all_reduce_us(comm, count, type) — NCCL's
//! estimate, a collective call. Without one (CPU communicators) the caps stay as given.

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
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/policies.hpp"
#include "lockstep/parallel/step.hpp"

namespace lockstep::detail {

template <class Comm>
struct bucket_costs {
  static constexpr bool available = false;
  struct stamp_type {};
};

//! The caps tried (MiB): DDP's 25 beside powers of two; those above the arena collapse to one.
inline constexpr std::size_t tuner_caps_mib[] = {1, 2, 4, 8, 16, 25, 32, 64, 128, 256};

//! The first synchronising step's device stamps: one at its start, one per reported gradient.
template <class Comm>
class first_step_timer {
  using costs = bucket_costs<Comm>;

 public:
  void start(Comm& comm) {
    if constexpr (costs::available) {
      stamps_.clear();
      begin_ = costs::now(comm);
      on_ = true;
    }
  }
  void mark(Comm& comm, std::size_t i) {
    if constexpr (costs::available) stamps_.push_back({i, costs::now(comm)});
  }
  bool on() const noexcept { return on_; }

  //! The first step is over: for the element type with the most bytes (order: the settled
  //! order, sizes: elements per parameter), the cap with the earliest simulated end of the
  //! sync; plan(type, order, policy) cuts the arena as the units would. Every rank calls it
  //! (NCCL's estimates are collective); rank 0's answer is broadcast. Sets policy's caps and
  //! st.tuned_cap_bytes / st.tuning; returns whether the cap changed.
  template <class Plan>
  bool settle(Comm& comm, const std::vector<std::size_t>& order, const std::vector<parameter>& params,
              BucketPolicy& policy, Plan&& plan, sync_stats& st) {
    on_ = false;
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
      std::vector<double> ready(params.size(), -1);  // µs after the step began
      double last = 0;
      for (const auto& [i, s] : stamps_) {
        ready[i] = costs::elapsed_us(comm, begin_, s);
        last = std::max(last, ready[i]);
      }
      std::vector<std::int64_t> best{static_cast<std::int64_t>(policy.cap_bytes)};
      double best_us = -1;
      std::string table;
      for (std::size_t mib : tuner_caps_mib) {
        BucketPolicy p = policy;
        p.cap_bytes = mib << 20;
        p.first_bytes = std::min(p.first_bytes, p.cap_bytes);
        const bucket_plan cut = plan(t, main.second, p);
        double end = 0;
        for (const auto& b : cut.buckets) {
          double at = 0;
          for (const auto& s : b.slices) at = std::max(at, ready[s.param] < 0 ? last : ready[s.param]);
          end = std::max(end, at) + costs::all_reduce_us(comm, b.end - b.begin, t);
        }
        const double tail = std::max(0.0, end - last);
        char row[48];
        std::snprintf(row, sizeof row, "%s%zu MiB %.0f", table.empty() ? "" : ", ", mib, tail);
        table += row;
        if (best_us < 0 || tail < best_us * 0.99) {  // ties (within 1%) go to the larger cap
          best_us = tail;
          best[0] = static_cast<std::int64_t>(p.cap_bytes);
        }
        if (cut.buckets.size() <= 1) break;  // larger caps cut the same one bucket
      }
      if (comm.size() > 1) host_broadcast(comm, best, 0);
      const auto cap = static_cast<std::size_t>(best[0]);
      char head[200];
      std::snprintf(head, sizeof head,
                    "cap %zu MiB (rank 0's first step: %.0f us from its start to the last gradient; the sync "
                    "ends, per cap, this many us after it: ",
                    cap >> 20, last);
      st.tuned_cap_bytes = cap;
      st.tuning = head + table + ")";
      const bool changed = cap != policy.cap_bytes || std::min(policy.first_bytes, cap) != policy.first_bytes;
      policy.cap_bytes = cap;
      policy.first_bytes = std::min(policy.first_bytes, cap);
      return changed;
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
};

}  // namespace lockstep::detail
