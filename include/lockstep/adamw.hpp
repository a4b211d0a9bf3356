#pragma once
//! lockstep::AdamW — Adam with decoupled weight decay, PyTorch semantics (amsgrad off), on
//! host parameters (f32/f64). The fused CUDA version is lockstep::cuda::kernels::adamw_step.
//!
//! Per slot, step ← step + 1; then per element, in the parameter's type, with scalars
//! computed in double and rounded once:
//!   p ← p·(1 − lr·weight_decay)
//!   m ← beta1·m + (1 − beta1)·g
//!   v ← beta2·v + (1 − beta2)·g²
//!   p ← p − lr/(1 − beta1^step) · m / (√v / √(1 − beta2^step) + eps)
//!
//! Slots and step_segments work as in lockstep::Sgd (slot i = the i-th parameter).
//!
//! Checkpoint layout (`save`/`load`), little-endian:
//!   "LKADW001" (8 bytes) | f64 lr, beta1, beta2, eps, weight_decay
//!   | u64 slot count | per slot: u8 has_state, u8 dtype, u64 count, i64 step,
//!     then (has_state) count elements of m, then count elements of v, in that dtype.
//! Loading restores the options too.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "lockstep/concepts.hpp"
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"
#include "lockstep/parameter.hpp"
#include "lockstep/sgd.hpp"  // detail::state_writer/state_reader, shared checks

namespace lockstep {

struct AdamWOptions {
  double lr;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

namespace detail {
//! AdamWOptions in the checkpoint layout (AdamW and cuda::FusedAdamW).
inline void put_options(state_writer& w, const AdamWOptions& o) {
  w.put(o.lr);
  w.put(o.beta1);
  w.put(o.beta2);
  w.put(o.eps);
  w.put(o.weight_decay);
}
inline void get_options(state_reader& r, AdamWOptions& o) {
  o.lr = r.get<double>();
  o.beta1 = r.get<double>();
  o.beta2 = r.get<double>();
  o.eps = r.get<double>();
  o.weight_decay = r.get<double>();
}
}  // namespace detail

class AdamW : public detail::host_optimizer<AdamW, AdamWOptions> {
  friend class detail::host_optimizer<AdamW, AdamWOptions>;

 public:
  static constexpr const char* name = "AdamW";
  explicit AdamW(AdamWOptions o) : host_optimizer(o) {}

  //! Steps taken by a slot (0 before its first).
  std::int64_t step_count(std::size_t slot) const {
    return slot < slots_.size() ? slots_[slot].step : 0;
  }
  //! First and second moments of a slot (empty before its first step or for another T).
  template <class T>
  std::span<const T> exp_avg(std::size_t slot) const { return moment<T>(slot, 0); }
  template <class T>
  std::span<const T> exp_avg_sq(std::size_t slot) const { return moment<T>(slot, 1); }
  std::size_t slot_count() const noexcept { return slots_.size(); }

  void save(std::vector<std::byte>& out) const {
    detail::state_writer w{out};
    for (char c : std::string_view("LKADW001")) w.put(c);
    detail::put_options(w, opt_);
    w.put(static_cast<std::uint64_t>(slots_.size()));
    for (const auto& s : slots_) {
      detail::put_slot_header(w, {s.has, s.type, s.count, s.step}, true);
      if (!s.has) continue;
      if (s.type == dtype::f32) {
        w.put_array(s.m32);
        w.put_array(s.v32);
      } else {
        w.put_array(s.m64);
        w.put_array(s.v64);
      }
    }
  }

