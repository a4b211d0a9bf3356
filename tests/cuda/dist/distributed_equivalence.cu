// Distributed (one process per GPU, started by lockstep-run or torchrun): N processes with
// batch B each end where one CPU rank with batch N·B ends. Every process computes the CPU
// reference itself and exits non-zero when its parameters differ; "[lockstep-skip]" when the
// machine has fewer GPUs than processes.
//   distributed_equivalence --uneven   rank 0 runs one step fewer (uneven inputs, no Join):
//   every process must end within seconds, the others saying that rank 0 left.
//   distributed_equivalence --graph    cycles 2.. (both micro-steps) captured once in a
//   lockstep::StepGraph (cudaStreamCaptureModeGlobal: nothing in the process may synchronise
//   or allocate meanwhile) and replayed; the same parameters.
//   distributed_equivalence --symmetric   the gradient arena in a symmetric window
//   (BucketPolicy::symmetric_memory): the buckets go to NCCL's symmetric kernels where the
//   GPUs allow (printed), with the same parameters.
//   distributed_equivalence --sweep    the all-reduce of buffers in a symmetric window alone
//   (lockstep's peer kernel, NCCL's symmetric kernels above its limit), random cases against
//   each rank's CPU sum (symmetric_sweep.cuh); no training.
//   distributed_equivalence --sweep-order   the order check carried by the peer kernel: agreed
//   calls pass, a mismatched label is named (symmetric_sweep.cuh); run() then ends with it.
//   distributed_equivalence --tune     BucketPolicy::tune: the cap chosen from the third
//   synchronising step's gradient times and timed all-reduces (printed), the same parameters.
//   Flags combine, but not --graph with --tune (the capture of cycle 3 would hold the step the
//   tuner times: refused by name).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <lockstep/cuda/run_processes.cuh>
#include <lockstep/cuda/step_graph.cuh>
#include <lockstep/lockstep.hpp>
#include <lockstep/parallel/data_parallel.hpp>

#include "gpu_mlp.cuh"
#include "launched.hpp"
#include "mlp.hpp"
#include "symmetric_sweep.cuh"
#include "test_util.hpp"

using namespace lockstep_test;

