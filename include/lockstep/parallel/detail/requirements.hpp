#pragma once
//! What DataParallel<Model, Comm, Policies...> requires of its arguments, as compile-time
//! errors that name the requirement (lockstep::model, lockstep::communicator, grad_ops for a
//! loss scaler): checked once, where DataParallel is instantiated.

#include "lockstep/core/concepts.hpp"
#include "lockstep/scaling/loss_scaler.hpp"

namespace lockstep::detail {

template <class Model, class Comm, class scaler_type>
consteval bool data_parallel_requirements() {
  static_assert(model_has_parameters<Model>,
                "lockstep::DataParallel: Model does not satisfy lockstep::model: requirement 1 "
                "— it needs parameters() returning a range of lockstep::parameter");
  static_assert(communicator_has_rank<Comm>, "lockstep::DataParallel: Comm does not satisfy lockstep::communicator: "
                                             "requirement 1 — it needs rank() and size()");
  static_assert(communicator_has_collectives<Comm>,
                "lockstep::DataParallel: Comm does not satisfy lockstep::communicator: "
                "requirements 2-6 — it needs all_reduce, broadcast, all_gather, "
                "reduce_scatter and barrier returning lockstep::work");
  static_assert(communicator_has_memory<Comm>, "lockstep::DataParallel: Comm does not satisfy lockstep::communicator: "
                                               "requirement 7 — it needs memory() returning lockstep::memory_ops");
  static_assert(loss_scaler_for<scaler_type, Comm> || has_grad_ops<memory_of_t<Comm>>,
                "lockstep::DataParallel: no lockstep::grad_ops for this communicator's memory "
                "space (the type Comm::memory() returns): the loss scaler needs it to unscale "
                "and check the gradients where they live. Include the header that provides it "
                "(<lockstep/cuda/grad_ops.cuh>, or <lockstep/cuda.cuh>, for NcclComm's "
                "CudaMemory), specialise lockstep::grad_ops for your memory type "
                "(docs/communicator.md), or use lockstep::NoScaling");
  static_assert(!has_grad_ops<memory_of_t<Comm>> || loss_scaler_for<scaler_type, Comm>,
                "lockstep::DataParallel: the loss scaler cannot unscale this communicator's "
                "gradients (it needs unscale_and_check(Comm&, span<const grad_group>))");
  return true;
}

}  // namespace lockstep::detail
