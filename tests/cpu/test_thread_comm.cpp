// ThreadComm is the reference every communicator is checked against, so it is checked
// here against sums written out in the test, on random data of awkward lengths.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>

#include <lockstep/comm/thread_comm.hpp>
#include <lockstep/launch/run.hpp>

#include "test_util.hpp"

using lockstep::dtype;
using lockstep::reduce_op;
using lockstep_test::fresh_seed;

namespace {

template <class T>
std::vector<std::vector<T>> per_rank_inputs(int n, std::size_t len, std::uint64_t seed) {
  std::vector<std::vector<T>> in;
  std::mt19937_64 rng(seed);
  for (int r = 0; r < n; ++r) {
    if constexpr (std::is_floating_point_v<T>) in.push_back(lockstep_test::random_vector<T>(len, rng, -100, 100));
    else {
      std::uniform_int_distribution<long long> d(-1000, 1000);
      std::vector<T> v(len);
      for (auto& x : v) x = static_cast<T>(d(rng));
      in.push_back(v);
    }
  }
  return in;
}

template <class T>
T poison() {
  if constexpr (std::is_floating_point_v<T>) return std::numeric_limits<T>::quiet_NaN();
  else return std::numeric_limits<T>::min();
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE_TEMPLATE("ThreadComm all_reduce sum/avg/max/min - in place and out of place", T, float, double,
                   std::int32_t, std::int64_t) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  for (int n : {1, 2, 3, 4}) {
    for (std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000003}}) {
      for (auto op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
        for (bool in_place : {false, true}) {
          CAPTURE(n); CAPTURE(len); CAPTURE(static_cast<int>(op)); CAPTURE(in_place);
          auto in = per_rank_inputs<T>(n, len, seed + len + static_cast<std::uint64_t>(n));
          // Reference: combine in rank order, as written in the docs.
          std::vector<T> ref(len);
          for (std::size_t i = 0; i < len; ++i) {
            T acc = in[0][i];
            for (int r = 1; r < n; ++r) {
              T x = in[static_cast<std::size_t>(r)][i];
              if (op == reduce_op::max) acc = std::max(acc, x);
              else if (op == reduce_op::min) acc = std::min(acc, x);
              else acc = static_cast<T>(acc + x);
            }
            if (op == reduce_op::avg) acc = static_cast<T>(acc / static_cast<T>(n));
            ref[i] = acc;
          }
          std::vector<std::vector<T>> out(static_cast<std::size_t>(n), std::vector<T>(len, poison<T>()));
          lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
            auto r = static_cast<std::size_t>(ctx.rank());
            if (in_place) {
              out[r] = in[r];
              ctx.comm().all_reduce(out[r].data(), out[r].data(), len, lockstep::dtype_of<T>, op).wait();
            } else {
              ctx.comm().all_reduce(in[r].data(), out[r].data(), len, lockstep::dtype_of<T>, op).wait();
            }
          });
          for (int r = 0; r < n; ++r) {
            bool same = std::memcmp(out[static_cast<std::size_t>(r)].data(), ref.data(), len * sizeof(T)) == 0;
            CHECK(same);
          }
        }
      }
    }
  }
}

TEST_CASE("ThreadComm broadcast - all_gather - reduce_scatter - barrier") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  for (int n : {1, 2, 3, 4}) {
    for (std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{65537}}) {
      CAPTURE(n); CAPTURE(len);
      auto in = per_rank_inputs<double>(n, len * static_cast<std::size_t>(n), seed ^ len);
      const int root = n - 1;
      std::vector<std::vector<double>> bc(static_cast<std::size_t>(n)), ag(static_cast<std::size_t>(n)),
          rs(static_cast<std::size_t>(n));
      std::atomic<int> after_barrier{0};
      std::atomic<bool> barrier_ok{true};
      lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
        auto r = static_cast<std::size_t>(ctx.rank());
        auto& c = ctx.comm();
        bc[r].assign(in[r].begin(), in[r].begin() + static_cast<long>(len));
        c.broadcast(bc[r].data(), len, dtype::f64, root).wait();
        ag[r].assign(len * static_cast<std::size_t>(n), std::numeric_limits<double>::quiet_NaN());
        c.all_gather(in[r].data(), ag[r].data(), len, dtype::f64).wait();
        rs[r].assign(len, std::numeric_limits<double>::quiet_NaN());
        c.reduce_scatter(in[r].data(), rs[r].data(), len, dtype::f64, reduce_op::sum).wait();
        // Nobody passes the barrier before everyone reached it.
        after_barrier.fetch_add(1);
        c.barrier();
        if (after_barrier.load() != n) barrier_ok = false;
      });
      CHECK(barrier_ok.load());
      std::size_t bad_bc = 0, bad_ag = 0, bad_rs = 0;
      for (int r = 0; r < n; ++r) {
        auto ur = static_cast<std::size_t>(r);
        for (std::size_t i = 0; i < len; ++i) bad_bc += !(bc[ur][i] == in[static_cast<std::size_t>(root)][i]);
        for (int q = 0; q < n; ++q)
          for (std::size_t i = 0; i < len; ++i)
            bad_ag += !(ag[ur][static_cast<std::size_t>(q) * len + i] == in[static_cast<std::size_t>(q)][i]);
        for (std::size_t i = 0; i < len; ++i) {
          double s = in[0][ur * len + i];
          for (int q = 1; q < n; ++q) s += in[static_cast<std::size_t>(q)][ur * len + i];
          bad_rs += !(rs[ur][i] == s);
        }
      }
      CHECK(bad_bc == 0);
      CHECK(bad_ag == 0);
      CHECK(bad_rs == 0);
    }
  }
}

