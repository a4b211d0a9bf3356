// The rendezvous stores: one scenario (set/get/check/wait/add/barrier, values of random
// sizes up to the cap, bounded timeouts) run by N ranks as threads and, for TcpStore and
// FileStore, as fork()ed processes; expected values are regenerated from the seed, never
// read back from the store under test. Plus: TcpStore's token check, malformed and
// oversized frames, late servers, a server that goes away; the wire parser on random
// frames cut at random points; the server engine without sockets, its hello of another run
// included (the fault cases of a stale rendezvous: test_fault_store.cpp). Every wait is bounded.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <lockstep/store/detail/wire.hpp>
#include <lockstep/store/file_store.hpp>
#include <lockstep/store/hash_store.hpp>
#include <lockstep/store/store.hpp>
#include <lockstep/store/tcp_store.hpp>

#include "net_util.hpp"
#include "test_util.hpp"

using namespace std::chrono_literals;
using lockstep::FileStore;
using lockstep::HashStore;
using lockstep::TcpStore;
using lockstep_test::fresh_seed;
namespace wire = lockstep::detail::wire;
using clk = std::chrono::steady_clock;

namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

double seconds_since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

//! Rank r's value: sizes cover the cap exactly, tiny, empty and random; never all zero.
std::vector<std::byte> value_for(std::uint64_t seed, int rank, std::size_t cap) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(rank));
  std::size_t n = 0;
  switch (rank % 5) {
    case 0: n = cap; break;
    case 1: n = 1 + rng() % 16; break;
    case 2: n = 0; break;
    default: n = rng() % (cap + 1); break;
  }
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  if (n > 0) v[0] |= std::byte{1};
  return v;
}

std::int64_t delta_for(std::uint64_t seed, int rank) {
  std::mt19937_64 rng(seed ^ (0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(rank + 1)));
  return static_cast<std::int64_t>(rng() % 2000001) - 1000000;
}

struct scenario_cfg {
  int world = 2;
  std::uint64_t seed = 1;
  std::size_t cap = 1 << 20;
  std::chrono::milliseconds quick{400};
};

//! What every rank runs. `quick` reaches the same store with a short timeout.
template <class S>
void scenario(S& s, S& quick, int rank, const scenario_cfg& cfg) {
  const int world = cfg.world;
  const std::string r = std::to_string(rank);
  s.set("v/" + r, value_for(cfg.seed, rank, cfg.cap));
  lockstep::barrier(s, "set");
  std::vector<std::string> keys;
  for (int i = 0; i < world; ++i) keys.push_back("v/" + std::to_string(i));
  expect(s.check(keys), "check after the barrier: not every rank's key is there");
  s.wait(keys, 2s);
  for (int i = 0; i < world; ++i)
    expect(s.get("v/" + std::to_string(i)) == value_for(cfg.seed, i, cfg.cap),
           "rank " + r + ": value of rank " + std::to_string(i) + " differs");
  // Counters: each rank adds its own random delta a few times; the expected total is
  // computed here from the seed.
  constexpr int adds = 4;
  std::int64_t expected = 0;
  for (int i = 0; i < world; ++i) expected += adds * delta_for(cfg.seed, i);
  for (int k = 0; k < adds; ++k) s.add("ctr", delta_for(cfg.seed, rank));
  lockstep::barrier(s, "added");
  expect(s.add("ctr", 0) == expected, "rank " + r + ": counter total differs");
  expect(s.add("ctr/" + r, 5) == 5 && s.add("ctr/" + r, -7) == -2, "rank " + r + ": private counter");
  // Counters and values are apart: no value appears under a counter's name.
  expect(!s.check({"ctr"}), "a counter is visible to check()");

  // A key nobody sets: get and wait time out within their bound, naming it.
  auto t0 = clk::now();
  try {
    (void)quick.get("missing/" + r);
    expect(false, "get of a missing key returned");
  } catch (const lockstep::timeout_error& e) {
    const double dt = seconds_since(t0);
    const double want = std::chrono::duration<double>(quick.timeout()).count();
    expect(dt >= want * 0.9 && dt < want + 5.0, "get timed out after " + std::to_string(dt) + " s");
    expect(std::string(e.what()).find("missing/" + r) != std::string::npos,
           "message lacks the key: " + std::string(e.what()));
  }
  t0 = clk::now();
  try {
    quick.wait({"v/0", "never/" + r}, 200ms);
    expect(false, "wait on a missing key returned");
  } catch (const lockstep::timeout_error& e) {
    const double dt = seconds_since(t0);
    expect(dt >= 0.18 && dt < 5.0, "wait timed out after " + std::to_string(dt) + " s");
    const std::string m = e.what();
    const bool v0_there = quick.check({"v/0"});  // HashStore's quick is a store of its own
    expect(m.find("never/" + r) != std::string::npos && m.find(v0_there ? "1 of 2" : "2 of 2") != std::string::npos,
           "wait message: " + m);
  }
  expect(!s.check({"v/0", "never/" + r}), "check of a missing key is true");

  // Overwrite: rank 0 replaces a value; after a barrier everyone sees the new one.
  if (rank == 0) {
    s.set("shared", lockstep::bytes_of("first"));
    s.set("shared", value_for(cfg.seed + 7, 3, cfg.cap / 3));
  }
  lockstep::barrier(s, "overwritten");
  expect(s.get("shared") == value_for(cfg.seed + 7, 3, cfg.cap / 3), "rank " + r + ": overwritten value");
  for (int i = 0; i < 3; ++i) lockstep::barrier(s, "loop");  // reuse of one barrier name
  lockstep::final_barrier(s, "end", rank);                   // rank 0 may host the store: it leaves last
}

