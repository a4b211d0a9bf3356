#pragma once
//! Blockwise 8-bit quantization on the host — the numbers of Int8Wire (parallel/gradient_wire.hpp) for
//! host communicators, and the reference its CUDA kernels (cuda/kernels/int8_ops.cuh) are
//! tested against bit for bit.
//!
//! n fp32 values are cut into blocks of int8_block (256) elements, the last one shorter. A
//! block's scale is s = max|x| / 127 (fp32, rounded to nearest, then one ulp up if 127·s falls
//! short of max|x| — subnormal blocks, whose scale rounds coarsely — and one ulp down if 127·s
//! overflows), each value is q = clamp(rint(x · (1/s)), −127, 127) (round to nearest even; x / s
//! where 1/s overflows), and it reads back as q · s: within s/2 of x (and an ulp). A block of
//! zeros reads back as zeros. A block holding an inf or a NaN gets s = NaN and reads back as NaN
//! throughout, so a found-inf check after the wire still sees it. Every operation is one IEEE
//! fp32 operation (no fused multiply-add), so the host and the GPU agree (device code compiled
//! without flush-to-zero, i.e. not with --use_fast_math).
//!
//! Encoded (one "chunk" of n values): the blocks' scales (fp32), padded to 16 bytes, then the
//! n int8 values, padded to 16 bytes — int8_chunk_bytes(n) bytes.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

namespace lockstep::detail {

inline constexpr std::size_t int8_block = 256;

constexpr std::size_t int8_blocks_of(std::size_t n) noexcept { return (n + int8_block - 1) / int8_block; }
constexpr std::size_t align16(std::size_t b) noexcept { return (b + 15) / 16 * 16; }
//! Where a chunk's int8 values start (its scales come first).
constexpr std::size_t int8_values_at(std::size_t n) noexcept { return align16(int8_blocks_of(n) * sizeof(float)); }
constexpr std::size_t int8_chunk_bytes(std::size_t n) noexcept { return int8_values_at(n) + align16(n); }

//! The scale of a block whose largest magnitude is m (NaN when the block is not finite).
inline float int8_scale_of(float m, bool finite) noexcept {
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  float s = m / 127.0f;
  if (s * 127.0f < m) s = std::nextafter(s, std::numeric_limits<float>::infinity());
  if (std::isinf(s * 127.0f)) s = std::nextafter(s, 0.0f);
  return s;
}
//! x in steps of s: x · (1 / s), or x / s where 1 / s overflows (a subnormal s).
inline std::int8_t int8_quantize(float x, float s) noexcept {
  if (!(s > 0.0f)) return 0;  // zeros, or NaN (the block reads back as NaN)
  const float inv = 1.0f / s;
  const float q = std::rint(std::isinf(inv) ? x / s : x * inv);
  return static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
}
inline float int8_value(std::int8_t q, float s) noexcept { return static_cast<float>(q) * s; }

//! out[0, int8_chunk_bytes(n)) ← x[0, n) encoded (padding zeroed).
inline void int8_encode(const float* x, std::size_t n, unsigned char* out) {
  std::memset(out, 0, int8_chunk_bytes(n));
  auto* q = reinterpret_cast<std::int8_t*>(out + int8_values_at(n));
  for (std::size_t b = 0; b < int8_blocks_of(n); ++b) {
    const std::size_t lo = b * int8_block, hi = std::min(n, lo + int8_block);
    float m = 0.0f;
    bool finite = true;
    for (std::size_t i = lo; i < hi; ++i) {
      finite = finite && std::isfinite(x[i]);
      m = std::max(m, std::fabs(x[i]));
    }
    const float s = int8_scale_of(m, finite);
    std::memcpy(out + b * sizeof(float), &s, sizeof s);
    for (std::size_t i = lo; i < hi; ++i) q[i] = int8_quantize(x[i], s);
  }
}

//! The scale of block b of an encoded chunk.
inline float int8_scale_at(const unsigned char* in, std::size_t b) noexcept {
  float s;
  std::memcpy(&s, in + b * sizeof(float), sizeof s);
  return s;
}

//! out[0, n) ← the values of an encoded chunk of n.
inline void int8_decode(const unsigned char* in, std::size_t n, float* out) {
  const auto* q = reinterpret_cast<const std::int8_t*>(in + int8_values_at(n));
  for (std::size_t i = 0; i < n; ++i) out[i] = int8_value(q[i], int8_scale_at(in, i / int8_block));
}

}  // namespace lockstep::detail
