// LOCKSTEP_TRACE: each rank writes a Chrome-trace JSON of its steps that Python's json reads
// (tests/support/read_trace.py), with every step, the model's forward and backward, each
// bucket collective and its wait, the loss scaler's check, clipping, the per-bucket
// callbacks and the skipped step where they happened — nested in time; unset, no file.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "observed_run.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;

namespace {

struct event {
  std::string ph, track, name;
  double ts = 0, dur = 0;
  std::string detail;
};

std::vector<event> read_trace(const fs::path& file, std::string& process) {
  int rc = 0;
  const std::string text = lockstep_test::command_output(
      std::string(LOCKSTEP_PYTHON) + " " + LOCKSTEP_READ_TRACE + " '" + file.string() + "'", rc);
  INFO(text);
  REQUIRE(rc == 0);
  std::vector<event> out;
  std::istringstream in(text);
  std::string line;
  std::getline(in, line);
  process = line.substr(line.find('\t') + 1);
  while (std::getline(in, line)) {
    std::istringstream f(line);
    event e;
    std::string ts, dur;
    std::getline(f, e.ph, '\t');
    std::getline(f, e.track, '\t');
    std::getline(f, e.name, '\t');
    std::getline(f, ts, '\t');
    std::getline(f, dur, '\t');
    std::getline(f, e.detail, '\t');
    e.ts = std::stod(ts);
    e.dur = std::stod(dur);
    out.push_back(e);
  }
  return out;
}

std::size_t count(const std::vector<event>& ev, const std::string& name) {
  std::size_t n = 0;
  for (const auto& e : ev) n += e.name == name ? 1 : 0;
  return n;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("trace: LOCKSTEP_TRACE writes each rank's steps as Chrome-trace JSON") {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const fs::path dir = fs::temp_directory_path() / ("lockstep_trace_" + std::to_string(seed));
  ::setenv("LOCKSTEP_TRACE", dir.c_str(), 1);
  const int steps = 4, bad_step = 2;
  std::size_t buckets = 0;
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    lockstep::Sgd opt({.lr = 0.05});
    const auto n =
        lockstep_test::observed_run(ctx, seed, steps, bad_step, [&](std::span<const lockstep::param_slice> sl) {
          for (const auto& p : sl)
            opt.step_segments(std::vector<std::size_t>{p.param * 1000 + p.offset},
                              std::vector<lockstep::segment>{{p.value, p.count}},
                              std::vector<lockstep::segment>{{p.grad, p.count}}, p.type);
        });
    if (ctx.rank() == 0) buckets = n;
  });
  ::unsetenv("LOCKSTEP_TRACE");
  REQUIRE(buckets > 2);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const auto file = dir / ("lockstep_trace.rank" + std::to_string(r) + ".pid" + std::to_string(::getpid()) + ".json");
    REQUIRE(fs::exists(file));
    std::string process;
    const auto ev = read_trace(file, process);
    CHECK(process == "rank " + std::to_string(r));
    CHECK(count(ev, "step") == steps);
    CHECK(count(ev, "forward + backward") == steps);
    CHECK(count(ev, "finish") == steps);
    CHECK(count(ev, "unscale + inf/NaN check") == steps);
    CHECK(count(ev, "clip by global norm") == steps - 1);  // not on the skipped step
    CHECK(count(ev, "step skipped: inf/NaN gradients") == 1);
    std::size_t callbacks = 0, collectives = 0, waits = 0;
    for (const auto& e : ev) {
      callbacks += e.track == "optimizer" ? 1 : 0;
      if (e.track == "communication") {
        ++collectives;
        CHECK(e.detail.find(" bytes f32") != std::string::npos);
      }
      waits += e.name == "wait" ? 1 : 0;
    }
    CHECK(callbacks == buckets * (steps - 1));  // every bucket of every applied step
    CHECK(collectives >= steps);
    CHECK(waits == collectives);
    // Every event of a step lies inside its "step" span (spans are host-clock intervals).
    std::vector<std::pair<double, double>> spans;
    for (const auto& e : ev)
      if (e.name == "step") spans.push_back({e.ts, e.ts + e.dur});
    for (const auto& e : ev) {
      if (e.name == "step") continue;
      bool inside = false;
      for (const auto& [a, b] : spans) inside = inside || (e.ts >= a - 1e-3 && e.ts + e.dur <= b + 1e-3);
      CAPTURE(e.name);
      CHECK(inside);
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST_CASE("trace: without LOCKSTEP_TRACE nothing is written") {
  ::unsetenv("LOCKSTEP_TRACE");
  CHECK(lockstep::detail::trace_log::from_env(0) == nullptr);
}

}  // TEST_SUITE