//! Runs body(rank) on `world` threads; rethrows the first failure here.
void run_threads(int world, const std::function<void(int)>& body) {
  std::vector<std::thread> ts;
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = "unknown exception";
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r)
    CHECK_MESSAGE(errors[static_cast<std::size_t>(r)].empty(), "rank ", r, ": ", errors[static_cast<std::size_t>(r)]);
}

//! Forks ranks 1..world-1 running body(rank), each exiting 0 on success; returns their pids.
std::vector<pid_t> fork_ranks(int world, const std::function<void(int)>& body) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 1; r < world; ++r) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int rc = 1;
      try {
        body(r);
        rc = 0;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "forked rank %d: %s\n", r, e.what());
      } catch (...) {
        std::fprintf(stderr, "forked rank %d: unknown exception\n", r);
      }
      std::fflush(stderr);
      ::_exit(rc);  // never return into the test runner
    }
    pids.push_back(pid);
  }
  return pids;
}

//! Waits for the children until the deadline; kills what is left. Checks they all exited 0.
void reap(std::vector<pid_t> pids, std::chrono::seconds limit) {
  const auto deadline = clk::now() + limit;
  std::vector<int> status(pids.size(), -1);
  std::size_t left = pids.size();
  while (left > 0 && clk::now() < deadline) {
    for (std::size_t i = 0; i < pids.size(); ++i) {
      if (pids[i] <= 0) continue;
      int st = 0;
      if (::waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        status[i] = st;
        pids[i] = 0;
        --left;
      }
    }
    std::this_thread::sleep_for(5ms);
  }
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] > 0) {
      ::kill(pids[i], SIGKILL);
      ::waitpid(pids[i], nullptr, 0);
      FAIL_CHECK("forked rank ", i + 1, " did not finish within ", limit.count(), " s (killed)");
      continue;
    }
    CHECK_MESSAGE((WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0), "forked rank ", i + 1, " failed (status ",
                  status[i], "; its message is on stderr)");
  }
}

//! Runs body(rank) on `world` processes: ranks 1.. forked, rank 0 in this one (an exception
//! there fails the test); then reaps the forked ones (60 s).
void run_forked(int world, const std::function<void(int)>& body) {
  auto pids = fork_ranks(world, body);
  try {
    body(0);
  } catch (const std::exception& e) {
    FAIL_CHECK("rank 0: ", e.what());
  }
  reap(pids, 60s);
}

//! A port free right now on loopback (for a server that starts after its clients).
using lockstep_test::free_port;

using lockstep_test::temp_dir;