TEST_CASE("ThreadComm in-place all_gather (send inside recv at rank offset)") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const int n = 3;
  const std::size_t len = 11;
  auto in = per_rank_inputs<float>(n, len, seed);
  std::vector<std::vector<float>> buf(n);
  lockstep::run(lockstep::Threads{n}, [&](auto& ctx) {
    auto r = static_cast<std::size_t>(ctx.rank());
    buf[r].assign(len * n, -7.0f);
    std::copy(in[r].begin(), in[r].end(), buf[r].begin() + static_cast<long>(r * len));
    ctx.comm().all_gather(buf[r].data() + r * len, buf[r].data(), len, dtype::f32).wait();
  });
  for (int r = 0; r < n; ++r)
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < len; ++i)
        CHECK(buf[static_cast<std::size_t>(r)][static_cast<std::size_t>(q) * len + i] == in[static_cast<std::size_t>(q)][i]);
}

TEST_CASE("ThreadComm names a collective mismatch on every rank instead of hanging") {
  std::vector<std::string> msgs(2);
  CHECK_THROWS_AS(lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
                    std::vector<float> v(10, 1.0f);
                    try {
                      if (ctx.rank() == 0) ctx.comm().all_reduce(v.data(), v.data(), 10, dtype::f32, reduce_op::sum);
                      else ctx.comm().all_reduce(v.data(), v.data(), 9, dtype::f32, reduce_op::sum);
                    } catch (const lockstep::mismatch_error& e) {
                      msgs[static_cast<std::size_t>(ctx.rank())] = e.what();
                      throw;
                    }
                  }),
                  lockstep::mismatch_error);
  for (auto& m : msgs) {
    CHECK(m.find("rank 1 called all_reduce #0 of 9 f32") != std::string::npos);
    CHECK(m.find("rank 0 called all_reduce #0 of 10 f32") != std::string::npos);
  }
}

TEST_CASE("ThreadComm: a rank that never arrives times out - naming it") {
  auto comms = lockstep::ThreadComm::create_group(3, std::chrono::milliseconds(300));
  // Whichever waiting rank times out first throws timeout_error and aborts the group; the
  // other then throws aborted_error carrying that reason. Both name the missing rank.
  std::string what0, what1;
  auto t0 = std::chrono::steady_clock::now();
  std::thread a([&] {
    try { comms[0].barrier(); } catch (const lockstep::error& e) { what0 = e.what(); }
  });
  std::thread b([&] {
    try { comms[1].barrier(); } catch (const lockstep::error& e) { what1 = e.what(); }
  });
  a.join(); b.join();
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(secs < 5.0);
  CAPTURE(what0); CAPTURE(what1);
  CHECK(what0.find("rank(s) 2 that never arrived") != std::string::npos);
  CHECK(what1.find("rank(s) 2 that never arrived") != std::string::npos);
}

TEST_CASE("run(): one rank's exception releases the others and is rethrown on the caller") {
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {
                         if (ctx.rank() == 2) throw std::runtime_error("boom on rank 2");
                         ctx.comm().barrier();  // would wait forever for rank 2
                       }),
                       "boom on rank 2", std::runtime_error);
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);
}

TEST_CASE("ThreadComm rejects a bad root and an empty group") {
  CHECK_THROWS_AS(lockstep::ThreadComm::create_group(0), lockstep::config_error);
  CHECK_THROWS_AS(lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
                    float x = 1;
                    ctx.comm().broadcast(&x, 1, dtype::f32, 5);
                  }),
                  lockstep::config_error);
}

}  // TEST_SUITE
