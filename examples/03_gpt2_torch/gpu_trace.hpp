#pragma once
// A Chrome trace of the GPU work of some steps, from libtorch's Kineto profiler (CUPTI): every
// kernel, copy and memset of the process, whichever thread queued it, so one rank's thread
// starting it records every GPU of the process. GPU activity only: recording every CPU-side
// operator too would make the host the bottleneck. For bench/kernel_profile.py. Examples 03
// and 05 (GPU builds) take --profile FILE: the `steps` steps after the warm-up.
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>

#include <torch/csrc/autograd/profiler_kineto.h>

namespace lockstep_bench {

inline void start_gpu_trace() {
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  const std::set<impl::ActivityType> activities{impl::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}

inline void save_gpu_trace(const char* program, const std::string& path, std::int64_t steps) {
  torch::autograd::profiler::disableProfiler()->save(path);
  std::printf("%s: wrote the trace of %lld steps to %s\n", program, static_cast<long long>(steps), path.c_str());
}

}  // namespace lockstep_bench
