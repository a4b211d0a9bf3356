#pragma once
//! What every lockstep optimizer shares: the optimizer_rule concept (an optimizer's math,
//! written once for the host and the GPU), the host optimizer Optimizer<Rule> that applies a
//! rule to host parameters (f32/f64), and the checkpoint layout of optimizer state, written
//! with the checkpoint's codec (core/codec.hpp). Rules: SgdRule (sgd.hpp), AdamWRule
//! (adamw.hpp). The GPU side is lockstep::FusedOptimizer<Rule> (cuda/fused_optimizer.cuh).
//! docs/optimizer.md says how to add one.
//!
//! Checkpoint layout (save/load), little-endian; the fused optimizers write the same:
//!   Rule::magic (8 bytes) | Rule::fields(options), each in turn | u64 slot count
//!   | per slot: u8 has_state, u8 state dtype (f32/f64), u64 count, [i64 step if
//!     Rule::saves_step], then (has_state) Rule::states(options) arrays of count elements.
//! A fused optimizer with f16/bf16 parameters writes Rule::magic_with_masters instead and
//! appends its fp32 masters (see cuda/detail/fused_state.cuh). Loading restores the options
//! too (as PyTorch's load_state_dict restores param_groups).

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/detail/host_device.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"

namespace lockstep {

namespace detail {
//! Multiply and add rounded separately: never contracted into an FMA on the device, so the
//! GPU computes exactly what the host computes (which has no FMA on baseline x86-64).
template <class A>
LOCKSTEP_HOST_DEVICE inline A rn_mul(A a, A b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) return __fmul_rn(a, b);
  else return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
template <class A>
LOCKSTEP_HOST_DEVICE inline A rn_add(A a, A b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) return __fadd_rn(a, b);
  else return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
//! √x correctly rounded in x's own type (float stays float), on host and device.
template <class A>
LOCKSTEP_HOST_DEVICE inline A rn_sqrt(A x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) return ::sqrtf(x);
  else return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}
LOCKSTEP_HOST_DEVICE inline double pow_of(double x, double y) {
#if defined(__CUDA_ARCH__)
  return ::pow(x, y);
#else
  return std::pow(x, y);
#endif
}

//! Every rule's first check: the learning rate (`who`: the optimizer's name for the message).
inline void check_learning_rate(const char* who, double lr) {
  if (!(lr >= 0) || !std::isfinite(lr))
    throw config_error(std::string(who) + ": lr must be a finite number ≥ 0, got " + std::to_string(lr));
}
}  // namespace detail

// ---------------------------------------------------------------------------------------
//! lockstep::optimizer_rule — an optimizer's math, once, for the host (Optimizer<Rule>) and
//! the GPU (FusedOptimizer<Rule>).
//!
//! Requirements, for a rule R:
//!  1. `R::options`: the hyperparameters, a trivially copyable aggregate with a `double lr`.
//!  2. `R::name`, `R::fused_name`: the host and GPU optimizers' names, for messages.
//!  3. `R::max_states` (0..2): state buffers per element at most; `R::states(o)`: how many
//!     options o use (e.g. SGD without momentum keeps none).
//!  4. `R::validate(o)`: throws config_error naming the bad option.
//!  5. Checkpoints: `R::magic` and `R::magic_with_masters` (8 characters each),
//!     `R::saves_step`, and `R::fields(o)`: the options as a std::tie of their members, in
//!     the order the checkpoint holds them (each written with byte_writer::write).
//!  6. `R::coefficients<A>` and `R::prepare<A>(o, step)`: the scalars of one step of one
//!     tensor in compute type A (float or double), rounded once from double; `step` counts
//!     the tensor's steps from 1.
//!  7. `R::update<A>(c, w, g, s)`: one element: parameter w (updated in place), gradient g,
//!     s[0..states) its state. prepare and update are LOCKSTEP_HOST_DEVICE; multiplies and
//!     adds go through detail::rn_mul / rn_add so that host and GPU agree bit for bit.
//! Example: lockstep::SgdRule (optim/sgd.hpp).
template <class R>
concept optimizer_rule = std::is_trivially_copyable_v<typename R::options> &&
                         requires(const typename R::options& o, byte_writer& w, byte_reader& r, float a, float* s) {
                           { R::name } -> std::convertible_to<const char*>;
                           { R::fused_name } -> std::convertible_to<const char*>;
                           { R::max_states } -> std::convertible_to<int>;
                           { R::states(o) } -> std::convertible_to<int>;
                           R::validate(o);
                           { R::saves_step } -> std::convertible_to<bool>;
                           R::fields(o);
                           R::update(R::template prepare<float>(o, std::int64_t{1}), a, a, s);
                           { o.lr } -> std::convertible_to<double>;
                         };

