// lockstep::TorchModule on CPU ranks (ThreadComm): a libtorch model trained data-parallel
// equals the same model trained on one rank with the whole batch; unused parameters, buffers,
// bf16 parameters, zero copy and wrong use. References are plain libtorch, without lockstep.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/torch.hpp>

#include "../../examples/03_gpt2_torch/gpt2.hpp"
#include "test_util.hpp"
#include "torch_test_util.hpp"

namespace {

using namespace lockstep_test;

struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl()
      : trunk(register_module("trunk", torch::nn::Linear(5, 7))), a(register_module("a", torch::nn::Linear(7, 3))),
        b(register_module("b", torch::nn::Linear(7, 3))), never(register_module("never", torch::nn::Linear(7, 3))) {}
  torch::Tensor forward(const torch::Tensor& x, bool use_a) { return (use_a ? a : b)(torch::tanh(trunk(x))); }
  torch::nn::Linear trunk, a, b, never;
};
TORCH_MODULE(TwoHeads);

struct NetImpl : torch::nn::Module {
  NetImpl() : l1(register_module("l1", torch::nn::Linear(6, 8))), l2(register_module("l2", torch::nn::Linear(8, 1))) {}
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) {
    return torch::mse_loss(l2(torch::relu(l1(x))), y);
  }
  torch::nn::Linear l1, l2;
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor x, y;
};

// What DataParallel's construction throws (mismatch_error) when rank r of `ranks` wraps pick(r).
template <class Pick>
std::string construction_mismatch(int ranks, Pick&& pick) {
  try {
    lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
      lockstep::TorchModule tm(pick(ctx.rank()));
      lockstep::DataParallel dp(ctx, tm);
    });
  } catch (const lockstep::mismatch_error& e) {
    return e.what();
  }
  return {};
}

// [snippet docs/torch.md#1]
void train(auto& ctx, Net& net, const std::vector<Batch>& my_batches) {  // once per rank
  lockstep::TorchModule tm(net);                                         // DDP(model)
  lockstep::DataParallel dp(ctx, tm);                                    // rank 0's parameters and buffers
  torch::optim::AdamW opt(tm.tensors(), torch::optim::AdamWOptions(3e-4));
  for (const auto& b : my_batches) {
    auto step = dp.step();
    tm.backward(net->loss(b.x, b.y), step.on_gradient_ready());  // buckets reduced during backward
    if (step.finish()) opt.step();                               // .grad holds the average over ranks
  }
}
// [end snippet]

}  // namespace

TEST_SUITE("torch") {

TEST_CASE("TorchModule: docs/torch.md's loop leaves every rank with the same parameters") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  constexpr int ranks = 2;
  std::vector<Net> nets;
  std::vector<std::vector<Batch>> batches(ranks);
  for (int r = 0; r < ranks; ++r) {
    torch::manual_seed(seed + static_cast<std::uint64_t>(r));  // different models and data
    nets.emplace_back();
    for (int b = 0; b < 3; ++b) batches[r].push_back({torch::randn({4, 6}), torch::randn({4, 1})});
  }
  const auto before = nets[0]->parameters()[0].clone();
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    train(ctx, nets[static_cast<std::size_t>(ctx.rank())], batches[static_cast<std::size_t>(ctx.rank())]);
  });
  CHECK(rel_diff(*nets[1], *nets[0]) == 0.0);
  CHECK_FALSE(torch::equal(nets[0]->parameters()[0], before));
}

