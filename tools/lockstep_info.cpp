// lockstep-info — checks this machine's setup for lockstep: CPU threads, each GPU (memory,
// compute capability, SMs), which GPUs reach each other directly, the NCCL version, and a
// small all-reduce across every GPU (or CPU ranks without CUDA) whose result is checked.
// Exit code 0 when everything works; otherwise 1 and a plain-language reason.
//
//   lockstep-info            # all visible GPUs
//   LOCKSTEP_DEVICES=0,1 lockstep-info
//   lockstep-info --version  # "lockstep 0.2.0"
//
// With --estimate it measures the all-reduce time curve across the visible GPUs (NCCL) or CPU
// ranks (ThreadComm), or reads a saved probe, and predicts the step time, speed-up and scaling
// efficiency on 1..G GPUs without overlap, with overlap and sharded (observe/estimate.hpp,
// docs/observe.md "Speed-up estimate"). Bad arguments: exit code 2 and what to give.
//
//   lockstep-info --estimate --params 124439808 --dtype bf16 --step-ms 27.7 [--save-probe p.txt]
//   lockstep-info --estimate --params 124439808 --dtype bf16 --step-ms 27.7 --probe p.txt --gpus 8
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <mutex>
#include <cstdio>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <lockstep/lockstep.hpp>
#include <lockstep/observe/estimate.hpp>
#include <lockstep/observe/gpu_monitor.hpp>
#if defined(LOCKSTEP_WITH_CUDA) && defined(__CUDACC__)
#include <lockstep/cuda/run_gpus.cuh>
#endif

