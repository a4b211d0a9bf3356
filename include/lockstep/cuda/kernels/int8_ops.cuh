#pragma once
//! The kernels of Int8Wire (cuda/nccl_wire.cuh): fp32 values encoded as blockwise int8 chunks, the
//! mean of N ranks' chunks summed in fp32, and chunks decoded — the numbers of
//! core/detail/int8_blocks.hpp bit for bit (the layout and the rounding are said there; every
//! operation here is an explicitly rounded fp32 one, never contracted into a fused
//! multiply-add). One warp per block of 256 values, 8 values per lane in two groups of 4 (lane l
//! holds l·4… and 128 + l·4…), so that each of the warp's loads and stores covers one contiguous
//! range (16-byte fp32 accesses and 4-byte int8 ones where the pointers allow); grid-stride over
//! every chunk's blocks as one range, a warp's chunk and block carried from one block to its
//! next (a division only where it passes into another chunk, not one per block). Measured against
//! the device-copy bandwidth by bench_kernels' wire rows.
//! Every call queues work on stream `s` and checks the launch.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "lockstep/core/detail/int8_blocks.hpp"
#include "lockstep/cuda/error.cuh"

namespace lockstep::cuda::kernels {

namespace int8_detail {

constexpr int warps = 8;
constexpr int threads = 32 * warps;
constexpr unsigned full = 0xffffffffu;
static_assert(lockstep::detail::int8_block == 32 * 8, "a warp of 8 values per lane covers one block");

inline unsigned blocks_for(std::size_t quant_blocks) {
  const std::size_t b = (quant_blocks + warps - 1) / warps;
  return static_cast<unsigned>(std::clamp<std::size_t>(b, 1, 8192));
}

// Where lane `lane`'s values of block b of a chunk of n lie: its two groups of 4, each from
// at[h] on, valid[h] (0 to 4) of them inside the chunk. Value e of the lane is group e / 4's
// value e % 4.
struct lane_groups {
  std::size_t at[2];
  int valid[2];
};
__device__ inline lane_groups groups_of(std::size_t b, int lane, std::size_t n) {
  lane_groups g;
  for (int h = 0; h < 2; ++h) {
    g.at[h] = b * 256 + static_cast<std::size_t>(h) * 128 + static_cast<std::size_t>(lane) * 4;
    g.valid[h] = g.at[h] >= n ? 0 : static_cast<int>(n - g.at[h] < 4 ? n - g.at[h] : 4);
  }
  return g;
}

// The warp's block of values v (8 per lane; the lanes' values outside the chunk are zeros): its
// scale, into *scale_out by lane 0 and returned, and each value's int8 into q.
__device__ inline float encode_block(const float (&v)[8], float* scale_out, signed char (&q)[8]) {
  float m = 0.0f;
  bool finite = true;
  for (int e = 0; e < 8; ++e) {
    finite = finite && isfinite(v[e]);
    m = fmaxf(m, fabsf(v[e]));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(full, m, o));
  finite = __all_sync(full, finite);
  float s = __int_as_float(0x7fc00000);  // quiet NaN: a block that is not finite reads back as NaN
  if (finite) {
    s = __fdiv_rn(m, 127.0f);
    if (__fmul_rn(s, 127.0f) < m) s = nextafterf(s, INFINITY);
    if (isinf(__fmul_rn(s, 127.0f))) s = nextafterf(s, 0.0f);
  }
  if ((threadIdx.x & 31) == 0) *scale_out = s;
  const float inv = __frcp_rn(s);  // 1 / s rounded to nearest, as the host's
  float t[8];
  if (isinf(inv)) {  // a subnormal s: x / s (the same branch for the whole warp: one scale)
    for (int e = 0; e < 8; ++e) t[e] = __fdiv_rn(v[e], s);
  } else {
    for (int e = 0; e < 8; ++e) t[e] = __fmul_rn(v[e], inv);
  }
  for (int e = 0; e < 8; ++e)
    q[e] =
        s > 0.0f ? static_cast<signed char>(fminf(fmaxf(rintf(t[e]), -127.0f), 127.0f)) : static_cast<signed char>(0);
  return s;
}

// A lane's int8 values at `values` (a chunk's int8 part): 4-byte accesses for whole groups.
__device__ inline void store_q(signed char* values, const lane_groups& g, const signed char (&q)[8]) {
  for (int h = 0; h < 2; ++h) {
    signed char* at = values + g.at[h];
    if (g.valid[h] == 4) {
      unsigned w = 0;
      for (int j = 0; j < 4; ++j) w |= static_cast<unsigned>(static_cast<unsigned char>(q[4 * h + j])) << (8 * j);
      *reinterpret_cast<unsigned*>(at) = w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < g.valid[h]) at[j] = q[4 * h + j];
    }
  }
}
// A lane's int8 values at `values`, four to a word (group h in w[h], value j in its byte j; zeros
// outside the chunk): 4-byte loads for whole groups. q_value reads value e back.
__device__ inline void load_q(const signed char* values, const lane_groups& g, unsigned (&w)[2]) {
  for (int h = 0; h < 2; ++h) {
    const signed char* at = values + g.at[h];
    if (g.valid[h] == 4) {
      w[h] = *reinterpret_cast<const unsigned*>(at);
    } else {
      w[h] = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < g.valid[h]) w[h] |= static_cast<unsigned>(static_cast<unsigned char>(at[j])) << (8 * j);
    }
  }
}
__device__ inline float q_value(const unsigned (&w)[2], int e) {
  return static_cast<float>(static_cast<int>(w[e / 4] << (24 - 8 * (e % 4))) >> 24);  // the byte, sign-extended
}
// A lane's fp32 values of a chunk starting at p (zeros outside it): 16-byte loads when vec.
__device__ inline void load_f(const float* p, const lane_groups& g, float (&v)[8], bool vec) {
  for (int h = 0; h < 2; ++h) {
    if (vec && g.valid[h] == 4) {
      const float4 a = *reinterpret_cast<const float4*>(p + g.at[h]);
      v[4 * h] = a.x, v[4 * h + 1] = a.y, v[4 * h + 2] = a.z, v[4 * h + 3] = a.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[4 * h + j] = j < g.valid[h] ? p[g.at[h] + static_cast<std::size_t>(j)] : 0.0f;
    }
  }
}
__device__ inline void store_f(float* p, const lane_groups& g, const float (&v)[8], bool vec) {
  for (int h = 0; h < 2; ++h) {
    if (vec && g.valid[h] == 4) {
      *reinterpret_cast<float4*>(p + g.at[h]) = make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < g.valid[h]) p[g.at[h] + static_cast<std::size_t>(j)] = v[4 * h + j];
    }
  }
}
// The same into bf16, each value rounded to nearest even (__float2bfloat16_rn, as the host's
// bf16_of_float): 8-byte stores when vec.
__device__ inline void store_f(__nv_bfloat16* p, const lane_groups& g, const float (&v)[8], bool vec) {
  for (int h = 0; h < 2; ++h) {
    if (vec && g.valid[h] == 4) {
      uint2 w;
      auto* b = reinterpret_cast<__nv_bfloat162*>(&w);
      b[0] = __floats2bfloat162_rn(v[4 * h], v[4 * h + 1]);
      b[1] = __floats2bfloat162_rn(v[4 * h + 2], v[4 * h + 3]);
      *reinterpret_cast<uint2*>(p + g.at[h]) = w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (j < g.valid[h]) p[g.at[h] + static_cast<std::size_t>(j)] = __float2bfloat16_rn(v[4 * h + j]);
    }
  }
}

