// bench_sync — lockstep's gradient synchronisation on local GPUs, each figure next to its
// limit measured in the same run (benchmarks a-c of the GPU issue):
//  a. sync of GPT-2-small's parameter set (fp32, bf16) vs one flat ncclAllReduce of the
//     same bytes on the same communicator;
//  b. overlap: a synthetic GPT-2-small step (per-tensor backward time ∝ its size, ≈26 ms in
//     all) at N GPUs vs 1 GPU: exposed communication = step(N) − step(1);
//  c. comm-bound MLP: 8 × 4096² (134M) with small per-layer compute (≈2.5 ms at 1 GPU);
//  s. (with c) the same MLP step with ShardedOptimizer;
//  w. (with c) the fp32 MLP step with gradients in bf16 (Bf16Wire) or blockwise int8 (Int8Wire) on
//     the wire, plain and sharded;
//  z. (with c) the MLP step under full sharding — each layer a block: ShardedGradients (ZeRO-2),
//     FullySharded (ZeRO-3) — beside plain and ShardedOptimizer (ZeRO-1), steps chained, with
//     each rank's shard and lent buffer bytes;
//  v. (with c) the same with the values' all-gather in bf16 or int8 (ShardedOptimizer::gather_wire)
//     and fp32 or int8 gradients.
//  t. the fastest sharded MLP step with and without its compute (where its time goes; one
//     configuration, for a profiler);
//  g. lockstep's own host time per step and per bucket for GPT-2's tensors (no compute);
//  k. bucket caps from the cost model (BucketPolicy::tune) beside a hand sweep (1, 4, 25, 64,
//     128 MiB) on b's GPT-2 step and c's MLP;
//  y. the mean all-reduce of 1-256 MiB in plain memory vs in a symmetric window (lockstep's
//     peer kernel; NCCL's symmetric kernels), bus bandwidth, each op timed alone and chained;
//  x. Deterministic's fixed-point sums beside the plain mean on b's GPT-2 step (fp32 gradients)
//     and c's MLP, at every GPU count (1 GPU: the conversion passes alone);
//  h. Hierarchical reduction (nodes of --node-size ranks) vs the flat all-reduce (not in the
//     default set: run it under scripts/two_node_sim.sh and on one node).
// Compute is simulated by kernels that hold every SM for a set time (so NCCL competes for
// SMs as it would with real GEMMs). Timings: CUDA events on each rank's compute stream,
// median over --iters steps after warm-up; a step's time is the slowest rank's.
//
//   bench_sync --shapes path/to/gpt2_124m_shapes.txt [--iters 30] [--gpus 4]
//   --symmetric: the training steps' gradient arenas in symmetric windows (BucketPolicy::
//   symmetric_memory: lockstep's peer all-reduce with one process per GPU).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <lockstep/cuda/nccl_wire.cuh>
#include <lockstep/cuda/deterministic_sum.cuh>
#include <lockstep/cuda/run_gpus.cuh>
#include <lockstep/cuda/run_processes.cuh>
#include <lockstep/lockstep.hpp>

namespace {

__global__ void spin_kernel(long long ns) {
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (static_cast<long long>(now - start) >= ns) break;
  }
}

template <class T>
__global__ void fill_kernel(T* p, std::size_t n, unsigned seed) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = static_cast<T>((x & 0xffff) / 65536.0f - 0.5f);
  }
}

template <class T>
__global__ void sgd_kernel(T* p, const T* g, std::size_t n, float lr) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = static_cast<T>(static_cast<float>(p[i]) - lr * static_cast<float>(g[i]));
}

int sm_count = 132;

// Occupies every SM for `us` microseconds (2 blocks per SM of 256 threads).
void compute(double us, cudaStream_t s) {
  if (us <= 0) return;
  spin_kernel<<<2 * sm_count, 256, 0, s>>>(static_cast<long long>(us * 1000.0));
  LOCKSTEP_CHECK_LAUNCH();
}

struct shape {
  std::string name;
  std::vector<std::int64_t> dims;
  std::size_t numel() const {
    return static_cast<std::size_t>(std::accumulate(dims.begin(), dims.end(), std::int64_t{1}, std::multiplies<>{}));
  }
};

std::vector<shape> read_shapes(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw lockstep::config_error("cannot open shapes file " + path);
  std::vector<shape> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    shape s;
    ss >> s.name;
    std::int64_t d;
    while (ss >> d) s.dims.push_back(d);
    out.push_back(s);
  }
  return out;
}

// A model of given shapes on one GPU: values and gradients in device memory; zero-copy
// (gradients, and with BindValues, sharded, the values too: lockstep::model (e)).
template <class T, bool BindValues = true>
struct ShapesModel {
  std::vector<shape> shapes;
  std::vector<T*> vals, grads;
  std::vector<T*> own, own_vals;
  cudaStream_t stream;
  ShapesModel(std::vector<shape> s, unsigned seed, cudaStream_t st) : shapes(std::move(s)), stream(st) {
    for (auto& sh : shapes) {
      T *v = nullptr, *g = nullptr;
      LOCKSTEP_TRY_CUDA(cudaMalloc(&v, sh.numel() * sizeof(T)));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&g, sh.numel() * sizeof(T)));
      fill_kernel<<<1024, 256, 0, st>>>(v, sh.numel(), seed++);
      LOCKSTEP_CHECK_LAUNCH();
      vals.push_back(v);
      grads.push_back(g);
      own.push_back(g);
      own_vals.push_back(v);
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
  }
  ~ShapesModel() {
    for (auto p : own_vals) cudaFree(p);
    for (auto p : own) cudaFree(p);
  }
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      ps.push_back(lockstep::param<T>(shapes[i].name, vals[i], grads[i], shapes[i].dims));
    return ps;
  }
  void bind_gradient(std::size_t i, void* p) { grads[i] = static_cast<T*>(p); }
  // Full sharding (lockstep::model (h), (i)): per_block consecutive tensors form a block.
  std::size_t per_block = 2;
  std::vector<std::size_t> blocks() const {
    std::vector<std::size_t> b;
    for (std::size_t i = 0; i < shapes.size(); ++i) b.push_back(i / per_block);
    return b;
  }
  void attach(std::size_t i, void* v, void* g) {
    vals[i] = static_cast<T*>(v);
    grads[i] = static_cast<T*>(g);
  }
  void bind_value(std::size_t i, void* p)
    requires BindValues
  {
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(p, vals[i], shapes[i].numel() * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    vals[i] = static_cast<T*>(p);
  }
  void unbind_values()
    requires BindValues
  {
    for (std::size_t i = 0; i < vals.size(); ++i) {
      LOCKSTEP_TRY_CUDA(
          cudaMemcpyAsync(own_vals[i], vals[i], shapes[i].numel() * sizeof(T), cudaMemcpyDeviceToDevice, stream));
      vals[i] = own_vals[i];
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream));
  }
  // "Backward": writes every gradient (a fill pass, as a real backward writes them).
  void write_grads(cudaStream_t s, unsigned seed) {
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      fill_kernel<<<1024, 256, 0, s>>>(grads[i], shapes[i].numel(), seed + static_cast<unsigned>(i));
      LOCKSTEP_CHECK_LAUNCH();
    }
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// setup(ctx, stream) returns {pre, body}. Each iteration: pre() (untimed), a barrier (every
// rank's device idle), then body() between two events on the compute stream. Returns the
// median over iterations of the slowest rank's time.
// Under a launcher (lockstep-run, torchrun) every process is one rank of this context and
// the benchmark measures Distributed mode; otherwise one process drives ngpu GPUs.
lockstep::context<lockstep::NcclComm>* g_process_ctx = nullptr;
bool g_print = true;
lockstep::sync_stats g_stats;  // rank 0's, after train_step_time's last step (k: the tuned cap)

