// Shrinking a job in place (issue 29), its first parts: the survivors of a failure agree on
// who goes on through the store — one decision on every survivor, with one or two ranks gone,
// a gone rank nobody named, a rank that reports too late, the coordinator gone, too few left,
// and changes one after another; on HashStore and on TcpStore (ranks as threads). Then a
// whole loop on CPU threads: ranks die at a phase of a step, the survivors agree, regroup
// their ThreadComm, rebuild DataParallel, re-partition the epoch's rest and redo the step, and
// end bit for bit where a run that switched rank counts at that step through a checkpoint ends;
// with accumulation, they keep the global batch by more micro-steps each and redo the cycle.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "lockstep/launch/elastic_join.hpp"
#include "lockstep/launch/elastic_link.hpp"
#include "lockstep/launch/membership_watch.hpp"
#include "lockstep/launch/watchdog.hpp"
#include "lockstep/store/tcp_store.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using lockstep::membership;
using lockstep::membership_change;
using lockstep::SurvivorOptions;
using lockstep_test::TestMlp;

// What each survivor's agree_on_survivors returned or threw.
struct outcome {
  std::optional<membership_change> change;
  std::string error;
};

// Every rank of `now` not in `dead` calls agree_on_survivors on its own thread with the gone
// ranks `names[job rank]` it knows of (after `delay[job rank]`), through its own store handle.
template <class StoreOf>
std::map<int, outcome> survive(StoreOf&& store_of, const membership& now, const std::set<int>& dead,
                               std::map<int, std::vector<int>> names, const SurvivorOptions& o,
                               std::map<int, std::chrono::milliseconds> delay = {}) {
  std::map<int, outcome> out;
  std::mutex m;
  std::vector<std::thread> threads;
  for (int place = 0; place < now.size(); ++place) {
    const int job = now.ranks[static_cast<std::size_t>(place)];
    if (dead.count(job)) continue;
    // Looked up here, on one thread: operator[] may insert.
    const std::vector<int> named = names[job];
    const auto wait = delay.count(job) ? delay[job] : std::chrono::milliseconds(0);
    threads.emplace_back([&, place, job, named, wait] {
      membership mine = now;
      mine.rank = place;
      outcome got;
      try {
        std::this_thread::sleep_for(wait);
        got.change = lockstep::agree_on_survivors(store_of(job), mine, named, o);
      } catch (const std::exception& e) {
        got.error = e.what();
      }
      std::lock_guard lk(m);
      out[job] = got;
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::vector<int> without(const std::vector<int>& ranks, const std::set<int>& gone) {
  std::vector<int> out;
  for (int r : ranks)
    if (!gone.count(r)) out.push_back(r);
  return out;
}

// Every survivor got the same decision: the members of `now` but `gone`, its own place in it.
void check_same_decision(const std::map<int, outcome>& got, const membership& now, const std::set<int>& gone) {
  const std::vector<int> expected = without(now.ranks, gone);
  for (const auto& [job, o] : got) {
    CAPTURE(job);
    CAPTURE(o.error);
    REQUIRE(o.change.has_value());
    CHECK(o.change->before.ranks == now.ranks);
    CHECK(o.change->after.epoch == now.epoch + 1);
    CHECK(o.change->after.ranks == expected);
    CHECK(o.change->after.job_rank() == job);
    CHECK(o.change->gone == std::vector<int>(gone.begin(), gone.end()));
  }
}

// ---- a training loop that survives ranks dying -------------------------------------------

struct job {
  std::vector<int> dims{11, 16, 5};
  std::size_t samples = 211;  // not divisible by the ranks: padding in play
  std::size_t batch = 4;
  std::uint64_t epochs = 2;
  std::uint64_t seed = 0;
  int accumulate = 1;              // micro-steps per optimizer step (Accumulate<>)
  bool keep_global_batch = false;  // after a change: steps_for_same_global_batch
  // ShardedOptimizer: a lost rank's optimizer shard is gone, so the survivors roll back to the
  // checkpoint the run saves every `rollback_every` steps (at `rollback`).
  std::int64_t rollback_every = 0;
  fs::path rollback;
  // ShardedOptimizer with lockstep::PeerCopy (a snapshot every `peer_copy_every` steps; 0: none):
  // a lost shard comes from the rank before it, or, when that is lost too, from the checkpoint.
  std::int64_t peer_copy_every = 0;
  int flaky_seal_rank = -1;    // with FlakyComm: the rank that does not see the seal of the deaths' step's snapshot
  bool flaky_regroup = false;  // with FlakyComm: every rank's first regroup fails
  // run(Threads{.max_restarts = restarts}): a rank that died is started again and joins the job
  // that went on without it; what the loop keeps besides the model it gets from rank 0 through a
  // checkpoint in `share` (PeerCopy: from the snapshot).
  int restarts = 0;
  fs::path share;
  std::vector<double> X;
  std::vector<int> y;
};

struct rank_killed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A ThreadComm whose i64 max all-reduces, on a rank that set flaky_seal::now (each rank is a
// thread), return a work that never reports itself complete (query() is false), although the
// collective completed: a seal that this rank did not see complete, as on a GPU that lags
// behind. That rank then holds the snapshot it seals unsealed.
struct flaky_seal {
  static inline thread_local bool now = false;
};
struct flaky_work {
  bool done = true;
  void wait() noexcept {}
  bool query() const noexcept { return done; }
};
// And whose regroup() fails once on a rank that set flaky_regroup::now, before it makes
// anything (as ncclCommInitRank can fail on every member: the survivors change again).
struct flaky_regroup {
  static inline thread_local bool now = false;
};
class FlakyComm : public lockstep::ThreadComm {
 public:
  explicit FlakyComm(lockstep::ThreadComm c) : ThreadComm(std::move(c)) {}
  flaky_work all_reduce(const void* send, void* recv, std::size_t count, lockstep::dtype t, lockstep::reduce_op op) {
    (void)ThreadComm::all_reduce(send, recv, count, t, op);
    return {!(flaky_seal::now && t == lockstep::dtype::i64 && op == lockstep::reduce_op::max)};
  }
  FlakyComm regroup(std::uint64_t change, std::span<const int> members) {
    if (std::exchange(flaky_regroup::now, false))
      throw lockstep::aborted_error("FlakyComm: the communicator of change " + std::to_string(change) +
                                    " could not be made");
    return FlakyComm(ThreadComm::regroup(change, members));
  }
};

// Where ranks die: at step `step` (its micro-step `micro`), before its forward (phase 0), in its
// backward after `hooks` gradients were handed over, while earlier buckets' collectives ran (1),
// or after finish(), before the optimizer (2: the others complete that step and find the loss
// at the next), or after the step's PeerCopy snapshot (3: the others' next step fails).
// `in_change`: ranks that die later, while the first change is being made (rebuilding DataParallel).
struct deaths {
  std::set<int> ranks{};
  std::int64_t step = -1;
  int phase = 0;
  int hooks = 0;
  int micro = 0;
  std::set<int> in_change{};
  std::set<int> all() const {
    std::set<int> a = ranks;
    a.insert(in_change.begin(), in_change.end());
    return a;
  }
};

struct trained {
  std::vector<double> params;                     // every member's, checked equal
  std::vector<lockstep::membership_change> seen;  // by the first survivor
  std::vector<std::int64_t> rolled_back_to;       // by the first survivor: the step of each rollback
  std::vector<std::int64_t> restored_to;          // by the first survivor: the step of each PeerCopy restore
  std::vector<int> lost;                          // by the first survivor: what PeerCopy could not restore
  std::int64_t flaky_step = -2;                   // by the rank of flaky_seal: its newest sealed step then
};

// Trains `world` CPU ranks for j.epochs epochs; stops after `stop_at` steps and saves a
// checkpoint there when `save` is given; starts from `resume` when given. Each step (its
// j.accumulate micro-steps; an epoch's last batches that do not fill one are dropped) goes
// through lockstep::ElasticGroup::attempt: when a peer died, the survivors agree on who goes
// on (through a HashStore), regroup, rebuild DataParallel (its loss scale carried over; with
// j.keep_global_batch more micro-steps each) and re-partition the rest of the epoch in
// on_change, and the loop redoes the whole step. Sharded (ShardedOptimizer): on_change rolls
// back to the last j.rollback checkpoint instead (its optimizer state resharded). With
// j.restarts, a dead rank starts again and joins: a change that grows the group, after which
// every rank gets the loop's state from rank 0 (PeerCopy: restores the snapshot of the group).
template <bool Sharded = false, class Comm = lockstep::ThreadComm>
trained train(const job& j, int world, const deaths& d, std::int64_t stop_at = -1, const fs::path* save = nullptr,
              const fs::path* resume = nullptr) {
  using DP = lockstep::DataParallel<TestMlp<double>, Comm, lockstep::DynamicScale, lockstep::Accumulate<>,
                                    std::conditional_t<Sharded, lockstep::ShardedOptimizer, lockstep::Replicated>>;
  std::vector<std::vector<double>> out(static_cast<std::size_t>(world));
  trained t;
  lockstep::HashStore store(world, 20s);
  const std::set<int> dead = d.all();
  int first_survivor = 0;
  while (dead.count(first_survivor)) ++first_survivor;
  auto body = [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    TestMlp<double> m(j.dims, j.seed);
    flaky_regroup::now = j.flaky_regroup;
    // (Failed ranks are named: no settling. A rank started again joins here.)
    lockstep::ElasticGroup<Comm, lockstep::HashStore> group(ctx, store, {.settle = 5s});
    std::optional<DP> dp;
    int micro_steps = j.accumulate;
    auto build = [&] {
      dp.emplace(group.comm(), m, lockstep::DataParallelOptions{.buckets = {.first_bytes = 200, .cap_bytes = 400}},
                 lockstep::DynamicScale({.init_scale = 256.0, .growth_interval = 3}),
                 lockstep::Accumulate<>(micro_steps));
    };
    build();
    lockstep::Sgd opt({.lr = 0.2, .momentum = 0.9, .weight_decay = 1e-3});
    lockstep::DistributedSampler<> sampler(j.samples, group, {.seed = j.seed});
    std::int64_t steps = 0;
    auto save_to = [&](const fs::path& path) {
      if constexpr (Sharded) {
        auto state = lockstep::gather_sharded(*dp, opt);  // collective
        lockstep::save_checkpoint_rank0(group.comm(), path, [&](lockstep::Checkpoint& ck) {
          ck.meta.step = steps;
          lockstep::add_training_state(ck, *dp, sampler);
          ck.add_blob("optimizer", std::move(state));
        });
      } else {
        lockstep::save_checkpoint_rank0(group.comm(), path, [&](lockstep::Checkpoint& ck) {
          ck.meta.step = steps;
          lockstep::add_training_state(ck, *dp, sampler);
          ck.add("optimizer", opt);
        });
      }
    };
    auto load_from = [&](const fs::path& path) {
      const auto ck = lockstep::load_checkpoint(path);
      lockstep::restore_training_state(ck, *dp, sampler);
      if constexpr (Sharded) lockstep::load_sharded(*dp, opt, ck.blob("optimizer"));
      else ck.restore("optimizer", opt);
      steps = ck.meta.step;
    };
    std::vector<std::int64_t> rolled_back_to, restored_to;
    std::vector<int> lost;
    lockstep::PeerCopy copies({.every = std::max<std::int64_t>(1, j.peer_copy_every)});
    // The lost ranks' optimizer shards (or a joiner's): from their copies, else the last checkpoint.
    auto recover_shards = [&] {
      if constexpr (Sharded) {
        if (j.peer_copy_every > 0) {
          if (const auto at = copies.restore(group.members(), *dp, opt, sampler)) {
            steps = *at;
            restored_to.push_back(steps);
            return;
          }
          lost = copies.lost();
        }
        load_from(j.rollback);  // (the sampler, made for the ranks before, is moved to the survivors' by it)
        rolled_back_to.push_back(steps);
      }
    };
    // After a grow: what the loop keeps besides the model, from rank 0.
    auto share = [&] {
      const fs::path at = j.share / ("grown-" + std::to_string(group.members().epoch) + ".ckpt");
      save_to(at);
      load_from(at);
    };
    group.on_change([&](const lockstep::membership_change& c) {
      if (d.in_change.count(ctx.rank())) throw rank_killed("job rank " + std::to_string(ctx.rank()) + " killed");
      if (j.keep_global_batch) micro_steps = lockstep::steps_for_same_global_batch(micro_steps, c);
      const auto scale = dp->scaler().state();
      dp.reset();
      build();
      if constexpr (Sharded) {
        recover_shards();
      } else {
        dp->scaler().load_state(scale);
        sampler.repartition(group.rank(), group.size());
        if (!c.joined.empty()) share();
      }
    });
    if (group.replacement()) {  // as the members do in on_change for the change that admitted it
      if constexpr (Sharded) recover_shards();
      else share();
    }
    if (resume) load_from(*resume);
    const int job_rank = ctx.rank();
    while (sampler.epoch() < j.epochs && steps != stop_at) {
      if (j.restarts > 0 && group.size() < world) std::this_thread::sleep_for(20ms);  // (time for a joiner)
      const auto batches = sampler.batches(j.batch);
      if (batches.size() < static_cast<std::size_t>(micro_steps)) {
        sampler.set_epoch(sampler.epoch() + 1);
        continue;
      }
      std::size_t taken = 0;
      const auto changed = group.attempt([&] {
        taken = 0;
        for (int k = 0; k < micro_steps; ++k) {
          const auto& b = batches[static_cast<std::size_t>(k)];
          const std::vector<std::size_t> rows(b.begin(), b.end());
          const bool dies = d.ranks.count(job_rank) && steps == d.step && k == d.micro;
          auto die = [&](int phase) {
            if (dies && d.phase == phase) throw rank_killed("job rank " + std::to_string(job_rank) + " killed");
          };
          die(0);
          auto step = dp->step();
          auto hook = step.on_gradient_ready();
          int handed = 0;
          m.forward_backward(
              j.X, j.y, rows,
              [&](std::size_t i) {
                if (handed++ == d.hooks) die(1);
                hook(i);
              },
              step.loss_scale());
          if constexpr (Sharded) {  // each rank's optimizer steps its shards, inside finish
            (void)step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
            die(2);
            if (k + 1 == micro_steps) group.commit();  // (with restarts: does a replacement wait?)
          } else {
            auto r = step.finish();
            die(2);
            if (k + 1 == micro_steps) {
              group.commit();
              opt.step(dp->parameters(), !r);
            }
          }
          taken += rows.size();
        }
        sampler.advance(taken);
        ++steps;
        if constexpr (Sharded)
          if (j.peer_copy_every > 0) {
            flaky_seal::now = job_rank == j.flaky_seal_rank && steps == d.step + 1 && group.changes().empty();
            copies.save(steps, group.members(), *dp, opt, sampler);
            if (std::exchange(flaky_seal::now, false)) t.flaky_step = copies.step();  // (the flake took effect?)
          }
        if (d.ranks.count(job_rank) && steps == d.step + 1 && d.phase == 3)
          throw rank_killed("job rank " + std::to_string(job_rank) + " killed");
      });
      if (changed) continue;  // the interrupted step again (all its micro-steps), over the survivors
      if (save && steps == stop_at) save_to(*save);
      if (j.rollback_every > 0 && steps % j.rollback_every == 0) save_to(j.rollback);
    }
    out[static_cast<std::size_t>(job_rank)] = m.flat_values();
    if (job_rank == first_survivor) {
      t.seen = group.changes();
      t.rolled_back_to = rolled_back_to;
      t.restored_to = restored_to;
      t.lost = lost;
    }
  };
  const lockstep::Threads mode{.ranks = world, .max_restarts = j.restarts};
  if (dead.empty() || j.restarts > 0) {  // (a rank that died and was started again is no failure of run())
    lockstep::run(mode, body);
  } else {  // run() reports the first rank that died, once every rank has ended
    CHECK_THROWS_WITH_AS(lockstep::run(mode, body), doctest::Contains("killed"), rank_killed);
  }
  t.params = out[static_cast<std::size_t>(first_survivor)];
  for (int r = 0; r < world; ++r)
    if (!dead.count(r) || j.restarts > 0) {  // (every rank, the replacements too)
      CAPTURE(r);
      CHECK(out[static_cast<std::size_t>(r)] == t.params);
    }
  return t;
}

// A job on fresh random data (the caller CAPTUREs j.seed; rng continues its stream) and a
// fresh folder for its checkpoints, removed with the object.
struct fresh_job {
  job j;
  std::mt19937_64 rng;
  fs::path dir;
  fs::path switch_ckpt;  // the checkpoint of a run that switches rank counts
  explicit fresh_job(const char* name) {
    j.seed = lockstep_test::fresh_seed();  // (LOCKSTEP_TEST_SEED replays it)
    rng.seed(j.seed);
    j.X = lockstep_test::random_vector<double>(j.samples * 11, rng, -1.5, 1.5);
    for (std::size_t i = 0; i < j.samples; ++i) j.y.push_back(static_cast<int>(rng() % 5));
    dir = fs::temp_directory_path() / (std::string("lockstep-") + name + "-" + std::to_string(j.seed));
    fs::create_directories(dir);
    switch_ckpt = dir / "switch.ckpt";
  }
  ~fresh_job() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

// The same switch as an elastic sharded run made, without a failure: `world` ranks to step `at`,
// a checkpoint (at `ck`), the rest on `survivors` ranks, with neither rollbacks nor copies; the
// elastic run must end there bit for bit, trained.
// The changes a run saw for deaths `d`: ranks that die in the same step are seen in one change,
// or — when one of them was released by another's failure before it reached its own (threads run
// unevenly) — in one each, the later one dying as the step is redone. Either way the ranks gone
// are the dead, the epochs count up and the survivors are the rest.
void check_changes(const trained& t, const deaths& d, int world) {
  const std::set<int> dead = d.all();
  REQUIRE(t.seen.size() >= (d.in_change.empty() ? 1u : 2u));
  REQUIRE(t.seen.size() <= dead.size());
  std::set<int> gone;
  for (std::size_t k = 0; k < t.seen.size(); ++k) {
    gone.insert(t.seen[k].gone.begin(), t.seen[k].gone.end());
    CHECK(t.seen[k].after.epoch == k + 1);
  }
  CHECK(gone == dead);
  CHECK(t.seen.back().after.ranks.size() == static_cast<std::size_t>(world) - dead.size());
}
bool all_equal(const std::vector<std::int64_t>& v, std::int64_t x) {
  return !v.empty() && std::all_of(v.begin(), v.end(), [&](std::int64_t y) { return y == x; });
}

struct rank_switch {
  std::int64_t at;  // the step
  int ranks;        // the ranks from there on
};
// A run without failures that switches rank counts: `world` ranks to the first switch's step,
// a checkpoint (in `dir`), each switch's ranks from there to the next one's; the elastic run
// must end there bit for bit, trained.
template <bool Sharded>
void check_as_switches(job plain, int world, const std::vector<rank_switch>& switches, const fs::path& dir,
                       const trained& elastic) {
  plain.rollback_every = 0;
  plain.peer_copy_every = 0;
  plain.flaky_seal_rank = -1;
  plain.restarts = 0;
  fs::path from;
  int ranks = world;
  for (std::size_t k = 0; k < switches.size(); ++k) {
    if (k + 1 < switches.size() && switches[k + 1].at == switches[k].at) continue;  // (no steps on these ranks)
    const fs::path to = dir / ("switch-" + std::to_string(k) + ".ckpt");
    train<Sharded>(plain, ranks, {}, switches[k].at, &to, from.empty() ? nullptr : &from);
    from = to;
    ranks = switches[k].ranks;
  }
  const trained switched = train<Sharded>(plain, ranks, {}, -1, nullptr, &from);
  CHECK(elastic.params == switched.params);  // bit for bit
  CHECK(lockstep_test::max_rel_diff(elastic.params, TestMlp<double>(plain.dims, plain.seed).flat_values()) > 1e-3);
}
void check_as_sharded_switch(const job& plain, int world, int survivors, std::int64_t at, const fs::path& ck,
                             const trained& elastic) {
  check_as_switches<true>(plain, world, {{at, survivors}}, ck.parent_path(), elastic);
}

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("ranks die mid-step: the survivors shrink - redo the step - and end bit for bit where a switch of rank "
          "counts at that step ends") {
  fresh_job f("elastic");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  // 211 samples over 4 ranks: 53 a rank, 14 steps of 4 an epoch.
  const std::vector<deaths> cases{
      {.ranks = {2}, .step = 5, .phase = 0},
      {.ranks = {1}, .step = 9, .phase = 1, .hooks = static_cast<int>(rng() % 4)},
      {.ranks = {3}, .step = 16, .phase = 2},  // in the second epoch; the others find it at step 17
      {.ranks = {1, 3}, .step = 3 + static_cast<std::int64_t>(rng() % 8), .phase = 1, .hooks = 1},
      {.ranks = {1}, .step = 7, .phase = 0, .in_change = {3}},  // a second change while making the first
  };
  const int world = 4;
  for (const auto& d : cases) {
    CAPTURE(d.step);
    CAPTURE(d.phase);
    const trained elastic = train(j, world, d);
    // Where the survivors went on without the dead: that step (phase 2: the next one).
    const std::int64_t at = d.step + (d.phase == 2 ? 1 : 0);
    const std::set<int> dead = d.all();
    check_changes(elastic, d, world);
    for (const auto& c : elastic.seen) CHECK(c.agreement < 2s);  // the dead were named: no 5 s settle
    // The same switch without a failure: `world` ranks to step `at`, a checkpoint, the rest on fewer.
    train(j, world, {}, at, &ck);
    const trained switched = train(j, world - static_cast<int>(dead.size()), {}, -1, nullptr, &ck);
    CHECK(elastic.params == switched.params);  // bit for bit
    CHECK(lockstep_test::max_rel_diff(elastic.params, TestMlp<double>(j.dims, j.seed).flat_values()) > 1e-3);
  }
}

TEST_CASE("the survivors' new communicator fails to be made - they change again and end bit for bit where a switch "
          "of rank counts at that step ends") {
  fresh_job f("elastic-regroup");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  j.flaky_regroup = true;  // every rank's first regroup throws
  const int world = 3 + static_cast<int>(rng() % 2);
  const int victim = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(world - 1));
  const deaths d{.ranks = {victim}, .step = 2 + static_cast<std::int64_t>(rng() % 8), .phase = 0};
  CAPTURE(world);
  CAPTURE(victim);
  CAPTURE(d.step);
  const trained elastic = train<false, FlakyComm>(j, world, d);
  REQUIRE(elastic.seen.size() == 2u);
  CHECK(elastic.seen[0].gone == std::vector<int>{victim});
  CHECK(elastic.seen[1].gone.empty());  // nobody else was lost: the same survivors, a new epoch
  CHECK(elastic.seen[1].before.ranks == elastic.seen[0].after.ranks);
  CHECK(elastic.seen[1].after.ranks == elastic.seen[0].after.ranks);
  CHECK(elastic.seen[1].after.epoch == 2u);
  j.flaky_regroup = false;
  train(j, world, {}, d.step, &ck);
  const trained switched = train(j, world - 1, {}, -1, nullptr, &ck);
  CHECK(elastic.params == switched.params);  // bit for bit
  CHECK(lockstep_test::max_rel_diff(elastic.params, TestMlp<double>(j.dims, j.seed).flat_values()) > 1e-3);
}

TEST_CASE("ranks die mid-cycle with accumulation: the survivors keep the global batch by more micro-steps - and "
          "end bit for bit where a switch of rank counts at that step ends") {
  fresh_job f("elastic-acc");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  j.keep_global_batch = true;
  // 211 samples over 4 ranks: 14 batches of 4 a rank and epoch. 4 ranks x 3 micro-steps go on
  // as 3 x 4 (one rank gone) or 2 x 6 (two gone): 12 micro-batches a step throughout.
  struct acc_case {
    deaths d;
    int after;  // micro-steps on the survivors
  };
  const std::vector<acc_case> cases{
      {{.ranks = {2}, .step = 2, .phase = 1, .hooks = static_cast<int>(rng() % 4), .micro = 1}, 4},
      {{.ranks = {1, 3}, .step = 1 + static_cast<std::int64_t>(rng() % 3), .phase = 0, .micro = 2}, 6},
      {{.ranks = {3}, .step = 5, .phase = 1, .hooks = 2, .micro = 0}, 4},  // in the second epoch
  };
  const int world = 4;
  for (const auto& [d, after] : cases) {
    CAPTURE(d.step);
    CAPTURE(d.micro);
    j.accumulate = 3;
    const trained elastic = train(j, world, d);
    check_changes(elastic, d, world);
    // The same switch without a failure: 4 ranks x 3 to step d.step, a checkpoint, the rest on
    // the survivors' count with `after` micro-steps each.
    train(j, world, {}, d.step, &ck);
    job fewer = j;
    fewer.accumulate = after;
    const trained switched = train(fewer, world - static_cast<int>(d.ranks.size()), {}, -1, nullptr, &ck);
    CHECK(elastic.params == switched.params);  // bit for bit
    // Control: the survivors with the per-rank batch kept (3 micro-steps) end elsewhere.
    fewer.accumulate = 3;
    const trained per_rank = train(fewer, world - static_cast<int>(d.ranks.size()), {}, -1, nullptr, &ck);
    CHECK(per_rank.params != switched.params);
  }
}

TEST_CASE("sharded optimizer: a lost shard - the survivors roll back to the last checkpoint resharded - and end "
          "bit for bit where a switch of rank counts at that checkpoint ends") {
  fresh_job f("elastic-sharded");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  j.rollback_every = 4;
  j.rollback = dir / "rollback.ckpt";
  // Deaths after the checkpoint of step 4 (steps 5-7) or of step 16 (in the second epoch: 14
  // steps of 4 rows an epoch).
  const std::vector<deaths> cases{
      {.ranks = {2}, .step = 5 + static_cast<std::int64_t>(rng() % 3), .phase = 1, .hooks = 1},
      {.ranks = {1, 3}, .step = 17, .phase = 0},
  };
  const int world = 4;
  for (const auto& d : cases) {
    CAPTURE(d.step);
    const trained elastic = train<true>(j, world, d);
    check_changes(elastic, d, world);
    const std::int64_t at = d.step / j.rollback_every * j.rollback_every;  // the last checkpoint before
    CHECK(all_equal(elastic.rolled_back_to, at));
    // The same switch without a failure, at the checkpoint's step.
    check_as_sharded_switch(j, world, world - static_cast<int>(d.ranks.size()), at, ck, elastic);
  }
}

TEST_CASE("sharded optimizer with PeerCopy: a lost shard comes from the rank before it - nothing is redone but the "
          "interrupted step - bit for bit where a switch of rank counts at that step ends") {
  fresh_job f("elastic-peer");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  j.rollback_every = 4;  // the fallback when a rank and the one holding its copy are both lost
  j.rollback = dir / "rollback.ckpt";
  struct peer_case {
    deaths d;
    std::int64_t every;
    std::int64_t at;  // the step the survivors go on from
    bool from_copies = true;
  };
  const std::vector<peer_case> cases{
      {{.ranks = {2}, .step = 5 + static_cast<std::int64_t>(rng() % 3), .phase = 1, .hooks = 1}, 1, -1},
      {{.ranks = {1, 3}, .step = 17, .phase = 0}, 1, 17},  // not neighbours: both copies survive
      {{.ranks = {3}, .step = 9, .phase = 2}, 1, 9},       // the others' snapshot of step 10 fails
      {{.ranks = {3}, .step = 12, .phase = 1}, 2, 12},     // a snapshot every 2 steps, one just taken
      {{.ranks = {1}, .step = 7, .phase = 0}, 3, 6},       // a snapshot every 3 steps: step 7 is redone
      {{.ranks = {1}, .step = 7, .phase = 1, .hooks = 2, .in_change = {3}}, 1, 7},  // a second change meanwhile
      {{.ranks = {1, 2}, .step = 6, .phase = 0}, 1, 4, false},                      // neighbours: 2's copy went with 1
  };
  const int world = 4;
  for (const auto& [d, every, at_given, from_copies] : cases) {
    CAPTURE(d.step);
    CAPTURE(every);
    const std::int64_t at = at_given >= 0 ? at_given : d.step;
    j.peer_copy_every = every;
    const trained elastic = train<true>(j, world, d);
    const std::set<int> dead = d.all();
    check_changes(elastic, d, world);
    if (from_copies) {
      CHECK(all_equal(elastic.restored_to, at));  // (a change cut short restores nothing)
      CHECK(elastic.rolled_back_to.empty());
    } else {  // (in one change; or rank 1's first, from the copies, then rank 2's)
      CHECK(elastic.restored_to.size() == elastic.seen.size() - 1);
      CHECK(elastic.lost == std::vector<int>{2});
      CHECK(elastic.rolled_back_to == std::vector<std::int64_t>{at});
    }
    check_as_sharded_switch(j, world, world - static_cast<int>(dead.size()), at, ck, elastic);
  }
}

TEST_CASE("sharded optimizer with PeerCopy: a survivor that did not see the newest snapshot sealed restores it "
          "from what it holds - bit for bit where a switch of rank counts at its step ends") {
  fresh_job f("elastic-peer-apart");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  j.peer_copy_every = 1;
  // Job rank 3 dies after the snapshot of step s + 1, whose seal job rank 1 did not see
  // complete (the others did): the survivors 0, 1, 2 agree on step s + 1, rank 1 from the
  // snapshot it holds unsealed.
  const std::int64_t s = 3 + static_cast<std::int64_t>(rng() % 10);
  CAPTURE(s);
  j.flaky_seal_rank = 1;
  const deaths d{.ranks = {3}, .step = s, .phase = 3};
  const trained elastic = train<true, FlakyComm>(j, 4, d);
  REQUIRE(elastic.seen.size() == 1u);
  CHECK(elastic.flaky_step == s);  // job rank 1 had not seen the seal of s + 1
  CHECK(elastic.restored_to == std::vector<std::int64_t>{s + 1});
  check_as_sharded_switch(j, 4, 3, s + 1, ck, elastic);
}

TEST_CASE("a dead rank started again joins the survivors at a step boundary - the job ends bit for bit where a run "
          "that switched rank counts at those steps ends") {
  fresh_job f("elastic-grow");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  j.restarts = 1;  // run(Threads{.max_restarts = 1}): the dead rank's body starts again, as a replacement
  j.share = dir;
  const std::vector<deaths> cases{
      {.ranks = {2},
       .step = 3 + static_cast<std::int64_t>(rng() % 6),
       .phase = 1,
       .hooks = static_cast<int>(rng() % 4)},
      {.ranks = {1}, .step = 4, .phase = 2},   // after finish(): found by the others' commit()
      {.ranks = {3}, .step = 16, .phase = 0},  // in the second epoch
  };
  const int world = 4;
  for (const auto& d : cases) {
    CAPTURE(d.step);
    CAPTURE(d.phase);
    const trained elastic = train(j, world, d);
    REQUIRE(elastic.seen.size() == 2u);
    const auto& shrink = elastic.seen[0];
    const auto& grow = elastic.seen[1];
    const std::vector<int> victim(d.ranks.begin(), d.ranks.end());
    CHECK(shrink.gone == victim);
    CHECK(shrink.steps == d.step);  // (phase 2 too: commit()'s all-reduce, before the update, finds the loss)
    CHECK(grow.joined == victim);
    CHECK(grow.gone.empty());
    CHECK(grow.after.ranks == std::vector<int>{0, 1, 2, 3});
    CHECK(grow.after.epoch == 2u);
    CHECK(grow.steps > shrink.steps);  // (admitted at a commit of the smaller group's)
    // The same switches without a failure: 4 ranks to the shrink's step, 3 to the grow's, 4 on.
    check_as_switches<false>(j, world, {{shrink.steps, world - 1}, {grow.steps, world}}, dir, elastic);
  }
}

TEST_CASE("sharded optimizer with PeerCopy: a dead rank started again joins - the members' snapshot is cut for the "
          "grown group - bit for bit where a run that switched rank counts at the restored steps ends") {
  fresh_job f("elastic-peer-grow");
  auto& [j, rng, dir, ck] = f;
  CAPTURE(j.seed);
  j.restarts = 1;
  j.share = dir;
  j.rollback_every = 4;  // (the fallback: not taken here)
  j.rollback = dir / "rollback.ckpt";
  struct grow_case {
    deaths d;
    std::int64_t every;
  };
  const std::vector<grow_case> cases{
      {{.ranks = {2}, .step = 5 + static_cast<std::int64_t>(rng() % 3), .phase = 1, .hooks = 1}, 1},
      {{.ranks = {1}, .step = 9, .phase = 2}, 1},
      {{.ranks = {3}, .step = 7, .phase = 0}, 2},  // restored from step 6; the grow from the newest snapshot
  };
  const int world = 4;
  for (const auto& [d, every] : cases) {
    CAPTURE(d.step);
    CAPTURE(every);
    j.peer_copy_every = every;
    const trained elastic = train<true>(j, world, d);
    REQUIRE(elastic.seen.size() == 2u);
    CHECK(elastic.seen[1].joined == std::vector<int>(d.ranks.begin(), d.ranks.end()));
    CHECK(elastic.rolled_back_to.empty());
    REQUIRE(elastic.restored_to.size() == 2u);
    const std::int64_t shrunk = elastic.restored_to[0], grown = elastic.restored_to[1];
    CHECK(shrunk == d.step / every * every);  // (phase 2: the others' commit() or snapshot finds the loss)
    // The grow: the members' newest snapshot, of the group that grew when one was taken since
    // the shrink (with every = 1, of the step it grew at: nothing redone). (The group's count of
    // steps is ahead of the loop's by the steps the shrink's restore went back.)
    const std::int64_t loop_at_grow = elastic.seen[1].steps - (elastic.seen[0].steps - shrunk);
    CHECK(grown == loop_at_grow / every * every);
    check_as_switches<true>(j, world, {{shrunk, world - 1}, {grown, world}}, dir, elastic);
  }
}

TEST_CASE("PeerCopy: a snapshot ahead of the step saved is dropped - clear() drops all - restore() without one says "
          "why") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 2 + static_cast<int>(rng() % 3);
  const auto X = lockstep_test::random_vector<double>(40 * 11, rng, -1.5, 1.5);
  std::vector<int> y;
  for (int i = 0; i < 40; ++i) y.push_back(static_cast<int>(rng() % 5));
  std::vector<std::vector<std::int64_t>> steps(static_cast<std::size_t>(world));
  std::vector<std::string> why(steps.size());
  std::vector<std::vector<double>> before(steps.size()), after(steps.size());
  lockstep::run(lockstep::Threads{world}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    TestMlp<double> m({11, 16, 5}, seed);
    lockstep::DataParallel<TestMlp<double>, lockstep::ThreadComm, lockstep::ShardedOptimizer> dp(ctx.comm(), m);
    lockstep::Sgd opt({.lr = 0.2, .momentum = 0.9});
    lockstep::DistributedSampler<> sampler(40, ctx.comm(), {.seed = seed});
    const auto members = lockstep::membership::whole(world, ctx.rank());
    lockstep::PeerCopy copies;
    auto& seen = steps[static_cast<std::size_t>(ctx.rank())];
    auto train = [&] {
      auto st = dp.step();
      const auto b = sampler.batches(4).front();
      m.forward_backward(X, y, std::vector<std::size_t>(b.begin(), b.end()), st.on_gradient_ready());
      (void)st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
      sampler.advance(b.size());
    };
    for (std::int64_t k : {10, 11}) {  // two snapshots
      train();
      copies.save(k, members, dp, opt, sampler);
      seen.push_back(copies.step());
    }
    copies.save(9, members, dp, opt, sampler);  // the loop went back (a checkpoint): 10 and 11 are gone
    seen.push_back(copies.step());
    before[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
    train();  // moves on, then back to the snapshot of step 9 (nobody gone)
    const auto at = copies.restore(members, dp, opt, sampler);
    seen.push_back(at.value_or(-2));
    after[static_cast<std::size_t>(ctx.rank())] = m.flat_values();
    copies.clear();
    seen.push_back(copies.step());
    seen.push_back(copies.restore(members, dp, opt, sampler).value_or(-2));
    why[static_cast<std::size_t>(ctx.rank())] = copies.why();
    CHECK_THROWS_WITH_AS(copies.save(-1, members, dp, opt, sampler), doctest::Contains("step -1"),
                         lockstep::config_error);
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    const auto k = static_cast<std::size_t>(r);
    CHECK(steps[k] == std::vector<std::int64_t>{10, 11, 9, 9, -1, -2});
    CHECK(why[k].find("no snapshot sealed yet") != std::string::npos);
    CHECK(after[k] == before[k]);  // the parameters of step 9's snapshot are back
  }
}

TEST_CASE("PeerCopy: ThreadComm's ring shift hands each rank the block of the rank d places after it") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 2 + static_cast<int>(rng() % 4);
  const int distance = static_cast<int>(rng() % 7) - 3;
  CAPTURE(world);
  CAPTURE(distance);
  std::vector<std::vector<std::int32_t>> sent(static_cast<std::size_t>(world)), got(sent.size());
  std::vector<std::string> texts(sent.size()), shifted(sent.size());
  for (auto& v : sent)
    for (int i = 0; i < 5; ++i) v.push_back(static_cast<std::int32_t>(rng()));
  for (int r = 0; r < world; ++r) texts[static_cast<std::size_t>(r)] = std::string(rng() % 40, 'a' + r);
  lockstep::run(lockstep::Threads{world}, [&](auto& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    got[r].resize(5);
    ctx.comm().shift(sent[r].data(), got[r].data(), 5, lockstep::dtype::i32, distance).wait();
    shifted[r] = lockstep::detail::host_shift_string(ctx.comm(), texts[r], distance);
  });
  for (int r = 0; r < world; ++r) {
    const auto from = static_cast<std::size_t>(((r + distance) % world + world) % world);
    CHECK(got[static_cast<std::size_t>(r)] == sent[from]);
    CHECK(shifted[static_cast<std::size_t>(r)] == texts[from]);
  }
}

TEST_CASE("survivors agree on who goes on: random gone ranks - named by some or by none") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    const int world = 2 + static_cast<int>(rng() % 7);
    const membership now = membership::whole(world, 0);
    std::set<int> dead;  // never job rank 0: the coordinator (its loss is the test below)
    const int deaths = 1 + static_cast<int>(rng() % std::min(2, world - 1));
    while (static_cast<int>(dead.size()) < deaths) dead.insert(1 + static_cast<int>(rng() % (world - 1)));
    std::map<int, std::vector<int>> names;  // each survivor knows of some of the dead, or of none
    const bool nobody_names = trial % 3 == 0;
    for (int r = 0; r < world; ++r)
      for (int d : dead)
        if (!nobody_names && rng() % 2) names[r].push_back(d);
    CAPTURE(world);
    CAPTURE(nobody_names);
    lockstep::HashStore st(world, 10s);
    const SurvivorOptions o{.settle = 800ms};
    const auto t0 = std::chrono::steady_clock::now();
    const auto got = survive([&](int) -> lockstep::HashStore& { return st; }, now, dead, names, o);
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(got.size() == static_cast<std::size_t>(world) - dead.size());
    check_same_decision(got, now, dead);
    // Unnamed dead ranks cost the settle time; named ones do not wait for it.
    bool all_named = true;
    for (int d : dead) {
      bool named = false;
      for (const auto& [r, n] : names)
        if (!dead.count(r) && std::count(n.begin(), n.end(), d)) named = true;
      all_named = all_named && named;
    }
    if (!all_named) CHECK(took >= 800ms);
    else CHECK(took < 800ms);
  }
}

TEST_CASE("survivors agree through a TcpStore - twice in a row (epochs 1 and 2)") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 4 + static_cast<int>(rng() % 3);
  const std::string token = "elastic-" + std::to_string(rng());
  lockstep::TcpStore server("127.0.0.1", 0, true, world, token, 10s);
  std::map<int, std::unique_ptr<lockstep::TcpStore>> clients;
  for (int r = 1; r < world; ++r)
    clients[r] = std::make_unique<lockstep::TcpStore>("127.0.0.1", server.port(), false, world, token, 10s);
  auto store_of = [&](int job) -> lockstep::TcpStore& { return job == 0 ? server : *clients[job]; };
  const SurvivorOptions o{.settle = 2s};
  // First change: the last rank gone, named by rank 1.
  const membership now = membership::whole(world, 0);
  const std::set<int> first{world - 1};
  const auto a = survive(store_of, now, first, {{1, {world - 1}}}, o);
  check_same_decision(a, now, first);
  // Second: job rank 1 gone too, named by everyone; the keys of epoch 1 are apart from epoch 0's.
  const membership after = a.at(0).change->after;
  const std::set<int> second{1};
  std::map<int, std::vector<int>> names;
  for (int r : after.ranks) names[r] = {1};
  const auto b = survive(store_of, after, second, names, o);
  check_same_decision(b, after, second);
  CHECK(b.at(0).change->after.epoch == 2);
  CHECK(b.at(0).change->after.ranks == without(now.ranks, {1, world - 1}));
}

TEST_CASE("a rank that reports after the decision is out - others go on without it") {
  const int world = 4;
  lockstep::HashStore st(world, 10s);
  const membership now = membership::whole(world, 0);
  // Rank 2 is slow: it reports 600 ms late, after the coordinator's 200 ms settle.
  const auto got =
      survive([&](int) -> lockstep::HashStore& { return st; }, now, {}, {}, {.settle = 200ms}, {{2, 600ms}});
  CHECK(got.at(2).error.find("rank 2 reported after the survivors were decided (job ranks 0, 1, 3 go on") !=
        std::string::npos);
  std::map<int, outcome> others = got;
  others.erase(2);
  check_same_decision(others, now, {2});
}

TEST_CASE("the coordinator gone or too few ranks left: every survivor is told why") {
  const int world = 5;
  const membership now = membership::whole(world, 0);
  {  // Job rank 0 (the coordinator) gone: named by rank 1, unknown to the others (they time out).
    lockstep::HashStore st(world, 700ms);
    const auto got = survive([&](int) -> lockstep::HashStore& { return st; }, now, {0}, {{1, {0}}}, {});
    CHECK(got.at(1).error.find("job rank 0, which coordinates changes of membership") != std::string::npos);
    for (int r : {2, 3, 4}) {
      CAPTURE(r);
      CHECK(got.at(r).error.find("no decision on who goes on came from job rank 0") != std::string::npos);
    }
  }
  {  // Three of five gone, two left, and at least three needed.
    lockstep::HashStore st(world, 10s);
    const auto got = survive([&](int) -> lockstep::HashStore& { return st; }, now, {1, 3, 4}, {{0, {1, 3, 4}}},
                             {.min_ranks = 3, .settle = 5s});
    REQUIRE(got.size() == 2);
    for (const auto& [r, o] : got) {
      CAPTURE(r);
      CHECK(o.error.find("the job cannot go on: 2 rank(s) remain (job ranks 0, 2), fewer than "
                         "SurvivorOptions::min_ranks = 3") != std::string::npos);
    }
  }
  CHECK_THROWS_AS(membership::whole(3, 3), lockstep::config_error);
}

// The coordinator's loop ends after its last step passed while the others' last step failed
// after its collective (on GPUs: a commit() aborted by a watchdog that saw a third rank go): no
// change of membership will come, and they hear so from the store at once (the coordinator's
// ElasticGroup says "ended" as it goes) instead of waiting out its timeout (60 s here).
// store_of(job rank): that rank's store.
template <class StoreOf>
void check_coordinator_ended(int world, std::int64_t last, StoreOf store_of) {
  CAPTURE(world);
  CAPTURE(last);
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::chrono::milliseconds> took(static_cast<std::size_t>(world));
  std::vector<std::int64_t> steps(static_cast<std::size_t>(world), -1);
  lockstep::run(lockstep::Threads{world}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    lockstep::ElasticGroup group(ctx, store_of(ctx.rank()));
    const auto t0 = std::chrono::steady_clock::now();
    try {
      for (std::int64_t s = 0; s < last; ++s) {
        const auto c = group.attempt([&] {
          std::vector<float> x{static_cast<float>(r + 1)};
          group.comm().all_reduce(x.data(), x.data(), 1, lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
          if (s == last - 1 && r != 0) throw lockstep::aborted_error("injected: this rank's commit was aborted");
        });
        REQUIRE_FALSE(c.has_value());
      }
    } catch (const lockstep::aborted_error& e) {
      errors[r] = e.what();
    }
    took[r] = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    steps[r] = group.steps();
  });
  CHECK(errors[0].empty());
  CHECK(steps[0] == last);
  for (std::size_t r = 1; r < errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(errors[r]);
    CHECK(errors[r].find("job rank 0, which coordinates changes of membership, ended its training loop after step " +
                         std::to_string(last) + " while this rank's step failed") != std::string::npos);
    CHECK(took[r] < 20s);
  }
}

// A second group on the store of a first that changed once (at epoch 0, after 2 steps) and
// ended cleanly: its change at the same epoch agrees as usual — it reads neither the first
// group's "ended" nor its decision (which says 2 steps). Every rank's step fails once.
void check_second_group(int world) {
  lockstep::HashStore st(world, 60s);
  std::vector<std::optional<membership_change>> seen(static_cast<std::size_t>(world));
  auto fail_once = [](bool& thrown) {
    if (!std::exchange(thrown, true)) throw lockstep::aborted_error("injected: every rank's step fails once");
  };
  lockstep::run(lockstep::Threads{world}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    {
      lockstep::ElasticGroup first(ctx, st);
      for (int s = 0; s < 2; ++s) REQUIRE_FALSE(first.attempt([] {}).has_value());
      bool thrown = false;
      const auto c = first.attempt([&] { fail_once(thrown); });
      REQUIRE(c.has_value());
      CHECK(c->steps == 2);
      REQUIRE_FALSE(first.attempt([] {}).has_value());
    }
    ctx.comm().barrier();  // the first group's coordinator has gone (and said so)
    lockstep::ElasticGroup second(ctx, st);
    bool thrown = false;
    seen[r] = second.attempt([&] { fail_once(thrown); });
  });
  for (const auto& c : seen) {
    REQUIRE(c.has_value());
    CHECK(c->gone.empty());
    CHECK(c->steps == 0);
    CHECK(c->after.epoch == 1u);
    CHECK(c->after.size() == world);
  }
}

