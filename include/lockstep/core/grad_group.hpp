#pragma once
//! lockstep::grad_group — the gradients of one element type, as the segments of memory that
//! hold them (in the communicator's memory space). After the all-reduce in `step.finish()`
//! the strategy hands a span of these to the loss scaler and to clipping; the segments are
//! typically the gradient arena of that element type, one segment per contiguous run.

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/host_memory.hpp"

namespace lockstep {

struct grad_group {
  dtype type = dtype::f32;
  std::span<const segment> segments;

  //! Elements over all segments.
  std::size_t count() const noexcept {
    std::size_t n = 0;
    for (const auto& s : segments) n += s.count;
    return n;
  }
  std::size_t bytes() const noexcept { return count() * size_of(type); }
};

//! Elements over all groups.
inline std::size_t total_count(std::span<const grad_group> groups) noexcept {
  std::size_t n = 0;
  for (const auto& g : groups) n += g.count();
  return n;
}

namespace detail {

//! Throws unless every group holds floating-point elements: scaling, clipping and the
//! non-finite check mean nothing for integer "gradients". `who` names the caller.
inline void require_floating(std::span<const grad_group> groups, const char* who) {
  for (const auto& g : groups)
    if (!is_floating(g.type))
      throw config_error(std::string(who) + ": a gradient group holds " + name_of(g.type) +
                         " elements; gradients must be floating point (f16, bf16, f32, f64)");
}

//! Calls f(T* data, std::size_t count) for every non-empty segment of every group, with T the
//! group's host element type. Host memory only; half-precision groups throw config_error
//! (visit_host_dtype) because they have no host arithmetic in this build.
template <class F>
void for_each_host_segment(std::span<const grad_group> groups, F&& f) {
  for (const auto& g : groups) {
    visit_host_dtype(g.type, [&]<class T>(T) {
      for (const auto& s : g.segments)
        if (s.count != 0) f(static_cast<T*>(s.ptr), s.count);
    });
  }
}

//! Bits of an IEEE float whose exponent is all ones (inf or NaN). Testing bits instead of
//! calling std::isfinite lets the loops vectorise (an OR-reduction of integers needs no
//! reassociation of floating-point sums) and keeps working under -ffast-math.
template <class T>
struct float_bits;
template <>
struct float_bits<float> {
  using uint = std::uint32_t;
  static constexpr uint exponent = 0x7f800000u;
};
template <>
struct float_bits<double> {
  using uint = std::uint64_t;
  static constexpr uint exponent = 0x7ff0000000000000ull;
};

template <class T>
inline bool nonfinite(T x) noexcept {
  using B = float_bits<T>;
  return (std::bit_cast<typename B::uint>(x) & B::exponent) == B::exponent;
}

//! Neumaier-compensated sum of doubles: the total of many chunk sums stays within a few ulps
//! whatever the order of magnitudes. Once the sum is inf or NaN it is returned as is.
struct compensated_sum {
  double sum = 0.0;
  double carry = 0.0;
  void add(double v) noexcept {
    const double t = sum + v;
    if (std::fabs(sum) >= std::fabs(v)) carry += (sum - t) + v;
    else carry += (v - t) + sum;
    sum = t;
  }
  double value() const noexcept { return std::isfinite(sum) ? sum + carry : sum; }
};

}  // namespace detail

// ---------------------------------------------------------------------------------------
//! lockstep::grad_ops<Mem> — the passes over gradients that loss scaling and clipping need,
//! for the memory space of a memory_ops type `Mem`. This is the extension point that lets the
//! scalers and clipping run where the gradients live: HostMemory's specialisation is below;
//! a device backend specialises it for its own memory_ops type (fused multi-tensor kernels)
//! and every scaler and clip function then works there, with no change of API.
//!
//! A specialisation provides (counts and layout come from the groups):
//!  1. `unscale_and_flag(mem, groups, inv_scale, void* flag)`: one pass, x ← x · T(inv_scale)
//!     (no write when inv_scale == 1), and if any result is inf or NaN, store the int32 1 at
//!     `flag` (in the memory space; never stores 0, the caller zeroes it first). flag may be
//!     null: then nothing is flagged (clip_grad_norm scales through it).
//!  2. `sum_of_squares(mem, groups)` → double: Σx² over every element, accumulated in double,
//!     in an order fixed by the layout (equal inputs give bit-equal results on every rank).
//!  3. `clamp(mem, groups, lo, hi)`: x ← min(max(x, lo), hi) elementwise; NaN stays NaN.
//! The primary template is empty: `has_grad_ops<Mem>` is false until one is provided.
template <class Mem>
struct grad_ops {};

template <class Mem>
concept has_grad_ops = requires(Mem& m, std::span<const grad_group> g, double d, void* flag) {
  grad_ops<Mem>::unscale_and_flag(m, g, d, flag);
  { grad_ops<Mem>::sum_of_squares(m, g) } -> std::convertible_to<double>;
  grad_ops<Mem>::clamp(m, g, d, d);
};

template <>
struct grad_ops<HostMemory> {
  static void unscale_and_flag(const HostMemory&, std::span<const grad_group> groups, double inv_scale, void* flag) {
    detail::require_floating(groups, "unscale_and_check");
    bool bad = false;
    detail::for_each_host_segment(groups, [&]<class T>(T* x, std::size_t n) {
      if constexpr (std::is_floating_point_v<T>) {
        unsigned any = 0;  // OR of per-element flags: branch-free, vectorisable
        if (inv_scale == 1.0) {
          for (std::size_t i = 0; i < n; ++i) any |= detail::nonfinite(x[i]) ? 1u : 0u;
        } else {
          // The same multiply memory_ops::scale does (factor rounded to T): a power-of-two
          // scale, as DynamicScale keeps, unscales exactly.
          const T f = static_cast<T>(inv_scale);
          for (std::size_t i = 0; i < n; ++i) {
            const T y = x[i] * f;
            x[i] = y;
            any |= detail::nonfinite(y) ? 1u : 0u;
          }
        }
        bad = bad || any != 0;
      }
    });
    // Checked after the multiply: catches inf/NaN in the input and overflow by unscaling.
    if (bad && flag != nullptr) *static_cast<std::int32_t*>(flag) = 1;
  }

