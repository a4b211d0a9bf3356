// Benchmark d: every kernel a training step runs, on GPT-2 small's real parameter set, fp32
// and bf16, each against the device-copy bandwidth measured in the same run for the bytes it
// really moves (an optimizer counts every byte it reads and writes). Target: ≥ 0.90 of copy.
//
//   bench_kernels [shapes-file] [--runs N]
//   default shapes file: ../shared/data/gpt2_124m_shapes.txt (relative to the repo root)
//
// Each tensor sits at its own 256-byte-aligned place in one arena (as separate cudaMalloc
// allocations would). Times are medians over N ≥ 50 runs (default 100) after 10 warm-up runs,
// each run bracketed by its own CUDA events. Everything is called through lockstep's public
// API (CudaMemory, grad_ops<CudaMemory>, clip_grad_norm, DeviceDynamicScale, FusedSgd,
// FusedAdamW), so this file also builds against the layout before 0.2 (commit 8dd442e): the
// before/after runs in bench/RESULTS.md build this same source against both trees.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#if __has_include(<lockstep/cuda.cuh>)
#include <lockstep/cuda.cuh>
#define LOCKSTEP_BENCH_TUNING 1  // the engine's tuning structs exist: print them
#else                            // the layout before 0.2
#include <lockstep/clipping.hpp>
#include <lockstep/cuda/cuda_memory.cuh>
#include <lockstep/cuda/device_dynamic_scale.cuh>
#include <lockstep/cuda/fused_optimizers.cuh>
#include <lockstep/cuda/grad_ops.cuh>
#include <lockstep/cuda/nccl_comm.cuh>
#define LOCKSTEP_BENCH_TUNING 0
#endif

namespace {

namespace ls = lockstep;

struct Shape {
  std::string name;
  std::size_t count = 1;
};

std::vector<Shape> read_shapes(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw ls::config_error("cannot open '" + path +
                           "'; pass the shapes file as the first "
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
      if (d <= 0) throw ls::config_error("'" + path + "': bad dimension in line: " + line);
      s.count *= static_cast<std::size_t>(d);
      ++dims;
    }
    if (dims == 0) throw ls::config_error("'" + path + "': no dimensions in line: " + line);
    shapes.push_back(s);
  }
  if (shapes.empty()) throw ls::config_error("'" + path + "' lists no tensors");
  return shapes;
}

template <class T>
__global__ void fill_kernel(T* p, std::size_t n, std::uint32_t seed, float amplitude) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    const float v = (static_cast<float>(h) / 4294967296.0f - 0.5f) * amplitude;
    if constexpr (std::is_same_v<T, float>) p[i] = v;
    else p[i] = __float2bfloat16_rn(v);
  }
}

struct Row {
  std::string kernel, dtype, tuning;
  double bytes = 0, ms = 0;  // bytes 0: latency only (no bandwidth to compare)
};

double median_ms(int runs, cudaStream_t s, const std::function<void(int)>& body) {
  cudaEvent_t a, b;
  LOCKSTEP_TRY_CUDA(cudaEventCreate(&a));
  LOCKSTEP_TRY_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 10; ++i) body(i);  // warm-up (and first-step work: optimizer masters)
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

#if LOCKSTEP_BENCH_TUNING
template <class Op>
std::string tuning_text() {
  constexpr auto t = ls::cuda::kernels::tuning_of<Op>;
  char text[32];
  std::snprintf(text, sizeof text, "u%d b%d", t.unroll, t.min_blocks);
  return text;
}
#define LOCKSTEP_TUNING(...) tuning_text<__VA_ARGS__>()
#else
#define LOCKSTEP_TUNING(...) std::string()
#endif

