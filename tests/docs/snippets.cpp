// The code blocks of the docs and of the headers' comments, verbatim between snippet markers
// (tests/docs/check_snippets.py compares them with their sources), compiled and run on CPU
// ranks. What a block presumes (`Mlp`, `optimizer`, `my_batches`, `train`...) is defined
// around it; the checks after a block test what it claims.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/checkpoint/training_state.hpp>
#include <lockstep/launch/job_store.hpp>
#include <lockstep/launch/launch_env.hpp>
#include <lockstep/lockstep.hpp>
#include <lockstep/parallel/join.hpp>

#include "lion_rule.hpp"
#include "snippet_env.hpp"

namespace fs = std::filesystem;

namespace {

//! A fresh directory, made the working directory for the test's lifetime.
struct scratch_dir {
  fs::path dir, before = fs::current_path();
  scratch_dir() {
    dir = fs::temp_directory_path() / ("lockstep_snippets_" + std::to_string(lockstep_test::fresh_seed()));
    fs::create_directories(dir);
    fs::current_path(dir);
  }
  ~scratch_dir() {
    fs::current_path(before);
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

}  // namespace

// [snippet include/lockstep/core/concepts.hpp#1]
struct Linear {
  std::vector<float> w, gw;
  std::vector<lockstep::parameter> parameters() { return {lockstep::param<float>("w", std::span(w), std::span(gw))}; }
};
// [end snippet]
static_assert(lockstep::model<Linear>);

// [snippet include/lockstep/core/codec.hpp#1]
struct MyOptimizerState {
  double lr;
  std::vector<float> momentum;
  void save(lockstep::byte_writer& w) const {
    w.write(lr);
    w.write_array(momentum);
  }
  void load(lockstep::byte_reader& r) {
    r.read(lr);
    momentum = r.read_array<float>();
  }
};
// [end snippet]
static_assert(lockstep::serializable<MyOptimizerState>);

// [snippet include/lockstep/parallel/step.hpp#1]
void backward(Mlp& model, const Batch& batch, double loss_scale, lockstep::gradient_ready_fn ready);
// [end snippet]
void backward(Mlp& model, const Batch& batch, double loss_scale, lockstep::gradient_ready_fn ready) {
  model.backward(batch, ready, loss_scale);
}

template <class Scaler, class Comm>
bool finish_step(Scaler& scaler, Comm& comm, const std::vector<lockstep::grad_group>& groups) {
  using lockstep::grad_group;
  // [snippet include/lockstep/scaling/loss_scaler.hpp#1]
  bool found_inf = scaler.unscale_and_check(comm, std::span<const grad_group>(groups));
  scaler.update(found_inf);
  return !found_inf;  // false: skip the optimizer step
  // [end snippet]
}

TEST_SUITE("cpu") {

TEST_CASE("snippets: DataParallel's loop (data_parallel.hpp) + a non-template backward (step.hpp)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const auto my_batches = snippet_env::batches(3);
  const PlainSgd optimizer;
  // [snippet include/lockstep/parallel/data_parallel.hpp#1]
  lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {
    Mlp model(seed);                        // same shapes on every rank
    lockstep::DataParallel dp(ctx, model);  // rank 0's values everywhere
    for (auto& batch : my_batches) {
      auto step = dp.step();
      model.backward(batch, step.on_gradient_ready());  // optional: overlap
      if (step.finish()) optimizer.update(model);       // averaged over all ranks
    }
  });
  // [end snippet]
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    Mlp model(seed + static_cast<std::uint64_t>(ctx.rank()));  // rank 0's values win
    lockstep::DataParallel dp(ctx, model, lockstep::DynamicScale());
    const auto mine = snippet_env::batches(2 + static_cast<std::size_t>(ctx.rank()) % 1);
    for (const auto& b : mine) {
      auto step = dp.step();
      backward(model, Batch(b), step.loss_scale(), step.on_gradient_ready());
      if (step.finish()) optimizer.update(model);
    }
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
}

TEST_CASE("snippets: Join with uneven batches (join.hpp + docs/join.md)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const PlainSgd optimizer;
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    Mlp model(seed);
    lockstep::DataParallel dp(ctx, model);
    const auto my_batches = snippet_env::batches(static_cast<std::size_t>(ctx.rank()) * 2);  // 0, 2, 4
    // [snippet include/lockstep/parallel/join.hpp#1]
    auto update = [&](lockstep::step_result r) {
      if (r) optimizer.update(model);
    };
    {
      auto join = dp.join(update);      // every rank enters, between steps
      for (auto& batch : my_batches) {  // any number, 0 included
        auto step = dp.step();          // syncing steps agree who contributes
        model.backward(batch, step.on_gradient_ready());
        update(step.finish());
      }
    }  // leaving: while other ranks still step, take part in their averages with zero
       // gradients and call update(result) for each; then every rank leaves together
    // [end snippet]
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Mlp model(seed);
    lockstep::DataParallel dp(ctx, model);
    const auto my_batches = snippet_env::batches(ctx.rank() == 0 ? 1 : 3);
    // [snippet docs/join.md#1]

    auto update = [&](lockstep::step_result r) {
      if (r) optimizer.update(model);
    };
    {
      auto join = dp.join(update);      // every rank enters, between steps
      for (auto& batch : my_batches) {  // any count per rank, 0 included
        auto step = dp.step();
        model.backward(batch, step.on_gradient_ready());
        update(step.finish());
      }
      join.leave();  // optional (the destructor leaves too); returns the steps shadowed
    }
    // [end snippet]
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
}

TEST_CASE("snippets: sampler + seeds + learning-rate helpers (data/ + docs/sampler.md)") {
  const auto& train = snippet_env::table();
  const std::uint64_t epochs = 2;
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    std::size_t seen = 0;
    auto train_step = [&](std::span<const std::size_t> batch) { seen += batch.size(); };
    // [snippet include/lockstep/data/sampler.hpp#1]
    lockstep::DistributedSampler sampler(train.size(), ctx, {.seed = 42});
    for (std::uint64_t epoch = 0; epoch < epochs; ++epoch) {
      sampler.set_epoch(epoch);
      for (auto batch : sampler.batches(64)) {
        train_step(batch);
        sampler.advance(batch.size());
      }
    }
    // [end snippet]
    CHECK(seen == epochs * sampler.size());

    // docs/sampler.md: resume from a state saved mid-epoch, then finish the run.
    lockstep::DistributedSampler first(train.size(), ctx, {.seed = 42});
    first.set_epoch(1);
    first.advance(64);
    const bool resuming = true;
    const lockstep::sampler_state saved = first.state();
    std::vector<std::size_t> order;
    auto step = [&](std::span<const std::size_t> batch) { order.insert(order.end(), batch.begin(), batch.end()); };
    {
      // [snippet docs/sampler.md#1]
      lockstep::DistributedSampler sampler(train.size(), ctx, {.seed = 42});  // <Shuffle, Pad>
      if (resuming) sampler.load_state(saved);  // seed, epoch, position (a used-up epoch: the next)
      for (; sampler.epoch() < epochs; sampler.set_epoch(sampler.epoch() + 1)) {  // set_epoch: position 0
        for (auto batch : sampler.batches(64)) {
          step(batch);
          sampler.advance(batch.size());
        }
        // a checkpoint here or mid-epoch: saved = sampler.state() (or add_training_state(ck, dp, sampler))
      }
      // [end snippet]
    }
    const auto all = first.indices();  // epoch 1's list; the resumed run saw its tail
    CHECK(std::vector<std::size_t>(all.begin() + 64, all.end()) == order);

    {
      const int step = 700;
      lockstep::Sgd optimizer({.lr = 0.1});
      // [snippet include/lockstep/data/lr_schedule.hpp#1]
      const auto eb = lockstep::effective_batch(64, ctx.size(), 4);  // 64 · N · 4
      const lockstep::LinearWarmup sched{.peak_lr = lockstep::scaled_lr(0.1, 256, eb),
                                         .warmup_steps = 500,
                                         .decay = lockstep::Decay::cosine,
                                         .total_steps = 20000};
      optimizer.set_lr(sched(step));  // step from 0
      // [end snippet]
      CHECK(eb == 64u * 3u * 4u);
      CHECK(optimizer.options().lr == doctest::Approx(sched(step)));
      CHECK(optimizer.options().lr > 0.0);
      CHECK(optimizer.options().lr <= 0.1 * 768.0 / 256.0);
    }

    const std::uint64_t epoch = 3;
    // [snippet include/lockstep/data/seeding.hpp#1]
    std::mt19937_64 init(lockstep::model_seed(42));                         // same on all ranks
    std::mt19937_64 aug(lockstep::rank_epoch_seed(42, ctx.rank(), epoch));  // differs per rank
    // [end snippet]
    std::vector<float> draws{static_cast<float>(init() >> 40), static_cast<float>(aug() >> 40)};
    std::vector<float> root = draws;
    lockstep::detail::host_broadcast(ctx.comm(), root, 0);
    CHECK(root[0] == draws[0]);
    if (ctx.rank() != 0) CHECK(root[1] != draws[1]);
  });
}

