#pragma once
//! How a DataParallel is named without spelling its type: the deduction guides
//! (`lockstep::DataParallel dp(ctx, model, policies...)`), make_data_parallel<Policies...> and
//! the Distributed alias. Declared against DataParallel's declaration; data_parallel.hpp
//! includes this before defining the class.

#include <type_traits>
#include <utility>

#include "lockstep/core/context.hpp"
#include "lockstep/parallel/detail/arguments.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep {

template <class Model, class Comm, class... Policies>
class DataParallel;

// Deduction from the context, so that one body compiles for every communicator run(Auto) can
// pick: `lockstep::DataParallel dp(ctx, model, lockstep::Accumulate<>(4), lockstep::DynamicScale());`
// The policies are the types of the arguments (DataParallelOptions first, if given).
template <class Comm, class Model>
DataParallel(context<Comm>&, Model&) -> DataParallel<Model, Comm>;
template <class Comm, class Model, class... Ps>
DataParallel(context<Comm>&, Model&, const DataParallelOptions&, Ps&&...)
    -> DataParallel<Model, Comm, std::remove_cvref_t<Ps>...>;
template <class Comm, class Model, class P, class... Ps>
  requires(!detail::is_options_v<P>)
DataParallel(context<Comm>&, Model&, P&&, Ps&&...)
    -> DataParallel<Model, Comm, std::remove_cvref_t<P>, std::remove_cvref_t<Ps>...>;

// The old positional form with braces (see the constructor that explains it).
template <class Comm, class Model, class... Ps>
DataParallel(context<Comm>&, Model&, const DataParallelOptions&, detail::braced_policy, Ps&&...)
    -> DataParallel<Model, Comm, std::remove_cvref_t<Ps>...>;

//! The same with the policies named as types: `auto dp = make_data_parallel<Accumulate<2>>(ctx, model);`
//! (instances, in any order, may follow the model as in the constructors).
template <class... Policies, class Comm, class Model, class... Args>
auto make_data_parallel(context<Comm>& ctx, Model& model, Args&&... args) {
  return DataParallel<Model, Comm, Policies...>(ctx, model, std::forward<Args>(args)...);
}

//! lockstep::Distributed<Model, Comm, Policies...> — data parallelism with one process per
//! device (run(Processes{}) with NcclComm, run(Mpi{}) with MpiComm). It is the same strategy
//! as DataParallel — the same reducer, buckets, policies and checks — driven from a
//! process-per-rank context instead of a thread-per-rank one; the name says how the job runs.
template <class Model, class Comm, class... Policies>
using Distributed = DataParallel<Model, Comm, Policies...>;

}  // namespace lockstep
