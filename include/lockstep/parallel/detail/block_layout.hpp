#pragma once
//! block_layout — the layout full sharding works on (block_units.hpp, its base): per element
//! type the plan's units (one per block of the model, make_block_plan) with this rank's shard
//! of each — its gradient mean and, ZeRO-3, its values, in shard arenas; ZeRO-2 a whole value
//! arena the model's values live in — and per block its parameters, its units and the buffers
//! lent to it while in use, of the group's compute type (FullySharded::param_dtype: bf16
//! values and gradients lent for fp32 shards). Where a parameter's values and gradient are now (value_of,
//! grad_of) follows from it. The optimizer's parameters are the shards (params_, slices_), and
//! map_ says which of the model's elements each holds (checkpoints reshard with it).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/detail/block_checks.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/value_wire.hpp"

namespace lockstep::detail {

//! Work: the communicator's work type; ShardValues: ZeRO-3 (else ZeRO-2).
template <class Work, bool ShardValues>
class block_layout {
 protected:
  struct unit {
    std::size_t begin = 0;  // the unit's first element in the plan
    std::size_t per = 0;    // elements per rank
    std::size_t shard = 0;  // this rank's shard's offset in the group's shard arenas
    std::size_t block = 0;
  };
  struct group {
    const bucket_plan* plan = nullptr;
    dtype cdt = dtype::f32;  // the element type lent to the model: values gathered, gradients written
    std::vector<unit> units;
    std::shared_ptr<void> values;  // ZeRO-3: the value shards (Σ per); ZeRO-2: the whole values (plan.total)
    // Per unit, its gradient shard (per elements) while a cycle holds one (gradient_shard),
    // whether it holds nothing of this cycle yet (fresh: the cycle's first reduce-scatter
    // writes it, no zeroing, no sum), and the shards present as segments.
    std::vector<std::shared_ptr<void>> grads;
    std::vector<char> fresh;
    std::vector<segment> shard_grads;
    // Lent buffers: values and the model's gradients (cdt); with cdt != the plan's type the
    // gradients are widened into a sum buffer (the plan's type) for their reduce-scatter.
    // Each pool by a buffer's elements (a unit's span: the blocks of a transformer share one).
    using pool = std::map<std::size_t, std::vector<std::shared_ptr<void>>>;
    pool grad_pool, value_pool, sum_pool;
    pool stage_pool;     // FullySharded::gather_wire: the encoded chunks of a gather, by bytes
    bool wired = false;  // its lent gathers go through FullySharded::gather_wire
    bool mixed() const { return cdt != plan->type; }
    pool& sum_buffers() { return mixed() ? sum_pool : grad_pool; }  // reduce-scatters run in these
    std::size_t span_of(std::size_t u) const { return plan->buckets[plan->units[u].first].elements(); }
    std::size_t shard_total() const { return units.empty() ? 0 : units.back().shard + units.back().per; }
    void* at(const std::shared_ptr<void>& p, std::size_t elem) const { return at(p, elem, plan->type); }
    static void* at(const std::shared_ptr<void>& p, std::size_t elem, dtype t) {
      return static_cast<char*>(p.get()) + elem * size_of(t);
    }
  };
  struct block {
    std::vector<std::size_t> params;
    std::vector<std::pair<std::size_t, std::size_t>> units;  // (group, unit)
    std::size_t bytes = 0;                                   // bytes of all its units (gathered size)
    std::vector<std::shared_ptr<void>> gathered;             // ZeRO-3, per unit: the buffer its values are in
    std::vector<std::optional<Work>> gathers;                // per unit: an all-gather not yet waited for
    std::vector<std::shared_ptr<void>> staged;               // per unit: its gather's encoded chunks (gather_wire)
    std::vector<std::shared_ptr<void>> grads;                // per unit: the lent gradient buffer
    bool in_use = false, forward = false, backward = false;  // this micro-step
    bool held() const { return !gathered.empty() && gathered.front() != nullptr; }
  };
  struct flight {
    std::size_t g = 0, u = 0;
    std::shared_ptr<void> buffer;
    std::optional<Work> work;
    bool direct = false;  // into the unit's gradient shard itself (its cycle's first)
  };
  // Where block buffers come from: the model's allocator (model (i)'s block_storage; a buffer
  // is then dropped when its use ends, for the framework to reuse) or mem, pooled; and what
  // to call when mem has none left (model (i)'s storage_released).
  struct sources {
    std::function<std::shared_ptr<void>(std::size_t)> storage;
    std::function<void()> release;
  };

