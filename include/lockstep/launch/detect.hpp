#pragma once
// lockstep-header-check: also-cpu (the CUDA parts are behind LOCKSTEP_WITH_CUDA)
//! lockstep::detect() — what this process can run on, and decide() — which mode Auto picks.
//! Adding a mode (GPUs, launcher-started processes) means adding a field here and a case
//! in decide() and in run(Auto).

#include <algorithm>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(LOCKSTEP_WITH_CUDA)
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/launch/launch_env.hpp"

namespace lockstep {

//! One visible GPU (CUDA numbering, i.e. after CUDA_VISIBLE_DEVICES).
struct gpu_info {
  int id = 0;
  std::string name;
  std::size_t total_memory = 0;  //!< bytes
  std::size_t free_memory = 0;   //!< bytes, when detected
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
  std::vector<bool> peer_access;  //!< peer_access[j]: this GPU can access GPU j directly
};

struct environment {
  int hardware_threads = 1;                 //!< std::thread::hardware_concurrency (≥ 1)
  std::optional<int> cpu_ranks;             //!< LOCKSTEP_CPU_RANKS, when set
  bool cuda_built = false;                  //!< this build has lockstep::cuda
  std::vector<gpu_info> gpus;               //!< visible GPUs (empty without CUDA or a driver)
  std::string cuda_error;                   //!< why no GPU was found, when the runtime said so
  int nccl_version = 0;                     //!< e.g. 22805 for 2.28.5; 0 when unknown
  std::optional<std::vector<int>> devices;  //!< LOCKSTEP_DEVICES="0,2": the GPUs to use
  std::optional<launch_info> launcher;      //!< set when a launcher started this process
  std::optional<int> model_parallel;        //!< LOCKSTEP_MODEL_PARALLEL, when set: ranks per model replica
};

namespace detail {
//! Parses "0,2,3" into device ids; rejects junk, negatives and duplicates.
inline std::vector<int> parse_device_list(const std::string& text, const char* what) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 0)
      throw config_error(std::string(what) + "='" + text + "': '" + item +
                         "' is not a device id (give non-negative integers separated by commas)");
    if (std::find(out.begin(), out.end(), static_cast<int>(v)) != out.end())
      throw config_error(std::string(what) + "='" + text + "' lists device " + item +
                         " twice; each GPU can hold one rank");
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) throw config_error(std::string(what) + " is empty; list device ids like 0,1");
  return out;
}

//! LOCKSTEP_MODEL_PARALLEL=M: the ranks that hold one model replica's parts, for run(Hybrid{})
//! when the code gives no degree (lockstep/run.hpp, docs/hybrid.md); nullopt when unset.
inline std::optional<int> model_parallel_from_env() {
  auto m = env_long("LOCKSTEP_MODEL_PARALLEL");
  if (!m) return std::nullopt;
  if (*m < 1 || *m > 4096)
    throw config_error("LOCKSTEP_MODEL_PARALLEL=" + std::to_string(*m) +
                       " is out of range: give the number of ranks per model replica, from 1 to 4096 "
                       "(a divisor of the job's size)");
  return static_cast<int>(*m);
}
}  // namespace detail

inline environment detect() {
  environment e;
  e.hardware_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (auto d = detail::env("LOCKSTEP_DEVICES")) e.devices = detail::parse_device_list(*d, "LOCKSTEP_DEVICES");
  e.launcher = detect_launcher();
#if defined(LOCKSTEP_WITH_CUDA)
  e.cuda_built = true;
  int n = 0;
  if (cudaError_t err = cudaGetDeviceCount(&n); err != cudaSuccess) {
    e.cuda_error = cudaGetErrorString(err);
    (void)cudaGetLastError();
    n = 0;
  }
  // Nothing here changes the current device, and nothing may set it: since CUDA 12,
  // cudaSetDevice makes a context (about half a GiB on an H100), so "restoring" device 0 put
  // one on GPU 0 in every process of a run(Auto) job, rank 1's, 2's and 3's included.
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    gpu_info g;
    g.id = i;
    g.name = prop.name;
    g.total_memory = prop.totalGlobalMem;
    g.cc_major = prop.major;
    g.cc_minor = prop.minor;
    g.multiprocessors = prop.multiProcessorCount;
    for (int j = 0; j < n; ++j) {
      int can = 0;
      if (i != j) (void)cudaDeviceCanAccessPeer(&can, i, j);
      g.peer_access.push_back(i == j || can != 0);
    }
    e.gpus.push_back(std::move(g));
  }
  (void)cudaGetLastError();
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess) e.nccl_version = v;
  if (e.devices)
    for (int d : *e.devices)
      if (d >= n)
        throw config_error("LOCKSTEP_DEVICES names GPU " + std::to_string(d) + ", but " + std::to_string(n) +
                           " GPU(s) are visible (ids 0.." + std::to_string(n - 1) +
                           "; CUDA_VISIBLE_DEVICES renumbers them)");
