#pragma once
//! CudaMemory — memory_ops for device memory on one device, ordered on one CUDA stream
//! (the compute stream of the communicator that hands it out).
//!
//!  - allocate: cudaMalloc + zero fill; the shared_ptr frees on the right device.
//!  - upload / download: blocking (they return once the copy is done) and ordered after
//!    everything already queued on the stream, e.g. a collective whose work was wait()ed.
//!  - zero / pack / unpack / scale: queued on the stream, not blocking.
//! Every call makes the device current for its duration and restores the caller's device,
//! so it may be used from any host thread.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <new>
#include <span>
#include <string>

#include <cuda.h>  // the driver API's types only (primary_context_active)
#include <cuda_runtime_api.h>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/detail/capture_guard.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/memory_ops.cuh"
#include "lockstep/cuda/kernels/wire_ops.cuh"

namespace lockstep {

namespace detail {

//! Whether `device`'s primary context is active in this process (the driver's
//! cuDevicePrimaryCtxGetState, reached through the runtime: no link to libcuda). True when
//! the driver cannot say.
inline bool primary_context_active(int device) noexcept {
  struct driver {
    CUresult (*get_device)(CUdevice*, int) = nullptr;
    CUresult (*get_state)(CUdevice, unsigned int*, int*) = nullptr;
  };
  static const driver d = [] {
    driver r;
    void* get_device = nullptr;
    void* get_state = nullptr;
    cudaDriverEntryPointQueryResult q1{}, q2{};
#if CUDART_VERSION >= 12050
    const bool found =
        cudaGetDriverEntryPointByVersion("cuDeviceGet", &get_device, 12000, cudaEnableDefault, &q1) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &get_state, 12000, cudaEnableDefault, &q2) ==
            cudaSuccess;
#else
    const bool found =
        cudaGetDriverEntryPoint("cuDeviceGet", &get_device, cudaEnableDefault, &q1) == cudaSuccess &&
        cudaGetDriverEntryPoint("cuDevicePrimaryCtxGetState", &get_state, cudaEnableDefault, &q2) == cudaSuccess;
#endif
    if (found && q1 == cudaDriverEntryPointSuccess && q2 == cudaDriverEntryPointSuccess) {
      r.get_device = reinterpret_cast<CUresult (*)(CUdevice*, int)>(get_device);
      r.get_state = reinterpret_cast<CUresult (*)(CUdevice, unsigned int*, int*)>(get_state);
    }
    return r;
  }();
  CUdevice dev{};
  unsigned int flags = 0;
  int active = 0;
  if (!d.get_device || !d.get_state || d.get_device(&dev, device) != CUDA_SUCCESS ||
      d.get_state(dev, &flags, &active) != CUDA_SUCCESS)
    return true;
  return active != 0;
}

//! Makes `device` current for a scope and restores the previous device afterwards.
//! CUDA's current device is per host thread; a thread driving several communicators (or a
//! user thread that set another device) must not be left on ours. The previous device is
//! restored only where this process has a context on it: since CUDA 12, cudaSetDevice makes
//! one (about half a GiB on an H100), and a thread that never chose a device "has" device 0 —
//! a watchdog thread of rank 1 would otherwise leave a context on GPU 0 behind. Such a thread
//! stays on `device`.
class device_guard {
 public:
  explicit device_guard(int device) {
    LOCKSTEP_TRY_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device) {
      LOCKSTEP_TRY_CUDA(cudaSetDevice(device));
      restore_ = true;
    }
  }
  //! For destructors: never throws; `ok()` says whether the device could be set.
  device_guard(int device, std::nothrow_t) noexcept {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      return;
    }
    if (prev_ != device) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      restore_ = ok_;
    }
  }
  ~device_guard() {
    if (restore_ && primary_context_active(prev_)) (void)cudaSetDevice(prev_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  bool ok() const noexcept { return ok_; }

 private:
  int prev_ = 0;
  bool restore_ = false;
  bool ok_ = true;
};

//! `words` zeroed int64s of pinned host memory that kernels of `device` may write (mapped), freed
//! when the last owner goes: flags the device raises and the host reads without synchronising.
//! Allocated with `device` current, so no context is created on another GPU.
inline std::shared_ptr<std::int64_t> mapped_word(int device, std::size_t words = 1) {
  device_guard g(device);
  void* p = nullptr;
  LOCKSTEP_TRY_CUDA(cudaHostAlloc(&p, words * sizeof(std::int64_t), cudaHostAllocMapped | cudaHostAllocPortable));
  for (std::size_t i = 0; i < words; ++i) static_cast<volatile std::int64_t*>(p)[i] = 0;
  return std::shared_ptr<std::int64_t>(static_cast<std::int64_t*>(p), [](std::int64_t* q) { (void)cudaFreeHost(q); });
}

//! The device's address of mapped pinned host memory (the same address under unified addressing).
inline std::int64_t* device_view(std::int64_t* host) {
  void* d = nullptr;
  LOCKSTEP_TRY_CUDA(cudaHostGetDevicePointer(&d, host, 0));
  return static_cast<std::int64_t*>(d);
}

}  // namespace detail

