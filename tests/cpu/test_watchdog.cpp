// Watchdog (lockstep/launch/watchdog.hpp) with real processes: each rank is a forked child with its
// own Watchdog; rank 0's child hosts the TcpStore, as under run(Processes). One rank is
// killed with SIGKILL, stopped with SIGSTOP, or fails on its own; the others must learn which
// rank and what happened, within the bounds measured here. The rank, the world size and the
// timeout are random per run (the seed is printed).
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/launch/detail/teardown_deadline.hpp>
#include <lockstep/launch/watchdog.hpp>
#include <lockstep/store/store.hpp>
#include <lockstep/store/tcp_store.hpp>

#include "net_util.hpp"
#include "test_util.hpp"

using namespace std::chrono_literals;
using clk = std::chrono::steady_clock;

namespace {

// Child exit codes.
constexpr int got_expected = 10;  // on_failure ran with a text containing the expected words
constexpr int got_other = 11;     // ... with another text
constexpr int got_nothing = 12;   // no failure within the child's patience
constexpr int clean_exit = 0;

using lockstep_test::free_port;

struct job {
  int world = 3;
  int port = 0;
  std::string token;
  lockstep::watchdog_options opt;
};

//! What one rank's child does once its Watchdog runs. `failed` is set by on_failure.
struct rank_env {
  int rank;
  lockstep::TcpStore& store;
  lockstep::Watchdog& dog;
  std::function<std::optional<std::string>(std::chrono::milliseconds)> wait_failure;
};

struct child {
  pid_t pid = -1;
  int status = -1;
  double exited_after = -1;  // seconds from the parent's mark
};

//! Forks `world` children running body(rank_env) → exit code; each writes one byte to the
//! ready pipe once its Watchdog runs. Returns when all are ready.
std::vector<child> start(const job& j, const std::function<int(rank_env&)>& body,
                         const lockstep::Watchdog::poll_fn& poll_for_rank0 = {}, int poll_rank = -1,
                         bool react = true) {
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<child> kids(static_cast<std::size_t>(j.world));
  for (int r = 0; r < j.world; ++r) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(ready[0]);
      int rc = 1;
      try {
        lockstep::TcpStore store("127.0.0.1", j.port, r == 0, j.world, j.token, 20s);
        std::mutex m;
        std::condition_variable cv;
        std::optional<std::string> why;
        lockstep::Watchdog dog(
            "127.0.0.1", j.port, r, j.world, j.token,
            [&](const std::string& w) {
              if (!react) return;  // a rank whose main thread never notices
              std::lock_guard lk(m);
              why = w;
              cv.notify_all();
            },
            r == poll_rank ? poll_for_rank0 : lockstep::Watchdog::poll_fn{}, j.opt);
        rank_env env{r, store, dog, [&](std::chrono::milliseconds patience) {
                       std::unique_lock lk(m);
                       cv.wait_for(lk, patience, [&] { return why.has_value(); });
                       return why;
                     }};
        const char b = 1;
        if (::write(ready[1], &b, 1) != 1) ::_exit(3);
        rc = body(env);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        rc = 2;
      }
      std::fflush(stderr);
      ::_exit(rc);
    }
    kids[static_cast<std::size_t>(r)].pid = pid;
  }
  ::close(ready[1]);
  int n = 0;
  char b;
  while (n < j.world && ::read(ready[0], &b, 1) == 1) ++n;
  ::close(ready[0]);
  if (n != j.world) {  // a rank failed to start: end the others before failing the test
    for (auto& k : kids) {
      ::kill(k.pid, SIGKILL);
      ::waitpid(k.pid, nullptr, 0);
    }
  }
  REQUIRE_MESSAGE(n == j.world, "only " << n << " of " << j.world << " ranks started");
  return kids;
}

