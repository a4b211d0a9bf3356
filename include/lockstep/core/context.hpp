#pragma once
//! lockstep::context<Comm> — what the SPMD body sees on its rank: who it is, which device
//! it drives, and the communicator that connects it to the other ranks.

#include <utility>

#include "lockstep/core/concepts.hpp"

namespace lockstep {

class elastic_link;  // launch/elastic_link.hpp

template <class Comm>
class context {
 public:
  using comm_type = Comm;

  //! device: the GPU this rank drives, or -1 for a CPU rank.
  context(Comm comm, int local_rank, int device) : comm_(std::move(comm)), local_rank_(local_rank), device_(device) {}

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  int local_rank() const noexcept { return local_rank_; }
  int device() const noexcept { return device_; }
  bool is_root() const { return rank() == 0; }
  Comm& comm() noexcept { return comm_; }
  const Comm& comm() const noexcept { return comm_; }

  //! What the launch mode lends an ElasticGroup built on this context (run(Processes):
  //! the job's store and a watchdog per membership); nullptr where the mode lends nothing
  //! (the group is then given a store, as with ranks as threads).
  elastic_link* elastic() const noexcept { return elastic_; }
  void set_elastic(elastic_link* link) noexcept { elastic_ = link; }

  //! How often this rank's body was started again after it failed: 0 on its first start
  //! (run(Threads) with Threads::max_restarts; a restarted rank joins the running job as a
  //! replacement when it builds an ElasticGroup on this context). run(Processes) says it
  //! through elastic() instead (LOCKSTEP_ELASTIC_JOIN).
  int restart_count() const noexcept { return restart_count_; }
  //! Whether the launch mode starts a failed rank's body again (run(Threads) with
  //! max_restarts > 0): an ElasticGroup on this context then looks for replacements at commit().
  bool restarts_failed() const noexcept { return restarts_failed_; }
  void set_restarts(int count, bool enabled) noexcept {
    restart_count_ = count;
    restarts_failed_ = enabled;
  }

 private:
  Comm comm_;
  elastic_link* elastic_ = nullptr;
  int restart_count_ = 0;
  bool restarts_failed_ = false;
  int local_rank_ = 0;
  int device_ = -1;
};

}  // namespace lockstep
