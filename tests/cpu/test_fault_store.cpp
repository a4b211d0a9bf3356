// The fault suite's stale rendezvous (docs/reliability.md, scenario 6): a process of another
// run meets this run's store — a new run starting while an earlier one still holds the port,
// a process left over from an earlier run reconnecting to a new store, a new run reusing an
// old FileStore directory. Each is refused at once with a message naming both runs (by run id,
// never the token) and what to do, and the generations never mix: no key of one run reaches
// the other. Processes are forked before any store thread starts; every wait is bounded.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <lockstep/launch/job_store.hpp>
#include <lockstep/launch/launch_env.hpp>
#include <lockstep/store/file_store.hpp>
#include <lockstep/store/store.hpp>
#include <lockstep/store/tcp_store.hpp>

#include "net_util.hpp"
#include "stderr_capture.hpp"
#include "test_util.hpp"

using namespace std::chrono_literals;
using lockstep::FileStore;
using lockstep::run_id_of;
using lockstep::TcpStore;
using clk = std::chrono::steady_clock;

namespace {

double seconds_since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

//! Runs `attempt`, which must throw E (FAIL_CHECK(`unexpected`) if it returns); returns E's
//! message and the seconds from the fault (t0) to it, both shown with MESSAGE (as `who`).
template <class E, class F>
std::pair<std::string, double> refusal(clk::time_point t0, const char* who, const char* unexpected, F attempt) {
  std::string msg;
  try {
    attempt();
    FAIL_CHECK(unexpected);
  } catch (const E& e) {
    msg = e.what();
  }
  const double fault_to_throw = seconds_since(t0);
  MESSAGE(who, ": ", msg);
  MESSAGE("fault to its error: ", fault_to_throw, " s");
  return {msg, fault_to_throw};
}

//! A job token like lockstep-run's: 32 hex digits.
std::string random_token(std::mt19937_64& rng) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string t(32, '0');
  for (auto& c : t) c = hex[rng() % 16];
  return t;
}

std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

using lockstep_test::temp_dir;

//! A forked process: body's return value is its exit status, its stderr goes to a file.
struct child {
  pid_t pid = -1;
  std::string err_path;
  int status = -1;
  double exited_after = -1;  // seconds from start to exit, as seen by wait_all
};

child spawn(const std::string& err_path, const std::function<int()>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  child c;
  c.err_path = err_path;
  c.pid = ::fork();
  REQUIRE(c.pid >= 0);
  if (c.pid == 0) {
    const int fd = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) ::dup2(fd, STDERR_FILENO);
    int rc = 90;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "unexpected: %s\n", e.what());
    }
    std::fflush(stderr);
    ::_exit(rc);  // never return into the test runner
  }
  return c;
}

//! Waits for every child until `limit` after `start`; kills what is left (a failed check).
void wait_all(std::vector<child*> kids, clk::time_point start, std::chrono::seconds limit) {
  const auto deadline = start + limit;
  std::size_t left = kids.size();
  while (left > 0 && clk::now() < deadline) {
    for (child* k : kids) {
      if (k->status != -1) continue;
      int st = 0;
      if (::waitpid(k->pid, &st, WNOHANG) == k->pid) {
        k->status = st;
        k->exited_after = seconds_since(start);
        --left;
      }
    }
    std::this_thread::sleep_for(2ms);
  }
  for (child* k : kids)
    if (k->status == -1) {
      ::kill(k->pid, SIGKILL);
      ::waitpid(k->pid, &k->status, 0);
      FAIL_CHECK("a child did not finish within ", limit.count(), " s (killed); its stderr: ", read_text(k->err_path));
    }
}

int exit_code(const child& k) { return WIFEXITED(k.status) ? WEXITSTATUS(k.status) : -1; }

