// DistributedSampler: PyTorch's partition rules, the shuffle's determinism and uniformity,
// batching and mid-epoch resume.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <type_traits>
#include <vector>

#include "lockstep/data/sampler.hpp"
#include "test_util.hpp"

namespace {

using lockstep::DistributedSampler;
using lockstep::DropLast;
using lockstep::LastBatch;
using lockstep::Pad;
using lockstep::Sequential;
using lockstep::Shuffle;

using lockstep_test::fresh_seed;

// PyTorch's num_samples, computed the way torch/utils/data/distributed.py writes it
// (math.ceil over floating point), independently of the sampler's integer arithmetic.
std::size_t torch_num_samples(std::size_t len, std::size_t world, bool drop_last) {
  const double l = static_cast<double>(len), r = static_cast<double>(world);
  if (drop_last && len % world != 0) return static_cast<std::size_t>(std::ceil((l - r) / r));
  return static_cast<std::size_t>(std::ceil(l / r));
}

// PyTorch's __iter__ after the shuffle: pad by repeating from the start (tiled when the
// padding is longer than the list) or truncate, then take list[rank : total : world].
std::vector<std::size_t> torch_rank_indices(std::vector<std::size_t> list, std::size_t world, std::size_t rank,
                                            bool drop_last) {
  const std::size_t len = list.size();
  const std::size_t total = torch_num_samples(len, world, drop_last) * world;
  if (!drop_last) {
    const std::size_t padding = total - len;
    if (padding <= len) {
      list.insert(list.end(), list.begin(), list.begin() + static_cast<std::ptrdiff_t>(padding));
    } else {
      const auto times = static_cast<std::size_t>(std::ceil(double(padding) / double(len)));
      std::vector<std::size_t> tiled;
      for (std::size_t t = 0; t < times; ++t) tiled.insert(tiled.end(), list.begin(), list.end());
      list.insert(list.end(), tiled.begin(), tiled.begin() + static_cast<std::ptrdiff_t>(padding));
    }
  } else {
    list.resize(total);
  }
  REQUIRE(list.size() == total);
  std::vector<std::size_t> out;
  for (std::size_t i = rank; i < total; i += world) out.push_back(list[i]);
  return out;
}

template <class Order>
std::vector<std::size_t> epoch_list(std::size_t len, std::uint64_t seed, std::uint64_t epoch) {
  // One rank of one holds the whole epoch's list, unpadded.
  DistributedSampler<Order, Pad> s(len, 0, 1, {.seed = seed});
  s.set_epoch(epoch);
  return s.indices();
}

bool is_permutation_of_iota(std::vector<std::size_t> v) {
  std::sort(v.begin(), v.end());
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] != i) return false;
  return true;
}

template <class Order, class Tail>
void check_against_torch(std::size_t len, std::size_t world, std::uint64_t seed, std::uint64_t epoch) {
  constexpr bool drop = std::is_same_v<Tail, DropLast>;
  CAPTURE(len);
  CAPTURE(world);
  CAPTURE(drop);
  const auto list = epoch_list<Order>(len, seed, epoch);
  REQUIRE(list.size() == len);
  REQUIRE(is_permutation_of_iota(list));
  const std::size_t expected = torch_num_samples(len, world, drop);
  for (std::size_t r = 0; r < world; ++r) {
    CAPTURE(r);
    DistributedSampler<Order, Tail> s(len, static_cast<int>(r), static_cast<int>(world), {.seed = seed});
    s.set_epoch(epoch);
    CHECK(s.size() == expected);
    CHECK(s.total_size() == expected * world);
    CHECK(s.indices().size() == expected);
    CHECK(s.indices() == torch_rank_indices(list, world, r, drop));
  }
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("sampler: sizes and per-rank indices match PyTorch's rules for many (len - R)") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (std::size_t len = 0; len <= 40; ++len) {
    for (std::size_t world = 1; world <= 12; ++world) {
      const std::uint64_t epoch = rng() % 100;
      check_against_torch<Shuffle, Pad>(len, world, seed, epoch);
      check_against_torch<Shuffle, DropLast>(len, world, seed, epoch);
      check_against_torch<Sequential, Pad>(len, world, seed, epoch);
      check_against_torch<Sequential, DropLast>(len, world, seed, epoch);
    }
  }
  for (int trial = 0; trial < 20; ++trial) {
    const std::size_t len = rng() % 5000, world = 1 + rng() % 64;
    check_against_torch<Shuffle, Pad>(len, world, seed, trial);
    check_against_torch<Shuffle, DropLast>(len, world, seed, trial);
  }
}

