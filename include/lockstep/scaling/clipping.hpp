#pragma once
//! Gradient clipping over grad_groups, PyTorch's clip_grad_norm_ / clip_grad_value_ semantics.
//!
//! Call these on gradients that are already averaged (identical on every rank) and unscaled,
//! i.e. after unscale_and_check: then every rank computes the same norm, bit for bit, because
//! the sum runs in an order fixed by the layout, and no communication is needed.
//!
//! The overloads without a memory argument work on host memory. The ones taking a memory_ops
//! value run wherever lockstep::grad_ops has a specialisation for it (HostMemory now; device
//! backends add theirs, see grad_group.hpp), so the same calls serve device gradients later.

#include <cmath>
#include <span>
#include <string>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/core/host_memory.hpp"
#include "lockstep/scaling/loss_scaler.hpp"

namespace lockstep {

namespace detail {
inline void check_max_norm(double max_norm) {
  if (!(max_norm >= 0.0)) throw config_error("clip_grad_norm: max_norm must be >= 0, got " + std::to_string(max_norm));
}
//! Scales the groups by max_norm / (norm + 1e-6) when that is below 1; returns norm.
template <memory_ops Mem>
double clip_to(Mem mem, std::span<const grad_group> groups, double max_norm, double norm) {
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  // One multi-tensor pass per element type (a scale per segment would be a launch each).
  if (coef < 1.0) grad_ops<Mem>::unscale_and_flag(mem, groups, coef, nullptr);
  return norm;
}
}  // namespace detail

//! The global L2 norm over every element of every group: sqrt(Σx²), the squares summed in
//! double with compensation (a relative error of a few 1e-16 whatever the size). inf/NaN in
//! any gradient make it inf/NaN.
template <memory_ops Mem>
  requires has_grad_ops<Mem>
double grad_norm(Mem mem, std::span<const grad_group> groups) {
  return std::sqrt(grad_ops<Mem>::sum_of_squares(mem, groups));
}
inline double grad_norm(std::span<const grad_group> groups) { return grad_norm(HostMemory{}, groups); }

//! Clips the global L2 norm to max_norm and returns the norm before clipping. As PyTorch:
//! coef = max_norm / (norm + 1e-6); when coef < 1 every gradient is multiplied by coef
//! (rounded to its element type), otherwise nothing is written.
//! A non-finite norm (an inf/NaN gradient) leaves the gradients untouched and is returned as
//! is: such a step is to be skipped, and multiplying by coef = 0 would only turn every
//! gradient into NaN/0. (PyTorch multiplies anyway unless error_if_nonfinite.)
//! Throws config_error for a negative or NaN max_norm; max_norm = inf never clips.
template <memory_ops Mem>
  requires has_grad_ops<Mem>
double clip_grad_norm(Mem mem, std::span<const grad_group> groups, double max_norm) {
  detail::check_max_norm(max_norm);
  return detail::clip_to(mem, groups, max_norm, grad_norm(mem, groups));
}
inline double clip_grad_norm(std::span<const grad_group> groups, double max_norm) {
  return clip_grad_norm(HostMemory{}, groups, max_norm);
}

//! As clip_grad_norm, for gradients split over the ranks of comm, each rank passing its own
//! part (its shard, as DataParallel does with ShardedOptimizer): the squares are summed over
//! the ranks (one all-reduce of a double), so every rank clips by the same norm. Collective.
template <communicator C>
  requires has_grad_ops<memory_of_t<C>>
double clip_grad_norm_sharded(C& comm, std::span<const grad_group> groups, double max_norm) {
  detail::check_max_norm(max_norm);
  auto mem = comm.memory();
  double sum = grad_ops<memory_of_t<C>>::sum_of_squares(mem, groups);
  if (comm.size() > 1) detail::host_all_reduce(comm, std::span<double>(&sum, 1), reduce_op::sum);
  return detail::clip_to(mem, groups, max_norm, std::sqrt(sum));
}

//! Clamps every gradient element to [-clip, clip] (PyTorch's clip_grad_value_); NaN stays NaN.
//! Throws config_error for a negative or NaN clip.
template <memory_ops Mem>
  requires has_grad_ops<Mem>
void clip_grad_value(Mem mem, std::span<const grad_group> groups, double clip) {
  if (!(clip >= 0.0)) throw config_error("clip_grad_value: clip must be >= 0, got " + std::to_string(clip));
  grad_ops<Mem>::clamp(mem, groups, -clip, clip);
}
inline void clip_grad_value(std::span<const grad_group> groups, double clip) {
  clip_grad_value(HostMemory{}, groups, clip);
}

}  // namespace lockstep
