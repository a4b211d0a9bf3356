#pragma once
//! The host side of lockstep's peer all-reduce (the kernel, and how it reduces and waits:
//! cuda/kernels/peer_reduce.cuh). A group whose symmetric_kernels() holds reduces buffers in its
//! symmetric windows with it up to a size (LOCKSTEP_PEER_ALL_REDUCE_MIB, default
//! peer_default_mib; 0 turns it off), and with NCCL's symmetric kernels above. NCCL's device
//! API (2.28) gives each rank its peers' window addresses (ncclGetPeerPointer: every rank of
//! the group must be in NCCL's load/store-accessible team). Set up once, agreed by every rank:
//! the flags' window registers, or no rank uses the kernel; the grid's cap
//! (LOCKSTEP_PEER_BLOCKS, default peer_default_blocks) is the group's smallest. The kernel
//! carries the order check's seal of its call (deferred mode), so that the check adds no
//! collective to it (nccl_order.cuh's carried_seal).

#include <cuda_runtime_api.h>
#include <nccl.h>
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#include <nccl_device.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <optional>
#include <string>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/detail/nccl_order.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/detail/nccl_window.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/peer_reduce.cuh"

namespace lockstep::detail {

//! Buffers up to this many MiB go to the peer kernel by default (bench/RESULTS.md, session 25).
constexpr std::size_t peer_default_mib = 1024;

//! The grid's cap this rank asks for (LOCKSTEP_PEER_BLOCKS; the group takes the smallest).
inline int peer_local_blocks() {
  return static_cast<int>(
      env_between("LOCKSTEP_PEER_BLOCKS", 1, cuda::kernels::peer_max_blocks, "blocks (the peer all-reduce's grid cap)")
          .value_or(cuda::kernels::peer_default_blocks));
}

//! The largest buffer this rank would reduce with the peer kernel, or 0 and why not.
inline std::pair<std::size_t, std::string> peer_local_limit(const nccl_state& s) {
  const auto mib = static_cast<std::size_t>(
      env_between("LOCKSTEP_PEER_ALL_REDUCE_MIB", 0, 1l << 30, "MiB (0 turns lockstep's peer all-reduce off)")
          .value_or(static_cast<long>(peer_default_mib)));
  if (mib == 0) return {0, "LOCKSTEP_PEER_ALL_REDUCE_MIB=0"};
  if (s.size > cuda::kernels::peer_max_ranks)
    return {0, std::to_string(s.size) + " ranks (it reduces over at most " +
                   std::to_string(cuda::kernels::peer_max_ranks) + ")"};
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  const ncclTeam_t lsa = ncclTeamLsa(s.comm);
  if (lsa.nRanks != s.size)
    return {0, "NCCL maps the windows of " + std::to_string(lsa.nRanks) + " of the group's " + std::to_string(s.size) +
                   " ranks into this one"};
  return {mib << 20, {}};
#else
  return {0, "NCCL older than 2.28"};
#endif
}

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)

// out[q] ← rank q's base of window w as this rank addresses it.
__global__ void peer_window_bases(ncclWindow_t w, int ranks, char** out) {
  for (int q = 0; q < ranks; ++q) out[q] = static_cast<char*>(ncclGetPeerPointer(w, 0, q));
}

inline std::array<char*, cuda::kernels::peer_max_ranks> peer_bases(nccl_state& s, ncclWindow_t w, cudaStream_t stream) {
  const CudaMemory mem(s.device, stream);
  auto dev = mem.allocate(sizeof(char*) * cuda::kernels::peer_max_ranks);
  peer_window_bases<<<1, 1, 0, stream>>>(w, s.size, static_cast<char**>(dev.get()));
  LOCKSTEP_CHECK_LAUNCH();
  std::array<char*, cuda::kernels::peer_max_ranks> out{};
  mem.download(out.data(), dev.get(), sizeof(char*) * static_cast<std::size_t>(s.size));
  return out;
}

//! Opens window w at p (one nccl_window recorded) to the peer kernel: every rank's base of it.
inline void peer_add_window(nccl_state& s, void* p, ncclWindow_t w, cudaStream_t stream) {
  if (s.peer.max_bytes == 0 || w == nullptr) return;
  const auto bases = peer_bases(s, w, stream);
  std::lock_guard wl(s.windows_m);
  for (auto& e : s.windows)
    if (e.start == reinterpret_cast<std::uintptr_t>(p)) e.bases = bases;
}

