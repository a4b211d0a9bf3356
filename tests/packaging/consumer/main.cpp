// Packaging smoke test: two ThreadComm ranks all-reduce random numbers; the result must
// equal the sum computed here. Exit code 0 on success, 1 on any mismatch or error.
// The umbrella header: every header it includes must be in the package.
#include <lockstep/lockstep.hpp>

#include <cstdio>
#include <exception>
#include <random>
#include <thread>
#include <vector>

int main() {
  static_assert(LOCKSTEP_VERSION_MAJOR == 0 && LOCKSTEP_VERSION_MINOR >= 1);
  const unsigned seed = std::random_device{}();
  std::printf("lockstep %s, seed %u\n", lockstep::version_string, seed);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-100.0, 100.0);

  constexpr int ranks = 2;
  constexpr std::size_t n = 1000;
  std::vector<std::vector<double>> in(ranks, std::vector<double>(n));
  for (auto& v : in)
    for (auto& x : v) x = dist(gen);
  std::vector<std::vector<double>> out(ranks, std::vector<double>(n, 0.0));

  auto comms = lockstep::ThreadComm::create_group(ranks);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        comms[r].all_reduce(in[r].data(), out[r].data(), n, lockstep::dtype::f64, lockstep::reduce_op::sum).wait();
      } catch (...) {
        errors[r] = std::current_exception();
        comms[r].abort("rank failed");
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r)
    if (errors[r]) {
      try {
        std::rethrow_exception(errors[r]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d failed: %s\n", r, e.what());
      }
      return 1;
    }

  // Two addends: a + b is exact to compare (addition is commutative in IEEE arithmetic).
  for (int r = 0; r < ranks; ++r)
    for (std::size_t i = 0; i < n; ++i)
      if (out[r][i] != in[0][i] + in[1][i]) {
        std::fprintf(stderr, "mismatch (seed %u): rank %d element %zu: %.17g, expected %.17g\n", seed, r, i, out[r][i],
                     in[0][i] + in[1][i]);
        return 1;
      }
  std::printf("all_reduce of %zu doubles on %d ranks: ok\n", n, ranks);
  return 0;
}
