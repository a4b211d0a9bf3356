#pragma once
//! The kernels of lockstep::Deterministic on the GPU (cuda/deterministic_sum.cuh), on the
//! multi-tensor engine: one micro-step's gradients into int64 sums (fold), the sums back into
//! the mean (unfold), every rank's one contribution to a block summed and converted back in one
//! pass (fold_mean), the end of a step (the agreed largest exponents become the next
//! step's, the counts are kept, a non-finite step's gradients are made NaN), and the tail of a
//! cycle cut short dropped. The arithmetic is
//! core/detail/fixed_point.hpp's, the host's, so host and device give the same bits. A tensor of a
//! launch is one run of one parameter; its "step counter" is that parameter's exponent.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "lockstep/core/detail/fixed_point.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/engine.cuh"
#include "lockstep/cuda/kernels/reduce.cuh"

namespace lockstep::cuda::kernels {

namespace fixed_detail {
//! N elements of E as one aligned access (16-byte pieces at most: the engine hands a vector
//! body only where every list is aligned to its vector width).
template <class E, int N>
struct alignas(sizeof(E) * N >= 16 ? 16 : sizeof(E) * N) vec {
  E x[N];
};
template <class E, int N>
__device__ inline void load_vec(E (&out)[N], const E* p) {
  const auto* v = reinterpret_cast<const vec<E, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = v->x[k];
}
template <class E, int N>
__device__ inline void store_vec(E* p, const E (&in)[N]) {
  vec<E, N> v;
#pragma unroll
  for (int k = 0; k < N; ++k) v.x[k] = in[k];
  *reinterpret_cast<vec<E, N>*>(p) = v;
}

//! What a thread of a converting op saw: its run's exponent and slot, the largest exponent,
//! the counts.
struct fold_local {
  int e = 0, slot = 0;
  std::int64_t largest = lockstep::detail::fixed::no_exponent, clamped = 0, nonfinite = 0, under = 0;
};

//! x in fixed point with l's exponent and f fractional bits, noted in l.
__device__ inline std::int64_t fold_value(double x, int f, fold_local& l) {
  lockstep::detail::fixed::fold_flags fl;
  const std::int64_t q = lockstep::detail::fixed::to_fixed(x, l.e, f, fl);
  if (!fl.nonfinite && x != 0.0) {
    const std::int64_t e = lockstep::detail::fixed::exponent_of(x);
    l.largest = e > l.largest ? e : l.largest;
  }
  l.clamped += fl.clamped;
  l.nonfinite += fl.nonfinite;
  l.under += fl.underflow;
  return q;
}

//! a + b mod 2^64: exact whenever the total fits.
__device__ inline std::int64_t wrapping_add(std::int64_t a, std::int64_t b) {
  return static_cast<long long>(static_cast<unsigned long long>(a) + static_cast<unsigned long long>(b));
}

//! The run's exponent and slot (a stepped op's "step counter" is its run's exponent).
__device__ inline void fold_begin(fold_local& l, const std::int64_t* exps, const std::int64_t* step) {
  l.e = static_cast<int>(*step);
  l.slot = static_cast<int>(step - exps);
}

//! The block's largest exponent and counts into tail (by every thread).
__device__ inline void fold_end(const fold_local& l, std::int64_t* tail, std::size_t params) {
  const std::int64_t largest = warp_max(l.largest), c = warp_sum(l.clamped), n = warp_sum(l.nonfinite),
                     u = warp_sum(l.under);
  if ((threadIdx.x & 31u) != 0) return;
  if (largest != lockstep::detail::fixed::no_exponent)
    atomicMax(reinterpret_cast<long long*>(tail) + l.slot, static_cast<long long>(largest));
  auto* counts = reinterpret_cast<unsigned long long*>(tail + params);
  if (c) atomicAdd(counts, static_cast<unsigned long long>(c));
  if (n) atomicAdd(counts + 1, static_cast<unsigned long long>(n));
  if (u) atomicAdd(counts + 2, static_cast<unsigned long long>(u));
}
}  // namespace fixed_detail

//! sums ← q(src) (overwrite) or sums + q(src), wrapping; src zeroed with zero_source. Lists:
//! 0 = src (T), 1 = sums (int64). tail[slot] ← max(tail[slot], exponents seen); tail[params..+3)
//! += clamped, non-finite, underflowed counts.
template <class T>
struct fold_op : op_base<T> {
  static constexpr int lists = 2;
  static constexpr bool stepped = true;  // the "step counter" is the run's exponent
  __host__ __device__ static constexpr int elem_bytes(int list) { return list == 0 ? sizeof(T) : 8; }
  using local = fixed_detail::fold_local;
  template <int N>
  struct frag {
    T x[N];
  };
  const std::int64_t* exps;
  std::int64_t* tail;
  std::size_t params;
  int f;
  bool overwrite, zero_source;

