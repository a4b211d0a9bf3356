#pragma once
//! The gradient reducer shared by every strategy: per element type one contiguous arena
//! in bucket order; buckets are averaged as soon as their last gradient is final,
//! strictly in plan order (so every rank issues the same collectives in the same order);
//! the plan is rebuilt once from rank 0's observed arrival order (unless the strategy fixes
//! the layout). What a launch unit's collective is, and what finish() does with the results,
//! is the strategy's: the reduction units `Units` (allreduce_units.hpp, shard_units.hpp),
//! chosen at compile time from DataParallel's policies. Events go to the step_recorder.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/parallel/bucket_hook.hpp"
#include "lockstep/parallel/detail/fixed_point_folds.hpp"
#include "lockstep/parallel/detail/binding.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/bucket_tuner.hpp"
#include "lockstep/parallel/detail/step_recorder.hpp"
#include "lockstep/parallel/policies.hpp"
#include "lockstep/parallel/step.hpp"

namespace lockstep::detail {

template <class Comm, class Hook, class Units>
class reducer {
 public:
  using step_fn = std::function<void(std::span<const param_slice>)>;
  //! bind(i, ptr): give parameter i arena storage for its gradient; refresh(): re-read the
  //! model's parameters (pointers after binding). bind is called once per parameter, when
  //! the layout is final: at construction if it is known then (no rebuild after the first
  //! step), else when the rebuild from the first step's arrival order (or a layout loaded
  //! from a checkpoint) takes effect — until then the gradients stay in the model's own
  //! buffers and buckets are packed. So storage a model or optimizer caches from bind never
  //! goes stale. (binding.hpp)
  using refresh_fn = std::function<std::vector<parameter>()>;

  //! units: the strategy's reduction units, built over the same communicator, hook and
  //! recorder, with what they may use of the model. With Units::fixed_layout,
  //! policy.rebuild_after_first_step is ignored; with Units::lends_gradients, bind is never used.
  template <class Strategy>
  reducer(Comm& comm, Hook& hook, step_recorder& rec, std::vector<parameter> params, BucketPolicy policy, bind_fn bind,
          refresh_fn refresh, const Strategy& strategy, const model_hooks& model)
      : comm_(comm), hook_(hook), rec_(rec), params_(std::move(params)), policy_(policy),
        bind_(Units::lends_gradients ? bind_fn{} : std::move(bind)), refresh_(std::move(refresh)),
        units_(comm, hook, rec, strategy, model) {
    if constexpr (Units::fixed_layout) policy_.rebuild_after_first_step = false;
    bucket_tuner<Comm>::check(policy_);
    if constexpr (!Units::lends_gradients) check_gradient_storage(params_);
    // Initial order: reverse registration order (backward produces the last layer first).
    std::vector<std::size_t> order;
    for (std::size_t i = params_.size(); i-- > 0;) order.push_back(i);
    build(order, bind_ && !policy_.rebuild_after_first_step);
  }

  const std::vector<parameter>& params() const { return params_; }
  //! Re-reads the model's parameters (with lent storage, where they are now).
  void refresh_params() { params_ = refresh_(); }
  //! The strategy's units (what only it offers: shards, their map, their layout).
  Units& units() noexcept { return units_; }
  const Units& units() const noexcept { return units_; }

  //! Applies a pending plan rebuild (a collective: the new plan is checked across ranks).
  //! Every rank does it at the same point: the start of its next accumulation cycle — or,
  //! for a rank shadowing others in a Join scope (join.hpp), before its next agreement.
  void apply_pending_plan() {
    if (!pending_order_) return;
    auto o = std::move(*pending_order_);
    pending_order_.reset();
    build(o, bind_ && !tuner_.due(policy_, comm_.size(), fused_));  // bound once: in the tuned layout
    rec_.stats().rebuilt = true;
  }

  //! Start of an accumulation cycle: apply a pending rebuild, zero every gradient.
  void begin_cycle() {
    apply_pending_plan();
    if constexpr (fixed_point) hook_.begin_cycle(comm_);
    if constexpr (Units::lends_gradients) return units_.begin_cycle();
    auto mem = comm_.memory();
    for (auto& g : groups_) {
      if (zero_copy()) {
        mem.zero(g.arena.get(), g.plan.total * size_of(g.plan.type));
      } else {
        for (auto i : g.plan.order) mem.zero(params_[i].grad, params_[i].bytes());
      }
    }
  }

