#pragma once
//! The kernels of the bf16 wire (cuda/nccl_wire.cuh): fp32 gradients rounded to bf16 for the
//! network, the mean of N ranks' bf16 blocks accumulated in fp32, and bf16 widened back. Each
//! is one streaming pass; 8 elements per thread and 16-byte accesses where the pointers allow
//! (buckets start 16-byte aligned; the widening reads 8 bytes so that its 16-byte stores are
//! each one contiguous range per warp), one element per thread otherwise. Every call queues work
//! on stream `s` and checks the launch. Measured by bench_kernels' wire rows.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "lockstep/cuda/error.cuh"

namespace lockstep::cuda::kernels {

namespace wire_detail {

constexpr int threads = 256;

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

inline unsigned blocks_for(std::size_t items) {
  const std::size_t b = (items + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::size_t>(b, 1, 8192));  // grid-stride beyond
}

__device__ inline uint4 pack8(const float (&v)[8]) {
  uint4 out;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&out);
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  return out;
}
__device__ inline void unpack8(const uint4& in, float (&v)[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&in);
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}

__device__ inline void load8(const __nv_bfloat16* p, std::size_t i, float (&v)[8]) {
  unpack8(reinterpret_cast<const uint4*>(p)[i], v);
}
__device__ inline void load8(const float* p, std::size_t i, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[2 * i], b = reinterpret_cast<const float4*>(p)[2 * i + 1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ inline void store8(float* p, std::size_t i, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[2 * i] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[2 * i + 1] = make_float4(v[4], v[5], v[6], v[7]);
}

// The value v goes to the wire with fb's residual (error feedback, parallel/detail/
// wire_feedback.hpp): v + r, and r ← what bf16 rounds off it (0 where that is not finite).
__device__ inline __nv_bfloat16 bf16_with_feedback(float v, float& r) {
  v = __fadd_rn(v, r);
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  const float d = __fsub_rn(v, __bfloat162float(b));
  r = isfinite(d) ? d : 0.0f;
  return b;
}

// dst[i] = bf16((src[i] − base[i]) · scale), base[i] read as 0 when base is null, fb[i]'s
// residual added when fb is not null (bf16_with_feedback); groups of 8 when vec, else one by one.
__global__ void to_bf16(const float* __restrict__ src, const float* __restrict__ base, float* __restrict__ fb,
                        __nv_bfloat16* __restrict__ dst, std::size_t n, float scale, bool vec) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < n / 8; i += stride) {
      float v[8];
      load8(src, i, v);
      if (base) {
        float b[8];
        load8(base, i, b);
        for (int e = 0; e < 8; ++e) v[e] = __fsub_rn(v[e], b[e]);
      }
      for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(v[e], scale);
      if (fb) {
        float r[8];
        load8(fb, i, r);
        uint4 out;
        auto* h = reinterpret_cast<__nv_bfloat16*>(&out);
        for (int e = 0; e < 8; ++e) h[e] = bf16_with_feedback(v[e], r[e]);
        reinterpret_cast<uint4*>(dst)[i] = out;
        store8(fb, i, r);
      } else {
        reinterpret_cast<uint4*>(dst)[i] = pack8(v);
      }
    }
    i = n / 8 * 8 + static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  }
  for (; i < n; i += stride) {
    const float v = __fmul_rn(base ? __fsub_rn(src[i], base[i]) : src[i], scale);
    dst[i] = fb ? bf16_with_feedback(v, fb[i]) : __float2bfloat16_rn(v);
  }
}

// dst[i] = float(src[i]), or dst[i] + float(src[i]) when add. When vec, groups of 4 (an 8-byte
// load, 16-byte stores: each of a warp's accesses one contiguous range), two groups a stride
// apart per thread and iteration, loaded before either is stored; else one by one.
__global__ void from_bf16(const __nv_bfloat16* __restrict__ src, float* __restrict__ dst, std::size_t n, bool add,
                          bool vec) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const std::size_t groups = n / 4;
    const auto load4 = [&](std::size_t k, float(&v)[4]) {
      const uint2 w = reinterpret_cast<const uint2*>(src)[k];
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
      v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
      if (add) {
        const float4 o = reinterpret_cast<const float4*>(dst)[k];
        v[0] = __fadd_rn(o.x, v[0]), v[1] = __fadd_rn(o.y, v[1]), v[2] = __fadd_rn(o.z, v[2]),
        v[3] = __fadd_rn(o.w, v[3]);
      }
    };
    for (; i < groups; i += 2 * stride) {
      float v[2][4];
      const bool second = i + stride < groups;
      load4(i, v[0]);
      if (second) load4(i + stride, v[1]);
      reinterpret_cast<float4*>(dst)[i] = make_float4(v[0][0], v[0][1], v[0][2], v[0][3]);
      if (second) reinterpret_cast<float4*>(dst)[i + stride] = make_float4(v[1][0], v[1][1], v[1][2], v[1][3]);
    }
    i = groups * 4 + static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  }
  for (; i < n; i += stride) dst[i] = add ? __fadd_rn(dst[i], __bfloat162float(src[i])) : __bfloat162float(src[i]);
}
__device__ inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float widen(float x) { return x; }