//! The environment lockstep-run gives rank `rank` of a run, and nothing else.
void lockstep_run_env(int rank, int world, int port, const std::string& token) {
  ::clearenv();
  const std::string r = std::to_string(rank), w = std::to_string(world), p = std::to_string(port);
  for (const char* v : {"RANK", "LOCAL_RANK", "LOCKSTEP_RANK", "LOCKSTEP_LOCAL_RANK"}) ::setenv(v, r.c_str(), 1);
  for (const char* v : {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCKSTEP_WORLD_SIZE", "LOCKSTEP_LOCAL_WORLD_SIZE"})
    ::setenv(v, w.c_str(), 1);
  for (const char* v : {"MASTER_ADDR", "LOCKSTEP_MASTER_ADDR"}) ::setenv(v, "127.0.0.1", 1);
  for (const char* v : {"MASTER_PORT", "LOCKSTEP_MASTER_PORT"}) ::setenv(v, p.c_str(), 1);
  ::setenv("LOCKSTEP_JOB_TOKEN", token.c_str(), 1);
  ::setenv("LOCKSTEP_LAUNCHER", "lockstep-run", 1);
}

//! What this process writes to stderr (the store server's log) until finish(), captured and still shown.
struct stderr_capture : lockstep_test::stderr_capture {
  stderr_capture() : lockstep_test::stderr_capture(true) {}
};

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE(
    "fault_stale_rendezvous_other_run_refused: a new run meeting an earlier run's store is refused on every rank") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string token_old = random_token(rng), token_new = random_token(rng);
  const std::string id_old = run_id_of(token_old), id_new = run_id_of(token_new);
  REQUIRE(id_old != id_new);
  const auto nccl_id = random_bytes(rng, 128);
  const int port = lockstep_test::free_port();
  const std::string p = std::to_string(port);
  temp_dir dir("lockstep_fault_store");
  int go[2], ready[2];
  REQUIRE(::pipe(go) == 0);
  REQUIRE(::pipe(ready) == 0);

  // The earlier run's rank 0, still alive: it hosts the store and keeps it until told.
  child old0 = spawn(dir.path + "/old0", [&] {
    ::close(go[1]);
    ::close(ready[0]);
    lockstep_run_env(0, 2, port, token_old);
    auto store = lockstep::job_store(*lockstep::detect_launcher(), 10s);
    store.set("lockstep/nccl_id", nccl_id);
    [[maybe_unused]] auto n = ::write(ready[1], "1", 1);
    pollfd pf{go[0], POLLIN, 0};
    ::poll(&pf, 1, 30000);
    // Nothing of the new run reached it.
    const bool untouched = store.get("lockstep/nccl_id") == nccl_id && !store.check({"new_run/was_here"}) &&
                           store.add("new_run/count", 0) == 0;
    return untouched ? 0 : 5;
  });
  ::close(go[0]);
  ::close(ready[1]);
  pollfd pf{ready[0], POLLIN, 0};
  REQUIRE(::poll(&pf, 1, 10000) == 1);

  // The new run: both ranks on the same port, with their own token.
  std::vector<child> fresh;
  const auto t0 = clk::now();
  for (int r = 0; r < 2; ++r)
    fresh.push_back(spawn(dir.path + "/new" + std::to_string(r), [&, r] {
      lockstep_run_env(r, 2, port, token_new);
      try {
        auto store = lockstep::job_store(*lockstep::detect_launcher(), 10s);
        store.add("new_run/count", 1);
        store.set("new_run/was_here", lockstep::bytes_of("yes"));
        return 0;
      } catch (const lockstep::config_error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 3;
      }
    }));
  wait_all({&fresh[0], &fresh[1]}, t0, 20s);
  const double fault_to_exit = std::max(fresh[0].exited_after, fresh[1].exited_after);
  [[maybe_unused]] auto n = ::write(go[1], "1", 1);
  ::close(go[1]);
  ::close(ready[0]);
  wait_all({&old0}, clk::now(), 20s);

  const std::string msg0 = read_text(fresh[0].err_path), msg1 = read_text(fresh[1].err_path);
  const std::string log = read_text(old0.err_path);
  MESSAGE("new rank 0: ", msg0);
  MESSAGE("new rank 1: ", msg1);
  MESSAGE("earlier run's store: ", log);
  MESSAGE("fault to the new run's last exit: ", fault_to_exit, " s");
  CHECK(exit_code(fresh[0]) == 3);
  CHECK(exit_code(fresh[1]) == 3);
  CHECK(exit_code(old0) == 0);  // the earlier run is untouched: no key of the new one
  // Rank 0 cannot host: the port is held.
  CHECK(has(msg0, "TcpStore: cannot listen on port " + p +
                      ": Address already in use (another job, or an earlier run "
                      "of this one, holds it: stop it (on this host, `ss -ltnp 'sport = :" +
                      p +
                      "'` names it) or choose "
                      "another MASTER_PORT)"));
  // Rank 1 reached the earlier run's store and was refused, naming both runs.
  CHECK(has(msg1, "TcpStore(127.0.0.1:" + p + ") refused this process: the store at this address belongs to run " +
                      id_old + ", this process is of run " + id_new +
                      ". A process of another run listens at 127.0.0.1:" + p +
                      ": an earlier run still alive, or another job."));
  CHECK(has(msg1, "give every rank the same job token (LOCKSTEP_JOB_TOKEN)"));
  CHECK_FALSE(has(msg1, token_old));
  CHECK_FALSE(has(msg1, token_new));
  // The earlier run's rank 0 logs whom it refused.
  CHECK(has(log, "lockstep TcpStore server: refused the connection from 127.0.0.1:"));
  CHECK(has(log, ": it is of run " + id_new + ", this store belongs to run " + id_old));
  CHECK(fault_to_exit < 2.0);
}

TEST_CASE("fault_stale_rendezvous_left_over_process_refused: a process of an earlier run reconnecting to a new store") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string token_old = random_token(rng), token_new = random_token(rng);
  const auto old_value = random_bytes(rng, 1 + rng() % 512);
  // The earlier run: its rank 0 hosts the store, its rank 1 joins and sets a key.
  auto old_host = std::make_unique<TcpStore>("127.0.0.1", 0, true, 2, token_old, 5s);
  const int port = old_host->port();
  const std::string p = std::to_string(port);
  TcpStore left_over("127.0.0.1", port, false, 2, token_old, 5s);
  left_over.set("lockstep/nccl_id", old_value);
  old_host.reset();  // the earlier run's rank 0 exits; its rank 1 lives on
  stderr_capture cap;
  // The new run takes the same port.
  TcpStore host("127.0.0.1", port, true, 2, token_new, 5s);
  TcpStore peer("127.0.0.1", port, false, 2, token_new, 5s);
  peer.set("lockstep/nccl_id", lockstep::bytes_of("new"));
  const auto t0 = clk::now();
  // Its connection died with its store; the next call reconnects, to the new store: refused.
  CHECK_THROWS_WITH_AS(left_over.check({"lockstep/nccl_id"}), doctest::Contains("lost the connection"),
                       lockstep::aborted_error);
  const auto [msg, fault_to_throw] = refusal<lockstep::aborted_error>(
      t0, "left-over process", "a process of an earlier run joined the new run's store",
      [&] { left_over.set("lockstep/nccl_id", old_value); });
  CHECK(has(msg, "TcpStore(127.0.0.1:" + p + ") refused this process: this process joined store "));
  CHECK(has(msg, " at this address, which is gone; store "));
  CHECK(has(msg, " of run " + run_id_of(token_new) + " listens there now (this process is of run " +
                     run_id_of(token_old) +
                     "). The rank 0 that hosted this process's store exited and another run "
                     "now listens at 127.0.0.1:" +
                     p + ": this process is left over from that earlier run and must not join the new one; stop it"));
  CHECK(fault_to_throw < 2.0);
  // The new run goes on, and never sees the earlier run's value.
  CHECK(lockstep::string_of(host.get("lockstep/nccl_id")) == "new");
  peer.set("after", lockstep::bytes_of("ok"));
  CHECK(lockstep::string_of(host.get("after")) == "ok");
  const std::string log = cap.finish();
  CHECK(has(log, "lockstep TcpStore server: refused the connection from 127.0.0.1:"));
  CHECK(has(log, ": a process left over from an earlier run (run " + run_id_of(token_old) + ") reconnected"));
}