  //! Start of a micro-step. sync: this micro-step averages; prescale: applied before the
  //! all-reduce's average over ranks (1/K for accumulation, else 1).
  //! With Units::lends_gradients every micro-step launches its units (the full gradients do
  //! not outlive it); end_micro() then ends one that does not sync.
  void begin_micro(bool sync, double prescale) {
    sync_ = sync;
    launching_ = sync || Units::lends_gradients;
    prescale_ = prescale;
    ready_.assign(params_.size(), false);
    if (!launching_) return;
    if (sync) tuner_.begin_sync(comm_, policy_, fused_);
    if (sync) sync_arrivals_.clear();
    for (auto& g : groups_) {
      g.pending.clear();
      for (auto& b : g.plan.buckets) g.pending.push_back(b.slices.size());
      g.next = 0;
    }
    units_.begin_sync();
  }

  //! Parameter i's gradient is final for this micro-step.
  void mark_ready(std::size_t i) {
    if (i >= params_.size())
      throw config_error("gradient-ready hook called with parameter index " + std::to_string(i) +
                         ", but the model has " + std::to_string(params_.size()) + " parameters");
    if (ready_[i])
      throw config_error("parameter " + std::to_string(i) + " ('" + params_[i].name +
                         "') was reported ready twice in one step; report each gradient once, "
                         "when it is final");
    units_.check_reported(i, params_[i].name);
    ready_[i] = true;
    if (!observed_) arrivals_.push_back(i);
    if (sync_) sync_arrivals_.push_back(i);
    if (sync_ && tuner_.on()) tuner_.mark(comm_, i);  // BucketPolicy::tune: when it was ready
    count_ready(i);
  }

  //! The gradients of `params` are final (a block's backward use ended): those not reported
  //! yet — first in the order the last synchronising micro-step reported them, so that a
  //! Join replay launches the units of several element types in the stepping ranks' order.
  void mark_all_ready(std::span<const std::size_t> params) {
    for (auto i : last_sync_arrivals_)
      if (!ready_.at(i) && std::find(params.begin(), params.end(), i) != params.end()) mark_ready(i);
    for (auto i : params)
      if (!ready_.at(i)) mark_ready(i);
  }

  //! End of a micro-step that does not sync: with Units::lends_gradients, every unit launched
  //! and its result kept by the units (drain); fixed point, its gradients folded and zeroed.
  void end_micro() {
    if constexpr (fixed_point)
      for (auto& g : groups_)
        fold_micro_step(hook_, comm_, g.plan, g.arena.get(), params_, zero_copy(), contributions());
    if constexpr (Units::lends_gradients) {
      for (auto& g : groups_) launch_ready(g, true);
      units_.drain();
      point_grad_groups();
    }
  }

  //! Join (join.hpp): a rank without data shadows a syncing micro-step, reporting its (zero)
  //! gradients in the order its last real syncing step saw them — else, once settled, the
  //! plan's (rank 0's arrivals) — so it launches the same units in the same order as the
  //! ranks whose backward reports them (with several element types, the interleaving of the
  //! types' launches follows that order). Nothing is recorded as an observation.
  void replay_arrivals() {
    const std::vector<std::size_t>* order = nullptr;
    if (!last_sync_arrivals_.empty()) order = &last_sync_arrivals_;
    else if (observed_ && !fused_) order = &current_order_;
    if (!order) return;  // first step: finish() launches every unit, as a silent model's ranks do
    for (auto i : *order) {
      if (ready_[i]) continue;
      ready_[i] = true;
      count_ready(i);
    }
  }

  //! End of a syncing micro-step: reduce what is left, wait for everything (the units' finish).
  //! on_bucket (optional) sees the averaged result as it comes: replicated, each bucket's
  //! parameter slices once it is averaged (unpacked first when packed); sharded, each unit's
  //! shard, stepped and then gathered into the parameters. Without on_bucket, call update()
  //! once the gradients are checked.
  void finish(const step_fn& on_bucket) {
    for (auto& g : groups_) launch_ready(g, true);
    units_.finish(on_bucket, [&](std::size_t gi, std::size_t b) {
      const auto& g = groups_[gi];
      const auto& bk = g.plan.buckets[b];
      if (!zero_copy() && !bk.slices.empty())
        comm_.memory().unpack(g.arena_at(bk.begin), bk.segments_in(params_), g.plan.type);
      if (on_bucket) hand_over(on_bucket, gi, b);
    });
    if constexpr (Units::lends_gradients) point_grad_groups();
    if constexpr (fixed_point) hook_.end_step(comm_, grad_groups());
    end_sync();
  }