// Chained (g_chained): the steps run back to back with no barrier between them, and a step's
// time is the span of all of them over their number — what a training loop sees when a step's
// communication overlaps the next step's start (ShardedOptimizer's gather in forward).
bool g_chained = false;
bool g_sm_gather = false;   // sharded: ShardedOptimizer::copy_engine_gather off (NCCL's SM kernels gather)
bool g_ce_scatter = false;  // sharded: ShardedOptimizer::copy_engine_scatter on (copy-engine reduce-scatters)
lockstep::wire_format g_gather_wire = lockstep::wire_format::fp32;  // sharded: ShardedOptimizer::gather_wire
bool g_symmetric = false;  // --symmetric: the training steps' gradient arenas in symmetric windows

// rank_body(ctx, mine) on every rank — this process's (Distributed mode) or one thread per GPU
// of ngpu — filling `mine` with one figure per iteration; the median over iterations of the
// slowest rank's figure.
template <class RankBody>
double slowest_median(int ngpu, RankBody&& rank_body) {
  std::vector<std::vector<double>> per_rank(static_cast<std::size_t>(g_process_ctx ? 1 : ngpu));
  if (g_process_ctx) {
    rank_body(*g_process_ctx, per_rank[0]);
    // The slowest process, iteration by iteration.
    lockstep::all_reduce_scalars(g_process_ctx->comm(), std::span<double>(per_rank[0]), lockstep::reduce_op::max);
  } else {
    std::vector<int> devs(static_cast<std::size_t>(ngpu));
    std::iota(devs.begin(), devs.end(), 0);
    lockstep::run(lockstep::Gpus{devs}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
      rank_body(ctx, per_rank[static_cast<std::size_t>(ctx.rank())]);
    });
  }
  std::vector<double> slowest(per_rank[0].size(), 0);
  for (auto& r : per_rank)
    for (std::size_t i = 0; i < r.size(); ++i) slowest[i] = std::max(slowest[i], r[i]);
  return median(slowest);
}

template <class Setup>
double timed(int ngpu, int warm, int iters, Setup&& setup) {
  auto rank_body = [&](lockstep::context<lockstep::NcclComm>& ctx, std::vector<double>& mine) {
    cudaStream_t s = ctx.comm().compute_stream();
    auto [pre, body] = setup(ctx, s);
    cudaEvent_t a, b;
    LOCKSTEP_TRY_CUDA(cudaEventCreate(&a));
    LOCKSTEP_TRY_CUDA(cudaEventCreate(&b));
    if (g_chained) {
      for (int i = 0; i < warm; ++i) pre(), body();
      ctx.comm().barrier();
      LOCKSTEP_TRY_CUDA(cudaEventRecord(a, s));
      for (int i = 0; i < iters; ++i) pre(), body();
      ctx.comm().barrier();  // the last step's communication included
      LOCKSTEP_TRY_CUDA(cudaEventRecord(b, s));
      LOCKSTEP_TRY_CUDA(cudaEventSynchronize(b));
      float ms = 0;
      LOCKSTEP_TRY_CUDA(cudaEventElapsedTime(&ms, a, b));
      mine.assign(1, ms / iters);
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      return;
    }
    for (int i = 0; i < warm + iters; ++i) {
      pre();
      ctx.comm().barrier();
      LOCKSTEP_TRY_CUDA(cudaEventRecord(a, s));
      body();
      LOCKSTEP_TRY_CUDA(cudaEventRecord(b, s));
      LOCKSTEP_TRY_CUDA(cudaEventSynchronize(b));
      float ms = 0;
      LOCKSTEP_TRY_CUDA(cudaEventElapsedTime(&ms, a, b));
      if (i >= warm) mine.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  };
  return slowest_median(ngpu, rank_body);
}

inline std::function<void()> nothing() {
  return [] {};
}

template <class T>
lockstep::dtype dt() {
  return lockstep::dtype_of<T>;
}

// Flat limit: one all-reduce (avg) of `total` elements on the same communicator.
template <class T>
double flat_time(std::size_t total, int ngpu, int iters) {
  return timed(ngpu, 5, iters, [&](auto& ctx, cudaStream_t s) {
    T* buf = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&buf, total * sizeof(T)));
    fill_kernel<<<1024, 256, 0, s>>>(buf, total, 7u);
    auto* comm = &ctx.comm();
    return std::pair{nothing(), std::function<void()>([=] {
                       comm->all_reduce(buf, buf, total, dt<T>(), lockstep::reduce_op::avg).wait();
                     })};
  });
}

// e. Where the deterministic MLP's time goes: the collectives of Deterministic's paths alone,
// one after the other as it issues them — with several micro-steps a rank, the int64
// reduce-scatter of `total` sums, then the all-gather of the f32 gradients; with one, the f32
// all-to-all, then the same all-gather — and the plain f32 all-reduce beside them.
inline void bench_e_flat(std::size_t total, int ngpu, int iters) {
  enum first_op { none, int64_reduce_scatter, f32_all_to_all };
  auto run = [&](first_op first, bool ag) {
    return timed(ngpu, 5, iters, [&, first, ag](auto& ctx, cudaStream_t s) {
      const auto n = static_cast<std::size_t>(ctx.comm().size()), me = static_cast<std::size_t>(ctx.comm().rank());
      const std::size_t per = total / n;
      std::int64_t* sums = nullptr;
      float* grads = nullptr;
      LOCKSTEP_TRY_CUDA(cudaMalloc(&sums, per * n * sizeof(std::int64_t)));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&grads, per * n * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMemsetAsync(sums, 1, per * n * sizeof(std::int64_t), s));
      fill_kernel<<<1024, 256, 0, s>>>(grads, per * n, 7u);
      auto* comm = &ctx.comm();
      return std::pair{nothing(), std::function<void()>([=] {
                         if (first == int64_reduce_scatter) {
                           auto w = comm->reduce_scatter(sums, sums + me * per, per, lockstep::dtype::i64,
                                                         lockstep::reduce_op::sum);
                           if (!ag) w.wait();
                         } else if (first == f32_all_to_all) {
                           auto w = comm->all_to_all(grads, sums, per, lockstep::dtype::f32);
                           if (!ag) w.wait();
                         }
                         if (ag) comm->all_gather(grads + me * per, grads, per, lockstep::dtype::f32).wait();
                       })};
    });
  };
  const double rs_ag = run(int64_reduce_scatter, true), rs = run(int64_reduce_scatter, false), ag = run(none, true);
  const double a2a_ag = run(f32_all_to_all, true), a2a = run(f32_all_to_all, false);
  const double flat = flat_time<float>(total, ngpu, iters);
  if (g_print)
    std::printf("e  %d GPU  %zu elements: int64 reduce-scatter + f32 all-gather %7.3f ms (reduce-scatter %7.3f, "
                "all-gather %7.3f)  f32 all-to-all + all-gather %7.3f ms (all-to-all %7.3f)  f32 all-reduce %7.3f ms\n",
                ngpu, total, rs_ag, rs, ag, a2a_ag, a2a, flat);
}

