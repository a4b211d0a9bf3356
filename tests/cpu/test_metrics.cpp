// Metrics: all-reduced scalars and counts across ThreadComm ranks, throughput, scaling
// efficiency, the progress line, and logging from rank 0 only.

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/comm/thread_comm.hpp"
#include "lockstep/observe/metrics.hpp"

#include "test_util.hpp"

using namespace lockstep;

namespace {

using lockstep_test::run_ranks;

std::uint32_t fresh_seed() { return std::random_device{}(); }

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("metrics: all_reduce_scalars sums and takes max and min of doubles and sums int64 exactly") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const int n = 4;
  const std::size_t k = 5;
  // Every rank's inputs, drawn up front so the test knows them all.
  std::mt19937 rng(seed);
  std::normal_distribution<double> val(0.0, 100.0);
  std::uniform_int_distribution<std::int64_t> ival(-(std::int64_t{1} << 50), std::int64_t{1} << 50);
  std::vector<std::vector<double>> in(n, std::vector<double>(k));
  std::vector<std::vector<std::int64_t>> iin(n, std::vector<std::int64_t>(k));
  for (auto& v : in)
    for (auto& x : v) x = val(rng);
  for (auto& v : iin)
    for (auto& x : v) x = ival(rng);

  std::vector<std::vector<double>> sum(n), mx(n), mn(n);
  std::vector<std::vector<std::int64_t>> isum(n);
  run_ranks(n, [&](int r, ThreadComm& comm) {
    const auto ru = static_cast<std::size_t>(r);
    sum[ru] = mx[ru] = mn[ru] = in[ru];
    isum[ru] = iin[ru];
    all_reduce_scalars(comm, std::span<double>(sum[ru]), reduce_op::sum);
    all_reduce_scalars(comm, std::span<double>(mx[ru]), reduce_op::max);
    all_reduce_scalars(comm, std::span<double>(mn[ru]), reduce_op::min);
    all_reduce_scalars(comm, std::span<std::int64_t>(isum[ru]), reduce_op::sum);
  });
  for (std::size_t i = 0; i < k; ++i) {
    long double s = 0;
    double hi = in[0][i], lo = in[0][i];
    std::int64_t is = 0;
    for (int r = 0; r < n; ++r) {
      s += in[static_cast<std::size_t>(r)][i];
      hi = std::max(hi, in[static_cast<std::size_t>(r)][i]);
      lo = std::min(lo, in[static_cast<std::size_t>(r)][i]);
      is += iin[static_cast<std::size_t>(r)][i];
    }
    for (int r = 0; r < n; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      CHECK(std::fabs(sum[ru][i] - s) <= 1e-12L * (std::fabs(s) + 400));
      CHECK(sum[ru][i] == sum[0][i]);  // bit-identical on every rank
      CHECK(mx[ru][i] == hi);
      CHECK(mn[ru][i] == lo);
      CHECK(isum[ru][i] == is);
    }
  }
}

TEST_CASE("metrics: mean_across_ranks and global accuracy") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const int n = 3;
  std::mt19937 rng(seed);
  std::vector<double> values(n);
  std::vector<eval_counts> counts(n);
  for (int r = 0; r < n; ++r) {
    values[static_cast<std::size_t>(r)] = std::uniform_real_distribution<double>(-5, 5)(rng);
    const auto total = std::uniform_int_distribution<std::int64_t>(1, 100000)(rng);
    counts[static_cast<std::size_t>(r)] = {std::uniform_int_distribution<std::int64_t>(0, total)(rng), total};
  }
  std::vector<double> means(n), accs(n);
  std::vector<eval_counts> globals(n);
  run_ranks(n, [&](int r, ThreadComm& comm) {
    const auto ru = static_cast<std::size_t>(r);
    means[ru] = mean_across_ranks(comm, values[ru]);
    globals[ru] = all_reduce_counts(comm, counts[ru]);
    accs[ru] = global_accuracy(comm, counts[ru]);
  });
  long double vs = 0;
  eval_counts sum;
  for (int r = 0; r < n; ++r) {
    vs += values[static_cast<std::size_t>(r)];
    sum.correct += counts[static_cast<std::size_t>(r)].correct;
    sum.total += counts[static_cast<std::size_t>(r)].total;
  }
  const double want_acc = static_cast<double>(sum.correct) / static_cast<double>(sum.total);
  for (int r = 0; r < n; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    CHECK(means[ru] == doctest::Approx(static_cast<double>(vs / n)).epsilon(1e-12));
    CHECK(globals[ru] == sum);
    CHECK(accs[ru] == want_acc);
  }
  CHECK(std::isnan(eval_counts{}.accuracy()));
  eval_counts a{3, 4};
  a += eval_counts{1, 4};
  CHECK(a.accuracy() == 0.5);
}

