#pragma once
//! lockstep::PeerCopy — ShardedOptimizer's state held twice, so that a lost rank's optimizer
//! shard outlives it: every `every` optimizer steps each rank snapshots, in memory, the
//! replicated training state (parameters, loss scale, gradient layout, data position) and its
//! own part of the sharded state (its shard map and optimizer state, as gather_sharded cuts
//! it), and hands its part to the rank before it in the ring (a communicator `shift`), which
//! keeps it. When ranks die, the survivors agree on the newest snapshot all of them completed,
//! gather the parts — their own, and the copies of the lost ranks' from the ranks before
//! those — and load them resharded for their number (load_sharded), the training state with
//! them: training goes on from the snapshot's step. With `every = 1` that is the step that was
//! interrupted; nothing is lost. A rank and the one before it lost together take the only copy
//! of the first: restore() then says so and changes nothing (roll back to a checkpoint).
//!
//! The loop: docs/elastic.md (compiled and run by tests/docs/snippets.cpp).
//! Host snapshots: the parameters and the optimizer state are copied to host memory at each
//! snapshot (a device-resident copy on the copy stream is issue 29's next step). Needs a
//! communicator with shift(): ThreadComm and NcclComm (staged through device memory) today.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/checkpoint/checkpoint.hpp"
#include "lockstep/checkpoint/sharded.hpp"
#include "lockstep/checkpoint/training_state.hpp"
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/elastic/membership.hpp"

namespace lockstep {

//! A communicator with a ring shift: `shift(send, recv, count, t, d)` gives each rank the
//! block of the rank d places after it (ThreadComm, NcclComm).
template <class C>
concept shifting_communicator = communicator<C> && requires(C& c, const void* s, void* r, std::size_t n, dtype t,
                                                            int d) { c.shift(s, r, n, t, d); };

struct PeerCopyOptions {
  //! A snapshot every `every` optimizer steps (save() is called every step and skips the
  //! others). 1: a failure costs the interrupted step only; k: up to k − 1 steps more.
  std::int64_t every = 1;
};

class PeerCopy {
 public:
  explicit PeerCopy(PeerCopyOptions o = {}) : opt_(o) {
    if (o.every < 1)
      throw config_error("PeerCopyOptions::every = " + std::to_string(o.every) +
                         ": snapshots are taken every `every` optimizer steps, at least 1");
  }

  //! After optimizer step `step` is complete on this rank (the sampler advanced past it), inside
  //! the step's ElasticGroup::attempt: when `step` is a multiple of `every`, a snapshot, and this
  //! rank's part to the rank before it in `members` (collective over dp.comm()). Returns whether
  //! it took one. A failure meanwhile leaves the snapshots before it usable.
  template <class DP, serializable Opt, class Sampler>
    requires DP::sharded
  bool save(std::int64_t step, const membership& members, DP& dp, const Opt& opt, const Sampler& sampler) {
    static_assert(shifting_communicator<std::remove_cvref_t<decltype(dp.comm())>>,
                  "lockstep::PeerCopy needs a communicator with shift() (ThreadComm, NcclComm); MpiComm "
                  "does not have one yet (issue 29): roll back to a checkpoint instead");
    if (step < 0)
      throw config_error("PeerCopy::save: step " + std::to_string(step) + "; pass the optimizer steps done");
    if (step % opt_.every != 0) return false;
    check_group("save", members, dp);
    // A snapshot of this step or a later one is of steps the loop went back before (a rollback
    // to a checkpoint): dropped, so that it can never be restored.
    for (auto& c : gen_)
      if (c.step >= step) c = generation{};
    // The older (or an empty) slot is overwritten; the newer stays until this one completes.
    generation& g = gen_[!gen_[0].complete ? 0 : !gen_[1].complete ? 1 : gen_[0].step < gen_[1].step ? 0 : 1];
    g = generation{};
    g.step = step;
    g.members = members.ranks;
    g.state.meta.step = static_cast<std::uint64_t>(step);
    add_training_state(g.state, dp, sampler);
    g.origin = detail::sharded_origin::of(dp);
    g.mine = detail::sharded_part_of(dp, opt);
    g.next = detail::host_shift_string(dp.comm(), g.mine, 1);
    g.complete = true;
    return true;
  }

