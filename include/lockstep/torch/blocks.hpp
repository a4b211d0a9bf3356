#pragma once
//! lockstep::TorchBlocks — full sharding (ShardedGradients, FullySharded) for a libtorch model:
//! what its forward calls at each block. libtorch has no module pre-hooks, so the one line a
//! model changes is the block call: `x = blocks.run(k, x, f)` runs `f(x)` (the block's forward)
//! as block k (TorchModule::set_blocks numbers them 1, 2, …; block 0 is every other parameter):
//!
//!  - forward: block k's values are requested (gathered, attached to its parameters) before
//!    f runs and released after it;
//!  - backward: an identity autograd node on f's output requests them again (with gradient
//!    buffers) before autograd reaches the block, and one on its input ends the use after
//!    the block's gradients are accumulated (its reduce-scatter goes out);
//!  - recompute (activation checkpointing): f runs without saving activations; in backward the
//!    values are requested, f runs again under grad mode, its backward runs (a reentrant
//!    backward, as torch.utils.checkpoint's), and the use ends.
//!
//! Without a DataParallel connected (shard_blocks), run(k, x, f) is f(x). When recomputing, f
//! is kept until block k runs again (its backward runs f again): capture by value (`[=]`, the
//! block's module holder), never a loop variable by reference.
//! Block 0 (the root: embeddings, final norm, head) spans the whole forward and backward: the
//! training loop holds dp.use_block(0, pass::forward) around the forward and
//! dp.use_block(0, pass::backward) around the backward (docs/torch.md).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>

#include "lockstep/core/error.hpp"
#include "lockstep/parallel/block_use.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep {

class TorchBlocks {
 public:
  using block_fn = std::function<at::Tensor(const at::Tensor&)>;
  //! gate(k, pass, begin): a use of block k begins (true) or ends (false).
  using gate_fn = std::function<void(std::size_t, pass, bool)>;

  //! Runs f(x) as block k (see the top); recompute: activation checkpointing.
  at::Tensor run(std::size_t k, const at::Tensor& x, block_fn f, bool recompute = false);
  //! The same as a plain function, for models that take one (a model without lockstep types).
  std::function<at::Tensor(std::size_t, const at::Tensor&, block_fn)> function(bool recompute = false) {
    return [this, recompute](std::size_t k, const at::Tensor& x, block_fn f) {
      return run(k, x, std::move(f), recompute);
    };
  }

  //! Connected by shard_blocks; empty: run() is f(x).
  void set_gate(gate_fn g) { gate_ = std::make_shared<gate_fn>(std::move(g)); }
  bool connected() const noexcept { return gate_ && *gate_; }

 private:
  std::shared_ptr<gate_fn> gate_;
  std::map<std::size_t, std::shared_ptr<block_fn>> fns_;  // recompute: each block's latest f
};

namespace detail {

//! Identity; its backward runs gate(k, backward, begin) — at a block's output (begin: the
//! block's backward is next) or its input (end: the block's gradients are accumulated).
struct torch_block_edge : torch::autograd::Function<torch_block_edge> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                std::int64_t gate, std::int64_t k, bool begin) {
    ctx->saved_data["gate"] = gate;
    ctx->saved_data["k"] = k;
    ctx->saved_data["begin"] = begin;
    return {x.view_as(x)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& gate = *reinterpret_cast<const TorchBlocks::gate_fn*>(ctx->saved_data["gate"].toInt());
    gate(static_cast<std::size_t>(ctx->saved_data["k"].toInt()), pass::backward, ctx->saved_data["begin"].toBool());
    return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

//! A block run without keeping its activations: forward under the block's forward use, f again
//! in backward under its backward use (the values requested again), then f's backward.
struct torch_block_recompute : torch::autograd::Function<torch_block_recompute> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                std::int64_t gate, std::int64_t k, std::int64_t fn) {
    const auto& g = *reinterpret_cast<const TorchBlocks::gate_fn*>(gate);
    const auto& f = *reinterpret_cast<const TorchBlocks::block_fn*>(fn);
    ctx->save_for_backward({x});
    ctx->saved_data["gate"] = gate;
    ctx->saved_data["k"] = k;
    ctx->saved_data["fn"] = fn;
    g(static_cast<std::size_t>(k), pass::forward, true);
    at::Tensor y;
    try {
      y = f(x);
    } catch (...) {
      g(static_cast<std::size_t>(k), pass::forward, false);
      throw;
    }
    g(static_cast<std::size_t>(k), pass::forward, false);
    return {y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& g = *reinterpret_cast<const TorchBlocks::gate_fn*>(ctx->saved_data["gate"].toInt());
    const auto& f = *reinterpret_cast<const TorchBlocks::block_fn*>(ctx->saved_data["fn"].toInt());
    const auto k = static_cast<std::size_t>(ctx->saved_data["k"].toInt());
    const auto x = ctx->get_saved_variables()[0];
    g(k, pass::backward, true);
    at::Tensor again = x.detach().requires_grad_(x.requires_grad());
    {
      torch::AutoGradMode on(true);
      at::Tensor y = f(again);
      torch::autograd::backward({y}, {grads[0]});
    }
    g(k, pass::backward, false);
    return {again.requires_grad() ? again.grad() : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

inline at::Tensor TorchBlocks::run(std::size_t k, const at::Tensor& x, block_fn f, bool recompute) {
  if (!connected()) return f(x);
  const auto gate = reinterpret_cast<std::int64_t>(gate_.get());
  const auto key = static_cast<std::int64_t>(k);
  // The input must be part of the graph for the end-of-backward node to run.
  const at::Tensor in = x.requires_grad() ? x : x.detach().requires_grad_(true);
  if (recompute) {
    // f must outlive the graph's node: kept until block k runs again (its backward has run by
    // then, one forward and its backward at a time).
    auto& held = fns_[k];
    held = std::make_shared<block_fn>(std::move(f));
    return detail::torch_block_recompute::apply(in, gate, key, reinterpret_cast<std::int64_t>(held.get()))[0];
  }
  const at::Tensor entered = detail::torch_block_edge::apply(in, gate, key, false)[0];  // backward: the use ends
  (*gate_)(k, pass::forward, true);
  at::Tensor y;
  try {
    y = f(entered);
  } catch (...) {
    (*gate_)(k, pass::forward, false);
    throw;
  }
  (*gate_)(k, pass::forward, false);
  return detail::torch_block_edge::apply(y, gate, key, true)[0];  // backward: the use begins
}

//! Connects a TorchBlocks to a DataParallel with ShardedGradients or FullySharded: each gate
//! call begins or ends a dp.use_block (held here between the two).
template <class DP>
void shard_blocks(DP& dp, TorchBlocks& blocks)
  requires DP::block_sharded
{
  auto uses = std::make_shared<std::map<std::pair<std::size_t, int>, block_use<DP>>>();
  blocks.set_gate([&dp, uses](std::size_t k, pass p, bool begin) {
    const std::pair<std::size_t, int> key{k, static_cast<int>(p)};
    if (begin) {
      uses->emplace(key, dp.use_block(k, p));
      return;
    }
    const auto it = uses->find(key);
    if (it == uses->end())
      throw config_error("lockstep::TorchBlocks: block " + std::to_string(k) + "'s use ends but never began");
    auto use = std::move(it->second);
    uses->erase(it);
    use.end();
  });
}

}  // namespace lockstep