// fn(c, b) for this warp's blocks of `chunks` chunks of nb blocks each, taken as one range
// (block b of chunk c is c·nb + b), grid-stride: the same c and b on every lane.
template <class F>
__device__ inline void each_block(int chunks, std::size_t nb, F&& fn) {
  const std::size_t total = static_cast<std::size_t>(chunks) * nb, stride = static_cast<std::size_t>(gridDim.x) * warps;
  std::size_t w = static_cast<std::size_t>(blockIdx.x) * warps + threadIdx.x / 32;
  if (w >= total) return;
  std::size_t c = w / nb, b = w - c * nb;
  for (; w < total; w += stride) {
    fn(c, b);
    b += stride;
    if (b >= nb) {  // into a later chunk
      c += b / nb;
      b %= nb;
    }
  }
}

// Chunk c of `chunks` (each n values of x, one after another; minus base's, when base is not
// null; plus fb's, when fb is not null, fb then ← what the encoding rounded off, 0 where that
// is not finite: parallel/detail/wire_feedback.hpp) → out + c·chunk_bytes(n). Feedback: fb is
// used (a kernel of its own: the residual's registers would cost the plain encode a block per SM).
template <bool Feedback>
__global__ void encode(const float* __restrict__ x, const float* __restrict__ base, float* __restrict__ fb, int chunks,
                       std::size_t n, unsigned char* __restrict__ out, bool vec) {
  using namespace lockstep::detail;
  const std::size_t nb = int8_blocks_of(n), cb = int8_chunk_bytes(n), at = int8_values_at(n);
  const int lane = static_cast<int>(threadIdx.x & 31);
  each_block(chunks, nb, [&](std::size_t c, std::size_t b) {
    const lane_groups g = groups_of(b, lane, n);
    float v[8];
    load_f(x + c * n, g, v, vec);
    if (base) {
      float from[8];
      load_f(base + c * n, g, from, vec);
      for (int e = 0; e < 8; ++e) v[e] = __fsub_rn(v[e], from[e]);
    }
    float r[8];
    if constexpr (Feedback) {
      load_f(fb + c * n, g, r, vec);
      for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(v[e], r[e]);
    }
    signed char q[8];
    unsigned char* o = out + c * cb;
    const float s = encode_block(v, reinterpret_cast<float*>(o) + b, q);
    store_q(reinterpret_cast<signed char*>(o + at), g, q);
    if constexpr (Feedback) {
      for (int e = 0; e < 8; ++e) {
        const float d = __fsub_rn(v[e], __fmul_rn(static_cast<float>(q[e]), s));
        r[e] = isfinite(d) ? d : 0.0f;
      }
      store_f(fb + c * n, g, r, vec);
    }
  });
}

