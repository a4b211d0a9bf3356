#pragma once
//! shard_units — ShardedOptimizer's reduction units (ZeRO-1, policies.hpp), the reducer's
//! strategy (the interface: allreduce_units.hpp): per element type and launch unit, this
//! rank's block of the gradient arena (its shard), a value arena of the same layout the
//! optimizer updates the shard in, and the collectives around it — the unit's reduce-scatter
//! (mean, through the bucket hook's hook_reduce_scatter) as soon as backward completes it, and
//! after the optimizer has stepped the shard, the all-gather of the unit's values, unpacked
//! into the model's parameters.
//! The plan must be dense and cut so that every unit's length is a multiple of size().
//! With a value binder (lockstep::model (e)) the model's parameters live in the value arena
//! itself: the optimizer steps them in place and the all-gather lands in them (no pack, no
//! unpack). With copy_engine_gather on a communicator that offers it (NcclComm on NCCL ≥
//! 2.28), the value arena is a symmetric window of a zero-CTA split of the communicator, and
//! the all-gathers run there, on the GPUs' copy engines: they take no SMs from the forward.
//! With copy_engine_scatter, so is the gradient arena (allocate_gradients) and the units'
//! reduce-scatters go to the split too, which does them on the copy engines as well (an
//! all-to-all, then a short sum kernel): they take no SMs from backward.
//! With a low-precision gather_wire (value_wire.hpp), each fp32 unit's shard has an fp32 master
//! of its own (the optimizer's parameter) and the all-gather carries it encoded into the value
//! arena, which holds the replicas; wait_all_parameters() makes them exact (an fp32 gather).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/parallel/bucket_hook.hpp"
#include "lockstep/parallel/detail/binding.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/copy_engine_split.hpp"
#include "lockstep/parallel/detail/step_recorder.hpp"
#include "lockstep/parallel/detail/value_wire.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

template <class Comm, class Hook>
class shard_units {
 public:
  using work_type = decltype(std::declval<Comm&>().all_gather(nullptr, nullptr, std::size_t{}, dtype::f32));
  using step_fn = std::function<void(std::span<const param_slice>)>;
  //! The optimizer's state is laid out along the shards: no rebuild after the first step.
  static constexpr bool fixed_layout = true;
  static constexpr bool lends_gradients = false;

  //! model.bind_value: the model's value binder (model (e)), or empty: values packed and unpacked.
  shard_units(Comm& comm, Hook& hook, step_recorder& rec, const ShardedOptimizer& policy, const model_hooks& model)
      : comm_(comm), hook_(hook), rec_(rec), bind_value_(model.bind_value), wire_(policy.gather_wire),
        deltas_(policy.gather_deltas), engines_(comm, policy.copy_engine_gather, policy.copy_engine_scatter),
        deferred_(policy.gather_in_forward) {}

  //! Sharded arenas stay dense (one pack per bucket fills them; shards cut them evenly): every
  //! unit a multiple of size() elements.
  bucket_plan make_plan(dtype t, std::vector<std::size_t> order, const std::vector<std::size_t>& sizes,
                        const BucketPolicy& policy, bool) const {
    return make_bucket_plan(t, std::move(order), sizes, policy, 1, static_cast<std::size_t>(comm_.size()));
  }

  //! The gradient arena of one group, `bytes` (before built()): with copy_engine_scatter
  //! where offered, a window of the copy-engine split.
  std::shared_ptr<void> allocate(std::size_t bytes, dtype, const BucketPolicy&) {
    return engines_.allocate_gradients(bytes);
  }

