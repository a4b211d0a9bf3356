#pragma once
#include <string>

#include "lockstep/concepts.hpp"
#include "lockstep/error.hpp"

namespace lockstep {

//! K chosen at run time (`Accumulate<>`).
inline constexpr int dynamic_steps = 0;

//! Accumulation policy: K micro-steps per optimizer step, communication only on the last
//! (no_sync semantics). `Accumulate<4>` fixes K at compile time; `Accumulate<>` takes it at
//! run time and may change it between optimizer steps.
template <int K = dynamic_steps>
struct Accumulate {
  static_assert(K >= 1, "lockstep::Accumulate<K>: K must be at least 1");
  static constexpr int steps() noexcept { return K; }
};

template <>
struct Accumulate<dynamic_steps> {
  Accumulate() = default;
  explicit Accumulate(int k) { set_steps(k); }
  int steps() const noexcept { return k_; }
  void set_steps(int k) {
    if (k < 1)
      throw config_error("lockstep::Accumulate: steps must be at least 1, got " +
                         std::to_string(k));
    k_ = k;
  }

 private:
  int k_ = 1;
};

static_assert(accumulation_policy<Accumulate<4>>);
static_assert(accumulation_policy<Accumulate<>>);

}  // namespace lockstep