  __device__ bool begin(local& l, const block_info& b) const {
    fixed_detail::fold_begin(l, exps, b.step);
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& fr, void* const* p, std::size_t i, local&) const {
    fixed_detail::load_vec(fr.x, static_cast<const T*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& fr, void* const* p, std::size_t i, local& l) const {
    auto* sums_at = static_cast<std::int64_t*>(p[1]) + i;
    std::int64_t sums[N];
    if (!overwrite) fixed_detail::load_vec(sums, sums_at);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t q = fixed_detail::fold_value(static_cast<double>(fr.x[k]), f, l);
      sums[k] = overwrite ? q : fixed_detail::wrapping_add(sums[k], q);
    }
    fixed_detail::store_vec(sums_at, sums);
    if (zero_source) {
      T zeros[N] = {};
      fixed_detail::store_vec(static_cast<T*>(p[0]) + i, zeros);
    }
  }
  __device__ void end(local& l, const block_info&) const { fixed_detail::fold_end(l, tail, params); }
};

//! dst ← the mean of the n contributions src[r·stride + i] (r = 0..n−1, one a rank, as an
//! all-to-all left them), each converted to fixed point, summed as integers and converted back
//! in one pass: what fold, the int64 sum over ranks and unfold give, without the int64 arrays.
//! Lists: 0 = src (T, contribution 0), 1 = dst (T; may be src itself when n = 1). The tail as
//! fold_op's (the values of this block from every rank).
template <class T>
struct fold_mean_op : op_base<T> {
  static constexpr int lists = 2;
  static constexpr bool stepped = true;
  using local = fixed_detail::fold_local;
  template <int N>
  struct frag {
    T x[N];
  };
  const std::int64_t* exps;
  std::int64_t* tail;
  std::size_t params;
  int f;
  std::int64_t m;  // micro-batches the mean is over
  int n;           // contributions
  std::size_t stride;
  bool aligned;  // stride keeps vector alignment (stride · sizeof(T) a multiple of 16)

  __device__ bool begin(local& l, const block_info& b) const {
    fixed_detail::fold_begin(l, exps, b.step);
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& fr, void* const* p, std::size_t i, local&) const {
    fixed_detail::load_vec(fr.x, static_cast<const T*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& fr, void* const* p, std::size_t i, local& l) const {
    std::int64_t q[N];
#pragma unroll
    for (int k = 0; k < N; ++k) q[k] = fixed_detail::fold_value(static_cast<double>(fr.x[k]), f, l);
    const T* src = static_cast<const T*>(p[0]) + i;
    for (int r = 1; r < n; ++r) {
      T x[N];
      if (aligned || N == 1) fixed_detail::load_vec(x, src + static_cast<std::size_t>(r) * stride);
      else
#pragma unroll
        for (int k = 0; k < N; ++k) x[k] = src[static_cast<std::size_t>(r) * stride + k];
#pragma unroll
      for (int k = 0; k < N; ++k)
        q[k] = fixed_detail::wrapping_add(q[k], fixed_detail::fold_value(static_cast<double>(x[k]), f, l));
    }
    T out[N];
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = static_cast<T>(lockstep::detail::fixed::from_fixed(q[k], l.e, f, m));
    fixed_detail::store_vec(static_cast<T*>(p[1]) + i, out);
  }
  __device__ void end(local& l, const block_info&) const { fixed_detail::fold_end(l, tail, params); }
};

//! dst ← the mean of m contributions whose sums are `sums`. Lists: 0 = sums, 1 = dst (T).
template <class T>
struct unfold_op : op_base<std::int64_t> {
  static constexpr int lists = 2;
  static constexpr bool stepped = true;
  __host__ __device__ static constexpr int elem_bytes(int list) { return list == 0 ? 8 : sizeof(T); }
  struct local {
    int e = 0;
  };
  template <int N>
  struct frag {
    std::int64_t x[N];
  };
  int f;
  std::int64_t m;
  __device__ bool begin(local& l, const block_info& b) const {
    l.e = static_cast<int>(*b.step);
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& fr, void* const* p, std::size_t i, local&) const {
    fixed_detail::load_vec(fr.x, static_cast<const std::int64_t*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& fr, void* const* p, std::size_t i, local& l) const {
    T out[N];
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = static_cast<T>(lockstep::detail::fixed::from_fixed(fr.x[k], l.e, f, m));
    fixed_detail::store_vec(static_cast<T*>(p[1]) + i, out);
  }
};

//! Where a non-finite step's NaN goes: the first element of each gradient group.
struct poison_targets {
  void* at[8] = {};
  bool is_double[8] = {};
  int n = 0;
};

namespace fixed_detail {
__global__ void end_step(std::int64_t* exps, std::int64_t* tail, std::int64_t* counts, std::size_t params, int margin,
                         poison_targets targets) {
  for (std::size_t p = threadIdx.x; p < params; p += blockDim.x) {
    exps[p] = lockstep::detail::fixed::next_exponent(tail[p], exps[p], margin);
    tail[p] = lockstep::detail::fixed::no_exponent;
  }
  if (threadIdx.x != 0) return;
  for (int k = 0; k < 3; ++k) {
    counts[k] = tail[params + k];
    counts[3 + k] += counts[k];
    tail[params + k] = 0;
  }
  if (counts[1] == 0) return;
  for (int g = 0; g < targets.n; ++g) {
    if (targets.is_double[g]) *static_cast<double*>(targets.at[g]) = __longlong_as_double(0x7ff8000000000000ll);
    else *static_cast<float*>(targets.at[g]) = __int_as_float(0x7fc00000);
  }
}

__global__ void reset_tail(std::int64_t* tail, std::size_t params) {
  for (std::size_t p = threadIdx.x; p < params + 3; p += blockDim.x)
    tail[p] = p < params ? lockstep::detail::fixed::no_exponent : 0;
}
}  // namespace fixed_detail

//! The tail as no fold left it (largest exponents none, counts 0), on stream s.
inline void fixed_point_reset_tail(std::int64_t* tail, std::size_t params, cudaStream_t s) {
  fixed_detail::reset_tail<<<1, 256, 0, s>>>(tail, params);
  LOCKSTEP_CHECK_LAUNCH();
}

//! The end of a step, on stream s (after tail was all-reduced with max).
inline void fixed_point_end_step(std::int64_t* exps, std::int64_t* tail, std::int64_t* counts, std::size_t params,
                                 int margin, const poison_targets& targets, cudaStream_t s) {
  fixed_detail::end_step<<<1, 256, 0, s>>>(exps, tail, counts, params, margin, targets);
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace lockstep::cuda::kernels
