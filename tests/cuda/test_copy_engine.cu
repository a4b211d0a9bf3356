// NcclComm's copy-engine group (copy_engine_group, allocate_window; cuda/detail/nccl_window.cuh):
// a reduce-scatter of window memory is an all-to-all on the copy engines and a local sum, so
// its result is the fp32 sum of the ranks' blocks in rank order, which the CPU reference here
// computes bit for bit from the same random inputs (NCCL's ring would sum in another order).
// Plain memory on the same group still reduce-scatters (NCCL's kernel); the in-place all-gather
// into a window is exact; a larger reduce-scatter after a smaller one grows the staging.
// DataParallel refuses, on every rank, copy-engine options that differ across ranks.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <lockstep/cuda.cuh>

#include "gpu_test_util.cuh"
#include "test_util.hpp"

#if LOCKSTEP_NCCL_COPY_ENGINE
namespace {

using lockstep::dtype;
using lockstep::reduce_op;

using lockstep_test::first_gpus;

float bf16_round(float f) { return lockstep::detail::float_of_bf16(lockstep::detail::bf16_of_float(f)); }

// What the copy-engine reduce-scatter computes for element i of block b: Σ_k x_k[b·per + i] in
// fp32, k in rank order, times scale (1/N for avg, else 1); bf16: the inputs are bf16 values and
// the result is rounded to bf16 once.
float want_at(const std::vector<std::vector<float>>& x, std::size_t at, float scale, bool bf16) {
  float acc = 0;
  for (const auto& v : x) acc += v[at];
  acc *= scale;
  return bf16 ? bf16_round(acc) : acc;
}

struct rs_case {
  std::size_t per;
  dtype t;
  reduce_op op;
  bool in_place;
};

void check_group(int n) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  std::mt19937_64 rng(seed);
  // Unaligned-length and vector-length blocks, f32 and bf16, sum and mean, in and out of place;
  // the third is larger than the first two (the staging grows between them).
  const std::vector<rs_case> cases{{8 * 1000 + 3, dtype::f32, reduce_op::avg, true},
                                   {8 * 512, dtype::bf16, reduce_op::avg, true},
                                   {8 * 40000, dtype::f32, reduce_op::sum, false},
                                   {8 * 3000 + 5, dtype::bf16, reduce_op::sum, false}};
  const std::size_t plain_per = 4099, gather_per = 2053;
  std::vector<std::vector<std::vector<float>>> x(cases.size());  // [case][rank][element]
  for (std::size_t c = 0; c < cases.size(); ++c)
    for (int r = 0; r < n; ++r) {
      auto v =
          lockstep_test::random_vector<float>(cases[c].per * static_cast<std::size_t>(n), rng, -4.0 * (r + 1), 3.0);
      if (cases[c].t == dtype::bf16)
        for (auto& f : v) f = bf16_round(f);
      x[c].push_back(std::move(v));
    }
  std::vector<std::vector<float>> plain, gathered;
  for (int r = 0; r < n; ++r) {
    plain.push_back(lockstep_test::random_vector<float>(plain_per * static_cast<std::size_t>(n), rng, -1.0, 1.0));
    gathered.push_back(lockstep_test::random_vector<float>(gather_per, rng, -5.0, 5.0));
  }
  // [rank][case][element] as floats (bf16 widened)
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(n));
  std::vector<std::vector<float>> got_plain(static_cast<std::size_t>(n)), got_gather(static_cast<std::size_t>(n));
  std::vector<int> flags(static_cast<std::size_t>(n), 0);
  std::vector<std::size_t> staging(static_cast<std::size_t>(n)), staging_after_plain(static_cast<std::size_t>(n));
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    lockstep::NcclComm engine = ctx.comm().copy_engine_group();
    flags[r] = engine.copy_engines() && !ctx.comm().copy_engines() ? 1 : 0;
    cudaStream_t cs = engine.compute_stream();
    for (std::size_t c = 0; c < cases.size(); ++c) {
      const rs_case& k = cases[c];
      const std::size_t es = lockstep::size_of(k.t), total = k.per * static_cast<std::size_t>(n);
      auto [win, taken] = engine.allocate_window(total * es);
      if (!taken) flags[r] |= 2;
      std::vector<std::uint16_t> h16;
      const void* src = x[c][r].data();
      if (k.t == dtype::bf16) {
        for (float f : x[c][r]) h16.push_back(lockstep::detail::bf16_of_float(f));
        src = h16.data();
      }
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(win.get(), src, total * es, cudaMemcpyHostToDevice, cs));
      char* base = static_cast<char*>(win.get());
      void* out = base + r * k.per * es;
      lockstep::CudaMemory mem(ctx.device(), cs);
      auto separate = k.in_place ? nullptr : mem.allocate(k.per * es);
      if (!k.in_place) out = separate.get();
      engine.reduce_scatter(win.get(), out, k.per, k.t, k.op).wait();
      std::vector<float> back(k.per);
      if (k.t == dtype::bf16) {
        std::vector<std::uint16_t> b16(k.per);
        LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(b16.data(), out, k.per * 2, cudaMemcpyDeviceToHost, cs));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
        for (std::size_t i = 0; i < k.per; ++i) back[i] = lockstep::detail::float_of_bf16(b16[i]);
      } else {
        LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(back.data(), out, k.per * 4, cudaMemcpyDeviceToHost, cs));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
      }
      got[r].push_back(std::move(back));
    }
    staging[r] = engine.copy_engine_staging_bytes();  // the copy-engine path ran: it staged
    {  // plain device memory on the same group: NCCL's kernel, the fp32 mean
      lockstep::CudaMemory mem(ctx.device(), cs);
      auto buf = mem.allocate(plain_per * static_cast<std::size_t>(n) * 4);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(buf.get(), plain[r].data(), plain[r].size() * 4, cudaMemcpyHostToDevice, cs));
      float* mine = static_cast<float*>(buf.get()) + r * plain_per;
      engine.reduce_scatter(buf.get(), mine, plain_per, dtype::f32, reduce_op::avg).wait();
      got_plain[r].resize(plain_per);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(got_plain[r].data(), mine, plain_per * 4, cudaMemcpyDeviceToHost, cs));
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
      staging_after_plain[r] = engine.copy_engine_staging_bytes();
    }
    {  // the all-gather in place into a window
      auto [win, taken] = engine.allocate_window(gather_per * static_cast<std::size_t>(n) * 4);
      float* all = static_cast<float*>(win.get());
      LOCKSTEP_TRY_CUDA(
          cudaMemcpyAsync(all + r * gather_per, gathered[r].data(), gather_per * 4, cudaMemcpyHostToDevice, cs));
      engine.all_gather(all + r * gather_per, all, gather_per, dtype::f32).wait();
      got_gather[r].resize(gather_per * static_cast<std::size_t>(n));
      LOCKSTEP_TRY_CUDA(
          cudaMemcpyAsync(got_gather[r].data(), all, got_gather[r].size() * 4, cudaMemcpyDeviceToHost, cs));
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
  });
  // On 2 ranks NCCL's own reduce-scatter gives the same bits, so the staging tells the paths
  // apart: the copy-engine one staged the largest case (and grew through the smaller ones);
  // plain memory went to NCCL's kernel and staged nothing.
  std::size_t largest = 0;
  for (const auto& k : cases) largest = std::max(largest, k.per * static_cast<std::size_t>(n) * lockstep::size_of(k.t));
  for (int r = 0; r < n; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    CHECK_MESSAGE((flags[ru] & 1) == 1, "copy_engines() is true on the group, false on its parent");
    CHECK_MESSAGE((flags[ru] & 2) == 0, "NCCL returned no window");
    CHECK(staging[ru] >= largest);
    CHECK(staging_after_plain[ru] == staging[ru]);
  }
  for (std::size_t c = 0; c < cases.size(); ++c) {
    const rs_case& k = cases[c];
    CAPTURE(c);
    CAPTURE(k.per);
    const float scale = k.op == reduce_op::avg ? 1.0f / static_cast<float>(n) : 1.0f;
    std::size_t off = 0;
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < k.per; ++i) {
        const float want = want_at(x[c], static_cast<std::size_t>(r) * k.per + i, scale, k.t == dtype::bf16);
        const float g = got[static_cast<std::size_t>(r)][c][i];
        if (g != want && off++ < 3) MESSAGE("rank " << r << " element " << i << ": got " << g << ", want " << want);
      }
    CHECK(off == 0);
  }
  std::size_t off_plain = 0, off_gather = 0;
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < plain_per; ++i) {
      double s = 0;
      for (int q = 0; q < n; ++q) s += plain[static_cast<std::size_t>(q)][static_cast<std::size_t>(r) * plain_per + i];
      const double want = s / n;
      if (std::abs(got_plain[static_cast<std::size_t>(r)][i] - want) > 1e-6 * std::max(1.0, std::abs(want)))
        ++off_plain;
    }
    for (int q = 0; q < n; ++q)
      if (std::memcmp(got_gather[static_cast<std::size_t>(r)].data() + static_cast<std::size_t>(q) * gather_per,
                      gathered[static_cast<std::size_t>(q)].data(), gather_per * 4) != 0)
        ++off_gather;
  }
  CHECK(off_plain == 0);
  CHECK(off_gather == 0);
}

