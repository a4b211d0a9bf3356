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
//! Ranks as threads (ThreadComm::regroup, a store the ranks share) and one process per GPU
//! (run(Processes): NcclComm::regroup through the job's store, the context lends the store and
//! a watchdog per membership: launch/elastic_link.hpp). MpiComm cannot regroup.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
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
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/launch/elastic_join.hpp"
#include "lockstep/launch/elastic_link.hpp"
#include "lockstep/store/store.hpp"
#include "lockstep/store/tcp_store.hpp"

namespace lockstep {

//! A communicator whose survivors can form a smaller one after a failure: by itself
//! (ThreadComm: regroup(change, members)) or through the job's store (NcclComm:
//! regroup(change, members, store)).
template <class C, class S>
concept regroupable_communicator =
    communicator<C> && (requires(C& c, std::uint64_t change, std::span<const int> m) {
      { c.regroup(change, m) } -> std::same_as<C>;
    } || requires(C& c, std::uint64_t change, std::span<const int> m, S& s) {
      { c.regroup(change, m, s) } -> std::same_as<C>;
    });

template <class Comm, store Store>
  requires regroupable_communicator<Comm, Store>
class ElasticGroup {
 public:
  //! The job's communicator `comm` (its ranks are the job ranks), the job's store.
  ElasticGroup(Comm comm, Store& store, SurvivorOptions o = {}) : ElasticGroup(std::move(comm), store, o, made{}) {
    open_if_coordinator();
  }
  //! On the context of ranks as threads (a communicator made from the context's, the job's
  //! store given). With run(Threads{.max_restarts = k}) the members look for replacements at
  //! commit(), and a rank that was started again (ctx.restart_count() > 0) joins the running
  //! job as one: it asks through the store, waits to be admitted (the store's timeout) and
  //! starts in the grown membership with steps() set (the coordinator's count; where the loop
  //! went back since, a PeerCopy::restore() says the step), replacement() true. One that no
  //! group admits (the job's loop ended first) is told so (aborted_error); job rank 0, which
  //! coordinates, cannot come back (the others ended when it failed): refused at once.
  template <class C>
    requires std::constructible_from<Comm, C&>
  ElasticGroup(context<C>& ctx, Store& store, SurvivorOptions o = {})
      : ElasticGroup(Comm(ctx.comm()), store, o, made{}) {
    joins_ = ctx.restarts_failed();
    if (ctx.restart_count() == 0) {
      open_if_coordinator();
      return;
    }
    if (now_.job_rank() == 0)
      throw aborted_error("job rank 0 was started again, but it coordinates changes of membership: the job's other "
                          "ranks ended when it failed, so there is no job to join; resume from the last checkpoint");
    join();
  }
  //! On the context of a launch mode that lends its store and watchdogs (run(Processes)):
  //! the group regroups the context's communicator in place. config_error on another context.
  //! A replacement process (LOCKSTEP_ELASTIC_JOIN=1) starts in the membership it was admitted
  //! to, with the steps the job had completed (steps()).
  explicit ElasticGroup(context<Comm>& ctx, SurvivorOptions o = {})
    requires std::same_as<Store, TcpStore>
      : comm_(&ctx.comm()), store_(&link_of(ctx).store()), link_(ctx.elastic()), opt_(o) {
    const growth first = link_->start();
    now_.epoch = first.epoch;
    now_.ranks = first.ranks;
    now_.rank = comm_->rank();
    steps_ = first.steps;
    replacement_ = first.epoch > 0;
    if (now_.ranks.size() != static_cast<std::size_t>(comm_->size()))
      throw config_error("ElasticGroup: the context's communicator has " + std::to_string(comm_->size()) +
                         " ranks, its membership " + std::to_string(now_.ranks.size()) +
                         "; build the group before anything regroups the communicator");
    generation_ = count_group();
    if (replacement_) adopt_generation(first.generation);
    else open_if_coordinator();
  }
  ElasticGroup(const ElasticGroup&) = delete;
  ElasticGroup& operator=(const ElasticGroup&) = delete;
  //! The coordinator's group ending after a completed step (its training loop is done) says
  //! so in the store: a member still waiting for a change of membership is told at once
  //! instead of waiting out the store's timeout (membership.hpp, step 5). However it ends, it
  //! answers the replacements still waiting to join (launch/elastic_join.hpp, step 4).
  ~ElasticGroup() {
    if (now_.rank != 0 || now_.ranks.empty() || replacement_) return;
    const bool clean = completed_ && std::uncaught_exceptions() == 0;
    try {
      if (clean) {
        byte_writer w;
        w.write(steps_);
        store_->set(ended_key(), std::move(w).release());
      }
      close_joins(*store_, generation_, steps_, clean, next_request_);
    } catch (...) {  // the store is gone: nobody waits on it
    }
  }

