#pragma once
#include "lockstep/concepts.hpp"

namespace lockstep {

//! Accumulation policy: synchronise gradients on every step.
struct EveryStep {
  static constexpr int steps() noexcept { return 1; }
};
static_assert(accumulation_policy<EveryStep>);

}  // namespace lockstep
