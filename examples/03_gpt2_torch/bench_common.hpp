#pragma once
// What the programs that train gpt2.hpp's GPT-2 for bench/gpt2_torch.sh share (the example,
// main.cpp, and libtorch's data_parallel reference, bench/gpt2_data_parallel.cpp): the model
// configs by name, the median step after the warm-up, the "bench:" line the script greps, and
// bf16 autocast on the calling thread across libtorch versions.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include "gpt2.hpp"

namespace gpt2 {

//! "small" (GPT-2 small, the default) or "tiny" (the CPU test's: 2 layers of width 64, 256
//! tokens), with a context of at least seq positions.
inline Config config_named(const std::string& name, std::int64_t seq) {
  Config c;
  if (name == "tiny") c = Config{.vocab = 256, .context = 64, .layers = 2, .heads = 2, .width = 64};
  c.context = std::max(c.context, seq);
  return c;
}

//! The options both programs take: the text, the model, the batch per rank, the schedule.
struct run_options {
  std::string data = "/usr/share/games/fortunes";
  std::string config = "small";
  std::int64_t batch = 8, seq = 1024, steps = 300, warmup = 5;
  double lr = 6e-4;
  std::uint64_t seed = 42;

  //! Takes option a (its value from next()) if it is one of these; false if it is not.
  template <class Next>
  bool take(const std::string& a, Next&& next) {
    if (a == "--data") data = next();
    else if (a == "--config") config = next();
    else if (a == "--batch") batch = std::stoll(next());
    else if (a == "--seq") seq = std::stoll(next());
    else if (a == "--steps") steps = std::stoll(next());
    else if (a == "--warmup") warmup = std::stoll(next());
    else if (a == "--lr") lr = std::stod(next());
    else if (a == "--seed") seed = std::stoull(next());
    else return false;
    return true;
  }
  //! A known config, batch ≥ 1, seq ≥ 2, steps ≥ 1 and 0 ≤ warmup < steps.
  bool valid() const {
    return (config == "small" || config == "tiny") && batch >= 1 && seq >= 2 && steps >= 1 && warmup >= 0 &&
           warmup < steps;
  }

  //! Reads argv: these options (take), then the program's own (own(a, next): true if it took
  //! a); --help or -h calls usage(0); an option without its value, an unknown argument or an
  //! invalid set (valid()) is named on stderr as `program: ...` and calls usage(2), which must
  //! not return.
  template <class Own, class Usage>
  void parse(int argc, char** argv, const char* program, Usage&& usage, Own&& own) {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) {
          std::fprintf(stderr, "%s: %s needs a value\n", program, a.c_str());
          usage(2);
        }
        return argv[++i];
      };
      if (take(a, next) || own(a, next)) continue;
      if (a == "--help" || a == "-h") usage(0);
      std::fprintf(stderr, "%s: unknown argument %s\n", program, a.c_str());
      usage(2);
    }
    if (!valid()) usage(2);
  }
};

//! Median of step_ms[warmup:] (of an even count the upper middle); step_ms holds more than
//! warmup steps.
inline double median_after_warmup(const std::vector<double>& step_ms, std::int64_t warmup) {
  std::vector<double> timed(step_ms.begin() + static_cast<std::ptrdiff_t>(warmup), step_ms.end());
  std::sort(timed.begin(), timed.end());
  return timed[timed.size() / 2];
}

//! "bench: <what> gpus=N step_ms=... tokens_per_s=... peak_gib=... loss_first=... loss_last=...",
//! the line bench/gpt2_torch.sh greps (bench/gpt2_ddp.py prints the same fields).
inline void print_bench_line(const std::string& what, int gpus, double step_ms, std::int64_t tokens_per_step,
                             double peak_gib, double loss_first, double loss_last) {
  std::printf("bench: %s gpus=%d step_ms=%.2f tokens_per_s=%.0f peak_gib=%.2f loss_first=%.3f loss_last=%.3f\n",
              what.c_str(), gpus, step_ms, static_cast<double>(tokens_per_step) / (step_ms / 1e3), peak_gib,
              loss_first, loss_last);
  std::fflush(stdout);
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

}  // namespace gpt2
