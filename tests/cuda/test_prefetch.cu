// lockstep::Prefetcher (cuda/prefetch.cuh): batches made on helper threads, staged in pinned
// memory, copied on the prefetcher's stream and consumed on a compute stream.
//  - every batch, of random size and random bytes (fresh seed per run, printed), reaches the
//    device intact and in order: a kernel on the compute stream copies each batch into its
//    own output area, and the outputs are compared with the batches the producer made. With
//    a slow consumer (the kernel first holds the GPU ~0.3 ms) a slot refilled before the
//    compute stream is done with it would corrupt an output; with a fast one (large batches)
//    a kernel that ran before its copy landed would. Slots 1-4, workers 1-3, two runs back
//    to back without a host sync between them, the legacy default stream, a second GPU;
//  - a producer that throws at batch k: batches 0..k-1 arrive, next() for k rethrows (again
//    on the next call), nothing hangs; a new run then works;
//  - a slow producer and PrefetchOptions::timeout: timeout_error naming the batch;
//  - destruction mid-run joins at once and frees the device memory (many cycles);
//  - configuration errors name what to give; the header's and docs/prefetch.md's examples run.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/cuda.cuh>
#include <lockstep/cuda/prefetch.cuh>
#include <lockstep/data/sampler.hpp>

#include "gpu_test_util.cuh"

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

using lockstep::test::Stream;

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t bytes) { LOCKSTEP_TRY_CUDA(cudaMalloc(&p, bytes ? bytes : 1)); }
  ~DevBuf() { (void)cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

// Holds the GPU for `ns` nanoseconds (one block's worth is enough: the kernel is the whole
// step), then copies the batch into `out`: a late read of the slot.
__global__ void slow_copy(const unsigned char* __restrict__ in, unsigned char* __restrict__ out, std::size_t n,
                          long long ns) {
  if (ns > 0) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (static_cast<long long>(now - start) < ns);
  }
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    out[i] = in[i];
}

std::uint64_t fresh_seed() {
  std::random_device rd;
  const std::uint64_t s = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  MESSAGE("random seed " << s);
  return s;
}

// `count` batches of random bytes; sizes random in [0, max], the last ones partial, a few
// exactly max and one empty.
std::vector<std::vector<unsigned char>> random_batches(std::mt19937_64& rng, std::size_t count, std::size_t max) {
  std::vector<std::vector<unsigned char>> b(count);
  std::uniform_int_distribution<std::size_t> size(1, max);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t n = i % 7 == 3 ? max : i == count / 2 ? 0 : size(rng);
    b[i].resize(n);
    for (std::size_t k = 0; k < n; k += 8) {
      const std::uint64_t v = rng();
      std::memcpy(b[i].data() + k, &v, std::min<std::size_t>(8, n - k));
    }
  }
  return b;
}

struct run_config {
  std::size_t slots, workers;
  long long consumer_ns;  // the consumer kernel's hold before it reads the batch
  std::size_t max_bytes;
  bool legacy_stream = false;
  int device = 0;
};

