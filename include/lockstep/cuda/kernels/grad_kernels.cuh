#pragma once
//! The kernels behind grad_ops<CudaMemory> (loss scaling and clipping on device gradients),
//! on the multi-tensor engine:
//!  - unscale: one pass, in place: x ← x · f (no write when f == 1), f read on the host or
//!    from device memory; a flag raised when a result is inf/NaN; optionally Σx² of the
//!    results per chunk. The same kernel is the unscale + inf check of every loss scaler
//!    (DeviceDynamicScale reads f on the device), the read-only check of NoScaling, and the
//!    sum of squares of grad_norm / clip_grad_norm.
//!  - sum_of_squares: Σx² in double over groups, in an order fixed by the layout (per chunk,
//!    then the chunk sums in order): equal inputs give bit-equal sums on every rank.
//!  - clamp: x ← min(max(x, lo), hi), NaN passing through (clip_grad_value).
//! Element types f32, f64, f16, bf16; arithmetic in f32 (f64 for f64).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/access.cuh"
#include "lockstep/cuda/kernels/engine.cuh"
#include "lockstep/cuda/kernels/reduce.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::cuda::kernels {

//! In place x ← x · f, f = *d_factor when d_factor is set (read once per block), else
//! `factor`, rounded to the compute type (as the host rounds it to T). With flag: stores the
//! int32 1 there when a result is inf/NaN (the result, not the input: overflow by unscaling
//! with a scale < 1 counts, as on the host; never stores 0). With partials:
//! partials[chunk] = Σ (double) x² of the results of the block's chunk, in an order fixed by
//! the layout. No write when f == 1. Partials = true is the instance that sums.
template <class Element, bool Partials = false>
struct unscale_op : op_base<storage_of<Element>> {
  using compute_t = compute_of<Element>;
  using storage_t = storage_of<Element>;
  struct local {
    compute_t f;
    bool write;
    unsigned bad;  // nonzero once an inf/NaN was seen
    double ss;
  };
  template <int N>
  using frag = vfrag<Element, N>;
  double factor;
  const double* d_factor;  // may be null
  int* flag;               // may be null
  double* partials;        // Partials: where the chunk sums go

  __device__ bool begin(local& st, const block_info&) const {
    const double v = d_factor != nullptr ? *d_factor : factor;
    st.f = static_cast<compute_t>(v);
    st.write = v != 1.0;
    st.bad = 0;
    st.ss = 0.0;
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_as<frag<N>>(static_cast<const storage_t*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local& st) const {
    if (st.write) map_elems<Element, N>(f, [&](compute_t x) { return x * st.f; });
    if (flag != nullptr) st.bad |= nonfinite<Element, N>(f);
    if constexpr (Partials) st.ss += squares<N>(f);
    if (st.write) store_as(static_cast<storage_t*>(p[0]) + i, f);
  }
  //! Σx² (double) of a fragment, each square exact in double and the N of them summed as a
  //! tree: a serial chain of one add per element would hold the block's tail for N dependent
  //! double adds.
  template <int N>
  __device__ static double squares(const frag<N>& f) {
    double sq[N];
    int j = 0;
    visit_elems<Element, N>(f, [&](compute_t y) {
      const double v = static_cast<double>(y);
      sq[j++] = v * v;
    });
#pragma unroll
    for (int w = 1; w < N; w *= 2)
#pragma unroll
      for (int k = 0; k + w < N; k += 2 * w) sq[k] += sq[k + w];
    return sq[0];
  }
  __device__ void end(local& st, const block_info& info) const {
    // The flag needs no block barrier: a warp that saw inf/NaN stores the 1 itself (rare, so
    // the atomic costs nothing in the common case; atomic only so that concurrent stores of
    // the same value are well defined).
    if (flag != nullptr && __any_sync(0xffffffffu, st.bad != 0) && (threadIdx.x & 31) == 0) atomicExch(flag, 1);
    if constexpr (Partials) {
      const double total = block_sum<tuning_of<unscale_op>.block_threads>(st.ss);
      if (threadIdx.x == 0) partials[info.chunk] = total;
    }
  }
};

//! x ← lo if x < lo, hi if hi < x, else x unchanged (bits included: NaN passes through).
//! lo and hi are exactly representable in Element.
template <class Element>
struct clamp_op : op_base<storage_of<Element>> {
  using compute_t = compute_of<Element>;
  using storage_t = storage_of<Element>;
  using local = typename op_base<storage_t>::local;
  template <int N>
  using frag = pack_of<storage_t, N>;
  compute_t lo, hi;
  storage_t lo_bits, hi_bits;

  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_pack<N, storage_t>(p[0], i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local&) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const compute_t v = element_traits<Element>::to_compute(f.v[j]);
      f.v[j] = v < lo ? lo_bits : (hi < v ? hi_bits : f.v[j]);
    }
    store_pack<N, storage_t>(p[0], i, f);
  }
};