TEST_CASE("the coordinator's training loop ended while a survivor's step failed - the survivor is told at once - not "
          "after the store's timeout - HashStore and TcpStore - a later group on the store is not told") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 2 + static_cast<int>(rng() % 2);
  const std::int64_t last = 2 + static_cast<std::int64_t>(rng() % 3);
  {
    lockstep::HashStore st(world, 60s);
    check_coordinator_ended(world, last, [&](int) -> lockstep::HashStore& { return st; });
  }
  const std::string token = "ended-" + std::to_string(rng());
  lockstep::TcpStore server("127.0.0.1", 0, true, world, token, 60s);
  std::map<int, std::unique_ptr<lockstep::TcpStore>> clients;
  for (int r = 1; r < world; ++r)
    clients[r] = std::make_unique<lockstep::TcpStore>("127.0.0.1", server.port(), false, world, token, 60s);
  check_coordinator_ended(world, last,
                          [&](int job) -> lockstep::TcpStore& { return job == 0 ? server : *clients[job]; });
  check_second_group(world);
}

// A replacement that joined, whose step then fails while the coordinator's loop ends: it is
// told at once, as a member is, not after the store's timeout (60 s) — its group took the
// coordinator's number at its admission, so it reads that group's "ended". Job rank world − 1
// dies at step 1 and is started again; every rank ends two steps after the group grew back;
// the replacement's last step fails after its collectives (its commit "aborted").
void check_replacement_told(int world) {
  CAPTURE(world);
  lockstep::HashStore st(world, 60s);
  const int victim = world - 1;
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::chrono::milliseconds> took(static_cast<std::size_t>(world));
  std::vector<int> grew(static_cast<std::size_t>(world), 0);
  lockstep::run(
      lockstep::Threads{.ranks = world, .max_restarts = 1}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
        const auto r = static_cast<std::size_t>(ctx.rank());
        const bool again = ctx.restart_count() > 0;
        lockstep::ElasticGroup group(ctx, st);
        std::int64_t end = again ? group.steps() + 2 : -1;  // (the replacement: admitted at group.steps())
        const auto t0 = std::chrono::steady_clock::now();
        try {
          for (int guard = 0; end < 0 || group.steps() < end; ++guard) {
            REQUIRE(guard < 20000);  // (the replacement is admitted within ~100 ms of asking)
            const auto c = group.attempt([&] {
              if (static_cast<int>(r) == victim && !again && group.steps() == 1)
                throw std::runtime_error("injected: this rank dies");
              std::vector<float> x{static_cast<float>(r + 1)};
              group.comm().all_reduce(x.data(), x.data(), 1, lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
              group.commit();
              if (again && group.steps() == end - 1)
                throw lockstep::aborted_error("injected: the replacement's commit");
              std::this_thread::sleep_for(1ms);
            });
            if (c && !c->joined.empty()) {
              ++grew[r];
              end = c->steps + 2;
            }
          }
        } catch (const lockstep::aborted_error& e) {
          errors[r] = e.what();
        }
        took[r] = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
        if (again) CHECK(group.replacement());
      });
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(errors[r]);
    if (static_cast<int>(r) != victim) {
      CHECK(errors[r].empty());
      CHECK(grew[r] == 1);
      continue;
    }
    CHECK(errors[r].find("job rank 0, which coordinates changes of membership, ended its training loop after step") !=
          std::string::npos);
    CHECK(took[r] < 20s);
  }
}

