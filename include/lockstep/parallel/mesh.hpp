#pragma once
//! lockstep::Mesh — data parallelism combined with model (tensor or pipeline) parallelism. The
//! job's N ranks form a grid of N/M replicas × M model-parallel ranks: ranks k·M … k·M+M−1
//! hold the M parts of replica k (consecutive ranks: on GPUs, the devices of one node share
//! the model's traffic), and the ranks that hold the same part, one per replica, form the
//! data axis. DataParallel runs over the data axis; the model makes its own collectives (a
//! tensor-parallel layer's all-reduce) on the model axis.
//!
//! \code
//!   lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {
//!     auto mesh = lockstep::make_mesh(ctx, {.model_parallel = 2});   // 2 replicas × 2 parts
//!     TpMlp model(dims, mesh.part(), mesh.parts(), &mesh.model, seed);  // all-reduces on mesh.model
//!     lockstep::DataParallel dp(mesh.data, model);                      // averages over the replicas
//!     lockstep::DistributedSampler sampler(n, mesh.data, {.seed = 7});  // a batch per replica
//!   });
//! \endcode
//!
//! Gradients: DataParallel averages every parameter over the data axis. A parameter that is
//! replicated across the model axis (a tensor-parallel block's output bias, LayerNorm) gets
//! the same gradient on every part when the model's backward runs the block's all-reduces (as
//! Megatron's f/g operators do), so nothing more is needed; a replicated parameter whose
//! gradient is only partial on each part (sequence parallelism) must be summed over the model
//! axis by the model before it reports the gradient ready. docs/hybrid.md.
//!
//! run(Hybrid{.model_parallel = M, .inner = mode}, body) (lockstep/run.hpp) builds the mesh
//! itself and hands the body a Mesh<Comm>&.

#include <string>
#include <utility>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/context.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

struct MeshOptions {
  int model_parallel = 1;  //!< M: ranks that hold one replica's parts; divides the job's size
};

template <class Comm>
class Mesh {
 public:
  Mesh(context<Comm> data_axis, Comm model_axis, context<Comm>& job)
      : data(std::move(data_axis)), model(std::move(model_axis)), world_(&job) {}

  context<Comm> data;  //!< over the ranks holding the same part: DataParallel, the sampler
  Comm model;          //!< over the ranks holding one replica's parts: the model's collectives
  //! The whole job's context the axes were split from (all N ranks: job-wide checks, rank 0's
  //! printing). make_mesh's ctx: it must outlive the mesh (run(Hybrid) keeps it so).
  context<Comm>& world() const noexcept { return *world_; }
  //! Which replica this rank belongs to (its rank on the data axis), of replicas().
  int replica() const { return data.rank(); }
  int replicas() const { return data.size(); }
  //! Which part of the model this rank holds (its rank on the model axis), of parts().
  int part() const { return model.rank(); }
  int parts() const { return model.size(); }

 private:
  context<Comm>* world_;
};

//! Splits ctx's communicator into the two axes (collective over it).
template <splittable_communicator Comm>
Mesh<Comm> make_mesh(context<Comm>& ctx, MeshOptions o) {
  const int n = ctx.size(), m = o.model_parallel;
  if (m < 1 || n % m != 0)
    throw config_error("lockstep::make_mesh: model_parallel = " + std::to_string(m) + " does not divide the " +
                       std::to_string(n) + " ranks of the job; give a divisor of " + std::to_string(n) +
                       " (the job is model_parallel ranks per replica × replicas)");
  const int r = ctx.rank();
  Comm model = ctx.comm().split(r / m, r);
  Comm data = ctx.comm().split(r % m, r);
  return Mesh<Comm>(context<Comm>(std::move(data), ctx.local_rank(), ctx.device()), std::move(model), ctx);
}

}  // namespace lockstep
