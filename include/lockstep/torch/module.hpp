#pragma once
//! lockstep::TorchModule — any libtorch `torch::nn::Module` as a lockstep::model, so that
//! DataParallel (threads, local GPUs, one process per GPU, MPI) trains it as PyTorch's
//! DistributedDataParallel trains a Python module:
//!
//!  - parameters(): every parameter that requires grad, in named_parameters() order, as a view
//!    of its data and its `.grad` (f32, f64, f16, bf16; CPU tensors for CPU communicators,
//!    CUDA tensors on the rank's device for NcclComm). `.grad` is allocated (zeros, in the
//!    parameter's own layout) here, so autograd accumulates into it in place from the first
//!    backward on. Any dense layout works — contiguous or channels_last (conv nets on tensor
//!    cores) — and a parameter's shape is given in memory order (sizes sorted by stride:
//!    [64, 7, 7, 3] for a channels_last [64, 3, 7, 7] weight), so ranks or checkpoints whose
//!    layouts differ are told apart as models of other shapes.
//!  - bind_gradient(i, storage): `.grad` becomes a tensor view of lockstep's arena
//!    (`from_blob`, no copy — DDP's gradient_as_bucket_view), so buckets are reduced in place
//!    and an optimizer reading `.grad` (torch::optim included) sees the average.
//!  - Overlap: a post hook on each parameter's gradient accumulator (the node that adds into
//!    `.grad`; PyTorch's Reducer uses the same) reports the parameter as ready once its
//!    gradient is accumulated. `backward(loss, step.on_gradient_ready())` runs
//!    `loss.backward()` with the hooks pointed at the step; `report_to(ready)` does the same
//!    around a backward of your own.
//!  - Unused parameters (no gradient this step: a branch not taken) are simply not reported;
//!    DataParallel reduces their zero gradients with the last buckets in finish(), the same
//!    on every rank, so nothing needs a graph traversal (DDP's find_unused_parameters).
//!  - frozen(): parameters with requires_grad == false (a frozen embedding, a LoRA base):
//!    not reduced, but DataParallel checks them across ranks and broadcasts rank 0's values
//!    at construction, as DDP does (under run(Threads) the ranks share libtorch's random
//!    generator, so a randomly initialised frozen layer differs between ranks until then).
//!    Freezing or unfreezing a parameter after wrapping is refused at the next step: wrap
//!    the module again.
//!  - buffers(): BatchNorm statistics and other buffers; DataParallel broadcasts them from
//!    rank 0 at construction and, with `DataParallelOptions::broadcast_buffers` (on by
//!    default, as DDP's), at the start of every accumulation cycle.
//!  - unbind_gradients(): `.grad` becomes the module's own copy again; DataParallel calls it
//!    when it is destroyed, so the module never keeps a view of freed arena memory.
//!  - bind_value(i, storage) (ShardedOptimizer): the parameter's data becomes a view of the
//!    arena its shards are all-gathered into (`set_data`, as Megatron's parameter buffer), so
//!    the optimizer steps it in place and the all-gather lands in it; unbind_values() gives
//!    it storage of its own again. The tensor object stays the same (autograd's accumulator,
//!    its hooks and torch::optim's references hold).
//!  - indices_of(submodule): its parameters' positions in parameters(), for
//!    DataParallel::wait_parameters before the forward uses them (gather_in_forward).
//!  - set_blocks(submodules), blocks(), attach(i, value, grad) (ShardedGradients,
//!    FullySharded: lockstep::model (h), (i)): the listed submodules are blocks 1, 2, …, the
//!    rest block 0; attach points the parameter's data (one storage per parameter, re-pointed)
//!    and `.grad` at lockstep's block buffers, or at nothing (a 0-element tensor, an undefined
//!    `.grad`) outside a use.
//!    TorchBlocks (blocks.hpp) is what the model's forward calls at each block.
//!
//! Hooks fire on autograd's threads (for CUDA tensors, the device's worker thread) while the
//! thread that called backward waits; DataParallel is used by one thread at a time, as always.
//! Built with libtorch 1.13 (Debian's libtorch-dev, CPU) and 2.x. See docs/torch.md.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/step.hpp"
#include "lockstep/torch/detail/storage.hpp"
#include "lockstep/torch/detail/types.hpp"

