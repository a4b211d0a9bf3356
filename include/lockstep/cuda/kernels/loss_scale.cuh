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
  double inv_scale;        //!< 1.0 / scale, as the host computes it
  float scale_f32;         //!< scale rounded to float: what the loss kernel multiplies by
  std::int32_t found_inf;  //!< this step's flag, agreed over ranks
  std::int64_t good_steps;
  std::int64_t skipped_steps;
  std::int64_t steps;
  std::int64_t skips_in_a_row;  //!< not part of loss_scale_state: counted since attach/load_state
};

inline device_scale_state make_device_scale_state(const loss_scale_state& st) {
  return {st.scale, 1.0 / st.scale, static_cast<float>(st.scale), 0, st.good_steps, st.skipped_steps, st.steps, 0};
}

//! The host's window on the device's skip accounting: pinned host memory mapped for the
//! device, written by the update kernel, read by the host without synchronising (so it lags).
struct skip_watch {
  std::int64_t stalled;       //!< the skips in a row at which max_consecutive_skips was reached; 0: not yet
  std::int64_t in_a_row;      //!< skipped steps in a row as of the latest update
  std::int64_t origin_step;   //!< the step that first found ranks with non-finite local gradients in this
                              //!< run of skips (1-based, as loss_scale_state::steps); 0: none yet
  std::int64_t origin_ranks;  //!< how many ranks it found
  std::uint64_t origin_mask;  //!< which of ranks 0..63 it found
};

namespace detail {
//! DynamicScale::update on the device, the same operations in the same order (double). One
//! thread. The agreed flag is votes[0] (the all-reduced found-inf), copied to st->found_inf for
//! the optimizers; votes[1 + r] is rank r's flag from checking its own gradients before
//! averaging (nonfinite.hpp; set only on steps a rank checked), zeroed here for the next step.
//! With a watch (max_consecutive_skips > 0): the first step of a run of skips whose votes name
//! ranks is recorded, a clean step forgets it, and when the step is the limit-th skipped in a
//! row the count goes to watch->stalled — after which the watch is left as it is, for the
//! host's error message.
template <int = 0>
__global__ void update_scale_kernel(device_scale_state* st, DynamicScaleOptions o, volatile skip_watch* watch,
                                    int* votes, int world) {
  const int found = votes[0];
  st->found_inf = found;
  st->steps += 1;
  double s = st->scale;
  st->skips_in_a_row = found != 0 ? st->skips_in_a_row + 1 : 0;
  if (watch != nullptr && watch->stalled == 0) {
    if (found == 0) {
      watch->origin_step = 0;
    } else if (watch->origin_step == 0) {
      std::int64_t n = 0;
      std::uint64_t mask = 0;
      for (int r = 0; r < world; ++r)
        if (votes[1 + r] != 0) {
          ++n;
          if (r < 64) mask |= std::uint64_t{1} << r;
        }
      if (n > 0) {
        watch->origin_ranks = n;
        watch->origin_mask = mask;
        __threadfence_system();  // the host reads origin_step last
        watch->origin_step = st->steps;
      }
    }
    watch->in_a_row = st->skips_in_a_row;
    if (o.max_consecutive_skips > 0 && st->skips_in_a_row >= o.max_consecutive_skips) {
      __threadfence_system();  // the finding before the stop
      watch->stalled = st->skips_in_a_row;
    }
  }
  for (int r = 1; r <= world; ++r) votes[r] = 0;
  if (found != 0) {
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

//! Queues DynamicScale's update of *st with options o on stream s, reading the agreed votes
//! (votes[0] the found-inf flag, votes[1..world] the ranks' own flags; see the kernel).
inline void update_scale(device_scale_state* st, const DynamicScaleOptions& o, int* votes, int world, cudaStream_t s,
                         skip_watch* watch = nullptr) {
  detail::update_scale_kernel<<<1, 1, 0, s>>>(st, o, watch, votes, world);
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace lockstep::cuda::kernels
