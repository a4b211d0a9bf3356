#pragma once
//! Optimizer state sharded over the ranks (ShardedOptimizer) in a checkpoint: on save every
//! rank's state is gathered into one section, on load each rank takes its own back.
//!
//! \code
//!   auto opt_state = lockstep::gather_sharded(dp, opt);        // collective: every rank
//!   lockstep::save_checkpoint_rank0(dp.comm(), path, [&](lockstep::Checkpoint& ck) {
//!     lockstep::add_training_state(ck, dp);
//!     ck.add_blob("optimizer", std::move(opt_state));
//!   });
//!   // ... on resume, every rank:
//!   const auto saved = lockstep::load_checkpoint(path);
//!   lockstep::restore_training_state(saved, dp);
//!   lockstep::load_sharded(dp, opt, saved.blob("optimizer"));
//! \endcode
//!
//! Section layout, little-endian: "LSSHARD2" | u32 ranks | u64 shard layout fingerprint
//! (DataParallel::shard_layout(): ranks, element types, unit sizes, parameter order) | u64 P |
//! P × u64 parameter lengths | per rank: u64 length, then that rank's part: u64 shards, per
//! shard u64 length, u64 segments, segments × (u64 parameter, u64 offset in it, u64 count,
//! u64 offset in the shard) — its shard map, DataParallel::shard_map() — then u64 length and
//! what that rank's opt.save() wrote.
//! Loading onto the same ranks and layout hands each rank its own part back. Onto another
//! number of ranks (or other bucket sizes) the state is resharded (checkpoint/detail/reshard.hpp):
//! each rank cuts its new shards from the saved ones through their maps, for any optimizer
//! with a rule_type (lockstep's host and fused optimizers). Sections of the first layout
//! ("LSSHARD1", no maps) load onto the same ranks and layout only.

#include <concepts>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/checkpoint/detail/reshard.hpp"

