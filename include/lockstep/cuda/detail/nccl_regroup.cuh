#pragma once
//! NcclComm::regroup's parts: this rank's place among the members that go on, and the NCCL id
//! of their new communicator, made by the lowest member and shared through the job's store.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include <nccl.h>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/store/store.hpp"

namespace lockstep::detail {

struct regroup_place {
  int rank = 0, size = 0;
};

//! job_rank's place in `members` (ascending, distinct, holding it), else config_error.
inline regroup_place regroup_place_of(std::span<const int> members, int job_rank) {
  const auto at = std::find(members.begin(), members.end(), job_rank);
  if (at == members.end() || !std::is_sorted(members.begin(), members.end()) ||
      std::adjacent_find(members.begin(), members.end()) != members.end())
    throw config_error("NcclComm::regroup: the members (" + std::to_string(members.size()) +
                       " job ranks) must be ascending, distinct and include this rank's job rank " +
                       std::to_string(job_rank) + "; pass what agree_on_survivors decided");
  return {static_cast<int>(at - members.begin()), static_cast<int>(members.size())};
}

//! The id of change `change`'s communicator: made and set by the first member, read (waiting,
//! bounded by the store's timeout) by the others.
template <store Store>
ncclUniqueId regroup_id(Store& st, std::uint64_t change, bool first) {
  const std::string key = "lockstep.elastic/" + std::to_string(change) + "/nccl_id";
  ncclUniqueId id{};
  if (first) {
    LOCKSTEP_TRY_NCCL(ncclGetUniqueId(&id));
    st.set(key, std::span<const std::byte>(reinterpret_cast<const std::byte*>(&id), sizeof id));
    return id;
  }
  const auto bytes = st.get(key);
  if (bytes.size() != sizeof id)
    throw mismatch_error("NcclComm::regroup: the NCCL id of change " + std::to_string(change) + " has " +
                         std::to_string(bytes.size()) + " bytes, expected " + std::to_string(sizeof id) +
                         ": the ranks were built against different NCCL versions");
  std::memcpy(&id, bytes.data(), sizeof id);
  return id;
}

}  // namespace lockstep::detail