  //! Lays out the shards of every group (one per element type, in the reducer's order):
  //! plans[g] cut arena g; params: the model's parameters (values are packed from them).
  //! With a value binder, each parameter moves into the value arena (bind_value(i, storage));
  //! returns those bindings (then re-read the parameters), empty without.
  std::span<const binding> built(std::span<const bucket_plan* const> plans, std::span<void* const> arenas,
                                 const std::vector<parameter>& params) {
    complete_all();                       // a rebuild must not drop values still in flight
    const auto old = std::move(groups_);  // the values a binding copies from stay alive until it has
    groups_.clear();
    staging_ = std::make_unique<wire_staging>();  // keyed by the old arenas' addresses
    rec_.stats().values_exact = true;
    bindings_.clear();
    params_.clear();
    map_.clear();
    slices_.clear();
    units_of_.assign(params.size(), {});
    bytes_ = 0;
    const auto n = static_cast<std::size_t>(comm_.size()), r = static_cast<std::size_t>(comm_.rank());
    const bool packed = !values_bound();  // bound, the values are never packed or unpacked
    if (n > 1 && !wire_agreed_) {         // the gathers' sizes depend on them; every rank checks (fp32 too)
      require_same_settings(comm_, "ShardedOptimizer",
                            {{"gather_wire", static_cast<std::int64_t>(wire_)},
                             {"gather_deltas", wire_ == wire_format::fp32 ? -1 : std::int64_t{deltas_}}});
      wire_agreed_ = true;
    }
    for (std::size_t gi = 0; gi < plans.size(); ++gi) {
      const bucket_plan& plan = *plans[gi];
      const std::size_t es = size_of(plan.type);
      group& g = groups_.emplace_back();
      g.plan = &plan;
      std::tie(g.values, g.by_engine) = engines_.allocate_values(plan.total * es);
      g.wire = wire_ != wire_format::fp32 && plan.type == dtype::f32 && n > 1;
      if (g.wire) {
        std::size_t count = 0;
        for (const auto& unit : plan.units)
          count += (plan.buckets[unit.last - 1].end - plan.buckets[unit.first].begin) / n;
        g.masters = comm_.memory().allocate(count * es);
      }
      std::size_t master_at = 0;
      g.scatter_by_engine = engines_.gradient_window(arenas[gi]);
      g.scatters.resize(plan.buckets.size());
      g.gathers.resize(plan.units.size());
      g.pending.assign(plan.units.size(), 0);
      char* grads = static_cast<char*>(arenas[gi]);
      for (const auto& unit : plan.units) {
        shard sh;
        sh.begin = plan.buckets[unit.first].begin;
        const std::size_t len = plan.buckets[unit.last - 1].end - sh.begin;
        sh.count = len / n;
        const std::size_t lo = sh.begin + r * sh.count, hi = lo + sh.count;
        auto& seg = map_.emplace_back();
        for (std::size_t b = unit.first; b < unit.last; ++b)
          for (const auto& s : plan.buckets[b].slices) {
            auto& of = units_of_[s.param];
            if (of.empty() || of.back() != std::pair{gi, g.shards.size()}) of.emplace_back(gi, g.shards.size());
            char* v = static_cast<char*>(params[s.param].value);
            if (packed) sh.all.push_back({v + s.param_offset * es, s.count});
            const std::size_t a = std::max(lo, s.arena_offset), e = std::min(hi, s.arena_offset + s.count);
            if (a < e) {
              if (packed) sh.mine.push_back({v + (s.param_offset + (a - s.arena_offset)) * es, e - a});
              seg.push_back({s.param, s.param_offset + (a - s.arena_offset), e - a, a - lo});
            }
          }
        sh.index = params_.size();
        void* value = g.values_at(lo);
        if (g.wire) {  // the optimizer steps the master; the value arena holds the replicas
          sh.master = static_cast<float*>(g.masters.get()) + master_at;
          value = sh.master;
          master_at += sh.count;
        }
        void* grad = grads + lo * es;
        params_.push_back(parameter{"shard " + std::to_string(r) + "/" + std::to_string(n) + " of " +
                                        name_of(plan.type) + " elements [" + std::to_string(sh.begin) + ", " +
                                        std::to_string(sh.begin + len) + ")",
                                    {static_cast<std::int64_t>(sh.count)},
                                    plan.type,
                                    value,
                                    grad});
        slices_.push_back({sh.index, 0, sh.count, plan.type, value, grad});
        if (sh.count) g.grads.push_back({grad, sh.count});
        bytes_ += sh.count * es;
        g.shards.push_back(std::move(sh));
      }
      if (bind_value_)
        for (std::size_t k = 0; k < plan.order.size(); ++k) {
          bindings_.emplace_back(plan.order[k], g.values_at(plan.offset[k]));
          bind_value_(bindings_.back().first, bindings_.back().second);
        }
      if (g.wire) seed_masters(g);
    }
    engines_.drop_unless(gathers_by_copy_engine() || scatters_by_copy_engine());
    auto& st = rec_.stats();
    st.shard_bytes = bytes_;
    st.values_bound = values_bound();
    st.gathers_by_copy_engine = gathers_by_copy_engine();
    st.scatters_by_copy_engine = scatters_by_copy_engine();
    return bindings_;
  }

  //! Whether the model's values live in the value arena (a value binder was given).
  bool values_bound() const noexcept { return static_cast<bool>(bind_value_); }
  //! Whether the all-gathers go to the zero-CTA split, into a registered window (see the file
  //! comment); NCCL then runs them on the copy engines where the GPUs allow it.
  bool gathers_by_copy_engine() const noexcept {
    return std::any_of(groups_.begin(), groups_.end(), [](const group& g) { return g.by_engine; });
  }
  //! The same for the reduce-scatters: the gradient arena is a window of the split.
  bool scatters_by_copy_engine() const noexcept {
    return std::any_of(groups_.begin(), groups_.end(), [](const group& g) { return g.scatter_by_engine; });
  }