// N CPU ranks, each taking `micro` micro-batches of B sequences per optimizer step (the
// gradients accumulated over them, averaged by DataParallel), against one rank taking
// all N * micro * B sequences: at once when micro is 1, else the same micro-batches, one
// backward each (the same arithmetic per sequence: a batch of 1 and a batch of 6 round
// differently, which AdamW's normalisation lifts to 1e-4 after a few steps).
void check_equivalence(int ranks, int B, int micro) {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(ranks);
  CAPTURE(B);
  CAPTURE(micro);
  const auto c = tiny();
  constexpr int steps = 4;
  const int per_rank = B * micro;
  // One batch for every step: the loss must go down (the model learns it by heart).
  const auto batch = tokens(ranks * per_rank, c, seed + 1);
  std::vector<torch::Tensor> data(steps, batch);

  torch::manual_seed(seed);
  gpt2::Gpt reference(c);
  std::vector<gpt2::Gpt> replicas;
  for (int r = 0; r < ranks; ++r) {
    torch::manual_seed(seed ^ static_cast<std::uint64_t>(r + 7));  // different: rank 0's values win
    replicas.emplace_back(c);
  }
  copy_parameters(*replicas[0], *reference);

  // The reference: plain libtorch, one process, the whole batch.
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  std::vector<double> ref_loss;
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad();
    const int chunk = micro == 1 ? ranks * per_rank : B, chunks = ranks * per_rank / chunk;
    double loss_sum = 0;
    for (int k = 0; k < chunks; ++k) {
      auto rows = data[s].narrow(0, k * chunk, chunk);
      auto loss = reference->loss(rows.narrow(1, 0, c.context), rows.narrow(1, 1, c.context));
      (loss / chunks).backward();
      loss_sum += loss.item<double>() / chunks;
    }
    ref_opt.step();
    ref_loss.push_back(loss_sum);
  }

  std::vector<double> mean_loss(steps, 0.0);
  std::vector<int> bound(static_cast<std::size_t>(ranks), 0);
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    gpt2::Gpt& model = replicas[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(model);
    lockstep::DataParallel dp(ctx, tm, {}, lockstep::Accumulate<>(micro));
    torch::optim::AdamW opt(tm.tensors(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    for (int s = 0; s < steps; ++s) {
      double loss_sum = 0;
      for (int m = 0; m < micro; ++m) {
        auto rows = data[s].narrow(0, ctx.rank() * per_rank + m * B, B);
        auto x = rows.narrow(1, 0, c.context), y = rows.narrow(1, 1, c.context);
        auto step = dp.step();
        auto loss = model->loss(x, y);
        tm.backward(loss, step.on_gradient_ready());  // averaged over the micro-batches by DataParallel
        const auto r = step.finish();
        REQUIRE(r.synced == (m + 1 == micro));
        if (r.synced) REQUIRE(r.applied);
        loss_sum += loss.template item<double>() / micro;
      }
      opt.step();  // torch::optim on lockstep-averaged gradients
      mean_loss[static_cast<std::size_t>(s)] = lockstep::mean_across_ranks(ctx.comm(), loss_sum);
    }
    // Zero copy from the second step on: .grad is a view of the arena.
    const auto ps = dp.parameters();
    bool all = true;
    for (std::size_t i = 0; i < ps.size(); ++i) all = all && tm.tensors()[i].grad().data_ptr() == ps[i].grad;
    bound[static_cast<std::size_t>(ctx.rank())] = all ? 1 : 0;
  });
  for (int s = 0; s < steps; ++s) CHECK(mean_loss[s] == doctest::Approx(ref_loss[s]).epsilon(1e-5));
  CHECK(ref_loss.back() < ref_loss.front());
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const double d = rel_diff(*replicas[r], *reference);
    MESSAGE("rank " << r << ": relative difference " << d);
    CHECK(d <= 1e-5);
    CHECK(bound[r] == 1);
    // DataParallel is gone: the gradients are the module's own again, with the last values.
    for (auto& p : replicas[r]->parameters()) CHECK(std::isfinite(p.grad().sum().item<double>()));
  }
}

TEST_CASE("TorchModule: 3 CPU ranks x batch B == 1 rank x batch 3B after 4 AdamW steps (tiny GPT-2)") {
  check_equivalence(3, 2, 1);
}

// Accumulation: autograd hands each micro-batch's gradient to the hook, which adds it into the
// arena (module.hpp) — the second micro-batch must add to the first, not replace it.
TEST_CASE("TorchModule: 2 CPU ranks x 3 accumulated micro-batches == 1 rank x the whole batch (tiny GPT-2)") {
  check_equivalence(2, 1, 3);
}

