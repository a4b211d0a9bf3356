#pragma once
//! lockstep::FusedOptimizer<Rule> — an optimizer_rule (optim/optimizer.hpp) applied to
//! device parameters through the multi-tensor engine, with its state owned for you, keyed by
//! parameter index (the order of DataParallel::parameters()), and the skip decision read on
//! the device. FusedSgd and FusedAdamW are its two instances: the same rules as lockstep::Sgd
//! and lockstep::AdamW, so GPU and CPU agree bit for bit on f32/f64.
//!
//! \code
//!   lockstep::FusedAdamW opt({.lr = 1e-3}, dp.parameters());     // on the rank's device
//!   const int* found_inf = dp.scaler().device_found_inf();              // DeviceDynamicScale
//!   auto step = dp.step();
//!   model.backward(batch, step.on_gradient_ready());
//!   step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s, stream, found_inf); });
//!   // or, after finish(): opt.step_all(dp.parameters(), stream, found_inf);
//! \endcode
//!
//! State, allocated at construction on the device (one allocation, zeroed; see
//! cuda/detail/fused_state.cuh): per parameter Rule::states(options) buffers (f32, f64 for f64
//! parameters); an f32 master copy for f16/bf16 parameters, filled from the parameter's values
//! the first time the parameter is stepped (so construct the optimizer any time before the
//! first step; capture a step in a CUDA graph only after that first step); and a per-parameter
//! int64 step counter. Nothing is allocated or synchronised in step().
//!
//! Step counting. A slice (param, offset, count) may cover part of a parameter (a parameter
//! split over buckets): state is indexed at the slice's offset. A parameter's counter advances
//! — on the device, unless *d_found_inf ≠ 0 — when its slice at offset 0 is stepped, before
//! that slice is updated; slices at later offsets read it. So within one optimizer step, a
//! parameter's offset-0 slice must come first (DataParallel hands buckets over in plan order,
//! where that holds), and every element is stepped once: the counter then advances exactly once
//! per optimizer step, whatever the buckets, and AdamW's bias correction sees step 1, 2, 3...
//! With d_found_inf set and non-zero, parameters, state and counters stay as they were, bit for
//! bit.
//!
//! Checkpoints: serializable (save(byte_writer&) / load(byte_reader&), so `ck.add("optimizer",
//! opt)` works); they synchronise (they wait for the stream of the last step() and copy to or
//! from the host). load() replaces the state's device allocation: capture CUDA graphs of steps
//! after loading, not before. Movable, not copyable (a copy would share the device state).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/cuda/detail/fused_state.cuh"
#include "lockstep/cuda/kernels/engine.cuh"
#include "lockstep/cuda/kernels/optimizers.cuh"
#include "lockstep/cuda/memory.cuh"
#include "lockstep/optim/adamw.hpp"
#include "lockstep/optim/optimizer.hpp"
#include "lockstep/optim/sgd.hpp"

namespace lockstep {

template <optimizer_rule Rule>
class FusedOptimizer : public detail::rule_options<Rule> {
  using base = detail::rule_options<Rule>;
  using base::opt_;

 public:
  using typename base::options_type;
  using typename base::rule_type;

  //! params: the parameters in the order slices index them (e.g. DataParallel::parameters()),
  //! on `device` (-1: the current device), where the state is allocated.
  FusedOptimizer(options_type o, const std::vector<parameter>& params, int device = -1)
      : base(o), st_(params, device, Rule::fused_name) {
    detail::device_guard g(st_.device());
    st_.build(Rule::states(o), o.lr);
  }

  //! Per-parameter step counters (device memory).
  const std::int64_t* device_steps() const noexcept { return st_.counters(); }
  //! Device memory the state takes, in bytes.
  std::size_t state_bytes() const noexcept { return st_.bytes(); }
  //! The whole state where it lies — one allocation of device(): step counters, the rate,
  //! the state buffers, the masters — for a copy without save()'s synchronisation (PeerCopy
  //! copies it on the stream of the steps). load() moves it: take it afresh each time.
  std::span<const std::byte> state_image() const noexcept { return st_.image(); }
  //! What save() writes of an optimizer of this rule and options built over parameters of
  //! `shapes`, read from a host copy of that optimizer's state_image() (its steps, state
  //! buffers and masters are all in it). checkpoint_error if the image's size does not fit.
  void save_image(std::span<const param_shape> shapes, std::span<const std::byte> image, byte_writer& w) const {
    detail::fused_state layout(shapes, Rule::fused_name);
    layout.template save_image<Rule>(w, opt_, image);
  }

