#pragma once
//! lockstep::ElasticGroup — a job that goes on when ranks die: one call per training step
//! that, when a peer failed, agrees with the other survivors on who goes on, builds the
//! smaller communicator, lets what depends on it be rebuilt (DataParallel, the sampler's
//! partition) and reports the change, so the loop redoes the interrupted step.
//!
//! The loop: construct it from the rank's context and the job's store; build DataParallel
//! on group.comm() and the sampler on the group; in on_change() rebuild DataParallel and
//! re-partition the sampler; run each step through attempt(), and when it reports a change
//! redo the step (docs/elastic.md has the whole loop, compiled and run by
//! tests/docs/snippets.cpp).
//!
//! What the step may have done when a peer fails: anything but apply the optimizer on some
//! ranks and not others — update after finish() returned, as DataParallel's step does (a
//! failure after every collective of the step completed is found at the next step's first).
//! Today: CPU ranks as threads (ThreadComm::regroup); NcclComm and MpiComm follow (issue 29).

#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/context.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/elastic/membership.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep {

//! A communicator whose survivors can form a smaller one after a failure (ThreadComm).
template <class C>
concept regroupable_communicator = communicator<C> && requires(C& c, std::uint64_t change, std::span<const int> m) {
  { c.regroup(change, m) } -> std::same_as<C>;
};

template <regroupable_communicator Comm, store Store>
class ElasticGroup {
 public:
  //! The job's communicator `comm` (its ranks are the job ranks), the job's store.
  ElasticGroup(Comm comm, Store& store, SurvivorOptions o = {})
      : comm_(std::move(comm)), store_(&store), opt_(o), now_(membership::whole(comm_.size(), comm_.rank())) {}
  ElasticGroup(context<Comm>& ctx, Store& store, SurvivorOptions o = {}) : ElasticGroup(ctx.comm(), store, o) {}

  //! The communicator of the ranks that go on (a new one after each change).
  Comm& comm() noexcept { return comm_; }
  int rank() const noexcept { return now_.rank; }
  int size() const noexcept { return now_.size(); }
  const membership& members() const noexcept { return now_; }
  //! Every change so far, oldest first.
  const std::vector<membership_change>& changes() const noexcept { return changes_; }

  //! Runs after each change, in the order given, once the new communicator exists: rebuild
  //! what holds the old one (DataParallel), re-partition the data (the sampler).
  void on_change(std::function<void(const membership_change&)> f) { callbacks_.push_back(std::move(f)); }

  //! Runs step(). When it throws aborted_error — a peer failed and this rank's communicator
  //! was released — the survivors agree on who goes on (agree_on_survivors, naming the ranks
  //! the communicator knows failed), the communicator is regrouped over them, the on_change
  //! callbacks run (a failure while they run changes the membership again), and the last
  //! change is returned: redo the step. Empty when the step completed. Throws aborted_error
  //! when this rank cannot go on (too few ranks, out of the decision, the coordinator gone);
  //! any other exception of the step propagates.
  template <class Step>
  std::optional<membership_change> attempt(Step&& step) {
    try {
      std::forward<Step>(step)();
      return std::nullopt;
    } catch (const aborted_error&) {
    }
    for (;;) {
      membership_change c = change();
      try {
        for (auto& f : callbacks_) f(c);
        return c;
      } catch (const aborted_error&) {  // another rank failed while this one rebuilt
      }
    }
  }

 private:
  membership_change change() {
    auto gone_now = [this] {
      if constexpr (requires { comm_.failed_ranks(); }) return comm_.failed_ranks();
      else return std::vector<int>{};
    };
    membership_change c = agree_on_survivors(*store_, now_, gone_now, opt_);
    comm_ = comm_.regroup(c.after.epoch, c.after.ranks);
    now_ = c.after;
    changes_.push_back(c);
    return c;
  }

  Comm comm_;
  Store* store_;
  SurvivorOptions opt_;
  membership now_;
  std::vector<membership_change> changes_;
  std::vector<std::function<void(const membership_change&)>> callbacks_;
};

template <class Comm, class Store>
ElasticGroup(context<Comm>&, Store&, SurvivorOptions = {}) -> ElasticGroup<Comm, Store>;
template <class Comm, class Store>
ElasticGroup(Comm, Store&, SurvivorOptions = {}) -> ElasticGroup<Comm, Store>;

}  // namespace lockstep
