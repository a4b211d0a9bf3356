// bench_prefetch — input-bound training steps on one GPU with and without lockstep::Prefetcher
// (issue 14, item 6), in one process, beside their limits:
//  synthetic: each step gathers a batch of --batch-mib MiB (rows of --row-bytes at random
//    indices) from a host array of --host-mib MiB, and a compute kernel reads the whole batch
//    and holds every SM for --compute-us. Limits measured in the same run: the compute alone
//    on a batch already on the device, the host → device copy of one batch from pinned memory
//    (the device-copy bandwidth) and from pageable memory, the host gather of one batch.
//  fmnist: example 01's GPU step (examples/01_fashion_mnist/gpu_mlp.cuh: forward and backward
//    in cuBLAS, then FusedSgd) on --fmnist-batch synthetic 28×28 images, gathered and
//    normalised on the host by the example's own fmnist::gather_into; its limit is the
//    example's --input device (the set on the GPU, batches gathered by a kernel).
// Modes: sync is the loop without prefetch — gather into pageable memory, then
// CudaMemory::upload (cudaMemcpyAsync on the compute stream + cudaStreamSynchronize, so the
// host waits for the previous step), then the compute; prefetch is a Prefetcher with the
// given slots and helper threads, its producer the same gather. Both modes process the same
// batches; a checksum the compute kernel takes of every batch must agree between them.
// Timing: CUDA events on the compute stream around --steps steps, median over --reps
// windows after warm-up; a window includes the time the GPU waited for input.
//
//   bench_prefetch [--steps 50] [--reps 15] [--only synthetic|fmnist] [--compute-us 500]
//                  [--batch-mib 8] [--row-bytes 4096] [--host-mib 1024] [--fmnist-batch 128]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/cuda/error.cuh>
#include <lockstep/cuda/memory.cuh>
#include <lockstep/cuda/prefetch.cuh>

#if defined(BENCH_PREFETCH_FMNIST)
#include <lockstep/cuda/fused_optimizer.cuh>
#include <lockstep/data/sampler.hpp>
#include <lockstep/data/seeding.hpp>

#include "fashion_mnist.hpp"
#include "gpu_mlp.cuh"
#endif

namespace {

int sm_count = 132;

// Reads the batch (64-bit words, summed into *sum) and then holds the SMs until `ns` have
// passed since the block started: a step whose compute does not depend on the batch size.
__global__ void compute_kernel(const std::uint64_t* __restrict__ x, std::size_t words, unsigned long long* sum,
                               long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  unsigned long long s = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    s += x[i];
  if (s != 0) atomicAdd(sum, s);
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<long long>(now - start) < ns);
}

void compute(const void* batch, std::size_t bytes, unsigned long long* sum, double us, cudaStream_t s) {
  compute_kernel<<<2 * sm_count, 256, 0, s>>>(static_cast<const std::uint64_t*>(batch), bytes / 8, sum,
                                              static_cast<long long>(us * 1000.0));
  LOCKSTEP_CHECK_LAUNCH();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Runs warmup + reps·steps steps of one input mode: begin(total) once, step(i) for each
// step (queues the step's input and compute on s), end() once. Returns the median over the
// reps of the milliseconds per step between events recorded on s.
double time_steps(cudaStream_t s, std::size_t warmup, std::size_t steps, std::size_t reps,
                  const std::function<void(std::size_t)>& begin, const std::function<void(std::size_t)>& step,
                  const std::function<void()>& end) {
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto& e : ev) LOCKSTEP_TRY_CUDA(cudaEventCreate(&e));
  begin(warmup + steps * reps);
  std::size_t i = 0;
  for (; i < warmup; ++i) step(i);
  LOCKSTEP_TRY_CUDA(cudaEventRecord(ev[0], s));
  for (std::size_t r = 0; r < reps; ++r) {
    for (std::size_t k = 0; k < steps; ++k) step(i++);
    LOCKSTEP_TRY_CUDA(cudaEventRecord(ev[r + 1], s));
  }
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  end();
  std::vector<double> per_step;
  for (std::size_t r = 0; r < reps; ++r) {
    float ms = 0;
    LOCKSTEP_TRY_CUDA(cudaEventElapsedTime(&ms, ev[r], ev[r + 1]));
    per_step.push_back(ms / static_cast<double>(steps));
  }
  for (auto& e : ev) (void)cudaEventDestroy(e);
  return median(per_step);
}