  //! For learning-rate schedules: takes effect at the next step. The update kernels read the
  //! rate from device memory, so a step captured in a CUDA graph (StepGraph) replays with the
  //! rate set last: before a first step() it is written at once, after one the write is
  //! queued on that step's stream (keep an optimizer's steps on one stream: a step on another
  //! queues it again there). Outside a capture (inside, config_error: the write would become
  //! part of the graph).
  void set_lr(double lr) {
    const options_type before = opt_;
    base::set_lr(lr);  // validates
    try {
      detail::device_guard g(st_.device());
      if (!st_.stepped()) st_.write_lr_now(opt_.lr);
      else st_.publish_lr(opt_.lr, st_.last_stream());
    } catch (...) {  // refused (inside a capture): the rate stays the one before
      opt_ = before;
      throw;
    }
  }

  //! Updates the slices (e.g. one bucket), queued on s; skipped entirely when d_found_inf is
  //! set and *d_found_inf ≠ 0. No synchronisation.
  void step(std::span<const param_slice> slices, cudaStream_t s, const int* d_found_inf = nullptr) {
    if (slices.empty()) return;
    detail::device_guard g(st_.device());
    st_.publish_lr(opt_.lr, s);
    st_.prepare(slices, s, d_found_inf);
    for (dtype t : {dtype::f32, dtype::f64, dtype::f16, dtype::bf16}) {
      refs_.clear();
      for (const auto& sl : slices)
        if (sl.type == t && sl.count != 0) refs_.push_back(&sl);
      if (refs_.empty()) continue;
      cuda::kernels::visit_float(t, Rule::fused_name, [&]<class Element>(std::type_identity<Element>) {
        using op_t = cuda::kernels::rule_op<Rule, Element>;
        const op_t op{{}, opt_, Rule::states(opt_), st_.device_lr()};
        cuda::kernels::launch(
            op, refs_.size(),
            [&](std::size_t i) {
              const param_slice& sl = *refs_[i];
              cuda::kernels::tensor_ref<op_t::lists> r{};
              r.p[0] = sl.value;
              r.p[1] = sl.grad;
              for (int k = 0; k < Rule::max_states; ++k) r.p[2 + k] = st_.state(sl.param, k, sl.offset);
              r.p[op_t::master_list] = st_.master(sl.param, sl.offset);
              r.count = sl.count;
              r.step = st_.counters() + sl.param;
              return r;
            },
            s, Rule::fused_name, d_found_inf);
      });
    }
  }

  //! Updates every parameter (params: the same parameters, in the same order).
  void step_all(const std::vector<parameter>& params, cudaStream_t s, const int* d_found_inf = nullptr) {
    if (params.size() != st_.size())
      throw config_error(std::string(Rule::fused_name) + "::step_all: got " + std::to_string(params.size()) +
                         " parameters, but the optimizer was built for " + std::to_string(st_.size()));
    whole_.clear();
    for (std::size_t i = 0; i < params.size(); ++i)
      whole_.push_back({i, 0, params[i].numel(), params[i].type, params[i].value, params[i].grad});
    step(whole_, s, d_found_inf);
  }

  //! The host optimizer's layout (optim/optimizer.hpp). Synchronises.
  void save(byte_writer& w) const { st_.template save<Rule>(w, opt_); }
  //! Reads what save() or the host optimizer wrote (options included). Synchronises.
  void load(byte_reader& r) { opt_ = st_.template load<Rule>(r); }

 private:
  detail::fused_state st_;
  std::vector<const param_slice*> refs_;  // reused by step(): no allocation in steady state
  std::vector<param_slice> whole_;        // reused by step_all()
};

//! SGD (momentum, dampening, nesterov, weight decay; PyTorch semantics, as lockstep::Sgd).
using FusedSgd = FusedOptimizer<SgdRule>;
//! AdamW (PyTorch semantics, as lockstep::AdamW).
using FusedAdamW = FusedOptimizer<AdamWRule>;

static_assert(serializable<FusedSgd> && serializable<FusedAdamW>);
static_assert(imaged_optimizer<FusedSgd> && imaged_optimizer<FusedAdamW>);

// The names of 0.2.0 (docs/design.md, "Namespaces": public CUDA types are lockstep::'s).
namespace cuda {
template <optimizer_rule Rule>
using FusedOptimizer [[deprecated("use lockstep::FusedOptimizer (public CUDA types are in namespace lockstep)")]] =
    lockstep::FusedOptimizer<Rule>;
using FusedSgd [[deprecated("use lockstep::FusedSgd (public CUDA types are in namespace lockstep)")]] =
    lockstep::FusedSgd;
using FusedAdamW [[deprecated("use lockstep::FusedAdamW (public CUDA types are in namespace lockstep)")]] =
    lockstep::FusedAdamW;
}  // namespace cuda

}  // namespace lockstep
