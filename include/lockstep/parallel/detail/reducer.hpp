#pragma once
//! The gradient reducer shared by every strategy: per element type one contiguous arena
//! in bucket order; buckets are averaged as soon as their last gradient is final,
//! strictly in plan order (so every rank issues the same collectives in the same order);
//! the plan is rebuilt once from rank 0's observed arrival order.
//! Sharded (ShardedOptimizer): units are reduce-scattered and the optimizer's shards gathered
//! back into the parameters (shards.hpp).

#include <chrono>
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
#include "lockstep/parallel/detail/binding.hpp"
#include "lockstep/parallel/bucket_hook.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/nonfinite.hpp"
#include "lockstep/parallel/policies.hpp"
#include "lockstep/parallel/detail/shard_units.hpp"
#include "lockstep/observe/detail/trace.hpp"
#include "lockstep/parallel/step.hpp"

namespace lockstep {

namespace detail {

template <class Comm, class Hook = AllReduceMean>
class reducer {
 public:
  using work_type = decltype(std::declval<Hook&>().reduce(std::declval<Comm&>(), nullptr, std::size_t{}, dtype::f32));
  //! bind(i, ptr): give parameter i arena storage for its gradient; refresh(): re-read the
  //! model's parameters (pointers after binding). bind is called once per parameter, when
  //! the layout is final: at construction if it is known then (no rebuild after the first
  //! step), else when the rebuild from the first step's arrival order (or a layout loaded
  //! from a checkpoint) takes effect — until then the gradients stay in the model's own
  //! buffers and buckets are packed. So storage a model or optimizer caches from bind never
  //! goes stale. (binding.hpp)
  using refresh_fn = std::function<std::vector<parameter>()>;

  //! sharded: reduce-scatter instead of all-reduce (see the file comment); the layout is then
  //! fixed at construction (policy.rebuild_after_first_step is ignored). shard_opts (sharded):
  //! the values' binder (model (e)) and where the all-gathers run (shards.hpp).
  reducer(Comm& comm, Hook& hook, std::vector<parameter> params, BucketPolicy policy, bind_fn bind,
          refresh_fn refresh, bool sharded = false, shard_options shard_opts = {})
      : comm_(comm), hook_(hook), params_(std::move(params)), policy_(policy), bind_(std::move(bind)),
        refresh_(std::move(refresh)), sharded_(sharded), shards_(comm, std::move(shard_opts)) {
    if (sharded_) policy_.rebuild_after_first_step = false;
    // Initial order: reverse registration order (backward produces the last layer first).
    std::vector<std::size_t> order;
    for (std::size_t i = params_.size(); i-- > 0;) order.push_back(i);
    build(order, bind_ && !policy_.rebuild_after_first_step);
  }

  const std::vector<parameter>& params() const { return params_; }
  const sync_stats& stats() const { return stats_; }
  sync_stats& stats() { return stats_; }

  //! Applies a pending plan rebuild (a collective: the new plan is checked across ranks).
  //! Every rank does it at the same point: the start of its next accumulation cycle — or,
  //! for a rank shadowing others in a Join scope (join.hpp), before its next agreement.
  void apply_pending_plan() {
    if (!pending_order_) return;
    auto o = std::move(*pending_order_);
    pending_order_.reset();
    build(o, static_cast<bool>(bind_));
    stats_.rebuilt = true;
  }