//! One device buffer per role, each tensor at a 256-byte-aligned offset.
template <class T>
struct Arena {
  T* base = nullptr;
  std::vector<ls::segment> segs;
  std::size_t total = 0;
  Arena(const std::vector<Shape>& shapes) {
    std::size_t at = 0;
    const std::size_t align = 256 / sizeof(T);
    std::vector<std::size_t> off;
    for (const auto& sh : shapes) {
      off.push_back(at);
      at += (sh.count + align - 1) / align * align;
      total += sh.count;
    }
    LOCKSTEP_TRY_CUDA(cudaMalloc(&base, at * sizeof(T)));
    for (std::size_t i = 0; i < shapes.size(); ++i) segs.push_back({base + off[i], shapes[i].count});
    fill_kernel<T><<<1024, 256>>>(base, at, 12345u + static_cast<std::uint32_t>(at), 4.0f);
    LOCKSTEP_CHECK_LAUNCH();
  }
  ~Arena() { (void)cudaFree(base); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
};

template <class T>
void bench_dtype(const std::vector<Shape>& shapes, int runs, ls::NcclComm& comm, std::vector<Row>& rows) {
  const ls::dtype t = ls::dtype_of<T>;
  const char* tn = ls::name_of(t);
  const cudaStream_t s = comm.compute_stream();
  const ls::CudaMemory mem = comm.memory();
  Arena<T> grads(shapes), params(shapes);
  const double n = static_cast<double>(grads.total), es = sizeof(T);
  T* packed = nullptr;
  int* flag = nullptr;
  LOCKSTEP_TRY_CUDA(cudaMalloc(&packed, grads.total * sizeof(T)));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&flag, sizeof(int)));
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  const std::vector<ls::grad_group> groups{{t, grads.segs}};
  const double rw = 2.0 * es * n;  // read + write of every element
#if LOCKSTEP_BENCH_TUNING
  namespace k = ls::cuda::kernels;
  using element = std::conditional_t<std::is_same_v<T, float>, float, __nv_bfloat16>;
  const std::string t_copy = LOCKSTEP_TUNING(k::copy_op<unsigned short>),
                    t_elem = LOCKSTEP_TUNING(k::unscale_op<element>),
                    t_red = LOCKSTEP_TUNING(k::unscale_op<element, true>);
#else
  const std::string t_copy, t_elem, t_red;
#endif

  rows.push_back({"device copy (memcpy D2D)", tn, "", rw, median_ms(runs, s, [&](int) {
                    LOCKSTEP_TRY_CUDA(
                        cudaMemcpyAsync(packed, grads.base, grads.total * sizeof(T), cudaMemcpyDeviceToDevice, s));
                  })});
  rows.push_back({"pack (packed buckets)", tn, t_copy, rw,
                  median_ms(runs, s, [&](int) { mem.pack(grads.segs, packed, t, 1.0); })});
  rows.push_back({"pack x 1/8 (folds accumulation's 1/K)", tn, t_elem, rw,
                  median_ms(runs, s, [&](int) { mem.pack(grads.segs, packed, t, 0.125); })});
  rows.push_back({"unpack", tn, t_copy, rw, median_ms(runs, s, [&](int) { mem.unpack(packed, grads.segs, t); })});
  // Zero-copy arenas are contiguous: accumulation's 1/K is one in-place pass over a range.
  rows.push_back({"scale in place x 1/8 (zero-copy 1/K)", tn, t_elem, rw,
                  median_ms(runs, s, [&](int i) { mem.scale(packed, grads.total, t, (i & 1) ? 8.0 : 0.125); })});
  // Unscale + inf/NaN check as the host-decided scalers run it (factor from the host);
  // alternate 1/2 and 2 so that repeated runs keep the values in range.
  rows.push_back({"unscale + inf check (Static/DynamicScale)", tn, t_elem, rw, median_ms(runs, s, [&](int i) {
                    ls::grad_ops<ls::CudaMemory>::unscale_and_flag(mem, groups, (i & 1) ? 2.0 : 0.5, flag);
                  })});
  rows.push_back({"inf check only, read (NoScaling check_finite)", tn, t_elem, es * n, median_ms(runs, s, [&](int) {
                    ls::grad_ops<ls::CudaMemory>::unscale_and_flag(mem, groups, 1.0, flag);
                  })});
  {
    // Scales pinned at 2 and 1/2, alternated: every run writes, and the values stay in range.
    ls::DeviceDynamicScale dds(
        ls::DynamicScaleOptions{.init_scale = 0.5, .growth_interval = 1 << 30, .min_scale = 0.5, .max_scale = 0.5});
    ls::DeviceDynamicScale dds2(
        ls::DynamicScaleOptions{.init_scale = 2.0, .growth_interval = 1 << 30, .min_scale = 2.0, .max_scale = 2.0});
    dds.attach(comm);
    dds2.attach(comm);
    rows.push_back({"unscale + check + scale update (DeviceDynamicScale)", tn, t_elem, rw,
                    median_ms(runs, s, [&](int i) { (void)((i & 1) ? dds : dds2).unscale_and_check(comm, groups); })});
  }
  rows.push_back({"sum of squares (grad_norm, + host read)", tn, t_red, es * n,
                  median_ms(runs, s, [&](int) { (void)ls::grad_ops<ls::CudaMemory>::sum_of_squares(mem, groups); })});
