#pragma once
//! lockstep::StepGraph — a whole training step (the model's forward and backward, lockstep's
//! bucket collectives, unscaling, clipping, the optimizer, the loss-scale update) captured once
//! into a CUDA graph and replayed, so that the host launches one graph per step instead of
//! every kernel and collective. One per rank, on the rank's NcclComm; run(Processes) and
//! run(Gpus) alike (each rank thread captures its own stream). docs/graphs.md has a whole
//! loop (compiled by tests/docs/snippets_cuda.cu), what a captured step may not hold, and the
//! measurements.
//!
//! run(step) calls step() eagerly for the first `warmup` calls: lockstep allocates, registers
//! windows and staging, and DataParallel rebuilds its bucket plan in the order the first step
//! reported gradients; a second step runs the final plan (with BucketPolicy::tune, warm up
//! tune_step + 1 steps: the tuner times step tune_step and re-cuts at the next; a capture of
//! either is refused by name). The next call captures step() on the
//! communicator's compute stream and launches the graph; later calls only launch it. While it
//! captures, lockstep refuses to allocate (config_error naming the call), and CUDA refuses any
//! host synchronisation on the capturing thread (a DynamicScale that reads the inf flag, a
//! download; StepGraphOptions::mode): the capture then throws config_error with CUDA's reason.
//! Nothing the host decides inside step() changes between replays, so:
//!  - inputs live at fixed device addresses, written before each run();
//!  - the loss scale must stay on the device (DeviceDynamicScale, or StaticScale/NoScaling);
//!  - learning rates reach the fused optimizers through set_lr(), which writes the device copy;
//!  - one graph holds whole accumulation cycles (capture all K micro-steps in one step());
//!  - host-side counters (sync_stats, the step recorder) advance only for eager steps;
//!  - collectives across the capture's edge (ShardedOptimizer's gather_in_forward: a forward
//!    waits for the gather of the step before): the capture begins with the device drained, so
//!    one issued outside the graph is complete when waited for inside it, and one captured into
//!    the graph is ordered by the replays on the compute stream (nccl_work::wait);
//!  - not yet: ShardedGradients and FullySharded.
//! reset() drops the graph (after load() of an optimizer, a changed batch shape): the next
//! run() captures again. A fused optimizer's first step fills its fp32 masters and a capture
//! refuses that (config_error): warm up at least one step after constructing it. Launches
//! are tracked like collectives (NcclComm::tracked_launch), so the watchdog of
//! run(Processes) names a replay that a dead or stopped peer holds up.

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <utility>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/detail/capture_guard.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/nccl_comm.cuh"

namespace lockstep {

//! While alive, lockstep refuses to allocate memory on `device` (-1: the calling thread's
//! current device), with a config_error naming the call; other devices are not affected.
//! StepGraph opens one around its capture; open one yourself around a capture you make with
//! another API (libtorch's at::cuda::CUDAGraph).
class CaptureScope {
 public:
  explicit CaptureScope(int device = -1) noexcept : device_(detail::capture_device(device)) {
    detail::captures_open(device_).fetch_add(1, std::memory_order_acq_rel);
  }
  ~CaptureScope() { detail::captures_open(device_).fetch_sub(1, std::memory_order_acq_rel); }
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  int device_;
};

struct StepGraphOptions {
  //! Eager calls of run() before the capture (at least 2 under DataParallel: its first step
  //! lays the buckets out again in the order gradients arrived; with BucketPolicy::tune,
  //! tune_step + 1).
  int warmup = 2;
  //! ThreadLocal: a host synchronisation (or another call a capture forbids) on the capturing
  //! thread fails the capture. Global extends that to every thread of the process: the
  //! strictest check for one rank per process, but under run(Gpus) a rank thread still
  //! synchronising before its own capture would then fail another rank's.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
};

class StepGraph {
 public:
  explicit StepGraph(NcclComm& comm, StepGraphOptions o = {}) : comm_(&comm), opt_(o) {
    if (o.warmup < 0)
      throw config_error("StepGraph: warmup is " + std::to_string(o.warmup) + "; pass 0 or more eager steps");
  }
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
  ~StepGraph() { drop(); }

