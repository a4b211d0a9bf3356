#pragma once
//! The residuals of a low-precision gradient wire with error feedback (WireOptions::
//! error_feedback, parallel/gradient_wire.hpp) in a checkpoint: each rank's are its own (what the
//! wire rounded off its gradients), so every rank's are gathered into one section, and on
//! resume each rank takes its own back — the resumed run then continues bit for bit.
//!
//! \code
//!   auto feedback = lockstep::gather_wire_feedback(dp);  // collective: rank 0's is the section
//!   lockstep::save_checkpoint_rank0(dp.comm(), path, [&](lockstep::Checkpoint& ck) {
//!     lockstep::add_training_state(ck, dp);
//!     ck.add_blob("wire_feedback", std::move(feedback));
//!   });
//!   // resume, on every rank, before the first step (after restore_training_state):
//!   auto ck = lockstep::load_checkpoint(path);
//!   lockstep::restore_training_state(ck, dp);
//!   lockstep::load_wire_feedback(dp, ck.blob("wire_feedback"));
//! \endcode
//!
//! Section layout, little-endian: "LSWFBALL" | u32 ranks | per rank: u64 length, then what that
//! rank's hook().save_feedback() wrote ("LSWIREF1" | u64 buckets | per bucket u64 count, count
//! fp32 residuals, in the order the buckets were first used). The section holds every rank's
//! residuals: 4 bytes per gradient value per rank (the whole model's, times the ranks). They
//! belong to each rank's buckets: loading onto another number of ranks is refused (resume
//! without them and they start at zero: one step's rounding lost), and onto another layout fails
//! at the first step that meets a bucket of another size or more buckets than were saved.
//! Saved while a new layout is due (after the first step, when the plan is rebuilt) the section
//! holds no residuals: the old layout's were dropped then, in the run that goes on too.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

namespace detail {
inline constexpr std::string_view wire_feedback_section_magic = "LSWFBALL";
}

//! Every rank's error feedback residuals as one checkpoint section, on rank 0 (collective: every
//! rank calls it, between steps; the other ranks get an empty one). Gathered one rank's at a
//! time: each rank holds its own residuals and one other rank's at most, rank 0 the section.
template <class DP>
  requires requires(DP& dp) { dp.hook().save_feedback(dp.comm()); }
std::vector<std::byte> gather_wire_feedback(DP& dp) {
  const auto all = detail::host_gather_strings(dp.comm(), dp.hook().save_feedback(dp.comm()), 0);
  if (dp.comm().rank() != 0) return {};
  byte_writer w;
  w.write_bytes(detail::wire_feedback_section_magic.data(), detail::wire_feedback_section_magic.size());
  w.write(static_cast<std::uint32_t>(all.size()));
  for (const auto& part : all) w.write_string(part);
  return std::move(w).release();
}

//! This rank's residuals from a section gather_wire_feedback wrote, for the buckets to take at
//! the next step. Throws checkpoint_error for a damaged section or another number of ranks
//! (every rank alike: the section is the same on every rank).
template <class DP>
  requires requires(DP& dp, std::span<const std::byte> b) { dp.hook().load_feedback(b); }
void load_wire_feedback(DP& dp, std::span<const std::byte> section) {
  byte_reader r(section, "wire error feedback section");
  r.expect_magic(detail::wire_feedback_section_magic, "lockstep::gather_wire_feedback");
  const auto ranks = r.read<std::uint32_t>();
  if (ranks != static_cast<std::uint32_t>(dp.comm().size()))
    throw checkpoint_error("the wire error feedback section was saved by " + std::to_string(ranks) +
                           " ranks but this job has " + std::to_string(dp.comm().size()) +
                           ": each rank's residuals belong to its own buckets and cannot be re-cut; resume on " +
                           std::to_string(ranks) + " ranks, or without load_wire_feedback (they start at zero)");
  std::string mine;
  for (std::uint32_t k = 0; k < ranks; ++k) {
    std::string part = r.read_string();
    if (k == static_cast<std::uint32_t>(dp.comm().rank())) mine = std::move(part);
  }
  r.expect_end();
  dp.hook().load_feedback(std::as_bytes(std::span<const char>(mine.data(), mine.size())));
}

}  // namespace lockstep
