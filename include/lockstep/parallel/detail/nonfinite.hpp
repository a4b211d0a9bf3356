#pragma once
//! Which rank's gradients held inf/NaN before they were averaged (docs/reliability.md,
//! scenario 8). The loss scaler sees only the average, in which one rank's NaN is everyone's.
//! So after a skipped step DataParallel arms this check for the next synchronising step: the
//! reducer runs each launch unit's local gradients through grad_ops' flagging pass just
//! before the unit's collective (one extra read pass over the gradients, on such steps only;
//! x · 1 leaves them unchanged), and after the collectives the ranks agree (one small
//! all-reduce) on who had non-finite values. The first finding of a run of skipped steps is
//! what the skip-limit error names. A step after a clean one costs nothing. With
//! DeviceDynamicScale (no host sync, so no host-side skip decision) each rank arms itself from
//! the scaler's lagging view of skips in a row and flags into the scaler's found-inf vote,
//! which the device update turns into the finding (see arm_for).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/scaling/loss_scaler.hpp"  // memory_of_t
#include "lockstep/scaling/scalers.hpp"      // origin_text

namespace lockstep::detail {

//! Whether scaler s stops after a number of skipped steps in a row (DynamicScale's
//! max_consecutive_skips > 0): only then is a finding ever reported, so only then is it sought.
template <class S>
bool has_skip_limit(const S& s) {
  if constexpr (requires { s.options().max_consecutive_skips; }) return s.options().max_consecutive_skips > 0;
  else return false;
}

template <class Comm>
class nonfinite_origin {
 public:
  //! Whether the check can run for this communicator's memory space (it needs grad_ops).
  static constexpr bool supported = has_grad_ops<memory_of_t<Comm>>;

  //! Flags inf/NaN among `count` local gradients of type t at `data` (in comm's memory).
  void check(Comm& comm, void* data, std::size_t count, dtype t) {
    if constexpr (supported) {
      auto mem = comm.memory();
      const segment seg{data, count};
      const grad_group g{t, std::span<const segment>(&seg, 1)};
      if (target_ != nullptr) {  // the device scaler zeroes its votes itself
        grad_ops<memory_of_t<Comm>>::unscale_and_flag(mem, std::span<const grad_group>(&g, 1), 1.0, target_);
        return;
      }
      if (!flag_) flag_ = mem.allocate(sizeof(std::int32_t));
      if (!raised_) {
        mem.zero(flag_.get(), sizeof(std::int32_t));
        raised_ = true;
      }
      grad_ops<memory_of_t<Comm>>::unscale_and_flag(mem, std::span<const grad_group>(&g, 1), 1.0, flag_.get());
    }
  }

  //! Collective (every rank that armed the check calls it once per checked step): the ranks
  //! whose local gradients held inf/NaN in this step, the same list on every rank.
  std::vector<int> agree(Comm& comm) {
    std::int32_t mine = 0;
    if (raised_) comm.memory().download(&mine, flag_.get(), sizeof mine);
    raised_ = false;
    std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()), 0);
    if (const auto r = static_cast<std::size_t>(comm.rank()); r < all.size()) all[r] = mine != 0 ? 1 : 0;
    if (comm.size() > 1) host_all_reduce(comm, std::span<std::int64_t>(all), reduce_op::sum);
    std::vector<int> ranks;
    for (std::size_t r = 0; r < all.size(); ++r)
      if (all[r] != 0) ranks.push_back(static_cast<int>(r));
    return ranks;
  }

  //! After this step's found-inf is agreed: returns this (the reducer checks the next step's
  //! units) when the step is skipped and the check is supported, else nullptr. Agreed on
  //! every rank, as found_inf is.
  nonfinite_origin* arm(bool found_inf) {
    armed_ = supported && found_inf;
    raised_ = false;  // the next check zeroes the flag first
    return armed_ ? this : nullptr;
  }

  //! Collective when the step was checked (every rank alike): records the first finding;
  //! step() gives this step's number (asked only then: a device scaler's state synchronises).
  template <class StepNumber>
  void settle(Comm& comm, StepNumber&& step) {
    if (!std::exchange(armed_, false)) return;
    if (auto ranks = agree(comm); !ranks.empty() && first_.empty()) first_ = describe(ranks, step());
  }

  //! Runs the scaler's update; a skip-limit error it throws gets the finding appended. A clean
  //! step ends the run of skips (and forgets the finding).
  template <class Update>
  void name_in(Update&& update, bool found_inf) {
    try {
      update();
    } catch (const error& e) {
      // Only the scalers' own lockstep::error (the skip limit) is decorated; a subclass
      // (aborted_error, timeout_error, ...) keeps its type.
      if (first_.empty() || typeid(e) != typeid(error)) throw;
      throw error(std::string(e.what()) + "; " + std::exchange(first_, {}));
    }
    if (!found_inf) first_.clear();
  }

  //! "rank 2" / "ranks 1, 3": the origin as the error names it (ranks of DataParallel's
  //! communicator: under a mesh, the data axis).
  static std::string describe(const std::vector<int>& ranks, std::int64_t step) {
    return origin_text(ranks, 0, step, "the step after the first skip is checked rank by rank");
  }

  //! After this step's scaler work: arms the next step's check (returns this for the reducer)
  //! or not (nullptr). Host scalers: when this step is skipped (agreed on every rank, as
  //! found_inf is), the ranks then agreeing in settle(). A device scaler (DeviceDynamicScale,
  //! whose host never learns of a skip) offers device_vote(rank): each rank arms itself while
  //! the scaler's lagging host view shows skips in a row, and its local flag goes into the
  //! scaler's own all-reduced found-inf vote, which the scaler's device update turns into the
  //! finding — no collective here, so ranks may arm a step apart without harm.
  template <class Scaler>
  nonfinite_origin* arm_for(Scaler& scaler, bool found_inf, int rank) {
    if constexpr (requires { scaler.device_vote(rank); }) {
      armed_ = raised_ = false;
      target_ = supported && has_skip_limit(scaler) && scaler.skipping() ? scaler.device_vote(rank) : nullptr;
      return target_ != nullptr ? this : nullptr;
    } else {
      target_ = nullptr;
      return arm(found_inf && has_skip_limit(scaler));
    }
  }

 private:
  std::shared_ptr<void> flag_;  // one int32 in comm's memory space
  bool raised_ = false;         // flag_ zeroed and written this step
  bool armed_ = false;          // this step's units are checked
  std::string first_;           // the first finding of the current run of skipped steps
  int* target_ = nullptr;       // a device scaler's vote for this rank (device memory), or null
};

}  // namespace lockstep::detail