//! A raw client socket, for speaking the protocol badly on purpose.
struct raw_client {
  int fd = -1;
  explicit raw_client(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  ~raw_client() { ::close(fd); }
  void send(std::span<const std::byte> b) const { (void)::send(fd, b.data(), b.size(), MSG_NOSIGNAL); }
  //! Reads replies until the server closes (true) or 3 s pass (false); returns frames seen.
  bool until_closed(std::vector<wire::frame>& frames) const {
    wire::frame_parser p(true, lockstep::store_limits{});
    const auto deadline = clk::now() + 3s;
    std::byte buf[4096];
    while (clk::now() < deadline) {
      pollfd pf{fd, POLLIN, 0};
      if (::poll(&pf, 1, 100) <= 0) continue;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return true;
      std::span<const std::byte> in(buf, static_cast<std::size_t>(n));
      while (!in.empty()) {
        in = in.subspan(p.feed(in));
        if (p.status() == wire::frame_parser::state::ready) frames.push_back(p.take());
        if (p.status() == wire::frame_parser::state::failed) return false;
      }
    }
    return false;
  }
};

std::vector<std::byte> hello_frame(const std::string& token, std::uint64_t joined = 0) {
  std::vector<std::byte> b;
  wire::encode(b, wire::op::hello, wire::protocol_version, {}, wire::encode_hello(joined, token));
  return b;
}

//! The replies the engine has queued on `id`, parsed (they must parse) and marked sent.
std::vector<wire::frame> take_replies(wire::store_engine& e, wire::store_engine::conn_id id,
                                      wire::store_engine::clock::time_point t) {
  std::vector<wire::frame> out;
  wire::frame_parser p(true, lockstep::store_limits{});
  std::span<const std::byte> in(e.out(id));
  while (!in.empty()) {
    in = in.subspan(p.feed(in));
    REQUIRE(p.status() != wire::frame_parser::state::failed);
    if (p.status() == wire::frame_parser::state::ready) out.push_back(p.take());
  }
  e.sent(id, e.out(id).size(), t);
  return out;
}

std::string random_token(std::mt19937_64& rng) {
  std::string t(32, ' ');
  for (auto& c : t) c = static_cast<char>('a' + rng() % 26);
  return t;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("HashStore: scenario on threads") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  scenario_cfg cfg{2 + static_cast<int>(rng() % 5), seed, 1 << 20, 300ms};
  CAPTURE(cfg.world);
  HashStore s(cfg.world, 10s);
  HashStore quick(cfg.world, cfg.quick);
  run_threads(cfg.world, [&](int r) { scenario(s, quick, r, cfg); });
}

TEST_CASE("final_barrier with an abort key: a failure set by a rank ends the others' wait at once") {
  // Rank 2 never reaches the barrier: it fails, and says so under the abort key. Without the
  // key the other ranks would wait the whole (here 30 s) timeout.
  lockstep::HashStore s(3, std::chrono::seconds(30));
  std::vector<std::string> got(3);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      if (r == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        s.set("job/failed", lockstep::bytes_of("rank 2 failed: deliberately"));
        return;
      }
      try {
        lockstep::final_barrier(s, "end", r, std::chrono::seconds(30), "job/failed");
      } catch (const lockstep::aborted_error& e) {
        got[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  for (int r = 0; r < 2; ++r)
    CHECK(got[static_cast<std::size_t>(r)].find("rank 2 failed: deliberately") != std::string::npos);
}

TEST_CASE("final_barrier_of: rank 0 waits for the members it names only - and times out on a silent one") {
  // An elastic job's survivors: a random part of the job with rank 0, the others gone.
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 3 + static_cast<int>(rng() % 4);
  std::vector<int> members{0};
  for (int r = 1; r < world; ++r)
    if (rng() % 2) members.push_back(r);
  if (members.size() == 1) members.push_back(world - 1);
  lockstep::HashStore s(world, std::chrono::seconds(30));
  std::atomic<int> passed{0};
  std::vector<std::thread> ts;
  for (int r : members)
    if (r != 0)
      ts.emplace_back([&, r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20 * r));
        lockstep::final_barrier_of(s, "end", r, members, std::chrono::seconds(5));
        ++passed;
      });
  lockstep::final_barrier_of(s, "end", 0, members, std::chrono::seconds(5));
  for (int r : members)  // rank 0 returned once every member had said so, and only then
    if (r != 0) CHECK(s.check({"lockstep/barrier/end/passed/" + std::to_string(r)}));
  for (auto& t : ts) t.join();
  CHECK(passed.load() == static_cast<int>(members.size()) - 1);
  // A member that never comes: rank 0 is told by the timeout, not left waiting.
  std::vector<int> with_silent = members;
  if (with_silent.size() < static_cast<std::size_t>(world)) {
    for (int r = 1; r < world; ++r)
      if (std::find(members.begin(), members.end(), r) == members.end()) {
        with_silent.push_back(r);
        break;
      }
    CHECK_THROWS_AS(lockstep::final_barrier_of(s, "end", 0, with_silent, std::chrono::milliseconds(100)),
                    lockstep::timeout_error);
  }
}

TEST_CASE("stores refuse oversized values and keys before sending") {
  lockstep::store_limits lim;
  lim.max_value_bytes = 1000;
  lim.max_key_bytes = 16;
  HashStore h(1, 1s, lim);
  std::vector<std::byte> big(1001, std::byte{7});
  CHECK_THROWS_WITH_AS(h.set("k", big), doctest::Contains("1001 bytes"), lockstep::config_error);
  CHECK_THROWS_WITH_AS(h.set(std::string(17, 'k'), big), doctest::Contains("max_key_bytes"), lockstep::config_error);
  CHECK_THROWS_AS(h.set("", big), lockstep::config_error);
  big.pop_back();
  h.set("k", big);
  CHECK(h.get("k") == big);
  temp_dir d("lockstep_store_test");
  FileStore f(d.path, 1, 1s, lim);
  big.push_back(std::byte{1});
  CHECK_THROWS_WITH_AS(f.set("k", big), doctest::Contains("max_value_bytes"), lockstep::config_error);
  lockstep::store_limits total;
  total.max_total_bytes = 100;
  HashStore small(1, 1s, total);
  small.set("a", std::vector<std::byte>(90, std::byte{1}));
  CHECK_THROWS_WITH_AS(small.set("b", std::vector<std::byte>(20, std::byte{1})), doctest::Contains("max_total_bytes"),
                       lockstep::config_error);
  small.set("a", std::vector<std::byte>(10, std::byte{1}));  // replacing frees the old bytes
  small.set("b", std::vector<std::byte>(20, std::byte{1}));
}

TEST_CASE("TcpStore: server + clients on threads") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  scenario_cfg cfg{2 + static_cast<int>(rng() % 4), seed, 1 << 20, 400ms};
  CAPTURE(cfg.world);
  const std::string token = random_token(rng);
  TcpStore server("127.0.0.1", 0, true, cfg.world, token, 20s);
  const int port = server.port();
  REQUIRE(port > 0);
  run_threads(cfg.world, [&](int r) {
    if (r == 0) {
      TcpStore quick("127.0.0.1", port, false, cfg.world, token, cfg.quick);
      scenario(server, quick, 0, cfg);
    } else {
      TcpStore s("127.0.0.1", port, false, cfg.world, token, 20s);
      TcpStore quick("127.0.0.1", port, false, cfg.world, token, cfg.quick);
      scenario(s, quick, r, cfg);
    }
  });
}

TEST_CASE("TcpStore: forked processes - server started after its clients") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  scenario_cfg cfg{4, seed, 1 << 20, 400ms};
  const std::string token = random_token(rng);
  const int port = free_port();
  CAPTURE(port);
  auto pids = fork_ranks(cfg.world, [&](int r) {
    TcpStore s("localhost", port, false, cfg.world, token, 20s);  // retries until rank 0 listens
    TcpStore quick("127.0.0.1", port, false, cfg.world, token, cfg.quick);
    scenario(s, quick, r, cfg);
  });
  std::this_thread::sleep_for(300ms);  // the clients are already retrying
  {
    TcpStore server("127.0.0.1", port, true, cfg.world, token, 20s);
    TcpStore quick("127.0.0.1", port, false, cfg.world, token, cfg.quick);
    try {
      scenario(server, quick, 0, cfg);
    } catch (const std::exception& e) {
      FAIL_CHECK("rank 0: ", e.what());
    }
  }
  reap(pids, 60s);
}