TEST_CASE("a replacement that joined is told at once when its step fails as the coordinator's loop ends") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  check_replacement_told(2 + static_cast<int>(rng() % 2));
}

TEST_CASE("job rank 0 started again is refused at once - it coordinated and the others ended when it failed") {
  const int world = 2;
  lockstep::HashStore st(world, 60s);
  std::string again_error, member_error;
  std::chrono::milliseconds again_took{};
  lockstep::run(
      lockstep::Threads{.ranks = world, .max_restarts = 1}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
        const bool again = ctx.restart_count() > 0;
        const auto t0 = std::chrono::steady_clock::now();
        try {
          lockstep::ElasticGroup group(ctx, st);
          for (int s = 0; s < 3; ++s)
            (void)group.attempt([&] {
              if (ctx.rank() == 0 && group.steps() == 1) throw std::runtime_error("injected: rank 0 dies");
              group.comm().barrier();
            });
        } catch (const lockstep::aborted_error& e) {
          (again ? again_error : member_error) = e.what();
          if (again)
            again_took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
        }
      });
  CAPTURE(again_error);
  CAPTURE(member_error);
  CHECK(again_error.find("job rank 0 was started again, but it coordinates changes of membership") !=
        std::string::npos);
  CHECK(again_took < 20s);
  CHECK(member_error.find("which coordinates changes of membership") != std::string::npos);
}

