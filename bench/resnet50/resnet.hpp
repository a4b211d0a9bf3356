#pragma once
// ResNet-50 written with libtorch's C++ frontend, equal to torchvision's resnet50 (the model
// PyTorch's DDP paper measures): a 7×7 stem convolution of stride 2, BatchNorm, ReLU, a 3×3
// max-pool of stride 2, four stages of Bottleneck blocks ([3, 4, 6, 3]; widths 64, 128, 256,
// 512, expanded 4×; the stride on the 3×3 convolution — "v1.5"; a 1×1 convolution + BatchNorm
// on the shortcut where the shape changes), global average pooling and a linear classifier
// (1000 classes). Initialisation as torchvision's: Kaiming-normal convolutions (fan_out, ReLU),
// BatchNorm weight 1 and bias 0, the classifier libtorch's (= PyTorch's) Linear default;
// zero_init_residual off. Parameter and buffer names are torchvision's (conv1, bn1,
// layer1.0.conv1, layer1.0.downsample.0, ..., fc): 25,557,032 parameters.
//
// The "tiny" config (base width 8, one block per stage, 10 classes) is the CPU smoke test's.
// bench/resnet50_ddp.py is the same model in PyTorch; bench/resnet50_torch.cpp trains it.
#include <array>
#include <cstdint>
#include <string>

#include <torch/torch.h>

namespace resnet {

struct Config {
  std::array<std::int64_t, 4> blocks{3, 4, 6, 3};  //!< Bottleneck blocks per stage
  std::int64_t width = 64;                         //!< stem and first stage width (stages: ×1, ×2, ×4, ×8)
  std::int64_t classes = 1000;
};

//! "full" (ResNet-50) or "tiny" (width 8, one block per stage, 10 classes); false if neither.
inline bool config_named(const std::string& name, Config& out) {
  if (name == "full") {
    out = Config{};
    return true;
  }
  if (name == "tiny") {
    out = Config{.blocks = {1, 1, 1, 1}, .width = 8, .classes = 10};
    return true;
  }
  return false;
}

//! Expansion of a Bottleneck: its output has 4 × its width channels.
inline constexpr std::int64_t expansion = 4;

inline torch::nn::Conv2d conv(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride,
                              std::int64_t padding) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding).bias(false));
}

//! torchvision's Bottleneck (groups 1, base width 64, dilation 1): 1×1 → 3×3 (stride) → 1×1,
//! each followed by BatchNorm, ReLU after the first two and after the residual sum.
struct BottleneckImpl : torch::nn::Module {
  BottleneckImpl(std::int64_t in, std::int64_t planes, std::int64_t stride) {
    conv1 = register_module("conv1", conv(in, planes, 1, 1, 0));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(planes));
    conv2 = register_module("conv2", conv(planes, planes, 3, stride, 1));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(planes));
    conv3 = register_module("conv3", conv(planes, planes * expansion, 1, 1, 0));
    bn3 = register_module("bn3", torch::nn::BatchNorm2d(planes * expansion));
    if (stride != 1 || in != planes * expansion) {
      downsample = register_module("downsample", torch::nn::Sequential(conv(in, planes * expansion, 1, stride, 0),
                                                                       torch::nn::BatchNorm2d(planes * expansion)));
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto out = bn1(conv1(x)).relu_();
    out = bn2(conv2(out)).relu_();
    out = bn3(conv3(out));
    out += downsample ? downsample->forward(x) : x;
    return out.relu_();
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

struct ResNetImpl : torch::nn::Module {
  explicit ResNetImpl(const Config& c) : config(c) {
    const std::int64_t w = c.width;
    conv1 = register_module("conv1", conv(3, w, 7, 2, 3));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(w));
    std::int64_t in = w;
    for (int s = 0; s < 4; ++s) {
      const std::int64_t planes = w << s;
      torch::nn::Sequential stage;
      for (std::int64_t b = 0; b < c.blocks[static_cast<std::size_t>(s)]; ++b) {
        stage->push_back(Bottleneck(in, planes, b == 0 && s > 0 ? 2 : 1));
        in = planes * expansion;
      }
      layers[static_cast<std::size_t>(s)] = register_module("layer" + std::to_string(s + 1), stage);
    }
    fc = register_module("fc", torch::nn::Linear(in, c.classes));

    torch::NoGradGuard no_grad;
    for (auto& m : modules(/*include_self=*/false)) {
      if (auto* cv = m->as<torch::nn::Conv2d>()) {
        torch::nn::init::kaiming_normal_(cv->weight, 0.0, torch::kFanOut, torch::kReLU);
      } else if (auto* bn = m->as<torch::nn::BatchNorm2d>()) {
        bn->weight.fill_(1.0);
        bn->bias.zero_();
      }
    }
  }

  //! Logits [B, classes] of images x [B, 3, H, W].
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = bn1(conv1(x)).relu_();
    h = torch::max_pool2d(h, /*kernel_size=*/3, /*stride=*/2, /*padding=*/1);
    for (auto& stage : layers) h = stage->forward(h);
    h = torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    // at::linear, the op Python's nn.Linear calls (see examples/03_gpt2_torch/gpt2.hpp: under
    // autocast torch::nn::Linear's C++ forward can add the bias in a separate, slow kernel).
    return at::linear(h, fc->weight, fc->bias);
  }

  //! Number of trained parameters (25,557,032 for ResNet-50).
  std::int64_t parameter_count() const {
    std::int64_t n = 0;
    for (const auto& p : parameters()) n += p.numel();
    return n;
  }

  Config config;
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  std::array<torch::nn::Sequential, 4> layers{nullptr, nullptr, nullptr, nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

//! ResNet-50's parameter count (torchvision.models.resnet50(weights=None)).
inline constexpr std::int64_t resnet50_parameters = 25'557'032;

}  // namespace resnet
