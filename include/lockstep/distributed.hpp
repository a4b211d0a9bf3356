#pragma once
//! lockstep::Distributed<Model, Comm, Policies...> — data parallelism with one process per
//! device (run(Processes{}) with NcclComm, run(Mpi{}) with MpiComm). It is the same strategy
//! as DataParallel — the same reducer, buckets, policies and checks — driven from a
//! process-per-rank context instead of a thread-per-rank one; the name says how the job runs.
#include "lockstep/data_parallel.hpp"

namespace lockstep {

template <class Model, class Comm, class... Policies>
using Distributed = DataParallel<Model, Comm, Policies...>;

}  // namespace lockstep
