#pragma once
//! Lending storage to the model (lockstep::model (a), (d), (e), (f)): the functions that bind
//! a parameter's gradient or values into lockstep's arenas, the check that a binding took
//! effect, and the hand-back when DataParallel goes away.

#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

//! bind(i, storage): parameter i takes storage (its gradient, or its values) from now on.
using bind_fn = std::function<void(std::size_t, void*)>;
//! (parameter index, the storage it was given)
using binding = std::pair<std::size_t, void*>;

//! attach(i, value, grad, t): parameter i's values and gradient are there now, of element
//! type t (model (i)).
using attach_fn = std::function<void(std::size_t, void*, void*, dtype)>;

//! What the reduction units may use of the model: its value binder (model (e), or empty), its
//! attach (model (i), or empty; typed_attach: the model takes values of another element type
//! than its own; released: its storage_released; storage: its block_storage) and the block of
//! each parameter (model (h); all 0 without).
struct model_hooks {
  bind_fn bind_value;
  attach_fn attach;
  std::vector<std::size_t> blocks;
  bool typed_attach = false;
  std::function<void()> released;                             // model.storage_released() (model (i)), or empty
  std::function<std::shared_ptr<void>(std::size_t)> storage;  // model.block_storage(bytes), or empty
};

//! The model_hooks of a model (bind_value: value_binder's choice).
template <class Model>
model_hooks hooks_of(Model& model, bind_fn bind_value) {
  std::size_t parameters = 0;
  for (auto&& p : model.parameters()) {
    (void)p;
    ++parameters;
  }
  model_hooks h{std::move(bind_value), {}, std::vector<std::size_t>(parameters, 0), false, {}, {}};
  if constexpr (typed_attaching_model<Model>) {
    h.attach = [&model](std::size_t i, void* v, void* g, dtype t) { model.attach(i, v, g, t); };
    h.typed_attach = true;
  } else if constexpr (attaching_model<Model>) {
    h.attach = [&model](std::size_t i, void* v, void* g, dtype) { model.attach(i, v, g); };
  }
  if constexpr (requires { model.storage_released(); }) h.released = [&model] { model.storage_released(); };
  if constexpr (requires(std::size_t n) {
                  { model.block_storage(n) } -> std::convertible_to<std::shared_ptr<void>>;
                })
    h.storage = [&model](std::size_t n) -> std::shared_ptr<void> { return model.block_storage(n); };
  if constexpr (block_model<Model>) {
    h.blocks.clear();
    for (auto b : model.blocks()) h.blocks.push_back(static_cast<std::size_t>(b));
    if (h.blocks.size() != parameters)
      throw config_error("model.blocks() lists " + std::to_string(h.blocks.size()) + " blocks, but the model has " +
                         std::to_string(parameters) + " parameters: give one block number per parameter");
  }
  return h;
}

//! The model's gradient binder, if it has one and zero_copy is on; else empty.
template <class Model>
bind_fn gradient_binder(Model& model, const DataParallelOptions& opts) {
  if constexpr (gradient_binding_model<Model>) {
    if (opts.zero_copy) return [&model](std::size_t i, void* p) { model.bind_gradient(i, p); };
  }
  (void)model;
  (void)opts;
  return {};
}

//! The model's value binder, if it has one, zero_copy is on and the strategy binds values
//! (ShardedOptimizer::bind_values); else empty.
template <class Model, class Strategy>
bind_fn value_binder(Model& model, const DataParallelOptions& opts, const Strategy& strategy) {
  if constexpr (value_binding_model<Model> && requires { strategy.bind_values; }) {
    if (opts.zero_copy && strategy.bind_values) return [&model](std::size_t i, void* p) { model.bind_value(i, p); };
  }
  (void)model;
  (void)opts;
  (void)strategy;
  return {};
}

//! fresh (the model's parameters re-read after binding), checked: every (i, storage) in given
//! is now what parameters()[i].*field points at — else the binder (named fn) did not take effect.
inline std::vector<parameter> checked_binding(std::vector<parameter> fresh, std::span<const binding> given,
                                              void* parameter::* field, const char* fn) {
  for (const auto& [i, storage] : given)
    if (i >= fresh.size() || fresh[i].*field != storage)
      throw config_error(std::string("model.") + fn + "(" + std::to_string(i) +
                         ", storage) did not take effect: parameters()[" + std::to_string(i) + "]." +
                         (field == &parameter::grad ? "grad" : "value") +
                         " does not point at the storage lockstep gave it (" + fn + " must make the model use it)");
  return fresh;
}

//! Every trained parameter has gradient storage (the reducer's, unless the units lend it).
inline void check_gradient_storage(const std::vector<parameter>& params) {
  for (std::size_t i = 0; i < params.size(); ++i)
    if (params[i].grad == nullptr && params[i].numel() > 0)
      throw config_error("parameter " + std::to_string(i) + " ('" + params[i].name +
                         "') has no gradient storage (parameters()[i].grad is null): give every trained "
                         "parameter one (a TorchModule after set_blocks lends its gradients: use it with "
                         "ShardedGradients or FullySharded)");
}

//! DataParallel's end: every deferred all-gather waited for, then the model takes back its
//! values and its gradients (in that order) while the arenas still exist. Never throws.
template <class Model, class Reducer>
void release_model(Model& model, Reducer& reducer) noexcept {
  try {
    if constexpr (requires { reducer.units().complete_all(); })
      reducer.units().complete_all();  // (no collective: gather_wire's replicas stay as they are)
    else reducer.units().wait_all_parameters();
    if constexpr (requires { model.unbind_values(); })
      if (reducer.units().values_bound()) model.unbind_values();
    if constexpr (gradient_unbinding_model<Model>)
      if (reducer.zero_copy()) model.unbind_gradients();
  } catch (...) {  // a destructor must not throw; the model keeps the (dead) views
  }
}

}  // namespace lockstep::detail