namespace {

// Each rank contributes (rank+1)·(i+1) at index i; the sum is (i+1)·n(n+1)/2 exactly in f32.
template <class Ctx>
bool check_all_reduce(Ctx& ctx, std::string& why, std::string& symmetric) {
  constexpr std::size_t n = 1 << 20;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>((ctx.rank() + 1) * ((i % 1000) + 1));
  auto mem = ctx.comm().memory();
  std::shared_ptr<void> buf;
  // Where the communicator has symmetric windows (NcclComm), the all-reduce runs in one: the
  // path lockstep's gradient buckets take (BucketPolicy::symmetric_memory).
  if constexpr (requires { ctx.comm().allocate_symmetric(n); }) {
    auto [p, in_window] = ctx.comm().allocate_symmetric(n * sizeof(float));
    buf = std::move(p);
    const auto [used, reason] = ctx.comm().symmetric_kernels();
    symmetric = std::string(used && in_window ? "used" : "not used") + " (" + reason + ")";
  } else {
    buf = mem.allocate(n * sizeof(float));
  }
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

// ---- --estimate -------------------------------------------------------------------------

constexpr const char* estimate_usage =
    "usage: lockstep-info                      check this machine's setup\n"
    "       lockstep-info --estimate (--params N | --shapes FILE) [options]\n"
    "  --params N               gradient elements (parameters that train)\n"
    "  --shapes FILE            tensor shapes instead, one per line: name dim dim ... (registration order)\n"
    "  --late NAME[,NAME]       tensors of --shapes final only at the end of backward (a tied embedding)\n"
    "  --dtype f32|bf16|f16     gradient element type (default f32)\n"
    "  --step-ms T              one training step on one GPU, in ms (without it: communication only)\n"
    "  --backward-fraction F    share of the step that is backward, in (0, 1] (default 0.667)\n"
    "  --optimizer-ms O         the optimizer's part of the step, in ms (default 0)\n"
    "  --bucket-mib C           bucket cap in MiB (default 25); --first-bucket-mib (default 1)\n"
    "  --gpus G                 estimate for 1..G GPUs (default: the most ranks measured or probed)\n"
    "  --probe FILE             read the all-reduce curve from FILE instead of measuring\n"
    "  --save-probe FILE        write the measured curve to FILE\n";

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct estimate_options {
  std::optional<std::uint64_t> params;
  std::string shapes, late, probe_in, probe_out;
  lockstep::dtype type = lockstep::dtype::f32;
  std::optional<double> step_ms;
  double backward_fraction = 2.0 / 3.0, optimizer_ms = 0, bucket_mib = 25, first_bucket_mib = 1;
  std::optional<int> gpus;
};

double number_of(const std::string& flag, const std::string& v, const char* what) {
  std::size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::logic_error&) {
    used = 0;
  }
  if (used == 0 || used != v.size() || !std::isfinite(x))
    throw usage_error(flag + " needs " + what + ", got '" + v + "'");
  return x;
}

estimate_options parse_estimate(int argc, char** argv) {
  estimate_options o;
  bool estimate = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], v;
    if (a == "--estimate") {
      estimate = true;
      continue;
    }
    if (a == "--help" || a == "-h") throw usage_error("");
    if (a.rfind("--", 0) != 0) throw usage_error("unexpected argument '" + a + "'; flags start with --");
    if (const auto eq = a.find('='); eq != std::string::npos) v = a.substr(eq + 1), a = a.substr(0, eq);
    else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) v = argv[++i];
    else throw usage_error(a + " needs a value (see lockstep-info --help)");
    const auto positive = [&](const char* what) {
      const double x = number_of(a, v, what);
      if (!(x > 0)) throw usage_error(a + " needs " + what + ", got '" + v + "'");
      return x;
    };
    if (a == "--params") {
      const double x = positive("a positive whole number of gradient elements, e.g. --params 124439808");
      if (x != std::floor(x) || x > 1e15)
        throw usage_error("--params needs a whole number of gradient elements, got '" + v + "'");
      o.params = static_cast<std::uint64_t>(x);
    } else if (a == "--dtype") {
      if (v == "f32" || v == "fp32") o.type = lockstep::dtype::f32;
      else if (v == "bf16") o.type = lockstep::dtype::bf16;
      else if (v == "f16" || v == "fp16") o.type = lockstep::dtype::f16;
      else throw usage_error("--dtype needs f32, bf16 or f16 (the gradients' element type), got '" + v + "'");
    } else if (a == "--step-ms") {
      o.step_ms = positive("the 1-GPU step time in milliseconds (> 0), e.g. --step-ms 27.7");
    } else if (a == "--backward-fraction") {
      o.backward_fraction = positive("the share of the step spent in backward, in (0, 1], e.g. 0.667");
      if (o.backward_fraction > 1) throw usage_error("--backward-fraction needs a share in (0, 1], got '" + v + "'");
    } else if (a == "--optimizer-ms") {
      o.optimizer_ms = number_of(a, v, "the optimizer's time in milliseconds (≥ 0)");
      if (o.optimizer_ms < 0) throw usage_error("--optimizer-ms needs a time ≥ 0 in milliseconds, got '" + v + "'");
    } else if (a == "--bucket-mib") {
      o.bucket_mib = positive("the bucket cap in MiB (> 0), e.g. 25");
    } else if (a == "--first-bucket-mib") {
      o.first_bucket_mib = positive("the first bucket's cap in MiB (> 0), e.g. 1");
    } else if (a == "--gpus") {
      const double x = positive("a whole number of GPUs ≥ 1, e.g. --gpus 8");
      const bool whole = x == std::floor(x) && x <= 4096;
      if (!whole) throw usage_error("--gpus needs a whole number of GPUs ≥ 1, got '" + v + "'");
      o.gpus = static_cast<int>(x);
    } else if (a == "--probe") {
      o.probe_in = v;
    } else if (a == "--save-probe") {
      o.probe_out = v;
    } else if (a == "--shapes") {
      o.shapes = v;
    } else if (a == "--late") {
      o.late = v;
    } else {
      throw usage_error("unknown flag " + a + " (see lockstep-info --help)");
    }
  }
  if (!estimate) throw usage_error("lockstep-info takes no arguments (the setup check), or --estimate and its flags");
  if (!o.params && o.shapes.empty())
    throw usage_error("--estimate needs --params N (the number of gradient elements) or --shapes FILE");
  if (!o.late.empty() && o.shapes.empty())
    throw usage_error("--late names tensors of --shapes FILE; give --shapes too");
  if (!o.probe_in.empty() && !o.probe_out.empty())
    throw usage_error(
        "--save-probe writes a measurement, and with --probe nothing is measured (copy the file instead)");
  if (o.step_ms && o.backward_fraction * *o.step_ms + o.optimizer_ms > *o.step_ms)
    throw usage_error("--optimizer-ms plus the backward (--backward-fraction × --step-ms) exceed --step-ms");
  return o;
}

// One rank count: every rank measures, rank 0's copy (all are the same) is kept.
template <class Mode>
void measure_ranks(Mode mode, const std::vector<std::uint64_t>& sizes, lockstep::dtype t,
                   std::vector<lockstep::probe_point>& out) {
  std::mutex m;
  lockstep::run(mode, [&](auto& ctx) {
    auto pts = lockstep::measure_all_reduce(ctx.comm(), std::span<const std::uint64_t>(sizes), t);
    std::lock_guard lk(m);
    if (ctx.rank() == 0) out.insert(out.end(), pts.begin(), pts.end());
  });
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", std::localtime(&now));
  return buf;
}

