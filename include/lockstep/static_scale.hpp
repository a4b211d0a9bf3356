#pragma once
//! StaticScale — a fixed loss scale: unscale, check for inf/NaN, skip such steps, never
//! change the scale.

#include <cstdint>
#include <span>

#include "lockstep/concepts.hpp"
#include "lockstep/grad_group.hpp"
#include "lockstep/loss_scaler.hpp"

namespace lockstep {

//! Tuning for StaticScale. The default 128 is deliberately modest: a fixed scale cannot back
//! off, so one too high skips every step of a model whose scaled gradients overflow fp16.
//! A power of two keeps unscaling exact; other values round the factor 1/scale to the
//! gradient's element type (as memory_ops::scale does).
struct StaticScaleOptions {
  double scale = 128.0;
};

//! Loss-scaling policy with a fixed scale. `update(found_inf)` only counts: a step with
//! inf/NaN is skipped (skipped_steps + 1, good_steps ← 0), a clean one adds to good_steps.
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

  void update(bool found_inf) noexcept {
    ++steps_;
    if (found_inf) {
      ++skipped_;
      good_ = 0;
    } else {
      ++good_;
    }
  }

  loss_scale_state state() const noexcept { return {scale_, good_, skipped_, steps_}; }

  //! Restores the counters. The scale stays the configured one: for a fixed scale it is
  //! configuration, not state, so a run may resume with a different StaticScale on purpose.
  void load_state(const loss_scale_state& st) {
    detail::require_valid_state(st, "StaticScale");
    good_ = st.good_steps;
    skipped_ = st.skipped_steps;
    steps_ = st.steps;
  }

 private:
  double scale_;
  std::int64_t good_ = 0;
  std::int64_t skipped_ = 0;
  std::int64_t steps_ = 0;
  detail::found_inf_flag flag_;
};
static_assert(loss_scaler<StaticScale>);

}  // namespace lockstep
