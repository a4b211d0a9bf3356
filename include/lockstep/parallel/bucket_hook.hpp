#pragma once
//! The bucket's collective as an extension point (PyTorch DDP's communication hooks): what a
//! bucket of gradients goes through once every gradient in it is final. DataParallel takes a
//! hook as one of its policies; the default averages with one all-reduce. A sharded optimizer
//! (reduce-scatter), a compressed or low-precision wire plug in here.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/detail/half.hpp"
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

//! Staging buffers of a low-precision wire, one per bucket (keyed by the bucket's address,
//! which stays put from step to step), allocated once in the communicator's memory space.
class wire_staging {
 public:
  template <class Memory>
  void* get(const Memory& mem, const void* key, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    auto& slot = bufs_[key];
    if (slot.first < bytes) slot = {bytes, mem.allocate(bytes)};
    return slot.second.get();
  }
  //! Bytes held (for the memory report).
  std::size_t bytes() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& [k, v] : bufs_) n += v.first;
    return n;
  }

 private:
  mutable std::mutex mutex_;
  std::map<const void*, std::pair<std::size_t, std::shared_ptr<void>>> bufs_;
};

//! Gradients in bf16 on the wire, accumulated in fp32 (never a bf16 sum across ranks): fp32
//! buckets are rounded to bf16, exchanged with an all-to-all, each rank sums its block of the N
//! ranks' values in fp32 (in rank order) and takes the mean, and the means go round again in
//! bf16 (an all-gather). Half the bytes of an fp32 all-reduce; every rank ends with the same
//! bf16-rounded mean. With ShardedOptimizer the reduce-scatter half alone: the shard's mean
//! stays fp32. Other element types (bf16, f16, f64 gradients) take the plain all-reduce.
//!  - On NcclComm (include lockstep/cuda.cuh): the casts and the sum are kernels on the
//!    communication stream between the collectives, so the compute stream is not held; staging
//!    costs two bf16 copies of each bucket (the size of the fp32 gradients).
//!  - On host communicators (ThreadComm, MpiComm) the same rounding with fp32 collectives, for
//!    tests and CPU ranks: the numbers of the wire, not its bytes.
//! \code
//!   lockstep::DataParallel dp(ctx, model, lockstep::Bf16Wire{});
//! \endcode
class Bf16Wire {
 public:
  Bf16Wire() = default;
  //! on = false: the plain fp32 all-reduce, for choosing the wire at run time (a flag) without
  //! a second DataParallel type.
  explicit Bf16Wire(bool on) : on_(on) {}
  bool on() const noexcept { return on_; }

  template <communicator Comm>
  auto reduce(Comm& comm, void* data, std::size_t count, dtype t) {
    if (!on_ || t != dtype::f32 || comm.size() == 1) return comm.all_reduce(data, data, count, t, reduce_op::avg);
    if constexpr (requires { bf16_wire_all_reduce(comm, *staging_, data, count); }) {
      return bf16_wire_all_reduce(comm, *staging_, data, count);
    } else {
      host_only(comm);
      round(data, count);
      comm.all_reduce(data, data, count, t, reduce_op::avg).wait();
      round(data, count);
      return decltype(comm.all_reduce(data, data, count, t, reduce_op::avg)){};
    }
  }

  //! Block rank() of data (size()·per elements) ← the fp32 mean over ranks of the blocks, each
  //! rank's values rounded to bf16 first; mine points at that block.
  template <communicator Comm>
  auto reduce_scatter(Comm& comm, void* data, void* mine, std::size_t per, dtype t) {
    if (!on_ || t != dtype::f32 || comm.size() == 1) return comm.reduce_scatter(data, mine, per, t, reduce_op::avg);
    if constexpr (requires { bf16_wire_reduce_scatter(comm, *staging_, data, mine, per); }) {
      return bf16_wire_reduce_scatter(comm, *staging_, data, mine, per);
    } else {
      host_only(comm);
      round(data, per * static_cast<std::size_t>(comm.size()));
      comm.reduce_scatter(data, mine, per, t, reduce_op::avg).wait();
      return decltype(comm.reduce_scatter(data, mine, per, t, reduce_op::avg)){};
    }
  }

  //! Staging bytes held on this rank.
  std::size_t staging_bytes() const { return staging_->bytes(); }

 private:
  template <class Comm>
  static void host_only(Comm& comm) {
    static_assert(
        !requires { comm.comm_stream(); },
        "lockstep::Bf16Wire on a device communicator: include lockstep/cuda.cuh (its wire kernels)");
  }
  static void round(void* data, std::size_t n) {
    auto* f = static_cast<float*>(data);
    for (std::size_t i = 0; i < n; ++i) f[i] = detail::float_of_bf16(detail::bf16_of_float(f[i]));
  }
  std::shared_ptr<wire_staging> staging_ = std::make_shared<wire_staging>();
  bool on_ = true;
};

//! The hook's reduce-scatter where it has one (a low-precision wire), else the communicator's
//! mean: what ShardedOptimizer's buckets go through.
template <class Hook, class Comm>
auto hook_reduce_scatter(Hook& h, Comm& comm, void* data, void* mine, std::size_t per, dtype t) {
  if constexpr (requires { h.reduce_scatter(comm, data, mine, per, t); })
    return h.reduce_scatter(comm, data, mine, per, t);
  else return comm.reduce_scatter(data, mine, per, t, reduce_op::avg);
}

}  // namespace lockstep
