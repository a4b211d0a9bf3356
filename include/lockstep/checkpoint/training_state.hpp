#pragma once
//! Restoring from a checkpoint: a model's parameters (restore_parameters), and a DataParallel
//! as a whole (add_training_state / restore_training_state): its parameters, its loss-scale
//! state and its settled gradient layout, so that a resumed run continues exactly as the
//! uninterrupted one (the same reductions in the same layout, hence the same rounding on
//! every communicator), and, given a sampler, where the data stands. The optimizer is the
//! caller's (add it to the same Checkpoint: lockstep's optimizers are serializable).
//!
//! \code
//!   lockstep::save_checkpoint_rank0(ctx.comm(), path, [&](lockstep::Checkpoint& ck) {
//!     lockstep::add_training_state(ck, dp, sampler);  // parameters, scale, layout, data position
//!     ck.add("optimizer", opt);
//!   });
//!   // resume, on every rank, before the first step:
//!   auto ck = lockstep::load_checkpoint(path);
//!   lockstep::restore_training_state(ck, dp, sampler);
//!   ck.restore("optimizer", opt);
//! \endcode

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/checkpoint/checkpoint.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/scaling/loss_scaler.hpp"

namespace lockstep {

// ---------------------------------------------------------------------------------------
//! Writes the checkpoint's parameters into the model's (through `ops`). First checks that
//! the model has the same parameters in the same order (name, shape, element type) and
//! throws checkpoint_error naming the first difference; the model is untouched unless
//! every check passed.
template <std::ranges::input_range R, class Ops>
  requires std::convertible_to<std::ranges::range_reference_t<R>, const parameter&> &&
           memory_ops<std::remove_cvref_t<Ops>>
void restore_parameters(const Checkpoint& ck, R&& params, Ops&& ops) {
  std::vector<parameter> ps;
  for (const parameter& p : params) ps.push_back(p);
  const auto& ts = ck.parameters();
  const std::string subject = ck.describe();
  if (!ck.has_parameters())
    throw checkpoint_error(subject + " holds no parameters (it was saved without "
                                     "add_parameters); restore only its sections");
  const std::string todo = "; load it into the model it was saved from (same parameters, order, shapes and types)";
  // Field by field rather than by fingerprint alone, to name the first difference (and
  // so that a hash collision can never pass).
  const std::size_t common = std::min(ps.size(), ts.size());
  for (std::size_t i = 0; i < common; ++i) {
    const auto& p = ps[i];
    const auto& t = ts[i];
    if (p.name != t.name || p.shape != t.shape || p.type != t.type)
      throw checkpoint_error(subject + " does not match the model at parameter #" + std::to_string(i) +
                             ": the checkpoint has '" + t.name + "' " + t.shape_string() + ", the model has '" +
                             p.name + "' " + p.shape_string() + todo);
  }
  if (ps.size() != ts.size()) {
    const std::string extra = ps.size() > ts.size() ? "the model's '" + ps[common].name + "' is not in the checkpoint"
                                                    : "the checkpoint's '" + ts[common].name + "' is not in the model";
    throw checkpoint_error(subject + " holds " + std::to_string(ts.size()) + " parameters but the model has " +
                           std::to_string(ps.size()) + " (parameter #" + std::to_string(common) + ": " + extra + ")" +
                           todo);
  }
  for (const auto& p : ps)
    if (p.bytes() != 0 && p.value == nullptr)
      throw config_error("restore_parameters: parameter '" + p.name + "' has no value buffer");
  for (std::size_t i = 0; i < ps.size(); ++i)
    if (ps[i].bytes()) ops.upload(ps[i].value, ts[i].data.data(), ps[i].bytes());
}

// ---------------------------------------------------------------------------------------
namespace detail {
inline void add_int64s(Checkpoint& ck, const char* name, const std::vector<std::int64_t>& v) {
  ck.add_blob(name, std::span<const std::byte>(reinterpret_cast<const std::byte*>(v.data()), v.size() * 8));
}
inline std::vector<std::int64_t> int64s(const Checkpoint& ck, const char* name) {
  const auto bytes = ck.blob(name);
  if (bytes.size() % sizeof(std::int64_t) != 0)
    throw checkpoint_error(std::string("checkpoint section '") + name +
                           "' has a length that is not a whole number of entries; the file is damaged");
  std::vector<std::int64_t> v(bytes.size() / sizeof(std::int64_t));
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}
//! The training state but the parameters: the loss scale, the layout, Deterministic's exponents.
template <class DP>
void add_training_sections(Checkpoint& ck, DP& dp) {
  ck.add_value("lockstep.loss_scale", dp.scaler().state());
  add_int64s(ck, "lockstep.plan", dp.plan_state());
  if constexpr (requires { dp.hook().exponents(); })
    add_int64s(ck, "lockstep.fixed_point_exponents", dp.hook().exponents());
}
//! The sampler's state: the section "lockstep.sampler", meta.epoch and meta.sample_position.
template <class Sampler>
void add_sampler_state(Checkpoint& ck, const Sampler& sampler) {
  const auto st = sampler.state();
  ck.add("lockstep.sampler", sampler);
  ck.meta.epoch = static_cast<std::int64_t>(st.epoch);
  ck.meta.sample_position = static_cast<std::int64_t>(st.position);
}
}  // namespace detail

//! With Deterministic, its exponents too ("lockstep.fixed_point_exponents"): the next step's
//! ranges, without which a resumed run would round otherwise.
template <class DP>
void add_training_state(Checkpoint& ck, DP& dp) {
  if (!dp.stats().values_exact)  // (rank 0 alone may be here: the exact values need every rank)
    throw config_error(
        "lockstep::add_training_state: ShardedOptimizer::gather_wire left the model's values rounded (the "
        "masters are apart); call dp.wait_all_parameters() on every rank first (lockstep::gather_sharded does) so "
        "that the checkpoint holds the exact values");
  dp.wait_all_parameters();  // gather_in_forward: the values still in flight
  ck.add_parameters(dp.parameters(), dp.comm().memory());
  detail::add_training_sections(ck, dp);
}

//! Every section is read and checked before parameters are written (the layout, which is
//! adopted first, changes no values).
template <class DP>
void restore_training_state(const Checkpoint& ck, DP& dp) {
  dp.wait_all_parameters();  // gather_in_forward: nothing in flight overwrites what is restored
  loss_scale_state st{};
  ck.restore_value("lockstep.loss_scale", st);
  dp.load_plan_state(detail::int64s(ck, "lockstep.plan"));
  if constexpr (requires { dp.hook().exponents(); })  // (a checkpoint of another mode has none: kept)
    if (ck.contains("lockstep.fixed_point_exponents"))
      dp.hook().load_exponents(dp.comm(), detail::int64s(ck, "lockstep.fixed_point_exponents"));
  restore_parameters(ck, dp.parameters(), dp.comm().memory());
  if constexpr (requires { dp.values_written(); }) dp.values_written();  // FullySharded: into its shards
  dp.scaler().load_state(st);
}

//! The same, with the data position: the sampler's state (seed, epoch, position) goes into
//! the section "lockstep.sampler", and meta.epoch / meta.sample_position are set from it.
//! Restoring resumes the sampler where the saved run stood (mid-epoch included); the loop
//! then continues from sampler.epoch() without calling set_epoch for that epoch. A sampler
//! that stands for another rank or number of ranks than dp (one built before ranks left or
//! joined) is first moved to dp's (repartition(dp.rank(), dp.size())), so the saved position
//! is cut for the ranks that go on, not for those the sampler was made for.
template <class DP, class Sampler>
  requires serializable<Sampler> && requires(const Sampler& s) { s.state(); }
void add_training_state(Checkpoint& ck, DP& dp, const Sampler& sampler) {
  detail::add_sampler_state(ck, sampler);
  add_training_state(ck, dp);
}

template <class DP, class Sampler>
  requires serializable<Sampler>
void restore_training_state(const Checkpoint& ck, DP& dp, Sampler& sampler) {
  Sampler resumed = sampler;  // checked in full before anything of dp changes
  if constexpr (requires {
                  resumed.repartition(dp.rank(), dp.size());
                  { resumed.rank() } -> std::convertible_to<int>;
                  { resumed.world() } -> std::convertible_to<int>;
                })
    if (resumed.rank() != dp.rank() || resumed.world() != dp.size()) resumed.repartition(dp.rank(), dp.size());
  ck.restore("lockstep.sampler", resumed);
  restore_training_state(ck, dp);
  sampler = std::move(resumed);
}

}  // namespace lockstep