TEST_CASE("TcpStore: wrong or missing token is rejected - the server keeps serving") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string token = random_token(rng);
  TcpStore server("127.0.0.1", 0, true, 2, token, 5s);
  const int port = server.port();
  std::string wrong = token;
  wrong[rng() % wrong.size()] ^= 1;  // one bit differs
  CHECK_THROWS_WITH_AS(TcpStore("127.0.0.1", port, false, 2, wrong, 2s), doctest::Contains("job token"),
                       lockstep::config_error);
  CHECK_THROWS_WITH_AS(TcpStore("127.0.0.1", port, false, 2, "", 2s), doctest::Contains("job token"),
                       lockstep::config_error);
  CHECK_THROWS_AS(TcpStore("127.0.0.1", port, false, 2, token + "x", 2s), lockstep::config_error);
  {  // a raw client sending a request before hello is answered with an error and dropped
    raw_client raw(port);
    std::vector<std::byte> b;
    wire::encode(b, wire::op::set, 0, "intruder", lockstep::bytes_of("x"));
    raw.send(b);
    std::vector<wire::frame> replies;
    CHECK(raw.until_closed(replies));
    REQUIRE(replies.size() == 1);
    CHECK(replies[0].type == wire::op::err);
    CHECK(replies[0].arg == static_cast<std::int64_t>(wire::err_code::bad_token));
  }
  TcpStore good("127.0.0.1", port, false, 2, token, 5s);
  const auto v = value_for(seed, 3, 5000);
  good.set("after", v);
  CHECK(server.get("after") == v);
  CHECK_FALSE(server.check({"intruder"}));
}

TEST_CASE("TcpStore: malformed and oversized frames close only that connection") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string token = random_token(rng);
  TcpStore server("127.0.0.1", 0, true, 2, token, 5s);
  const int port = server.port();
  {  // random garbage (first byte not the magic)
    raw_client raw(port);
    std::vector<std::byte> junk(1 + rng() % 3000);
    for (auto& b : junk) b = static_cast<std::byte>(rng());
    junk[0] = std::byte{'X'};
    raw.send(junk);
    std::vector<wire::frame> replies;
    CHECK(raw.until_closed(replies));
  }
  {  // after hello: a header announcing a value over the server's cap
    raw_client raw(port);
    raw.send(hello_frame(token));
    std::vector<std::byte> b;
    wire::encode(b, wire::op::set, 0, "k", lockstep::bytes_of("v"));
    lockstep::detail::store_le(b.data() + 8, static_cast<std::uint32_t>((1u << 20) + 1));
    raw.send(std::span<const std::byte>(b).first(wire::header_bytes));
    std::vector<wire::frame> replies;
    CHECK(raw.until_closed(replies));
    REQUIRE(replies.size() == 2);  // hello ok, then the error
    CHECK(replies[0].type == wire::op::ok);
    CHECK(replies[1].type == wire::op::err);
    CHECK(replies[1].arg == static_cast<std::int64_t>(wire::err_code::malformed));
  }
  {  // a corrupted CRC
    raw_client raw(port);
    raw.send(hello_frame(token));
    std::vector<std::byte> b;
    wire::encode(b, wire::op::set, 0, "k", value_for(seed, 0, 100));  // exactly 100 bytes
    b[wire::header_bytes + 1 + rng() % 100] ^= std::byte{0x10};
    raw.send(b);
    std::vector<wire::frame> replies;
    CHECK(raw.until_closed(replies));
  }
  CHECK_FALSE(server.check({"k"}));
  // A client's oversized value is refused before sending, with the limit in the message.
  TcpStore client("127.0.0.1", port, false, 2, token, 5s);
  std::vector<std::byte> big((1u << 20) + 1, std::byte{3});
  CHECK_THROWS_WITH_AS(client.set("big", big), doctest::Contains("max_value_bytes"), lockstep::config_error);
  CHECK_THROWS_AS(client.set(std::string(513, 'k'), big), lockstep::config_error);
  big.pop_back();  // exactly the cap goes through
  client.set("big", big);
  CHECK(server.get("big") == big);
}

//! A store whose wait() starts late: it widens the window in which a rank has passed a
//! barrier's counter but not yet asked the server whether the barrier is done.
template <class S>
struct late_wait {
  S& s;
  std::chrono::milliseconds delay;
  void set(std::string_view k, std::span<const std::byte> v) { s.set(k, v); }
  std::vector<std::byte> get(std::string_view k) { return s.get(k); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds t) {
    std::this_thread::sleep_for(delay);
    s.wait(keys, t);
  }
  bool check(const std::vector<std::string>& keys) { return s.check(keys); }
  std::int64_t add(std::string_view k, std::int64_t d) { return s.add(k, d); }
  int world() const { return s.world(); }
  std::chrono::milliseconds timeout() const { return s.timeout(); }
};

TEST_CASE("TcpStore: final_barrier keeps rank 0's server up until every rank has passed") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 2 + static_cast<int>(rng() % 4);
  const auto delay = std::chrono::milliseconds(200 + rng() % 300);
  const int port = free_port();
  std::atomic<int> passed{0};
  run_threads(world, [&](int r) {
    if (r == 0) {
      TcpStore server("127.0.0.1", port, true, world, "t", 10s);
      std::this_thread::sleep_for(delay);  // arrives last: a plain barrier returns here at once
      lockstep::final_barrier(server, "end", 0);
      return;  // the server goes away
    }
    TcpStore client("127.0.0.1", port, false, world, "t", 10s);
    late_wait<TcpStore> slow{client, delay};  // others reach the server's "done" late
    lockstep::final_barrier(slow, "end", r);
    ++passed;
  });
  CHECK(passed == world - 1);
}

TEST_CASE("TcpStore: a client with larger limits adopts the server's") {
  lockstep::store_limits server_lim;
  server_lim.max_value_bytes = 4096;
  TcpStore server("127.0.0.1", 0, true, 2, "t", 5s, server_lim);
  TcpStore client("127.0.0.1", server.port(), false, 2, "t", 5s);  // default: 1 MiB
  CHECK(client.limits().max_value_bytes == 4096);
  CHECK_THROWS_WITH_AS(client.set("k", std::vector<std::byte>(4097, std::byte{1})), doctest::Contains("4096"),
                       lockstep::config_error);
  client.set("k", std::vector<std::byte>(4096, std::byte{1}));
}

