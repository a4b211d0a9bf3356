// ShardedOptimizer (ZeRO-1) on CPU ranks: a sharded run ends with the parameters of the same
// run unsharded — AdamW on 1..4 ranks, a model whose size no rank count divides, tiny buckets
// (tensors split over buckets and shards), zero-copy and packed gradients, accumulation,
// dynamic loss scaling with an injected inf (the step is skipped on every rank), clipping by
// the global norm summed over the shards — with state for 1/N of the parameters per rank, and
// checkpoints of the sharded state that resume bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <type_traits>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "sharded_run.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

using config = sharded_config;
using outcome = sharded_outcome;

template <class T, bool Sharded, bool Bindable, class Hold = std::nullptr_t, class Start = std::nullptr_t>
outcome train(const dataset& d, const config& c, std::uint64_t init_seed, Hold hold = nullptr, Start start = nullptr) {
  outcome out;
  out.values.resize(static_cast<std::size_t>(c.ranks));
  lockstep::run(lockstep::Threads{c.ranks},
                [&](auto& ctx) { train_rank<T, Sharded, Bindable>(ctx, d, c, init_seed, out, hold, start); });
  return out;
}

template <class T, bool Bindable>
void check_sharded_equals_unsharded(const config& c) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  CAPTURE(c.ranks);
  CAPTURE(c.accumulate);
  CAPTURE(c.hooks);
  CAPTURE(Bindable);
  CAPTURE(c.buckets.cap_bytes);
  CAPTURE(c.max_norm);
  CAPTURE(c.inf_step);
  const auto d = make_data(seed, 211);
  const auto plain = train<T, false, Bindable>(d, c, seed + 1);
  const auto sharded = train<T, true, Bindable>(d, c, seed + 1);
  // The run trained (values moved) and all ranks agree bit for bit.
  TestMlp<T> init(d.dims, seed + 1);
  std::vector<double> v0;
  for (auto x : init.flat_values()) v0.push_back(static_cast<double>(x));
  CHECK(max_rel_diff(v0, plain.values[0]) > 1e-3);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  for (int r = 0; r < c.ranks; ++r) {
    CAPTURE(r);
    CHECK(sharded.values[static_cast<std::size_t>(r)] == sharded.values[0]);
    CHECK(max_rel_diff(sharded.values[static_cast<std::size_t>(r)], plain.values[0]) <= tol);
  }
  if (c.max_norm == 0) CHECK(sharded.values[0] == plain.values[0]);  // same sums, same updates
  CHECK(sharded.applied == plain.applied);
  CHECK(sharded.values_bound == Bindable);  // a model offering bind_value trains in the shards' arena
  CHECK(!plain.values_bound);
  CHECK(sharded.final_scale == plain.final_scale);
  for (std::size_t s = 0; s < plain.norms.size(); ++s) {
    if (std::isnan(plain.norms[s])) CHECK(std::isnan(sharded.norms[s]));
    else CHECK(std::abs(sharded.norms[s] - plain.norms[s]) <= 1e-12 * plain.norms[s]);
  }
  // State for this rank's shard only: ceil(P / N) elements per state buffer, and the same
  // number of bytes in the gradient arena's shard.
  const std::size_t P = parameter_count(d), N = static_cast<std::size_t>(c.ranks);
  CHECK(plain.state_elements == P);
  CHECK(sharded.state_elements == (P + N - 1) / N);
  CHECK(sharded.shard_bytes == (P + N - 1) / N * sizeof(T));
}

// The sharded run of config c, whose training state and sharded optimizer state after step
// at − 1 go into `saved` (what a checkpoint holds). Bindable: the values in the shards' arena.
template <class T, bool Bindable = true>
outcome train_saving(const dataset& d, const config& c, std::uint64_t init_seed, int at, lockstep::Checkpoint& saved) {
  return train<T, true, Bindable>(d, c, init_seed, [&](auto& ctx, auto& dp, auto& opt, int s) {
    if (s != at - 1) return;
    auto state = lockstep::gather_sharded(dp, opt);
    if (ctx.rank() == 0) {
      lockstep::Checkpoint ck;
      lockstep::add_training_state(ck, dp);
      ck.add_blob("optimizer", std::move(state));
      saved = ck;
    }
  });
}

