#pragma once
//! 16-bit floats on the host: conversions of IEEE binary16 (f16) and bfloat16 (bf16) bit
//! patterns to and from float, rounding to nearest even (NaN stays NaN, overflow becomes
//! inf, f16 subnormals are kept). The host does no arithmetic in 16 bits: where it reduces or
//! scales halves (ThreadComm, HostMemory) it computes in float and rounds once.

#include <bit>
#include <cmath>
#include <cstdint>

#include "lockstep/core/dtype.hpp"

namespace lockstep::detail {

inline float float_of_bf16(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

inline std::uint16_t bf16_of_float(float f) noexcept {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);  // to nearest, ties to even (carries into the exponent)
  return static_cast<std::uint16_t>(x >> 16);
}

inline float float_of_f16(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m · 2^−24, exact in float
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));  // inf, NaN
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

inline std::uint16_t f16_of_float(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // ≥ 65520 (and inf): inf
  if (ax < 0x38800000u) {  // below 2^−14: a subnormal half; units of 2^−24, ties to even
    const float units = std::bit_cast<float>(ax) * 0x1p24f;  // exact
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(units)));
  }
  std::uint32_t r = ax - 0x38000000u;  // exponent bias 127 → 15
  r += 0x0fffu + ((r >> 13) & 1u);     // 23 → 10 mantissa bits, to nearest, ties to even
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

//! f(to_float, from_float) for a 16-bit float type t (f16 or bf16).
template <class F>
decltype(auto) with_half_codec(dtype t, F&& f) {
  if (t == dtype::bf16) return f(&float_of_bf16, &bf16_of_float);
  return f(&float_of_f16, &f16_of_float);
}

inline constexpr bool is_half(dtype t) noexcept { return t == dtype::f16 || t == dtype::bf16; }

}  // namespace lockstep::detail
