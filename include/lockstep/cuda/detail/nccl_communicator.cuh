#pragma once
//! NcclComm — a lockstep::communicator over NCCL: one object per rank, one rank per GPU.
//! (The class. Include lockstep/cuda/nccl_comm.cuh: it brings the wires' device paths too.)
//!
//! Streams. Each communicator has these streams on its device:
//!  - the *compute* stream, where the model's kernels run (a stream of its own by default;
//!    hand yours in with set_compute_stream()). memory() works on it.
//!  - the *communication* stream (non-blocking, highest priority), where NCCL runs;
//!  - the *aside* stream, for kernels after a transfer (enqueue_aside; cuda/detail/nccl_aside.cuh).
//! A collective records an event on the compute stream, makes the communication stream wait
//! for it (so it sees every gradient computed so far), runs NCCL there and records a
//! completion event. The returned work's wait() makes the compute stream wait for that event:
//! no host synchronisation anywhere, so later backward kernels overlap the communication.
//!
//! Threads. One host thread per rank: every rank's collectives must be issued concurrently
//! (from different threads, or different processes), because NCCL's kernels wait for their
//! peers. A communicator must not be used by two threads at once. Every method makes the
//! communicator's device current for its duration and restores the caller's device, so a
//! thread need not call cudaSetDevice itself (lockstep's DataParallel gives each device its
//! own thread). The exception is abort(), which any thread may call at any time (e.g. a
//! watchdog) to release a rank blocked on a peer that died.
//!
//! Failures. Calls that fail throw cuda_error / nccl_error naming the call, file:line and
//! NCCL's or CUDA's reason; misuse (bad root, unknown device) throws config_error. After a
//! rank fails, call abort() on every communicator of the group before destroying them:
//! destroying a communicator whose peers stopped waits for them up to LOCKSTEP_TIMEOUT.
//!
//! Example (one process, all its GPUs):
//! \code
//!   std::vector<int> devices{0, 1, 2, 3};
//!   auto comms = lockstep::NcclComm::create_local(devices);
//!   // on thread r: auto w = comms[r].all_reduce(g, g, n, lockstep::dtype::f32,
//!   //                                           lockstep::reduce_op::avg);
//!   //              w.wait();   // later kernels on comms[r].compute_stream() see the average
//! \endcode

#include <cstdint>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "lockstep/comm/collective.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/detail/nccl_costs.cuh"
#include "lockstep/cuda/detail/nccl_control.cuh"
#include "lockstep/cuda/detail/nccl_handle.cuh"
#include "lockstep/cuda/detail/nccl_marker.cuh"
#include "lockstep/cuda/detail/nccl_order.cuh"
#include "lockstep/cuda/detail/nccl_peer.cuh"
#include "lockstep/cuda/detail/nccl_regroup.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/detail/nccl_symmetric.cuh"
#include "lockstep/cuda/detail/nccl_window.cuh"
#include "lockstep/cuda/detail/nccl_work.cuh"
#include "lockstep/cuda/error.cuh"
// The grad_ops of its memory space come with it: a DataParallel over NcclComm with a loss
// scaler or clipping needs them, and a body written for run(Auto) names no CUDA header.
#include "lockstep/cuda/grad_ops.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep {

class NcclComm : private detail::nccl_control {
 public:
  // Failure handling and the order check (cuda/detail/nccl_control.cuh).
  using nccl_control::abort;
  using nccl_control::aborted;
  using nccl_control::check_async_error;
  using nccl_control::label_next;
  using nccl_control::order_check;
  using nccl_control::order_failure;
  using nccl_control::overdue;
  using nccl_control::track_collectives;
  using nccl_control::tracked_launch;
  using nccl_control::verify_order;

  //! The handle of one collective in flight (cuda/detail/nccl_work.cuh).
  using work = detail::nccl_work;
  using work_type = work;