// ShardedOptimizer with a libtorch module: each rank's AdamW state covers 1/N of the model, the
// parameters live in the shards' arena (bind_value), and the forward waits for each block's
// all-gather just before using it (gather_in_forward, gpt2::before_fn + indices_of). It must end
// where the unsharded run ends, and the module must hold its trained values after the
// DataParallel is gone.
TEST_CASE(
    "TorchModule sharded: 3 CPU ranks - values bound - gathers waited for block by block == unsharded (tiny GPT-2)") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const auto c = tiny();
  constexpr int ranks = 3, B = 2, steps = 4;
  const auto batch = tokens(ranks * B, c, seed + 1);
  torch::manual_seed(seed);
  gpt2::Gpt init(c);
  const lockstep::AdamWOptions ao{.lr = 1e-3, .weight_decay = 0.1};
  std::vector<gpt2::Gpt> plain, sharded;
  for (int r = 0; r < ranks; ++r) {
    torch::manual_seed(seed ^ static_cast<std::uint64_t>(r + 3));  // rank 0's values win
    plain.emplace_back(c);
    sharded.emplace_back(c);
  }
  copy_parameters(*plain[0], *init);
  copy_parameters(*sharded[0], *init);
  std::vector<int> checks(ranks, 0);
  std::vector<std::size_t> state(ranks, 0);
  const auto rows_of = [&](int rank) { return batch.narrow(0, rank * B, B); };
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    gpt2::Gpt& model = plain[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(model);
    lockstep::DataParallel dp(ctx, tm);
    lockstep::AdamW opt(ao);
    for (int s = 0; s < steps; ++s) {
      auto rows = rows_of(ctx.rank());
      auto step = dp.step();
      tm.backward(model->loss(rows.narrow(1, 0, c.context), rows.narrow(1, 1, c.context)), step.on_gradient_ready());
      if (step.finish()) opt.step(dp.parameters());
    }
  });
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    gpt2::Gpt& model = sharded[r];
    lockstep::TorchModule tm(model);
    std::vector<torch::Tensor> trained;
    {
      lockstep::DataParallel dp(ctx, tm, {.buckets = {.first_bytes = 2048, .cap_bytes = 8192}},
                                lockstep::ShardedOptimizer{.gather_in_forward = true});
      lockstep::AdamW opt(ao);
      std::vector<std::size_t> waited;  // the parameters the forward waited for, in order
      const gpt2::before_fn before = [&](torch::nn::Module& sub) {
        for (auto i : tm.indices_of(sub)) {
          dp.wait_parameters(i);
          waited.push_back(i);
        }
      };
      for (int s = 0; s < steps; ++s) {
        auto rows = rows_of(ctx.rank());
        auto step = dp.step();
        waited.clear();
        tm.backward(model->loss(rows.narrow(1, 0, c.context), rows.narrow(1, 1, c.context), before),
                    step.on_gradient_ready());
        step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
      }
      dp.wait_all_parameters();
      std::vector<std::size_t> every(tm.tensors().size());
      std::iota(every.begin(), every.end(), std::size_t{0});
      const bool bound = dp.stats().values_bound && tm.tensors()[5].data_ptr() == dp.parameters()[5].value;
      checks[r] = (waited == every ? 1 : 0) + (bound ? 2 : 0);  // registration order, each once
      for (std::size_t i = 0; i < opt.slot_count(); ++i) state[r] += opt.state<float>(i, 0).size();
      for (auto& p : model->parameters()) trained.push_back(p.detach().clone());
    }
    auto ps = model->parameters();  // after the DataParallel: the module's own storage, same values
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (!torch::equal(ps[i].detach(), trained[i])) checks[r] = -1;
  });
  std::int64_t P = 0;
  for (auto& p : init->parameters()) P += p.numel();
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(checks[r] == 3);
    CHECK(state[r] <= static_cast<std::size_t>(P) / ranks + 64);  // 1/N of the model (units rounded up to N)
    const double d = rel_diff(*sharded[r], *plain[0]);
    MESSAGE("sharded rank " << r << " vs unsharded: relative difference " << d);
    CHECK(d <= 1e-6);
    CHECK(rel_diff(*sharded[r], *sharded[0]) == 0.0);
  }
  CHECK(rel_diff(*plain[0], *init) > 1e-4);  // it trained
}

