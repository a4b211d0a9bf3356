// Shrinking a job in place (issue 29), its first part: the survivors of a failure agree on who
// goes on through the store — one decision on every survivor, with one or two ranks gone, a
// gone rank nobody named, a rank that reports too late, the coordinator gone, too few left,
// and changes one after another; on HashStore and on TcpStore (ranks as threads).
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/elastic/membership.hpp"
#include "lockstep/store/hash_store.hpp"
#include "lockstep/store/tcp_store.hpp"
#include "test_util.hpp"

namespace {

using namespace std::chrono_literals;
using lockstep::membership;
using lockstep::membership_change;
using lockstep::SurvivorOptions;

// What each survivor's agree_on_survivors returned or threw.
struct outcome {
  std::optional<membership_change> change;
  std::string error;
};

// Every rank of `now` not in `dead` calls agree_on_survivors on its own thread with the gone
// ranks `names[job rank]` it knows of (after `delay[job rank]`), through its own store handle.
template <class StoreOf>
std::map<int, outcome> survive(StoreOf&& store_of, const membership& now, const std::set<int>& dead,
                               std::map<int, std::vector<int>> names, const SurvivorOptions& o,
                               std::map<int, std::chrono::milliseconds> delay = {}) {
  std::map<int, outcome> out;
  std::mutex m;
  std::vector<std::thread> threads;
  for (int place = 0; place < now.size(); ++place) {
    const int job = now.ranks[static_cast<std::size_t>(place)];
    if (dead.count(job)) continue;
    threads.emplace_back([&, place, job] {
      membership mine = now;
      mine.rank = place;
      outcome got;
      try {
        if (delay.count(job)) std::this_thread::sleep_for(delay[job]);
        got.change = lockstep::agree_on_survivors(store_of(job), mine, names[job], o);
      } catch (const std::exception& e) {
        got.error = e.what();
      }
      std::lock_guard lk(m);
      out[job] = got;
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::vector<int> without(const std::vector<int>& ranks, const std::set<int>& gone) {
  std::vector<int> out;
  for (int r : ranks)
    if (!gone.count(r)) out.push_back(r);
  return out;
}

// Every survivor got the same decision: the members of `now` but `gone`, its own place in it.
void check_same_decision(const std::map<int, outcome>& got, const membership& now, const std::set<int>& gone) {
  const std::vector<int> expected = without(now.ranks, gone);
  for (const auto& [job, o] : got) {
    CAPTURE(job);
    CAPTURE(o.error);
    REQUIRE(o.change.has_value());
    CHECK(o.change->before.ranks == now.ranks);
    CHECK(o.change->after.epoch == now.epoch + 1);
    CHECK(o.change->after.ranks == expected);
    CHECK(o.change->after.job_rank() == job);
    CHECK(o.change->gone == std::vector<int>(gone.begin(), gone.end()));
  }
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("survivors agree on who goes on: random gone ranks - named by some or by none") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    const int world = 2 + static_cast<int>(rng() % 7);
    const membership now = membership::whole(world, 0);
    std::set<int> dead;  // never job rank 0: the coordinator (its loss is the test below)
    const int deaths = 1 + static_cast<int>(rng() % std::min(2, world - 1));
    while (static_cast<int>(dead.size()) < deaths) dead.insert(1 + static_cast<int>(rng() % (world - 1)));
    std::map<int, std::vector<int>> names;  // each survivor knows of some of the dead, or of none
    const bool nobody_names = trial % 3 == 0;
    for (int r = 0; r < world; ++r)
      for (int d : dead)
        if (!nobody_names && rng() % 2) names[r].push_back(d);
    CAPTURE(world);
    CAPTURE(nobody_names);
    lockstep::HashStore st(world, 10s);
    const SurvivorOptions o{.settle = 300ms};
    const auto t0 = std::chrono::steady_clock::now();
    const auto got = survive([&](int) -> lockstep::HashStore& { return st; }, now, dead, names, o);
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(got.size() == static_cast<std::size_t>(world) - dead.size());
    check_same_decision(got, now, dead);
    // Unnamed dead ranks cost the settle time; named ones do not wait for it.
    bool all_named = true;
    for (int d : dead) {
      bool named = false;
      for (const auto& [r, n] : names)
        if (!dead.count(r) && std::count(n.begin(), n.end(), d)) named = true;
      all_named = all_named && named;
    }
    if (!all_named) CHECK(took >= 300ms);
    else CHECK(took < 300ms);
  }
}

TEST_CASE("survivors agree through a TcpStore - twice in a row (epochs 1 and 2)") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 4 + static_cast<int>(rng() % 3);
  const std::string token = "elastic-" + std::to_string(rng());
  lockstep::TcpStore server("127.0.0.1", 0, true, world, token, 10s);
  std::map<int, std::unique_ptr<lockstep::TcpStore>> clients;
  for (int r = 1; r < world; ++r)
    clients[r] = std::make_unique<lockstep::TcpStore>("127.0.0.1", server.port(), false, world, token, 10s);
  auto store_of = [&](int job) -> lockstep::TcpStore& { return job == 0 ? server : *clients[job]; };
  const SurvivorOptions o{.settle = 2s};
  // First change: the last rank gone, named by rank 1.
  const membership now = membership::whole(world, 0);
  const std::set<int> first{world - 1};
  const auto a = survive(store_of, now, first, {{1, {world - 1}}}, o);
  check_same_decision(a, now, first);
  // Second: job rank 1 gone too, named by everyone; the keys of epoch 1 are apart from epoch 0's.
  const membership after = a.at(0).change->after;
  const std::set<int> second{1};
  std::map<int, std::vector<int>> names;
  for (int r : after.ranks) names[r] = {1};
  const auto b = survive(store_of, after, second, names, o);
  check_same_decision(b, after, second);
  CHECK(b.at(0).change->after.epoch == 2);
  CHECK(b.at(0).change->after.ranks == without(now.ranks, {1, world - 1}));
}

TEST_CASE("a rank that reports after the decision is out - others go on without it") {
  const int world = 4;
  lockstep::HashStore st(world, 10s);
  const membership now = membership::whole(world, 0);
  // Rank 2 is slow: it reports 600 ms late, after the coordinator's 200 ms settle.
  const auto got =
      survive([&](int) -> lockstep::HashStore& { return st; }, now, {}, {}, {.settle = 200ms}, {{2, 600ms}});
  CHECK(got.at(2).error.find("rank 2 reported after the survivors were decided (job ranks 0, 1, 3 go on") !=
        std::string::npos);
  std::map<int, outcome> others = got;
  others.erase(2);
  check_same_decision(others, now, {2});
}

TEST_CASE("the coordinator gone or too few ranks left: every survivor is told why") {
  const int world = 5;
  const membership now = membership::whole(world, 0);
  {  // Job rank 0 (the coordinator) gone: named by rank 1, unknown to the others (they time out).
    lockstep::HashStore st(world, 700ms);
    const auto got = survive([&](int) -> lockstep::HashStore& { return st; }, now, {0}, {{1, {0}}}, {});
    CHECK(got.at(1).error.find("job rank 0, which coordinates changes of membership") != std::string::npos);
    for (int r : {2, 3, 4}) {
      CAPTURE(r);
      CHECK(got.at(r).error.find("no decision on who goes on came from job rank 0") != std::string::npos);
    }
  }
  {  // Three of five gone, two left, and at least three needed.
    lockstep::HashStore st(world, 10s);
    const auto got = survive([&](int) -> lockstep::HashStore& { return st; }, now, {1, 3, 4}, {{0, {1, 3, 4}}},
                             {.min_ranks = 3, .settle = 5s});
    REQUIRE(got.size() == 2);
    for (const auto& [r, o] : got) {
      CAPTURE(r);
      CHECK(o.error.find("the job cannot go on: 2 rank(s) remain (job ranks 0, 2), fewer than "
                         "SurvivorOptions::min_ranks = 3") != std::string::npos);
    }
  }
  CHECK_THROWS_AS(membership::whole(3, 3), lockstep::config_error);
}
}  // TEST_SUITE