class CudaMemory {
 public:
  //! Memory on `device`, with asynchronous work queued on `stream` (a stream of that device;
  //! nullptr is the legacy default stream).
  CudaMemory(int device, cudaStream_t stream) noexcept : device_(device), stream_(stream) {}

  int device() const noexcept { return device_; }
  cudaStream_t stream() const noexcept { return stream_; }

  //! `bytes` of zeroed device memory (at least 1 byte is reserved, so the pointer is never
  //! null). The fill has completed when this returns, so any stream may use the memory.
  std::shared_ptr<void> allocate(std::size_t bytes) const {
    detail::refuse_in_capture("CudaMemory::allocate", bytes, device_);
    detail::device_guard g(device_);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory is not sticky: leave no stale error behind
      throw cuda_error(detail::call_failure("cudaMalloc", __FILE__, __LINE__,
                                            detail::describe_cuda(e) + " while allocating " + std::to_string(bytes) +
                                                " bytes on device " + std::to_string(device_)));
    }
    // The shared_ptr frees p (through the deleter) if its own allocation throws.
    std::shared_ptr<void> owner(p, deleter{device_});
    if (bytes) LOCKSTEP_TRY_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream_));
    return owner;
  }

  //! Host → device, blocking.
  void upload(void* dst, const void* src, std::size_t bytes) const {
    if (bytes == 0) return;
    detail::device_guard g(device_);
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream_));
  }

  //! Device → host, blocking.
  void download(void* dst, const void* src, std::size_t bytes) const {
    if (bytes == 0) return;
    detail::device_guard g(device_);
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream_));
  }

  void zero(void* p, std::size_t bytes) const {
    if (bytes == 0) return;
    detail::device_guard g(device_);
    LOCKSTEP_TRY_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));
  }

  //! dst ← concat(src) · scale, one fused launch.
  void pack(std::span<const segment> src, void* dst, dtype t, double scale) const {
    detail::device_guard g(device_);
    cuda::kernels::pack(src, dst, t, scale, stream_);
  }

  //! Scatters contiguous src into the segments of dst.
  void unpack(const void* src, std::span<const segment> dst, dtype t) const {
    detail::device_guard g(device_);
    cuda::kernels::unpack(src, dst, t, stream_);
  }

  void scale(void* p, std::size_t count, dtype t, double factor) const {
    detail::device_guard g(device_);
    cuda::kernels::scale(p, count, t, factor, stream_);
  }
  //! dst ← dst + src, one launch.
  void add(void* dst, const void* src, std::size_t count, dtype t) const {
    detail::device_guard g(device_);
    cuda::kernels::add(dst, src, count, t, stream_);
  }
  //! dst ← src rounded to dst_t (to nearest, ties to even), one launch: f32 ⇄ bf16, or a
  //! copy when the types are the same.
  void convert(void* dst, dtype dst_t, const void* src, dtype src_t, std::size_t count) const {
    detail::device_guard g(device_);
    if (dst_t == src_t) {
      if (count && dst != src)
        LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(dst, src, count * size_of(dst_t), cudaMemcpyDeviceToDevice, stream_));
    } else if (src_t == dtype::f32 && dst_t == dtype::bf16) {
      cuda::kernels::to_bf16(static_cast<const float*>(src), dst, count, 1.0f, stream_);
    } else if (src_t == dtype::bf16 && dst_t == dtype::f32) {
      cuda::kernels::from_bf16(src, static_cast<float*>(dst), count, stream_);
    } else {
      throw config_error(std::string("CudaMemory::convert: ") + name_of(src_t) + " -> " + name_of(dst_t) +
                         " is not supported (f32 <-> bf16 is)");
    }
  }

 private:
  struct deleter {
    int device;
    void operator()(void* p) const noexcept {
      // Never throws: it may run during unwinding or at exit (when the runtime may already
      // be unloading). A failure is reported, not raised.
      detail::device_guard g(device, std::nothrow);
      const cudaError_t e = cudaFree(p);
      if (e != cudaSuccess && e != cudaErrorCudartUnloading)
        std::fprintf(stderr, "lockstep: cudaFree on device %d failed: %s\n", device, cudaGetErrorString(e));
    }
  };

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

static_assert(memory_ops_with_add<CudaMemory> && memory_ops_with_convert<CudaMemory>);

}  // namespace lockstep