// Full sharding of a libtorch module: the blocks are GPT-2's transformer blocks (set_blocks),
// the model's forward runs each through TorchBlocks (gpt2::run_fn), the training loop holds
// block 0 (embeddings, final LayerNorm, head) around the forward and the backward. ZeRO-2 and
// ZeRO-3, with and without recomputation (activation checkpointing), must end where the
// unsharded run ends; the module holds its trained values after the DataParallel is gone.
template <class Strategy>
void check_fullshard_torch(bool recompute) {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(recompute);
  const auto c = tiny();
  constexpr int ranks = 3, B = 2, steps = 4;
  const auto batch = tokens(ranks * B, c, seed + 1);
  torch::manual_seed(seed);
  gpt2::Gpt init(c);
  const lockstep::AdamWOptions ao{.lr = 1e-3, .weight_decay = 0.1};
  std::vector<gpt2::Gpt> plain, sharded;
  for (int r = 0; r < ranks; ++r) {
    torch::manual_seed(seed ^ static_cast<std::uint64_t>(r + 3));  // rank 0's values win
    plain.emplace_back(c);
    sharded.emplace_back(c);
  }
  copy_parameters(*plain[0], *init);
  copy_parameters(*sharded[0], *init);
  const auto rows_of = [&](int rank) { return batch.narrow(0, rank * B, B); };
  std::vector<double> plain_loss(steps), sharded_loss(steps);
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    gpt2::Gpt& model = plain[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(model);
    lockstep::DataParallel dp(ctx, tm);
    lockstep::AdamW opt(ao);
    for (int s = 0; s < steps; ++s) {
      auto rows = rows_of(ctx.rank());
      auto step = dp.step();
      auto loss = model->loss(rows.narrow(1, 0, c.context), rows.narrow(1, 1, c.context));
      tm.backward(loss, step.on_gradient_ready());
      if (step.finish()) opt.step(dp.parameters());
      plain_loss[static_cast<std::size_t>(s)] = lockstep::mean_across_ranks(ctx.comm(), loss.template item<double>());
    }
  });
  std::vector<int> checks(ranks, 0);
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    gpt2::Gpt& model = sharded[r];
    std::vector<torch::Tensor> trained;
    {
      // [snippet docs/torch.md#3]
      lockstep::TorchModule tm(model);
      tm.set_blocks(std::vector<std::shared_ptr<torch::nn::Module>>(model->blocks->begin(), model->blocks->end()));
      lockstep::DataParallel dp(ctx, tm, Strategy{});  // FullySharded or ShardedGradients
      lockstep::TorchBlocks blocks;
      lockstep::shard_blocks(dp, blocks);  // model->loss(..., blocks.function()) runs each block as one
      lockstep::AdamW opt(ao);             // over this rank's shards (FusedAdamW on GPUs)
      // [end snippet]
      for (int s = 0; s < steps; ++s) {
        auto rows = rows_of(ctx.rank());
        auto x = rows.narrow(1, 0, c.context), y = rows.narrow(1, 1, c.context);
        // [snippet docs/torch.md#3]
        auto step = dp.step();
        torch::Tensor loss;
        {  // block 0 (embeddings, final LayerNorm, head) spans the forward, and then the backward
          auto root = dp.use_block(0, lockstep::pass::forward);
          loss = model->loss(x, y, {}, blocks.function(recompute));  // recompute: activation checkpointing
        }
        {
          auto root = dp.use_block(0, lockstep::pass::backward);
          tm.backward(loss, step.on_gradient_ready());
        }
        step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl); });
        // [end snippet]
        sharded_loss[static_cast<std::size_t>(s)] =
            lockstep::mean_across_ranks(ctx.comm(), loss.template item<double>());
      }
      // Between steps, FullySharded's parameters hold nothing (0 elements); wait_all_parameters
      // gathers them whole.
      const bool released = !std::is_same_v<Strategy, lockstep::FullySharded> || tm.tensors()[3].numel() == 0;
      dp.wait_all_parameters();
      checks[r] = (released ? 1 : 0) + (tm.tensors()[3].numel() > 0 ? 2 : 0);
      for (auto& p : model->parameters()) trained.push_back(p.detach().clone());
    }
    auto ps = model->parameters();  // after the DataParallel: the module's own storage, same values
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (!torch::equal(ps[i].detach(), trained[i])) checks[r] = -1;
  });
  for (int s = 0; s < steps; ++s) CHECK(sharded_loss[s] == doctest::Approx(plain_loss[s]).epsilon(1e-5));
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(checks[r] == 3);
    const double d = rel_diff(*sharded[r], *plain[0]);
    MESSAGE("fully sharded rank " << r << " vs unsharded: relative difference " << d);
    CHECK(d <= 1e-6);
    CHECK(rel_diff(*sharded[r], *sharded[0]) == 0.0);
  }
  CHECK(rel_diff(*plain[0], *init) > 1e-4);  // it trained
}

TEST_CASE("TorchModule fullshard zero3: 3 CPU ranks == unsharded - with and without recompute (tiny GPT-2)") {
  check_fullshard_torch<lockstep::FullySharded>(false);
  check_fullshard_torch<lockstep::FullySharded>(true);
}

TEST_CASE("TorchModule fullshard zero2: 3 CPU ranks == unsharded - recomputed blocks (tiny GPT-2)") {
  check_fullshard_torch<lockstep::ShardedGradients>(true);
}

