#pragma once
//! Seeds that are the same on every rank where they must be (model initialisation) and
//! different where they should be (data augmentation, dropout), plus the PRNG behind them.
//!
//! Everything here is fully specified integer arithmetic, so every platform, compiler and
//! standard library gives the same values (unlike std::shuffle or the std distributions,
//! whose algorithms are implementation-defined).
//!
//! \code
//!   std::mt19937_64 init(lockstep::model_seed(42));                       // same on all ranks
//!   std::mt19937_64 aug(lockstep::rank_epoch_seed(42, ctx.rank(), epoch)); // differs per rank
//! \endcode

#include <cstdint>
#include <limits>

namespace lockstep {

//! SplitMix64's output function (Steele, Lea & Flood, "Fast splittable pseudorandom number
//! generators", OOPSLA 2014; constants from Vigna's reference splitmix64.c). A bijection
//! on 64-bit words that mixes every input bit into every output bit: a good hash for seeds.
constexpr std::uint64_t splitmix64_mix(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

//! SplitMix64: state += 0x9e3779b97f4a7c15, output splitmix64_mix(state). Period 2^64,
//! passes BigCrush; small, fast and fully specified. Satisfies
//! std::uniform_random_bit_generator.
class SplitMix64 {
 public:
  using result_type = std::uint64_t;
  static constexpr std::uint64_t gamma = 0x9e3779b97f4a7c15ULL;  // 2^64 / golden ratio, odd

  constexpr explicit SplitMix64(std::uint64_t seed) noexcept : state_(seed) {}

  constexpr std::uint64_t next() noexcept {
    state_ += gamma;
    return splitmix64_mix(state_);
  }
  constexpr std::uint64_t operator()() noexcept { return next(); }
  constexpr std::uint64_t state() const noexcept { return state_; }

  static constexpr std::uint64_t min() noexcept { return 0; }
  static constexpr std::uint64_t max() noexcept { return std::numeric_limits<std::uint64_t>::max(); }

 private:
  std::uint64_t state_;
};

namespace detail {
//! Folds v into the hash h. For a fixed h it is injective in v (a chain of bijections), so
//! distinct ranks or epochs always give distinct seeds.
constexpr std::uint64_t seed_combine(std::uint64_t h, std::uint64_t v) noexcept {
  return splitmix64_mix(h ^ splitmix64_mix(v + SplitMix64::gamma));
}
// Domain tags (ASCII) keep the model, per-rank and sampler streams apart for one base seed.
inline constexpr std::uint64_t model_domain = 0x6d6f64656cULL;        // "model"
inline constexpr std::uint64_t rank_domain = 0x72616e6bULL;           // "rank"
inline constexpr std::uint64_t sampler_domain = 0x73616d706c6572ULL;  // "sampler"

//! The key of DistributedSampler's shuffle for (seed, epoch): the SplitMix64 state it
//! starts from. Hashed (not seed + epoch) so that epochs start at unrelated points of the
//! SplitMix64 cycle instead of overlapping, shifted copies of one stream.
constexpr std::uint64_t sampler_key(std::uint64_t seed, std::uint64_t epoch) noexcept {
  return seed_combine(seed_combine(splitmix64_mix(seed), sampler_domain), epoch);
}
}  // namespace detail

//! The seed for everything that must be identical on every rank (parameter
//! initialisation): depends on `base` only.
//! Defined as seed_combine(splitmix64_mix(base), "model").
constexpr std::uint64_t model_seed(std::uint64_t base) noexcept {
  return detail::seed_combine(splitmix64_mix(base), detail::model_domain);
}

//! A per-rank seed (data augmentation, dropout): distinct for distinct ranks of one base,
//! and unrelated to model_seed(base).
//! Defined as seed_combine(seed_combine(splitmix64_mix(base), "rank"), rank).
constexpr std::uint64_t rank_seed(std::uint64_t base, int rank) noexcept {
  return detail::seed_combine(detail::seed_combine(splitmix64_mix(base), detail::rank_domain),
                              static_cast<std::uint64_t>(static_cast<std::int64_t>(rank)));
}

//! A per-rank, per-epoch seed: distinct for distinct epochs of one (base, rank), so
//! augmentation is not replayed identically each epoch, yet reproducible after a resume.
//! Defined as seed_combine(rank_seed(base, rank), epoch).
constexpr std::uint64_t rank_epoch_seed(std::uint64_t base, int rank, std::uint64_t epoch) noexcept {
  return detail::seed_combine(rank_seed(base, rank), epoch);
}

}  // namespace lockstep
