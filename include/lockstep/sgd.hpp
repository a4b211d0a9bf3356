#pragma once
//! lockstep::Sgd — stochastic gradient descent with momentum, PyTorch semantics, on host
//! parameters (f32/f64). The fused CUDA version is lockstep::cuda::kernels::sgd_step.
//!
//! Per element, with g the gradient and p the parameter (all in the parameter's type):
//!   g ← g + weight_decay·p                       (when weight_decay ≠ 0)
//!   buf ← g on a slot's first step, else momentum·buf + (1 − dampening)·g
//!   g ← g + momentum·buf (nesterov) or buf        (when momentum ≠ 0)
//!   p ← p − lr·g
//!
//! State lives in *slots*: slot i belongs to the i-th parameter of `parameters()`.
//! `step(params)` updates every slot; `step_segments(slots, values, grads, t)` updates a
//! subset, e.g. one bucket as soon as it is reduced.
//!
//! Checkpoint layout (`save`/`load`), little-endian:
//!   "LKSGD001" (8 bytes) | f64 lr, momentum, dampening, weight_decay | u8 nesterov
//!   | u64 slot count | per slot: u8 has_buffer, u8 dtype, u64 count,
//!     then (has_buffer) count elements of the momentum buffer in that dtype.
//! Loading restores the options too (as PyTorch's load_state_dict restores param_groups).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "lockstep/concepts.hpp"
#include "lockstep/detail/byte_io.hpp"
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"
#include "lockstep/parameter.hpp"

namespace lockstep {

struct SgdOptions {
  double lr;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};

namespace detail {

//! Appends little-endian scalars and raw element arrays to a checkpoint blob.
struct state_writer {
  std::vector<std::byte>& out;
  template <le_scalar T>
  void put(T v) {
    const auto at = out.size();
    out.resize(at + sizeof(T));
    store_le(out.data() + at, v);
  }
  template <class T>
  void put_array(const std::vector<T>& v) {
    for (const T& x : v) put(x);
  }
};

//! Reads what state_writer wrote; every short read is a checkpoint_error naming `what`.
struct state_reader {
  std::span<const std::byte> in;
  const char* what;
  std::size_t at = 0;
  void need(std::size_t n) const {
    if (in.size() - at < n)
      throw checkpoint_error(std::string(what) + " state is truncated at byte " +
                             std::to_string(at) + " of " + std::to_string(in.size()) +
                             "; pass the whole blob that save() wrote");
  }
  template <le_scalar T>
  T get() {
    need(sizeof(T));
    T v = load_le<T>(in.data() + at);
    at += sizeof(T);
    return v;
  }
  template <class T>
  void get_array(std::vector<T>& v, std::size_t n) {
    if (n > (in.size() - at) / sizeof(T)) need(n * sizeof(T));  // overflow-safe truncation check
    v.resize(n);
    for (auto& x : v) x = get<T>();
  }
  void expect_magic(const char (&magic)[9]) {
    need(8);
    if (std::memcmp(in.data() + at, magic, 8) != 0)
      throw checkpoint_error(std::string(what) + " state does not start with \"" + magic +
                             "\": this blob was not written by " + what + "::save()");
    at += 8;
  }
  void expect_end() const {
    if (at != in.size())
      throw checkpoint_error(std::string(what) + " state has " + std::to_string(in.size() - at) +
                             " trailing bytes; the blob is corrupt or from another optimizer");
  }
};

//! One slot's header in the optimizers' checkpoint layout, shared by the CPU optimizers and
//! cuda::FusedSgd / FusedAdamW: u8 has-state, u8 state type (f32/f64), u64 element count,
//! then — in AdamW's layout only — i64 step.
struct slot_header {
  bool has = false;
  dtype type = dtype::f32;
  std::uint64_t count = 0;
  std::int64_t step = 0;
};

inline void put_slot_header(state_writer& w, const slot_header& h, bool with_step) {
  w.put(static_cast<std::uint8_t>(h.has ? 1 : 0));
  w.put(static_cast<std::uint8_t>(h.type));
  w.put(h.count);
  if (with_step) w.put(h.step);
}

//! Reads and checks slot i's header. Without a step in the layout, a slot with state reads
//! as stepped once. allow_state = false: a slot with state is corrupt (no buffers expected).
inline slot_header get_slot_header(state_reader& r, std::uint64_t i, bool with_step, bool allow_state = true) {
  const auto has = r.get<std::uint8_t>();
  const auto t = static_cast<dtype>(r.get<std::uint8_t>());
  slot_header h;
  h.count = r.get<std::uint64_t>();
  h.step = with_step ? r.get<std::int64_t>() : (has == 1 ? 1 : 0);
  if (has > 1 || (t != dtype::f32 && t != dtype::f64) || (has == 1 && !allow_state) ||
      (with_step && (h.step < 0 || (has == 1) != (h.step > 0))))
    throw checkpoint_error(std::string(r.what) + " state slot " + std::to_string(i) +
                           " has an invalid header; the blob is corrupt");
  h.has = has == 1;
  h.type = t;
  return h;
}

//! SgdOptions in the checkpoint layout (Sgd and cuda::FusedSgd).
inline void put_options(state_writer& w, const SgdOptions& o) {
  w.put(o.lr);
  w.put(o.momentum);
  w.put(o.dampening);
  w.put(o.weight_decay);
  w.put(static_cast<std::uint8_t>(o.nesterov ? 1 : 0));
}
inline void get_options(state_reader& r, SgdOptions& o) {
  o.lr = r.get<double>();
  o.momentum = r.get<double>();
  o.dampening = r.get<double>();
  o.weight_decay = r.get<double>();
  const auto nest = r.get<std::uint8_t>();
  if (nest > 1) throw checkpoint_error(std::string(r.what) + " state has an invalid nesterov byte; the blob is corrupt");
  o.nesterov = nest == 1;
}

//! Host element types the CPU optimizers compute on.
inline void check_optimizer_dtype(dtype t, const char* who) {
  if (t != dtype::f32 && t != dtype::f64)
    throw config_error(std::string(who) + " on the CPU updates f32 or f64 parameters, not " +
                       name_of(t) + "; use lockstep::cuda::kernels for half precision");
}

inline void check_segment_pair(const segment& v, const segment& g, std::size_t slot,
                               const char* who) {
  if (v.count != g.count)
    throw config_error(std::string(who) + ": slot " + std::to_string(slot) + " has " +
                       std::to_string(v.count) + " values but " + std::to_string(g.count) +
                       " gradients; pass matching segments");
  if (v.count != 0 && (v.ptr == nullptr || g.ptr == nullptr))
    throw config_error(std::string(who) + ": slot " + std::to_string(slot) +
                       " has a null value or gradient pointer");
}

//! Calls f(i, parameter) for each parameter of a range.
template <class R, class F>
void for_each_parameter(R&& params, F&& f) {
  std::size_t i = 0;
  for (auto&& p : params) f(i++, static_cast<const parameter&>(p));
}

template <class R>
concept parameter_range = std::ranges::input_range<R> &&
                          std::convertible_to<std::ranges::range_value_t<R>, parameter>;

//! What the host optimizers share: options with a learning rate, and stepping all
//! parameters or a subset (a bucket). Derived provides validate(Options) and
//! update(slot, value segment, grad segment, dtype); slot i is the i-th parameter.
template <class Derived, class Options>
class host_optimizer {
 public:
  explicit host_optimizer(Options o) : opt_(o) { Derived::validate(opt_); }