// docs/elastic.md: rank 2 of 3 dies after its third backward; ranks 0 and 1 go on, redo that
// step over the two of them, and end the epochs with the same parameters.
TEST_CASE("snippets: a job that goes on when a rank dies (docs/elastic.md)") {
  const auto& train = snippet_env::table();
  const std::uint64_t epochs = 2;
  const PlainSgd optimizer;
  std::vector<std::vector<float>> values(3);
  std::vector<std::size_t> changes(3), survivors(3);
  std::vector<int> same(3, 0);
  try {
    // [snippet docs/elastic.md#1]
    lockstep::HashStore store(3);  // ranks as threads: one store in the process
    lockstep::run(lockstep::Threads{3}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
      Mlp model(7);
      lockstep::ElasticGroup group(ctx, store, {.min_ranks = 2});
      using DP = lockstep::DataParallel<Mlp, lockstep::ThreadComm>;
      std::optional<DP> dp(std::in_place, group.comm(), model);
      lockstep::DistributedSampler sampler(train.size(), group, {.seed = 42});
      group.on_change([&](const lockstep::membership_change&) {  // before, after, gone
        dp.reset();                                              // the model gets its gradients back
        dp.emplace(group.comm(), model);                         // over the survivors
        sampler.repartition(group.rank(), group.size());         // the rest of the epoch
      });
      while (sampler.epoch() < epochs) {
        const auto batches = sampler.batches(16);
        if (batches.empty()) {
          sampler.set_epoch(sampler.epoch() + 1);
          continue;
        }
        const auto batch = batches.front();
        const auto changed = group.attempt([&] {
          auto step = dp->step();
          model.backward(batch, step.on_gradient_ready());
          // [end snippet]
          static thread_local int backwards = 0;
          if (ctx.rank() == 2 && ++backwards == 3) throw std::runtime_error("rank 2 lost its GPU");
          // [snippet docs/elastic.md#1]
          if (step.finish()) {
            group.commit();  // on GPUs: the step's collectives completed; with restarts: a joiner?
            optimizer.update(model);
          }
        });
        if (changed) continue;  // ranks died: the survivors redo this step
        sampler.advance(batch.size());
      }
      // [end snippet]
      const auto r = static_cast<std::size_t>(ctx.rank());
      values[r] = values_of(model);
      changes[r] = group.changes().size();
      survivors[r] = static_cast<std::size_t>(group.size());
      same[r] = same_on_every_rank(group.comm(), values[r]) ? 1 : 0;
      // [snippet docs/elastic.md#1]
    });
    // [end snippet]
    FAIL("rank 2 did not die");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "rank 2 lost its GPU");
  }
  for (std::size_t r : {0u, 1u}) {
    CAPTURE(r);
    CHECK(changes[r] == 1);
    CHECK(survivors[r] == 2);
    CHECK(same[r] == 1);
  }
  CHECK(values[0] == values[1]);
  CHECK(values[0] != values_of(*std::make_unique<Mlp>(7)));
}

