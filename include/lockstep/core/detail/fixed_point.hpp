#pragma once
//! The arithmetic of lockstep::Deterministic (parallel/deterministic.hpp), shared by host and
//! device code so that both produce the same bits: a gradient value x of parameter p becomes the
//! integer q = round(x · 2^(F − E_p)) (round to nearest, ties to even), where E_p is the step's
//! exponent of p (values must satisfy |x| < 2^E_p) and F = 62 − H leaves H bits of headroom for
//! summing M ≤ 2^H such integers in an int64. Integer sums are associative, so the total — and
//! the mean converted back, ldexp(double(Σq), E_p − F) / M rounded once to the gradient's type —
//! does not depend on how the M contributions were split over ranks, micro-steps or buckets.
//! E_p for the next step is the largest exponent seen this step plus a margin: an order-free max.

#include <cmath>
#include <cstdint>

#include "lockstep/core/detail/host_device.hpp"

namespace lockstep::detail::fixed {

//! A parameter that saw only zeros this step (its exponent stays).
inline constexpr std::int64_t no_exponent = -100000;
//! Exponents are kept within these bounds (far beyond float's range; doubles scale exactly).
inline constexpr int min_exponent = -300, max_exponent = 300;
//! The most contributions (micro-batches) one sum may have: 2^max_headroom.
inline constexpr int max_headroom = 30;

//! F for M contributions: 62 − ceil(log2 M) (0 bits for one).
LOCKSTEP_HOST_DEVICE constexpr int frac_bits(std::int64_t contributions) {
  int h = 0;
  while ((std::int64_t{1} << h) < contributions) ++h;
  return 62 - h;
}

LOCKSTEP_HOST_DEVICE inline double scaled(double x, int e) {
#if defined(__CUDA_ARCH__)
  return ::ldexp(x, e);
#else
  return std::ldexp(x, e);
#endif
}

#if defined(__CUDA_ARCH__)
//! 2^k for a normal double (−1022 ≤ k ≤ 1023), from its bits. On the device x · pow2(k) takes
//! ldexp's place where 2^k is normal: both are x · 2^k rounded once (exact unless subnormal),
//! so they have the same bits, and a multiplication costs far less than ldexp's general case.
__device__ inline double pow2(int k) { return __longlong_as_double(static_cast<long long>(k + 1023) << 52); }
#endif

//! The e with 2^(e−1) ≤ |x| < 2^e, for finite x ≠ 0.
LOCKSTEP_HOST_DEVICE inline int exponent_of(double x) {
  int e = 0;
#if defined(__CUDA_ARCH__)
  const int biased = static_cast<int>((__double_as_longlong(x) >> 52) & 0x7ff);
  if (biased != 0) return biased - 1022;  // normal: x = 1.m · 2^(biased − 1023) = 0.1m · 2^(biased − 1022)
  (void)::frexp(x, &e);
#else
  (void)std::frexp(x, &e);
#endif
  return e;
}

//! What converting one value found.
struct fold_flags {
  bool clamped = false;    //!< |x| ≥ 2^E: stored as ±2^F (the largest value of the range)
  bool nonfinite = false;  //!< inf or NaN: stored as 0 (the step is marked non-finite)
  bool underflow = false;  //!< x ≠ 0 rounded to 0
};

//! q for x with exponent e (|x| < 2^e) and F fractional bits of the range.
LOCKSTEP_HOST_DEVICE inline std::int64_t to_fixed(double x, int e, int f, fold_flags& flags) {
  if (!(x - x == 0.0)) {  // inf − inf and NaN − NaN are NaN
    flags.nonfinite = true;
    return 0;
  }
  const double a = x < 0 ? -x : x;
#if defined(__CUDA_ARCH__)
  if (a >= pow2(e)) {  // (e within ±300, f − e within [−268, 362]: both powers normal)
#else
  if (a >= scaled(1.0, e)) {
#endif
    flags.clamped = true;
    return x < 0 ? -(std::int64_t{1} << f) : (std::int64_t{1} << f);
  }
#if defined(__CUDA_ARCH__)
  const double v = x * pow2(f - e);
  const std::int64_t q = __double2ll_rn(v);
#else
  const double v = scaled(x, f - e);      // exact: a power-of-two scale of a float or double
  const std::int64_t q = std::llrint(v);  // the default rounding mode: nearest, ties to even
#endif
  if (q == 0 && x != 0.0) flags.underflow = true;
  return q;
}

//! The mean of M contributions whose fixed-point sum is s (exponent e, F fractional bits).
LOCKSTEP_HOST_DEVICE inline double from_fixed(std::int64_t s, int e, int f, std::int64_t contributions) {
#if defined(__CUDA_ARCH__)
  const double t = __ll2double_rn(s) * pow2(e - f);  // exact: |s| < 2^63, e − f ≥ −362
  // A power of two's reciprocal is exact, and t / 2^h and t · 2^−h are one value rounded once.
  if ((contributions & (contributions - 1)) == 0) return t * pow2(1 - __ffsll(contributions));
  return t / static_cast<double>(contributions);
#else
  const double d = static_cast<double>(s);
  return scaled(d, e - f) / static_cast<double>(contributions);
#endif
}

//! The next step's exponent from this step's largest (over ranks and micro-steps).
LOCKSTEP_HOST_DEVICE inline std::int64_t next_exponent(std::int64_t largest, std::int64_t previous, int margin) {
  if (largest == no_exponent) return previous;
  const std::int64_t e = largest + margin;
  return e < min_exponent ? min_exponent : (e > max_exponent ? max_exponent : e);
}

}  // namespace lockstep::detail::fixed
