// Full sharding on CPU ranks — ShardedGradients (ZeRO-2) and FullySharded (ZeRO-3): the
// MLP's layers (or each parameter) are blocks used through dp.use_block in its forward and
// backward; a run ends with the parameters of the same run unsharded — AdamW on 1..4 ranks,
// blocks whose sizes no rank count divides, a block smaller than the rank count, hooks or
// none, accumulation, dynamic loss scaling with an injected inf (skipped on every rank),
// clipping — with optimizer state and gradients for 1/N of each block per rank, and lent
// buffers of a few blocks, not the model. Misuse of the protocol is named.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <type_traits>

#include <lockstep/lockstep.hpp>

#include "equivalence.hpp"
#include "mlp.hpp"
#include "sharded_run.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

template <class T, class Strategy>
sharded_outcome train(const dataset& d, const sharded_config& c, std::uint64_t init_seed, Strategy strategy = {}) {
  sharded_outcome out;
  out.values.resize(static_cast<std::size_t>(c.ranks));
  lockstep::run(lockstep::Threads{c.ranks}, [&](auto& ctx) {
    train_rank_as<T, Strategy, true>(ctx, d, c, init_seed, out, nullptr, nullptr, strategy);
  });
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
  // State, gradient shards: ceil(block / N) per block. Lent buffers: a few of the largest
  // block's — a layer's blocks in use, one prefetched, two reduce-scatters in flight.
  const std::size_t N = static_cast<std::size_t>(c.ranks);
  std::size_t shard = 0, largest = 0, total = 0;
  for (auto b : block_sizes(d, c.block_per_parameter)) {
    shard += (b + N - 1) / N;
    largest = std::max(largest, (b + N - 1) / N * N);
    total += b;
  }
  CHECK(sharded.state_elements == shard);
  CHECK(sharded.shard_bytes == shard * sizeof(T));
  CHECK(sharded.lent_bytes > 0);
  std::size_t buffers = c.block_per_parameter ? 8 : 6;  // with one block prefetched
  if constexpr (std::is_same_v<Strategy, lockstep::FullySharded>) {
    buffers += static_cast<std::size_t>(std::max(0, strategy.buffers.prefetch - 1));
    if (strategy.keep_after_forward) buffers = 4 * block_sizes(d, c.block_per_parameter).size();  // all values kept
  }
  CHECK(sharded.lent_bytes <= buffers * largest * sizeof(T));
  if (d.dims.size() > 8) CHECK(sharded.lent_bytes < total * sizeof(T));  // a deep model: less than its gradients
}

// dims whose second hidden layer has 3 units: with per-parameter blocks, a bias of 3 elements
// is a block smaller than 4 ranks.
dataset narrow_data(std::uint64_t seed) {
  auto d = make_data(seed, 211);
  d.dims = {13, 17, 3, 5};
  return d;
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
    sharded_config clip = c;
    clip.max_norm = 0.05;  // below the norms of this model: every step clips
    check_equals_unsharded<T, lockstep::FullySharded>(d, clip);
    clip.accumulate = 1;
    clip.block_per_parameter = true;
    check_equals_unsharded<T, lockstep::ShardedGradients>(d, clip);
  }
}

}  // TEST_SUITE