namespace {

//! What each rank of the two sharded elastic snippets (docs/elastic.md #2, #3) trains with.
struct sharded_job {
  using DP = lockstep::DataParallel<Mlp, lockstep::ThreadComm, lockstep::ShardedOptimizer>;
  Mlp model{7};
  lockstep::ElasticGroup<lockstep::ThreadComm, lockstep::HashStore> group;
  std::optional<DP> dp;
  lockstep::Sgd opt{{.lr = 0.1, .momentum = 0.9}};
  lockstep::DistributedSampler<> sampler;
  std::int64_t step = 0;
  // [snippet docs/elastic.md#3]
  lockstep::PeerCopy copies;  // a snapshot after every step
  // [end snippet]
  sharded_job(lockstep::context<lockstep::ThreadComm>& ctx, lockstep::HashStore& store, std::size_t samples)
      : group(ctx, store, {.min_ranks = 2}), dp(std::in_place, group.comm(), model, lockstep::ShardedOptimizer{}),
        sampler(samples, group, {.seed = 42}) {}
};

//! One step of it, the optimizer stepping this rank's shards inside finish().
void sharded_step(sharded_job& job, std::span<const std::size_t> batch) {
  auto st = job.dp->step();
  job.model.backward(batch, st.on_gradient_ready());
  (void)st.finish([&](std::span<const lockstep::param_slice> s) { job.opt.step(s); });
}

//! Three ranks of a ShardedOptimizer job on the snippet table; rank 2 dies before step 5.
//! `install(job)` sets the job's on_change, `train(job, batch)` runs one step (through
//! group.attempt) and returns whether the membership changed. Ranks 0 and 1 must go back to
//! step `back_to` once and end at step 8 with the same, trained, parameters.
template <class Install, class Train>
void three_ranks_lose_one(std::int64_t back_to, Install install, Train train) {
  const auto& table = snippet_env::table();
  std::vector<std::vector<float>> values(3);
  std::vector<std::vector<std::int64_t>> back(3);
  std::vector<int> same(3, 0);
  try {
    lockstep::HashStore store(3);
    lockstep::run(lockstep::Threads{3}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
      sharded_job job(ctx, store, table.size());
      install(job);
      while (job.step < 8) {
        const auto batches = job.sampler.batches(8);
        if (batches.empty()) {
          job.sampler.set_epoch(job.sampler.epoch() + 1);
          continue;
        }
        if (ctx.rank() == 2 && job.step == 5) throw std::runtime_error("rank 2 lost its GPU");
        if (train(job, batches.front())) back[static_cast<std::size_t>(ctx.rank())].push_back(job.step);
      }
      const auto r = static_cast<std::size_t>(ctx.rank());
      values[r] = values_of(job.model);
      same[r] = same_on_every_rank(job.group.comm(), values[r]) ? 1 : 0;
    });
    FAIL("rank 2 did not die");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "rank 2 lost its GPU");
  }
  for (std::size_t r : {0u, 1u}) {
    CAPTURE(r);
    CHECK(back[r] == std::vector<std::int64_t>{back_to});
    CHECK(same[r] == 1);
  }
  CHECK(values[0] == values[1]);
  CHECK(values[0] != values_of(*std::make_unique<Mlp>(7)));
}

}  // namespace

// docs/elastic.md, ShardedOptimizer: 3 ranks checkpoint after step 3; rank 2 dies at step 5;
// ranks 0 and 1 go back to step 3, resharded over the two of them, and end the run alike.
TEST_CASE("snippets: a sharded job goes back to its last checkpoint when a rank dies (docs/elastic.md)") {
  const fs::path last_checkpoint =
      fs::temp_directory_path() / ("lockstep-snippet-rollback-" + std::to_string(lockstep_test::fresh_seed()));
  three_ranks_lose_one(
      3,
      [&](sharded_job& job) {
        auto& [model, group, dp, opt, sampler, step, copies] = job;
        // [snippet docs/elastic.md#2]
        group.on_change([&](const lockstep::membership_change&) {
          dp.reset();
          dp.emplace(group.comm(), model, lockstep::ShardedOptimizer{});
          const auto ck = lockstep::load_checkpoint(last_checkpoint);
          lockstep::restore_training_state(ck, *dp, sampler);  // parameters, loss scale, layout, data position
          lockstep::load_sharded(*dp, opt, ck.blob("optimizer"));
          step = ck.meta.step;  // the steps since are redone
        });
        // [end snippet]
      },
      [&](sharded_job& job, std::span<const std::size_t> batch) {
        auto& [model, group, dp, opt, sampler, step, copies] = job;
        if (group.attempt([&] { sharded_step(job, batch); })) return true;
        sampler.advance(batch.size());
        if (++step == 3) {
          auto state = lockstep::gather_sharded(*dp, opt);
          lockstep::save_checkpoint_rank0(group.comm(), last_checkpoint, [&](lockstep::Checkpoint& ck) {
            ck.meta.step = step;
            lockstep::add_training_state(ck, *dp, sampler);
            ck.add_blob("optimizer", std::move(state));
          });
        }
        return false;
      });
  fs::remove(last_checkpoint);
}

// docs/elastic.md, PeerCopy: 3 ranks snapshot after every step; rank 2 dies before step 5; ranks
// 0 and 1 rebuild its optimizer shard from rank 1's copy, go on from step 5 and end the run alike.
TEST_CASE("snippets: a sharded job rebuilds a lost shard from its copy on the rank before (docs/elastic.md)") {
  three_ranks_lose_one(
      5,  // nothing lost: the step rank 2 died before is the one redone
      [&](sharded_job& job) {
        auto& [model, group, dp, opt, sampler, step, copies] = job;
        // [snippet docs/elastic.md#3]
        group.on_change([&](const lockstep::membership_change&) {
          dp.reset();
          dp.emplace(group.comm(), model, lockstep::ShardedOptimizer{});
          if (const auto at = copies.restore(group.members(), *dp, opt, sampler)) step = *at;
          else throw std::runtime_error("PeerCopy: " + copies.why());  // or go back to a checkpoint
        });
        // [end snippet]
      },
      [&](sharded_job& job, std::span<const std::size_t> batch) {
        auto& [model, group, dp, opt, sampler, step, copies] = job;
        // [snippet docs/elastic.md#3]
        const auto changed = group.attempt([&] {
          auto st = dp->step();
          model.backward(batch, st.on_gradient_ready());
          (void)st.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
          sampler.advance(batch.size());
          copies.save(++step, group.members(), *dp, opt, sampler);  // collective: inside attempt
        });
        // [end snippet]
        return changed.has_value();
      });
}

