#pragma once
//! The device side of DeviceDynamicScale (cuda/device_dynamic_scale.cuh): its state as it lives
//! in device memory, and DynamicScale's update rule run there, so that a step's skip decision
//! and the next scale never travel to the host.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lockstep/cuda/error.cuh"
#include "lockstep/scaling/loss_scaler.hpp"
#include "lockstep/scaling/scalers.hpp"

namespace lockstep::cuda::kernels {

//! The device-resident state of a DeviceDynamicScale.
struct device_scale_state {
  double scale;
  double inv_scale;       //!< 1.0 / scale, as the host computes it
  float scale_f32;        //!< scale rounded to float: what the loss kernel multiplies by
  std::int32_t found_inf; //!< this step's flag, agreed over ranks
  std::int64_t good_steps;
  std::int64_t skipped_steps;
  std::int64_t steps;
  std::int64_t skips_in_a_row;  //!< not part of loss_scale_state: counted since attach/load_state
};

inline device_scale_state make_device_scale_state(const loss_scale_state& st) {
  return {st.scale, 1.0 / st.scale, static_cast<float>(st.scale), 0, st.good_steps, st.skipped_steps, st.steps, 0};
}

namespace detail {
//! DynamicScale::update on the device, the same operations in the same order (double),
//! reading the agreed flag. One thread. When the step is the max_consecutive_skips-th skipped in
//! a row, the count goes to *stalled (host memory mapped for the device; nullptr: no limit),
//! which the host reads without synchronising.
template <int = 0>
__global__ void update_scale_kernel(device_scale_state* st, DynamicScaleOptions o, volatile std::int64_t* stalled) {
  st->steps += 1;
  double s = st->scale;
  st->skips_in_a_row = st->found_inf != 0 ? st->skips_in_a_row + 1 : 0;
  if (stalled != nullptr && o.max_consecutive_skips > 0 && st->skips_in_a_row >= o.max_consecutive_skips &&
      *stalled == 0)
    *stalled = st->skips_in_a_row;
  if (st->found_inf != 0) {
    st->skipped_steps += 1;
    st->good_steps = 0;
    const double b = s * o.backoff_factor;
    s = b < o.min_scale ? o.min_scale : b;  // std::max(b, min_scale)
  } else if (++st->good_steps >= o.growth_interval) {
    st->good_steps = 0;
    const double g = s * o.growth_factor;
    s = o.max_scale < g ? o.max_scale : g;  // std::min(g, max_scale)
  }
  st->scale = s;
  st->inv_scale = 1.0 / s;
  st->scale_f32 = static_cast<float>(s);
}
}  // namespace detail

//! Queues DynamicScale's update of *st with options o on stream s (reads st->found_inf).
inline void update_scale(device_scale_state* st, const DynamicScaleOptions& o, cudaStream_t s,
                         std::int64_t* stalled = nullptr) {
  detail::update_scale_kernel<<<1, 1, 0, s>>>(st, o, stalled);
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace lockstep::cuda::kernels
