#pragma once
// lockstep-header-check: also-cpu (the CUDA parts are behind LOCKSTEP_WITH_CUDA)
//! lockstep::run(mode, body) — runs the SPMD body once per rank.
//!
//! Modes are tags chosen at compile time (`Threads{n}`: n CPU ranks as host threads of
//! this process) or `Auto{}`, which asks detect()/decide() at run time. With Auto the body
//! must be generic (`[&](auto& ctx)`), since each mode hands it a context of its own
//! communicator type. An exception on any rank releases the others (their waits throw
//! aborted_error) and is rethrown here, on the caller's thread.

#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/context.hpp"
#include "lockstep/detail/run_ranks.hpp"
#include "lockstep/detect.hpp"
#include "lockstep/error.hpp"
#include "lockstep/thread_comm.hpp"

namespace lockstep {

//! Mode tag: `ranks` CPU ranks as threads of this process (0: from detect()).
struct Threads {
  int ranks = 0;
};

//! Mode tag: decide at run time from lockstep::detect().
struct Auto {};


template <class Body>
void run(Threads mode, Body&& body) {
  const int n = mode.ranks > 0 ? mode.ranks : decide(detect()).ranks;
  auto comms = ThreadComm::create_group(n);
  ThreadComm aborter = comms[0];
  detail::run_ranks(
      n,
      [&](int r) {
        context<ThreadComm> ctx(comms[static_cast<std::size_t>(r)], r, -1);
        body(ctx);
      },
      [&](const std::string& why) { aborter.abort(why); });
}

}  // namespace lockstep

// In CUDA translation units of a CUDA build, Auto can also pick the local GPUs (one process
// driving all) or one process per GPU under a launcher; with lockstep::mpi, MPI processes.
#if defined(LOCKSTEP_WITH_CUDA) && defined(__CUDACC__)
#include "lockstep/cuda/run_gpus.cuh"
#include "lockstep/cuda/run_processes.cuh"
#define LOCKSTEP_AUTO_HAS_GPUS 1
#else
#define LOCKSTEP_AUTO_HAS_GPUS 0
#endif
#if defined(LOCKSTEP_WITH_MPI)
#include "lockstep/run_mpi.hpp"
#define LOCKSTEP_AUTO_HAS_MPI 1
#else
#define LOCKSTEP_AUTO_HAS_MPI 0
#endif

namespace lockstep {

template <class Body>
void run(Auto, Body&& body) {
  const plan p = decide(detect(), LOCKSTEP_AUTO_HAS_GPUS != 0, LOCKSTEP_AUTO_HAS_MPI != 0);
  switch (p.kind) {
    case mode_kind::cpu_threads: return run(Threads{p.ranks}, std::forward<Body>(body));
    case mode_kind::local_gpus:
#if LOCKSTEP_AUTO_HAS_GPUS
      return run(Gpus{p.devices}, std::forward<Body>(body));
#else
      break;
#endif
    case mode_kind::gpu_processes:
#if LOCKSTEP_AUTO_HAS_GPUS
      return run(Processes{}, std::forward<Body>(body));
#else
      break;
#endif
    case mode_kind::mpi_processes:
#if LOCKSTEP_AUTO_HAS_MPI
      return run(Mpi{}, std::forward<Body>(body));
#else
      break;
#endif
  }
  throw config_error(std::string("lockstep::run(Auto): mode ") + name_of(p.kind) +
                     " is not available in this translation unit");
}

}  // namespace lockstep
