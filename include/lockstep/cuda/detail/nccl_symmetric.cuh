#pragma once
//! NCCL's symmetric kernels (2.27+) for lockstep's all-reduces: when both buffers of an
//! all-reduce lie in a window registered with NCCL_WIN_COLL_SYMMETRIC, NCCL reduces with
//! kernels that load and store straight from the peers' windows (no ring through staging
//! buffers): 1.3-2.1x faster at 1-16 MiB. They reduce only with ncclSum (ncclAvg becomes a
//! pre-multiplied sum, which they do not take before NCCL 2.30), so a mean in a window runs
//! as their sum, then ×1/N on the communication stream. Their multimem variants need NVLink
//! multicast; with NCCL_NVLS_ENABLE=0 (lockstep's rule) NCCL picks the load/store ones.
//! Whether the group can use them is decided once, the same on every rank (local_verdict,
//! agreed by NcclComm::symmetric_kernels()): NCCL gives no way to ask, and a window it cannot
//! use that way registers silently as a plain one.
//! Failures: ncclCommAbort does not end a symmetric kernel that waits for a dead peer
//! (measured with NCCL 2.28.3 on 4 x H200: the survivors' kernels kept spinning). With one
//! process per GPU, run(Processes)'s watchdog then ends the process after its grace period
//! (watchdog_options::grace, 5 s), naming the cause; a process driving several GPUs would
//! hang, so create_local() groups never use them.

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/detail/nccl_peer.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/detail/nccl_window.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/memory_ops.cuh"
#include "lockstep/cuda/memory.cuh"
#include "lockstep/detail/checksum.hpp"

namespace lockstep::detail {

struct symmetric_verdict {
  bool ok = false;
  std::string why;        //!< what rules them out here, or what was checked
  std::int64_t host = 0;  //!< this rank's host name, hashed (the group must share one host)
};

//! What this rank can tell alone: NCCL's version at run time, NCCL_WIN_ENABLE and
//! NCCL_CUMEM_ENABLE, peer access from its device to every GPU it sees (NCCL's condition:
//! every pair connected by NVLink or PCIe peer access; such GPUs have the CUDA virtual memory
//! ncclMemAlloc needs).
inline symmetric_verdict local_verdict(int device) {
  symmetric_verdict v;
  char name[256] = {};
  (void)::gethostname(name, sizeof name - 1);
  fnv1a64 h;
  h.update(name, std::string_view(name).size());
  v.host = static_cast<std::int64_t>(h.value() >> 1);
#if LOCKSTEP_NCCL_COPY_ENGINE
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version < NCCL_VERSION(2, 28, 0)) {
    v.why = "the NCCL loaded at run time is " + std::to_string(version) + "; lockstep uses its windows from 2.28";
    return v;
  }
  for (const char* var : {"NCCL_WIN_ENABLE", "NCCL_CUMEM_ENABLE"})
    if (const char* e = std::getenv(var); e != nullptr && std::string_view(e) == "0") {
      v.why = std::string(var) + "=0 turns NCCL's windows off";
      return v;
    }
  int count = 0;
  (void)cudaGetDeviceCount(&count);
  for (int other = 0; other < count; ++other) {
    int peer = 1;
    if (other != device && (cudaDeviceCanAccessPeer(&peer, device, other) != cudaSuccess || !peer)) {
      (void)cudaGetLastError();
      v.why = "GPUs " + std::to_string(device) + " and " + std::to_string(other) +
              " cannot map each other's memory (no NVLink or PCIe peer access)";
      return v;
    }
  }
  v.ok = true;
  v.why = "NCCL " + std::to_string(version) + ", every rank on one host, GPUs peer-connected";
#else
  (void)device;
  v.why = "lockstep was built against an NCCL older than 2.28 (no windows)";
#endif
  return v;
}

//! Whether an all-reduce of send → recv that lockstep's peer kernel does not take (peer_args)
//! goes to NCCL's symmetric kernels: the group can use them, a sum or mean, both buffers
//! inside windows of s, f32 or bf16.
inline bool symmetric_reducible(nccl_state& s, const void* send, const void* recv, std::size_t count, dtype t,
                                reduce_op op) {
#if LOCKSTEP_NCCL_COPY_ENGINE
  if (s.symmetric != 1 || s.comm == nullptr || s.size < 2) return false;
  if (op != reduce_op::sum && op != reduce_op::avg) return false;
  const std::size_t bytes = count * size_of(t);
  if (!in_window(s, send, bytes) || (recv != send && !in_window(s, recv, bytes))) return false;
  // Not f16: their sum of N ranks' values can overflow where ncclAvg's pre-divided one does
  // not (the peer kernel sums in f32).
  return t == dtype::f32 || t == dtype::bf16;
#else
  (void)s, (void)send, (void)recv, (void)count, (void)t, (void)op;
  return false;
#endif
}

//! The all-reduce of symmetric_reducible() buffers, queued on `stream`: NCCL's sum (its
//! symmetric kernels), then ×1/N for a mean.
inline void symmetric_all_reduce(nccl_state& s, const void* send, void* recv, std::size_t count, dtype t, reduce_op op,
                                 cudaStream_t stream) {
  LOCKSTEP_TRY_NCCL(ncclAllReduce(send, recv, count, to_nccl(t), ncclSum, s.comm, stream));
  if (op == reduce_op::avg) cuda::kernels::scale(recv, count, t, 1.0 / static_cast<double>(s.size), stream);
}

