#pragma once
//! The kernels of Int8Wire (cuda/nccl_wire.cuh): fp32 values encoded as blockwise int8 chunks, the
//! mean of N ranks' chunks summed in fp32, and chunks decoded — the numbers of
//! core/detail/int8_blocks.hpp bit for bit (the layout and the rounding are said there; every
//! operation here is an explicitly rounded fp32 one, never contracted into a fused
//! multiply-add). One warp per block of 256 values, 8 values per thread, 16-byte loads of fp32
//! and 8-byte accesses of int8 where the pointers allow; grid-stride over the blocks. Every call
//! queues work on stream `s` and checks the launch.

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
static_assert(lockstep::detail::int8_block == 32 * 8, "a warp of 8 values per thread covers one block");

inline unsigned blocks_for(std::size_t quant_blocks) {
  const std::size_t b = (quant_blocks + warps - 1) / warps;
  return static_cast<unsigned>(std::clamp<std::size_t>(b, 1, 8192));
}

// The values of thread `lane` in block b of a chunk of n: how many (0 to 8) and where they start.
__device__ inline std::size_t first_of(std::size_t b, int lane) { return b * 256 + static_cast<std::size_t>(lane) * 8; }
__device__ inline int valid_of(std::size_t lo, std::size_t n) {
  return lo >= n ? 0 : static_cast<int>(n - lo < 8 ? n - lo : 8);
}

// The warp's block of values v (8 per lane, `valid` of them real): its scale, into *scale_out
// by lane 0, and each value's int8 into q.
__device__ inline void encode_block(const float (&v)[8], int valid, float* scale_out, signed char (&q)[8]) {
  float m = 0.0f;
  bool finite = true;
  for (int e = 0; e < valid; ++e) {
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
  const bool divide = isinf(inv);  // a subnormal s: x / s
  for (int e = 0; e < 8; ++e) {
    const float t = divide ? __fdiv_rn(v[e], s) : __fmul_rn(v[e], inv);
    q[e] = (e < valid && s > 0.0f) ? static_cast<signed char>(fminf(fmaxf(rintf(t), -127.0f), 127.0f))
                                   : static_cast<signed char>(0);
  }
}

__device__ inline void store_q(signed char* at, const signed char (&q)[8], int valid) {
  if (valid == 8) {
    uint2 w;
    auto* b = reinterpret_cast<signed char*>(&w);
    for (int e = 0; e < 8; ++e) b[e] = q[e];
    *reinterpret_cast<uint2*>(at) = w;
  } else {
    for (int e = 0; e < valid; ++e) at[e] = q[e];
  }
}
__device__ inline void load_q(const signed char* at, signed char (&q)[8], int valid) {
  if (valid == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(at);
    const auto* b = reinterpret_cast<const signed char*>(&w);
    for (int e = 0; e < 8; ++e) q[e] = b[e];
  } else {
    for (int e = 0; e < 8; ++e) q[e] = e < valid ? at[e] : static_cast<signed char>(0);
  }
}
__device__ inline void load_f(const float* at, float (&v)[8], int valid, bool vec) {
  if (vec && valid == 8) {
    const float4 a = reinterpret_cast<const float4*>(at)[0], b = reinterpret_cast<const float4*>(at)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    for (int e = 0; e < 8; ++e) v[e] = e < valid ? at[e] : 0.0f;
  }
}
__device__ inline void store_f(float* at, const float (&v)[8], int valid, bool vec) {
  if (vec && valid == 8) {
    reinterpret_cast<float4*>(at)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(at)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    for (int e = 0; e < valid; ++e) at[e] = v[e];
  }
}

// Chunk c of `chunks` (each n values of x, one after another; minus base's, when base is not
// null) → out + c·chunk_bytes(n).
__global__ void encode(const float* __restrict__ x, const float* __restrict__ base, int chunks, std::size_t n,
                       unsigned char* __restrict__ out, bool vec) {
  using namespace lockstep::detail;
  const std::size_t nb = int8_blocks_of(n), cb = int8_chunk_bytes(n), at = int8_values_at(n);
  const std::size_t total = static_cast<std::size_t>(chunks) * nb;
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (std::size_t w = static_cast<std::size_t>(blockIdx.x) * warps + threadIdx.x / 32; w < total;
       w += static_cast<std::size_t>(gridDim.x) * warps) {
    const std::size_t c = w / nb, b = w % nb, lo = first_of(b, lane);
    const int valid = valid_of(lo, n);
    float v[8];
    load_f(x + c * n + lo, v, valid, vec);
    if (base) {
      float from[8];
      load_f(base + c * n + lo, from, valid, vec);
      for (int e = 0; e < 8; ++e) v[e] = __fsub_rn(v[e], from[e]);
    }
    signed char q[8];
    unsigned char* o = out + c * cb;
    encode_block(v, valid, reinterpret_cast<float*>(o) + b, q);
    store_q(reinterpret_cast<signed char*>(o + at) + lo, q, valid);
  }
}

// out32 (n fp32, may be null) and out_enc (one encoded chunk, may be null) ← (Σ_k chunk k of
// `ranks` encoded chunks of n at in, decoded, in rank order) · inv.
__global__ void mean(const unsigned char* __restrict__ in, int ranks, std::size_t n, float inv,
                     float* __restrict__ out32, unsigned char* __restrict__ out_enc, bool vec) {
  using namespace lockstep::detail;
  const std::size_t nb = int8_blocks_of(n), cb = int8_chunk_bytes(n), at = int8_values_at(n);
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (std::size_t b = static_cast<std::size_t>(blockIdx.x) * warps + threadIdx.x / 32; b < nb;
       b += static_cast<std::size_t>(gridDim.x) * warps) {
    const std::size_t lo = first_of(b, lane);
    const int valid = valid_of(lo, n);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < ranks; ++k) {
      const unsigned char* chunk = in + static_cast<std::size_t>(k) * cb;
      const float s = reinterpret_cast<const float*>(chunk)[b];
      signed char q[8];
      load_q(reinterpret_cast<const signed char*>(chunk + at) + lo, q, valid);
      for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(static_cast<float>(q[e]), s));
    }
    for (int e = 0; e < 8; ++e) acc[e] = __fmul_rn(acc[e], inv);
    if (out32) store_f(out32 + lo, acc, valid, vec);
    if (out_enc) {
      signed char q[8];
      encode_block(acc, valid, reinterpret_cast<float*>(out_enc) + b, q);
      store_q(reinterpret_cast<signed char*>(out_enc + at) + lo, q, valid);
    }
  }
}