  const Options& options() const noexcept { return opt_; }
  //! For learning-rate schedules.
  void set_lr(double lr) {
    Options o = opt_;
    o.lr = lr;
    Derived::validate(o);
    opt_ = o;
  }

  //! Updates every parameter. skip = true leaves parameters and state untouched (a step
  //! whose gradients held inf/NaN), step counts included.
  template <parameter_range R>
  void step(R&& params, bool skip = false) {
    if (skip) return;
    for_each_parameter(params, [&](std::size_t i, const parameter& p) {
      self().update(i, segment{p.value, p.numel()}, segment{p.grad, p.numel()}, p.type);
    });
  }

  //! Updates a subset: values[k], grads[k] (host memory, element type t) belong to slot
  //! slots[k]. The three spans have the same length.
  void step_segments(std::span<const std::size_t> slots, std::span<const segment> values,
                     std::span<const segment> grads, dtype t, bool skip = false) {
    if (slots.size() != values.size() || slots.size() != grads.size())
      throw config_error(std::string(Derived::name) + "::step_segments: " + std::to_string(slots.size()) +
                         " slots, " + std::to_string(values.size()) + " value and " +
                         std::to_string(grads.size()) + " gradient segments; pass one of each per slot");
    if (skip) return;
    for (std::size_t k = 0; k < slots.size(); ++k) self().update(slots[k], values[k], grads[k], t);
  }

 protected:
  //! The state slot of parameter i, after checking the update's arguments: a float type, two
  //! segments of one length, and the same type and length as the slot saw before.
  template <class Slot>
  static Slot& checked_slot(std::vector<Slot>& slots, std::size_t i, const segment& v, const segment& g, dtype t) {
    check_optimizer_dtype(t, Derived::name);
    check_segment_pair(v, g, i, Derived::name);
    if (i >= slots.size()) slots.resize(i + 1);
    Slot& s = slots[i];
    if (s.has && (s.type != t || s.count != v.count))
      throw config_error(std::string(Derived::name) + ": slot " + std::to_string(i) + " holds state for " +
                         std::to_string(s.count) + " " + name_of(s.type) + " elements, but got " +
                         std::to_string(v.count) + " " + name_of(t) +
                         "; pass the same parameters in the same order every step");
    return s;
  }

