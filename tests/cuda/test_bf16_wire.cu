// lockstep::Bf16Wire on NcclComm (cuda/bf16_wire.cuh): fp32 gradients go over NCCL in bf16 and
// are summed in fp32. Checked against a CPU reference computed here from the same random
// inputs: the mean of the ranks' bf16-rounded values, summed in fp32 in rank order (bit for
// bit), then rounded to bf16 (all-reduce) or kept in fp32 (reduce-scatter); a plain bf16 ring
// sum would miss it on most elements. Tails the rank count does not divide: the exact fp32 mean.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <lockstep/cuda.cuh>

#include "gpu_test_util.cuh"
#include "test_util.hpp"

namespace {

using lockstep::dtype;

float bf16_round(float f) { return lockstep::detail::float_of_bf16(lockstep::detail::bf16_of_float(f)); }

// What the wire computes for element i of ranks' inputs: Σ_r bf16(x_r[i]) in fp32, rank order, × 1/N.
float wire_mean(const std::vector<std::vector<float>>& x, std::size_t i) {
  float acc = 0;
  for (const auto& v : x) acc += bf16_round(v[i]);
  return acc * (1.0f / static_cast<float>(x.size()));
}
double exact_mean(const std::vector<std::vector<float>>& x, std::size_t i) {
  double s = 0;
  for (const auto& v : x) s += v[i];
  return s / static_cast<double>(x.size());
}

std::vector<int> first_gpus(int n) {
  std::vector<int> d(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) d[static_cast<std::size_t>(i)] = i;
  return d;
}

// The hook alone on n GPUs: all-reduce of `count` elements at `offset` floats into a buffer (an
// offset of 1 takes the unaligned kernels), and reduce-scatter of n·per.
void check_hook(int n, std::size_t count, std::size_t offset, std::size_t per) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  CAPTURE(count);
  CAPTURE(offset);
  CAPTURE(per);
  std::mt19937_64 rng(seed);
  const std::size_t total = per * static_cast<std::size_t>(n);
  std::vector<std::vector<float>> x(static_cast<std::size_t>(n)), y(x.size());
  for (int r = 0; r < n; ++r) {
    x[static_cast<std::size_t>(r)] = lockstep_test::random_vector<float>(count, rng, -3.0 * (r + 1), 2.0 * (r + 1));
    y[static_cast<std::size_t>(r)] = lockstep_test::random_vector<float>(total, rng, -1.0, 1.0);
  }
  std::vector<std::vector<float>> got(x.size()), got_rs(x.size());
  std::vector<std::size_t> staging(x.size());
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    auto& comm = ctx.comm();
    float* buf = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&buf, (count + offset + total) * sizeof(float)));
    float* d = buf + offset;
    float* e = buf + offset + count;
    LOCKSTEP_TRY_CUDA(cudaMemcpy(d, x[r].data(), count * sizeof(float), cudaMemcpyHostToDevice));
    if (total) LOCKSTEP_TRY_CUDA(cudaMemcpy(e, y[r].data(), total * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    lockstep::Bf16Wire wire;
    wire.reduce(comm, d, count, dtype::f32).wait();
    wire.reduce_scatter(comm, e, e + r * per, per, dtype::f32).wait();
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(comm.compute_stream()));
    got[r].resize(count);
    got_rs[r].resize(per);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(got[r].data(), d, count * sizeof(float), cudaMemcpyDeviceToHost));
    if (per) LOCKSTEP_TRY_CUDA(cudaMemcpy(got_rs[r].data(), e + r * per, per * sizeof(float), cudaMemcpyDeviceToHost));
    staging[r] = wire.staging_bytes();
    cudaFree(buf);
  });
  const std::size_t main = n > 1 ? count / static_cast<std::size_t>(n) * static_cast<std::size_t>(n) : 0;
  std::size_t off_bf16 = 0, off_tail = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const float want = i < main ? bf16_round(wire_mean(x, i)) : static_cast<float>(exact_mean(x, i));
    const float g = got[0][i];
    if (i < main ? g != want : std::abs(g - want) > 1e-6f * std::max(1.0f, std::abs(want))) {
      if (i < main && off_bf16++ < 3) MESSAGE("element " << i << ": got " << g << ", the wire's mean is " << want);
      if (i >= main && off_tail++ < 3) MESSAGE("tail element " << i << ": got " << g << ", the fp32 mean is " << want);
    }
  }
  CHECK(off_bf16 == 0);
  CHECK(off_tail == 0);
  for (int r = 1; r < n; ++r)
    CHECK(std::memcmp(got[static_cast<std::size_t>(r)].data(), got[0].data(), count * sizeof(float)) == 0);
  std::size_t off_rs = 0;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < per; ++i) {
      const std::size_t at = static_cast<std::size_t>(r) * per + i;
      const float want = n > 1 ? wire_mean(y, at) : y[0][at];
      if (got_rs[static_cast<std::size_t>(r)][i] != want && off_rs++ < 3)
        MESSAGE("reduce-scatter, rank " << r << " element " << i << ": got " << got_rs[static_cast<std::size_t>(r)][i]
                                        << ", want " << want);
    }
  CHECK(off_rs == 0);
  if (n > 1 && main > 0) CHECK(staging[0] >= 4 * main);  // two bf16 copies of the bucket's main part
}

