#pragma once
//! The loss_scaler concept, the state a scaler checkpoints, and what every scaler shares: the
//! counters of that state (scale_counters) and the pass that unscales gradients and agrees on
//! inf/NaN across ranks (found_inf_flag). Policies: NoScaling, StaticScale, DynamicScale
//! (scalers.hpp) and DeviceDynamicScale (lockstep/cuda/device_dynamic_scale.cuh).

#include <cmath>
#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"

namespace lockstep {

//! What a loss scaler saves in a checkpoint. Equal on every rank after every update.
struct loss_scale_state {
  double scale = 1.0;              //!< the factor the loss is multiplied by
  std::int64_t good_steps = 0;     //!< consecutive clean steps since the last skip or scale change
  std::int64_t skipped_steps = 0;  //!< steps skipped for inf/NaN gradients, in total
  std::int64_t steps = 0;          //!< update() calls, in total (clean + skipped)

  bool operator==(const loss_scale_state&) const = default;
};

// ---------------------------------------------------------------------------------------
//! lockstep::loss_scaler — how the loss is scaled and gradients unscaled, one state on all ranks.
//!
//! Requirements (checked by `loss_scaler<S>`; 3 also by `loss_scaler_for<S, Comm>`):
//!  1. Default-constructible and copyable: a strategy holds one per rank, copied from the
//!     one the user gives (or default-constructed).
//!  2. `s.scale()` → double, finite and > 0: the user multiplies the loss by it before
//!     backward (`step.loss_scale()`); the gradients then carry this factor.
//!  3. `s.unscale_and_check(comm, groups)` → bool, for a lockstep::communicator `comm` and a
//!     `std::span<const grad_group>` of gradients already averaged over ranks, in comm's
//!     memory space: multiplies them by 1/scale() and looks for inf/NaN, in one pass. Returns
//!     true when ANY rank found one. It may be a collective: every rank calls it at the same
//!     point of its sequence of collectives, and every rank gets the same answer.
//!  4. `s.update(found_inf)`: ends the step with the agreed flag; a dynamic scaler changes its
//!     scale here. The same flags in the same order give the same state on every rank.
//!  5. `s.state()` → loss_scale_state and `s.load_state(st)`: checkpoint and resume; resuming
//!     reproduces the uninterrupted run.
//!
//! Optional members, each found by DataParallel through the concept named beside it:
//!  (a) `s.active()` → bool (`inspecting_scaler`): false when unscale_and_check would touch
//!      no gradient, issue no collective and return false (NoScaling without check_finite).
//!      DataParallel then hands each bucket to per-bucket callbacks as soon as it lands
//!      instead of after the whole check. Without it, a scaler counts as active.
//!  (b) `s.attach(comm)` (`attachable_scaler<S, Comm>`): called once when DataParallel is
//!      built, so a device-side scaler can allocate its state before the first loss kernel.
//!  (c) `s.device_scale()` → const float* and `s.device_found_inf()` → const int*
//!      (`device_scaler<S>`): the scale and the agreed flag in device memory.
//!      step.device_loss_scale() returns the first; step_result::device_found_inf the second.
//!
//! How a strategy uses it, in `step.finish()` after the gradient all-reduce:
//! \code
//!   bool found_inf = scaler.unscale_and_check(comm, std::span<const grad_group>(groups));
//!   scaler.update(found_inf);
//!   return !found_inf;   // false: skip the optimizer step
//! \endcode
template <class S>
concept loss_scaler = std::semiregular<S> && requires(S& s, const S& cs, bool found_inf, const loss_scale_state& st) {
  { cs.scale() } -> std::convertible_to<double>;
  s.update(found_inf);
  { cs.state() } -> std::same_as<loss_scale_state>;
  s.load_state(st);
};

//! loss_scaler<S> whose unscale_and_check (requirement 3) accepts communicator C.
template <class S, class C>
concept loss_scaler_for = loss_scaler<S> && communicator<C> && requires(S& s, C& c, std::span<const grad_group> g) {
  { s.unscale_and_check(c, g) } -> std::same_as<bool>;
};

//! Optional member (a): whether this step's unscale_and_check does anything.
template <class S>
concept inspecting_scaler = requires(const S& s) {
  { s.active() } -> std::convertible_to<bool>;
};
//! Optional member (b).
template <class S, class C>
concept attachable_scaler = requires(S& s, C& c) { s.attach(c); };
//! Optional member (c).
template <class S>
concept device_scaler = requires(const S& s) {
  { s.device_scale() } -> std::same_as<const float*>;
  { s.device_found_inf() } -> std::same_as<const int*>;
};

//! The memory_ops type of a communicator.
template <class C>
using memory_of_t = std::remove_cvref_t<decltype(std::declval<C&>().memory())>;

namespace detail {

//! Throws unless `s` can be a loss scale. `who` names the caller.
inline void require_valid_scale(double s, const char* who) {
  if (!(std::isfinite(s) && s > 0.0 && std::isfinite(1.0 / s)))
    throw config_error(std::string(who) + ": the loss scale must be finite and > 0, got " + std::to_string(s));
}

//! Throws checkpoint_error unless `st` could have been written by a scaler.
inline void require_valid_state(const loss_scale_state& st, const char* who) {
  if (!(std::isfinite(st.scale) && st.scale > 0.0) || st.good_steps < 0 || st.skipped_steps < 0 || st.steps < 0 ||
      st.skipped_steps > st.steps)
    throw checkpoint_error(std::string(who) + "::load_state: the state is not one a scaler " + "writes (scale " +
                           std::to_string(st.scale) + ", good_steps " + std::to_string(st.good_steps) +
                           ", skipped_steps " + std::to_string(st.skipped_steps) + ", steps " +
                           std::to_string(st.steps) + "); the checkpoint is damaged");
}

//! The counters of loss_scale_state, kept alike by every scaler: one update per optimizer
//! step, a skipped one resets the run of clean steps.
struct scale_counters {
  std::int64_t good_steps = 0;
  std::int64_t skipped_steps = 0;
  std::int64_t steps = 0;

