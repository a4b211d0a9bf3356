#pragma once
// GPT-2 written with the libtorch C++ frontend: learned token and position embeddings,
// pre-LayerNorm blocks (causal self-attention, GELU MLP of 4× width), a final LayerNorm and an
// untied output head. GPT-2 small is the default config (vocabulary padded to 50304); the
// tests use a tiny one. Used by the example (main.cpp), the benchmark (bench/bench_gpt2_torch)
// and the torch adapter's tests; bench/gpt2_ddp.py is the same model in PyTorch. The modules
// are torch::nn::Cloneable (reset() builds them) so that libtorch's own
// torch::nn::parallel::data_parallel can replicate them (bench/gpt2_data_parallel.cpp).
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include <torch/torch.h>

namespace gpt2 {

//! Called with each submodule just before the forward uses its parameters (the embeddings, each
//! block, the final LayerNorm and the head, in that order): where a sharded run waits for the
//! all-gather of those parameters (lockstep::DataParallel::wait_parameters).
using before_fn = std::function<void(torch::nn::Module&)>;

//! Runs transformer block k (1, 2, …): run(k, x, f) returns f(x), the block's forward — or, with
//! lockstep::TorchBlocks::function(), runs it as block k of a fully sharded model (the block's
//! values gathered around it, recomputed in backward if asked). Empty: f(x).
using block_fn = std::function<torch::Tensor(const torch::Tensor&)>;
using run_fn = std::function<torch::Tensor(std::size_t, const torch::Tensor&, block_fn)>;

struct Config {
  std::int64_t vocab = 50304;  // GPT-2's 50257, padded to a multiple of 128
  std::int64_t context = 1024;
  std::int64_t layers = 12;
  std::int64_t heads = 12;
  std::int64_t width = 768;
};

//! x · Wᵀ + b through at::linear, the op Python's nn.Linear calls. torch::nn::Linear's C++
//! forward (F::linear) multiplies and then adds the bias in place when x has more than two
//! dimensions: under autocast that add mixes the bf16 product with the fp32 bias in an
//! unvectorised kernel — 3.0 ms of a 30 ms GPT-2 small step on an H200 (bench/RESULTS.md,
//! session 6). at::linear casts the bias too and fuses the add into the matrix product.
inline torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) {
  return at::linear(x, l->weight, l->bias);
}

struct BlockImpl : torch::nn::Cloneable<BlockImpl> {
  explicit BlockImpl(const Config& c) : config(c), heads(c.heads) { reset(); }

  //! Registers the submodules and gives them GPT-2's initialisation: N(0, 0.02), residual
  //! projections scaled by 1/√(2·layers). Cloneable's pattern: clone() (and so
  //! torch::nn::parallel::data_parallel's replicas) calls it on a copy, then copies the weights.
  void reset() override {
    const Config& c = config;
    ln1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    qkv = register_module("attn_qkv", torch::nn::Linear(c.width, 3 * c.width));
    proj = register_module("attn_proj", torch::nn::Linear(c.width, c.width));
    ln2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    fc = register_module("mlp_fc", torch::nn::Linear(c.width, 4 * c.width));
    out = register_module("mlp_proj", torch::nn::Linear(4 * c.width, c.width));
    const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers));
    torch::NoGradGuard no_grad;
    for (auto* l : {&qkv, &fc}) (*l)->weight.normal_(0.0, 0.02), (*l)->bias.zero_();
    for (auto* l : {&proj, &out}) (*l)->weight.normal_(0.0, residual), (*l)->bias.zero_();
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), D = C / heads;
    auto parts = linear(qkv, ln1(x)).split(C, 2);
    auto q = parts[0].view({B, T, heads, D}).transpose(1, 2);
    auto k = parts[1].view({B, T, heads, D}).transpose(1, 2);
    auto v = parts[2].view({B, T, heads, D}).transpose(1, 2);
#if TORCH_VERSION_MAJOR >= 2
    auto y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#else  // libtorch 1.x has no fused attention: the same math, written out
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
    auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
    auto y = torch::matmul(att, v);
#endif
    auto h = x + linear(proj, y.transpose(1, 2).contiguous().view({B, T, C}));
    return h + linear(out, torch::gelu(linear(fc, ln2(h)), "tanh"));
  }

  Config config;
  std::int64_t heads;
  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Cloneable<GptImpl> {
  explicit GptImpl(const Config& c) : config(c) { reset(); }

  //! Registers the submodules (the blocks under "h") and initialises them; see BlockImpl::reset.
  void reset() override {
    const Config& c = config;
    wte = register_module("wte", torch::nn::Embedding(c.vocab, c.width));
    wpe = register_module("wpe", torch::nn::Embedding(c.context, c.width));
    blocks = register_module("h", torch::nn::ModuleList());
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})));
    head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.width, c.vocab).bias(false)));
    for (std::int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
    torch::NoGradGuard no_grad;
    wte->weight.normal_(0.0, 0.02);
    wpe->weight.normal_(0.0, 0.01);
    head->weight.normal_(0.0, 0.02);
  }

  //! Logits [B, T, vocab] of token ids idx [B, T] (int64); before: see before_fn; run: run_fn.
  torch::Tensor forward(const torch::Tensor& idx, const before_fn& before = {}, const run_fn& run = {}) {
    const auto T = idx.size(1);
    auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    if (before) before(*wte), before(*wpe);
    auto x = wte(idx) + wpe(pos);
    std::size_t k = 0;
    for (const auto& b : *blocks) {
      if (before) before(*b);
      if (run) x = run(++k, x, [b](const torch::Tensor& h) { return b->as<Block>()->forward(h); });
      else x = b->as<Block>()->forward(x);
    }
    if (before) before(*ln_f), before(*head);
    return linear(head, ln_f(x));
  }

  //! Mean cross-entropy of predicting targets [B, T] from idx [B, T].
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const before_fn& before = {},
                     const run_fn& run = {}) {
    auto logits = forward(idx, before, run);
    return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}).to(torch::kFloat),
                                                targets.reshape({-1}));
  }

  Config config;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace gpt2
