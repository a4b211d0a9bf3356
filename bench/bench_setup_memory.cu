// bench_setup_memory — the device memory lockstep's set-up takes on GPU 0 before any model
// exists, next to NCCL alone measured the same way in another run of this program (a process
// does not get back all it gave a communicator, so each variant is its own process):
//   context   the CUDA context and a 64 MiB buffer per GPU, nothing else (the floor);
//   nccl      + ncclCommInitAll over the GPUs, then all-reduces of the buffer (ncclGroup);
//   lockstep  + lockstep::run(Gpus) (NcclComm::create_local, its streams and events, the
//             order check's seals), then the same collectives through NcclComm.
// Each prints cudaMemGetInfo's used bytes on GPU 0 after the context, after the communicator,
// and after the first call of each kind of collective in turn (NCCL connects the peers an
// algorithm needs, and sizes their buffers, on its first use): a one-element all-reduce, a
// 64 MiB all-reduce (then 20 more), a broadcast, an all-gather, a reduce-scatter, an all-to-all.
//
//   bench_setup_memory --what context|nccl|lockstep [--gpus N]
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <lockstep/cuda/run_gpus.cuh>
#include <lockstep/lockstep.hpp>

namespace {

constexpr std::size_t buffer_floats = std::size_t{16} << 20;  // 64 MiB of f32 per GPU
constexpr int repeats = 20;                                   // 64 MiB all-reduces

void print_used(const std::string& what, int gpus, const char* phase) {
  lockstep::detail::device_guard g(0);
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  std::size_t free = 0, total = 0;
  LOCKSTEP_TRY_CUDA(cudaMemGetInfo(&free, &total));
  std::printf("setup-memory: what=%s gpus=%d phase=%s used_gib=%.3f\n", what.c_str(), gpus, phase,
              static_cast<double>(total - free) / (1 << 30));
  std::fflush(stdout);
}

__global__ void fill(float* p, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = v + static_cast<float>(i % 7);
}

int usage() {
  std::fprintf(stderr, "usage: bench_setup_memory --what context|nccl|lockstep [--gpus N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string what;
  int gpus = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--what" && i + 1 < argc) what = argv[++i];
    else if (a == "--gpus" && i + 1 < argc) gpus = std::stoi(argv[++i]);
    else return usage();
  }
  if (what != "context" && what != "nccl" && what != "lockstep") return usage();
  int visible = 0;
  LOCKSTEP_TRY_CUDA(cudaGetDeviceCount(&visible));
  if (gpus < 1 || gpus > visible) {
    std::fprintf(stderr, "bench_setup_memory: --gpus %d, but %d GPU(s) are visible\n", gpus, visible);
    return 2;
  }
  std::vector<int> devices;
  std::vector<float*> buffers;
  for (int d = 0; d < gpus; ++d) {
    devices.push_back(d);
    lockstep::detail::device_guard g(d);
    float* p = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&p, buffer_floats * sizeof(float)));
    fill<<<256, 256>>>(p, buffer_floats, static_cast<float>(d));
    LOCKSTEP_TRY_CUDA(cudaGetLastError());
    buffers.push_back(p);
  }
  print_used(what, gpus, "context");

  // The collectives in turn on rank r's buffer p (in place where NCCL allows it, else into the
  // buffer's second half): one(name, call) runs call on every rank, then prints.
  const std::size_t half = buffer_floats / 2, block = half / static_cast<std::size_t>(gpus);
  const auto sequence = [&](auto&& one, auto&& all_reduce, auto&& broadcast, auto&& all_gather, auto&& reduce_scatter,
                            auto&& all_to_all) {
    one("all-reduce-1", [&](int, float* p) { all_reduce(p, 1); });
    one("all-reduce-64MiB", [&](int, float* p) { all_reduce(p, buffer_floats); });
    for (int k = 1; k < repeats; ++k) one("", [&](int, float* p) { all_reduce(p, buffer_floats); });
    one("all-reduce-64MiB-x20", [](int, float*) {});
    one("broadcast", [&](int, float* p) { broadcast(p, buffer_floats); });
    one("all-gather", [&](int r, float* p) { all_gather(p + static_cast<std::size_t>(r) * block, p, block); });
    one("reduce-scatter", [&](int, float* p) { reduce_scatter(p, p + half, block); });
    one("all-to-all", [&](int, float* p) { all_to_all(p, p + half, block / static_cast<std::size_t>(gpus)); });
  };

  if (what == "nccl") {
    std::vector<ncclComm_t> comms(static_cast<std::size_t>(gpus));
    std::vector<cudaStream_t> streams(static_cast<std::size_t>(gpus));
    LOCKSTEP_TRY_NCCL(ncclCommInitAll(comms.data(), gpus, devices.data()));
    for (int d = 0; d < gpus; ++d) {
      lockstep::detail::device_guard g(d);
      LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(d)], cudaStreamNonBlocking));
    }
    print_used(what, gpus, "communicator");
    int r = 0;  // the rank being issued, for the calls below
    const auto c = [&] { return comms[static_cast<std::size_t>(r)]; };
    const auto st = [&] { return streams[static_cast<std::size_t>(r)]; };
    sequence(
        [&](const char* name, auto&& call) {
          LOCKSTEP_TRY_NCCL(ncclGroupStart());
          for (r = 0; r < gpus; ++r) call(r, buffers[static_cast<std::size_t>(r)]);
          LOCKSTEP_TRY_NCCL(ncclGroupEnd());
          for (auto s : streams) LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
          if (*name) print_used(what, gpus, name);
        },
        [&](float* p, std::size_t n) { LOCKSTEP_TRY_NCCL(ncclAllReduce(p, p, n, ncclFloat, ncclSum, c(), st())); },
        [&](float* p, std::size_t n) { LOCKSTEP_TRY_NCCL(ncclBroadcast(p, p, n, ncclFloat, 0, c(), st())); },
        [&](float* in, float* out, std::size_t n) {
          LOCKSTEP_TRY_NCCL(ncclAllGather(in, out, n, ncclFloat, c(), st()));
        },
        [&](float* in, float* out, std::size_t n) {
          LOCKSTEP_TRY_NCCL(ncclReduceScatter(in, out, n, ncclFloat, ncclSum, c(), st()));
        },
        [&](float* in, float* out, std::size_t n) {
          LOCKSTEP_TRY_NCCL(ncclAlltoAll(in, out, n, ncclFloat, c(), st()));
        });
    for (auto cm : comms) (void)ncclCommDestroy(cm);
  } else if (what == "lockstep") {
    lockstep::run(lockstep::Gpus{devices}, [&](auto& ctx) {
      auto& comm = ctx.comm();
      comm.barrier();
      if (ctx.is_root()) print_used(what, gpus, "communicator");
      comm.barrier();
      using lockstep::dtype;
      constexpr auto sum = lockstep::reduce_op::sum;
      float* mine = buffers[static_cast<std::size_t>(ctx.rank())];
      sequence(
          [&](const char* name, auto&& call) {
            call(ctx.rank(), mine);
            LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(comm.compute_stream()));
            LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(comm.comm_stream()));
            if (!*name) return;
            comm.barrier();
            if (ctx.is_root()) print_used(what, gpus, name);
            comm.barrier();
          },
          [&](float* p, std::size_t n) { comm.all_reduce(p, p, n, dtype::f32, sum).wait(); },
          [&](float* p, std::size_t n) { comm.broadcast(p, n, dtype::f32, 0).wait(); },
          [&](float* in, float* out, std::size_t n) { comm.all_gather(in, out, n, dtype::f32).wait(); },
          [&](float* in, float* out, std::size_t n) { comm.reduce_scatter(in, out, n, dtype::f32, sum).wait(); },
          [&](float* in, float* out, std::size_t n) { comm.all_to_all(in, out, n, dtype::f32).wait(); });
    });
  }
  for (int d = 0; d < gpus; ++d) {
    lockstep::detail::device_guard g(d);
    LOCKSTEP_TRY_CUDA(cudaFree(buffers[static_cast<std::size_t>(d)]));
  }
  return 0;
}