// Milliseconds per host → device copy of `bytes` from `src` (events, median of 20).
double copy_ms(void* dst, const void* src, std::size_t bytes, cudaStream_t s) {
  cudaEvent_t a, b;
  LOCKSTEP_TRY_CUDA(cudaEventCreate(&a));
  LOCKSTEP_TRY_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < 22; ++r) {
    LOCKSTEP_TRY_CUDA(cudaEventRecord(a, s));
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    LOCKSTEP_TRY_CUDA(cudaEventRecord(b, s));
    LOCKSTEP_TRY_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    LOCKSTEP_TRY_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) t.push_back(ms);
  }
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  return median(t);
}

struct options {
  std::size_t steps = 50, reps = 15, warmup = 10;
  std::string only;
  double compute_us = 500;
  std::size_t batch_mib = 8, row_bytes = 4096, host_mib = 1024, fmnist_batch = 128;
};

struct prefetch_shape {
  std::size_t slots, workers;
};
constexpr prefetch_shape shapes[] = {{2, 1}, {3, 2}, {4, 4}};

// One table row: "name  ms/step  speed-up over sync".
void row(const char* name, double ms, double sync_ms) {
  if (sync_ms > 0) std::printf("  %-44s %8.3f ms/step   %5.2fx sync\n", name, ms, sync_ms / ms);
  else std::printf("  %-44s %8.3f ms/step\n", name, ms);
}