  //! The communicator of the ranks that go on (a new one after each change).
  Comm& comm() noexcept { return *comm_; }
  int rank() const noexcept { return now_.rank; }
  int size() const noexcept { return now_.size(); }
  const membership& members() const noexcept { return now_; }
  //! Every change so far, oldest first.
  const std::vector<membership_change>& changes() const noexcept { return changes_; }
  //! Whether this rank joined the running job as a replacement (run(Processes) with
  //! LOCKSTEP_ELASTIC_JOIN=1, run(Threads) with max_restarts): what the loop keeps besides the model it must get from
  //! rank 0, as the members send it in on_change for the change that admitted it (c.joined).
  bool replacement() const noexcept { return replacement_; }
  //! The steps completed: attempt() calls that returned empty, since the start or — after a
  //! change — since the step the coordinator had completed (membership_change::steps).
  std::int64_t steps() const noexcept { return steps_; }

  //! Call it in the step between DataParallel's finish() and the optimizer's update. On GPUs
  //! (NcclComm) it waits until this rank's collectives of the step have completed and throws
  //! aborted_error if a peer's failure aborted the communicator first: an aborted NCCL
  //! collective leaves partial sums, which the update must never see. The host waits once a
  //! step for it. With ranks as threads the collectives already completed: nothing to wait
  //! for. Where the launch mode lends a store (run(Processes)) or restarts failed ranks
  //! (run(Threads) with max_restarts: call it there too), commit() also tells every member
  //! whether a replacement asked to join (the coordinator's word, in one small all-reduce, so
  //! that all see it at the same step): the next attempt() then admits it (below).
  void commit() {
    std::int64_t want[1] = {0};
    if (link_ || joins_) {
      want[0] = now_.rank == 0 && joiner_waiting() ? 1 : 0;
      detail::host_all_reduce(*comm_, std::span<std::int64_t>(want), reduce_op::max);
    }
    if constexpr (requires { comm_->synchronize(); }) comm_->synchronize();
    // Only a commit that passed says "grow": one that threw leads to a change instead, on
    // every member (a member whose all-reduce completed but whose wait threw must not grow
    // while the others shrink).
    grow_ = want[0] != 0;
  }

  //! Runs after each change, in the order given, once the new communicator exists: rebuild
  //! what holds the old one (DataParallel), re-partition the data (the sampler).
  void on_change(std::function<void(const membership_change&)> f) { callbacks_.push_back(std::move(f)); }

  //! Runs step(). When it fails because a peer failed — aborted_error, or any error while this
  //! rank's communicator is aborted (an NCCL call the abort interrupted) — the survivors agree
  //! on who goes on (agree_on_survivors, naming the ranks known gone), the communicator is
  //! regrouped over them, the on_change callbacks run (a failure while the communicator is made or
  //! while they run changes the membership again), and the last change is returned: redo the step. Empty when the step
  //! completed. Throws aborted_error when this rank cannot go on (too few ranks, out of the
  //! decision, the coordinator gone, or — processes — the communicator was released but no
  //! rank is gone: a failure of another kind, named); any other exception of the step
  //! propagates.
  //!
  //! When a commit() reported a replacement waiting, attempt() first admits
  //! it — the members and the joiners agree through the store (launch/elastic_join.hpp), the
  //! communicator is regrouped over all, the on_change callbacks run (the replacement builds
  //! the same in its body: DataParallel broadcasts rank 0's parameters) — and returns that
  //! change without running step(): run it next, with the data cut for the larger group.
  template <class Step>
  std::optional<membership_change> attempt(Step&& step) {
    completed_ = false;
    if (grow_) {
      grow_ = false;
      try {
        membership_change c = grow();
        enter(c);
        return c;
      } catch (const std::exception& e) {  // a rank failed while the group grew
        if (!released(e)) throw;
      }
      return settle();
    }
    try {
      std::forward<Step>(step)();
      ++steps_;
      completed_ = true;
      return std::nullopt;
    } catch (const std::exception& e) {
      if (!released(e)) throw;
    }
    return settle();
  }

