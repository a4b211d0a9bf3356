#pragma once
// What every libtorch benchmark program of lockstep shares, whatever its model: the argument
// loop, the median step after the warm-up, and bf16 CUDA autocast on the calling thread across
// libtorch versions. Used by example 03 (through bench_common.hpp, which adds GPT-2's options
// and bench line), bench/gpt2_data_parallel.cpp and bench/resnet50_torch.cpp.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace lockstep_bench {

//! Reads argv: take(a, next) is offered each argument a (its value from next()) and returns
//! true if it took it; --help or -h calls usage(0); an option without its value or an unknown
//! argument is named on stderr as `program: ...` and calls usage(2), which must not return.
template <class Take, class Usage>
void parse_args(int argc, char** argv, const char* program, Usage&& usage, Take&& take) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: %s needs a value\n", program, a.c_str());
        usage(2);
      }
      return argv[++i];
    };
    if (take(a, next)) continue;
    if (a == "--help" || a == "-h") usage(0);
    std::fprintf(stderr, "%s: unknown argument %s\n", program, a.c_str());
    usage(2);
  }
}

//! Median of step_ms[warmup:] (of an even count the upper middle); step_ms holds more than
//! warmup steps.
inline double median_after_warmup(const std::vector<double>& step_ms, std::int64_t warmup) {
  std::vector<double> timed(step_ms.begin() + static_cast<std::ptrdiff_t>(warmup), step_ms.end());
  std::sort(timed.begin(), timed.end());
  return timed[timed.size() / 2];
}

//! The mean of the steps after the warm-up (where steps differ by design, e.g. every K-th one
//! does more, the median hides that share).
inline double mean_after_warmup(const std::vector<double>& step_ms, std::int64_t warmup) {
  double sum = 0;
  for (auto i = static_cast<std::size_t>(warmup); i < step_ms.size(); ++i) sum += step_ms[i];
  return sum / static_cast<double>(step_ms.size() - static_cast<std::size_t>(warmup));
}

//! Turns CUDA autocast to bf16 on (or off) for the calling thread: autocast's switch and dtype
//! are per thread (the dtype defaults to fp16 in every new thread).
inline void set_cuda_bf16_autocast(bool on) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(at::kCUDA, on);
  if (on) at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
#else
  at::autocast::set_enabled(on);
  if (on) at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
#endif
}

//! bf16 CUDA autocast on the calling thread for the guard's lifetime; the thread's previous
//! switch and dtype come back after.
class CudaBf16Autocast {
 public:
  CudaBf16Autocast() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    was_on_ = at::autocast::is_autocast_enabled(at::kCUDA);
    was_dtype_ = at::autocast::get_autocast_dtype(at::kCUDA);
#else
    was_on_ = at::autocast::is_enabled();
    was_dtype_ = at::autocast::get_autocast_gpu_dtype();
#endif
    set_cuda_bf16_autocast(true);
  }
  ~CudaBf16Autocast() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_dtype(at::kCUDA, was_dtype_);
    at::autocast::set_autocast_enabled(at::kCUDA, was_on_);
#else
    at::autocast::set_autocast_gpu_dtype(was_dtype_);
    at::autocast::set_enabled(was_on_);
#endif
  }
  CudaBf16Autocast(const CudaBf16Autocast&) = delete;
  CudaBf16Autocast& operator=(const CudaBf16Autocast&) = delete;

 private:
  bool was_on_ = false;
  at::ScalarType was_dtype_ = at::kHalf;
};

}  // namespace lockstep_bench
