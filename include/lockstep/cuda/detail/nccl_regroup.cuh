#pragma once
//! What NcclComm::regroup does besides making the communicator: the NCCL id of the group of
//! survivors, agreed through the job's store, and what the new communicator takes over from
//! the old one (its compute stream, the tracking of collectives).

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include <nccl.h>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/store/store.hpp"

namespace lockstep::detail {

//! This rank's place among `members` (job ranks, ascending, without repeats), or a
//! config_error naming what is wrong with the list.
inline int regroup_place(int job_rank, std::span<const int> members, std::uint64_t change) {
  int place = -1;
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (i > 0 && members[i] <= members[i - 1])
      throw config_error("NcclComm::regroup: change " + std::to_string(change) +
                         ": the members must be job ranks in ascending order without repeats (as "
                         "agree_on_survivors returns them)");
    if (members[i] == job_rank) place = static_cast<int>(i);
  }
  if (place < 0)
    throw config_error("NcclComm::regroup: change " + std::to_string(change) + ": job rank " +
                       std::to_string(job_rank) +
                       " is not among the members; only the members of the new group regroup");
  return place;
}

//! The NCCL id of a group made through the store `st`: drawn by its first member (`first`)
//! and set under `key`; the others wait for it there (the store's timeout). `group` names it
//! in the error.
template <store S>
ncclUniqueId shared_nccl_id(S& st, const std::string& key, bool first, const std::string& group) {
  ncclUniqueId id{};
  if (first) {
    LOCKSTEP_TRY_NCCL(ncclGetUniqueId(&id));
    st.set(key, std::span<const std::byte>(reinterpret_cast<const std::byte*>(&id), sizeof id));
    return id;
  }
  const auto bytes = st.get(key);
  if (bytes.size() != sizeof id)
    throw mismatch_error("the NCCL id of " + group + " (store key " + key + ") has " + std::to_string(bytes.size()) +
                         " bytes, expected " + std::to_string(sizeof id) +
                         ": the ranks were built against different NCCL versions");
  std::memcpy(&id, bytes.data(), sizeof id);
  return id;
}

//! The NCCL id of change `change`'s group: drawn by its first member (place 0) and set in the
//! store under "lockstep.elastic/<change>/nccl_id".
template <store S>
ncclUniqueId regroup_id(S& st, std::uint64_t change, int place) {
  return shared_nccl_id(st, "lockstep.elastic/" + std::to_string(change) + "/nccl_id", place == 0,
                        "change " + std::to_string(change) + "'s group (NcclComm::regroup)");
}

//! `next` takes over from `old` what the model and the watchdog rely on: the compute stream
//! (its own one changes hands, so kernels queued on it stay in order and a stream the user
//! set stays set) and the tracking of collectives.
inline void regroup_carry_over(nccl_state& old, nccl_state& next) {
  if (old.compute == old.own_compute) {
    std::swap(old.own_compute, next.own_compute);
    old.compute = old.own_compute;
    next.compute = next.own_compute;
  } else {
    next.compute = old.compute;
  }
  next.tracking = old.tracking;
}

}  // namespace lockstep::detail
