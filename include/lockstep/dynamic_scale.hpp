#pragma once
//! DynamicScale — loss scaling that adapts, as PyTorch's GradScaler does: start high, halve
//! the scale (and skip the step) on inf/NaN gradients, double it after a run of clean steps.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>

#include "lockstep/concepts.hpp"
#include "lockstep/error.hpp"
#include "lockstep/grad_group.hpp"
#include "lockstep/loss_scaler.hpp"

namespace lockstep {

//! Tuning for DynamicScale. Defaults are GradScaler's (2^16, ×2 after 2000 clean steps, ×0.5
//! on inf/NaN) plus a floor and a ceiling GradScaler lacks: at the floor a model that keeps
//! overflowing keeps skipping steps (visible in skipped_steps) instead of its scale sinking
//! towards 0; the ceiling 2^24 keeps scaled fp16/bf16 gradients far from overflow by growth
//! alone. Powers of two keep unscaling exact.
struct DynamicScaleOptions {
  double init_scale = 65536.0;       //!< 2^16
  double growth_factor = 2.0;        //!< > 1
  double backoff_factor = 0.5;       //!< in (0, 1)
  int growth_interval = 2000;        //!< clean steps between growths, >= 1
  double min_scale = 1.0;            //!< floor, > 0
  double max_scale = 16777216.0;     //!< ceiling, 2^24
};

//! Loss-scaling policy. `update(found_inf)`:
//!  - found_inf: scale ← max(scale · backoff_factor, min_scale); good_steps ← 0; the step is
//!    skipped (skipped_steps + 1).
//!  - clean: good_steps + 1; when it reaches growth_interval, scale ← min(scale · growth_factor,
//!    max_scale) and good_steps ← 0 (also when the ceiling holds the scale where it is).
//! So the scale grows on exactly the growth_interval-th consecutive clean step.
class DynamicScale {
 public:
  DynamicScale() : DynamicScale(DynamicScaleOptions{}) {}
  explicit DynamicScale(const DynamicScaleOptions& o) : opts_(o), scale_(o.init_scale) {
    validate(o);
  }

  double scale() const noexcept { return scale_; }
  const DynamicScaleOptions& options() const noexcept { return opts_; }

  //! Multiplies the gradients by 1/scale() and reports inf/NaN found on any rank (collective).
  template <communicator C>
    requires has_grad_ops<memory_of_t<C>>
  bool unscale_and_check(C& comm, std::span<const grad_group> groups) {
    return flag_.unscale_and_agree(comm, groups, 1.0 / scale_);
  }

  void update(bool found_inf) noexcept {
    ++steps_;
    if (found_inf) {
      ++skipped_;
      good_ = 0;
      scale_ = std::max(scale_ * opts_.backoff_factor, opts_.min_scale);
    } else if (++good_ >= opts_.growth_interval) {
      good_ = 0;
      scale_ = std::min(scale_ * opts_.growth_factor, opts_.max_scale);
    }
  }

  loss_scale_state state() const noexcept { return {scale_, good_, skipped_, steps_}; }

  //! Restores a state written by a DynamicScale with the same options; throws
  //! checkpoint_error for one these options could not have produced.
  void load_state(const loss_scale_state& st) {
    detail::require_valid_state(st, "DynamicScale");
    if (st.scale < opts_.min_scale || st.scale > opts_.max_scale ||
        st.good_steps >= opts_.growth_interval)
      throw checkpoint_error(
          "DynamicScale::load_state: the checkpoint's scale " + std::to_string(st.scale) +
          " / good_steps " + std::to_string(st.good_steps) +
          " cannot come from these options (scale in [" + std::to_string(opts_.min_scale) + ", " +
          std::to_string(opts_.max_scale) + "], growth_interval " +
          std::to_string(opts_.growth_interval) +
          "); construct DynamicScale with the options the checkpoint was written with");
    scale_ = st.scale;
    good_ = st.good_steps;
    skipped_ = st.skipped_steps;
    steps_ = st.steps;
  }

 private:
  static void validate(const DynamicScaleOptions& o) {
    auto fail = [](const std::string& what) {
      throw config_error("DynamicScaleOptions: " + what);
    };
    if (!(std::isfinite(o.growth_factor) && o.growth_factor > 1.0))
      fail("growth_factor must be finite and > 1, got " + std::to_string(o.growth_factor));
    if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
      fail("backoff_factor must be in (0, 1), got " + std::to_string(o.backoff_factor));
    if (o.growth_interval < 1)
      fail("growth_interval must be >= 1, got " + std::to_string(o.growth_interval));
    detail::require_valid_scale(o.min_scale, "DynamicScaleOptions::min_scale");
    detail::require_valid_scale(o.max_scale, "DynamicScaleOptions::max_scale");
    detail::require_valid_scale(o.init_scale, "DynamicScaleOptions::init_scale");
    if (!(o.min_scale <= o.init_scale && o.init_scale <= o.max_scale))
      fail("need min_scale <= init_scale <= max_scale, got " + std::to_string(o.min_scale) +
           " <= " + std::to_string(o.init_scale) + " <= " + std::to_string(o.max_scale));
  }

  DynamicScaleOptions opts_;
  double scale_;
  std::int64_t good_ = 0;
  std::int64_t skipped_ = 0;
  std::int64_t steps_ = 0;
  detail::found_inf_flag flag_;
};
static_assert(loss_scaler<DynamicScale>);

}  // namespace lockstep
