#pragma once
//! The multi-tensor engine: one kernel launch walks many tensors (lists of pointers) in
//! fixed-size chunks, one thread block per chunk, applying an op. Every elementwise kernel of a
//! training step runs on it — pack/unpack/scale (memory_ops.cuh), unscale + inf/NaN check +
//! sum of squares, clamp (grad_ops.cuh), the fused optimizers (optimizers.cuh) — so the kernel
//! a step runs is the kernel the tests check and benchmark d measures.
//!
//! How a launch is laid out:
//!  - The tensors' pointers and counts travel in the kernel's parameters (a __grid_constant__
//!    table: CUDA 12.1+ allows 32 KB of parameters on sm_70+), several hundred tensors a
//!    launch; longer lists are split over several launches. Lists of ≤ 32 tensors use a
//!    small table, so short buckets do not pay for copying 32 KB of parameters.
//!  - Block b finds its tensor by binary search of a prefix sum of chunk counts, then
//!    handles tuning::chunk_elems elements of it.
//!  - Inside a chunk, vector loads/stores when every list's pointer is equally misaligned (a
//!    scalar head brings them to the vector size), scalar otherwise and for the tail. A thread
//!    issues tuning::unroll vector loads before the first use.
//!  - The engine also carries what the fused optimizers need, so they need no kernel of their
//!    own: a device skip flag (a block whose *skip ≠ 0 leaves its chunk alone: a skipped step
//!    costs one read) and, for ops with `stepped = true`, one step counter per tensor.
//!  - Block b of the whole call (all its launches) is chunk `block_info::chunk`, so an op can
//!    write one result per chunk in an order fixed by the layout (deterministic reductions).
//!
//! Writing an op: derive from op_base<Storage> (every knob at its default) and override what
//! differs — `lists`, `kind` (which selects the tuning), `stepped`, `elem_bytes(k)`,
//! `list_required(k)`, a per-thread `local`, `begin(local&, block_info)` (false: leave the
//! chunk), `end(local&, block_info)` (by every thread: block reductions) — plus the math:
//! `template <int N> using frag`, `load<N>(frag&, p, i, local&)`, `store<N>(frag&, p, i, local&)`
//! for elements i..i+N−1 of the tensor whose list-k base pointer is p[k] (null if unused).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/access.cuh"
#include "lockstep/cuda/kernels/tuning.cuh"