TEST_CASE("sampler: known sizes (hand-computed)") {
  // len 10, 4 ranks: Pad ceil(10/4) = 3 (total 12), DropLast ceil((10-4)/4) = 2 (total 8).
  CHECK(DistributedSampler<Shuffle, Pad>(10, 0, 4).size() == 3);
  CHECK(DistributedSampler<Shuffle, Pad>(10, 0, 4).total_size() == 12);
  CHECK(DistributedSampler<Shuffle, DropLast>(10, 3, 4).size() == 2);
  CHECK(DistributedSampler<Shuffle, DropLast>(10, 3, 4).total_size() == 8);
  // len 2 < 5 ranks: Pad gives one sample each, tiled [a b a b a]; DropLast gives none.
  CHECK(DistributedSampler<Sequential, Pad>(2, 4, 5).indices() == std::vector<std::size_t>{0});
  CHECK(DistributedSampler<Sequential, Pad>(2, 3, 5).indices() == std::vector<std::size_t>{1});
  CHECK(DistributedSampler<Shuffle, DropLast>(2, 1, 5).size() == 0);
  // Sequential partition of 7 over 3 ranks with padding: list 0..6 then 0, 1.
  CHECK(DistributedSampler<Sequential, Pad>(7, 0, 3).indices() == std::vector<std::size_t>{0, 3, 6});
  CHECK(DistributedSampler<Sequential, Pad>(7, 1, 3).indices() == std::vector<std::size_t>{1, 4, 0});
  CHECK(DistributedSampler<Sequential, Pad>(7, 2, 3).indices() == std::vector<std::size_t>{2, 5, 1});
  CHECK(DistributedSampler<Sequential, DropLast>(7, 2, 3).indices() == std::vector<std::size_t>{2, 5});
}

TEST_CASE("sampler: len = 0 gives no samples and no batches") {
  for (int world = 1; world <= 4; ++world) {
    for (int r = 0; r < world; ++r) {
      DistributedSampler<Shuffle, Pad> p(0, r, world, {.seed = 3});
      DistributedSampler<Sequential, DropLast> d(0, r, world);
      p.set_epoch(5);
      CHECK(p.size() == 0);
      CHECK(p.total_size() == 0);
      CHECK(p.indices().empty());
      CHECK(d.indices().empty());
      CHECK(p.batches(4).empty());
      CHECK(d.batches(4, LastBatch::drop_partial).empty());
      p.set_position(0);
      CHECK_THROWS_AS(p.set_position(1), lockstep::config_error);
    }
  }
}

TEST_CASE("sampler: ranks cover the data exactly once per epoch when len divides") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 30; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 16);
    const std::size_t len = static_cast<std::size_t>(world) * (1 + rng() % 200);
    const std::uint64_t epoch = rng() % 1000;
    CAPTURE(world);
    CAPTURE(len);
    std::vector<int> seen(len, 0);
    for (int r = 0; r < world; ++r) {
      DistributedSampler<> s(len, r, world, {.seed = seed});
      s.set_epoch(epoch);
      CHECK(s.size() == len / static_cast<std::size_t>(world));
      for (auto i : s.indices()) {
        REQUIRE(i < len);
        ++seen[i];
      }
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  }
}