// a. gradient sync once every gradient is final: lockstep's finish() (the remaining buckets
// fused into one all-reduce) and bucket-by-bucket launches, vs the flat all-reduce.
template <class T>
void bench_a(const std::vector<shape>& shapes, int ngpu, int iters, const char* tname) {
  std::size_t total = 0;
  for (auto& s : shapes) total += s.numel();
  const double flat = flat_time<T>(total, ngpu, iters);
  auto lockstep_time = [&](bool per_bucket) {
    return timed(ngpu, 5, iters, [&, per_bucket](auto& ctx, cudaStream_t s) {
      auto m = std::make_shared<ShapesModel<T>>(shapes, 11u, s);
      auto dp = std::make_shared<lockstep::DataParallel<ShapesModel<T>, lockstep::NcclComm>>(ctx, *m);
      using handle = typename decltype(dp)::element_type::step_handle;
      auto step = std::make_shared<std::optional<handle>>();
      const std::size_t n = shapes.size();
      // Untimed: start the step and write every gradient (a backward).
      auto pre = [=] {
        step->emplace(dp->step());
        m->write_grads(s, 3u);
      };
      // Timed: report the gradients (per-bucket launches) or not (all fused), then finish().
      auto body = [=] {
        if (per_bucket)
          for (std::size_t i = n; i-- > 0;) (*step)->gradient_ready(i);
        (*step)->finish();
        step->reset();
      };
      return std::pair{std::function<void()>(pre), std::function<void()>(body)};
    });
  };
  const double fused = lockstep_time(false);
  const double buckets = lockstep_time(true);
  if (g_print)
    std::printf("a  %-4s %d GPU  %6.1f MB  flat %7.3f ms  lockstep fused %7.3f ms (flat/lockstep %.3f)  per-bucket "
                "%7.3f ms (%.3f)\n",
                tname, ngpu, total * sizeof(T) / 1e6, flat, fused, flat / fused, buckets, flat / buckets);
}

// g. lockstep's own host time per step: GPT-2's tensors, no compute — dp.step(), every
// gradient reported (the bucket launches), finish() — on the host clock around those calls
// (device work is not waited for inside; each iteration ends synchronised, untimed). Median
// over iterations of the slowest rank, and that over the plan's buckets.
template <class T>
void bench_g(const std::vector<shape>& shapes, int ngpu, int iters, const char* tname) {
  std::size_t buckets = 0;
  bool symmetric = false;
  auto rank_body = [&](lockstep::context<lockstep::NcclComm>& ctx, std::vector<double>& mine) {
    cudaStream_t s = ctx.comm().compute_stream();
    ShapesModel<T> m(shapes, 11u, s);
    lockstep::DataParallel<ShapesModel<T>, lockstep::NcclComm> dp(ctx, m);
    using clock = std::chrono::steady_clock;
    for (int i = 0; i < 5 + iters; ++i) {
      m.write_grads(s, 3u);
      ctx.comm().barrier();
      const auto t0 = clock::now();
      auto step = dp.step();
      for (std::size_t k = shapes.size(); k-- > 0;) step.gradient_ready(k);
      step.finish();
      const double us = std::chrono::duration<double, std::micro>(clock::now() - t0).count();
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      if (i >= 5) mine.push_back(us);
    }
    if (ctx.rank() == 0) {
      buckets = dp.stats().bucket_count;
      symmetric = dp.stats().symmetric_memory;
    }
  };
  const double us = slowest_median(ngpu, rank_body);
  if (g_print)
    std::printf("g  %s %d GPU  lockstep host time per step %7.1f us: %zu tensors, %zu buckets, %.1f us per bucket "
                "(arena %s)\n",
                tname, ngpu, us, shapes.size(), buckets, us / static_cast<double>(std::max<std::size_t>(buckets, 1)),
                symmetric ? "a symmetric window" : "plain memory");
}

// y. The mean all-reduce of 1-256 MiB on the same communicator, plain device memory (NCCL's
// ring or tree, ncclAvg) beside a symmetric window (NcclComm::allocate_symmetric): lockstep's
// peer kernel (up to LOCKSTEP_PEER_ALL_REDUCE_MIB, default 1024; NCCL's symmetric kernels above)
// and, with the peer kernel off, NCCL's symmetric kernels (their sum, then x1/N). Bus
// bandwidth, busbw = bytes/t * 2(n-1)/n.
template <class T>
void bench_y(int ngpu, int iters, const char* tname) {
  std::string why;
  const char* limit = std::getenv("LOCKSTEP_PEER_ALL_REDUCE_MIB");
  const std::string user_limit = limit ? limit : "";
  for (std::size_t mib : {1, 4, 16, 64, 256}) {
    const std::size_t bytes = mib << 20, n = bytes / sizeof(T);
    auto run_one = [&](int how) {  // 0 plain, 1 window (the default path), 2 window with the peer kernel off
      if (how == 2) setenv("LOCKSTEP_PEER_ALL_REDUCE_MIB", "0", 1);
      else if (limit) setenv("LOCKSTEP_PEER_ALL_REDUCE_MIB", user_limit.c_str(), 1);
      else unsetenv("LOCKSTEP_PEER_ALL_REDUCE_MIB");
      return timed(ngpu, 5, iters, [&, how](auto& ctx, cudaStream_t s) {
        // The group decides its symmetric path once: a fresh split for the peer kernel off
        // (a process's communicator lives across benchmarks under a launcher).
        std::shared_ptr<lockstep::NcclComm> own;
        lockstep::NcclComm* comm = &ctx.comm();
        if (how == 2) {
          own = std::make_shared<lockstep::NcclComm>(ctx.comm().split(0, ctx.rank()));
          comm = own.get();
        }
        std::shared_ptr<void> buf;
        if (how == 0) buf = comm->memory().allocate(bytes);
        else {
          buf = comm->allocate_symmetric(bytes).first;
          if (ctx.rank() == 0 && how == 1) why = comm->symmetric_kernels().second;
        }
        fill_kernel<<<1024, 256, 0, s>>>(static_cast<T*>(buf.get()), n, 7u);
        return std::pair{nothing(), std::function<void()>([=] {
                           comm->all_reduce(buf.get(), buf.get(), n, dt<T>(), lockstep::reduce_op::avg).wait();
                           (void)own;
                         })};
      });
    };
    const double plain = run_one(0), window = run_one(1), nccl = run_one(2);
    if (limit) setenv("LOCKSTEP_PEER_ALL_REDUCE_MIB", user_limit.c_str(), 1);
    else unsetenv("LOCKSTEP_PEER_ALL_REDUCE_MIB");
    const double f = 2.0 * (ngpu - 1) / ngpu;
    auto bw = [&](double ms) { return static_cast<double>(bytes) / (ms * 1e-3) * f / 1e9; };
    if (g_print)
      std::printf("y  %s %d GPU  %4zu MiB  plain %8.1f us %6.1f GB/s | window (lockstep peer kernel <= limit) %8.1f us "
                  "%6.1f GB/s (%.2fx) | NCCL symmetric %8.1f us %6.1f GB/s (%.2fx)\n",
                  tname, ngpu, mib, plain * 1e3, bw(plain), window * 1e3, bw(window), plain / window, nccl * 1e3,
                  bw(nccl), plain / nccl);
  }
  if (g_print) std::printf("y  symmetric_kernels(): %s\n", why.c_str());
}