// The sharded run of config c from step `at` on, with fresh models (other initial values): the
// training state and the sharded optimizer state come from `saved`; then loaded(dp, opt).
template <class T, bool Bindable = true, class Loaded = std::nullptr_t>
outcome resume(const dataset& d, config c, int at, const lockstep::Checkpoint& saved, std::uint64_t init_seed,
               Loaded loaded = nullptr) {
  c.first_step = at;
  return train<T, true, Bindable>(d, c, init_seed, nullptr, [&](auto& dp, auto& opt) {
    lockstep::restore_training_state(saved, dp);
    lockstep::load_sharded(dp, opt, saved.blob("optimizer"));
    if constexpr (!std::is_same_v<Loaded, std::nullptr_t>) loaded(dp, opt);
  });
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE_TEMPLATE("sharded: AdamW on N ranks equals the unsharded run - zero-copy and packed", T, float, double) {
  for (int n : {1, 2, 3, 4}) {
    config c;
    c.ranks = n;
    check_sharded_equals_unsharded<T, true>(c);
    check_sharded_equals_unsharded<T, false>(c);
    c.hooks = false;  // every bucket reduced in finish()
    check_sharded_equals_unsharded<T, true>(c);
  }
}

TEST_CASE_TEMPLATE("sharded: tiny buckets split tensors over buckets and shards", T, float, double) {
  for (int n : {2, 3, 4}) {
    config c;
    c.ranks = n;
    c.buckets = {.first_bytes = 4 * sizeof(T) * 7, .cap_bytes = 4 * sizeof(T) * 19};
    check_sharded_equals_unsharded<T, true>(c);
    check_sharded_equals_unsharded<T, false>(c);
  }
}

TEST_CASE_TEMPLATE("sharded: accumulation - loss scaling with an injected inf - clipping", T, float, double) {
  std::mt19937_64 rng(fresh_seed());
  for (int n : {2, 3, 4}) {
    config c;
    c.ranks = n;
    c.accumulate = 2;
    c.buckets = {.first_bytes = 256, .cap_bytes = 1024};
    check_sharded_equals_unsharded<T, true>(c);
    config inf = c;
    inf.inf_step = 2;
    inf.inf_at = std::uniform_int_distribution<std::size_t>(0, 13 * 17 - 1)(rng);  // anywhere in the first weight
    check_sharded_equals_unsharded<T, true>(inf);
    config clip = c;
    clip.max_norm = 0.05;  // below the norms of this model: every step clips
    check_sharded_equals_unsharded<T, true>(clip);
    check_sharded_equals_unsharded<T, false>(clip);
  }
}

TEST_CASE("sharded: the skipped step is skipped on every rank and clipping reports the norm") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const config c{.ranks = 3, .steps = 4, .max_norm = 0.05, .inf_step = 1};
  const auto got = train<float, true, true>(d, c, seed + 1);
  CHECK(got.applied == std::vector<int>{1, 0, 1, 1});
  CHECK(got.final_scale == 512.0);  // halved once; 3 clean steps (growth_interval) not reached after it
  CHECK(std::isfinite(got.norms[0]));
  CHECK(got.norms[0] > c.max_norm);  // so it clipped
}

TEST_CASE_TEMPLATE("sharded: a checkpoint of the sharded state resumes bit for bit", T, float, double) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const config c{.ranks = 3, .steps = 6, .buckets = {.first_bytes = 300, .cap_bytes = 700}};
  const int at = 3;
  lockstep::Checkpoint saved;
  const auto whole = train_saving<T>(d, c, seed + 1, at, saved);
  // Fresh models (other initial values) take everything from the checkpoint.
  const auto resumed = resume<T>(d, c, at, saved, seed + 99);
  for (int r = 0; r < c.ranks; ++r) CHECK(resumed.values[static_cast<std::size_t>(r)] == whole.values[0]);
  CHECK(resumed.final_scale == whole.final_scale);
}