  //! In ElasticGroup::on_change, once DataParallel was rebuilt over the survivors `now`
  //! (group.members()): the survivors agree on the newest snapshot they all completed, and —
  //! when each lost rank's part survives, its own or its copy — the sampler is re-partitioned,
  //! the snapshot's training state restored and the optimizer state loaded resharded
  //! (collective over dp.comm()). Returns the snapshot's step: go on from it. Empty, with
  //! nothing changed, when a rank and the rank before it were both lost (lost() names them) or
  //! a survivor has no snapshot yet (why() says which): restore from a checkpoint then (the
  //! snapshots are dropped). Until the next save() the copies are those of the group before
  //! the change. A throw after the agreement (a damaged part) may leave the training state
  //! restored but not the optimizer: go back to a checkpoint then too.
  template <class DP, serializable Opt, class Sampler>
    requires DP::sharded
  std::optional<std::int64_t> restore(const membership& now, DP& dp, Opt& opt, Sampler& sampler) {
    check_group("restore", now, dp);
    std::int64_t agreed = newest_complete();
    detail::host_all_reduce(dp.comm(), std::span<std::int64_t>(&agreed, 1), reduce_op::min);
    lost_.clear();
    why_.clear();
    if (agreed < 0) {
      why_ = "no snapshot yet on every survivor (the first is taken at step " + std::to_string(opt_.every) + ")";
      clear();  // the caller goes back to a checkpoint: what some ranks hold is ahead of it
      return std::nullopt;
    }
    int at = -1;
    for (int k = 0; k < 2; ++k)
      if (gen_[k].complete && gen_[k].step == agreed) at = k;
    if (at < 0)  // survivors differ by at most one snapshot (each completed the step between)
      throw checkpoint_error("PeerCopy::restore: this rank no longer holds the snapshot of step " +
                             std::to_string(agreed) + " that the survivors agreed on");
    // A newer snapshot than the agreed one belongs to steps the survivors now redo: dropped.
    if (gen_[1 - at].step > agreed) gen_[1 - at] = generation{};
    const generation* g = &gen_[at];
    for (int r : now.ranks)
      if (std::find(g->members.begin(), g->members.end(), r) == g->members.end())
        throw config_error("PeerCopy::restore: job rank " + std::to_string(r) +
                           " was not a member when the snapshot was taken (a grown group: take a new one)");
    const auto alive = [&](int r) { return std::find(now.ranks.begin(), now.ranks.end(), r) != now.ranks.end(); };
    const std::size_t n = g->members.size();
    for (std::size_t q = 0; q < n; ++q)
      if (!alive(g->members[q]) && !alive(g->members[(q + n - 1) % n])) lost_.push_back(g->members[q]);
    if (!lost_.empty()) {
      why_ = "the part of job rank(s)";
      for (int r : lost_) why_ += " " + std::to_string(r);
      why_ += " was lost with the rank before it, which held its copy";
      clear();  // the caller goes back to a checkpoint: these are ahead of it
      return std::nullopt;
    }
    // What this survivor holds of the snapshot: its own part, and its successor's if that is gone.
    const auto me =
        static_cast<std::size_t>(std::find(g->members.begin(), g->members.end(), now.job_rank()) - g->members.begin());
    byte_writer held;
    const bool successor_gone = n > 1 && !alive(g->members[(me + 1) % n]);
    held.write(static_cast<std::uint32_t>(successor_gone ? 2 : 1));
    const auto hold = [&](std::size_t place, const std::string& part) {
      held.write(static_cast<std::uint64_t>(place));
      held.write(static_cast<std::uint64_t>(part.size()));
      held.write_bytes(part.data(), part.size());
    };
    hold(me, g->mine);
    if (successor_gone) hold((me + 1) % n, g->next);
    const auto bytes = std::move(held).release();
    const auto all = detail::host_all_gather_strings(
        dp.comm(), std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    std::vector<std::string> parts(n);
    std::vector<bool> have(n, false);
    for (const auto& s : all) {
      byte_reader r(std::as_bytes(std::span(s.data(), s.size())), "a survivor's parts of the peer copy");
      const auto k = r.read<std::uint32_t>();
      for (std::uint32_t i = 0; i < k; ++i) {
        const auto place = r.read<std::uint64_t>();
        const auto len = r.read<std::uint64_t>();
        if (place >= n || len > r.remaining())
          r.fail("names part " + std::to_string(place) + " of " + std::to_string(n));
        const auto b = r.take(static_cast<std::size_t>(len));
        parts[place].assign(reinterpret_cast<const char*>(b.data()), b.size());
        have[place] = true;
      }
    }
    if (std::find(have.begin(), have.end(), false) != have.end())
      throw checkpoint_error("PeerCopy::restore: a part of the snapshot of step " + std::to_string(agreed) +
                             " came from no survivor");
    restore_training_state(g->state, dp, sampler);  // (the sampler moved to the survivors' ranks first)
    load_sharded(dp, opt, detail::sharded_section(g->origin, parts));
    return agreed;
  }

  //! Drops every snapshot: call it when the loop goes back to a checkpoint by other means (the
  //! snapshots are ahead of it; save() also drops any of the step it is given or later).
  void clear() {
    for (auto& c : gen_) c = generation{};
  }

  //! After restore() returned empty: why (no snapshot on every survivor yet, or parts lost),
  //! and the job ranks whose part was lost with the rank holding its copy.
  const std::string& why() const noexcept { return why_; }
  const std::vector<int>& lost() const noexcept { return lost_; }
  //! The step of the newest complete snapshot on this rank (−1: none yet).
  std::int64_t step() const noexcept { return newest_complete(); }
  //! Host memory the snapshots hold on this rank.
  std::size_t bytes() const {
    std::size_t b = 0;
    for (const auto& g : gen_) {
      b += g.mine.size() + g.next.size();
      for (const auto& t : g.state.parameters()) b += t.data.size();
      for (const auto& name : g.state.section_names()) b += g.state.blob(name).size();
    }
    return b;
  }

 private:
  struct generation {
    std::int64_t step = -1;
    std::vector<int> members;  // job ranks when it was taken
    Checkpoint state;          // replicated: parameters, loss scale, layout, sampler
    detail::sharded_origin origin;
    std::string mine;  // this rank's part
    std::string next;  // the part of the rank after this one in `members`
    bool complete = false;
  };
  template <class DP>
  static void check_group(const char* what, const membership& m, DP& dp) {
    if (m.size() != dp.size() || m.rank != dp.rank())
      throw config_error(std::string("PeerCopy::") + what + ": the membership (" + std::to_string(m.size()) +
                         " ranks, this one " + std::to_string(m.rank) + ") is not the DataParallel's group (" +
                         std::to_string(dp.size()) + " ranks, this one " + std::to_string(dp.rank()) +
                         "); pass ElasticGroup::members()");
  }
  std::int64_t newest_complete() const {
    std::int64_t s = -1;
    for (const auto& g : gen_)
      if (g.complete) s = std::max(s, g.step);
    return s;
  }

  PeerCopyOptions opt_;
  generation gen_[2];
  std::vector<int> lost_;
  std::string why_;
};

}  // namespace lockstep