// h. Hierarchical reduction (nodes of `node` consecutive ranks) against the flat all-reduce of
// the same bytes, on the same communicator: GPT-2's gradients as one buffer, and lockstep's
// bucket-by-bucket sync (as in a) with the Hierarchical hook vs the default one.
template <class T>
void bench_h(const std::vector<shape>& shapes, int ngpu, int iters, const char* tname, int node) {
  if (ngpu % node != 0 || ngpu == 1) return;  // node == ngpu: one node, Hierarchical is the flat all-reduce
  std::size_t total = 0;
  for (auto& s : shapes) total += s.numel();
  const double flat = flat_time<T>(total, ngpu, iters);
  const double hier = timed(ngpu, 5, iters, [&](auto& ctx, cudaStream_t s) {
    T* buf = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&buf, total * sizeof(T)));
    fill_kernel<<<1024, 256, 0, s>>>(buf, total, 7u);
    auto h = std::make_shared<lockstep::Hierarchical<lockstep::NcclComm>>(
        ctx.comm(), lockstep::HierarchicalOptions{.ranks_per_node = node});
    auto* comm = &ctx.comm();
    return std::pair{nothing(), std::function<void()>([=] { h->reduce(*comm, buf, total, dt<T>()).wait(); })};
  });
  auto per_bucket = [&](bool hierarchical) {
    return timed(ngpu, 5, iters, [&, hierarchical](auto& ctx, cudaStream_t s) {
      auto m = std::make_shared<ShapesModel<T>>(shapes, 11u, s);
      using Hook = lockstep::Hierarchical<lockstep::NcclComm>;
      auto hook = hierarchical ? Hook(ctx.comm(), {.ranks_per_node = node}) : Hook();
      auto dp =
          std::make_shared<lockstep::DataParallel<ShapesModel<T>, lockstep::NcclComm, Hook>>(ctx, *m, std::move(hook));
      using handle = typename decltype(dp)::element_type::step_handle;
      auto step = std::make_shared<std::optional<handle>>();
      const std::size_t n = shapes.size();
      auto pre = [=] {
        step->emplace(dp->step());
        m->write_grads(s, 3u);
      };
      auto body = [=] {
        for (std::size_t i = n; i-- > 0;) (*step)->gradient_ready(i);
        (*step)->finish();
        step->reset();
      };
      return std::pair{std::function<void()>(pre), std::function<void()>(body)};
    });
  };
  const double dp_flat = per_bucket(false), dp_hier = per_bucket(true);
  if (g_print)
    std::printf(
        "h  %-4s %d GPU  nodes of %d  %6.1f MB  one buffer: flat %8.3f ms  hierarchical %8.3f ms (flat/hier %.3f)  "
        "per-bucket sync: flat %8.3f ms  hierarchical %8.3f ms (%.3f)\n",
        tname, ngpu, node, total * sizeof(T) / 1e6, flat, hier, flat / hier, dp_flat, dp_hier, dp_flat / dp_hier);
}

// b/c. A synthetic training step: forward (fwd_us per layer); backward: `head_us` of compute
// with no gradient final yet (e.g. GPT-2's tied lm_head), then per tensor (reverse
// registration order) bwd_us[i] of compute and its gradient reported; finish() with a
// per-bucket SGD update (which overlaps the buckets still in flight).
// Sharded: ShardedOptimizer (reduce-scatter per unit, the SGD on this GPU's shard, all-gather).
// Deferred: gather_in_forward — the forward waits for each layer's parameters (params_per_layer
// of them, in order) just before its compute. Bound (sharded): the parameters live in the
// shards' value arena (no pack before the optimizer, no unpack after the all-gather).
template <class T, bool Sharded = false, int Wire = 0, bool Deferred = false, bool Bound = true,
          bool Deterministic = false>
double train_step_time(const std::vector<shape>& shapes, int ngpu, int iters, double head_us,
                       const std::vector<double>& fwd_us, const std::vector<double>& bwd_us,
                       lockstep::BucketPolicy buckets = {}) {
  return timed(ngpu, 5, iters, [&](auto& ctx, cudaStream_t s) {
    using M = ShapesModel<T, Bound>;
    auto m = std::make_shared<M>(shapes, 5u, s);
    using C = lockstep::NcclComm;
    using Strategy = std::conditional_t<Sharded, lockstep::ShardedOptimizer, lockstep::Replicated>;
    // Wire: 0 the fp32 all-reduce, 1 Bf16Wire, 2 Int8Wire.
    using Hook = std::conditional_t<
        Deterministic, lockstep::Deterministic,
        std::conditional_t<Wire == 1, lockstep::Bf16Wire,
                           std::conditional_t<Wire == 2, lockstep::Int8Wire, lockstep::AllReduceMean>>>;
    using DP = lockstep::DataParallel<M, C, Hook, Strategy>;
    Strategy strategy{};
    if constexpr (Sharded) {  // field by field: nvcc 13.0 assigned `strategy = {.a = x, .c = y}` positionally
      strategy.gather_in_forward = Deferred;
      strategy.copy_engine_gather = !g_sm_gather;
      strategy.copy_engine_scatter = g_ce_scatter;
      strategy.gather_wire = g_gather_wire;
    }
    // The DataParallel hands the model its values back when it goes (unbind_values): it holds
    // the model, so the model outlives it whatever order the closures release them in.
    buckets.symmetric_memory = buckets.symmetric_memory || g_symmetric;
    auto dp = std::shared_ptr<DP>(new DP(ctx, *m, lockstep::DataParallelOptions{.buckets = buckets}, strategy),
                                  [m](DP* p) { delete p; });
    if constexpr (Sharded) {  // where the time goes: did the options take effect?
      const auto& st = dp->stats();
      if (ctx.rank() == 0 && std::getenv("BENCH_SYNC_STATS"))
        std::printf("   [sharded: values bound %d, gathers on copy engines %d, scatters on copy engines %d]\n",
                    st.values_bound, st.gathers_by_copy_engine, st.scatters_by_copy_engine);
    }
    const std::size_t n = shapes.size(), per_layer = n / fwd_us.size();
    auto body = [=, &fwd_us, &bwd_us] {
      auto step = dp->step();
      for (std::size_t l = 0; l < fwd_us.size(); ++l) {
        if constexpr (Deferred)
          for (std::size_t i = l * per_layer; i < (l + 1) * per_layer && i < n; ++i) dp->wait_parameters(i);
        compute(fwd_us[l], s);
      }
      compute(head_us, s);
      for (std::size_t i = n; i-- > 0;) {
        compute(bwd_us[i], s);
        fill_kernel<<<264, 256, 0, s>>>(m->grads[i], m->shapes[i].numel(), 9u);
        step.gradient_ready(i);
      }
      step.finish([&](std::span<const lockstep::param_slice> slices) {
        for (const auto& sl : slices)
          sgd_kernel<<<528, 256, 0, s>>>(static_cast<T*>(sl.value), static_cast<const T*>(sl.grad), sl.count, 1e-3f);
      });
    };
    const bool root = ctx.rank() == 0;
    return std::pair{std::function<void()>([=] {
                       if (root) g_stats = dp->stats();
                     }),
                     std::function<void()>(body)};
  });
}

