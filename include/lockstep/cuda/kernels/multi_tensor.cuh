#pragma once
//! Multi-tensor apply: one kernel launch walks many tensors (lists of lockstep::segment) in
//! fixed-size chunks, one thread block per chunk, and the elementwise kernels built on it:
//! pack / unpack / scale, unscale + non-finite check (+ squared norm), gradient clipping and
//! the device-side dynamic loss-scale update; and device_permutation (CUB radix sort) for
//! samplers. Nothing here synchronises with the host.
//!
//! How a launch is laid out:
//!  - The tensors' pointers and counts travel in the kernel's parameters (a __grid_constant__
//!    table: CUDA 12.1+ allows 32 KB of parameters on sm_70+), several hundred tensors a
//!    launch; longer lists are split over several launches. Lists of ≤ 32 tensors use a
//!    small table, so short buckets do not pay for copying 32 KB of parameters.
//!  - Block b finds its tensor by binary search of a prefix sum of chunk counts, then
//!    handles chunk_elems elements of it.
//!  - Inside a chunk, 16-byte vector loads/stores when every list's pointer is equally
//!    misaligned (a scalar head brings them to 16 bytes), scalar otherwise and for the tail.
//!    The elementwise ops issue all of a thread's loads of a chunk before the first use (one
//!    memory wait per block: these kernels are latency-bound otherwise; docs/kernels.md).
//!
//! Element types: f32, f64, f16 (__half), bf16 (__nv_bfloat16); arithmetic in f32 (f64 for
//! f64). Every call queues work on stream `s` and checks the launch (cuda_error on failure).
//! Segments handed to one call must not overlap one another, except that pack/unpack
//! source and destination may be identical (an in-place no-op copy).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "lockstep/concepts.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"