TEST_CASE(
    "fault_stale_rendezvous_same_token_left_over_refused: runs that share a token (or have none) still never mix") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  // A fixed LOCKSTEP_JOB_TOKEN exported for every run, torchrun's default "none", or no token.
  const int pick = static_cast<int>(rng() % 3);
  const std::string token = pick == 0 ? random_token(rng) : pick == 1 ? std::string("none") : std::string();
  CAPTURE(token);
  auto old_host = std::make_unique<TcpStore>("127.0.0.1", 0, true, 2, token, 5s);
  const int port = old_host->port();
  TcpStore left_over("127.0.0.1", port, false, 2, token, 5s);
  const std::int64_t before = left_over.add("lockstep/barrier/step/count", 1);
  CHECK(before == 1);
  old_host.reset();
  stderr_capture cap;
  TcpStore host("127.0.0.1", port, true, 2, token, 5s);
  const auto t0 = clk::now();
  CHECK_THROWS_AS(left_over.add("lockstep/barrier/step/count", 1), lockstep::aborted_error);  // lost
  CHECK_THROWS_WITH_AS(
      left_over.add("lockstep/barrier/step/count", 1),
      doctest::Contains("this process is left over from that earlier run and must not join the new one"),
      lockstep::aborted_error);
  CHECK(seconds_since(t0) < 2.0);
  // The new store's counter never saw the earlier run's arrivals.
  CHECK(host.add("lockstep/barrier/step/count", 0) == 0);
  const std::string log = cap.finish();
  CHECK(has(log, "a process left over from an earlier run (" + lockstep::detail::run_label(run_id_of(token)) +
                     ") reconnected"));
}

