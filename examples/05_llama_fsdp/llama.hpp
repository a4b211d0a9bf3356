#pragma once
// A Llama-style decoder in libtorch's C++ frontend: token embeddings, `depth` blocks of
// pre-RMSNorm causal self-attention with rotary positions and a SwiGLU MLP, a final RMSNorm and
// an untied output head. Plain libtorch: nothing here knows lockstep, except that the forward
// runs each block through a run_fn when given one (lockstep::TorchBlocks::function()).
#include <cmath>
#include <cstdint>
#include <functional>

#include <torch/torch.h>
#include <torch/version.h>

namespace llama {

struct Config {
  std::int64_t vocab = 32000, context = 2048, depth = 32, heads = 32, width = 4096, ffn = 11008;
  torch::Device device = torch::kCPU;  // where the parameters are made (and drawn: no copy of a whole model)
};

//! y = x · weightᵀ, no bias; the weight is made uninitialised on the device (LlamaImpl draws it).
struct ProjImpl : torch::nn::Module {
  ProjImpl(std::int64_t in, std::int64_t out, torch::Device device)
      : weight(register_parameter("weight", torch::empty({out, in}, torch::TensorOptions().device(device)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(Proj);

//! Runs block k (1, 2, …): run(k, x, f) returns f(x), the block's forward (see gpt2::run_fn).
using block_fn = std::function<torch::Tensor(const torch::Tensor&)>;
using run_fn = std::function<torch::Tensor(std::size_t, const torch::Tensor&, block_fn)>;

//! x / rms(x) · weight, the mean of squares taken in fp32.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(std::int64_t width, torch::Device device)
      : weight(register_parameter("weight", torch::ones({width}, torch::TensorOptions().device(device)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto f = x.to(torch::kFloat);
    return (f * torch::rsqrt(f.pow(2).mean(-1, /*keepdim=*/true) + 1e-5)).to(x.scalar_type()) * weight;
  }
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

//! Rotates pairs (x[i], x[i + d/2]) of the last dimension by the angles of cos/sin [T, d/2].
inline torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto half = x.size(-1) / 2;
  const auto a = x.narrow(-1, 0, half), b = x.narrow(-1, half, half);
  const auto c = cos.to(x.scalar_type()), s = sin.to(x.scalar_type());
  return torch::cat({a * c - b * s, a * s + b * c}, -1);
}

//! Causal attention of q, k, v [B, H, T, d].
inline torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#else
  const auto T = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  const auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  return torch::matmul(torch::softmax(scores.masked_fill(mask, -INFINITY), -1), v);
#endif
}

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c) : heads(c.heads) {
    attn_norm = register_module("attention_norm", RMSNorm(c.width, c.device));
    wq = register_module("wq", Proj(c.width, c.width, c.device));
    wk = register_module("wk", Proj(c.width, c.width, c.device));
    wv = register_module("wv", Proj(c.width, c.width, c.device));
    wo = register_module("wo", Proj(c.width, c.width, c.device));
    mlp_norm = register_module("ffn_norm", RMSNorm(c.width, c.device));
    w1 = register_module("w1", Proj(c.width, c.ffn, c.device));
    w3 = register_module("w3", Proj(c.width, c.ffn, c.device));
    w2 = register_module("w2", Proj(c.ffn, c.width, c.device));
  }
  //! x [B, T, width]; cos/sin [T, head_dim / 2].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), d = C / heads;
    const auto h = attn_norm(x);
    const auto split = [&](const torch::Tensor& t) { return t.view({B, T, heads, d}).transpose(1, 2); };
    const auto q = rotate(split(wq(h)), cos, sin), k = rotate(split(wk(h)), cos, sin);
    const auto y = causal_attention(q, k, split(wv(h))).transpose(1, 2).reshape({B, T, C});
    const auto r = x + wo(y);
    const auto m = mlp_norm(r);
    return r + w2(torch::silu(w1(m)) * w3(m));
  }
  std::int64_t heads;
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  Proj wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr}, w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(Block);

struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const Config& c) : config(c) {
    embed = register_module("tok_embeddings", torch::nn::Embedding(c.vocab, c.width));
    embed->to(c.device);
    blocks = register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.depth; ++i) blocks->push_back(Block(c));
    norm = register_module("norm", RMSNorm(c.width, c.device));
    head = register_module("output", Proj(c.width, c.vocab, c.device));
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters())
      if (p.key().find("norm") == std::string::npos) p.value().normal_(0.0, 0.02);
  }

  //! Mean cross-entropy of predicting targets [B, T] from idx [B, T] (int64).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, const run_fn& run = {}) {
    const auto T = idx.size(1), d = config.width / config.heads;
    const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(idx.device());
    const auto inv = torch::pow(10000.0, -torch::arange(0, d, 2, opts) / static_cast<double>(d));
    const auto angles = torch::outer(torch::arange(T, opts), inv);  // [T, d/2]
    const auto cos = angles.cos(), sin = angles.sin();
    auto x = embed(idx);
    std::size_t k = 0;
    for (const auto& b : *blocks) {
      const block_fn f = [b, cos, sin](const torch::Tensor& h) { return b->as<Block>()->forward(h, cos, sin); };
      x = run ? run(++k, x, f) : f(x);
    }
    const auto logits = head(norm(x));
    return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}).to(torch::kFloat),
                                                targets.reshape({-1}));
  }

  Config config;
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  RMSNorm norm{nullptr};
  Proj head{nullptr};
};
TORCH_MODULE(Llama);

}  // namespace llama
