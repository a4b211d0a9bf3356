// GpuMonitor without GPUs: NVML absent (or a file that is not NVML) is reported, never thrown
// unless asked, and start/stop do not hang; the thread's period, its prompt stop and its
// handling of exceptions are checked through an injected fake sampler, as are the progress
// line and the ScalarLog tags. Where NVML is present (the GPU machine) the first test reads
// it; tests/cuda/test_nvml_monitor.cu checks the values against CUDA's.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <lockstep/lockstep.hpp>

namespace {

using namespace std::chrono_literals;
using ms = std::chrono::duration<double, std::milli>;

//! Counts its calls; optionally throws; stands in for NVML.
struct fake_state {
  std::atomic<int> calls{0};
  std::atomic<bool> throw_now{false};
  std::string reason;  // non-empty: unavailable
};

class FakeSampler final : public lockstep::GpuSampler {
 public:
  explicit FakeSampler(fake_state& s) : s_(&s) {}
  std::string unavailable_reason() const override { return s_->reason; }
  std::vector<lockstep::gpu_sample> sample() override {
    const int n = ++s_->calls;
    if (s_->throw_now) throw std::runtime_error("fake sensor broke at call " + std::to_string(n));
    lockstep::gpu_sample g;
    g.device = 0;
    g.util_pct = n;
    g.mem_used_bytes = 3ull << 30;
    g.mem_total_bytes = 80ull << 30;
    g.temp_c = 50;
    g.power_w = 300;
    return {g};
  }

