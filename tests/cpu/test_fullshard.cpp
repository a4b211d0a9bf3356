// Full sharding on CPU ranks — ShardedGradients (ZeRO-2) and FullySharded (ZeRO-3): the
// MLP's layers (or each parameter) are blocks used through dp.use_block in its forward and
// backward; a run ends with the parameters of the same run unsharded — AdamW on 1..4 ranks,
// blocks whose sizes no rank count divides, a block smaller than the rank count, hooks or
// none, accumulation, dynamic loss scaling with an injected inf (skipped on every rank),
// clipping — with optimizer state and gradients for 1/N of each block per rank, and lent
// buffers of a few blocks, not the model. Misuse of the protocol is named, alike on every rank.
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <type_traits>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "sharded_run.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

template <class T, class Strategy, class Hold = std::nullptr_t, class Start = std::nullptr_t>
sharded_outcome train(const dataset& d, const sharded_config& c, std::uint64_t init_seed, Strategy strategy = {},
                      Hold hold = nullptr, Start start = nullptr) {
  sharded_outcome out;
  out.values.resize(static_cast<std::size_t>(c.ranks));
  lockstep::run(lockstep::Threads{c.ranks},
                [&](auto& ctx) { train_rank_as<T, Strategy, true>(ctx, d, c, init_seed, out, hold, start, strategy); });
  return out;
}

// The MLP's blocks' element counts (per layer, or per parameter).
std::vector<std::size_t> block_sizes(const dataset& d, bool per_parameter) {
  std::vector<std::size_t> b;
  for (std::size_t l = 0; l + 1 < d.dims.size(); ++l) {
    const auto w = static_cast<std::size_t>(d.dims[l] * d.dims[l + 1]), bias = static_cast<std::size_t>(d.dims[l + 1]);
    if (per_parameter) {
      b.push_back(w);
      b.push_back(bias);
    } else {
      b.push_back(w + bias);
    }
  }
  return b;
}

template <class T, class Strategy>
void check_equals_unsharded(const dataset& d, const sharded_config& c, Strategy strategy = {}) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(c.ranks);
  CAPTURE(c.accumulate);
  CAPTURE(c.hooks);
  CAPTURE(c.block_per_parameter);
  CAPTURE(c.max_norm);
  CAPTURE(c.inf_step);
  const auto plain = train<T, lockstep::Replicated>(d, c, seed + 1);
  const auto sharded = train<T, Strategy>(d, c, seed + 1, strategy);
  TestMlp<T> init(d.dims, seed + 1);
  std::vector<double> v0;
  for (auto x : init.flat_values()) v0.push_back(static_cast<double>(x));
  CHECK(max_rel_diff(v0, plain.values[0]) > 1e-3);  // it trained
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  for (int r = 0; r < c.ranks; ++r) {
    CAPTURE(r);
    CHECK(sharded.values[static_cast<std::size_t>(r)] == sharded.values[0]);
    CHECK(max_rel_diff(sharded.values[static_cast<std::size_t>(r)], plain.values[0]) <= tol);
  }
  CHECK(sharded.applied == plain.applied);
  CHECK(sharded.final_scale == plain.final_scale);
  for (std::size_t s = 0; s < plain.norms.size(); ++s) {
    if (std::isnan(plain.norms[s])) CHECK(std::isnan(sharded.norms[s]));
    else CHECK(std::abs(sharded.norms[s] - plain.norms[s]) <= tol * plain.norms[s]);
  }
  // State, gradient shards: ceil(block / N) per block. Lent buffers, pooled per size: of each
  // block size a few — a layer's blocks in use, one prefetched, two reduce-scatters in flight.
  const std::size_t N = static_cast<std::size_t>(c.ranks);
  std::size_t shard = 0, total = 0;
  std::set<std::size_t> padded;  // the distinct block sizes, padded to a multiple of N
  for (auto b : block_sizes(d, c.block_per_parameter)) {
    shard += (b + N - 1) / N;
    padded.insert((b + N - 1) / N * N);
    total += b;
  }
  const std::size_t sizes = std::accumulate(padded.begin(), padded.end(), std::size_t{0});
  CHECK(sharded.state_elements == shard);
  CHECK(sharded.shard_bytes == shard * sizeof(T));
  CHECK(sharded.lent_bytes > 0);
  std::size_t buffers = c.block_per_parameter ? 8 : 6;  // with one block prefetched
  if constexpr (std::is_same_v<Strategy, lockstep::FullySharded>) {
    buffers += static_cast<std::size_t>(std::max(0, strategy.buffers.prefetch - 1));
    if (strategy.keep_after_forward) buffers = 4 * block_sizes(d, c.block_per_parameter).size();  // all values kept
  }
  CHECK(sharded.lent_bytes <= buffers * sizes * sizeof(T));
  if (d.dims.size() > 8) CHECK(sharded.lent_bytes < total * sizeof(T));  // a deep model: less than its gradients
  if (c.model_storage) {  // every buffer from the model, none pooled: asked for anew at every use,
    // and each gradient shard anew in every cycle (given back when the next one begins)
    const auto blocks = block_sizes(d, c.block_per_parameter).size();
    CHECK(sharded.storage_allocations >= static_cast<std::size_t>(c.steps * (c.accumulate + 1)) * blocks);
    CHECK(sharded.storage_left == sharded.shard_bytes);  // the last cycle's gradient shards, nothing else
    CHECK(sharded.storage_peak >= sharded.lent_bytes);
    CHECK(sharded.storage_peak <= sharded.lent_bytes + sharded.shard_bytes);
  }
}