// A chain of blocks, one of them holding an f32 and an f64 Linear (two units, launched apart),
// trained under Strategy with plain SGD on the shards; against the same chain Replicated.
struct MixedImpl : torch::nn::Module {
  MixedImpl() {
    f = register_module("f", torch::nn::Linear(8, 8));
    d = register_module("d", torch::nn::Linear(8, 8));
    d->to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& t) {
    return torch::tanh(f(t) + d(t.to(torch::kDouble)).to(torch::kFloat));
  }
  torch::nn::Linear f{nullptr}, d{nullptr};
};
TORCH_MODULE(Mixed);
struct ChainImpl : torch::nn::Module {
  explicit ChainImpl(int n) {
    for (int i = 0; i < n; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(8, 8)));
    mixed = register_module("mixed", Mixed());
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() {
    std::vector<std::shared_ptr<torch::nn::Module>> b;
    for (const auto& l : layers) b.push_back(l.ptr());
    b.push_back(mixed.ptr());
    return b;
  }
  torch::Tensor loss(const torch::Tensor& x, const gpt2::run_fn& run) {
    auto h = x;
    std::size_t k = 0;
    for (auto l : layers) {  // (a holder per block: the recomputation calls it again)
      const gpt2::block_fn f = [l](const torch::Tensor& t) mutable { return torch::tanh(l->forward(t)); };
      h = run ? run(++k, h, f) : f(h);
    }
    const gpt2::block_fn m = [mm = mixed](const torch::Tensor& t) mutable { return mm->forward(t); };
    h = run ? run(++k, h, m) : m(h);
    return head(h).pow(2).mean();
  }
  std::vector<torch::nn::Linear> layers;
  Mixed mixed{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Chain);

// bf16: the forward (not the backward) runs under CPU bf16 autocast.
template <class Strategy>
std::vector<torch::Tensor> train_chain(std::uint64_t seed, Strategy strategy, bool recompute, bool bf16 = false) {
  std::vector<torch::Tensor> out;
  std::vector<Chain> nets;  // built here, one after the other: libtorch's generator is global
  std::vector<torch::Tensor> xs;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(seed);  // the same values on both ranks (and in every run)
    nets.emplace_back(6);
    torch::manual_seed(seed + 1 + static_cast<std::uint64_t>(r));
    xs.push_back(torch::randn({4, 8}));
  }
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    Chain& net = nets[static_cast<std::size_t>(ctx.rank())];
    const auto& x = xs[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(net);
    if constexpr (lockstep::detail::is_block_sharded<Strategy>::value) tm.set_blocks(net->blocks());
    lockstep::DataParallel dp(ctx, tm, strategy);
    using DP = std::remove_cvref_t<decltype(dp)>;
    lockstep::TorchBlocks blocks;
    gpt2::run_fn run;
    if constexpr (DP::block_sharded) {
      lockstep::shard_blocks(dp, blocks);
      run = blocks.function(recompute);
    }
    const auto sgd = [](std::span<const lockstep::param_slice> sl) {
      for (const auto& p : sl) {
        const auto step = [&]<class T>(T) {
          for (std::size_t i = 0; i < p.count; ++i)
            static_cast<T*>(p.value)[i] -= static_cast<T>(0.5) * static_cast<const T*>(p.grad)[i];
        };
        if (p.type == lockstep::dtype::f64) step(double{});
        else step(float{});
      }
    };
    const auto autocast = [&](bool on) {  // leaving it drops its cached casts, as torch.autocast's exit does
      lockstep::detail::set_autocast(c10::DeviceType::CPU, on, at::kBFloat16);
      if (!on) at::autocast::clear_cache();
    };
    for (int s = 0; s < 3; ++s) {
      auto st = dp.step();
      torch::Tensor loss;
      if constexpr (DP::block_sharded) {
        {
          auto root = dp.use_block(0, lockstep::pass::forward);
          autocast(bf16);
          loss = net->loss(x, run);
          autocast(false);
        }
        auto root = dp.use_block(0, lockstep::pass::backward);
        tm.backward(loss, st.on_gradient_ready());
      } else {
        autocast(bf16);
        loss = net->loss(x, run);
        autocast(false);
        tm.backward(loss, st.on_gradient_ready());
      }
      if constexpr (DP::sharded) {
        st.finish(sgd);
      } else {
        st.finish();
        for (const auto& p : dp.parameters())
          sgd(std::span<const lockstep::param_slice>(
              std::vector<lockstep::param_slice>{{0, 0, p.numel(), p.type, p.value, p.grad}}));
      }
    }
    dp.wait_all_parameters();
    if (ctx.rank() == 0)
      for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  });
  return out;
}

// Autograd saves views of parameters (weight.t()): a block's backward must read the values its
// own backward use gathered even when the buffer its forward used holds another block by then
// (prefetch 2 and 3 over 7 blocks); a block of two element types reports both units' gradients.
TEST_CASE("TorchModule fullshard zero3: saved views of released blocks - a block of two element types") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const auto ref = train_chain(seed, lockstep::Replicated{}, false);
  for (int prefetch : {1, 2, 3})
    for (bool recompute : {false, true}) {
      CAPTURE(prefetch);
      CAPTURE(recompute);
      lockstep::FullySharded fs;
      fs.buffers.prefetch = prefetch;
      const auto got = train_chain(seed, fs, recompute);
      REQUIRE(got.size() == ref.size());
      for (std::size_t i = 0; i < ref.size(); ++i) CHECK(torch::allclose(got[i], ref[i], 1e-6, 1e-7));
    }
  const auto zero2 = train_chain(seed, lockstep::ShardedGradients{}, false);
  for (std::size_t i = 0; i < ref.size(); ++i) CHECK(torch::allclose(zero2[i], ref[i], 1e-6, 1e-7));
}