TEST_CASE("snippets: the codec's example (core/codec.hpp) round-trips") {
  std::mt19937_64 rng(lockstep_test::fresh_seed());
  MyOptimizerState a{0.25 + static_cast<double>(rng() % 1000) / 7.0, lockstep_test::random_vector<float>(37, rng)};
  const auto bytes = lockstep::to_bytes(a);
  MyOptimizerState b{};
  lockstep::from_bytes(b, std::span<const std::byte>(bytes));
  CHECK(b.lr == a.lr);
  CHECK(b.momentum == a.momentum);
}

TEST_CASE("snippets: a new optimizer rule (docs/optimizer.md's Lion) on the host") {
  std::mt19937_64 rng(lockstep_test::fresh_seed());
  const LionOptions o{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1};
  auto w32 = lockstep_test::random_vector<float>(1 + rng() % 300, rng);
  auto w64 = lockstep_test::random_vector<double>(1 + rng() % 300, rng);
  std::vector<float> g32(w32.size());
  std::vector<double> g64(w64.size());
  std::vector<lockstep::parameter> params{lockstep::param<float>("a", std::span(w32), std::span(g32)),
                                          lockstep::param<double>("b", std::span(w64), std::span(g64))};
  // The reference: the rule's formulas, written out in the parameter's own type.
  auto ref32 = w32;
  auto ref64 = w64;
  std::vector<float> m32(w32.size(), 0.0f);
  std::vector<double> m64(w64.size(), 0.0);
  auto reference = [&](auto& w, auto& m, const auto& g) {
    using A = std::remove_cvref_t<decltype(w[0])>;
    for (std::size_t i = 0; i < w.size(); ++i) {
      const A u = A(o.beta1) * m[i] + A(1 - o.beta1) * g[i];
      const A sign = u > A(0) ? A(1) : u < A(0) ? A(-1) : A(0);
      w[i] = w[i] - (A(o.lr) * sign + A(o.lr * o.weight_decay) * w[i]);
      m[i] = A(o.beta2) * m[i] + A(1 - o.beta2) * g[i];
    }
  };
  Lion opt(o);
  std::vector<std::byte> saved;
  Lion resumed({.lr = 1.0});
  for (int step = 0; step < 4; ++step) {
    for (auto& x : g32) x = static_cast<float>(std::uniform_real_distribution<double>(-1, 1)(rng));
    for (auto& x : g64) x = std::uniform_real_distribution<double>(-1, 1)(rng);
    if (step == 2) {
      saved = lockstep::to_bytes(opt);
      lockstep::from_bytes(resumed, std::span<const std::byte>(saved));
    }
    const auto before32 = w32;
    const auto before64 = w64;
    opt.step(params);
    reference(ref32, m32, g32);
    reference(ref64, m64, g64);
    CHECK(w32 == ref32);
    CHECK(w64 == ref64);
    if (step >= 2) {  // the resumed optimizer takes the same step from the same values
      auto again32 = before32;
      auto again64 = before64;
      std::vector<lockstep::parameter> ps{lockstep::param<float>("a", std::span(again32), std::span(g32)),
                                          lockstep::param<double>("b", std::span(again64), std::span(g64))};
      resumed.step(ps);
      CHECK(again32 == w32);
      CHECK(again64 == w64);
    }
  }
  CHECK(resumed.options().lr == o.lr);
  CHECK_THROWS_AS(Lion({.lr = 0.1, .beta1 = 1.0}), lockstep::config_error);
}

TEST_CASE("snippets: the loss scaler's contract (scaling/loss_scaler.hpp)") {
  using lockstep::grad_group;
  std::mt19937_64 rng(lockstep_test::fresh_seed());
  auto comms = lockstep::ThreadComm::create_group(1);
  lockstep::DynamicScale scaler({.init_scale = 1024.0});
  auto g = lockstep_test::random_vector<float>(33, rng, 1.0, 2.0);
  const std::vector<float> before = g;
  const lockstep::segment seg{g.data(), g.size()};
  std::vector<grad_group> groups{grad_group{lockstep::dtype::f32, std::span(&seg, 1)}};
  CHECK(finish_step(scaler, comms[0], groups));
  CHECK(g[5] == doctest::Approx(before[5] / 1024.0));
  g[17] = std::numeric_limits<float>::infinity();
  CHECK_FALSE(finish_step(scaler, comms[0], groups));
  CHECK(scaler.scale() < 1024.0);
}