 private:
  // After a peer's failure: change until a membership's communicator is made and its callbacks
  // complete. The decision's own errors (too few ranks, the coordinator gone) propagate.
  membership_change settle() {
    for (;;) {
      membership_change c = change();
      try {
        enter(c);
        return c;
      } catch (const std::exception& e) {  // a rank failed (or the communicator could not be
        if (!released(e)) throw;           // made) while this one regrouped or rebuilt
      }
    }
  }

  // The membership is c.after from here on, also when a rank fails before its communicator
  // exists (the survivors then agree under its epoch, a joiner among them): its watchdog, its
  // communicator, then the callbacks.
  void enter(const membership_change& c) {
    now_ = c.after;
    steps_ = c.steps;
    changes_.push_back(c);
    if (link_) link_->watch(c.after.epoch, c.after.ranks);
    regroup(c.after);
    // A member lost while the communicator was made: it is aborted already, so the callbacks'
    // first collective (or the redone step's) fails and the survivors change again.
    if (link_) (void)link_->adopt();
    for (auto& f : callbacks_) f(c);
  }

  // The communicator of membership m: through the store where the communicator needs it.
  void regroup(const membership& m) {
    const std::span<const int> ranks(m.ranks);
    if constexpr (requires { comm_->regroup(m.epoch, ranks, *store_); })
      *comm_ = comm_->regroup(m.epoch, ranks, *store_);
    else *comm_ = comm_->regroup(m.epoch, ranks);
  }

  // A rank started again: asks to join, waits for its admission, makes the grown membership's
  // communicator with the members (their enter() of the same epoch).
  void join() {
    const int job = now_.job_rank();
    const std::int64_t n = request_join(*store_, job);
    const growth g = await_admission(*store_, n, job, std::chrono::milliseconds(store_->timeout()));
    now_.epoch = g.epoch;
    now_.ranks = g.ranks;
    now_.rank = static_cast<int>(std::find(g.ranks.begin(), g.ranks.end(), job) - g.ranks.begin());
    steps_ = g.steps;
    replacement_ = true;
    adopt_generation(g.generation);
    regroup(now_);
  }

