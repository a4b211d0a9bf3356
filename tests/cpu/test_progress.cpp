// Progress lines of long phases (docs/observe.md, "Progress on long phases"): the throttle
// under an injected clock, the start-up rendezvous naming the ranks still missing, checkpoint
// save and load with a low threshold, and silence when everything is fast.
#include <doctest/doctest.h>

#include <lockstep/checkpoint/checkpoint.hpp>
#include <lockstep/checkpoint/file.hpp>
#include <lockstep/core/host_memory.hpp>
#include <lockstep/core/progress.hpp>
#include <lockstep/launch/job_store.hpp>
#include <lockstep/store/detail/arrivals.hpp>
#include <lockstep/store/tcp_store.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "net_util.hpp"
#include "stderr_capture.hpp"
#include "test_util.hpp"

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

//! Collects the lines a sink receives, from any thread.
struct lines {
  std::mutex m;
  std::vector<std::string> v;
  lockstep::progress_options options(std::optional<std::chrono::milliseconds> first = {},
                                     std::optional<std::chrono::milliseconds> every = {}) {
    return {.enabled = true, .first = first, .every = every, .sink = [this](std::string_view line) {
              std::lock_guard lk(m);
              v.emplace_back(line);
            }};
  }
  std::vector<std::string> get() {
    std::lock_guard lk(m);
    return v;
  }
};

bool starts_with(const std::string& s, std::string_view p) { return s.compare(0, p.size(), p) == 0; }
bool has(const std::string& s, std::string_view p) { return s.find(p) != std::string::npos; }

//! Sets an environment variable for one scope, restoring the previous value.
struct scoped_env {
  std::string name;
  std::optional<std::string> old;
  scoped_env(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    if (value) ::setenv(n, value, 1);
    else ::unsetenv(n);
  }
  ~scoped_env() {
    if (old) ::setenv(name.c_str(), old->c_str(), 1);
    else ::unsetenv(name.c_str());
  }
};

lockstep::launch_info job(int rank, int world, int port) {
  return {.rank = rank,
          .world = world,
          .local_rank = rank,
          .local_world = world,
          .master_addr = "127.0.0.1",
          .master_port = port,
          .launcher = "explicit",
          .job_token = "progress-test"};
}

//! A checkpoint of about `bytes` bytes of parameters.
lockstep::Checkpoint big_checkpoint(std::size_t bytes, std::vector<float>& storage) {
  storage.assign(bytes / sizeof(float), 0.5f);
  for (std::size_t i = 0; i < storage.size(); i += 1024) storage[i] = static_cast<float>(i);
  lockstep::Checkpoint ck;
  ck.meta.step = 7;
  std::vector<lockstep::parameter> ps{
      lockstep::param<float>("w", std::span<float>(storage), std::span<float>(storage))};
  ck.add_parameters(ps, lockstep::HostMemory{});
  return ck;
}

using lockstep_test::stderr_capture;
using lockstep_test::temp_dir;

//! big_checkpoint(bytes) and the path of a file named `name` in a fresh directory to save it to.
struct checkpoint_in_dir {
  temp_dir dir{"lockstep_progress"};
  std::vector<float> storage;
  const lockstep::Checkpoint ck;
  const fs::path file;
  checkpoint_in_dir(std::size_t bytes, const char* name)
      : ck(big_checkpoint(bytes, storage)), file(fs::path(dir.path) / name) {}
};

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("progress throttles its lines under an injected clock") {
  scoped_env quiet("LOCKSTEP_PROGRESS", nullptr);
  using clk = lockstep::detail::progress::clock;
  clk::time_point t{};
  lines out;
  lockstep::detail::progress p(out.options(), 2s, 5s, [&] { return t; });
  CHECK(p.enabled());
  CHECK_FALSE(p.due());
  t += 1999ms;
  CHECK_FALSE(p.due());
  p.finish("never: nothing was reported");
  CHECK(out.get().empty());
  t += 1ms;  // 2 s: the first line is due
  REQUIRE(p.due());
  CHECK(p.seconds() == doctest::Approx(2.0));
  p.report("one");
  CHECK(p.reported());
  CHECK_FALSE(p.due());
  t += 4999ms;
  CHECK_FALSE(p.due());
  t += 1ms;  // 5 s after the first
  CHECK(p.due());
  t += 60s;  // a late ask: one line, then the next 5 s after it
  p.report("two");
  CHECK_FALSE(p.due());
  t += 5s;
  CHECK(p.due());
  p.finish("done");
  CHECK(out.get() == std::vector<std::string>{"one", "two", "done"});

  // Options beat the phase's defaults.
  lines custom;
  lockstep::detail::progress q(custom.options(100ms, 50ms), 2s, 5s, [&] { return t; });
  t += 100ms;
  CHECK(q.due());
  q.report("a");
  t += 50ms;
  CHECK(q.due());

  // Off: by the options, or by LOCKSTEP_PROGRESS=0; a malformed value names the variable.
  auto off_opts = out.options();
  off_opts.enabled = false;
  lockstep::detail::progress off(off_opts, 0ms, 1ms, [&] { return t; });
  t += 10s;
  CHECK_FALSE(off.due());
  off.report("x");
  off.finish("y");
  {
    scoped_env zero("LOCKSTEP_PROGRESS", "0");
    lockstep::detail::progress silent(out.options(), 0ms, 1ms, [&] { return t; });
    CHECK_FALSE(silent.enabled());
    CHECK_FALSE(silent.due());
    silent.report("z");
  }
  CHECK(out.get().size() == 3);
  {
    scoped_env bad("LOCKSTEP_PROGRESS", "yes");
    CHECK_THROWS_WITH_AS(lockstep::detail::progress(out.options(), 0ms, 1ms),
                         doctest::Contains("LOCKSTEP_PROGRESS='yes'"), lockstep::config_error);
  }
  CHECK_THROWS_AS(lockstep::detail::progress(out.options(0ms, 0ms), 0ms, 1ms), lockstep::config_error);
}