// dims whose second hidden layer has 3 units: with per-parameter blocks, a bias of 3 elements
// is a block smaller than 4 ranks.
dataset narrow_data(std::uint64_t seed) {
  auto d = make_data(seed, 211);
  d.dims = {13, 17, 3, 5};
  return d;
}

// A checkpoint of a fully sharded run after step at − 1 (train()'s hold): the whole values and
// the optimizer's shards gathered on every rank, rank 0's kept in `saved`; and its restore
// (train()'s start).
auto save_after(int at, lockstep::Checkpoint& saved) {
  return [at, &saved](auto& ctx, auto& dp, auto& opt, int s) {
    if (s != at - 1) return;
    auto state = lockstep::gather_sharded(dp, opt);
    lockstep::Checkpoint ck;
    lockstep::add_training_state(ck, dp);
    ck.add_blob("optimizer", std::move(state));
    if (ctx.rank() == 0) saved = ck;
  };
}
auto restore_from(const lockstep::Checkpoint& saved) {
  return [&saved](auto& dp, auto& opt) {
    lockstep::restore_training_state(saved, dp);
    lockstep::load_sharded(dp, opt, saved.blob("optimizer"));
  };
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE_TEMPLATE("fullshard zero2 zero3: AdamW on N ranks equals the unsharded run", T, float, double) {
  const auto d = make_data(fresh_seed(), 211);
  for (int n : {1, 2, 3, 4}) {
    sharded_config c;
    c.ranks = n;
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, c);
    check_equals_unsharded<T, lockstep::FullySharded>(d, c);
    c.hooks = false;  // each block's gradients final when its backward use ends
    check_equals_unsharded<T, lockstep::FullySharded>(d, c);
    c.block_per_parameter = true;
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, c);
    check_equals_unsharded<T, lockstep::FullySharded>(d, c);
  }
  auto deep = d;  // ten hidden layers: the lent buffers hold less than the model's gradients
  deep.dims = {13, 17, 17, 17, 17, 17, 17, 17, 17, 17, 17, 5};
  sharded_config c;
  c.ranks = 3;
  check_equals_unsharded<T, lockstep::FullySharded>(deep, c);
  check_equals_unsharded<T, lockstep::ShardedGradients>(deep, c);
}

TEST_CASE_TEMPLATE("fullshard zero2 zero3: block buffers from the model's allocator", T, float, double) {
  const auto d = make_data(fresh_seed(), 211);
  for (int n : {1, 2, 3}) {
    sharded_config c;
    c.ranks = n;
    c.model_storage = true;
    c.accumulate = 2;
    c.inf_step = 2;
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, c);
    check_equals_unsharded<T, lockstep::FullySharded>(d, c);
    lockstep::FullySharded keep;
    keep.keep_after_forward = true;
    keep.buffers.prefetch = 2;
    check_equals_unsharded<T, lockstep::FullySharded>(d, c, keep);
    c.model_storage = false;  // the gradient shards kept from cycle to cycle (zeroed when one begins)
    keep.buffers.keep_gradient_shards = true;
    check_equals_unsharded<T, lockstep::FullySharded>(d, c, keep);
    lockstep::ShardedGradients kept{};
    kept.buffers.keep_gradient_shards = true;
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, c, kept);
  }
}