namespace lockstep::cuda::kernels {

namespace detail {

inline constexpr int block_threads = 512;
//! Elements per block. A multiple of every vector width (≤ 16 elements), so all chunks of
//! a tensor share its alignment; 16 Ki elements keep even one large tensor spread over
//! many blocks (GPT-2's 38.6M-element embedding = 2357 blocks).
inline constexpr std::size_t chunk_elems = 16384;
inline constexpr unsigned max_blocks = 0x7fffffffu;  // gridDim.x limit
inline constexpr std::size_t max_param_bytes = 32764; // kernel parameter limit, CUDA ≥ 12.1
inline constexpr int small_capacity = 32;

// ---- element types: storage bits, compute type, conversions --------------------------------
template <class T>
struct elem;
template <>
struct elem<float> {
  using bits = float;
  using acc = float;
  __device__ static float to_acc(float x) { return x; }
  __device__ static float from_acc(float x) { return x; }
  __device__ static bool finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
};
template <>
struct elem<double> {
  using bits = double;
  using acc = double;
  __device__ static double to_acc(double x) { return x; }
  __device__ static double from_acc(double x) { return x; }
  __device__ static bool finite(double x) {
    return (static_cast<unsigned long long>(__double_as_longlong(x)) & 0x7ff0000000000000ull) !=
           0x7ff0000000000000ull;
  }
};
// Halves are moved as raw 16-bit patterns: trivially copyable, vectorisable.
template <>
struct elem<__half> {
  using bits = unsigned short;
  using acc = float;
  __device__ static float to_acc(unsigned short b) { return __half2float(__ushort_as_half(b)); }
  __device__ static unsigned short from_acc(float x) { return __half_as_ushort(__float2half_rn(x)); }
  __device__ static bool finite(unsigned short b) { return (b & 0x7c00u) != 0x7c00u; }
};
template <>
struct elem<__nv_bfloat16> {
  using bits = unsigned short;
  using acc = float;
  __device__ static float to_acc(unsigned short b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  __device__ static unsigned short from_acc(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  __device__ static bool finite(unsigned short b) { return (b & 0x7f80u) != 0x7f80u; }
};

//! N elements of B moved as one aligned access (two 16-byte accesses when 32 bytes).
template <class B, int N>
struct alignas(sizeof(B) * N) pack_of {
  B v[N];
};

//! One access of F's size (≤ 16 bytes, or a multiple of 16) through a machine vector type.
//! 16-byte stores go through inline PTX: nvcc 13.0 split plain ones (struct or uint4) into
//! four 4-byte stores in some unrolled positions (the original kernels' two-list ops had 49
//! STG.E and no STG.E.128), four times the store instructions and partial-sector writes.
template <std::size_t Bytes>
struct access_word {
  using type = uint4;
};
template <> struct access_word<8> { using type = uint2; };
template <> struct access_word<4> { using type = unsigned int; };
template <> struct access_word<2> { using type = unsigned short; };
template <> struct access_word<1> { using type = unsigned char; };
template <class F>
__device__ __forceinline__ F load_as(const void* at) {
  using W = typename access_word<sizeof(F)>::type;
  static_assert(sizeof(F) <= 16 ? sizeof(W) == sizeof(F) : sizeof(F) % 16 == 0);
  constexpr int words = sizeof(F) <= 16 ? 1 : sizeof(F) / 16;
  W w[words];
#pragma unroll
  for (int k = 0; k < words; ++k) w[k] = static_cast<const W*>(at)[k];
  F f;
  __builtin_memcpy(&f, w, sizeof f);  // registers only: no memory traffic
  return f;
}
template <class F>
__device__ __forceinline__ void store_as(void* at, const F& f) {
  using W = typename access_word<sizeof(F)>::type;
  static_assert(sizeof(F) <= 16 ? sizeof(W) == sizeof(F) : sizeof(F) % 16 == 0);
  constexpr int words = sizeof(F) <= 16 ? 1 : sizeof(F) / 16;
  W w[words];
  __builtin_memcpy(w, &f, sizeof f);
#pragma unroll
  for (int k = 0; k < words; ++k) {
    if constexpr (sizeof(W) == 16)  // the one form the compiler never splits
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(static_cast<W*>(at) + k),
                   "r"(w[k].x), "r"(w[k].y), "r"(w[k].z), "r"(w[k].w)
                   : "memory");
    else
      static_cast<W*>(at)[k] = w[k];
  }
}
template <int N, class B>
__device__ __forceinline__ pack_of<B, N> load_pack(const void* base, std::size_t i) {
  return load_as<pack_of<B, N>>(static_cast<const B*>(base) + i);
}
template <int N, class B>
__device__ __forceinline__ void store_pack(void* base, std::size_t i, const pack_of<B, N>& x) {
  store_as(static_cast<B*>(base) + i, x);
}

//! Unsigned storage of a given byte size, for type-blind copies.
template <std::size_t Bytes>
struct raw_bits;
template <> struct raw_bits<1> { using type = unsigned char; };
template <> struct raw_bits<2> { using type = unsigned short; };
template <> struct raw_bits<4> { using type = unsigned int; };
template <> struct raw_bits<8> { using type = unsigned long long; };

// ---- the launch table ------------------------------------------------------------------------
template <int D, int Cap>
struct tensor_table {
  void* ptr[Cap][D];
  std::size_t count[Cap];
  unsigned block_begin[Cap + 1];  // tensor t owns blocks [block_begin[t], block_begin[t+1])
  int n;
};

template <int D>
struct tensor_ref {
  void* p[D];
  std::size_t count;
};

//! Tensors per launch so that the table and the op fit the 32 KB parameter limit.
template <int D, std::size_t OpBytes>
inline constexpr int table_capacity =
    static_cast<int>((max_param_bytes - OpBytes - 64) / (8 * D + 8 + 4));

//! The chunk loop. An Op provides:
//!   lists, width (elements per vector access), unroll (vector accesses in flight per thread),
//!   min_blocks (resident blocks per SM to compile for: caps registers),
//!   elem_bytes(k), struct local (per-thread state), template<int N> frag,
//!   bool begin(local&)  — once per block, uniform; false = leave this block's chunk alone,
//!   load<N>(frag&, p, i, local&), store<N>(frag&, p, i, local&)  — elements i..i+N−1,
//!   end(local&)  — once per block, by every thread (block reductions).
//! p[k] is list k's tensor base pointer (null for an unused list); i is the element index.
template <class Op>
__device__ __forceinline__ void run_chunk(const Op& op, typename Op::local& st, void* const* p,
                                          std::size_t start, unsigned n) {
  constexpr int D = Op::lists, V = Op::width, U = Op::unroll;
  // Vectorise only when every list is misaligned by the same number of elements.
  int mis = -1;
  bool same = true;
#pragma unroll
  for (int k = 0; k < D; ++k) {
    if (p[k] == nullptr) continue;
    const auto addr = reinterpret_cast<std::uintptr_t>(p[k]);
    const auto eb = static_cast<std::uintptr_t>(Op::elem_bytes(k));
    const int m = static_cast<int>((addr / eb + start) % V);
    if (addr % eb != 0 || (mis >= 0 && m != mis)) same = false;
    if (mis < 0) mis = m;
  }
  if (mis < 0) mis = 0;
  const unsigned head = same ? min(n, static_cast<unsigned>((V - mis) % V)) : n;
  const unsigned nvec = (n - head) / V;
  const unsigned body_end = head + nvec * V;
  const unsigned tid = threadIdx.x;

  // All U loads are issued before the first use. The element index is kept in 64 bits as
  // base + a compile-time offset, so each access is one base register plus an immediate
  // (a 32-bit vector index widened per access costs two registers and an IMAD each).
  constexpr unsigned step = U * block_threads;  // vectors per pass of the block
  std::size_t i0 = start + head + std::size_t(tid) * V;
#pragma unroll 1  // U accesses a pass are in flight already; unrolling passes only adds code
  for (unsigned v0 = tid; v0 < nvec; v0 += step, i0 += std::size_t(step) * V) {
    typename Op::template frag<V> f[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * block_threads < nvec)
        op.template load<V>(f[u], p, i0 + std::size_t(u) * block_threads * V, st);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * block_threads < nvec)
        op.template store<V>(f[u], p, i0 + std::size_t(u) * block_threads * V, st);
  }
  const unsigned scalars = n - nvec * V;  // head + tail
  for (unsigned j = tid; j < scalars; j += block_threads) {
    const unsigned i = j < head ? j : body_end + (j - head);
    typename Op::template frag<1> f;
    op.template load<1>(f, p, start + i, st);
    op.template store<1>(f, p, start + i, st);
  }
}

template <class Op, int D, int Cap>
__global__ void __launch_bounds__(block_threads, Op::min_blocks)
    multi_tensor_kernel(const __grid_constant__ tensor_table<D, Cap> tab,
                        const __grid_constant__ Op op) {
  typename Op::local st;
  if (!op.begin(st)) return;  // uniform across the block (reads device flags only)
  const unsigned b = blockIdx.x;
  int lo = 0, hi = tab.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab.block_begin[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const std::size_t start = std::size_t(b - tab.block_begin[lo]) * chunk_elems;
  const std::size_t left = tab.count[lo] - start;
  const unsigned n = static_cast<unsigned>(left < chunk_elems ? left : chunk_elems);
  void* p[D];
#pragma unroll
  for (int k = 0; k < D; ++k) p[k] = tab.ptr[lo][k];
  run_chunk(op, st, p, start, n);
  op.end(st);
}

//! Room for one launch table, per host thread, shared by every Op: 32 KB is too much for
//! the stacks of some user threads, and one static thread_local per Op type would give
//! every thread of the process ~1 MB of TLS. Allocated on a thread's first launch.
inline void* launch_table_storage() {
  constexpr std::size_t words = (max_param_bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
  thread_local std::unique_ptr<std::max_align_t[]> buf;
  if (!buf) buf.reset(new std::max_align_t[words]);
  return buf.get();
}

//! Launches Op over tensors get(0..n−1) (each a tensor_ref<D>), as few launches as fit.
template <class Op, class Get>
void launch_multi_tensor(const Op& op, std::size_t n, Get&& get, cudaStream_t s, const char* who) {
  constexpr int D = Op::lists;
  constexpr int Cap = table_capacity<D, sizeof(Op)>;
  using big_t = tensor_table<D, Cap>;
  using small_t = tensor_table<D, small_capacity>;
  static_assert(Cap > small_capacity, "multi-tensor table too small");
  static_assert(sizeof(big_t) + sizeof(Op) + 16 <= max_param_bytes,
                "multi-tensor kernel parameters exceed CUDA's 32 KB limit");
  static_assert(std::is_trivially_copyable_v<Op>, "an Op travels as a kernel parameter");
  static_assert(sizeof(big_t) <= max_param_bytes && std::is_trivially_destructible_v<big_t>);
  big_t& tab = *::new (launch_table_storage()) big_t;
  tab.n = 0;
  tab.block_begin[0] = 0;

  auto flush = [&] {
    if (tab.n == 0) return;
    const unsigned blocks = tab.block_begin[tab.n];
    if (tab.n <= small_capacity) {
      small_t sm;
      sm.n = tab.n;
      for (int t = 0; t < tab.n; ++t) {
        for (int k = 0; k < D; ++k) sm.ptr[t][k] = tab.ptr[t][k];
        sm.count[t] = tab.count[t];
        sm.block_begin[t] = tab.block_begin[t];
      }
      sm.block_begin[tab.n] = blocks;
      multi_tensor_kernel<Op, D, small_capacity><<<blocks, block_threads, 0, s>>>(sm, op);
    } else {
      multi_tensor_kernel<Op, D, Cap><<<blocks, block_threads, 0, s>>>(tab, op);
    }
    LOCKSTEP_CHECK_LAUNCH();
    tab.n = 0;
    tab.block_begin[0] = 0;
  };

  for (std::size_t i = 0; i < n; ++i) {
    const tensor_ref<D> r = get(i);
    if (r.count == 0) continue;
    for (int k = 0; k < D; ++k)
      if (r.p[k] == nullptr && Op::list_required(k))
        throw config_error(std::string(who) + ": tensor " + std::to_string(i) + " has " +
                           std::to_string(r.count) + " elements but a null pointer");
    const std::size_t chunks = (r.count + chunk_elems - 1) / chunk_elems;
    if (chunks > max_blocks)
      throw config_error(std::string(who) + ": tensor " + std::to_string(i) + " has " +
                         std::to_string(r.count) + " elements, more than one launch can cover; "
                         "split it into several segments");
    if (tab.n == Cap || tab.block_begin[tab.n] + chunks > max_blocks) flush();
    for (int k = 0; k < D; ++k) tab.ptr[tab.n][k] = r.p[k];
    tab.count[tab.n] = r.count;
    tab.block_begin[tab.n + 1] = tab.block_begin[tab.n] + static_cast<unsigned>(chunks);
    ++tab.n;
  }
  flush();
}

//! Calls f(std::type_identity<T>{}) for a floating dtype's device type.
template <class F>
void visit_float(dtype t, const char* who, F&& f) {
  switch (t) {
    case dtype::f32: f(std::type_identity<float>{}); return;
    case dtype::f64: f(std::type_identity<double>{}); return;
    case dtype::f16: f(std::type_identity<__half>{}); return;
    case dtype::bf16: f(std::type_identity<__nv_bfloat16>{}); return;
    default: break;
  }
  throw config_error(std::string(who) + " works on f16, bf16, f32 and f64 elements, not " +
                     name_of(t));
}

// ---- ops -------------------------------------------------------------------------------------
struct no_local {};

//! Vector accesses per thread that cover a whole chunk in one pass (so each block waits for
//! memory once), at most `cap` (registers).
__host__ __device__ constexpr int one_pass_unroll(int width, int cap) {
  const int need = static_cast<int>(chunk_elems / std::size_t(width) / block_threads);
  return need < 1 ? 1 : need < cap ? need : cap;
}

//! Two 16-bit floats packed in a 32-bit word (element i in the low half), converted a pair at
//! a time: one register per pair rather than one per element, so a thread can hold a whole
//! chunk's share of loads. The conversions round exactly as elem<T>'s (round to nearest even).
template <class T>
struct pair_ops;
template <>
struct pair_ops<__nv_bfloat16> {
  static constexpr unsigned exp = 0x7f807f80u, unit = 0x00800080u;
  __device__ static float2 unpack(unsigned w) {
    return {__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)};
  }
  __device__ static unsigned pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    unsigned w;
    __builtin_memcpy(&w, &h, sizeof w);
    return w;
  }
};
template <>
struct pair_ops<__half> {
  static constexpr unsigned exp = 0x7c007c00u, unit = 0x04000400u;
  __device__ static float2 unpack(unsigned w) {
    __half2 h;
    __builtin_memcpy(&h, &w, sizeof w);
    return __half22float2(h);
  }
  __device__ static unsigned pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    unsigned w;
    __builtin_memcpy(&w, &h, sizeof w);
    return w;
  }
};

//! N elements of T in registers: pairs of 16-bit floats per word when N is even, else one
//! element of storage bits per slot.
template <class T, int N>
inline constexpr bool paired = sizeof(typename elem<T>::bits) == 2 && N % 2 == 0;
template <class T, int N>
using vfrag = std::conditional_t<paired<T, N>, pack_of<unsigned, N / 2 + (N % 2)>,
                                 pack_of<typename elem<T>::bits, N>>;

//! v[j] ← f(v[j]) for each element in order, f on the compute type (one rounding to T).
template <class T, int N, class F>
__device__ __forceinline__ void map_elems(vfrag<T, N>& v, F&& f) {
  using E = elem<T>;
  if constexpr (paired<T, N>) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x = pair_ops<T>::unpack(v.v[j]);
      v.v[j] = pair_ops<T>::pack(f(x.x), f(x.y));
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v.v[j] = E::from_acc(f(E::to_acc(v.v[j])));
  }
}
//! f(v[j]) for each element in order, on the compute type.
template <class T, int N, class F>
__device__ __forceinline__ void visit_elems(const vfrag<T, N>& v, F&& f) {
  using E = elem<T>;
  if constexpr (paired<T, N>) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x = pair_ops<T>::unpack(v.v[j]);
      f(x.x);
      f(x.y);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) f(E::to_acc(v.v[j]));
  }
}
//! Nonzero when an element of v is inf or NaN (an all-ones exponent). For pairs, one unit
//! added to each half's masked exponent carries into that half's top bit only from all ones.
template <class T, int N>
__device__ __forceinline__ unsigned nonfinite(const vfrag<T, N>& v) {
  unsigned acc = 0;
  if constexpr (paired<T, N>) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) acc |= (v.v[j] & pair_ops<T>::exp) + pair_ops<T>::unit;
    return acc & 0x80008000u;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) acc |= elem<T>::finite(v.v[j]) ? 0u : 1u;
    return acc;
  }
}