TEST_CASE("fault_stale_rendezvous_same_run_admitted: clients of one run still meet - also after a refusal") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string token = random_token(rng);
  const int world = 2 + static_cast<int>(rng() % 3);
  TcpStore host("127.0.0.1", 0, true, world, token, 10s);
  CHECK(host.run_id() == run_id_of(token));
  {  // a stranger first: refused, and the store keeps serving
    stderr_capture cap;
    CHECK_THROWS_AS(TcpStore("127.0.0.1", host.port(), false, world, random_token(rng), 2s), lockstep::config_error);
  }
  std::vector<std::vector<std::byte>> values;
  for (int r = 0; r < world; ++r) values.push_back(random_bytes(rng, rng() % 2048));
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      try {
        std::unique_ptr<TcpStore> own;
        if (r != 0) own = std::make_unique<TcpStore>("127.0.0.1", host.port(), false, world, token, 10s);
        TcpStore& s = r == 0 ? host : *own;
        s.set("v/" + std::to_string(r), values[static_cast<std::size_t>(r)]);
        lockstep::barrier(s, "set");
        for (int i = 0; i < world; ++i)
          if (s.get("v/" + std::to_string(i)) != values[static_cast<std::size_t>(i)])
            throw std::runtime_error("value of rank " + std::to_string(i) + " differs");
        lockstep::final_barrier(s, "end", r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world; ++r)
    CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].empty(), "rank ", r, ": ", errors[static_cast<std::size_t>(r)]);
}

TEST_CASE("fault_stale_store_reused: a FileStore directory of an earlier run is refused to a new one") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string token_old = random_token(rng), token_new = random_token(rng);
  const auto nccl_id = random_bytes(rng, 1 + rng() % 256);
  temp_dir dir("lockstep_fault_store");
  const std::string path = dir.path + "/rdzv";
  {
    FileStore earlier(path, 2, 2s, {}, token_old);
    CHECK(earlier.run_id() == run_id_of(token_old));
    earlier.set("lockstep/nccl_id", nccl_id);
    earlier.add("lockstep/barrier/start/count", 2);
    FileStore same_run(path, 2, 2s, {}, token_old);  // another process of that run: admitted
    CHECK(same_run.get("lockstep/nccl_id") == nccl_id);
  }
  const auto t0 = clk::now();
  const auto [msg, fault_to_throw] =
      refusal<lockstep::config_error>(t0, "new run", "a new run opened an earlier run's store directory",
                                      [&] { FileStore later(path, 2, 2s, {}, token_new); });
  CHECK(msg == "FileStore(" + path + "): the directory holds the store of run " + run_id_of(token_old) +
                   " but this process is of run " + run_id_of(token_new) +
                   ". A store directory serves one run: another run's keys (an NCCL id, barrier counts) must not be "
                   "read by this one, and a process of that run may still write there. Give this run a directory of "
                   "its own (e.g. named after the job id), or remove " +
                   path + " once no process of run " + run_id_of(token_old) + " runs");
  CHECK(fault_to_throw < 1.0);
  // An unnamed run is another run too, both ways.
  CHECK_THROWS_WITH_AS(FileStore(path, 2, 2s, {}, ""),
                       doctest::Contains("this process is of an unnamed run (no job token)"), lockstep::config_error);
  const std::string unnamed = dir.path + "/unnamed";
  {
    FileStore first(unnamed, 2, 2s);
  }
  CHECK_THROWS_WITH_AS(FileStore(unnamed, 2, 2s, {}, token_new),
                       doctest::Contains("holds the store of an unnamed run (no job token)"), lockstep::config_error);
  // A fresh directory serves the new run, which never sees the earlier run's key.
  FileStore fresh(dir.path + "/rdzv2", 2, 2s, {}, token_new);
  CHECK_FALSE(fresh.check({"lockstep/nccl_id"}));
  CHECK(fresh.add("lockstep/barrier/start/count", 0) == 0);
}