#endif
  if (auto n = detail::env_long("LOCKSTEP_CPU_RANKS")) {
    if (*n < 1 || *n > 4096)
      throw config_error("LOCKSTEP_CPU_RANKS=" + std::to_string(*n) +
                         " is out of range: give a number of CPU ranks from 1 to 4096");
    e.cpu_ranks = static_cast<int>(*n);
  }
  e.model_parallel = detail::model_parallel_from_env();
  return e;
}

enum class mode_kind { cpu_threads, local_gpus, gpu_processes, mpi_processes };

inline const char* name_of(mode_kind k) {
  switch (k) {
    case mode_kind::cpu_threads: return "cpu-threads";
    case mode_kind::local_gpus: return "local-gpus";
    case mode_kind::gpu_processes: return "gpu-processes";
    case mode_kind::mpi_processes: return "mpi-processes";
  }
  return "?";
}

//! The mode Auto runs, with the number of ranks and a one-line reason for logs.
struct plan {
  mode_kind kind = mode_kind::cpu_threads;
  int ranks = 1;
  std::vector<int> devices;  //!< local_gpus: one rank per listed device
  std::string reason;
};

//! gpus_usable / mpi_usable: whether the caller can run those modes (its code was compiled
//! with CUDA / MPI).
inline plan decide(const environment& e, bool gpus_usable = false, bool mpi_usable = false) {
  if (e.launcher) {
    const auto& l = *e.launcher;
    const std::string who =
        "rank " + std::to_string(l.rank) + " of " + std::to_string(l.world) + " (" + l.launcher + ")";
    if (gpus_usable && !e.gpus.empty() && !e.cpu_ranks)
      return {mode_kind::gpu_processes, l.world, {}, who + ": one process per GPU"};
    if (mpi_usable && (l.launcher == "openmpi" || l.launcher == "mpich" || l.launcher == "slurm"))
      return {mode_kind::mpi_processes, l.world, {}, who + ": one CPU process per rank over MPI"};
    throw config_error(
        "this process was started by " + l.launcher + " as " + who +
        ", but this build cannot run one process per rank here: " +
        (e.gpus.empty() ? std::string("no GPU is visible") : std::string("it was not compiled with CUDA")) +
        (mpi_usable ? " and it was not launched by mpirun/srun" : " and has no MPI (lockstep::mpi)") +
        ". Run CPU ranks as threads (unset the launcher variables, or use Threads{})");
  }
  if (gpus_usable && !e.gpus.empty() && !e.cpu_ranks) {
    plan p{mode_kind::local_gpus, 0, {}, {}};
    if (e.devices) {
      p.devices = *e.devices;
      p.reason = "GPUs from LOCKSTEP_DEVICES";
    } else {
      for (const auto& g : e.gpus) p.devices.push_back(g.id);
      p.reason = e.gpus.size() == 1 ? "the one visible GPU" : "all visible GPUs";
    }
    p.ranks = static_cast<int>(p.devices.size());
    p.reason = std::to_string(p.ranks) + " GPU rank(s): " + p.reason;
    return p;
  }
  if (e.cpu_ranks)
    return {mode_kind::cpu_threads, *e.cpu_ranks, {}, std::to_string(*e.cpu_ranks) + " CPU ranks (LOCKSTEP_CPU_RANKS)"};
  return {mode_kind::cpu_threads,
          e.hardware_threads,
          {},
          std::to_string(e.hardware_threads) + " CPU ranks (one per hardware thread" +
              std::string(e.gpus.empty() ? ", no GPU visible" : "") + ")"};
}

}  // namespace lockstep