 private:
  fake_state* s_;
};

//! A scalar_sink that keeps what it is given, by tag and step.
struct memory_sink {
  std::map<std::pair<std::string, std::int64_t>, double>* out;
  void scalar(std::string_view tag, std::int64_t step, double v, double) { (*out)[{std::string(tag), step}] = v; }
  void flush() {}
};

double elapsed_ms(std::chrono::steady_clock::time_point t0) {
  return ms(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("gpu_monitor: NVML absent is reported without a throw - start and stop are no-ops") {
  lockstep::GpuMonitor mon;
  INFO("reason: " << mon.unavailable_reason());
  if (mon.available()) {  // the GPU machine: NVML is there; the values are checked in tests/cuda
    MESSAGE("NVML present: " << lockstep::describe_gpus_now());
    CHECK(mon.running());
    for (int i = 0; i < 100 && mon.latest().empty(); ++i) std::this_thread::sleep_for(10ms);
    CHECK(!mon.latest().empty());
  } else {
    CHECK(mon.unavailable_reason().find("NVML") == 0);
    CHECK(!mon.running());
    mon.start();
    CHECK(!mon.running());
    CHECK(mon.latest().empty());
    CHECK(mon.summary().empty());
    CHECK(lockstep::describe_gpus_now().find("GPU monitor: unavailable (NVML") == 0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  mon.stop();
  mon.stop();
  CHECK(elapsed_ms(t0) < 1000.0);
}

TEST_CASE("gpu_monitor: a missing library and a library without NVML's functions are named") {
  lockstep::GpuMonitor absent({.nvml_library = "/nonexistent/libnvidia-ml.so.1"});
  CHECK(!absent.available());
  CHECK(absent.unavailable_reason().find("NVML not found: /nonexistent/libnvidia-ml.so.1") == 0);
  CHECK(absent.unavailable_reason().find("LD_LIBRARY_PATH") != std::string::npos);

  lockstep::GpuMonitor not_nvml({.nvml_library = "libc.so.6"});  // loads, but holds no NVML
  CHECK(!not_nvml.available());
  CHECK(not_nvml.unavailable_reason().find("NVML at 'libc.so.6' lacks nvmlInit_v2") == 0);

  CHECK_THROWS_WITH_AS(lockstep::GpuMonitor({.require = true, .nvml_library = "/nonexistent/libnvidia-ml.so"}),
                       doctest::Contains("GpuMonitor: NVML not found"), lockstep::config_error);
  CHECK(
      lockstep::describe_gpus_now("/nonexistent/libnvidia-ml.so.1").find("GPU monitor: unavailable (NVML not found") ==
      0);
  CHECK_THROWS_AS(lockstep::GpuMonitor({.period = 0ms}), lockstep::config_error);
}

TEST_CASE("gpu_monitor: an unavailable sampler makes start and stop no-ops") {
  fake_state st;
  st.reason = "fake: no GPUs";
  lockstep::GpuMonitor mon(std::make_unique<FakeSampler>(st), {.period = 10ms});
  CHECK(!mon.available());
  CHECK(mon.unavailable_reason() == "fake: no GPUs");
  mon.start();
  std::this_thread::sleep_for(50ms);
  mon.stop();
  CHECK(st.calls == 0);
  CHECK(!mon.running());
  CHECK_THROWS_WITH_AS(lockstep::GpuMonitor(std::make_unique<FakeSampler>(st), {.require = true}),
                       "GpuMonitor: fake: no GPUs", lockstep::config_error);
}

TEST_CASE("gpu_monitor: one sample at start then one per period - stop() returns promptly") {
  fake_state st;
  std::atomic<int> seen{0};
  {
    lockstep::GpuMonitor mon(std::make_unique<FakeSampler>(st),
                             {.period = 100ms, .on_sample = [&](const std::vector<lockstep::gpu_sample>& s) {
                                CHECK(s.size() == 1);
                                ++seen;
                              }});
    CHECK(mon.running());
    const auto t0 = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(1050ms);
    const int calls = st.calls;
    const double ran = elapsed_ms(t0);
    mon.stop();
    MESSAGE(calls << " samples in " << ran << " ms at a 100 ms period (ideal: 11)");
    CHECK(calls >= 6);   // generous: 2 shared cores may delay the thread
    CHECK(calls <= 12);  // never a burst: the period is a lower bound between samples
    CHECK(seen == calls);
    CHECK(mon.samples_taken() == static_cast<std::uint64_t>(calls));
    CHECK(mon.latest().at(0).util_pct == calls);
    std::this_thread::sleep_for(250ms);
    CHECK(st.calls == calls);  // stopped means stopped
    mon.start();               // and it starts again
    for (int i = 0; i < 100 && st.calls == calls; ++i) std::this_thread::sleep_for(5ms);
    CHECK(st.calls > calls);
  }  // the destructor joins

  fake_state slow;
  lockstep::GpuMonitor mon(std::make_unique<FakeSampler>(slow), {.period = 60s});
  for (int i = 0; i < 200 && slow.calls == 0; ++i) std::this_thread::sleep_for(5ms);
  CHECK(slow.calls == 1);  // the first sample comes at once, not after a period
  std::this_thread::sleep_for(20ms);
  const auto t0 = std::chrono::steady_clock::now();
  mon.stop();
  const double took = elapsed_ms(t0);
  MESSAGE("stop() during a 60 s period wait took " << took << " ms");
  WARN_MESSAGE(took < 50.0, "stop() took " << took << " ms (aim: < 50 ms; the machine may be loaded)");
  CHECK(took < 1000.0);
  CHECK(!mon.running());
}

TEST_CASE("gpu_monitor: exceptions of the sampler and of on_sample are kept - sampling goes on") {
  fake_state st;
  std::atomic<int> callbacks{0};
  lockstep::GpuMonitor mon(std::make_unique<FakeSampler>(st),
                           {.period = 10ms, .on_sample = [&](const std::vector<lockstep::gpu_sample>&) {
                              if (++callbacks <= 3) throw std::logic_error("callback broke");
                            }});
  for (int i = 0; i < 400 && callbacks < 6; ++i) std::this_thread::sleep_for(5ms);
  CHECK(callbacks >= 6);  // it kept calling after three throws
  CHECK(mon.errors() == 3);
  CHECK(mon.last_error() == "GpuMonitorOptions::on_sample threw: callback broke");
  CHECK_THROWS_WITH_AS(mon.rethrow_error(), "callback broke", std::logic_error);

  st.throw_now = true;
  const int before = st.calls;
  for (int i = 0; i < 400 && st.calls < before + 3; ++i) std::this_thread::sleep_for(5ms);
  CHECK(st.calls >= before + 3);  // still sampling
  CHECK(mon.errors() >= 5);
  CHECK(mon.last_error().find("the GPU sampler threw: fake sensor broke at call ") == 0);
  CHECK_THROWS_WITH_AS(mon.rethrow_error(), "callback broke", std::logic_error);  // the first stays
  CHECK(!mon.latest().empty());                                                   // the last good sample is kept
  mon.stop();
}

TEST_CASE("gpu_monitor: format_gpu_samples and log_gpu_samples write what the samples hold") {
  lockstep::gpu_sample a;
  a.device = 0;
  a.util_pct = 97;
  a.mem_used_bytes = static_cast<std::uint64_t>(61.2 * (1ull << 30));
  a.mem_total_bytes = static_cast<std::uint64_t>(79.6 * (1ull << 30));
  a.temp_c = 64;
  a.power_w = 512.3;
  lockstep::gpu_sample b;  // a GPU reporting nothing but its memory
  b.device = 3;
  b.mem_used_bytes = 1ull << 29;
  b.mem_total_bytes = 1ull << 34;
  CHECK(lockstep::format_gpu_samples({a, b}) ==
        "GPU0 97% 61.2/79.6 GiB 64\u00b0C 512 W | GPU3 ?% 0.5/16.0 GiB ?\u00b0C ? W");
  CHECK(lockstep::format_gpu_samples({}).empty());
  lockstep::gpu_sample c;  // nothing at all
  c.device = 1;
  CHECK(lockstep::format_gpu_samples({c}) == "GPU1 ?% ? GiB ?\u00b0C ? W");

  std::map<std::pair<std::string, std::int64_t>, double> got;
  {
    lockstep::ScalarLog log;  // rank -1: inactive, writes nothing
    lockstep::log_gpu_samples(log, 1, {a});
  }
  lockstep::ScalarLog log(0, {});
  log.add(memory_sink{&got});
  lockstep::log_gpu_samples(log, 7, {a, b, c});
  CHECK(got.size() == 5);
  CHECK(got.at({"gpu0/util", 7}) == 97);
  CHECK(got.at({"gpu0/mem_used_gib", 7}) == doctest::Approx(61.2).epsilon(1e-9));
  CHECK(got.at({"gpu0/temp_c", 7}) == 64);
  CHECK(got.at({"gpu0/power_w", 7}) == doctest::Approx(512.3));
  CHECK(got.at({"gpu3/mem_used_gib", 7}) == 0.5);

  fake_state st;
  lockstep::GpuMonitor mon(std::make_unique<FakeSampler>(st), {.period = 1h});
  for (int i = 0; i < 200 && mon.latest().empty(); ++i) std::this_thread::sleep_for(5ms);
  got.clear();
  mon.log(log, 9);
  CHECK(got.size() == 4);
  CHECK(got.at({"gpu0/util", 9}) == 1);
  CHECK(mon.summary() == "GPU0 1% 3.0/80.0 GiB 50\u00b0C 300 W");
}

TEST_CASE("gpu_monitor: the documented uses compile and run") {
  lockstep::ScalarLog log(0, {});
  std::map<std::pair<std::string, std::int64_t>, double> got;
  log.add(memory_sink{&got});
  {
    const std::int64_t step = 1;
    // [snippet include/lockstep/observe/gpu_monitor.hpp#1]
    lockstep::GpuMonitor mon;                    // starts sampling, or says why it cannot
    std::printf("%s\n", mon.summary().c_str());  // GPU0 97% 61.2/79.6 GiB 64°C 512 W | ...
    mon.log(log, step);                          // gpu0/util, gpu0/mem_used_gib, ... to a ScalarLog
    // [end snippet]
  }
  std::ostringstream out;
  lockstep::Rank0Logger logger(0, out);
  const int epoch = 1;
  const std::int64_t steps = 100;
  double loss = 0.5, rate = 1000;
  // [snippet docs/observe.md#1]
  lockstep::GpuMonitor gpus({.period = std::chrono::seconds(1)});  // starts at once
  if (!gpus.available()) logger.log("no GPU monitor: ", gpus.unavailable_reason());
  for (std::int64_t step = 1; step <= steps; ++step) {
    // ... one training step ...
    if (step % 50 == 0) {
      logger.progress(lockstep::progress_line(epoch, step, steps, loss, rate) + " | " + gpus.summary());
      gpus.log(log, step);  // gpu0/util, gpu0/mem_used_gib, gpu0/temp_c, gpu0/power_w
    }
  }
  // [end snippet]
  logger.end_progress();
  CHECK(out.str().find("step 100/100") != std::string::npos);
}

}  // TEST_SUITE
