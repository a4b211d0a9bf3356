#pragma once
//! What one DataParallel step hands to the model (the gradient-ready hook) and reports back
//! to the training loop (step_result, and sync_stats over all steps).

#include <cstddef>
#include <cstdint>
#include <string>
#include <limits>

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

//! What gradient synchronisation has cost so far (per rank).
struct sync_stats {
  std::uint64_t micro_steps = 0;      //!< step() calls
  std::uint64_t syncs = 0;            //!< micro-steps that averaged gradients
  std::uint64_t buckets_reduced = 0;  //!< bucket all-reduces issued
  std::uint64_t bytes_reduced = 0;    //!< bytes all-reduced (this rank's buffers)
  double comm_seconds = 0;            //!< host time spent issuing and waiting on collectives
  std::size_t bucket_count = 0;       //!< buckets in the current plan (all element types)
  std::size_t arena_bytes = 0;        //!< gradient arena size (all element types)
  std::size_t shard_bytes = 0;        //!< sharded: this rank's shard of the arena (optimizer's share)
  //! Host time of the model's part of the last accumulation cycle: step() to finish(), less
  //! the time spent in collectives meanwhile, summed over its micro-steps (on GPUs, the time to
  //! launch the work). stragglers() compares it across ranks.
  double model_seconds = 0;
  bool zero_copy = false;                //!< the model's gradients live in the arena
  bool values_bound = false;             //!< sharded: its values live in the shards' arena (model (e))
  bool gathers_by_copy_engine = false;   //!< sharded: the all-gathers go to a window of the copy-engine split
  bool scatters_by_copy_engine = false;  //!< sharded: so do the reduce-scatters (copy_engine_scatter)
  bool rebuilt = false;                  //!< the plan was reordered after the first step
  //! false while ShardedOptimizer::gather_wire has left the model's values rounded (the masters
  //! apart), from its all-gather until wait_all_parameters()
  bool values_exact = true;
  bool symmetric_memory =
      false;  //!< the f32/bf16 arenas are symmetric windows (BucketPolicy::symmetric_memory; an f16 arena never is)
  //! ShardedGradients / FullySharded: the most bytes of block buffers that existed at once
  //! (gathered values, gradients until their reduce-scatter ran, pooled ones) — what full
  //! sharding holds beside the shards.
  std::size_t lent_bytes = 0;
  //! BucketPolicy::tune: the cap chosen after the first step (0: not tuned), and the model's
  //! comparison of the caps it tried.
  std::size_t tuned_cap_bytes = 0;
  std::string tuning;
};

//! What finish() reports. Converts to true when the optimizer should step.
struct step_result {
  bool synced = false;  //!< this micro-step averaged gradients (last of its cycle)
  bool applied = true;  //!< false: the step must be skipped (non-finite gradients)
  //! With a device-side scaler (DeviceDynamicScale): its found-inf flag agreed over ranks, an
  //! int32 in device memory (non-zero: skip the step), valid in stream order on the compute
  //! stream; hand it to the optimizer (FusedSgd / FusedAdamW). `applied` is then true:
  //! the host does not know. nullptr with host-decided scalers.
  const int* device_found_inf = nullptr;
  //! The global L2 norm of the averaged gradients before clipping, when
  //! DataParallelOptions::max_grad_norm is set; NaN otherwise (and on micro-steps).
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  explicit operator bool() const noexcept { return synced && applied; }
};

}  // namespace lockstep
