#pragma once
// The data-parallel side of the equivalence tests, for any communicator (ThreadComm in
// tests/cpu/test_equivalence.cpp, MpiComm in tests/mpi/test_mpi_equivalence.cpp): which rows
// each rank trains on, and one rank's plain-SGD training loop checked against the one-rank
// reference of equivalence.hpp.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <type_traits>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

namespace lockstep_test {

//! The rows `rank` trains on in micro-step `micro` of optimizer step `step`: each optimizer
//! step takes the next batch·ranks·accumulate samples (wrapping around the data set), micro-step
//! by micro-step, each micro-step's rows cut in blocks of `batch` in rank order.
inline std::vector<std::size_t> rank_rows(const dataset& d, std::size_t batch, int ranks, int rank, int step,
                                          int accumulate = 1, int micro = 0) {
  const std::size_t global = batch * static_cast<std::size_t>(ranks * accumulate);
  const std::size_t first =
      static_cast<std::size_t>(step) * global + (static_cast<std::size_t>(micro) * ranks + rank) * batch;
  std::vector<std::size_t> rows(batch);
  for (std::size_t i = 0; i < batch; ++i) rows[i] = (first + i) % d.samples;
  return rows;
}

//! One equivalence run's shape (the rank count is the communicator's).
struct equivalence_config {
  std::size_t batch = 4;  // per rank, per micro-step
  int accumulate = 1;
  int steps = 4;  // optimizer steps
  bool hooks = true;
  lockstep::BucketPolicy buckets{};
};

//! What CAPTURE(c) prints.
inline std::ostream& operator<<(std::ostream& os, const equivalence_config& c) {
  return os << "{batch " << c.batch << ", accumulate " << c.accumulate << ", steps " << c.steps << ", hooks " << c.hooks
            << ", buckets.cap_bytes " << c.buckets.cap_bytes << "}";
}

constexpr double equivalence_lr = 0.2;

//! How close the data-parallel run ends to the one-rank reference.
template <class T>
constexpr double equivalence_tolerance = std::is_same_v<T, double> ? 1e-12 : 1e-5;

//! The one-rank reference of config c on `ranks` ranks: batch N·K·B per optimizer step.
template <class T>
std::vector<T> equivalence_reference(const dataset& d, const equivalence_config& c, int ranks, std::uint64_t init_seed,
                                     double lr) {
  return one_rank_reference<T>(d, c.batch, ranks, c.accumulate, c.steps, init_seed, lr);
}

//! This rank's part of the data-parallel run of config c: batch B of the N·K·B samples of each
//! step, plain SGD; returns its parameters, its DataParallel's stats in `stats`.
template <class T, bool Bindable, class Ctx, class Acc>
std::vector<T> data_parallel_rank(Ctx& ctx, const dataset& d, const equivalence_config& c, std::uint64_t init_seed,
                                  double lr, Acc acc, lockstep::sync_stats& stats) {
  using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
  // Different initial values per rank: construction must broadcast rank 0's.
  TestMlp<T, Bindable> m(d.dims, init_seed + static_cast<std::uint64_t>(ctx.rank()) * 7919);
  lockstep::DataParallel<TestMlp<T, Bindable>, Comm, Acc> dp(ctx, m, {.buckets = c.buckets}, acc);
  for (int s = 0; s < c.steps; ++s) {
    for (int k = 0; k < c.accumulate; ++k) {
      auto step = dp.step();
      CHECK(step.synchronizes() == (k + 1 == c.accumulate));
      const auto rows = rank_rows(d, c.batch, ctx.size(), ctx.rank(), s, c.accumulate, k);
      if (c.hooks) m.forward_backward(inputs<T>(d), d.y, rows, step.on_gradient_ready());
      else m.forward_backward(inputs<T>(d), d.y, rows, [](std::size_t) {});
      auto r = step.finish();
      CHECK(r.synced == (k + 1 == c.accumulate));
      if (r) m.sgd(lr);
    }
  }
  stats = dp.stats();
  return m.flat_values();
}

//! The one-rank reference of config c on `ranks` ranks and the data-parallel run's result,
//! run(acc) with lockstep::EveryStep{} when c.accumulate is 1, else lockstep::Accumulate<>;
//! checks that the reference trained (the comparison is not between initial values).
template <class T, class Run>
auto reference_and_run(const dataset& d, const equivalence_config& c, int ranks, std::uint64_t init_seed, Run&& run) {
  auto ref = equivalence_reference<T>(d, c, ranks, init_seed, equivalence_lr);
  auto got = c.accumulate == 1 ? run(lockstep::EveryStep{}) : run(lockstep::Accumulate<>(c.accumulate));
  TestMlp<T> init(d.dims, init_seed);
  CHECK(max_rel_diff(init.flat_values(), ref) > 1e-3);
  return std::pair{std::move(ref), std::move(got)};
}

}  // namespace lockstep_test
