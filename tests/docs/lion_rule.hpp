#pragma once
// docs/optimizer.md's example rule (Lion), verbatim between the snippet markers. snippets.cpp
// runs it on the host against a plain reference; snippets_cuda.cu compiles its fused form.
#include <cstdint>
#include <tuple>

#include <lockstep/core/error.hpp>
#include <lockstep/optim/optimizer.hpp>

// [snippet docs/optimizer.md#1]
#include <lockstep/optim/optimizer.hpp>

struct LionOptions {
  double lr;
  double beta1 = 0.9, beta2 = 0.99, weight_decay = 0;
};

struct LionRule {
  using options = LionOptions;
  static constexpr const char* name = "Lion";
  static constexpr const char* fused_name = "FusedLion";
  static constexpr char magic[9] = "MYLION01";  // checkpoint tags, 8 characters
  static constexpr char magic_with_masters[9] = "MYLIONM1";
  static constexpr bool saves_step = false;  // the update ignores the step count
  static constexpr int max_states = 1;       // the momentum m
  static int states(const LionOptions&) noexcept { return 1; }
  static void validate(const LionOptions& o) {
    if (!(o.lr >= 0) || !(o.weight_decay >= 0) || !(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1))
      throw lockstep::config_error("Lion: lr and weight_decay must be ≥ 0, beta1 and beta2 in [0, 1)");
  }
  static constexpr auto fields(auto& o) noexcept {  // the checkpoint's order
    return std::tie(o.lr, o.beta1, o.beta2, o.weight_decay);
  }

  template <class A>  // one step's scalars in the compute type, rounded once
  struct coefficients {
    A lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay;
    bool first;
  };
  template <class A>
  LOCKSTEP_HOST_DEVICE static coefficients<A> prepare(const LionOptions& o, std::int64_t step) {
    return {A(o.lr), A(o.beta1), A(1 - o.beta1), A(o.beta2), A(1 - o.beta2), A(o.lr * o.weight_decay), step == 1};
  }
  template <class A>  // one element: parameter w, gradient g, state s[0] = m
  LOCKSTEP_HOST_DEVICE static void update(const coefficients<A>& c, A& w, A g, A* s) {
    using lockstep::detail::rn_add, lockstep::detail::rn_mul;
    const A m = c.first ? A(0) : s[0];
    const A u = rn_add(rn_mul(c.beta1, m), rn_mul(c.one_minus_beta1, g));
    const A sign = u > A(0) ? A(1) : u < A(0) ? A(-1) : A(0);
    w = rn_add(w, -rn_add(rn_mul(c.lr, sign), rn_mul(c.decay, w)));
    s[0] = rn_add(rn_mul(c.beta2, m), rn_mul(c.one_minus_beta2, g));
  }
};
static_assert(lockstep::optimizer_rule<LionRule>);

using Lion = lockstep::Optimizer<LionRule>;  // host; on the GPU: lockstep::FusedOptimizer<LionRule>
// [end snippet]