// A joiner waits on its own thread (60 s at most), through its own store handle; what it got,
// and how long it waited.
struct waiting_joiner {
  std::string error;
  std::chrono::milliseconds took{};
  std::thread t;
  template <class Store>
  waiting_joiner(Store& st, int job_rank) {
    const auto n = lockstep::request_join(st, job_rank);
    t = std::thread([this, &st, n, job_rank] {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        (void)lockstep::await_admission(st, n, job_rank, 60s);
        error = "admitted";
      } catch (const std::exception& e) {
        error = e.what();
      }
      took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    });
  }
  ~waiting_joiner() {
    if (t.joinable()) t.join();
  }
};

// Groups without restarts never admit: a request waits until the coordinator's group goes,
// which answers it; one made after that is told by the store's word and withdrawn; a group
// that fails answers too; a later group begins after the answered requests. store_of(job
// rank): that rank's store; `joiner`: the joiners'.
template <class StoreOf, class JoinerStore>
void check_joins_closed(int world, std::int64_t last, StoreOf store_of, JoinerStore& joiner) {
  CAPTURE(world);
  CAPTURE(last);
  // `early`: asks to join from rank 0's thread once rank 0's group is made (its word says open).
  auto train = [&](bool fail, std::optional<waiting_joiner>& early) {
    lockstep::run(lockstep::Threads{world}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
      lockstep::ElasticGroup group(ctx, store_of(ctx.rank()));
      if (ctx.rank() == 0) early.emplace(joiner, world);
      for (std::int64_t s = 0; s < last; ++s) REQUIRE_FALSE(group.attempt([&] { group.comm().barrier(); }).has_value());
      if (fail) throw std::runtime_error("injected: every rank's loop fails");
    });
  };
  {
    std::optional<waiting_joiner> early;
    train(false, early);
    early->t.join();
    CAPTURE(early->error);
    CHECK(early->error.find("may not join the job: job rank 0's ElasticGroup, which admits replacements, went away "
                            "after step " +
                            std::to_string(last) + " (the job's training loop ended)") != std::string::npos);
    CHECK(early->took < 20s);
  }
  const auto answered = lockstep::joins_requested(joiner);
  {
    waiting_joiner late(joiner, world);
    late.t.join();
    CAPTURE(late.error);
    CHECK(late.error.find("asked to join the job, but job rank 0's ElasticGroup") != std::string::npos);
    CHECK(late.took < 20s);
    CHECK(lockstep::string_of(joiner.get("lockstep.elastic/join/" + std::to_string(answered + 1))) == "withdrawn");
  }
  {
    std::optional<waiting_joiner> early;
    CHECK_THROWS_AS(train(true, early), std::runtime_error);
    early->t.join();
    CAPTURE(early->error);
    CHECK(early->error.find("(its loop did not end cleanly)") != std::string::npos);
  }
  // A later group begins after the answered requests.
  CHECK(lockstep::open_joins(joiner, 9) == lockstep::joins_requested(joiner) + 1);
  // A request its joiner claimed as it gave up is not admitted by a later group.
  const auto n = lockstep::request_join(joiner, world);
  (void)joiner.add("lockstep.elastic/claim/" + std::to_string(n), 1);
  std::int64_t next = n;
  CHECK(lockstep::admit(joiner, 5, std::vector<int>{0}, next, 0, next, 9).joined.empty());
  CHECK(next == n + 1);
}

