// docs/api.md's smallest complete training loop (its second code block, verbatim between the
// snippet markers). Built three ways by tests/docs/CMakeLists.txt: for CPU threads (run by
// ctest), with lockstep::mpi (run under mpirun) and with lockstep::cuda (compiled), so one
// body is checked against every mode run(Auto) can pick.
#include <cstdio>

#include "api_model.hpp"

// [snippet docs/api.md#2]
int main() {
  const Data data = make_data(4096, 8, 7);
  lockstep::run(lockstep::Auto{}, [&](auto& ctx) {  // CPU threads, all local GPUs, or processes
    Linear model(data.d);
    lockstep::DataParallel dp(ctx, model, lockstep::DynamicScale());
    lockstep::DistributedSampler sampler(data.n, ctx, {.seed = 42});
    lockstep::Sgd opt({.lr = 0.05, .momentum = 0.9});
    for (; sampler.epoch() < 4; sampler.set_epoch(sampler.epoch() + 1)) {
      double loss = 0.0;
      const auto batches = sampler.batches(32);
      for (auto batch : batches) {
        auto step = dp.step();
        loss += model.forward_backward(data, batch, step.loss_scale(), step.on_gradient_ready());
        const auto r = step.finish();  // averaged over ranks, unscaled, inf/NaN agreed
        opt.step(dp.parameters(), /*skip=*/!r.applied);
        sampler.advance(batch.size());
      }
      loss = lockstep::mean_across_ranks(ctx.comm(), loss / static_cast<double>(batches.size()));
      if (ctx.is_root())
        std::printf("epoch %llu: mean loss %.5f over %d ranks\n", static_cast<unsigned long long>(sampler.epoch() + 1),
                    loss, ctx.size());
    }
  });
}
// [end snippet]
