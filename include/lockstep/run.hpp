#pragma once
// lockstep-header-check: also-cpu (the CUDA parts are behind LOCKSTEP_WITH_CUDA)
//! lockstep::run(mode, body) — runs the SPMD body once per rank, in the mode chosen at compile
//! time (a mode tag: Threads, Gpus, Processes, Mpi) or at run time (Auto); Hybrid{...} wraps
//! any of them and hands the body a data × model mesh instead. This header puts every
//! compiled-in mode behind Auto: it sits above every layer, including the optional
//! backends, so that no lower layer includes them.
//!
//! Auto asks detect()/decide() at run time. With Auto the body must compile for every mode it
//! can pick: write it generically (`[&](auto& ctx)`) and build the strategy from the context
//! (`lockstep::DataParallel dp(ctx, model, policies...)` deduces the communicator). Auto picks
//! GPUs only in translation units compiled by nvcc of a CUDA build; MPI processes only with
//! lockstep::mpi.

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "lockstep/core/error.hpp"
#include "lockstep/launch/detect.hpp"
#include "lockstep/launch/run_threads.hpp"
#include "lockstep/parallel/mesh.hpp"

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
#include "lockstep/mpi/run_mpi.hpp"
#define LOCKSTEP_AUTO_HAS_MPI 1
#else
#define LOCKSTEP_AUTO_HAS_MPI 0
#endif

namespace lockstep {

//! Mode tag: decide at run time from lockstep::detect().
struct Auto {};

//! Mode wrapper: runs `inner` and hands the body, on every rank, the job's data × model mesh
//! (a Mesh<Comm>&, parallel/mesh.hpp) instead of a context. mesh.data is the data axis (for
//! DataParallel and the sampler), mesh.model the model axis (the model's own collectives).
//!
//! \code
//!   lockstep::run(lockstep::Hybrid{.model_parallel = 2, .inner = lockstep::Threads{4}}, [&](auto& mesh) {
//!     TpMlp model(dims, mesh.part(), mesh.parts(), &mesh.model, seed);  // 2 parts per replica
//!     lockstep::DataParallel dp(mesh.data, model);                      // averages over 2 replicas
//!   });
//! \endcode
//!
//! `Hybrid{}` (inner Auto, no degree) takes the degree from LOCKSTEP_MODEL_PARALLEL, else 1 (a
//! model axis of one rank: plain data parallelism, the same body). The body always gets a
//! mesh, whatever the degree: a body written for a context never receives one, which is why
//! run(Auto) refuses LOCKSTEP_MODEL_PARALLEL > 1 rather than ignore it. A degree that does not
//! divide the job fails on every rank with make_mesh's error. Without aggregate deduction
//! (Clang < 17), name the inner mode: `Hybrid<Threads>{.model_parallel = 2, .inner = {4}}`.
template <class Inner = Auto>
struct Hybrid {
  int model_parallel = 0;  //!< M: ranks per replica, dividing the job; 0: LOCKSTEP_MODEL_PARALLEL, else 1
  Inner inner{};           //!< the mode whose ranks form the mesh: Threads, Gpus, Processes, Mpi or Auto
};

namespace detail {

//! Runs the body in the mode p names (run(Auto) after its checks, and Hybrid<Auto>).
template <class Body>
void run_plan(const plan& p, Body&& body) {
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

inline plan auto_plan(const environment& e) {
  return decide(e, LOCKSTEP_AUTO_HAS_GPUS != 0, LOCKSTEP_AUTO_HAS_MPI != 0);
}

}  // namespace detail

template <class Body>
void run(Auto, Body&& body) {
  const environment e = detect();
  if (e.model_parallel && *e.model_parallel > 1)
    throw config_error("lockstep::run(Auto): LOCKSTEP_MODEL_PARALLEL=" + std::to_string(*e.model_parallel) +
                       " asks for a data × model mesh, but run(Auto{}, body) hands the body a context, not a "
                       "mesh; run the body with run(Hybrid{}, [&](auto& mesh) {...}) (docs/hybrid.md), or "
                       "unset LOCKSTEP_MODEL_PARALLEL");
  detail::run_plan(detail::auto_plan(e), std::forward<Body>(body));
}

namespace detail {
template <class T>
inline constexpr bool is_hybrid = false;
template <class I>
inline constexpr bool is_hybrid<Hybrid<I>> = true;
}  // namespace detail

template <class Inner, class Body>
void run(Hybrid<Inner> mode, Body&& body) {
  static_assert(!detail::is_hybrid<Inner>,
                "lockstep::run(Hybrid{.inner = Hybrid{...}}): a mesh of a mesh; give one Hybrid with the "
                "model-parallel degree and a plain mode (Threads, Gpus, Processes, Mpi, Auto) as inner");
  int m = mode.model_parallel;
  std::optional<int> from_env;
  if (m < 0)
    throw config_error("lockstep::run(Hybrid{.model_parallel = " + std::to_string(m) +
                       "}): a negative degree; give the ranks per model replica (a divisor of the job's size), "
                       "or 0 to read LOCKSTEP_MODEL_PARALLEL (default 1)");
  if (m == 0) {
    from_env = detail::model_parallel_from_env();
    m = from_env.value_or(1);
  }
  auto on_rank = [&](auto& ctx) {
    auto mesh = [&] {
      try {
        return make_mesh(ctx, {.model_parallel = m});
      } catch (const config_error& e) {
        if (!from_env) throw;
        throw config_error(std::string(e.what()) +
                           "; the degree came from LOCKSTEP_MODEL_PARALLEL=" + std::to_string(*from_env));
      }
    }();
    body(mesh);
  };
  if constexpr (std::is_same_v<Inner, Auto>) detail::run_plan(detail::auto_plan(detect()), on_rank);
  else run(std::move(mode.inner), on_rank);
}

}  // namespace lockstep
