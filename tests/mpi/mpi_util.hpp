#pragma once
// Helpers for the MPI tests: a seed shared by all ranks, deterministic per-rank inputs (so
// every rank can compute every reference itself), agreement checks over MPI_COMM_WORLD.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <lockstep/mpi/comm.hpp>

#include "test_util.hpp"

namespace lockstep_mpi_test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

//! Rank 0's fresh seed, on every rank (LOCKSTEP_TEST_SEED fixes it).
inline std::uint64_t shared_seed() {
  std::uint64_t s = lockstep_test::fresh_seed();
  MPI_Bcast(&s, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return s;
}

//! True on every rank iff `ok` holds on every rank.
inline bool all_ranks(bool ok) {
  int v = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return v == 1;
}

inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

//! Element i of rank r's input for case `salt`: never all zero, signed where the type is.
template <class T>
T value(std::uint64_t seed, std::uint64_t salt, int r, std::size_t i) {
  const std::uint64_t h = splitmix(seed ^ splitmix(salt * 1315423911ull + static_cast<std::uint64_t>(r)) ^
                                   (static_cast<std::uint64_t>(i) * 0x2545f4914f6cdd1dull));
  if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(static_cast<double>(h >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    return static_cast<T>(h & 0xff);  // sums wrap modulo 256, as they should
  } else if constexpr (std::is_same_v<T, std::int32_t>) {
    return static_cast<T>(static_cast<std::int64_t>(h % 2000001) - 1000000);
  } else {
    return static_cast<T>(static_cast<std::int64_t>(h % 2000000000001ull) - 1000000000000ll);
  }
}

template <class T>
std::vector<T> input(std::uint64_t seed, std::uint64_t salt, int r, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = value<T>(seed, salt, r, i);
  return v;
}

//! 64-bit FNV-1a of the bytes.
template <class T>
std::uint64_t hash_of(const std::vector<T>& v) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

//! Whether every rank holds the same bytes.
template <class T>
bool same_on_all_ranks(const std::vector<T>& v) {
  std::uint64_t mine[2] = {hash_of(v), static_cast<std::uint64_t>(v.size())};
  std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(world_size()));
  MPI_Allgather(mine, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, MPI_COMM_WORLD);
  for (std::size_t r = 1; r < all.size() / 2; ++r)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) return false;
  return true;
}

}  // namespace lockstep_mpi_test