//! An optimizer whose whole state lies in one buffer of its memory space, so that a copy of
//! it needs no synchronisation (FusedSgd, FusedAdamW): `state_image()` that buffer, and
//! `save_image(shapes, host_copy, w)` what save() writes of an optimizer like this one built
//! over parameters of `shapes`, read from a host copy of its state_image(). PeerCopy keeps
//! such a state by a copy on the stream of the steps instead of save().
template <class O>
concept imaged_optimizer = serializable<O> && requires(const O& o, std::span<const param_shape> s,
                                                       std::span<const std::byte> b, byte_writer& w) {
  { o.state_image() } -> std::convertible_to<std::span<const std::byte>>;
  o.save_image(s, b, w);
};

namespace detail {

//! One slot's header in the checkpoint layout (see the file comment).
struct slot_header {
  bool has = false;
  dtype type = dtype::f32;
  std::uint64_t count = 0;
  std::int64_t step = 0;
};

inline void put_slot_header(byte_writer& w, const slot_header& h, bool with_step) {
  w.write(static_cast<std::uint8_t>(h.has ? 1 : 0));
  w.write(static_cast<std::uint8_t>(h.type));
  w.write(h.count);
  if (with_step) w.write(h.step);
}

//! Reads and checks slot i's header. Without a step in the layout, a slot with state reads
//! as stepped once. allow_state = false: a slot with state is corrupt (no buffers expected).
inline slot_header get_slot_header(byte_reader& r, std::uint64_t i, bool with_step, bool allow_state) {
  const auto has = r.read<std::uint8_t>();
  const auto t = static_cast<dtype>(r.read<std::uint8_t>());
  slot_header h;
  h.count = r.read<std::uint64_t>();
  h.step = with_step ? r.read<std::int64_t>() : (has == 1 ? 1 : 0);
  if (has > 1 || (t != dtype::f32 && t != dtype::f64) || (has == 1 && !allow_state) ||
      (with_step && (h.step < 0 || (has == 1) != (h.step > 0))))
    r.fail("slot " + std::to_string(i) + " has an invalid header; the state is corrupt");
  h.has = has == 1;
  h.type = t;
  return h;
}

//! A rule's options in checkpoint order (Rule::fields), written or read in turn.
template <class Rule>
void save_options(byte_writer& w, const typename Rule::options& o) {
  std::apply([&](const auto&... f) { (w.write(f), ...); }, Rule::fields(o));
}
template <class Rule>
typename Rule::options load_options(byte_reader& r) {
  typename Rule::options o{};
  std::apply([&](auto&... f) { ((f = r.read<std::remove_cvref_t<decltype(f)>>()), ...); }, Rule::fields(o));
  return o;
}

//! Options read from a checkpoint: invalid ones are a damaged checkpoint, not user input.
template <optimizer_rule Rule>
typename Rule::options checked_loaded_options(byte_reader& r, const char* who) {
  const auto o = load_options<Rule>(r);
  try {
    Rule::validate(o);
  } catch (const config_error& e) {
    throw checkpoint_error(std::string(who) + " state holds invalid options: " + e.what());
  }
  return o;
}

inline void check_segment_pair(const segment& v, const segment& g, std::size_t slot, const char* who) {
  if (v.count != g.count)
    throw config_error(std::string(who) + ": slot " + std::to_string(slot) + " has " + std::to_string(v.count) +
                       " values but " + std::to_string(g.count) + " gradients; pass matching segments");
  if (v.count != 0 && (v.ptr == nullptr || g.ptr == nullptr))
    throw config_error(std::string(who) + ": slot " + std::to_string(slot) + " has a null value or gradient pointer");
}

template <class R>
concept parameter_range = std::ranges::input_range<R> && std::convertible_to<std::ranges::range_value_t<R>, parameter>;

//! What the host and the fused optimizer of a rule share: its options, validated at
//! construction and on every change.
template <optimizer_rule Rule>
class rule_options {
 public:
  using rule_type = Rule;
  using options_type = typename Rule::options;

  explicit rule_options(options_type o) : opt_(o) { Rule::validate(opt_); }