// With a low-precision gather_wire the masters are apart from the values the model reads: a
// checkpoint (which makes the replicas exact first) holds the masters, and the resumed run
// continues bit for bit — also packed, deferred, with accumulation and an injected inf.
TEST_CASE("sharded gather_wire: a checkpoint resumes bit for bit - bf16 and int8 - deltas and values - bound and "
          "packed") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const int at = 3;
  using lockstep::wire_format;
  const auto check = [&]<bool Bindable>(std::bool_constant<Bindable>, wire_format wire, bool deltas, bool deferred) {
    CAPTURE(Bindable);
    CAPTURE(lockstep::name_of(wire));
    CAPTURE(deltas);
    CAPTURE(deferred);
    const config c{.ranks = 3,
                   .accumulate = 2,
                   .steps = 7,
                   .buckets = {.first_bytes = 300, .cap_bytes = 700},
                   .inf_step = 5,
                   .inf_at = 3,
                   .gather_in_forward = deferred,
                   .gather_wire = wire,
                   .gather_deltas = deltas};
    lockstep::Checkpoint saved;
    const auto whole = train_saving<float, Bindable>(d, c, seed + 1, at, saved);
    const auto resumed = resume<float, Bindable>(d, c, at, saved, seed + 99);
    CHECK(whole.values_bound == Bindable);
    for (int r = 0; r < c.ranks; ++r) CHECK(resumed.values[static_cast<std::size_t>(r)] == whole.values[0]);
    CHECK(resumed.final_scale == whole.final_scale);
    CHECK(resumed.applied == std::vector<int>(whole.applied.begin() + at, whole.applied.end()));
    // and the wire changed the run: the fp32 gather's ends elsewhere
    config fp32 = c;
    fp32.gather_wire = wire_format::fp32;
    CHECK(train<float, true, Bindable>(d, fp32, seed + 1).values[0] != whole.values[0]);
  };
  for (const auto wire : {wire_format::bf16, wire_format::int8})
    for (const bool deferred : {false, true}) {
      for (const bool deltas : {true, false}) check(std::true_type{}, wire, deltas, deferred);
      check(std::false_type{}, wire, true, deferred);  // packed: the values apart from the shards' arena
    }
}

// Resharding: state saved by 4 ranks resumes on 1, 2 and 3 ranks (the same global batch of 12
// rows per step, split otherwise) and on 4 ranks with other bucket sizes (another shard
// layout): each rank cuts its new shards from the saved ones through their shard maps. The
// run ends where the uninterrupted 4-rank run ends, up to the rounding of sums split otherwise.
TEST_CASE_TEMPLATE("sharded: a checkpoint saved on 4 ranks resumes on 1 - 2 - 3 ranks and on other buckets", T, float,
                   double) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const config c{.ranks = 4, .batch = 3, .steps = 6, .buckets = {.first_bytes = 300, .cap_bytes = 700}};
  const int at = 3;
  lockstep::Checkpoint saved;
  const auto whole = train_saving<T>(d, c, seed + 1, at, saved);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 2e-6;
  struct target {
    int ranks;
    std::size_t batch;
    lockstep::BucketPolicy buckets;
  };
  for (const target t : {target{1, 12, c.buckets}, target{2, 6, c.buckets}, target{3, 4, c.buckets},
                         target{4, 3, {.first_bytes = 200, .cap_bytes = 1500}}}) {
    CAPTURE(t.ranks);
    CAPTURE(t.buckets.cap_bytes);
    config rest = c;
    rest.ranks = t.ranks;
    rest.batch = t.batch;
    rest.buckets = t.buckets;
    std::size_t saved_state = 0;
    const auto resumed = resume<T>(d, rest, at, saved, seed + 99, [&](auto& dp, auto& opt) {
      if (dp.rank() == 0) saved_state = opt.slot_count();
    });
    CHECK(saved_state > 0);  // the state was loaded, not started afresh
    for (int r = 0; r < t.ranks; ++r) {
      CAPTURE(r);
      CHECK(resumed.values[static_cast<std::size_t>(r)] == resumed.values[0]);
      CHECK(max_rel_diff(resumed.values[static_cast<std::size_t>(r)], whole.values[0]) <= tol);
    }
    CHECK(resumed.final_scale == whole.final_scale);
  }
  // Started afresh instead (no optimizer state): AdamW's moments from zero end elsewhere.
  config rest = c;
  rest.ranks = 2;
  rest.batch = 6;
  rest.first_step = at;
  const auto fresh = train<T, true, true>(d, rest, seed + 99, nullptr,
                                          [&](auto& dp, auto&) { lockstep::restore_training_state(saved, dp); });
  CHECK(max_rel_diff(fresh.values[0], whole.values[0]) > 100 * tol);
}