TEST_CASE("sampler: uneven len — DropLast ranks are disjoint - Pad repeats the list's first indices") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 40; ++trial) {
    const int world = 2 + static_cast<int>(rng() % 15);
    const std::size_t len = 1 + rng() % 300;
    const std::uint64_t epoch = rng();
    CAPTURE(world);
    CAPTURE(len);
    const auto w = static_cast<std::size_t>(world);
    const auto list = epoch_list<Shuffle>(len, seed, epoch);

    std::map<std::size_t, int> drop_seen, pad_seen;
    for (int r = 0; r < world; ++r) {
      DistributedSampler<Shuffle, DropLast> d(len, r, world, {.seed = seed});
      DistributedSampler<Shuffle, Pad> p(len, r, world, {.seed = seed});
      d.set_epoch(epoch);
      p.set_epoch(epoch);
      for (auto i : d.indices()) ++drop_seen[i];
      for (auto i : p.indices()) ++pad_seen[i];
    }
    // DropLast: floor(len / R) · R distinct indices, exactly the list's first ones.
    CHECK(drop_seen.size() == (len / w) * w);
    for (std::size_t i = 0; i < (len / w) * w; ++i) CHECK(drop_seen[list[i]] == 1);
    // Pad: every index at least once; the padding is list[0], list[1], ... repeated.
    const std::size_t total = ((len + w - 1) / w) * w;
    std::vector<int> expected(len, 0);
    for (std::size_t i = 0; i < total; ++i) ++expected[list[i % len]];
    CHECK(pad_seen.size() == len);
    for (std::size_t i = 0; i < len; ++i) CHECK(pad_seen[i] == expected[i]);
    if (total - len <= len)  // padding shorter than the list: the first total-len appear twice
      for (std::size_t i = 0; i < total - len; ++i) CHECK(pad_seen[list[i]] == 2);
  }
}

TEST_CASE("sampler: order is a function of (seed - epoch) only") {
  const auto seed = fresh_seed();
  INFO("seed = " << seed);
  const std::size_t len = 1000;
  DistributedSampler<> a(len, 1, 3, {.seed = seed});
  DistributedSampler<> b(len, 1, 3, {.seed = seed});
  CHECK(a.indices() == b.indices());  // epoch 0 from two separate objects
  a.set_epoch(7);
  b.set_epoch(7);
  CHECK(a.epoch() == 7);
  CHECK(a.indices() == b.indices());
  const auto at7 = a.indices();
  a.set_epoch(8);
  CHECK(a.indices() != at7);  // new epoch, new order (equal with probability ~1/1000!)
  a.set_epoch(7);
  CHECK(a.indices() == at7);  // going back reproduces it
  DistributedSampler<> other_seed(len, 1, 3, {.seed = seed + 1});
  other_seed.set_epoch(7);
  CHECK(other_seed.indices() != at7);
  // The list does not depend on the number of ranks.
  const auto list = epoch_list<Shuffle>(len, seed, 7);
  DistributedSampler<> four(len, 2, 4, {.seed = seed});
  four.set_epoch(7);
  for (std::size_t k = 0; k < four.size(); ++k) CHECK(four.indices()[k] == list[2 + 4 * k]);
}

TEST_CASE("sampler: Sequential is 0..len-1 partitioned and ignores seed and epoch") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 20; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 8);
    const std::size_t len = 1 + rng() % 100;
    const int r = static_cast<int>(rng() % static_cast<std::uint64_t>(world));
    DistributedSampler<Sequential, DropLast> s(len, r, world, {.seed = rng()});
    s.set_epoch(rng());
    const auto& idx = s.indices();
    for (std::size_t k = 0; k < idx.size(); ++k)
      CHECK(idx[k] == static_cast<std::size_t>(r) + k * static_cast<std::size_t>(world));
  }
}

