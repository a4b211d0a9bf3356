#pragma once
//! Which lockstep calls may run while a training step is being captured into a CUDA graph:
//! none that allocates device memory (lockstep allocates only in its first steps, and a
//! graph replays the addresses it saw). StepGraph and CaptureScope (cuda/step_graph.cuh) open
//! a capture here; CudaMemory::allocate and the window allocations refuse, by name, while one
//! is open on their device. Host synchronisation inside a capture is CUDA's to refuse
//! (cudaStreamCaptureModeGlobal), and the capture then fails.

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <string>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"

namespace lockstep::detail {

//! Captures open on each device of this process, by device ordinal (every rank thread of a
//! run(Gpus) captures its own device; one allocating for another device is not held up).
inline constexpr int capture_devices = 256;
inline std::atomic<int>& captures_open(int device) noexcept {
  static std::array<std::atomic<int>, capture_devices> open{};
  return open[static_cast<std::size_t>(device >= 0 && device < capture_devices ? device : 0)];
}
//! Whether `s` is being captured into a CUDA graph (an invalidated capture counts: work
//! queued there must not be recorded either).
inline bool stream_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  LOCKSTEP_TRY_CUDA(cudaStreamIsCapturing(s, &cap));
  return cap != cudaStreamCaptureStatusNone;
}
//! `device`, or the calling thread's current device for -1.
inline int capture_device(int device) noexcept {
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) device = 0;
  return device;
}

//! Throws config_error naming `what` when a capture is open on `device` (-1: the current
//! one): an allocation there would be baked into the graph (or, with cudaMallocAsync, re-run
//! by every replay).
inline void refuse_in_capture(const char* what, std::size_t bytes, int device) {
  device = capture_device(device);
  if (captures_open(device).load(std::memory_order_acquire) == 0) return;
  throw config_error(std::string(what) + ": asked for " + std::to_string(bytes) + " bytes of memory on device " +
                     std::to_string(device) +
                     " while a training step is being captured into a CUDA graph there "
                     "(lockstep::StepGraph or lockstep::CaptureScope); lockstep allocates only in the first steps of "
                     "a run: capture after more eager warm-up steps (StepGraphOptions::warmup), and construct "
                     "lockstep objects (optimizers, scalers, windows) before the capture, not inside it");
}

}  // namespace lockstep::detail
