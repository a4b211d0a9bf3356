#pragma once
//! What one DataParallel step reports to the training loop.

namespace lockstep {

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
