#pragma once
//! Who goes on after ranks fail: one decision, the same on every survivor, through the job's
//! store (docs/elastic.md). The first step of shrinking a job in place (issue 29): the ranks
//! this returns are the members of the smaller communicator, in order.
//!
//! Protocol for a change of membership `m` (epoch e → e + 1), keys under
//! "lockstep.elastic/<scope><e>/" (scope: "g<n>/" for an ElasticGroup, its number n among the
//! groups made on the store, whose epochs start again; "" for a lone agreement):
//!  1. Every survivor sets "alive/<job rank>" to the job ranks it knows are gone (its
//!     communicator named them, its connection to them closed).
//!  2. The coordinator — m.ranks[0], the lowest member (with a TcpStore, the job rank that
//!     hosts the store, whose loss no rank survives) — waits until every member has reported
//!     alive or is named gone by some report, at most `settle` after it started; members still
//!     silent then are declared gone. A report overrides a claim that its rank is gone (the
//!     store heard from it).
//!  3. It sets "decision": the job ranks that reported, ascending — or why the job cannot go
//!     on (fewer than min_ranks remain).
//!  4. Every survivor reads the decision (waiting at most the store's timeout). A rank not in
//!     it (it reported after the decision) is told so by aborted_error, as is every rank when
//!     the job cannot go on, or when the coordinator is gone (no decision can come).
//!  5. A coordinator whose training loop ended (its ElasticGroup went after a completed step)
//!     sets the key `ended` names (ElasticGroup: "lockstep.elastic/g<n>/ended", of its group —
//!     a replacement takes the coordinator's number when it is admitted) to the steps it
//!     completed: no decision will come, and a survivor asking for one is
//!     told so by aborted_error at once, not after the store's timeout.
//! A rank that fails during the change is in the decision if it reported before failing; the
//! smaller communicator's construction then fails on the others, and they change again.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep {

//! The ranks that train together: job ranks (as launched), ascending; this process's place.
struct membership {
  std::uint64_t epoch = 0;  //!< changes so far
  std::vector<int> ranks;   //!< job ranks of the members; rank r of the group is ranks[r]
  int rank = -1;            //!< this process's rank in the group (its index in `ranks`)
  int size() const noexcept { return static_cast<int>(ranks.size()); }
  bool operator==(const membership&) const = default;

  //! Every rank of a job of `world` ranks, this one job rank `job_rank` (epoch 0).
  static membership whole(int world, int job_rank) {
    if (world < 1 || job_rank < 0 || job_rank >= world)
      throw config_error("membership::whole: job rank " + std::to_string(job_rank) + " of " + std::to_string(world) +
                         " ranks; pass this rank and the number of ranks");
    membership m;
    for (int r = 0; r < world; ++r) m.ranks.push_back(r);
    m.rank = job_rank;
    return m;
  }
  //! This process's job rank.
  int job_rank() const { return ranks.at(static_cast<std::size_t>(rank)); }
};

//! What a change of membership decided.
struct membership_change {
  membership before;
  membership after;
  std::vector<int> gone;    //!< job ranks of `before` not in `after`, ascending
  std::vector<int> joined;  //!< job ranks of `after` not in `before` (replacements), ascending
  //! The steps the job completed before the change as the coordinator counted them (the
  //! `steps` it passed): the survivors go on from there. On GPUs a survivor may count one
  //! more or one less (ElasticGroup::commit): it follows the coordinator.
  std::int64_t steps = 0;
  //! How long this rank took to agree (from its call to the decision).
  std::chrono::milliseconds agreement{0};
};

struct SurvivorOptions {
  //! The job cannot go on with fewer ranks than this: every survivor gets aborted_error.
  int min_ranks = 1;
  //! How long the coordinator waits for members that neither reported nor were named gone.
  std::chrono::milliseconds settle{2000};
};