//! The minimum over comm's group of `n` int64 values (in place): the agreements below.
template <class Comm>
void agree_min(Comm& comm, std::int64_t* v, std::size_t n, const char* label) {
  const CudaMemory mem = comm.memory();
  auto buf = mem.allocate(n * sizeof *v);
  mem.upload(buf.get(), v, n * sizeof *v);
  comm.label_next(label);
  comm.all_reduce(buf.get(), buf.get(), n, dtype::i64, reduce_op::min).synchronize();
  mem.download(v, buf.get(), n * sizeof *v);
}

//! NcclComm::allocate_symmetric()'s window: every rank of the group agreed that windows work,
//! and one whose window did not register would reduce this memory with the ring while the
//! others wait in symmetric kernels — so the ranks agree on the registration (collective), and
//! all of them throw if any window did not register.
template <class Comm>
std::shared_ptr<void> symmetric_window(Comm& comm, const std::shared_ptr<nccl_state>& s, std::size_t bytes,
                                       cudaStream_t stream) {
#if LOCKSTEP_NCCL_COPY_ENGINE
  ncclWindow_t handle = nullptr;
  auto [p, registered] = nccl_window(s, bytes, stream, &handle);
  std::int64_t all = registered ? 1 : 0;
  agree_min(comm, &all, 1, "allocate_symmetric: every window registered");
  if (all == 0)
    throw nccl_error(s->who() + ": NCCL did not register a symmetric window of " + std::to_string(bytes) +
                     " bytes on " + (registered ? "another rank" : "this rank") +
                     ", although the group's ranks agreed that they can use them (" + s->symmetric_why +
                     "); turn BucketPolicy::symmetric_memory off");
  peer_add_window(*s, p.get(), handle, stream);
  return std::move(p);
#else
  (void)comm;
  return CudaMemory(s->device, stream).allocate(bytes);  // symmetric_kernels() is false: not reached
#endif
}

//! With the group's symmetric kernels agreed: sets up the peer kernel for buffers up to
//! `max_bytes` with grids up to `blocks` (the group's minima; max_bytes 0: `why_not`), or says
//! why not, the same on every rank.
template <class Comm>
void decide_peer(Comm& comm, nccl_state& s, std::size_t max_bytes, int blocks, const std::string& why_not) {
  if (max_bytes == 0) {
    s.symmetric_why += "; lockstep's peer all-reduce off (" + why_not + "): NCCL's symmetric kernels reduce";
    return;
  }
  std::string why_here;
  std::int64_t ready = peer_prepare(s, max_bytes, blocks, comm.compute_stream(), why_here) ? 1 : 0;
  agree_min(comm, &ready, 1, "symmetric_kernels: the peer all-reduce's flags registered");
  if (ready == 0) {
    s.peer.max_bytes = 0;
    s.symmetric_why +=
        "; lockstep's peer all-reduce off (" + (why_here.empty() ? "its setup failed on another rank" : why_here) + ")";
    return;
  }
  s.symmetric_why += "; buffers up to " + std::to_string(max_bytes >> 20) +
                     " MiB reduced by lockstep's peer all-reduce (LOCKSTEP_PEER_ALL_REDUCE_MIB; up to " +
                     std::to_string(blocks) +
                     " blocks, twice for 2-byte types: LOCKSTEP_PEER_BLOCKS), larger ones by "
                     "NCCL's symmetric kernels";
}

//! Agrees on NcclComm::symmetric_kernels() over comm's group (state s): the minimum of every
//! rank's local verdict, and one host for all (an all-reduce of {ok, host, −host} by min), and
//! the peer kernel's limits.
template <class Comm>
void decide_symmetric(Comm& comm, nccl_state& s) {
  if (s.comm == nullptr || s.size < 2) {
    s.symmetric = 0;
    s.symmetric_why = "one rank: nothing to reduce";
    return;
  }
  if (s.one_process) {  // the same on every rank of the group: no collective needed
    s.symmetric = 0;
    s.symmetric_why =
        "one process drives these GPUs (run(Gpus)): an aborted communicator does not end NCCL's symmetric kernels, "
        "so one rank's failure would hang the others; they are used with one process per GPU";
    return;
  }
  const symmetric_verdict mine = local_verdict(s.device);
  // A bad LOCKSTEP_PEER_* is thrown on every rank after the agreement, not here: the others
  // would wait for this rank in it.
  std::pair<std::size_t, std::string> peer{};
  int blocks = 1;
  std::string bad;
  try {
    if (mine.ok) peer = peer_local_limit(s);
    blocks = peer_local_blocks();
  } catch (const config_error& e) {
    bad = e.what();
  }
  const auto& [peer_max, peer_why] = peer;
  std::int64_t v[6] = {mine.ok ? 1 : 0, mine.host,          -mine.host, static_cast<std::int64_t>(peer_max),
                       blocks,          bad.empty() ? 1 : 0};
  agree_min(comm, v, 6, "symmetric_kernels: the group's verdict");
  if (v[5] == 0)
    throw config_error(bad.empty() ? "another rank's LOCKSTEP_PEER_ALL_REDUCE_MIB or LOCKSTEP_PEER_BLOCKS is not "
                                     "valid (its error says why): give every rank valid, equal settings"
                                   : bad);
  s.symmetric = 0;
  if (!mine.ok) s.symmetric_why = mine.why;
  else if (v[0] == 0) s.symmetric_why = "another rank cannot use them (its lockstep-info says why)";
  else if (v[1] != -v[2])
    s.symmetric_why = "the ranks are on more than one host (NCCL's symmetric kernels work within one)";
  else {
    s.symmetric = 1;
    s.symmetric_why = mine.why;
    decide_peer(comm, s, static_cast<std::size_t>(v[3]), static_cast<int>(v[4]),
                peer_max == 0 ? peer_why : "another rank's limit");
  }
}

}  // namespace lockstep::detail