// out32 (n fp32, may be null) and out_enc (one encoded chunk, may be null) ← (Σ_k chunk k of
// `ranks` encoded chunks of n at in, decoded, in rank order) · inv. The ranks' chunks are read
// four at a time, their loads before their sums.
__global__ void mean(const unsigned char* __restrict__ in, int ranks, std::size_t n, float inv,
                     float* __restrict__ out32, unsigned char* __restrict__ out_enc, bool vec) {
  using namespace lockstep::detail;
  constexpr int together = 4;
  const std::size_t nb = int8_blocks_of(n), cb = int8_chunk_bytes(n), at = int8_values_at(n);
  const int lane = static_cast<int>(threadIdx.x & 31);
  each_block(1, nb, [&](std::size_t, std::size_t b) {
    const lane_groups g = groups_of(b, lane, n);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k0 = 0; k0 < ranks; k0 += together) {
      const int here = ranks - k0 < together ? ranks - k0 : together;
      float s[together];
      unsigned q[together][2];
#pragma unroll
      for (int j = 0; j < together; ++j) {
        if (j < here) {
          const unsigned char* chunk = in + static_cast<std::size_t>(k0 + j) * cb;
          s[j] = reinterpret_cast<const float*>(chunk)[b];
          load_q(reinterpret_cast<const signed char*>(chunk + at), g, q[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < together; ++j) {
        if (j < here) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(q_value(q[j], e), s[j]));
        }
      }
    }
    for (int e = 0; e < 8; ++e) acc[e] = __fmul_rn(acc[e], inv);
    if (out32) store_f(out32, g, acc, vec);
    if (out_enc) {
      signed char q[8];
      encode_block(acc, reinterpret_cast<float*>(out_enc) + b, q);
      store_q(reinterpret_cast<signed char*>(out_enc + at), g, q);
    }
  });
}

// Chunk c of `chunks` encoded chunks of n at in → out[c·n, (c + 1)·n), fp32 (added to what is
// there when add) or bf16 (Out = __nv_bfloat16: rounded; add is false).
template <class Out>
__global__ void decode(const unsigned char* __restrict__ in, int chunks, std::size_t n, Out* __restrict__ out, bool add,
                       bool vec) {
  using namespace lockstep::detail;
  const std::size_t nb = int8_blocks_of(n), cb = int8_chunk_bytes(n), at = int8_values_at(n);
  const int lane = static_cast<int>(threadIdx.x & 31);
  each_block(chunks, nb, [&](std::size_t c, std::size_t b) {
    const unsigned char* chunk = in + c * cb;
    Out* oc = out + c * n;
    const lane_groups g = groups_of(b, lane, n);
    const float s = reinterpret_cast<const float*>(chunk)[b];
    unsigned q[2];
    load_q(reinterpret_cast<const signed char*>(chunk + at), g, q);
    float v[8];
    for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(q_value(q, e), s);
    if constexpr (std::is_same_v<Out, float>) {
      if (add) {
        float o[8];
        load_f(oc, g, o, vec);
        for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(o[e], v[e]);
      }
    }
    store_f(oc, g, v, vec);
  });
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

}  // namespace int8_detail