int main(int argc, char** argv) {
  try {
    bool uneven = false, graphed = false, symmetric = false, tune = false, sweep = false, sweep_order = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--uneven") uneven = true;
      else if (a == "--graph") graphed = true;
      else if (a == "--symmetric") symmetric = true;
      else if (a == "--tune") tune = true;
      else if (a == "--sweep") sweep = true;
      else if (a == "--sweep-order") sweep_order = true;
      else {
        std::fprintf(stderr,
                     "distributed_equivalence: unknown option '%s' (--uneven, --graph, --symmetric, --tune, --sweep, "
                     "--sweep-order)\n",
                     a.c_str());
        return 2;
      }
    }
    // What run(Auto) asks first (the GPUs, their properties and peer access): it must leave
    // no CUDA context behind on a GPU this process does not use (checked at the end).
    (void)lockstep::detect();
    int exit_code = 0;
    const auto here = launched_on_gpus("distributed_equivalence", "lockstep-run or torchrun", exit_code);
    if (!here) return exit_code;
    const auto* info = &here->info;
    const int visible = here->visible;
    // The same seed everywhere: rank 0's, through the environment the test sets (or fixed).
    const std::uint64_t seed =
        std::getenv("LOCKSTEP_TEST_SEED") ? std::strtoull(std::getenv("LOCKSTEP_TEST_SEED"), nullptr, 10) : 20261126;
    const std::vector<int> dims{37, 64, 33, 10};
    const std::size_t samples = 2048;
    const int batch = 16, steps = 5, accumulate = 2;
    const float lr = 0.1f;
    std::mt19937_64 rng(seed);
    auto X = random_vector<float>(samples * dims[0], rng, -2, 2);
    std::vector<int> y(samples);
    std::uniform_int_distribution<int> lab(0, 9);
    for (auto& v : y) v = lab(rng);
    int failures = 0;
    if (sweep_order) {  // the body's checks, then run() must end with the mismatch it provoked
      bool reached = false, ended = false;
      try {
        lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
          failures = symmetric_order_sweep(ctx, reached);
        });
      } catch (const std::exception& e) {  // the mismatch, or the watchdog's abort for it
        const std::string m = e.what();
        const bool kind = dynamic_cast<const lockstep::mismatch_error*>(&e) != nullptr ||
                          dynamic_cast<const lockstep::aborted_error*>(&e) != nullptr;
        ended = kind && m.find("sweep order: rank 0's label") != std::string::npos &&
                m.find("sweep order: the others' label") != std::string::npos;
        std::printf("run() ended with %s: %s\n", ended ? "the mismatch, both labels named" : "something else",
                    e.what());
      }
      if (failures < 0) return 0;  // skipped
      const bool ok = reached && failures == 0 && ended;
      std::printf("order check over the peer kernel: %s\n", ok ? "PASS" : "FAIL");
      return ok ? 0 : 1;
    }
    lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
      if (sweep) {
        failures += symmetric_sweep(ctx);
        return;
      }
      const int world = ctx.size();
      const std::size_t global = static_cast<std::size_t>(batch * world * accumulate);
      TestMlp<float> ref(dims, seed + 1);
      for (int s = 0; s < steps; ++s) {
        ref.zero_grad();
        std::vector<std::size_t> rows(global);
        for (std::size_t i = 0; i < global; ++i) rows[i] = (s * global + i) % samples;
        ref.forward_backward(X, y, rows, [](std::size_t) {});
        ref.sgd(lr);
      }
      cudaStream_t st = ctx.comm().compute_stream();
      TestMlp<float> init(dims, seed + 1 + static_cast<std::uint64_t>(ctx.rank()) * 7919);
      std::vector<std::vector<float>> values;
      for (auto& p : init.parameters()) {
        auto v = p.value_as<float>();
        values.emplace_back(v.begin(), v.end());
      }
      GpuMlp m(dims, values, st);
      lockstep::Distributed<GpuMlp, lockstep::NcclComm, lockstep::Accumulate<>> dp(
          ctx, m, {.buckets = {.first_bytes = 2000, .cap_bytes = 6000, .symmetric_memory = symmetric, .tune = tune}},
          lockstep::Accumulate<>(accumulate));
      float* dX = nullptr;
      int *dy = nullptr, *drows = nullptr;  // one row buffer per micro-step of a cycle
      LOCKSTEP_TRY_CUDA(cudaMalloc(&dX, X.size() * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&dy, y.size() * sizeof(int)));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&drows, accumulate * batch * sizeof(int)));
      LOCKSTEP_TRY_CUDA(cudaMemcpy(dX, X.data(), X.size() * sizeof(float), cudaMemcpyHostToDevice));
      LOCKSTEP_TRY_CUDA(cudaMemcpy(dy, y.data(), y.size() * sizeof(int), cudaMemcpyHostToDevice));
      LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
      // The whole cycle is one graph: both micro-steps, the sync and the SGD step.
      lockstep::StepGraph graph(ctx.comm(), {.warmup = 2, .mode = cudaStreamCaptureModeGlobal});
      const int my_steps = uneven && ctx.rank() == 0 ? steps - 1 : steps;
      for (int s = 0; s < my_steps; ++s) {
        std::vector<int> rows(static_cast<std::size_t>(accumulate * batch));
        for (int k = 0; k < accumulate; ++k) {
          const std::size_t first = s * global + (static_cast<std::size_t>(k) * world + ctx.rank()) * batch;
          for (int i = 0; i < batch; ++i)
            rows[static_cast<std::size_t>(k * batch + i)] = static_cast<int>((first + i) % samples);
        }
        LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(drows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, st));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
        const auto cycle = [&] {
          for (int k = 0; k < accumulate; ++k) {
            auto step = dp.step();
            m.forward_backward(dX, dy, drows + k * batch, batch, step.on_gradient_ready());
            if (step.finish()) m.sgd(lr);
          }
        };
        if (graphed) graph.run(cycle);
        else cycle();
      }
      if (uneven) return;  // the ranks that stepped on fail in their last step (not here)
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
      if (graphed && graph.replays() != static_cast<std::uint64_t>(steps - 2)) {
        std::printf("rank %d: the graph ran %llu times, expected %d\n", ctx.rank(),
                    static_cast<unsigned long long>(graph.replays()), steps - 2);
        ++failures;
      }
      if (tune && (dp.stats().tuned_cap_bytes == 0 || dp.stats().tuning.empty())) {
        std::printf("rank %d: --tune chose no cap\n", ctx.rank());
        ++failures;
      }
      if (tune && ctx.rank() == 0) std::printf("tuned: %s\n", dp.stats().tuning.c_str());
      if (symmetric && ctx.rank() == 0)
        std::printf("symmetric window: %s (%s)\n", dp.stats().symmetric_memory ? "yes" : "no",
                    ctx.comm().symmetric_kernels().second.c_str());
      const auto got = m.flat_values();
      const double err = max_rel_diff(got, ref.flat_values());
      const double moved = max_rel_diff(init.flat_values(), ref.flat_values());
      // Every rank holds the same parameters: compare a checksum through the communicator.
      double sum = 0;
      for (float v : got) sum += static_cast<double>(v) * 1.000001;
      std::vector<double> mx{sum}, mn{-sum};
      lockstep::all_reduce_scalars(ctx.comm(), std::span<double>(mx), lockstep::reduce_op::max);
      lockstep::all_reduce_scalars(ctx.comm(), std::span<double>(mn), lockstep::reduce_op::max);
      const bool same = mx[0] == -mn[0];
      std::printf("rank %d/%d (GPU %d, launcher %s): rel. diff to the CPU reference %.3g, ranks identical: %s\n",
                  ctx.rank(), world, ctx.device(), info->launcher.c_str(), err, same ? "yes" : "NO");
      if (!(err <= 1e-5) || !(moved > 1e-3) || !same) ++failures;
      cudaFree(dX);
      cudaFree(dy);
      cudaFree(drows);
      // No CUDA context on another rank's GPU (each takes about half a GiB there): neither
      // detect() above nor the watchdog's thread, which polls the communicator every 200 ms
      // (restoring its "previous" device 0 after each poll), may leave one on GPU 0. Wait
      // for a few polls first.
      std::this_thread::sleep_for(std::chrono::milliseconds(700));
      for (int d = 0; d < visible; ++d)
        if (d != ctx.device() && lockstep::detail::primary_context_active(d)) {
          std::printf("rank %d (GPU %d) has a CUDA context on GPU %d too\n", ctx.rank(), ctx.device(), d);
          ++failures;
        }
    });
    if (failures) {
      std::printf("FAIL\n");
      return 1;
    }
    std::printf("PASS\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distributed_equivalence: %s\n", e.what());
    return 1;
  }
}
