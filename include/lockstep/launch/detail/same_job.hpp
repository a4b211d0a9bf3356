#pragma once
//! run(Processes)'s first exchange through the job's store: every rank must run the same
//! lockstep, with the same world size and launcher, and the same mode of the order check (a rank
//! that sends seals pairs them with another's collectives, and deferred seals ride on lockstep's
//! peer all-reduce where immediate ones are gathered).

#include <string>

#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/launch/launch_env.hpp"
#include "lockstep/store/store.hpp"
#include "lockstep/version.hpp"

namespace lockstep::detail {

//! What this process runs, as compared across the job.
inline std::string job_hello(const launch_info& info) {
  const auto mode = order_check_mode_from_env();
  return std::string("lockstep ") + version_string + ", world " + std::to_string(info.world) + ", launcher " +
         info.launcher + ", order check " +
         (mode == order_check_mode::off         ? "off"
          : mode == order_check_mode::immediate ? "immediate"
                                                : "deferred");
}

//! Publishes this rank's job_hello and compares it with rank 0's (waits for it: the store's
//! timeout); mismatch_error naming both when they differ.
template <class S>
void check_same_job(S& store, const launch_info& info) {
  const std::string mine = job_hello(info);
  store.set("lockstep/hello/" + std::to_string(info.rank), bytes_of(mine));
  const auto root = string_of(store.get("lockstep/hello/0"));
  if (root != mine)
    throw mismatch_error("rank " + std::to_string(info.rank) + " runs '" + mine + "' but rank 0 runs '" + root +
                         "': start every process of the job from the same build and launcher, with the same "
                         "LOCKSTEP_CHECK_ORDER / LOCKSTEP_DEBUG");
}

}  // namespace lockstep::detail
