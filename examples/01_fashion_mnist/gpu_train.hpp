#pragma once
// The GPU side of example 01, compiled by nvcc in gpu_train.cu; main.cpp (a plain C++ file)
// calls it when the build has CUDA (FASHION_MNIST_WITH_GPUS) and GPUs are chosen.
#include <vector>

#include "fashion_mnist.hpp"

namespace fmnist {

//! Two training steps (forward, backward, SGD with momentum) of the GPU model on `device`
//! against the CPU model (mlp.hpp) from the same weights on the same batch, and the input
//! gather and test predictions likewise. Prints one line; true when every relative
//! difference is at most 1e-4 (and the inputs are identical).
bool check_gpu_model(int device, const dataset& data, const options& opt);

//! The training of main(): one rank per device of `devices` (lockstep::run(Gpus{...})).
void train_on_gpus(const std::vector<int>& devices, const options& opt,
                   const training_plan& plan, const dataset& data, final_result& result);

}  // namespace fmnist