  //! block_of[i]: parameter i's block (0, 1, … without gaps).
  explicit block_layout(std::vector<std::size_t> block_of) : block_of_(std::move(block_of)) {
    std::size_t nb = 0;
    for (auto b : block_of_) nb = std::max(nb, b + 1);
    blocks_.resize(nb);
    for (std::size_t i = 0; i < block_of_.size(); ++i) blocks_[block_of_[i]].params.push_back(i);
  }

  //! Lays out the shards of every group (plans: one per element type) for rank r of n, and
  //! moves the model's values (params) in: ZeRO-3 this rank's block of each unit, ZeRO-2 all.
  //! f32 groups lend their buffers in param_dtype (the others in their own type).
  template <class Mem>
  void lay_out(std::span<const bucket_plan* const> plans, const std::vector<parameter>& params, std::size_t n,
               std::size_t r, Mem mem, dtype param_dtype) {
    groups_.clear();
    types_.clear();
    for (const auto& p : params) types_.push_back(p.type);
    params_.clear();
    slices_.clear();
    map_.clear();
    bytes_ = 0;
    ranks_ = n;
    for (auto& b : blocks_) b.units.clear();
    for (std::size_t gi = 0; gi < plans.size(); ++gi) {
      const bucket_plan& plan = *plans[gi];
      const std::size_t es = size_of(plan.type);
      group& g = groups_.emplace_back();
      g.plan = &plan;
      g.cdt = plan.type == dtype::f32 ? param_dtype : plan.type;
      // gather_wire: fp32 values, more than one rank, the wire narrower than the lent type
      g.wired = ShardValues && wire_ != wire_format::fp32 && plan.type == dtype::f32 && n > 1 &&
                !(wire_ == wire_format::bf16 && g.cdt == dtype::bf16);
      std::size_t shard_total = 0;
      for (const auto& lu : plan.units) {
        const bucket& bk = plan.buckets[lu.first];
        unit u{bk.begin, bk.elements() / n, shard_total, block_of_[bk.slices.front().param]};
        shard_total += u.per;
        blocks_[u.block].units.push_back({gi, g.units.size()});
        g.units.push_back(u);
      }
      g.values = mem.allocate((ShardValues ? shard_total : plan.total) * es);
      g.grads.assign(g.units.size(), nullptr);
      g.fresh.assign(g.units.size(), 1);
      for (std::size_t k = 0; k < g.units.size(); ++k) {
        const unit& u = g.units[k];
        const bucket& bk = plan.buckets[plan.units[k].first];
        const std::size_t lo = u.begin + r * u.per, hi = lo + u.per;
        auto& seg = map_.emplace_back();
        std::vector<segment> mine, all;
        for (const auto& s : bk.slices) {
          char* v = static_cast<char*>(params[s.param].value);
          all.push_back({v, s.count});
          const std::size_t a = std::max(lo, s.arena_offset), e = std::min(hi, s.arena_offset + s.count);
          if (a >= e) continue;
          mine.push_back({v + (a - s.arena_offset) * es, e - a});
          seg.push_back({s.param, a - s.arena_offset, e - a, a - lo});
        }
        // The values move in: ZeRO-3 this rank's block only, ZeRO-2 all of them (the model's
        // own storage may be freed once attach has been called).
        if constexpr (ShardValues) mem.pack(mine, g.at(g.values, u.shard), plan.type, 1.0);
        else
          for (std::size_t j = 0; j < bk.slices.size(); ++j)
            mem.pack(std::span(&all[j], 1), g.at(g.values, bk.slices[j].arena_offset), plan.type, 1.0);
        void* value = ShardValues ? g.at(g.values, u.shard) : g.at(g.values, lo);
        void* grad = nullptr;  // gradient_shard
        params_.push_back(parameter{"shard " + std::to_string(r) + "/" + std::to_string(n) + " of block " +
                                        std::to_string(u.block) + " (" + name_of(plan.type) + ")",
                                    {static_cast<std::int64_t>(u.per)},
                                    plan.type,
                                    value,
                                    grad});
        slices_.push_back({params_.size() - 1, 0, u.per, plan.type, value, grad});
        bytes_ += u.per * es;
      }
    }
    for (auto& b : blocks_) {
      b.bytes = 0;
      for (auto [gi, k] : b.units) b.bytes += groups_[gi].span_of(k) * size_of(groups_[gi].cdt);
      b.gathered.assign(b.units.size(), {});
      b.gathers.resize(b.units.size());
      b.staged.assign(b.units.size(), {});
      b.grads.assign(b.units.size(), {});
    }
    places_.assign(block_of_.size(), std::nullopt);  // where each parameter is: found once
    for (std::size_t i = 0; i < block_of_.size(); ++i) {
      const block& b = blocks_[block_of_[i]];
      for (std::size_t j = 0; j < b.units.size() && !places_[i]; ++j) {
        const auto [gi, u] = b.units[j];
        for (const auto& sl : groups_[gi].plan->buckets[groups_[gi].plan->units[u].first].slices)
          if (sl.param == i) places_[i] = place{j, gi, u, sl.arena_offset};
      }
    }
  }

