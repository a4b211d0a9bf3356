// Checkpoints of a sharded run on GPUs (checkpoint/sharded.hpp): ShardedOptimizer over NcclComm
// with a fused optimizer whose state lives on the device. The state saved after step 3 of a
// 4-GPU run resumes on 4 GPUs bit for bit (fresh models, other initial values: everything comes
// from the checkpoint), and on 2 GPUs and 1 GPU — resharded, each rank cutting its new shards
// from the saved ones — where the run ends where the 4-GPU run ends up to the rounding of
// gradient sums split otherwise (the same global batch of 24 rows per step). Started afresh
// instead (no optimizer state), it ends elsewhere: the state was loaded, not zeros.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <lockstep/cuda.cuh>
#include <lockstep/lockstep.hpp>

#include "device_vector.cuh"
#include "gpu_mlp.cuh"
#include "gpu_test_util.cuh"
#include "mlp.hpp"
#include "test_util.hpp"

namespace {

using lockstep_test::device_vector;
using lockstep_test::GpuMlp;
using lockstep_test::max_rel_diff;
using lockstep_test::TestMlp;

constexpr int global_rows = 24, steps = 6, at = 3;
const std::vector<int> dims{29, 64, 48, 10};

struct data {
  std::vector<float> X;
  std::vector<int> y;
  std::size_t samples = 600;
};

data make_data(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  data d;
  d.X = lockstep_test::random_vector<float>(d.samples * static_cast<std::size_t>(dims[0]), rng, -2, 2);
  std::uniform_int_distribution<int> lab(0, dims.back() - 1);
  for (std::size_t i = 0; i < d.samples; ++i) d.y.push_back(lab(rng));
  return d;
}

std::vector<float> flat(const std::vector<std::vector<float>>& v) {
  std::vector<float> out;
  for (const auto& x : v) out.insert(out.end(), x.begin(), x.end());
  return out;
}

std::vector<std::vector<float>> initial_values(std::uint64_t seed) {
  TestMlp<float> m(dims, seed);
  return lockstep_test::split_params(m);
}

struct plan {
  int gpus = 4;
  int first_step = 0;
  bool save = false;  // after step at − 1, into `saved`
  enum { none, all, training_only } load = none;
  lockstep::BucketPolicy buckets{.first_bytes = 2000, .cap_bytes = 9000};  // tensors split over buckets
};

// Trains steps [p.first_step, steps) on p.gpus GPUs, sharded; returns every rank's final values.
template <class Opt, class Options>
std::vector<std::vector<float>> train(const data& d, const plan& p, std::uint64_t init_seed, const Options& o,
                                      lockstep::Checkpoint& saved) {
  std::vector<std::vector<float>> got(static_cast<std::size_t>(p.gpus));
  std::vector<int> devices;
  for (int i = 0; i < p.gpus; ++i) devices.push_back(i);
  const int batch = global_rows / p.gpus;
  lockstep::run(lockstep::Gpus{devices}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    cudaStream_t s = ctx.comm().compute_stream();
    GpuMlp m(dims, initial_values(init_seed), s);
    lockstep::DataParallel<GpuMlp, lockstep::NcclComm, lockstep::ShardedOptimizer> dp(ctx, m, {.buckets = p.buckets});
    Opt opt(o, dp.shard_parameters(), ctx.device());
    if (p.load != plan::none) {
      lockstep::restore_training_state(saved, dp);
      if (p.load == plan::all) lockstep::load_sharded(dp, opt, saved.blob("optimizer"));
    }
    const device_vector<float> X(d.X);
    const device_vector<int> y(d.y);
    device_vector<int> rows(std::vector<int>(static_cast<std::size_t>(batch)));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    for (int st = p.first_step; st < steps; ++st) {
      std::vector<int> r(static_cast<std::size_t>(batch));
      for (int i = 0; i < batch; ++i)
        r[static_cast<std::size_t>(i)] = static_cast<int>(
            (static_cast<std::size_t>(st) * global_rows + rank * static_cast<std::size_t>(batch) + i) % d.samples);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(rows.p, r.data(), r.size() * sizeof(int), cudaMemcpyHostToDevice, s));
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));  // r goes out of scope
      auto step = dp.step();
      auto hook = step.on_gradient_ready();
      m.forward_backward(X.p, y.p, rows.p, batch, hook);
      (void)step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, s, nullptr); });
      if (p.save && st == at - 1) {
        auto state = lockstep::gather_sharded(dp, opt);  // collective
        if (rank == 0) {
          lockstep::Checkpoint ck;
          lockstep::add_training_state(ck, dp);
          ck.add_blob("optimizer", std::move(state));
          saved = ck;
        }
        ctx.comm().barrier();  // `saved` is complete before any rank goes on
      }
    }
    got[rank] = m.flat_values();
  });
  return got;
}

template <class Opt, class Options>
void check_resume(const Options& o, bool across_world_sizes) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed);
  lockstep::Checkpoint saved;
  const auto whole = train<Opt>(d, {.gpus = 4, .save = true}, seed + 1, o, saved);
  for (std::size_t r = 1; r < whole.size(); ++r) CHECK(whole[r] == whole[0]);
  CHECK(max_rel_diff(flat(initial_values(seed + 1)), whole[0]) > 1e-3);  // it trained
  // Same world size and layout: bit for bit.
  const auto same = train<Opt>(d, {.gpus = 4, .first_step = at, .load = plan::all}, seed + 99, o, saved);
  for (const auto& v : same) CHECK(v == whole[0]);
  if (!across_world_sizes) return;
  const double tol = 2e-6;
  for (int g : {2, 1}) {
    CAPTURE(g);
    const auto other = train<Opt>(d, {.gpus = g, .first_step = at, .load = plan::all}, seed + 99, o, saved);
    for (const auto& v : other) {
      CHECK(v == other[0]);
      CHECK(max_rel_diff(v, whole[0]) <= tol);
    }
  }
  const auto fresh = train<Opt>(d, {.gpus = 2, .first_step = at, .load = plan::training_only}, seed + 99, o, saved);
  CHECK(max_rel_diff(fresh[0], whole[0]) > 100 * tol);
}

}  // namespace

TEST_SUITE("multigpu") {
TEST_CASE("sharded checkpoint on GPUs: saved on 4 resumes bit for bit on 4 - resharded onto 2 and 1 - FusedSgd and "
          "FusedAdamW") {
  LOCKSTEP_REQUIRE_GPUS(4);
  // SGD with momentum: linear in the gradients, so another split of the batch changes the run
  // only by rounding — the resharded resume is checked against the 4-GPU run.
  check_resume<lockstep::FusedSgd>(lockstep::SgdOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}, true);
  // AdamW: two moments per element, bit for bit on the same GPUs.
  check_resume<lockstep::FusedAdamW>(
      lockstep::AdamWOptions{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1}, false);
}
}
