// NVTX ranges (observe/detail/nvtx.hpp) as a tool sees them: tests/support/nvtx_injection.cpp is
// loaded by NVTX itself, as Nsight Systems' library would be (NVTX_INJECTION64_PATH), and
// records every range of the "lockstep" domain. Three CPU ranks, small buckets, loss scaling
// with a skipped step, clipping and per-bucket callbacks: each rank's thread shows every step
// and its phases, each bucket's collective, wait and callback by number, pushes and pops
// balanced. Built where the CUDA toolkit's NVTX3 headers are found (they need no GPU).
#include <doctest/doctest.h>

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "observed_run.hpp"
#include "test_util.hpp"

TEST_SUITE("cpu") {

#ifdef LOCKSTEP_NVTX_INJECTION
TEST_CASE(
    "nvtx: a tool attached through NVTX sees every step phase and the collective - wait - callback of each bucket") {
  static_assert(LOCKSTEP_NVTX == 1, "the test is built with LOCKSTEP_WITH_NVTX and the NVTX3 headers");
  ::setenv("NVTX_INJECTION64_PATH", LOCKSTEP_NVTX_INJECTION, 1);  // before the first NVTX call
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const int steps = 4, bad_step = 2, ranks = 3;
  std::size_t buckets = 0;
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    const auto n =
        lockstep_test::observed_run(ctx, seed, steps, bad_step, [](std::span<const lockstep::param_slice>) {});
    if (ctx.rank() == 0) buckets = n;
  });
  REQUIRE(buckets > 2);

  void* tool = ::dlopen(LOCKSTEP_NVTX_INJECTION, RTLD_NOW | RTLD_NOLOAD);
  REQUIRE_MESSAGE(tool != nullptr, "NVTX did not load the tool from NVTX_INJECTION64_PATH");
  using events_fn = const char* (*)();
  auto events = reinterpret_cast<events_fn>(::dlsym(tool, "lockstep_nvtx_events"));
  const bool has_events = events != nullptr;
  REQUIRE_MESSAGE(has_events, "the tool has no lockstep_nvtx_events");
  const std::string text = events();
  ::dlclose(tool);

  struct per_thread {
    std::map<std::string, int> pushes, starts;
    std::set<std::string> payloads;  // "name#bucket"
    int depth = 0, deepest = 0;
    bool underflow = false;
  };
  std::map<std::string, per_thread> threads;
  std::map<std::string, int> open_starts;  // range id -> 1 while open
  int domains = 0;
  for (const auto& row : lockstep_test::tab_fields(text, 4)) {
    const std::string &tid = row[0], &kind = row[1], &name = row[2], &payload = row[3];
    auto& t = threads[tid];
    if (kind == "domain") {
      CHECK(name == "lockstep");
      ++domains;
    } else if (kind == "push") {
      ++t.pushes[name];
      if (payload != "-") t.payloads.insert(name + "#" + payload);
      t.deepest = std::max(t.deepest, ++t.depth);
    } else if (kind == "pop") {
      if (--t.depth < 0) t.underflow = true;
    } else if (kind == "start") {
      ++t.starts[name];
      open_starts[payload] = 1;
    } else if (kind == "end") {
      CHECK(open_starts.erase(payload) == 1);  // ends only what was started, once
    }
  }
  CHECK(domains == 1);
  CHECK(open_starts.empty());
  int rank_threads = 0;
  for (const auto& [tid, t] : threads) {
    if (t.starts.empty()) continue;  // the domain's creator, if another thread
    ++rank_threads;
    CAPTURE(tid);
    CHECK_FALSE(t.underflow);
    CHECK(t.depth == 0);
    CHECK(t.deepest >= 2);  // a phase inside "finish"
    CHECK(t.starts.at("step") == steps);
    CHECK(t.starts.at("forward + backward") == steps);
    CHECK(t.pushes.at("finish") == steps);
    CHECK(t.pushes.at("unscale + inf/NaN check") == steps);
    CHECK(t.pushes.at("clip by global norm") == steps - 1);  // not on the skipped step
    CHECK(t.pushes.at("bucket callback") == static_cast<int>(buckets) * (steps - 1));
    CHECK(t.pushes.at("collective issued") >= steps);
    CHECK(t.pushes.at("wait for bucket") == t.pushes.at("collective issued"));
    for (std::size_t b = 0; b < buckets; ++b) CHECK(t.payloads.count("bucket callback#" + std::to_string(b)) == 1);
  }
  CHECK(rank_threads == ranks);
}
#else
TEST_CASE("nvtx: not built") {
  MESSAGE("[lockstep-skip] the NVTX3 headers (CUDA toolkit, nvtx3/nvToolsExt.h) were not found: the NVTX test is not "
          "built");
}
#endif
}
