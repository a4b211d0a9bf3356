// Resuming from a checkpoint reproduces the uninterrupted run bit for bit: parameters,
// momentum, loss-scale state, sampler epoch/position and the step counter all round-trip.
#include <doctest/doctest.h>

#include <filesystem>

#include <lockstep/lockstep.hpp>

#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;
namespace fs = std::filesystem;

namespace {

struct job {
  std::vector<int> dims{11, 16, 5};
  std::size_t samples = 203;  // not divisible by the ranks: padding in play
  int ranks = 3;
  std::size_t batch = 5;
  int epochs = 3;
  std::uint64_t seed = 0;
  std::vector<double> X;
  std::vector<int> y;
};

// Trains until `stop_at` steps (or the end of the last epoch), optionally resuming from
// `resume`, and saves a checkpoint to `save` after step `save_at` — mid-epoch when the step
// count says so. The loop is the resumable one: the sampler knows its epoch and position.
// Returns rank 0's parameters.
std::vector<double> train(const job& j, std::int64_t stop_at, const fs::path* resume, std::int64_t save_at,
                          const fs::path* save, std::vector<std::int64_t>* plan_out = nullptr) {
  std::vector<std::vector<double>> out(static_cast<std::size_t>(j.ranks));
  lockstep::run(lockstep::Threads{j.ranks}, [&](auto& ctx) {
    TestMlp<double> m(j.dims, j.seed);
    lockstep::DataParallel dp(ctx, m, {.buckets = {.first_bytes = 200, .cap_bytes = 400}},
                              lockstep::DynamicScale({.init_scale = 256.0, .growth_interval = 3}));
    lockstep::Sgd opt({.lr = 0.2, .momentum = 0.9, .weight_decay = 1e-3});
    lockstep::DistributedSampler<> sampler(j.samples, ctx, {.seed = j.seed});
    std::int64_t step_count = 0;
    if (resume) {  // one call for the model, the loss scale, the layout and the data position
      auto ck = lockstep::load_checkpoint(*resume);
      lockstep::restore_training_state(ck, dp, sampler);
      ck.restore("optimizer", opt);
      step_count = ck.meta.step;
    }
    const std::int64_t start_steps = step_count;
    for (; sampler.epoch() < static_cast<std::uint64_t>(j.epochs); sampler.set_epoch(sampler.epoch() + 1)) {
      for (auto batch : sampler.batches(j.batch)) {
        if (step_count == stop_at) break;
        auto step = dp.step();
        // A resumed run adopts the saved layout at its very first step.
        if (resume && step_count == start_steps) CHECK(dp.stats().rebuilt);
        std::vector<std::size_t> rows(batch.begin(), batch.end());
        m.forward_backward(j.X, j.y, rows, step.on_gradient_ready(), step.loss_scale());
        auto r = step.finish();
        opt.step(dp.parameters(), !r);
        sampler.advance(batch.size());
        ++step_count;
        if (save && step_count == save_at)
          lockstep::save_checkpoint_rank0(ctx.comm(), *save, [&](lockstep::Checkpoint& ck) {
            ck.meta.step = step_count;
            lockstep::add_training_state(ck, dp, sampler);
            ck.add("optimizer", opt);
          });
      }
      if (step_count == stop_at) break;
    }
    out[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
    if (plan_out && ctx.rank() == 0) *plan_out = dp.plan_state();
  });
  for (auto& o : out) CHECK(o == out[0]);
  return out[0];
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("resume from a checkpoint reproduces the uninterrupted run bit for bit") {
  job j;
  j.seed = fresh_seed();
  CAPTURE(j.seed);
  std::mt19937_64 rng(j.seed);
  j.X = random_vector<double>(j.samples * 11, rng, -1.5, 1.5);
  for (std::size_t i = 0; i < j.samples; ++i) j.y.push_back(static_cast<int>(rng() % 5));
  const fs::path dir = fs::temp_directory_path() / ("lockstep-resume-" + std::to_string(j.seed));
  fs::create_directories(dir);
  const fs::path ck = dir / "run.ckpt";

  // 203 samples over 3 ranks: 68 a rank, 14 batches of 5 (the last one of 3) an epoch.
  constexpr std::int64_t per_epoch = 14, never = -1;
  std::vector<std::int64_t> plan_a, plan_b;
  const auto uninterrupted = train(j, never, nullptr, never, nullptr, &plan_a);
  for (std::int64_t at : {per_epoch, per_epoch + 6}) {  // at an epoch's end, and mid-epoch
    CAPTURE(at);
    train(j, at, nullptr, at, &ck);  // "killed" right after its checkpoint
    const auto resumed = train(j, never, &ck, never, nullptr, &plan_b);
    CHECK(resumed == uninterrupted);  // bit for bit
    const auto saved = lockstep::load_checkpoint(ck);
    CHECK(saved.meta.step == at);
    CHECK(saved.meta.epoch == (at == per_epoch ? 0 : 1));
    CHECK(saved.meta.sample_position == (at == per_epoch ? 68 : 30));
  }
  // The resumed run reduced with the settled layout from its first step (TestMlp reports
  // weight before bias, unlike the initial guess, so the layout did change once).
  CHECK(plan_b == plan_a);
  CHECK(plan_a.size() == 4 + 4);
  CHECK(plan_a[1] == 1);
  TestMlp<double> init(j.dims, j.seed);
  CHECK(max_rel_diff(init.flat_values(), uninterrupted) > 1e-3);

  // A checkpoint of another model is refused and leaves the model untouched.
  CHECK_THROWS_AS(lockstep::run(lockstep::Threads{1},
                                [&](auto& ctx) {
                                  TestMlp<double> other({11, 17, 5}, 1);
                                  lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm> dp(ctx, other);
                                  auto before = other.flat_values();
                                  try {
                                    lockstep::restore_parameters(lockstep::load_checkpoint(ck), dp.parameters(),
                                                                 ctx.comm().memory());
                                  } catch (...) {
                                    CHECK(other.flat_values() == before);
                                    throw;
                                  }
                                }),
                  lockstep::checkpoint_error);
  fs::remove_all(dir);
}

}  // TEST_SUITE