void synthetic(const options& o, int device, cudaStream_t s) {
  const std::size_t row_bytes = o.row_bytes, rows = (o.batch_mib << 20) / row_bytes;
  const std::size_t bytes = rows * row_bytes, host_rows = (o.host_mib << 20) / row_bytes;
  std::printf("synthetic: host array %zu MiB, batch %zu rows x %zu B = %.1f MiB at random rows, compute %.0f us/step\n",
              o.host_mib, rows, row_bytes, static_cast<double>(bytes) / (1 << 20), o.compute_us);
  std::vector<std::uint64_t> host_array(host_rows * row_bytes / 8);
  lockstep::detail::device_guard g(device);
  {
    std::uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (auto& w : host_array) {  // splitmix64: cheap, not compressible
      std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      w = z ^ (z >> 31);
    }
  }
  const auto* data = reinterpret_cast<const std::byte*>(host_array.data());
  constexpr std::size_t distinct = 256;  // batches of indices, cycled
  std::vector<std::size_t> idx(distinct * rows);
  std::mt19937_64 rng(7);
  for (auto& i : idx) i = rng() % host_rows;
  auto gather = [&](std::size_t step, std::byte* out) {
    const std::size_t* r = idx.data() + (step % distinct) * rows;
    for (std::size_t k = 0; k < rows; ++k) std::memcpy(out + k * row_bytes, data + r[k] * row_bytes, row_bytes);
  };

  const lockstep::CudaMemory mem(device, s);
  auto dev_batch = mem.allocate(bytes);
  auto dev_sum = mem.allocate(sizeof(unsigned long long));
  auto* sum = static_cast<unsigned long long*>(dev_sum.get());
  std::vector<std::byte> pageable(bytes);
  void* pinned = nullptr;
  LOCKSTEP_TRY_CUDA(cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault));
  gather(0, static_cast<std::byte*>(pinned));
  std::memcpy(pageable.data(), pinned, bytes);

  // Limits.
  const double pinned_ms = copy_ms(dev_batch.get(), pinned, bytes, s);
  const double pageable_ms = copy_ms(dev_batch.get(), pageable.data(), bytes, s);
  std::vector<double> g_ms;
  for (int r = 0; r < 30; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    gather(static_cast<std::size_t>(r), pageable.data());
    g_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const double gather_ms = median(g_ms);
  const auto gbs = [&](double ms) { return static_cast<double>(bytes) / (ms * 1e-3) / 1e9; };
  std::printf(
      "  H2D copy of one batch: pinned %.3f ms (%.1f GB/s, the device-copy limit), pageable %.3f ms (%.1f GB/s)\n",
      pinned_ms, gbs(pinned_ms), pageable_ms, gbs(pageable_ms));
  std::printf("  host gather of one batch (one thread): %.3f ms (%.1f GB/s)\n", gather_ms, gbs(gather_ms));

  const auto nothing = [] {};
  const auto no_begin = [](std::size_t) {};
  const double limit = time_steps(
      s, o.warmup, o.steps, o.reps, no_begin,
      [&](std::size_t) { compute(dev_batch.get(), bytes, sum, o.compute_us, s); }, nothing);
  auto read_sum = [&] {
    unsigned long long v = 0;
    mem.download(&v, sum, sizeof v);
    mem.zero(sum, sizeof v);
    return v;
  };
  (void)read_sum();
  const double sync = time_steps(
      s, o.warmup, o.steps, o.reps, no_begin,
      [&](std::size_t i) {
        gather(i, pageable.data());
        mem.upload(dev_batch.get(), pageable.data(), bytes);  // after the previous step, blocking
        compute(dev_batch.get(), bytes, sum, o.compute_us, s);
      },
      nothing);
  const unsigned long long sync_sum = read_sum();
  row("compute only, batch on the device (limit)", limit, 0);
  row("sync: gather + pageable copy + compute", sync, 0);
  std::printf("  bound for prefetch: max(compute, gather / workers, pinned copy) = max(%.3f, %.3f / w, %.3f) ms\n",
              limit, gather_ms, pinned_ms);
  double best = 1e30;
  for (const prefetch_shape sh : shapes) {
    lockstep::Prefetcher pf(device, s, bytes, {.slots = sh.slots, .workers = sh.workers});
    const double t = time_steps(
        s, o.warmup, o.steps, o.reps,
        [&](std::size_t total) {
          pf.start(total, [&](std::size_t i, std::span<std::byte> host) { gather(i, host.data()); });
        },
        [&](std::size_t) {
          const auto b = pf.next();
          compute(b.data, b.bytes, sum, o.compute_us, s);
        },
        [&] { pf.stop(); });
    const unsigned long long pf_sum = read_sum();
    char name[96];
    std::snprintf(name, sizeof name, "prefetch: %zu slots, %zu helper thread%s", sh.slots, sh.workers,
                  sh.workers == 1 ? "" : "s");
    row(name, t, sync);
    if (pf_sum != sync_sum)
      std::printf("  ERROR: the batches' checksum differs from sync's (%llx vs %llx)\n", pf_sum, sync_sum);
    best = std::min(best, t);
  }
  std::printf("  synthetic: sync %.3f ms/step, best prefetch %.3f ms/step: %.2fx faster; compute alone %.3f ms\n", sync,
              best, sync / best, limit);
  LOCKSTEP_TRY_CUDA(cudaFreeHost(pinned));
}