  //! This rank's shard of every launch unit, in launch order (the optimizer's parameters).
  const std::vector<parameter>& parameters() const noexcept { return params_; }
  //! The gradient shards of group g: what this rank unscales, checks and clips.
  std::vector<segment> grads(std::size_t g, const bucket_plan&, const std::vector<parameter>&) const {
    return groups_[g].grads;
  }
  //! Per shard (parameters() order): the model's elements it holds.
  std::span<const std::vector<shard_segment>> map() const noexcept { return map_; }
  //! Bytes of the gradient arena this rank's shards cover.
  std::size_t bytes() const noexcept { return bytes_; }

  //! A fingerprint of the layout (ranks, element types, shard sizes) mixed into h.
  std::uint64_t layout_hash(std::uint64_t h) const {
    const auto mix = [&h](std::uint64_t v) {
      h ^= v;
      h *= 1099511628211ull;
    };
    mix(static_cast<std::uint64_t>(comm_.size()));
    for (const auto& g : groups_) {
      mix(static_cast<std::uint64_t>(g.plan->type));
      for (const auto& sh : g.shards) mix(sh.count);
    }
    return h;
  }

  //! The syncing step begins: no reduce-scatter in flight (all-gathers deferred to the
  //! forward stay pending).
  void begin_sync() {
    for (auto& g : groups_)
      for (auto& w : g.scatters) w.reset();
  }

  //! Gather in forward (ShardedOptimizer::gather_in_forward): finish() issues the all-gathers
  //! in forward order (the last launch unit, the model's first layers, first) and returns
  //! without waiting for them; wait_parameters(i) then orders the compute stream after the
  //! units holding parameter i and unpacks them, just before the forward uses it.
  //! Parameter i's values are current (its units' all-gathers waited for and unpacked).
  void wait_parameters(std::size_t i) {
    if (i >= units_of_.size())
      throw config_error("wait_parameters: parameter index " + std::to_string(i) + ", but the model has " +
                         std::to_string(units_of_.size()) + " parameters");
    for (const auto& [g, u] : units_of_[i]) complete(g, u);
  }
  //! Parameter i got its gradient: with gather_in_forward, its values must have been waited for.
  void check_reported(std::size_t i, const std::string& name) const {
    if (!deferred_) return;
    for (const auto& [g, u] : units_of_.at(i))
      if (groups_[g].pending[u])
        throw config_error("parameter " + std::to_string(i) + " ('" + name +
                           "') got a gradient, but its values were "
                           "not waited for in this forward (gather_in_forward): call dp.wait_parameters(i) first");
  }
  //! Every deferred all-gather waited for and unpacked (before reading all parameters:
  //! evaluation, checkpoints, the end of training); with a low-precision gather_wire, every
  //! replica then made exact: each master copied into its block, an fp32 all-gather (collective).
  void wait_all_parameters() {
    complete_all();
    if (rec_.stats().values_exact) return;
    rec_.stats().values_exact = true;
    for (auto& g : groups_) {
      if (!g.wire) continue;
      const std::size_t r = static_cast<std::size_t>(comm_.rank());
      for (std::size_t u = 0; u < g.shards.size(); ++u) {
        const shard& sh = g.shards[u];
        const segment master{sh.master, sh.count};
        comm_.memory().pack(std::span<const segment>(&master, 1), g.values_at(sh.begin + r * sh.count), dtype::f32,
                            1.0);
        gatherer(g)
            .all_gather(g.values_at(sh.begin + r * sh.count), g.values_at(sh.begin), sh.count, dtype::f32)
            .wait();
        if (!values_bound()) comm_.memory().unpack(g.values_at(sh.begin), sh.all, dtype::f32);
      }
    }
  }
  //! Every deferred all-gather waited for and unpacked, no more (local: DataParallel's end).
  void complete_all() {
    for (std::size_t gi = 0; gi < groups_.size(); ++gi)
      for (std::size_t u = 0; u < groups_[gi].shards.size(); ++u) complete(gi, u);
  }
  //! The model's values were written from outside (a restored checkpoint): with a
  //! low-precision gather_wire the masters are taken from them again.
  void values_written() {
    complete_all();
    for (auto& g : groups_)
      if (g.wire) seed_masters(g);
    rec_.stats().values_exact = true;  // every rank was given the same values
  }