// FullySharded::param_dtype = bf16: fp32 master shards, bf16 values lent to the blocks (their
// f32 parameters; the f64 Linear stays f64) and bf16 gradients widened for the reduce-scatter.
// The same numbers as the unsharded model under bf16 autocast, whose casts round the fp32
// weights alike and whose backward widens the bf16 gradients alike; the recomputed blocks run
// under the forward's autocast (the backward runs without it) and train the same.
TEST_CASE("TorchModule fullshard zero3: bf16 param_dtype == unsharded under bf16 autocast - recomputed too") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  const auto ref = train_chain(seed, lockstep::Replicated{}, false, true);
  const auto fp32 = train_chain(seed, lockstep::Replicated{}, false, false);
  double apart = 0;  // bf16 compute differs from fp32: the comparison can tell them apart
  for (std::size_t i = 0; i < ref.size(); ++i) apart = std::max(apart, (ref[i] - fp32[i]).abs().max().item<double>());
  CHECK(apart > 1e-5);
  for (bool recompute : {false, true}) {
    CAPTURE(recompute);
    lockstep::FullySharded fs;
    fs.param_dtype = lockstep::dtype::bf16;
    fs.buffers.prefetch = 2;
    const auto got = train_chain(seed, fs, recompute, true);
    REQUIRE(got.size() == ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      CAPTURE(i);
      CHECK((got[i].scalar_type() == ref[i].scalar_type()));  // gathered whole: the masters' type again
      CHECK(torch::allclose(got[i], ref[i], 1e-5, 1e-6));
    }
  }
}

TEST_CASE("TorchModule: a branch used on some ranks only and one used on none") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  constexpr int ranks = 2;
  torch::manual_seed(seed);
  TwoHeads reference;
  std::vector<TwoHeads> replicas(ranks);
  for (auto& m : replicas) copy_parameters(*m, *reference);
  torch::manual_seed(seed + 1);
  auto x = torch::randn({ranks, 4, 5});

  // Reference gradients: the mean over ranks of each rank's loss, rank r using head a iff r is even.
  torch::Tensor total = torch::zeros({});
  for (int r = 0; r < ranks; ++r) total = total + reference->forward(x[r], r % 2 == 0).pow(2).mean();
  (total / ranks).backward();

  for (int round = 0; round < 2; ++round)  // the first step packs, the second runs zero copy
    lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
      TwoHeads& m = replicas[static_cast<std::size_t>(ctx.rank())];
      lockstep::TorchModule tm(m);
      lockstep::DataParallel dp(ctx, tm);
      for (int s = 0; s < 2; ++s) {
        auto step = dp.step();
        tm.backward(m->forward(x[ctx.rank()], ctx.rank() % 2 == 0).pow(2).mean(), step.on_gradient_ready());
        step.finish();
        const auto named = m->named_parameters();
        for (const auto& item : reference->named_parameters()) {
          CAPTURE(item.key());
          const auto got = named[item.key()].grad();
          REQUIRE(got.defined());
          if (item.key().rfind("never", 0) == 0) {
            CHECK(got.abs().max().item<float>() == 0.0f);
          } else {
            CHECK(torch::allclose(got, item.value().grad(), 1e-6, 1e-7));
          }
        }
      }
    });
}

TEST_CASE("TorchModule: buffers are rank 0's at construction and with broadcast_buffers at every step") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  constexpr int ranks = 3;
  auto nets = per_rank(ranks, seed, [](int r) {
    torch::nn::Sequential n(torch::nn::Linear(4, 6), torch::nn::BatchNorm1d(6), torch::nn::Linear(6, 1));
    n->train();
    n->forward(torch::randn({8, 4}) * (r + 1));  // different running statistics per rank
    return n;
  });
  auto buffers_of = [](torch::nn::Sequential& n) {
    std::vector<torch::Tensor> out;
    for (auto& b : n->buffers()) out.push_back(b.clone());
    return out;
  };
  const auto rank0 = buffers_of(nets[0]);
  REQUIRE_FALSE(torch::equal(buffers_of(nets[1])[0], rank0[0]));
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    auto& net = nets[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(net);
    CHECK(tm.buffers().size() == 3);  // running_mean, running_var, num_batches_tracked
    lockstep::DataParallelOptions opts;
    opts.broadcast_buffers = true;
    lockstep::DataParallel dp(ctx, tm, opts);
    const auto now = buffers_of(net);
    for (std::size_t i = 0; i < now.size(); ++i) CHECK(torch::equal(now[i], rank0[i]));
    // A step whose forward moves each rank's statistics its own way...
    {
      auto step = dp.step();
      tm.backward(net->forward(torch::randn({8, 4}) * (ctx.rank() + 2)).sum(), step.on_gradient_ready());
      step.finish();
    }
    const auto own = buffers_of(net);
    ctx.comm().barrier();
    // ...and the next step starts from rank 0's again.
    auto step = dp.step();
    std::vector<float> mine(own[0].data_ptr<float>(), own[0].data_ptr<float>() + 6);
    std::vector<float> root = mine;
    lockstep::detail::host_broadcast(ctx.comm(), root, 0);
    CHECK(std::equal(root.begin(), root.end(), buffers_of(net)[0].data_ptr<float>()));
    step.finish();
  });
}