TEST_CASE("sampler: the shuffle is a valid - roughly uniform permutation") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 20; ++trial) {
    const std::size_t len = rng() % 3000;
    CHECK(is_permutation_of_iota(lockstep::detail::permutation(len, rng(), rng())));
  }

  // Position × value table for len 8 over many epochs: every cell should hold 1/8.
  // Chi-square with 7·7 = 49 degrees of freedom has mean 49, sd ≈ 10: 120 is ~7 sd out.
  {
    constexpr std::size_t n = 8, epochs = 16000;
    std::vector<double> table(n * n, 0.0);
    for (std::uint64_t e = 0; e < epochs; ++e) {
      const auto p = lockstep::detail::permutation(n, seed, e);
      for (std::size_t pos = 0; pos < n; ++pos) table[pos * n + p[pos]] += 1;
    }
    const double expect = double(epochs) / n;
    double chi2 = 0;
    for (double c : table) chi2 += (c - expect) * (c - expect) / expect;
    CAPTURE(chi2);
    CHECK(chi2 < 120.0);
  }
  // All 3! orders of len 3 equally often (catches the classic biased "swap with any" shuffle,
  // whose first-position marginals can look fine). 5 degrees of freedom: 35 is ~9 sd out.
  {
    constexpr std::uint64_t epochs = 12000;
    std::map<std::vector<std::size_t>, double> freq;
    for (std::uint64_t e = 0; e < epochs; ++e) freq[lockstep::detail::permutation(3, seed, e)] += 1;
    CHECK(freq.size() == 6);
    const double expect = double(epochs) / 6;
    double chi2 = 0;
    for (const auto& [perm, c] : freq) chi2 += (c - expect) * (c - expect) / expect;
    CAPTURE(chi2);
    CHECK(chi2 < 35.0);
  }
}

TEST_CASE("sampler: golden values of the documented shuffle") {
  // Computed with an independent Python transcription of the algorithm documented in
  // distributed_sampler.hpp (SplitMix64 from detail::sampler_key, Lemire's bounded draw,
  // Fisher–Yates from the top): these pin the order on every platform and compiler.
  CHECK(lockstep::detail::permutation(10, 42, 3) == std::vector<std::size_t>{2, 7, 5, 0, 3, 8, 1, 6, 4, 9});
  CHECK(lockstep::detail::permutation(16, 0, 0) ==
        std::vector<std::size_t>{3, 0, 12, 1, 11, 10, 7, 14, 8, 4, 9, 5, 15, 2, 13, 6});
  CHECK(lockstep::detail::permutation(1, 5, 5) == std::vector<std::size_t>{0});

  // Lemire's bounded draw, including its rejection path: with n = 2^63 + 1 about half the
  // candidates are rejected (10 times in these 8 draws), with n = 3·2^62 a quarter (2 times).
  using lockstep::SplitMix64;
  const std::uint64_t big1[] = {1889100008830663798ULL, 1102585717339666702ULL, 4425244153875356811ULL,
                                1702875918339116738ULL, 7057181614276279346ULL, 8951156463191064200ULL,
                                7234133431497328526ULL, 4696173240441134095ULL};
  SplitMix64 g1(12345);
  for (auto v : big1) CHECK(lockstep::detail::bounded(g1, (std::uint64_t{1} << 63) + 1) == v);
  const std::uint64_t big2[] = {2833650013245995697ULL, 1653878576009500053ULL, 2436600087803032087ULL,
                                7012717208619588272ULL, 4662892491721603234ULL, 1696900514627103409ULL,
                                6637866230813035217ULL, 12002216188126887707ULL};
  SplitMix64 g2(12345);
  for (auto v : big2) CHECK(lockstep::detail::bounded(g2, std::uint64_t{3} << 62) == v);
  const std::uint64_t small[] = {1, 0, 5, 0, 1, 1, 4, 4};
  SplitMix64 g3(99);
  for (auto v : small) CHECK(lockstep::detail::bounded(g3, 6) == v);
}