namespace detail {

template <int BlockThreads>
__global__ void __launch_bounds__(BlockThreads)
    sum_partials_kernel(const double* partials, std::size_t n, double* out) {
  double s = 0.0;
  for (std::size_t i = threadIdx.x; i < n; i += BlockThreads) s += partials[i];
  const double total = block_sum<BlockThreads>(s);
  if (threadIdx.x == 0) *out = total;
}

//! A clamp bound as Element's storage (through f32 for halves): beyond Element's largest
//! finite value it is ±inf.
template <class Element>
storage_of<Element> clamp_bound(double b) {
  if constexpr (std::is_same_v<Element, float> || std::is_same_v<Element, double>) {
    constexpr double big = static_cast<double>(std::numeric_limits<Element>::max());
    if (b > big) return std::numeric_limits<Element>::infinity();
    if (b < -big) return -std::numeric_limits<Element>::infinity();
    return static_cast<Element>(b);
  } else if constexpr (std::is_same_v<Element, __half>) {
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

template <class Element>
compute_of<Element> bound_value(storage_of<Element> b) {
  if constexpr (std::is_same_v<Element, __half>) return __half2float(__ushort_as_half(b));
  else if constexpr (std::is_same_v<Element, __nv_bfloat16>) return __bfloat162float(__ushort_as_bfloat16(b));
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

//! A device buffer of at least `bytes` on `device`, owned by the calling host thread and kept
//! between calls, for passes that wait for their stream before returning (so the buffer is
//! idle between uses). Grows when asked for more; freed when the thread ends.
inline void* thread_scratch(int device, std::size_t bytes) {
  struct buffer {
    int device = -1;
    void* p = nullptr;
    std::size_t bytes = 0;
    ~buffer() {
      if (p == nullptr) return;
      lockstep::detail::device_guard g(device, std::nothrow);
      (void)cudaFree(p);  // may fail harmlessly at process exit, once the runtime unloads
    }
  };
  thread_local std::vector<std::unique_ptr<buffer>> buffers;
  buffer* b = nullptr;
  for (auto& x : buffers)
    if (x->device == device) b = x.get();
  if (b == nullptr) b = buffers.emplace_back(std::make_unique<buffer>(buffer{device, nullptr, 0})).get();
  if (b->bytes < bytes) {
    if (b->p != nullptr) LOCKSTEP_TRY_CUDA(cudaFree(b->p));
    b->p = nullptr;
    b->bytes = 0;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&b->p, bytes));
    b->bytes = bytes;
  }
  return b->p;
}

}  // namespace detail

//! The number of chunk sums unscale() writes for `segs` (the length its partials need).
template <class Element>
std::size_t unscale_chunks(std::span<const segment> segs) {
  std::size_t n = 0;
  for (const auto& s : segs) n += chunks_of<unscale_op<Element, true>>(s.count);
  return n;
}

//! One unscale_op pass over `segs` (element type t): see unscale_op. d_flag and d_partials
//! (device memory) may be null; partials are written from d_partials[0] (unscale_chunks of
//! them). Returns the number of chunks. Queued on s.
inline std::size_t unscale(std::span<const segment> segs, dtype t, double factor, const double* d_factor, int* d_flag,
                           double* d_partials, cudaStream_t s) {
  check_segments(segs, "unscale");
  std::size_t chunks = 0;
  visit_float(t, "unscale", [&]<class Element>(std::type_identity<Element>) {
    const auto tensor = [&](std::size_t i) { return tensor_ref<1>{{segs[i].ptr}, segs[i].count}; };
    if (d_partials != nullptr)
      chunks = launch(unscale_op<Element, true>{{}, factor, d_factor, d_flag, d_partials}, segs.size(), tensor, s,
                      "unscale");
    else chunks = launch(unscale_op<Element>{{}, factor, d_factor, d_flag, nullptr}, segs.size(), tensor, s, "unscale");
  });
  return chunks;
}

//! x ← clamp(x, lo, hi) over `segs`; NaN passes through. Queued on s.
inline void clamp(std::span<const segment> segs, dtype t, double lo, double hi, cudaStream_t s) {
  check_segments(segs, "clamp");
  visit_float(t, "clamp", [&]<class Element>(std::type_identity<Element>) {
    const auto lb = detail::clamp_bound<Element>(lo), hb = detail::clamp_bound<Element>(hi);
    const clamp_op<Element> op{{}, detail::bound_value<Element>(lb), detail::bound_value<Element>(hb), lb, hb};
    launch(op, segs.size(), [&](std::size_t i) { return tensor_ref<1>{{segs[i].ptr}, segs[i].count}; }, s, "clamp");
  });
}

namespace detail {
//! The chunks sum_of_squares covers for `groups` (checked).
inline std::size_t square_chunks(std::span<const grad_group> groups) {
  std::size_t total = 0;
  for (const auto& g : groups) {
    check_segments(g.segments, "sum_of_squares");
    visit_float(g.type, "sum_of_squares",
                [&]<class Element>(std::type_identity<Element>) { total += unscale_chunks<Element>(g.segments); });
  }
  return total;
}
//! Σx² into *d_out, with partials[0 .. square_chunks(groups)) as scratch. Nothing synchronises.
inline void sum_of_squares(std::span<const grad_group> groups, double* partials, std::size_t total, double* d_out,
                           cudaStream_t s) {
  if (total == 0) {
    LOCKSTEP_TRY_CUDA(cudaMemsetAsync(d_out, 0, sizeof(double), s));
    return;
  }
  std::size_t base = 0;
  for (const auto& g : groups) base += unscale(g.segments, g.type, 1.0, nullptr, nullptr, partials + base, s);
  constexpr int threads = tuning_of<unscale_op<float>>.block_threads;
  sum_partials_kernel<threads><<<1, threads, 0, s>>>(partials, total, d_out);
  LOCKSTEP_CHECK_LAUNCH();
}
}  // namespace detail

//! Σx² (double) over every element of every group, in a fixed order (per chunk, then the chunk
//! sums in order), into *d_out (device memory). Scratch comes from cudaMallocAsync on s;
//! nothing synchronises.
inline void sum_of_squares(std::span<const grad_group> groups, double* d_out, cudaStream_t s) {
  const std::size_t total = detail::square_chunks(groups);
  detail::stream_scratch buf(total * sizeof(double), s);
  detail::sum_of_squares(groups, static_cast<double*>(buf.p), total, d_out, s);
}

//! The same, returned on the host (waits for stream s). Its scratch is kept per host thread
//! and device between calls (it is idle whenever this returns): allocating it each time cost
//! more than the pass itself once the stream's memory pool had given the memory back.
inline double sum_of_squares(std::span<const grad_group> groups, cudaStream_t s) {
  const std::size_t total = detail::square_chunks(groups);
  int device = 0;
  LOCKSTEP_TRY_CUDA(cudaGetDevice(&device));
  auto* partials = static_cast<double*>(detail::thread_scratch(device, (total + 1) * sizeof(double)));
  detail::sum_of_squares(groups, partials, total, partials + total, s);  // partials, then the sum
  double v = 0.0;
  LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(&v, partials + total, sizeof v, cudaMemcpyDeviceToHost, s));
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  return v;
}

}  // namespace lockstep::cuda::kernels
