#pragma once
// The GPU side of example 04, compiled by nvcc in gpu_hybrid.cu; main.cpp (a plain C++ file)
// calls it when the build has CUDA (HYBRID_WITH_GPUS) and --gpus is given.
#include "common.hpp"

namespace hybrid {

//! GPUs visible to this process (0 when none, or no driver).
int visible_gpus();

//! main()'s training on GPUs 0 .. o.gpus-1: run(Hybrid{.model_parallel = o.parts, .inner =
//! Gpus{...}}), GpuTpMlp on every rank, DataParallel over mesh.data. Prints what the CPU path
//! prints, ending with the "final: test accuracy ..." line.
void train_on_gpus(const options& o, const fmnist::dataset& data);

//! --check-equivalence: o.gpus/o.parts replicas × o.parts parts, trained a few SGD steps on
//! random data, against the unsplit GpuTpMlp on GPU 0 trained with the global batch (and that
//! against the host TpMlp). Prints the differences; returns 0 when within tolerance, else 1.
int check_equivalence(const options& o);

}  // namespace hybrid
