#pragma once
//! DeviceDynamicScale — DynamicScale (same options, same rule, same state) whose scale, found-inf
//! flag and skip decision stay on the GPU: a steady-state step never waits for the device.
//!
//! \code
//!   lockstep::DataParallel<Model, lockstep::NcclComm, lockstep::DeviceDynamicScale> dp(ctx, model);
//!   dp.scaler().attach(dp.comm());                 // once: allocates the state on the device
//!   const float* scale = dp.scaler().device_scale();
//!   const int* found_inf = dp.scaler().device_found_inf();
//!   lockstep::FusedAdamW opt({.lr = 1e-3}, dp.parameters());
//!   for (auto& batch : my_batches) {
//!     auto step = dp.step();
//!     model.forward_backward(batch, scale, step.on_gradient_ready());  // its loss kernel reads *scale
//!     step.finish([&](auto slices) { opt.step(slices, stream, found_inf); });
//!   }
//! \endcode
//!
//! unscale_and_check(comm, groups) queues, on the communicator's compute stream: zero the flag;
//! one multi-tensor pass per element type g ← g · (1/scale), raising the flag on any inf/NaN
//! result; the flag's all-reduce (max) over ranks; the scale update. It returns **false**: the
//! host does not know whether the step is skipped. The decision is *device_found_inf(), which
//! the optimizer reads on the device (lockstep::FusedSgd / FusedAdamW and the kernels in
//! cuda/fused_optimizer.cuh takes it): a skipped step leaves parameters and optimizer state
//! as they were. update(found_inf) does nothing (the device already updated).
//!
//! The state lives in one small device allocation: the scale in double (the authoritative value,
//! updated exactly as DynamicScale::update does, so the two agree bit for bit), 1/scale in
//! double (gradients are multiplied by it rounded to their element type, as DynamicScale does),
//! the scale rounded to float for the loss kernel (device_scale()), the flag, and the counters of
//! loss_scale_state. Every rank feeds the same all-reduced flag to the same update, so every
//! rank's state stays identical.
//!
//! Skip limit: DynamicScaleOptions::max_consecutive_skips holds here too. The update kernel counts
//! the skipped steps in a row and, at the limit, writes the count into a word of pinned host
//! memory mapped for the device; unscale_and_check reads that word (no synchronisation) and
//! throws lockstep::error — so the error comes a step or two after the limit, as the host runs
//! ahead of the device, and also with a CUDA-graph-captured step (whose next replay is not
//! called through here: check stalled_steps() between replays). Every rank's count is the same
//! (the flag is agreed). The error names the rank whose own gradients were non-finite, as
//! DynamicScale's does: while the host's (lagging) view shows skips in a row, DataParallel
//! checks each rank's local gradients before averaging into that rank's slot of the found-inf
//! vote (device_vote), which is all-reduced with the flag — no extra collective, no host sync —
//! and the update kernel records the first finding of the run for the message. Under
//! lockstep's launchers (run(Gpus), run(Processes)) a rank that throws first aborts the others,
//! which end with its cause — with hand-made communicators, abort them yourself, or the others
//! wait in their next collective.
//!
//! These synchronise with the device and are meant for logging and checkpoints, not for every
//! step: scale() and state() (download), load_state() and attach() (upload), and copying an
//! attached scaler (a copy starts with the state, downloaded, and no device allocation of its
//! own). Note that step.loss_scale() calls scale(): read *device_scale() in the loss kernel.

#include <cuda_runtime_api.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/grad_kernels.cuh"
#include "lockstep/cuda/kernels/loss_scale.cuh"
#include "lockstep/cuda/memory.cuh"
#include "lockstep/scaling/loss_scaler.hpp"
#include "lockstep/scaling/scalers.hpp"

namespace lockstep {

class DeviceDynamicScale {
 public:
  DeviceDynamicScale() : DeviceDynamicScale(DynamicScaleOptions{}) {}
  explicit DeviceDynamicScale(const DynamicScaleOptions& o) : opts_(o), host_{o.init_scale, 0, 0, 0} {
    detail::validate(o);  // as DynamicScale does
    if (!(o.max_scale <= static_cast<double>(std::numeric_limits<float>::max())) ||
        !(o.min_scale >= static_cast<double>(std::numeric_limits<float>::min())))
      throw config_error("DeviceDynamicScale: min_scale and max_scale must lie within float's "
                         "normal range (the loss kernel reads the scale as a float), got [" +
                         std::to_string(o.min_scale) + ", " + std::to_string(o.max_scale) + "]");
  }

