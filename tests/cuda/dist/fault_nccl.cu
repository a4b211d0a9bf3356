// The fault suite over NCCL (docs/reliability.md): one process per GPU under lockstep-run,
// driven by expect_failure (exit status, the messages, the time). Each rank catches what ended
// it and prints "rank R ended: <what>", so the test sees every rank's cause.
//   skip:      rank 1 lets one bucket's all-reduce fall through (the order check names both)
//   extra:     rank 1 runs a metrics all-reduce the others do not (the order check names both)
//   shapes:    rank 1 rebuilds its model with another shape after two steps
//   oom:       rank 1 runs out of GPU memory in the first step
//   nonfinite: rank 1's gradients hold a NaN every step; DeviceDynamicScale's skip limit (5)
#include <cstdio>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/cuda.cuh>
#include <lockstep/lockstep.hpp>

#include "device_vector.cuh"
#include "gpu_mlp.cuh"
#include "launched.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;

namespace {

__global__ void poison(float* g) { *g = __int_as_float(0x7fc00000); }  // NaN

struct SkipOne {
  int rank = -1, at = -1, seen = 0;
  lockstep::NcclComm::work reduce(lockstep::NcclComm& comm, void* data, std::size_t n, lockstep::dtype t) {
    if (comm.rank() == rank && seen++ == at) return {};
    return comm.all_reduce(data, data, n, t, lockstep::reduce_op::avg);
  }
};

std::vector<std::vector<float>> values_of(TestMlp<float>& m) {
  std::vector<std::vector<float>> out;
  for (auto& p : m.parameters()) {
    auto v = p.value_as<float>();
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int exit_code = 0;
  const auto here = lockstep_test::launched_on_gpus("fault_nccl", "lockstep-run", exit_code);
  if (!here) return exit_code;
  const auto* info = &here->info;
  const int rank = info->rank;
  try {
    const std::vector<int> dims{8, 8, 8, 8, 8};
    const lockstep::BucketPolicy equal{.first_bytes = 256, .cap_bytes = 256, .rebuild_after_first_step = false};
    std::mt19937_64 rng(7);
    const auto X = random_vector<float>(64, rng, -1, 1);
    const std::vector<int> y{0, 1, 2, 3, 4, 5, 6, 7}, rows{0, 1, 2, 3};
    lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
      cudaStream_t s = ctx.comm().compute_stream();
      const lockstep_test::device_vector<float> dX(X);
      const lockstep_test::device_vector<int> dy(y), drows(rows);
      TestMlp<float> init(dims, 7);
      std::optional<GpuMlp> m(std::in_place, dims, values_of(init), s);
      const auto train = [&](auto& dp, int steps, auto&& before_ready) {
        for (int k = 0; k < steps; ++k) {
          auto st = dp.step();
          m->forward_backward(dX.p, dy.p, drows.p, 4, [&](std::size_t i) {
            before_ready(i);
            st.on_gradient_ready()(i);
          });
          if (st.finish()) m->sgd(0.1f);
        }
      };
      const auto none = [](std::size_t) {};
      if (mode == "skip") {
        lockstep::DataParallel dp(ctx, *m, {.buckets = equal}, SkipOne{.rank = 1, .at = 11});
        train(dp, 4, none);
      } else if (mode == "nonfinite") {
        lockstep::DataParallel dp(ctx, *m, {.buckets = equal},
                                  lockstep::DeviceDynamicScale({.init_scale = 1024.0, .max_consecutive_skips = 5}));
        dp.scaler().attach(dp.comm());
        for (int k = 0; k < 200; ++k) {
          auto st = dp.step();
          const auto params = dp.parameters();
          m->forward_backward(dX.p, dy.p, drows.p, 4, [&](std::size_t i) {
            if (ctx.rank() == 1 && i == 0) poison<<<1, 1, 0, s>>>(static_cast<float*>(params[0].grad));
            st.on_gradient_ready()(i);
          });
          (void)st.finish();
          LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));  // a training loop that logs its loss
        }
      } else {
        lockstep::DataParallel dp(ctx, *m, {.buckets = equal});
        if (mode == "oom" && ctx.rank() == 1) {
          void* huge = nullptr;  // 1 PiB: more than any GPU has
          LOCKSTEP_TRY_CUDA(cudaMalloc(&huge, std::size_t{1} << 50));
        }
        train(dp, 2, none);
        if (mode == "extra" && ctx.rank() == 1) {
          double acc[2] = {0.5, 1.0};
          lockstep::all_reduce_scalars(ctx.comm(), std::span<double>(acc), lockstep::reduce_op::sum);
        }
        if (mode == "shapes" && ctx.rank() == 1) {
          TestMlp<float> other({8, 8, 9, 8, 8}, 7);
          m.reset();  // the same object, another shape: DataParallel still holds a reference to it
          m.emplace(std::vector<int>{8, 8, 9, 8, 8}, values_of(other), s);
        }
        train(dp, 2, none);
      }
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
      std::printf("rank %d: training ended normally, which it must not\n", ctx.rank());
    });
  } catch (const std::exception& e) {
    std::printf("rank %d ended: %s\n", rank, e.what());
    std::fflush(stdout);
    return 1;
  }
  return 0;
}
