#pragma once
//! lockstep — data-parallel training for any C++ model. Umbrella header (CPU parts);
//! CUDA parts: <lockstep/cuda/cuda.cuh>.

#include "lockstep/accumulate.hpp"
#include "lockstep/bucket_policy.hpp"
#include "lockstep/concepts.hpp"
#include "lockstep/context.hpp"
#include "lockstep/data_parallel.hpp"
#include "lockstep/detect.hpp"
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"
#include "lockstep/every_step.hpp"
#include "lockstep/host_memory.hpp"
#include "lockstep/parameter.hpp"
#include "lockstep/reduce_op.hpp"
#include "lockstep/run.hpp"
#include "lockstep/sync_stats.hpp"
#include "lockstep/thread_comm.hpp"
#include "lockstep/version.hpp"