// DataParallel with Bf16Wire over a model whose gradients the test writes (the same each of two
// steps) and whose values start at 0, stepped by FusedSgd with lr 1 in finish's per-bucket (or,
// sharded, per-shard) callback: after two steps each value is exactly −2 × the averaged gradient,
// read through the model's own value pointers (which never move). The average is the wire's mean
// (buckets' main parts; sharded: in fp32, unsharded: rounded to bf16) or the exact fp32 mean
// (bucket tails the rank count does not divide).
struct given_grads {
  std::vector<std::size_t> sizes;
  std::vector<float*> vals, grads;
  explicit given_grads(std::vector<std::size_t> s) : sizes(std::move(s)) {
    for (auto n : sizes) {
      float *v = nullptr, *g = nullptr;
      LOCKSTEP_TRY_CUDA(cudaMalloc(&v, n * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&g, n * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMemset(v, 0, n * sizeof(float)));
      vals.push_back(v);
      grads.push_back(g);
    }
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  }
  ~given_grads() {
    for (auto p : vals) cudaFree(p);
  }
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      ps.push_back(
          lockstep::param<float>("p" + std::to_string(i), vals[i], grads[i], {static_cast<std::int64_t>(sizes[i])}));
    return ps;
  }
  void bind_gradient(std::size_t i, void* p) { grads[i] = static_cast<float*>(p); }
};