TEST_CASE(
    "fault_stale_store_two_runs_race: processes of two runs starting on one fresh directory - exactly one run wins") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string tokens[2] = {random_token(rng), random_token(rng)};
  const int per_run = 2 + static_cast<int>(rng() % 3);
  temp_dir dir("lockstep_fault_store");
  const std::string path = dir.path + "/shared";
  std::vector<child> kids;
  const auto t0 = clk::now();
  for (int i = 0; i < 2 * per_run; ++i) {
    const int run = (i + static_cast<int>(rng() % 2)) % 2;  // interleaved, in a random order
    kids.push_back(spawn(dir.path + "/err" + std::to_string(i), [&, run] {
      try {
        FileStore s(path, per_run, 5s, {}, tokens[run]);
        s.add("members", 1);
        return 10 + run;  // admitted
      } catch (const lockstep::config_error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 20 + run;  // refused
      }
    }));
  }
  std::vector<child*> all;
  for (auto& k : kids) all.push_back(&k);
  wait_all(all, t0, 30s);
  int admitted[2] = {0, 0}, refused[2] = {0, 0};
  for (const auto& k : kids) {
    const int rc = exit_code(k);
    if (rc == 10 || rc == 11) ++admitted[rc - 10];
    else if (rc == 20 || rc == 21) ++refused[rc - 20];
    else FAIL_CHECK("a process ended with ", rc, ": ", read_text(k.err_path));
  }
  // One run has every process admitted, the other every process refused.
  const int winner = admitted[0] > 0 ? 0 : 1;
  CHECK(refused[winner] == 0);
  CHECK(admitted[1 - winner] == 0);
  CHECK(admitted[0] + admitted[1] + refused[0] + refused[1] == 2 * per_run);
  FileStore winner_store(path, per_run, 2s, {}, tokens[winner]);
  CHECK(winner_store.add("members", 0) == admitted[winner]);
}

TEST_CASE("fault_stale_rendezvous_mpi_runs_named: every mpirun job has a run id of its own") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  temp_dir dir("lockstep_fault_store");
  const std::string ns = std::to_string(rng() % 4000000000u);
  int to_parent[2];
  REQUIRE(::pipe(to_parent) == 0);
  child k = spawn(dir.path + "/err", [&] {
    ::close(to_parent[0]);
    ::clearenv();
    ::setenv("OMPI_COMM_WORLD_RANK", "0", 1);
    ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
    ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
    ::setenv("PMIX_NAMESPACE", ns.c_str(), 1);
    const std::string token = lockstep::detect_launcher()->job_token;
    ::setenv("LOCKSTEP_JOB_TOKEN", "chosen", 1);  // an explicit token still wins
    const std::string chosen = lockstep::detect_launcher()->job_token;
    const std::string out = token + "\n" + chosen + "\n";
    [[maybe_unused]] auto n = ::write(to_parent[1], out.data(), out.size());
    return 0;
  });
  ::close(to_parent[1]);
  wait_all({&k}, clk::now(), 10s);
  std::string got(256, '\0');
  const ssize_t n = ::read(to_parent[0], got.data(), got.size());
  ::close(to_parent[0]);
  got.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  CHECK_MESSAGE(exit_code(k) == 0, read_text(k.err_path));
  CHECK(got == "openmpi-" + ns + "\nchosen\n");
}

}  // TEST_SUITE