  void load(std::span<const std::byte> in) {
    detail::state_reader r{in, "AdamW"};
    r.expect_magic("LKADW001");
    AdamWOptions o{};
    detail::get_options(r, o);
    const auto n = r.get<std::uint64_t>();
    std::vector<slot> slots;
    for (std::uint64_t i = 0; i < n; ++i) {
      slot s;
      const auto h = detail::get_slot_header(r, i, true);
      s.count = static_cast<std::size_t>(h.count);
      s.step = h.step;
      s.has = h.has;
      s.type = h.type;
      if (s.has) {
        if (s.type == dtype::f32) {
          r.get_array(s.m32, s.count);
          r.get_array(s.v32, s.count);
        } else {
          r.get_array(s.m64, s.count);
          r.get_array(s.v64, s.count);
        }
      }
      slots.push_back(std::move(s));
    }
    r.expect_end();
    adopt_loaded_options(o);
    slots_ = std::move(slots);
  }

 private:
  struct slot {
    bool has = false;
    dtype type = dtype::f32;
    std::size_t count = 0;
    std::int64_t step = 0;
    std::vector<float> m32, v32;
    std::vector<double> m64, v64;
  };

  template <class T>
  std::span<const T> moment(std::size_t i, int which) const {
    if (i >= slots_.size() || !slots_[i].has || slots_[i].type != dtype_of<T>) return {};
    const slot& s = slots_[i];
    if constexpr (std::is_same_v<T, float>) return which == 0 ? std::span<const T>(s.m32) : std::span<const T>(s.v32);
    else return which == 0 ? std::span<const T>(s.m64) : std::span<const T>(s.v64);
  }

  static void validate(const AdamWOptions& o) {
    if (!(o.lr >= 0) || !std::isfinite(o.lr))
      throw config_error("AdamW: lr must be a finite number ≥ 0, got " + std::to_string(o.lr));
    if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1))
      throw config_error("AdamW: beta1 and beta2 must lie in [0, 1), got " +
                         std::to_string(o.beta1) + " and " + std::to_string(o.beta2));
    if (!(o.eps > 0) || !(o.weight_decay >= 0) || !std::isfinite(o.weight_decay))
      throw config_error("AdamW: eps must be > 0 and weight_decay a finite number ≥ 0");
  }

  void update(std::size_t i, const segment& v, const segment& g, dtype t) {
    slot& s = checked_slot(slots_, i, v, g, t);
    if (!s.has) {
      s.has = true;
      s.type = t;
      s.count = v.count;
      if (t == dtype::f32) {
        s.m32.assign(v.count, 0.0f);
        s.v32.assign(v.count, 0.0f);
      } else {
        s.m64.assign(v.count, 0.0);
        s.v64.assign(v.count, 0.0);
      }
    }
    ++s.step;
    if (t == dtype::f32)
      apply<float>(s.step, static_cast<float*>(v.ptr), static_cast<const float*>(g.ptr), s.m32.data(), s.v32.data(), v.count);
    else
      apply<double>(s.step, static_cast<double*>(v.ptr), static_cast<const double*>(g.ptr), s.m64.data(), s.v64.data(), v.count);
  }

  template <class T>
  void apply(std::int64_t step, T* p, const T* g, T* m, T* v, std::size_t n) const {
    const double st = static_cast<double>(step);
    const T decay = static_cast<T>(1.0 - opt_.lr * opt_.weight_decay);
    const T step_size = static_cast<T>(opt_.lr / (1.0 - std::pow(opt_.beta1, st)));
    const T bc2_sqrt = static_cast<T>(std::sqrt(1.0 - std::pow(opt_.beta2, st)));
    const T b1 = static_cast<T>(opt_.beta1), omb1 = static_cast<T>(1.0 - opt_.beta1);
    const T b2 = static_cast<T>(opt_.beta2), omb2 = static_cast<T>(1.0 - opt_.beta2);
    const T eps = static_cast<T>(opt_.eps);
    for (std::size_t k = 0; k < n; ++k) {
      const T gk = g[k];
      p[k] = p[k] * decay;
      m[k] = b1 * m[k] + omb1 * gk;
      v[k] = b2 * v[k] + omb2 * gk * gk;
      const T denom = std::sqrt(v[k]) / bc2_sqrt + eps;
      p[k] = p[k] - step_size * (m[k] / denom);
    }
  }

  std::vector<slot> slots_;
};

}  // namespace lockstep
