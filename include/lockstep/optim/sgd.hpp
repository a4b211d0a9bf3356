#pragma once
//! lockstep::Sgd — stochastic gradient descent with momentum, PyTorch semantics. The rule
//! (SgdRule) is written once: lockstep::Sgd applies it to host parameters (f32/f64),
//! lockstep::FusedSgd to device parameters (all four float types).
//!
//! Per element, with g the gradient and p the parameter (in the compute type):
//!   g ← g + weight_decay·p                       (when weight_decay ≠ 0)
//!   buf ← g on a slot's first step, else momentum·buf + (1 − dampening)·g
//!   g ← g + momentum·buf (nesterov) or buf        (when momentum ≠ 0)
//!   p ← p − lr·g
//!
//! Checkpoint layout: optimizer.hpp's, with magic "LKSGD001", options
//! f64 lr, momentum, dampening, weight_decay | u8 nesterov, no step per slot, and one state
//! buffer (the momentum buffer) when momentum ≠ 0.

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/optim/optimizer.hpp"

namespace lockstep {

struct SgdOptions {
  double lr;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};

struct SgdRule {
  using options = SgdOptions;
  static constexpr const char* name = "Sgd";
  static constexpr const char* fused_name = "FusedSgd";
  static constexpr char magic[9] = "LKSGD001";
  static constexpr char magic_with_masters[9] = "LKSGDM01";
  static constexpr bool saves_step = false;
  static constexpr int max_states = 1;
  static int states(const SgdOptions& o) noexcept { return o.momentum != 0 ? 1 : 0; }

  static void validate(const SgdOptions& o) {
    detail::check_learning_rate(name, o.lr);
    if (!(o.momentum >= 0) || !(o.weight_decay >= 0) || !std::isfinite(o.dampening))
      throw config_error("Sgd: momentum and weight_decay must be ≥ 0 and dampening finite");
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      throw config_error("Sgd: nesterov needs momentum > 0 and dampening = 0 (as in PyTorch)");
  }
  static constexpr auto fields(auto& o) noexcept {
    return std::tie(o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov);
  }

  template <class A>
  struct coefficients {
    A lr, momentum, dampening1, weight_decay;  // dampening1 = 1 − dampening
    bool nesterov, use_momentum, first;
  };
  template <class A>
  LOCKSTEP_HOST_DEVICE static coefficients<A> prepare(const SgdOptions& o, std::int64_t step) {
    return {static_cast<A>(o.lr),
            static_cast<A>(o.momentum),
            static_cast<A>(1.0 - o.dampening),
            static_cast<A>(o.weight_decay),
            o.nesterov,
            o.momentum != 0,
            step == 1};
  }
  template <class A>
  LOCKSTEP_HOST_DEVICE static void update(const coefficients<A>& c, A& w, A g, A* s) {
    using detail::rn_add, detail::rn_mul;
    A d = g;
    if (c.weight_decay != A(0)) d = rn_add(d, rn_mul(c.weight_decay, w));
    if (c.use_momentum) {
      const A b = c.first ? d : rn_add(rn_mul(c.momentum, s[0]), rn_mul(c.dampening1, d));
      s[0] = b;
      d = c.nesterov ? rn_add(d, rn_mul(c.momentum, b)) : b;
    }
    w = rn_add(w, -rn_mul(c.lr, d));
  }
};
static_assert(optimizer_rule<SgdRule>);

class Sgd : public Optimizer<SgdRule> {
 public:
  using Optimizer::Optimizer;
  //! The momentum buffer of a slot (empty before its first step or when momentum = 0).
  template <class T>
  std::span<const T> momentum_buffer(std::size_t slot) const {
    return state<T>(slot, 0);
  }
};
static_assert(serializable<Sgd>);

}  // namespace lockstep
