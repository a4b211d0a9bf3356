#pragma once
//! NcclComm — a lockstep::communicator over NCCL: one object per rank, one rank per GPU. The
//! class is in cuda/detail/nccl_communicator.cuh (its streams, threads, failures, an example).
//! This header brings with it the device paths of the low-precision wires (cuda/nccl_wire.cuh:
//! Bf16Wire and Int8Wire's all-reduce and reduce-scatter, ShardedOptimizer's and FullySharded's
//! value gathers), which the generic code finds by argument-dependent lookup: every translation
//! unit that sees NcclComm then compiles the same gathers, whether or not it includes
//! lockstep/cuda.cuh (a template with a device body in one unit and a host one in another would
//! break the one-definition rule).

#include "lockstep/cuda/detail/nccl_communicator.cuh"
#include "lockstep/cuda/nccl_wire.cuh"
