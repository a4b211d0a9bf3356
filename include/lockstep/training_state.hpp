#pragma once
//! Checkpointing a DataParallel as a whole: its parameters, its loss-scale state and its
//! settled gradient layout, so that a resumed run continues exactly as the uninterrupted
//! one (the same reductions in the same layout, hence the same rounding on every
//! communicator). The optimizer and the data position are the caller's (add them to the
//! same Checkpoint).
//!
//! \code
//!   lockstep::save_checkpoint_rank0(ctx.comm(), path, [&](lockstep::Checkpoint& ck) {
//!     lockstep::add_training_state(ck, dp);
//!     ck.add_blob("optimizer", opt_bytes);
//!   });
//!   // resume, on every rank, before the first step:
//!   auto ck = lockstep::load_checkpoint(path);
//!   lockstep::restore_training_state(ck, dp);
//! \endcode

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "lockstep/checkpoint.hpp"
#include "lockstep/loss_scaler.hpp"

namespace lockstep {

template <class DP>
void add_training_state(Checkpoint& ck, DP& dp) {
  ck.add_parameters(dp.parameters(), dp.comm().memory());
  ck.add_value("lockstep.loss_scale", dp.scaler().state());
  const auto plan = dp.plan_state();
  ck.add_blob("lockstep.plan", std::span<const std::byte>(reinterpret_cast<const std::byte*>(plan.data()),
                                                          plan.size() * sizeof(std::int64_t)));
}

//! Every section is read and checked before parameters are written (the layout, which is
//! adopted first, changes no values).
template <class DP>
void restore_training_state(const Checkpoint& ck, DP& dp) {
  loss_scale_state st{};
  ck.restore_value("lockstep.loss_scale", st);
  const auto bytes = ck.blob("lockstep.plan");
  if (bytes.size() % sizeof(std::int64_t) != 0)
    throw checkpoint_error("checkpoint section 'lockstep.plan' has a length that is not a whole "
                           "number of entries; the file is damaged");
  std::vector<std::int64_t> plan(bytes.size() / sizeof(std::int64_t));
  std::memcpy(plan.data(), bytes.data(), bytes.size());
  dp.load_plan_state(plan);
  restore_parameters(ck, dp.parameters(), dp.comm().memory());
  dp.scaler().load_state(st);
}

}  // namespace lockstep