TEST_CASE("snippets: checkpoints (checkpoint.hpp + training_state.hpp + docs/checkpoint.md)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  scratch_dir scratch;
  fs::create_directories("run");
  const fs::path dir = "run";
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    auto& comm = ctx.comm();
    Mlp model(seed);
    lockstep::Sgd optimizer({.lr = 0.1, .momentum = 0.9});
    optimizer.step(model.parameters());  // momentum state to save (the gradients are zero)
    lockstep::loss_scale_state scaler_state{.scale = 512.0, .good_steps = 3, .steps = 9};
    std::mt19937_64 rng(seed ^ 0x5eed);
    std::int64_t step = 11, epoch = 2, pos = 96;
    const auto values = values_of(model);
    const auto next_draw = std::mt19937_64(rng)();
    for (int file = 0; file < 2; ++file) {
      {
        if (file == 0) {
          // [snippet include/lockstep/checkpoint/checkpoint.hpp#1]
          // save: only rank 0 builds and writes; every rank returns once the file is in place
          lockstep::save_checkpoint_rank0(comm, "run/ckpt.lsck", [&](lockstep::Checkpoint& ck) {
            ck.meta = {.step = step, .epoch = epoch, .sample_position = pos};
            ck.add_parameters(model.parameters(), comm.memory());
            ck.add("optimizer", optimizer);            // lockstep::serializable
            ck.add_value("loss_scale", scaler_state);  // trivially copyable struct
            ck.add_streamed("rng", rng);               // anything with << and >>
          });
          // [end snippet]
        } else {
          // [snippet docs/checkpoint.md#1]
          // Save (collective): rank 0 builds and writes, every rank returns once the file is in place.
          lockstep::save_checkpoint_rank0(comm, dir / "last.lsck", [&](lockstep::Checkpoint& ck) {
            ck.meta = {.step = step, .epoch = epoch, .sample_position = pos};
            ck.add_parameters(model.parameters(), comm.memory());  // values may live on the device
            ck.add("optimizer", optimizer);                        // lockstep::serializable
            ck.add_value("loss_scale", scaler_state);              // trivially copyable struct
            ck.add_streamed("rng", rng);                           // std::mt19937_64 etc. (<< and >>)
          });
          // [end snippet]
        }
      }
      // Scramble what the file holds, then resume.
      Mlp other(seed + 1);
      const auto mine = model.parameters(), theirs = other.parameters();
      for (std::size_t i = 0; i < mine.size(); ++i)
        std::copy_n(static_cast<const std::byte*>(theirs[i].value), mine[i].bytes(),
                    static_cast<std::byte*>(mine[i].value));
      lockstep::Sgd fresh({.lr = 0.1, .momentum = 0.9});
      optimizer = fresh;
      scaler_state = {};
      rng.seed(1);
      step = epoch = pos = 0;
      if (file == 0) {
        // [snippet include/lockstep/checkpoint/checkpoint.hpp#1]
        // resume: every rank reads and verifies the file, then restores
        auto ck = lockstep::load_checkpoint("run/ckpt.lsck");
        lockstep::restore_parameters(ck, model.parameters(), comm.memory());
        ck.restore("optimizer", optimizer);
        ck.restore_value("loss_scale", scaler_state);
        ck.restore_streamed("rng", rng);
        // [end snippet]
        step = ck.meta.step;
        epoch = ck.meta.epoch;
        pos = ck.meta.sample_position;
      } else {
        // [snippet docs/checkpoint.md#1]
        // Resume (every rank reads the same file).
        auto ck = lockstep::load_checkpoint(dir / "last.lsck");  // throws checkpoint_error unless intact
        lockstep::restore_parameters(ck, model.parameters(), comm.memory());
        ck.restore("optimizer", optimizer);
        ck.restore_value("loss_scale", scaler_state);
        ck.restore_streamed("rng", rng);
        step = ck.meta.step;
        epoch = ck.meta.epoch;
        pos = ck.meta.sample_position;
        // [end snippet]
      }
      CHECK(values_of(model) == values);
      CHECK(optimizer.step_count(0) == 1);
      CHECK(scaler_state.scale == 512.0);
      CHECK(scaler_state.good_steps == 3);
      CHECK(rng() == next_draw);
      CHECK(step == 11);
      CHECK(epoch == 2);
      CHECK(pos == 96);
      rng.seed(seed ^ 0x5eed);
    }

    // The one-call form with a DataParallel and its sampler.
    const fs::path path = dir / "state.lsck";
    lockstep::DataParallel dp(ctx, model, lockstep::DynamicScale());
    lockstep::DistributedSampler sampler(snippet_env::table().size(), ctx, {.seed = 7});
    lockstep::Sgd opt({.lr = 0.05});
    sampler.set_epoch(1);
    sampler.advance(16);
    const auto want = sampler.state();
    // [snippet include/lockstep/checkpoint/training_state.hpp#1]
    lockstep::save_checkpoint_rank0(ctx.comm(), path, [&](lockstep::Checkpoint& ck) {
      lockstep::add_training_state(ck, dp, sampler);  // parameters, scale, layout, data position
      ck.add("optimizer", opt);
    });
    // [end snippet]
    sampler.set_epoch(0);
    {
      // [snippet docs/checkpoint.md#2]
      lockstep::save_checkpoint_rank0(ctx.comm(), path, [&](lockstep::Checkpoint& ck) {
        lockstep::add_training_state(ck, dp, sampler);  // parameters, scale, layout, data position
        ck.add("optimizer", opt);
      });
      // resume, on every rank, before the first step:
      auto ck = lockstep::load_checkpoint(path);
      lockstep::restore_training_state(ck, dp, sampler);
      ck.restore("optimizer", opt);
      // [end snippet]
    }
    CHECK(sampler.epoch() == 0);
    sampler.load_state(want);
    lockstep::save_checkpoint_rank0(ctx.comm(), path, [&](lockstep::Checkpoint& ck) {
      lockstep::add_training_state(ck, dp, sampler);
      ck.add("optimizer", opt);
    });
    sampler.set_epoch(0);
    {
      // [snippet include/lockstep/checkpoint/training_state.hpp#1]
      // resume, on every rank, before the first step:
      auto ck = lockstep::load_checkpoint(path);
      lockstep::restore_training_state(ck, dp, sampler);
      ck.restore("optimizer", opt);
      // [end snippet]
    }
    CHECK(sampler.state() == want);
  });
}