  static double sum_of_squares(const HostMemory&, std::span<const grad_group> groups) {
    detail::require_floating(groups, "grad_norm");
    detail::compensated_sum total;
    detail::for_each_host_segment(groups, [&]<class T>(const T* x, std::size_t n) {
      if constexpr (std::is_floating_point_v<T>) {
        // Chunks of plain sums over 8 independent lanes (fast, error ~ chunk/8 ulps), then
        // the chunk sums compensated. A float squared is exact in double.
        constexpr std::size_t lanes = 8, chunk = 4096;
        for (std::size_t i = 0; i < n; i += chunk) {
          const std::size_t m = std::min(chunk, n - i);
          const T* p = x + i;
          double lane[lanes] = {};
          std::size_t j = 0;
          for (; j + lanes <= m; j += lanes)
            for (std::size_t k = 0; k < lanes; ++k) {
              const double v = static_cast<double>(p[j + k]);
              lane[k] += v * v;
            }
          double s = 0.0;
          for (; j < m; ++j) {
            const double v = static_cast<double>(p[j]);
            s += v * v;
          }
          for (std::size_t k = 0; k < lanes; ++k) s += lane[k];
          total.add(s);
        }
      }
    });
    return total.value();
  }

  static void clamp(const HostMemory&, std::span<const grad_group> groups, double lo, double hi) {
    detail::require_floating(groups, "clip_grad_value");
    detail::for_each_host_segment(groups, [&]<class T>(T* x, std::size_t n) {
      if constexpr (std::is_floating_point_v<T>) {
        const T l = bound<T>(lo), h = bound<T>(hi);
        // Written with comparisons that are false for NaN, so NaN passes through.
        for (std::size_t i = 0; i < n; ++i) {
          const T v = x[i];
          x[i] = v < l ? l : (h < v ? h : v);
        }
      }
    });
  }

 private:
  // A bound beyond T's range is no bound (converting it would be undefined).
  template <class T>
  static T bound(double b) {
    constexpr double big = static_cast<double>(std::numeric_limits<T>::max());
    if (b > big) return std::numeric_limits<T>::infinity();
    if (b < -big) return -std::numeric_limits<T>::infinity();
    return static_cast<T>(b);
  }
};
static_assert(has_grad_ops<HostMemory>);

}  // namespace lockstep
