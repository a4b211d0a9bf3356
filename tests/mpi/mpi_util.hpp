#pragma once
// Helpers for the MPI tests: a seed shared by all ranks, agreement checks over MPI_COMM_WORLD.
// (Collective inputs and references: tests/support/comm_conformance.hpp.)
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <lockstep/mpi/mpi_comm.hpp>

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

inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
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
