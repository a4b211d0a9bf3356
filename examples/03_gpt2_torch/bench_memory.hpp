#pragma once
// --memory-trace of the libtorch benchmark programs on GPUs (example 03, bench/resnet50_torch):
// where the device memory goes, phase by phase. Include only in a CUDA build of libtorch.
#include <cuda_runtime_api.h>

#include <cstdio>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>

namespace lockstep_bench {

//! "memory: <phase> used_gib=... torch_reserved_gib=... torch_allocated_gib=..." on stdout:
//! cudaMemGetInfo's used bytes on `device` (everything: contexts, NCCL, every allocator) after
//! the device's work so far, beside libtorch's caching allocator (reserved and allocated now).
//! bench/resnet50_ddp.py and bench/gpt2_ddp.py print the same line for PyTorch.
inline void print_device_memory(const char* phase, int device) {
  int before = 0;
  if (cudaGetDevice(&before) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return;
  // libtorch's allocator has stats once it holds a block (the Python peers make torch.zeros(1)
  // before their first line too): one small tensor, freed at once, its block kept.
  (void)at::zeros({1}, at::TensorOptions().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
  std::size_t free = 0, total = 0;
  if (cudaDeviceSynchronize() == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess) {
    const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr double gib = 1 << 30;
    std::printf("memory: %-28s used_gib=%.3f torch_reserved_gib=%.3f torch_allocated_gib=%.3f\n", phase,
                static_cast<double>(total - free) / gib, static_cast<double>(st.reserved_bytes[0].current) / gib,
                static_cast<double>(st.allocated_bytes[0].current) / gib);
    std::fflush(stdout);
  }
  (void)cudaSetDevice(before);
}

}  // namespace lockstep_bench