TEST_CASE("sampler: the portable 64x64 multiply agrees with exact arithmetic") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int i = 0; i < 10000; ++i) {
    std::uint64_t a = rng(), b = rng();
    if (i % 4 == 1) a = ~std::uint64_t{0} - (rng() % 4);  // near the top: carries everywhere
    if (i % 4 == 2) b = ~std::uint64_t{0};
    // Reference: schoolbook over 16-bit digits, independent of both implementations.
    std::uint64_t digits[8] = {};
    for (int x = 0; x < 4; ++x) {
      std::uint64_t carry = 0;
      for (int y = 0; y < 4; ++y) {
        const std::uint64_t t = ((a >> (16 * x)) & 0xffff) * ((b >> (16 * y)) & 0xffff) + digits[x + y] + carry;
        digits[x + y] = t & 0xffff;
        carry = t >> 16;
      }
      digits[x + 4] += carry;
    }
    std::uint64_t lo = 0, hi = 0;
    for (int d = 0; d < 4; ++d) lo |= digits[d] << (16 * d);
    for (int d = 0; d < 4; ++d) hi |= digits[d + 4] << (16 * d);
    const auto p = lockstep::detail::mul_64x64_portable(a, b);
    const auto q = lockstep::detail::mul_64x64(a, b);
    CHECK(p.first == hi);
    CHECK(p.second == lo);
    CHECK(q.first == hi);
    CHECK(q.second == lo);
  }
}

TEST_CASE("sampler: batches with both last-batch policies") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 200; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 8);
    const std::size_t len = rng() % 500;
    const std::size_t batch = 1 + rng() % 40;
    CAPTURE(world);
    CAPTURE(len);
    CAPTURE(batch);
    DistributedSampler<> s(len, static_cast<int>(rng() % static_cast<std::uint64_t>(world)), world, {.seed = seed});
    s.set_epoch(rng() % 50);
    const std::size_t n = s.size();

    const auto keep = s.batches(batch);
    const std::size_t full = n / batch, rem = n % batch;
    REQUIRE(keep.size() == full + (rem ? 1 : 0));
    std::vector<std::size_t> joined;
    for (std::size_t b = 0; b < keep.size(); ++b) {
      CHECK(keep[b].size() == (b < full ? batch : rem));
      joined.insert(joined.end(), keep[b].begin(), keep[b].end());
    }
    CHECK(joined == s.indices());

    const auto drop = s.batches(batch, LastBatch::drop_partial);
    REQUIRE(drop.size() == full);
    joined.clear();
    for (const auto& b : drop) {
      CHECK(b.size() == batch);
      joined.insert(joined.end(), b.begin(), b.end());
    }
    CHECK(std::equal(joined.begin(), joined.end(), s.indices().begin()));
  }
  DistributedSampler<> s(10, 0, 1);
  CHECK_THROWS_AS(s.batches(0), lockstep::config_error);
}