TEST_CASE("progress texts: sizes and rates and rank lists") {
  using namespace lockstep::detail;
  CHECK(bytes_text(0) == "0 B");
  CHECK(bytes_text(999) == "999 B");
  CHECK(bytes_text(17'000) == "17.0 kB");
  CHECK(bytes_text(812e6) == "812 MB");
  CHECK(bytes_text(4.25e9) == "4.25 GB");
  CHECK(duration_text(15.2) == "15 s");
  CHECK(duration_text(2.44) == "2.4 s");
  CHECK(transfer_text(812'000'000, 4'000'000'000, 2.0) == "812 MB of 4.00 GB (20 %), 406 MB/s");
  CHECK(transfer_done_text(4'000'000'000, 10.0) == "4.00 GB in 10 s (400 MB/s)");
  CHECK(rank_list_text({3, 7}) == "3, 7");
  CHECK(rank_list_text({0, 1, 2, 3, 4, 5, 9}) == "0-5, 9");
  CHECK(rank_list_text({1, 2, 5}) == "1, 2, 5");
  std::vector<int> many;
  for (int r = 0; r < 40; r += 2) many.push_back(r);
  CHECK(rank_list_text(many) == "0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30 (+4 more)");
  CHECK(waiting_for_ranks_line({3, 7}, 8, 15.0, "node0:29500") ==
        "lockstep: waiting for ranks 3, 7 (2 of 8 missing) for 15 s at node0:29500");
  CHECK(waiting_for_ranks_line({1}, 2, 5.0, "h:1") == "lockstep: waiting for rank 1 (1 of 2 missing) for 5.0 s at h:1");
}

TEST_CASE("progress of the rendezvous names the ranks still missing") {
  scoped_env quiet("LOCKSTEP_PROGRESS", nullptr);
  const int port = lockstep_test::free_port();
  lines out;
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 0 hosts; rank 1 joins at once; ranks 2 and 3 arrive late, rank 3 last.
  auto host = lockstep::job_store(job(0, 4, port), 10s, {}, out.options(250ms, 150ms));
  auto r1 = lockstep::job_store(job(1, 4, port), 10s);
  auto late = [&](int rank, std::chrono::milliseconds after) {
    std::this_thread::sleep_for(after);
    (void)lockstep::job_store(job(rank, 4, port), 10s);
  };
  std::thread r2(late, 2, 600ms);
  std::thread r3(late, 3, 1200ms);
  r2.join();
  r3.join();
  // The closing line comes within ~200 ms of the last arrival.
  while (std::chrono::steady_clock::now() - t0 < 5s) {
    const auto v = out.get();
    if (!v.empty() && starts_with(v.back(), "lockstep: all 4 ranks arrived after ")) break;
    std::this_thread::sleep_for(20ms);
  }
  const auto v = out.get();
  for (const auto& l : v) MESSAGE(l);
  REQUIRE(v.size() >= 3);
  const std::string where = " at 127.0.0.1:" + std::to_string(port);
  CHECK(starts_with(v.front(), "lockstep: waiting for ranks 2, 3 (2 of 4 missing) for "));
  CHECK(has(v.front(), where));
  bool only_3 = false;
  for (const auto& l : v) only_3 = only_3 || starts_with(l, "lockstep: waiting for rank 3 (1 of 4 missing) for ");
  CHECK(only_3);
  CHECK(starts_with(v.back(), "lockstep: all 4 ranks arrived after "));
  CHECK(has(v.back(), where));
  for (std::size_t i = 0; i + 1 < v.size(); ++i) CHECK(starts_with(v[i], "lockstep: waiting for rank"));
  // At most one line per 150 ms after the first at 250 ms, over about a second.
  CHECK(v.size() <= 12);
}

TEST_CASE("progress of a fast rendezvous prints nothing") {
  scoped_env quiet("LOCKSTEP_PROGRESS", nullptr);
  const int port = lockstep_test::free_port();
  lines out;
  stderr_capture err;
  {
    auto host = lockstep::job_store(job(0, 3, port), 10s, {}, out.options(600ms, 100ms));
    std::thread r1([&] {
      auto s = lockstep::job_store(job(1, 3, port), 10s);
      lockstep::barrier(s, "met", 10s);
    });
    std::thread r2([&] {
      auto s = lockstep::job_store(job(2, 3, port), 10s);
      lockstep::barrier(s, "met", 10s);
    });
    lockstep::barrier(host, "met", 10s);
    r1.join();
    r2.join();
    std::this_thread::sleep_for(900ms);  // past the first line's time: the watch saw all three
  }
  // A store's own default (5 s) with nobody missing: silent on stderr too.
  {
    auto solo = lockstep::job_store(job(0, 1, 0), 10s);
    CHECK(solo.world() == 1);
  }
  const std::string text = err.finish();
  CHECK(out.get().empty());
  CHECK(text.empty());
}

TEST_CASE("progress of checkpoint save and load with a low threshold") {
  scoped_env quiet("LOCKSTEP_PROGRESS", nullptr);
  const checkpoint_in_dir big(std::size_t{6} << 20, "big.lsck");
  const auto& [dir, storage, ck, file] = big;
  lines saved, loaded;
  lockstep::save_checkpoint(file, ck, saved.options(0ms, 1ms));
  const auto back = lockstep::load_checkpoint(file, loaded.options(0ms, 1ms));
  CHECK(back.meta.step == 7);
  REQUIRE(back.parameters().size() == 1);
  CHECK(back.parameters()[0].values<float>() == storage);

  const std::string subject = "checkpoint '" + file.string() + "'";
  const auto s = saved.get(), l = loaded.get();
  for (const auto& x : s) MESSAGE(x);
  for (const auto& x : l) MESSAGE(x);
  REQUIRE(s.size() >= 3);
  CHECK(starts_with(s.front(), "lockstep: saving " + subject + ": "));
  CHECK(has(s.front(), " of 6.29 MB ("));
  CHECK(has(s.front(), "/s"));
  CHECK(starts_with(s[s.size() - 2], "lockstep: saving " + subject + ": 6.29 MB written, syncing it to disk"));
  CHECK(starts_with(s.back(), "lockstep: saved " + subject + ": 6.29 MB in "));
  CHECK(has(s.back(), "B/s)"));
  REQUIRE(l.size() == 2);
  CHECK(starts_with(l.front(), "lockstep: loading " + subject + ": 6.29 MB of 6.29 MB (100 %), "));
  CHECK(starts_with(l.back(), "lockstep: loaded " + subject + ": 6.29 MB in "));
}

TEST_CASE("progress of a fast checkpoint save and load prints nothing") {
  scoped_env quiet("LOCKSTEP_PROGRESS", nullptr);
  const checkpoint_in_dir small(std::size_t{1} << 20, "small.lsck");
  const auto& [dir, storage, ck, file] = small;
  lines out;
  stderr_capture err;
  lockstep::save_checkpoint(file, ck, out.options());
  (void)lockstep::load_checkpoint(file, out.options());
  lockstep::save_checkpoint(file, ck);  // the defaults, to stderr
  (void)lockstep::load_checkpoint(file);
  {
    scoped_env off("LOCKSTEP_PROGRESS", "0");  // off beats even a zero threshold
    lockstep::save_checkpoint(file, ck, out.options(0ms, 1ms));
    (void)lockstep::load_checkpoint(file, out.options(0ms, 1ms));
  }
  CHECK(err.finish().empty());
  CHECK(out.get().empty());
}

TEST_CASE("progress options of the docs") {
  scoped_env quiet("LOCKSTEP_PROGRESS", nullptr);
  temp_dir dir("lockstep_progress");
  std::vector<float> storage;
  const fs::path path = fs::path(dir.path) / "docs.lsck";
  lockstep::save_checkpoint(path, big_checkpoint(4096, storage));
  const auto info = job(0, 1, 0);
  stderr_capture err;
  // [snippet docs/observe.md#4]
  // Later and rarer lines for a job whose ranks start slowly anyway; only rank 0 reports a load.
  lockstep::progress_options patient{.first = std::chrono::seconds(60), .every = std::chrono::minutes(2)};
  auto store = lockstep::job_store(info, std::chrono::seconds(120), {}, patient);
  auto ck = lockstep::load_checkpoint(path, {.enabled = info.rank == 0});
  // [end snippet]
  CHECK(store.world() == 1);
  CHECK(ck.meta.step == 7);
  CHECK(err.finish().empty());
}

}  // TEST_SUITE