namespace lockstep {

namespace detail {
inline constexpr std::string_view sharded_magic = "LSSHARD2";
inline constexpr std::string_view sharded_magic_v1 = "LSSHARD1";  // no shard maps

//! One saved rank's part of the section: its shard map and its optimizer's bytes.
struct sharded_part {
  std::vector<std::size_t> counts;              // per shard: its length
  std::vector<std::vector<shard_segment>> map;  // per shard: the model's elements in it
  std::span<const std::byte> state;             // what opt.save() wrote
};

inline sharded_part read_sharded_part(std::span<const std::byte> bytes, std::uint32_t rank) {
  byte_reader r(bytes, "rank " + std::to_string(rank) + "'s part of the sharded optimizer state");
  sharded_part p;
  const auto shards = r.read<std::uint64_t>();
  if (shards > r.remaining() / 16) r.fail("claims " + std::to_string(shards) + " shards");
  for (std::uint64_t j = 0; j < shards; ++j) {
    p.counts.push_back(static_cast<std::size_t>(r.read<std::uint64_t>()));
    const auto n = r.read<std::uint64_t>();
    if (n > r.remaining() / 32) r.fail("claims " + std::to_string(n) + " segments in shard " + std::to_string(j));
    auto& segs = p.map.emplace_back();
    for (std::uint64_t k = 0; k < n; ++k) {
      shard_segment g;
      g.param = static_cast<std::size_t>(r.read<std::uint64_t>());
      g.param_offset = static_cast<std::size_t>(r.read<std::uint64_t>());
      g.count = static_cast<std::size_t>(r.read<std::uint64_t>());
      g.slot_offset = static_cast<std::size_t>(r.read<std::uint64_t>());
      if (g.slot_offset > p.counts.back() || g.count > p.counts.back() - g.slot_offset)
        r.fail("shard " + std::to_string(j) + " has a segment outside it");
      segs.push_back(g);
    }
  }
  const auto n = r.read<std::uint64_t>();
  if (n != r.remaining()) r.fail("its optimizer state claims " + std::to_string(n) + " bytes");
  p.state = r.take(static_cast<std::size_t>(n));
  return p;
}
}  // namespace detail

namespace detail {
//! The head of this rank's part of the section: its shard map.
template <class DP>
std::string sharded_map_of(DP& dp) {
  byte_writer mine;
  const auto map = dp.shard_map();
  mine.write(static_cast<std::uint64_t>(map.size()));
  for (std::size_t j = 0; j < map.size(); ++j) {
    mine.write(static_cast<std::uint64_t>(dp.shard_parameters()[j].numel()));
    mine.write(static_cast<std::uint64_t>(map[j].size()));
    for (const auto& g : map[j]) {
      const std::uint64_t fields[] = {g.param, g.param_offset, g.count, g.slot_offset};
      for (const auto v : fields) mine.write(v);
    }
  }
  const auto bytes = std::move(mine).release();
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

//! A part of the section: a shard map (sharded_map_of) and the optimizer's bytes.
inline std::string sharded_part(std::string map, std::span<const std::byte> state) {
  byte_writer w;
  w.write(static_cast<std::uint64_t>(state.size()));
  const auto len = std::move(w).release();
  map.append(reinterpret_cast<const char*>(len.data()), len.size());
  map.append(reinterpret_cast<const char*>(state.data()), state.size());
  return map;
}

//! This rank's part of the section: its shard map and what opt.save() writes.
template <class DP, serializable Opt>
std::string sharded_part_of(DP& dp, const Opt& opt) {
  byte_writer state;
  opt.save(state);
  const auto bytes = std::move(state).release();
  return sharded_part(sharded_map_of(dp), bytes);
}

//! What the section's head says of the DataParallel that saved it: its shard layout and its
//! parameters' lengths.
struct sharded_origin {
  std::uint64_t layout = 0;
  std::vector<std::uint64_t> lengths;
  template <class DP>
  static sharded_origin of(DP& dp) {
    sharded_origin o{dp.shard_layout(), {}};
    for (const auto& p : dp.parameters()) o.lengths.push_back(static_cast<std::uint64_t>(p.numel()));
    return o;
  }
};

//! The section: the head, then every rank's part (sharded_part_of), in rank order.
inline std::vector<std::byte> sharded_section(const sharded_origin& origin, std::span<const std::string> parts) {
  byte_writer w;
  w.write_bytes(sharded_magic.data(), sharded_magic.size());
  w.write(static_cast<std::uint32_t>(parts.size()));
  w.write(origin.layout);
  w.write(static_cast<std::uint64_t>(origin.lengths.size()));
  for (const auto n : origin.lengths) w.write(n);
  for (const auto& s : parts) {
    w.write(static_cast<std::uint64_t>(s.size()));
    w.write_bytes(s.data(), s.size());
  }
  return std::move(w).release();
}
}  // namespace detail

//! Every rank's optimizer state, as one checkpoint section (collective: every rank calls it
//! and gets the same bytes; rank 0 adds them to the checkpoint).
template <class DP, serializable Opt>
  requires DP::sharded
std::vector<std::byte> gather_sharded(DP& dp, const Opt& opt) {
  if (!dp.stats().values_exact) dp.wait_all_parameters();  // every rank is here: gather_wire's values made exact
  const auto all = detail::host_all_gather_strings(dp.comm(), detail::sharded_part_of(dp, opt));
  return detail::sharded_section(detail::sharded_origin::of(dp), all);
}

//! Loads this rank's part of a section gather_sharded wrote into opt (collective) — resharded
//! when the section was saved by another number of ranks or shard layout (see the top). If
//! any rank's part is missing or damaged, every rank throws checkpoint_error (the damaged rank
//! its own); a copyable optimizer is then unchanged everywhere.
template <class DP, serializable Opt>
  requires DP::sharded
void load_sharded(DP& dp, Opt& opt, std::span<const std::byte> section) {
  const auto apply = [&](Opt& target) {
    byte_reader r(section, "sharded optimizer state");
    const auto head = r.peek(8);
    const bool v1 = head.size() == 8 && std::memcmp(head.data(), detail::sharded_magic_v1.data(), 8) == 0;
    r.expect_magic(v1 ? detail::sharded_magic_v1 : detail::sharded_magic, "lockstep::gather_sharded");
    const auto ranks = r.read<std::uint32_t>();
    const auto layout = r.read<std::uint64_t>();
    const bool same = ranks == static_cast<std::uint32_t>(dp.size()) && layout == dp.shard_layout();
    if (v1 && !same)
      throw checkpoint_error("the sharded optimizer state was saved by " + std::to_string(ranks) + " ranks with " +
                             (layout == dp.shard_layout() ? "this" : "another") +
                             " shard layout, by a lockstep "
                             "that saved no shard maps: resume on the same number of ranks, model and BucketPolicy");
    if (!v1) {
      const auto& ps = dp.parameters();
      const auto P = r.read<std::uint64_t>();
      bool match = P == ps.size();
      for (std::uint64_t i = 0; i < P && r.remaining() >= 8; ++i)
        match = r.read<std::uint64_t>() == (i < ps.size() ? ps[i].numel() : 0) && match;
      if (!match)
        throw checkpoint_error("the sharded optimizer state was saved from another model (" + std::to_string(P) +
                               " parameters or other sizes; this one has " + std::to_string(ps.size()) + ")");
    }
    std::vector<std::span<const std::byte>> parts;
    for (std::uint32_t k = 0; k < ranks; ++k) {
      const auto n = r.read<std::uint64_t>();
      if (n > r.remaining()) r.fail("ends inside rank " + std::to_string(k) + "'s state");
      parts.push_back(r.take(static_cast<std::size_t>(n)));
    }
    r.expect_end();
    std::vector<std::byte> resharded;
    std::span<const std::byte> state;
    if (v1) {
      state = parts[static_cast<std::size_t>(dp.rank())];
    } else if (same) {
      state =
          detail::read_sharded_part(parts[static_cast<std::size_t>(dp.rank())], static_cast<std::uint32_t>(dp.rank()))
              .state;
    } else if constexpr (requires { typename Opt::rule_type; }) {
      using Rule = typename Opt::rule_type;
      std::vector<detail::saved_optimizer> saved;
      std::vector<std::vector<std::vector<detail::shard_segment>>> maps;
      for (std::uint32_t k = 0; k < ranks; ++k) {
        auto part = detail::read_sharded_part(parts[k], k);
        saved.push_back(
            detail::index_saved_optimizer<Rule>(part.state, "rank " + std::to_string(k) + "'s optimizer state"));
        maps.push_back(std::move(part.map));
      }
      std::vector<std::size_t> counts;
      for (const auto& p : dp.shard_parameters()) counts.push_back(p.numel());
      resharded = detail::reshard_optimizer_state<Rule>(saved, maps, dp.shard_map(), counts);
      state = resharded;
    } else {
      throw checkpoint_error("the sharded optimizer state was saved by " + std::to_string(ranks) +
                             " ranks (or another shard layout) and this optimizer type has no rule_type to "
                             "reshard it by: resume on the same number of ranks and BucketPolicy");
    }
    byte_reader mine(state, "rank " + std::to_string(dp.rank()) + "'s sharded optimizer state");
    target.load(mine);
    mine.expect_end();
  };
  // Every rank learns whether all could load (else the others would go on alone).
  const auto agree = [&](Opt& target) {
    std::exception_ptr failure;
    try {
      apply(target);
    } catch (...) {
      failure = std::current_exception();
    }
    std::int32_t bad = failure ? 1 : 0;
    detail::host_all_reduce(dp.comm(), std::span<std::int32_t>(&bad, 1), reduce_op::max);
    if (failure) std::rethrow_exception(failure);
    if (bad) throw checkpoint_error("another rank could not load its part of the sharded optimizer state");
  };
  if constexpr (std::copy_constructible<Opt> && std::is_move_assignable_v<Opt>) {
    Opt tmp(opt);
    agree(tmp);
    opt = std::move(tmp);
  } else {
    agree(opt);  // such an optimizer's load() leaves it unchanged when it throws
  }
}

}  // namespace lockstep