// The cut itself, on a state written by hand in the optimizer checkpoint layout (AdamW with
// fp32 masters, as FusedAdamW writes for bf16 parameters): two saved ranks — rank 0's
// shard holds parameter 0's elements [0, 3) and a padding element, rank 1's parameter 0's
// [3, 5) and parameter 1's [0, 2) — become one rank's shard of 8 (5 + 2 + padding). Moments
// and masters must follow their elements; padding gets zeros.
TEST_CASE("sharded: resharding moves moments and fp32 masters with their elements - padding gets zeros") {
  using lockstep::detail::shard_segment;
  using Rule = lockstep::AdamWRule;
  std::mt19937_64 rng(fresh_seed());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const lockstep::AdamWOptions o{.lr = 0.01, .weight_decay = 0.05};
  // one saved rank: one slot of n elements, 2 moments and masters, stepped 7 times
  const auto blob = [&](std::size_t n, std::vector<float>(&arr)[3]) {
    lockstep::byte_writer w;
    w.write_bytes(Rule::magic_with_masters, 8);
    lockstep::detail::save_options<Rule>(w, o);
    w.write(std::uint64_t{1});
    lockstep::detail::put_slot_header(w, {true, lockstep::dtype::f32, n, 7}, Rule::saves_step);
    for (auto& a : arr) {
      a.resize(n);
      for (auto& x : a) x = u(rng);
    }
    w.write_elements(std::span<const float>(arr[0]));
    w.write_elements(std::span<const float>(arr[1]));
    w.write(std::uint64_t{1});  // masters: slot 0
    w.write(std::uint64_t{0});
    w.write(static_cast<std::uint64_t>(n));
    w.write_elements(std::span<const float>(arr[2]));
    return std::move(w).release();
  };
  std::vector<float> a[3], b[3];  // moment 1, moment 2, masters of saved ranks 0 and 1
  const auto bytes0 = blob(4, a), bytes1 = blob(4, b);
  std::vector<lockstep::detail::saved_optimizer> saved{lockstep::detail::index_saved_optimizer<Rule>(bytes0, "rank 0"),
                                                       lockstep::detail::index_saved_optimizer<Rule>(bytes1, "rank 1")};
  std::vector<std::vector<std::vector<shard_segment>>> maps{{{{0, 0, 3, 0}}}, {{{0, 3, 2, 0}, {1, 0, 2, 2}}}};
  const std::vector<std::vector<shard_segment>> mine{{{0, 0, 5, 0}, {1, 0, 2, 5}}};
  const std::vector<std::size_t> counts{8};
  const auto out = lockstep::detail::reshard_optimizer_state<Rule>(saved, maps, mine, counts);
  // Expected, element by element, from the hand-made inputs.
  std::vector<float> want[3];
  for (int k = 0; k < 3; ++k) want[k] = {a[k][0], a[k][1], a[k][2], b[k][0], b[k][1], b[k][2], b[k][3], 0.0f};
  lockstep::byte_reader r(out, "resharded");
  r.expect_magic(std::string_view(Rule::magic_with_masters, 8), "reshard");
  CHECK(lockstep::detail::load_options<Rule>(r).lr == o.lr);
  REQUIRE(r.read<std::uint64_t>() == 1);
  const auto h = lockstep::detail::get_slot_header(r, 0, Rule::saves_step, true);
  CHECK(h.has);
  CHECK(h.count == 8);
  CHECK(h.step == 7);
  std::vector<float> got(8);
  for (int k = 0; k < 2; ++k) {
    r.read_elements(std::span<float>(got));
    CHECK(got == want[k]);
  }
  REQUIRE(r.read<std::uint64_t>() == 1);
  CHECK(r.read<std::uint64_t>() == 0);
  CHECK(r.read<std::uint64_t>() == 8);
  r.read_elements(std::span<float>(got));
  CHECK(got == want[2]);
  r.expect_end();
  // A saved state that does not cover what the new shard needs is refused.
  const std::vector<std::vector<shard_segment>> more{{{0, 0, 6, 0}}};
  CHECK_THROWS_WITH_AS(lockstep::detail::reshard_optimizer_state<Rule>(saved, maps, more, counts),
                       doctest::Contains("covers 5 of the 6 elements of parameter 0"), lockstep::checkpoint_error);
}

