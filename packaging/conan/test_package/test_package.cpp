// Two CPU ranks average their gradients through the packaged headers; exits non-zero if the
// mean is wrong.
#include <cstdio>
#include <vector>

#include <lockstep/lockstep.hpp>

int main() {
  bool ok = true;
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    std::vector<double> v{static_cast<double>(ctx.rank() + 1), 10.0 * (ctx.rank() + 1)};
    lockstep::all_reduce_scalars(ctx.comm(), std::span<double>(v), lockstep::reduce_op::avg);
    if (v[0] != 1.5 || v[1] != 15.0) ok = false;
  });
  std::printf("lockstep %s from Conan: %s\n", lockstep::version_string, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