//! Waits for every child still running (at most `limit`); times are from `mark`.
void reap(std::vector<child>& kids, clk::time_point mark, std::chrono::seconds limit) {
  const auto deadline = clk::now() + limit;
  while (clk::now() < deadline) {
    bool left = false;
    for (auto& k : kids) {
      if (k.status != -1) continue;
      int st = 0;
      if (::waitpid(k.pid, &st, WNOHANG) == k.pid) {
        k.status = st;
        k.exited_after = std::chrono::duration<double>(clk::now() - mark).count();
      } else {
        left = true;
      }
    }
    if (!left) return;
    std::this_thread::sleep_for(5ms);
  }
  for (auto& k : kids)
    if (k.status == -1) {
      ::kill(k.pid, SIGKILL);
      ::waitpid(k.pid, &k.status, 0);
      FAIL_CHECK("a rank was still running after ", limit.count(), " s");
    }
}

int exit_code(const child& k) { return WIFEXITED(k.status) ? WEXITSTATUS(k.status) : 128 + WTERMSIG(k.status); }

//! Waits for every child (at most 40 s, times from now) and checks each ended with `code`.
void reap_expecting(std::vector<child>& kids, int code) {
  reap(kids, clk::now(), 40s);
  for (const auto& k : kids) CHECK(exit_code(k) == code);
}

//! Survivors wait for the failure and check it names `expect`.
int expect_failure(rank_env& e, const std::string& expect) {
  const auto why = e.wait_failure(30s);
  if (!why) return got_nothing;
  std::fprintf(stderr, "rank %d was told: %s\n", e.rank, why->c_str());
  return why->find(expect) != std::string::npos ? got_expected : got_other;
}

//! Every rank but `idle` waits for a failure naming `expect`; `idle` only sleeps (the test
//! kills or stops it).
std::vector<child> start_waiting(const job& j, int idle, const std::string& expect) {
  return start(j, [idle, expect](rank_env& e) {
    if (e.rank == idle) {
      std::this_thread::sleep_for(60s);
      return 0;
    }
    return expect_failure(e, expect);
  });
}

int random_peer(std::mt19937_64& rng, const job& j) {  // any rank but 0 (the store's host)
  return 1 + static_cast<int>(rng() % static_cast<unsigned>(j.world - 1));
}

job random_job(std::mt19937_64& rng) {
  job j;
  j.world = 3 + static_cast<int>(rng() % 3);  // 3..5
  j.port = free_port();
  j.token = "job-" + std::to_string(rng());
  j.opt.period = 50ms;
  j.opt.timeout = std::chrono::milliseconds(1500 + rng() % 1000);
  j.opt.grace = 0ms;
  return j;
}

//! A test's random choices: a fresh seed (CAPTURE it), its generator and a job from it.
struct scenario {
  std::uint64_t seed = lockstep_test::fresh_seed();
  std::mt19937_64 rng{seed};
  job j = random_job(rng);
};