namespace detail {

//! A key of the change from epoch `epoch`: "lockstep.elastic/<scope><epoch>/<what>". `scope`
//! tells apart the groups made one after another on a store (their epochs start again):
//! ElasticGroup's is "g<its number>/", a lone agreement's "".
inline std::string elastic_key(const std::string& scope, std::uint64_t epoch, const std::string& what) {
  return "lockstep.elastic/" + scope + std::to_string(epoch) + "/" + what;
}

inline std::vector<std::byte> encode_ranks(std::span<const int> ranks, std::string_view failure = {},
                                           std::int64_t steps = 0) {
  byte_writer w;
  w.write(static_cast<std::uint64_t>(ranks.size()));
  for (int r : ranks) w.write(static_cast<std::int64_t>(r));
  w.write_string(failure);
  w.write(steps);
  return std::move(w).release();
}

struct decoded_ranks {
  std::vector<int> ranks;
  std::string failure;
  std::int64_t steps = 0;
};
inline decoded_ranks decode_ranks(std::span<const std::byte> bytes, const std::string& key) {
  byte_reader r(bytes, "membership record '" + key + "'");
  decoded_ranks out;
  const auto n = r.read<std::uint64_t>();
  if (n > bytes.size()) r.fail("names " + std::to_string(n) + " ranks; the record is damaged");
  for (std::uint64_t i = 0; i < n; ++i) out.ranks.push_back(static_cast<int>(r.read<std::int64_t>()));
  out.failure = r.read_string();
  out.steps = r.read<std::int64_t>();
  return out;
}

//! aborted_error, naming the step, when the coordinator's training loop ended (`ended_key` is
//! set: step 5 of the protocol; "" watches nothing).
template <store S>
void refuse_if_ended(S& st, const std::string& ended_key, const std::string& who, int coordinator) {
  if (ended_key.empty() || !st.check({ended_key})) return;
  const std::vector<std::byte> record = st.get(ended_key);
  byte_reader r(record, "membership record '" + ended_key + "'");
  const auto steps = r.read<std::int64_t>();
  throw aborted_error(who + ": job rank " + std::to_string(coordinator) +
                      ", which coordinates changes of membership, ended its training loop after step " +
                      std::to_string(steps) +
                      " while this rank's step failed: no change of membership will come, so this rank cannot go on");
}

//! Waits for `decision_key` (the store's timeout at most) and throws aborted_error when the
//! coordinator's loop ended instead (`ended_key`, step 5 of the protocol: looked at between
//! slices of the wait).
template <store S>
std::vector<std::byte> await_decision(S& st, const std::string& decision_key, const std::string& ended_key,
                                      const std::string& who, int coordinator) {
  const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(st.timeout());
  try {
    wait_unless(st, {decision_key}, limit, [&] { refuse_if_ended(st, ended_key, who, coordinator); });
  } catch (const timeout_error&) {
    throw timeout_error(who + ": no decision on who goes on came from job rank " + std::to_string(coordinator) +
                        ", which coordinates changes of membership (gone too?), within the store's timeout (" +
                        std::to_string(limit.count()) + " ms)");
  }
  return st.get(decision_key);
}

inline std::string rank_list(std::span<const int> ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s.empty() ? "none" : s;
}

// The coordinator's part: who reported, by the rules in the file comment; the decision.
// gone_now(): the ranks this rank knows are gone, asked again while it waits (a second rank
// may fail after the first).
template <store S, class GoneNow>
std::vector<std::byte> coordinate(S& st, const membership& now, GoneNow& gone_now, const SurvivorOptions& o,
                                  std::int64_t steps, const std::string& scope, std::string& failure) {
  std::vector<int> gone = gone_now();
  const auto deadline = std::chrono::steady_clock::now() + o.settle;
  std::vector<int> alive{now.job_rank()}, pending;
  for (int r : now.ranks)
    if (r != now.job_rank()) pending.push_back(r);
  for (;;) {
    for (int g : gone_now()) gone.push_back(g);
    for (auto it = pending.begin(); it != pending.end();) {
      const std::string key = elastic_key(scope, now.epoch, "alive/" + std::to_string(*it));
      if (st.check({key})) {
        for (int g : decode_ranks(st.get(key), key).ranks) gone.push_back(g);
        alive.push_back(*it);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    const bool settled = std::all_of(pending.begin(), pending.end(),
                                     [&](int r) { return std::find(gone.begin(), gone.end(), r) != gone.end(); });
    if (settled || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::sort(alive.begin(), alive.end());
  if (static_cast<int>(alive.size()) < o.min_ranks)
    failure = std::to_string(alive.size()) + " rank(s) remain (job ranks " + rank_list(alive) +
              "), fewer than SurvivorOptions::min_ranks = " + std::to_string(o.min_ranks);
  return encode_ranks(alive, failure, steps);
}

}  // namespace detail

//! After a failure in membership `now` (every survivor calls it): the members that go on,
//! agreed through the store `st` (the file comment has the protocol). gone_now() returns the
//! job ranks this rank knows are gone (e.g. ThreadComm::failed_ranks); the coordinator asks
//! it again while it waits. Returns the change, `after.epoch` = now.epoch + 1, `after.rank`
//! this process's rank in the smaller group. Throws aborted_error, naming why, when this rank
//! is not among them, when fewer than o.min_ranks remain, when the coordinator (now.ranks[0])
//! is gone or its training loop ended; timeout_error when no decision came within the store's
//! timeout.
//! `steps`: the steps this rank completed; the coordinator's reach every survivor (`steps` of
//! the change). `ended`: the key a coordinator whose training loop ended sets (step 5 of the
//! protocol; ElasticGroup passes its own), "" for none. `scope`: the keys' (elastic_key), so
//! that groups made one after another on the store do not read each other's.
template <store S, class GoneNow>
  requires std::is_invocable_r_v<std::vector<int>, GoneNow&>
membership_change agree_on_survivors(S& st, const membership& now, GoneNow gone_now, const SurvivorOptions& o = {},
                                     std::int64_t steps = 0, const std::string& ended = {},
                                     const std::string& scope = {}) {
  if (now.rank < 0 || now.rank >= now.size())
    throw config_error("agree_on_survivors: this rank's place " + std::to_string(now.rank) +
                       " is outside the membership of " + std::to_string(now.size()) + " ranks");
  const int coordinator = now.ranks.front();
  const std::string who = "rank " + std::to_string(now.job_rank());
  // A coordinator whose loop ended counts as gone too (ranks as threads): say which it was.
  if (now.job_rank() != coordinator) detail::refuse_if_ended(st, ended, who, coordinator);
  const std::vector<int> known_gone = gone_now();
  if (std::find(known_gone.begin(), known_gone.end(), coordinator) != known_gone.end())
    throw aborted_error(who + ": job rank " + std::to_string(coordinator) +
                        ", which coordinates changes of membership (the lowest member; with a TcpStore, the rank "
                        "that hosts the store), is gone; the job cannot go on without it: resume from the last "
                        "checkpoint");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string decision_key = detail::elastic_key(scope, now.epoch, "decision");
  std::vector<std::byte> decision;
  if (now.job_rank() == coordinator) {
    std::string failure;
    decision = detail::coordinate(st, now, gone_now, o, steps, scope, failure);
    st.set(decision_key, decision);
  } else {
    st.set(detail::elastic_key(scope, now.epoch, "alive/" + std::to_string(now.job_rank())),
           detail::encode_ranks(known_gone));
    decision = detail::await_decision(st, decision_key, ended, who, coordinator);
  }
  const auto got = detail::decode_ranks(decision, decision_key);
  if (!got.failure.empty()) throw aborted_error(who + ": the job cannot go on: " + got.failure);
  membership_change c;
  c.before = now;
  c.after.epoch = now.epoch + 1;
  c.after.ranks = got.ranks;
  const auto me = std::find(got.ranks.begin(), got.ranks.end(), now.job_rank());
  if (me == got.ranks.end())
    throw aborted_error(who + " reported after the survivors were decided (job ranks " + detail::rank_list(got.ranks) +
                        " go on without it); it is out of the job and may join again as a new rank");
  c.after.rank = static_cast<int>(me - got.ranks.begin());
  c.steps = got.steps;
  for (int r : now.ranks)
    if (std::find(got.ranks.begin(), got.ranks.end(), r) == got.ranks.end()) c.gone.push_back(r);
  c.agreement = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  return c;
}

//! The same with a fixed list of the job ranks this rank knows are gone.
template <store S>
membership_change agree_on_survivors(S& st, const membership& now, std::span<const int> known_gone,
                                     const SurvivorOptions& o = {}) {
  const std::vector<int> gone(known_gone.begin(), known_gone.end());
  return agree_on_survivors(st, now, [&gone] { return gone; }, o);
}

//! After a change, the two ways to go on with fewer (or more) ranks, `c.before.size()` → `c.after.size()`:
//!  - the same global batch: each rank accumulates more micro-steps (Accumulate<>::set_steps
//!    in an ElasticGroup's on_change). `steps` micro-steps per rank before; returns
//!    steps · before / after, or throws config_error, naming the other way, when that is not
//!    a whole number;
//!  - the same per-rank batch (the default of ElasticGroup, which changes nothing): the global
//!    batch scales by after / before, and so, by the linear scaling rule (Goyal et al. 2017),
//!    may the learning rate — lr_for_rank_change.
inline int steps_for_same_global_batch(int steps, const membership_change& c) {
  const long long total = static_cast<long long>(steps) * c.before.size();
  if (steps < 1 || c.after.size() < 1 || total % c.after.size() != 0)
    throw config_error("steps_for_same_global_batch: " + std::to_string(steps) + " micro-step(s) on each of " +
                       std::to_string(c.before.size()) + " ranks cannot be split evenly over " +
                       std::to_string(c.after.size()) +
                       "; keep the per-rank batch instead and rescale the learning rate (lr_for_rank_change)");
  return static_cast<int>(total / c.after.size());
}
//! lr · after / before: the learning rate for the same per-rank batch on the new ranks.
inline double lr_for_rank_change(double lr, const membership_change& c) {
  return lr * static_cast<double>(c.after.size()) / static_cast<double>(c.before.size());
}

}  // namespace lockstep
