#pragma once
//! lockstep::grad_ops<CudaMemory> — the gradient passes of loss scaling and clipping on device
//! memory (see grad_group.hpp), so NoScaling{check_finite}, StaticScale, DynamicScale,
//! grad_norm, clip_grad_norm and clip_grad_value work on GPU gradients with no change of API.
//! Include this header wherever a host-decided scaler or clipping meets an NcclComm.
//!
//! Semantics are the host specialisation's, for f32, f64, f16 and bf16 elements:
//!  1. unscale_and_flag: x ← x · T(inv_scale) (halves: the product in f32, rounded to the
//!     half type, as CudaMemory::scale does); no write when inv_scale == 1; the int32 1 is
//!     stored at the *device* pointer `flag` when any result is inf/NaN. Queued on mem's
//!     stream; nothing synchronises.
//!  2. sum_of_squares: Σx² in double, in an order fixed by the layout (per 16 Ki-element chunk,
//!     then the chunk sums in order): equal inputs give bit-equal sums on every rank. Returns a
//!     host value, so it waits for mem's stream.
//!  3. clamp: x ← min(max(x, lo), hi); NaN stays NaN (bit for bit); a bound beyond T's range is
//!     no bound; halves round the bounds through f32. Queued, no synchronisation.
//!
//! The device-side launchers (lockstep::cuda::kernels::unscale_flag / sum_of_squares / clamp)
//! are public too: unscale_flag also takes its factor from device memory, which is how
//! DeviceDynamicScale unscales without the host knowing the scale.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cub/block/block_reduce.cuh>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "lockstep/concepts.hpp"
#include "lockstep/cuda/cuda_memory.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/multi_tensor.cuh"
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"
#include "lockstep/grad_group.hpp"

namespace lockstep::cuda::kernels {

namespace detail {

//! x ← x · f in place, f = *d_inv when d_inv is set (read once per block), else `inv`;
//! *flag ← 1 when a result is inf/NaN (the result, not the input: overflow by unscaling with
//! a scale < 1 counts too, as on the host). No write at all when f == 1.
template <class T>
struct unscale_flag_op {
  using E = elem<T>;
  using B = typename E::bits;
  using A = typename E::acc;
  static constexpr int lists = 1, width = 16 / int(sizeof(B)), unroll = sizeof(B) == 2 ? 2 : 4,
                       min_blocks = 2;
  __host__ __device__ static constexpr int elem_bytes(int) { return sizeof(B); }
  static constexpr bool list_required(int) { return true; }
  struct local {
    A f;
    bool write;
    bool bad;
  };
  template <int N>
  using frag = pack_of<B, N>;
  double inv;
  const double* d_inv;  // may be null
  int* flag;

  __device__ bool begin(local& st) const {
    const double v = d_inv != nullptr ? *d_inv : inv;
    st.f = static_cast<A>(v);  // rounded to the compute type, as the host rounds to T
    st.write = v != 1.0;
    st.bad = false;
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_pack<N, B>(p[0], i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local& st) const {
    bool bad = false;
    if (st.write) {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        f.v[j] = E::from_acc(E::to_acc(f.v[j]) * st.f);
        bad |= !E::finite(f.v[j]);
      }
      store_pack<N, B>(p[0], i, f);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) bad |= !E::finite(f.v[j]);
    }
    st.bad |= bad;
  }
  __device__ void end(local& st) const {
    if (__syncthreads_or(st.bad) && threadIdx.x == 0) *flag = 1;  // never stores 0
  }
};

//! partials[blockIdx.x] ← Σx² (double) of this block's chunk. Launched so that block b is
//! global chunk b of the batch (see sum_of_squares): a fixed order, no atomics.
template <class T>
struct sumsq_op {
  using E = elem<T>;
  using B = typename E::bits;
  using A = typename E::acc;
  static constexpr int lists = 1, width = 16 / int(sizeof(B)), unroll = sizeof(B) == 2 ? 2 : 4,
                       min_blocks = 2;
  __host__ __device__ static constexpr int elem_bytes(int) { return sizeof(B); }
  static constexpr bool list_required(int) { return true; }
  struct local {
    double ss;
  };
  template <int N>
  using frag = pack_of<B, N>;
  double* partials;

  __device__ bool begin(local& st) const {
    st.ss = 0.0;
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_pack<N, B>(p[0], i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const*, std::size_t, local& st) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const double v = static_cast<double>(E::to_acc(f.v[j]));  // a float squared is exact in double
      st.ss += v * v;
    }
  }
  __device__ void end(local& st) const {
    using reduce_t = cub::BlockReduce<double, block_threads>;
    __shared__ typename reduce_t::TempStorage temp;
    const double total = reduce_t(temp).Sum(st.ss);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
  }
};

