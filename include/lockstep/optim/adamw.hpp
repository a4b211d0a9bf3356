#pragma once
//! lockstep::AdamW — Adam with decoupled weight decay, PyTorch semantics (amsgrad off). The
//! rule (AdamWRule) is written once: lockstep::AdamW applies it to host parameters
//! (f32/f64), lockstep::FusedAdamW to device parameters (all four float types).
//!
//! Per slot, step ← step + 1; then per element, in the compute type, with the scalars
//! computed in double and rounded once:
//!   p ← p·(1 − lr·weight_decay)
//!   m ← beta1·m + (1 − beta1)·g
//!   v ← beta2·v + (1 − beta2)·g²
//!   p ← p − lr/(1 − beta1^step) · m / (√v / √(1 − beta2^step) + eps)
//!
//! Checkpoint layout: optimizer.hpp's, with magic "LKADW001", options
//! f64 lr, beta1, beta2, eps, weight_decay, an i64 step per slot, and two state buffers
//! (m, then v).

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/optim/optimizer.hpp"

namespace lockstep {

struct AdamWOptions {
  double lr;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

struct AdamWRule {
  using options = AdamWOptions;
  static constexpr const char* name = "AdamW";
  static constexpr const char* fused_name = "FusedAdamW";
  static constexpr char magic[9] = "LKADW001";
  static constexpr char magic_with_masters[9] = "LKADWM01";
  static constexpr bool saves_step = true;
  static constexpr int max_states = 2;
  static int states(const AdamWOptions&) noexcept { return 2; }

  static void validate(const AdamWOptions& o) {
    detail::check_learning_rate(name, o.lr);
    if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1))
      throw config_error("AdamW: beta1 and beta2 must lie in [0, 1), got " + std::to_string(o.beta1) + " and " +
                         std::to_string(o.beta2));
    if (!(o.eps > 0) || !(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
      throw config_error("AdamW: eps must be > 0 and weight_decay a finite number ≥ 0");
  }
  static constexpr auto fields(auto& o) noexcept { return std::tie(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay); }

  template <class A>
  struct coefficients {
    A decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bc2_sqrt;
  };
  template <class A>
  LOCKSTEP_HOST_DEVICE static coefficients<A> prepare(const AdamWOptions& o, std::int64_t step) {
    const double t = static_cast<double>(step);
    return {static_cast<A>(1.0 - o.lr * o.weight_decay),
            static_cast<A>(o.beta1),
            static_cast<A>(1.0 - o.beta1),
            static_cast<A>(o.beta2),
            static_cast<A>(1.0 - o.beta2),
            static_cast<A>(o.eps),
            static_cast<A>(o.lr / (1.0 - detail::pow_of(o.beta1, t))),
            static_cast<A>(detail::rn_sqrt(1.0 - detail::pow_of(o.beta2, t)))};
  }
  template <class A>
  LOCKSTEP_HOST_DEVICE static void update(const coefficients<A>& c, A& w, A g, A* s) {
    using detail::rn_add, detail::rn_mul;
    w = rn_mul(w, c.decay);
    s[0] = rn_add(rn_mul(c.beta1, s[0]), rn_mul(c.one_minus_beta1, g));
    s[1] = rn_add(rn_mul(c.beta2, s[1]), rn_mul(rn_mul(c.one_minus_beta2, g), g));
    const A denom = rn_add(detail::rn_sqrt(s[1]) / c.bc2_sqrt, c.eps);
    w = rn_add(w, -rn_mul(c.step_size, s[0] / denom));
  }
};
static_assert(optimizer_rule<AdamWRule>);

class AdamW : public Optimizer<AdamWRule> {
 public:
  using Optimizer::Optimizer;
  //! First and second moments of a slot (empty before its first step or for another T).
  template <class T>
  std::span<const T> exp_avg(std::size_t slot) const {
    return state<T>(slot, 0);
  }
  template <class T>
  std::span<const T> exp_avg_sq(std::size_t slot) const {
    return state<T>(slot, 1);
  }
};
static_assert(serializable<AdamW>);

}  // namespace lockstep