TEST_CASE("snippets: stores and the watchdog (store.hpp + watchdog.hpp + docs/launch_and_store.md)") {
  std::mt19937_64 rng(lockstep_test::fresh_seed());
  const auto id_bytes = lockstep_test::random_vector<float>(8, rng);  // as bytes below
  const auto id_span = std::as_bytes(std::span(id_bytes));
  lockstep::launch_info info{.rank = 0,
                             .world = 1,
                             .master_addr = "127.0.0.1",
                             .master_port = 0,
                             .launcher = "explicit",
                             .job_token = "snippets"};
  {
    const auto& id_bytes = id_span;
    // [snippet include/lockstep/store/store.hpp#1]
    lockstep::TcpStore st(info.master_addr, info.master_port, info.rank == 0, info.world, info.job_token);
    if (info.rank == 0) st.set("nccl_id", id_bytes);
    auto id = st.get("nccl_id");     // waits for rank 0, bounded by LOCKSTEP_TIMEOUT
    lockstep::barrier(st, "ready");  // everyone got it
    // [end snippet]
    CHECK(std::ranges::equal(id, id_bytes));

    info.master_port = st.port();
    auto comms = lockstep::ThreadComm::create_group(1);
    auto& comm = comms[0];
    bool trained = false;
    auto train = [&](lockstep::ThreadComm&) { trained = true; };
    // [snippet include/lockstep/launch/watchdog.hpp#1]
    lockstep::Watchdog dog(info.master_addr, info.master_port, info.rank, info.world, info.job_token,
                           [&](const std::string& why) { comm.abort(why); });
    train(comm);  // ... a watched job
    dog.stop();   // a clean leave: before the job's last barrier
    // [end snippet]
    CHECK(trained);
  }
  {
    const auto& id_bytes = id_span;
    // Not started by a launcher here (ctest): the block does nothing unless one is seen.
    // [snippet docs/launch_and_store.md#1]

    auto info = lockstep::detect_launcher();  // std::nullopt: not started by a launcher
    if (info) {
      auto store = lockstep::job_store(*info);  // a TcpStore; rank 0 hosts at MASTER_ADDR:MASTER_PORT
      if (info->rank == 0) store.set("nccl_id", id_bytes);
      auto id = store.get("nccl_id");  // waits, at most LOCKSTEP_TIMEOUT (60 s)
      lockstep::barrier(store, "ready");
    }
    // [end snippet]
    CHECK_FALSE(info.has_value());
  }
}

TEST_CASE("snippets: gather_in_forward and Bf16Wire (docs/sharding.md)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const auto my_batches = snippet_env::batches(3);
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    Mlp model(seed + static_cast<std::uint64_t>(ctx.rank()));
    // [snippet docs/sharding.md#3]
    lockstep::DataParallel dp(ctx, model, lockstep::ShardedOptimizer{.gather_in_forward = true});
    lockstep::Sgd opt({.lr = 0.1});
    for (auto& batch : my_batches) {
      auto step = dp.step();
      dp.wait_parameters(0);  // before the forward reads parameter 0 (in a real model: layer by layer)
      model.backward(Batch(batch), step.on_gradient_ready());
      step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
    }
    dp.wait_all_parameters();  // before reading the weights outside a forward
    // [end snippet]
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Mlp model(seed);
    // [snippet docs/sharding.md#4]
    lockstep::DataParallel dp(ctx, model, lockstep::Bf16Wire{}, lockstep::ShardedOptimizer{.gather_in_forward = true});
    // [end snippet]
    lockstep::Sgd opt({.lr = 0.1});
    auto step = dp.step();
    dp.wait_parameters(0);
    model.backward(Batch(my_batches[static_cast<std::size_t>(ctx.rank())]), step.on_gradient_ready());
    step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
    dp.wait_all_parameters();
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
}

TEST_CASE("snippets: wire error feedback and its checkpoint (docs/sharding.md + checkpoint/wire_feedback.hpp)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  scratch_dir scratch;
  const fs::path path = "feedback.lsck";
  const auto my_batches = snippet_env::batches(2);
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Mlp model(seed + static_cast<std::uint64_t>(ctx.rank()));
    // [snippet docs/sharding.md#5]
    lockstep::DataParallel dp(ctx, model, lockstep::Int8Wire({.error_feedback = true}), lockstep::ShardedOptimizer{});
    auto feedback = lockstep::gather_wire_feedback(dp);  // every rank, between steps; rank 0's to save
    // [end snippet]
    CHECK(feedback.empty() == (ctx.rank() != 0));
    lockstep::Sgd opt({.lr = 0.1});
    auto step = dp.step();
    model.backward(Batch(my_batches[static_cast<std::size_t>(ctx.rank())]), step.on_gradient_ready());
    step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
    dp.wait_all_parameters();
    {
      // [snippet include/lockstep/checkpoint/wire_feedback.hpp#1]
      auto feedback = lockstep::gather_wire_feedback(dp);  // collective: rank 0's is the section
      lockstep::save_checkpoint_rank0(dp.comm(), path, [&](lockstep::Checkpoint& ck) {
        lockstep::add_training_state(ck, dp);
        ck.add_blob("wire_feedback", std::move(feedback));
      });
      // resume, on every rank, before the first step (after restore_training_state):
      auto ck = lockstep::load_checkpoint(path);
      lockstep::restore_training_state(ck, dp);
      lockstep::load_wire_feedback(dp, ck.blob("wire_feedback"));
      // [end snippet]
      CHECK(ck.blob("wire_feedback").size() > 2 * values_of(model).size() * sizeof(float));  // both ranks' residuals
    }
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
}

// [snippet docs/sharding.md#6]
struct Linear {  // values and gradients reached through pointers it can repoint
  std::vector<float> w = std::vector<float>(6, 0.5f), gw = std::vector<float>(6);
  float* wp = w.data();
  float* gp = gw.data();
  std::vector<lockstep::parameter> parameters() { return {lockstep::param<float>("w", wp, gp, {2, 3})}; }
  void bind_gradient(std::size_t, void* p) { gp = static_cast<float*>(p); }
  void bind_value(std::size_t, void* p) {  // lockstep's storage: copy the values in, use it
    std::copy_n(wp, w.size(), static_cast<float*>(p));
    wp = static_cast<float*>(p);
  }
  void unbind_values() {  // before lockstep frees it: copy them back, use our own again
    std::copy_n(wp, w.size(), w.data());
    wp = w.data();
  }
};
// [end snippet]