#if LOCKSTEP_BENCH_TUNING
  {  // the device part alone: the sum stays on the device (what a device-side clip would read)
    double* d_sum = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&d_sum, sizeof(double)));
    rows.push_back({"sum of squares, on the device", tn, t_red, es * n,
                    median_ms(runs, s, [&](int) { k::sum_of_squares(groups, d_sum, s); })});
    // The tuning is a value a benchmark can sweep: the summing pass alone with its own
    // tuning (16 Ki-element chunks, one pass a block), and with 4× longer chunks (4× fewer
    // block reductions).
    using red_op = k::unscale_op<element, true>;
    constexpr k::tuning short_chunks = k::tuning_of<red_op>;
    constexpr k::tuning long_chunks{.chunk_elems = 4 * short_chunks.chunk_elems,
                                    .unroll = short_chunks.unroll,
                                    .min_blocks = short_chunks.min_blocks};
    std::size_t chunks = 0;
    for (const auto& sg : grads.segs) chunks += k::chunks_of<red_op, short_chunks>(sg.count);  // the most
    double* partials = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&partials, chunks * sizeof(double)));
    const auto tensor = [&](std::size_t i) { return k::tensor_ref<1>{{grads.segs[i].ptr}, grads.segs[i].count}; };
    rows.push_back({"  its pass alone, 64 Ki-element chunks (sweep)", tn, "c64k", es * n, median_ms(runs, s, [&](int) {
                      k::launch<red_op, long_chunks>(red_op{{}, 1.0, nullptr, nullptr, partials}, grads.segs.size(),
                                                     tensor, s, "sweep");
                    })});
    rows.push_back({"  its pass alone, 16 Ki-element chunks (sweep)", tn, "c16k", es * n, median_ms(runs, s, [&](int) {
                      k::launch<red_op, short_chunks>(red_op{{}, 1.0, nullptr, nullptr, partials}, grads.segs.size(),
                                                      tensor, s, "sweep");
                    })});
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    LOCKSTEP_TRY_CUDA(cudaFree(partials));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    LOCKSTEP_TRY_CUDA(cudaFree(d_sum));
  }
#endif
  {
    // Every run clips: the bound is half the norm the previous run found (values halve each
    // run; 110 halvings stay within the normal range of f32 and bf16).
    double norm = std::sqrt(ls::grad_ops<ls::CudaMemory>::sum_of_squares(mem, groups));
    rows.push_back({"clip_grad_norm (sum of squares + scale)", tn, t_red, 3.0 * es * n,
                    median_ms(runs, s, [&](int) { norm = ls::clip_grad_norm(mem, groups, norm * 0.5) * 0.5; })});
  }
  rows.push_back({"clamp (clip_grad_value)", tn, t_elem, rw,
                  median_ms(runs, s, [&](int) { ls::grad_ops<ls::CudaMemory>::clamp(mem, groups, -1.5, 1.5); })});

  // Fused optimizers over every parameter: parameters, gradients, states (f32) and, for
  // bf16, the f32 master; each step reads and writes what the update touches.
  std::vector<ls::parameter> ps;
  std::vector<ls::param_slice> slices;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    ps.push_back(ls::param<T>(shapes[i].name, static_cast<T*>(params.segs[i].ptr), static_cast<T*>(grads.segs[i].ptr),
                              {static_cast<std::int64_t>(shapes[i].count)}));
    slices.push_back({i, 0, shapes[i].count, t, params.segs[i].ptr, grads.segs[i].ptr});
  }
  LOCKSTEP_TRY_CUDA(cudaMemsetAsync(flag, 0, sizeof(int), s));
  const double master = std::is_same_v<T, float> ? 0 : 4;  // bytes of master read and write
  {
    ls::FusedSgd sgd({.lr = 1e-4, .momentum = 0.9}, ps, comm.device());
    // reads p (or master), g, buf; writes p (and master), buf
    const double bytes = n * (es + es + 4 + es + 4 + (master ? 2 * master - es : 0));
    rows.push_back(
        {"fused SGD, momentum (FusedSgd)", tn, "", bytes, median_ms(runs, s, [&](int) { sgd.step(slices, s, flag); })});
  }
  {
    ls::FusedAdamW adamw({.lr = 1e-4}, ps, comm.device());
    // reads p (or master), g, m, v; writes p (and master), m, v
    const double bytes = n * (es + es + 8 + es + 8 + (master ? 2 * master - es : 0));
    rows.push_back(
        {"fused AdamW (FusedAdamW)", tn, "", bytes, median_ms(runs, s, [&](int) { adamw.step(slices, s, flag); })});
  }
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  LOCKSTEP_TRY_CUDA(cudaFree(packed));
  LOCKSTEP_TRY_CUDA(cudaFree(flag));
}