  //! The gradient shard of unit u of group gi (per elements, the plan's type), taken when the
  //! cycle has none yet (zeroed when `zero`): the cycle's first reduce-scatter of the unit
  //! writes it, and new_gradient_cycle(true) gives every one back to the model's allocator when
  //! it lends them (model (i)'s block_storage): as FSDP2's sharded gradients after zero_grad,
  //! they then take none of the memory the forward and the early backward need. Null for a
  //! unit of no elements.
  template <class Mem>
  void* gradient_shard(std::size_t gi, std::size_t u, Mem mem, const sources& from, bool zero) {
    group& g = groups_[gi];
    const std::size_t per = g.units[u].per;
    if (per == 0) return nullptr;
    if (!g.grads[u]) {
      g.grads[u] = allocate_from(per, g.plan->type, mem, from, false);
      point_gradients(gi);
    }
    if (zero) mem.zero(g.grads[u].get(), bytes_of(g, per));
    return g.grads[u].get();
  }
  //! This cycle's gradient shards, once complete, are multiplied by c (Join::sync_prescale:
  //! the mean over the micro-batches the ranks contributed, where each micro-step assumed all).
  void scale_cycle(double c) noexcept { cycle_scale_ = c; }
  template <class Mem>
  void apply_cycle_scale(Mem mem) {
    if (cycle_scale_ != 1.0)
      for (auto& g : groups_)
        for (std::size_t u = 0; u < g.units.size(); ++u)
          if (g.grads[u]) mem.scale(g.grads[u].get(), g.units[u].per, g.plan->type, cycle_scale_);
    cycle_scale_ = 1.0;
  }
  //! Parameter i got its gradient: its block must be in its backward use.
  void check_reported(std::size_t i, const std::string& name) const {
    check_gradient_in_use(blocks_[block_of_.at(i)], i, name, block_of_[i]);
  }
  //! A cycle begins: every shard is to be written anew by its unit's first reduce-scatter;
  //! with `release`, the shards go back to the model's allocator (taken again then).
  void new_gradient_cycle(bool release) {
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      group& g = groups_[gi];
      std::fill(g.fresh.begin(), g.fresh.end(), 1);
      if (!release) continue;
      for (auto& p : g.grads) p.reset();
      point_gradients(gi);
    }
  }