  //! After finish(nullptr) and the checks: fn (the optimizer) gets every bucket (sharded:
  //! every shard, which is then gathered).
  void update(const step_fn& fn) {
    units_.update(fn, [&](std::size_t gi, std::size_t b) { hand_over(fn, gi, b); });
  }

  //! Whether the model's gradients live in the arena now (after the binding, see bind_fn).
  bool zero_copy() const { return bound_; }

  //! A fingerprint of the gradient order, for the units' layout hash.
  std::uint64_t order_fingerprint() const { return order_hash(current_order_); }

  //! The settled layout, for checkpoints: {format 1, observed, fused, n, order...}.
  //! Restoring it makes a resumed run reduce with the same layout (and so, on NCCL, the
  //! same rounding) as the uninterrupted run from its first step on.
  std::vector<std::int64_t> plan_state() const {
    return encode_plan_state(
        {observed_, fused_, pending_order_ ? *pending_order_ : current_order_, rec_.stats().tuned_cap_bytes});
  }

  //! Adopts a layout saved by plan_state() (same on every rank: it comes from one file);
  //! takes effect at the start of the next accumulation cycle.
  void load_plan_state(std::span<const std::int64_t> st) {
    auto saved = decode_plan_state(st, params_.size());
    if (Units::fixed_layout && saved.order != current_order_)
      throw checkpoint_error("the saved gradient bucket layout differs from this sharded run's (a sharded "
                             "optimizer's layout is fixed at construction: the checkpoint was saved with "
                             "another model or without ShardedOptimizer)");
    observed_ = saved.observed;
    fused_ = saved.fused;
    arrivals_.clear();
    tuner_.stop(saved.tuned_cap != 0);
    const bool recut = adopt_tuned_cap(saved.tuned_cap, policy_, rec_.stats());  // the same rounding on resume
    if (saved.order != current_order_ || binding_due() || recut) pending_order_ = std::move(saved.order);
    else pending_order_.reset();
  }

  //! Every gradient, grouped by element type (for unscaling, clipping, norms) — sharded: this
  //! rank's shards only. Built with the plan, so a step reads it without allocating; valid
  //! until the plan is rebuilt (Units::lends_gradients: until the next cycle begins; re-read
  //! after each drain).
  std::span<const grad_group> grad_groups() const { return grad_groups_; }

 private:
  struct group {
    bucket_plan plan;
    std::shared_ptr<void> arena;
    std::vector<std::size_t> pending;
    std::size_t next = 0;
    std::vector<segment> grads;  // what this rank unscales, checks and clips (the units' choice)
    void* arena_at(std::size_t elem) const { return static_cast<char*>(arena.get()) + elem * size_of(plan.type); }
  };

  void end_sync() {
    ++rec_.stats().syncs;
    tuner_.end_sync();
    if (!sync_arrivals_.empty()) last_sync_arrivals_.swap(sync_arrivals_);  // for replay_arrivals
    const bool settling = !observed_;
    if (settling) {
      settle_order();
    } else if (tuner_.on() && (tune(current_order_) || binding_due())) {
      pending_order_ = current_order_;  // the tuned cap, and the gradients bound into the arena
    }
    // The units the hook saw are gone from here on (a rebuild is due, or one fused all-reduce
    // follows): its state for them too, before a checkpoint could save it with the new layout.
    if (pending_order_ || (settling && fused_)) hook_layout_changed(hook_);
  }

  // The timed step is over: the cap for the arena laid out in `order`; whether it changed.
  bool tune(const std::vector<std::size_t>& order) {
    return tuner_.settle(
        comm_, order, params_, policy_,
        [&](dtype t, auto idx, auto p) {
          return units_.make_plan(t, idx, sizes_of(params_), p, static_cast<bool>(bind_));
        },
        rec_.stats());
  }

