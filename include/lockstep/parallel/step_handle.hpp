#pragma once
//! lockstep::step_handle<DP> — one micro-step of a DataParallel (DataParallel::step_handle):
//! what the training loop holds between dp.step() and finish() — the loss scale to multiply
//! the loss by, the gradient-ready hook for the model's backward, and finish() itself.

#include <cstddef>
#include <functional>
#include <span>
#include <utility>

#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/step.hpp"
#include "lockstep/scaling/loss_scaler.hpp"

namespace lockstep {

//! One micro-step of a DataParallel: created by dp.step(), ended by finish().
template <class DP>
class step_handle {
 public:
  step_handle(const step_handle&) = delete;
  step_handle& operator=(const step_handle&) = delete;
  step_handle(step_handle&& o) noexcept : dp_(std::exchange(o.dp_, nullptr)), sync_(o.sync_) {}
  ~step_handle() {
    if (dp_) dp_->abandon();  // abandoned (e.g. an exception): the next step() cleans up
  }

  //! Whether this micro-step will average gradients (the last of its cycle).
  bool synchronizes() const noexcept { return sync_; }
  //! Multiply the loss by this before backward (1 without loss scaling). With a device-side
  //! scaler this reads the scale back (a host synchronisation): use device_loss_scale().
  double loss_scale() const { return dp_->scaler_.scale(); }
  //! With a device-side scaler: the scale as a float in device memory, for the loss kernel.
  const float* device_loss_scale() const
    requires device_scaler<typename DP::scaler_type>
  {
    return dp_->scaler_.device_scale();
  }
  //! The hook for the model's backward (see gradient_ready_fn): gradient i is final.
  gradient_ready_fn on_gradient_ready() const {
    return gradient_ready_fn(dp_, [](void* dp, std::size_t i) { static_cast<DP*>(dp)->reducer_.mark_ready(i); });
  }
  void gradient_ready(std::size_t i) const { dp_->reducer_.mark_ready(i); }

  //! Ends backward: reduces every bucket not yet reduced and waits for all of them.
  step_result finish() { return finish(nullptr); }

  //! As finish(), calling on_bucket(slices) for each bucket as soon as it is averaged
  //! (e.g. an optimizer updating those parameters while later buckets are in flight).
  //! Sharded (the only form there): the slices are this rank's shards (one slice of
  //! shard_parameters() per call), each all-gathered into the parameters after on_bucket
  //! (by the time finish returns, or, gather_in_forward, as the next forward waits for it).
  step_result finish(const std::function<void(std::span<const param_slice>)>& on_bucket) {
    if (!dp_) throw config_error("lockstep: finish() called twice on one step");
    auto* dp = std::exchange(dp_, nullptr);
    try {
      return dp->finish_step(sync_, on_bucket);
    } catch (...) {
      dp->abandon();  // what it left in flight must not reach the next cycle
      throw;
    }
  }

 private:
  friend DP;
  step_handle(DP* dp, bool sync) : dp_(dp), sync_(sync) {}
  DP* dp_;
  bool sync_;
};

}  // namespace lockstep