// Two runs of `count` batches through one Prefetcher; every batch checked on the host.
void check_runs(const run_config& c, std::uint64_t seed) {
  CAPTURE(c.slots);
  CAPTURE(c.workers);
  CAPTURE(c.consumer_ns);
  CAPTURE(c.max_bytes);
  CAPTURE(c.legacy_stream);
  CAPTURE(c.device);
  lockstep::detail::device_guard g(c.device);
  constexpr std::size_t count = 24;
  std::mt19937_64 rng(seed);
  Stream own;
  const cudaStream_t compute = c.legacy_stream ? nullptr : own.s;
  DevBuf out(2 * count * c.max_bytes);
  auto* out_bytes = static_cast<unsigned char*>(out.p);
  std::vector<std::vector<unsigned char>> made[2];
  {
    lockstep::Prefetcher pf(c.device, compute, c.max_bytes, {.slots = c.slots, .workers = c.workers});
    CHECK(pf.slots() == c.slots);
    CHECK(pf.slot_bytes() == c.max_bytes);
    for (int run = 0; run < 2; ++run) {
      made[run] = random_batches(rng, count, c.max_bytes);
      const auto& batches = made[run];
      std::atomic<int> calls{0};
      pf.start(count, [&](std::size_t i, std::span<std::byte> host) {
        ++calls;
        CHECK(host.size() == c.max_bytes);  // doctest's asserts are thread-safe
        std::memcpy(host.data(), batches[i].data(), batches[i].size());
        return batches[i].size();
      });
      CHECK(pf.remaining() == count);
      for (std::size_t i = 0; i < count; ++i) {
        const lockstep::prefetched_batch b = pf.next();
        REQUIRE(b.index == i);
        REQUIRE(b.bytes == batches[i].size());
        unsigned char* dst = out_bytes + (static_cast<std::size_t>(run) * count + i) * c.max_bytes;
        slow_copy<<<264, 256, 0, compute>>>(b.as<const unsigned char>(), dst, b.bytes, c.consumer_ns);
        LOCKSTEP_CHECK_LAUNCH();
      }
      CHECK(pf.remaining() == 0);
      CHECK(calls.load() == static_cast<int>(count));
      CHECK_THROWS_WITH_AS(pf.next(), doctest::Contains("call start() for the next run"), lockstep::config_error);
      // No host synchronisation here: the next run's copies must wait for this run's kernels.
    }
    // The destructor waits for the compute stream to finish with the slots.
  }
  int now_device = -1;
  LOCKSTEP_TRY_CUDA(cudaGetDevice(&now_device));
  CHECK(now_device == c.device);  // the guard above; the Prefetcher restored it each call
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(compute));
  std::vector<unsigned char> got(c.max_bytes);
  std::size_t bad = 0;
  for (int run = 0; run < 2; ++run)
    for (std::size_t i = 0; i < count; ++i) {
      const auto& want = made[run][i];
      if (want.empty()) continue;
      LOCKSTEP_TRY_CUDA(cudaMemcpy(got.data(), out_bytes + (static_cast<std::size_t>(run) * count + i) * c.max_bytes,
                                   want.size(), cudaMemcpyDeviceToHost));
      if (std::memcmp(got.data(), want.data(), want.size()) != 0) {
        ++bad;
        std::size_t at = 0;
        while (got[at] == want[at]) ++at;
        MESSAGE("run " << run << " batch " << i << " (" << want.size() << " bytes) differs at byte " << at);
      }
    }
  CHECK(bad == 0);
}

std::string what_of(auto&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

// ---- the header's example, run ----------------------------------------------------------
__device__ unsigned long long g_sum;

__global__ void step(const float* x, std::size_t bytes) {
  const std::size_t n = bytes / sizeof(float);
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    atomicAdd(&g_sum, static_cast<unsigned long long>(x[i]));
}

unsigned long long read_sum(cudaStream_t s) {
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  unsigned long long v = 0;
  LOCKSTEP_TRY_CUDA(cudaMemcpyFromSymbol(&v, g_sum, sizeof v));
  return v;
}

void reset_sum() {
  const unsigned long long zero = 0;
  LOCKSTEP_TRY_CUDA(cudaMemcpyToSymbol(g_sum, &zero, sizeof zero));
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("prefetch: bad configuration is a config_error naming what to give") {
  // Checked before any CUDA call: these run without a GPU too.
  CHECK(what_of([] { lockstep::Prefetcher p(0, nullptr, 64, {.slots = 0}); }).find("PrefetchOptions::slots is 0") !=
        std::string::npos);
  CHECK(what_of([] { lockstep::Prefetcher p(0, nullptr, 64, {.workers = 0}); }).find("PrefetchOptions::workers is 0") !=
        std::string::npos);
  CHECK(what_of([] { lockstep::Prefetcher p(0, nullptr, 0); }).find("give the size in bytes of the largest batch") !=
        std::string::npos);
  CHECK_THROWS_AS(lockstep::Prefetcher(0, nullptr, 0), lockstep::config_error);
  LOCKSTEP_REQUIRE_GPUS(1);
  Stream s;
  lockstep::Prefetcher pf(0, s.s, 64);
  CHECK_THROWS_WITH_AS(pf.next(), doctest::Contains("call start(count, producer) first"), lockstep::config_error);
  CHECK_THROWS_WITH_AS(pf.start(3, lockstep::Prefetcher::producer_fn{}), doctest::Contains("the producer is empty"),
                       lockstep::config_error);
  // A producer that writes past its slot.
  pf.start(3, [](std::size_t i, std::span<std::byte> host) { return i == 1 ? host.size() + 1 : host.size(); });
  CHECK(pf.next().bytes == 64);
  CHECK_THROWS_WITH_AS(pf.next(), doctest::Contains("construct the Prefetcher with the largest batch's size"),
                       lockstep::config_error);
  // A run of no batches.
  pf.start(0, [](std::size_t, std::span<std::byte>) {});
  CHECK(pf.remaining() == 0);
  CHECK_THROWS_WITH_AS(pf.next(), doctest::Contains("all 0 batches"), lockstep::config_error);
  // A void producer copies the whole slot.
  pf.start(1, [](std::size_t, std::span<std::byte> host) { std::memset(host.data(), 7, host.size()); });
  CHECK(pf.next().bytes == 64);
  pf.stop();
  CHECK(pf.remaining() == 0);
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s.s));
}

