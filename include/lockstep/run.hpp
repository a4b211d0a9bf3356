#pragma once
// lockstep-header-check: also-cpu (the CUDA parts are behind LOCKSTEP_WITH_CUDA)
//! lockstep::run(mode, body) — runs the SPMD body once per rank, in the mode chosen at compile
//! time (a mode tag: Threads, Gpus, Processes, Mpi) or at run time (Auto). This header puts
//! every compiled-in mode behind Auto: it sits above every layer, including the optional
//! backends, so that no lower layer includes them.
//!
//! Auto asks detect()/decide() at run time. With Auto the body must compile for every mode it
//! can pick: write it generically (`[&](auto& ctx)`) and build the strategy from the context
//! (`lockstep::DataParallel dp(ctx, model, policies...)` deduces the communicator). Auto picks
//! GPUs only in translation units compiled by nvcc of a CUDA build; MPI processes only with
//! lockstep::mpi.

#include <string>
#include <utility>

#include "lockstep/core/error.hpp"
#include "lockstep/launch/detect.hpp"
#include "lockstep/launch/run.hpp"

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
#include "lockstep/mpi/run.hpp"
#define LOCKSTEP_AUTO_HAS_MPI 1
#else
#define LOCKSTEP_AUTO_HAS_MPI 0
#endif

namespace lockstep {

//! Mode tag: decide at run time from lockstep::detect().
struct Auto {};

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