  // --------------------------------------------------------------------------------------
  //! One process driving several local GPUs: element r is rank r, on devices[r]. Hand each
  //! element to its own host thread. Devices must be distinct and visible.
  static std::vector<NcclComm> create_local(std::span<const int> devices) {
    std::vector<ncclComm_t> raw = detail::nccl_init_local(devices);
    const int n = static_cast<int>(raw.size());
    std::vector<NcclComm> out;
    std::size_t adopted = 0;  // raw[0, adopted) belong to `out` (or were destroyed by it)
    try {
      out.reserve(static_cast<std::size_t>(n));
      for (; adopted < raw.size(); ++adopted) {
        const auto r = static_cast<int>(adopted);
        ncclComm_t c = std::exchange(raw[adopted], nullptr);
        out.push_back(NcclComm(adopt_tag{}, c, r, n, devices[adopted]));
        out.back().s_->one_process = true;
      }
    } catch (...) {
      for (std::size_t j = adopted; j < raw.size(); ++j)
        if (raw[j] != nullptr) detail::nccl_destroy(raw[j], devices[j]);
      throw;
    }
    return out;
  }
  static std::vector<NcclComm> create_local(std::initializer_list<int> devices) {
    return create_local(std::span<const int>(devices.begin(), devices.size()));
  }

  //! One process (or thread) per GPU: rank `rank` of `world`, on `device`. Every rank calls
  //! this with the same id (from ncclGetUniqueId on one rank, shared out of band); it returns
  //! once all `world` ranks have joined.
  NcclComm(const ncclUniqueId& id, int rank, int world, int device)
      : NcclComm(adopt_tag{}, detail::nccl_init_rank(id, rank, world, device), rank, world, device) {}

  NcclComm(NcclComm&&) noexcept = default;
  NcclComm& operator=(NcclComm&&) noexcept = default;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  //! ncclCommDestroy (unless aborted), then the streams and events. Never throws. A collective
  //! still running is waited for, at most LOCKSTEP_TIMEOUT; then, or if the family was aborted
  //! meanwhile, ncclCommAbort ends it (a peer that never issues it would hold ncclCommDestroy).
  ~NcclComm() = default;

  // --------------------------------------------------------------------------------------
  int rank() const noexcept { return s_ ? s_->rank : -1; }
  int size() const noexcept { return s_ ? s_->size : 0; }
  int device() const noexcept { return s_ ? s_->device : -1; }
  cudaStream_t comm_stream() const noexcept { return s_ ? s_->comm_stream : nullptr; }
  cudaStream_t compute_stream() const noexcept { return s_ ? s_->compute_stream() : nullptr; }
  //! The raw NCCL communicator, for calls lockstep does not wrap. Stays owned by this object.
  //! nullptr for a group of one rank from create_local or the constructor: lockstep makes no
  //! NCCL communicator there (it would hold half a GiB of device buffers for nothing).
  ncclComm_t raw() const noexcept { return s_ ? s_->comm : nullptr; }

  //! Use `stream` (a stream of device(); nullptr = the legacy default stream) as the compute
  //! stream from now on: collectives wait for the work queued on it, and work::wait() and
  //! memory() order on it. The stream must outlive its use here. Communicators split from this
  //! one follow it, unless they were given their own.
  void set_compute_stream(cudaStream_t stream) {
    state& s = live("set_compute_stream");
    s.compute = stream;
    s.follows_parent = false;
  }

  //! Device memory operations, ordered on the compute stream.
  CudaMemory memory() const noexcept { return CudaMemory(device(), compute_stream()); }

  // --------------------------------------------------------------------------------------
  // Collectives: device pointers, counts in elements of t. Every rank must issue the same
  // collectives in the same order with the same counts, types and ops.

