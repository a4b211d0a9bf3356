#pragma once
//! lockstep::run(lockstep::Mpi{}, body) — the SPMD body once per MPI process (one rank each),
//! with a context<MpiComm> over MPI_COMM_WORLD. Start the program with the MPI launcher:
//!
//! \code
//!   // mpirun -np 4 ./train
//!   lockstep::run(lockstep::Mpi{}, [&](lockstep::context<lockstep::MpiComm>& ctx) {
//!     Mlp model(seed);
//!     lockstep::DataParallel dp(ctx, model);   // a Distributed<Mlp, MpiComm>
//!     for (auto& batch : my_batches) {
//!       auto step = dp.step();
//!       model.backward(batch, step.on_gradient_ready());
//!       if (step.finish()) optimizer.update(model);
//!     }
//!   });
//! \endcode
//!
//! Failure: a rank whose body throws cannot release the others from inside MPI (their
//! collectives may already be waiting for it), so run prints "lockstep: rank r failed: ..."
//! to stderr, waits a short grace period (LOCKSTEP_ABORT_GRACE seconds, default 2: lets
//! ranks that failed the same way, e.g. a mismatch_error seen by every rank, print theirs)
//! and calls MPI_Abort(MPI_COMM_WORLD, 1), which ends every process of the job with a
//! non-zero status. Exceptions therefore never leave run(Mpi{}, ...) (except when MPI could
//! not be initialised: then it rethrows, there being no job to end). Ranks stuck in a
//! collective with no failing peer end by LOCKSTEP_TIMEOUT (timeout_error → the same abort).

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <utility>

#include "lockstep/core/context.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/mpi/mpi_comm.hpp"

namespace lockstep {

//! Mode tag: one rank per MPI process (start the program with mpirun / srun).
struct Mpi {};

namespace detail {

//! This process' index among the job's processes on its node: the launcher's variable when
//! it sets one (Open MPI, MPICH/Hydra, Slurm), else MPI_Comm_split_type(SHARED) (collective).
inline int mpi_local_rank(MPI_Comm world) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (auto v = env_long(name); v && *v >= 0) return static_cast<int>(*v);
  MPI_Comm node = MPI_COMM_NULL;
  LOCKSTEP_TRY_MPI(MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int r = 0;
  MPI_Comm_rank(node, &r);
  MPI_Comm_free(&node);
  return r;
}

inline bool mpi_running() {
  int up = 0, down = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  return up && !down;
}

[[noreturn]] inline void mpi_fail(int rank, const std::string& why) {
  std::fprintf(stderr, "lockstep: rank %d failed: %s\n", rank, why.c_str());
  std::fflush(stderr);
  std::this_thread::sleep_for(abort_grace());
  std::fprintf(stderr, "lockstep: rank %d: ending the job (MPI_Abort)\n", rank);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return; this keeps [[noreturn]] honest if it does
}

}  // namespace detail

template <class Body>
void run(Mpi, Body&& body) {
  int rank = -1;
  try {
    MpiComm comm = MpiComm::world();
    rank = comm.rank();
    const int local = detail::mpi_local_rank(comm.native());
    context<MpiComm> ctx(std::move(comm), local, -1);
    body(ctx);
    // The order check of the last collectives (deferred) has not been compared yet.
    ctx.comm().verify_order();
  } catch (const std::exception& e) {
    if (!detail::mpi_running()) throw;  // MPI never came up: there are no peers to release
    detail::mpi_fail(rank, e.what());
  } catch (...) {
    if (!detail::mpi_running()) throw;
    detail::mpi_fail(rank, "a non-standard exception");
  }
}

}  // namespace lockstep