TEST_CASE("TcpStore: the server admits 2 x world + 8 connections") {
  const int world = 1 + static_cast<int>(std::random_device{}() % 3);
  TcpStore server("127.0.0.1", 0, true, world, "t", 5s);  // its own client is the first
  std::vector<std::unique_ptr<TcpStore>> clients;
  for (int i = 1; i < 2 * world + 8; ++i)
    clients.push_back(std::make_unique<TcpStore>("127.0.0.1", server.port(), false, 1, "t", 5s));
  try {
    TcpStore one_too_many("127.0.0.1", server.port(), false, 1, "t", 5s);
    FAIL_CHECK("a connection beyond the cap was admitted");
  } catch (const lockstep::error& e) {  // config_error with the reason, or a bare lost connection
    MESSAGE(std::string(e.what()));
  }
  clients.pop_back();  // a slot frees up once the server notices the close
  bool admitted = false;
  for (int i = 0; i < 50 && !admitted; ++i) {
    try {
      TcpStore again("127.0.0.1", server.port(), false, 1, "t", 5s);
      again.set("k", lockstep::bytes_of("v"));
      admitted = true;
    } catch (const lockstep::error&) {
      std::this_thread::sleep_for(20ms);
    }
  }
  CHECK(admitted);
  CHECK(lockstep::string_of(server.get("k")) == "v");
}

TEST_CASE("TcpStore: connecting to nobody times out within the bound") {
  const int port = free_port();
  const auto t0 = clk::now();
  CHECK_THROWS_WITH_AS(TcpStore("127.0.0.1", port, false, 2, "t", 500ms), doctest::Contains("could not connect"),
                       lockstep::timeout_error);
  const double dt = seconds_since(t0);
  CHECK(dt >= 0.45);
  CHECK(dt < 5.0);
  CHECK_THROWS_AS(TcpStore("127.0.0.1", 0, false, 2, "t", 500ms), lockstep::config_error);  // port 0 client
  CHECK_THROWS_AS(TcpStore("127.0.0.1", 70000, false, 2, "t", 500ms), lockstep::config_error);
}

TEST_CASE("TcpStore: a waiting client fails promptly when the server goes away") {
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, true, 2, "t", 5s);
  TcpStore client("127.0.0.1", server->port(), false, 2, "t", 20s);
  std::atomic<bool> threw{false};
  std::string what;
  const auto t0 = clk::now();
  std::thread waiter([&] {
    try {
      (void)client.get("never");
    } catch (const lockstep::error& e) {
      what = e.what();
      threw = true;
    }
  });
  std::this_thread::sleep_for(200ms);
  server.reset();  // joins the server thread and closes every connection
  waiter.join();
  CHECK(threw.load());
  CHECK_MESSAGE(what.find("lost the connection") != std::string::npos, what);
  CHECK(seconds_since(t0) < 5.0);
}

TEST_CASE("FileStore: scenario on threads and on forked processes") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  {
    temp_dir d("lockstep_store_test");
    scenario_cfg cfg{3, seed, 1 << 20, 300ms};
    run_threads(cfg.world, [&](int r) {
      FileStore s(d.path + "/store", cfg.world, 20s);  // each rank its own object, one directory
      FileStore quick(d.path + "/store", cfg.world, cfg.quick);
      scenario(s, quick, r, cfg);
    });
  }
  temp_dir d("lockstep_store_test");
  scenario_cfg cfg{4, seed + 1, 1 << 20, 300ms};
  auto body = [&](int r) {
    FileStore s(d.path + "/store", cfg.world, 20s);
    FileStore quick(d.path + "/store", cfg.world, cfg.quick);
    scenario(s, quick, r, cfg);
  };
  run_forked(cfg.world, body);
}

TEST_CASE("FileStore: counters under contention from processes") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  temp_dir d("lockstep_store_test");
  constexpr int procs = 4, adds = 50;
  auto body = [&](int r) {
    FileStore s(d.path, procs, 20s);
    for (int k = 0; k < adds; ++k) s.add("hot", delta_for(seed, r));
    lockstep::barrier(s, "done");
    std::int64_t expected = 0;
    for (int i = 0; i < procs; ++i) expected += adds * delta_for(seed, i);
    expect(s.add("hot", 0) == expected, "rank " + std::to_string(r) + ": counter total differs");
  };
  run_forked(procs, body);
}

TEST_CASE("FileStore: awkward keys map to distinct files") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  temp_dir d("lockstep_store_test");
  FileStore s(d.path, 1, 2s);
  HashStore ref(1, 2s);  // the reference
  std::vector<std::string> keys = {"a",
                                   "a.v",
                                   "a.d",
                                   "a%2E",
                                   "../x",
                                   "/abs",
                                   ".",
                                   "..",
                                   std::string("nul\0in", 6),
                                   std::string(64, 'p'),
                                   std::string(64, 'p') + "q",
                                   std::string(128, 'p'),
                                   std::string(512, '/'),
                                   std::string(512, 'z')};
  for (int i = 0; i < 40; ++i) {
    std::string k(1 + rng() % 512, ' ');
    for (auto& c : k) c = static_cast<char>(rng() % 4 == 0 ? rng() % 256 : 'a' + rng() % 3);
    keys.push_back(k);
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const auto v = value_for(seed + i, 3, 300);
    s.set(keys[i], v);
    ref.set(keys[i], v);
  }
  for (const auto& k : keys) CHECK(s.get(k) == ref.get(k));
  CHECK(s.check(keys));
  for (const auto& k : keys) CHECK(s.add(k, 3) == ref.add(k, 3));
}