// copy_engines (sharded): the reduce-scatters' all-to-alls and the all-gathers on the copy
// engines (ShardedOptimizer::copy_engine_scatter/_gather): the same numbers.
template <bool Sharded>
void check_data_parallel(int n, bool copy_engines = false) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  CAPTURE(Sharded);
  CAPTURE(copy_engines);
  std::mt19937_64 rng(seed);
  const std::vector<std::size_t> sizes{4096, 37, 1000, 5, 20000, 333};
  std::vector<std::vector<std::vector<float>>> x(sizes.size());  // [param][rank][element]
  for (std::size_t p = 0; p < sizes.size(); ++p)
    for (int r = 0; r < n; ++r) x[p].push_back(lockstep_test::random_vector<float>(sizes[p], rng, -2.0, 2.0));
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(n));  // [rank][param]
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    cudaStream_t cs = ctx.comm().compute_stream();
    given_grads m(sizes);
    using DP = std::conditional_t<
        Sharded,
        lockstep::DataParallel<given_grads, lockstep::NcclComm, lockstep::Bf16Wire, lockstep::ShardedOptimizer>,
        lockstep::DataParallel<given_grads, lockstep::NcclComm, lockstep::Bf16Wire>>;
    const lockstep::DataParallelOptions o{.buckets = {.first_bytes = 4000, .cap_bytes = 30000}};
    auto dp = [&] {
      if constexpr (Sharded)
        return DP(ctx, m, o,
                  lockstep::ShardedOptimizer{.copy_engine_gather = copy_engines, .copy_engine_scatter = copy_engines});
      else return DP(ctx, m, o);
    }();
    const auto& stepped = [&]() -> const std::vector<lockstep::parameter>& {
      if constexpr (Sharded) return dp.shard_parameters();
      else return dp.parameters();
    }();
    lockstep::FusedSgd opt({.lr = 1.0}, stepped, ctx.device());
    for (int step = 0; step < 2; ++step) {
      auto st = dp.step();
      for (std::size_t p = sizes.size(); p-- > 0;) {
        const auto params = dp.parameters();  // where the gradient lives now (the arena once bound)
        LOCKSTEP_TRY_CUDA(
            cudaMemcpyAsync(params[p].grad, x[p][r].data(), sizes[p] * sizeof(float), cudaMemcpyHostToDevice, cs));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
        st.gradient_ready(p);
      }
      (void)st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, cs, nullptr); });
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      got[r].emplace_back(sizes[p]);
      LOCKSTEP_TRY_CUDA(cudaMemcpy(got[r][p].data(), m.vals[p], sizes[p] * sizeof(float), cudaMemcpyDeviceToHost));
    }
  });
  std::size_t total = 0, wire_exact = 0;
  std::vector<std::string> problems;
  for (std::size_t p = 0; p < sizes.size(); ++p)
    for (std::size_t i = 0; i < sizes[p]; ++i) {
      ++total;
      // Each step's bucket layout differs (step 1 runs on the rebuilt plan), so an element may be
      // a tail in one step and go over the wire in the other: v = −(a + b), a and b each the
      // wire's mean or the fp32 mean.
      const float v = got[0][p][i];
      const float wire = Sharded ? wire_mean(x[p], i) : bf16_round(wire_mean(x[p], i));
      const float exact = static_cast<float>(exact_mean(x[p], i));
      const float g = -v / 2.0f;
      const auto near = [&](float want) { return std::abs(v - want) <= 2e-6f * std::max(1.0f, std::abs(want)); };
      if (v == -(wire + wire)) ++wire_exact;
      else if (!near(-(exact + exact)) && !near(-(wire + exact)) && problems.size() < 5)
        problems.push_back("p" + std::to_string(p) + "[" + std::to_string(i) + "] averaged to " + std::to_string(g) +
                           ": neither the wire's mean " + std::to_string(wire) + " nor the fp32 mean " +
                           std::to_string(exact));
    }
  for (const auto& pr : problems) MESSAGE(pr);
  CHECK(problems.empty());
  for (int r = 1; r < n; ++r)
    for (std::size_t p = 0; p < sizes.size(); ++p) CHECK(got[static_cast<std::size_t>(r)][p] == got[0][p]);
  // Almost everything went over the wire (only bucket tails the rank count does not divide not);
  // one GPU has no wire.
  if (n > 1) CHECK(wire_exact * 100 >= total * 95);
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("bf16 wire on 1 GPU: the hook is the identity - sharded and not") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_hook(1, 1003, 0, 77);
  check_data_parallel<false>(1);
}
}

TEST_SUITE("multigpu") {
TEST_CASE("bf16 wire on 2 GPUs: fp32 sum of bf16 values - tails - unaligned - DataParallel - sharded - copy engines") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_hook(2, 8 * 2 * 1234, 0, 8 * 300);
  check_hook(2, 8 * 2 * 1234 + 1, 1, 5);
  check_hook(2, 1, 0, 3);
  check_data_parallel<false>(2);
  check_data_parallel<true>(2);
  check_data_parallel<true>(2, true);
}
TEST_CASE("bf16 wire on 4 GPUs: fp32 sum of bf16 values - tails - DataParallel - sharded - copy engines") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_hook(4, 8 * 4 * 5000 + 3, 0, 8 * 1000);
  check_hook(4, 4 * 999, 1, 13);
  check_data_parallel<false>(4);
  check_data_parallel<true>(4);
  check_data_parallel<true>(4, true);
}
}
