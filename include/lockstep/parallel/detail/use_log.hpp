#pragma once
//! The block uses of a micro-step (ShardedGradients, FullySharded), in order: each
//! DataParallel::use_block and each end of a use, kept from the last synchronising micro-step
//! that completed. A rank out of data in a Join scope replays them without a model, so that it
//! issues the all-gathers and reduce-scatters of the ranks still stepping, in their order (the
//! prefetches follow from the uses), and contributes zero gradients.

#include <cstddef>
#include <utility>
#include <vector>

#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

class use_log {
 public:
  struct event {
    std::size_t block;
    lockstep::pass pass;
    bool begins;  // the use begins (else it ends)
  };

  //! A micro-step begins: its uses are recorded anew.
  void begin() { now_.clear(); }
  void record(std::size_t k, lockstep::pass p, bool begins) { now_.push_back({k, p, begins}); }
  //! A synchronising micro-step completed: its uses are the ones to replay.
  void commit() { last_ = now_; }

  //! What a rank without data replays: the last completed synchronising micro-step's uses —
  //! or, before this rank completed any (with accumulation: a whole cycle), every one of
  //! `blocks` blocks used in forward order, then in backward order (what a model with
  //! use_block around each block's forward and backward does; one whose uses differ must
  //! complete a cycle before it runs out of data).
  std::vector<event> replayed(std::size_t blocks) const {
    if (!last_.empty()) return last_;
    std::vector<event> plain;
    for (std::size_t k = 0; k < blocks; ++k) {
      plain.push_back({k, lockstep::pass::forward, true});
      plain.push_back({k, lockstep::pass::forward, false});
    }
    for (std::size_t k = blocks; k-- > 0;) {
      plain.push_back({k, lockstep::pass::backward, true});
      plain.push_back({k, lockstep::pass::backward, false});
    }
    return plain;
  }

 private:
  std::vector<event> now_, last_;
};

}  // namespace lockstep::detail
