// lockstep::torch consumed without the project's own find_package(Torch): a torch::nn::Linear
// wrapped in lockstep::TorchModule takes a few DataParallel SGD steps on two CPU ranks, each
// rank starting from different weights and seeing different data. Afterwards the ranks' weights
// must be equal (rank 0's broadcast, then averaged gradients), have moved, and match plain
// libtorch taking the same steps on both ranks' data at once. Exit code 0 on success.
#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

// libtorch's headers for what is used, not <torch/torch.h>: they are most of the compile time.
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <cstdio>
#include <vector>

int main() {
  torch::set_num_threads(1);
  constexpr int ranks = 2, steps = 3, rows = 8;
  std::vector<torch::nn::Linear> nets;
  std::vector<torch::Tensor> xs, ys;
  for (int r = 0; r < ranks; ++r) {
    torch::manual_seed(100 + r);
    nets.emplace_back(5, 1);
    xs.push_back(torch::randn({rows, 5}));
    ys.push_back(torch::randn({rows, 1}));
  }
  // The reference: rank 0's starting weights, the mean loss over both ranks' rows.
  torch::nn::Linear reference(5, 1);
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < reference->parameters().size(); ++i)
      reference->parameters()[i].copy_(nets[0]->parameters()[i]);
  }
  const auto start = nets[0]->weight.clone();

  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    auto& net = nets[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(net);
    lockstep::DataParallel dp(ctx, tm);  // rank 0's weights everywhere
    torch::optim::SGD opt(tm.tensors(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < steps; ++s) {
      auto step = dp.step();
      const auto& x = xs[static_cast<std::size_t>(ctx.rank())];
      const auto& y = ys[static_cast<std::size_t>(ctx.rank())];
      tm.backward(torch::mse_loss(net(x), y), step.on_gradient_ready());
      if (step.finish()) opt.step();
    }
  });

  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  const auto x = torch::cat(xs), y = torch::cat(ys);
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad();
    torch::mse_loss(reference(x), y).backward();
    ref_opt.step();
  }

  bool ok = !torch::equal(nets[0]->weight, start);
  for (std::size_t i = 0; i < reference->parameters().size(); ++i) {
    const auto a = nets[0]->parameters()[i], b = nets[1]->parameters()[i];
    ok = ok && torch::equal(a, b) && torch::allclose(a, reference->parameters()[i], 1e-5, 1e-6);
  }
  if (!ok) {
    std::fprintf(stderr,
                 "lockstep::torch: after %d steps the ranks' weights differ, did not move, "
                 "or differ from plain libtorch on the whole batch\n",
                 steps);
    return 1;
  }
  std::printf("lockstep %s with libtorch %s: %d DataParallel steps of a Linear on %d ranks: ok\n",
              lockstep::version_string, TORCH_VERSION, steps, ranks);
  return 0;
}