TEST_CASE("TorchModule: frozen parameters are rank 0's at construction and stay out of the reduction") {
  // A frozen projection initialised differently on every rank (as libtorch's shared random
  // generator does to layers built inside run(Threads)'s body) must not stay different.
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  constexpr int ranks = 3;
  auto nets = per_rank(ranks, seed, [](int) {
    torch::nn::Sequential n(torch::nn::Linear(4, 6), torch::nn::Linear(6, 5), torch::nn::Linear(5, 1));
    for (auto& p : n[1]->parameters()) p.set_requires_grad(false);  // the frozen middle layer
    return n;
  });
  const auto frozen0 = nets[0][1]->parameters()[0].clone();
  REQUIRE_FALSE(torch::equal(nets[1][1]->parameters()[0], frozen0));
  std::vector<std::string> unfrozen(ranks);
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    auto& net = nets[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(net);
    CHECK(tm.parameters().size() == 4);
    REQUIRE(tm.frozen().size() == 2);
    CHECK(tm.frozen()[0].name == "1.weight");
    lockstep::DataParallel dp(ctx, tm);
    CHECK(torch::equal(net[1]->parameters()[0], frozen0));  // rank 0's, on every rank
    torch::optim::SGD opt(tm.tensors(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(seed + 10 + static_cast<std::uint64_t>(ctx.rank()));
    const auto x = torch::randn({8, 4});
    for (int k = 0; k < 2; ++k) {
      auto step = dp.step();
      tm.backward(net->forward(x).pow(2).mean(), step.on_gradient_ready());
      if (step.finish()) opt.step();
    }
    CHECK(torch::equal(net[1]->parameters()[0], frozen0));  // never trained
    // Unfrozen after wrapping: refused at the next step, on the rank that did it.
    if (ctx.rank() == 2) {
      net[1]->parameters()[0].set_requires_grad(true);
      try {
        auto step = dp.step();
      } catch (const lockstep::config_error& e) {
        unfrozen[2] = e.what();
      }
    }
  });
  CHECK(unfrozen[2].find("parameter '1.weight' was frozen (requires_grad false) when the module was wrapped") !=
        std::string::npos);
}

namespace {
// A linear layer with a frozen int8 table beside it (a quantized base weight): lockstep does not
// reduce int8, but broadcasts its bytes.
struct QuantizedImpl : torch::nn::Module {
  explicit QuantizedImpl(std::int64_t r)
      : lin(register_module("lin", torch::nn::Linear(3, 2))),
        table(register_parameter("table", torch::randint(-100, 100, {4, 5}, torch::kChar) + r, false)) {}
  torch::nn::Linear lin;
  torch::Tensor table;
};
TORCH_MODULE(Quantized);
}  // namespace

TEST_CASE("TorchModule: a frozen parameter of a type lockstep does not reduce (int8) is broadcast as bytes") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  auto nets = per_rank(3, seed, [](int r) { return Quantized(r); });
  const auto root = nets[0]->table.clone();
  REQUIRE_FALSE(torch::equal(nets[2]->table, root));
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    auto& net = nets[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(net);
    REQUIRE(tm.frozen().size() == 1);
    CHECK(tm.frozen()[0].type == lockstep::dtype::u8);
    CHECK(tm.frozen()[0].shape == std::vector<std::int64_t>{20});  // its bytes
    lockstep::DataParallel dp(ctx, tm);
    CHECK(torch::equal(net->table, root));
  });
}

TEST_CASE("TorchModule: ranks with different frozen parameters are told which one differs") {
  torch::set_num_threads(1);
  std::vector<torch::nn::Sequential> nets;  // the same trained layers, another frozen head
  nets.emplace_back(torch::nn::Linear(4, 6), torch::nn::Linear(6, 2), torch::nn::Linear(2, 3));
  nets.emplace_back(torch::nn::Linear(4, 6), torch::nn::Linear(6, 2), torch::nn::Linear(2, 4));
  for (auto& n : nets)
    for (auto& p : n[2]->parameters()) p.set_requires_grad(false);
  const std::string what = construction_mismatch(2, [&](int r) -> auto& { return nets[static_cast<std::size_t>(r)]; });
  CAPTURE(what);
  CHECK(what.find("ranks built different models: frozen parameter 0 is '2.weight [3,2] f32' on rank 0 but "
                  "'2.weight [4,2] f32' on rank 1") != std::string::npos);
}