  //! Reduce-scatters the unit of group g starting at bucket `first`: count elements at buf
  //! (already prescaled); rank r keeps the mean of block r in place, through the bucket hook's
  //! reduce-scatter (hook_reduce_scatter) on comm_ or, scatters_by_copy_engine(), the split.
  void launch(std::size_t g, std::size_t first, void* buf, std::size_t count) {
    const auto t = groups_[g].plan->type;
    rec_.reduced(count * size_of(t));
    if (comm_.size() == 1 || count == 0) return;
    const std::size_t per = count / static_cast<std::size_t>(comm_.size());
    void* mine = static_cast<char*>(buf) + static_cast<std::size_t>(comm_.rank()) * per * size_of(t);
    const auto s = rec_.issue(step_event::issue_scatter, static_cast<std::int64_t>(first), key(0, g, first),
                              count * size_of(t), t);
    Comm& c = groups_[g].scatter_by_engine ? engines_.split() : comm_;
    label_next_collective(c, [&] { return bucket_label(*groups_[g].plan, first, count, "reduce-scatter of bucket "); });
    groups_[g].scatters[first].emplace(hook_reduce_scatter(hook_, c, buf, mine, per, t));
  }

  //! Waits for every reduce-scatter in unit order; with fn, updates each unit as it is ready
  //! and gathers everything (see update). Without fn, call update() next, after the checks.
  template <class Each>
  void finish(const step_fn& fn, Each&&) {
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      group& g = groups_[gi];
      for (std::size_t u = 0; u < g.shards.size(); ++u) {
        const std::size_t first = g.plan->units[u].first;
        wait(g.scatters[first], step_event::wait_scatter, first, key(0, gi, first));
        if (fn) update_unit(gi, u, fn);
      }
    }
    if (fn) gather();
  }

  //! Hands every unit's shard to fn (the optimizer) and gathers everything.
  template <class Each>
  void update(const step_fn& fn, Each&&) {
    for (std::size_t gi = 0; gi < groups_.size(); ++gi)
      for (std::size_t u = 0; u < groups_[gi].shards.size(); ++u) update_unit(gi, u, fn);
    gather();
  }

 private:
  struct shard {
    std::size_t begin = 0;      // the unit's first arena element
    std::size_t count = 0;      // elements per rank (the unit's length / size())
    std::size_t index = 0;      // into params_
    float* master = nullptr;    // gather_wire: this rank's fp32 master of its block
    std::vector<segment> mine;  // the model's values in this rank's block (packed only)
    std::vector<segment> all;   // the model's values in the whole unit (packed only)
  };
  struct group {
    const bucket_plan* plan = nullptr;
    std::shared_ptr<void> values;                    // the value arena, the plan's layout
    std::vector<shard> shards;                       // per launch unit
    std::vector<segment> grads;                      // the gradient shards
    std::vector<std::optional<work_type>> scatters;  // by the unit's first bucket
    std::vector<std::optional<work_type>> gathers;   // by unit
    std::vector<char> pending;                       // by unit: all-gather issued, not yet unpacked
    bool by_engine = false;                          // values: a window of engine_ (gathered there)
    bool scatter_by_engine = false;                  // gradients: a window of engine_ (scattered there)
    bool wire = false;                               // fp32 values gathered through gather_wire
    std::shared_ptr<void> masters;                   // wire: the shards' fp32 masters, unit after unit
    void* values_at(std::size_t elem) const { return static_cast<char*>(values.get()) + elem * size_of(plan->type); }
  };

  Comm& gatherer(const group& g) { return g.by_engine ? engines_.split() : comm_; }

  // A wire group's replicas start as the model's values (packed: copied into the value arena)
  // and each master as this rank's block of them.
  void seed_masters(group& g) {
    const std::size_t r = static_cast<std::size_t>(comm_.rank());
    for (const shard& sh : g.shards) {
      if (!values_bound()) comm_.memory().pack(sh.all, g.values_at(sh.begin), dtype::f32, 1.0);
      const segment own{g.values_at(sh.begin + r * sh.count), sh.count};
      comm_.memory().pack(std::span<const segment>(&own, 1), sh.master, dtype::f32, 1.0);
    }
  }

  // A collective's key for the recorder: kind (0 reduce-scatter, 1 all-gather), group, index.
  static std::uint64_t key(int kind, std::size_t g, std::size_t i) {
    return (static_cast<std::uint64_t>(kind) << 62) | (static_cast<std::uint64_t>(g) << 32) | i;
  }

  void wait(std::optional<work_type>& w, step_event e, std::size_t index, std::uint64_t k) {
    if (!w) return;
    const auto s = rec_.wait(e, static_cast<std::int64_t>(index), k);
    w->wait();
    w.reset();
  }

  // Packs this rank's block of unit u from the parameters into the value arena, hands it to
  // fn with its gradient shard, and issues the unit's all-gather (in place) — deferred, the
  // all-gathers go out in gather(), in forward order.
  void update_unit(std::size_t gi, std::size_t u, const step_fn& fn) {
    complete(gi, u);  // the parameters must hold last step's values before the pack
    group& g = groups_[gi];
    const shard& sh = g.shards[u];
    const std::size_t mine = sh.begin + static_cast<std::size_t>(comm_.rank()) * sh.count;
    if (!values_bound() && !g.wire) comm_.memory().pack(sh.mine, g.values_at(mine), g.plan->type, 1.0);
    {
      const auto s = rec_.record(step_event::callback, static_cast<std::int64_t>(g.plan->units[u].first));
      fn(std::span<const param_slice>(&slices_[sh.index], 1));
    }
    if (!deferred_) issue_gather(gi, u);
  }

  // Issues unit u's all-gather; the unit is pending (to unpack) until complete().
  void issue_gather(std::size_t gi, std::size_t u) {
    group& g = groups_[gi];
    g.pending[u] = 1;
    if (comm_.size() == 1) return;
    const shard& sh = g.shards[u];
    const std::size_t mine = sh.begin + static_cast<std::size_t>(comm_.rank()) * sh.count;
    const std::size_t first = g.plan->units[u].first;
    const std::size_t n = static_cast<std::size_t>(comm_.size());
    const std::size_t bytes = g.wire ? n * with_codec(wire_, [&](auto c) { return c.chunk_bytes(sh.count); })
                                     : n * sh.count * size_of(g.plan->type);
    const auto s = rec_.issue(step_event::issue_gather, static_cast<std::int64_t>(first), key(1, gi, first), bytes,
                              g.wire ? dtype::u8 : g.plan->type);
    label_next_collective(gatherer(g), [&] {
      return bucket_label(*g.plan, g.plan->units[u].first, sh.count * n,
                          g.wire ? "low-precision all-gather of bucket " : "all-gather of bucket ");
    });
    if (g.wire) {
      rec_.stats().values_exact = false;
      g.gathers[u].emplace(value_gather(gatherer(g), *staging_, wire_, sh.master,
                                        static_cast<float*>(g.values_at(sh.begin)), sh.count, deltas_));
    } else {
      g.gathers[u].emplace(gatherer(g).all_gather(g.values_at(mine), g.values_at(sh.begin), sh.count, g.plan->type));
    }
  }

  // Waits for every unit's all-gather and unpacks the values into the parameters; deferred,
  // issues them in forward order and leaves them pending.
  void gather() {
    if (!deferred_) return complete_all();
    for (std::size_t gi = groups_.size(); gi-- > 0;)
      for (std::size_t u = groups_[gi].shards.size(); u-- > 0;) issue_gather(gi, u);
  }

  // A pending unit: wait for its all-gather, unpack it into the parameters.
  void complete(std::size_t gi, std::size_t u) {
    group& g = groups_[gi];
    if (!g.pending[u]) return;
    const std::size_t first = g.plan->units[u].first;
    wait(g.gathers[u], step_event::wait_gather, first, key(1, gi, first));
    if (!values_bound()) comm_.memory().unpack(g.values_at(g.shards[u].begin), g.shards[u].all, g.plan->type);
    g.pending[u] = 0;
  }

  Comm& comm_;
  Hook& hook_;
  step_recorder& rec_;
  bind_fn bind_value_;                     // model (e), or empty: values packed and unpacked
  wire_format wire_ = wire_format::fp32;   // ShardedOptimizer::gather_wire
  bool deltas_ = true;                     // ShardedOptimizer::gather_deltas
  bool wire_agreed_ = false;               // gather_wire checked across ranks
  std::unique_ptr<wire_staging> staging_;  // gather_wire: each unit's encoded chunks, by its values
  copy_engine_split<Comm> engines_;        // the copy-engine split and its windows (outlives groups_)
  std::vector<binding> bindings_;          // what build() bound
  std::vector<group> groups_;
  std::vector<parameter> params_;                                           // this rank's shard of each unit
  std::vector<param_slice> slices_;                                         // the same, as the optimizer's slices
  std::vector<std::vector<shard_segment>> map_;                             // the same, as the model's elements
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> units_of_;  // parameter → (group, unit)s
  bool deferred_ = false;                                                   // ShardedOptimizer::gather_in_forward
  std::size_t bytes_ = 0;
};

}  // namespace lockstep::detail
