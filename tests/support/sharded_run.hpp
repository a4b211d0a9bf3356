#pragma once
// The training loop of the ShardedOptimizer tests, one rank's part, for any communicator
// (ThreadComm in tests/cpu/test_sharded.cpp, MpiComm in tests/mpi/test_mpi_sharded.cpp):
// the MLP trained with host AdamW, DynamicScale and Accumulate<>, sharded or not.
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"

namespace lockstep_test {

struct sharded_config {
  int ranks = 2;
  std::size_t batch = 3;  // per rank, per micro-step
  int accumulate = 1;
  int steps = 5;
  bool hooks = true;
  lockstep::BucketPolicy buckets{};
  double max_norm = 0;  // DataParallelOptions::max_grad_norm
  int inf_step = -1;    // this step's gradients get an inf on the last rank
  std::size_t inf_at = 0;
  int first_step = 0;                // resume: the step the loop starts at
  bool gather_in_forward = false;    // sharded: each parameter waited for just before the forward
  bool block_per_parameter = false;  // full sharding: each parameter its own block (else each layer)
  int skip_step = -1;                // this step is not run (its batch is not seen)
  int abandon_step = -1;             // full sharding: this step's backward throws at layer 1 on every rank, caught
  bool model_storage = false;        // full sharding: block buffers from the model's allocator (block_storage)
  lockstep::wire_format gather_wire = lockstep::wire_format::fp32;  // ShardedOptimizer::gather_wire
  bool gather_deltas = true;                                        // ShardedOptimizer::gather_deltas
};

//! What the training loop of an abandon_step throws (and catches).
struct abandoned_step {};

struct sharded_outcome {
  std::vector<std::vector<double>> values;  // per rank, widened
  std::vector<int> applied;                 // rank 0, per step
  std::vector<double> norms;                // rank 0, per step
  double final_scale = 0;
  std::size_t state_elements = 0;  // rank 0: optimizer state per buffer
  std::size_t shard_bytes = 0;
  bool values_bound = false;   // rank 0: the model's values live in the shards' arena
  std::size_t lent_bytes = 0;  // rank 0, full sharding: the block buffers lent
  // rank 0, model_storage: buffers the model's allocator gave, bytes of them still alive after
  // the last step, and the most alive at once
  std::size_t storage_allocations = 0, storage_left = 0, storage_peak = 0;
};

using Scale = lockstep::DynamicScale;
constexpr lockstep::DynamicScaleOptions scale_options{.init_scale = 1024.0, .growth_interval = 3};

// One rank of config c (c.ranks must be ctx.size()) under Strategy (Replicated,
// ShardedOptimizer, ShardedGradients, FullySharded: each layer's blocks used through
// use_block). hold(ctx, dp, opt, step) is called after each optimizer step (checkpoints);
// start(dp, opt) before the first (resume). Fills out.values[rank], and on rank 0 the rest of out.
template <class T, class Strategy, bool Bindable, class Ctx, class Hold = std::nullptr_t, class Start = std::nullptr_t>
void train_rank_as(Ctx& ctx, const dataset& d, const sharded_config& c, std::uint64_t init_seed, sharded_outcome& out,
                   Hold hold = nullptr, Start start = nullptr, Strategy strategy = {}) {
  using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
  using Model = TestMlp<T, Bindable>;
  constexpr bool Sharded = !std::is_same_v<Strategy, lockstep::Replicated>;
  std::size_t allocations = 0, alive = 0, peak = 0;  // declared before m: its allocator's books
  Model m(d.dims, init_seed + static_cast<std::uint64_t>(ctx.rank()) * 7919);
  m.block_per_parameter = c.block_per_parameter;
  if (c.model_storage)
    m.storage = [&](std::size_t bytes) {
      ++allocations;
      peak = std::max(peak, alive += bytes);
      return std::shared_ptr<void>(std::malloc(bytes), [&alive, bytes](void* p) {
        alive -= bytes;
        std::free(p);
      });
    };
  constexpr bool ZeRO1 = std::is_same_v<Strategy, lockstep::ShardedOptimizer>;
  const bool deferred = ZeRO1 && c.gather_in_forward;
  const lockstep::DataParallelOptions o{.buckets = c.buckets, .max_grad_norm = c.max_norm};
  if constexpr (ZeRO1) {
    strategy.gather_in_forward = deferred;
    strategy.gather_wire = c.gather_wire;
    strategy.gather_deltas = c.gather_deltas;
  }
  using DP = lockstep::DataParallel<Model, Comm, lockstep::Accumulate<>, Scale, Strategy>;
  DP p(ctx, m, o, lockstep::Accumulate<>(c.accumulate), Scale(scale_options), strategy);
  lockstep::AdamW opt({.lr = 0.01, .weight_decay = 0.05});
  if constexpr (!std::is_same_v<Start, std::nullptr_t>) start(p, opt);
  const std::size_t global = c.batch * static_cast<std::size_t>(c.ranks * c.accumulate);
  for (int s = c.first_step; s < c.steps; ++s) {
    if (s == c.skip_step) continue;
    lockstep::step_result r;
    try {
      for (int k = 0; k < c.accumulate; ++k) {
        auto step = p.step();
        std::vector<std::size_t> rows(c.batch);
        const std::size_t first =
            static_cast<std::size_t>(s) * global + (static_cast<std::size_t>(k) * c.ranks + ctx.rank()) * c.batch;
        for (std::size_t i = 0; i < c.batch; ++i) rows[i] = (first + i) % d.samples;
        // The inf goes in before parameter 0's gradient is reported final (and reduced).
        const bool inject = s == c.inf_step && ctx.rank() == c.ranks - 1 && step.synchronizes();
        const auto poison = [&] {
          static_cast<T*>(m.parameters()[0].grad)[c.inf_at] = std::numeric_limits<T>::infinity();
        };
        if (deferred)  // what a layer-by-layer forward does, here all before TestMlp's forward
          for (std::size_t i = 0; i < m.parameters().size(); ++i) p.wait_parameters(i);
        m.forward_backward(
            inputs<T>(d), d.y, rows,
            [&](std::size_t i) {
              if (inject && i == 0) poison();
              if (c.hooks) step.gradient_ready(i);
            },
            step.loss_scale(),
            [&](std::size_t l, bool forward) {
              std::vector<lockstep::block_use<DP>> held;  // the layer's blocks, for its forward or backward
              if constexpr (DP::block_sharded) {
                const auto blocks = m.blocks();
                for (std::size_t i : {2 * l, 2 * l + 1})
                  if (i == 2 * l || blocks[i] != blocks[2 * l])
                    held.push_back(
                        p.use_block(blocks[i], forward ? lockstep::pass::forward : lockstep::pass::backward));
                // Layers L-1 … 2 are reduce-scattered by now; layer 1's uses end by the exception.
                if (s == c.abandon_step && !forward && l == 1) throw abandoned_step{};
              }
              return held;
            });
        if constexpr (Sharded) {
          r = step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
        } else {
          r = step.finish();
          if (r) opt.step(p.parameters());
        }
      }
    } catch (const abandoned_step&) {
      continue;  // the step is dropped; the next one begins a cycle anew
    }
    if (ctx.rank() == 0) {
      out.applied.push_back(r.applied ? 1 : 0);
      out.norms.push_back(r.grad_norm);
    }
    if constexpr (!std::is_same_v<Hold, std::nullptr_t>) hold(ctx, p, opt, s);
  }
  if (deferred || DP::block_sharded) p.wait_all_parameters();
  std::vector<double> v;
  for (auto x : m.flat_values()) v.push_back(static_cast<double>(x));
  out.values[static_cast<std::size_t>(ctx.rank())] = std::move(v);
  if (ctx.rank() == 0) {
    out.final_scale = p.scaler().scale();
    for (std::size_t i = 0; i < opt.slot_count(); ++i) out.state_elements += opt.template state<T>(i, 0).size();
    out.shard_bytes = p.stats().shard_bytes;
    out.values_bound = p.stats().values_bound;
    out.lent_bytes = p.stats().lent_bytes;
    out.storage_allocations = allocations;
    out.storage_left = alive;
    out.storage_peak = peak;
  }
}

template <class T, bool Sharded, bool Bindable, class Ctx, class Hold = std::nullptr_t, class Start = std::nullptr_t>
void train_rank(Ctx& ctx, const dataset& d, const sharded_config& c, std::uint64_t init_seed, sharded_outcome& out,
                Hold hold = nullptr, Start start = nullptr) {
  using Strategy = std::conditional_t<Sharded, lockstep::ShardedOptimizer, lockstep::Replicated>;
  train_rank_as<T, Strategy, Bindable>(ctx, d, c, init_seed, out, hold, start);
}

inline std::size_t parameter_count(const dataset& d) {
  std::size_t n = 0;
  for (std::size_t l = 0; l + 1 < d.dims.size(); ++l)
    n += static_cast<std::size_t>(d.dims[l] * d.dims[l + 1] + d.dims[l + 1]);
  return n;
}

}  // namespace lockstep_test