  const options_type& options() const noexcept { return opt_; }
  //! For learning-rate schedules (takes effect at the next step).
  void set_lr(double lr) {
    options_type o = opt_;
    o.lr = lr;
    Rule::validate(o);
    opt_ = o;
  }

 protected:
  options_type opt_;
};

}  // namespace detail

// ---------------------------------------------------------------------------------------
//! Optimizer<Rule> — a rule applied to host parameters (f32/f64), in their own type.
//! State lives in *slots*: slot i belongs to the i-th parameter of `parameters()`.
//! `step(params)` updates every slot; `step(slices)` the slots the slices name (whole), and
//! `step_segments(slots, values, grads, t)` a subset (e.g. one bucket as soon as it is reduced). serializable:
//! save(byte_writer&) / load(byte_reader&).
template <optimizer_rule Rule>
class Optimizer : public detail::rule_options<Rule> {
  using base = detail::rule_options<Rule>;
  using base::opt_;

 public:
  using typename base::options_type;
  using typename base::rule_type;

  explicit Optimizer(options_type o) : base(o) {}

  //! Updates every parameter. skip = true leaves parameters and state untouched (a step
  //! whose gradients held inf/NaN), step counts included.
  template <detail::parameter_range R>
  void step(R&& params, bool skip = false) {
    if (skip) return;
    std::size_t i = 0;
    for (auto&& p : params) {
      const parameter& q = p;
      update(i++, segment{q.value, q.numel()}, segment{q.grad, q.numel()}, q.type);
    }
  }

  //! Updates slices, e.g. the shards DataParallel hands to finish(on_shard) with
  //! ShardedOptimizer: slice k updates slot slices[k].param. Host optimizers keep state per
  //! whole slot, so each slice must start at offset 0 and cover the same count every step.
  void step(std::span<const param_slice> slices, bool skip = false) {
    if (skip) return;
    for (const auto& sl : slices) {  // all checked before any is updated
      if (sl.offset != 0)
        throw config_error(std::string(Rule::name) + "::step: a slice of parameter " + std::to_string(sl.param) +
                           " starts at element " + std::to_string(sl.offset) +
                           "; host optimizers step whole slots (a bucket split this parameter: step "
                           "after finish() with step(dp.parameters()), or use ShardedOptimizer's shards)");
      if (sl.param < slots_.size() && slots_[sl.param].has && slots_[sl.param].count != sl.count)
        checked_slot(sl.param, segment{sl.value, sl.count}, segment{sl.grad, sl.count}, sl.type);  // throws
    }
    for (const auto& sl : slices) update(sl.param, segment{sl.value, sl.count}, segment{sl.grad, sl.count}, sl.type);
  }

  //! Updates a subset: values[k], grads[k] (host memory, element type t) belong to slot
  //! slots[k]. The three spans have the same length.
  void step_segments(std::span<const std::size_t> slots, std::span<const segment> values,
                     std::span<const segment> grads, dtype t, bool skip = false) {
    if (slots.size() != values.size() || slots.size() != grads.size())
      throw config_error(std::string(Rule::name) + "::step_segments: " + std::to_string(slots.size()) + " slots, " +
                         std::to_string(values.size()) + " value and " + std::to_string(grads.size()) +
                         " gradient segments; pass one of each per slot");
    if (skip) return;
    for (std::size_t k = 0; k < slots.size(); ++k) update(slots[k], values[k], grads[k], t);
  }

  //! Steps taken by a slot (0 before its first).
  std::int64_t step_count(std::size_t slot) const { return slot < slots_.size() ? slots_[slot].step : 0; }
  //! State buffer k of a slot (empty before its first step, or for another T).
  template <class T>
  std::span<const T> state(std::size_t slot, int k) const {
    if (slot >= slots_.size() || !slots_[slot].has || slots_[slot].type != dtype_of<T> || k < 0 ||
        k >= Rule::max_states)
      return {};
    if constexpr (std::is_same_v<T, float>) return slots_[slot].f32[k];
    else return slots_[slot].f64[k];
  }
  std::size_t slot_count() const noexcept { return slots_.size(); }

  void save(byte_writer& w) const {
    w.write_bytes(Rule::magic, 8);
    detail::save_options<Rule>(w, opt_);
    w.write(static_cast<std::uint64_t>(slots_.size()));
    const int states = Rule::states(opt_);
    for (const auto& s : slots_) {
      detail::put_slot_header(w, detail::slot_header{s.has, s.type, static_cast<std::uint64_t>(s.count), s.step},
                              Rule::saves_step);
      if (!s.has) continue;
      for (int k = 0; k < states; ++k) {
        if (s.type == dtype::f32) w.write_elements(std::span<const float>(s.f32[k]));
        else w.write_elements(std::span<const double>(s.f64[k]));
      }
    }
  }