namespace lockstep {

namespace detail {

//! What the accumulator hooks share with the TorchModule: where to report, and which
//! parameters reported in this backward.
struct torch_hook_state {
  std::mutex m;
  gradient_ready_fn ready;
  std::vector<char> fired;
};

//! Runs after autograd accumulated parameter `index`'s gradient into `.grad`.
class torch_ready_hook final : public torch::autograd::FunctionPostHook {
 public:
  torch_ready_hook(std::shared_ptr<torch_hook_state> st, std::size_t index) : st_(std::move(st)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    gradient_ready_fn ready;
    {
      std::lock_guard<std::mutex> lock(st_->m);
      if (!st_->ready) return outputs;         // a backward outside a step: nothing to report
      if (st_->fired[index_]) return outputs;  // twice in one backward (retain_graph): once is enough
      st_->fired[index_] = 1;
      ready = st_->ready;
    }
    ready(index_);
    return outputs;
  }

 private:
  std::shared_ptr<torch_hook_state> st_;
  std::size_t index_;
};

}  // namespace detail

class TorchModule {
 public:
  //! While alive, gradients accumulated by autograd are reported to `ready` (see report_to).
  class reporting {
   public:
    reporting(const reporting&) = delete;
    reporting& operator=(const reporting&) = delete;
    ~reporting() {
      std::lock_guard<std::mutex> lock(st_->m);
      st_->ready = {};
    }

   private:
    friend class TorchModule;
    explicit reporting(std::shared_ptr<detail::torch_hook_state> st, gradient_ready_fn ready) : st_(std::move(st)) {
      std::lock_guard<std::mutex> lock(st_->m);
      if (st_->ready)
        throw config_error("lockstep::TorchModule: report_to() while another report_to() is active; "
                           "one backward at a time per module");
      st_->ready = ready;
      std::fill(st_->fired.begin(), st_->fired.end(), 0);
    }
    std::shared_ptr<detail::torch_hook_state> st_;
  };

  //! Wraps `module` (held, shared). Its parameters must not change afterwards.
  explicit TorchModule(std::shared_ptr<torch::nn::Module> module) : module_(std::move(module)) {
    if (!module_) throw config_error("lockstep::TorchModule: the module is null");
    for (auto& item : module_->named_parameters(/*recurse=*/true)) {
      at::Tensor& p = item.value();
      if (!p.requires_grad()) {  // frozen: not trained, not reduced; still rank 0's values (as in DDP)
        frozen_names_.push_back(item.key());
        frozen_.push_back(value_only(item.key(), p, "frozen parameter"));
        continue;
      }
      if (!p.is_non_overlapping_and_dense())
        throw config_error("lockstep::TorchModule: parameter '" + item.key() +
                           "' is not dense (a view with gaps or overlaps); make it contiguous (or channels_last) "
                           "before wrapping the module");
      const dtype t = detail::dtype_of_torch(p.scalar_type(), "parameter '" + item.key() + "'");
      if (!is_floating(t))
        throw config_error("lockstep::TorchModule: parameter '" + item.key() + "' is not floating point");
      names_.push_back(item.key());
      params_.push_back(p);
      protos_.push_back(view(item.key(), p, {}));  // shape and type, kept while attach detaches
      sizes_.emplace_back(p.sizes().begin(), p.sizes().end());
      strides_.emplace_back(p.strides().begin(), p.strides().end());
    }
    for (auto& item : module_->named_buffers(/*recurse=*/true)) {
      if (!item.value().defined() || item.value().numel() == 0) continue;
      buffer_names_.push_back(item.key());
      buffers_.push_back(value_only(item.key(), item.value(), "buffer"));
    }
    check_one_device();
    hooks_ = std::make_shared<detail::torch_hook_state>();
    hooks_->fired.assign(params_.size(), 0);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      // The accumulator node lives as long as someone holds it: keep it, or the hook goes with it.
      auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
      if (!acc) throw config_error("lockstep::TorchModule: parameter '" + names_[i] + "' has no gradient accumulator");
      acc->add_post_hook(std::make_unique<detail::torch_ready_hook>(hooks_, i));
      accumulators_.push_back(std::move(acc));
    }
  }
  //! From a module holder (`Net net; lockstep::TorchModule m(net);`).
  template <class Holder>
    requires requires(Holder& h) { h.ptr(); }
  explicit TorchModule(Holder& holder) : TorchModule(std::static_pointer_cast<torch::nn::Module>(holder.ptr())) {}

  TorchModule(const TorchModule&) = delete;
  TorchModule& operator=(const TorchModule&) = delete;