TEST_CASE("sampler: resuming at a position yields the remaining batches") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 100; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 8);
    const int rank = static_cast<int>(rng() % static_cast<std::uint64_t>(world));
    const std::size_t len = 1 + rng() % 400;
    const std::size_t batch = 1 + rng() % 16;
    const std::uint64_t epoch = rng() % 100;
    CAPTURE(world);
    CAPTURE(len);
    CAPTURE(batch);

    // The uninterrupted run, which keeps position() current with advance().
    DistributedSampler<> run(len, rank, world, {.seed = seed});
    run.set_epoch(epoch);
    const auto all = run.batches(batch);
    const std::size_t steps_done = rng() % (all.size() + 1);
    for (std::size_t b = 0; b < steps_done; ++b) run.advance(all[b].size());
    const std::size_t k = run.position();
    CHECK(k == std::min(steps_done * batch, run.size()));

    // A fresh sampler restored from (epoch, position), as after loading a checkpoint.
    DistributedSampler<> resumed(len, rank, world, {.seed = seed});
    resumed.set_epoch(epoch);
    resumed.set_position(k);
    CHECK(resumed.position() == k);
    const auto rest = resumed.batches(batch);
    REQUIRE(rest.size() == all.size() - steps_done);
    for (std::size_t b = 0; b < rest.size(); ++b)
      CHECK(std::vector<std::size_t>(rest[b].begin(), rest[b].end()) ==
            std::vector<std::size_t>(all[steps_done + b].begin(), all[steps_done + b].end()));

    // Any position, not only batch boundaries: the rest of the indices, in order.
    const std::size_t any = rng() % (resumed.size() + 1);
    resumed.set_position(any);
    std::vector<std::size_t> joined;
    for (const auto& b : resumed.batches(batch)) joined.insert(joined.end(), b.begin(), b.end());
    CHECK(joined == std::vector<std::size_t>(resumed.indices().begin() + static_cast<std::ptrdiff_t>(any),
                                             resumed.indices().end()));

    CHECK_THROWS_AS(resumed.set_position(resumed.size() + 1), lockstep::config_error);
    resumed.set_epoch(epoch + 1);
    CHECK(resumed.position() == 0);  // a new epoch starts from its beginning
  }
}

TEST_CASE("sampler: invalid rank or world is a config_error") {
  CHECK_THROWS_AS(DistributedSampler<>(10, 0, 0), lockstep::config_error);
  CHECK_THROWS_AS(DistributedSampler<>(10, -1, 4), lockstep::config_error);
  CHECK_THROWS_AS(DistributedSampler<>(10, 4, 4), lockstep::config_error);
  CHECK_THROWS_WITH_AS(DistributedSampler<>(10, 5, 4), doctest::Contains("rank 5"), lockstep::config_error);
  CHECK_NOTHROW(DistributedSampler<>(10, 3, 4));
}

TEST_CASE("sampler: constructs from anything with rank() and size()") {
  struct Group {
    int r, n;
    int rank() const { return r; }
    int size() const { return n; }
  };
  const Group g{2, 3};
  lockstep::DistributedSampler s(100, g, {.seed = 42});  // class template argument deduction
  static_assert(std::is_same_v<decltype(s), DistributedSampler<Shuffle, Pad>>);
  CHECK(s.rank() == 2);
  CHECK(s.world() == 3);
  CHECK(s.seed() == 42);
  CHECK(s.indices() == DistributedSampler<>(100, 2, 3, {.seed = 42}).indices());
  CHECK_THROWS_AS(DistributedSampler<>(100, Group{3, 3}), lockstep::config_error);
}

TEST_CASE("sampler: its state resumes it mid-epoch - a used-up epoch resumes at the next - other data is refused") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  lockstep::DistributedSampler<> a(1003, 1, 4, {.seed = seed});
  a.set_epoch(5);
  a.advance(40);
  const auto st = a.state();
  // Restored through the byte codec into a sampler of another seed and epoch.
  lockstep::DistributedSampler<> b(1003, 1, 4, {.seed = seed + 1});
  lockstep::from_bytes(b, lockstep::to_bytes(a));
  CHECK(b.state() == st);
  CHECK(b.indices() == a.indices());
  CHECK(b.batches(8).front().front() == a.indices()[40]);
  // The epoch used up: the next one, from its start.
  a.advance(a.size() - 40);
  lockstep::DistributedSampler<> c(1003, 1, 4, {.seed = seed});
  c.load_state(a.state());
  CHECK(c.epoch() == 6);
  CHECK(c.position() == 0);
  lockstep::DistributedSampler<> next(1003, 1, 4, {.seed = seed});
  next.set_epoch(6);
  CHECK(c.indices() == next.indices());
  // Another number of ranks: at an epoch boundary the next epoch; mid-epoch the rest of the
  // epoch over the new ranks (test below); other data refused, the sampler unchanged.
  lockstep::DistributedSampler<> d(1003, 0, 2, {.seed = seed});
  d.load_state(a.state());
  CHECK(d.epoch() == 6);
  d.load_state(st);
  CHECK(d.epoch() == 5);
  CHECK(d.consumed() == 160);  // 40 samples on each of 4 ranks
  CHECK(d.size() == (1003 - 160 + 1) / 2);
  lockstep::DistributedSampler<> e(1004, 1, 4, {.seed = seed});
  CHECK_THROWS_WITH_AS(e.load_state(st), doctest::Contains("same data"), lockstep::checkpoint_error);
  CHECK(e.state() == lockstep::DistributedSampler<>(1004, 1, 4, {.seed = seed}).state());
  // A state without a change of ranks is written as before (40 bytes).
  CHECK(lockstep::to_bytes(a).size() == 40);
}

