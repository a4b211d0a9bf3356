#pragma once
//! lockstep::DataParallel<Model, Comm, Policies...> — one model replica per rank, gradients
//! averaged bucket by bucket as backward produces them.
//!
//! \code
//!   lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {
//!     Mlp model(seed);                                     // same shapes on every rank
//!     lockstep::DataParallel dp(ctx, model);               // rank 0's values everywhere
//!     for (auto& batch : my_batches) {
//!       auto step = dp.step();
//!       model.backward(batch, step.on_gradient_ready());   // optional: overlap
//!       if (step.finish()) optimizer.update(model);        // averaged over all ranks
//!     }
//!   });
//! \endcode
//!
//! Policies (any order, each at most once): an accumulation_policy (EveryStep default,
//! Accumulate<K>, Accumulate<> with K at run time), a loss_scaler (NoScaling default,
//! StaticScale, DynamicScale), a bucket_hook (AllReduceMean default, Hierarchical, Bf16Wire;
//! bucket_hook.hpp) and ShardedOptimizer (policies.hpp). With a scaler, multiply the loss
//! by step.loss_scale() before backward; finish() unscales the averaged gradients, checks them
//! for inf/NaN (agreed across ranks) and reports applied = false when the optimizer must skip
//! the step. With DataParallelOptions::max_grad_norm it also clips them.
//! Sharded, the optimizer steps shard_parameters() in finish(on_shard): docs/sharding.md.
//!
//! Uneven inputs (ranks with different numbers of batches): open a scope with dp.join(...)
//! around the loop — see join.hpp.

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/context.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/parallel/detail/binding.hpp"
#include "lockstep/parallel/bucket_hook.hpp"
#include "lockstep/parallel/deduction.hpp"
#include "lockstep/parallel/block_use.hpp"
#include "lockstep/parallel/detail/allreduce_units.hpp"
#include "lockstep/parallel/detail/block_units.hpp"
#include "lockstep/parallel/detail/arguments.hpp"
#include "lockstep/parallel/detail/nonfinite.hpp"
#include "lockstep/parallel/detail/use_log.hpp"
#include "lockstep/parallel/detail/reducer.hpp"
#include "lockstep/parallel/detail/step_recorder.hpp"
#include "lockstep/parallel/detail/replicas.hpp"
#include "lockstep/parallel/detail/requirements.hpp"
#include "lockstep/parallel/detail/shard_units.hpp"
#include "lockstep/parallel/join.hpp"
#include "lockstep/parallel/gradient_wire.hpp"
#include "lockstep/parallel/policies.hpp"
#include "lockstep/parallel/step.hpp"
#include "lockstep/parallel/step_handle.hpp"
#include "lockstep/scaling/clipping.hpp"
#include "lockstep/scaling/loss_scaler.hpp"
#include "lockstep/scaling/scalers.hpp"

namespace lockstep {

template <class Model, class Comm, class... Policies>
class DataParallel {
 public:
  using model_type = Model;
  using comm_type = Comm;
  using accumulation_type = typename detail::policy_set<Comm, Policies...>::accumulation;
  using scaler_type = typename detail::policy_set<Comm, Policies...>::scaler;
  using hook_type = typename detail::policy_set<Comm, Policies...>::hook;
  //! Whether the optimizer state is sharded over the ranks (ShardedOptimizer).
  static constexpr bool sharded = detail::policy_set<Comm, Policies...>::sharded;
  //! Whether the model's blocks are used through use_block (ShardedGradients, FullySharded).
  static constexpr bool block_sharded = detail::policy_set<Comm, Policies...>::block_sharded;
  //! The strategy policy (Replicated, the default, or ShardedOptimizer) and the
  //! reduction units it runs (parallel/detail/).
  using strategy_type = typename detail::policy_set<Comm, Policies...>::strategy;
  using units_type = typename detail::policy_set<Comm, Policies...>::units;
  static_assert(detail::data_parallel_requirements<Model, Comm, scaler_type>());