  //! One training step: eager during the warm-up, captured at the next call, replayed after.
  //! Returns true when the step ran as the graph.
  template <class Step>
  bool run(Step&& step) {
    if (eager_ < opt_.warmup) {
      std::forward<Step>(step)();
      ++eager_;
      return false;
    }
    if (exec_ == nullptr) capture(step);
    // The graph waits for no collective issued outside it (an eager step's gather between
    // replays, which the captured forward would have waited for): the compute stream waits for
    // the communication stream's work so far. An event, no host synchronisation.
    comm_->enqueue([](cudaStream_t) {}).wait();
    comm_->tracked_launch("the captured training step",
                          [&] { LOCKSTEP_TRY_CUDA(cudaGraphLaunch(exec_, comm_->compute_stream())); });
    ++replays_;
    return true;
  }

  //! Drops the graph: the next run() captures again (no further warm-up).
  void reset() noexcept { drop(); }

  bool captured() const noexcept { return exec_ != nullptr; }
  //! Launches of the graph so far; eager warm-up calls so far.
  std::uint64_t replays() const noexcept { return replays_; }
  int eager_steps() const noexcept { return eager_; }
  //! Kernel, memcpy and other nodes of the captured graph (0 before the capture).
  std::size_t nodes() const noexcept { return nodes_; }

 private:
  template <class Step>
  void capture(Step& step) {
    detail::device_guard g(comm_->device());
    const cudaStream_t s = comm_->compute_stream();
    if (s == nullptr)
      throw config_error("StepGraph: the communicator's compute stream is the legacy default stream, which CUDA "
                         "cannot capture; give it a stream of its own (NcclComm::set_compute_stream)");
    // Collectives of earlier steps or graphs (a gather the next forward waits for) cannot join
    // the graph: let them finish first (nccl_work::wait). Relaxed: another rank's thread may be
    // capturing in global mode (StepGraphOptions::mode).
    {
      const detail::relaxed_capture relaxed;
      LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    }
    cudaGraph_t graph = nullptr;
    {
      const CaptureScope scope(comm_->device());
      LOCKSTEP_TRY_CUDA(cudaStreamBeginCapture(s, opt_.mode));
      try {
        step();
        // Collectives the step issued and did not wait for (the gathers for the next forward)
        // join the captured stream: a graph ends with all its work joined (a launch completes
        // with all its nodes anyway).
        comm_->enqueue([](cudaStream_t) {}).wait();
      } catch (const cuda_error& e) {  // CUDA refused a call: the capture is broken
        abandon(s);
        throw config_error(std::string("StepGraph: the step could not be captured into a CUDA graph: ") + e.what() +
                           forbidden);
      } catch (...) {
        abandon(s);
        throw;
      }
      const cudaError_t e = cudaStreamEndCapture(s, &graph);
      if (e != cudaSuccess || graph == nullptr) {
        (void)cudaGetLastError();
        if (graph != nullptr) (void)cudaGraphDestroy(graph);
        throw config_error(std::string("StepGraph: the step could not be captured into a CUDA graph (") +
                           cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")" + forbidden +
                           ", or work on another stream was not joined back into the captured one");
      }
    }
    const cudaError_t ie = cudaGraphInstantiate(&exec_, graph, 0);
    std::size_t n = 0;
    (void)cudaGraphGetNodes(graph, nullptr, &n);
    (void)cudaGraphDestroy(graph);
    if (ie != cudaSuccess) {
      exec_ = nullptr;
      detail::check_cuda(ie, "cudaGraphInstantiate(the captured step)", __FILE__, __LINE__);
    }
    nodes_ = n;
  }

  static constexpr const char* forbidden =
      "; something in it synchronised with the host or used a call a capture forbids (a host-side loss scaler such "
      "as DynamicScale, reading a value back, an allocation)";

  static void abandon(cudaStream_t s) noexcept {
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(s, &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
  }

  void drop() noexcept {
    if (exec_ == nullptr) return;
    if (comm_->aborted()) {
      // The replay may hold collectives that wait for a dead peer (NCCL's symmetric kernels
      // outlive an abort): waiting could block for ever, and destroying a running graph is
      // undefined. The process is ending its work on this communicator: leave the graph.
      exec_ = nullptr;
      nodes_ = 0;
      return;
    }
    detail::device_guard g(comm_->device(), std::nothrow);
    // A replay may still be running: the graph's resources must outlive it.
    (void)cudaStreamSynchronize(comm_->compute_stream());
    (void)cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
    nodes_ = 0;
  }

  NcclComm* comm_;
  StepGraphOptions opt_;
  cudaGraphExec_t exec_ = nullptr;
  int eager_ = 0;
  std::uint64_t replays_ = 0;
  std::size_t nodes_ = 0;
};

}  // namespace lockstep