TEST_CASE("the coordinator's group goes: a replacement waiting to join is refused at once - one that asks later is "
          "told at once and withdrawn - a later group begins after the answered requests - HashStore and TcpStore") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 2 + static_cast<int>(rng() % 2);
  const auto last = 1 + static_cast<std::int64_t>(rng() % 3);
  {
    lockstep::HashStore st(world, 60s);
    check_joins_closed(world, last, [&](int) -> lockstep::HashStore& { return st; }, st);
  }
  const std::string token = "joins-" + std::to_string(rng());
  lockstep::TcpStore server("127.0.0.1", 0, true, world, token, 60s);
  std::map<int, std::unique_ptr<lockstep::TcpStore>> clients;
  for (int r = 1; r <= world; ++r)  // (the last: the joiners')
    clients[r] = std::make_unique<lockstep::TcpStore>("127.0.0.1", server.port(), false, world, token, 60s);
  check_joins_closed(
      world, last, [&](int job) -> lockstep::TcpStore& { return job == 0 ? server : *clients[job]; }, *clients[world]);
}

TEST_CASE("going on with fewer ranks: the same global batch by more micro-steps - or the learning rate rescaled") {
  auto change = [](int before, int after) {
    membership_change c;
    c.before = membership::whole(before, 0);
    c.after = membership::whole(after, 0);
    return c;
  };
  CHECK(lockstep::steps_for_same_global_batch(1, change(4, 2)) == 2);
  CHECK(lockstep::steps_for_same_global_batch(3, change(4, 3)) == 4);
  CHECK(lockstep::steps_for_same_global_batch(2, change(2, 4)) == 1);  // grown back
  CHECK_THROWS_WITH_AS(lockstep::steps_for_same_global_batch(1, change(4, 3)),
                       doctest::Contains("cannot be split evenly over 3; keep the per-rank batch"),
                       lockstep::config_error);
  CHECK(lockstep::lr_for_rank_change(0.3, change(4, 3)) == doctest::Approx(0.225));
}