// m = (Σ_k blocks[k·per + i]) · scale in fp32, k = 0..ranks-1 in rank order (the same order on
// every rank); out32[i] = m (when not null), out16[i] = bf16(m) (when not null). In: bf16 or f32.
template <class In>
__global__ void mean_blocks(const In* __restrict__ blocks, int ranks, std::size_t per, float scale,
                            float* __restrict__ out32, __nv_bfloat16* __restrict__ out16, bool vec) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < per / 8; i += stride) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
      for (int k = 0; k < ranks; ++k) {
        load8(blocks + static_cast<std::size_t>(k) * per, i, v);
        for (int e = 0; e < 8; ++e) acc[e] += v[e];
      }
      for (int e = 0; e < 8; ++e) acc[e] *= scale;
      if (out32) store8(out32, i, acc);
      if (out16) reinterpret_cast<uint4*>(out16)[i] = pack8(acc);
    }
    i = per / 8 * 8 + static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  }
  for (; i < per; i += stride) {
    float acc = 0;
    for (int k = 0; k < ranks; ++k) acc += widen(blocks[static_cast<std::size_t>(k) * per + i]);
    acc *= scale;
    if (out32) out32[i] = acc;
    if (out16) out16[i] = __float2bfloat16_rn(acc);
  }
}

template <class In>
void launch_mean_blocks(const In* blocks, int ranks, std::size_t per, float scale, float* out32, void* out16,
                        cudaStream_t s) {
  if (per == 0) return;
  const bool vec = (per % 8 == 0) && aligned16(blocks) && (!out32 || aligned16(out32)) && (!out16 || aligned16(out16));
  mean_blocks<In><<<blocks_for(vec ? per / 8 : per), threads, 0, s>>>(blocks, ranks, per, scale, out32,
                                                                      static_cast<__nv_bfloat16*>(out16), vec);
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace wire_detail

//! dst[0..n) ← bf16(src · scale), round to nearest even; with base: bf16((src − base) · scale)
//! (each an fp32 operation rounded to nearest); with fb: fb's residual added first, and fb ←
//! what the rounding took off (error feedback).
inline void to_bf16(const float* src, void* dst, std::size_t n, float scale, cudaStream_t s,
                    const float* base = nullptr, float* fb = nullptr) {
  if (n == 0) return;
  const bool vec = wire_detail::aligned16(src) && wire_detail::aligned16(dst) &&
                   (!base || wire_detail::aligned16(base)) && (!fb || wire_detail::aligned16(fb));
  wire_detail::to_bf16<<<wire_detail::blocks_for(vec ? n / 8 : n), wire_detail::threads, 0, s>>>(
      src, base, fb, static_cast<__nv_bfloat16*>(dst), n, scale, vec);
  LOCKSTEP_CHECK_LAUNCH();
}

//! dst[0..n) ← float(src), exact; add: dst + float(src) (one fp32 addition each).
inline void from_bf16(const void* src, float* dst, std::size_t n, cudaStream_t s, bool add = false) {
  if (n == 0) return;
  const bool vec = wire_detail::aligned16(src) && wire_detail::aligned16(dst);
  wire_detail::from_bf16<<<wire_detail::blocks_for(vec ? n / 8 : n), wire_detail::threads, 0, s>>>(
      static_cast<const __nv_bfloat16*>(src), dst, n, add, vec);
  LOCKSTEP_CHECK_LAUNCH();
}

//! The fp32 mean of `ranks` bf16 blocks of `per` elements laid end to end at `blocks`, summed
//! in rank order: into out32 (fp32, may be null) and out16 (rounded to bf16, may be null).
inline void mean_blocks(const void* blocks, int ranks, std::size_t per, float* out32, void* out16, cudaStream_t s) {
  wire_detail::launch_mean_blocks(static_cast<const __nv_bfloat16*>(blocks), ranks, per,
                                  1.0f / static_cast<float>(ranks), out32, out16, s);
}

//! out[0..per) ← scale · Σ_k block k of `ranks` blocks of `per` elements at `blocks`, summed
//! in fp32 in rank order; blocks and out are both f32 or both bf16 (rounded once, at the end).
//! The local half of a reduce-scatter done as an all-to-all (NcclComm's copy-engine one).
inline void sum_blocks(const void* blocks, bool bf16, int ranks, std::size_t per, float scale, void* out,
                       cudaStream_t s) {
  if (bf16)
    wire_detail::launch_mean_blocks(static_cast<const __nv_bfloat16*>(blocks), ranks, per, scale, nullptr, out, s);
  else
    wire_detail::launch_mean_blocks(static_cast<const float*>(blocks), ranks, per, scale, static_cast<float*>(out),
                                    nullptr, s);
}

}  // namespace lockstep::cuda::kernels