// k. Bucket caps from the cost model (BucketPolicy::tune) beside a hand sweep of caps, each
// timed in this run: `name`'s step (train_step_time's synthetic model), the tuned cap and the
// model's comparison printed.
template <class T>
void bench_k(const char* name, const std::vector<shape>& shapes, int g, int iters, double head,
             const std::vector<double>& fwd, const std::vector<double>& bwd) {
  std::string row;
  double best = -1;
  std::size_t best_cap = 0;
  for (std::size_t cap_mib : {std::size_t{1}, std::size_t{4}, std::size_t{25}, std::size_t{64}, std::size_t{128}}) {
    const double t = train_step_time<T>(shapes, g, iters, head, fwd, bwd, {.cap_bytes = cap_mib << 20});
    char cell[48];
    std::snprintf(cell, sizeof cell, "  %zu MiB %.3f", cap_mib, t);
    row += cell;
    if (best < 0 || t < best) best = t, best_cap = cap_mib;
  }
  const double tuned = train_step_time<T>(shapes, g, iters, head, fwd, bwd, {.tune = true});
  if (g_print) {
    std::printf("k  %s %d GPU  hand sweep (cap, ms):%s | best %zu MiB %.3f ms | tuned %.3f ms (%.1f%% off the best)\n",
                name, g, row.c_str(), best_cap, best, tuned, 100.0 * (tuned - best) / best);
    std::printf("k  %s %d GPU  tuned: %s\n", name, g, g_stats.tuning.c_str());
  }
}