TEST_CASE_TEMPLATE("sharded gather_in_forward: the all-gather waited for in the next forward equals the unsharded run",
                   T, float, double) {
  std::mt19937_64 rng(fresh_seed());
  for (int n : {1, 2, 3, 4}) {
    config c;
    c.ranks = n;
    c.gather_in_forward = true;
    check_sharded_equals_unsharded<T, true>(c);
    check_sharded_equals_unsharded<T, false>(c);
    c.buckets = {.first_bytes = 4 * sizeof(T) * 7, .cap_bytes = 4 * sizeof(T) * 19};  // tensors over several units
    c.accumulate = 2;
    check_sharded_equals_unsharded<T, true>(c);
    config inf = c;
    inf.inf_step = 2;
    inf.inf_at = std::uniform_int_distribution<std::size_t>(0, 13 * 17 - 1)(rng);
    check_sharded_equals_unsharded<T, true>(inf);
    config clip = c;
    clip.max_norm = 0.05;
    check_sharded_equals_unsharded<T, true>(clip);
  }
}

TEST_CASE("sharded gather_in_forward: finish() leaves the parameters to the next forward - which must wait for them") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 64);
  using Model = TestMlp<float, false>;  // values unbound: what the wait unpacks is visible
  using DP = lockstep::DataParallel<Model, lockstep::ThreadComm, lockstep::ShardedOptimizer>;
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    Model m(d.dims, seed);
    DP dp(ctx, m, {.buckets = {.first_bytes = 300, .cap_bytes = 700}},
          lockstep::ShardedOptimizer{.gather_in_forward = true});
    lockstep::Sgd opt({.lr = 0.1});
    std::vector<std::size_t> rows{static_cast<std::size_t>(ctx.rank()), 7};
    auto step = dp.step();
    m.forward_backward(d.X32, d.y, rows, step.on_gradient_ready());
    const auto before = m.flat_values();
    (void)step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
    CHECK(m.flat_values() == before);  // nothing unpacked yet: deferred to the forward
    dp.wait_parameters(0);
    const auto one = m.flat_values();
    CHECK(one != before);  // parameter 0's units are in
    dp.wait_all_parameters();
    const auto after = m.flat_values();
    CHECK(after != one);      // and the rest followed
    auto second = dp.step();  // every parameter waited for: accepted
    m.forward_backward(d.X32, d.y, rows, second.on_gradient_ready());
    (void)second.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
    // A forward that skips the wait: its first gradient is refused, naming what to call.
    auto next = dp.step();
    CHECK_THROWS_WITH_AS(m.forward_backward(d.X32, d.y, rows, [&](std::size_t i) { next.gradient_ready(i); }),
                         doctest::Contains("call dp.wait_parameters(i) first"), lockstep::config_error);
  });
  // (gather_in_forward without sharding cannot be written: it is ShardedOptimizer's own option.)
}

