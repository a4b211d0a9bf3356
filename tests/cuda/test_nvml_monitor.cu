// GpuMonitor on real GPUs, through NVML: every visible GPU read by its PCI bus id, values in
// range and the memory size agreeing with CUDA's for the same device; start and stop clean;
// and a GPU step loop timed with and without the monitor sampling at 1 Hz — printed for the
// record (bench/RESULTS.md), not asserted: speed is checked by benchmarks, not by timed tests.
// Skips ("[lockstep-skip]") without a GPU or without NVML.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/cuda.cuh>
#include <lockstep/lockstep.hpp>

#include "gpu_test_util.cuh"

namespace {

using namespace std::chrono_literals;

__global__ void busy_kernel(float* x, int n, int iters) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = x[i];
  for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
  x[i] = v;
}

//! One "training step": a few kernels, then the host waits for them (as it does to read a loss).
void one_step(float* x, int n, cudaStream_t s) {
  for (int k = 0; k < 8; ++k) busy_kernel<<<(n + 255) / 256, 256, 0, s>>>(x, n, 32);
  LOCKSTEP_TRY_CUDA(cudaGetLastError());
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
}

double run_steps(float* x, int n, cudaStream_t s, int steps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) one_step(x, n, s);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("gpu_monitor: NVML readings of every visible GPU are in range and match CUDA's memory size") {
  LOCKSTEP_REQUIRE_GPUS(1);
  const int n = lockstep::test::visible_gpus();
  // [snippet docs/observe.md#2]
  std::vector<std::string> ids;
  for (int d = 0; d < n; ++d) {
    char bus[32];
    LOCKSTEP_TRY_CUDA(cudaDeviceGetPCIBusId(bus, sizeof bus, d));
    ids.push_back(bus);
  }
  lockstep::GpuMonitor gpus({.pci_bus_ids = ids});  // gpu0 is CUDA device 0, ...
  // [end snippet]
  if (!gpus.available()) {
    std::printf("[lockstep-skip] no GPU monitor here: %s\n", gpus.unavailable_reason().c_str());
    return;
  }
  CHECK(gpus.running());
  std::vector<lockstep::gpu_sample> got;
  for (int i = 0; i < 300 && (got = gpus.latest()).empty(); ++i) std::this_thread::sleep_for(10ms);
  REQUIRE(got.size() == static_cast<std::size_t>(n));
  std::printf("CUDA ids -> NVML: %s\n%s", gpus.summary().c_str(), lockstep::describe_gpus_now().c_str());
  for (int d = 0; d < n; ++d) {
    const auto& g = got[static_cast<std::size_t>(d)];
    cudaDeviceProp prop{};
    LOCKSTEP_TRY_CUDA(cudaGetDeviceProperties(&prop, d));
    CAPTURE(d);
    CAPTURE(prop.name);
    CAPTURE(g.name);
    CAPTURE(g.pci_bus_id);
    CHECK(g.device == d);
    CHECK(g.util_pct >= 0.0);
    CHECK(g.util_pct <= 100.0);
    CHECK(g.mem_total_bytes > 0);
    CHECK(g.mem_used_bytes <= g.mem_total_bytes);
    const double cuda_total = static_cast<double>(prop.totalGlobalMem);
    CAPTURE(cuda_total);
    CAPTURE(g.mem_total_bytes);
    CHECK(static_cast<double>(g.mem_total_bytes) == doctest::Approx(cuda_total).epsilon(0.01));
    CHECK(g.temp_c >= 10.0);
    CHECK(g.temp_c <= 110.0);
    CHECK(g.power_w > 0.0);
    CHECK(g.power_w < 2000.0);
    CHECK(g.wall_time > 1.6e9);
  }
  const auto t0 = std::chrono::steady_clock::now();
  gpus.stop();
  const double stop_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("stop() took %.3f ms\n", stop_ms);
  CHECK(!gpus.running());
  CHECK(gpus.errors() == 0);
  const auto taken = gpus.samples_taken();
  gpus.start();  // starts again: one more sample at once
  for (int i = 0; i < 300 && gpus.samples_taken() == taken; ++i) std::this_thread::sleep_for(10ms);
  CHECK(gpus.samples_taken() > taken);
}

TEST_CASE("gpu_monitor: a GPU step loop timed with and without the monitor at 1 Hz (printed)") {
  LOCKSTEP_REQUIRE_GPUS(1);
  lockstep::GpuMonitor mon({.period = 1s, .start = false});
  if (!mon.available()) {
    std::printf("[lockstep-skip] no GPU monitor here: %s\n", mon.unavailable_reason().c_str());
    return;
  }
  LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
  const int n = 1 << 22;
  float* x = nullptr;
  cudaStream_t s = nullptr;
  LOCKSTEP_TRY_CUDA(cudaMalloc(&x, sizeof(float) * n));
  LOCKSTEP_TRY_CUDA(cudaMemset(x, 0, sizeof(float) * n));
  LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  (void)run_steps(x, n, s, 50);  // warm up
  const double per_step = run_steps(x, n, s, 200) / 200;
  const int steps = std::max(100, static_cast<int>(3.0 / per_step));  // about 3 s a run: 3 samples at 1 Hz
  std::vector<double> off, on;
  for (int rep = 0; rep < 3; ++rep) {
    off.push_back(run_steps(x, n, s, steps) / steps);
    mon.start();
    on.push_back(run_steps(x, n, s, steps) / steps);
    mon.stop();
  }
  LOCKSTEP_TRY_CUDA(cudaStreamDestroy(s));
  LOCKSTEP_TRY_CUDA(cudaFree(x));
  const double a = median(off), b = median(on), slower = (b - a) / a * 100.0;
  cudaDeviceProp prop{};
  LOCKSTEP_TRY_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("gpu_monitor overhead on %s: %d steps a run, median of 3 runs each: without %.4f ms/step, "
              "with the monitor at 1 Hz %.4f ms/step (%+.2f%%); %llu samples taken\n",
              prop.name, steps, a * 1e3, b * 1e3, slower, static_cast<unsigned long long>(mon.samples_taken()));
  CHECK(mon.samples_taken() >= 6);  // it did sample during the timed runs
  CHECK(mon.errors() == 0);
  WARN_MESSAGE(slower < 5.0, "the monitor slowed the step loop by " << slower << "% (more than 5%)");
}

}  // TEST_SUITE