TEST_CASE("wire: random frames survive any split - corruption never yields a frame") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  lockstep::store_limits lim;
  lim.max_value_bytes = 5000;
  for (int trial = 0; trial < 300; ++trial) {
    // A stream of random requests, encoded, fed in random pieces.
    std::vector<wire::frame> sent;
    std::vector<std::byte> stream;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      wire::frame f;
      const int kind = static_cast<int>(rng() % 6);
      constexpr wire::op kinds[] = {wire::op::set,  wire::op::get,   wire::op::add,
                                    wire::op::wait, wire::op::watch, wire::op::unwatch};
      f.type = kinds[kind];
      f.arg = f.type == wire::op::set       ? static_cast<std::int64_t>(rng() % 2)  // flags: 0, or 1 = if absent
              : f.type == wire::op::unwatch ? 0
                                            : static_cast<std::int64_t>(rng() % 100000);
      if (f.type != wire::op::wait && f.type != wire::op::unwatch) {
        f.key.resize(1 + rng() % lim.max_key_bytes);
        for (auto& c : f.key) c = static_cast<char>(rng());
      }
      if (f.type == wire::op::set) f.value = value_for(rng(), static_cast<int>(rng() % 5), lim.max_value_bytes);
      if (f.type == wire::op::watch) f.value = value_for(rng(), 1, 16);  // 1..16 bytes of text
      if (f.type == wire::op::wait) {
        std::vector<std::string> keys(1 + rng() % 5, "k");
        for (auto& k : keys) k += std::to_string(rng());
        f.value = wire::encode_key_list(keys);
      }
      wire::encode(stream, f.type, f.arg, f.key, f.value);
      sent.push_back(f);
    }
    wire::frame_parser p(false, lim);
    std::vector<wire::frame> got;
    std::size_t at = 0;
    while (at < stream.size()) {
      const std::size_t piece = std::min<std::size_t>(stream.size() - at, 1 + rng() % 700);
      std::span<const std::byte> in(stream.data() + at, piece);
      while (!in.empty()) {
        in = in.subspan(p.feed(in));
        REQUIRE(p.status() != wire::frame_parser::state::failed);
        if (p.status() == wire::frame_parser::state::ready) got.push_back(p.take());
      }
      at += piece;
    }
    REQUIRE(got.size() == sent.size());
    for (std::size_t i = 0; i < sent.size(); ++i) {
      CHECK(got[i].type == sent[i].type);
      CHECK(got[i].arg == sent[i].arg);
      CHECK(got[i].key == sent[i].key);
      CHECK(got[i].value == sent[i].value);
    }
    // Flip one bit of a one-frame stream: the parser fails or waits for more, never delivers.
    std::vector<std::byte> one;
    wire::encode(one, sent[0].type, sent[0].arg, sent[0].key, sent[0].value);
    one[rng() % one.size()] ^= static_cast<std::byte>(1u << (rng() % 8));
    wire::frame_parser q(false, lim);
    std::span<const std::byte> in(one);
    bool delivered = false;
    while (!in.empty() && q.status() == wire::frame_parser::state::need_more) {
      in = in.subspan(q.feed(in));
      delivered = delivered || q.status() == wire::frame_parser::state::ready;
    }
    CHECK_FALSE(delivered);
  }
  std::vector<std::string> keys;  // key lists: strict round trip, junk refused
  CHECK(wire::decode_key_list(wire::encode_key_list({"a", "bc"}), 10, 10, keys));
  CHECK(keys == std::vector<std::string>{"a", "bc"});
  auto list = wire::encode_key_list({"a", "bc"});
  list.push_back(std::byte{0});
  CHECK_FALSE(wire::decode_key_list(list, 10, 10, keys));
  CHECK_FALSE(wire::decode_key_list(wire::encode_key_list({"a", "bc"}), 1, 10, keys));
  CHECK_FALSE(wire::decode_key_list(wire::encode_key_list({"abc"}), 10, 2, keys));
  CHECK(wire::token_equal(lockstep::bytes_of("secret"), "secret"));
  CHECK_FALSE(wire::token_equal(lockstep::bytes_of("secreT"), "secret"));
  CHECK_FALSE(wire::token_equal(lockstep::bytes_of(std::string_view("secret\0", 7)), "secret"));
  CHECK_FALSE(wire::token_equal(lockstep::bytes_of(""), "secret"));
}

TEST_CASE("wire: the server engine parks waits - wakes them - and times them out") {
  using eng = wire::store_engine;
  eng e("tok", lockstep::store_limits{}, 4, 1s);
  auto t = eng::clock::time_point{} + 1000h;
  auto a = e.open("a", t);
  auto b = e.open("b", t);
  REQUIRE(a);
  REQUIRE(b);
  auto replies = [&](wire::store_engine::conn_id id) { return take_replies(e, id, t); };
  e.receive(*a, hello_frame("tok"), t);
  e.receive(*b, hello_frame("tok"), t);
  CHECK(replies(*a).at(0).type == wire::op::ok);
  CHECK(replies(*b).at(0).type == wire::op::ok);
  std::vector<std::byte> req;
  wire::encode(req, wire::op::wait, 5000, {}, wire::encode_key_list({"x", "y"}));
  e.receive(*a, req, t);
  CHECK(e.out(*a).empty());
  CHECK_FALSE(e.wants_read(*a));  // parked
  req.clear();
  wire::encode(req, wire::op::set, 0, "y", lockstep::bytes_of("1"));
  wire::encode(req, wire::op::set, 0, "x", lockstep::bytes_of("2"));  // pipelined
  e.receive(*b, req, t);
  CHECK(replies(*b).size() == 2);
  auto ra = replies(*a);
  REQUIRE(ra.size() == 1);
  CHECK(ra[0].type == wire::op::ok);
  req.clear();
  wire::encode(req, wire::op::get, 2000, "z", {});
  e.receive(*a, req, t);
  REQUIRE(e.next_deadline().has_value());
  CHECK(*e.next_deadline() == t + 2000ms);
  e.tick(t + 1999ms);
  CHECK(e.out(*a).empty());
  e.tick(t + 2000ms);
  ra = replies(*a);
  REQUIRE(ra.size() == 1);
  CHECK(ra[0].type == wire::op::err);
  CHECK(ra[0].arg == static_cast<std::int64_t>(wire::err_code::timeout));
  CHECK(lockstep::string_of(ra[0].value).find("'z'") != std::string::npos);
  // A connection that never says hello is closed at its auth deadline.
  auto c = e.open("c", t);
  e.tick(t + 999ms);
  CHECK_FALSE(e.should_close(*c));
  e.tick(t + 1s);
  CHECK(e.should_close(*c));
  e.close(*c);
  // Connection cap.
  auto d = e.open("d", t);
  auto f = e.open("f", t);
  CHECK(d.has_value());
  CHECK(f.has_value());
  CHECK_FALSE(e.open("g", t).has_value());
}