// Ranks change twice mid-epoch (r1 → r2 → r3, as when ranks leave and join): each time the
// rest of the epoch's list, list[consumed() : len], is partitioned over the new ranks by
// PyTorch's rules (torch_rank_indices applied to the rest: an independent reference), the
// survivors by repartition() and the newcomers by load_state() of a survivor's state (also
// through the byte codec); over the whole epoch DropLast consumes no sample twice and Pad
// none less than once.
template <class Order, class Tail>
void check_repartition(std::mt19937_64& rng, std::uint64_t seed) {
  constexpr bool drop = std::is_same_v<Tail, DropLast>;
  using S = DistributedSampler<Order, Tail>;
  const std::size_t len = 1 + rng() % 700;
  const std::uint64_t epoch = rng() % 4;
  const std::vector<int> worlds{1 + static_cast<int>(rng() % 8), 1 + static_cast<int>(rng() % 8),
                                1 + static_cast<int>(rng() % 8)};
  CAPTURE(len);
  CAPTURE(worlds[0]);
  CAPTURE(worlds[1]);
  CAPTURE(worlds[2]);
  const auto list = epoch_list<Order>(len, seed, epoch);
  std::vector<S> ranks;
  for (int r = 0; r < worlds[0]; ++r) ranks.emplace_back(len, r, worlds[0], lockstep::SamplerOptions{.seed = seed});
  for (auto& s : ranks) s.set_epoch(epoch);
  std::map<std::size_t, int> times;  // sample → how often consumed this epoch
  std::size_t consumed = 0;          // of the epoch's list, by the reference
  int last_world = worlds[0];
  for (std::size_t phase = 0; phase < worlds.size(); ++phase) {
    CAPTURE(phase);
    const int w = worlds[phase];
    const std::vector<std::size_t> rest(list.begin() + static_cast<std::ptrdiff_t>(consumed), list.end());
    for (int r = 0; r < w; ++r)
      CHECK(ranks[static_cast<std::size_t>(r)].indices() == torch_rank_indices(rest, w, r, drop));
    const std::size_t n = ranks[0].size();
    // A change of ranks inside the epoch (the last phase ends it; so does a partition with no
    // samples, DropLast's whole rest cut): a state saved at its end resumes the next epoch.
    const bool last = phase + 1 == worlds.size() || n == 0;
    const std::size_t p = last ? n : rng() % n;
    last_world = w;
    for (auto& s : ranks) {
      for (std::size_t k = 0; k < p; ++k) ++times[s.indices()[k]];
      s.advance(p);
    }
    consumed += std::min(p * static_cast<std::size_t>(w), rest.size());
    CHECK(ranks[0].consumed() == consumed);
    if (last) break;
    const int next = worlds[phase + 1];
    const lockstep::sampler_state saved = ranks[0].state();
    const auto bytes = lockstep::to_bytes(ranks[0]);
    ranks.erase(ranks.begin() + std::min(w, next), ranks.end());  // the ranks that leave
    for (int r = 0; r < static_cast<int>(ranks.size()); ++r) ranks[static_cast<std::size_t>(r)].repartition(r, next);
    for (int r = static_cast<int>(ranks.size()); r < next; ++r) {  // the ranks that join
      S joined(len, r, next, {.seed = seed + 1});
      if (r % 2 == 0) joined.load_state(saved);
      else lockstep::from_bytes(joined, bytes);
      CHECK(joined.epoch() == epoch);
      ranks.push_back(std::move(joined));
    }
  }
  if (drop) CHECK(len - consumed < static_cast<std::size_t>(last_world));  // the last partition's cut
  else CHECK(consumed == len);
  for (std::size_t i = 0; i < len; ++i) {
    CAPTURE(i);
    if (drop) CHECK(times[i] <= 1);
    else CHECK(times[i] >= 1);
  }
  // The epoch used up: its state resumes at the next epoch, over any number of ranks.
  S after(len, 0, 3, {.seed = seed});
  after.load_state(ranks[0].state());
  CHECK(after.epoch() == epoch + 1);
  CHECK(after.consumed() == 0);
}

