#pragma once
//! Which lockstep calls may run while a training step is being captured into a CUDA graph:
//! none that allocates device memory (lockstep allocates only in its first steps, and a
//! graph replays the addresses it saw). StepGraph and CaptureScope (cuda/step_graph.cuh) open
//! a capture here; CudaMemory::allocate and the window allocations refuse, by name, while one
//! is open in this process. Host synchronisation inside a capture is CUDA's to refuse
//! (cudaStreamCaptureModeGlobal), and the capture then fails.

#include <atomic>
#include <cstddef>
#include <string>

#include "lockstep/core/error.hpp"

namespace lockstep::detail {

//! Captures open in this process (every rank thread of a run(Gpus) may capture at once).
inline std::atomic<int>& captures_open() noexcept {
  static std::atomic<int> open{0};
  return open;
}

//! Throws config_error naming `what` when a capture is open: an allocation there would be
//! baked into the graph (or, with cudaMallocAsync, re-run by every replay).
inline void refuse_in_capture(const char* what, std::size_t bytes) {
  if (captures_open().load(std::memory_order_acquire) == 0) return;
  throw config_error(std::string(what) + ": asked for " + std::to_string(bytes) +
                     " bytes of device memory while a training step is being captured into a CUDA graph "
                     "(lockstep::StepGraph or lockstep::CaptureScope); lockstep allocates only in the first steps of "
                     "a run: capture after more eager warm-up steps (StepGraphOptions::warmup), and construct "
                     "lockstep objects (optimizers, scalers, windows) before the capture, not inside it");
}

}  // namespace lockstep::detail
