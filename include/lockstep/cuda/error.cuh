#pragma once
//! CUDA and NCCL error checking, and the CUDA/NCCL side of lockstep's element types.
//!
//!  LOCKSTEP_TRY_CUDA(call)   throws lockstep::cuda_error if `call` does not return cudaSuccess
//!  LOCKSTEP_TRY_NCCL(call)   throws lockstep::nccl_error if `call` does not return ncclSuccess
//!  LOCKSTEP_CHECK_LAUNCH()   after a kernel launch: throws cuda_error for a failed launch
//!
//! Messages read "<call text> failed at file:line: <error name> (<library's description>)"
//! so a log line alone says which call, where and why.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "lockstep needs NCCL 2.10 or newer (ncclAvg, ncclBfloat16)"
#endif

namespace lockstep {

namespace detail {

inline std::string describe_cuda(cudaError_t e) {
  std::string s = std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
  switch (e) {
    // These leave the device's context unusable: say so, or the next unrelated call's
    // failure gets blamed.
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
      s += "; a kernel faulted and this process's CUDA context is lost: restart it, and run "
           "under compute-sanitizer to find the kernel";
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver: s += "; check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"; break;
    default: break;
  }
  return s;
}

inline void check_cuda(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess) [[unlikely]] {
    // Reset the thread's last error (a no-op for sticky ones): this failure is reported
    // here, and must not resurface at the next LOCKSTEP_CHECK_LAUNCH as someone else's.
    (void)cudaGetLastError();
    throw cuda_error(call_failure(call, file, line, describe_cuda(e)));
  }
}

inline const char* nccl_result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    case ncclRemoteError: return "ncclRemoteError";
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
    case ncclInProgress: return "ncclInProgress";
#endif
    default: return "ncclResult";
  }
}

inline std::string describe_nccl(ncclResult_t r) {
  std::string s = std::string(nccl_result_name(r)) + " (" + ncclGetErrorString(r) + ")";
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  // The last error of this thread; NCCL documents it may stem from an earlier call.
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') s += "; NCCL says: " + std::string(last);
#endif
  s += "; rerun with NCCL_DEBUG=WARN for NCCL's own diagnosis";
  return s;
}

inline void check_nccl(ncclResult_t r, const char* call, const char* file, int line) {
  if (r != ncclSuccess) [[unlikely]]
    throw nccl_error(call_failure(call, file, line, describe_nccl(r)));
}

}  // namespace detail

// ----------------------------------------------------------------------------------------
// Half and bfloat16 storage types as lockstep element types.
template <>
struct dtype_traits<__half> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct dtype_traits<__nv_bfloat16> : std::integral_constant<dtype, dtype::bf16> {};

//! The NCCL element type for a lockstep dtype.
inline ncclDataType_t to_nccl(dtype t) {
  switch (t) {
    case dtype::u8: return ncclUint8;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
  }
  throw config_error("to_nccl: unknown element type tag " + std::to_string(static_cast<int>(t)));
}

//! The NCCL reduction for a lockstep reduce_op (avg is NCCL's own ncclAvg, one pass).
inline ncclRedOp_t to_nccl(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclAvg;
    case reduce_op::max: return ncclMax;
    case reduce_op::min: return ncclMin;
  }
  throw config_error("to_nccl: unknown reduce_op tag " + std::to_string(static_cast<int>(op)));
}

}  // namespace lockstep

#define LOCKSTEP_TRY_CUDA(call) ::lockstep::detail::check_cuda((call), #call, __FILE__, __LINE__)
#define LOCKSTEP_TRY_NCCL(call) ::lockstep::detail::check_nccl((call), #call, __FILE__, __LINE__)
//! After `kernel<<<...>>>(...)`: reports a failed launch (bad configuration, no kernel image
//! for this GPU, ...) at the launch site rather than at some later call.
#define LOCKSTEP_CHECK_LAUNCH() \
  ::lockstep::detail::check_cuda(cudaGetLastError(), "kernel launch (cudaGetLastError)", __FILE__, __LINE__)
