// The run scripts/render_trace.py's test draws (tests/support/test_render_trace.py): CPU ranks
// (ThreadComm) training a small MLP with DataParallel — small buckets so that every step has
// several collectives, DynamicScale and clipping so that finish() has its unscale and clip
// spans, a NaN planted on rank 1 at step `bad` (that step is skipped) — for a few seconds.
// Run it with LOCKSTEP_TRACE=<dir>; each rank's trace is written when its DataParallel goes.
//
// Usage: render_trace_run RANKS STEPS BAD_STEP (BAD_STEP -1: none). Prints "buckets N".
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "mlp.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s RANKS STEPS BAD_STEP\n", argv[0]);
    return 2;
  }
  const int ranks = std::atoi(argv[1]), steps = std::atoi(argv[2]), bad = std::atoi(argv[3]);
  std::atomic<std::size_t> buckets{0};
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    const std::vector<int> dims{64, 192, 192, 192, 10};
    lockstep_test::TestMlp<float> m(dims, 42);
    const lockstep::BucketPolicy small{
        .first_bytes = 16 << 10, .cap_bytes = 64 << 10, .rebuild_after_first_step = false};
    lockstep::DataParallel dp(ctx, m, {.buckets = small, .max_grad_norm = 1.0},
                              lockstep::DynamicScale({.init_scale = 256}));
    lockstep::Sgd opt({.lr = 0.01});
    std::mt19937_64 rng(7 + static_cast<std::uint64_t>(ctx.rank()));
    const std::size_t rows_n = 48;
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> x(rows_n * static_cast<std::size_t>(dims[0]));
    for (auto& v : x) v = u(rng);
    std::vector<int> y(rows_n);
    std::vector<std::size_t> rows(rows_n);
    for (std::size_t i = 0; i < rows_n; ++i) {
      y[i] = static_cast<int>(i % 10);
      rows[i] = i;
    }
    for (int s = 0; s < steps; ++s) {
      auto st = dp.step();
      m.forward_backward(
          x, y, rows,
          [&](std::size_t i) {
            if (s == bad && ctx.rank() == 1 && i == 0)
              static_cast<float*>(m.parameters()[0].grad)[0] = std::numeric_limits<float>::quiet_NaN();
            st.gradient_ready(i);
          },
          st.loss_scale());
      (void)st.finish([&](std::span<const lockstep::param_slice> sl) {
        for (const auto& p : sl)
          opt.step_segments(std::vector<std::size_t>{p.param * 1000000 + p.offset},
                            std::vector<lockstep::segment>{{p.value, p.count}},
                            std::vector<lockstep::segment>{{p.grad, p.count}}, p.type);
      });
    }
    if (ctx.rank() == 0) buckets = dp.stats().bucket_count;
  });
  std::printf("buckets %zu\n", buckets.load());
  return 0;
}