  // A buffer for unit u of group gi in type t: from pool (by the unit's size), else new — a
  // pool grows, never waits. When mem has none left, release() (the model gives back what its
  // allocator keeps: libtorch's cache of freed activations) and one more try. Counted in
  // lent_bytes() while it exists.
  template <class Mem>
  std::shared_ptr<void> take_from(typename group::pool& pool, std::size_t elems, dtype t, Mem mem,
                                  const sources& from) {
    auto& free = pool[elems];
    if (free.empty()) return allocate_from(elems, t, mem, from, true);
    auto p = std::move(free.back());
    free.pop_back();
    return p;
  }
  // A new buffer (counted in lent_bytes() while it exists when `lent`).
  template <class Mem>
  std::shared_ptr<void> allocate_from(std::size_t elems, dtype t, Mem mem, const sources& from, bool lent) {
    const std::size_t bytes = elems * size_of(t);
    const auto allocate = [&]() -> std::shared_ptr<void> {
      if (from.storage)
        if (auto p = from.storage(bytes)) {
          dropping_ = true;
          return p;
        }
      return mem.allocate(bytes);
    };
    std::shared_ptr<void> p;
    try {
      p = allocate();
    } catch (const error&) {
      if (!from.release) throw;
      from.release();
      p = allocate();
    }
    if (!lent) return p;
    *lent_ += bytes;
    peak_lent_ = std::max(peak_lent_, *lent_);
    return std::shared_ptr<void>(p.get(), [p, lent = lent_, bytes](void*) mutable {
      p.reset();
      *lent -= bytes;
    });
  }
  // ZeRO-3's prefetch after block k: the next blocks in p's direction not held, at most
  // `count`, while the values gathered but not in use stay within max_bytes.
  std::vector<std::size_t> to_prefetch(std::size_t k, pass p, int count, std::size_t max_bytes) const {
    std::size_t ahead = 0;
    for (const auto& b : blocks_)
      if (b.held() && !b.in_use) ahead += b.bytes;
    std::vector<std::size_t> next;
    for (std::size_t d = 1; static_cast<int>(next.size()) < count; ++d) {
      if (p == pass::forward ? k + d >= blocks_.size() : d > k) break;
      const std::size_t j = p == pass::forward ? k + d : k - d;
      const block& b = blocks_[j];
      if (b.held()) continue;
      if (ahead + b.bytes > max_bytes) break;
      next.push_back(j);
      ahead += b.bytes;
    }
    return next;
  }
  // ZeRO-3, after a restore wrote into the whole values (wait_all_parameters'): rank r's block
  // of each unit copied into its shard.
  template <class Mem>
  void shards_from_whole(Mem mem, std::size_t r) {
    if (whole_.empty()) return;
    for (std::size_t gi = 0; gi < groups_.size(); ++gi)
      for (const auto& u : groups_[gi].units) {
        const segment mine{groups_[gi].at(whole_[gi], u.begin + r * u.per), u.per};
        mem.pack(std::span(&mine, 1), groups_[gi].at(groups_[gi].values, u.shard), groups_[gi].plan->type, 1.0);
      }
  }
  // The bytes of a gather_wire gather of `per` values per rank: every rank's chunk.
  std::size_t staging_bytes(std::size_t per) const {
    return ranks_ * with_codec(wire_, [&](auto c) { return c.chunk_bytes(per); });
  }
  // A buffer whose use ended: pooled for the next take of its size — or, when the model's
  // allocator gave buffers, dropped (its memory goes back to the framework at once).
  void give_back(typename group::pool& pool, std::size_t elems, std::shared_ptr<void> buffer) {
    if (buffer && !dropping_) pool[elems].push_back(std::move(buffer));
  }
  // Whether the model's allocator gives the buffers (none is pooled).
  bool dropping() const noexcept { return dropping_; }
  // The most bytes of block buffers that existed at once (in use, in flight or pooled).
  std::size_t lent_bytes() const noexcept { return peak_lent_; }

  // The optimizer's parameters and the shard_grads of group gi point at its gradient shards now.
  void point_gradients(std::size_t gi) {
    group& g = groups_[gi];
    g.shard_grads.clear();
    for (std::size_t u = 0; u < g.units.size(); ++u) {
      void* grad = g.grads[u].get();
      params_[index_of(gi, u)].grad = slices_[index_of(gi, u)].grad = grad;
      if (grad) g.shard_grads.push_back({grad, g.units[u].per});
    }
  }

  // The layout's part of DataParallel's layout hash (n ranks).
  std::uint64_t hash(std::uint64_t h, std::size_t n) const {
    const auto mix = [&h](std::uint64_t v) {
      h ^= v;
      h *= 1099511628211ull;
    };
    mix(static_cast<std::uint64_t>(n));
    mix(ShardValues ? 3 : 2);
    for (const auto& g : groups_) {
      mix(static_cast<std::uint64_t>(g.plan->type));
      for (const auto& u : g.units) mix(u.per);
    }
    return h;
  }