#if LOCKSTEP_BENCH_TUNING
// The wires' codecs (cuda/nccl_wire.cuh: Bf16Wire / Int8Wire on the gradients, gather_wire on
// the values) on the parameter set as one flat fp32 buffer cut into two chunks — two ranks'
// shards, as the wires run them — each row against a device copy of its fp32 input in the same
// run. The encodes are on the critical path of every low-precision gather (they run just before
// it, on the communication stream): how near they run to the copy bandwidth says what fusing
// them into another pass (the optimizer's) could save at most.
void bench_wire(std::size_t total, int runs, ls::NcclComm& comm, std::vector<Row>& rows) {
  namespace k = ls::cuda::kernels;
  namespace d = ls::detail;
  const cudaStream_t s = comm.compute_stream();
  const std::size_t per = total / 2 / 256 * 256, n = 2 * per;  // two chunks of `per`, whole int8 blocks
  const double e = static_cast<double>(n), ib = static_cast<double>(2 * d::int8_chunk_bytes(per)),
               ib8 = static_cast<double>(8 * d::int8_chunk_bytes(per / 4));
  float *x = nullptr, *base = nullptr, *out = nullptr, *fb = nullptr;
  void *b16 = nullptr, *m16 = nullptr, *q = nullptr, *q1 = nullptr;
  LOCKSTEP_TRY_CUDA(cudaMalloc(&x, n * 4));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&base, n * 4));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&out, n * 4));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&fb, n * 4));  // error feedback's residuals
  LOCKSTEP_TRY_CUDA(cudaMemsetAsync(fb, 0, n * 4, s));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&b16, n * 2));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&m16, per * 2));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&q, static_cast<std::size_t>(std::max(ib, ib8))));
  LOCKSTEP_TRY_CUDA(cudaMalloc(&q1, d::int8_chunk_bytes(per)));
  fill_kernel<float><<<1024, 256, 0, s>>>(x, n, 777u, 4.0f);
  fill_kernel<float><<<1024, 256, 0, s>>>(base, n, 778u, 4.0f);
  LOCKSTEP_CHECK_LAUNCH();
  const char* tn = "f32";
  rows.push_back({"device copy (memcpy D2D)", tn, "", 8.0 * e, median_ms(runs, s, [&](int) {
                    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(out, x, n * 4, cudaMemcpyDeviceToDevice, s));
                  })});
  rows.push_back({"wire: bf16 encode (values)", tn, "", 6.0 * e,
                  median_ms(runs, s, [&](int) { k::to_bf16(x, b16, n, 1.0f, s); })});
  rows.push_back({"wire: bf16 encode of x - base (deltas)", tn, "", 10.0 * e,
                  median_ms(runs, s, [&](int) { k::to_bf16(x, b16, n, 1.0f, s, base); })});
  rows.push_back({"wire: bf16 encode + error feedback", tn, "", 14.0 * e,
                  median_ms(runs, s, [&](int) { k::to_bf16(x, b16, n, 1.0f, s, nullptr, fb); })});
  rows.push_back(
      {"wire: bf16 decode", tn, "", 6.0 * e, median_ms(runs, s, [&](int) { k::from_bf16(b16, out, n, s); })});
  rows.push_back({"wire: bf16 decode + add (deltas)", tn, "", 10.0 * e,
                  median_ms(runs, s, [&](int) { k::from_bf16(b16, out, n, s, true); })});
  rows.push_back({"wire: bf16 mean of 2 chunks -> f32 + bf16", tn, "", 5.0 * e,
                  median_ms(runs, s, [&](int) { k::mean_blocks(b16, 2, per, out, m16, s); })});
  rows.push_back({"wire: int8 encode (values)", tn, "", 4.0 * e + ib,
                  median_ms(runs, s, [&](int) { k::int8_encode(x, 2, per, q, s); })});
  rows.push_back({"wire: int8 encode of x - base (deltas)", tn, "", 8.0 * e + ib,
                  median_ms(runs, s, [&](int) { k::int8_encode(x, 2, per, q, s, base); })});
  rows.push_back({"wire: int8 encode + error feedback", tn, "", 12.0 * e + ib,
                  median_ms(runs, s, [&](int) { k::int8_encode(x, 2, per, q, s, nullptr, fb); })});
  rows.push_back({"wire: int8 decode -> f32", tn, "", ib + 4.0 * e,
                  median_ms(runs, s, [&](int) { k::int8_decode(q, 2, per, out, s); })});
  rows.push_back({"wire: int8 decode + add (deltas)", tn, "", ib + 8.0 * e,
                  median_ms(runs, s, [&](int) { k::int8_decode(q, 2, per, out, s, true); })});
  rows.push_back({"wire: int8 decode -> bf16", tn, "", ib + 2.0 * e,
                  median_ms(runs, s, [&](int) { k::int8_decode_bf16(q, 2, per, b16, s); })});
  rows.push_back({"wire: int8 mean of 2 chunks -> f32 + int8", tn, "", ib + 2.0 * e + ib / 2,
                  median_ms(runs, s, [&](int) { k::int8_mean(q, 2, per, out, q1, s); })});
  // Eight ranks' chunks (an int8 wire's gather on 8 GPUs) of the same values.
  rows.push_back({"wire: int8 decode of 8 chunks -> f32", tn, "", ib8 + 4.0 * e,
                  median_ms(runs, s, [&](int) { k::int8_decode(q, 8, per / 4, out, s); })});
  LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
  for (void* p : {static_cast<void*>(x), static_cast<void*>(base), static_cast<void*>(out), static_cast<void*>(fb), b16,
                  m16, q, q1})
    LOCKSTEP_TRY_CUDA(cudaFree(p));
}
#endif

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
  std::printf("device %d: %s (sm_%d%d, %d SMs), driver %d, runtime %d\n", dev, prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, driver, runtime);
  std::printf("tensors: %zu from %s, %zu elements; medians of %d runs\n\n", shapes.size(), path.c_str(), total, runs);

  auto comms = ls::NcclComm::create_local({dev});  // DeviceDynamicScale needs a communicator
  std::vector<Row> rows;
  bench_dtype<float>(shapes, runs, comms[0], rows);
  bench_dtype<__nv_bfloat16>(shapes, runs, comms[0], rows);