// z. The same step under full sharding (Strategy: ShardedGradients or FullySharded): each layer
// (per_layer tensors) a block, used in forward and in backward; stats: its shard and lent bytes.
template <class T, class Strategy>
double block_step_time(const std::vector<shape>& shapes, int ngpu, int iters, const std::vector<double>& fwd_us,
                       const std::vector<double>& bwd_us, lockstep::sync_stats* stats, Strategy strategy = {}) {
  return timed(ngpu, 5, iters, [&](auto& ctx, cudaStream_t s) {
    using M = ShapesModel<T, false>;
    auto m = std::make_shared<M>(shapes, 5u, s);
    const std::size_t n = shapes.size(), per_layer = n / fwd_us.size();
    m->per_block = per_layer;
    using DP = lockstep::DataParallel<M, lockstep::NcclComm, Strategy>;
    auto dp = std::shared_ptr<DP>(new DP(ctx, *m, strategy), [m](DP* p) { delete p; });
    const bool report = stats && ctx.rank() == 0;
    if (report) *stats = dp->stats();
    auto body = [=, &fwd_us, &bwd_us] {
      auto step = dp->step();
      for (std::size_t l = 0; l < fwd_us.size(); ++l) {
        auto use = dp->use_block(l, lockstep::pass::forward);
        compute(fwd_us[l], s);
      }
      for (std::size_t l = fwd_us.size(); l-- > 0;) {
        auto use = dp->use_block(l, lockstep::pass::backward);
        for (std::size_t i = std::min(n, (l + 1) * per_layer); i-- > l * per_layer;) {
          compute(bwd_us[i], s);
          fill_kernel<<<264, 256, 0, s>>>(m->grads[i], m->shapes[i].numel(), 9u);
          step.gradient_ready(i);
        }
      }
      step.finish([&](std::span<const lockstep::param_slice> slices) {
        for (const auto& sl : slices)
          sgd_kernel<<<528, 256, 0, s>>>(static_cast<T*>(sl.value), static_cast<const T*>(sl.grad), sl.count, 1e-3f);
      });
      if (report) stats->lent_bytes = dp->stats().lent_bytes;
    };
    return std::pair{nothing(), std::function<void()>(body)};
  });
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string shapes_path = "bench/data/gpt2_124m_shapes.txt";
    int iters = 30, max_gpus = 0, node = 2;
    std::string only = "abc";  // which benchmarks: a slow (socket) network wants fewer
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--shapes" && i + 1 < argc) shapes_path = argv[++i];
      else if (a == "--iters" && i + 1 < argc) iters = std::stoi(argv[++i]);
      else if (a == "--gpus" && i + 1 < argc) max_gpus = std::stoi(argv[++i]);
      else if (a == "--only" && i + 1 < argc) only = argv[++i];
      else if (a == "--node-size" && i + 1 < argc) node = std::stoi(argv[++i]);
      else if (a == "--symmetric") g_symmetric = true;
      else {
        std::fprintf(stderr,
                     "usage: bench_sync [--shapes FILE] [--iters N] [--gpus N] [--only abceghkstwxyz] [--node-size L] "
                     "[--symmetric]\n");
        return 2;
      }
    }
    const auto wanted = [&](char b) { return only.find(b) != std::string::npos; };
    int visible = 0;
    LOCKSTEP_TRY_CUDA(cudaGetDeviceCount(&visible));
    if (max_gpus <= 0 || max_gpus > visible) max_gpus = visible;
    cudaDeviceProp prop{};
    LOCKSTEP_TRY_CUDA(cudaGetDeviceProperties(&prop, 0));
    sm_count = prop.multiProcessorCount;
    std::printf("device: %d x %s, %d SMs, NCCL_NVLS_ENABLE=%s\n", visible, prop.name, sm_count,
                std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "(unset)");
    auto gpt2 = read_shapes(shapes_path);
    // All benchmarks for the given GPU counts (in Distributed mode: the launcher's world).
    auto all = [&](const std::vector<int>& counts) {
      if (wanted('h'))
        for (int g : counts) {
          bench_h<float>(gpt2, g, iters, "fp32", node);
          bench_h<__nv_bfloat16>(gpt2, g, iters, "bf16", node);
        }
      if (wanted('g'))
        for (int g : counts) bench_g<__nv_bfloat16>(gpt2, g, iters, "bf16");
      if (wanted('y'))
        for (int g : counts)
          if (g > 1)
            for (bool chained : {false, true}) {  // each op alone (its latency), then back to back
              g_chained = chained;
              if (g_print) std::printf("y  %s\n", chained ? "chained: ops back to back" : "each op alone");
              bench_y<__nv_bfloat16>(g, iters, "bf16");
              bench_y<float>(g, iters, "fp32");
              g_chained = false;
            }
      if (wanted('a'))
        for (int g : counts)
          if (g > 1) {
            bench_a<float>(gpt2, g, iters, "fp32");
            bench_a<__nv_bfloat16>(gpt2, g, iters, "bf16");
          }

      // b. GPT-2-small step ≈ 26 ms on one GPU: forward 1/3, backward 2/3 with time ∝ tensor
      // size. The tied wte/lm_head: its big matmul comes first in backward (no gradient final
      // yet), its embedding part last — wte's gradient is final only at the very end.
      if (wanted('b')) {
        std::size_t total = 0;
        for (auto& s : gpt2) total += s.numel();
        std::vector<double> fwd(12, 8700.0 / 12), bwd(gpt2.size());
        double head = 0;
        for (std::size_t i = 0; i < gpt2.size(); ++i) {
          const double us = 17300.0 * gpt2[i].numel() / total;
          if (gpt2[i].name == "wte") {
            head = us;
            bwd[i] = 20.0;
          } else bwd[i] = us;
        }
        double one = 0;
        for (int g : counts) {
          double t = train_step_time<__nv_bfloat16>(gpt2, g, iters, head, fwd, bwd);
          if (g == 1) one = t;
          if (!g_print) continue;
          if (one > 0)
            std::printf("b  bf16 %d GPU  step %7.3f ms  exposed %6.3f ms (%5.2f%% of step)  scaling %.1f%%\n", g, t,
                        t - one, 100.0 * (t - one) / t, 100.0 * one / t);
          else  // Distributed mode: the 1-GPU step comes from a DataParallel run of the same machine
            std::printf("b  bf16 %d GPU  step %7.3f ms\n", g, t);
        }
      }
      // k. The tuned caps against a hand sweep: b's GPT-2 step (bf16) and c's MLP (fp32).
      if (wanted('k') || wanted('x') || wanted('e')) {
        std::size_t total = 0;
        for (auto& s : gpt2) total += s.numel();
        std::vector<double> fwd(12, 8700.0 / 12), bwd(gpt2.size());
        double head = 0;
        for (std::size_t i = 0; i < gpt2.size(); ++i) {
          const double us = 17300.0 * gpt2[i].numel() / total;
          if (gpt2[i].name == "wte") head = us, bwd[i] = 20.0;
          else bwd[i] = us;
        }
        std::vector<shape> mlp;
        for (int l = 0; l < 8; ++l) {
          mlp.push_back({"l" + std::to_string(l) + ".weight", {4096, 4096}});
          mlp.push_back({"l" + std::to_string(l) + ".bias", {4096}});
        }
        std::vector<double> mfwd(8, 70.0), mbwd(mlp.size(), 0.0);
        for (std::size_t i = 0; i < mlp.size(); i += 2) mbwd[i] = 140.0;
        for (int g : counts)
          if (g > 1 && wanted('k')) {
            bench_k<__nv_bfloat16>("gpt2 bf16", gpt2, g, iters, head, fwd, bwd);
            bench_k<float>("mlp fp32", mlp, g, iters, 0, mfwd, mbwd);
          }
        // x. Deterministic (fixed-point sums) beside the plain mean, one after the other in this
        // call: the synthetic GPT-2 step in fp32 gradients (libtorch's autocast keeps them fp32)
        // and the comm-bound MLP.
        for (int g : counts)
          if (wanted('x')) {
            const double p = train_step_time<float>(gpt2, g, iters, head, fwd, bwd);
            const double d = train_step_time<float, false, false, false, true, true>(gpt2, g, iters, head, fwd, bwd);
            const double mp = train_step_time<float>(mlp, g, iters, 0, mfwd, mbwd);
            const double md = train_step_time<float, false, false, false, true, true>(mlp, g, iters, 0, mfwd, mbwd);
            if (g_print)
              std::printf("x  %d GPU  gpt2 fp32: plain %7.3f ms  deterministic %7.3f ms (%.3fx)   mlp fp32: plain "
                          "%7.3f ms  deterministic %7.3f ms (%.3fx)\n",
                          g, p, d, d / p, mp, md, md / mp);
          }
        // e. The MLP's deterministic step taken apart: with no compute (sync, conversions and
        // SGD only), with 64 and 128 MiB caps, and its collectives alone (bench_e_flat).
        for (int g : counts)
          if (wanted('e') && g > 1) {
            std::size_t total = 0;
            for (auto& s : mlp) total += s.numel();
            const std::vector<double> none(mfwd.size(), 0.0), none_b(mbwd.size(), 0.0);
            const double p0 = train_step_time<float>(mlp, g, iters, 0, none, none_b);
            const double d0 = train_step_time<float, false, false, false, true, true>(mlp, g, iters, 0, none, none_b);
            if (g_print)
              std::printf("e  %d GPU  mlp fp32 no compute: plain %7.3f ms  deterministic %7.3f ms\n", g, p0, d0);
            for (std::size_t cap_mib : {std::size_t{64}, std::size_t{128}}) {
              const lockstep::BucketPolicy bp{.first_bytes = std::size_t{1} << 20, .cap_bytes = cap_mib << 20};
              const double p = train_step_time<float>(mlp, g, iters, 0, mfwd, mbwd, bp);
              const double d =
                  train_step_time<float, false, false, false, true, true>(mlp, g, iters, 0, mfwd, mbwd, bp);
              if (g_print)
                std::printf("e  %d GPU  mlp fp32 cap %zu MiB: plain %7.3f ms  deterministic %7.3f ms (%.3fx)\n", g,
                            cap_mib, p, d, d / p);
            }
            bench_e_flat(total, g, iters);
          }
      }
      // c. comm-bound MLP: 8 × (4096×4096 weight + 4096 bias); small per-layer compute; bucket
      // caps swept (DDP's 25 MiB default first). s and w run on the same MLP, with or without c.
      if (wanted('c') || wanted('s') || wanted('w') || wanted('t') || wanted('z')) {
        std::vector<shape> mlp;
        for (int l = 0; l < 8; ++l) {
          mlp.push_back({"l" + std::to_string(l) + ".weight", {4096, 4096}});
          mlp.push_back({"l" + std::to_string(l) + ".bias", {4096}});
        }
        std::size_t total = 0;
        for (auto& s : mlp) total += s.numel();
        std::vector<double> fwd(8, 70.0), bwd(mlp.size(), 0.0);
        for (std::size_t i = 0; i < mlp.size(); i += 2) bwd[i] = 140.0;
        for (int pass = 0; pass < 2; ++pass) {
          const char* tn = pass == 0 ? "fp32" : "bf16";
          // In Distributed mode every process is a rank of one job: no 1-GPU run here (it comes
          // from a DataParallel run of the same machine).
          double one = 0;
          if (!g_process_ctx) {
            one = pass == 0 ? train_step_time<float>(mlp, 1, iters, 0, fwd, bwd)
                            : train_step_time<__nv_bfloat16>(mlp, 1, iters, 0, fwd, bwd);
            if (g_print) std::printf("c  %s 1 GPU  step %7.3f ms\n", tn, one);
          }
          for (int g : counts) {
            if (g == 1) continue;
            double flat = pass == 0 ? flat_time<float>(total, g, iters) : flat_time<__nv_bfloat16>(total, g, iters);
            if (wanted('c')) {
              // Where the time goes: the same step with no compute at all (communication and
              // optimizer only), default buckets.
              const std::vector<double> none(fwd.size(), 0.0), none_b(bwd.size(), 0.0);
              double t0 = pass == 0 ? train_step_time<float>(mlp, g, iters, 0, none, none_b)
                                    : train_step_time<__nv_bfloat16>(mlp, g, iters, 0, none, none_b);
              if (g_print) std::printf("c  %s %d GPU  no compute (sync + SGD only)  step %7.3f ms\n", tn, g, t0);
            }
            for (std::size_t cap_mib : {std::size_t{25}, std::size_t{64}, std::size_t{128}}) {
              if (!wanted('c')) break;
              lockstep::BucketPolicy bp{.first_bytes = std::size_t{1} << 20, .cap_bytes = cap_mib << 20};
              double t = pass == 0 ? train_step_time<float>(mlp, g, iters, 0, fwd, bwd, bp)
                                   : train_step_time<__nv_bfloat16>(mlp, g, iters, 0, fwd, bwd, bp);
              if (g_print && one > 0)
                std::printf(
                    "c  %s %d GPU  cap %3zu MiB  step %7.3f ms  (1 GPU %6.3f ms, flat all-reduce alone %6.3f ms, "
                    "scaling %.1f%%)\n",
                    tn, g, cap_mib, t, one, flat, 100.0 * one / t);
              else if (g_print)
                std::printf("c  %s %d GPU  cap %3zu MiB  step %7.3f ms  (flat all-reduce alone %6.3f ms)\n", tn, g,
                            cap_mib, t, flat);
            }
            // w. fp32 gradients in bf16 (Bf16Wire) or blockwise int8 (Int8Wire) on the wire, plain
            // and sharded.
            if (wanted('w') && pass == 0)
              for (std::size_t cap_mib : {std::size_t{25}, std::size_t{64}}) {
                lockstep::BucketPolicy bp{.first_bytes = std::size_t{1} << 20, .cap_bytes = cap_mib << 20};
                g_chained = true;
                const auto wire_row = [&]<int W>(std::integral_constant<int, W>, const char* name) {
                  const double t = train_step_time<float, false, W>(mlp, g, iters, 0, fwd, bwd, bp);
                  const double ts = train_step_time<float, true, W>(mlp, g, iters, 0, fwd, bwd, bp);
                  const double tsd = train_step_time<float, true, W, true>(mlp, g, iters, 0, fwd, bwd, bp);
                  g_ce_scatter = true;
                  const double tss = train_step_time<float, true, W, true>(mlp, g, iters, 0, fwd, bwd, bp);
                  g_ce_scatter = false;
                  g_sm_gather = true;
                  const double tsm = train_step_time<float, true, W, true>(mlp, g, iters, 0, fwd, bwd, bp);
                  g_sm_gather = false;
                  if (g_print)
                    std::printf(
                        "w  fp32 %d GPU  cap %3zu MiB  chained steps: %s wire %7.3f ms  sharded + %s wire %7.3f ms  "
                        "+ gather in forward %7.3f ms (+ reduce-scatters on copy engines %7.3f ms; gathers on SMs "
                        "%7.3f ms)  (1 GPU %6.3f ms, flat fp32 all-reduce alone %6.3f ms)\n",
                        g, cap_mib, name, t, name, ts, tsd, tss, tsm, one, flat);
                };
                wire_row(std::integral_constant<int, 1>{}, "bf16");
                wire_row(std::integral_constant<int, 2>{}, "int8");
                g_chained = false;
              }
            // t. Where the sharded step's time goes: the fastest schedule (gather in forward, both
            // copy-engine options, cap 64 MiB, chained) with its compute and with none (only the
            // collectives and the shard's SGD: the communication floor), beside the compute alone
            // (1 GPU); one configuration, to run under a profiler (nsys) for a per-stream timeline.
            if (wanted('t')) {
              lockstep::BucketPolicy bp{.first_bytes = std::size_t{1} << 20, .cap_bytes = std::size_t{64} << 20};
              const std::vector<double> none(fwd.size(), 0.0), none_b(bwd.size(), 0.0);
              g_chained = g_ce_scatter = true;
              const double full =
                  pass == 0 ? train_step_time<float, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp)
                            : train_step_time<__nv_bfloat16, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp);
              const double bare =
                  pass == 0 ? train_step_time<float, true, false, true>(mlp, g, iters, 0, none, none_b, bp)
                            : train_step_time<__nv_bfloat16, true, false, true>(mlp, g, iters, 0, none, none_b, bp);
              const double wired =
                  pass == 0 ? train_step_time<float, true, 1, true>(mlp, g, iters, 0, fwd, bwd, bp) : 0.0;
              const double wired_bare =
                  pass == 0 ? train_step_time<float, true, 1, true>(mlp, g, iters, 0, none, none_b, bp) : 0.0;
              const double int8 =
                  pass == 0 ? train_step_time<float, true, 2, true>(mlp, g, iters, 0, fwd, bwd, bp) : 0.0;
              const double int8_bare =
                  pass == 0 ? train_step_time<float, true, 2, true>(mlp, g, iters, 0, none, none_b, bp) : 0.0;
              g_chained = g_ce_scatter = false;
              if (g_print)
                std::printf(
                    "t  %s %d GPU  cap  64 MiB  sharded, gather in forward, copy engines, chained: step %7.3f ms, "
                    "the same with no compute %7.3f ms;  + bf16 wire %7.3f ms, no compute %7.3f ms;  + int8 wire "
                    "%7.3f ms, no compute %7.3f ms  (1 GPU %6.3f ms)\n",
                    tn, g, full, bare, wired, wired_bare, int8, int8_bare, one);
            }
            // v. The schedule of t with the values' all-gather in bf16 or int8 (gather_wire, deltas)
            // and the gradients in fp32 or int8, with the compute and with none.
            if (wanted('v') && pass == 0) {
              lockstep::BucketPolicy bp{.first_bytes = std::size_t{1} << 20, .cap_bytes = std::size_t{64} << 20};
              const std::vector<double> none(fwd.size(), 0.0), none_b(bwd.size(), 0.0);
              g_chained = g_ce_scatter = true;
              for (const auto gw :
                   {lockstep::wire_format::fp32, lockstep::wire_format::bf16, lockstep::wire_format::int8}) {
                g_gather_wire = gw;
                const double f32 = train_step_time<float, true, 0, true>(mlp, g, iters, 0, fwd, bwd, bp);
                const double f32_bare = train_step_time<float, true, 0, true>(mlp, g, iters, 0, none, none_b, bp);
                const double i8 = train_step_time<float, true, 2, true>(mlp, g, iters, 0, fwd, bwd, bp);
                const double i8_bare = train_step_time<float, true, 2, true>(mlp, g, iters, 0, none, none_b, bp);
                if (g_print)
                  std::printf(
                      "v  fp32 %d GPU  cap  64 MiB  sharded, gather in forward, copy engines, chained, values on the "
                      "wire in %s: fp32 gradients %7.3f ms (no compute %7.3f ms);  int8 gradients %7.3f ms (no "
                      "compute %7.3f ms)  (1 GPU %6.3f ms)\n",
                      g, lockstep::name_of(gw), f32, f32_bare, i8, i8_bare, one);
              }
              g_gather_wire = lockstep::wire_format::fp32;
              g_chained = g_ce_scatter = false;
            }
            // s. The same step with ShardedOptimizer (issue 13's schedule: the all-gather after
            // each unit's update, the optimizer on 1/N of the parameters).
            if (wanted('z')) {  // full sharding beside plain and ZeRO-1, steps chained
              g_chained = true;
              lockstep::sync_stats z2{}, z3{};
              double tp = 0, t1 = 0, t2 = 0, t3 = 0, t3b = 0, t3i = 0;
              if (pass == 0) {
                tp = train_step_time<float>(mlp, g, iters, 0, fwd, bwd);
                t1 = train_step_time<float, true, false, true>(mlp, g, iters, 0, fwd, bwd);
                t2 = block_step_time<float, lockstep::ShardedGradients>(mlp, g, iters, fwd, bwd, &z2);
                t3 = block_step_time<float, lockstep::FullySharded>(mlp, g, iters, fwd, bwd, &z3);
                lockstep::FullySharded wired;  // FullySharded::gather_wire: the gathers in bf16, in int8
                wired.gather_wire = lockstep::wire_format::bf16;
                t3b = block_step_time<float>(mlp, g, iters, fwd, bwd, nullptr, wired);
                wired.gather_wire = lockstep::wire_format::int8;
                t3i = block_step_time<float>(mlp, g, iters, fwd, bwd, nullptr, wired);
              } else {
                tp = train_step_time<__nv_bfloat16>(mlp, g, iters, 0, fwd, bwd);
                t1 = train_step_time<__nv_bfloat16, true, false, true>(mlp, g, iters, 0, fwd, bwd);
                t2 = block_step_time<__nv_bfloat16, lockstep::ShardedGradients>(mlp, g, iters, fwd, bwd, &z2);
                t3 = block_step_time<__nv_bfloat16, lockstep::FullySharded>(mlp, g, iters, fwd, bwd, &z3);
              }
              g_chained = false;
              if (g_print)
                std::printf("z  %s %d GPU  chained steps: plain %7.3f  ZeRO-1 %7.3f  ZeRO-2 %7.3f  ZeRO-3 %7.3f ms  "
                            "(ZeRO-2 shard %.1f MB lent %.1f MB; ZeRO-3 shard %.1f MB lent %.1f MB; model %.1f MB; "
                            "1 GPU %6.3f ms, flat all-reduce alone %6.3f ms)\n",
                            tn, g, tp, t1, t2, t3, z2.shard_bytes / 1e6, z2.lent_bytes / 1e6, z3.shard_bytes / 1e6,
                            z3.lent_bytes / 1e6, total * (pass == 0 ? 4.0 : 2.0) / 1e6, one, flat);
              if (g_print && pass == 0)
                std::printf("z  %s %d GPU  ZeRO-3 gathers on the wire (FullySharded::gather_wire): fp32 %7.3f  bf16 "
                            "%7.3f  int8 %7.3f ms\n",
                            tn, g, t3, t3b, t3i);
            }
            if (wanted('s'))
              for (std::size_t cap_mib : {std::size_t{25}, std::size_t{64}}) {
                lockstep::BucketPolicy bp{.first_bytes = std::size_t{1} << 20, .cap_bytes = cap_mib << 20};
                double t = pass == 0 ? train_step_time<float, true>(mlp, g, iters, 0, fwd, bwd, bp)
                                     : train_step_time<__nv_bfloat16, true>(mlp, g, iters, 0, fwd, bwd, bp);
                g_chained = true;  // the same three, steps back to back (the gather's overlap is across steps)
                double tp = pass == 0 ? train_step_time<float>(mlp, g, iters, 0, fwd, bwd, bp)
                                      : train_step_time<__nv_bfloat16>(mlp, g, iters, 0, fwd, bwd, bp);
                double tc = pass == 0 ? train_step_time<float, true>(mlp, g, iters, 0, fwd, bwd, bp)
                                      : train_step_time<__nv_bfloat16, true>(mlp, g, iters, 0, fwd, bwd, bp);
                double td = pass == 0
                                ? train_step_time<float, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp)
                                : train_step_time<__nv_bfloat16, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp);
                double tu = pass == 0 ? train_step_time<float, true, false, true, false>(mlp, g, iters, 0, fwd, bwd, bp)
                                      : train_step_time<__nv_bfloat16, true, false, true, false>(mlp, g, iters, 0, fwd,
                                                                                                 bwd, bp);
                g_ce_scatter = true;  // the reduce-scatters on the copy engines too
                double tcs = pass == 0
                                 ? train_step_time<float, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp)
                                 : train_step_time<__nv_bfloat16, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp);
                g_ce_scatter = false;
                g_sm_gather = true;  // the gathers on NCCL's SM kernels instead of the copy engines
                double tsm = pass == 0
                                 ? train_step_time<float, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp)
                                 : train_step_time<__nv_bfloat16, true, false, true>(mlp, g, iters, 0, fwd, bwd, bp);
                g_sm_gather = g_chained = false;
                if (g_print)
                  std::printf(
                      "s  %s %d GPU  cap %3zu MiB  sharded step %7.3f ms;  chained steps: plain %7.3f  sharded %7.3f  "
                      "gather in forward %7.3f ms  (+ reduce-scatters on copy engines %7.3f ms; values packed, not "
                      "bound: "
                      "%7.3f ms; gathers on SMs, not copy engines: %7.3f ms)  (1 GPU %6.3f ms, flat all-reduce alone "
                      "%6.3f ms)\n",
                      tn, g, cap_mib, t, tp, tc, td, tcs, tu, tsm, one, flat);
              }
          }
        }
      }
    };
    if (const auto launched = lockstep::detect_launcher()) {
      // Distributed mode: one process per GPU (lockstep-run / torchrun); the 1-GPU baselines
      // come from the DataParallel run of the same machine.
      lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
        g_process_ctx = &ctx;
        g_print = ctx.rank() == 0;
        if (g_print) std::printf("mode: Distributed, %d processes (%s)\n", ctx.size(), launched->launcher.c_str());
        all({ctx.size()});
        g_process_ctx = nullptr;
      });
    } else {
      std::vector<int> counts;
      for (int g : {1, 2, 4, 8})
        if (g <= max_gpus) counts.push_back(g);
      std::printf("mode: DataParallel, one process driving the GPUs\n");
      all(counts);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sync: %s\n", e.what());
    return 1;
  }
}