  //! Copies take the state (downloaded: synchronises when `o` is attached) but not the device
  //! allocation; attach() or the first unscale_and_check gives them their own.
  DeviceDynamicScale(const DeviceDynamicScale& o) : opts_(o.opts_), host_(o.state()) {}
  DeviceDynamicScale& operator=(const DeviceDynamicScale& o) {
    if (this != &o) {
      const auto st = o.state();
      opts_ = o.opts_;
      release();
      host_ = st;
    }
    return *this;
  }
  DeviceDynamicScale(DeviceDynamicScale&& o) noexcept
      : opts_(o.opts_), host_(o.host_), buf_(std::move(o.buf_)), watch_(std::move(o.watch_)), mem_(o.mem_),
        owner_(std::exchange(o.owner_, nullptr)), world_(o.world_) {}
  DeviceDynamicScale& operator=(DeviceDynamicScale&& o) noexcept {
    if (this != &o) {
      opts_ = o.opts_;
      host_ = o.host_;
      buf_ = std::move(o.buf_);
      watch_ = std::move(o.watch_);
      mem_ = o.mem_;
      owner_ = std::exchange(o.owner_, nullptr);
      world_ = o.world_;
    }
    return *this;
  }

  const DynamicScaleOptions& options() const noexcept { return opts_; }

  //! Allocates the state on comm's device and uploads it (blocking; once per communicator —
  //! again for another one, which moves the state there). After this, device_scale() and
  //! device_found_inf() are valid, and stay the same pointers.
  template <communicator C>
    requires std::same_as<memory_of_t<C>, CudaMemory>
  void attach(C& comm) {
    if (buf_ && owner_ == static_cast<const void*>(&comm)) {
      mem_ = comm.memory();
      return;
    }
    const loss_scale_state st = state();
    CudaMemory mem = comm.memory();
    // The state, then the votes: [found-inf, rank 0's own flag, ..., rank N-1's] (zeroed).
    const int world = comm.size();
    auto buf =
        mem.allocate(sizeof(cuda::kernels::device_scale_state) + sizeof(int) * (1 + static_cast<std::size_t>(world)));
    const auto dev = cuda::kernels::make_device_scale_state(st);
    mem.upload(buf.get(), &dev, sizeof dev);
    if (!watch_ && opts_.max_consecutive_skips > 0) watch_ = new_watch(mem.device());
    if (watch_) clear_watch();
    buf_ = std::move(buf);
    mem_ = mem;
    owner_ = &comm;
    world_ = world;
  }
  bool attached() const noexcept { return static_cast<bool>(buf_); }

  //! The current scale. Synchronises with the device when attached.
  double scale() const { return state().scale; }

  //! Unscales and checks on the device, agrees on the flag over ranks and updates the scale,
  //! all queued on comm's compute stream (see the header comment). Always returns false: the
  //! skip decision is *device_found_inf(). Collective: every rank calls it in the same order.
  template <communicator C>
    requires std::same_as<memory_of_t<C>, CudaMemory>
  bool unscale_and_check(C& comm, std::span<const grad_group> groups) {
    detail::require_floating(groups, "DeviceDynamicScale::unscale_and_check");
    attach(comm);
    if (const std::int64_t n = stalled_steps(); n > 0)
      throw error("lockstep::DeviceDynamicScale: " + std::to_string(n) +
                  " steps in a row had inf/NaN gradients (the loss scale backed off each time, to no less "
                  "than its floor " +
                  std::to_string(opts_.min_scale) + ")" + detail::stalled_advice + origin());
    detail::device_guard g(mem_.device());
    auto* st = state_ptr();
    int* votes = votes_ptr();
    const cudaStream_t s = mem_.stream();
    LOCKSTEP_TRY_CUDA(cudaMemsetAsync(votes, 0, sizeof(int), s));  // the ranks' own flags are the update's
    for (const auto& grp : groups)
      cuda::kernels::unscale(grp.segments, grp.type, 1.0, &st->inv_scale, votes, nullptr, s);
    // Stream ordered: the compute stream waits for the all-reduce, the host does not.
    if (comm.size() > 1)
      comm.all_reduce(votes, votes, 1 + static_cast<std::size_t>(world_), dtype::i32, reduce_op::max).wait();
    cuda::kernels::update_scale(st, opts_, votes, world_, s, watch_ ? device_watch() : nullptr);
    return false;
  }

  //! Whether the host's view of the device shows skipped steps in a row (lagging, no
  //! synchronisation; false without a skip limit). DataParallel then checks this rank's own
  //! gradients into device_vote(rank) (parallel/detail/nonfinite.hpp).
  bool skipping() const noexcept { return watch_ && watch_field(&cuda::kernels::skip_watch::in_a_row) > 0; }
  //! Rank r's slot of the found-inf vote (device memory, int32): raised when r's own
  //! gradients held inf/NaN before averaging; the update names such ranks in the skip-limit error.
  int* device_vote(int r) const {
    if (r < 0 || r >= world_)
      throw config_error("DeviceDynamicScale::device_vote: rank " + std::to_string(r) + " of " +
                         std::to_string(world_));
    return votes_ptr() + 1 + r;
  }

