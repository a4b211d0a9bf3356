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
//! Runs [lo, hi) of the arena's runs (clipped) launched with Op over (a, b): arena element i is
//! a[i − a_first] (elements of a_bytes) and b[i].
template <class Op>
void launch_runs(const Op& op, const fixed_state& st, void* a, std::size_t a_bytes, std::size_t a_first, void* b,
                 std::size_t b_bytes, std::size_t lo, std::size_t hi, cudaStream_t s, const char* who) {
  const auto* exps = static_cast<const std::int64_t*>(st.exps.get());
  cuda::kernels::launch(
      op, st.runs.size(),
      [&](std::size_t i) {
        const auto& r = st.runs[i];
        const std::size_t from = std::max(lo, r.offset), to = std::min(hi, r.offset + r.count);
        const std::size_t at = from < to ? from : lo;  // (an empty run's pointers are not used)
        cuda::kernels::tensor_ref<2> t{
            {static_cast<char*>(a) + (at - a_first) * a_bytes, static_cast<char*>(b) + at * b_bytes},
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
    launch_runs(cuda::kernels::unfold_op<float>{{}, f, st.contributions}, st, a.sums.get(), 8, 0, base, 4, lo, hi, s,
                "Deterministic: sums to gradients");
  else
    launch_runs(cuda::kernels::unfold_op<double>{{}, f, st.contributions}, st, a.sums.get(), 8, 0, base, 8, lo, hi, s,
                "Deterministic: sums to gradients");
}

// [lo, hi) of the arena's runs into their sums (overwritten: the first contribution), on stream s.
inline void fold_runs(fixed_state& st, const fixed_state::arena& a, bool zero_source, bool overwrite, std::size_t lo,
                      std::size_t hi, cudaStream_t s) {
  const int f = fixed::frac_bits(st.contributions);
  const auto* exps = static_cast<const std::int64_t*>(st.exps.get());
  auto* tail = static_cast<std::int64_t*>(st.tail.get());
  auto* base = const_cast<void*>(a.base);
  if (a.type == dtype::f32)
    launch_runs(cuda::kernels::fold_op<float>{{}, exps, tail, st.params, f, overwrite, zero_source}, st, base, 4, 0,
                a.sums.get(), 8, lo, hi, s, "Deterministic: gradients to sums");
  else
    launch_runs(cuda::kernels::fold_op<double>{{}, exps, tail, st.params, f, overwrite, zero_source}, st, base, 8, 0,
                a.sums.get(), 8, lo, hi, s, "Deterministic: gradients to sums");
}

// Arena elements [lo, hi) (of the last fold's runs) ← the mean of n contributions, element i's
// r-th at src[i − src_first + r·stride], in one pass (fold_mean_op), on stream s.
inline void fold_mean_runs(fixed_state& st, const fixed_state::arena& a, void* src, std::size_t src_first, int n,
                           std::size_t stride, std::size_t lo, std::size_t hi, cudaStream_t s) {
  const int f = fixed::frac_bits(st.contributions);
  const auto* exps = static_cast<const std::int64_t*>(st.exps.get());
  auto* tail = static_cast<std::int64_t*>(st.tail.get());
  auto* base = const_cast<void*>(a.base);
  const std::size_t size = size_of(a.type);
  const bool aligned = stride * size % 16 == 0;
  if (a.type == dtype::f32)
    launch_runs(cuda::kernels::fold_mean_op<float>{{}, exps, tail, st.params, f, st.contributions, n, stride, aligned},
                st, src, size, src_first, base, size, lo, hi, s, "Deterministic: contributions to the mean");
  else
    launch_runs(cuda::kernels::fold_mean_op<double>{{}, exps, tail, st.params, f, st.contributions, n, stride, aligned},
                st, src, size, src_first, base, size, lo, hi, s, "Deterministic: contributions to the mean");
}
}  // namespace detail

//! One micro-step's runs of arena a (st.runs: the last fold's) into its sums, on the compute stream.
inline void fixed_point_fold(NcclComm& comm, detail::fixed_state& st, detail::fixed_state::arena& a, bool zero_source) {
  detail::fold_runs(st, a, zero_source, !a.holds, 0, a.count, comm.compute_stream());
}

namespace detail {
// One contribution a rank (the last fold deferred, fixed_state::deferred): the count elements
// of arena a at sums' place go to the ranks as they are (an all-to-all of blocks of per, a
// multiple of 4 elements), each rank turns its block's contributions into their mean in one
// pass (the bytes of an all-reduce in the gradients' type; no int64 array is written), and
// the means are all-gathered; the elements after the blocks are folded and all-reduced as
// int64. The all-to-all lands in the bucket's int64 sums, unused then (8 bytes an element).
inline NcclComm::work fold_mean_all_reduce(NcclComm& comm, fixed_state& st, fixed_state::arena& a, std::int64_t* sums,
                                           std::size_t count) {
  const std::size_t lo = static_cast<std::size_t>(sums - static_cast<std::int64_t*>(a.sums.get()));
  const auto n = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
  auto* base = static_cast<char*>(const_cast<void*>(a.base));
  if (n == 1) return comm.enqueue([&](cudaStream_t s) { fold_mean_runs(st, a, base, 0, 1, 0, lo, lo + count, s); });
  const std::size_t per = count / n / 4 * 4, split = per * n, size = size_of(a.type);
  NcclComm::work w;
  if (split < count) {
    (void)comm.enqueue([&](cudaStream_t s) { fold_runs(st, a, false, true, lo + split, lo + count, s); });
    (void)comm.all_reduce(sums + split, sums + split, count - split, dtype::i64, reduce_op::sum);
    w = comm.enqueue([&](cudaStream_t s) { unfold_runs(st, a, lo + split, lo + count, s); });
    if (per == 0) return w;
  }
  (void)comm.all_to_all(base + lo * size, sums, per, a.type);
  const std::size_t mine = lo + me * per;
  (void)comm.enqueue(
      [&](cudaStream_t s) { fold_mean_runs(st, a, sums, mine, static_cast<int>(n), per, mine, mine + per, s); });
  return comm.all_gather(base + mine * size, base + lo * size, per, a.type);
}
}  // namespace detail

//! sums (count int64 of arena a) summed over ranks, then converted back into the arena. The
//! int64 sums are twice as wide as f32 gradients, so on more than one rank they are not
//! all-reduced: each rank's block is reduce-scattered, converted back alone, and the gradients
//! all-gathered (1.5x an f32 all-reduce's bytes instead of 2x; the same bits, as the
//! conversion is elementwise). The last count mod size() elements are all-reduced. With one
//! contribution a rank (the fold deferred), detail::fold_mean_all_reduce.
inline NcclComm::work fixed_point_all_reduce(NcclComm& comm, detail::fixed_state& st, detail::fixed_state::arena& a,
                                             std::int64_t* sums, std::size_t count) {
  detail::refuse_copy_engines(comm);
  if (st.deferred) return detail::fold_mean_all_reduce(comm, st, a, sums, count);
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
//! With one contribution a rank (the fold deferred): the gradients' blocks go to their ranks as
//! they are (all-to-all into the bucket's int64 sums) and each rank's are turned into their
//! mean in one pass.
inline NcclComm::work fixed_point_reduce_scatter(NcclComm& comm, detail::fixed_state& st, detail::fixed_state::arena& a,
                                                 std::int64_t* sums, std::int64_t* mine, std::size_t per) {
  detail::refuse_copy_engines(comm);
  const std::size_t lo = static_cast<std::size_t>(mine - static_cast<std::int64_t*>(a.sums.get()));
  if (st.deferred) {
    const int n = comm.size();
    auto* base = static_cast<char*>(const_cast<void*>(a.base));
    if (n == 1)
      return comm.enqueue([&](cudaStream_t s) { detail::fold_mean_runs(st, a, base, 0, 1, 0, lo, lo + per, s); });
    const std::size_t first = static_cast<std::size_t>(sums - static_cast<std::int64_t*>(a.sums.get()));
    (void)comm.all_to_all(base + first * size_of(a.type), sums, per, a.type);
    return comm.enqueue([&](cudaStream_t s) { detail::fold_mean_runs(st, a, sums, lo, n, per, lo, lo + per, s); });
  }
  if (comm.size() > 1) (void)comm.reduce_scatter(sums, mine, per, dtype::i64, reduce_op::sum);
  return comm.enqueue([&](cudaStream_t s) { detail::unfold_runs(st, a, lo, lo + per, s); });
}

//! A cycle cut short (begin_cycle after folds without end_step): its tail dropped.
inline void fixed_point_reset_tail(NcclComm& comm, detail::fixed_state& st) {
  // On the communication stream, where deferred folds (fold_mean) write the tail, and the
  // compute stream waits for it: the next folds there come after.
  comm.enqueue([&](cudaStream_t s) {
        cuda::kernels::fixed_point_reset_tail(static_cast<std::int64_t*>(st.tail.get()), st.params, s);
      })
      .wait();
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