// Measures 2..most ranks: GPUs through NCCL when this build drives GPUs and some are visible,
// CPU ranks through ThreadComm otherwise.
lockstep::probe measure_probe(const estimate_options& o) {
  const auto env = lockstep::detect();
  if (env.launcher)
    throw lockstep::config_error("lockstep-info --estimate was started by " + env.launcher->launcher +
                                 "; run it as one plain process: it drives the local GPUs itself");
  lockstep::probe p;
  p.notes.push_back(std::string("measured by lockstep-info --estimate (lockstep ") + lockstep::version_string +
                    ") on " + today());
  const auto mib = [](std::uint64_t n) { return n << 20; };
#if LOCKSTEP_AUTO_HAS_GPUS
  if (!env.gpus.empty() && !env.cpu_ranks) {
    std::vector<int> devices;
    if (env.devices) devices = *env.devices;
    else
      for (const auto& g : env.gpus) devices.push_back(g.id);
    const int most = std::min<int>(static_cast<int>(devices.size()), o.gpus.value_or(1 << 20));
    if (most < 2)
      throw lockstep::config_error(
          std::to_string(most) + " GPU(s) to measure on (of " + std::to_string(devices.size()) +
          " to use): an all-reduce across GPUs needs two; give --gpus 2 or more, or --probe FILE " +
          "measured on a machine with several GPUs");
    std::string name = env.gpus.front().name;
    for (const auto& g : env.gpus)
      if (g.id == devices.front()) name = g.name;
    p.notes.push_back(
        "device: " + std::to_string(most) + " x " + name + ", NCCL " + std::to_string(env.nccl_version / 10000) + "." +
        std::to_string((env.nccl_version / 100) % 100) + "." + std::to_string(env.nccl_version % 100) +
        ", NCCL_NVLS_ENABLE=" + (std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "(unset)"));
    p.notes.push_back(
        std::string("NCCL all-reduce (avg, ") + lockstep::name_of(o.type) +
        ") on the first 2..N GPUs listed; host clock, batches between barriers, median of 7, slowest rank");
    const std::vector<std::uint64_t> sizes{mib(1), mib(4), mib(16), mib(64), mib(256), mib(1024)};
    for (int g = 2; g <= most; ++g) {
      std::printf("measuring the all-reduce on %d GPUs...\n", g);
      std::fflush(stdout);
      measure_ranks(lockstep::Gpus{std::vector<int>(devices.begin(), devices.begin() + g)}, sizes, o.type, p.points);
    }
    return p;
  }
#endif
  const int most = std::max(2, o.gpus.value_or(env.cpu_ranks.value_or(std::min(env.hardware_threads, 4))));
  p.notes.push_back("device: CPU ranks as threads (ThreadComm), " + std::to_string(env.hardware_threads) +
                    " hardware threads: host memory, not a GPU interconnect");
  p.notes.push_back(std::string("ThreadComm all-reduce (avg, ") + lockstep::name_of(o.type) +
                    "); host clock, batches between barriers, median of 7, slowest rank");
  const std::vector<std::uint64_t> sizes{std::uint64_t{64} << 10, std::uint64_t{256} << 10, mib(1), mib(4), mib(16)};
  for (int g = 2; g <= most; ++g) {
    std::printf("measuring the all-reduce on %d CPU ranks...\n", g);
    std::fflush(stdout);
    measure_ranks(lockstep::Threads{g}, sizes, o.type, p.points);
  }
  return p;
}

