#pragma once
//! lockstep on GPUs: everything of <lockstep/lockstep.hpp> plus the CUDA/NCCL part (target
//! lockstep::cuda): NcclComm, run(Gpus) and run(Processes), device memory, the multi-tensor
//! kernels, grad_ops on device memory, DeviceDynamicScale and the fused optimizers. Include it
//! from a CUDA translation unit (.cu); run(Auto) then also picks the GPUs. Not included here,
//! because CUB costs every translation unit compile time: the device permutation
//! (lockstep/cuda/kernels/permutation.cuh).

#include "lockstep/cuda/deterministic_sum.cuh"
#include "lockstep/cuda/device_dynamic_scale.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/fused_optimizer.cuh"
#include "lockstep/cuda/grad_ops.cuh"
#include "lockstep/cuda/kernels/engine.cuh"
#include "lockstep/cuda/kernels/fixed_point_ops.cuh"
#include "lockstep/cuda/kernels/grad_kernels.cuh"
#include "lockstep/cuda/kernels/memory_ops.cuh"
#include "lockstep/cuda/kernels/optimizers.cuh"
#include "lockstep/cuda/memory.cuh"
#include "lockstep/cuda/nccl_comm.cuh"
#include "lockstep/cuda/nccl_wire.cuh"
#include "lockstep/cuda/prefetch.cuh"
#include "lockstep/cuda/run_gpus.cuh"
#include "lockstep/cuda/run_processes.cuh"
#include "lockstep/cuda/step_graph.cuh"
#include "lockstep/lockstep.hpp"
