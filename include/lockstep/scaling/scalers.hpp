#pragma once
//! The host-decided loss scalers (one family, one file). Each keeps its counters in one
//! scale_counters and unscales through one found_inf_flag (loss_scaler.hpp):
//!  - NoScaling: the loss is not scaled; optionally the gradients are still checked.
//!  - StaticScale: a fixed scale; inf/NaN steps are skipped, the scale never changes.
//!  - DynamicScale: PyTorch GradScaler's rule (halve on inf/NaN, double after a clean run).
//! The device-side DynamicScale is lockstep::DeviceDynamicScale (lockstep/cuda/device_dynamic_scale.cuh).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/scaling/loss_scaler.hpp"

namespace lockstep {

// ---- NoScaling ---------------------------------------------------------------------------

//! Tuning for NoScaling. Every rank must use the same value (it decides whether a
//! collective is issued).
struct NoScalingOptions {
  bool check_finite = false;  //!< detect inf/NaN gradients and skip those steps
};

//! The loss is not scaled. By default it does not look at the gradients either (PyTorch
//! without a GradScaler does not): unscale_and_check does nothing, issues no collective and
//! returns false, so no step is ever skipped. With `check_finite` it still checks: one
//! read-only pass, the flag agreed across ranks, and a step with inf/NaN gradients is
//! reported (and skipped by the strategy) instead of poisoning the parameters.
class NoScaling {
 public:
  NoScaling() = default;
  explicit NoScaling(const NoScalingOptions& o) : check_finite_(o.check_finite) {}

  static constexpr double scale() noexcept { return 1.0; }
  bool check_finite() const noexcept { return check_finite_; }
  //! Optional member (a) of loss_scaler: off, unscale_and_check does nothing.
  bool active() const noexcept { return check_finite_; }

  //! check_finite off: returns false and touches nothing. On: reports inf/NaN found on any
  //! rank (collective); the gradients are not written.
  template <communicator C>
  bool unscale_and_check(C& comm, std::span<const grad_group> groups) {
    if (!check_finite_) return false;
    if constexpr (has_grad_ops<memory_of_t<C>>) {
      return flag_.unscale_and_agree(comm, groups, 1.0);
    } else {
      throw config_error("NoScaling{.check_finite = true}: this communicator's memory space has no "
                         "lockstep::grad_ops specialisation to check gradients with; include the backend's "
                         "header that provides it, or turn check_finite off");
    }
  }

  void update(bool found_inf) noexcept { counters_.count(found_inf); }
  loss_scale_state state() const noexcept { return counters_.state(1.0); }

  //! Restores the counters; the scale stays 1 (a state from another scaler loads too).
  void load_state(const loss_scale_state& st) {
    detail::require_valid_state(st, "NoScaling");
    counters_.load(st);
  }

 private:
  bool check_finite_ = false;
  detail::scale_counters counters_;
  detail::found_inf_flag flag_;
};
static_assert(loss_scaler<NoScaling> && inspecting_scaler<NoScaling>);

// ---- StaticScale -------------------------------------------------------------------------

//! Tuning for StaticScale. The default 128 is deliberately modest: a fixed scale cannot back
//! off, so one too high skips every step of a model whose scaled gradients overflow fp16.
//! A power of two keeps unscaling exact; other values round the factor 1/scale to the
//! gradient's element type (as memory_ops::scale does).
struct StaticScaleOptions {
  double scale = 128.0;
};

//! A fixed loss scale. `update(found_inf)` only counts: a step with inf/NaN is skipped
//! (skipped_steps + 1, good_steps ← 0), a clean one adds to good_steps.
class StaticScale {
 public:
  StaticScale() : StaticScale(StaticScaleOptions{}) {}
  explicit StaticScale(const StaticScaleOptions& o) : scale_(o.scale) {
    detail::require_valid_scale(o.scale, "StaticScaleOptions::scale");
  }
  explicit StaticScale(double scale) : StaticScale(StaticScaleOptions{scale}) {}

  double scale() const noexcept { return scale_; }

  //! Multiplies the gradients by 1/scale() and reports inf/NaN found on any rank (collective).
  template <communicator C>
    requires has_grad_ops<memory_of_t<C>>
  bool unscale_and_check(C& comm, std::span<const grad_group> groups) {
    return flag_.unscale_and_agree(comm, groups, 1.0 / scale_);
  }

