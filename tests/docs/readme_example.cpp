// The README's usage block (verbatim between the snippet markers), with docs/api.md's model.
// Built by tests/docs/CMakeLists.txt for CPU threads and under mpirun (both run) and as CUDA
// with MPI also linked (compiled): one body for every mode run(Auto) can pick.
#include "api_model.hpp"

// [snippet README.md#1]
#include <lockstep/lockstep.hpp>
// Linear and Data: docs/api.md's model — parameters() views each parameter's values and
// gradient; forward_backward adds d(loss_scale · loss)/dθ and calls ready(i) per final gradient.

int main() {
  const Data data = make_data(4096, 8, 7);
  lockstep::run(lockstep::Auto{}, [&](auto& ctx) {  // CPU threads, MPI processes, or GPUs
    Linear model(data.d);
    lockstep::DataParallel dp(ctx, model, lockstep::Accumulate<>(2), lockstep::DynamicScale());
    lockstep::DistributedSampler sampler(data.n, ctx, {.seed = 42});
    lockstep::Sgd opt({.lr = 0.05, .momentum = 0.9});
    for (; sampler.epoch() < 4; sampler.set_epoch(sampler.epoch() + 1)) {
      for (auto batch : sampler.batches(32)) {
        auto step = dp.step();  // averages gradients at every 2nd micro-step
        model.forward_backward(data, batch, step.loss_scale(), step.on_gradient_ready());
        const auto r = step.finish();  // averaged over ranks + unscaled on a syncing step
        if (r.synced) opt.step(dp.parameters(), /*skip=*/!r.applied);
        sampler.advance(batch.size());
      }
    }
  });
}
// [end snippet]