TEST_CASE("sampler: a change of ranks mid-epoch partitions the rest of the epoch - in state - through the codec") {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    check_repartition<Shuffle, Pad>(rng, seed + static_cast<std::uint64_t>(trial));
    check_repartition<Shuffle, DropLast>(rng, seed + static_cast<std::uint64_t>(trial));
    check_repartition<Sequential, Pad>(rng, seed);
    check_repartition<Sequential, DropLast>(rng, seed);
  }
  lockstep::DistributedSampler<> s(10, 0, 2);
  CHECK_THROWS_AS(s.repartition(2, 2), lockstep::config_error);
  CHECK_THROWS_AS(s.repartition(0, 0), lockstep::config_error);
}

TEST_CASE("sampler: micro_batches cut a global batch by position - the same micro-batches for any rank count") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  CAPTURE(seed);
  const std::size_t micro = 1 + rng() % 7, per_step = 12;  // 12 micro-batches: 1x12, 2x6, 3x4, 4x3, 6x2, 12x1
  std::vector<std::size_t> batch(micro * per_step);
  for (auto& v : batch) v = rng() % 100000;
  for (int world : {1, 2, 3, 4, 6, 12}) {
    std::vector<int> owner(per_step, -1);
    for (int r = 0; r < world; ++r) {
      const auto mine = lockstep::micro_batches(batch, micro, r, world);
      REQUIRE(mine.size() == per_step / static_cast<std::size_t>(world));
      for (std::size_t k = 0; k < mine.size(); ++k) {
        REQUIRE(mine[k].size() == micro);
        const auto at = static_cast<std::size_t>(mine[k].data() - batch.data());
        REQUIRE(at % micro == 0);
        const std::size_t j = at / micro;  // micro-batch j: rank j % world, micro-step j / world
        CHECK(j == static_cast<std::size_t>(r) + k * static_cast<std::size_t>(world));
        CHECK(owner[j] == -1);
        owner[j] = r;
        CHECK(std::equal(mine[k].begin(), mine[k].end(), batch.begin() + static_cast<std::ptrdiff_t>(j * micro)));
      }
    }
    CHECK(std::count(owner.begin(), owner.end(), -1) == 0);
  }
  CHECK_THROWS_WITH_AS(lockstep::micro_batches(std::span<const std::size_t>(batch).first(micro * 5), micro, 0, 2),
                       doctest::Contains("multiple of micro-batch x ranks"), lockstep::config_error);
  CHECK_THROWS_WITH_AS(lockstep::micro_batches(batch, 0, 0, 1), doctest::Contains("micro-batches of 0"),
                       lockstep::config_error);
  CHECK_THROWS_WITH_AS(lockstep::micro_batches(batch, micro, 2, 2), doctest::Contains("rank 2 of 2"),
                       lockstep::config_error);
}

}  // TEST_SUITE