  void update(bool found_inf) noexcept { counters_.count(found_inf); }
  loss_scale_state state() const noexcept { return counters_.state(scale_); }

  //! Restores the counters. The scale stays the configured one: for a fixed scale it is
  //! configuration, not state, so a run may resume with a different StaticScale on purpose.
  void load_state(const loss_scale_state& st) {
    detail::require_valid_state(st, "StaticScale");
    counters_.load(st);
  }

 private:
  double scale_;
  detail::scale_counters counters_;
  detail::found_inf_flag flag_;
};
static_assert(loss_scaler<StaticScale>);

// ---- DynamicScale ------------------------------------------------------------------------

//! Tuning for DynamicScale. Defaults are GradScaler's (2^16, ×2 after 2000 clean steps, ×0.5
//! on inf/NaN) plus a floor and a ceiling GradScaler lacks: at the floor a model that keeps
//! overflowing keeps skipping steps (visible in skipped_steps) instead of its scale sinking
//! towards 0; the ceiling 2^24 keeps scaled fp16/bf16 gradients far from overflow by growth
//! alone. Powers of two keep unscaling exact.
struct DynamicScaleOptions {
  double init_scale = 65536.0;    //!< 2^16
  double growth_factor = 2.0;     //!< > 1
  double backoff_factor = 0.5;    //!< in (0, 1)
  int growth_interval = 2000;     //!< clean steps between growths, >= 1
  double min_scale = 1.0;         //!< floor, > 0
  double max_scale = 16777216.0;  //!< ceiling, 2^24
  //! This many skipped steps in a row end training with an error on every rank: lowering the
  //! scale cannot fix a loss that is itself inf/NaN (0: skip forever, as GradScaler does).
  //! Counted since construction or load_state (not checkpointed). DynamicScale only.
  int max_consecutive_skips = 1000;
};

namespace detail {
//! What the skip-limit error of DynamicScale and DeviceDynamicScale says after the numbers.
inline constexpr const char* stalled_advice =
    ": a smaller scale does not help, so the loss or the model produces non-finite values on at least one "
    "rank (one is enough to poison the average) — check every rank's inputs and loss. "
    "DynamicScaleOptions::max_consecutive_skips sets this limit (0: none)";

//! What the skip-limit error appends when lockstep found whose gradients were non-finite
//! before averaging (parallel/detail/nonfinite.hpp; DeviceDynamicScale on the device): "rank 2" /
//! "ranks 1, 3" (of DataParallel's communicator; `more` ranks beyond those listed), the step
//! that found it, and how it was looked for (`how`).
inline std::string origin_text(const std::vector<int>& ranks, std::size_t more, std::int64_t step, const char* how) {
  const std::size_t n = ranks.size() + more;
  std::string s = n == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (more > 0) s += " and " + std::to_string(more) + " more";
  return "the non-finite values came from " + s + ": " + (n == 1 ? "its" : "their") +
         " own gradients held inf/NaN before averaging (first seen in optimizer step " + std::to_string(step) + ", " +
         how + ")";
}

//! Throws config_error naming the first bad DynamicScaleOptions field.
inline void validate(const DynamicScaleOptions& o) {
  auto fail = [](const std::string& what) { throw config_error("DynamicScaleOptions: " + what); };
  if (!(std::isfinite(o.growth_factor) && o.growth_factor > 1.0))
    fail("growth_factor must be finite and > 1, got " + std::to_string(o.growth_factor));
  if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
    fail("backoff_factor must be in (0, 1), got " + std::to_string(o.backoff_factor));
  if (o.growth_interval < 1) fail("growth_interval must be >= 1, got " + std::to_string(o.growth_interval));
  if (o.max_consecutive_skips < 0)
    fail("max_consecutive_skips must be >= 0 (0: no limit), got " + std::to_string(o.max_consecutive_skips));
  require_valid_scale(o.min_scale, "DynamicScaleOptions::min_scale");
  require_valid_scale(o.max_scale, "DynamicScaleOptions::max_scale");
  require_valid_scale(o.init_scale, "DynamicScaleOptions::init_scale");
  if (!(o.min_scale <= o.init_scale && o.init_scale <= o.max_scale))
    fail("need min_scale <= init_scale <= max_scale, got " + std::to_string(o.min_scale) +
         " <= " + std::to_string(o.init_scale) + " <= " + std::to_string(o.max_scale));
}

//! Throws checkpoint_error unless `st` (already require_valid_state) could come from a dynamic
//! scaler with options `o`. `who` names the scaler.
inline void require_state_fits(const loss_scale_state& st, const DynamicScaleOptions& o, const char* who) {
  if (st.scale < o.min_scale || st.scale > o.max_scale || st.good_steps >= o.growth_interval)
    throw checkpoint_error(std::string(who) + "::load_state: the checkpoint's scale " + std::to_string(st.scale) +
                           " / good_steps " + std::to_string(st.good_steps) +
                           " cannot come from these options (scale in [" + std::to_string(o.min_scale) + ", " +
                           std::to_string(o.max_scale) + "], growth_interval " + std::to_string(o.growth_interval) +
                           "); construct " + who + " with the options the checkpoint was written with");
}
}  // namespace detail

//! Loss scaling that adapts, as PyTorch's GradScaler does. `update(found_inf)`:
//!  - found_inf: scale ← max(scale · backoff_factor, min_scale); good_steps ← 0; the step is
//!    skipped (skipped_steps + 1).
//!  - clean: good_steps + 1; when it reaches growth_interval, scale ← min(scale · growth_factor,
//!    max_scale) and good_steps ← 0 (also when the ceiling holds the scale where it is).
//! So the scale grows on exactly the growth_interval-th consecutive clean step.
class DynamicScale {
 public:
  DynamicScale() : DynamicScale(DynamicScaleOptions{}) {}
  explicit DynamicScale(const DynamicScaleOptions& o) : opts_(o), scale_(o.init_scale) { detail::validate(o); }

