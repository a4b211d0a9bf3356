// Benchmark d: multi-tensor pack and unscale_check throughput on GPT-2 small's real
// parameter set, fp32 and bf16, against the device-copy bandwidth measured in the same run.
//
//   bench_kernels [shapes-file] [--runs N]
//   default shapes file: ../shared/data/gpt2_124m_shapes.txt (relative to the repo root)
//
// Each tensor sits at its own 256-byte-aligned place in one arena (as separate cudaMalloc
// allocations would). Bytes moved count reads + writes. Times are medians over N ≥ 50
// runs (default 100) after 10 warm-up runs, each run bracketed by its own CUDA events.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/multi_tensor.cuh"

namespace {

struct Shape {
  std::string name;
  std::size_t count = 1;
};

std::vector<Shape> read_shapes(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw lockstep::config_error("cannot open '" + path + "'; pass the shapes file as the first "
                                 "argument (format: '# comment' lines, then 'name dim dim ...')");
  std::vector<Shape> shapes;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    Shape s;
    ls >> s.name;
    long long d = 0;
    int dims = 0;
    while (ls >> d) {
      if (d <= 0) throw lockstep::config_error("'" + path + "': bad dimension in line: " + line);
      s.count *= static_cast<std::size_t>(d);
      ++dims;
    }
    if (dims == 0) throw lockstep::config_error("'" + path + "': no dimensions in line: " + line);
    shapes.push_back(s);
  }
  if (shapes.empty()) throw lockstep::config_error("'" + path + "' lists no tensors");
  return shapes;
}

template <class T>
__global__ void fill_kernel(T* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    const float v = (static_cast<float>(h) / 4294967296.0f - 0.5f) * 4.0f;
    if constexpr (std::is_same_v<T, float>) p[i] = v;
    else p[i] = __float2bfloat16_rn(v);
  }
}

struct Row {
  std::string kernel, dtype;
  double bytes = 0, ms = 0;
};

double median_ms(int runs, cudaStream_t s, const std::function<void(int)>& body) {
  cudaEvent_t a, b;
  LOCKSTEP_TRY_CUDA(cudaEventCreate(&a));
  LOCKSTEP_TRY_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 10; ++i) body(i);  // warm-up
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  std::vector<float> t(runs);
  for (int i = 0; i < runs; ++i) {
    LOCKSTEP_TRY_CUDA(cudaEventRecord(a, s));
    body(i);
    LOCKSTEP_TRY_CUDA(cudaEventRecord(b, s));
    LOCKSTEP_TRY_CUDA(cudaEventSynchronize(b));
    LOCKSTEP_TRY_CUDA(cudaEventElapsedTime(&t[i], a, b));
  }
  LOCKSTEP_TRY_CUDA(cudaEventDestroy(a));
  LOCKSTEP_TRY_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return runs % 2 ? t[runs / 2] : 0.5 * (t[runs / 2 - 1] + t[runs / 2]);
}

