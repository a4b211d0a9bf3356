#pragma once
//! block_units — the reduction units of ShardedGradients (ZeRO-2, ShardValues = false) and
//! FullySharded (ZeRO-3, ShardValues = true), policies.hpp; the reducer's strategy (the
//! interface: allreduce_units.hpp). One launch unit per block of the model (model (h)) and
//! element type: the plan lays the blocks out in backward order, each padded to a multiple of
//! size(). Per unit this rank keeps its shard of the gradient — the mean over ranks, summed
//! over micro-steps — and of the values: ZeRO-3 in a shard arena, ZeRO-2 as its block of a
//! whole value arena the model's values live in (the all-gather after the update lands there).
//!
//! Full gradients and (ZeRO-3) gathered values exist only while a block is in use: use(k, pass)
//! lends the block buffers (block_layout: the model's allocator, or pools that grow, never
//! wait) and attaches them to the model (model (i)); end_use(k, pass) detaches them. A backward
//! use's gradient buffer goes to its reduce-scatter (launched by the reducer once the block's
//! gradients are final: a cycle's first into the gradient shard, later ones added into it) and
//! back when that is done. ZeRO-3 gathers block k's values when it is first used (waits for
//! them: stream-ordered on device communicators) and prefetches the next blocks — k + 1, … in
//! forward, k − 1, … in backward — within BlockBuffers; a buffer released after a use is
//! gathered into again only by a collective issued later, so stream ordering keeps it from
//! overwriting values still being read.
//!
//! Mixed precision (FullySharded::param_dtype = bf16): fp32 shards stay the masters; a gather
//! rounds this rank's shard into its own slot of the bf16 buffer and all-gathers in place
//! (half the bytes, no extra memory); the model computes in bf16 and writes bf16 gradients,
//! which lend() widens into an fp32 buffer for the reduce-scatter (fp32 sums, or Bf16Wire's).
//! FullySharded::gather_wire: each gather goes through the codec (value_wire.hpp), its chunks
//! in a staging buffer on devices (pooled, held until the gather is waited for).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/bucket_hook.hpp"
#include "lockstep/parallel/detail/binding.hpp"
#include "lockstep/parallel/detail/block_checks.hpp"
#include "lockstep/parallel/detail/block_layout.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/step_recorder.hpp"
#include "lockstep/parallel/detail/value_wire.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

