#pragma once
// The GPU side of example 01, compiled by nvcc in gpu_train.cu; main.cpp (a plain C++ file)
// calls it when the build has CUDA (FASHION_MNIST_WITH_GPUS) and GPUs are chosen.
#include <functional>
#include <vector>

#include "fashion_mnist.hpp"

namespace fmnist {

//! Two training steps (forward, backward, SGD with momentum) of the GPU model on `device`
//! against the CPU model (mlp.hpp) from the same weights on the same batch, and the input
//! gather and test predictions likewise. Prints one line; true when every relative
//! difference is at most 1e-4 (and the inputs are identical).
bool check_gpu_model(int device, const dataset& data, const options& opt);

//! The training of main(): one rank per device of `devices` (lockstep::run(Gpus{...})).
void train_on_gpus(const std::vector<int>& devices, const options& opt, const training_plan& plan, const dataset& data,
                   final_result& result);

//! Who this process is, once the job's communicator is up (example 02's GPU path).
struct process_rank {
  int rank = 0;
  int ranks = 1;
  long long hosts = 1;  //!< ranks with local rank 0, summed over the job
  int device = 0;
};

//! Example 02's GPU path: this process is one rank of a job started by a launcher
//! (lockstep::run(lockstep::Processes{}), NcclComm, one GPU per process). `start` runs on
//! every rank once the communicator is up and returns the plan (rank 0 prints it); the
//! result holds rank 0's view; `me` says who this process was.
void train_as_gpu_process(const options& opt, const dataset& data,
                          const std::function<training_plan(const process_rank&)>& start, final_result& result,
                          process_rank& me);

}  // namespace fmnist
