// ThreadComm::split: sub-groups of uneven sizes pass the communicator conformance suite, ranks
// are ordered by key, splits nest, and a sub-group shares the job's failure handling — a rank
// that fails or leaves ends the waits of every group, not after LOCKSTEP_TIMEOUT.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "comm_conformance.hpp"
#include "test_util.hpp"

namespace {

// The world ranks of sub's members, in sub's rank order (an all_gather over sub).
std::vector<std::int64_t> members(lockstep::ThreadComm& sub, int world_rank) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(sub.size()));
  const std::int64_t me = world_rank;
  sub.all_gather(&me, all.data(), 1, lockstep::dtype::i64);
  return all;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("split: sub-groups of uneven sizes pass the conformance suite - ranked by key") {
  const auto o = lockstep_test::thread_comm_options(lockstep_test::fresh_seed());
  lockstep::run(lockstep::Threads{5}, [&](auto& ctx) {
    const int r = ctx.rank();
    auto sub = ctx.comm().split(r < 3 ? 0 : 1, -r);  // sizes 3 and 2, ranks in reverse order
    CHECK(sub.size() == (r < 3 ? 3 : 2));
    CHECK(members(sub, r) == (r < 3 ? std::vector<std::int64_t>{2, 1, 0} : std::vector<std::int64_t>{4, 3}));
    lockstep_test::check_collectives(sub, o);
    lockstep_test::check_collectives(ctx.comm(), o);  // the parent still works
  });
}

TEST_CASE("split: equal keys keep the parent's order - splits nest - one colour is a copy") {
  lockstep::run(lockstep::Threads{6}, [&](auto& ctx) {
    const int r = ctx.rank();
    auto even_odd = ctx.comm().split(r % 2, 0);
    CHECK(members(even_odd, r) == (r % 2 ? std::vector<std::int64_t>{1, 3, 5} : std::vector<std::int64_t>{0, 2, 4}));
    auto inner = even_odd.split(even_odd.rank() == 0 ? 0 : 1, 0);  // {first}, {the other two}
    CHECK(inner.size() == (even_odd.rank() == 0 ? 1 : 2));
    auto copy = ctx.comm().split(7, r);
    CHECK(copy.size() == 6);
    CHECK(copy.rank() == r);
    float v = static_cast<float>(r);
    copy.all_reduce(&v, &v, 1, lockstep::dtype::f32, lockstep::reduce_op::sum);
    CHECK(v == 15.0f);
  });
}

TEST_CASE("split: a rank that fails releases the ranks waiting in other groups at once") {
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{4},
                                     [](auto& ctx) {
                                       auto sub = ctx.comm().split(ctx.rank() % 2, ctx.rank());
                                       if (ctx.rank() == 1)
                                         throw lockstep::config_error("deliberate failure on rank 1");
                                       float v = 1;
                                       sub.all_reduce(&v, &v, 1, lockstep::dtype::f32,
                                                      lockstep::reduce_op::sum);  // rank 3 waits for 1
                                       ctx.comm().barrier();
                                     }),
                       doctest::Contains("deliberate failure on rank 1"), lockstep::config_error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));  // not the 60 s timeout
}

TEST_CASE("split: every released rank names the rank that failed first - in every group") {
  // Ranks blocked in three levels of groups (pairs, fours, the world) are released by rank 4's
  // failure while each released rank reports its own release: the first failure must reach
  // every group, whichever report gets there first.
  for (int round = 0; round < 40; ++round) {
    std::vector<std::string> seen(8);
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{8},
                                       [&](auto& ctx) {
                                         const int r = ctx.rank();
                                         auto pair = ctx.comm().split(r / 2, r);
                                         auto four = ctx.comm().split(r / 4, r);
                                         if (r == 4) throw lockstep::config_error("deliberate failure on rank 4");
                                         try {
                                           float v = 1;
                                           pair.all_reduce(&v, &v, 1, lockstep::dtype::f32, lockstep::reduce_op::sum);
                                           four.all_reduce(&v, &v, 1, lockstep::dtype::f32, lockstep::reduce_op::sum);
                                           ctx.comm().barrier();
                                         } catch (const lockstep::aborted_error& e) {
                                           seen[static_cast<std::size_t>(r)] = e.what();
                                           throw;
                                         }
                                       }),
                         doctest::Contains("deliberate failure on rank 4"), lockstep::config_error);
    for (int r = 0; r < 8; ++r) {
      if (r == 4) continue;
      INFO("round " << round << ", rank " << r << ": " << seen[static_cast<std::size_t>(r)]);
      const std::string want =
          "rank " + std::to_string(r) +
          " stopped waiting because another rank failed: rank 4 failed: deliberate failure on rank 4";
      CHECK(seen[static_cast<std::size_t>(r)].starts_with(want));
    }
  }
}

TEST_CASE("split: a rank whose body returned is reported to a sub-group peer waiting for it") {
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{4},
                                     [](auto& ctx) {
                                       auto sub = ctx.comm().split(ctx.rank() % 2, ctx.rank());
                                       if (ctx.rank() == 3) return;
                                       float v = 1;
                                       sub.all_reduce(&v, &v, 1, lockstep::dtype::f32, lockstep::reduce_op::sum);
                                     }),
                       doctest::Contains("rank 3 has left the training body; rank 1 is waiting"),
                       lockstep::mismatch_error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

TEST_CASE("split: a negative colour is refused") {
  CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{2}, [](auto& ctx) { (void)ctx.comm().split(-1, 0); }),
                       doctest::Contains("colour -1 is negative"), lockstep::config_error);
}

}  // TEST_SUITE