TEST_CASE("sharded: bound values - the model trains in the shards' arena and gets its values back at the end") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 64);
  using Model = TestMlp<float>;
  using DP = lockstep::DataParallel<Model, lockstep::ThreadComm, lockstep::ShardedOptimizer>;
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Model m(d.dims, seed);
    const auto own = m.parameters();
    std::vector<float> trained;
    {
      DP dp(ctx, m, {.buckets = {.first_bytes = 300, .cap_bytes = 700}});
      CHECK(dp.stats().values_bound);
      for (std::size_t i = 0; i < own.size(); ++i) {
        CAPTURE(i);
        CHECK(m.parameters()[i].value != own[i].value);  // moved into lockstep's storage
        CHECK(dp.parameters()[i].value == m.parameters()[i].value);
      }
      CHECK(m.flat_values() != std::vector<float>{});
      lockstep::Sgd opt({.lr = 0.1});
      std::vector<std::size_t> rows{static_cast<std::size_t>(ctx.rank()), 5};
      auto step = dp.step();
      m.forward_backward(d.X32, d.y, rows, step.on_gradient_ready());
      (void)step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
      trained = m.flat_values();
    }
    for (std::size_t i = 0; i < own.size(); ++i) CHECK(m.parameters()[i].value == own[i].value);  // its own again
    CHECK(m.flat_values() == trained);  // holding the trained values
  });
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {  // bind_values off: packed, as without bind_value
    Model m(d.dims, seed);
    const auto own = m.parameters();
    DP dp(ctx, m, lockstep::ShardedOptimizer{.bind_values = false});
    CHECK_FALSE(dp.stats().values_bound);
    CHECK(dp.stats().zero_copy);  // the gradients still are the arena's
    CHECK(m.parameters()[0].value == own[0].value);
  });
  struct Ignoring : Model {  // takes the values but keeps using its own storage
    using Model::Model;
    void bind_value(std::size_t, void*) {}
    void unbind_values() {}
  };
  CHECK_THROWS_WITH_AS(
      lockstep::run(lockstep::Threads{2},
                    [&](auto& ctx) {
                      Ignoring m(d.dims, seed);
                      lockstep::DataParallel<Ignoring, lockstep::ThreadComm, lockstep::ShardedOptimizer> dp(ctx, m);
                    }),
      doctest::Contains("model.bind_value(5, storage) did not take effect"), lockstep::config_error);
}

TEST_CASE("sharded: wrong use is refused with what to do") {
  const auto seed = fresh_seed();
  const auto d = make_data(seed, 64);
  using Model = TestMlp<float>;
  using DP = lockstep::DataParallel<Model, lockstep::ThreadComm, lockstep::ShardedOptimizer>;
  SUBCASE("finish() without the optimizer") {
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{2},
                                       [&](auto& ctx) {
                                         Model m(d.dims, seed);
                                         DP dp(ctx, m);
                                         auto step = dp.step();
                                         std::vector<std::size_t> rows{0, 1};
                                         m.forward_backward(d.X32, d.y, rows, step.on_gradient_ready());
                                         (void)step.finish();
                                       }),
                         doctest::Contains("finish(on_shard)"), lockstep::config_error);
  }
  SUBCASE("join") {
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{2},
                                       [&](auto& ctx) {
                                         Model m(d.dims, seed);
                                         DP dp(ctx, m);
                                         auto j = dp.join([](lockstep::step_result) {});
                                       }),
                         doctest::Contains("pass the optimizer's shard step too"), lockstep::config_error);
  }
  SUBCASE("a negative max_grad_norm") {
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{2},
                                       [&](auto& ctx) {
                                         Model m(d.dims, seed);
                                         DP dp(ctx, m, {.max_grad_norm = -1});
                                       }),
                         doctest::Contains("max_grad_norm"), lockstep::config_error);
  }
  SUBCASE("damaged state or another model's is not loaded") {
    std::vector<std::byte> two;
    lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
      Model m(d.dims, seed);
      DP dp(ctx, m);
      lockstep::AdamW opt({.lr = 0.01});
      auto step = dp.step();
      std::vector<std::size_t> rows{0, 1};
      m.forward_backward(d.X32, d.y, rows, step.on_gradient_ready());
      step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
      auto st = lockstep::gather_sharded(dp, opt);
      if (ctx.rank() == 0) two = st;
    });
    auto other_dims = d.dims;
    other_dims[1] += 1;
    CHECK_THROWS_WITH_AS(lockstep::run(lockstep::Threads{3},
                                       [&](auto& ctx) {
                                         Model m(other_dims, seed);
                                         DP dp(ctx, m);
                                         lockstep::AdamW opt({.lr = 0.01});
                                         lockstep::load_sharded(dp, opt, two);
                                       }),
                         doctest::Contains("saved from another model"), lockstep::checkpoint_error);
    auto cut = two;
    cut.resize(cut.size() - 5);
    lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
      Model m(d.dims, seed);
      DP dp(ctx, m);
      lockstep::AdamW opt({.lr = 0.01});
      CHECK_THROWS_AS(lockstep::load_sharded(dp, opt, cut), lockstep::checkpoint_error);
      CHECK(opt.slot_count() == 0);  // unchanged
    });
  }
}