// ---- growing back and run(Processes)'s parts, on CPU ---------------------------------------

TEST_CASE("growing back: joiners ask - the coordinator admits them at a step boundary - members and joiners read "
          "one membership") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 4 + static_cast<int>(rng() % 4);
  lockstep::HashStore store(world);
  // Members: rank 0 and a random part of the others (epoch 3); the rest may join.
  std::vector<int> members{0}, outside;
  for (int r = 1; r < world; ++r) (rng() % 2 ? members : outside).push_back(r);
  if (outside.empty()) outside.push_back(members.back()), members.pop_back();
  const auto steps = static_cast<std::int64_t>(rng() % 1000);
  // Each outsider asks once; one member's job rank asks too (refused), and one outsider twice.
  std::vector<int> asks(outside);
  const int member_asking = members[rng() % members.size()];
  const int twice = outside[rng() % outside.size()];
  asks.push_back(member_asking);
  asks.push_back(twice);
  std::shuffle(asks.begin(), asks.end(), rng);
  std::map<std::int64_t, int> request_of;  // request number → job rank
  for (int r : asks) request_of[lockstep::request_join(store, r)] = r;
  CHECK(lockstep::joins_requested(store) == static_cast<std::int64_t>(asks.size()));
  std::int64_t next = 1;
  const auto generation = 1 + static_cast<std::int64_t>(rng() % 9);
  const lockstep::growth g = lockstep::admit(store, 4, members, next, steps, next, generation);
  CHECK(next == static_cast<std::int64_t>(asks.size()) + 1);
  std::vector<int> expected = members;
  expected.insert(expected.end(), outside.begin(), outside.end());
  std::sort(expected.begin(), expected.end());
  CHECK(g.epoch == 4);
  CHECK(g.ranks == expected);
  CHECK(g.joined == std::vector<int>([&] {
          auto o = outside;
          std::sort(o.begin(), o.end());
          return o;
        }()));
  CHECK(g.steps == steps);
  const auto read = lockstep::read_growth(store, 4, generation);
  CHECK(read.ranks == g.ranks);
  CHECK(read.joined == g.joined);
  CHECK(read.steps == steps);
  CHECK(read.generation == generation);  // (the joiners take the coordinator's group number)
  // Each request is answered: the first of each outsider admitted, a member's and a second
  // request refused by name.
  std::set<int> admitted;
  for (const auto& [n, r] : request_of) {
    CAPTURE(n);
    CAPTURE(r);
    if (r == member_asking) {
      CHECK_THROWS_WITH_AS(lockstep::await_admission(store, n, r, 1s), doctest::Contains("a member of the running job"),
                           lockstep::aborted_error);
    } else if (admitted.count(r)) {
      CHECK_THROWS_WITH_AS(lockstep::await_admission(store, n, r, 1s),
                           doctest::Contains("joining by an earlier request"), lockstep::aborted_error);
    } else {
      const auto got = lockstep::await_admission(store, n, r, 1s);
      CHECK(got.ranks == g.ranks);
      CHECK(got.steps == steps);
      CHECK(got.generation == generation);
      admitted.insert(r);
    }
  }
  // A request nobody admits times out by name.
  const auto late = lockstep::request_join(store, outside.front());
  CHECK_THROWS_WITH_AS(lockstep::await_admission(store, late, outside.front(), 50ms),
                       doctest::Contains("was not admitted within"), lockstep::timeout_error);
}

