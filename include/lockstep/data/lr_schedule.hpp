#pragma once
//! Batch-size and learning-rate helpers for data-parallel training.
//!
//! Going from one device to N ranks multiplies the batch per optimizer step by N (and by
//! the accumulation steps K). The linear scaling rule with a warmup (Goyal et al.,
//! "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017) keeps SGD's
//! trajectory close to the small-batch one:
//!
//! \code
//!   const auto eb = lockstep::effective_batch(64, ctx.size(), 4);        // 64 · N · 4
//!   const lockstep::LinearWarmup sched{.peak_lr = lockstep::scaled_lr(0.1, 256, eb),
//!                                      .warmup_steps = 500,
//!                                      .decay = lockstep::Decay::cosine,
//!                                      .total_steps = 20000};
//!   optimizer.set_lr(sched(step));                                       // step from 0
//! \endcode

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <string>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

//! Samples per optimizer step: per_rank_batch · ranks · accumulation.
inline std::size_t effective_batch(std::size_t per_rank_batch, int ranks, int accumulation = 1) {
  if (per_rank_batch == 0 || ranks < 1 || accumulation < 1)
    throw config_error("effective_batch(" + std::to_string(per_rank_batch) + ", " + std::to_string(ranks) + ", " +
                       std::to_string(accumulation) +
                       "): the batch per rank, the number of ranks and the accumulation "
                       "steps must all be at least 1");
  return per_rank_batch * static_cast<std::size_t>(ranks) * static_cast<std::size_t>(accumulation);
}

//! Linear scaling rule: base_lr was tuned for base_batch; returns
//! base_lr · effective_batch / base_batch.
inline double scaled_lr(double base_lr, std::size_t base_batch, std::size_t effective_batch) {
  if (base_batch == 0 || effective_batch == 0)
    throw config_error("scaled_lr: base_batch (" + std::to_string(base_batch) + ") and effective_batch (" +
                       std::to_string(effective_batch) + ") must be at least 1");
  return base_lr * (static_cast<double>(effective_batch) / static_cast<double>(base_batch));
}

//! How the learning rate follows the global batch: not at all, in proportion (the linear
//! rule, for SGD) or with its square root (often used for Adam-type optimizers).
enum class LrScaling { none, linear, sqrt };

//! The rule a launcher asked for in LOCKSTEP_LR_SCALING ("none", "linear" or "sqrt"; set by
//! lockstep-run's interactive mode), or `fallback` when it is unset. Anything else: config_error.
inline LrScaling lr_scaling_from_env(LrScaling fallback = LrScaling::none) {
  const auto v = detail::env("LOCKSTEP_LR_SCALING");
  if (!v || v->empty()) return fallback;
  if (*v == "none") return LrScaling::none;
  if (*v == "linear") return LrScaling::linear;
  if (*v == "sqrt") return LrScaling::sqrt;
  throw config_error("LOCKSTEP_LR_SCALING=" + *v + ": give none, linear or sqrt");
}

//! base_lr, tuned for base_batch, for effective_batch under `rule`: × r, × √r or × 1, where
//! r = effective_batch / base_batch.
inline double scaled_lr(double base_lr, std::size_t base_batch, std::size_t effective_batch, LrScaling rule) {
  const double linear = scaled_lr(1.0, base_batch, effective_batch);  // checks both batches
  switch (rule) {
    case LrScaling::linear: return base_lr * linear;
    case LrScaling::sqrt: return base_lr * std::sqrt(linear);
    default: return base_lr;
  }
}

//! Linear warmup for step = 0, 1, ...: peak_lr · (step + 1) / warmup_steps while
//! step < warmup_steps (so the first step already moves, and step warmup_steps - 1 reaches
//! the peak), peak_lr afterwards. warmup_steps = 0 means no warmup.
inline double warmup_lr(std::uint64_t step, std::uint64_t warmup_steps, double peak_lr) noexcept {
  if (step >= warmup_steps) return peak_lr;
  return peak_lr * (static_cast<double>(step + 1) / static_cast<double>(warmup_steps));
}

//! What LinearWarmup does after the warmup.
enum class Decay {
  none,    //!< stay at peak_lr
  linear,  //!< straight line from peak_lr (at warmup_steps) to final_lr (at total_steps)
  cosine,  //!< half cosine from peak_lr to final_lr (Loshchilov & Hutter's SGDR, no restarts)
};

//! warmup_lr() for the first warmup_steps steps, then the chosen decay until total_steps,
//! then final_lr. A value struct: set the fields by name (see the example above).
struct LinearWarmup {
  double peak_lr = 0.0;
  std::uint64_t warmup_steps = 0;
  Decay decay = Decay::none;
  std::uint64_t total_steps = 0;  //!< where the decay ends; needed when decay != none
  double final_lr = 0.0;

  //! The learning rate for optimizer step `step` (counted from 0).
  double lr(std::uint64_t step) const {
    if (!std::isfinite(peak_lr) || peak_lr < 0 || !std::isfinite(final_lr) || final_lr < 0)
      throw config_error("LinearWarmup: peak_lr (" + std::to_string(peak_lr) + ") and final_lr (" +
                         std::to_string(final_lr) + ") must be finite and non-negative");
    if (decay != Decay::none && total_steps < warmup_steps)
      throw config_error("LinearWarmup: total_steps (" + std::to_string(total_steps) +
                         ") is before the end of the warmup (" + std::to_string(warmup_steps) +
                         "); set total_steps to the length of the whole run");
    if (step < warmup_steps || decay == Decay::none) return warmup_lr(step, warmup_steps, peak_lr);
    if (step >= total_steps) return final_lr;
    const double t =
        static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);  // in [0, 1)
    if (decay == Decay::linear) return peak_lr + (final_lr - peak_lr) * t;
    return final_lr + (peak_lr - final_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * t));
  }
  double operator()(std::uint64_t step) const { return lr(step); }
};

}  // namespace lockstep