  //! Options read from a checkpoint: invalid ones are a damaged checkpoint, not user input.
  void adopt_loaded_options(const Options& o) {
    try {
      Derived::validate(o);
    } catch (const config_error& e) {
      throw checkpoint_error(std::string(Derived::name) + " state holds invalid options: " + e.what());
    }
    opt_ = o;
  }

  Options opt_;

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

}  // namespace detail

class Sgd : public detail::host_optimizer<Sgd, SgdOptions> {
  friend class detail::host_optimizer<Sgd, SgdOptions>;

 public:
  static constexpr const char* name = "Sgd";
  explicit Sgd(SgdOptions o) : host_optimizer(o) {}

  //! The momentum buffer of a slot (empty before its first step or when momentum = 0).
  template <class T>
  std::span<const T> momentum_buffer(std::size_t slot) const {
    if (slot >= slots_.size() || !slots_[slot].has) return {};
    return buffer<T>(slots_[slot]);
  }
  std::size_t slot_count() const noexcept { return slots_.size(); }

  void save(std::vector<std::byte>& out) const {
    detail::state_writer w{out};
    for (char c : std::string_view("LKSGD001")) w.put(c);
    detail::put_options(w, opt_);
    w.put(static_cast<std::uint64_t>(slots_.size()));
    for (const auto& s : slots_) {
      detail::put_slot_header(w, {s.has, s.type, s.count, 0}, false);
      if (s.has) {
        if (s.type == dtype::f32) w.put_array(s.f32);
        else w.put_array(s.f64);
      }
    }
  }

  void load(std::span<const std::byte> in) {
    detail::state_reader r{in, "Sgd"};
    r.expect_magic("LKSGD001");
    SgdOptions o{};
    detail::get_options(r, o);
    const auto n = r.get<std::uint64_t>();
    std::vector<slot> slots;
    for (std::uint64_t i = 0; i < n; ++i) {
      slot s;
      const auto h = detail::get_slot_header(r, i, false);
      s.count = static_cast<std::size_t>(h.count);
      s.has = h.has;
      s.type = h.type;
      if (s.has) {
        if (s.type == dtype::f32) r.get_array(s.f32, s.count);
        else r.get_array(s.f64, s.count);
      }
      slots.push_back(std::move(s));
    }
    r.expect_end();
    adopt_loaded_options(o);
    slots_ = std::move(slots);
  }

 private:
  struct slot {
    bool has = false;  // momentum buffer initialised (PyTorch: buffer is not None)
    dtype type = dtype::f32;
    std::size_t count = 0;
    std::vector<float> f32;
    std::vector<double> f64;
  };

  template <class T>
  static std::span<const T> buffer(const slot& s) {
    if constexpr (std::is_same_v<T, float>) return s.type == dtype::f32 ? std::span<const T>(s.f32) : std::span<const T>();
    else return s.type == dtype::f64 ? std::span<const T>(s.f64) : std::span<const T>();
  }

  static void validate(const SgdOptions& o) {
    if (!(o.lr >= 0) || !std::isfinite(o.lr))
      throw config_error("Sgd: lr must be a finite number ≥ 0, got " + std::to_string(o.lr));
    if (!(o.momentum >= 0) || !(o.weight_decay >= 0) || !std::isfinite(o.dampening))
      throw config_error("Sgd: momentum and weight_decay must be ≥ 0 and dampening finite");
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      throw config_error("Sgd: nesterov needs momentum > 0 and dampening = 0 (as in PyTorch)");
  }

  void update(std::size_t i, const segment& v, const segment& g, dtype t) {
    slot& s = checked_slot(slots_, i, v, g, t);
    if (t == dtype::f32) apply<float>(s, static_cast<float*>(v.ptr), static_cast<const float*>(g.ptr), v.count);
    else apply<double>(s, static_cast<double*>(v.ptr), static_cast<const double*>(g.ptr), v.count);
  }

  template <class T>
  void apply(slot& s, T* p, const T* g, std::size_t n) {
    const T lr = static_cast<T>(opt_.lr), wd = static_cast<T>(opt_.weight_decay);
    const T mom = static_cast<T>(opt_.momentum), damp1 = static_cast<T>(1 - opt_.dampening);
    const bool use_mom = opt_.momentum != 0;
    T* buf = nullptr;
    bool first = false;
    if (use_mom) {
      first = !s.has;
      if (first) {
        s.has = true;
        s.type = dtype_of<T>;
        s.count = n;
        if constexpr (std::is_same_v<T, float>) s.f32.assign(n, 0.0f);
        else s.f64.assign(n, 0.0);
      }
      if constexpr (std::is_same_v<T, float>) buf = s.f32.data();
      else buf = s.f64.data();
    }
    for (std::size_t k = 0; k < n; ++k) {
      T d = g[k];
      if (wd != 0) d = d + wd * p[k];
      if (use_mom) {
        buf[k] = first ? d : mom * buf[k] + damp1 * d;
        d = opt_.nesterov ? d + mom * buf[k] : buf[k];
      }
      p[k] = p[k] - lr * d;
    }
  }

  std::vector<slot> slots_;
};

}  // namespace lockstep
