#pragma once
//! NoScaling — the loss is not scaled. By default it does not look at the gradients either
//! (PyTorch without a GradScaler does not): unscale_and_check does nothing, issues no
//! collective and returns false, so no step is ever skipped. With `check_finite` it still
//! checks: one read-only pass, the flag agreed across ranks, and a step with inf/NaN gradients
//! is reported (and skipped by the strategy) instead of poisoning the parameters.

#include <cstdint>
#include <span>

#include "lockstep/concepts.hpp"
#include "lockstep/error.hpp"
#include "lockstep/grad_group.hpp"
#include "lockstep/loss_scaler.hpp"

namespace lockstep {

//! Tuning for NoScaling. Every rank must use the same value (it decides whether a
//! collective is issued).
struct NoScalingOptions {
  bool check_finite = false;  //!< detect inf/NaN gradients and skip those steps
};

class NoScaling {
 public:
  NoScaling() = default;
  explicit NoScaling(const NoScalingOptions& o) : check_finite_(o.check_finite) {}

  static constexpr double scale() noexcept { return 1.0; }
  bool check_finite() const noexcept { return check_finite_; }

  //! check_finite off: returns false and touches nothing. On: reports inf/NaN found on any
  //! rank (collective); the gradients are not written.
  template <communicator C>
  bool unscale_and_check(C& comm, std::span<const grad_group> groups) {
    if (!check_finite_) return false;
    if constexpr (has_grad_ops<memory_of_t<C>>) {
      return flag_.unscale_and_agree(comm, groups, 1.0);
    } else {
      throw config_error(
          "NoScaling{.check_finite = true}: this communicator's memory space has no "
          "lockstep::grad_ops specialisation to check gradients with; include the backend's "
          "header that provides it, or turn check_finite off");
    }
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

  loss_scale_state state() const noexcept { return {1.0, good_, skipped_, steps_}; }

  //! Restores the counters; the scale stays 1 (a state from another scaler loads too).
  void load_state(const loss_scale_state& st) {
    detail::require_valid_state(st, "NoScaling");
    good_ = st.good_steps;
    skipped_ = st.skipped_steps;
    steps_ = st.steps;
  }

 private:
  bool check_finite_ = false;
  std::int64_t good_ = 0;
  std::int64_t skipped_ = 0;
  std::int64_t steps_ = 0;
  detail::found_inf_flag flag_;
};
static_assert(loss_scaler<NoScaling>);

}  // namespace lockstep
