// MpiStore: the collective rendezvous store over MPI (set local; get, wait, check, add
// collective), and the generic lockstep::barrier on top of it.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include <lockstep/mpi/mpi_store.hpp>

#include "mpi_util.hpp"

using namespace lockstep_mpi_test;

TEST_SUITE("mpi") {

TEST_CASE("MpiStore: values set on one rank reach every rank") {
  const auto seed = shared_seed();
  CAPTURE(seed);
  lockstep::MpiStore st;
  const int me = st.rank(), n = st.world();
  CHECK(n == world_size());
  // Rank r's value for key "k/r" is derived from the seed: every rank knows what to expect.
  auto expected = [&](int r) {
    std::string s = "value of rank " + std::to_string(r) + ": ";
    for (std::size_t i = 0; i < 100 + static_cast<std::size_t>(r) * 37; ++i)
      s += static_cast<char>(splitmix(seed + static_cast<std::uint64_t>(r) * 1000 + i) & 0xff);
    return s;
  };
  st.set("k/" + std::to_string(me), lockstep::bytes_of(expected(me)));
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(lockstep::string_of(st.get("k/" + std::to_string(r))) == expected(r));
  }
  // Keys set on several ranks: the lowest rank's value wins, alike everywhere.
  st.set("shared", lockstep::bytes_of(std::to_string(me + 100)));
  CHECK(lockstep::string_of(st.get("shared")) == "100");
  // Empty values are values.
  if (me == n - 1) st.set("empty", {});
  CHECK(st.get("empty").empty());

  std::vector<std::string> keys{"k/0", "k/" + std::to_string(n - 1), "empty"};
  CHECK(st.check(keys));
  st.wait(keys, std::chrono::milliseconds(100));
  CHECK_FALSE(st.check({"k/0", "never-set"}));
  CHECK_THROWS_AS(st.wait({"never-set"}, std::chrono::milliseconds(100)), lockstep::timeout_error);
  CHECK_THROWS_AS(st.get("never-set"), lockstep::timeout_error);

  auto b = st.broadcast_bytes(n - 1, lockstep::bytes_of(expected(me)));
  CHECK(lockstep::string_of(b) == expected(n - 1));
}

TEST_CASE("MpiStore: counters and the generic barrier") {
  lockstep::MpiStore st;
  const int me = st.rank(), n = st.world();
  const std::int64_t total = std::int64_t{n} * (n + 1) / 2;  // Σ (r + 1)
  CHECK(st.add("c", me + 1) == total);
  CHECK(st.add("c", 0) == total);
  CHECK(st.add("c", -(me + 1)) == 0);
  for (int i = 0; i < 3; ++i) lockstep::barrier(st, "ready");
  // Limits are checked before anything is sent (alike on every rank).
  CHECK_THROWS_AS(st.set(std::string(600, 'x'), {}), lockstep::config_error);
  CHECK_THROWS_AS(st.get(""), lockstep::config_error);
  std::vector<std::byte> big(st.limits().max_value_bytes + 1);
  CHECK_THROWS_AS(st.set("big", big), lockstep::config_error);
  CHECK_THROWS_AS(st.broadcast_bytes(n, {}), lockstep::config_error);
}

}  // TEST_SUITE
