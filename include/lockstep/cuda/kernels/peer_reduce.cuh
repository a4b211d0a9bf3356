#pragma once
//! lockstep's all-reduce of a buffer in a symmetric window (cuda/detail/nccl_peer.cuh): every
//! rank loads and stores its peers' windows directly (NVLink or PCIe peer access), one pass,
//! no staging. Rank r owns chunk r of the buffer: it loads that chunk from every rank, sums in
//! rank order in f32 (f64 for f64), multiplies by `scale` (1/N for a mean), rounds once and
//! stores the result into every rank's buffer (no other rank reads or writes chunk r, so in
//! place is safe). Two barriers, block by block, through flags in a symmetric window of their
//! own: before (every rank's input is there) and after (every rank's chunks have arrived, and
//! no rank still reads this one's buffer once the kernel ends). Every rank ends with the same
//! bits, and every run too: the order of the sum is fixed.
//!
//! A wait for a peer never hangs: it polls the communicator's abort word (pinned host memory,
//! set before ncclCommAbort) and a deadline (LOCKSTEP_TIMEOUT); either ends the kernel and
//! records why in the error word, which the host reads (nccl_peer.cuh). The blocks of one call
//! pair with the same blocks on the peers, so the grid is the same on every rank for the same
//! count (at most peer_max_blocks). No block waits for another block of its own GPU, so blocks
//! that are not yet resident only delay their partners. A call after one that gave up returns
//! at once: the communicator is broken from then on.
//!
//! The order check rides along (deferred mode): block 0 writes the call's seal into every
//! rank's seal slots (after the flags) ahead of its first barrier and, past it, copies the
//! slots (every rank's seal) to the host's pinned words, then sets the word after them, so
//! that the check needs neither a collective nor a copy of its own and can compare as soon as
//! block 0 is past its first barrier (cuda/detail/nccl_peer.cuh). A peer's next sealed call
//! cannot overwrite the slots before that: it passes this call's second barrier first.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "lockstep/core/dtype.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/access.cuh"