TEST_CASE("an ElasticGroup on a context that lends no store is refused by name") {
  lockstep::run(lockstep::Threads{2}, [&](lockstep::context<lockstep::ThreadComm>& ctx) {
    CHECK_THROWS_WITH_AS(lockstep::ElasticGroup(ctx, SurvivorOptions{}), doctest::Contains("lends no store"),
                         lockstep::config_error);
  });
}

TEST_CASE("watchdogs of one membership: the store names each rank gone - a retired one is not - a new key is "
          "apart") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 3;
  const std::string token = "watch-" + std::to_string(rng());
  lockstep::TcpStore server("127.0.0.1", 0, true, world, token, 10s);
  const std::string key = lockstep::membership_failure_key(1 + rng() % 9);
  CHECK(lockstep::membership_failure_key(0) == lockstep::Watchdog::failure_key);
  const lockstep::watchdog_options o{.timeout = 5s, .period = 20ms, .grace = 0ms, .key = key};
  std::atomic<int> fired{0};
  auto make = [&](int r) {
    return std::make_unique<lockstep::Watchdog>(
        "127.0.0.1", server.port(), r, world, token, [&](const std::string&) { ++fired; },
        lockstep::Watchdog::poll_fn{}, o);
  };
  auto one = make(1), two = make(2);
  one->report("rank 1 failed: a test");  // both see the failure under this membership's key
  for (int i = 0; i < 200 && fired < 2; ++i) std::this_thread::sleep_for(10ms);
  CHECK(fired == 2);
  CHECK(lockstep::string_of(server.get(key)) == "rank 1 failed: a test");
  CHECK_FALSE(server.check({lockstep::Watchdog::failure_key}));  // membership 0's key untouched
  one->retire();                                                 // goes on in the next membership: its leave is clean
  two->stop();  // after a failure: its connection closes without a leave, so the store fires
  one.reset();
  two.reset();
  for (int i = 0; i < 200 && !server.check({key + "/rank 2"}); ++i) std::this_thread::sleep_for(10ms);
  CHECK(server.check({key + "/rank 2"}));
  CHECK_FALSE(server.check({key + "/rank 1"}));
}