TEST_CASE("TorchModule: channels_last parameters train as contiguous ones - shapes in memory order") {
  // 2 ranks × 3 images with channels_last conv weights == 1 rank × 6 images, contiguous.
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  torch::manual_seed(seed);
  const auto make = [] {
    return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3)), torch::nn::ReLU(),
                                 torch::nn::Flatten(), torch::nn::Linear(4 * 3 * 3, 1));
  };
  auto proto = make();
  const auto x = torch::randn({6, 2, 5, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  const auto y = torch::randn({6, 1});
  const auto channels_last = [](torch::nn::Sequential& n) {
    torch::NoGradGuard g;
    for (auto& p : n->parameters())
      if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
  };
  auto ref = make();
  copy_parameters(*ref, *proto);
  {
    torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    for (int k = 0; k < 3; ++k) {
      opt.zero_grad();
      torch::mse_loss(ref->forward(x), y).backward();
      opt.step();
    }
  }
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < 2; ++r) {
    nets.push_back(make());
    copy_parameters(*nets.back(), *proto);
    channels_last(nets.back());
  }
  REQUIRE_FALSE(nets[0]->parameters()[0].is_contiguous());
  lockstep::run(lockstep::Threads{2}, [&](auto& ctx) {
    auto& net = nets[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(net);
    CHECK(tm.parameters()[0].shape == std::vector<std::int64_t>{4, 3, 3, 2});  // [O, H, W, I]
    lockstep::DataParallel dp(ctx, tm);
    torch::optim::SGD opt(tm.tensors(), torch::optim::SGDOptions(0.1));
    const auto mine = torch::arange(3 * ctx.rank(), 3 * ctx.rank() + 3);
    for (int k = 0; k < 3; ++k) {
      auto step = dp.step();
      tm.backward(torch::mse_loss(net->forward(x.index_select(0, mine)), y.index_select(0, mine)),
                  step.on_gradient_ready());
      if (step.finish()) opt.step();
    }
    CHECK_FALSE(net->parameters()[0].is_contiguous());  // still channels_last, and trained in place
  });
  CHECK(rel_diff(*nets[0], *ref) <= 1e-5);
  CHECK(rel_diff(*nets[1], *ref) <= 1e-5);
  CHECK(rel_diff(*proto, *ref) > 1e-3);  // it trained
  // Ranks whose layouts differ are told apart, as models of other shapes.
  auto other = make();
  const std::string what = construction_mismatch(2, [&](int r) -> auto& { return r == 0 ? nets[0] : other; });
  CAPTURE(what);
  CHECK(what.find("'0.weight [4,3,3,2] f32' on rank 0 but '0.weight [4,2,3,3] f32' on rank 1") != std::string::npos);
}

TEST_CASE("TorchModule: bf16 parameters are averaged in float and rounded once") {
  torch::set_num_threads(1);
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  constexpr int ranks = 2;
  std::vector<torch::nn::Linear> nets;
  torch::manual_seed(seed);
  torch::nn::Linear proto(8, 4);
  for (int r = 0; r < ranks; ++r) {
    nets.emplace_back(8, 4);
    copy_parameters(*nets.back(), *proto);
    nets.back()->to(torch::kBFloat16);
  }
  torch::manual_seed(seed + 1);
  auto x = torch::randn({ranks, 5, 8}).to(torch::kBFloat16);
  // Each rank's own gradient, computed alone (no lockstep): the average is float(g0 + g1)/2 → bf16.
  std::vector<std::vector<torch::Tensor>> own(ranks);
  for (int r = 0; r < ranks; ++r) {
    torch::nn::Linear alone(8, 4);
    copy_parameters(*alone, *proto);
    alone->to(torch::kBFloat16);
    alone->forward(x[r]).pow(2).mean().backward();
    for (auto& p : alone->parameters()) own[r].push_back(p.grad().clone());
  }
  lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
    auto& net = nets[static_cast<std::size_t>(ctx.rank())];
    lockstep::TorchModule tm(net);
    CHECK(tm.parameters()[0].type == lockstep::dtype::bf16);
    lockstep::DataParallel dp(ctx, tm);
    auto step = dp.step();
    tm.backward(net->forward(x[ctx.rank()]).pow(2).mean(), step.on_gradient_ready());
    step.finish();
    const auto ps = net->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto want = ((own[0][i].to(torch::kFloat) + own[1][i].to(torch::kFloat)) / 2).to(torch::kBFloat16);
      CHECK(torch::equal(ps[i].grad(), want));
    }
  });
}

TEST_CASE("TorchModule: ranks that built different modules are told which parameter differs") {
  torch::set_num_threads(1);
  std::vector<torch::nn::Sequential> nets;
  nets.emplace_back(torch::nn::Linear(4, 6), torch::nn::Linear(6, 2));
  nets.emplace_back(torch::nn::Linear(4, 6), torch::nn::Linear(6, 3));  // rank 1: another head
  const std::string what = construction_mismatch(2, [&](int r) -> auto& { return nets[static_cast<std::size_t>(r)]; });
  CAPTURE(what);
  CHECK(what.find("1.weight") != std::string::npos);
  CHECK(what.find("[2,6]") != std::string::npos);
  CHECK(what.find("[3,6]") != std::string::npos);
  CHECK_THROWS_AS(lockstep::TorchModule(std::shared_ptr<torch::nn::Module>{}), lockstep::config_error);
}

}  // TEST_SUITE