  // Hands bucket b of group gi to fn (the optimizer).
  void hand_over(const step_fn& fn, std::size_t gi, std::size_t b) {
    const auto s = rec_.record(step_event::callback, static_cast<std::int64_t>(b));
    fn(groups_[gi].plan.buckets[b].slices_in(params_, slices_));
  }

  // Parameter i's gradient is final: on a syncing micro-step, launch what became complete.
  void count_ready(std::size_t i) {
    if (!launching_ || fused_) return;
    const gradient_locator at = where_[i];
    auto& g = groups_[at.group];
    for (auto b : g.plan.buckets_of[at.position]) --g.pending[b];
    launch_ready(g, false);
  }

  // Launch units strictly in plan order while the next one is complete, so every rank
  // issues the same collectives in the same order. At the end (all = true) the rest go out
  // unit by unit — or, once every rank agreed the model reports no gradient (fused_), as one
  // all-reduce over the remaining arena, which runs at the flat all-reduce's bandwidth.
  void launch_ready(group& g, bool all) {
    const auto complete = [&](std::size_t u) {
      for (std::size_t b = g.plan.units[u].first; b < g.plan.units[u].last; ++b)
        if (g.pending[b] != 0) return false;
      return true;
    };
    if (all && fused_ && !Units::fixed_layout && g.next < g.plan.units.size()) {
      launch_range(g, g.plan.units[g.next].first, g.plan.buckets.size());
      g.next = g.plan.units.size();
      return;
    }
    while (g.next < g.plan.units.size() && (all || complete(g.next))) {
      launch_range(g, g.plan.units[g.next].first, g.plan.units[g.next].last);
      ++g.next;
    }
  }

  // Buckets [first, last) are contiguous in the arena: scale or pack them, one all-reduce.
  void launch_range(group& g, std::size_t first, std::size_t last) {
    const std::size_t begin = g.plan.buckets[first].begin, end = g.plan.buckets[last - 1].end;
    const auto gi = static_cast<std::size_t>(&g - groups_.data());
    void* buf = nullptr;
    if constexpr (Units::lends_gradients) buf = units_.lend(gi, first);
    else buf = g.arena_at(begin);
    auto mem = comm_.memory();
    const double prescale = fixed_point ? 1.0 : prescale_;  // (fixed point: divided once, at the end)
    if (zero_copy() || Units::lends_gradients) {
      mem.scale(buf, end - begin, g.plan.type, prescale);
    } else {
      mem.pack(segments_of(g.plan.buckets, first, last, params_), buf, g.plan.type, prescale);
    }
    rec_.launching(buf, end - begin, g.plan.type);  // listeners: the non-finite origin check
    if constexpr (fixed_point) fold_unit(hook_, comm_, g.plan, g.arena.get(), first, last, contributions());
    units_.launch(gi, first, buf, end - begin);
  }

  // After the first syncing step: take rank 0's arrival order (unreported parameters
  // after it, in reverse registration order) so every rank rebuilds identically.
  void settle_order() {
    observed_ = true;
    // If no rank reported any gradient during the first step, the model cannot report:
    // from now on every rank reduces everything in finish() as one all-reduce per type.
    std::vector<std::int64_t> reported{arrivals_.empty() ? 0 : 1};
    if (comm_.size() > 1) host_all_reduce(comm_, std::span<std::int64_t>(reported), reduce_op::max);
    fused_ = reported[0] == 0;
    if (!policy_.rebuild_after_first_step || fused_) {
      tuner_.stop();
      arrivals_.clear();
      if (binding_due()) pending_order_ = current_order_;  // the layout is final: bind now
      return;
    }
    std::vector<std::int64_t> order = observed_order(arrivals_, params_.size());
    if (comm_.size() > 1) host_broadcast(comm_, order, 0);
    std::vector<std::size_t> o(order.begin(), order.end());
    const bool recut = tuner_.on() && tune(o);  // BucketPolicy::tune_step 1
    if (o != current_order_ || binding_due() || recut) pending_order_ = std::move(o);
    arrivals_.clear();
  }

  // The model lends its gradients but they are not in the arena yet.
  bool binding_due() const { return bind_ && !bound_; }