//! This rank's part of the setup (collective: the flags' window): false if it could not be
//! made here (the caller agrees with the others).
inline bool peer_prepare(nccl_state& s, std::size_t max_bytes, int blocks, cudaStream_t stream, std::string& why_not) {
  static_assert(order_words <= cuda::kernels::peer_seal_words, "a seal fits the peer kernel's slots");
  auto& p = s.peer;
  std::size_t bytes = cuda::kernels::peer_window_bytes;
  const auto [mem, win] = nccl_window_raw(s, bytes, "BucketPolicy::symmetric_memory");
  p.signal = mem;
  p.signal_window = win;  // both freed with the communicator (nccl_state::free_staging)
  if (win == nullptr) {
    why_not = "NCCL returned no window for its flags";
    return false;
  }
  try {  // past the collective registration: a failure here is this rank's, agreed on after
    LOCKSTEP_TRY_CUDA(cudaMemsetAsync(mem, 0, bytes, stream));
    const std::size_t epochs = sizeof(unsigned) * cuda::kernels::peer_epoch_words;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&p.epochs, epochs));
    LOCKSTEP_TRY_CUDA(cudaMemsetAsync(p.epochs, 0, epochs, stream));
    void* words = nullptr;
    LOCKSTEP_TRY_CUDA(cudaHostAlloc(&words, 2 * sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    p.words = static_cast<int*>(words);
    p.words[0] = p.words[1] = 0;
    void* dev = nullptr;
    LOCKSTEP_TRY_CUDA(cudaHostGetDevicePointer(&dev, words, 0));
    p.words_device = static_cast<int*>(dev);
    const auto bases = peer_bases(s, win, stream);
    for (int q = 0; q < s.size; ++q) p.flags[static_cast<std::size_t>(q)] = reinterpret_cast<unsigned*>(bases[q]);
    // The watchdog names a stuck peer LOCKSTEP_TIMEOUT + 2 s after a collective was issued
    // (a stopped peer first by its missing heartbeat): the kernel waits that long too.
    p.timeout = default_timeout() + std::chrono::seconds(2);
  } catch (const std::exception& e) {
    why_not = std::string("its setup failed on a rank: ") + e.what();
    return false;
  }
  p.max_bytes = max_bytes;
  p.blocks = blocks;
  return true;
}

//! The kernel's arguments for an all-reduce of send → recv, if the peer kernel takes it: set
//! up, a sum or mean of a type it reduces, 1 to max_bytes, both buffers in one window.
inline std::optional<cuda::kernels::peer_reduce_args> peer_args(nccl_state& s, const void* send, const void* recv,
                                                                std::size_t count, dtype t, reduce_op op) {
  const std::size_t bytes = count * size_of(t);
  if (s.peer.max_bytes == 0 || count == 0 || bytes > s.peer.max_bytes || !cuda::kernels::peer_reducible(t) ||
      (op != reduce_op::sum && op != reduce_op::avg))
    return std::nullopt;
  const auto a = reinterpret_cast<std::uintptr_t>(send), b = reinterpret_cast<std::uintptr_t>(recv);
  std::lock_guard wl(s.windows_m);
  for (const auto& w : s.windows) {
    if (w.bases[0] == nullptr) continue;  // not opened to the peer kernel
    auto inside = [&](std::uintptr_t x) { return x >= w.start && x + bytes <= w.start + w.bytes; };
    if (!inside(a) || !inside(b)) continue;
    cuda::kernels::peer_reduce_args r;
    for (int q = 0; q < s.size; ++q) {
      r.data[q] = w.bases[static_cast<std::size_t>(q)];
      r.flags[q] = s.peer.flags[static_cast<std::size_t>(q)];
    }
    r.epochs = s.peer.epochs;
    r.abort = s.peer.words_device;
    r.error = s.peer.words_device + 1;
    r.send_off = a - w.start;
    r.recv_off = b - w.start;
    r.count = count;
    r.rank = s.rank;
    r.ranks = s.size;
    r.scale = op == reduce_op::avg ? 1.0 / static_cast<double>(s.size) : 1.0;
    r.timeout_ns = static_cast<unsigned long long>(s.peer.timeout.count()) * 1000000ull;
    r.max_blocks = s.peer.blocks;
    return r;
  }
  return std::nullopt;
}

//! Queues the peer all-reduce `a` of t on stream; with `seal` (nccl_check_order's words for
//! it), the kernel delivers them and the check compares what every rank's kernel delivered.
inline void peer_all_reduce(nccl_state& s, cuda::kernels::peer_reduce_args a, const std::optional<seal_words>& seal,
                            dtype t, cudaStream_t stream) {
  if (!seal) return cuda::kernels::peer_all_reduce(a, t, stream);
  carried_seal carried(s, *seal);
  std::copy(seal->begin(), seal->end(), a.seal);
  a.seal_words = static_cast<int>(order_words);
  a.seal_out = carried.gathered();
  carried.launching();
  cuda::kernels::peer_all_reduce(a, t, stream);
  carried.queued(stream);
}

#else

inline void peer_add_window(nccl_state&, void*, void*, cudaStream_t) {}
inline bool peer_prepare(nccl_state&, std::size_t, int, cudaStream_t, std::string&) { return false; }
inline std::optional<cuda::kernels::peer_reduce_args> peer_args(nccl_state&, const void*, const void*, std::size_t,
                                                                dtype, reduce_op) {
  return std::nullopt;
}
inline void peer_all_reduce(nccl_state&, const cuda::kernels::peer_reduce_args&, const std::optional<seal_words>&,
                            dtype, cudaStream_t) {}

#endif

}  // namespace lockstep::detail
