#pragma once
//! Saving a checkpoint from a job: rank 0 writes, every rank learns the outcome.

#include <concepts>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <span>

#include "lockstep/checkpoint/checkpoint.hpp"
#include "lockstep/checkpoint/file.hpp"
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

// ---------------------------------------------------------------------------------------
//! Rank 0 calls `build(Checkpoint&)` and saves the result to `path`; the other ranks do
//! neither. Every rank returns only once rank 0 has finished (the file is in place, so
//! any rank may load it next), and if rank 0 failed every rank throws: rank 0 its own
//! error, the others a checkpoint_error that points to it. Collective: every rank calls it.
template <communicator C, class Build>
  requires std::invocable<Build&, Checkpoint&>
void save_checkpoint_rank0(C& comm, const std::filesystem::path& path, Build&& build) {
  std::exception_ptr failure;
  if (comm.rank() == 0) {
    try {
      Checkpoint ck;
      build(ck);
      save_checkpoint(path, ck);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // The status exchange is also the barrier: no rank leaves before rank 0 is done.
  std::int32_t status = failure ? 1 : 0;
  detail::host_all_reduce(comm, std::span<std::int32_t>(&status, 1), reduce_op::max);
  if (failure) std::rethrow_exception(failure);
  if (status != 0)
    throw checkpoint_error("rank 0 failed to save checkpoint '" + path.string() +
                           "' (rank 0's error says why); no new checkpoint was written and the "
                           "previous one at that path, if any, is unchanged");
}

//! Same, for a checkpoint already built on every rank (only rank 0's is written).
template <communicator C>
void save_checkpoint_rank0(C& comm, const std::filesystem::path& path, const Checkpoint& ck) {
  save_checkpoint_rank0(comm, path, [&](Checkpoint& out) { out = ck; });
}

}  // namespace lockstep