TEST_CASE("snippets: a model lending its values to the shards' arena (docs/sharding.md)") {
  std::mt19937_64 rng(lockstep_test::fresh_seed());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::vector<float>> grads(2, std::vector<float>(6));
  for (auto& g : grads)
    for (auto& x : g) x = u(rng);
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Linear m;
    {
      lockstep::DataParallel dp(ctx, m, lockstep::ShardedOptimizer{});
      CHECK(dp.stats().values_bound);
      CHECK(m.wp != m.w.data());  // the weights live in lockstep's arena now
      lockstep::Sgd opt({.lr = 0.25});
      auto step = dp.step();
      std::copy(grads[ctx.rank()].begin(), grads[ctx.rank()].end(), m.gp);  // "backward"
      step.gradient_ready(0);
      step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
    }
    CHECK(m.wp == m.w.data());  // its own storage again, holding the update
    for (std::size_t i = 0; i < 6; ++i)
      CHECK(m.w[i] == doctest::Approx(0.5f - 0.25f * (grads[0][i] + grads[1][i]) / 2).epsilon(1e-6));
  });
}

TEST_CASE("snippets: ShardedOptimizer (checkpoint/sharded.hpp + docs/sharding.md)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const auto my_batches = snippet_env::batches(3);
  std::vector<std::vector<float>> after(4);
  // [snippet docs/sharding.md#1]
  lockstep::run(lockstep::Threads{4}, [&](auto& ctx) {
    Mlp model(seed);
    lockstep::DataParallel dp(ctx, model, {.max_grad_norm = 1.0}, lockstep::ShardedOptimizer{},
                              lockstep::DynamicScale());
    lockstep::AdamW opt({.lr = 1e-3});  // steps dp.shard_parameters(): 1/N of the model
    for (auto& batch : my_batches) {
      auto step = dp.step();
      model.backward(Batch(batch), step.on_gradient_ready(), step.loss_scale());
      const auto r = step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
      // every rank's model holds the updated parameters here (unless !r.applied: skipped)
      // [end snippet]
      CHECK(r.applied);
      CHECK(r.grad_norm > 0);
      CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
      // [snippet docs/sharding.md#1]
    }
    // [end snippet]
    after[static_cast<std::size_t>(ctx.rank())] = values_of(model);
    // [snippet docs/sharding.md#1]
  });
  // [end snippet]
  Mlp init(seed);
  CHECK(after[0] != values_of(init));  // it trained

  scratch_dir tmp;
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    Mlp model(seed + static_cast<std::uint64_t>(ctx.rank()));
    const Batch batch(my_batches[static_cast<std::size_t>(ctx.rank())]);
    lockstep::DataParallel dp(ctx, model, lockstep::ShardedOptimizer{});
    lockstep::AdamW opt({.lr = 1e-3});
    auto step = dp.step();
    model.backward(batch, step.on_gradient_ready());
    step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
    const std::string path = "sharded.ckpt";
    const auto before = values_of(model);
    // [snippet include/lockstep/checkpoint/sharded.hpp#1]
    auto opt_state = lockstep::gather_sharded(dp, opt);  // collective: every rank
    lockstep::save_checkpoint_rank0(dp.comm(), path, [&](lockstep::Checkpoint& ck) {
      lockstep::add_training_state(ck, dp);
      ck.add_blob("optimizer", std::move(opt_state));
    });
    // ... on resume, every rank:
    const auto saved = lockstep::load_checkpoint(path);
    lockstep::restore_training_state(saved, dp);
    lockstep::load_sharded(dp, opt, saved.blob("optimizer"));
    // [end snippet]
    CHECK(values_of(model) == before);
    CHECK(opt.slot_count() == dp.shard_parameters().size());
  });
}

TEST_CASE("snippets: ScalarLog (observe/scalars.hpp)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  scratch_dir tmp;
  const auto my_batches = snippet_env::batches(1);
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Mlp model(seed);
    lockstep::DataParallel dp(ctx, model, lockstep::DynamicScale());
    const std::int64_t step = 1;
    auto st = dp.step();
    const double loss = model.backward(Batch(my_batches[0]), st.on_gradient_ready(), st.loss_scale());
    const auto r = st.finish();
    {
      // [snippet include/lockstep/observe/scalars.hpp#1]
      lockstep::ScalarLog log(ctx.rank(), {.tensorboard = "runs/mlp", .csv = "runs/mlp.csv"});
      log.scalar("train/loss", step, loss);  // rank 0 writes; elsewhere a no-op
      log.training(step, dp, r);             // lockstep's own: loss scale, grad norm, ...
      // [end snippet]
    }
    ctx.comm().barrier();
    std::ifstream csv("runs/mlp.csv");
    std::string all((std::istreambuf_iterator<char>(csv)), std::istreambuf_iterator<char>());
    CHECK(all.find(",1,train/loss,") != std::string::npos);
    CHECK(all.find(",1,lockstep/loss_scale,65536") != std::string::npos);
  });
  int events = 0;
  for (const auto& e : fs::directory_iterator("runs/mlp")) events += e.is_regular_file() ? 1 : 0;
  CHECK(events == 1);
}

TEST_CASE("snippets: the learning-rate rule lockstep-run asks for (docs/lockstep_run.md)") {
  ::setenv("LOCKSTEP_LR_SCALING", "sqrt", 1);
  const std::size_t global_batch = 1024;
  // [snippet docs/lockstep_run.md#1]
  const double lr = lockstep::scaled_lr(0.1, 256, global_batch, lockstep::lr_scaling_from_env());
  // [end snippet]
  ::unsetenv("LOCKSTEP_LR_SCALING");
  CHECK(lr == doctest::Approx(0.2).epsilon(1e-15));  // √(1024 / 256) = 2
}