template <class T>
void bench_dtype(const std::vector<Shape>& shapes, int runs, cudaStream_t s, std::vector<Row>& rows) {
  namespace k = lockstep::cuda::kernels;
  const lockstep::dtype t = lockstep::dtype_of<T>;
  const char* tn = lockstep::name_of(t);
  std::size_t total = 0, arena_elems = 0;
  std::vector<std::size_t> off;
  const std::size_t align = 256 / sizeof(T);
  for (const auto& sh : shapes) {
    off.push_back(arena_elems);
    arena_elems += (sh.count + align - 1) / align * align;
    total += sh.count;
  }
  const double es = sizeof(T);
  T *arena = nullptr, *packed = nullptr;
  float *inv = nullptr;
  int* found = nullptr;
  double* sumsq = nullptr;
  LOCKSTEP_TRY_CUDA(cudaMalloc(&arena, arena_elems * sizeof(T)));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&packed, total * sizeof(T)));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&inv, 2 * sizeof(float)));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&found, sizeof(int)));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&sumsq, sizeof(double)));
  fill_kernel<T><<<1024, 256, 0, s>>>(arena, arena_elems, 12345u);
  LOCKSTEP_CHECK_LAUNCH();
  const float invs[2] = {0.5f, 2.0f};  // alternate so repeated unscaling keeps values in range
  LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(inv, invs, sizeof(invs), cudaMemcpyHostToDevice, s));
  LOCKSTEP_TRY_CUDA(cudaMemsetAsync(found, 0, sizeof(int), s));
  std::vector<lockstep::segment> segs;
  for (std::size_t i = 0; i < shapes.size(); ++i) segs.push_back({arena + off[i], shapes[i].count});

  const double rw = 2.0 * es * static_cast<double>(total);  // read + write of every element
  rows.push_back({"device copy (memcpy D2D)", tn, rw, median_ms(runs, s, [&](int) {
                    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(packed, arena, total * sizeof(T),
                                                      cudaMemcpyDeviceToDevice, s));
                  })});
  rows.push_back({"pack", tn, rw, median_ms(runs, s, [&](int) { k::pack(segs, packed, t, 1.0, s); })});
  rows.push_back({"pack x 1/8 (folds the average)", tn, rw,
                  median_ms(runs, s, [&](int) { k::pack(segs, packed, t, 0.125, s); })});
  rows.push_back({"unpack", tn, rw, median_ms(runs, s, [&](int) { k::unpack(packed, segs, t, s); })});
  rows.push_back({"unscale_check", tn, rw, median_ms(runs, s, [&](int i) {
                    k::unscale_check(segs, t, inv + (i & 1), found, nullptr, s);
                  })});
  rows.push_back({"unscale_check + sumsq", tn, rw, median_ms(runs, s, [&](int i) {
                    k::unscale_check(segs, t, inv + (i & 1), found, sumsq, s);
                  })});
  // inv_scale == 1 (no loss scaling, only the inf/NaN check): the kernel only reads.
  const float one = 1.0f;
  LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(inv, &one, sizeof(float), cudaMemcpyHostToDevice, s));
  rows.push_back({"unscale_check, scale 1 (read only)", tn, rw / 2, median_ms(runs, s, [&](int) {
                    k::unscale_check(segs, t, inv, found, sumsq, s);
                  })});
  // The same without the norm: no block reduction or atomic, only the inf/NaN vote.
  rows.push_back({"unscale_check, scale 1, no sumsq", tn, rw / 2, median_ms(runs, s, [&](int) {
                    k::unscale_check(segs, t, inv, found, nullptr, s);
                  })});
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  int flag = 0;
  LOCKSTEP_TRY_CUDA(cudaMemcpy(&flag, found, sizeof(int), cudaMemcpyDeviceToHost));
  if (flag != 0) std::printf("warning: %s data flagged non-finite (unexpected)\n", tn);
  LOCKSTEP_TRY_CUDA(cudaFree(arena));
  LOCKSTEP_TRY_CUDA(cudaFree(packed));
  LOCKSTEP_TRY_CUDA(cudaFree(inv));
  LOCKSTEP_TRY_CUDA(cudaFree(found));
  LOCKSTEP_TRY_CUDA(cudaFree(sumsq));
}

}  // namespace

int main(int argc, char** argv) try {
  std::string path = "../shared/data/gpt2_124m_shapes.txt";
  int runs = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--runs" && i + 1 < argc) runs = std::atoi(argv[++i]);
    else if (a == "-h" || a == "--help") {
      std::printf("usage: %s [shapes-file] [--runs N]   (N >= 50, default 100)\n", argv[0]);
      return 0;
    } else path = a;
  }
  if (runs < 50) {
    std::fprintf(stderr, "--runs must be at least 50\n");
    return 2;
  }
  const auto shapes = read_shapes(path);
  std::size_t total = 0;
  for (const auto& s : shapes) total += s.count;

  int dev = 0;
  cudaDeviceProp prop{};
  LOCKSTEP_TRY_CUDA(cudaGetDevice(&dev));
  LOCKSTEP_TRY_CUDA(cudaGetDeviceProperties(&prop, dev));
  int driver = 0, runtime = 0;
  LOCKSTEP_TRY_CUDA(cudaDriverGetVersion(&driver));
  LOCKSTEP_TRY_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("device %d: %s (sm_%d%d, %d SMs), driver %d, runtime %d\n", dev, prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, driver, runtime);
  std::printf("tensors: %zu from %s, %zu elements; medians of %d runs\n\n", shapes.size(), path.c_str(),
              total, runs);

  cudaStream_t s;
  LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<Row> rows;
  bench_dtype<float>(shapes, runs, s, rows);
  bench_dtype<__nv_bfloat16>(shapes, runs, s, rows);
  LOCKSTEP_TRY_CUDA(cudaStreamDestroy(s));

  std::printf("%-36s %-5s %12s %10s %9s %9s\n", "kernel", "dtype", "bytes moved", "median ms", "GB/s",
              "vs copy");
  double copy_bw = 0;
  for (const auto& r : rows) {
    const double bw = r.bytes / (r.ms * 1e-3) / 1e9;
    if (r.kernel.rfind("device copy", 0) == 0) copy_bw = bw;  // each dtype's copy row comes first
    std::printf("%-36s %-5s %12.0f %10.4f %9.1f %8.2f%s\n", r.kernel.c_str(), r.dtype.c_str(), r.bytes,
                r.ms, bw, bw / copy_bw, bw / copy_bw >= 0.80 ? "" : "  < 0.80 target");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_kernels: %s\n", e.what());
  return 1;
}
