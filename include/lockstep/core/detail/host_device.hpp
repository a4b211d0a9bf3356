#pragma once
//! LOCKSTEP_HOST_DEVICE: __host__ __device__ under a CUDA compiler, nothing elsewhere — for
//! functions host and device code share so that both compute the same bits (optimizer rules,
//! the fixed-point sums of lockstep::Deterministic).

#if defined(__CUDACC__)
#define LOCKSTEP_HOST_DEVICE __host__ __device__
#else
#define LOCKSTEP_HOST_DEVICE
#endif