  //! One micro-step: created by step(), ended by finish() (step_handle.hpp).
  using step_handle = lockstep::step_handle<DataParallel>;

  //! What the constructors take after the model, in any order, each at most once: a
  //! DataParallelOptions, and an instance of any of this DataParallel's policies (e.g.
  //! `Accumulate<>(4)`, `DynamicScale({.init_scale = 1024})`). What is not given is
  //! default-constructed. Braced options (`{.zero_copy = false}`) go first.
  template <class A>
  static constexpr bool argument_v =
      detail::is_options_v<A> || std::is_same_v<std::remove_cvref_t<A>, accumulation_type> ||
      std::is_same_v<std::remove_cvref_t<A>, scaler_type> || std::is_same_v<std::remove_cvref_t<A>, hook_type> ||
      std::is_same_v<std::remove_cvref_t<A>, strategy_type>;

  template <class... Args>
    requires(argument_v<Args> && ...) && (!detail::starts_with_options_v<Args...>)
  explicit DataParallel(context<Comm>& ctx, Model& model, Args&&... args)
      : DataParallel(ctx.comm(), model, std::forward<Args>(args)...) {}
  template <class... Args>
    requires(argument_v<Args> && ...)
  DataParallel(context<Comm>& ctx, Model& model, const DataParallelOptions& opts, Args&&... args)
      : DataParallel(ctx.comm(), model, opts, std::forward<Args>(args)...) {}

  //! The positional form of earlier versions — DataParallel(ctx, model, {}, {}, scaler), braces
  //! for the policies left at their defaults — is gone: only this message remains of it.
  template <class... Args>
  DataParallel(context<Comm>& ctx, Model& model, const DataParallelOptions&, detail::braced_policy, Args&&...)
      : DataParallel(ctx, model) {
    static_assert(detail::positional_form_v<Args...>,
                  "lockstep::DataParallel: `{}` in a policy's place is the old positional form "
                  "(ctx, model, options, accumulation, scaler, hook). Pass only the policies you "
                  "choose, as instances in any order after the model (options first if any), e.g. "
                  "DataParallel(ctx, model, lockstep::DynamicScale()) or "
                  "DataParallel(ctx, model, {.zero_copy = false}, lockstep::Accumulate<>(4)); "
                  "leave out what you want at its default");
  }
  template <class... Args>
  DataParallel(context<Comm>& ctx, Model& model, const DataParallelOptions& o, detail::braced_policy,
               detail::braced_policy, Args&&... args)
      : DataParallel(ctx, model, o, detail::braced_policy{}, std::forward<Args>(args)...) {}
  template <class... Args>
  DataParallel(context<Comm>& ctx, Model& model, const DataParallelOptions& o, detail::braced_policy,
               detail::braced_policy, detail::braced_policy, Args&&... args)
      : DataParallel(ctx, model, o, detail::braced_policy{}, std::forward<Args>(args)...) {}