  double scale() const noexcept { return scale_; }
  const DynamicScaleOptions& options() const noexcept { return opts_; }

  //! Multiplies the gradients by 1/scale() and reports inf/NaN found on any rank (collective).
  template <communicator C>
    requires has_grad_ops<memory_of_t<C>>
  bool unscale_and_check(C& comm, std::span<const grad_group> groups) {
    return flag_.unscale_and_agree(comm, groups, 1.0 / scale_);
  }

  //! Throws lockstep::error (on every rank alike: found_inf is agreed) when the step is the
  //! max_consecutive_skips-th skipped in a row.
  void update(bool found_inf) {
    counters_.count(found_inf);
    skips_in_a_row_ = found_inf ? skips_in_a_row_ + 1 : 0;
    if (found_inf) {
      scale_ = std::max(scale_ * opts_.backoff_factor, opts_.min_scale);
      if (opts_.max_consecutive_skips > 0 && skips_in_a_row_ >= opts_.max_consecutive_skips)
        throw error("lockstep::DynamicScale: " + std::to_string(skips_in_a_row_) +
                    " steps in a row had inf/NaN gradients (the loss scale is now " + std::to_string(scale_) +
                    ", its floor " + std::to_string(opts_.min_scale) + ")" + detail::stalled_advice);
    } else if (counters_.good_steps >= opts_.growth_interval) {
      counters_.good_steps = 0;
      scale_ = std::min(scale_ * opts_.growth_factor, opts_.max_scale);
    }
  }

  loss_scale_state state() const noexcept { return counters_.state(scale_); }

  //! Restores a state written by a DynamicScale with the same options; throws
  //! checkpoint_error for one these options could not have produced.
  void load_state(const loss_scale_state& st) {
    detail::require_valid_state(st, "DynamicScale");
    detail::require_state_fits(st, opts_, "DynamicScale");
    scale_ = st.scale;
    counters_.load(st);
    skips_in_a_row_ = 0;
  }

 private:
  DynamicScaleOptions opts_;
  double scale_;
  std::int64_t skips_in_a_row_ = 0;
  detail::scale_counters counters_;
  detail::found_inf_flag flag_;
};
static_assert(loss_scaler<DynamicScale>);

}  // namespace lockstep