//! Starts the job, then sends `sig` to a random rank other than 0 (after a random pause);
//! every other rank must be told "rank V <what>". Returns the others (reaped, with their exit
//! times from the signal) and the victim (killed and reaped afterwards).
std::pair<std::vector<child>, child> lose_a_rank(scenario& sc, int sig, const std::string& what) {
  const int victim = random_peer(sc.rng, sc.j);
  INFO("world ", sc.j.world, ", victim rank ", victim);
  auto kids = start_waiting(sc.j, victim, "rank " + std::to_string(victim) + " " + what);
  std::this_thread::sleep_for(std::chrono::milliseconds(100 + sc.rng() % 300));
  child lost = kids[static_cast<std::size_t>(victim)];
  kids.erase(kids.begin() + victim);
  const auto mark = clk::now();
  REQUIRE(::kill(lost.pid, sig) == 0);
  reap(kids, mark, 40s);
  if (sig != SIGKILL) {
    ::kill(lost.pid, SIGKILL);
    ::kill(lost.pid, SIGCONT);
  }
  ::waitpid(lost.pid, &lost.status, 0);
  return {kids, lost};
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("Watchdog: a rank killed with SIGKILL is named on every other rank within a second") {
  scenario sc;
  CAPTURE(sc.seed);
  const auto [survivors, victim] = lose_a_rank(sc, SIGKILL, "left");
  CAPTURE(victim);
  CHECK(exit_code(victim) == 128 + SIGKILL);
  for (const auto& k : survivors) {
    CHECK(exit_code(k) == got_expected);
    CHECK(k.exited_after < 1.0);  // the store notices the closed connection at once
    MESSAGE("a survivor knew after ", k.exited_after, " s");
  }
}

TEST_CASE("Watchdog: a stopped rank is named after the timeout - not before") {
  scenario sc;
  CAPTURE(sc.seed);
  const auto [survivors, victim] = lose_a_rank(sc, SIGSTOP, "stopped responding");
  const double t = std::chrono::duration<double>(sc.j.opt.timeout).count();
  for (const auto& k : survivors) {
    CHECK(exit_code(k) == got_expected);
    // The last heartbeat came at most one period before the stop.
    CHECK(k.exited_after > t - 0.3);
    CHECK(k.exited_after < t + 1.5);
    MESSAGE("timeout ", t, " s: a survivor knew after ", k.exited_after, " s");
  }
}

TEST_CASE("Watchdog: a failure found by one rank's poll reaches every rank with its text") {
  scenario sc;
  CAPTURE(sc.seed);
  auto& rng = sc.rng;
  job& j = sc.j;
  const int victim = static_cast<int>(rng() % static_cast<unsigned>(j.world));
  const int polls = 3 + static_cast<int>(rng() % 10);
  const std::string text = "rank " + std::to_string(victim) + ": disk " + std::to_string(rng() % 1000) + " is full";
  CAPTURE(victim);
  std::atomic<int> n{0};
  auto poll = [&]() -> std::optional<std::string> {
    if (++n < polls) return std::nullopt;
    return text;
  };
  auto kids = start(j, [&](rank_env& e) { return expect_failure(e, text); }, poll, victim);
  reap_expecting(kids, got_expected);
}

TEST_CASE("Watchdog: rank 0 - the store's host - killed is named by the others") {
  scenario sc;
  CAPTURE(sc.seed);
  job& j = sc.j;
  auto kids = start(j, [&](rank_env& e) {
    if (e.rank == 0) {
      std::this_thread::sleep_for(60s);
      return 0;
    }
    const int rc = expect_failure(e, "rank 0 left");
    // The main thread then fails too and reports it, as run(Processes) does: that must not
    // wait on the store that is gone with rank 0.
    e.dog.report("rank " + std::to_string(e.rank) + " failed as well");
    return rc;
  });
  const auto mark = clk::now();
  REQUIRE(::kill(kids[0].pid, SIGKILL) == 0);
  reap(kids, mark, 40s);
  CHECK(exit_code(kids[0]) == 128 + SIGKILL);
  for (std::size_t r = 1; r < kids.size(); ++r) {
    CHECK(exit_code(kids[r]) == got_expected);
    CHECK(kids[r].exited_after < 1.0);
  }
}

TEST_CASE("Watchdog: a clean finish in any order reports nothing") {
  scenario sc;
  CAPTURE(sc.seed);
  auto& rng = sc.rng;
  job& j = sc.j;
  std::vector<int> work_ms;
  for (int r = 0; r < j.world; ++r) work_ms.push_back(static_cast<int>(rng() % 700));
  auto kids = start(j, [&](rank_env& e) {
    std::this_thread::sleep_for(std::chrono::milliseconds(work_ms[static_cast<std::size_t>(e.rank)]));
    e.dog.stop();  // a clean leave, then the job's last barrier (rank 0 hosts the store)
    lockstep::final_barrier(e.store, "finished", e.rank);
    return e.dog.failure() ? got_other : clean_exit;
  });
  reap_expecting(kids, clean_exit);
}

TEST_CASE("Watchdog: a rank whose main thread never returns is ended after the grace period") {
  scenario sc;
  CAPTURE(sc.seed);
  auto& rng = sc.rng;
  job& j = sc.j;
  j.opt.grace = std::chrono::milliseconds(500 + rng() % 1000);
  const int victim = random_peer(rng, j);
  auto kids = start(
      j,
      [&](rank_env& e) {
        std::this_thread::sleep_for(60s);  // never looks at the failure
        (void)e;
        return got_nothing;
      },
      {}, -1, /*react=*/false);
  const auto mark = clk::now();
  REQUIRE(::kill(kids[static_cast<std::size_t>(victim)].pid, SIGKILL) == 0);
  reap(kids, mark, 40s);
  const double g = std::chrono::duration<double>(j.opt.grace).count();
  for (int r = 0; r < j.world; ++r) {
    if (r == victim) continue;
    const auto& k = kids[static_cast<std::size_t>(r)];
    CHECK(exit_code(k) == 1);
    CHECK(k.exited_after > g);
    CHECK(k.exited_after < g + 1.5);
  }
}

// run(Processes)'s teardown after a failure (launch/detail/teardown_deadline.hpp): a child
// arms the deadline with a random LOCKSTEP_ABORT_GRACE, then hangs (it must be ended, status 1,
// within the grace plus a margin, naming the failure), or finishes its teardown in time (it
// must end normally, also after the grace has passed), or never arms it.
TEST_CASE("teardown deadline: a teardown that hangs past LOCKSTEP_ABORT_GRACE ends the process and names the failure") {
  std::mt19937_64 rng(std::random_device{}());
  const double grace = 1.0 + static_cast<double>(rng() % 600) / 1000.0;
  CAPTURE(grace);
  const lockstep_test::temp_dir tmp("teardown");
  const std::string& dir = tmp.path;
  const std::string why = "rank " + std::to_string(1 + rng() % 7) + " left: test " + std::to_string(rng() % 1000);
  // 0: hangs after arm(); 1: tears down in 0.2 s, then lives on past the grace; 2: never armed.
  std::vector<child> kids(3);
  const auto mark = clk::now();
  for (int mode = 0; mode < 3; ++mode) {
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      std::FILE* err = std::freopen((dir + "/err" + std::to_string(mode)).c_str(), "w", stderr);
      (void)err;
      ::setenv("LOCKSTEP_ABORT_GRACE", std::to_string(grace).c_str(), 1);
      {
        lockstep::detail::teardown_deadline deadline;
        if (mode != 2) deadline.arm(3, why);
        std::this_thread::sleep_for(mode == 0 ? std::chrono::milliseconds(30000) : std::chrono::milliseconds(200));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<long long>(grace * 1000) + 500));
      ::_exit(0);
    }
    kids[static_cast<std::size_t>(mode)].pid = pid;
  }
  reap(kids, mark, 20s);
  const auto text = [&](int mode) {
    std::FILE* f = std::fopen((dir + "/err" + std::to_string(mode)).c_str(), "r");
    std::string out;
    if (f == nullptr) return out;
    char buf[512];
    while (std::fgets(buf, sizeof buf, f) != nullptr) out += buf;
    std::fclose(f);
    return out;
  };
  CHECK(exit_code(kids[0]) == 1);
  CHECK(kids[0].exited_after > grace);
  CHECK(kids[0].exited_after < grace + 1.5);
  CHECK(text(0).find("lockstep: rank 3 exits: " + why) != std::string::npos);
  for (int mode : {1, 2}) {
    CAPTURE(mode);
    CHECK(exit_code(kids[static_cast<std::size_t>(mode)]) == 0);
    CHECK(text(mode).empty());
  }
}

TEST_CASE("Watchdog: bad options and an unreachable store are clear errors") {
  lockstep::watchdog_options bad;
  bad.period = 0ms;
  CHECK_THROWS_AS(
      lockstep::Watchdog("127.0.0.1", 1, 1, 2, "t", [](const std::string&) {}, {}, bad), lockstep::config_error);
  CHECK_THROWS_AS(lockstep::Watchdog("127.0.0.1", 1, 1, 2, "t", {}), lockstep::config_error);
  lockstep::watchdog_options quick;
  quick.timeout = 600ms;
  CHECK_THROWS_WITH_AS(lockstep::Watchdog(
                           "127.0.0.1", free_port(), 1, 2, "t", [](const std::string&) {}, {}, quick),
                       doctest::Contains("could not connect"), lockstep::timeout_error);
}

}  // TEST_SUITE