  // (std::type_identity_t: the communicator alone never deduces the class; the context does.)
  template <class... Args>
    requires(argument_v<Args> && ...) && (!detail::starts_with_options_v<Args...>)
  explicit DataParallel(std::type_identity_t<Comm>& comm, Model& model, Args&&... args)
      : DataParallel(built, comm, model, detail::take_arg<DataParallelOptions>(args...),
                     detail::take_arg<accumulation_type>(args...), detail::take_arg<scaler_type>(args...),
                     detail::take_arg<hook_type>(args...), detail::take_arg<strategy_type>(args...)) {}
  template <class... Args>
    requires(argument_v<Args> && ...)
  DataParallel(std::type_identity_t<Comm>& comm, Model& model, const DataParallelOptions& opts, Args&&... args)
      : DataParallel(built, comm, model, opts, detail::take_arg<accumulation_type>(args...),
                     detail::take_arg<scaler_type>(args...), detail::take_arg<hook_type>(args...),
                     detail::take_arg<strategy_type>(args...)) {
    static_assert(((detail::is_options_v<Args> ? 1 : 0) + ... + 0) == 0,
                  "lockstep::DataParallel: DataParallelOptions is given twice");
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  //! A model holding views of the arenas gets its values and gradients back (model (d), (f)).
  ~DataParallel() {
    try {
      settle_abandoned();
    } catch (...) {  // a destructor must not throw; release_model gathers what it can
    }
    detail::release_model(model_, reducer_);
  }

  //! Begins a micro-step. The accumulation policy decides whether it synchronises.
  [[nodiscard]] step_handle step() {
    if (open_)
      throw config_error("lockstep: step() called while the previous step is still open; "
                         "call finish() on each step before starting the next");
    settle_abandoned();
    if (!in_cycle_) {
      detail::check_unchanged(reducer_.params(), detail::collect_parameters(model_), comm_.rank(), reducer_.zero_copy(),
                              !block_sharded);
      k_ = acc_.steps();
      if (k_ < 1) throw config_error("lockstep: the accumulation policy returned steps() < 1");
      if (joining_) Join<DataParallel>::steps_in_scope(*this);  // fixed in a scope (block sharding)
      micro_ = 0;
      reducer_.begin_cycle();
      in_cycle_ = true;
      if (opts_.broadcast_buffers) sync_buffers(/*stepping=*/true);
      if (joining_) Join<DataParallel>::cycle_begins(*this);
    }
    const bool sync = micro_ + 1 >= k_;
    double prescale = usual_prescale();
    // In a Join scope a syncing micro-step first agrees with the other ranks on who
    // contributes (one tiny all-reduce; outside a scope nothing is added).
    if (joining_ && sync) {
      using join = Join<DataParallel>;
      prescale = join::sync_prescale(*this, join::agree(*this, micro_ + 1));
    }
    reducer_.begin_micro(sync, prescale);
    uses_.begin();
    open_ = true;
    recorder_.step_begin(sync);
    return step_handle(this, sync);
  }

  //! Opens a Join scope for uneven inputs (join.hpp). Every rank enters it at the same point
  //! of its loop; a rank that runs out of batches, on leaving the scope, keeps taking part in
  //! the others' gradient averages (contributing zeros) and calls on_shadow_step(result) for
  //! each such step, with the averaged gradients in place, to apply the same optimizer update.
  //! Sharded: on_shard (the optimizer's shard step) as well; ShardedGradients / FullySharded:
  //! it replays its last step's block uses, gathers and all, in each micro-step it shadows.
  [[nodiscard]] Join<DataParallel> join(std::function<void(step_result)> on_shadow_step,
                                        std::function<void(std::span<const param_slice>)> on_shard = {}) {
    return Join<DataParallel>(*this, std::move(on_shadow_step), std::move(on_shard));
  }

  //! The accumulation policy (e.g. to set K at run time with Accumulate<>: takes effect
  //! at the next optimizer step).
  accumulation_type& accumulation() noexcept { return acc_; }
  //! The loss scaler (its state() goes into checkpoints; load_state() restores it).
  scaler_type& scaler() noexcept { return scaler_; }
  //! The bucket hook (e.g. Deterministic's report() and exponents()).
  hook_type& hook() noexcept { return hook_; }
  const sync_stats& stats() const noexcept { return recorder_.stats(); }
  Comm& comm() noexcept { return comm_; }
  Model& model() noexcept { return model_; }
  //! Parameters as lockstep sees them (gradients pointing into the arena when zero-copy).
  const std::vector<parameter>& parameters() const noexcept { return reducer_.params(); }
  //! Sharded: this rank's shard of the parameters, one per launch unit (build the optimizer
  //! over these: its state is then 1/N of the model's). Fixed from construction on — but under
  //! ShardedGradients / FullySharded with the model's block_storage, `.grad` exists only from
  //! the cycle's reduce-scatters until the next cycle: read it through finish(on_shard)'s slices.
  const std::vector<parameter>& shard_parameters() const noexcept
    requires sharded
  {
    return reducer_.units().parameters();
  }
  //! Sharded: per shard parameter, which elements of the model's parameters it holds
  //! (checkpoint/sharded.hpp reshards the optimizer state onto another world size with it).
  std::span<const std::vector<detail::shard_segment>> shard_map() const
    requires sharded
  {
    return reducer_.units().map();
  }
  //! ShardedOptimizer::gather_in_forward: before the forward uses parameter i (its units
  //! gathered, unpacked); all of them. Nothing to wait for otherwise.
  void wait_parameters(std::size_t i) { reducer_.units().wait_parameters(i); }
  //! ShardedGradients / FullySharded: block k (model (h)) is used for pass p until the returned
  //! use ends (block_use.hpp): its values, and in backward its gradient buffers, are attached
  //! to the model (model (i)); read the pointers after this call. In a step, use each block once
  //! in forward and once in backward (covering its recomputation), in backward order there.
  [[nodiscard]] block_use<DataParallel> use_block(std::size_t k, pass p)
    requires block_sharded
  {
    if (!open_) settle_abandoned();  // (an evaluation forward after a failed step)
    reducer_.units().use(k, p);
    if (open_) uses_.record(k, p, true);  // in a step (for Join's replay)
    return block_use<DataParallel>(this, k, p);
  }
  //! Every parameter's values current and in place (FullySharded: the whole model gathered and
  //! attached until the next step; parameters() then points at it).
  void wait_all_parameters() {
    settle_abandoned();
    reducer_.units().wait_all_parameters();
    if constexpr (block_sharded) reducer_.refresh_params();
  }
  //! After values were written into parameters() from outside (restore_training_state does it):
  //! FullySharded takes them into its shards, ShardedOptimizer's gather_wire into its masters.
  void values_written() {
    if constexpr (requires { reducer_.units().values_written(); }) reducer_.units().values_written();
  }
  //! Sharded: a fingerprint of the shard layout (see save_sharded / load_sharded).
  std::uint64_t shard_layout() const
    requires sharded
  {
    return reducer_.units().layout_hash(reducer_.order_fingerprint());
  }
  //! The settled gradient layout, for checkpoints (see training_state.hpp).
  std::vector<std::int64_t> plan_state() const { return reducer_.plan_state(); }
  //! Restores a layout saved by plan_state(); call on every rank before the next step.
  void load_plan_state(std::span<const std::int64_t> st) { reducer_.load_plan_state(st); }
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

 private:
  // The step's events around finish_inner (step_recorder: NVTX, trace, model time).
  step_result finish_step(bool sync, const std::function<void(std::span<const param_slice>)>& on_bucket) {
    if (block_sharded && abandoned_)
      throw config_error("lockstep: finish() on a step an exception abandoned (a block's use ended by it): its "
                         "gradients are incomplete; drop the step and begin the next with dp.step()");
    recorder_.model_end(sync);
    step_result r;
    {
      const auto s = recorder_.record(detail::step_event::finish);
      r = finish_inner(sync, on_bucket);
    }
    if (sync) uses_.commit();  // block_sharded: what a rank out of data replays (Join)
    recorder_.step_end(r.synced && !r.applied);
    return r;
  }

  step_result finish_inner(bool sync, const std::function<void(std::span<const param_slice>)>& on_bucket) {
    open_ = false;
    if constexpr (sharded) {
      if (sync && !on_bucket)
        throw config_error("lockstep: with a sharded strategy (ShardedOptimizer, ShardedGradients, FullySharded), "
                           "end a synchronising step with "
                           "finish(on_shard), the optimizer stepping each shard: "
                           "step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); }) "
                           "(finish() alone would leave the parameters without their update)");
    }
    step_result r;
    r.synced = sync;
    ++micro_;
    if (!sync) {
      reducer_.end_micro();  // full sharding: this micro-step's reduce-scatters completed
      return r;
    }
    in_cycle_ = false;
    bool whole = opts_.max_grad_norm > 0 || detail::fixed_point_hook_v<hook_type>;  // clipping, fixed point
    if constexpr (inspecting_scaler<scaler_type>) whole = whole || scaler_.active();
    else whole = true;
    if (!whole) {
      reducer_.finish(on_bucket);  // per-bucket callbacks overlap the later buckets
      return r;
    }
    // Unscaling, the inf/NaN decision and clipping need every bucket: callbacks come after.
    reducer_.finish(nullptr);
    bool found_inf = false;
    {
      const auto s = recorder_.record(detail::step_event::unscale);
      found_inf = scaler_.unscale_and_check(comm_, reducer_.grad_groups());
    }
    // After a skipped step, who had inf/NaN before averaging (nonfinite.hpp), for the error:
    // armed, the check listens to the next step's launch units.
    origin_.settle(comm_, [&] { return scaler_.state().steps + 1; });  // this step's number
    if (auto* check = origin_.arm_for(scaler_, found_inf, comm_.rank()))
      recorder_.listen_launches(
          [check, this](const detail::unit_launch& u) { check->check(comm_, u.data, u.count, u.type); });
    else recorder_.listen_launches(nullptr);
    origin_.name_in([&] { scaler_.update(found_inf); }, found_inf);
    r.applied = !found_inf;
    if constexpr (device_scaler<scaler_type>) r.device_found_inf = scaler_.device_found_inf();
    if (r.applied && opts_.max_grad_norm > 0) {
      const auto s = recorder_.record(detail::step_event::clip);
      r.grad_norm = clip();
    }
    if (r.applied && on_bucket) reducer_.update(on_bucket);
    return r;
  }

  // DataParallelOptions::max_grad_norm: every rank holds the same averaged gradients (the
  // norm needs no communication), or, sharded, its shard (the squares are summed over ranks).
  double clip() {
    if constexpr (has_grad_ops<memory_of_t<Comm>>) {
      const auto groups = reducer_.grad_groups();
      if constexpr (sharded) return clip_grad_norm_sharded(comm_, groups, opts_.max_grad_norm);
      else return clip_grad_norm(comm_.memory(), groups, opts_.max_grad_norm);
    } else {
      throw config_error("lockstep: DataParallelOptions::max_grad_norm needs lockstep::grad_ops for this "
                         "communicator's memory space (see docs/communicator.md)");
    }
  }

  // The buffers (model (c)) from one rank to all, at the start of an accumulation cycle
  // (broadcast_buffers). Outside a Join scope from rank 0. Inside one, from the highest rank
  // still stepping (one small all-reduce first: rank 0 may have run out of data, its
  // statistics stale), as DDP's join does; a cycle no rank steps broadcasts nothing. stepping:
  // this rank contributes data to the cycle (false for a rank shadowing the others).
  void sync_buffers(bool stepping) {
    if (comm_.size() == 1 || buffers_.empty()) return;  // the same on every rank: checked at construction
    int root = 0;
    if (joining_) {
      stepped_ = stepping;
      root = Join<DataParallel>::common_rank(*this, stepping);
    }
    if (root >= 0) broadcast_buffers_(comm_, buffers_, root);
  }

  // --- Join (join.hpp): its agreement and shadow steps work on these members ------------
  friend class Join<DataParallel>;
  friend class lockstep::step_handle<DataParallel>;  // marks gradients ready, ends the step
  friend class lockstep::block_use<DataParallel>;    // ends a block's use

  // Each micro-step's share of its cycle's mean (the gradient is prescaled before it is summed).
  double usual_prescale() const { return opts_.average_over_accumulation ? 1.0 / k_ : 1.0; }
  // A micro-step, or a block's use, ended by an exception (step_handle, block_use): nothing
  // more this step — no collective on this rank alone. settle_abandoned (before anything else
  // uses the blocks) releases those it left in use, drops the reduce-scatters it issued and
  // restarts its cycle; uses from before end with nothing to do (epoch).
  void abandon() noexcept {
    open_ = false;
    if constexpr (block_sharded) abandoned_ = true;
  }
  void settle_abandoned() {
    if constexpr (block_sharded) {
      if (!abandoned_) return;
      ++epoch_;
      reducer_.units().abandon();
      abandoned_ = false;
      in_cycle_ = false;
    }
  }
  // A block's use ends: after a backward one its gradients are final (the reducer launches
  // what became complete), then the units detach it.
  void end_block(std::size_t k, pass p) {
    if constexpr (block_sharded) {
      if (p == pass::backward) reducer_.mark_all_ready(reducer_.units().params_of(k));
      reducer_.units().end_use(k, p);
      if (open_) uses_.record(k, p, false);
    }
  }

  struct built_t {};
  static constexpr built_t built{};
  DataParallel(built_t, Comm& comm, Model& model, const DataParallelOptions& opts, accumulation_type acc,
               scaler_type scaler, hook_type hook, const strategy_type& strategy)
      : comm_(comm), model_(model), opts_(opts), acc_(std::move(acc)), scaler_(std::move(scaler)),
        hook_(std::move(hook)), recorder_(comm.rank()),
        reducer_(
            comm, hook_, recorder_, detail::initial_parameters(comm, model, opts.broadcast_parameters), opts.buckets,
            detail::gradient_binder(model, opts), [&model] { return detail::collect_parameters(model); }, strategy,
            detail::hooks_of(model, detail::value_binder(model, opts, strategy))),
        buffers_(detail::collect_buffers(model)), frozen_(detail::collect_frozen(model)) {
    if (!(opts_.max_grad_norm >= 0))
      throw config_error("DataParallelOptions::max_grad_norm must be >= 0 (0: no clipping), got " +
                         std::to_string(opts_.max_grad_norm));
    // Checked whenever the model's type has them (not by this rank's count: a rank without
    // any would skip the collective its peers issue). Frozen (model (g)): never reduced.
    detail::share_extras(comm_, frozen_model<Model>, frozen_, buffer_model<Model>, buffers_, opts.broadcast_parameters,
                         broadcast_buffers_);
    // A device-side scaler's state must exist before the first loss kernel reads it.
    if constexpr (attachable_scaler<scaler_type, Comm>) scaler_.attach(comm_);
  }

  Comm& comm_;
  Model& model_;
  DataParallelOptions opts_;
  accumulation_type acc_;
  scaler_type scaler_;
  hook_type hook_;
  detail::step_recorder recorder_;  // the step's events: NVTX, LOCKSTEP_TRACE, sync_stats
  detail::reducer<Comm, hook_type, units_type> reducer_;
  std::vector<parameter> buffers_;                       // the model's buffers (model (c)), empty without
  std::vector<parameter> frozen_;                        // its frozen parameters (model (g)), empty without
  detail::coalesced_broadcast<Comm> broadcast_buffers_;  // buffers: one broadcast per element type
  int k_ = 1;
  int micro_ = 0;
  bool in_cycle_ = false;
  bool open_ = false;
  bool abandoned_ = false;          // block_sharded: an exception left a micro-step (abandon())
  std::uint64_t epoch_ = 0;         // block_sharded: abandoned micro-steps cleaned up (block_use ignores older uses)
  detail::use_log uses_;            // block_sharded: the block uses of the micro-step
  bool joining_ = false;            // a Join scope is open on this rank
  bool stepped_ = false;            // in it: this rank contributed to the latest cycle (sync_buffers)
  int join_active_ = 0;             // contributing ranks at the latest agreement
  int join_steps_ = 1;              // the accumulation's K when the scope opened
  std::shared_ptr<void> join_buf_;  // the agreement's buffer, in comm's memory space
  detail::nonfinite_origin<Comm> origin_;  // after a skip: whose gradients were non-finite
};

}  // namespace lockstep