  //! The skipped steps in a row at which the device reached max_consecutive_skips, or 0 (not
  //! yet, or no limit). Reads host memory the device writes: no synchronisation; it may lag.
  std::int64_t stalled_steps() const noexcept { return watch_ ? watch_field(&cuda::kernels::skip_watch::stalled) : 0; }

  //! Nothing to do: unscale_and_check already updated the state on the device.
  void update(bool) noexcept {}

  //! Synchronises with the device when attached.
  loss_scale_state state() const {
    if (!buf_) return host_;
    cuda::kernels::device_scale_state d{};
    mem_.download(&d, buf_.get(), sizeof d);
    return {d.scale, d.good_steps, d.skipped_steps, d.steps};
  }

  //! Restores a state written by a scaler with these options (DeviceDynamicScale or
  //! DynamicScale: the states are the same); uploads it when attached (blocking).
  void load_state(const loss_scale_state& st) {
    detail::require_valid_state(st, "DeviceDynamicScale");
    detail::require_state_fits(st, opts_, "DeviceDynamicScale");
    if (buf_) {
      const auto dev = cuda::kernels::make_device_scale_state(st);
      mem_.upload(buf_.get(), &dev, sizeof dev);
      if (watch_) clear_watch();
    }
    host_ = st;
  }

  //! The scale as float, in device memory: multiply the loss (or its gradient) by it.
  const float* device_scale() const { return &state_ptr("device_scale")->scale_f32; }
  //! 1/scale (double) in device memory, as the unscaling pass reads it.
  const double* device_inv_scale() const { return &state_ptr("device_inv_scale")->inv_scale; }
  //! The last step's agreed flag (int32, device memory): non-zero = skip the step. Valid after
  //! unscale_and_check, in stream order on the compute stream.
  const int* device_found_inf() const { return &state_ptr("device_found_inf")->found_inf; }

 private:
  cuda::kernels::device_scale_state* state_ptr(const char* who = "unscale_and_check") const {
    if (!buf_)
      throw config_error(std::string("DeviceDynamicScale::") + who +
                         ": the scaler has no device state yet; call attach(comm) first (or "
                         "run one unscale_and_check)");
    return static_cast<cuda::kernels::device_scale_state*>(buf_.get());
  }
  int* votes_ptr() const {
    return reinterpret_cast<int*>(reinterpret_cast<char*>(state_ptr()) + sizeof(cuda::kernels::device_scale_state));
  }

  // The skip watch (cuda::kernels::skip_watch) lives in mapped pinned host memory: the host
  // reads it with volatile loads, never waiting for the device.
  using watch_t = cuda::kernels::skip_watch;
  static constexpr std::size_t watch_words = (sizeof(watch_t) + sizeof(std::int64_t) - 1) / sizeof(std::int64_t);
  static std::shared_ptr<std::int64_t> new_watch(int device) { return detail::mapped_word(device, watch_words); }
  volatile watch_t* host_watch() const noexcept { return reinterpret_cast<volatile watch_t*>(watch_.get()); }
  watch_t* device_watch() const { return reinterpret_cast<watch_t*>(detail::device_view(watch_.get())); }
  template <class T>
  T watch_field(T watch_t::* field) const noexcept {
    return host_watch()->*field;
  }
  void clear_watch() noexcept {
    volatile watch_t* w = host_watch();
    w->stalled = 0;
    w->in_a_row = 0;
    w->origin_step = 0;
    w->origin_ranks = 0;
    w->origin_mask = 0;
  }
  //! "; the non-finite values came from rank R: ..." when the device found the ranks, else "".
  std::string origin() const {
    const volatile watch_t* w = host_watch();
    const std::int64_t step = w->origin_step;  // written last by the device
    if (step == 0) return {};
    std::vector<int> ranks;
    const std::uint64_t mask = w->origin_mask;
    for (int r = 0; r < 64 && r < world_; ++r)
      if (mask >> r & 1U) ranks.push_back(r);
    const auto total = static_cast<std::size_t>(w->origin_ranks);
    return "; " + detail::origin_text(ranks, total > ranks.size() ? total - ranks.size() : 0, step,
                                      "checked rank by rank on the device once the host saw skips in a row");
  }
  void release() noexcept {
    buf_.reset();
    watch_.reset();
    owner_ = nullptr;
  }

  DynamicScaleOptions opts_;
  loss_scale_state host_;                // the state while not attached
  std::shared_ptr<void> buf_;            // one cuda::kernels::device_scale_state
  std::shared_ptr<std::int64_t> watch_;  // a cuda::kernels::skip_watch in mapped pinned host memory
  CudaMemory mem_{0, nullptr};
  const void* owner_ = nullptr;
  int world_ = 1;
};
static_assert(loss_scaler<DeviceDynamicScale> && device_scaler<DeviceDynamicScale>);

}  // namespace lockstep
