#pragma once
//! lockstep::Deterministic on NcclComm (parallel/deterministic.hpp has the policy, its
//! arithmetic and its contract): the folds on the compute stream, where backward wrote the
//! gradients; the int64 sum (all-reduce or reduce-scatter), the conversion back and the end of a
//! step on the communication stream, so the compute stream waits only for the returned work.
//! Nothing here synchronises with the host or allocates: a warmed-up step can be captured.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/grad_group.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/kernels/fixed_point_ops.cuh"
#include "lockstep/cuda/nccl_comm.cuh"
#include "lockstep/parallel/deterministic.hpp"

namespace lockstep {

namespace detail {
//! Runs [lo, hi) of the arena's runs (clipped) launched with Op over (a, b) base pointers.
template <class Op>
void launch_runs(const Op& op, const fixed_state& st, void* a, std::size_t a_bytes, void* b, std::size_t b_bytes,
                 std::size_t lo, std::size_t hi, cudaStream_t s, const char* who) {
  const auto* exps = static_cast<const std::int64_t*>(st.exps.get());
  cuda::kernels::launch(
      op, st.runs.size(),
      [&](std::size_t i) {
        const auto& r = st.runs[i];
        const std::size_t from = std::max(lo, r.offset), to = std::min(hi, r.offset + r.count);
        cuda::kernels::tensor_ref<2> t{{static_cast<char*>(a) + from * a_bytes, static_cast<char*>(b) + from * b_bytes},
                                       from < to ? to - from : 0,
                                       exps + r.slot};
        return t;
      },
      s, who);
}

inline void refuse_copy_engines(NcclComm& comm) {
  if (comm.copy_engines())
    throw config_error("lockstep::Deterministic with ShardedOptimizer::copy_engine_scatter: the copy engines move "
                       "bytes but do not add integers; turn copy_engine_scatter off");
}

// The sums of [lo, hi) back into the arena's gradients, on stream s.
inline void unfold_runs(const fixed_state& st, const fixed_state::arena& a, std::size_t lo, std::size_t hi,
                        cudaStream_t s) {
  const int f = fixed::frac_bits(st.contributions);
  auto* base = const_cast<void*>(a.base);
  if (a.type == dtype::f32)
    launch_runs(cuda::kernels::unfold_op<float>{{}, f, st.contributions}, st, a.sums.get(), 8, base, 4, lo, hi, s,
                "Deterministic: sums to gradients");
  else
    launch_runs(cuda::kernels::unfold_op<double>{{}, f, st.contributions}, st, a.sums.get(), 8, base, 8, lo, hi, s,
                "Deterministic: sums to gradients");
}
}  // namespace detail

//! One micro-step's runs of arena a (st.runs: the last fold's) into its sums, on the compute stream.
inline void fixed_point_fold(NcclComm& comm, detail::fixed_state& st, detail::fixed_state::arena& a, std::int64_t* sums,
                             bool zero_source) {
  const int f = detail::fixed::frac_bits(st.contributions);
  const auto* exps = static_cast<const std::int64_t*>(st.exps.get());
  auto* tail = static_cast<std::int64_t*>(st.tail.get());
  const cudaStream_t s = comm.compute_stream();
  auto* base = const_cast<void*>(a.base);
  const std::size_t all = a.count;
  if (a.type == dtype::f32)
    detail::launch_runs(cuda::kernels::fold_op<float>{{}, exps, tail, st.params, f, !a.holds, zero_source}, st, base, 4,
                        sums, 8, 0, all, s, "Deterministic: gradients to sums");
  else
    detail::launch_runs(cuda::kernels::fold_op<double>{{}, exps, tail, st.params, f, !a.holds, zero_source}, st, base,
                        8, sums, 8, 0, all, s, "Deterministic: gradients to sums");
}

//! sums (count int64 of arena a) summed over ranks, then converted back into the arena. The
//! int64 sums are twice as wide as f32 gradients, so on more than one rank they are not
//! all-reduced: each rank's block is reduce-scattered, converted back alone, and the gradients
//! all-gathered (1.5x an f32 all-reduce's bytes instead of 2x; the same bits, as the
//! conversion is elementwise). The last count mod size() elements are all-reduced.
inline NcclComm::work fixed_point_all_reduce(NcclComm& comm, detail::fixed_state& st, detail::fixed_state::arena& a,
                                             std::int64_t* sums, std::size_t count) {
  detail::refuse_copy_engines(comm);
  const std::size_t lo = static_cast<std::size_t>(sums - static_cast<std::int64_t*>(a.sums.get()));
  const auto n = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
  const std::size_t per = n > 1 ? count / n : 0, split = per * n;
  if (per > 0) {
    auto* data = static_cast<char*>(const_cast<void*>(a.base)) + lo * size_of(a.type);
    (void)comm.reduce_scatter(sums, sums + me * per, per, dtype::i64, reduce_op::sum);
    (void)comm.enqueue([&](cudaStream_t s) { detail::unfold_runs(st, a, lo + me * per, lo + (me + 1) * per, s); });
    auto w = comm.all_gather(data + me * per * size_of(a.type), data, per, a.type);
    if (split == count) return w;
  }
  if (n > 1) (void)comm.all_reduce(sums + split, sums + split, count - split, dtype::i64, reduce_op::sum);
  return comm.enqueue([&](cudaStream_t s) { detail::unfold_runs(st, a, lo + split, lo + count, s); });
}

//! Block rank() of sums (size()·per int64) summed over ranks into mine, then converted back.
inline NcclComm::work fixed_point_reduce_scatter(NcclComm& comm, detail::fixed_state& st, detail::fixed_state::arena& a,
                                                 std::int64_t* sums, std::int64_t* mine, std::size_t per) {
  detail::refuse_copy_engines(comm);
  const std::size_t lo = static_cast<std::size_t>(mine - static_cast<std::int64_t*>(a.sums.get()));
  if (comm.size() > 1) (void)comm.reduce_scatter(sums, mine, per, dtype::i64, reduce_op::sum);
  return comm.enqueue([&](cudaStream_t s) { detail::unfold_runs(st, a, lo, lo + per, s); });
}

//! A cycle cut short (begin_cycle after folds without end_step): its tail dropped, on the
//! compute stream, where the folds ran.
inline void fixed_point_reset_tail(NcclComm& comm, detail::fixed_state& st) {
  cuda::kernels::fixed_point_reset_tail(static_cast<std::int64_t*>(st.tail.get()), st.params, comm.compute_stream());
}

//! The end of a step: the tail agreed (max over ranks), the next exponents, the counts, NaN
//! into each group's first element after a non-finite value; the compute stream waits for it.
inline void fixed_point_end_step(NcclComm& comm, detail::fixed_state& st, std::span<const grad_group> groups,
                                 int margin) {
  auto* tail = static_cast<std::int64_t*>(st.tail.get());
  if (comm.size() > 1) (void)comm.all_reduce(tail, tail, st.params + 3, dtype::i64, reduce_op::max);
  cuda::kernels::poison_targets targets;
  for (const auto& g : groups)
    for (const auto& s : g.segments) {
      if (s.count == 0) continue;
      if (targets.n == 8)
        throw config_error("lockstep::Deterministic: more than 8 gradient element types");  // (dtype has fewer)
      targets.at[targets.n] = s.ptr;
      targets.is_double[targets.n++] = g.type == dtype::f64;
      break;
    }
  comm.enqueue([&](cudaStream_t s) {
        cuda::kernels::fixed_point_end_step(static_cast<std::int64_t*>(st.exps.get()), tail,
                                            static_cast<std::int64_t*>(st.counts.get()), st.params, margin, targets, s);
      })
      .wait();
}

}  // namespace lockstep
