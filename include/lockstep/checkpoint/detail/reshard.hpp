#pragma once
//! Resharding a sharded optimizer's state (checkpoint/sharded.hpp) onto another shard layout —
//! another number of ranks, or other bucket sizes. Every saved rank's state (the optimizer
//! checkpoint layout of optim/optimizer.hpp) is indexed in place, its slots located on the
//! model's parameters through the shard map saved beside it, and this rank's new shards are
//! cut from them element by element, in the same layout, for opt.load(). Elements of a shard
//! that hold no parameter (the padding that makes a unit divisible by the rank count) get zero
//! state. Nothing is converted: states keep their element type and bits.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/optim/optimizer.hpp"

namespace lockstep::detail {

//! One rank's saved optimizer state, indexed: where each slot's arrays start in `bytes`.
struct saved_optimizer {
  struct slot : slot_header {         // has, type, count, step as saved
    std::vector<std::size_t> states;  // byte positions of the state arrays
    std::size_t master = 0;           // byte position of its fp32 masters, if has_master
    bool has_master = false;
  };
  std::span<const std::byte> bytes;
  bool masters = false;  // written with Rule::magic_with_masters
  std::span<const std::byte> options;
  std::vector<slot> slots;
};

//! Indexes bytes (what opt.save() wrote, Rule's layout); `what` names it in errors.
template <optimizer_rule Rule>
saved_optimizer index_saved_optimizer(std::span<const std::byte> bytes, const std::string& what) {
  byte_reader r(bytes, what);
  saved_optimizer s;
  s.bytes = bytes;
  const auto head = r.peek(8);
  s.masters = head.size() == 8 && std::memcmp(head.data(), Rule::magic_with_masters, 8) == 0;
  r.expect_magic(std::string_view(s.masters ? Rule::magic_with_masters : Rule::magic, 8),
                 std::string(Rule::name) + "::save() or " + Rule::fused_name + "::save()");
  const std::size_t options_at = r.position();
  const auto o = checked_loaded_options<Rule>(r, Rule::name);
  s.options = bytes.subspan(options_at, r.position() - options_at);
  const int states = Rule::states(o);
  const auto n = r.read<std::uint64_t>();
  if (n > r.remaining()) r.fail("claims " + std::to_string(n) + " slots");
  for (std::uint64_t i = 0; i < n; ++i) {
    const auto h = get_slot_header(r, i, Rule::saves_step, states > 0);
    auto& sl = s.slots.emplace_back();
    static_cast<slot_header&>(sl) = h;
    if (!h.has) continue;
    const std::size_t es = size_of(h.type);
    for (int k = 0; k < states; ++k) {
      if (h.count > r.remaining() / es) r.fail("ends inside slot " + std::to_string(i) + "'s state");
      sl.states.push_back(r.position());
      (void)r.take(static_cast<std::size_t>(h.count) * es);
    }
  }
  if (s.masters) {
    const auto m = r.read<std::uint64_t>();
    for (std::uint64_t j = 0; j < m; ++j) {
      const auto i = r.read<std::uint64_t>();
      const auto count = r.read<std::uint64_t>();
      if (i >= s.slots.size() || s.slots[i].has_master || count != s.slots[i].count || count > r.remaining() / 4)
        r.fail("master " + std::to_string(j) + " (slot " + std::to_string(i) + ") matches no slot");
      s.slots[i].has_master = true;
      s.slots[i].master = r.position();
      (void)r.take(static_cast<std::size_t>(count) * 4);
    }
  }
  r.expect_end();
  return s;
}

//! This rank's state for its shards `mine` (per new slot: its segments; counts: each new
//! shard's length), cut from every saved rank's state `saved` through that rank's shard map
//! `saved_maps`; Rule's layout, ready for opt.load(). Throws checkpoint_error when the saved
//! state does not cover a parameter of the new shards, or its ranks disagree (options, step).
template <optimizer_rule Rule>
std::vector<std::byte> reshard_optimizer_state(std::span<const saved_optimizer> saved,
                                               std::span<const std::vector<std::vector<shard_segment>>> saved_maps,
                                               std::span<const std::vector<shard_segment>> mine,
                                               std::span<const std::size_t> counts) {
  const auto fail = [](const std::string& why) -> void {
    throw checkpoint_error("cannot reshard the sharded optimizer state: " + why);
  };
  if (saved.empty() || saved.size() != saved_maps.size()) fail("it holds no rank's state");
  for (std::size_t k = 0; k < saved.size(); ++k) {
    const auto& a = saved[k].options;
    if (saved[k].masters != saved[0].masters || a.size() != saved[0].options.size() ||
        std::memcmp(a.data(), saved[0].options.data(), a.size()) != 0)
      fail("rank " + std::to_string(k) + " saved other optimizer options than rank 0");
    if (saved[k].slots.size() > saved_maps[k].size())
      fail("rank " + std::to_string(k) + " saved more slots than it had shards");
  }
  // Where each parameter's elements were: (saved rank, slot, segment).
  struct piece {
    std::size_t rank, slot;
    shard_segment seg;
  };
  std::vector<std::vector<piece>> pieces;
  for (std::size_t k = 0; k < saved_maps.size(); ++k)
    for (std::size_t j = 0; j < saved_maps[k].size(); ++j)
      for (const auto& g : saved_maps[k][j]) {
        if (g.param >= pieces.size()) pieces.resize(g.param + 1);
        pieces[g.param].push_back({k, j, g});
      }
  const auto slot_of = [&](const piece& p) -> const saved_optimizer::slot* {
    return p.slot < saved[p.rank].slots.size() ? &saved[p.rank].slots[p.slot] : nullptr;  // none: never stepped
  };
  // A run: n elements of new slot j, from element `from` of a saved rank's slot (nullptr: that
  // slot was never stepped) to element `to`.
  struct run {
    const saved_optimizer::slot* slot;
    std::size_t rank, from, to, n;
  };
  const auto runs_of = [&](std::size_t j) {
    std::vector<run> runs;
    for (const auto& g : mine[j]) {
      std::size_t covered = 0;
      if (g.param < pieces.size())
        for (const auto& p : pieces[g.param]) {
          const std::size_t a = std::max(g.param_offset, p.seg.param_offset);
          const std::size_t e = std::min(g.param_offset + g.count, p.seg.param_offset + p.seg.count);
          if (a >= e) continue;
          runs.push_back({slot_of(p), p.rank, p.seg.slot_offset + (a - p.seg.param_offset),
                          g.slot_offset + (a - g.param_offset), e - a});
          covered += e - a;
        }
      if (covered != g.count)
        fail("the saved state covers " + std::to_string(covered) + " of the " + std::to_string(g.count) +
             " elements of parameter " + std::to_string(g.param) + " this rank needs from offset " +
             std::to_string(g.param_offset) + " (saved from another model?)");
    }
    return runs;
  };
  // Copies each run's elements (es bytes each) into out (zeros where no run lands) from its
  // saved rank's bytes, from the array its slot keeps at position at(slot).
  const auto cut = [&](const std::vector<run>& runs, std::size_t es, auto&& at, std::vector<std::byte>& out) {
    for (const auto& r : runs)
      std::memcpy(out.data() + r.to * es, saved[r.rank].bytes.data() + at(*r.slot) + r.from * es, r.n * es);
  };
  std::size_t n_states = 0;  // state arrays per stepped slot (the same options: the same everywhere)
  for (const auto& s : saved)
    for (const auto& sl : s.slots)
      if (sl.has) n_states = sl.states.size();
  const auto& first = saved[0];
  byte_writer w;
  w.write_bytes(first.masters ? Rule::magic_with_masters : Rule::magic, 8);
  w.write_bytes(first.options.data(), first.options.size());
  w.write(static_cast<std::uint64_t>(mine.size()));
  std::vector<std::pair<std::size_t, std::vector<std::byte>>> masters;  // (new slot, fp32 values)
  for (std::size_t j = 0; j < mine.size(); ++j) {
    const auto runs = runs_of(j);
    // The new slot has state if its elements' saved slots have; they must agree on the step.
    int with = 0, without = 0, with_master = 0;
    slot_header h;
    for (const auto& r : runs) {
      if (!r.slot || !r.slot->has) {
        ++without;
        continue;
      }
      if (with++ == 0) h.step = r.slot->step, h.type = r.slot->type;
      else if (r.slot->step != h.step || r.slot->type != h.type)
        fail("rank " + std::to_string(r.rank) + "'s state of a parameter was stepped " + std::to_string(r.slot->step) +
             " times, another's " + std::to_string(h.step));
      with_master += r.slot->has_master ? 1 : 0;
    }
    if (with && without) fail("new shard " + std::to_string(j) + " mixes stepped and never stepped parameters");
    h.has = with > 0;
    h.count = h.has ? counts[j] : 0;
    put_slot_header(w, h, Rule::saves_step);
    if (!h.has) continue;
    const std::size_t es = size_of(h.type);
    for (std::size_t k = 0; k < n_states; ++k) {
      std::vector<std::byte> out(counts[j] * es, std::byte{0});
      cut(runs, es, [k](const saved_optimizer::slot& sl) { return sl.states[k]; }, out);
      w.write_bytes(out.data(), out.size());
    }
    if (with_master > 0 && with_master != with)
      fail("new shard " + std::to_string(j) + " mixes parameters with and without fp32 masters");
    if (with_master > 0) {
      auto& m = masters.emplace_back(j, std::vector<std::byte>(counts[j] * 4, std::byte{0}));
      cut(runs, 4, [](const saved_optimizer::slot& sl) { return sl.master; }, m.second);
    }
  }
  if (first.masters) {
    w.write(static_cast<std::uint64_t>(masters.size()));
    for (const auto& [j, bytes] : masters) {
      w.write(static_cast<std::uint64_t>(j));
      w.write(static_cast<std::uint64_t>(counts[j]));
      w.write_bytes(bytes.data(), bytes.size());
    }
  }
  return std::move(w).release();
}

}  // namespace lockstep::detail
