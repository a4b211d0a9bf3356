#pragma once
//! What one DataParallel step hands to the model (the gradient-ready hook) and reports back
//! to the training loop (step_result).

#include <cstddef>

namespace lockstep {

//! The hook a model's backward calls with a parameter index when that gradient is final, so
//! its bucket can be reduced while backward goes on. One type for every DataParallel, so a
//! backward written as an ordinary (non-template) function can take it:
//! \code
//!   void backward(Mlp& model, const Batch& batch, double loss_scale, lockstep::gradient_ready_fn ready);
//! \endcode
//! A default-constructed hook does nothing (for the same backward outside DataParallel).
//! Cheap to copy (two pointers); valid until the step that made it finishes.
class gradient_ready_fn {
 public:
  gradient_ready_fn() = default;
  //! Calls fn(target, i) for each gradient i.
  gradient_ready_fn(void* target, void (*fn)(void*, std::size_t)) noexcept : target_(target), fn_(fn) {}
  void operator()(std::size_t param_index) const {
    if (fn_ != nullptr) fn_(target_, param_index);
  }
  explicit operator bool() const noexcept { return fn_ != nullptr; }

 private:
  void* target_ = nullptr;
  void (*fn_)(void*, std::size_t) = nullptr;
};

//! What finish() reports. Converts to true when the optimizer should step.
struct step_result {
  bool synced = false;   //!< this micro-step averaged gradients (last of its cycle)
  bool applied = true;   //!< false: the step must be skipped (non-finite gradients)
  //! With a device-side scaler (DeviceDynamicScale): its found-inf flag agreed over ranks, an
  //! int32 in device memory (non-zero: skip the step), valid in stream order on the compute
  //! stream; hand it to the optimizer (cuda::FusedSgd / FusedAdamW). `applied` is then true:
  //! the host does not know. nullptr with host-decided scalers.
  const int* device_found_inf = nullptr;
  explicit operator bool() const noexcept { return synced && applied; }
};

}  // namespace lockstep