namespace lockstep::cuda::kernels {

//! What the engine tells an op about its block besides the chunk.
struct block_info {
  std::size_t chunk = 0;               //!< this block's chunk among all chunks of the call
  const std::int64_t* step = nullptr;  //!< the tensor's step counter (stepped ops), else null
};

//! An op's defaults (CUTLASS's op-base idea): one list of Storage, streaming, no step
//! counter, nothing per thread, nothing before or after a chunk.
template <class Storage>
struct op_base {
  using storage_t = Storage;
  static constexpr int lists = 1;
  static constexpr op_kind kind = op_kind::streaming;
  static constexpr bool stepped = false;
  __host__ __device__ static constexpr int elem_bytes(int /*list*/) { return sizeof(Storage); }
  __host__ __device__ constexpr bool list_required(int /*list*/) const { return true; }
  struct local {};
  template <class Local>
  __device__ bool begin(Local&, const block_info&) const {
    return true;
  }
  template <class Local>
  __device__ void end(Local&, const block_info&) const {}
};

//! The tuning an op runs with: the selector's choice for its kind and list-0 element size.
template <class Op>
inline constexpr tuning tuning_of = select_tuning(Op::kind, Op::elem_bytes(0));

//! One tensor of a launch: list k's base pointer p[k], its element count, its step counter.
template <int Lists>
struct tensor_ref {
  void* p[Lists];
  std::size_t count = 0;
  const std::int64_t* step = nullptr;
};

namespace detail {

inline constexpr unsigned max_blocks = 0x7fffffffu;    // gridDim.x limit
inline constexpr std::size_t max_param_bytes = 32764;  // kernel parameter limit, CUDA ≥ 12.1
inline constexpr int small_capacity = 32;

template <int Cap, bool Stepped>
struct table_steps {};
template <int Cap>
struct table_steps<Cap, true> {
  const std::int64_t* step[Cap];
};

template <int Lists, int Cap, bool Stepped>
struct tensor_table : table_steps<Cap, Stepped> {
  void* ptr[Cap][Lists];
  std::size_t count[Cap];
  unsigned block_begin[Cap + 1];  // tensor t owns blocks [block_begin[t], block_begin[t+1])
  int n;
  const int* skip;         // nullable: *skip ≠ 0 means every block returns at once
  std::size_t chunk_base;  // chunks of the call's earlier launches
};

//! Tensors per launch so that the table and the op fit the 32 KB parameter limit.
template <int Lists, std::size_t OpBytes, bool Stepped>
inline constexpr int table_capacity =
    static_cast<int>((max_param_bytes - OpBytes - 96) / (8 * Lists + 8 + 4 + (Stepped ? 8 : 0)));

//! The chunk loop: `n` elements from element `start` of the tensor with list pointers p.
//! All U loads of a pass are issued before the first use. The element index is kept in 64
//! bits as base + a compile-time offset, so each access is one base register plus an
//! immediate (a 32-bit vector index widened per access costs two registers and an IMAD each).
template <tuning Tune, class Op>
__device__ __forceinline__ void run_chunk(const Op& op, typename Op::local& st, void* const* p, std::size_t start,
                                          unsigned n) {
  constexpr int lists = Op::lists, width = Tune.width(Op::elem_bytes(0)), unroll = Tune.unroll;
  constexpr unsigned threads = Tune.block_threads;
  // Vectorise only when every list is misaligned by the same number of elements.
  int mis = -1;
  bool same = true;
#pragma unroll
  for (int k = 0; k < lists; ++k) {
    if (p[k] == nullptr) continue;
    const auto addr = reinterpret_cast<std::uintptr_t>(p[k]);
    const auto eb = static_cast<std::uintptr_t>(Op::elem_bytes(k));
    const int m = static_cast<int>((addr / eb + start) % width);
    if (addr % eb != 0 || (mis >= 0 && m != mis)) same = false;
    if (mis < 0) mis = m;
  }
  if (mis < 0) mis = 0;
  const unsigned head = same ? min(n, static_cast<unsigned>((width - mis) % width)) : n;
  const unsigned nvec = (n - head) / width;
  const unsigned body_end = head + nvec * width;
  const unsigned tid = threadIdx.x;

  constexpr unsigned step = unroll * threads;  // vectors per pass of the block
  std::size_t i0 = start + head + std::size_t(tid) * width;
#pragma unroll 1  // the unroll accesses of a pass are in flight already; unrolling passes only adds code
  for (unsigned v0 = tid; v0 < nvec; v0 += step, i0 += std::size_t(step) * width) {
    typename Op::template frag<width> f[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u)
      if (v0 + u * threads < nvec) op.template load<width>(f[u], p, i0 + std::size_t(u) * threads * width, st);
#pragma unroll
    for (int u = 0; u < unroll; ++u)
      if (v0 + u * threads < nvec) op.template store<width>(f[u], p, i0 + std::size_t(u) * threads * width, st);
  }
  const unsigned scalars = n - nvec * width;  // head + tail
  for (unsigned j = tid; j < scalars; j += threads) {
    const unsigned i = j < head ? j : body_end + (j - head);
    typename Op::template frag<1> f;
    op.template load<1>(f, p, start + i, st);
    op.template store<1>(f, p, start + i, st);
  }
}

//! The tuning travels as plain integers: nvcc 13.0's host stubs cannot name a kernel template
//! instantiated with a class-type template argument.
template <class Op, int Threads, int Chunk, int VectorBytes, int Unroll, int MinBlocks, int Cap>
__global__ void __launch_bounds__(Threads, MinBlocks)
    multi_tensor_kernel(const __grid_constant__ tensor_table<Op::lists, Cap, Op::stepped> tab,
                        const __grid_constant__ Op op) {
  constexpr tuning Tune{Threads, Chunk, VectorBytes, Unroll, MinBlocks};
  if (tab.skip != nullptr && *tab.skip != 0) return;  // a skipped step: uniform over the grid
  const unsigned b = blockIdx.x;
  int lo = 0, hi = tab.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab.block_begin[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  block_info info;
  info.chunk = tab.chunk_base + b;
  if constexpr (Op::stepped) info.step = tab.step[lo];
  typename Op::local st;
  if (!op.begin(st, info)) return;  // uniform across the block (reads device values only)
  const std::size_t start = std::size_t(b - tab.block_begin[lo]) * Tune.chunk_elems;
  const std::size_t left = tab.count[lo] - start;
  const unsigned n = static_cast<unsigned>(left < std::size_t(Tune.chunk_elems) ? left : Tune.chunk_elems);
  void* p[Op::lists];
#pragma unroll
  for (int k = 0; k < Op::lists; ++k) p[k] = tab.ptr[lo][k];
  run_chunk<Tune>(op, st, p, start, n);
  op.end(st, info);
}

//! Room for one launch table, per host thread, shared by every op: 32 KB is too much for
//! the stacks of some user threads, and one static thread_local per op type would give
//! every thread of the process ~1 MB of TLS. Allocated on a thread's first launch.
inline void* launch_table_storage() {
  constexpr std::size_t words = (max_param_bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
  thread_local std::unique_ptr<std::max_align_t[]> buf;
  if (!buf) buf.reset(new std::max_align_t[words]);
  return buf.get();
}

//! LOCKSTEP_DEBUG_KERNELS=1: each op type's tuning, once, at its first launch.
template <class Op, tuning Tune>
void report_tuning(const char* who) {
  static const bool once = [&] {
    if (const auto v = lockstep::detail::env("LOCKSTEP_DEBUG_KERNELS"); v && *v != "0")
      std::fprintf(stderr, "lockstep kernels: %s (%d lists, %s) runs with %s\n", who, Op::lists, name_of(Op::kind),
                   to_string(Tune).c_str());
    return true;
  }();
  (void)once;
}

}  // namespace detail

//! The number of chunks (= blocks) a tensor of `count` elements takes with Op's tuning.
template <class Op, tuning Tune = tuning_of<Op>>
constexpr std::size_t chunks_of(std::size_t count) {
  return (count + Tune.chunk_elems - 1) / Tune.chunk_elems;
}

//! Launches op over the tensors get(0..n−1) (each a tensor_ref<Op::lists>), on stream s, in
//! as few launches as fit. skip (device int, nullable): when *skip ≠ 0 at run time, nothing is
//! written. `who` names the caller in errors. Returns the number of chunks (blocks) launched.
template <class Op, tuning Tune = tuning_of<Op>, class Get>
std::size_t launch(const Op& op, std::size_t n, Get&& get, cudaStream_t s, const char* who, const int* skip = nullptr) {
  constexpr int lists = Op::lists;
  constexpr int cap = detail::table_capacity<lists, sizeof(Op), Op::stepped>;
  using big_t = detail::tensor_table<lists, cap, Op::stepped>;
  using small_t = detail::tensor_table<lists, detail::small_capacity, Op::stepped>;
  static_assert(cap > detail::small_capacity, "multi-tensor table too small");
  static_assert(sizeof(big_t) + sizeof(Op) + 16 <= detail::max_param_bytes,
                "multi-tensor kernel parameters exceed CUDA's 32 KB limit");
  static_assert(std::is_trivially_copyable_v<Op>, "an op travels as a kernel parameter");
  static_assert(Tune.chunk_elems % (Tune.vector_bytes / Op::elem_bytes(0)) == 0,
                "a chunk must hold whole vectors, so that all chunks of a tensor share its alignment");
  detail::report_tuning<Op, Tune>(who);
  big_t& tab = *::new (detail::launch_table_storage()) big_t;
  tab.n = 0;
  tab.block_begin[0] = 0;
  tab.skip = skip;
  tab.chunk_base = 0;

  auto flush = [&] {
    if (tab.n == 0) return;
    const unsigned blocks = tab.block_begin[tab.n];
    if (tab.n <= detail::small_capacity) {
      small_t sm;
      sm.n = tab.n;
      sm.skip = tab.skip;
      sm.chunk_base = tab.chunk_base;
      for (int t = 0; t < tab.n; ++t) {
        for (int k = 0; k < lists; ++k) sm.ptr[t][k] = tab.ptr[t][k];
        sm.count[t] = tab.count[t];
        sm.block_begin[t] = tab.block_begin[t];
        if constexpr (Op::stepped) sm.step[t] = tab.step[t];
      }
      sm.block_begin[tab.n] = blocks;
      detail::multi_tensor_kernel<Op, Tune.block_threads, Tune.chunk_elems, Tune.vector_bytes, Tune.unroll,
                                  Tune.min_blocks, detail::small_capacity>
          <<<blocks, Tune.block_threads, 0, s>>>(sm, op);
    } else {
      detail::multi_tensor_kernel<Op, Tune.block_threads, Tune.chunk_elems, Tune.vector_bytes, Tune.unroll,
                                  Tune.min_blocks, cap><<<blocks, Tune.block_threads, 0, s>>>(tab, op);
    }
    LOCKSTEP_CHECK_LAUNCH();
    tab.chunk_base += blocks;
    tab.n = 0;
    tab.block_begin[0] = 0;
  };

  for (std::size_t i = 0; i < n; ++i) {
    const tensor_ref<lists> r = get(i);
    if (r.count == 0) continue;
    for (int k = 0; k < lists; ++k)
      if (r.p[k] == nullptr && op.list_required(k))
        throw config_error(std::string(who) + ": tensor " + std::to_string(i) + " has " + std::to_string(r.count) +
                           " elements but a null pointer");
    if (Op::stepped && r.step == nullptr)
      throw config_error(std::string(who) + ": tensor " + std::to_string(i) + " has no step counter");
    const std::size_t chunks = chunks_of<Op, Tune>(r.count);
    if (chunks > detail::max_blocks)
      throw config_error(std::string(who) + ": tensor " + std::to_string(i) + " has " + std::to_string(r.count) +
                         " elements, more than one launch can cover; "
                         "split it into several segments");
    if (tab.n == cap || tab.block_begin[tab.n] + chunks > detail::max_blocks) flush();
    for (int k = 0; k < lists; ++k) tab.ptr[tab.n][k] = r.p[k];
    tab.count[tab.n] = r.count;
    if constexpr (Op::stepped) tab.step[tab.n] = r.step;
    tab.block_begin[tab.n + 1] = tab.block_begin[tab.n] + static_cast<unsigned>(chunks);
    ++tab.n;
  }
  flush();
  return tab.chunk_base;
}

//! Throws config_error naming `who` if a segment with elements has no pointer.
inline void check_segments(std::span<const segment> segs, const char* who) {
  for (std::size_t i = 0; i < segs.size(); ++i)
    if (segs[i].count != 0 && segs[i].ptr == nullptr)
      throw config_error(std::string(who) + ": segment " + std::to_string(i) + " has " + std::to_string(segs[i].count) +
                         " elements but a null pointer");
}

}  // namespace lockstep::cuda::kernels