namespace lockstep::cuda::kernels {

constexpr int peer_max_ranks = 8;
constexpr int peer_max_blocks = 128;
//! The grid's cap for 4- and 8-byte elements unless LOCKSTEP_PEER_BLOCKS says otherwise; twice
//! that for 2-byte ones, which convert twice as many elements per byte. Few blocks leave the
//! SMs to the backward a bucket overlaps and still carry 1–256 MiB alone at NVLink speed
//! (bench/RESULTS.md, session 26).
constexpr int peer_default_blocks = 16;
constexpr int peer_threads = 512;
//! Per-block call counters, then one word: nonzero once a call on this communicator gave up.
constexpr std::size_t peer_epoch_words = peer_max_blocks + 1;
//! Signal slots a rank holds: one per (block, sending rank).
constexpr std::size_t peer_signal_slots = static_cast<std::size_t>(peer_max_blocks) * peer_max_ranks;
//! Room for one seal of the order check (comm/order_check.hpp's order_words fit).
constexpr std::size_t peer_seal_words = 24;
//! The seal slots after the signal slots: [sending rank][seal words].
constexpr std::size_t peer_seal_slot_words = peer_max_ranks * peer_seal_words;
//! The flags window's bytes: signal slots, then seal slots.
constexpr std::size_t peer_window_bytes =
    peer_signal_slots * sizeof(unsigned) + peer_seal_slot_words * sizeof(std::int64_t);
static_assert(peer_signal_slots * sizeof(unsigned) % sizeof(std::int64_t) == 0, "seal slots are 8-byte aligned");

//! The seal slots of the flags window that starts at `flags` (any rank's).
__device__ __forceinline__ std::int64_t* peer_seal_slots(unsigned* flags) {
  return reinterpret_cast<std::int64_t*>(flags + peer_signal_slots);
}

//! What one call reads and writes. data[q] and flags[q] are rank q's window bases as this rank
//! addresses them (its own at [rank]); the buffer lies at the same offsets in every rank's window.
struct peer_reduce_args {
  char* data[peer_max_ranks] = {};
  unsigned* flags[peer_max_ranks] = {};
  unsigned* epochs = nullptr;     //!< this rank's peer_epoch_words (device memory)
  volatile int* abort = nullptr;  //!< nonzero: the communicator was aborted (mapped host memory)
  volatile int* error = nullptr;  //!< set on giving up: -1 aborted, 1 + q waiting for rank q (mapped)
  std::size_t send_off = 0, recv_off = 0, count = 0;
  std::size_t chunk = 0;  //!< elements a rank owns (the last rank's may be fewer)
  int rank = 0, ranks = 0;
  double scale = 1.0;  //!< in the compute type: float(1/N) for f32 and halves, 1/N for f64
  unsigned long long timeout_ns = 0;
  int max_blocks = peer_default_blocks;  //!< the grid's cap for 4-byte elements (the same on every rank)
  //! The order check's seal of this call: seal_words words (0: none), delivered into word
  //! rank · seal_words of every rank's seal slots; every rank's, in rank order, then go to
  //! seal_out (pinned host memory), and 1 to the word after them.
  std::int64_t seal[peer_seal_words] = {};
  int seal_words = 0;
  std::int64_t* seal_out = nullptr;
};

namespace peer_detail {

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread q's part of delivering the seal: into rank q's slots (its own too).
__device__ __forceinline__ void deliver_seal(const peer_reduce_args& a, int q) {
  std::int64_t* to = peer_seal_slots(a.flags[q]) + a.rank * a.seal_words;
  for (int i = 0; i < a.seal_words; ++i) to[i] = a.seal[i];
}

// Block b of this rank meets block b of every peer at `epoch` (the block's counter, the same on
// every rank). Thread q < ranks tells rank q and waits for it; with `seal`, it first delivers
// the seal to rank q. False (the same in every thread of the block) when a wait gave up.
__device__ bool meet(const peer_reduce_args& a, unsigned epoch, volatile int& gave_up, bool seal) {
  __syncthreads();  // the block's loads and stores so far are done
  const int q = static_cast<int>(threadIdx.x);
  if (seal && q == a.rank) deliver_seal(a, q);
  if (q < a.ranks && q != a.rank) {
    if (seal) deliver_seal(a, q);
    __threadfence_system();
    store_release(a.flags[q] + blockIdx.x * peer_max_ranks + a.rank, epoch);
    const unsigned* mine = a.flags[a.rank] + blockIdx.x * peer_max_ranks + q;
    const unsigned long long start = now_ns();
    for (unsigned spin = 1; static_cast<int>(load_acquire(mine) - epoch) < 0; ++spin) {
      if ((spin & 255u) != 0) continue;
      if (gave_up) break;
      if (*a.abort != 0) {
        *a.error = -1;
        gave_up = 1;
      } else if (now_ns() - start > a.timeout_ns) {
        *a.error = 1 + q;
        gave_up = 1;
      }
      // Later calls on this communicator must not pair with a peer's older ones (this block's
      // counter did not advance): they return at once (the host reports the failure).
      if (gave_up) *static_cast<volatile unsigned*>(a.epochs + peer_max_blocks) = 1;
    }
  }
  __syncthreads();
  return gave_up == 0;
}

// Chunk q as this thread walks it: groups of V elements (U groups a stride apart at a time,
// so that each thread has U loads in flight per rank), then the tail one by one.
template <int V, class F>
__device__ __forceinline__ void walk(const peer_reduce_args& a, int q, F&& f) {
  constexpr int U = 4;
  const std::size_t lo = std::min(static_cast<std::size_t>(q) * a.chunk, a.count);
  const std::size_t hi = std::min(lo + a.chunk, a.count);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t me = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t groups = (hi - lo) / V;
  std::size_t i = me;
  for (; i + (U - 1) * stride < groups; i += U * stride) f.template run<V, U>(lo + i * V, stride * V);
  for (; i < groups; i += stride) f.template run<V, 1>(lo + i * V, 0);
  for (std::size_t j = lo + groups * V + me; j < hi; j += stride) f.template run<1, 1>(j, 0);
}

// Elements at+u·step (u < U, N each) of every rank's send, summed in rank order, scaled,
// rounded once and stored into every rank's recv.
template <class Element>
struct reduce_and_push {
  const peer_reduce_args& a;
  template <int N, int U>
  __device__ __forceinline__ void run(std::size_t at, std::size_t step) const {
    using tr = element_traits<Element>;
    using S = storage_of<Element>;
    using C = compute_of<Element>;
    C acc[U][N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const auto x = load_pack<N, S>(a.data[0] + a.send_off, at + u * step);
#pragma unroll
      for (int k = 0; k < N; ++k) acc[u][k] = tr::to_compute(x.v[k]);
    }
    for (int q = 1; q < a.ranks; ++q) {
      pack_of<S, N> x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = load_pack<N, S>(a.data[q] + a.send_off, at + u * step);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < N; ++k) acc[u][k] += tr::to_compute(x[u].v[k]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      pack_of<S, N> out;
#pragma unroll
      for (int k = 0; k < N; ++k) out.v[k] = tr::to_storage(acc[u][k] * static_cast<C>(a.scale));
      for (int q = 0; q < a.ranks; ++q) store_pack<N>(a.data[q] + a.recv_off, at + u * step, out);
    }
  }
};

template <class Element, int V>
__global__ void __launch_bounds__(peer_threads) all_reduce(peer_reduce_args a) {
  __shared__ unsigned base;
  __shared__ volatile int gave_up;
  if (threadIdx.x == 0) {
    base = a.epochs[blockIdx.x];
    gave_up = static_cast<volatile unsigned*>(a.epochs)[peer_max_blocks] != 0;  // an earlier call gave up
  }
  __syncthreads();  // base is read below as meet()'s argument, before meet()'s own barrier
  const bool seal = blockIdx.x == 0 && a.seal_words > 0;
  if (gave_up || !meet(a, base + 1, gave_up, seal)) return;
  if (seal) {  // every rank's seal has arrived: to the host, then the word that says so
    const std::int64_t* slots = peer_seal_slots(a.flags[a.rank]);
    const int words = a.ranks * a.seal_words;
    for (int i = static_cast<int>(threadIdx.x); i < words; i += peer_threads) a.seal_out[i] = slots[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) *static_cast<volatile std::int64_t*>(a.seal_out + words) = 1;
  }
  walk<V>(a, a.rank, reduce_and_push<Element>{a});
  if (!meet(a, base + 2, gave_up, false)) return;
  if (threadIdx.x == 0) a.epochs[blockIdx.x] = base + 2;
}

}  // namespace peer_detail

//! The element types the peer kernel reduces (f16 and bf16 are summed in f32).
inline bool peer_reducible(dtype t) {
  return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16 || t == dtype::f64;
}

//! Queues the all-reduce of `a` (count elements of t; chunk is set here) on stream s.
inline void peer_all_reduce(peer_reduce_args a, dtype t, cudaStream_t s) {
  if (a.count == 0) return;
  visit_float(t, "the peer all-reduce", [&](auto id) {
    using Element = typename decltype(id)::type;
    constexpr int V = static_cast<int>(16 / sizeof(storage_of<Element>));
    const std::size_t per = (a.count + static_cast<std::size_t>(a.ranks) - 1) / static_cast<std::size_t>(a.ranks);
    a.chunk = (per + V - 1) / V * V;
    const bool vec = a.send_off % 16 == 0 && a.recv_off % 16 == 0;
    const std::size_t items = vec ? a.chunk / V : a.chunk;
    const int wide = sizeof(storage_of<Element>) == 2 ? 2 : 1;
    const auto cap = static_cast<std::size_t>(std::clamp(a.max_blocks * wide, 1, peer_max_blocks));
    const auto blocks =
        static_cast<unsigned>(std::clamp<std::size_t>((items + peer_threads - 1) / peer_threads, 1, cap));
    if (vec) peer_detail::all_reduce<Element, V><<<blocks, peer_threads, 0, s>>>(a);
    else peer_detail::all_reduce<Element, 1><<<blocks, peer_threads, 0, s>>>(a);
  });
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace lockstep::cuda::kernels