  // Lays out the arena in `order`; with bind, the model's gradients move into it (once).
  void build(const std::vector<std::size_t>& order, bool bind) {
    current_order_ = order;
    bound_ = bind;
    std::map<dtype, std::vector<std::size_t>> by_type;
    for (auto i : order) by_type[params_[i].type].push_back(i);
    const std::vector<std::size_t> sizes = sizes_of(params_);
    groups_.clear();
    where_.assign(params_.size(), gradient_locator{});
    auto& st = rec_.stats();
    st.bucket_count = 0;
    st.arena_bytes = 0;
    for (auto& [t, idx] : by_type) {
      group g;
      g.plan = units_.make_plan(t, idx, sizes, policy_, zero_copy());
      const std::size_t bytes = g.plan.total * size_of(t);
      if constexpr (!Units::lends_gradients) g.arena = units_.allocate(bytes, t, policy_);
      st.bucket_count += g.plan.buckets.size();
      st.arena_bytes += Units::lends_gradients ? 0 : bytes;
      groups_.push_back(std::move(g));
    }
    for (std::size_t gi = 0; gi < groups_.size(); ++gi)
      for (std::size_t k = 0; k < groups_[gi].plan.order.size(); ++k)
        where_[groups_[gi].plan.order[k]] = gradient_locator{gi, k};
    if (zero_copy()) {
      std::vector<binding> given;
      for (auto& g : groups_)
        for (std::size_t k = 0; k < g.plan.order.size(); ++k) {
          given.emplace_back(g.plan.order[k], g.arena_at(g.plan.offset[k]));
          bind_(given.back().first, given.back().second);
        }
      params_ = checked_binding(refresh_(), given, &parameter::grad, "bind_gradient");
    }
    st.zero_copy = zero_copy();
    std::vector<const bucket_plan*> plans;
    std::vector<void*> arenas;
    for (auto& g : groups_) {
      plans.push_back(&g.plan);
      arenas.push_back(g.arena.get());
    }
    const auto moved = units_.built(plans, arenas, params_);
    if constexpr (fixed_point) attach_arenas(hook_, comm_, plans, arenas, params_.size());
    hook_layout_changed(hook_);
    if (!moved.empty() || Units::lends_gradients)  // the model's values moved into the units' storage
      params_ = checked_binding(refresh_(), moved, &parameter::value, "bind_value");
    point_grad_groups();
    check_same_plans(comm_, plans, policy_.tune);
  }
  // grad_groups() from the units' gradients as they are now (with Units::lends_gradients the
  // shards of a cycle come with its reduce-scatters: again after each drain).
  void point_grad_groups() {
    grad_groups_.clear();
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      auto& g = groups_[gi];
      g.grads = units_.grads(gi, g.plan, params_);
      grad_groups_.push_back({g.plan.type, g.grads});
    }
  }

  // The hook sums in fixed point (Deterministic): micro-steps folded, no prescale (N·K divides).
  static constexpr bool fixed_point = sums_in_fixed_point<Hook, Units::lends_gradients>();
  std::int64_t contributions() const { return std::llround(comm_.size() / prescale_); }

  Comm& comm_;
  Hook& hook_;
  step_recorder& rec_;
  std::vector<parameter> params_;
  BucketPolicy policy_;
  bind_fn bind_;
  refresh_fn refresh_;
  std::vector<group> groups_;
  std::vector<grad_group> grad_groups_;  // views of groups_[k].grads
  std::vector<gradient_locator> where_;  // by parameter index
  std::vector<std::size_t> current_order_;
  std::optional<std::vector<std::size_t>> pending_order_;
  std::vector<std::size_t> arrivals_;
  std::vector<std::size_t> sync_arrivals_;       // this syncing micro-step's reports, in order
  std::vector<std::size_t> last_sync_arrivals_;  // the last real syncing micro-step's
  std::vector<bool> ready_;
  bool observed_ = false;
  bool fused_ = false;
  bucket_tuner<Comm> tuner_;         // BucketPolicy::tune
  bool bound_ = false;               // the model's gradients live in the arena
  Units units_;                      // the strategy: the units' collectives and what finish() does with them
  std::vector<param_slice> slices_;  // hand_over's scratch
  bool sync_ = false;
  bool launching_ = false;  // this micro-step launches units (it syncs, or the units lend gradients)
  double prescale_ = 1.0;
};

}  // namespace lockstep::detail
