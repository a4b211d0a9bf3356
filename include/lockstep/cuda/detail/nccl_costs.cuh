#pragma once
//! NcclComm's part in choosing bucket sizes (BucketPolicy::tune, parallel/detail/
//! bucket_tuner.hpp): device stamps on the compute stream (timing events), and the times of
//! real mean all-reduces of a few sizes, in plain memory (so with BucketPolicy::
//! symmetric_memory the model sees NCCL's ring and tree, not its symmetric kernels).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <new>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/detail/capture_guard.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"
#include "lockstep/parallel/detail/bucket_tuner.hpp"

namespace lockstep {
class NcclComm;
}

namespace lockstep::detail {

template <>
struct bucket_costs<NcclComm> {
  static constexpr bool available = true;
  using stamp_type = std::shared_ptr<CUevent_st>;

  //! Throws while the compute stream is being captured: the tuner's step ends with timed
  //! all-reduces on the host's clock and re-cuts the arena at the next, so no step up to that
  //! one may be part of a graph.
  template <class C>
  static void refuse_capture(C& comm) {
    device_guard g(comm.device());
    if (stream_capturing(comm.compute_stream()))
      throw config_error("BucketPolicy::tune times synchronising step BucketPolicy::tune_step (default 3) and "
                         "re-cuts the buckets after it, but a step up to that one is being captured into a CUDA "
                         "graph: run tune_step + 1 steps eagerly before the capture (StepGraphOptions::warmup), or "
                         "lower tune_step");
  }

  template <class C>
  static stamp_type now(C& comm) {
    device_guard g(comm.device());
    stamp_type s = event(comm.device());
    LOCKSTEP_TRY_CUDA(cudaEventRecord(s.get(), comm.compute_stream()));
    return s;
  }

  //! Microseconds from a to b (waits for b).
  template <class C>
  static double elapsed_us(C& comm, const stamp_type& a, const stamp_type& b) {
    device_guard g(comm.device());
    LOCKSTEP_TRY_CUDA(cudaEventSynchronize(b.get()));
    float ms = 0;
    LOCKSTEP_TRY_CUDA(cudaEventElapsedTime(&ms, a.get(), b.get()));
    return 1e3 * static_cast<double>(ms);
  }

  //! The µs of a mean all-reduce of each of counts (elements of t, ascending), each the
  //! median of three after one to warm up, on the communication stream with the compute
  //! stream drained first, in a scratch buffer of the largest (freed after). Collective.
  template <class C>
  static std::vector<double> probe_us(C& comm, const std::vector<std::size_t>& counts, dtype t) {
    std::vector<double> out(counts.size(), 0.0);
    if (comm.size() < 2 || counts.empty()) return out;
    device_guard g(comm.device());
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(comm.compute_stream()));
    const auto scratch = comm.memory().allocate(*std::max_element(counts.begin(), counts.end()) * size_of(t));
    const stamp_type a = event(comm.device()), b = event(comm.device());
    for (std::size_t i = 0; i < counts.size(); ++i) {
      std::vector<double> runs;
      for (int r = 0; r < 4; ++r) {
        LOCKSTEP_TRY_CUDA(cudaEventRecord(a.get(), comm.comm_stream()));
        comm.label_next("bucket tuner: probe");
        (void)comm.all_reduce(scratch.get(), scratch.get(), counts[i], t, reduce_op::avg);
        LOCKSTEP_TRY_CUDA(cudaEventRecord(b.get(), comm.comm_stream()));
        LOCKSTEP_TRY_CUDA(cudaEventSynchronize(b.get()));
        float ms = 0;
        LOCKSTEP_TRY_CUDA(cudaEventElapsedTime(&ms, a.get(), b.get()));
        if (r > 0) runs.push_back(1e3 * static_cast<double>(ms));
      }
      std::sort(runs.begin(), runs.end());
      out[i] = runs[runs.size() / 2];
    }
    return out;
  }

 private:
  static stamp_type event(int device) {
    cudaEvent_t e = nullptr;
    LOCKSTEP_TRY_CUDA(cudaEventCreate(&e));
    return stamp_type(e, [device](cudaEvent_t ev) {
      device_guard dg(device, std::nothrow);
      (void)cudaEventDestroy(ev);
    });
  }
};

}  // namespace lockstep::detail
