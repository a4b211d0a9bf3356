#pragma once
// The run the observability tests watch (test_trace: LOCKSTEP_TRACE's files; test_nvtx: NVTX
// ranges): one rank's part of a small MLP trained with small buckets, clipping and DynamicScale,
// a NaN planted on rank 1 at `bad_step` (that step is skipped), `on_bucket` called with each
// bucket's slices. Returns DataParallel's bucket count.
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "mlp.hpp"
#include "test_util.hpp"

namespace lockstep_test {

template <class Ctx, class OnBucket>
std::size_t observed_run(Ctx& ctx, std::uint64_t seed, int steps, int bad_step, OnBucket&& on_bucket) {
  TestMlp<float> m({7, 16, 9, 3}, seed);
  const lockstep::BucketPolicy small{.first_bytes = 128, .cap_bytes = 256, .rebuild_after_first_step = false};
  lockstep::DataParallel dp(ctx, m, {.buckets = small, .max_grad_norm = 0.5},
                            lockstep::DynamicScale({.init_scale = 64}));
  std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ctx.rank()));
  const auto x = random_vector<float>(8 * 7, rng);
  const std::vector<int> y{0, 1, 2, 0, 1, 2, 0, 1};
  const std::vector<std::size_t> rows{0, 1, 2, 3, 4, 5, 6, 7};
  for (int s = 0; s < steps; ++s) {
    auto st = dp.step();
    m.forward_backward(
        x, y, rows,
        [&](std::size_t i) {
          if (s == bad_step && ctx.rank() == 1 && i == 0)
            static_cast<float*>(m.parameters()[0].grad)[0] = std::numeric_limits<float>::quiet_NaN();
          st.gradient_ready(i);
        },
        st.loss_scale());
    (void)st.finish([&](std::span<const lockstep::param_slice> sl) { on_bucket(sl); });
  }
  return dp.stats().bucket_count;
}

}  // namespace lockstep_test