  //! recv[i] = op over ranks of send[i]; send == recv is in place. avg is NCCL's ncclAvg —
  //! except for f32/bf16 buffers in allocate_symmetric() windows of a group whose
  //! symmetric_kernels() holds: NCCL's symmetric kernels sum them, then ×1/N.
  work all_reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    state& s = live("all_reduce");
    // lockstep's peer kernel where it takes the buffers (cuda/detail/nccl_peer.cuh): it carries
    // the order check's seal too.
    const auto peer = detail::peer_args(s, send, recv, count, t, op);
    std::optional<detail::seal_words> seal;
    const collective c = detail::nccl_check_order(s, collective::all_reduce(count, t, op), peer ? &seal : nullptr);
    if (count == 0) return {};
    detail::nccl_require(send, "send", "all_reduce");
    detail::nccl_require(recv, "recv", "all_reduce");
    const auto touched = {device_range{send, count * size_of(t)}, device_range{recv, count * size_of(t)}};
    if (peer) return issue(s, c, touched, [&](cudaStream_t cs) { detail::peer_all_reduce(s, *peer, seal, t, cs); });
    if (detail::symmetric_reducible(s, send, recv, count, t, op))  // cuda/detail/nccl_symmetric.cuh
      return issue(s, c, touched,
                   [&](cudaStream_t cs) { detail::symmetric_all_reduce(s, send, recv, count, t, op, cs); });
    const ncclDataType_t nt = to_nccl(t);
    const ncclRedOp_t nop = detail::nccl_reduction(s, op);
    return issue(s, c, touched, [&](cudaStream_t cs) {
      if (!s.comm) return detail::nccl_local(send, recv, count * size_of(t), cs);
      LOCKSTEP_TRY_NCCL(ncclAllReduce(send, recv, count, nt, nop, s.comm, cs));
    });
  }

  //! buf on every rank ← buf on `root`.
  work broadcast(void* buf, std::size_t count, dtype t, int root) {
    state& s = live("broadcast");
    if (root < 0 || root >= s.size)
      throw config_error("NcclComm::broadcast: root " + std::to_string(root) + " is not a rank of this group of " +
                         std::to_string(s.size));
    const collective c = detail::nccl_check_order(s, collective::broadcast(count, t, root));
    if (count == 0) return {};
    detail::nccl_require(buf, "buf", "broadcast");
    const ncclDataType_t nt = to_nccl(t);
    return issue(s, c, {{buf, count * size_of(t)}}, [&](cudaStream_t cs) {
      if (s.comm) LOCKSTEP_TRY_NCCL(ncclBroadcast(buf, buf, count, nt, root, s.comm, cs));
    });
  }

  //! recv (size()·count elements) ← every rank's send, rank r's at r·count. In place when
  //! send == recv + rank()·count.
  work all_gather(const void* send, void* recv, std::size_t count, dtype t) {
    state& s = live("all_gather");
    const collective c = detail::nccl_check_order(s, collective::all_gather(count, t));
    if (count == 0) return {};
    detail::nccl_require(send, "send", "all_gather");
    detail::nccl_require(recv, "recv", "all_gather");
    const ncclDataType_t nt = to_nccl(t);
    const std::size_t b = count * size_of(t);
    return issue(s, c, {{send, b}, {recv, b * static_cast<std::size_t>(s.size)}}, [&](cudaStream_t cs) {
      if (!s.comm) return detail::nccl_local(send, recv, b, cs);
      LOCKSTEP_TRY_NCCL(ncclAllGather(send, recv, count, nt, s.comm, cs));
    });
  }

  //! Block j of send (count elements each, size() blocks) goes to rank j; block i of recv comes
  //! from rank i. Not in place. (NcclComm only: the bf16 wire's transport.)
  work all_to_all(const void* send, void* recv, std::size_t count, dtype t) {
    state& s = live("all_to_all");
    const collective c = detail::nccl_check_order(s, collective::all_to_all(count, t));
    if (count == 0) return {};
    detail::nccl_require(send, "send", "all_to_all");
    detail::nccl_require(recv, "recv", "all_to_all");
    const ncclDataType_t nt = to_nccl(t);
    const std::size_t b = count * size_of(t) * static_cast<std::size_t>(s.size);
    return issue(s, c, {{send, b}, {recv, b}}, [&](cudaStream_t cs) {
      if (!s.comm) return detail::nccl_local(send, recv, b, cs);
      LOCKSTEP_TRY_NCCL(ncclAlltoAll(send, recv, count, nt, s.comm, cs));
    });
  }

  //! A ring shift: recv ← the `count` elements that the rank `distance` places after this one
  //! (mod size()) sent; each rank's send goes once, to one rank (an ncclSend and an ncclRecv in
  //! one group). Every rank calls it with the same count and distance. Not in place.
  //! (PeerCopy's transport: each rank's optimizer part to the rank before it.)
  work shift(const void* send, void* recv, std::size_t count, dtype t, int distance) {
    state& s = live("shift");
    const collective c = detail::nccl_check_order(s, collective::shift(count, t, distance));
    if (count == 0) return {};
    detail::nccl_require(send, "send", "shift");
    detail::nccl_require(recv, "recv", "shift");
    const ncclDataType_t nt = to_nccl(t);
    const int n = s.size, d = ((distance % n) + n) % n;
    return issue(s, c, {{send, count * size_of(t)}, {recv, count * size_of(t)}}, [&](cudaStream_t cs) {
      if (!s.comm || d == 0) return detail::nccl_local(send, recv, count * size_of(t), cs);
      LOCKSTEP_TRY_NCCL(ncclGroupStart());
      const ncclResult_t to = ncclSend(send, count, nt, (s.rank - d + n) % n, s.comm, cs);
      const ncclResult_t from = ncclRecv(recv, count, nt, (s.rank + d) % n, s.comm, cs);
      const ncclResult_t end = ncclGroupEnd();  // always: a group left open would swallow the next call
      LOCKSTEP_TRY_NCCL(to);
      LOCKSTEP_TRY_NCCL(from);
      LOCKSTEP_TRY_NCCL(end);
    });
  }

  //! Queues f(stream) on the communication stream: after every collective issued so far (and
  //! all aside work) and the compute stream's work queued so far, before the next collective.
  //! The work orders the compute stream after it, like a collective's. For kernels between
  //! collectives (the wires' casts) that must not hold the compute stream. With `touched` (all
  //! the device memory f reads or writes), it waits only for the aside work that touches it.
  template <class F>
  work enqueue(F&& f) {
    return queue(live("enqueue"), {}, false, f);
  }
  template <class F>
  work enqueue(std::initializer_list<device_range> touched, F&& f) {
    return queue(live("enqueue"), touched, false, f);
  }
  //! Queues f(stream) on the communicator's aside stream (cuda/detail/nccl_aside.cuh), after
  //! everything queued on the communication stream so far: for kernels that read what a
  //! transfer brought (ShardedOptimizer::gather_wire's decodes) and that the next transfer
  //! need not wait for. `touched` must name all the device memory f reads or writes: later
  //! work on the communication stream that touches it waits for f. In a CUDA graph capture, as
  //! enqueue.
  template <class F>
  work enqueue_aside(std::initializer_list<device_range> touched, F&& f) {
    return queue(live("enqueue_aside"), touched, true, f);
  }

  //! recv (count elements) ← op over ranks of block rank() of send (size()·count elements).
  //! In place when recv == send + rank()·count. On a copy_engine_group(), a sum or mean of f32
  //! or bf16 whose send lies in an allocate_window() runs on the copy engines (an all-to-all
  //! into a staging window, then a short kernel sums the blocks in fp32, in rank order): give
  //! every rank window memory alike (each decides alone; a first use of a larger size registers
  //! a staging window, a collective, so not inside a graph capture).
  work reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    state& s = live("reduce_scatter");
    const collective c = detail::nccl_check_order(s, collective::reduce_scatter(count, t, op));
    if (count == 0) return {};
    detail::nccl_require(send, "send", "reduce_scatter");
    detail::nccl_require(recv, "recv", "reduce_scatter");
    const ncclDataType_t nt = to_nccl(t);
    const ncclRedOp_t nop = detail::nccl_reduction(s, op);
    const auto touched = {device_range{send, count * size_of(t) * static_cast<std::size_t>(s.size)},
                          device_range{recv, count * size_of(t)}};
    if (detail::copy_engine_reducible(s, send, count, t, op))  // cuda/detail/nccl_window.cuh
      return issue(s, c, touched,
                   [&](cudaStream_t cs) { detail::copy_engine_reduce_scatter(s, send, recv, count, t, op, nt, cs); });
    return issue(s, c, touched, [&](cudaStream_t cs) {
      if (!s.comm) return detail::nccl_local(send, recv, count * size_of(t), cs);
      LOCKSTEP_TRY_NCCL(ncclReduceScatter(send, recv, count, nt, nop, s.comm, cs));
    });
  }

  //! Returns (on the host) once every rank has reached the barrier and this rank's device
  //! work issued before it (compute and communication) has finished.
  void barrier() {
    state& s = live("barrier");
    // An all-reduce of one int underneath, numbered and checked as a barrier (so that the
    // order check tells it from a user's one-element sum).
    const collective c = detail::nccl_check_order(s, collective::barrier());
    work w = issue(s, c, {}, [&](cudaStream_t cs) {  // after all aside work
      if (s.comm) LOCKSTEP_TRY_NCCL(ncclAllReduce(s.barrier_buf, s.barrier_buf, 1, ncclInt32, ncclSum, s.comm, cs));
    });
    w.synchronize();
    live("barrier");  // an abort() while we waited turns into aborted_error here
  }

  //! Returns (on the host) once this rank's queued work — compute and communication — has
  //! finished; aborted_error if the communicator was aborted before or meanwhile (its
  //! collectives may then have ended early: ElasticGroup::commit).
  void synchronize() {
    state& s = live("synchronize");
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s.compute_stream()));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s.comm_stream));
    s.aside.synchronize();
    live("synchronize");
  }

  //! A communicator over the ranks that pass the same colour (≥ 0), ordered by key (ties: by
  //! rank here), by ncclCommSplit — collective over this group, every rank calls it. The new
  //! one is on the same device and orders on this one's compute stream, also one set later by
  //! set_compute_stream() here (so the model's kernels and both groups' collectives stay in
  //! order), until its own set_compute_stream() gives it another. It numbers and
  //! (LOCKSTEP_DEBUG=1) checks its collectives on its own, and shares this one's failure
  //! handling: abort(), overdue() and check_async_error() of either reach both; a split that
  //! an abort() overtakes throws aborted_error. It keeps this communicator alive.
  //! Its first collective connects its peers (NCCL_RUNTIME_CONNECT=1, NCCL's default) inside
  //! the host call, which waits for them there; overdue() names it meanwhile.
  NcclComm split(int color, int key) { return split_with(color, key, nullptr, "split"); }

  //! After the job's membership changed (lockstep::ElasticGroup, docs/elastic.md): this rank's
  //! communicator over the job ranks `members` — ascending, this rank's job rank (its rank as
  //! launched) among them, the same list on every member —, made afresh through the job's
  //! store `st` (the first member draws the NCCL id: cuda/detail/nccl_regroup.cuh) by
  //! ncclCommInitRank, which returns once every member joined. `change` numbers the change
  //! (the store's keys). This communicator is aborted first, never destroyed (a collective of
  //! the failed step may still wait for a lost peer); the new one takes its compute stream and
  //! its tracking of collectives, and is a rank's first communicator again (no splits).
  template <store S>
  NcclComm regroup(std::uint64_t change, std::span<const int> members, S& st) {
    if (!s_) throw config_error("NcclComm::regroup: this communicator was moved from");
    if (s_->parent)
      throw config_error("NcclComm::regroup: " + s_->who() +
                         " was split from another; regroup the communicator the job started with");
    abort("regrouped after a change of membership");
    NcclComm next = join(change, members, s_->job_rank, s_->device, st);
    detail::regroup_carry_over(*s_, *next.s_);
    return next;
  }
  //! The same for a process that joins the job at change `change` as job rank `job_rank`
  //! (a replacement: run(Processes) with LOCKSTEP_ELASTIC_JOIN=1), on `device`.
  template <store S>
  static NcclComm join(std::uint64_t change, std::span<const int> members, int job_rank, int device, S& st) {
    const int place = detail::regroup_place(job_rank, members, change);
    const int n = static_cast<int>(members.size());
    const ncclComm_t c =
        n > 1 ? detail::nccl_init_rank(detail::regroup_id(st, change, place), place, n, device) : nullptr;
    NcclComm next(adopt_tag{}, c, place, n, device);
    next.s_->job_rank = job_rank;
    return next;
  }