  //! Start of an accumulation cycle: apply a pending rebuild, zero every gradient.
  void begin_cycle() {
    apply_pending_plan();
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
  void begin_micro(bool sync, double prescale) {
    sync_ = sync;
    prescale_ = prescale;
    ready_.assign(params_.size(), false);
    if (!sync) return;
    sync_arrivals_.clear();
    for (auto& g : groups_) {
      g.pending.clear();
      for (auto& b : g.plan.buckets) g.pending.push_back(b.slices.size());
      g.next = 0;
      g.works.clear();
      g.works.resize(g.plan.buckets.size());
      if (trace_) g.issued.assign(g.plan.buckets.size(), {});
    }
    if (sharded_) shards_.begin();
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
    if (sharded_ && shards_.deferred() && shards_.pending(i))
      throw config_error("parameter " + std::to_string(i) + " ('" + params_[i].name + "') got a gradient, but its values "
                         "were not waited for in this forward (gather_in_forward): call dp.wait_parameters(i) first");
    ready_[i] = true;
    if (!observed_) arrivals_.push_back(i);
    if (sync_) sync_arrivals_.push_back(i);
    count_ready(i);
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

  //! End of a syncing micro-step: reduce what is left, wait for everything, unpack.
  //! on_bucket (optional) sees each bucket's parameter slices once it is averaged.
  //! Sharded: on_bucket (the optimizer) steps each unit's shard, then the unit is gathered
  //! into the parameters (shards.hpp); without on_bucket, call update_shards() next.
  void finish(const std::function<void(std::span<const param_slice>)>& on_bucket) {
    for (auto& g : groups_) launch_ready(g, true);
    if (sharded_) {
      shards_.finish(on_bucket, stats_.comm_seconds);
      end_sync();
      return;
    }
    std::vector<param_slice> slices;
    for (auto& g : groups_) {
      for (std::size_t b = 0; b < g.plan.buckets.size(); ++b) {
        const auto& bk = g.plan.buckets[b];
        if (g.works[b]) {
          auto t0 = std::chrono::steady_clock::now();
          const nvtx_range nvtx("wait for bucket", static_cast<std::int64_t>(b));
          g.works[b]->wait();
          stats_.comm_seconds += seconds_since(t0);
          if (trace_) trace_collective(g, b, t0);
        }
        if (!zero_copy() && !bk.slices.empty()) {
          auto segs = bk.segments_in(params_);
          comm_.memory().unpack(g.arena_at(bk.begin), segs, g.plan.type);
        }
        if (on_bucket) hand_over(on_bucket, bk, b, slices);
      }
      g.works.clear();
    }
    end_sync();
  }

  //! Sharded, after finish(nullptr): fn (the optimizer) steps each shard; all are gathered.
  void update_shards(const std::function<void(std::span<const param_slice>)>& fn) { shards_.update_all(fn, stats_.comm_seconds); }

  void wait_parameters(std::size_t i) { if (sharded_) shards_.wait_parameters(i, stats_.comm_seconds); }  // shards.hpp
  void wait_all_parameters() { shards_.complete_all(); }
  void set_gather_in_forward(bool on) {
    if (on && !sharded_)
      throw config_error("DataParallelOptions::gather_in_forward needs ShardedOptimizer (it defers the shards' all-gather)");
    shards_.set_deferred(on);
  }

  //! Sharded: this rank's shard of every launch unit as a parameter (value in the value
  //! arena, gradient in the gradient arena), in launch order; slice k handed to the
  //! optimizer names parameter k of this list. Empty when not sharded.
  const std::vector<parameter>& shard_parameters() const noexcept { return shards_.parameters(); }
  std::span<const std::vector<shard_segment>> shard_map() const noexcept { return shards_.map(); }

  //! From the next launch on, check each unit's local gradients for inf/NaN before its
  //! collective (nonfinite.hpp); nullptr stops it.
  void check_local_nonfinite(nonfinite_origin<Comm>* c) noexcept { local_check_ = c; }

  //! LOCKSTEP_TRACE (observe/detail/trace.hpp): record each bucket collective and callback in t.
  void set_trace(trace_log* t) noexcept { trace_ = t; }

  //! Whether the model's gradients live in the arena now (after the binding, see bind_fn).
  bool zero_copy() const { return bound_; }
  //! Sharded: whether the model's values live in the shards' value arena (model (e)).
  bool values_bound() const { return shards_.values_bound(); }

  //! Sharded: a fingerprint of the shard layout (ranks, element types, unit sizes), so that
  //! optimizer state saved from shards is loaded only into the same layout.
  std::uint64_t shard_layout_hash() const { return shards_.layout_hash(order_hash(current_order_)); }

  //! The settled layout, for checkpoints: {format 1, observed, fused, n, order...}.
  //! Restoring it makes a resumed run reduce with the same layout (and so, on NCCL, the
  //! same rounding) as the uninterrupted run from its first step on.
  std::vector<std::int64_t> plan_state() const {
    return encode_plan_state({observed_, fused_, pending_order_ ? *pending_order_ : current_order_});
  }

  //! Adopts a layout saved by plan_state() (same on every rank: it comes from one file);
  //! takes effect at the start of the next accumulation cycle.
  void load_plan_state(std::span<const std::int64_t> st) {
    auto saved = decode_plan_state(st, params_.size());
    if (sharded_ && saved.order != current_order_)
      throw checkpoint_error("the saved gradient bucket layout differs from this sharded run's (a sharded "
                             "optimizer's layout is fixed at construction: the checkpoint was saved with "
                             "another model or without ShardedOptimizer)");
    observed_ = saved.observed;
    fused_ = saved.fused;
    arrivals_.clear();
    if (saved.order != current_order_ || binding_due()) pending_order_ = std::move(saved.order);
    else pending_order_.reset();
  }

  //! Calls fn with each bucket's parameter slices, in plan order.
  void for_each_bucket(const std::function<void(std::span<const param_slice>)>& fn) const {
    std::vector<param_slice> tmp;
    for (const auto& g : groups_)
      for (std::size_t b = 0; b < g.plan.buckets.size(); ++b) hand_over(fn, g.plan.buckets[b], b, tmp);
  }

  //! Every gradient, grouped by element type (for unscaling, clipping, norms) — sharded: this
  //! rank's shards only. Built with the plan, so a step reads it without allocating; valid
  //! until the plan is rebuilt.
  std::span<const grad_group> grad_groups() const { return grad_groups_; }

 private:
  struct group {
    bucket_plan plan;
    std::shared_ptr<void> arena;
    std::vector<std::size_t> pending;
    std::size_t next = 0;
    std::vector<std::optional<work_type>> works;
    std::vector<std::pair<std::chrono::steady_clock::time_point, std::size_t>> issued;  // LOCKSTEP_TRACE: when, how many
    std::vector<segment> grads;  // every gradient of this type, in plan order
    void* arena_at(std::size_t elem) const {
      return static_cast<char*>(arena.get()) + elem * size_of(plan.type);
    }
  };

  // The collective that bucket b starts, from its issue to the end of its wait (begun at t0).
  void trace_collective(const group& g, std::size_t b, std::chrono::steady_clock::time_point t0) {
    const auto end = trace_->now();
    trace_->span("reduce from bucket " + std::to_string(b), trace_log::comm, g.issued[b].first, end,
                 std::to_string(g.issued[b].second * size_of(g.plan.type)) + " bytes " + name_of(g.plan.type));
    trace_->span("wait", trace_log::host, t0, end);
  }

  void end_sync() {
    ++stats_.syncs;
    if (!sync_arrivals_.empty()) last_sync_arrivals_.swap(sync_arrivals_);  // for replay_arrivals
    if (!observed_) settle_order();
  }

  // Hands bucket b's slices to fn (LOCKSTEP_TRACE: timed on the optimizer track).
  void hand_over(const std::function<void(std::span<const param_slice>)>& fn, const bucket& bk, std::size_t b,
                 std::vector<param_slice>& tmp) const {
    const auto t0 = std::chrono::steady_clock::now();
    const nvtx_range nvtx("bucket callback", static_cast<std::int64_t>(b));
    fn(bk.slices_in(params_, tmp));
    if (trace_) trace_->span("bucket " + std::to_string(b) + " callback", trace_log::optimizer, t0, trace_->now());
  }

  // Parameter i's gradient is final: on a syncing micro-step, launch what became complete.
  void count_ready(std::size_t i) {
    if (!sync_ || fused_) return;
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
    if (all && fused_ && !sharded_ && g.next < g.plan.units.size()) {
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
    void* buf = g.arena_at(begin);
    auto mem = comm_.memory();
    if (zero_copy()) {
      mem.scale(buf, end - begin, g.plan.type, prescale_);
    } else {
      std::vector<segment> segs;
      for (std::size_t b = first; b < last; ++b) {
        auto more = g.plan.buckets[b].segments_in(params_);
        segs.insert(segs.end(), more.begin(), more.end());
      }
      mem.pack(segs, buf, g.plan.type, prescale_);
    }
    if (local_check_) local_check_->check(comm_, buf, end - begin, g.plan.type);  // nonfinite.hpp
    if (sharded_) {
      shards_.reduce_scatter(static_cast<std::size_t>(&g - groups_.data()), first, buf, end - begin, stats_.comm_seconds,
                             [&](Comm& c, void* b, void* mine, std::size_t per, dtype t) {
                               return hook_reduce_scatter(hook_, c, b, mine, per, t);
                             });
      ++stats_.buckets_reduced;
      stats_.bytes_reduced += (end - begin) * size_of(g.plan.type);
    } else {
      reduce(g, first, buf, end - begin);
    }
  }

  // The bucket's collective is the hook's (bucket_hook.hpp); the default folds the 1/N of
  // the average into the communicator's reduce_op::avg (no extra pass). Only accumulation's
  // 1/K is a prescale.
  void reduce(group& g, std::size_t slot, void* buf, std::size_t count) {
    if (comm_.size() == 1 || count == 0) return;
    auto t0 = std::chrono::steady_clock::now();
    const nvtx_range nvtx("collective issued", static_cast<std::int64_t>(slot));
    label_next_collective(comm_, [&] { return bucket_label(g.plan, slot, count); });
    g.works[slot].emplace(hook_.reduce(comm_, buf, count, g.plan.type));
    label_next_collective(comm_, [] { return std::string{}; });  // a hook that did not use it
    if (trace_) g.issued[slot] = {t0, count};
    stats_.comm_seconds += seconds_since(t0);
    ++stats_.buckets_reduced;
    stats_.bytes_reduced += count * size_of(g.plan.type);
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
      arrivals_.clear();
      if (binding_due()) pending_order_ = current_order_;  // the layout is final: bind now
      return;
    }
    std::vector<std::int64_t> order;
    std::vector<bool> seen(params_.size(), false);
    for (auto i : arrivals_) {
      if (seen[i]) continue;  // reported again in a later micro-step of the first cycle
      order.push_back(static_cast<std::int64_t>(i));
      seen[i] = true;
    }
    for (std::size_t i = params_.size(); i-- > 0;)
      if (!seen[i]) order.push_back(static_cast<std::int64_t>(i));
    if (comm_.size() > 1) host_broadcast(comm_, order, 0);
    std::vector<std::size_t> o(order.begin(), order.end());
    if (o != current_order_ || binding_due()) pending_order_ = std::move(o);
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
    std::vector<std::size_t> sizes(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) sizes[i] = params_[i].numel();
    auto mem = comm_.memory();
    groups_.clear();
    where_.assign(params_.size(), gradient_locator{});
    stats_.bucket_count = 0;
    stats_.arena_bytes = 0;
    for (auto& [t, idx] : by_type) {
      group g;
      // Zero-copy arenas align each gradient to 256 bytes (vector loads, cuBLAS); packed and
      // sharded arenas stay dense (one pack per bucket fills them; shards cut them evenly).
      const std::size_t align = zero_copy() && !sharded_ ? std::max<std::size_t>(1, 256 / size_of(t)) : 1;
      g.plan = make_bucket_plan(t, idx, sizes, policy_, align,
                                sharded_ ? static_cast<std::size_t>(comm_.size()) : 1);
      const std::size_t bytes = g.plan.total * size_of(t);
      g.arena = sharded_ ? shards_.allocate_gradients(bytes) : mem.allocate(bytes);  // shards: maybe a window
      stats_.bucket_count += g.plan.buckets.size();
      stats_.arena_bytes += bytes;
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
    stats_.zero_copy = zero_copy();
    if (sharded_) {
      std::vector<const bucket_plan*> plans;
      std::vector<void*> arenas;
      for (auto& g : groups_) {
        plans.push_back(&g.plan);
        arenas.push_back(g.arena.get());
      }
      if (shards_.build(plans, arenas, params_))  // the values moved into the shards' arena
        params_ = checked_binding(refresh_(), shards_.value_bindings(), &parameter::value, "bind_value");
      stats_.shard_bytes = shards_.bytes();
      stats_.values_bound = shards_.values_bound();
      stats_.gathers_by_copy_engine = shards_.gathers_by_copy_engine();
      stats_.scatters_by_copy_engine = shards_.scatters_by_copy_engine();
    }
    grad_groups_.clear();
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      auto& g = groups_[gi];
      g.grads.clear();
      if (sharded_) {  // this rank's shards: what it unscales, checks and clips
        const auto mine = shards_.grads(gi);
        g.grads.assign(mine.begin(), mine.end());
      } else {
        for (auto i : g.plan.order)
          if (params_[i].numel()) g.grads.push_back({params_[i].grad, params_[i].numel()});
      }
      grad_groups_.push_back({g.plan.type, g.grads});
    }
    check_same_plan();
  }

  // Every rank must cut the arena identically (same BucketPolicy, same zero-copy choice),
  // or their all-reduces would pair different ranges: compare against rank 0's plan.
  void check_same_plan() {
    if (comm_.size() == 1) return;
    std::string mine;
    for (const auto& g : groups_) mine += describe_plan(g.plan);
    auto all = host_all_gather_strings(comm_, mine);
    for (std::size_t r = 1; r < all.size(); ++r)
      if (all[r] != all[0])
        throw mismatch_error("ranks built different gradient bucket plans: rank 0 has " + all[0] +
                             "rank " + std::to_string(r) + " has " + all[r] +
                             "(give every rank the same BucketPolicy and zero_copy setting)");
  }

  Comm& comm_;
  Hook& hook_;
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
  bool bound_ = false;  // the model's gradients live in the arena
  bool sharded_ = false;
  trace_log* trace_ = nullptr;  // LOCKSTEP_TRACE, else null
  nonfinite_origin<Comm>* local_check_ = nullptr;  // armed after a skipped step
  shard_set<Comm> shards_;  // sharded: the shards, the value arena, their collectives
  bool sync_ = false;
  double prescale_ = 1.0;
  sync_stats stats_;
};

}  // namespace detail
}  // namespace lockstep
