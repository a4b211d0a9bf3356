#pragma once
//! lockstep::block_use<DP> — one use of a block of the model under ShardedGradients or
//! FullySharded (DataParallel::use_block): while it lives, the block's values (and, in a
//! backward use, its gradient buffers) are attached to the model (lockstep::model (i)); when it
//! ends, they are detached — a backward use's gradients are then final and go to their
//! reduce-scatter.
//!
//! A forward takes block k's use for its compute (`auto use = dp.use_block(k, pass::forward);`),
//! blocks in forward order; a backward takes it again (`pass::backward`) around block k's
//! backward — and its recomputation, if any — blocks in reverse order (docs/sharding.md).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <utility>

#include "lockstep/parallel/policies.hpp"

namespace lockstep {

template <class DP>
class block_use {
 public:
  block_use(const block_use&) = delete;
  block_use& operator=(const block_use&) = delete;
  block_use(block_use&& o) noexcept
      : dp_(std::exchange(o.dp_, nullptr)), block_(o.block_), pass_(o.pass_), unwinding_(o.unwinding_),
        epoch_(o.epoch_) {}
  //! Ends the use (see end()) — unless an exception is unwinding the stack: then the step is
  //! abandoned (DataParallel::step() cleans up, issuing no collective on this rank alone now).
  ~block_use() noexcept(false) {
    if (!dp_) return;
    if (std::uncaught_exceptions() > unwinding_) {
      std::exchange(dp_, nullptr)->abandon();
      return;
    }
    end();
  }

  std::size_t block() const noexcept { return block_; }
  lockstep::pass pass() const noexcept { return pass_; }
  //! Ends the use now: the block's values are detached (FullySharded: released unless kept for
  //! the backward), and after a backward use, its gradients are final and reduce-scattered.
  //! A use from a step that was abandoned since has nothing left to end.
  void end() {
    if (auto* dp = std::exchange(dp_, nullptr); dp && dp->epoch_ == epoch_) dp->end_block(block_, pass_);
  }

 private:
  friend DP;
  block_use(DP* dp, std::size_t block, lockstep::pass p)
      : dp_(dp), block_(block), pass_(p), unwinding_(std::uncaught_exceptions()), epoch_(dp->epoch_) {}
  DP* dp_;
  std::size_t block_;
  lockstep::pass pass_;
  int unwinding_;
  std::uint64_t epoch_;  // DataParallel's count of abandoned steps when the use began
};

}  // namespace lockstep