template <class Comm, class Hook, bool ShardValues>
class block_units
    : private block_layout<decltype(std::declval<Comm&>().all_gather(nullptr, nullptr, std::size_t{}, dtype::f32)),
                           ShardValues> {
  using layout = block_layout<decltype(std::declval<Comm&>().all_gather(nullptr, nullptr, std::size_t{}, dtype::f32)),
                              ShardValues>;
  using layout::block_of_, layout::blocks_, layout::groups_, layout::whole_, layout::params_, layout::slices_,
      layout::map_, layout::bytes_, layout::wire_;
  using layout::key, layout::bytes_of, layout::unit_of, layout::slot_in, layout::index_of, layout::value_of,
      layout::grad_of, layout::type_of, layout::staging_bytes;
  using typename layout::block;
  using typename layout::flight;
  using typename layout::group;
  using typename layout::unit;

 public:
  using layout::check_reported, layout::scale_cycle;
  using work_type = decltype(std::declval<Comm&>().all_gather(nullptr, nullptr, std::size_t{}, dtype::f32));
  using step_fn = std::function<void(std::span<const param_slice>)>;
  using policy_type = std::conditional_t<ShardValues, FullySharded, ShardedGradients>;
  static constexpr bool fixed_layout = true;     // the optimizer's state is laid out along the shards
  static constexpr bool lends_gradients = true;  // no gradient arena: block buffers, lent per use
  static_assert(memory_ops_with_add<memory_of_t<Comm>>,
                "lockstep::ShardedGradients / FullySharded: the communicator's memory space needs "
                "add(dst, src, count, dtype) (memory_ops_with_add) to sum the gradient shards over micro-steps");

  block_units(Comm& comm, Hook& hook, step_recorder& rec, const policy_type& policy, const model_hooks& model)
      : layout(model.blocks), comm_(comm), hook_(hook), rec_(rec), buffers_(policy.buffers), attach_(model.attach),
        released_(model.released), sources_{model.storage, model.released} {
    if constexpr (ShardValues) {
      keep_ = policy.keep_after_forward;
      param_dtype_ = policy.param_dtype;
      wire_ = policy.gather_wire;
    }
    check_block_config(model, buffers_, param_dtype_, memory_ops_with_convert<memory_of_t<Comm>>);
  }
  block_units(const block_units&) = delete;
  block_units& operator=(const block_units&) = delete;

  //! One unit per block (backward order), each a multiple of size() elements.
  bucket_plan make_plan(dtype t, std::vector<std::size_t> order, const std::vector<std::size_t>& sizes,
                        const BucketPolicy&, bool) const {
    std::vector<std::size_t> unused;
    return make_block_plan(t, order, sizes, block_of_, 1, static_cast<std::size_t>(comm_.size()), unused);
  }
  static std::shared_ptr<void> allocate(std::size_t, dtype, const BucketPolicy&) {
    return nullptr;
  }  // never: lends_gradients

  std::span<const binding> built(std::span<const bucket_plan* const> plans, std::span<void* const>,
                                 const std::vector<parameter>& params) {
    if (ShardValues && comm_.size() > 1)  // the gathers' sizes, types and order depend on them: checked first
      require_same_settings(comm_, "FullySharded",
                            {{"gather_wire", static_cast<std::int64_t>(wire_)},
                             {"param_dtype", static_cast<std::int64_t>(param_dtype_)},
                             {"keep_after_forward", keep_},
                             {"buffers.prefetch", buffers_.prefetch},
                             {"buffers.max_prefetch_bytes", static_cast<std::int64_t>(buffers_.max_prefetch_bytes)}});
    this->lay_out(plans, params, static_cast<std::size_t>(comm_.size()), static_cast<std::size_t>(comm_.rank()),
                  comm_.memory(), param_dtype_);
    for (std::size_t i = 0; i < params.size(); ++i) attach(i, !ShardValues, false);
    if (released_) released_();  // the model's own storage is free now (gradient shards come per cycle)
    auto& st = rec_.stats();
    st.shard_bytes = bytes_;
    st.values_bound = true;
    if constexpr (!ShardValues) {  // the model's values are the value arena's: checked like model (e)
      bindings_.clear();
      for (std::size_t i = 0; i < params.size(); ++i) bindings_.emplace_back(i, value_of(i, false));
      return bindings_;
    }
    return {};
  }

  static constexpr bool values_bound() noexcept { return true; }
  const std::vector<parameter>& parameters() const noexcept { return params_; }
  std::vector<segment> grads(std::size_t g, const bucket_plan&, const std::vector<parameter>&) const {
    return groups_[g].shard_grads;
  }
  std::span<const std::vector<shard_segment>> map() const noexcept { return map_; }
  std::size_t bytes() const noexcept { return bytes_; }
  std::size_t blocks() const noexcept { return blocks_.size(); }
  //! The parameters of block k (registration order).
  std::span<const std::size_t> params_of(std::size_t k) const { return blocks_.at(k).params; }

  std::uint64_t layout_hash(std::uint64_t h) const { return this->hash(h, static_cast<std::size_t>(comm_.size())); }

  //! A cycle begins: the gradient shards go back to the model's allocator (unless kept), else
  //! stay in place; each unit's first reduce-scatter overwrites its shard.
  void begin_cycle() { this->new_gradient_cycle(!buffers_.keep_gradient_shards && this->dropping()); }
  //! A micro-step begins (every one launches its reduce-scatters): forward and backward anew.
  void begin_sync() {
    drop_whole();
    for (std::size_t k = 0; k < blocks_.size(); ++k) {
      block& b = blocks_[k];
      if (b.in_use) throw block_unfinished(k);
      if (b.held()) release_values(k);  // kept after a forward that had no backward (evaluation)
      b.forward = b.backward = false;
    }
    open_ = true;
  }

  //! DataParallel::use_block: block k's values (and, in backward, gradient buffers) attached.
  void use(std::size_t k, pass p) {
    check_block_use(blocks_, k, p, open_);
    block& b = blocks_[k];
    if constexpr (ShardValues) gather(k);
    wait_gathers(k);
    if constexpr (ShardValues)
      for (auto j : this->to_prefetch(k, p, buffers_.prefetch, buffers_.max_prefetch_bytes)) gather(j);
    if (p == pass::backward)
      for (std::size_t j = 0; j < b.units.size(); ++j) {
        auto [gi, u] = b.units[j];
        group& g = groups_[gi];
        b.grads[j] = g.mixed() ? take(g.grad_pool, g.span_of(u), g.cdt) : take_sum_buffer(gi, u);
        comm_.memory().zero(b.grads[j].get(), g.span_of(u) * size_of(g.cdt));
      }
    b.in_use = true;
    (p == pass::forward ? b.forward : b.backward) = true;
    for (auto i : b.params) attach(i, true, p == pass::backward);
  }
  //! The use ends: gradients detached (the reducer has launched the block's reduce-scatter, or
  //! will), ZeRO-3 values released unless kept for the backward.
  void end_use(std::size_t k, pass p) {
    block& b = blocks_[k];
    if (!b.in_use) throw config_error("block " + std::to_string(k) + " is not in use");
    b.in_use = false;
    const bool keep = ShardValues && p == pass::forward && keep_ && open_;
    for (auto i : b.params) attach(i, keep || !ShardValues, false);
    if (ShardValues && !keep) release_values(k);
  }

  //! The buffer of the unit of group g from bucket `first`: the gradients the block's backward
  //! wrote, in the plan's type (widened from the compute type, mixed), or zeros for a block
  //! that had no backward this micro-step.
  void* lend(std::size_t gi, std::size_t first) {
    group& g = groups_[gi];
    const std::size_t u = unit_of(gi, first);
    block& b = blocks_[g.units[u].block];
    const std::size_t j = slot_in(b, gi, u);
    if (!b.grads[j]) {
      b.grads[j] = take_sum_buffer(gi, u);
      comm_.memory().zero(b.grads[j].get(), bytes_of(g, g.span_of(u)));
    } else if (g.mixed()) {
      if constexpr (memory_ops_with_convert<memory_of_t<Comm>>) {
        auto wide = take_sum_buffer(gi, u);
        comm_.memory().convert(wide.get(), g.plan->type, b.grads[j].get(), g.cdt, g.span_of(u));
        this->give_back(g.grad_pool, g.span_of(u), std::exchange(b.grads[j], std::move(wide)));
      }
    }
    return b.grads[j].get();
  }

  //! Reduce-scatters the unit (already prescaled) through the hook: the cycle's first straight
  //! into the gradient shard, a later one in place (this rank's block of the buffer gets the
  //! mean; complete() adds it into the shard).
  void launch(std::size_t gi, std::size_t first, void* buf, std::size_t count) {
    group& g = groups_[gi];
    const std::size_t u = unit_of(gi, first);
    block& b = blocks_[g.units[u].block];
    const std::size_t j = slot_in(b, gi, u);
    const auto t = g.plan->type;
    rec_.reduced(count * size_of(t));
    flight f{gi, u, std::move(b.grads[j]), std::nullopt};
    if (comm_.size() > 1) {
      const std::size_t per = g.units[u].per;
      void* mine = static_cast<char*>(buf) + static_cast<std::size_t>(comm_.rank()) * per * size_of(t);
      if (per && std::exchange(g.fresh[u], 0)) {
        mine = this->gradient_shard(gi, u, comm_.memory(), sources_, false);
        f.direct = true;
      }
      const auto s =
          rec_.issue(step_event::issue_scatter, static_cast<std::int64_t>(first), key(0, gi, u), count * size_of(t), t);
      label_next_collective(comm_, [&] { return bucket_label(*g.plan, first, count, "reduce-scatter of block "); });
      f.work.emplace(hook_reduce_scatter(hook_, comm_, buf, mine, per, t, &g.units[u]));
    }
    flights_.push_back(std::move(f));
  }

  //! The micro-step was abandoned (an exception left it): every block still in use is
  //! detached without its reduce-scatter; the reduce-scatters already issued are waited for
  //! and dropped (their sums must not reach the next cycle's shards); buffers go back.
  void abandon() {
    for (std::size_t k = 0; k < blocks_.size(); ++k) {
      block& b = blocks_[k];
      if (b.in_use || (ShardValues && b.held()))  // in use, or kept after its forward
        for (auto i : b.params) attach(i, !ShardValues, false);
      b.in_use = false;
      if (ShardValues && b.held()) release_values(k);
      for (auto& g : b.grads) g.reset();
      b.forward = b.backward = false;
    }
    while (!flights_.empty()) complete_oldest(/*keep=*/false);
    this->scale_cycle(1.0);  // the cycle restarts
    open_ = false;
  }

  //! End of a micro-step that does not step (accumulation): every reduce-scatter completed.
  void drain() {
    while (!flights_.empty()) complete_oldest();
    open_ = false;
  }
  template <class Each>
  void finish(const step_fn& fn, Each&& each) {
    drain();
    this->apply_cycle_scale(comm_.memory());
    if (fn) update(fn, each);
  }
  //! Hands every unit's shard to fn (the optimizer); ZeRO-2 then gathers the values in place
  //! (waited for at the block's next use).
  template <class Each>
  void update(const step_fn& fn, Each&&) {
    for (std::size_t gi = 0; gi < groups_.size(); ++gi)
      for (std::size_t u = 0; u < groups_[gi].units.size(); ++u) {
        const auto s = rec_.record(step_event::callback, static_cast<std::int64_t>(u));
        fn(std::span<const param_slice>(&slices_[index_of(gi, u)], 1));
      }
    if constexpr (!ShardValues)  // in forward order: the first block's values come first
      for (const auto& b : blocks_)
        for (const auto& [gi, u] : b.units) gather_in_place(gi, u);
  }

  //! Every parameter's values whole and attached (evaluation outside blocks, checkpoints, the
  //! end of training): ZeRO-2 waits for the gathers; ZeRO-3 gathers the whole model into a
  //! buffer kept until the next step begins (the whole model's values, once) — a collective:
  //! every rank calls it (add_training_state too: build the checkpoint on every rank).
  void wait_all_parameters() {
    for (std::size_t k = 0; k < blocks_.size(); ++k) wait_gathers(k);
    if constexpr (ShardValues) {
      if (!whole_.empty()) return;
      std::vector<std::shared_ptr<void>> whole;  // taken only once complete (a collective: may throw)
      for (auto& g : groups_) {
        whole.push_back(comm_.memory().allocate(bytes_of(g, g.plan->total)));
        for (std::size_t u = 0; u < g.units.size(); ++u)
          all_gather(g, u, g.at(whole.back(), g.units[u].begin), g.plan->type).wait();
      }
      whole_ = std::move(whole);
      for (std::size_t i = 0; i < block_of_.size(); ++i) attach(i, true, false);
    }
  }
  //! After a restore wrote into the whole values (wait_all_parameters'): ZeRO-3 copies this
  //! rank's block of each unit into its shard (ZeRO-2's shards are the value arena itself).
  void values_written() {
    if constexpr (ShardValues) this->shards_from_whole(comm_.memory(), static_cast<std::size_t>(comm_.rank()));
  }
  static void wait_parameters(std::size_t) { throw wait_parameters_refused(); }

 private:
  std::shared_ptr<void> take(typename group::pool& pool, std::size_t elems, dtype t) {
    auto p = this->take_from(pool, elems, t, comm_.memory(), sources_);
    rec_.stats().lent_bytes = this->lent_bytes();
    return p;
  }

  // A buffer for a reduce-scatter: with BlockBuffers::scatters_in_flight of them in flight, the
  // oldest is completed first and its buffer reused (ordered after it on device streams).
  std::shared_ptr<void> take_sum_buffer(std::size_t gi, std::size_t u) {
    group& g = groups_[gi];
    while (g.sum_buffers()[g.span_of(u)].empty() && !flights_.empty() &&
           flights_.size() >= static_cast<std::size_t>(buffers_.scatters_in_flight))
      complete_oldest();
    return take(g.sum_buffers(), g.span_of(u), g.plan->type);
  }

  void attach(std::size_t i, bool values, bool grad) {
    attach_(i, values ? value_of(i, true) : nullptr, grad ? grad_of(i) : nullptr, type_of(i));
  }

  // ZeRO-3: block k's all-gathers issued (into lent buffers) unless its values are held.
  void gather(std::size_t k) {
    block& b = blocks_[k];
    if (b.held()) return;
    for (std::size_t j = 0; j < b.units.size(); ++j) {
      const auto [gi, u] = b.units[j];
      group& g = groups_[gi];
      b.gathered[j] = take(g.value_pool, g.span_of(u), g.cdt);
      if (g.wired && requires { comm_.comm_stream(); })  // (host communicators need no staging)
        b.staged[j] = take(g.stage_pool, staging_bytes(g.units[u].per), dtype::u8);
      try {
        b.gathers[j].emplace(all_gather(g, u, b.gathered[j].get(), g.cdt, g.wired, b.staged[j].get()));
      } catch (...) {  // work on them may be queued (no work to wait for): they are never reused
        stranded_.push_back(std::move(b.gathered[j]));
        stranded_.push_back(std::move(b.staged[j]));
        throw;
      }
    }
  }
  // Unit u's values from every rank's shard into `to`, of type t: the plan's type straight
  // from the shard; another (param_dtype) rounded into this rank's slot of `to`, gathered in
  // place; `wired` (gather_wire), through the wire's codec (its chunks in `staging` on devices).
  work_type all_gather(group& g, std::size_t u, void* to, dtype t, bool wired = false, void* staging = nullptr) {
    const unit& un = g.units[u];
    const void* from = g.at(g.values, un.shard);
    if (t != g.plan->type && !wired) {
      if constexpr (memory_ops_with_convert<memory_of_t<Comm>>) {
        void* mine = static_cast<char*>(to) + static_cast<std::size_t>(comm_.rank()) * un.per * size_of(t);
        comm_.memory().convert(mine, t, from, g.plan->type, un.per);
        from = mine;
      }
    }
    if (comm_.size() == 1) {
      const segment s{const_cast<void*>(from), un.per};
      comm_.memory().pack(std::span(&s, 1), to, t, 1.0);
      return work_type{};
    }
    const auto gi = static_cast<std::size_t>(&g - groups_.data());
    const std::size_t n = static_cast<std::size_t>(comm_.size());
    const auto s = rec_.issue(step_event::issue_gather, static_cast<std::int64_t>(u), key(1, gi, u),
                              wired ? staging_bytes(un.per) : un.per * n * size_of(t), wired ? dtype::u8 : t);
    label_next_collective(comm_, [&] {
      return bucket_label(*g.plan, g.plan->units[u].first, un.per * n,
                          wired ? "low-precision all-gather of block " : "all-gather of block ");
    });
    if (wired) return block_value_gather(comm_, wire_, staging, static_cast<const float*>(from), un.per, to, t);
    return comm_.all_gather(from, to, un.per, t);
  }
  // Block k's gathers waited for; their staging back to its pool.
  void wait_gathers(std::size_t k) {
    block& b = blocks_[k];
    for (std::size_t j = 0; j < b.units.size(); ++j) {
      wait_work(b.gathers[j], step_event::wait_gather, k);
      if (!b.staged[j]) continue;
      const auto [gi, u] = b.units[j];
      this->give_back(groups_[gi].stage_pool, staging_bytes(groups_[gi].units[u].per), std::move(b.staged[j]));
    }
  }
  void release_values(std::size_t k) {
    block& b = blocks_[k];
    wait_gathers(k);
    for (std::size_t j = 0; j < b.units.size(); ++j) {
      if (!b.gathered[j]) continue;
      group& g = groups_[b.units[j].first];
      this->give_back(g.value_pool, g.span_of(b.units[j].second), std::move(b.gathered[j]));
    }
  }
  void drop_whole() {
    if (whole_.empty()) return;
    whole_.clear();
    for (std::size_t i = 0; i < block_of_.size(); ++i) attach(i, !ShardValues, false);
  }

  // ZeRO-2: unit u's updated shard to every rank, in place in the value arena (deferred).
  void gather_in_place(std::size_t gi, std::size_t u) {
    group& g = groups_[gi];
    block& b = blocks_[g.units[u].block];
    if (comm_.size() == 1) return;
    const unit& un = g.units[u];
    void* from = g.at(g.values, un.begin + static_cast<std::size_t>(comm_.rank()) * un.per);
    auto& w = b.gathers[slot_in(b, gi, u)];
    wait_work(w, step_event::wait_gather, g.units[u].block);  // a block not used since its last gather
    w.emplace(comm_.all_gather(from, g.at(g.values, un.begin), un.per, g.plan->type));
  }

  void wait_work(std::optional<work_type>& w, step_event e, std::size_t index) {
    if (!w) return;
    const auto s = rec_.wait(e, static_cast<std::int64_t>(index), key(1, 0, index));
    w->wait();
    w.reset();
  }

  // The oldest reduce-scatter: waited for, its mean added into the shard (unless written there
  // or dropped: a dropped first leaves the shard to be written anew), its buffer pooled.
  void complete_oldest(bool keep = true) {
    flight f = std::move(flights_.front());
    flights_.pop_front();
    group& g = groups_[f.g];
    const unit& un = g.units[f.u];
    if (f.work) {
      const auto s = rec_.wait(step_event::wait_scatter, static_cast<std::int64_t>(f.u), key(0, f.g, f.u));
      f.work->wait();
    }
    const void* mine = g.at(f.buffer, static_cast<std::size_t>(comm_.rank()) * un.per);
    if (f.direct) g.fresh[f.u] = !keep;
    else if (keep && un.per)
      comm_.memory().add(this->gradient_shard(f.g, f.u, comm_.memory(), sources_, std::exchange(g.fresh[f.u], 0)), mine,
                         un.per, g.plan->type);
    this->give_back(g.sum_buffers(), g.span_of(f.u), std::move(f.buffer));
  }

  Comm& comm_;
  Hook& hook_;
  step_recorder& rec_;
  BlockBuffers buffers_;
  bool keep_ = false;               // FullySharded::keep_after_forward
  dtype param_dtype_ = dtype::f32;  // FullySharded::param_dtype (f32: lent as they are)
  attach_fn attach_;
  std::function<void()> released_;    // model.storage_released, if it has it
  typename layout::sources sources_;  // where block buffers come from (model.block_storage or the memory space)
  std::deque<flight> flights_;        // reduce-scatters issued, in issue order
  std::vector<std::shared_ptr<void>> stranded_;  // buffers of gathers that failed to issue, kept
  std::vector<binding> bindings_;
  bool open_ = false;  // a micro-step is open (between begin_sync and its drain)
};

}  // namespace lockstep::detail