#if LOCKSTEP_BENCH_TUNING
  bench_wire(total, runs, comms[0], rows);
  {  // DeviceDynamicScale's update alone: one thread, latency-bound (no bandwidth to compare)
    ls::cuda::kernels::device_scale_state* st = nullptr;
    int* votes = nullptr;  // the agreed found-inf flag and one rank's own flag, zero: clean steps
    LOCKSTEP_TRY_CUDA(cudaMalloc(&st, sizeof *st));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&votes, 2 * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMemset(votes, 0, 2 * sizeof(int)));
    const auto init = ls::cuda::kernels::make_device_scale_state(ls::DynamicScale().state());
    LOCKSTEP_TRY_CUDA(cudaMemcpy(st, &init, sizeof init, cudaMemcpyHostToDevice));
    const cudaStream_t s = comms[0].compute_stream();
    rows.push_back({"loss-scale update (DeviceDynamicScale, 1 thread)", "-", "", 0, median_ms(runs, s, [&](int) {
                      ls::cuda::kernels::update_scale(st, ls::DynamicScaleOptions{}, votes, 1, s);
                    })});
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    LOCKSTEP_TRY_CUDA(cudaFree(st));
    LOCKSTEP_TRY_CUDA(cudaFree(votes));
  }
#endif

  std::printf("%-52s %-5s %-11s %12s %10s %9s %8s\n", "kernel", "dtype", "tuning", "bytes moved", "median ms", "GB/s",
              "vs copy");
  double copy_bw = 0;
  for (const auto& r : rows) {
    if (r.bytes == 0) {
      std::printf("%-52s %-5s %-11s %12s %10.4f %9s %8s\n", r.kernel.c_str(), r.dtype.c_str(), r.tuning.c_str(), "-",
                  r.ms, "-", "latency");
      continue;
    }
    const double bw = r.bytes / (r.ms * 1e-3) / 1e9;
    if (r.kernel.rfind("device copy", 0) == 0) copy_bw = bw;  // each dtype's copy row comes first
    std::printf("%-52s %-5s %-11s %12.0f %10.4f %9.1f %8.2f%s\n", r.kernel.c_str(), r.dtype.c_str(), r.tuning.c_str(),
                r.bytes, r.ms, bw, bw / copy_bw, bw / copy_bw >= 0.90 ? "" : "  < 0.90 target");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_kernels: %s\n", e.what());
  return 1;
}