#if LOCKSTEP_NCCL_COPY_ENGINE
  //! The same ranks in a new communicator (a split, so collective) with NCCL's zero-CTA
  //! policy: its all-gathers in place into allocate_window() memory run on the GPUs' copy
  //! engines instead of SMs, so they overlap the model's kernels without slowing them
  //! (ShardedOptimizer's gathers use it: DataParallelOptions::copy_engine_gather). Such a
  //! gather waits for its peers with stream memory operations that abort() does not end.
  NcclComm copy_engine_group() {
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess || v < NCCL_VERSION(2, 28, 0))
      throw config_error("NcclComm::copy_engine_group: the NCCL loaded at run time is " + std::to_string(v) +
                         ", copy-engine collectives need 2.28 or later (22800); load a newer libnccl or "
                         "turn ShardedOptimizer::copy_engine_gather and copy_engine_scatter off");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    NcclComm group = split_with(0, rank(), &config, "copy_engine_group");
    group.s_->copy_engines = true;
    group.s_->seals.set_mode(order_check_mode::off);  // zero CTAs: window collectives only
    return group;
  }
  //! `bytes` of zeroed device memory registered as a symmetric window of this communicator
  //! (collective: same size, same order on every rank); .second: whether NCCL returned a
  //! window (cuda/detail/nccl_window.cuh says when the copy engines then do the gathers).
  //! Freed with the pointer.
  std::pair<std::shared_ptr<void>, bool> allocate_window(std::size_t bytes) {
    return detail::nccl_window(s_, bytes, live("allocate_window").compute_stream());
  }