TEST_CASE("sharded: AllReduceMean named beside ShardedOptimizer is the default hook") {
  // Spelled out, the default hook compiles (it used to fail a static_assert) and trains the
  // same bits as when left out.
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 64);
  using Model = TestMlp<float>;
  const auto run = [&]<class... Hook>(std::type_identity<Hook>...) {
    std::vector<float> out;
    lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
      Model m(d.dims, seed);
      lockstep::DataParallel dp(ctx, m, Hook{}..., lockstep::ShardedOptimizer{});
      lockstep::AdamW opt({.lr = 0.01});
      for (int k = 0; k < 3; ++k) {
        auto step = dp.step();
        std::vector<std::size_t> rows{static_cast<std::size_t>(2 * k + ctx.rank())};
        m.forward_backward(d.X32, d.y, rows, step.on_gradient_ready());
        step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s); });
      }
      if (ctx.rank() == 1) out = m.flat_values();
    });
    return out;
  };
  const auto plain = run();
  CHECK(run(std::type_identity<lockstep::AllReduceMean>{}) == plain);
  TestMlp<float> init(d.dims, seed);
  CHECK(init.flat_values() != plain);  // it trained
}

TEST_CASE("max_grad_norm: finish() clips as clip_grad_norm after finish() does - and reports the norm") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const auto d = make_data(seed, 211);
  const double max_norm = 0.05, lr = 0.1;
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    TestMlp<float> a(d.dims, seed + 1), b(d.dims, seed + 1);
    lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm> da(ctx, a, {.max_grad_norm = max_norm});
    lockstep::DataParallel<TestMlp<float>, lockstep::ThreadComm> db(ctx, b);
    for (std::size_t s = 0; s < 4; ++s) {
      std::vector<std::size_t> rows{(s * 9 + 3 * static_cast<std::size_t>(ctx.rank())) % d.samples,
                                    (s * 9 + 3 * static_cast<std::size_t>(ctx.rank()) + 1) % d.samples};
      auto sa = da.step();
      a.forward_backward(d.X32, d.y, rows, sa.on_gradient_ready());
      const auto ra = sa.finish();
      a.sgd(lr);
      auto sb = db.step();
      b.forward_backward(d.X32, d.y, rows, sb.on_gradient_ready());
      (void)sb.finish();
      std::vector<lockstep::segment> segs;
      for (const auto& p : db.parameters()) segs.push_back({p.grad, p.numel()});
      const lockstep::grad_group g{lockstep::dtype::f32, segs};
      const double nb = lockstep::clip_grad_norm(std::span<const lockstep::grad_group>(&g, 1), max_norm);
      b.sgd(lr);
      CHECK(ra.grad_norm == nb);
      CHECK(ra.grad_norm > max_norm);  // it clipped
    }
    CHECK(a.flat_values() == b.flat_values());
  });
}

}  // TEST_SUITE