TEST_CASE_TEMPLATE("fullshard zero3: blocks smaller than the rank count - prefetch and kept values", T, float, double) {
  const auto d = narrow_data(fresh_seed());
  for (int n : {3, 4}) {
    sharded_config c;
    c.ranks = n;
    c.block_per_parameter = true;
    check_equals_unsharded<T, lockstep::FullySharded>(d, c);
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, c);
    check_equals_unsharded<T, lockstep::FullySharded>(d, c, lockstep::FullySharded{.keep_after_forward = true});
    check_equals_unsharded<T, lockstep::FullySharded>(
        d, c, lockstep::FullySharded{.buffers = {.prefetch = 0, .scatters_in_flight = 1}});
    check_equals_unsharded<T, lockstep::FullySharded>(d, c, lockstep::FullySharded{.buffers = {.prefetch = 3}});
  }
}

// An exception out of a block's backward (every rank alike), caught by the training loop: the
// step is dropped — no collective on one rank alone, the reduce-scatters it had issued never
// reach the next step's shards, the blocks it left in use are released — and training goes on
// exactly as if that step had never run.
TEST_CASE_TEMPLATE("fullshard zero2 zero3: a step abandoned by an exception in backward is dropped", T, float, double) {
  const auto seed = fresh_seed();
  const auto d = narrow_data(seed);
  for (int n : {2, 3}) {
    sharded_config skipped;
    skipped.ranks = n;
    skipped.skip_step = 2;
    sharded_config abandoned = skipped;
    abandoned.skip_step = -1;
    abandoned.abandon_step = 2;
    const auto want = train<T, lockstep::FullySharded>(d, skipped, seed + 9);
    const auto got = train<T, lockstep::FullySharded>(d, abandoned, seed + 9);
    for (std::size_t r = 0; r < got.values.size(); ++r) CHECK(got.values[r] == want.values[r]);
    const auto want2 = train<T, lockstep::ShardedGradients>(d, skipped, seed + 9);
    const auto got2 = train<T, lockstep::ShardedGradients>(d, abandoned, seed + 9);
    for (std::size_t r = 0; r < got2.values.size(); ++r) CHECK(got2.values[r] == want2.values[r]);
  }
}

// Within the abandoned step: finish() is refused by name (its gradients are incomplete), and
// the values can still be gathered whole (a checkpoint after the failure) — the same as before
// the step, on every rank.
TEST_CASE("fullshard zero3: after an exception in backward finish() is refused - the values gather whole") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = narrow_data(seed);
  std::vector<std::vector<float>> before(2), after(2);
  std::vector<int> refused(2, 0);
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    TestMlp<float> m(d.dims, seed + 1);
    lockstep::DataParallel dp(ctx, m, lockstep::FullySharded{});
    using DP = decltype(dp);
    dp.wait_all_parameters();
    before[r] = m.flat_values();
    auto step = dp.step();
    const std::vector<std::size_t> rows{r, r + 2, r + 4};
    try {
      m.forward_backward(inputs<float>(d), d.y, rows, step.on_gradient_ready(), 1.0, [&](std::size_t l, bool fwd) {
        std::vector<lockstep::block_use<DP>> held;
        held.push_back(dp.use_block(m.blocks()[2 * l], fwd ? lockstep::pass::forward : lockstep::pass::backward));
        if (!fwd && l == 1) throw abandoned_step{};
        return held;
      });
    } catch (const abandoned_step&) {
    }
    try {
      (void)step.finish();
    } catch (const lockstep::config_error& e) {
      refused[r] = std::string(e.what()).find("abandoned") != std::string::npos ? 1 : 2;
    }
    dp.wait_all_parameters();
    after[r] = m.flat_values();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(refused[r] == 1);
    CHECK(after[r] == before[0]);
  }
}

TEST_CASE_TEMPLATE("fullshard zero2 zero3: accumulation - loss scaling with an injected inf - clipping", T, float,
                   double) {
  std::mt19937_64 rng(fresh_seed());
  const auto d = make_data(rng(), 211);
  for (int n : {2, 3, 4}) {
    sharded_config c;
    c.ranks = n;
    c.accumulate = 2;
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, c);
    check_equals_unsharded<T, lockstep::FullySharded>(d, c);
    sharded_config inf = c;
    inf.inf_step = 2;
    inf.inf_at = std::uniform_int_distribution<std::size_t>(0, 13 * 17 - 1)(rng);  // anywhere in the first weight
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, inf);
    check_equals_unsharded<T, lockstep::FullySharded>(d, inf);
    inf.accumulate = 1;  // values kept from forward to backward, prefetched two ahead, around the skipped step
    check_equals_unsharded<T, lockstep::FullySharded>(
        d, inf, lockstep::FullySharded{.buffers = {.prefetch = 2}, .keep_after_forward = true});
    sharded_config clip = c;
    clip.max_norm = 0.05;  // below the norms of this model: every step clips
    check_equals_unsharded<T, lockstep::FullySharded>(d, clip);
    clip.accumulate = 1;
    clip.block_per_parameter = true;
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, clip);
  }
}

