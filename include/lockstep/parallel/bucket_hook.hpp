#pragma once
//! The bucket's collective as an extension point (PyTorch DDP's communication hooks): what a
//! bucket of gradients goes through once every gradient in it is final. DataParallel takes a
//! hook as one of its policies; the default averages with one all-reduce. A sharded optimizer
//! (reduce-scatter), a compressed or low-precision wire plug in here.

#include <concepts>
#include <cstddef>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

// ---------------------------------------------------------------------------------------
//! lockstep::bucket_hook<H, Comm> — how a bucket's gradients are combined across ranks.
//!
//! Requirements, for `H& h`, a communicator `Comm& comm`, `void* data` (comm's memory space),
//! `std::size_t count`, `dtype t`:
//!  1. `h.reduce(comm, data, count, t)` issues the bucket's reduction and returns a
//!     lockstep::work; once that work is waited for, `data` holds the mean over ranks of every
//!     rank's `data` (what the rest of the step — unscaling, clipping, the optimizer — reads).
//!  2. Every rank's hook issues the same collectives in the same order (the hook is called
//!     for the same buckets in the same order on every rank).
//!  3. Default-constructible and copyable, like every DataParallel policy.
//! DataParallel has already folded accumulation's 1/K into `data`; the hook owes the 1/N.
//!
//! Example: AllReduceMean below.
template <class H, class Comm>
concept bucket_hook = std::semiregular<H> && communicator<Comm> &&
                      requires(H& h, Comm& comm, void* data, std::size_t count, dtype t) {
                        { h.reduce(comm, data, count, t) } -> work;
                      };

//! The default hook: one all-reduce with reduce_op::avg, in place (NCCL folds the 1/N into its
//! reduction: no extra pass over the gradients).
struct AllReduceMean {
  template <communicator Comm>
  auto reduce(Comm& comm, void* data, std::size_t count, dtype t) {
    return comm.all_reduce(data, data, count, t, reduce_op::avg);
  }
};

}  // namespace lockstep
