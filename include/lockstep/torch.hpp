#pragma once
//! lockstep's libtorch adapter (target lockstep::torch): lockstep::TorchModule makes any
//! torch::nn::Module a lockstep::model. See docs/torch.md.
#include "lockstep/torch/blocks.hpp"
#include "lockstep/torch/module.hpp"