  void count(bool found_inf) noexcept {
    ++steps;
    if (found_inf) {
      ++skipped_steps;
      good_steps = 0;
    } else {
      ++good_steps;
    }
  }
  loss_scale_state state(double scale) const noexcept { return {scale, good_steps, skipped_steps, steps}; }
  //! Adopts the counters of a checked state (require_valid_state first).
  void load(const loss_scale_state& st) noexcept {
    good_steps = st.good_steps;
    skipped_steps = st.skipped_steps;
    steps = st.steps;
  }
};

//! The shared step of every scaler: zero a 4-byte flag in the communicator's memory space,
//! unscale + check in one pass (grad_ops of that space raises the flag), all-reduce the flag
//! with max so every rank decides the same, and read it back. The flag's buffer is cached for
//! the communicator object it was made for (a scaler belongs to one rank), so a steady-state
//! step allocates nothing. Copies start without a buffer: two scalers never share one.
class found_inf_flag {
 public:
  found_inf_flag() = default;
  found_inf_flag(const found_inf_flag&) noexcept {}
  found_inf_flag& operator=(const found_inf_flag&) noexcept {
    buf_.reset();
    owner_ = nullptr;
    return *this;
  }

  template <communicator C>
    requires has_grad_ops<memory_of_t<C>>
  bool unscale_and_agree(C& comm, std::span<const grad_group> groups, double inv_scale) {
    auto mem = comm.memory();
    if (!buf_ || owner_ != static_cast<const void*>(&comm) || kind_ != &kind_tag<C>) {
      buf_ = mem.allocate(sizeof(std::int32_t));
      owner_ = &comm;
      kind_ = &kind_tag<C>;
    }
    void* flag = buf_.get();
    mem.zero(flag, sizeof(std::int32_t));
    grad_ops<memory_of_t<C>>::unscale_and_flag(mem, groups, inv_scale, flag);
    // One rank's inf must stop every rank (its gradients would otherwise differ from the
    // others' after the update). A one-rank group has nothing to agree with.
    if (comm.size() > 1) comm.all_reduce(flag, flag, 1, dtype::i32, reduce_op::max).wait();
    std::int32_t found = 0;
    mem.download(&found, flag, sizeof found);
    return found != 0;
  }

 private:
  template <class C>
  static constexpr char kind_tag = 0;  // its address identifies the communicator type

  std::shared_ptr<void> buf_;
  const void* owner_ = nullptr;
  const char* kind_ = nullptr;
};

}  // namespace detail
}  // namespace lockstep
