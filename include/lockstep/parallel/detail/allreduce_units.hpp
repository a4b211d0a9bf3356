#pragma once
//! allreduce_units — the Replicated strategy's reduction units (DataParallel's default,
//! PyTorch DDP's): each launch unit of the gradient arena is all-reduced in place
//! through the bucket hook as soon as backward completes it; finish() waits for them bucket by
//! bucket and hands each averaged bucket on. Every rank ends with the whole averaged gradient.
//!
//! A reduction-unit set is what reducer<Comm, Hook, Units> (reducer.hpp) asks of a strategy:
//!  - fixed_layout: the layout is fixed at construction (no rebuild from the first step's
//!    arrival order, no fused all-reduce of the rest for a model that reports nothing);
//!  - lends_gradients: no gradient arena; the units lend a buffer per launch unit (lend(g,
//!    first)), begin_cycle() zeroes what they accumulate, drain() ends a micro-step that does
//!    not step (each launches its collectives: block_units.hpp);
//!  - make_plan(type, order, sizes, policy, zero_copy): how one element type's arena is cut;
//!  - allocate(bytes, type, policy): one element type's gradient arena;
//!  - built(plans, arenas, params): the layout is final (or rebuilt); returns the value
//!    bindings it made (the model's values moved into its storage), empty if none;
//!  - grads(g, plan, params): the gradients of group g this rank unscales, checks and clips;
//!  - begin_sync(); launch(g, first, buf, count); finish(on_bucket, each); update(fn, each);
//!  - check_reported(i, name), wait_parameters(i), wait_all_parameters(), values_bound().

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/detail/binding.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"
#include "lockstep/parallel/detail/step_recorder.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

template <class Comm, class Hook>
class allreduce_units {
 public:
  using work_type = decltype(std::declval<Hook&>().reduce(std::declval<Comm&>(), nullptr, std::size_t{}, dtype::f32));
  using step_fn = std::function<void(std::span<const param_slice>)>;
  static constexpr bool fixed_layout = false;

  static constexpr bool lends_gradients = false;

  allreduce_units(Comm& comm, Hook& hook, step_recorder& rec, const Replicated&, const model_hooks&)
      : comm_(comm), hook_(hook), rec_(rec) {}

  //! Zero-copy arenas align each gradient to 256 bytes (vector loads, cuBLAS); packed ones
  //! stay dense (one pack per bucket fills them).
  static bucket_plan make_plan(dtype t, std::vector<std::size_t> order, const std::vector<std::size_t>& sizes,
                               const BucketPolicy& policy, bool zero_copy) {
    return make_bucket_plan(t, std::move(order), sizes, policy,
                            zero_copy ? std::max<std::size_t>(1, 256 / size_of(t)) : 1);
  }
  //! A symmetric window where the policy asks for one and the communicator has them
  //! (lockstep's peer all-reduce, or NCCL's symmetric kernels, then reduce the buckets:
  //! NcclComm::all_reduce).
  std::shared_ptr<void> allocate(std::size_t bytes, dtype t, const BucketPolicy& policy) {
    if constexpr (requires { comm_.allocate_symmetric(bytes); }) {
      // Not f16: above the peer all-reduce's limit NCCL's symmetric kernels would sum it.
      if (t == dtype::f16) return comm_.memory().allocate(bytes);
      if (policy.symmetric_memory && comm_.size() > 1) {
        auto [p, symmetric] = comm_.allocate_symmetric(bytes);
        rec_.stats().symmetric_memory = symmetric;
        return std::move(p);
      }
    }
    rec_.stats().symmetric_memory = false;
    return comm_.memory().allocate(bytes);
  }

  std::span<const binding> built(std::span<const bucket_plan* const> plans, std::span<void* const>,
                                 const std::vector<parameter>&) {
    plans_.assign(plans.begin(), plans.end());
    works_.clear();
    works_.resize(plans.size());  // (move-only works: no assign)
    return {};
  }

  //! Every gradient of group g, in plan order.
  static std::vector<segment> grads(std::size_t, const bucket_plan& plan, const std::vector<parameter>& params) {
    std::vector<segment> out;
    for (auto i : plan.order)
      if (params[i].numel()) out.push_back({params[i].grad, params[i].numel()});
    return out;
  }

  //! A syncing micro-step begins: no collective in flight.
  void begin_sync() {
    for (std::size_t g = 0; g < works_.size(); ++g) {
      works_[g].clear();
      works_[g].resize(plans_[g]->buckets.size());
    }
  }

  //! The unit of group g from bucket `first`: count elements at buf, all-reduced in place by
  //! the hook (the default folds the 1/N of the mean into reduce_op::avg: no extra pass).
  void launch(std::size_t g, std::size_t first, void* buf, std::size_t count) {
    if (comm_.size() == 1 || count == 0) return;
    const auto t = plans_[g]->type;
    const auto s =
        rec_.issue(step_event::issue_reduce, static_cast<std::int64_t>(first), key(g, first), count * size_of(t), t);
    label_next_collective(comm_, [&] { return bucket_label(*plans_[g], first, count); });
    works_[g][first].emplace(hook_.reduce(comm_, buf, count, t));
    label_next_collective(comm_, [] { return std::string{}; });  // a hook that did not use it
    rec_.reduced(count * size_of(t));
  }

  //! Waits for every bucket in plan order; each(g, b) then unpacks it and hands it to
  //! on_bucket (the reducer's part: the averaged bucket is ready).
  template <class Each>
  void finish(const step_fn&, Each&& each) {
    for (std::size_t g = 0; g < works_.size(); ++g) {
      for (std::size_t b = 0; b < works_[g].size(); ++b) {
        if (auto& w = works_[g][b]) {
          const auto s = rec_.wait(step_event::wait_reduce, static_cast<std::int64_t>(b), key(g, b));
          w->wait();
        }
        each(g, b);
      }
      works_[g].clear();
    }
  }

  //! After unscaling, checks and clipping: every averaged bucket to the optimizer.
  template <class Each>
  void update(const step_fn&, Each&& each) {
    for (std::size_t g = 0; g < plans_.size(); ++g)
      for (std::size_t b = 0; b < plans_[g]->buckets.size(); ++b) each(g, b);
  }

  // Every rank holds every value: nothing to wait for.
  static void check_reported(std::size_t, const std::string&) {}
  static void wait_parameters(std::size_t) {}
  static void wait_all_parameters() {}
  static bool values_bound() { return false; }

 private:
  static std::uint64_t key(std::size_t g, std::size_t b) { return (static_cast<std::uint64_t>(g) << 32) | b; }

  Comm& comm_;
  Hook& hook_;
  step_recorder& rec_;
  std::vector<const bucket_plan*> plans_;                     // per element type
  std::vector<std::vector<std::optional<work_type>>> works_;  // per type, by the unit's first bucket
};

}  // namespace lockstep::detail