// Eight decoded values into bf16, each rounded to nearest even (__float2bfloat16_rn, as the
// host's bf16_of_float): one 16-byte store when vec.
__device__ inline void store_f(__nv_bfloat16* at, const float (&v)[8], int valid, bool vec) {
  if (vec && valid == 8) {
    alignas(16) __nv_bfloat16 b[8];
    for (int e = 0; e < 8; ++e) b[e] = __float2bfloat16_rn(v[e]);
    *reinterpret_cast<uint4*>(at) = *reinterpret_cast<const uint4*>(b);
  } else {
    for (int e = 0; e < valid; ++e) at[e] = __float2bfloat16_rn(v[e]);
  }
}

// Chunk c of `chunks` encoded chunks of n at in → out[c·n, (c + 1)·n), fp32 (added to what is
// there when add) or bf16 (Out = __nv_bfloat16: rounded; add is false).
template <class Out>
__global__ void decode(const unsigned char* __restrict__ in, int chunks, std::size_t n, Out* __restrict__ out, bool add,
                       bool vec) {
  using namespace lockstep::detail;
  const std::size_t nb = int8_blocks_of(n), cb = int8_chunk_bytes(n), at = int8_values_at(n);
  const std::size_t total = static_cast<std::size_t>(chunks) * nb;
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (std::size_t w = static_cast<std::size_t>(blockIdx.x) * warps + threadIdx.x / 32; w < total;
       w += static_cast<std::size_t>(gridDim.x) * warps) {
    const std::size_t c = w / nb, b = w % nb, lo = first_of(b, lane);
    const int valid = valid_of(lo, n);
    const unsigned char* chunk = in + c * cb;
    const float s = reinterpret_cast<const float*>(chunk)[b];
    signed char q[8];
    load_q(reinterpret_cast<const signed char*>(chunk + at) + lo, q, valid);
    float v[8];
    for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(static_cast<float>(q[e]), s);
    if constexpr (std::is_same_v<Out, float>) {
      if (add) {
        float o[8];
        load_f(out + c * n + lo, o, valid, vec);
        for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(o[e], v[e]);
      }
    }
    store_f(out + c * n + lo, v, valid, vec);
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

}  // namespace int8_detail

//! dst ← `chunks` chunks of n values each at src (minus base's, elementwise, when base is not
//! null), each encoded (int8_chunk_bytes(n) apart). dst must be 16-byte aligned.
inline void int8_encode(const float* src, int chunks, std::size_t n, void* dst, cudaStream_t s,
                        const float* base = nullptr) {
  if (n == 0 || chunks <= 0) return;
  const bool vec = n % 4 == 0 && int8_detail::aligned16(src) && (!base || int8_detail::aligned16(base));
  int8_detail::encode<<<int8_detail::blocks_for(static_cast<std::size_t>(chunks) * lockstep::detail::int8_blocks_of(n)),
                        int8_detail::threads, 0, s>>>(src, base, chunks, n, static_cast<unsigned char*>(dst), vec);
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
  const bool vec = n % 8 == 0 && int8_detail::aligned16(dst);
  int8_detail::decode<<<int8_detail::blocks_for(static_cast<std::size_t>(chunks) * lockstep::detail::int8_blocks_of(n)),
                        int8_detail::threads, 0, s>>>(static_cast<const unsigned char*>(src), chunks, n,
                                                      static_cast<__nv_bfloat16*>(dst), false, vec);
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace lockstep::cuda::kernels