int estimate_main(int argc, char** argv) {
  estimate_options o;
  try {
    o = parse_estimate(argc, argv);
  } catch (const usage_error& e) {
    if (std::string(e.what()).empty()) {
      std::printf("%s", estimate_usage);
      return 0;
    }
    std::fprintf(stderr, "lockstep-info: %s\n\n%s", e.what(), estimate_usage);
    return 2;
  }
  try {
    lockstep::estimate_input in;
    in.element_bytes = lockstep::size_of(o.type);
    if (!o.shapes.empty()) {
      std::ifstream f(o.shapes);
      if (!f) throw usage_error("--shapes " + o.shapes + ": cannot open it (give a file of lines: name dim dim ...)");
      try {
        in.tensors = lockstep::parse_shapes(f, o.shapes, in.element_bytes);
      } catch (const lockstep::config_error& e) {
        throw usage_error(std::string("--shapes: ") + e.what());
      }
      std::stringstream names(o.late);
      for (std::string name; std::getline(names, name, ',');) {
        auto it = std::find_if(in.tensors.begin(), in.tensors.end(), [&](const auto& t) { return t.name == name; });
        if (it == in.tensors.end()) throw usage_error("--late " + name + ": no tensor of that name in " + o.shapes);
        it->late = true;
      }
      if (o.params && *o.params * in.element_bytes != in.gradient_bytes())
        throw usage_error("--params " + std::to_string(*o.params) + " disagrees with --shapes " + o.shapes + " (" +
                          std::to_string(in.gradient_bytes() / in.element_bytes) + " elements); give one of them");
    } else {
      in.params = *o.params;
    }
    in.step_seconds = o.step_ms.value_or(0) / 1e3;
    in.backward_fraction = o.backward_fraction;
    in.optimizer_seconds = o.optimizer_ms / 1e3;
    in.bucket_bytes = static_cast<std::uint64_t>(o.bucket_mib * 1048576.0);
    in.first_bucket_bytes = static_cast<std::uint64_t>(o.first_bucket_mib * 1048576.0);

    std::optional<lockstep::probe> read;
    if (!o.probe_in.empty()) {
      try {
        read = lockstep::read_probe(o.probe_in);
        lockstep::comm_curve check(*read);
      } catch (const lockstep::config_error& e) {
        throw usage_error(std::string("--probe: ") + e.what());
      }
    }
    std::printf("lockstep %s — speed-up estimate\n", lockstep::version_string);
    const lockstep::probe p = read ? *read : measure_probe(o);
    if (!o.probe_out.empty()) {
      std::ofstream f(o.probe_out);
      if (f) lockstep::write_probe(f, p);
      if (!f) throw lockstep::config_error("cannot write the probe to " + o.probe_out + " (give a writable path)");
      std::printf("probe written to %s\n", o.probe_out.c_str());
    }
    std::printf("probe (%s):\n", o.probe_in.empty() ? "measured now" : o.probe_in.c_str());
    for (const auto& n : p.notes) std::printf("  # %s\n", n.c_str());
    for (const auto& pt : p.points)
      std::printf("  all-reduce %d ranks %10.3f MiB %9.4f ms  bus bandwidth %7.1f GB/s\n", pt.ranks,
                  pt.bytes / 1048576.0, pt.seconds * 1e3,
                  pt.bytes * lockstep::comm_curve::bus_factor(pt.ranks) / pt.seconds / 1e9);
    const lockstep::comm_curve curve(p);
    const auto probed = curve.ranks_probed();
    for (int r : probed)
      std::printf("  fit on %d ranks: latency %.1f us, bus bandwidth %.1f GB/s (probed %.4g to %.4g MB)\n", r,
                  curve.latency(r) * 1e6, curve.bus_bandwidth(r) / 1e9, curve.smallest_bytes(r) / 1e6,
                  curve.largest_bytes(r) / 1e6);
    const int most = o.gpus.value_or(probed.back());
    const double S = static_cast<double>(in.gradient_bytes());
    const auto units = lockstep::launch_units(in);
    std::printf("gradients: %llu elements x %zu bytes (%s) = %.1f MB; buckets %.3g MiB then %.3g MiB: %zu all-reduce "
                "launches\n",
                static_cast<unsigned long long>(in.gradient_bytes() / in.element_bytes), in.element_bytes,
                lockstep::name_of(o.type), S / 1e6, o.first_bucket_mib, o.bucket_mib, units.size());
    // Say where the curve is extrapolated: rank counts not probed, sizes below the probe.
    std::string unprobed;
    std::vector<int> used;
    for (int g = 2; g <= most; ++g) {
      if (curve.probed_ranks(g) != g) unprobed += (unprobed.empty() ? "" : ", ") + std::to_string(g);
      if (std::find(used.begin(), used.end(), curve.probed_ranks(g)) == used.end())
        used.push_back(curve.probed_ranks(g));
    }
    if (!unprobed.empty())
      std::printf("note: %s GPUs not probed: the nearest probed rank count's curve is used, at its bus bandwidth\n",
                  unprobed.c_str());
    for (int r : used) {
      std::size_t below = 0;
      for (const auto& u : units) below += static_cast<double>(u.bytes) < curve.smallest_bytes(r);
      if (below > 0)
        std::printf(
            "note: %zu of %zu launches are smaller than the smallest size probed on %d ranks (%.3g MB): their "
            "time rests on the fitted latency (%.1f us); a probe measured on GPUs by --estimate starts at 1 MiB\n",
            below, units.size(), r, curve.smallest_bytes(r) / 1e6, curve.latency(r) * 1e6);
    }
    if (!o.step_ms) {
      std::printf(
          "\n GPUs | one all-reduce of the gradients ms | bucket by bucket ms | reduce-scatter + all-gather ms\n");
      for (int g = 2; g <= most; ++g) {
        double buckets = 0, sharded = 0;
        for (const auto& u : units) {
          buckets += curve.all_reduce(g, static_cast<double>(u.bytes));
          sharded += 2 * curve.reduce_scatter(g, static_cast<double>(u.bytes));
        }
        std::printf(" %4d | %34.3f | %18.3f | %30.3f\n", g, curve.all_reduce(g, S) * 1e3, buckets * 1e3, sharded * 1e3);
      }
      std::printf("give --step-ms T (one step on one GPU) for step times, speed-up and scaling efficiency\n");
      return 0;
    }
    std::printf(
        "model: 1-GPU step %.3f ms, backward %.1f %%, optimizer %.3f ms (docs/observe.md, \"Speed-up estimate\")\n",
        *o.step_ms, 100 * o.backward_fraction, o.optimizer_ms);
    std::printf("speed-up = G x T / step (per-GPU batch fixed); efficiency = T / step\n\n");
    std::printf(" GPUs | no overlap: step ms  speed-up  efficiency | overlap: step ms  speed-up  efficiency | "
                "sharded: step ms  speed-up  efficiency\n");
    for (const auto& r : lockstep::estimate(in, curve, most)) {
      std::printf(" %4d", r.gpus);
      for (const auto* m : {&r.no_overlap, &r.overlap, &r.sharded})
        std::printf(" | %*.3f %9.2f %9.1f %%", m == &r.no_overlap ? 19 : 16, m->step_seconds * 1e3, m->speedup,
                    100 * m->efficiency);
      std::printf("\n");
    }
    return 0;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "lockstep-info: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--version") {
    std::printf("lockstep %s\n", lockstep::version_string);
    return 0;
  }
  if (argc > 1) return estimate_main(argc, argv);
  try {
    const auto env = lockstep::detect();
    std::printf("lockstep %s\n", lockstep::version_string);
    std::printf("CPU: %d hardware threads%s\n", env.hardware_threads,
                env.cpu_ranks ? (" (LOCKSTEP_CPU_RANKS=" + std::to_string(*env.cpu_ranks) + ")").c_str() : "");
    if (!env.cuda_built) {
      std::printf("CUDA: not built in (configure with -DLOCKSTEP_ENABLE_CUDA=ON for GPUs)\n");
    } else {
      std::printf("NCCL: %d.%d.%d\n", env.nccl_version / 10000, (env.nccl_version / 100) % 100, env.nccl_version % 100);
      if (env.gpus.empty()) {
        const std::string why = env.cuda_error.empty() ? "" : " — CUDA says: " + env.cuda_error;
        std::printf("GPUs: none visible%s\n", why.c_str());
      }
      for (const auto& g : env.gpus)
        std::printf("GPU %d: %s, %.1f GiB, compute capability %d.%d, %d SMs\n", g.id, g.name.c_str(),
                    g.total_memory / 1073741824.0, g.cc_major, g.cc_minor, g.multiprocessors);
      // Utilisation, memory, temperature and power now, through NVML (observe/gpu_monitor.hpp).
      if (!env.gpus.empty()) std::fputs(lockstep::describe_gpus_now().c_str(), stdout);
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
    std::string symmetric;
    std::mutex m;
    lockstep::run(lockstep::Auto{}, [&](auto& ctx) {
      std::string why, sym;
      const bool ok = check_all_reduce(ctx, why, sym);
      if (ctx.rank() == 0) symmetric = sym;
      if (!ok) {
        std::lock_guard lk(m);
        failures.push_back(why);
      }
    });
    if (!failures.empty()) {
      std::printf("FAILED: the all-reduce across %d rank(s) gave a wrong result: %s\n", plan.ranks,
                  failures[0].c_str());
      std::printf("Check the GPU driver and NCCL (NCCL_DEBUG=INFO lockstep-info shows NCCL's view).\n");
      return 1;
    }
    if (!symmetric.empty()) std::printf("NCCL symmetric kernels for gradient buckets: %s\n", symmetric.c_str());
    std::printf("OK: a 4 MiB all-reduce across %d rank(s) gave the exact result\n", plan.ranks);
    return 0;
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    std::printf("lockstep cannot run here as configured; the message above says what failed.\n");
    return 1;
  }
}