template <int = 0>
__global__ void __launch_bounds__(block_threads)
    sum_partials_kernel(const double* partials, std::size_t n, double* out) {
  double s = 0.0;
  for (std::size_t i = threadIdx.x; i < n; i += block_threads) s += partials[i];
  using reduce_t = cub::BlockReduce<double, block_threads>;
  __shared__ typename reduce_t::TempStorage temp;
  const double total = reduce_t(temp).Sum(s);
  if (threadIdx.x == 0) *out = total;
}

//! x ← lo if x < lo, hi if hi < x, else x unchanged (bits included: NaN passes through).
//! lo and hi are exactly representable in T.
template <class T>
struct clamp_op {
  using E = elem<T>;
  using B = typename E::bits;
  using A = typename E::acc;
  static constexpr int lists = 1, width = 16 / int(sizeof(B)), unroll = sizeof(B) == 2 ? 2 : 4,
                       min_blocks = 2;
  __host__ __device__ static constexpr int elem_bytes(int) { return sizeof(B); }
  static constexpr bool list_required(int) { return true; }
  using local = no_local;
  template <int N>
  using frag = pack_of<B, N>;
  A lo, hi;
  B lo_bits, hi_bits;

  __device__ bool begin(local&) const { return true; }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_pack<N, B>(p[0], i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local&) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A v = E::to_acc(f.v[j]);
      f.v[j] = v < lo ? lo_bits : (hi < v ? hi_bits : f.v[j]);
    }
    store_pack<N, B>(p[0], i, f);
  }
  __device__ void end(local&) const {}
};

//! A clamp bound as T (through f32 for halves): beyond T's largest finite value it is ±inf.
template <class T>
typename elem<T>::bits clamp_bound(double b) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    constexpr double big = static_cast<double>(std::numeric_limits<T>::max());
    if (b > big) return std::numeric_limits<T>::infinity();
    if (b < -big) return -std::numeric_limits<T>::infinity();
    return static_cast<T>(b);
  } else if constexpr (std::is_same_v<T, __half>) {
    constexpr double big = 65504.0;
    if (b > big) return 0x7c00u;
    if (b < -big) return 0xfc00u;
    return __half_as_ushort(__float2half_rn(static_cast<float>(b)));
  } else {
    constexpr double big = 3.3895313892515355e38;  // bf16's largest finite value
    if (b > big) return 0x7f80u;
    if (b < -big) return 0xff80u;
    return __bfloat16_as_ushort(__float2bfloat16_rn(static_cast<float>(b)));
  }
}

template <class T>
typename elem<T>::acc bound_value(typename elem<T>::bits b) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(__ushort_as_half(b));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(__ushort_as_bfloat16(b));
  else return b;
}

//! cudaMallocAsync'd scratch, freed on the same stream when it goes out of scope.
struct stream_scratch {
  void* p = nullptr;
  cudaStream_t s = nullptr;
  stream_scratch(std::size_t bytes, cudaStream_t stream) : s(stream) {
    LOCKSTEP_TRY_CUDA(cudaMallocAsync(&p, bytes ? bytes : 1, s));
  }
  ~stream_scratch() {
    if (p != nullptr) (void)cudaFreeAsync(p, s);
  }
  stream_scratch(const stream_scratch&) = delete;
  stream_scratch& operator=(const stream_scratch&) = delete;
};

}  // namespace detail

//! In place x ← x · f over `segs` (element type t), f = *d_inv_scale if it is not null (device
//! memory, read on the device) else inv_scale; sets *d_flag = 1 (device int32) when any result
//! is inf/NaN, never resets it. Queued on s.
inline void unscale_flag(std::span<const segment> segs, dtype t, double inv_scale,
                         const double* d_inv_scale, int* d_flag, cudaStream_t s) {
  detail::check_segments(segs, "unscale_flag");
  if (d_flag == nullptr) throw config_error("unscale_flag: d_flag must point to device memory");
  detail::visit_float(t, "unscale_flag", [&]<class T>(std::type_identity<T>) {
    detail::launch_multi_tensor(detail::unscale_flag_op<T>{inv_scale, d_inv_scale, d_flag},
                                segs.size(),
                                [&](std::size_t i) {
                                  return detail::tensor_ref<1>{{segs[i].ptr}, segs[i].count};
                                },
                                s, "unscale_flag");
  });
}