TEST_CASE("wire: a hello of another run or for a gone store is refused naming both runs - the same run is admitted") {
  using eng = wire::store_engine;
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string ours = random_token(rng);
  std::string theirs = random_token(rng);
  const std::uint64_t instance = rng() | 1;
  eng e(ours, lockstep::store_limits{}, 16, 1s, instance);
  CHECK(e.instance() == instance);
  CHECK(e.run_id() == lockstep::run_id_of(ours));
  auto t = eng::clock::time_point{} + 1000h;
  //! One hello on a fresh connection: its single reply, and whether the server then closes it.
  auto hello = [&](std::span<const std::byte> frame, bool& closes) {
    auto id = e.open("10.0.0.7:4242", t);
    REQUIRE(id);
    e.receive(*id, frame, t);
    auto r = take_replies(e, *id, t);
    REQUIRE(r.size() == 1);
    closes = e.should_close(*id);
    if (closes) e.close(*id);
    return r[0];
  };
  bool closes = false;
  auto is_other_run = [](const wire::frame& f) {
    return f.type == wire::op::err && f.arg == static_cast<std::int64_t>(wire::err_code::other_run);
  };
  // The same run, first connection and reconnection to this store: admitted, told the instance.
  for (std::uint64_t joined : {std::uint64_t{0}, instance}) {
    const auto ok = hello(hello_frame(ours, joined), closes);
    CHECK(ok.type == wire::op::ok);
    CHECK_FALSE(closes);
    const auto w = wire::decode_welcome(ok.value);
    REQUIRE(w.has_value());
    CHECK(w->instance == instance);
  }
  // Another run: refused, both runs named by their ids, neither token printed.
  auto r = hello(hello_frame(theirs), closes);
  CHECK(is_other_run(r));
  CHECK(closes);
  std::string m = lockstep::string_of(r.value);
  CHECK_MESSAGE(m == "the store at this address belongs to run " + lockstep::run_id_of(ours) +
                         ", this process is of run " + lockstep::run_id_of(theirs),
                m);
  CHECK(m.find(ours) == std::string::npos);
  CHECK(m.find(theirs) == std::string::npos);
  // No token (an unnamed run) against a named store.
  r = hello(hello_frame(""), closes);
  CHECK(is_other_run(r));
  CHECK(lockstep::string_of(r.value).find("an unnamed run (no job token)") != std::string::npos);
  // Left over: this run's token, but it joined another store at this address.
  std::uint64_t old = rng();
  if (old == 0 || old == instance) old = instance + 1;
  r = hello(hello_frame(ours, old), closes);
  CHECK(is_other_run(r));
  CHECK(closes);
  m = lockstep::string_of(r.value);
  CHECK_MESSAGE(m == "this process joined store " + wire::instance_text(old) +
                         " at this address, which is gone; store " + wire::instance_text(instance) + " of run " +
                         lockstep::run_id_of(ours) + " listens there now (this process is of run " +
                         lockstep::run_id_of(ours) + ")",
                m);
  // A hello too short to hold its instance, and one of another protocol version.
  std::vector<std::byte> f;
  wire::encode(f, wire::op::hello, wire::protocol_version, {}, lockstep::bytes_of("abc"));
  r = hello(f, closes);
  CHECK(r.arg == static_cast<std::int64_t>(wire::err_code::malformed));
  CHECK(closes);
  f.clear();
  wire::encode(f, wire::op::hello, wire::protocol_version - 1, {}, lockstep::bytes_of(ours));
  r = hello(f, closes);
  CHECK(r.arg == static_cast<std::int64_t>(wire::err_code::bad_token));
  CHECK(lockstep::string_of(r.value).find("protocol version") != std::string::npos);
  // The server's log names the peer and both runs.
  const auto log = e.take_log();
  bool named_other = false, named_left_over = false;
  for (const auto& line : log) {
    named_other = named_other || line == "refused the connection from 10.0.0.7:4242: it is of run " +
                                             lockstep::run_id_of(theirs) + ", this store belongs to run " +
                                             lockstep::run_id_of(ours) +
                                             " (a process of an earlier run, or of another job, reached this "
                                             "port). This run goes on";
    named_left_over = named_left_over || line.find("a process left over from an earlier run (run " +
                                                   lockstep::run_id_of(ours) + ") reconnected") != std::string::npos;
  }
  CHECK(named_other);
  CHECK(named_left_over);
  // Run ids: 8 hex digits, "" without a token, equal for equal tokens.
  CHECK(lockstep::run_id_of("").empty());
  CHECK(lockstep::run_id_of(ours).size() == 8);
  CHECK(lockstep::run_id_of(ours) == lockstep::run_id_of(std::string(ours)));
}

