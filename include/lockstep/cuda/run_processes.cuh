#pragma once
//! lockstep::run(Processes{}, body) — one process per GPU, on one machine or many, started by
//! a launcher (lockstep-run, `torchrun --no-python`, mpirun, srun). The launcher's variables
//! say who this process is (lockstep::detect_launcher); rank 0 hosts a TcpStore at
//! MASTER_ADDR:MASTER_PORT, through which the ranks check that they run the same lockstep
//! with the same world size and exchange the NCCL unique id; then every rank drives GPU
//! `local_rank` (or the local_rank-th of LOCKSTEP_DEVICES) with an NcclComm.
//!
//!   lockstep-run --nproc 4 ./train            # or: torchrun --no-python --nproc-per-node 4 ./train
//!   lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {...});
//!
//! Failures. A Watchdog (lockstep/launch/watchdog.hpp) runs beside the body: it aborts this rank's
//! communicator — so the body's next call throws instead of hanging — when
//!  - another rank's process died (its store connection closed; e.g. kill -9): at once;
//!  - another rank stopped responding (no heartbeat for LOCKSTEP_TIMEOUT);
//!  - another rank's body threw (it reports its error first);
//!  - NCCL reports an asynchronous error (ncclCommGetAsyncError) on this rank;
//!  - a collective of this rank has not completed LOCKSTEP_TIMEOUT + 2 s after it was issued.
//! The text names the rank and the cause, on every rank. A rank whose body throws prints the
//! error, reports it, aborts its communicator and rethrows: the process exits non-zero. A
//! rank stuck outside lockstep's calls is ended 5 s after the failure (exit status 1).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/context.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/nccl_comm.cuh"
#include "lockstep/launch/detail/same_job.hpp"
#include "lockstep/launch/detail/teardown_deadline.hpp"
#include "lockstep/launch/detect.hpp"
#include "lockstep/launch/elastic_join.hpp"
#include "lockstep/launch/job_store.hpp"
#include "lockstep/launch/launch_env.hpp"
#include "lockstep/launch/membership_watch.hpp"
#include "lockstep/launch/watchdog.hpp"
#include "lockstep/store/store.hpp"
#include "lockstep/store/tcp_store.hpp"
#include "lockstep/version.hpp"

