#pragma once
//! lockstep::elastic_link — what a launch mode lends a lockstep::ElasticGroup built on its
//! context (run(Processes) does): the job's store, and a watchdog for each membership, so that
//! a peer's failure releases this rank's communicator without ending the process, and the
//! survivors watch each other again once they regrouped.
//!
//! The ElasticGroup calls, for each change of membership:
//!  1. leave()  — the failure released the communicator: the membership's watchdog stops
//!     without ending the process, its watch withdrawn (this rank is not gone);
//!  2. gone(epoch, ranks) — while the survivors agree: the ranks whose store connection closed
//!     or went silent (the store keeps one key per firing watch: store/detail/wire.hpp);
//!  3. watch(epoch, ranks) — the survivors agreed on the new membership: its watchdog starts
//!     before the communicator is made, so that a rank lost meanwhile still ends the job by
//!     name (after watchdog_options::grace) instead of leaving the others waiting;
//!  4. adopt() — the new communicator is in place (the context's): the watchdog may abort and
//!     poll it from now on. Returns the failure seen since watch(), if any (then the new
//!     communicator is aborted already: change again).
//! The same leave / watch / adopt when the membership grows (launch/elastic_join.hpp). A
//! replacement process starts in the membership it joined: start().

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lockstep/launch/elastic_join.hpp"

namespace lockstep {

class TcpStore;

class elastic_link {
 public:
  virtual ~elastic_link() = default;
  //! The job's store (the one rank 0 hosts).
  virtual TcpStore& store() = 0;
  virtual void leave() = 0;
  virtual std::vector<int> gone(std::uint64_t epoch, std::span<const int> ranks) = 0;
  virtual void watch(std::uint64_t epoch, std::span<const int> ranks) = 0;
  virtual std::optional<std::string> adopt() = 0;
  //! The failure that released the communicator (the watchdog's text), if one was seen.
  virtual std::optional<std::string> failure() const = 0;
  //! The membership this process started in: the whole job (epoch 0, no steps), or for a
  //! replacement the one it was admitted to. For the one ElasticGroup of the run: a second
  //! call throws config_error (a second group would start from a membership long changed).
  virtual growth start() = 0;
};

//! The key a membership's watchdogs watch: the job's failure key for the first membership (a
//! job that never changes uses only that one), one per change after it.
inline std::string membership_failure_key(std::uint64_t epoch) {
  return epoch == 0 ? std::string("lockstep/failed") : "lockstep.elastic/" + std::to_string(epoch) + "/failed";
}

}  // namespace lockstep
