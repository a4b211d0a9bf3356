// lockstep-info — checks this machine's setup for lockstep: CPU threads, each GPU (memory,
// compute capability, SMs), which GPUs reach each other directly, the NCCL version, and a
// small all-reduce across every GPU (or CPU ranks without CUDA) whose result is checked.
// Exit code 0 when everything works; otherwise 1 and a plain-language reason.
//
//   lockstep-info            # all visible GPUs
//   LOCKSTEP_DEVICES=0,1 lockstep-info
#include <cmath>
#include <mutex>
#include <cstdio>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>
#if defined(LOCKSTEP_WITH_CUDA) && defined(__CUDACC__)
#include <lockstep/cuda/run_gpus.cuh>
#endif

namespace {

// Each rank contributes (rank+1)·(i+1) at index i; the sum is (i+1)·n(n+1)/2 exactly in f32.
template <class Ctx>
bool check_all_reduce(Ctx& ctx, std::string& why) {
  constexpr std::size_t n = 1 << 20;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>((ctx.rank() + 1) * ((i % 1000) + 1));
  auto mem = ctx.comm().memory();
  auto buf = mem.allocate(n * sizeof(float));
  mem.upload(buf.get(), host.data(), n * sizeof(float));
  ctx.comm().all_reduce(buf.get(), buf.get(), n, lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
  mem.download(host.data(), buf.get(), n * sizeof(float));
  const double w = ctx.size() * (ctx.size() + 1) / 2.0;
  for (std::size_t i = 0; i < n; ++i) {
    if (host[i] != static_cast<float>(w * ((i % 1000) + 1))) {
      why = "rank " + std::to_string(ctx.rank()) + " got " + std::to_string(host[i]) + " at element " +
            std::to_string(i) + ", expected " + std::to_string(w * ((i % 1000) + 1));
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
  try {
    const auto env = lockstep::detect();
    std::printf("lockstep %s\n", lockstep::version_string);
    std::printf("CPU: %d hardware threads%s\n", env.hardware_threads,
                env.cpu_ranks ? (" (LOCKSTEP_CPU_RANKS=" + std::to_string(*env.cpu_ranks) + ")").c_str() : "");
    if (!env.cuda_built) {
      std::printf("CUDA: not built in (configure with -DLOCKSTEP_ENABLE_CUDA=ON for GPUs)\n");
    } else {
      std::printf("NCCL: %d.%d.%d\n", env.nccl_version / 10000, (env.nccl_version / 100) % 100, env.nccl_version % 100);
      if (env.gpus.empty())
        std::printf("GPUs: none visible%s%s\n", env.cuda_error.empty() ? "" : " — CUDA says: ", env.cuda_error.c_str());
      for (const auto& g : env.gpus)
        std::printf("GPU %d: %s, %.1f GiB, compute capability %d.%d, %d SMs\n", g.id, g.name.c_str(),
                    g.total_memory / 1073741824.0, g.cc_major, g.cc_minor, g.multiprocessors);
      if (env.gpus.size() > 1) {
        std::printf("peer access (row reaches column directly):\n     ");
        for (const auto& g : env.gpus) std::printf("%4d", g.id);
        std::printf("\n");
        for (const auto& g : env.gpus) {
          std::printf("%4d ", g.id);
          for (bool b : g.peer_access) std::printf("%4s", b ? "yes" : "-");
          std::printf("\n");
        }
      }
    }
    const auto plan = lockstep::decide(env, LOCKSTEP_AUTO_HAS_GPUS != 0);
    std::printf("Auto mode: %s — %s\n", lockstep::name_of(plan.kind), plan.reason.c_str());
    std::vector<std::string> failures;
    std::mutex m;
    lockstep::run(lockstep::Auto{}, [&](auto& ctx) {
      std::string why;
      if (!check_all_reduce(ctx, why)) {
        std::lock_guard lk(m);
        failures.push_back(why);
      }
    });
    if (!failures.empty()) {
      std::printf("FAILED: the all-reduce across %d rank(s) gave a wrong result: %s\n", plan.ranks, failures[0].c_str());
      std::printf("Check the GPU driver and NCCL (NCCL_DEBUG=INFO lockstep-info shows NCCL's view).\n");
      return 1;
    }
    std::printf("OK: a 4 MiB all-reduce across %d rank(s) gave the exact result\n", plan.ranks);
    return 0;
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    std::printf("lockstep cannot run here as configured; the message above says what failed.\n");
    return 1;
  }
}
