#pragma once
//! lockstep::run(Gpus{devices}, body) — one process driving several local GPUs: one rank,
//! one host thread and one NcclComm per device. Each rank's model lives on its own device
//! and reads its own shard of the data: nothing is scattered from or gathered to device 0.

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "lockstep/core/context.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/nccl_comm.cuh"
#include "lockstep/launch/detail/run_ranks.hpp"

namespace lockstep {

//! Mode tag: one rank per listed GPU (empty: every visible GPU).
struct Gpus {
  std::vector<int> devices;
};

template <class Body>
void run(Gpus mode, Body&& body) {
  if (mode.devices.empty()) {
    int n = 0;
    LOCKSTEP_TRY_CUDA(cudaGetDeviceCount(&n));
    if (n == 0) throw config_error("lockstep::run(Gpus): no GPU is visible; use Threads{} for CPU ranks");
    for (int i = 0; i < n; ++i) mode.devices.push_back(i);
  }
  auto comms = NcclComm::create_local(mode.devices);
  const int n = static_cast<int>(comms.size());
  // Contexts are made here, before the threads, so the abort below can reach every rank.
  std::vector<context<NcclComm>> ctxs;
  ctxs.reserve(comms.size());
  for (int r = 0; r < n; ++r)
    ctxs.emplace_back(std::move(comms[static_cast<std::size_t>(r)]), r, mode.devices[static_cast<std::size_t>(r)]);
  detail::run_ranks(
      n,
      [&](int r) {
        auto& ctx = ctxs[static_cast<std::size_t>(r)];
        LOCKSTEP_TRY_CUDA(cudaSetDevice(ctx.device()));
        body(ctx);
        // Finish this rank's queued work before its communicator goes away.
        ctx.comm().synchronize();   // compute, communication and aside streams
        ctx.comm().verify_order();  // the last collectives' order check, compared now
      },
      [&](const std::string& why) {
        // Release ranks blocked in NCCL kernels waiting for the failed one (the first reason
        // stays: a released rank's report of its own release never replaces it).
        for (auto& c : ctxs) c.comm().abort(why);
      });
}

}  // namespace lockstep