TEST_CASE("growing back: a request that names no job rank is refused - the others are admitted") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  lockstep::HashStore store(6);
  const int joiner = 1 + static_cast<int>(rng() % 4);
  (void)store.add("lockstep.elastic/joins", 1);  // a joiner that died between its number and its rank
  const auto bad = store.add("lockstep.elastic/joins", 1);
  store.set("lockstep.elastic/join/" + std::to_string(bad), lockstep::bytes_of("rank?"));
  const auto good = lockstep::request_join(store, joiner);
  std::int64_t next = 1;
  const std::vector<int> members{0, 5};
  const auto g = lockstep::admit(store, 2, members, next, 9, next);
  CHECK(g.joined == std::vector<int>{joiner});
  CHECK(next == good + 1);
  CHECK(lockstep::await_admission(store, good, joiner, 1s).ranks == g.ranks);
  for (std::int64_t n : {std::int64_t{1}, bad})
    CHECK_THROWS_WITH_AS(lockstep::await_admission(store, n, 3, 1s), doctest::Contains("named no job rank"),
                         lockstep::aborted_error);
}

// A communicator stand-in for membership_watch: it only records its aborts.
struct AbortRecorder {
  std::atomic<int> aborts{0};
  void abort(const std::string&) { ++aborts; }
};

TEST_CASE("membership_watch: a peer's failure aborts the communicator in place - the store names who is gone - the "
          "next membership's watchdog reaches the communicator only once adopted") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const int world = 3;
  const std::string token = "membership-" + std::to_string(rng());
  lockstep::TcpStore server("127.0.0.1", 0, true, world, token, 10s);
  const lockstep::watchdog_options o{.timeout = 5s, .period = 20ms, .grace = 0ms};
  lockstep::growth whole{0, {0, 1, 2}, 0, {}};
  AbortRecorder comm1, comm2;
  using Watch = lockstep::membership_watch<AbortRecorder>;
  auto w1 =
      std::make_unique<Watch>(server, "127.0.0.1", server.port(), 1, world, token, comm1, Watch::poll_fn{}, o, whole);
  auto w2 =
      std::make_unique<Watch>(server, "127.0.0.1", server.port(), 2, world, token, comm2, Watch::poll_fn{}, o, whole);
  CHECK(w1->start().ranks == whole.ranks);
  CHECK_THROWS_WITH_AS(w1->start(), doctest::Contains("one ElasticGroup"), lockstep::config_error);
  w2->report("rank 2 failed: a test");
  for (int i = 0; i < 300 && (comm1.aborts == 0 || !w1->failure() || !w2->failure()); ++i)
    std::this_thread::sleep_for(10ms);
  CHECK(comm1.aborts == 1);                 // aborted by its watchdog, in place
  CHECK(w1->gone(0, whole.ranks).empty());  // a report names no rank gone: the process is there
  w2.reset();                               // rank 2's process ends after its failure: its watch fires
  std::vector<int> gone;
  for (int i = 0; i < 300 && gone.empty(); ++i, std::this_thread::sleep_for(10ms)) gone = w1->gone(0, whole.ranks);
  CAPTURE(lockstep::detail::rank_list(gone));
  CHECK(gone == std::vector<int>{2});
  w1->leave();
  CHECK(w1->failure() == std::optional<std::string>("rank 2 failed: a test"));  // still said after leave()
  w1->watch(1, std::vector<int>{0, 1});
  CHECK(w1->epoch() == 1);
  CHECK(w1->failure_key() == lockstep::membership_failure_key(1));
  // A failure of the new membership before adopt(): the communicator being made is not
  // touched; adopt() aborts it then and says why.
  server.set(lockstep::membership_failure_key(1), lockstep::bytes_of("rank 0 failed: the next one"));
  for (int i = 0; i < 300 && !w1->failure(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(comm1.aborts == 1);
  const auto why = w1->adopt();
  REQUIRE(why.has_value());
  CHECK(*why == "rank 0 failed: the next one");
  CHECK(comm1.aborts == 2);
  CHECK_FALSE(server.check({lockstep::membership_failure_key(0) + "/rank 1"}));  // rank 1 left membership 0 cleanly
}

TEST_CASE("membership_watch: a communicator never made (a member lost while the group changed) is reported after "
          "the timeout - not waited for") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const std::string token = "made-" + std::to_string(rng());
  lockstep::TcpStore server("127.0.0.1", 0, true, 2, token, 10s);
  const auto limit = std::chrono::milliseconds(200 + rng() % 300);
  const lockstep::watchdog_options o{.timeout = limit, .period = 20ms, .grace = 0ms};
  AbortRecorder comm;
  using Watch = lockstep::membership_watch<AbortRecorder>;
  Watch w(server, "127.0.0.1", server.port(), 1, 2, token, comm, Watch::poll_fn{}, o, {0, {0, 1}, 0, {}});
  w.leave();
  const auto t0 = std::chrono::steady_clock::now();
  w.watch(1, std::vector<int>{0, 1});  // and no adopt(): the communicator is never made
  for (int i = 0; i < 500 && !w.failure(); ++i) std::this_thread::sleep_for(10ms);
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(w.failure().has_value());
  CHECK(w.failure()->find("was not made within") != std::string::npos);
  CHECK(took >= limit);
  CHECK(lockstep::string_of(server.get(lockstep::membership_failure_key(1))) == *w.failure());  // the others hear it
  CHECK(comm.aborts == 0);
}
}  // TEST_SUITE