TEST_CASE(
    "prefetch: every batch arrives intact and in order - slow and fast consumers - slots 1 to 4 - workers 1 to 3") {
  LOCKSTEP_REQUIRE_GPUS(1);
  const std::uint64_t seed = fresh_seed();
  const std::vector<run_config> configs = {
      // slow consumer: the producer runs far ahead; a slot refilled too early corrupts
      {2, 1, 300'000, 256 << 10},
      {1, 1, 300'000, 256 << 10},
      {3, 2, 300'000, 256 << 10},
      {4, 3, 300'000, 256 << 10},
      {2, 1, 300'000, 256 << 10, true},  // the legacy default stream as the compute stream
      // fast consumer, large batches: a kernel that ran before its copy landed reads stale data
      {2, 1, 0, 8 << 20},
      {3, 3, 0, 8 << 20},
  };
  std::uint64_t s = seed;
  for (const auto& c : configs) check_runs(c, s++);
  if (lockstep::test::visible_gpus() >= 2) {
    // A device other than the caller's current one (the helper threads must set it).
    LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
    check_runs({2, 2, 300'000, 256 << 10, false, 1}, s++);
    int d = -1;
    LOCKSTEP_TRY_CUDA(cudaGetDevice(&d));
    CHECK(d == 0);
  } else {
    MESSAGE("one GPU: the second-device case is not run");
  }
}

TEST_CASE("prefetch: a producer that throws at batch k surfaces in next() for batch k - no hang") {
  LOCKSTEP_REQUIRE_GPUS(1);
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  constexpr std::size_t count = 16, bytes = 64 << 10;
  struct shape {
    std::size_t slots, workers;
  };
  for (const shape sh : {shape{2, 1}, shape{3, 3}, shape{1, 2}}) {
    const std::size_t slots = sh.slots, workers = sh.workers;
    CAPTURE(slots);
    CAPTURE(workers);
    const std::size_t k = 1 + rng() % (count - 2);  // 1..count-2
    CAPTURE(k);
    const auto batches = random_batches(rng, count, bytes);
    const auto t0 = clock_type::now();
    Stream s;
    DevBuf out(count * bytes);
    lockstep::Prefetcher pf(0, s.s, bytes,
                            {.slots = slots, .workers = workers, .timeout = std::chrono::milliseconds(20'000)});
    std::atomic<std::size_t> made_after_k{0};
    pf.start(count, [&](std::size_t i, std::span<std::byte> host) -> std::size_t {
      if (i == k) throw std::runtime_error("producer failed at batch " + std::to_string(i));
      if (i > k) ++made_after_k;
      std::memcpy(host.data(), batches[i].data(), batches[i].size());
      return batches[i].size();
    });
    for (std::size_t i = 0; i < k; ++i) {
      const auto b = pf.next();
      REQUIRE(b.index == i);
      slow_copy<<<64, 256, 0, s.s>>>(b.as<const unsigned char>(), static_cast<unsigned char*>(out.p) + i * bytes,
                                     b.bytes, 50'000);
      LOCKSTEP_CHECK_LAUNCH();
    }
    const std::string why = "producer failed at batch " + std::to_string(k);
    CHECK_THROWS_WITH_AS(pf.next(), why.c_str(), std::runtime_error);
    CHECK_THROWS_WITH_AS(pf.next(), why.c_str(), std::runtime_error);  // again: the run stays failed
    CHECK(pf.remaining() == count - k);
    // Batches made after k (by other workers) are never handed out; at most one per worker
    // and slot can have been made before the failure was seen.
    CHECK(made_after_k.load() <= slots + workers);
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s.s));
    std::vector<unsigned char> got(bytes);
    for (std::size_t i = 0; i < k; ++i) {
      if (batches[i].empty()) continue;
      LOCKSTEP_TRY_CUDA(cudaMemcpy(got.data(), static_cast<unsigned char*>(out.p) + i * bytes, batches[i].size(),
                                   cudaMemcpyDeviceToHost));
      CHECK(std::memcmp(got.data(), batches[i].data(), batches[i].size()) == 0);
    }
    // The object is usable again after the failure: a fresh run delivers every batch.
    pf.start(count, [&](std::size_t i, std::span<std::byte> host) {
      std::memcpy(host.data(), batches[i].data(), batches[i].size());
      return batches[i].size();
    });
    for (std::size_t i = 0; i < count; ++i) CHECK(pf.next().bytes == batches[i].size());
    CHECK(seconds_since(t0) < 15.0);
  }
  // Failing at batch 0, and destroying the prefetcher with the error never collected.
  const auto t0 = clock_type::now();
  {
    Stream s;
    lockstep::Prefetcher pf(0, s.s, 1024, {.slots = 2, .workers = 2});
    pf.start(10, [](std::size_t i, std::span<std::byte>) -> std::size_t {
      throw lockstep::config_error("bad sample " + std::to_string(i));
    });
    CHECK_THROWS_WITH_AS(pf.next(), "bad sample 0", lockstep::config_error);
    lockstep::Prefetcher quiet(0, s.s, 1024, {.workers = 3});
    quiet.start(10, [](std::size_t, std::span<std::byte>) -> std::size_t { throw std::runtime_error("never read"); });
  }
  CHECK(seconds_since(t0) < 10.0);
}

TEST_CASE("prefetch: a slow producer meets PrefetchOptions::timeout with timeout_error naming the batch") {
  LOCKSTEP_REQUIRE_GPUS(1);
  Stream s;
  const auto t0 = clock_type::now();
  {
    lockstep::Prefetcher pf(0, s.s, 256, {.timeout = std::chrono::milliseconds(50)});
    pf.start(4, [](std::size_t i, std::span<std::byte> host) {
      if (i == 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
      return host.size();
    });
    CHECK(pf.next().index == 0);
    CHECK_THROWS_WITH_AS(pf.next(), doctest::Contains("batch 1 was not ready after 50 ms"), lockstep::timeout_error);
    // Still the same batch: waiting longer gets it.
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    CHECK(pf.next().index == 1);
    CHECK(pf.wait_seconds() >= 0.04);
  }
  CHECK(seconds_since(t0) < 5.0);
}

TEST_CASE("prefetch: destruction mid-run joins at once and frees its memory") {
  LOCKSTEP_REQUIRE_GPUS(1);
  LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
  Stream s;
  std::size_t free_before = 0, total = 0;
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  LOCKSTEP_TRY_CUDA(cudaMemGetInfo(&free_before, &total));
  const auto t0 = clock_type::now();
  std::atomic<int> calls{0};
  constexpr int cycles = 24;
  constexpr std::size_t bytes = 16 << 20;  // 4 slots × 16 MiB per cycle: 1.5 GiB if it leaked
  for (int cycle = 0; cycle < cycles; ++cycle) {
    lockstep::Prefetcher pf(0, s.s, bytes, {.slots = 4, .workers = 2});
    pf.start(1000, [&](std::size_t, std::span<std::byte> host) {
      ++calls;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      return host.size() / 2;
    });
    for (int i = 0; i < 3; ++i) {
      const auto b = pf.next();
      slow_copy<<<8, 256, 0, s.s>>>(b.as<const unsigned char>(), b.as<unsigned char>(b.bytes), 1024, 200'000);
      LOCKSTEP_CHECK_LAUNCH();
    }
    // Destroyed here with batches in flight, a kernel still reading one, workers blocked.
  }
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  const double took = seconds_since(t0);
  CHECK(took < 20.0);
  // At most slots + workers batches made beyond the 3 taken, per cycle.
  CHECK(calls.load() <= cycles * (3 + 4 + 2));
  std::size_t free_after = 0;
  LOCKSTEP_TRY_CUDA(cudaMemGetInfo(&free_after, &total));
  const double leaked_mib = (static_cast<double>(free_before) - static_cast<double>(free_after)) / (1 << 20);
  CAPTURE(leaked_mib);
  // Generous: another test running at the same time on this GPU moves the free memory too.
  CHECK_MESSAGE(leaked_mib < 512.0, "free device memory fell by " << leaked_mib << " MiB over " << cycles << " cycles");
}

TEST_CASE("prefetch: the header's example and docs/prefetch.md's epoch loop run") {
  LOCKSTEP_REQUIRE_GPUS(1);
  LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
  const int device = 0;
  Stream own;
  const cudaStream_t compute_stream = own.s;
  constexpr std::size_t rows_total = 1000, row_floats = 64, row_bytes = row_floats * sizeof(float), batch = 96;
  std::vector<float> host_data(rows_total * row_floats);
  for (std::size_t r = 0; r < rows_total; ++r)
    for (std::size_t k = 0; k < row_floats; ++k) host_data[r * row_floats + k] = static_cast<float>(r + k);
  const unsigned char* data = reinterpret_cast<const unsigned char*>(host_data.data());
  unsigned long long want = 0;
  for (float v : host_data) want += static_cast<unsigned long long>(v);
  const dim3 grid(32), block(256);
  lockstep::DistributedSampler<> sampler(rows_total, 0, 1, {.seed = 5});
  const auto batches = sampler.batches(batch);
  reset_sum();
  {
    // [snippet include/lockstep/cuda/prefetch.cuh#1]
    lockstep::Prefetcher prefetch(device, compute_stream, batch * row_bytes, {.slots = 2});
    auto gather = [&](std::size_t i, std::span<std::byte> host) {
      const auto rows = batches[i];  // e.g. sampler.batches(batch): indices into the data
      for (std::size_t r = 0; r < rows.size(); ++r)
        std::memcpy(host.data() + r * row_bytes, data + rows[r] * row_bytes, row_bytes);
      return rows.size() * row_bytes;  // bytes to copy to the device
    };
    prefetch.start(batches.size(), gather);
    for (std::size_t i = 0; i < batches.size(); ++i) {
      const lockstep::prefetched_batch b = prefetch.next();  // on the device, ordered on C
      step<<<grid, block, 0, compute_stream>>>(b.as<const float>(), b.bytes);
    }
    // [end snippet]
    LOCKSTEP_CHECK_LAUNCH();
  }
  CHECK(read_sum(compute_stream) == want);

  // docs/prefetch.md: one Prefetcher for the whole training, one run per epoch.
  reset_sum();
  const int epochs = 3;
  {
    // [snippet docs/prefetch.md#2]
    lockstep::Prefetcher input(device, compute_stream, batch * row_bytes, {.slots = 3, .workers = 2});
    for (int epoch = 0; epoch < epochs; ++epoch) {
      sampler.set_epoch(static_cast<std::uint64_t>(epoch));
      const auto epoch_batches = sampler.batches(batch);  // spans into sampler.indices()
      input.start(epoch_batches.size(), [&](std::size_t i, std::span<std::byte> host) {
        const auto rows = epoch_batches[i];
        for (std::size_t r = 0; r < rows.size(); ++r)
          std::memcpy(host.data() + r * row_bytes, data + rows[r] * row_bytes, row_bytes);
        return rows.size() * row_bytes;
      });
      for (std::size_t i = 0; i < epoch_batches.size(); ++i) {
        const auto b = input.next();  // compute_stream waits for the copy; the host does not
        step<<<grid, block, 0, compute_stream>>>(b.as<const float>(), b.bytes);
        sampler.advance(epoch_batches[i].size());
      }
      input.stop();  // before set_epoch() rewrites the indices the producer reads
    }
    std::printf("input: waited %.3f s for batches\n", input.wait_seconds());
    // [end snippet]
    LOCKSTEP_CHECK_LAUNCH();
  }
  CHECK(read_sum(compute_stream) == want * epochs);
}
}  // TEST_SUITE