//! dst ← src (raw bits of B). Lists: 0 = src, 1 = dst. Whole vectors move as 16-byte words
//! whatever B is (no per-element unpacking, fewer registers).
template <class B>
struct copy_op {
  static constexpr int lists = 2, width = 16 / int(sizeof(B)), unroll = one_pass_unroll(width, 8),
                       min_blocks = sizeof(B) <= 2 ? 3 : 2;
  __host__ __device__ static constexpr int elem_bytes(int) { return sizeof(B); }
  static constexpr bool list_required(int) { return true; }
  using local = no_local;
  template <int N>
  using frag = std::conditional_t<N == 1, B, uint4>;
  static_assert(sizeof(uint4) == sizeof(B) * width);
  __device__ bool begin(local&) const { return true; }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_as<frag<N>>(static_cast<const B*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local&) const {
    store_as(static_cast<B*>(p[1]) + i, f);
  }
  __device__ void end(local&) const {}
};

//! dst ← src · factor, in T's compute type. Lists: 0 = src, 1 = dst (may be src).
template <class T>
struct scale_op {
  using E = elem<T>;
  using B = typename E::bits;
  using A = typename E::acc;
  static constexpr int lists = 2, width = 16 / int(sizeof(B)), unroll = one_pass_unroll(width, 8),
                       min_blocks = sizeof(B) == 2 ? 3 : 2;
  __host__ __device__ static constexpr int elem_bytes(int) { return sizeof(B); }
  static constexpr bool list_required(int) { return true; }
  using local = no_local;
  template <int N>
  using frag = vfrag<T, N>;
  A factor;
  __device__ bool begin(local&) const { return true; }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_as<frag<N>>(static_cast<const B*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local&) const {
    map_elems<T, N>(f, [&](A x) { return x * factor; });
    store_as(static_cast<B*>(p[1]) + i, f);
  }
  __device__ void end(local&) const {}
};

