#pragma once
//! lockstep::PeerCopy — ShardedOptimizer's state held twice, so that a lost rank's optimizer
//! shard outlives it: every `every` optimizer steps each rank copies its part of the sharded
//! state — its shards' values and its optimizer's state — within the communicator's memory
//! (device memory on GPUs) and hands it to the rank before it in the ring (a communicator
//! `shift`), which keeps it; the replicated rest (loss scale, layout, data position) is kept
//! on the host. Nothing waits for the copy: it runs on the streams of the steps, and a seal (a
//! one-element all-reduce issued after the shift on every rank) is waited for at the next
//! snapshot. When ranks die, the survivors tell each other what they hold and all take the
//! newest snapshot of which every part is there — held by its own rank, still a member, or, once
//! a survivor saw its seal complete (then every rank had received its copy), by the rank before
//! it —, gather the parts and load them resharded for their number (load_sharded), the
//! parameters and the training state with them: training goes on from the snapshot's step. A
//! rank and the one before it lost together take the only copy of the first: restore() then
//! says so and changes nothing (roll back to a checkpoint). When a replacement joined (nobody
//! lost), the members' own parts of their newest snapshot are cut for the grown group the same
//! way; the replacement, which holds nothing, restores with them.
//!
//! The optimizer's state is copied whole where the optimizer keeps it in one buffer
//! (imaged_optimizer: FusedSgd, FusedAdamW — a device-to-device copy, turned into save()'s
//! bytes only at a restore); any other serializable optimizer is saved at each snapshot (a
//! host copy). The loop: docs/elastic.md (compiled and run by tests/docs/snippets.cpp). Needs
//! a communicator with shift(): ThreadComm and NcclComm.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "lockstep/checkpoint/checkpoint.hpp"
#include "lockstep/checkpoint/sharded.hpp"
#include "lockstep/checkpoint/training_state.hpp"
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/elastic/detail/peer_part.hpp"
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
  PeerCopy(const PeerCopy&) = delete;
  PeerCopy& operator=(const PeerCopy&) = delete;
  ~PeerCopy() {
    for (auto& g : gen_) settle_quietly(g);  // (a copy in flight must not outlive its buffers)
  }

  //! After optimizer step `step` is complete on this rank (the sampler advanced past it), inside
  //! the step's ElasticGroup::attempt: when `step` is a multiple of `every`, a snapshot, and this
  //! rank's part to the rank before it in `members` (collective over dp.comm()). Returns whether
  //! it took one. Waits only for the seal of the snapshot before (issued a snapshot ago); the
  //! first snapshot of a DataParallel, or of another shard layout, also exchanges the parts'
  //! heads (host collectives). A failure meanwhile leaves the snapshots before it usable.
  template <class DP, serializable Opt, class Sampler>
    requires DP::sharded
  bool save(std::int64_t step, const membership& members, DP& dp, const Opt& opt, const Sampler& sampler) {
    return save_with(step, members, dp, opt, [&](Checkpoint& ck) { detail::add_sampler_state(ck, sampler); });
  }
  //! The same for a loop without a sampler (the data position is the loop's).
  template <class DP, serializable Opt>
    requires DP::sharded
  bool save(std::int64_t step, const membership& members, DP& dp, const Opt& opt) {
    return save_with(step, members, dp, opt, [](Checkpoint&) {});
  }

  //! In ElasticGroup::on_change, once DataParallel (and an optimizer over its shards) was rebuilt
  //! over the survivors `now` (group.members()): the survivors agree on the newest snapshot of
  //! which every part is held — by its own rank, or, once one of them saw its seal complete, by
  //! the rank before it (after a grow: the members' newest, the replacement calling restore()
  //! too, once it built the same) —, and the sampler is re-partitioned, the snapshot's
  //! parameters and training state restored and the optimizer state loaded resharded
  //! (collective over dp.comm()). Returns the snapshot's step: go on from it. Empty, with
  //! nothing changed, when no snapshot is whole: a rank and the rank before it were both lost
  //! (lost() names them) or none was sealed yet (why() says so): restore from a checkpoint then
  //! (the snapshots are dropped). Until the next save() the
  //! copies are those of the group before the change. A throw after the agreement (a damaged
  //! part) may leave the training state restored but not the optimizer: go back to a
  //! checkpoint then too.
  template <class DP, serializable Opt, class Sampler>
    requires DP::sharded
  std::optional<std::int64_t> restore(const membership& now, DP& dp, Opt& opt, Sampler& sampler) {
    return restore_with(now, dp, opt, [&](const Checkpoint& ck) { restore_training_state(ck, dp, sampler); });
  }
  template <class DP, serializable Opt>
    requires DP::sharded
  std::optional<std::int64_t> restore(const membership& now, DP& dp, Opt& opt) {
    return restore_with(now, dp, opt, [&](const Checkpoint& ck) { restore_training_state(ck, dp); });
  }

  //! Drops every snapshot: call it when the loop goes back to a checkpoint by other means (the
  //! snapshots are ahead of it; save() also drops any of the step it is given or later).
  void clear() {
    for (auto& g : gen_) drop(g);
  }

  //! After restore() returned empty: why (no snapshot sealed yet, or parts lost), and the job
  //! ranks whose part was lost with the rank holding its copy.
  const std::string& why() const noexcept { return why_; }
  const std::vector<int>& lost() const noexcept { return lost_; }
  //! The step of the newest snapshot this rank saw sealed (−1: none yet).
  std::int64_t step() const noexcept { return newest_sealed(); }
  //! Memory the snapshots hold on this rank: in the communicator's memory space (device memory
  //! on GPUs: two snapshots, each this rank's part and the copy of the next rank's), and on the
  //! host (the replicated training state, the heads).
  std::size_t bytes() const {
    std::size_t b = 0;
    for (const auto& g : gen_) b += 2 * g.width + g.mine_head.map.size() + g.next_head.map.size() + state_bytes(g);
    return b;
  }

 private:
  struct generation {
    std::int64_t step = -1;
    std::uint64_t epoch = 0;   // the membership's: its seal is trusted only over that communicator
    std::vector<int> members;  // job ranks when it was taken
    Checkpoint state;          // replicated, but the parameters: loss scale, layout, sampler
    detail::sharded_origin origin;
    detail::peer_part_head mine_head, next_head;
    std::shared_ptr<void> mine, next, seal_buf;  // the communicator's memory: `width` bytes each
    std::size_t width = 0;
    std::function<bool()> seal_done;  // the seal's work: completed (never blocks)
    std::function<void()> seal_wait;  // ... waited for on the host
    bool sealed = false;              // this rank saw the seal complete: every rank holds its copy
  };

  template <class DP, class Opt, class AddSampler>
  bool save_with(std::int64_t step, const membership& members, DP& dp, const Opt& opt, AddSampler&& add_sampler) {
    using Comm = std::remove_cvref_t<decltype(dp.comm())>;
    static_assert(shifting_communicator<Comm>,
                  "lockstep::PeerCopy needs a communicator with shift() (ThreadComm, NcclComm); MpiComm "
                  "does not have one yet (issue 29): roll back to a checkpoint instead");
    if (step < 0)
      throw config_error("PeerCopy::save: step " + std::to_string(step) + "; pass the optimizer steps done");
    if (step % opt_.every != 0) return false;
    check_group("save", members, dp);
    auto& comm = dp.comm();
    // The snapshot before this one: its seal (long since complete, unless the device lags).
    for (auto& g : gen_) seal(g, comm, members.epoch);
    // A snapshot of this step or a later one is of steps the loop went back before (a rollback
    // to a checkpoint): dropped, so that it can never be restored.
    for (auto& g : gen_)
      if (g.step >= step) drop(g);
    // The older (or an empty) slot is overwritten; the newer stays until this one is sealed.
    generation& g = gen_[gen_[0].step < 0 ? 0 : gen_[1].step < 0 ? 1 : gen_[0].step < gen_[1].step ? 0 : 1];
    drop(g);
    // This rank's part: its shards' values, then the optimizer's image or save()'s bytes.
    std::vector<std::pair<const void*, std::size_t>> from;
    for (const auto& p : dp.shard_parameters()) from.emplace_back(p.value, p.bytes());
    std::vector<std::byte> saved;
    if constexpr (imaged_optimizer<Opt>) {
      const auto img = opt.state_image();
      from.emplace_back(img.data(), img.size());
    } else {
      byte_writer w;
      opt.save(w);
      saved = std::move(w).release();
    }
    auto mine =
        detail::peer_head_of(dp, imaged_optimizer<Opt>, imaged_optimizer<Opt> ? from.back().second : saved.size());
    // The heads go round once for a layout and membership (an image's size is fixed), at every
    // snapshot for saved bytes (their length may change). Collective either way: the same on
    // every rank.
    const bool same_group = head_ && head_->layout == dp.shard_layout() && head_->members == members;
    const bool fresh = !imaged_optimizer<Opt> || !(same_group && head_->mine == mine);
    if (fresh) {
      if (same_group && imaged_optimizer<Opt>)
        throw config_error("PeerCopy::save: the optimizer's state changed size since the last snapshot of this "
                           "group (another optimizer?); call clear() on every rank, or keep one optimizer");
      std::int64_t width = static_cast<std::int64_t>(mine.bytes());
      detail::host_all_reduce(comm, std::span<std::int64_t>(&width, 1), reduce_op::max);
      const auto next = detail::peer_part_head::decode(detail::host_shift_string(comm, mine.encode(), 1));
      head_ = heads{dp.shard_layout(), members, mine, next, static_cast<std::size_t>(width)};
    }
    auto mem = comm.memory();
    if (g.width != head_->width || !g.mine) {
      g = generation{};  // (nothing runs into its buffers: its seal was waited for above, or they were retired)
      g.mine = mem.allocate(head_->width);
      g.next = mem.allocate(head_->width);
      g.seal_buf = mem.allocate(sizeof(std::int64_t));
      g.width = head_->width;
    }
    g.epoch = members.epoch;
    g.members = members.ranks;
    g.state.meta.step = static_cast<std::uint64_t>(step);
    add_sampler(g.state);
    detail::add_training_sections(g.state, dp);
    g.origin = detail::sharded_origin::of(dp);
    g.mine_head = head_->mine;
    g.next_head = head_->next;
    detail::pack_bytes(mem, std::span<const std::pair<const void*, std::size_t>>(from), g.mine.get());
    if (!saved.empty())
      mem.upload(static_cast<std::byte*>(g.mine.get()) + mine.value_bytes(), saved.data(), saved.size());
    (void)comm.shift(g.mine.get(), g.next.get(), g.width, dtype::u8, 1);
    auto w =
        std::make_shared<decltype(comm.all_reduce(g.seal_buf.get(), g.seal_buf.get(), 1, dtype::i64, reduce_op::max))>(
            comm.all_reduce(g.seal_buf.get(), g.seal_buf.get(), 1, dtype::i64, reduce_op::max));
    g.seal_done = [w] {
      if constexpr (requires { w->query(); }) return w->query();
      else return true;  // (a host communicator's collectives complete before they return)
    };
    g.seal_wait = [w] {
      if constexpr (requires { w->synchronize(); }) w->synchronize();
      else w->wait();
    };
    g.step = step;  // (only now: a throw above leaves the slot empty)
    if (g.seal_done() && !aborted(comm)) g.sealed = true;
    return true;
  }

  template <class DP, class Opt, class RestoreState>
  std::optional<std::int64_t> restore_with(const membership& now, DP& dp, Opt& opt, RestoreState&& restore_state) {
    check_group("restore", now, dp);
    // Every survivor tells what it holds (a replacement that joined: nothing); all then decide
    // alike which snapshot to go on from, and find the same problems.
    std::vector<detail::peer_holding> mine;
    for (const auto& g : gen_)
      if (g.step >= 0) mine.push_back({g.step, g.sealed, {g.members, g.state, g.origin}});
    std::vector<std::vector<detail::peer_holding>> told;
    for (const auto& t : detail::host_all_gather_strings(dp.comm(), detail::encode_holdings(mine)))
      told.push_back(detail::decode_holdings(t));
    const auto choice = detail::choose_peer_snapshot(told, now.ranks);
    lost_ = choice.lost;
    why_.clear();
    if (choice.step < 0) {
      if (lost_.empty()) {
        why_ = "no snapshot sealed yet on any survivor (the first is taken at step " + std::to_string(opt_.every) + ")";
      } else {
        why_ = "the part of job rank(s)";
        for (int r : lost_) why_ += " " + std::to_string(r);
        why_ += " was lost with the rank before it, which held its copy";
      }
      clear();  // the caller goes back to a checkpoint: what some ranks hold is ahead of it
      return std::nullopt;
    }
    const std::int64_t agreed = choice.step;
    const detail::peer_snapshot& snap = *choice.snap;
    int at = -1;
    for (int k = 0; k < 2; ++k)
      if (gen_[k].step == agreed) at = k;
    if (at >= 0) {
      // A newer snapshot than the agreed one belongs to steps the survivors now redo: dropped.
      if (gen_[1 - at].step > agreed) drop(gen_[1 - at]);
      if (choice.sealed) gen_[at].sealed = true;  // (whoever saw its seal said so)
    }
    // What this survivor gives: its own part, and the copy of its successor's where the
    // successor does not give its own (gone, or back without it).
    const std::size_t n = snap.members.size();
    std::vector<std::size_t> give;
    for (std::size_t q = 0; q < n; ++q)
      if (choice.provider[q] == now.job_rank()) give.push_back(q);
    std::string problem;
    byte_writer held;
    held.write(static_cast<std::uint32_t>(give.size()));
    auto mem = dp.comm().memory();
    const auto hold = [&](std::size_t place, const detail::peer_part_head& h, const void* where) {
      std::vector<std::byte> bytes(h.bytes());
      if (!bytes.empty()) mem.download(bytes.data(), where, bytes.size());
      const auto part = detail::sharded_part_from(h, bytes, opt);
      const auto head = h.encode();
      held.write(static_cast<std::uint64_t>(place));
      held.write_string(head);
      held.write_string(part);
      held.write_string(std::string_view(reinterpret_cast<const char*>(bytes.data()), h.value_bytes()));
    };
    try {
      for (const std::size_t q : give) {
        const bool own = snap.members[q] == now.job_rank();
        hold(q, own ? gen_[at].mine_head : gen_[at].next_head, own ? gen_[at].mine.get() : gen_[at].next.get());
      }
    } catch (const std::exception& e) {  // (an image that the optimizer given cannot read)
      problem = e.what();
    }
    detail::peer_agree_or_throw(dp.comm(), problem, agreed);
    const auto bytes = std::move(held).release();
    const auto all = detail::host_all_gather_strings(
        dp.comm(), std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    std::vector<std::string> heads(n), parts(n), values(n);
    std::vector<bool> have(n, false);
    for (const auto& s : all) {
      byte_reader r(std::as_bytes(std::span(s.data(), s.size())), "a survivor's parts of the peer copy");
      const auto k = r.read<std::uint32_t>();
      for (std::uint32_t i = 0; i < k; ++i) {
        const auto place = r.read<std::uint64_t>();
        if (place >= n) r.fail("names part " + std::to_string(place) + " of " + std::to_string(n));
        for (std::string* into : {&heads[place], &parts[place], &values[place]}) *into = r.read_string();
        have[place] = true;
      }
    }
    if (std::find(have.begin(), have.end(), false) != have.end())
      throw checkpoint_error("PeerCopy::restore: a part of the snapshot of step " + std::to_string(agreed) +
                             " came from no survivor");
    Checkpoint ck = snap.state;
    detail::add_peer_parameters(ck, dp, snap.origin, heads, parts, values);
    restore_state(ck);  // (the sampler moved to the survivors' ranks first)
    load_sharded(dp, opt, detail::sharded_section(snap.origin, parts));
    return agreed;
  }

  template <class Comm>
  static bool aborted(Comm& comm) {
    if constexpr (requires { comm.aborted(); }) return comm.aborted();
    else return false;
  }
  // Waits for g's seal; a communicator aborted meanwhile means it may have ended early. A seal
  // issued over the communicator of another membership (aborted at the change, or left by a
  // grow) proves nothing: that snapshot is dropped, its buffers retired if its copy still runs.
  template <class Comm>
  void seal(generation& g, Comm& comm, std::uint64_t epoch) {
    if (!g.seal_wait) return;
    if (g.sealed) {
      g.seal_wait = {};
      g.seal_done = {};
      return;
    }
    if (g.epoch != epoch) {
      if (!g.seal_done()) retire(g);
      g.seal_wait = {};
      g.seal_done = {};
      drop(g);
      return;
    }
    g.seal_wait();  // (also for a dropped one: its buffers are about to be reused)
    g.seal_wait = {};
    g.seal_done = {};
    if (g.step < 0) return;
    if (aborted(comm))
      throw aborted_error("PeerCopy::save: the communicator was aborted while the snapshot of step " +
                          std::to_string(g.step) + " was handed on");
    g.sealed = true;
  }
  // g's buffers, kept (until this object ends) rather than reused: a copy may still run into them.
  void retire(generation& g) {
    for (auto* b : {&g.mine, &g.next, &g.seal_buf})
      if (*b) retired_.push_back(std::move(*b));
    g.width = 0;
  }
  static void settle_quietly(generation& g) noexcept {
    try {
      if (g.seal_wait) g.seal_wait();
    } catch (...) {
    }
    g.seal_wait = {};
    g.seal_done = {};
  }
  // Forgets g's snapshot; its buffers stay (a copy may still run into them).
  static void drop(generation& g) {
    g.step = -1;
    g.sealed = false;
    g.members.clear();
    g.state = Checkpoint{};
  }
  static std::size_t state_bytes(const generation& g) {
    std::size_t b = 0;
    for (const auto& name : g.state.section_names()) b += g.state.blob(name).size();
    return b;
  }
  template <class DP>
  static void check_group(const char* what, const membership& m, DP& dp) {
    if (m.size() != dp.size() || m.rank != dp.rank())
      throw config_error(std::string("PeerCopy::") + what + ": the membership (" + std::to_string(m.size()) +
                         " ranks, this one " + std::to_string(m.rank) + ") is not the DataParallel's group (" +
                         std::to_string(dp.size()) + " ranks, this one " + std::to_string(dp.rank()) +
                         "); pass ElasticGroup::members()");
  }
  std::int64_t newest_sealed() const {
    std::int64_t s = -1;
    for (const auto& g : gen_)
      if (g.sealed) s = std::max(s, g.step);
    return s;
  }

  // The heads of this group's parts: this rank's and the next one's, and the parts' width.
  struct heads {
    std::uint64_t layout = 0;
    membership members;
    detail::peer_part_head mine, next;
    std::size_t width = 0;
  };

  PeerCopyOptions opt_;
  generation gen_[2];
  std::optional<heads> head_;
  std::vector<std::shared_ptr<void>> retired_;  // buffers a copy of an older membership may still reach
  std::vector<int> lost_;
  std::string why_;
};

}  // namespace lockstep
