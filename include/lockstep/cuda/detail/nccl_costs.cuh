#pragma once
//! NcclComm's part in choosing bucket sizes (BucketPolicy::tune, parallel/detail/
//! bucket_tuner.hpp): device stamps on the compute stream (timing events), and NCCL's own
//! estimate of an all-reduce's time — ncclGroupSimulateEnd runs NCCL's tuning model on the
//! call and launches nothing. It is asked with plain memory: NCCL gives no estimate for its
//! symmetric kernels (they skip its model).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <new>

#include "lockstep/core/dtype.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"
#include "lockstep/parallel/detail/bucket_tuner.hpp"

namespace lockstep {
class NcclComm;
}

namespace lockstep::detail {

template <>
struct bucket_costs<NcclComm> {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 22, 0)
  static constexpr bool available = true;
#else
  static constexpr bool available = false;  // no ncclGroupSimulateEnd
#endif
  using stamp_type = std::shared_ptr<CUevent_st>;

  template <class C>
  static stamp_type now(C& comm) {
    device_guard g(comm.device());
    cudaEvent_t e = nullptr;
    LOCKSTEP_TRY_CUDA(cudaEventCreate(&e));
    stamp_type s(e, [d = comm.device()](cudaEvent_t ev) {
      device_guard dg(d, std::nothrow);
      (void)cudaEventDestroy(ev);
    });
    LOCKSTEP_TRY_CUDA(cudaEventRecord(e, comm.compute_stream()));
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

  //! NCCL's estimate of a mean all-reduce of count elements of t, in µs (0 for one rank).
  //! Collective: NCCL may connect peers for an algorithm it has not used yet.
  template <class C>
  static double all_reduce_us(C& comm, std::size_t count, dtype t) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 22, 0)
    if (comm.raw() == nullptr || count == 0) return 0;
    device_guard g(comm.device());
    // The buffers are not read: NCCL checks, at most, that they are device memory.
    static thread_local std::shared_ptr<void> scratch;
    static thread_local int scratch_device = -1;
    if (!scratch || scratch_device != comm.device()) {
      scratch = CudaMemory(comm.device(), comm.compute_stream()).allocate(256);
      scratch_device = comm.device();
    }
    ncclSimInfo_t info = NCCL_SIM_INFO_INITIALIZER;
    LOCKSTEP_TRY_NCCL(ncclGroupStart());
    const ncclResult_t r =
        ncclAllReduce(scratch.get(), scratch.get(), count, to_nccl(t), ncclAvg, comm.raw(), comm.compute_stream());
    LOCKSTEP_TRY_NCCL(ncclGroupSimulateEnd(&info));
    LOCKSTEP_TRY_NCCL(r);
    return info.estimatedTime > 0 ? static_cast<double>(info.estimatedTime) : 0.0;
#else
    (void)comm, (void)count, (void)t;
    return 0;
#endif
  }
};

}  // namespace lockstep::detail