TEST_CASE("metrics: ThroughputMeter add and start/stop and the global rate") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  ThroughputMeter m;
  CHECK(m.samples_per_s() == 0.0);
  const auto s1 = std::uniform_int_distribution<std::int64_t>(1, 10000)(rng);
  const auto s2 = std::uniform_int_distribution<std::int64_t>(1, 10000)(rng);
  const double t1 = std::uniform_real_distribution<double>(0.1, 3)(rng);
  const double t2 = std::uniform_real_distribution<double>(0.1, 3)(rng);
  m.add(s1, t1);
  m.add(s2, t2);
  CHECK(m.samples() == s1 + s2);
  CHECK(m.samples_per_s() == doctest::Approx(static_cast<double>(s1 + s2) / (t1 + t2)));
  CHECK(m.total_samples_per_s(4) == doctest::Approx(4.0 * static_cast<double>(s1 + s2) / (t1 + t2)));
  CHECK_THROWS_AS(m.add(-1, 1.0), config_error);
  CHECK_THROWS_AS(m.stop(1), config_error);

  ThroughputMeter timed;
  timed.start();
  CHECK_THROWS_AS(timed.start(), config_error);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  timed.stop(300);
  CHECK(timed.seconds() >= 0.029);
  CHECK(timed.seconds() < 5.0);
  CHECK(timed.samples_per_s() <= 300 / 0.029);
  timed.reset();
  CHECK(timed.samples() == 0);

  // Global: samples summed over ranks, divided by the slowest rank's time.
  const int n = 3;
  std::vector<std::int64_t> samples(n);
  std::vector<double> secs(n);
  for (int r = 0; r < n; ++r) {
    samples[static_cast<std::size_t>(r)] = std::uniform_int_distribution<std::int64_t>(1, 5000)(rng);
    secs[static_cast<std::size_t>(r)] = std::uniform_real_distribution<double>(0.5, 2)(rng);
  }
  std::vector<double> global(n);
  run_ranks(n, [&](int r, ThreadComm& comm) {
    ThroughputMeter t;
    t.add(samples[static_cast<std::size_t>(r)], secs[static_cast<std::size_t>(r)]);
    global[static_cast<std::size_t>(r)] = t.global_samples_per_s(comm);
  });
  std::int64_t total = 0;
  double slowest = 0;
  for (int r = 0; r < n; ++r) {
    total += samples[static_cast<std::size_t>(r)];
    slowest = std::max(slowest, secs[static_cast<std::size_t>(r)]);
  }
  for (double g : global) CHECK(g == doctest::Approx(static_cast<double>(total) / slowest));
}

TEST_CASE("metrics: scaling_efficiency") {
  LOCKSTEP_SEEDED(std::mt19937 rng);
  const double one = std::uniform_real_distribution<double>(100, 1e5)(rng);
  const int n = std::uniform_int_distribution<int>(2, 64)(rng);
  const double frac = std::uniform_real_distribution<double>(0.3, 1.0)(rng);
  const double total = one * n * frac;
  CHECK(scaling_efficiency(one, total, n) == doctest::Approx(frac).epsilon(1e-12));
  CHECK(scaling_efficiency(1000.0, 3620.0, 4) == doctest::Approx(0.905));  // 90.5%
  CHECK(scaling_efficiency(one, one, 1) == 1.0);
  CHECK_THROWS_AS(scaling_efficiency(one, total, 0), config_error);
  CHECK_THROWS_AS(scaling_efficiency(0.0, total, 2), config_error);
}

TEST_CASE("metrics: progress_line") {
  const std::string s = progress_line(3, 120, 469, 0.4321, 12345.67);
  CHECK(s == "epoch 3 | step 120/469 | loss 0.432100 | 12345.7 samples/s");
}

TEST_CASE("metrics: Rank0Logger and log0 print on rank 0 only") {
  const int n = 3;
  std::vector<std::ostringstream> outs(n);
  run_ranks(n, [&](int r, ThreadComm& comm) {
    auto& out = outs[static_cast<std::size_t>(r)];
    Rank0Logger log(comm, out);
    CHECK(log.active() == (r == 0));
    log.log("epoch ", 2, " loss ", 0.5);
    log("rank says ", r);
    log0(out, r, "x=", 7);
    log.progress("step 1/10");
    log.progress("step 10/10 done");
    log.progress("end");
    log.end_progress();
    log.progress("plain", false);
  });
  CHECK(outs[0].str() == "epoch 2 loss 0.5\nrank says 0\nx=7\n\rstep 1/10\rstep 10/10 done\rend            \nplain\n");
  CHECK(outs[1].str().empty());
  CHECK(outs[2].str().empty());

  // A log line while a progress line is open starts on a fresh line.
  std::ostringstream o;
  Rank0Logger l(0, o);
  l.progress("50%");
  l.log("note");
  CHECK(o.str() == "\r50%\nnote\n");
}

}  // TEST_SUITE
