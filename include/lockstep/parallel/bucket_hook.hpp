#pragma once
//! The bucket's collective as an extension point (PyTorch DDP's communication hooks): what a
//! bucket of gradients goes through once every gradient in it is final. DataParallel takes a
//! hook as one of its policies; the default averages with one all-reduce. A sharded optimizer
//! (reduce-scatter), a compressed or low-precision wire (parallel/gradient_wire.hpp) plug in here.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
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
concept bucket_hook =
    std::semiregular<H> && communicator<Comm> && requires(H& h, Comm& comm, void* data, std::size_t count, dtype t) {
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

//! Hierarchical reduction for jobs over several nodes: within each node a reduce-scatter of the
//! bucket, across nodes an all-reduce of each rank's block (1/L of the bytes per rank over the
//! slow links, L ranks per node sending in parallel), within the node an all-gather. Ranks
//! r·L … r·L+L−1 form a node (launchers number ranks node by node; the launcher's count is
//! `detect_launcher()->local_world`). A tail the node size does not divide goes through one flat
//! all-reduce. With L = 1 or one node (L = the job's size) it is the flat all-reduce, since the
//! three steps cost more than one on a single node (measured: 0.78× on 4 × H200 with L = 2).
//! Default-constructed (no nodes given): the flat all-reduce, as AllReduceMean. The three steps run one after the
//! other: on host communicators the call returns when the first two are done; on NCCL each step's stream waits for the
//! one before, and the call returns at once.
//! \code
//!   lockstep::DataParallel dp(ctx, model, lockstep::Hierarchical(ctx.comm(), {.ranks_per_node = 8}));
//! \endcode
struct HierarchicalOptions {
  int ranks_per_node = 1;  //!< L: divides the job's size
};

template <splittable_communicator Comm>
class Hierarchical {
 public:
  Hierarchical() = default;
  //! Splits comm into the node and cross-node communicators (collective over comm).
  Hierarchical(Comm& comm, HierarchicalOptions o) {
    const int n = comm.size(), l = o.ranks_per_node, r = comm.rank();
    if (l < 1 || n % l != 0)
      throw config_error("lockstep::Hierarchical: ranks_per_node = " + std::to_string(l) + " does not divide the " +
                         std::to_string(n) + " ranks of the job");
    if (l == 1 || l == n) return;  // one rank per node, or one node: nothing to gain, the flat all-reduce
    node_ = std::make_shared<Comm>(comm.split(r / l, r));
    across_ = std::make_shared<Comm>(comm.split(r % l, r));
  }

  auto reduce(Comm& comm, void* data, std::size_t count, dtype t) {
    if (!node_) return comm.all_reduce(data, data, count, t, reduce_op::avg);
    const std::size_t l = static_cast<std::size_t>(node_->size()), block = count / l, main = block * l;
    if (block == 0) return comm.all_reduce(data, data, count, t, reduce_op::avg);  // smaller than a node: flat
    const std::size_t es = size_of(t);
    auto* bytes = static_cast<unsigned char*>(data);
    if (main < count)  // the tail, flat
      comm.all_reduce(bytes + main * es, bytes + main * es, count - main, t, reduce_op::avg).wait();
    void* mine = bytes + static_cast<std::size_t>(node_->rank()) * block * es;
    auto rs = node_->reduce_scatter(data, mine, block, t, reduce_op::avg);  // mean within the node
    then(rs, *across_);
    auto ar = across_->all_reduce(mine, mine, block, t, reduce_op::avg);  // mean of the nodes' means
    then(ar, *node_);
    return node_->all_gather(mine, data, block, t);
  }

  //! Orders `next`'s following collective after w. A device communicator chains its own
  //! streams (the compute stream is not held, so backward goes on while the three steps run);
  //! a host communicator waits.
  template <class Work>
  static void then(Work& w, Comm& next) {
    if constexpr (requires {
                    next.comm_stream();
                    w.wait(next.comm_stream());
                  })
      w.wait(next.comm_stream());
    else w.wait();
  }

  //! The communicators within this rank's node and across nodes (null when default-constructed).
  const std::shared_ptr<Comm>& node() const noexcept { return node_; }
  const std::shared_ptr<Comm>& across() const noexcept { return across_; }

 private:
  std::shared_ptr<Comm> node_, across_;
};

//! The hook's reduce-scatter where it has one (a low-precision wire), else the communicator's
//! mean: what ShardedOptimizer's buckets go through. `key` names the unit where data's address
//! may change from step to step (pooled buffers), for a hook that keeps state per unit (a wire's
//! error feedback) and takes it.
template <class Hook, class Comm>
auto hook_reduce_scatter(Hook& h, Comm& comm, void* data, void* mine, std::size_t per, dtype t,
                         const void* key = nullptr) {
  if constexpr (requires { h.reduce_scatter(comm, data, mine, per, t, key); })
    return h.reduce_scatter(comm, data, mine, per, t, key);
  else if constexpr (requires { h.reduce_scatter(comm, data, mine, per, t); })
    return h.reduce_scatter(comm, data, mine, per, t);
  else return comm.reduce_scatter(data, mine, per, t, reduce_op::avg);
}

//! Tells a hook that keeps state per bucket (a wire's error feedback) that the gradient layout
//! it saw is going away: a rebuild became due or was made (DataParallel's plan), the first
//! step settled on one fused all-reduce.
template <class Hook>
void hook_layout_changed(Hook& h) {
  if constexpr (requires { h.layout_changed(); }) h.layout_changed();
}

}  // namespace lockstep