#endif
  //! Whether this group's all-reduces of buffers in symmetric windows go to NCCL's symmetric
  //! kernels, and why (or why not) — decided on the first call, the same on every rank
  //! (collective then: every rank calls it; allocate_symmetric() does): NCCL 2.28 or later
  //! at run time, its windows not turned off, every rank on one host with GPUs that
  //! map each other's memory (cuda/detail/nccl_symmetric.cuh), one process per GPU (a
  //! create_local() group: false, as an aborted communicator does not end their kernels).
  //! One rank: false.
  std::pair<bool, std::string> symmetric_kernels() {
    state& s = live("symmetric_kernels");
    if (s.symmetric < 0) detail::decide_symmetric(*this, s);
    return {s.symmetric == 1, s.symmetric_why};
  }
  //! `bytes` of zeroed device memory: a symmetric window of this group when
  //! symmetric_kernels() holds (.second true), else plain memory. Collective (same size, same
  //! order on every rank). Freed with the pointer.
  std::pair<std::shared_ptr<void>, bool> allocate_symmetric(std::size_t bytes) {
    if (!symmetric_kernels().first) return {memory().allocate(bytes), false};
    return {detail::symmetric_window(*this, s_, bytes, compute_stream()), true};
  }

  //! Whether this is a copy_engine_group() (false without NCCL 2.28); its reduce-scatters' staging bytes.
  bool copy_engines() const noexcept { return s_ && s_->copy_engines; }
  std::size_t copy_engine_staging_bytes() const noexcept { return s_ ? s_->staging_bytes() : 0; }

 private:
  struct adopt_tag {};

  using state = detail::nccl_state;

  // `parent`: the communicator this one was split from (nullptr: a rank's first one).
  NcclComm(adopt_tag, ncclComm_t c, int rank, int world, int device, const std::shared_ptr<state>& parent = {},
           std::string group_name = {})
      : nccl_control(c, rank, world, device, parent, std::move(group_name)) {}

  NcclComm split_with(int color, int key, ncclConfig_t* config, const char* what) {
    split_part sub = split_comm(color, key, config, what);  // cuda/detail/nccl_handle.cuh
    NcclComm out(adopt_tag{}, sub.comm, sub.rank, sub.size, s_->device, s_, std::move(sub.name));
    out.s_->one_process = s_->one_process;  // a group of create_local()'s ranks stays one process
    return out;
  }
};

static_assert(communicator<NcclComm>);
static_assert(work<NcclComm::work>);

}  // namespace lockstep