  //! Reads what save wrote; the state (and the options) change only if all of it is good.
  void load(byte_reader& r) {
    r.expect_magic(std::string_view(Rule::magic, 8), std::string(Rule::name) + "::save()");
    const auto o = detail::checked_loaded_options<Rule>(r, Rule::name);
    const int states = Rule::states(o);
    const auto n = r.read<std::uint64_t>();
    std::vector<slot> slots;
    for (std::uint64_t i = 0; i < n; ++i) {
      const auto h = detail::get_slot_header(r, i, Rule::saves_step, states > 0);
      slot& s = slots.emplace_back();
      s.has = h.has;
      s.type = h.type;
      s.count = static_cast<std::size_t>(h.count);
      s.step = h.step;
      if (!s.has) continue;
      for (int k = 0; k < states; ++k) {
        if (s.type == dtype::f32) read_state(r, s.f32[k], s.count);
        else read_state(r, s.f64[k], s.count);
      }
    }
    opt_ = o;
    slots_ = std::move(slots);
  }

 private:
  struct slot {
    bool has = false;  // state buffers exist (allocated at the first step)
    dtype type = dtype::f32;
    std::size_t count = 0;
    std::int64_t step = 0;
    std::vector<float> f32[Rule::max_states > 0 ? Rule::max_states : 1];
    std::vector<double> f64[Rule::max_states > 0 ? Rule::max_states : 1];
  };

  template <class T>
  static void read_state(byte_reader& r, std::vector<T>& v, std::size_t n) {
    if (n > r.remaining() / sizeof(T)) r.fail("ends inside a state buffer of " + std::to_string(n) + " elements");
    v.resize(n);
    r.read_elements(std::span<T>(v));
  }

  //! Checks the update's arguments: a float type, two segments of one length, and the same
  //! type and length as the slot saw before.
  slot& checked_slot(std::size_t i, const segment& v, const segment& g, dtype t) {
    if (t != dtype::f32 && t != dtype::f64)
      throw config_error(std::string(Rule::name) + " on the CPU updates f32 or f64 parameters, not " + name_of(t) +
                         "; use lockstep::cuda::" + Rule::fused_name + " for half precision");
    detail::check_segment_pair(v, g, i, Rule::name);
    if (i >= slots_.size()) slots_.resize(i + 1);
    slot& s = slots_[i];
    if (s.has && (s.type != t || s.count != v.count))
      throw config_error(std::string(Rule::name) + ": slot " + std::to_string(i) + " holds state for " +
                         std::to_string(s.count) + " " + name_of(s.type) + " elements, but got " +
                         std::to_string(v.count) + " " + name_of(t) +
                         "; pass the same parameters in the same order every step");
    return s;
  }

  void update(std::size_t i, const segment& v, const segment& g, dtype t) {
    slot& s = checked_slot(i, v, g, t);
    const int states = Rule::states(opt_);
    if (!s.has && states > 0) {
      s.has = true;
      s.type = t;
      s.count = v.count;
      for (int k = 0; k < states; ++k) {
        if (t == dtype::f32) s.f32[k].assign(v.count, 0.0f);
        else s.f64[k].assign(v.count, 0.0);
      }
    }
    ++s.step;
    if (t == dtype::f32) apply<float>(s, s.f32, static_cast<float*>(v.ptr), static_cast<const float*>(g.ptr), v.count);
    else apply<double>(s, s.f64, static_cast<double*>(v.ptr), static_cast<const double*>(g.ptr), v.count);
  }

  template <class T, std::size_t K>
  void apply(const slot& s, std::vector<T> (&buf)[K], T* p, const T* g, std::size_t n) const {
    const auto c = Rule::template prepare<T>(opt_, s.step);
    const int states = Rule::states(opt_);
    T st[K] = {};
    for (std::size_t j = 0; j < n; ++j) {
      for (int k = 0; k < states; ++k) st[k] = buf[k][j];
      T w = p[j];
      Rule::update(c, w, g[j], st);
      p[j] = w;
      for (int k = 0; k < states; ++k) buf[k][j] = st[k];
    }
  }

  std::vector<slot> slots_;
};

}  // namespace lockstep
