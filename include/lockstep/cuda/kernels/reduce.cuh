#pragma once
//! Warp and block reductions of the kernels, in a fixed order (the same bits on every run):
//! butterfly shuffles within a warp, then the warps' results in warp order by thread 0.

#include <cstdint>

namespace lockstep::cuda::kernels {

//! The sum of v over the 32 lanes of a full warp, in every lane.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

//! The largest v over the 32 lanes of a full warp, in every lane.
__device__ __forceinline__ std::int64_t warp_max(std::int64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const std::int64_t w = __shfl_xor_sync(0xffffffffu, static_cast<long long>(v), o);
    v = w > v ? w : v;
  }
  return v;
}

//! The sum of v over a block of BlockThreads threads (a multiple of 32), valid in thread 0;
//! called by every thread, at most once per kernel (its shared words are not fenced for reuse).
template <int BlockThreads>
__device__ double block_sum(double v) {
  static_assert(BlockThreads % 32 == 0 && BlockThreads <= 1024, "block_sum: whole warps only");
  constexpr int warps = BlockThreads / 32;
  __shared__ double per_warp[warps];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) per_warp[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < warps; ++w) total += per_warp[w];
  return total;
}

}  // namespace lockstep::cuda::kernels