TEST_CASE("wire: a watched connection that closes or goes silent sets its key once - unwatch cancels") {
  using eng = wire::store_engine;
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  eng e("tok", lockstep::store_limits{}, 8, 1s);
  auto t = eng::clock::time_point{} + 1000h;
  auto replies = [&](wire::store_engine::conn_id id) { return take_replies(e, id, t); };
  auto request = [&](eng::conn_id id, wire::op o, std::int64_t arg, std::string_view key, std::string_view value) {
    std::vector<std::byte> f;
    wire::encode(f, o, arg, key, lockstep::bytes_of(value));
    e.receive(id, f, t);
    auto r = replies(id);
    REQUIRE(r.size() == 1);
    return r[0];
  };
  auto connect = [&] {
    auto id = e.open("x", t);
    REQUIRE(id);
    e.receive(*id, hello_frame("tok"), t);
    REQUIRE(replies(*id).at(0).type == wire::op::ok);
    return *id;
  };
  const std::string key = "failed/" + std::to_string(rng() % 1000);
  const auto limit = std::chrono::milliseconds(200 + rng() % 5000);
  const auto watcher = connect();  // waits for the key, like a survivor
  std::vector<std::byte> w;
  wire::encode(w, wire::op::get, 100'000'000, key, {});
  e.receive(watcher, w, t);
  CHECK(e.out(watcher).empty());

  // A clean leave: unwatch, then close. Nothing is set.
  const auto clean = connect();
  CHECK(request(clean, wire::op::watch, limit.count(), key, "rank 1").type == wire::op::ok);
  CHECK(request(clean, wire::op::unwatch, 0, {}, {}).type == wire::op::ok);
  e.close(clean);
  e.tick(t + limit * 2);
  CHECK(e.out(watcher).empty());

  // Silence: heartbeats (any request) keep it alive; one limit without them fires.
  const auto quiet = connect();
  CHECK(request(quiet, wire::op::watch, limit.count(), key, "rank 2").type == wire::op::ok);
  for (int i = 0; i < 5; ++i) {
    t += limit / 2;
    e.tick(t);
    CHECK(request(quiet, wire::op::check, 0, {}, lockstep::string_of(wire::encode_key_list({key}))).arg == 0);
  }
  REQUIRE(e.next_deadline().has_value());
  CHECK(*e.next_deadline() == t + limit);
  e.tick(t + limit - 1ms);
  CHECK(e.out(watcher).empty());
  e.tick(t + limit);
  auto got = replies(watcher);
  REQUIRE(got.size() == 1);
  const std::string first = lockstep::string_of(got[0].value);
  CHECK(first.find("rank 2 stopped responding") == 0);

  // A close of another watched connection does not overwrite the first failure.
  const auto dying = connect();
  CHECK(request(dying, wire::op::watch, 0, key, "rank 3").type == wire::op::ok);
  e.close(dying);
  const auto reader = connect();
  auto v = request(reader, wire::op::get, 0, key, {});
  CHECK(lockstep::string_of(v.value) == first);
  // ... but each firing is kept under the key and its own text: who is gone.
  CHECK(lockstep::string_of(request(reader, wire::op::get, 0, key + "/rank 3", {}).value).find("rank 3 left") == 0);
  CHECK(lockstep::string_of(request(reader, wire::op::get, 0, key + "/rank 2", {}).value) == first);
  CHECK(request(reader, wire::op::check, 0, {}, lockstep::string_of(wire::encode_key_list({key + "/rank 1"}))).arg ==
        0);

  // set with flag 1 stores only when absent and says which happened.
  const std::string k2 = "once/" + std::to_string(rng());
  CHECK(request(reader, wire::op::set, 1, k2, "a").arg == 1);
  CHECK(request(reader, wire::op::set, 1, k2, "b").arg == 0);
  CHECK(lockstep::string_of(request(reader, wire::op::get, 0, k2, {}).value) == "a");
  CHECK(request(reader, wire::op::set, 0, k2, "c").arg == 1);  // a plain set overwrites
  CHECK(lockstep::string_of(request(reader, wire::op::get, 0, k2, {}).value) == "c");

  // A close fires at once (fresh key): the text says the process left.
  const std::string k3 = "gone/" + std::to_string(rng());
  const auto killed = connect();
  CHECK(request(killed, wire::op::watch, 0, k3, "rank 7").type == wire::op::ok);
  e.close(killed);
  CHECK(lockstep::string_of(request(reader, wire::op::get, 0, k3, {}).value).find("rank 7 left") == 0);
  // Malformed watches close the connection: no text, unknown set flags.
  for (auto [o, arg, k, val] : {std::tuple{wire::op::watch, 0, std::string("k"), std::string()},
                                std::tuple{wire::op::set, 2, std::string("k"), std::string("v")},
                                std::tuple{wire::op::watch, -1, std::string("k"), std::string("r")}}) {
    const auto bad = connect();
    std::vector<std::byte> f;
    wire::encode(f, o, arg, k, lockstep::bytes_of(val));
    e.receive(bad, f, t);
    CHECK(replies(bad).at(0).type == wire::op::err);
    CHECK(e.should_close(bad));
    e.close(bad);
  }
}

TEST_CASE("TcpStore: watch - set_if_absent - unwatch over sockets") {
  TcpStore server("127.0.0.1", 0, true, 3, "t", 5s);
  {
    TcpStore a("127.0.0.1", server.port(), false, 3, "t", 5s);
    a.watch("dead", "rank 1", 0ms);
    TcpStore b("127.0.0.1", server.port(), false, 3, "t", 5s);
    b.watch("dead", "rank 2", 0ms);
    b.unwatch();
  }  // both close; only a's watch fires
  CHECK(lockstep::string_of(server.get("dead")).find("rank 1 left") == 0);
  CHECK(server.check({"dead/rank 1"}));
  CHECK_FALSE(server.check({"dead/rank 2"}));  // unwatched: a clean leave
  CHECK_FALSE(server.set_if_absent("dead", lockstep::bytes_of("later")));
  CHECK(lockstep::string_of(server.get("dead")).find("rank 1 left") == 0);
  CHECK(server.set_if_absent("fresh", lockstep::bytes_of("x")));
  CHECK_THROWS_AS(server.watch("k", "", 0ms), lockstep::config_error);
}

}  // TEST_SUITE