//! g ← g · *inv_scale in place; *found_inf = 1 if an input is inf/NaN; *sumsq += Σ g²
//! (of the stored, unscaled values). When *inv_scale == 1 the gradients are only read.
template <class T>
struct unscale_op {
  using E = elem<T>;
  using B = typename E::bits;
  using A = typename E::acc;
  static constexpr int lists = 1, width = 16 / int(sizeof(B)), unroll = one_pass_unroll(width, 8),
                       min_blocks = sizeof(B) == 2 ? 3 : 2;
  __host__ __device__ static constexpr int elem_bytes(int) { return sizeof(B); }
  static constexpr bool list_required(int) { return true; }
  struct local {
    A inv;
    bool write;
    unsigned bad;  // nonzero once an inf/NaN was seen
    double ss;
  };
  template <int N>
  using frag = vfrag<T, N>;
  const float* inv_scale;
  int* found_inf;
  double* sumsq;  // may be null
  __device__ bool begin(local& st) const {
    st.inv = static_cast<A>(*inv_scale);
    st.write = st.inv != A(1);
    st.bad = 0;
    st.ss = 0.0;
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_as<frag<N>>(static_cast<const B*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local& st) const {
    st.bad |= nonfinite<T, N>(f);  // of the input, before unscaling
    if (st.write) map_elems<T, N>(f, [&](A x) { return x * st.inv; });
    if (sumsq != nullptr) {
      A part = 0;
      visit_elems<T, N>(f, [&](A y) { part += y * y; });
      st.ss += static_cast<double>(part);
    }
    if (st.write) store_as(static_cast<B*>(p[0]) + i, f);
  }
  __device__ void end(local& st) const {
    // The flag needs no block barrier: a warp that saw inf/NaN stores the 1 itself (rare, so
    // the atomic costs nothing in the common case; atomic only so that concurrent stores of
    // the same value are well defined).
    if (__any_sync(0xffffffffu, st.bad != 0) && (threadIdx.x & 31) == 0) atomicExch(found_inf, 1);
    if (sumsq != nullptr) {
      using reduce_t = cub::BlockReduce<double, block_threads>;
      __shared__ typename reduce_t::TempStorage temp;
      const double total = reduce_t(temp).Sum(st.ss);
      if (threadIdx.x == 0) atomicAdd(sumsq, total);
    }
  }
};

//! g ← g · min(1, max_norm / (√*sumsq + 1e-6)); blocks return at once when the factor is 1
//! (or the norm is NaN: the step is then skipped through found_inf anyway).
template <class T>
struct clip_op {
  using E = elem<T>;
  using B = typename E::bits;
  using A = typename E::acc;
  static constexpr int lists = 1, width = 16 / int(sizeof(B)), unroll = one_pass_unroll(width, 8),
                       min_blocks = sizeof(B) == 2 ? 3 : 2;
  __host__ __device__ static constexpr int elem_bytes(int) { return sizeof(B); }
  static constexpr bool list_required(int) { return true; }
  struct local {
    A coef;
  };
  template <int N>
  using frag = vfrag<T, N>;
  const double* sumsq;
  float max_norm;
  __device__ bool begin(local& st) const {
    const double c = static_cast<double>(max_norm) / (sqrt(*sumsq) + 1e-6);
    if (!(c < 1.0)) return false;
    st.coef = static_cast<A>(c);
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_as<frag<N>>(static_cast<const B*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local& st) const {
    map_elems<T, N>(f, [&](A x) { return x * st.coef; });
    store_as(static_cast<B*>(p[0]) + i, f);
  }
  __device__ void end(local&) const {}
};

template <int = 0>
__global__ void update_scale_kernel(float* scale, float* inv_scale, int* tracker, const int* found_inf,
                                    float growth, float backoff, int interval, float min_scale,
                                    float max_scale) {
  float s = *scale;
  if (*found_inf != 0) {
    s *= backoff;
    *tracker = 0;
  } else {
    int t = *tracker + 1;  // a clean step
    if (t >= interval) {   // == in PyTorch; ≥ also recovers if the interval was lowered
      const float grown = s * growth;
      if ((__float_as_uint(grown) & 0x7f800000u) != 0x7f800000u) s = grown;  // never to inf
      t = 0;
    }
    *tracker = t;
  }
  s = fminf(fmaxf(s, min_scale), max_scale);  // fmaxf(NaN, min) = min: a NaN scale recovers
  *scale = s;
  *inv_scale = static_cast<float>(1.0 / static_cast<double>(s));  // as PyTorch: double reciprocal
}

//! A bijection of 64-bit integers (splitmix64's finaliser after adding a seed-derived
//! offset): distinct indices get distinct keys, so sorting by key is a uniform-looking
//! permutation without ties.
__device__ __forceinline__ std::uint64_t permutation_key(std::uint64_t i, std::uint64_t seed) {
  std::uint64_t z = i + (seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <int = 0>
__global__ void permutation_init_kernel(std::uint64_t* keys, std::uint64_t* values, std::size_t n,
                                        std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    keys[i] = permutation_key(i, seed);
    values[i] = i;
  }
}

inline void check_segments(std::span<const segment> segs, const char* who) {
  for (std::size_t i = 0; i < segs.size(); ++i)
    if (segs[i].count != 0 && segs[i].ptr == nullptr)
      throw config_error(std::string(who) + ": segment " + std::to_string(i) + " has " +
                         std::to_string(segs[i].count) + " elements but a null pointer");
}

template <class B>
void copy_segments(std::span<const segment> segs, void* packed, bool to_packed, cudaStream_t s,
                   const char* who) {
  auto* base = static_cast<B*>(packed);
  std::size_t offset = 0;  // get() is called in order, so a running offset suffices
  launch_multi_tensor(copy_op<B>{}, segs.size(), [&](std::size_t i) {
    tensor_ref<2> r{{segs[i].ptr, base + offset}, segs[i].count};
    if (!to_packed) std::swap(r.p[0], r.p[1]);
    offset += segs[i].count;
    return r;
  }, s, who);
}

template <class F>
void visit_size(dtype t, F&& f) {
  switch (size_of(t)) {
    case 1: f(std::type_identity<unsigned char>{}); return;
    case 2: f(std::type_identity<unsigned short>{}); return;
    case 4: f(std::type_identity<unsigned int>{}); return;
    case 8: f(std::type_identity<unsigned long long>{}); return;
    default: break;
  }
  throw config_error(std::string("unknown element type ") + name_of(t));
}

}  // namespace detail

// ---- public entry points -----------------------------------------------------------------

//! dst ← concat(src) · scale. Any dtype when scale == 1 (a copy); floating types otherwise.
inline void pack(std::span<const segment> src, void* dst, dtype t, double scale, cudaStream_t s) {
  detail::check_segments(src, "pack");
  if (dst == nullptr) {
    for (const auto& g : src)
      if (g.count) throw config_error("pack: the destination is null");
    return;
  }
  if (scale == 1.0) {
    detail::visit_size(t, [&]<class B>(std::type_identity<B>) {
      detail::copy_segments<B>(src, dst, true, s, "pack");
    });
    return;
  }
  detail::visit_float(t, "pack with a scale ≠ 1", [&]<class T>(std::type_identity<T>) {
    using op_t = detail::scale_op<T>;
    using A = typename detail::elem<T>::acc;
    using B = typename detail::elem<T>::bits;
    auto* base = static_cast<B*>(dst);
    std::size_t offset = 0;
    detail::launch_multi_tensor(op_t{static_cast<A>(scale)}, src.size(), [&](std::size_t i) {
      detail::tensor_ref<2> r{{src[i].ptr, base + offset}, src[i].count};
      offset += src[i].count;
      return r;
    }, s, "pack");
  });
}

//! Scatters contiguous src into the segments dst (any dtype).
inline void unpack(const void* src, std::span<const segment> dst, dtype t, cudaStream_t s) {
  detail::check_segments(dst, "unpack");
  if (src == nullptr) {
    for (const auto& g : dst)
      if (g.count) throw config_error("unpack: the source is null");
    return;
  }
  detail::visit_size(t, [&]<class B>(std::type_identity<B>) {
    detail::copy_segments<B>(dst, const_cast<void*>(src), false, s, "unpack");
  });
}

//! p[0..count) ← p · factor (floating types; a no-op for factor == 1).
inline void scale(void* p, std::size_t count, dtype t, double factor, cudaStream_t s) {
  if (count == 0 || factor == 1.0) return;
  if (p == nullptr) throw config_error("scale: null pointer for " + std::to_string(count) + " elements");
  detail::visit_float(t, "scale", [&]<class T>(std::type_identity<T>) {
    using A = typename detail::elem<T>::acc;
    detail::launch_multi_tensor(detail::scale_op<T>{static_cast<A>(factor)}, 1, [&](std::size_t) {
      return detail::tensor_ref<2>{{p, p}, count};
    }, s, "scale");
  });
}

//! In place g ← g · *d_inv_scale; sets *d_found_inf = 1 if any input element is inf or NaN
//! (never resets it: zero it once per step); if d_sumsq is not null, atomically adds
//! Σ g² of the unscaled (stored) gradients to *d_sumsq — a double, for accuracy over
//! 10⁸ elements; zero it before the first call of a step. Meaningless when inf/NaN was found.
inline void unscale_check(std::span<const segment> grads, dtype t, const float* d_inv_scale,
                          int* d_found_inf, double* d_sumsq, cudaStream_t s) {
  detail::check_segments(grads, "unscale_check");
  if (d_inv_scale == nullptr || d_found_inf == nullptr)
    throw config_error("unscale_check: d_inv_scale and d_found_inf must point to device memory");
  detail::visit_float(t, "unscale_check", [&]<class T>(std::type_identity<T>) {
    detail::launch_multi_tensor(detail::unscale_op<T>{d_inv_scale, d_found_inf, d_sumsq}, grads.size(),
                                [&](std::size_t i) {
                                  return detail::tensor_ref<1>{{grads[i].ptr}, grads[i].count};
                                }, s, "unscale_check");
  });
}

//! Gradient clipping by global norm, read on the device: g ← g · min(1, max_norm /
//! (√*d_sumsq + 1e-6)) (PyTorch's clip_grad_norm_). *d_sumsq must hold the sum over every
//! gradient of the model (all buckets, after the all-reduce).
inline void scale_by_clip(std::span<const segment> grads, dtype t, const double* d_sumsq,
                          float max_norm, cudaStream_t s) {
  detail::check_segments(grads, "scale_by_clip");
  if (d_sumsq == nullptr) throw config_error("scale_by_clip: d_sumsq must point to device memory");
  if (!(max_norm > 0)) throw config_error("scale_by_clip: max_norm must be > 0");
  detail::visit_float(t, "scale_by_clip", [&]<class T>(std::type_identity<T>) {
    detail::launch_multi_tensor(detail::clip_op<T>{d_sumsq, max_norm}, grads.size(),
                                [&](std::size_t i) {
                                  return detail::tensor_ref<1>{{grads[i].ptr}, grads[i].count};
                                }, s, "scale_by_clip");
  });
}

//! Device-side GradScaler update (PyTorch semantics), one thread, no host sync:
//!   found inf/NaN: scale ← scale·backoff, tracker ← 0
//!   else: tracker ← tracker + 1; when it reaches growth_interval, scale ← scale·growth
//!         (unless that overflows to inf) and tracker ← 0
//! then scale is clamped to [min_scale, max_scale] and inv_scale ← 1/scale.
inline void update_dynamic_scale(float* d_scale, float* d_inv_scale, int* d_growth_tracker,
                                 const int* d_found_inf, float growth_factor, float backoff_factor,
                                 int growth_interval, float min_scale, float max_scale,
                                 cudaStream_t s) {
  if (!d_scale || !d_inv_scale || !d_growth_tracker || !d_found_inf)
    throw config_error("update_dynamic_scale: every state pointer must point to device memory");
  if (!(growth_factor > 0) || !(backoff_factor > 0) || growth_interval < 1 ||
      !(min_scale > 0) || !(min_scale <= max_scale))
    throw config_error("update_dynamic_scale: need growth_factor > 0, backoff_factor > 0, "
                       "growth_interval ≥ 1 and 0 < min_scale ≤ max_scale");
  detail::update_scale_kernel<<<1, 1, 0, s>>>(d_scale, d_inv_scale, d_growth_tracker, d_found_inf,
                                              growth_factor, backoff_factor, growth_interval,
                                              min_scale, max_scale);
  LOCKSTEP_CHECK_LAUNCH();
}

//! d_out[0..n) ← a pseudo-random permutation of 0..n−1 determined by seed (the same on
//! every device and run), for samplers over data sets too large to shuffle on the host.
//! Sorts bijectively hashed indices with cub::DeviceRadixSort; temporary memory (≈ 24·n
//! bytes) comes from cudaMallocAsync on stream s and is freed on it.
inline void device_permutation(std::uint64_t seed, std::size_t n, std::uint64_t* d_out, cudaStream_t s) {
  if (n == 0) return;
  if (d_out == nullptr) throw config_error("device_permutation: d_out is null");
  std::uint64_t *keys_in = nullptr, *keys_out = nullptr, *values_in = nullptr;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
  LOCKSTEP_TRY_CUDA((cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, values_in,
                                                     d_out, n, 0, 64, s)));
  LOCKSTEP_TRY_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&keys_in), n * sizeof(std::uint64_t), s));
  auto release = [&] {  // best effort on the error path; the first error is the one reported
    for (void* p : {static_cast<void*>(keys_in), static_cast<void*>(keys_out),
                    static_cast<void*>(values_in), temp})
      if (p != nullptr) (void)cudaFreeAsync(p, s);
  };
  try {
    LOCKSTEP_TRY_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&keys_out), n * sizeof(std::uint64_t), s));
    LOCKSTEP_TRY_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&values_in), n * sizeof(std::uint64_t), s));
    LOCKSTEP_TRY_CUDA(cudaMallocAsync(&temp, temp_bytes ? temp_bytes : 1, s));
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 4096));
    detail::permutation_init_kernel<<<blocks, 256, 0, s>>>(keys_in, values_in, n, seed);
    LOCKSTEP_CHECK_LAUNCH();
    LOCKSTEP_TRY_CUDA((cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in,
                                                       d_out, n, 0, 64, s)));
  } catch (...) {
    release();
    throw;
  }
  release();
}

}  // namespace lockstep::cuda::kernels