// A model of two parameters for DataParallel's option check.
struct two_params {
  float* v = nullptr;
  float* g = nullptr;
  two_params() {
    LOCKSTEP_TRY_CUDA(cudaMalloc(&v, 2 * 1024 * sizeof(float)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&g, 2 * 1024 * sizeof(float)));
  }
  ~two_params() {
    cudaFree(v);
    cudaFree(g);
  }
  std::vector<lockstep::parameter> parameters() {
    return {lockstep::param<float>("a", v, g, {1024}), lockstep::param<float>("b", v + 1024, g + 1024, {1024})};
  }
};

}  // namespace

TEST_SUITE("multigpu") {
TEST_CASE("NcclComm copy-engine group on 2 GPUs: reduce-scatter of a window == fp32 sum in rank order - bf16 - staging "
          "grows - plain memory - all-gather") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_group(2);
}
TEST_CASE("NcclComm copy-engine group on 4 GPUs: reduce-scatter of a window == fp32 sum in rank order - bf16 - staging "
          "grows - plain memory - all-gather") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_group(4);
}
TEST_CASE("sharded: copy-engine options that differ across GPUs fail on every rank with a mismatch_error") {
  LOCKSTEP_REQUIRE_GPUS(2);
  for (int which = 0; which < 2; ++which) {
    CAPTURE(which);
    std::vector<std::string> errors(2);
    lockstep::run(lockstep::Gpus{first_gpus(2)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
      two_params m;
      const bool on = ctx.rank() == 1;
      lockstep::ShardedOptimizer o;
      (which == 0 ? o.copy_engine_gather : o.copy_engine_scatter) = on;
      try {
        lockstep::DataParallel<two_params, lockstep::NcclComm, lockstep::ShardedOptimizer> dp(ctx, m, o);
      } catch (const lockstep::mismatch_error& e) {
        errors[static_cast<std::size_t>(ctx.rank())] = e.what();
      }
    });
    const std::string option = which == 0 ? "copy_engine_gather" : "copy_engine_scatter";
    for (const auto& e : errors) CHECK_MESSAGE(e.find(option) != std::string::npos, "got: '" << e << "'");
  }
}
}
#endif