#if defined(BENCH_PREFETCH_FMNIST)
void fmnist_step(const options& o, int device, cudaStream_t s) {
  constexpr std::size_t P = fmnist::image_pixels;
  constexpr std::size_t n_images = 60000;
  const std::size_t B = o.fmnist_batch;
  constexpr std::size_t sample_bytes = P * sizeof(float) + 1;
  std::printf("fmnist: example 01's step (gpu::Mlp 784-256-128-10 forward + backward, FusedSgd), batch %zu, "
              "%zu synthetic images\n",
              B, n_images);
  lockstep::detail::device_guard g(device);
  fmnist::split train;
  train.size = n_images;
  train.pixels.resize(n_images * P);
  train.labels.resize(n_images);
  std::mt19937_64 rng(11);
  for (auto& p : train.pixels) p = static_cast<std::uint8_t>(rng() >> 56);
  for (auto& l : train.labels) l = static_cast<std::uint8_t>(rng() % 10);
  std::array<float, 256> table{};
  for (int v = 0; v < 256; ++v) table[static_cast<std::size_t>(v)] = static_cast<float>((v / 255.0 - 0.286) / 0.353);
  lockstep::DistributedSampler<> sampler(n_images, 0, 1, {.seed = 3});
  const auto batches = sampler.batches(B, lockstep::LastBatch::drop_partial);
  const auto& order = sampler.indices();

  const lockstep::CudaMemory mem(device, s);
  fmnist::Mlp host_model(lockstep::model_seed(42));
  fmnist::gpu::Mlp model(host_model.parameters(), mem, B);
  const auto params = model.parameters();
  lockstep::FusedSgd sgd({.lr = 0.01, .momentum = 0.9}, params, device);
  auto acc = mem.allocate(sizeof(double));
  auto* loss = static_cast<double*>(acc.get());
  auto train_step = [&](const float* x, const std::uint8_t* y) {
    model.zero_grad();
    model.forward_backward(x, y, B, loss, [](std::size_t) {});
    sgd.step_all(params, s);
  };
  // The data set on the device (--input device) and a staging buffer (--input sync).
  auto px = mem.allocate(train.pixels.size());
  mem.upload(px.get(), train.pixels.data(), train.pixels.size());
  auto lab = mem.allocate(train.labels.size());
  mem.upload(lab.get(), train.labels.data(), train.labels.size());
  auto tab = mem.allocate(sizeof table);
  mem.upload(tab.get(), table.data(), sizeof table);
  std::vector<int> order_i(order.begin(), order.end());
  auto d_order = mem.allocate(order_i.size() * sizeof(int));
  mem.upload(d_order.get(), order_i.data(), order_i.size() * sizeof(int));
  auto dx = mem.allocate(B * sample_bytes);
  auto* x_dev = static_cast<float*>(dx.get());
  auto* y_dev = reinterpret_cast<std::uint8_t*>(x_dev + B * P);
  std::vector<std::byte> staged(B * sample_bytes);
  auto gather = [&](std::size_t step, std::byte* out) {
    const auto rows = batches[step % batches.size()];
    auto* x = reinterpret_cast<float*>(out);
    fmnist::gather_into(train, rows, table.data(), x, reinterpret_cast<std::uint8_t*>(x + rows.size() * P));
  };
  std::vector<double> g_ms;
  for (int r = 0; r < 30; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    gather(static_cast<std::size_t>(r), staged.data());
    g_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("  host gather of one batch (one thread): %.3f ms\n", median(g_ms));
  const auto nothing = [] {};
  const auto no_begin = [](std::size_t) {};
  const double on_device = time_steps(
      s, o.warmup, o.steps, o.reps, no_begin,
      [&](std::size_t i) {
        const std::size_t at = static_cast<std::size_t>(batches[i % batches.size()].data() - order.data());
        fmnist::gpu::gather_rows(static_cast<const std::uint8_t*>(px.get()),
                                 static_cast<const std::uint8_t*>(lab.get()),
                                 static_cast<const int*>(d_order.get()) + at, 0, static_cast<const float*>(tab.get()),
                                 x_dev, y_dev, static_cast<int>(B), s);
        train_step(x_dev, y_dev);
      },
      nothing);
  const double sync = time_steps(
      s, o.warmup, o.steps, o.reps, no_begin,
      [&](std::size_t i) {
        gather(i, staged.data());
        mem.upload(dx.get(), staged.data(), staged.size());
        train_step(x_dev, y_dev);
      },
      nothing);
  row("device: set on the GPU, kernel gather (limit)", on_device, sync);
  row("sync: host gather + pageable copy + step", sync, 0);
  double best = 1e30;
  for (const prefetch_shape sh : shapes) {
    lockstep::Prefetcher pf(device, s, B * sample_bytes, {.slots = sh.slots, .workers = sh.workers});
    const double t = time_steps(
        s, o.warmup, o.steps, o.reps,
        [&](std::size_t total) {
          pf.start(total, [&](std::size_t i, std::span<std::byte> host) { gather(i, host.data()); });
        },
        [&](std::size_t) {
          const auto b = pf.next();
          train_step(b.as<const float>(), b.as<const std::uint8_t>(B * P * sizeof(float)));
        },
        [&] { pf.stop(); });
    char name[96];
    std::snprintf(name, sizeof name, "prefetch: %zu slots, %zu helper thread%s", sh.slots, sh.workers,
                  sh.workers == 1 ? "" : "s");
    row(name, t, sync);
    best = std::min(best, t);
  }
  std::printf("  fmnist: sync %.3f ms/step, best prefetch %.3f ms/step: %.2fx faster; set on the GPU %.3f ms\n", sync,
              best, sync / best, on_device);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  options o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw lockstep::config_error(a + " needs a value");
        return argv[++i];
      };
      if (a == "--steps") o.steps = std::stoul(value());
      else if (a == "--reps") o.reps = std::stoul(value());
      else if (a == "--only") o.only = value();
      else if (a == "--compute-us") o.compute_us = std::stod(value());
      else if (a == "--batch-mib") o.batch_mib = std::stoul(value());
      else if (a == "--row-bytes") o.row_bytes = std::stoul(value());
      else if (a == "--host-mib") o.host_mib = std::stoul(value());
      else if (a == "--fmnist-batch") o.fmnist_batch = std::stoul(value());
      else {
        std::fprintf(stderr,
                     "usage: bench_prefetch [--steps N] [--reps N] [--only synthetic|fmnist] [--compute-us US]\n"
                     "                      [--batch-mib M] [--row-bytes B] [--host-mib M] [--fmnist-batch B]\n");
        return 2;
      }
    }
    if (o.steps == 0 || o.reps == 0 || o.row_bytes == 0 || o.row_bytes % 8 != 0 || o.batch_mib == 0 ||
        (o.batch_mib << 20) < o.row_bytes || o.host_mib < o.batch_mib || o.fmnist_batch == 0)
      throw lockstep::config_error(
          "bench_prefetch: --steps, --reps, --batch-mib, --fmnist-batch must be at least 1, --row-bytes a "
          "multiple of 8 within a batch, --host-mib at least --batch-mib");
    int device = 0;
    LOCKSTEP_TRY_CUDA(cudaSetDevice(device));
    cudaDeviceProp prop{};
    LOCKSTEP_TRY_CUDA(cudaGetDeviceProperties(&prop, device));
    sm_count = prop.multiProcessorCount;
    std::printf("device: %s, %d SMs; %zu steps per window, median of %zu windows after %zu warm-up steps\n", prop.name,
                sm_count, o.steps, o.reps, o.warmup);
    cudaStream_t s = nullptr;
    LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (o.only.empty() || o.only == "synthetic") synthetic(o, device, s);
#if defined(BENCH_PREFETCH_FMNIST)
    if (o.only.empty() || o.only == "fmnist") fmnist_step(o, device, s);
#else
    if (o.only == "fmnist") std::printf("fmnist: not built (needs cuBLAS and zlib)\n");
#endif
    LOCKSTEP_TRY_CUDA(cudaStreamDestroy(s));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_prefetch: %s\n", e.what());
    return 1;
  }
}
