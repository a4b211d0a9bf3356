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
//!    backward, as torch.utils.checkpoint's), and the use ends. The recomputation sees what the
//!    forward saw: the forward thread's autocast switches and types (CPU and CUDA; backward
//!    runs on autograd's device thread, where autocast is off; its cast cache is off meanwhile)
//!    and the state of x's device's random generator (dropout draws the same mask), put back
//!    after.
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
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>
#include <torch/version.h>

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

//! Autocast on the calling thread for device type d (CPU or CUDA): on or off, and its type.
inline bool autocast_on(c10::DeviceType d) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}
inline at::ScalarType autocast_type(c10::DeviceType d) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::get_autocast_dtype(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
#endif
}
inline void set_autocast(c10::DeviceType d, bool on, at::ScalarType t) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(d, on);
  at::autocast::set_autocast_dtype(d, t);
#else
  if (d == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(on);
    at::autocast::set_autocast_cpu_dtype(t);
  } else {
    at::autocast::set_enabled(on);
    at::autocast::set_autocast_gpu_dtype(t);
  }
#endif
}

//! What a recomputed block must see again (autocast, random generators), saved with the
//! forward in an autograd context and replayed for the recomputation (a scoped guard).
class torch_replay {
 public:
  static void save(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    for (auto d : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
      const std::string n = d == c10::DeviceType::CPU ? "cpu" : "cuda";
      ctx->saved_data["autocast_" + n] = autocast_on(d);
      ctx->saved_data["autocast_type_" + n] = static_cast<std::int64_t>(autocast_type(d));
    }
    // The generator of x's device: on a GPU its own (one per device, one rank per device); on
    // the CPU the process's one, which thread ranks share (their replay is then only as exact
    // as their interleaving).
    ctx->saved_data["rng"] = state_of(generator(x));
  }
  torch_replay(torch::autograd::AutogradContext* ctx, const at::Tensor& x) : device_(x.device()) {
    for (auto d : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
      const std::string n = d == c10::DeviceType::CPU ? "cpu" : "cuda";
      was_.push_back({d, autocast_on(d), autocast_type(d)});
      set_autocast(d, ctx->saved_data["autocast_" + n].toBool(),
                   static_cast<at::ScalarType>(ctx->saved_data["autocast_type_" + n].toInt()));
    }
    // Autocast's cache of fp32 → bf16 casts of weights is never cleared on this thread: a
    // recomputation that filled it would hand the next step's last step's weights.
    cache_was_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    rng_ = swap(generator(x), ctx->saved_data["rng"].toTensor());
  }
  ~torch_replay() {
    for (const auto& w : was_) set_autocast(w.d, w.on, w.t);
    at::autocast::set_autocast_cache_enabled(cache_was_);
    swap(device_.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device_), rng_);
  }
  torch_replay(const torch_replay&) = delete;
  torch_replay& operator=(const torch_replay&) = delete;

 private:
  struct autocast {
    c10::DeviceType d;
    bool on;
    at::ScalarType t;
  };
  static at::Generator generator(const at::Tensor& x) {
    return x.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(x.device());
  }
  static at::Tensor state_of(at::Generator g) {
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  }
  static at::Tensor swap(at::Generator g, const at::Tensor& state) {  // returns the state it replaced
    std::lock_guard<std::mutex> lock(g.mutex());
    at::Tensor was = g.get_state();
    g.set_state(state);
    return was;
  }
  c10::Device device_;
  std::vector<autocast> was_;
  bool cache_was_ = true;
  at::Tensor rng_;
};

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
    torch_replay::save(ctx, x);
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
      at::Tensor y;
      {
        torch_replay replay(ctx, x);
        y = f(again);
      }
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
      uses->erase(key);  // a use an abandoned step left open (its end is a no-op now)
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
