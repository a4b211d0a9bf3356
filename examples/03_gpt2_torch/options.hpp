#pragma once
// gpt2_torch's command line (main.cpp): its options beside the shared ones (run_options,
// bench_common.hpp), the usage text and the checks of a combination.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <lockstep/core/error.hpp>
#include <lockstep/parallel/wire_format.hpp>

#include "bench_common.hpp"

namespace gpt2 {

struct options : gpt2::run_options {
  std::string device = "auto";
  std::string profile;         // a Chrome trace of steps [warmup, warmup + 3) (GPUs)
  std::string wire = "fp32";   // gradients on the wire: fp32, bf16 (lockstep::Bf16Wire), int8 (lockstep::Int8Wire)
  bool wire_feedback = false;  // --wire-feedback: WireOptions::error_feedback
  std::int64_t log_every = 25;
  bool bench = false;
  bool memory_trace = false;         // rank 0 prints the device memory in use after each phase (GPUs)
  bool shard = false;                // ShardedOptimizer + gather_in_forward
  bool pack_values = false;          // sharded: ShardedOptimizer::bind_values off
  bool ce_gather = false;            // sharded: ShardedOptimizer::copy_engine_gather on
  bool ce_scatter = false;           // sharded: ShardedOptimizer::copy_engine_scatter on
  std::string gather_wire = "fp32";  // ShardedOptimizer::gather_wire, FullySharded::gather_wire
  bool gather_values = false;        // sharded: ShardedOptimizer::gather_deltas off
  int zero = 0;                      // 2: ShardedGradients, 3: FullySharded (each block a block)
  bool recompute = false;            // --zero: recompute each block in backward
  bool keep_grads = false;           // --zero: BlockBuffers::keep_gradient_shards
  int prefetch = 1;                  // --zero 3: BlockBuffers::prefetch
  bool cuda_graph = false;           // GPUs: each step after the first two replayed as one CUDA graph
  std::int64_t deterministic = 0;    // Q: lockstep::Deterministic, Q micro-batches of --batch sequences a step
  std::int64_t bucket_mib = 0;       // 0: lockstep's default buckets
  bool tune = false;                 // BucketPolicy::tune: the cap from lockstep's cost model
  bool torch_deterministic = false;  // libtorch's deterministic kernels (on with --deterministic)
  std::int64_t peer_copy = 0;        // --shard: a PeerCopy snapshot every K steps (0: none)
};

// Eager steps before --cuda-graph captures one: the first lays lockstep's buckets out in the
// order gradients arrived, the second runs the final layout (StepGraphOptions::warmup); with
// --tune, tune_step - 1 more (the tuner times step tune_step, its cut applies at the next).
constexpr std::int64_t graph_warmup = 2;

constexpr std::int64_t profiled_steps = 3;

[[noreturn]] inline void usage(int rc) {
  std::printf(
      "usage: gpt2_torch [--data DIR|FILE] [--config small|tiny] [--device auto|cpu] [--batch B]\n"
      "                  [--seq T] [--steps N] [--warmup N] [--lr X] [--seed S] [--log-every N] [--bench]\n"
      "                  [--memory-trace]\n"
      "                  [--profile TRACE.json] [--wire fp32|bf16|int8 [--wire-feedback]] [--shard [--pack-values] "
      "[--copy-engine[-gather]]\n"
      "                  [--gather-wire fp32|bf16|int8 [--gather-values]]]\n"
      "                  [--zero 2|3 [--recompute] [--keep-grad-shards] [--prefetch N] [--gather-wire W]]\n"
      "                  [--cuda-graph]\n"
      "                  [--deterministic Q] [--bucket-mib M] [--tune] [--peer-copy K]\n"
      "  batch: sequences per rank and step; on GPUs: all local GPUs, or one per process under a launcher\n"
      "  --cuda-graph: (GPUs, not with --zero) after two eager steps, capture the whole step\n"
      "                (forward, backward, lockstep's collectives, AdamW) with at::cuda::CUDAGraph and replay it\n"
      "  --deterministic Q: a step is Q micro-batches of --batch sequences (micro-batch j's windows drawn from\n"
      "                (seed, step, j)), rank r taking j = r, r + N, ...; gradients summed in fixed point\n"
      "                (lockstep::Deterministic) and libtorch's deterministic algorithms on: the parameters\n"
      "                do not depend on the number of ranks N (Q a multiple of it) or the bucket sizes\n"
      "  --torch-deterministic: only libtorch's deterministic kernels (what --deterministic sets for the model),\n"
      "                to measure their share of its cost\n"
      "  --wire-feedback: (--wire bf16|int8) what the wire rounds off each rank's gradients goes with its next\n"
      "                step's (error feedback, WireOptions::error_feedback)\n"
      "  --gather-wire W: (--shard) the updated values all-gathered in bf16 or int8 from fp32 masters kept\n"
      "                apart (ShardedOptimizer::gather_wire): the change since the last gather, or with\n"
      "                --gather-values the values themselves; (--zero 3) each block's gathers in W, decoded\n"
      "                into the values lent to it (FullySharded::gather_wire)\n"
      "  --bucket-mib M: gradient buckets of M MiB (default: lockstep's, 1 MiB first, 25 MiB cap)\n"
      "  --peer-copy K: (--shard) a lockstep::PeerCopy snapshot every K steps: each rank's shards and\n"
      "                optimizer state copied and handed to the rank before it (what an elastic job\n"
      "                keeps to survive a lost rank); to measure its cost\n"
      "  --tune: the bucket cap chosen after the third step from lockstep's cost model (BucketPolicy::tune;\n"
      "                GPUs; with --bench, prints its choice)\n");
  std::exit(rc);
}

inline options parse(int argc, char** argv) {
  options o;
  o.parse(argc, argv, "gpt2_torch", usage, [&o](const std::string& a, auto& next) {
    if (a == "--device") o.device = next();
    else if (a == "--log-every") o.log_every = std::stoll(next());
    else if (a == "--bench") o.bench = true;
    else if (a == "--memory-trace") o.memory_trace = true;
    else if (a == "--shard") o.shard = true;
    else if (a == "--pack-values") o.pack_values = true;
    else if (a == "--copy-engine") o.ce_gather = o.ce_scatter = true;  // the gathers and the reduce-scatters
    else if (a == "--copy-engine-gather") o.ce_gather = true;
    else if (a == "--wire") o.wire = next();
    else if (a == "--wire-feedback") o.wire_feedback = true;
    else if (a == "--gather-wire") o.gather_wire = next();
    else if (a == "--gather-values") o.gather_values = true;
    else if (a == "--profile") o.profile = next();
    else if (a == "--zero") o.zero = std::stoi(next());
    else if (a == "--recompute") o.recompute = true;
    else if (a == "--keep-grad-shards") o.keep_grads = true;
    else if (a == "--prefetch") o.prefetch = std::stoi(next());
    else if (a == "--cuda-graph") o.cuda_graph = true;
    else if (a == "--deterministic") o.deterministic = std::stoll(next());
    else if (a == "--bucket-mib") o.bucket_mib = std::stoll(next());
    else if (a == "--tune") o.tune = true;
    else if (a == "--torch-deterministic") o.torch_deterministic = true;
    else if (a == "--peer-copy") o.peer_copy = std::stoll(next());
    else return false;
    return true;
  });
  if (o.prefetch < 0) {
    std::fprintf(stderr, "gpt2_torch: --prefetch %d: say 0 or more blocks\n", o.prefetch);
    usage(2);
  }
  if (o.zero != 0 && o.zero != 2 && o.zero != 3) {
    std::fprintf(stderr, "gpt2_torch: --zero %d: say 2 (ShardedGradients) or 3 (FullySharded)\n", o.zero);
    usage(2);
  }
  if (o.cuda_graph && o.zero != 0) {
    std::fprintf(stderr,
                 "gpt2_torch: --cuda-graph with --zero is not supported yet (a block's use is driven from the host); "
                 "leave one out\n");
    usage(2);
  }
  if (o.tune && (o.shard || o.zero != 0 || o.bucket_mib > 0)) {
    std::fprintf(stderr, "gpt2_torch: --tune with --%s: %s; leave one out\n",
                 o.shard       ? "shard"
                 : o.zero != 0 ? "zero"
                               : "bucket-mib",
                 o.bucket_mib > 0 && !o.shard && o.zero == 0
                     ? "the tuner chooses the cap itself"
                     : "a sharded layout is fixed after the first step, not tuned");
    usage(2);
  }
  if (o.deterministic < 0 || o.bucket_mib < 0) {
    std::fprintf(stderr, "gpt2_torch: --deterministic and --bucket-mib take 0 (off) or more\n");
    usage(2);
  }
  if (o.deterministic > 0 && (o.zero != 0 || o.cuda_graph || o.wire != "fp32" || o.ce_scatter)) {
    std::fprintf(stderr,
                 "gpt2_torch: --deterministic sums gradients in fixed point over accumulated micro-steps: not with "
                 "%s; leave one out\n",
                 o.zero != 0    ? "--zero (its gradient shards accumulate in floating point)"
                 : o.cuda_graph ? "--cuda-graph (it captures one micro-step)"
                 : o.ce_scatter ? "--copy-engine (the copy engines do not add integers)"
                                : "--wire bf16|int8");
    usage(2);
  }
  if (o.peer_copy < 0 || (o.peer_copy > 0 && (!o.shard || o.zero != 0 || o.cuda_graph))) {
    std::fprintf(stderr,
                 "gpt2_torch: --peer-copy K (K >= 1) keeps ShardedOptimizer's state twice: give it with --shard, "
                 "without --zero and --cuda-graph\n");
    usage(2);
  }
  if (o.deterministic > 0) o.torch_deterministic = true;
  for (const auto& [flag, name] : {std::pair{"--wire", &o.wire}, std::pair{"--gather-wire", &o.gather_wire}}) {
    try {
      (void)lockstep::wire_format_of(*name);  // main.cpp takes the format from the name
    } catch (const lockstep::config_error& e) {
      std::fprintf(stderr, "gpt2_torch: %s: %s\n", flag, e.what());
      usage(2);
    }
  }
  if (o.wire_feedback && o.wire == "fp32") {
    std::fprintf(stderr, "gpt2_torch: --wire-feedback goes with --wire bf16 or int8 (fp32 rounds nothing off)\n");
    usage(2);
  }
  if ((o.gather_wire != "fp32" && !o.shard && o.zero != 3) || (o.gather_values && !o.shard)) {
    std::fprintf(stderr, "gpt2_torch: --gather-wire goes with --shard or --zero 3, --gather-values with --shard\n");
    usage(2);
  }
  if (o.gather_wire != "fp32" && (o.cuda_graph || o.deterministic > 0)) {
    std::fprintf(stderr, "gpt2_torch: --gather-wire %s with %s: %s; leave one out\n", o.gather_wire.c_str(),
                 o.cuda_graph ? "--cuda-graph" : "--deterministic",
                 o.cuda_graph ? "a captured gather_wire is refused (the host cannot tell when replays round the values)"
                              : "rounded values depend on how the ranks cut the shards");
    usage(2);
  }
  if (!o.profile.empty() && o.steps < o.warmup + profiled_steps) {
    std::fprintf(stderr, "gpt2_torch: --profile records steps %lld to %lld: give --steps of at least %lld\n",
                 static_cast<long long>(o.warmup), static_cast<long long>(o.warmup + profiled_steps - 1),
                 static_cast<long long>(o.warmup + profiled_steps));
    usage(2);
  }
  return o;
}

}  // namespace gpt2