  // The step recorder's key of a collective: kind (0 reduce-scatter, 1 all-gather), group, index.
  static std::uint64_t key(int kind, std::size_t g, std::size_t i) {
    return (static_cast<std::uint64_t>(kind) << 62) | (static_cast<std::uint64_t>(g) << 32) | i;
  }
  std::size_t bytes_of(const group& g, std::size_t elems) const { return elems * size_of(g.plan->type); }
  std::size_t unit_of(std::size_t gi, std::size_t first) const {
    const auto& us = groups_[gi].plan->units;
    for (std::size_t u = 0; u < us.size(); ++u)
      if (us[u].first == first) return u;
    throw config_error("block_units: no unit starts at bucket " + std::to_string(first));
  }
  static std::size_t slot_in(const block& b, std::size_t gi, std::size_t u) {
    for (std::size_t j = 0; j < b.units.size(); ++j)
      if (b.units[j] == std::pair{gi, u}) return j;
    return 0;
  }
  std::size_t index_of(std::size_t gi, std::size_t u) const {
    std::size_t i = 0;
    for (std::size_t h = 0; h < gi; ++h) i += groups_[h].units.size();
    return i + u;
  }
  // Where parameter i lies: its block's unit slot j, its group and unit, its offset in the
  // plan; none for a parameter without elements (in no unit).
  struct place {
    std::size_t j, gi, u, offset;
  };
  const std::optional<place>& place_of(std::size_t i) const { return places_[i]; }
  // Where parameter i's values are now (held: a ZeRO-3 block's gathered buffer counts).
  void* value_of(std::size_t i, bool held) const {
    const auto p = place_of(i);
    if (!p) return nullptr;
    const block& b = blocks_[block_of_[i]];
    const group& g = groups_[p->gi];
    if constexpr (!ShardValues) return g.at(g.values, p->offset);
    if (!whole_.empty() && !b.in_use) return g.at(whole_[p->gi], p->offset);
    return held && b.gathered[p->j] ? g.at(b.gathered[p->j], p->offset - g.units[p->u].begin, g.cdt) : nullptr;
  }
  // Where parameter i's gradient is now: in its block's lent buffer, or null.
  void* grad_of(std::size_t i) const {
    const auto p = place_of(i);
    if (!p || !blocks_[block_of_[i]].grads[p->j]) return nullptr;
    const group& g = groups_[p->gi];
    return group::at(blocks_[block_of_[i]].grads[p->j], p->offset - g.units[p->u].begin, g.cdt);
  }
  // The element type of parameter i's values and gradient as lent now (model (i)'s dtype).
  dtype type_of(std::size_t i) const {
    const auto p = place_of(i);
    if (!p) return types_.at(i);  // no elements: its own type
    const group& g = groups_[p->gi];
    return !whole_.empty() && !blocks_[block_of_[i]].in_use ? g.plan->type : g.cdt;
  }

  std::vector<std::size_t> block_of_;         // per parameter
  std::vector<std::optional<place>> places_;  // per parameter: its slot in its block (none: no elements)
  std::vector<dtype> types_;                  // per parameter: its element type in the model
  std::vector<block> blocks_;
  std::vector<group> groups_;
  std::vector<std::shared_ptr<void>> whole_;  // ZeRO-3 wait_all_parameters: per group, every value
  std::vector<parameter> params_;             // this rank's shard of each unit (the optimizer's parameters)
  std::vector<param_slice> slices_;
  std::vector<std::vector<shard_segment>> map_;
  std::size_t bytes_ = 0;
  std::shared_ptr<std::size_t> lent_ = std::make_shared<std::size_t>(0);  // bytes of block buffers now
  std::size_t peak_lent_ = 0;
  bool dropping_ = false;                 // the model's allocator gives the buffers: none is pooled
  double cycle_scale_ = 1.0;              // scale_cycle's factor
  wire_format wire_ = wire_format::fp32;  // FullySharded::gather_wire
  std::size_t ranks_ = 1;                 // as laid out
};

}  // namespace lockstep::detail
