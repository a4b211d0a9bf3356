#pragma once
// What the programs that train gpt2.hpp's GPT-2 for bench/gpt2_torch.sh share (the example,
// main.cpp, and libtorch's data_parallel reference, bench/gpt2_data_parallel.cpp): the model
// configs by name, GPT-2's options and the "bench:" line the script greps. The pieces that do
// not depend on the model (the argument loop, the median step after the warm-up, bf16
// autocast on the calling thread across libtorch versions) are in bench_util.hpp, named here
// in namespace gpt2 too.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.hpp"
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
    lockstep_bench::parse_args(argc, argv, program, usage,
                               [&](const std::string& a, auto& next) { return take(a, next) || own(a, next); });
    if (!valid()) usage(2);
  }
};

using lockstep_bench::mean_after_warmup;
using lockstep_bench::median_after_warmup;

//! "bench: <what> gpus=N step_ms=... tokens_per_s=... peak_gib=... loss_first=... loss_last=...",
//! the line bench/gpt2_torch.sh greps (bench/gpt2_ddp.py prints the same fields).
inline void print_bench_line(const std::string& what, int gpus, double step_ms, std::int64_t tokens_per_step,
                             double peak_gib, double loss_first, double loss_last) {
  std::printf("bench: %s gpus=%d step_ms=%.2f tokens_per_s=%.0f peak_gib=%.2f loss_first=%.3f loss_last=%.3f\n",
              what.c_str(), gpus, step_ms, static_cast<double>(tokens_per_step) / (step_ms / 1e3), peak_gib, loss_first,
              loss_last);
  std::fflush(stdout);
}

using lockstep_bench::CudaBf16Autocast;
using lockstep_bench::set_cuda_bf16_autocast;

//! FNV-1a 64 over the parameters' bytes (copied to the host), in the module's order: equal
//! parameters, equal checksums (to compare runs bit for bit).
inline std::uint64_t parameter_checksum(torch::nn::Module& m) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const auto& p : m.parameters()) {
    const auto host = p.detach().to(torch::kCPU).contiguous();
    const auto* b = static_cast<const unsigned char*>(host.data_ptr());
    for (std::size_t i = 0, n = static_cast<std::size_t>(host.numel()) * host.element_size(); i < n; ++i)
      h = (h ^ b[i]) * 0x100000001b3ULL;
  }
  return h;
}

}  // namespace gpt2