  bool joiner_waiting() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_poll_) return false;
    next_poll_ = now + std::chrono::milliseconds(100);
    return joins_requested(*store_) >= next_request_;
  }

  // The coordinator admits what asked to join; every member reads its record (enter() makes
  // the grown membership's communicator).
  membership_change grow() {
    const std::uint64_t epoch = now_.epoch + 1;
    const growth g = now_.rank == 0
                         ? admit(*store_, epoch, now_.ranks, next_request_, steps_, next_request_, generation_)
                         : read_growth(*store_, epoch, generation_);
    membership_change c;
    c.before = now_;
    c.after.epoch = epoch;
    c.after.ranks = g.ranks;
    c.after.rank = static_cast<int>(std::find(g.ranks.begin(), g.ranks.end(), now_.job_rank()) - g.ranks.begin());
    c.joined = g.joined;
    c.steps = g.steps;
    return c;
  }

  static elastic_link& link_of(context<Comm>& ctx) {
    if (ctx.elastic() == nullptr)
      throw config_error("ElasticGroup: this context lends no store (only run(Processes) does); pass the job's "
                         "store: ElasticGroup(ctx, store, options)");
    return *ctx.elastic();
  }

  bool released(const std::exception& e) const {
    if (dynamic_cast<const aborted_error*>(&e) != nullptr) return true;
    if constexpr (requires { comm_->aborted(); }) return comm_->aborted();
    return false;
  }

  membership_change change() {
    grow_ = false;  // a joiner still waiting is seen again at a later commit()
    if (link_) link_->leave();
    auto gone_now = [this] {
      std::vector<int> gone;
      if (link_) gone = link_->gone(now_.epoch, now_.ranks);
      if constexpr (requires { comm_->failed_ranks(); })
        for (int r : comm_->failed_ranks()) gone.push_back(r);
      return gone;
    };
    membership_change c =
        agree_on_survivors(*store_, now_, gone_now, opt_, steps_, ended_key(), detail::group_scope(generation_));
    if (link_ && c.gone.empty())
      throw aborted_error("rank " + std::to_string(now_.job_rank()) +
                          ": the communicator was released, but every rank is still there: " + link_failure() +
                          "; this is not a lost rank, so the job cannot go on without it");
    return c;
  }

  // A group that is not a replacement's: its coordinator opens joins (elastic_join.hpp, step 4).
  void open_if_coordinator() {
    if (now_.rank == 0) next_request_ = open_joins(*store_, generation_);
  }
  // This rank's groups on the store, this one counted.
  std::int64_t count_group() { return store_->add(group_counter(), 1); }
  std::string group_counter() const { return "lockstep.elastic/groups/" + std::to_string(now_.job_rank()); }
  // A replacement takes the number of the coordinator's group it joined (`g`, from the
  // admission's record), its count on the store too: the keys of that group (ended_key) are
  // then its own, and so are those of later groups.
  void adopt_generation(std::int64_t g) {
    if (g <= 0 || g == generation_) return;
    (void)store_->add(group_counter(), g - generation_);
    generation_ = g;
  }
  // Step 5's key for this group: by its generation, so that a later group on the same store
  // (its epochs start again) does not read this one's.
  std::string ended_key() const { return detail::join_key(detail::group_scope(generation_) + "ended"); }

  std::string link_failure() const {
    const auto why = link_ ? link_->failure() : std::nullopt;
    return why ? *why : std::string("no failure was named");
  }

  struct made {};  // the members, before joins are opened or a restarted rank joins
  ElasticGroup(Comm comm, Store& store, SurvivorOptions o, made)
      : own_(std::move(comm)), comm_(&*own_), store_(&store), opt_(o),
        now_(membership::whole(comm_->size(), comm_->rank())), generation_(count_group()) {}

  std::optional<Comm> own_;  // the communicator, unless it is the context's (regrouped in place)
  Comm* comm_;
  Store* store_;
  elastic_link* link_ = nullptr;
  SurvivorOptions opt_;
  membership now_;
  std::int64_t steps_ = 0;
  //! This rank's groups on the store so far, this one included: the same on every rank that
  //! made as many; a replacement takes the coordinator's (adopt_generation).
  std::int64_t generation_ = 0;
  bool completed_ = false;  // the last attempt() ran its step to the end
  bool replacement_ = false;
  bool joins_ = false;             // replacements may join (ranks as threads, restarted: commit() asks)
  bool grow_ = false;              // commit() said: admit a replacement
  std::int64_t next_request_ = 1;  // the coordinator's next join request
  std::chrono::steady_clock::time_point next_poll_{};  // the coordinator's next look at them
  std::vector<membership_change> changes_;
  std::vector<std::function<void(const membership_change&)>> callbacks_;
};

template <class Comm, class Store>
ElasticGroup(context<Comm>&, Store&, SurvivorOptions = {}) -> ElasticGroup<Comm, Store>;
template <class Comm, class Store>
ElasticGroup(Comm, Store&, SurvivorOptions = {}) -> ElasticGroup<Comm, Store>;
template <class Comm>
ElasticGroup(context<Comm>&, SurvivorOptions = {}) -> ElasticGroup<Comm, TcpStore>;

}  // namespace lockstep