namespace lockstep {

//! Mode tag: one rank per process, as the launcher's environment says (overrides win).
struct Processes {
  launch_overrides overrides{};
};

namespace detail {

//! The GPU this process drives: LOCKSTEP_DEVICES[local_rank] when set, else local_rank.
inline int process_device(const launch_info& info) {
  int visible = 0;
  LOCKSTEP_TRY_CUDA(cudaGetDeviceCount(&visible));
  int device = info.local_rank;
  std::string from = "its local rank";
  if (auto list = env("LOCKSTEP_DEVICES")) {
    auto ids = parse_device_list(*list, "LOCKSTEP_DEVICES");
    if (info.local_rank >= static_cast<int>(ids.size()))
      throw config_error("local rank " + std::to_string(info.local_rank) + " has no entry in LOCKSTEP_DEVICES='" +
                         *list + "'; list one GPU per process on this host");
    device = ids[static_cast<std::size_t>(info.local_rank)];
    from = "LOCKSTEP_DEVICES";
  }
  if (device >= visible)
    throw config_error("rank " + std::to_string(info.rank) + " would drive GPU " + std::to_string(device) + " (from " +
                       from + "), but " + std::to_string(visible) +
                       " GPU(s) are visible on this host: start at most one process per GPU "
                       "(lockstep-run --nproc " +
                       std::to_string(visible) + ")");
  return device;
}

}  // namespace detail

template <class Body>
void run(Processes mode, Body&& body) {
  const auto found = detect_launcher(mode.overrides);
  if (!found)
    throw config_error("lockstep::run(Processes): no launcher variables found (RANK/WORLD_SIZE, "
                       "OMPI_COMM_WORLD_*, SLURM_PROCID...). Start the program with lockstep-run "
                       "--nproc N, torchrun --no-python, mpirun or srun");
  launch_info info = *found;
  // torchrun's agent already serves its own TCPStore at MASTER_PORT (it exports
  // TORCHELASTIC_USE_AGENT_STORE=True); lockstep's store then listens on the next port,
  // unless LOCKSTEP_MASTER_PORT chose one.
  if (info.launcher == "torchrun" && !mode.overrides.master_port) {
    if (const auto own = detail::env_long("LOCKSTEP_MASTER_PORT")) {
      if (*own < 1 || *own > 65535)
        throw config_error("LOCKSTEP_MASTER_PORT=" + std::to_string(*own) + " is not a TCP port (1..65535)");
      info.master_port = static_cast<int>(*own);
    } else if (const auto agent = detail::env("TORCHELASTIC_USE_AGENT_STORE");
               agent && (*agent == "True" || *agent == "true" || *agent == "1")) {
      if (info.master_port >= 65535)
        throw config_error("MASTER_PORT=" + std::to_string(info.master_port) +
                           " is torchrun's agent store and leaves no next port for lockstep's; set "
                           "LOCKSTEP_MASTER_PORT to a free port");
      info.master_port += 1;
    }
  }
  const int device = detail::process_device(info);
  LOCKSTEP_TRY_CUDA(cudaSetDevice(device));
  TcpStore store = job_store(info);
  detail::check_same_job(store, info);
  // The membership this process starts in: the whole job, or — a replacement, started with
  // LOCKSTEP_ELASTIC_JOIN=1 — the one the running job admits it to (launch/elastic_join.hpp).
  growth first{0, {}, 0, {}};
  for (int r = 0; r < info.world; ++r) first.ranks.push_back(r);
  std::optional<NcclComm> comm;
  if (const auto join = detail::env("LOCKSTEP_ELASTIC_JOIN"); join && *join == "1") {
    if (info.rank == 0)
      throw config_error("LOCKSTEP_ELASTIC_JOIN=1 on rank 0: rank 0 hosts the job's store, so a job that lost it "
                         "cannot be joined; start a replacement with the job rank of a rank that left");
    const std::int64_t request = request_join(store, info.rank);
    first = await_admission(store, request, info.rank, store.timeout());
    comm.emplace(NcclComm::join(first.epoch, first.ranks, info.rank, device, store));
  } else {
    const ncclUniqueId id = detail::shared_nccl_id(store, "lockstep/nccl_id", info.rank == 0, "the job (rank 0's)");
    comm.emplace(id, info.rank, info.world, device);
  }
  // Declared before ctx: after a failure it bounds the teardown, the communicator's included.
  detail::teardown_deadline deadline;
  context<NcclComm> ctx(std::move(*comm), info.local_rank, device);
  comm.reset();
  const auto limit = store.timeout();
  ctx.comm().track_collectives();
  // A collective is overdue 2 s after the heartbeat limit, so that a stopped peer is named by
  // its missing heartbeat before a survivor blames its own stuck collective.
  const auto overdue_after = limit + std::chrono::seconds(2);
  // Declared after ctx: it stops (joins its thread) before the communicator is destroyed.
  // One watchdog per membership (launch/membership_watch.hpp): an ElasticGroup on ctx
  // regroups the job after a failure instead of ending it.
  std::optional<membership_watch<NcclComm>> watch;
  try {
    watch.emplace(
        store, store.host(), store.port(), info.rank, info.world, info.job_token, ctx.comm(),
        [overdue_after](NcclComm& comm, const Watchdog& dog) -> std::optional<std::string> {
          const std::string rank = "rank " + std::to_string(comm.rank());
          // Mismatched collectives first: what follows them (a stuck one) is their effect.
          if (auto why = comm.order_failure()) return rank + ": " + *why;
          try {
            comm.check_async_error();
          } catch (const std::exception& e) {
            return rank + ": NCCL reported an asynchronous error: " + e.what();
          }
          // A peer whose body returned never issues another collective: one of ours still
          // running 2 s after that is waiting for nobody (uneven inputs without a Join).
          if (const auto who = dog.departed())
            if (const auto pending = comm.overdue(std::chrono::seconds(2)))
              return *who + " has left the training body; " + *pending +
                     " — uneven inputs? Every rank must issue the same collectives; with different "
                     "numbers of batches per rank, use dp.join() (lockstep::Join)";
          return comm.overdue(overdue_after);
        },
        watchdog_options{.timeout = limit}, first);
  } catch (...) {  // a communicator whose peers may be waiting must be aborted, not destroyed
    deadline.arm(info.rank, "rank " + std::to_string(info.rank) + " could not start its watchdog");
    ctx.comm().abort("rank " + std::to_string(info.rank) + " could not start its watchdog");
    throw;
  }
  ctx.set_elastic(&*watch);
  // Ranks are named by their job rank (as launched), also after a change of membership.
  const std::string me = "rank " + std::to_string(info.rank);
  try {
    body(ctx);
    ctx.comm().synchronize();   // compute, communication and aside streams
    ctx.comm().verify_order();  // the last collectives' order check, compared now
  } catch (const std::exception& e) {
    ctx.set_elastic(nullptr);
    // Released by a peer's failure (the watchdog aborted us): that is the cause, not whatever
    // the aborted NCCL or CUDA call said here — every rank ends naming the same one.
    if (const auto peer = watch->failure()) {
      std::fprintf(stderr, "lockstep: %s stopped: %s (here: %s)\n", me.c_str(), peer->c_str(), e.what());
      std::fflush(stderr);
      deadline.arm(info.rank, *peer);  // the watchdog thread may be stuck in ncclCommAbort: stop() joins it
      ctx.comm().abort(*peer);
      watch->stop();
      throw aborted_error(me + " stopped: " + *peer + " (here: " + e.what() + ")");
    }
    std::fprintf(stderr, "lockstep: %s failed: %s\n", me.c_str(), e.what());
    std::fflush(stderr);
    watch->report(me + " failed: " + e.what());
    deadline.arm(info.rank, me + " failed: " + e.what());
    ctx.comm().abort(me + " failed");
    watch->stop();
    throw;
  }
  ctx.set_elastic(nullptr);
  // This rank issues no more collectives: a peer still waiting in one is told (first one wins).
  store.set_if_absent(Watchdog::departure_key, bytes_of(me));
  if (const auto why = watch->failure()) deadline.arm(info.rank, *why);  // stop() joins a thread that may be stuck
  watch->stop();
  if (auto why = watch->failure()) {  // the body finished, but a peer did not: do not wait for it
    deadline.arm(info.rank, *why);
    throw aborted_error(me + " finished, but the job failed: " + *why);
  }
  // Rank 0 hosts the store: it leaves only after everyone is done with it. A peer's failure
  // (say, one that waited for this rank after it left) ends the wait at once. After a change
  // of membership, everyone is the survivors.
  if (watch->epoch() == 0)
    final_barrier(store, "lockstep/finished", info.rank, std::chrono::milliseconds(store.timeout()),
                  Watchdog::failure_key);
  else
    final_barrier_of(store, "lockstep/finished/" + std::to_string(watch->epoch()), info.rank, watch->members(),
                     std::chrono::milliseconds(store.timeout()), watch->failure_key());
}

}  // namespace lockstep
