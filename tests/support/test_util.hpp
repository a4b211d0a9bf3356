#pragma once
// Shared test helpers: fresh random seeds (printed on failure), running ranks as threads.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <lockstep/launch/run_threads.hpp>

namespace lockstep_test {

//! A fresh directory under /tmp (mkdtemp), removed with everything in it at scope exit.
struct temp_dir {
  std::string path;
  explicit temp_dir(const std::string& prefix = "lockstep_test") {
    std::string tmpl = "/tmp/" + prefix + "_XXXXXX";
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

//! Runs a shell command (stderr joined to stdout); returns what it printed, its status in rc.
inline std::string command_output(const std::string& cmd, int& rc) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE_MESSAGE(p != nullptr, "cannot run: " << cmd);
  std::string text;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) text.append(buf, n);
  rc = pclose(p);
  return text;
}

//! Runs body(rank, comm) on n threads over a fresh ThreadComm group; a failing rank aborts
//! the group so the others stop waiting, and the root cause is rethrown here.
template <class F>
void run_ranks(int n, F body) {
  auto comms = lockstep::ThreadComm::create_group(n);
  lockstep::detail::run_ranks(
      n, [&](int r) { body(r, comms[static_cast<std::size_t>(r)]); },
      [&](const std::string& why) { comms[0].abort(why); });
}

//! A fresh seed per run; CAPTURE it in the test so a failure can be replayed
//! (LOCKSTEP_TEST_SEED=... fixes it).
inline std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("LOCKSTEP_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

//! How far from zero every pre-activation of a ReLU reference (TestMlp::relu_margin) must stay
//! for a comparison at 1e-5: another implementation sums in another order, and a unit within
//! its rounding (≈1e-7 of the sums) of zero may switch sides — an O(gradient) difference that
//! is no bug (seed 14986634868504541839 in test_fullshard_gpu, momentum and weight decay: 2e-8
//! at step 3). Such data is drawn again (next_seed), the seed of what was compared CAPTUREd.
inline constexpr double relu_margin_needed = 1e-5;
//! The seed after `seed` (splitmix64), for data drawn again.
inline std::uint64_t next_seed(std::uint64_t seed) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! Declares `seed`, a fresh_seed() CAPTUREd for the rest of the scope, then the random engine
//! `engine_decl` seeded with it: `LOCKSTEP_SEEDED(std::mt19937_64 rng);` declares seed and rng.
#define LOCKSTEP_SEEDED(engine_decl)               \
  const auto seed = ::lockstep_test::fresh_seed(); \
  CAPTURE(seed);                                   \
  engine_decl(seed)

//! The lines of `text`, each cut at tabs into `fields` strings (those a line lacks are empty;
//! text after the last is dropped).
inline std::vector<std::vector<std::string>> tab_fields(const std::string& text, std::size_t fields) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    auto& row = rows.emplace_back(fields);
    for (auto& field : row) std::getline(f, field, '\t');
  }
  return rows;
}

template <class T>
std::vector<T> random_vector(std::size_t n, std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(rng));
  return v;
}

//! ‖a − b‖₂ / ‖b‖₂ (b the reference); infinite when the sizes differ or a value is NaN.
template <class T>
double max_rel_diff(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  long double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    long double d = static_cast<long double>(a[i]) - static_cast<long double>(b[i]);
    num += d * d;
    den += static_cast<long double>(b[i]) * static_cast<long double>(b[i]);
  }
  double r = static_cast<double>(std::sqrt(num) / std::max(std::sqrt(den), 1e-300L));
  return std::isnan(r) ? std::numeric_limits<double>::infinity() : r;
}

}  // namespace lockstep_test