//! x ← clamp(x, lo, hi) over `segs`; NaN passes through. Queued on s.
inline void clamp(std::span<const segment> segs, dtype t, double lo, double hi, cudaStream_t s) {
  detail::check_segments(segs, "clamp");
  detail::visit_float(t, "clamp", [&]<class T>(std::type_identity<T>) {
    using op_t = detail::clamp_op<T>;
    const auto lb = detail::clamp_bound<T>(lo), hb = detail::clamp_bound<T>(hi);
    const op_t op{detail::bound_value<T>(lb), detail::bound_value<T>(hb), lb, hb};
    detail::launch_multi_tensor(op, segs.size(),
                                [&](std::size_t i) {
                                  return detail::tensor_ref<1>{{segs[i].ptr}, segs[i].count};
                                },
                                s, "clamp");
  });
}

//! Σx² (double) over every element of every group, in a fixed order; waits for stream s and
//! returns the host value. Scratch comes from cudaMallocAsync on s.
inline double sum_of_squares(std::span<const grad_group> groups, cudaStream_t s) {
  // Batches of tensors that make exactly one launch each (at most a launch table's worth and
  // fewer blocks than the grid limit; launch_multi_tensor splits only beyond those), so that
  // block b of a launch is chunk b of its batch and writes partials[batch_base + b].
  std::size_t total_chunks = 0;
  for (const auto& g : groups) {
    detail::check_segments(g.segments, "sum_of_squares");
    for (const auto& seg : g.segments)
      total_chunks += (seg.count + detail::chunk_elems - 1) / detail::chunk_elems;
  }
  if (total_chunks == 0) return 0.0;
  detail::stream_scratch buf((total_chunks + 1) * sizeof(double), s);
  auto* partials = static_cast<double*>(buf.p);
  std::size_t base = 0;
  for (const auto& g : groups) {
    detail::visit_float(g.type, "sum_of_squares", [&]<class T>(std::type_identity<T>) {
      using op_t = detail::sumsq_op<T>;
      constexpr std::size_t cap = detail::table_capacity<1, sizeof(op_t)>;
      const auto segs = g.segments;
      std::size_t i = 0;
      while (i < segs.size()) {
        std::size_t first = i, tensors = 0, blocks = 0;
        while (i < segs.size()) {
          const std::size_t c = (segs[i].count + detail::chunk_elems - 1) / detail::chunk_elems;
          if (c != 0 && (tensors == cap || blocks + c > detail::max_blocks)) break;
          if (c != 0) ++tensors;
          blocks += c;
          ++i;
        }
        if (tensors == 0 && i < segs.size()) {
          // One segment alone exceeds a launch; launch_multi_tensor reports it.
          tensors = 1;
          ++i;
        }
        detail::launch_multi_tensor(op_t{partials + base}, i - first,
                                    [&](std::size_t k) {
                                      return detail::tensor_ref<1>{{segs[first + k].ptr},
                                                                   segs[first + k].count};
                                    },
                                    s, "sum_of_squares");
        base += blocks;
      }
    });
  }
  detail::sum_partials_kernel<<<1, detail::block_threads, 0, s>>>(partials, total_chunks,
                                                                  partials + total_chunks);
  LOCKSTEP_CHECK_LAUNCH();
  double out = 0.0;
  LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(&out, partials + total_chunks, sizeof out,
                                    cudaMemcpyDeviceToHost, s));
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  return out;
}

}  // namespace lockstep::cuda::kernels

namespace lockstep {

template <>
struct grad_ops<CudaMemory> {
  //! `flag` is device memory on mem's device (the caller zeroes it). Queued on mem's stream.
  static void unscale_and_flag(const CudaMemory& mem, std::span<const grad_group> groups,
                               double inv_scale, void* flag) {
    detail::require_floating(groups, "unscale_and_check");
    detail::device_guard g(mem.device());
    for (const auto& grp : groups)
      cuda::kernels::unscale_flag(grp.segments, grp.type, inv_scale, nullptr,
                                  static_cast<int*>(flag), mem.stream());
  }

  //! Waits for mem's stream (returns a host value).
  static double sum_of_squares(const CudaMemory& mem, std::span<const grad_group> groups) {
    detail::require_floating(groups, "grad_norm");
    detail::device_guard g(mem.device());
    return cuda::kernels::sum_of_squares(groups, mem.stream());
  }

  static void clamp(const CudaMemory& mem, std::span<const grad_group> groups, double lo, double hi) {
    detail::require_floating(groups, "clip_grad_value");
    detail::device_guard g(mem.device());
    for (const auto& grp : groups) cuda::kernels::clamp(grp.segments, grp.type, lo, hi, mem.stream());
  }
};
static_assert(has_grad_ops<CudaMemory>);

}  // namespace lockstep
