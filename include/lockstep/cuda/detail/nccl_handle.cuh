#pragma once
//! The core of an NcclComm, its private base: the state it owns (nccl_state), made from an NCCL
//! communicator — checked against what NCCL reports, given its streams, events and order-check
//! buffer, joined to its family —, the split of a new NCCL communicator from it, the check that
//! it is still usable (live) and the issue of one NCCL call on the communication stream.

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/detail/nccl_marker.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/detail/nccl_work.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::detail {

class nccl_handle {
 protected:
  using state = nccl_state;

  // `parent`: the communicator this one was split from (nullptr: a rank's first one).
  nccl_handle(ncclComm_t c, int rank, int world, int device, const std::shared_ptr<state>& parent,
              std::string group_name) {
    try {
      s_ = std::make_shared<state>();
    } catch (...) {
      nccl_destroy(c, device);
      throw;
    }
    state& s = *s_;  // from here on s_ owns c: a throw destroys it with the rest
    s.comm = c;
    s.rank = rank;
    s.job_rank = rank;
    s.size = world;
    s.device = device;
    s.parent = parent;
    s.group_name = std::move(group_name);
    s.family = parent ? parent->family : std::make_shared<nccl_family>();
    device_guard g(device);
    // Trust, but verify: the rank/size/device NCCL holds must be the ones we report.
    int nccl_rank = 0, nccl_size = 1, nccl_device = device;  // no NCCL communicator: one rank
    if (c) LOCKSTEP_TRY_NCCL(ncclCommUserRank(c, &nccl_rank));
    if (c) LOCKSTEP_TRY_NCCL(ncclCommCount(c, &nccl_size));
    if (c) LOCKSTEP_TRY_NCCL(ncclCommCuDevice(c, &nccl_device));
    if (nccl_rank != rank || nccl_size != world || nccl_device != device)
      throw nccl_error("NcclComm: NCCL reports rank " + std::to_string(nccl_rank) + " of " + std::to_string(nccl_size) +
                       " on device " + std::to_string(nccl_device) + ", expected rank " + std::to_string(rank) +
                       " of " + std::to_string(world) + " on device " + std::to_string(device));
    int least = 0, greatest = 0;
    LOCKSTEP_TRY_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    LOCKSTEP_TRY_CUDA(cudaStreamCreateWithPriority(&s.comm_stream, cudaStreamNonBlocking, greatest));
    if (parent) {
      s.follows_parent = true;  // the model's kernels and both groups' collectives stay ordered
      s.tracking = parent->tracking;
    } else {
      LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&s.own_compute, cudaStreamNonBlocking));
      s.compute = s.own_compute;
    }
    LOCKSTEP_TRY_CUDA(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming));
    s.events = std::make_shared<event_pool>(device);
    LOCKSTEP_TRY_CUDA(cudaMalloc(reinterpret_cast<void**>(&s.barrier_buf), sizeof(int)));
    s.seals.init(world, parent ? parent->seals.mode() : order_check_mode_from_env());  // order check
    LOCKSTEP_TRY_CUDA(cudaMemsetAsync(s.barrier_buf, 0, sizeof(int), s.comm_stream));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s.comm_stream));
    if (const auto why = s.family->add(s_)) {  // abort() overtook the split: end what it missed
      nccl_abort(s, *why);
      throw aborted_error("NcclComm::split: " + s.who() + " was aborted while it was made (" + *why +
                          "); create a new communicator to continue");
    }
  }

  //! What NcclComm::split_with makes its new communicator of: the NCCL communicator (nullptr for
  //! a group of one rank without one), its rank and size there, and the group's name.
  struct split_part {
    ncclComm_t comm;
    int rank;
    int size;
    std::string name;
  };
  split_part split_comm(int color, int key, ncclConfig_t* config, const char* what) {
    state& s = live(what);
    if (color < 0)
      throw config_error(std::string("NcclComm::") + what + ": colour " + std::to_string(color) +
                         " is negative; give every rank a colour >= 0 (ranks of one colour form a group)");
    const std::string name = (s.group_name.empty() ? "" : s.group_name + " / ") + "split " +
                             std::to_string(s.splits++) + " (colour " + std::to_string(color) + ")";
    if (!s.comm) return {nullptr, 0, 1, name};  // one rank: one group
    device_guard g(s.device);
    ncclComm_t sub = nullptr;
    LOCKSTEP_TRY_NCCL(ncclCommSplit(s.comm, color, key, &sub, config));
    if (sub == nullptr)
      throw nccl_error(std::string("NcclComm::") + what + ": ncclCommSplit gave no communicator for colour " +
                       std::to_string(color));
    int r = -1, n = -1;
    const ncclResult_t qr = ncclCommUserRank(sub, &r);
    const ncclResult_t qn = qr == ncclSuccess ? ncclCommCount(sub, &n) : qr;
    if (qn != ncclSuccess) {
      nccl_destroy(sub, s.device);
      throw nccl_error(std::string("NcclComm::") + what +
                       ": the new communicator does not say its rank and size: " + describe_nccl(qn));
    }
    return {sub, r, n, name};
  }

  state& live(const char* what) const {
    if (!s_) throw config_error(std::string("NcclComm::") + what + ": this communicator was moved from");
    if (s_->aborted.load(std::memory_order_acquire))
      throw aborted_error(std::string("NcclComm::") + what + ": rank " + std::to_string(s_->rank) + " was aborted (" +
                          s_->abort_reason + "); create a new communicator to continue");
    if (auto why = s_->peer_failure()) throw timeout_error(std::string("NcclComm::") + what + ": " + *why);
    return *s_;
  }

  // Queues call(stream) on the communication stream after the compute stream's work so far,
  // once that stream waits for the aside work that touches `touched` ({}: anything).
  template <class Call>
  nccl_work issue(state& s, const collective& c, nccl_aside::ranges touched, Call&& call) {
    device_guard g(s.device);
    const cudaStream_t compute = after_compute(s);
    s.aside.order(s.comm_stream, touched);
    nccl_work w(s.events, s.events->acquire(), compute);  // gives the event back if we throw below
    // Marked before the call, which may block inside NCCL (nccl_marker); completed after.
    nccl_marker mark(s, c);
    call(s.comm_stream);
    LOCKSTEP_TRY_CUDA(cudaEventRecord(w.event(), s.comm_stream));
    mark.done();
    return w;
  }

  // NcclComm::enqueue and enqueue_aside: f(stream) on the communication stream (after the
  // aside work that touches `touched`) or on the aside stream.
  template <class F>
  nccl_work queue(state& s, nccl_aside::ranges touched, bool aside, F&& f) {
    device_guard g(s.device);
    const cudaStream_t compute = after_compute(s);
    nccl_work w(s.events, s.events->acquire(), compute);
    cudaStream_t end = s.comm_stream;
    if (aside) {
      end = s.aside.run(s.comm_stream, touched, f);
    } else {
      s.aside.order(s.comm_stream, touched);
      f(s.comm_stream);
    }
    LOCKSTEP_TRY_CUDA(cudaEventRecord(w.event(), end));
    return w;
  }

  std::shared_ptr<state> s_;

 private:
  // The communication stream waits for the compute stream's work so far; returns the latter.
  static cudaStream_t after_compute(state& s) {
    const cudaStream_t compute = s.compute_stream();
    LOCKSTEP_TRY_CUDA(cudaEventRecord(s.ready, compute));
    LOCKSTEP_TRY_CUDA(cudaStreamWaitEvent(s.comm_stream, s.ready, 0));
    return compute;
  }
};

}  // namespace lockstep::detail
