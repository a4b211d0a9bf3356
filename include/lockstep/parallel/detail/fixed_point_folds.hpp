#pragma once
//! The reducer's side of lockstep::Deterministic (parallel/deterministic.hpp): which arena
//! elements belong to which parameter (the runs an exponent applies to), the arenas handed to
//! the hook when a layout is built, and a micro-step that does not synchronise folded whole.

#include <cstddef>
#include <cstdint>
#include <cmath>
#include <span>
#include <vector>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/deterministic.hpp"
#include "lockstep/parallel/detail/bucket_plan.hpp"

namespace lockstep::detail {

//! Whether a reducer with this hook sums in fixed point (Deterministic): units with an arena.
template <class Hook, bool LendsGradients>
consteval bool sums_in_fixed_point() {
  static_assert(!(fixed_point_hook_v<Hook> && LendsGradients),
                "lockstep::Deterministic: not with ShardedGradients or FullySharded yet (their gradient shards "
                "accumulate in floating point over micro-steps); use Replicated or ShardedOptimizer");
  return fixed_point_hook_v<Hook>;
}

//! The parameter slices of buckets [first, last) as runs (arena offset, count, parameter index
//! as the exponent's slot).
inline std::vector<fixed_run> fixed_runs(const bucket_plan& p, std::size_t first, std::size_t last) {
  std::vector<fixed_run> runs;
  for (std::size_t b = first; b < last; ++b)
    for (const auto& s : p.buckets[b].slices) runs.push_back({s.arena_offset, s.count, s.param});
  return runs;
}

//! A new layout's arenas (one per element type) to the hook.
template <class Comm>
void attach_arenas(Deterministic& hook, Comm& comm, std::span<const bucket_plan* const> plans,
                   std::span<void* const> arenas, std::size_t params) {
  std::vector<std::size_t> totals;
  std::vector<dtype> types;
  for (const auto* p : plans) {
    totals.push_back(p->total);
    types.push_back(p->type);
  }
  hook.attach(comm, arenas, totals, types, params);
}

//! A synchronising micro-step's launch unit (buckets [first, last)) into the sums; with one
//! rank, converted back at once (the units issue nothing then).
template <class Comm>
void fold_unit(Deterministic& hook, Comm& comm, const bucket_plan& plan, void* arena, std::size_t first,
               std::size_t last, std::int64_t contributions) {
  hook.fold(comm, arena, fixed_runs(plan, first, last), contributions, false);
  const std::size_t begin = plan.buckets[first].begin, end = plan.buckets[last - 1].end;
  if (comm.size() == 1)
    hook.reduce(comm, static_cast<char*>(arena) + begin * size_of(plan.type), end - begin, plan.type).wait();
}

//! A micro-step that does not synchronise: its gradients (packed into the arena first when
//! the model keeps its own) go into the sums, and are zeroed for the next micro-step.
template <class Comm>
void fold_micro_step(Deterministic& hook, Comm& comm, const bucket_plan& plan, void* arena,
                     std::span<const parameter> params, bool zero_copy, std::int64_t contributions) {
  const auto segs = segments_of(plan.buckets, 0, plan.buckets.size(), params);
  auto mem = comm.memory();
  if (!zero_copy) mem.pack(segs, arena, plan.type, 1.0);
  hook.fold(comm, arena, fixed_runs(plan, 0, plan.buckets.size()), contributions, true);
  if (!zero_copy)
    for (const auto& s : segs) mem.zero(s.ptr, s.count * size_of(plan.type));
}

}  // namespace lockstep::detail