TEST_CASE("snippets: deterministic sums (parallel/deterministic.hpp)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  const auto my_batches = snippet_env::batches(2);
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Mlp model(seed + static_cast<std::uint64_t>(ctx.rank()));
    // [snippet include/lockstep/parallel/deterministic.hpp#1]
    lockstep::DataParallel dp(ctx, model, lockstep::Deterministic{});
    // [end snippet]
    auto step = dp.step();
    model.backward(Batch(my_batches[static_cast<std::size_t>(ctx.rank())]), step.on_gradient_ready());
    if (step.finish()) model.sgd(0.1);
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
    CHECK(dp.hook().report().steps == 1);
  });
}

// Trains Mlp(seed) with train(ctx, model) on each rank count of `worlds` (threads): it trains,
// and rank 0 ends with the same bits on every count.
template <class Train>
void check_same_bits_over_ranks(std::initializer_list<int> worlds, std::uint64_t seed, Train train) {
  std::vector<std::vector<float>> got;
  for (int ranks : worlds) {
    std::vector<float> mine;
    lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
      Mlp model(seed);
      train(ctx, model);
      if (ctx.rank() == 0) mine = values_of(model);
    });
    got.push_back(mine);
  }
  Mlp init(seed);
  CHECK(got[0] != values_of(init));  // it trained
  for (std::size_t i = 1; i < got.size(); ++i) CHECK(got[i] == got[0]);
}

TEST_CASE("snippets: the same bits whatever the number of ranks (docs/determinism.md)") {
  const auto micro = snippet_env::batches(4);
  check_same_bits_over_ranks({1, 2, 4}, lockstep_test::fresh_seed(), [&](auto& ctx, Mlp& model) {
    const int k = 4 / ctx.size();
    // [snippet docs/determinism.md#1]
    lockstep::DataParallel dp(ctx, model, lockstep::Deterministic{}, lockstep::Accumulate<>(k));
    for (int i = 0; i < k; ++i) {  // rank r takes micro-batches r, r + N, ...: N·k of them a step
      auto step = dp.step();
      model.backward(Batch(micro[static_cast<std::size_t>(i * ctx.size() + ctx.rank())]), step.on_gradient_ready());
      if (step.finish()) model.sgd(0.1);
    }
    // [end snippet]
  });
}

TEST_CASE("snippets: micro-batches by global position (docs/sampler.md)") {
  // An epoch of a 240-row table, global batches of 24 = 6 micro-batches of 4, over 1, 2 and 3
  // ranks: the same micro-batches, so with Deterministic the same bits.
  const std::size_t len = snippet_env::table().size(), global = 24, m = 4;
  check_same_bits_over_ranks({1, 2, 3}, lockstep_test::fresh_seed(), [&](auto& ctx, Mlp& model) {
    lockstep::DataParallel dp(ctx, model, lockstep::Deterministic{},
                              lockstep::Accumulate<>(static_cast<int>(global / m) / ctx.size()));
    const auto train_micro_step = [&](Batch micro) {
      auto step = dp.step();
      model.backward(micro, step.on_gradient_ready());
      if (step.finish()) model.sgd(0.1);
    };
    // [snippet docs/sampler.md#2]
    lockstep::DistributedSampler<> all(len, 0, 1, {.seed = 42});  // every rank: the whole list
    for (auto batch : all.batches(global, lockstep::LastBatch::drop_partial)) {
      for (auto micro : lockstep::micro_batches(batch, m, ctx.rank(), ctx.size())) train_micro_step(micro);
      all.advance(batch.size());
    }
    // [end snippet]
  });
}

TEST_CASE("snippets: gradients in int8 on the wire - a wire chosen at run time (parallel/gradient_wire.hpp)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  const auto my_batches = snippet_env::batches(2);
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Mlp model(seed + static_cast<std::uint64_t>(ctx.rank()));
    {
      // [snippet include/lockstep/parallel/gradient_wire.hpp#1]
      lockstep::DataParallel dp(ctx, model, lockstep::Int8Wire{});
      // [end snippet]
      auto step = dp.step();
      model.backward(Batch(my_batches[static_cast<std::size_t>(ctx.rank())]), step.on_gradient_ready());
      if (step.finish()) model.sgd(0.1);
    }
    {
      // [snippet include/lockstep/parallel/gradient_wire.hpp#2]
      lockstep::DataParallel dp(ctx, model, lockstep::Int8Wire({.error_feedback = true}));
      // [end snippet]
      for (int s = 0; s < 2; ++s) {  // (step 1's residuals go with its layout: the plan is rebuilt)
        auto step = dp.step();
        model.backward(Batch(my_batches[static_cast<std::size_t>(ctx.rank())]), step.on_gradient_ready());
        if (step.finish()) model.sgd(0.1);
      }
      CHECK(dp.hook().staging_bytes() > 0);  // step 2's residuals (host ranks stage nothing else)
    }
    const std::string flag = "bf16";  // a command line's --wire
    // [snippet include/lockstep/parallel/gradient_wire.hpp#3]
    lockstep::DataParallel dp(ctx, model, lockstep::AnyWire(lockstep::wire_format_of(flag)));
    // [end snippet]
    auto step = dp.step();
    model.backward(Batch(my_batches[static_cast<std::size_t>(ctx.rank())]), step.on_gradient_ready());
    if (step.finish()) model.sgd(0.1);
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
}

TEST_CASE("snippets: hierarchical reduction (parallel/bucket_hook.hpp)") {
  const std::uint64_t seed = lockstep_test::fresh_seed();
  const auto my_batches = snippet_env::batches(8);
  lockstep::run(lockstep::Threads{16}, [&](auto& ctx) {
    Mlp model(seed + static_cast<std::uint64_t>(ctx.rank()));
    // [snippet include/lockstep/parallel/bucket_hook.hpp#1]
    lockstep::DataParallel dp(ctx, model, lockstep::Hierarchical(ctx.comm(), {.ranks_per_node = 8}));
    // [end snippet]
    auto step = dp.step();
    model.backward(Batch(my_batches[static_cast<std::size_t>(ctx.rank()) % 8]), step.on_gradient_ready());
    if (step.finish()) model.sgd(0.1);
    CHECK(same_on_every_rank(ctx.comm(), values_of(model)));
  });
}

}  // TEST_SUITE
