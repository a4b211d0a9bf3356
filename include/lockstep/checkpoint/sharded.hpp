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
//! Section layout, little-endian: "LSSHARD1" | u32 ranks | u64 shard layout fingerprint
//! (DataParallel::shard_layout(): ranks, element types, unit sizes, parameter order) | per
//! rank: u64 length, then what that rank's opt.save() wrote. Loading needs the same number of
//! ranks and the same layout; resharding onto another world size is not supported yet.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "lockstep/comm/host_collectives.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

namespace detail {
inline constexpr std::string_view sharded_magic = "LSSHARD1";
}

//! Every rank's optimizer state, as one checkpoint section (collective: every rank calls it
//! and gets the same bytes; rank 0 adds them to the checkpoint).
template <class DP, serializable Opt>
  requires DP::sharded
std::vector<std::byte> gather_sharded(DP& dp, const Opt& opt) {
  byte_writer mine;
  opt.save(mine);
  const auto bytes = std::move(mine).release();
  const auto all = detail::host_all_gather_strings(
      dp.comm(), std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  byte_writer w;
  w.write_bytes(detail::sharded_magic.data(), detail::sharded_magic.size());
  w.write(static_cast<std::uint32_t>(all.size()));
  w.write(dp.shard_layout());
  for (const auto& s : all) {
    w.write(static_cast<std::uint64_t>(s.size()));
    w.write_bytes(s.data(), s.size());
  }
  return std::move(w).release();
}

//! Loads this rank's part of a section gather_sharded wrote into opt (collective). If any
//! rank's part is missing or damaged, every rank throws checkpoint_error (the damaged rank
//! its own); a copyable optimizer is then unchanged everywhere.
template <class DP, serializable Opt>
  requires DP::sharded
void load_sharded(DP& dp, Opt& opt, std::span<const std::byte> section) {
  const auto apply = [&](Opt& target) {
    byte_reader r(section, "sharded optimizer state");
    r.expect_magic(detail::sharded_magic, "lockstep::gather_sharded");
    const auto ranks = r.read<std::uint32_t>();
    const auto layout = r.read<std::uint64_t>();
    if (ranks != static_cast<std::uint32_t>(dp.size()))
      throw checkpoint_error("the sharded optimizer state was saved by " + std::to_string(ranks) +
                             " ranks, but this job has " + std::to_string(dp.size()) +
                             "; resume on the same number of ranks (resharding is not supported yet)");
    if (layout != dp.shard_layout())
      throw checkpoint_error("the sharded optimizer state was saved with another shard layout (a "
                             "different model, element types or BucketPolicy); resume with the "
                             "configuration that saved it");
    std::span<const std::byte> part;
    for (std::uint32_t k = 0; k < ranks; ++k) {
      const auto n = r.read<std::uint64_t>();
      if (n > r.remaining()) r.fail("ends inside rank " + std::to_string(k) + "'s state");
      const auto bytes = r.take(static_cast<std::size_t>(n));
      if (static_cast<int>(k) == dp.rank()) part = bytes;
    }
    r.expect_end();
    byte_reader mine(part, "rank " + std::to_string(dp.rank()) + "'s sharded optimizer state");
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