// A checkpoint of a fully sharded run — the whole values gathered into it on every rank and
// saved by rank 0 (a consolidated state), the optimizer's shards through gather_sharded —
// resumes bit for bit on as many ranks, and on other rank counts up to the rounding of sums
// split otherwise; each rank takes its new shards from the whole values.
TEST_CASE_TEMPLATE("fullshard zero2 zero3: a checkpoint resumes - bit for bit and on 1 - 2 - 3 ranks", T, float,
                   double) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const sharded_config c{.ranks = 4, .batch = 3, .steps = 6};
  const int at = 3;
  lockstep::Checkpoint saved;
  const auto whole = train<T, lockstep::FullySharded>(d, c, seed + 1, {}, save_after(at, saved));
  const auto load = restore_from(saved);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 2e-6;
  for (const auto& [ranks, batch] : {std::pair{4, std::size_t{3}}, {1, 12}, {2, 6}, {3, 4}}) {
    CAPTURE(ranks);
    sharded_config rest = c;
    rest.ranks = ranks;
    rest.batch = batch;
    rest.first_step = at;
    const auto resumed = train<T, lockstep::FullySharded>(d, rest, seed + 99, {}, nullptr, load);
    const auto zero2 = train<T, lockstep::ShardedGradients>(d, rest, seed + 77, {}, nullptr, load);
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      if (ranks == c.ranks) CHECK(resumed.values[static_cast<std::size_t>(r)] == whole.values[0]);
      CHECK(max_rel_diff(resumed.values[static_cast<std::size_t>(r)], whole.values[0]) <= tol);
      CHECK(max_rel_diff(zero2.values[static_cast<std::size_t>(r)], whole.values[0]) <= tol);
    }
    CHECK(resumed.final_scale == whole.final_scale);
  }
}

// FullySharded::gather_wire keeps no state of its own (each use decodes the exact masters
// anew): a checkpoint — the exact values, gathered in fp32 — resumes bit for bit, both codecs.
TEST_CASE("fullshard zero3: a checkpoint of a gather_wire run resumes bit for bit - bf16 and int8") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const sharded_config c{.ranks = 3, .batch = 4, .steps = 6};
  const int at = 3;
  for (const auto wire : {lockstep::wire_format::bf16, lockstep::wire_format::int8}) {
    const std::string format = lockstep::name_of(wire);
    CAPTURE(format);
    lockstep::FullySharded fs;
    fs.gather_wire = wire;
    lockstep::Checkpoint saved;
    const auto whole = train<float, lockstep::FullySharded>(d, c, seed + 1, fs, save_after(at, saved));
    sharded_config rest = c;
    rest.first_step = at;
    const auto resumed = train<float, lockstep::FullySharded>(d, rest, seed + 99, fs, nullptr, restore_from(saved));
    for (const auto& v : resumed.values) CHECK(v == whole.values[0]);
    const auto fp32 = train<float, lockstep::FullySharded>(d, c, seed + 1);
    CHECK(whole.values[0] != fp32.values[0]);  // (the wire rounded what the forward saw)
  }
}

// The wire's numbers do not depend on how the block buffers are held: prefetch 0 and 2, values
// kept from forward to backward, buffers (and staging) from the model's allocator, accumulation
// with an injected inf, a step abandoned mid-backward — each run ends bit for bit where the
// same run with the defaults ends, and not where the fp32 gathers end.
TEST_CASE("fullshard zero3: gather_wire alike under any block buffers - prefetch - kept - the model's allocator") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  for (const auto wire : {lockstep::wire_format::bf16, lockstep::wire_format::int8}) {
    const std::string format = lockstep::name_of(wire);
    CAPTURE(format);
    lockstep::FullySharded fs;
    fs.gather_wire = wire;
    for (const auto& base : {sharded_config{.ranks = 3, .batch = 4, .steps = 4},
                             sharded_config{.ranks = 2, .accumulate = 2, .steps = 5, .inf_step = 2}}) {
      const auto ref = train<float, lockstep::FullySharded>(d, base, seed + 1, fs);
      CHECK(ref.values[0] != train<float, lockstep::FullySharded>(d, base, seed + 1).values[0]);
      auto variant = fs;
      for (int prefetch : {0, 2}) {
        CAPTURE(prefetch);
        variant.buffers.prefetch = prefetch;
        CHECK(train<float, lockstep::FullySharded>(d, base, seed + 1, variant).values == ref.values);
      }
      variant = fs;
      variant.keep_after_forward = true;
      CHECK(train<float, lockstep::FullySharded>(d, base, seed + 1, variant).values == ref.values);
      auto from_model = base;
      from_model.model_storage = true;
      CHECK(train<float, lockstep::FullySharded>(d, from_model, seed + 1, fs).values == ref.values);
    }
    // An abandoned step drops alike with the wire: as a run that skipped it.
    sharded_config abandon{.ranks = 3, .steps = 5, .abandon_step = 2}, skip = abandon;
    skip.abandon_step = -1;
    skip.skip_step = 2;
    CHECK(train<float, lockstep::FullySharded>(d, abandon, seed + 1, fs).values ==
          train<float, lockstep::FullySharded>(d, skip, seed + 1, fs).values);
  }
}

