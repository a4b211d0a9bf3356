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
      : dp_(std::exchange(o.dp_, nullptr)), block_(o.block_), pass_(o.pass_), unwinding_(o.unwinding_) {}
  //! Ends the use (see end()). An error ending it is thrown on, unless an exception is already
  //! unwinding the stack (then the step is abandoned anyway and the error dropped).
  ~block_use() noexcept(false) {
    if (!dp_) return;
    if (std::uncaught_exceptions() > unwinding_) {
      try {
        end();
      } catch (...) {
      }
      return;
    }
    end();
  }

  std::size_t block() const noexcept { return block_; }
  lockstep::pass pass() const noexcept { return pass_; }
  //! Ends the use now: the block's values are detached (FullySharded: released unless kept for
  //! the backward), and after a backward use, its gradients are final and reduce-scattered.
  void end() {
    if (auto* dp = std::exchange(dp_, nullptr)) dp->end_block(block_, pass_);
  }

 private:
  friend DP;
  block_use(DP* dp, std::size_t block, lockstep::pass p)
      : dp_(dp), block_(block), pass_(p), unwinding_(std::uncaught_exceptions()) {}
  DP* dp_;
  std::size_t block_;
  lockstep::pass pass_;
  int unwinding_;
};

}  // namespace lockstep
