#pragma once
//! lockstep::grad_ops<CudaMemory> — the gradient passes of loss scaling and clipping on device
//! memory (see core/grad_group.hpp), so NoScaling{check_finite}, StaticScale, DynamicScale,
//! grad_norm, clip_grad_norm and clip_grad_value work on GPU gradients with no change of API.
//! A thin front: the kernels are cuda/kernels/grad_kernels.cuh's, on the multi-tensor engine.
//! Included by lockstep/cuda.cuh; include it wherever a host-decided scaler or clipping
//! meets an NcclComm.
//!
//! Semantics are the host specialisation's, for f32, f64, f16 and bf16 elements:
//!  1. unscale_and_flag: x ← x · T(inv_scale) (halves: the product in f32, rounded to the
//!     half type, as CudaMemory::scale does); no write when inv_scale == 1; the int32 1 is
//!     stored at the *device* pointer `flag` when any result is inf/NaN. Queued on mem's
//!     stream; nothing synchronises.
//!  2. sum_of_squares: Σx² in double, in an order fixed by the layout (per chunk, then the
//!     chunk sums in order): equal inputs give bit-equal sums on every rank. Returns a host
//!     value, so it waits for mem's stream.
//!  3. clamp: x ← min(max(x, lo), hi); NaN stays NaN (bit for bit); a bound beyond T's range is
//!     no bound; halves round the bounds through f32. Queued, no synchronisation.

#include <span>

#include "lockstep/core/grad_group.hpp"
#include "lockstep/cuda/kernels/grad_kernels.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep {

template <>
struct grad_ops<CudaMemory> {
  //! `flag` is device memory on mem's device (the caller zeroes it). Queued on mem's stream.
  static void unscale_and_flag(const CudaMemory& mem, std::span<const grad_group> groups, double inv_scale,
                               void* flag) {
    detail::require_floating(groups, "unscale_and_check");
    detail::device_guard g(mem.device());
    for (const auto& grp : groups)
      cuda::kernels::unscale(grp.segments, grp.type, inv_scale, nullptr, static_cast<int*>(flag), nullptr,
                             mem.stream());
  }

  //! Waits for mem's stream (returns a host value).
  static double sum_of_squares(const CudaMemory& mem, std::span<const grad_group> groups) {
    detail::require_floating(groups, "grad_norm");
    detail::device_guard g(mem.device());
    return cuda::kernels::sum_of_squares(groups, mem.stream());
  }

  static void clamp(const CudaMemory& mem, std::span<const grad_group> groups, double lo, double hi) {
    detail::require_floating(groups, "clip_grad_value");
    detail::device_guard g(mem.device());
    for (const auto& grp : groups) cuda::kernels::clamp(grp.segments, grp.type, lo, hi, mem.stream());
  }
};
static_assert(has_grad_ops<CudaMemory>);

}  // namespace lockstep
