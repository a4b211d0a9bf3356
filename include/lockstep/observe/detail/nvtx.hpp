#pragma once
//! NVTX ranges (the NVIDIA Tools Extension; NVTX3 is header-only and ships with the CUDA
//! toolkit) around what DataParallel does in a step, in the NVTX domain "lockstep", so that
//! Nsight Systems shows a step next to the model's kernels: "step" and "forward + backward"
//! (start/end ranges: they begin in step() and end in finish()), "finish", "unscale + inf/NaN
//! check", "clip by global norm", and per bucket (its number as the payload) "collective issued",
//! "wait for bucket" and "bucket callback" (the optimizer). Pushed ranges nest per thread.
//!
//! Compiled in where LOCKSTEP_WITH_NVTX is defined (the lockstep::cuda CMake target defines it)
//! and <nvtx3/nvToolsExt.h> is on the include path; otherwise every call here is empty. With no
//! tool attached, NVTX's first call finds no injection library and every later call returns at
//! once (one indirect call). docs/observe.md says how to record them.

#include <cstdint>

#if defined(LOCKSTEP_WITH_NVTX) && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define LOCKSTEP_NVTX 1
#else
#define LOCKSTEP_NVTX 0
#endif

namespace lockstep::detail {

#if LOCKSTEP_NVTX
inline nvtxDomainHandle_t nvtx_domain() {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA("lockstep");
  return d;
}
inline nvtxEventAttributes_t nvtx_attributes(const char* name, std::int64_t payload) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  if (payload >= 0) {
    a.payloadType = NVTX_PAYLOAD_TYPE_INT64;
    a.payload.llValue = payload;
  }
  return a;
}
#endif

//! A range on this thread while alive (NVTX push/pop); payload ≥ 0 is shown with it.
class nvtx_range {
 public:
  explicit nvtx_range(const char* name, std::int64_t payload = -1) noexcept {
#if LOCKSTEP_NVTX
    const auto a = nvtx_attributes(name, payload);
    nvtxDomainRangePushEx(nvtx_domain(), &a);
#else
    (void)name;
    (void)payload;
#endif
  }
  ~nvtx_range() {
#if LOCKSTEP_NVTX
    nvtxDomainRangePop(nvtx_domain());
#endif
  }
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;
};

//! A range that may end in another function (NVTX start/end); 0 when NVTX is not compiled in.
inline std::uint64_t nvtx_start(const char* name) noexcept {
#if LOCKSTEP_NVTX
  const auto a = nvtx_attributes(name, -1);
  return nvtxDomainRangeStartEx(nvtx_domain(), &a);
#else
  (void)name;
  return 0;
#endif
}
//! Ends a range of nvtx_start (nothing for 0).
inline void nvtx_end(std::uint64_t id) noexcept {
#if LOCKSTEP_NVTX
  if (id != 0) nvtxDomainRangeEnd(nvtx_domain(), id);
#else
  (void)id;
#endif
}

}  // namespace lockstep::detail