//! dst ← `chunks` chunks of n values each at src (minus base's, elementwise, when base is not
//! null; plus fb's when fb is not null, fb then ← what the encoding rounded off: error feedback),
//! each encoded (int8_chunk_bytes(n) apart). dst must be 16-byte aligned.
inline void int8_encode(const float* src, int chunks, std::size_t n, void* dst, cudaStream_t s,
                        const float* base = nullptr, float* fb = nullptr) {
  if (n == 0 || chunks <= 0) return;
  const bool vec = n % 4 == 0 && int8_detail::aligned16(src) && (!base || int8_detail::aligned16(base)) &&
                   (!fb || int8_detail::aligned16(fb));
  const unsigned grid = int8_detail::blocks_for(static_cast<std::size_t>(chunks) * lockstep::detail::int8_blocks_of(n));
  auto* out = static_cast<unsigned char*>(dst);
  if (fb) int8_detail::encode<true><<<grid, int8_detail::threads, 0, s>>>(src, base, fb, chunks, n, out, vec);
  else int8_detail::encode<false><<<grid, int8_detail::threads, 0, s>>>(src, base, nullptr, chunks, n, out, vec);
  LOCKSTEP_CHECK_LAUNCH();
}

//! The fp32 mean of `ranks` encoded chunks of n values laid end to end at `chunks`, summed in
//! rank order and times 1/ranks: into out32 (may be null) and, encoded again, into out_enc
//! (may be null). chunks and out_enc 16-byte aligned.
inline void int8_mean(const void* chunks, int ranks, std::size_t n, float* out32, void* out_enc, cudaStream_t s) {
  if (n == 0) return;
  const bool vec = n % 4 == 0 && (!out32 || int8_detail::aligned16(out32));
  int8_detail::mean<<<int8_detail::blocks_for(lockstep::detail::int8_blocks_of(n)), int8_detail::threads, 0, s>>>(
      static_cast<const unsigned char*>(chunks), ranks, n, 1.0f / static_cast<float>(ranks), out32,
      static_cast<unsigned char*>(out_enc), vec);
  LOCKSTEP_CHECK_LAUNCH();
}

//! dst[c·n, (c + 1)·n) ← the values of encoded chunk c of `chunks` at src (16-byte aligned);
//! add: dst[i] + those values instead (one fp32 addition each).
inline void int8_decode(const void* src, int chunks, std::size_t n, float* dst, cudaStream_t s, bool add = false) {
  if (n == 0 || chunks <= 0) return;
  const bool vec = n % 4 == 0 && int8_detail::aligned16(dst);
  int8_detail::decode<<<int8_detail::blocks_for(static_cast<std::size_t>(chunks) * lockstep::detail::int8_blocks_of(n)),
                        int8_detail::threads, 0, s>>>(static_cast<const unsigned char*>(src), chunks, n, dst, add, vec);
  LOCKSTEP_CHECK_LAUNCH();
}

//! The same into bf16 (FullySharded's gather_wire with param_dtype = bf16): each decoded fp32
//! value rounded to the nearest bf16 (ties to even).
inline void int8_decode_bf16(const void* src, int chunks, std::size_t n, void* dst, cudaStream_t s) {
  if (n == 0 || chunks <= 0) return;
  const bool vec = n % 4 == 0 && int8_detail::aligned16(dst);
  int8_detail::decode<<<int8_detail::blocks_for(static_cast<std::size_t>(chunks) * lockstep::detail::int8_blocks_of(n)),
                        int8_detail::threads, 0, s>>>(static_cast<const unsigned char*>(src), chunks, n,
                                                      static_cast<__nv_bfloat16*>(dst), false, vec);
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace lockstep::cuda::kernels