// Each rank runs `misuse` on a fresh FullySharded DataParallel over a 3-layer TestMlp and
// reports what it threw: every rank must end with the same message, naming the mistake.
template <class Misuse>
std::vector<std::string> misuse_messages(int ranks, Misuse misuse) {
  std::vector<std::string> got(static_cast<std::size_t>(ranks));
  const auto d = make_data(fresh_seed(), 64);
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
    TestMlp<float> m(d.dims, 7);
    lockstep::DataParallel<TestMlp<float>, Comm, lockstep::FullySharded> dp(ctx, m);
    try {
      misuse(dp, m);
    } catch (const lockstep::config_error& e) {
      got[static_cast<std::size_t>(ctx.rank())] = e.what();
    }
  });
  return got;
}

TEST_CASE("fullshard zero3: misuse of the block protocol is named on every rank") {
  using lockstep::pass;
  const auto same_on_all = [](const std::vector<std::string>& got, const char* part) {
    CAPTURE(got[0]);
    CHECK(got[0].find(part) != std::string::npos);
    for (const auto& g : got) CHECK(g == got[0]);
  };
  same_on_all(misuse_messages(2,
                              [](auto& dp, auto&) {
                                auto step = dp.step();
                                {
                                  auto u = dp.use_block(0, pass::forward);
                                }
                                auto again = dp.use_block(0, pass::forward);
                              }),
              "requested twice in one forward");
  same_on_all(misuse_messages(2,
                              [](auto& dp, auto&) {
                                auto step = dp.step();
                                auto u = dp.use_block(1, pass::backward);
                              }),
              "never used in this step's forward");
  same_on_all(misuse_messages(3,
                              [](auto& dp, auto&) {
                                auto step = dp.step();
                                {
                                  auto u = dp.use_block(2, pass::forward);
                                }
                                auto u = dp.use_block(2, pass::forward);
                              }),
              "block 2 is requested twice");
  same_on_all(misuse_messages(2,
                              [](auto& dp, auto&) {
                                auto step = dp.step();
                                {
                                  auto u = dp.use_block(0, pass::forward);
                                }
                                step.gradient_ready(0);  // its backward use never began
                              }),
              "got a gradient outside the backward use of its block 0");
  same_on_all(misuse_messages(2,
                              [](auto& dp, auto&) {
                                auto step = dp.step();
                                auto u = dp.use_block(0, pass::forward);
                                (void)step.finish([](std::span<const lockstep::param_slice>) {});
                                auto next = dp.step();
                              }),
              "still in use at the next step");
  same_on_all(misuse_messages(2, [](auto& dp, auto&) { auto u = dp.use_block(7, pass::forward); }),
              "the model has 3 blocks");
  same_on_all(misuse_messages(2, [](auto& dp, auto&) { auto u = dp.use_block(0, pass::backward); }), "outside a step");
}

TEST_CASE("fullshard zero2: blocks() of another length than parameters() is refused at construction") {
  struct short_blocks : TestMlp<float> {
    using TestMlp<float>::TestMlp;
    std::vector<std::size_t> blocks() const { return {0, 0, 1, 1, 2}; }
  };
  const auto d = make_data(fresh_seed(), 16);
  std::string got;
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
    short_blocks m(d.dims, 3);
    try {
      lockstep::DataParallel<short_blocks, Comm, lockstep::ShardedGradients> dp(ctx, m);
    } catch (const lockstep::config_error& e) {
      if (ctx.rank() == 0) got = e.what();
    }
  });
  CHECK(got.find("model.blocks() lists 5 blocks, but the model has 6 parameters") != std::string::npos);
}

}  // TEST_SUITE