  // ---- lockstep::model ------------------------------------------------------------------
  //! `.grad` is allocated here, where missing, in the parameter's layout (zeros) — except
  //! after set_blocks: ShardedGradients / FullySharded lend the gradients block by block, so
  //! the module never holds a whole model's gradients (grad null here).
  std::vector<parameter> parameters() const {
    check_frozen_unchanged();
    std::vector<parameter> out;
    out.reserve(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i];
      if (block_of_.empty() && storages_.empty()) {  // (never attached: full sharding lends its gradients)
        at::Tensor& g = p.mutable_grad();
        if (!g.defined() || g.sizes() != p.sizes() || g.strides() != p.strides() ||
            g.scalar_type() != p.scalar_type() || g.device() != p.device())
          g = torch::zeros_like(p, at::MemoryFormat::Preserve);  // the parameter's strides
      }
      if (p.numel() == static_cast<std::int64_t>(protos_[i].numel()) &&
          p.scalar_type() == detail::torch_type_of(protos_[i].type)) {
        out.push_back(view(names_[i], p, p.grad()));
      } else {  // detached by attach, or lent in another type (full sharding): as wrapped
        out.push_back(protos_[i]);
        out.back().value = nullptr;
        out.back().grad = params_[i].grad().defined() ? params_[i].grad().data_ptr() : nullptr;
      }
    }
    return out;
  }
  //! Full sharding (lockstep::model (h)): the listed submodules are blocks 1, 2, … in the
  //! order given (forward order); every other trained parameter is block 0 (which may be
  //! empty). Before the DataParallel is built; a parameter in two listed blocks is refused.
  //! The module then holds no `.grad` of its own (the DataParallel lends them per use): use it
  //! with ShardedGradients or FullySharded.
  void set_blocks(const std::vector<std::shared_ptr<torch::nn::Module>>& blocks) {
    std::vector<std::size_t> of(params_.size(), 0);
    for (std::size_t k = 0; k < blocks.size(); ++k) {
      if (!blocks[k])
        throw config_error("lockstep::TorchModule::set_blocks: block " + std::to_string(k + 1) + " is null");
      const auto idx = indices_of(*blocks[k]);
      if (idx.empty())
        throw config_error("lockstep::TorchModule::set_blocks: block " + std::to_string(k + 1) +
                           " has no trained parameter of the wrapped module");
      for (auto i : idx) {
        if (of[i] != 0)
          throw config_error("lockstep::TorchModule::set_blocks: parameter '" + names_[i] + "' is in blocks " +
                             std::to_string(of[i]) + " and " + std::to_string(k + 1) + "; list disjoint submodules");
        of[i] = k + 1;
      }
    }
    block_of_ = std::move(of);
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }
  std::vector<std::size_t> blocks() const {
    return block_of_.empty() ? std::vector<std::size_t>(params_.size(), 0) : block_of_;
  }
  //! Full sharding (lockstep::model (i)): parameter i's data is a view of `value` (or a
  //! 0-element tensor: not held) and its `.grad` a view of `grad` (or undefined).
  //! The data lives in one storage per parameter whose address is re-pointed at each use:
  //! autograd saves views of parameters (a Linear's weight.t()), which share that storage, so a
  //! backward reads the values its own use gathered — not the buffer the forward's use had,
  //! which may hold another block by then (FSDP2 resizes one storage for the same reason).
  //! With t (FullySharded::param_dtype), both are of element type t: the parameter becomes a
  //! tensor of that type (bf16 during a use, its own type when gathered whole).
  void attach(std::size_t i, void* value, void* grad, dtype t) {
    at::Tensor& p = params_.at(i);
    const auto opts = p.options().dtype(detail::torch_type_of(t)).requires_grad(false);
    if (storages_.empty()) storages_.resize(params_.size());
    if (!storages_[i]) {
      const auto bytes = static_cast<std::size_t>(protos_.at(i).bytes());
      storages_[i] = c10::Storage(c10::Storage::use_byte_size_t(), bytes, c10::DataPtr(nullptr, p.device()), nullptr,
                                  /*resizable=*/false);
    }
    storages_[i].unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(value, p.device()));
    p.set_data(value ? at::empty({0}, opts).set_(storages_[i], 0, sizes_.at(i), strides_.at(i)) : at::empty({0}, opts));
    p.mutable_grad() = grad ? torch::from_blob(grad, sizes_.at(i), strides_.at(i), opts) : at::Tensor();
    // set_data to another element type drops the parameter's gradient accumulator: hook the new
    // one (made here, with values attached: it takes the parameter's shape).
    if (auto acc = value ? torch::autograd::impl::grad_accumulator(p) : nullptr; acc && acc != accumulators_.at(i)) {
      acc->add_post_hook(std::make_unique<detail::torch_ready_hook>(hooks_, i));
      accumulators_[i] = std::move(acc);
    }
  }
  void attach(std::size_t i, void* value, void* grad) { attach(i, value, grad, protos_.at(i).type); }
  //! After construction detached every parameter, and when a block buffer finds the device
  //! full: what libtorch's CUDA allocator keeps of freed storage goes back to the device
  //! (detail::release_cached: one process per GPU only).
  void storage_released() {
    if (!params_.empty()) detail::release_cached(params_.front());
  }
  //! Storage for a block buffer of full sharding (model (i)'s block_storage) from libtorch's
  //! allocator (detail::torch_storage): lockstep drops it after a use, for libtorch to hand
  //! the memory to the next activations, as FSDP2's buffers share its caching allocator.
  std::shared_ptr<void> block_storage(std::size_t bytes) const {
    return params_.empty() ? nullptr : detail::torch_storage(params_.front(), bytes, "a block buffer (full sharding)");
  }
  void bind_gradient(std::size_t i, void* storage) {
    at::Tensor& p = params_.at(i);
    at::Tensor view = torch::from_blob(storage, p.sizes(), p.strides(), p.options().requires_grad(false));
    view.copy_(p.grad());  // the arena starts with what the module holds
    p.mutable_grad() = view;
  }
  //! `.grad` becomes the module's own storage again (a copy of the arena's values).
  void unbind_gradients() {
    for (auto& p : params_) p.mutable_grad() = p.grad().clone(at::MemoryFormat::Preserve);
  }
  //! The parameter's data becomes a view of `storage`, holding its current values (copied on
  //! libtorch's current stream: make it lockstep's compute stream, see docs/torch.md).
  void bind_value(std::size_t i, void* storage) {
    at::Tensor& p = params_.at(i);
    at::Tensor view = torch::from_blob(storage, p.sizes(), p.strides(), p.options().requires_grad(false));
    view.copy_(p.detach());
    p.set_data(view);
  }
  //! Every parameter's data becomes storage of its own again (a copy of the arena's values).
  void unbind_values() {
    for (auto& p : params_) p.set_data(p.detach().clone(at::MemoryFormat::Preserve));
  }
  //! The positions in parameters() of the trained parameters of `sub` (the wrapped module or
  //! one of its submodules, recursively), e.g. to wait for them before a layer's forward:
  //! `for (auto i : tm.indices_of(*block)) dp.wait_parameters(i);`
  std::vector<std::size_t> indices_of(const torch::nn::Module& sub) const {
    std::vector<std::size_t> out;
    for (const auto& t : sub.parameters(/*recurse=*/true))
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (params_[i].unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) out.push_back(i);
    return out;
  }
  //! Frozen parameters (requires_grad == false) as value-only views (grad null): checked and
  //! broadcast at construction, never reduced (lockstep::model (g)).
  std::vector<parameter> frozen() const {
    std::vector<parameter> out;
    out.reserve(frozen_.size());
    for (std::size_t i = 0; i < frozen_.size(); ++i) out.push_back(view(frozen_names_[i], frozen_[i], {}, true));
    return out;
  }
  //! Buffers as value-only views (grad null), for broadcasts.
  std::vector<parameter> buffers() const {
    std::vector<parameter> out;
    out.reserve(buffers_.size());
    for (std::size_t i = 0; i < buffers_.size(); ++i) out.push_back(view(buffer_names_[i], buffers_[i], {}, true));
    return out;
  }

  // ---- backward -------------------------------------------------------------------------
  //! loss.backward(), reporting each parameter's gradient to `ready` once accumulated.
  void backward(const at::Tensor& loss, gradient_ready_fn ready) {
    auto r = report_to(ready);
    loss.backward();
  }
  //! For a backward of your own (e.g. `(loss * scale).backward()`): reports while alive.
  [[nodiscard]] reporting report_to(gradient_ready_fn ready) { return reporting(hooks_, ready); }

  torch::nn::Module& module() noexcept { return *module_; }
  //! The trained tensors, in parameters() order (for torch::optim: `torch::optim::AdamW(m.tensors(), ...)`).
  const std::vector<at::Tensor>& tensors() const noexcept { return params_; }
  const std::vector<std::string>& names() const noexcept { return names_; }

 private:
  // raw: a tensor only broadcast (frozen, buffer) whose element type lockstep does not carry
  // (int8, fp8, ...) goes as its bytes (u8, shape {bytes}).
  static parameter view(const std::string& name, const at::Tensor& t, const at::Tensor& grad, bool raw = false) {
    parameter p;
    p.name = name;
    if (raw && !detail::carried_dtype(t.scalar_type())) {
      p.shape.push_back(static_cast<std::int64_t>(t.numel() * t.element_size()));
      p.type = dtype::u8;
      p.value = t.data_ptr();
      return p;
    }
    // In memory order: a contiguous tensor's sizes; another layout's dimensions of more than
    // one element by stride, largest first, then its size-1 ones (which do not move an element),
    // so that tensors with the same bytes in the same order have the same shape.
    if (t.is_contiguous()) {
      p.shape.assign(t.sizes().begin(), t.sizes().end());
    } else {
      std::vector<std::int64_t> dims, ones;
      for (std::int64_t d = 0; d < t.dim(); ++d) (t.size(d) > 1 ? dims : ones).push_back(d);
      std::stable_sort(dims.begin(), dims.end(),
                       [&](std::int64_t a, std::int64_t b) { return t.stride(a) > t.stride(b); });
      for (auto d : dims) p.shape.push_back(t.size(d));
      for (auto d : ones) p.shape.push_back(t.size(d));
    }
    if (p.shape.empty()) p.shape.push_back(1);  // a 0-d parameter is one element
    p.type = detail::dtype_of_torch(t.scalar_type(), "'" + name + "'");
    p.value = t.data_ptr();
    p.grad = grad.defined() ? grad.data_ptr() : nullptr;
    return p;
  }

  // A buffer or frozen parameter: dense (any element type: see view()).
  static const at::Tensor& value_only(const std::string& name, const at::Tensor& t, const char* what) {
    if (!t.is_non_overlapping_and_dense())
      throw config_error(std::string("lockstep::TorchModule: ") + what + " '" + name +
                         "' is not dense (a view with gaps or overlaps); make it contiguous before wrapping "
                         "the module");
    return t;
  }

  // Every tensor lockstep moves lives where the communicator's buffers do: one device for all
  // (a frozen embedding offloaded to the CPU in a GPU job would hand NCCL a host pointer).
  void check_one_device() const {
    const at::Tensor* first = nullptr;
    std::string first_name;
    const auto check = [&](const std::vector<std::string>& names, const std::vector<at::Tensor>& ts) {
      for (std::size_t i = 0; i < ts.size(); ++i) {
        if (!first) {
          first = &ts[i];
          first_name = names[i];
        } else if (ts[i].device() != first->device()) {
          throw config_error("lockstep::TorchModule: '" + names[i] + "' is on " + ts[i].device().str() + " but '" +
                             first_name + "' on " + first->device().str() +
                             "; every parameter, frozen parameter and buffer of a wrapped module must be on the "
                             "rank's one device (move the module there before wrapping it)");
        }
      }
    };
    check(names_, params_);
    check(frozen_names_, frozen_);
    check(buffer_names_, buffers_);
  }

  // A parameter frozen or unfrozen after wrapping would be trained without being reduced (or
  // reduced without a gradient): refuse it where DataParallel re-reads the parameters (every
  // accumulation cycle), so no step runs on it.
  void check_frozen_unchanged() const {
    const auto changed = [](const std::string& name, bool now_trained) {
      return config_error("lockstep::TorchModule: parameter '" + name + "' was " +
                          (now_trained ? "frozen (requires_grad false)" : "trained (requires_grad true)") +
                          " when the module was wrapped and is " + (now_trained ? "trained" : "frozen") +
                          " now; after changing requires_grad, wrap the module again and build a new "
                          "DataParallel, on every rank alike");
    };
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (!params_[i].requires_grad()) throw changed(names_[i], false);
    for (std::size_t i = 0; i < frozen_.size(); ++i)
      if (frozen_[i].requires_grad()) throw changed(frozen_names_[i], true);
  }

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<parameter> protos_;                           // per parameter: name, shape, type as wrapped
  std::vector<std::size_t> block_of_;                       // set_blocks, or empty: every parameter block 0
  std::vector<std::vector<std::int64_t>> sizes_, strides_;  // per parameter, as wrapped
  std::vector<c10::Storage> storages_;                      // attach: per parameter, re-pointed per use
  std::vector<std::string> names_, buffer_names_, frozen_names_;
  std::vector<at::Tensor> params_, buffers_, frozen_;
  std::shared_ptr<detail::torch_hook_state> hooks_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
};

}  // namespace lockstep
