#pragma once
//! lockstep::GpuMonitor — a background thread that reads each GPU's utilisation, memory,
//! temperature and power every `period` (1 s), through NVML loaded at run time (dlopen of
//! libnvidia-ml.so.1): no NVML header or library is needed to build, and where NVML is absent
//! the monitor says so (available() == false, unavailable_reason()) and does nothing.
//!
//! \code
//!   lockstep::GpuMonitor mon;                      // starts sampling, or says why it cannot
//!   std::printf("%s\n", mon.summary().c_str());    // GPU0 97% 61.2/79.6 GiB 64°C 512 W | ...
//!   mon.log(log, step);                            // gpu0/util, gpu0/mem_used_gib, ... to a ScalarLog
//! \endcode
//!
//! Which GPUs: NVML numbers every physical GPU of the host, ignoring CUDA_VISIBLE_DEVICES and
//! CUDA_DEVICE_ORDER, so NVML index i is not CUDA device i in general. By default the monitor
//! reads every GPU NVML sees and labels it with its NVML index; give `pci_bus_ids` (from
//! cudaDeviceGetPCIBusId, one per CUDA device you use) to read exactly those GPUs, labelled by
//! their position in the list — pass CUDA devices 0..n-1 in order and labels are CUDA ids.
//!
//! Errors on the monitor's thread (a sampler or on_sample that throws) never end the process:
//! the first is kept and rethrown by rethrow_error() on the caller's thread, each is counted
//! (errors()), the last is described by last_error(), the first is printed to stderr once,
//! and sampling goes on at the next period.

#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/observe/scalars.hpp"

namespace lockstep {

//! One reading of one GPU. A value the GPU does not report (power on some boards,
//! utilisation under MIG) is NaN, or 0 for the memory sizes.
struct gpu_sample {
  int device = 0;                  //!< the label: NVML index, or position in pci_bus_ids
  std::string name;                //!< e.g. "NVIDIA H100 80GB HBM3" ("" when not reported)
  std::string pci_bus_id;          //!< e.g. "00000000:18:00.0" ("" when not reported)
  double util_pct = std::numeric_limits<double>::quiet_NaN();      //!< kernel time share, 0..100
  double mem_util_pct = std::numeric_limits<double>::quiet_NaN();  //!< memory-controller busy share
  std::uint64_t mem_used_bytes = 0;
  std::uint64_t mem_total_bytes = 0;
  double temp_c = std::numeric_limits<double>::quiet_NaN();   //!< GPU die, °C
  double power_w = std::numeric_limits<double>::quiet_NaN();  //!< board power draw, W
  double wall_time = 0;  //!< when it was read: seconds since the Unix epoch
};

//! Where a GpuMonitor's readings come from. NvmlSampler reads real GPUs; tests inject fakes.
class GpuSampler {
 public:
  virtual ~GpuSampler() = default;
  //! "" when sample() can be called; otherwise what is missing and what to do.
  virtual std::string unavailable_reason() const = 0;
  //! One reading of every monitored GPU. Called from the monitor's thread; may throw.
  virtual std::vector<gpu_sample> sample() = 0;
};

namespace detail {

// NVML's C ABI, declared here so no nvml.h is needed: nvmlReturn_t and the enums are ints,
// nvmlDevice_t an opaque pointer; the structs have NVML's documented layouts.
using nvml_return = int;
using nvml_device = struct nvml_device_opaque*;
struct nvml_utilization {
  unsigned int gpu, memory;
};
struct nvml_memory {
  unsigned long long total, free, used;
};
struct nvml_pci_info {  // nvmlPciInfo_t as nvmlDeviceGetPciInfo_v3 fills it
  char bus_id_legacy[16];
  unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
inline constexpr nvml_return nvml_success = 0;
inline constexpr int nvml_temperature_gpu = 0;

//! The NVML entry points lockstep calls, looked up with dlsym.
struct nvml_api {
  nvml_return (*init)() = nullptr;                                            // nvmlInit_v2
  nvml_return (*shutdown)() = nullptr;                                        // nvmlShutdown
  const char* (*error_string)(nvml_return) = nullptr;                         // nvmlErrorString
  nvml_return (*device_count)(unsigned int*) = nullptr;                       // nvmlDeviceGetCount_v2
  nvml_return (*by_index)(unsigned int, nvml_device*) = nullptr;              // nvmlDeviceGetHandleByIndex_v2
  nvml_return (*by_pci_bus_id)(const char*, nvml_device*) = nullptr;          // nvmlDeviceGetHandleByPciBusId_v2
  nvml_return (*utilization)(nvml_device, nvml_utilization*) = nullptr;       // nvmlDeviceGetUtilizationRates
  nvml_return (*memory)(nvml_device, nvml_memory*) = nullptr;                 // nvmlDeviceGetMemoryInfo
  nvml_return (*temperature)(nvml_device, int, unsigned int*) = nullptr;      // nvmlDeviceGetTemperature
  nvml_return (*power)(nvml_device, unsigned int*) = nullptr;                 // nvmlDeviceGetPowerUsage (mW)
  nvml_return (*name)(nvml_device, char*, unsigned int) = nullptr;            // nvmlDeviceGetName
  nvml_return (*pci_info)(nvml_device, nvml_pci_info*) = nullptr;             // nvmlDeviceGetPciInfo_v3
};

}  // namespace detail

//! GPU readings from NVML, loaded with dlopen: `library` if given, else libnvidia-ml.so.1,
//! then libnvidia-ml.so. A missing library, a missing symbol, a failed nvmlInit or an
//! unknown PCI bus id makes it unavailable (the reason says which); it never throws.
class NvmlSampler final : public GpuSampler {
 public:
  explicit NvmlSampler(std::vector<std::string> pci_bus_ids = {}, std::string library = {}) {
    if (!load(library)) return;
    if (const auto r = api_.init(); r != detail::nvml_success) {
      reason_ = "NVML did not start: nvmlInit_v2 returned " + text(r) +
                " (is the NVIDIA driver loaded? nvidia-smi reports the same problem)";
      return;
    }
    initialized_ = true;
    find_devices(pci_bus_ids);
  }
  NvmlSampler(const NvmlSampler&) = delete;
  NvmlSampler& operator=(const NvmlSampler&) = delete;
  ~NvmlSampler() override {
    if (initialized_) (void)api_.shutdown();
    if (lib_ != nullptr) dlclose(lib_);  // opened with RTLD_NODELETE: the driver library stays mapped
  }

  std::string unavailable_reason() const override { return reason_; }
  //! How many GPUs each sample() reads.
  std::size_t devices() const noexcept { return devices_.size(); }

  std::vector<gpu_sample> sample() override {
    std::vector<gpu_sample> out;
    if (!reason_.empty()) return out;
    const double now = detail::wall_seconds();
    for (const auto& d : devices_) {
      gpu_sample s;
      s.device = d.label;
      s.name = d.name;
      s.pci_bus_id = d.bus_id;
      s.wall_time = now;
      if (detail::nvml_utilization u{}; api_.utilization(d.handle, &u) == detail::nvml_success) {
        s.util_pct = u.gpu;
        s.mem_util_pct = u.memory;
      }
      if (detail::nvml_memory m{}; api_.memory(d.handle, &m) == detail::nvml_success) {
        s.mem_used_bytes = m.used;
        s.mem_total_bytes = m.total;
      }
      if (unsigned t = 0; api_.temperature(d.handle, detail::nvml_temperature_gpu, &t) == detail::nvml_success)
        s.temp_c = t;
      if (unsigned mw = 0; api_.power(d.handle, &mw) == detail::nvml_success) s.power_w = mw / 1000.0;
      out.push_back(std::move(s));
    }
    return out;
  }

 private:
  struct device {
    int label;
    detail::nvml_device handle;
    std::string name, bus_id;
  };

  std::string text(detail::nvml_return r) const {
    const char* s = api_.error_string != nullptr ? api_.error_string(r) : nullptr;
    return std::string(s != nullptr ? s : "an unknown error") + " (code " + std::to_string(r) + ")";
  }

  bool load(const std::string& library) {
    const std::vector<std::string> names =
        library.empty() ? std::vector<std::string>{"libnvidia-ml.so.1", "libnvidia-ml.so"} : std::vector{library};
    std::string tried;
    for (const auto& n : names) {
      lib_ = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
      if (lib_ != nullptr) {
        path_ = n;
        break;
      }
      const char* e = dlerror();
      tried += (tried.empty() ? "" : "; ") + (e != nullptr ? std::string(e) : n);
    }
    if (lib_ == nullptr) {
      reason_ = "NVML not found: " + tried +
                " (GPU monitoring needs the NVIDIA driver's libnvidia-ml.so.1: install the driver, or add its "
                "folder to LD_LIBRARY_PATH)";
      return false;
    }
    const auto need = [&](auto& fn, const char* symbol, bool required = true) {
      (void)dlerror();
      void* p = dlsym(lib_, symbol);
      if (p == nullptr && required && reason_.empty())
        reason_ = "NVML at '" + path_ + "' lacks " + symbol +
                  " (too old, or not NVIDIA's library: a driver of release 450 or newer has every function the "
                  "monitor uses)";
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    need(api_.init, "nvmlInit_v2");
    need(api_.shutdown, "nvmlShutdown");
    need(api_.error_string, "nvmlErrorString");
    need(api_.device_count, "nvmlDeviceGetCount_v2");
    need(api_.by_index, "nvmlDeviceGetHandleByIndex_v2");
    need(api_.by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2");
    need(api_.utilization, "nvmlDeviceGetUtilizationRates");
    need(api_.memory, "nvmlDeviceGetMemoryInfo");
    need(api_.temperature, "nvmlDeviceGetTemperature");
    need(api_.power, "nvmlDeviceGetPowerUsage");
    need(api_.name, "nvmlDeviceGetName", false);
    need(api_.pci_info, "nvmlDeviceGetPciInfo_v3", false);
    return reason_.empty();
  }

  void add(int label, detail::nvml_device h) {
    device d{label, h, {}, {}};
    char buf[128] = {};
    if (api_.name != nullptr && api_.name(h, buf, sizeof buf - 1) == detail::nvml_success) d.name = buf;
    struct {
      detail::nvml_pci_info info;
      char spare[64];  // room should a later NVML write more than the documented layout
    } pci{};
    if (api_.pci_info != nullptr && api_.pci_info(h, &pci.info) == detail::nvml_success) {
      pci.info.bus_id[sizeof pci.info.bus_id - 1] = '\0';
      d.bus_id = pci.info.bus_id;
    }
    devices_.push_back(std::move(d));
  }

  void find_devices(const std::vector<std::string>& pci_bus_ids) {
    if (!pci_bus_ids.empty()) {
      for (std::size_t i = 0; i < pci_bus_ids.size(); ++i) {
        detail::nvml_device h = nullptr;
        if (const auto r = api_.by_pci_bus_id(pci_bus_ids[i].c_str(), &h); r != detail::nvml_success) {
          reason_ = "NVML has no GPU at PCI bus id '" + pci_bus_ids[i] + "' (GpuMonitorOptions::pci_bus_ids[" +
                    std::to_string(i) + "]): " + text(r) +
                    " (give ids as cudaDeviceGetPCIBusId or nvidia-smi --query-gpu=pci.bus_id print them)";
          devices_.clear();
          return;
        }
        add(static_cast<int>(i), h);
      }
      return;
    }
    unsigned n = 0;
    if (const auto r = api_.device_count(&n); r != detail::nvml_success) {
      reason_ = "NVML could not count the GPUs: nvmlDeviceGetCount_v2 returned " + text(r);
      return;
    }
    std::string skipped;
    for (unsigned i = 0; i < n; ++i) {
      detail::nvml_device h = nullptr;
      // A GPU this process may not touch (a container's cgroup) is left out, not fatal.
      if (const auto r = api_.by_index(i, &h); r != detail::nvml_success) {
        skipped += " GPU" + std::to_string(i) + ": " + text(r) + ";";
        continue;
      }
      add(static_cast<int>(i), h);
    }
    if (devices_.empty())
      reason_ = "NVML sees no GPU it may read (" + std::to_string(n) + " counted;" + skipped +
                " nvidia-smi should list the GPUs of this machine)";
  }

  void* lib_ = nullptr;
  std::string path_;
  detail::nvml_api api_;
  bool initialized_ = false;
  std::string reason_;
  std::vector<device> devices_;
};

//! The samples as one line: "GPU0 97% 61.2/79.6 GiB 64°C 512 W | GPU1 ..."; a value a GPU
//! does not report is "?". "" for no samples.
inline std::string format_gpu_samples(const std::vector<gpu_sample>& samples) {
  std::string out;
  const auto num = [](double v, const char* fmt) {
    if (!std::isfinite(v)) return std::string("?");
    char b[32];
    std::snprintf(b, sizeof b, fmt, v);
    return std::string(b);
  };
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  for (const auto& s : samples) {
    if (!out.empty()) out += " | ";
    out += "GPU" + std::to_string(s.device) + " " + num(s.util_pct, "%.0f") + "% ";
    if (s.mem_total_bytes == 0) out += "?";
    else out += num(static_cast<double>(s.mem_used_bytes) / gib, "%.1f") + "/" +
                num(static_cast<double>(s.mem_total_bytes) / gib, "%.1f");
    out += " GiB " + num(s.temp_c, "%.0f") + "\u00b0C " + num(s.power_w, "%.0f") + " W";
  }
  return out;
}

//! Writes the samples at `step`: gpu<N>/util (%), gpu<N>/mem_used_gib, gpu<N>/temp_c,
//! gpu<N>/power_w, N the sample's device label. Values a GPU does not report are left out.
//! ScalarLog is not thread-safe: call this from the thread that owns the log (pass
//! GpuMonitor::latest()), not from on_sample.
inline void log_gpu_samples(ScalarLog& log, std::int64_t step, const std::vector<gpu_sample>& samples) {
  for (const auto& s : samples) {
    const std::string p = "gpu" + std::to_string(s.device) + "/";
    const auto put = [&](const char* what, double v) {
      if (std::isfinite(v)) log.scalar(p + what, step, v);
    };
    put("util", s.util_pct);
    if (s.mem_total_bytes != 0) put("mem_used_gib", static_cast<double>(s.mem_used_bytes) / (1024.0 * 1024.0 * 1024.0));
    put("temp_c", s.temp_c);
    put("power_w", s.power_w);
  }
}

struct GpuMonitorOptions {
  std::chrono::milliseconds period = std::chrono::seconds(1);  //!< between samples (> 0)
  //! Which GPUs (NvmlSampler): empty for all NVML sees, labelled by NVML index; else these, labelled 0, 1, ...
  std::vector<std::string> pci_bus_ids{};
  //! Called on the monitor's thread after each sample (keep it short; see the file comment for errors).
  std::function<void(const std::vector<gpu_sample>&)> on_sample{};
  bool start = true;        //!< start sampling at construction (else call start())
  bool require = false;     //!< throw config_error at construction when unavailable
  std::string nvml_library{};  //!< NVML's file; empty: libnvidia-ml.so.1, then libnvidia-ml.so
};

class GpuMonitor {
 public:
  using clock = std::chrono::steady_clock;

  //! Reads GPUs through NVML.
  explicit GpuMonitor(const GpuMonitorOptions& o = {})
      : GpuMonitor(std::make_unique<NvmlSampler>(o.pci_bus_ids, o.nvml_library), o) {}
  //! Reads through `sampler` (pci_bus_ids and nvml_library are then unused).
  GpuMonitor(std::unique_ptr<GpuSampler> sampler, GpuMonitorOptions o)
      : opt_(std::move(o)), sampler_(std::move(sampler)) {
    if (opt_.period.count() <= 0)
      throw config_error("GpuMonitor: period must be positive, got " + std::to_string(opt_.period.count()) +
                         " ms (the default is 1000)");
    reason_ = sampler_ ? sampler_->unavailable_reason() : "GpuMonitor: no sampler given";
    if (!reason_.empty() && opt_.require) throw config_error("GpuMonitor: " + reason_);
    if (opt_.start) start();
  }
  GpuMonitor(const GpuMonitor&) = delete;
  GpuMonitor& operator=(const GpuMonitor&) = delete;
  ~GpuMonitor() { stop(); }

  bool available() const noexcept { return reason_.empty(); }
  //! Why nothing is sampled ("" when available()).
  const std::string& unavailable_reason() const noexcept { return reason_; }

  //! Starts the thread: one sample at once, then one every period. A no-op when unavailable
  //! or already running. start() and stop() are called from one thread at a time.
  void start() {
    if (!available() || thread_.joinable()) return;
    set_stopping(false);
    thread_ = std::thread([this] { loop(); });
  }
  //! Stops and joins the thread; returns within a sample's time (the period wait is cut
  //! short). Idempotent; never throws.
  void stop() noexcept {
    set_stopping(true);
    cv_.notify_all();
    if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
  }
  bool running() const noexcept { return thread_.joinable(); }

  //! The last sample of each GPU (empty before the first).
  std::vector<gpu_sample> latest() const { return locked(latest_); }
  //! format_gpu_samples(latest()), for a progress line.
  std::string summary() const { return format_gpu_samples(latest()); }
  //! log_gpu_samples(log, step, latest()).
  void log(ScalarLog& log, std::int64_t step) const { log_gpu_samples(log, step, latest()); }

  std::uint64_t samples_taken() const { return locked(taken_); }
  //! How many times the sampler or on_sample threw, and what the last one said.
  std::uint64_t errors() const { return locked(errors_); }
  std::string last_error() const { return locked(last_error_); }
  //! Rethrows, on the caller's thread, the first exception of the monitor's thread (if any).
  void rethrow_error() const {
    if (auto e = locked(first_error_)) std::rethrow_exception(e);
  }

 private:
  template <class T>
  T locked(const T& member) const {
    std::lock_guard lk(m_);
    return member;
  }
  void set_stopping(bool v) noexcept {
    std::lock_guard lk(m_);
    stopping_ = v;
  }

  void loop() noexcept {
    auto next = clock::now();
    std::unique_lock lk(m_);
    while (!stopping_) {
      lk.unlock();
      take();
      lk.lock();
      next += opt_.period;
      const auto now = clock::now();
      if (next <= now) next = now + opt_.period;  // fell behind: no burst of catch-up samples
      cv_.wait_until(lk, next, [&] { return stopping_; });
    }
  }

  void take() noexcept {
    std::vector<gpu_sample> s;
    try {
      s = sampler_->sample();
    } catch (...) {
      failed("the GPU sampler", std::current_exception());
      return;
    }
    {
      std::lock_guard lk(m_);
      latest_ = s;
      ++taken_;
    }
    if (!opt_.on_sample) return;
    try {
      opt_.on_sample(s);
    } catch (...) {
      failed("GpuMonitorOptions::on_sample", std::current_exception());
    }
  }

  void failed(const char* who, std::exception_ptr e) noexcept {
    std::string what = "an exception not derived from std::exception";
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
    }
    bool first = false;
    try {
      std::lock_guard lk(m_);
      first = !first_error_;
      if (first) first_error_ = e;
      ++errors_;
      last_error_ = std::string(who) + " threw: " + what;
    } catch (...) {  // out of memory for the text: the count still says it happened
    }
    if (first)
      std::fprintf(stderr,
                   "lockstep: GPU monitor: %s threw: %s (sampling goes on; GpuMonitor::rethrow_error() raises it, "
                   "errors() counts them)\n",
                   who, what.c_str());
  }

  GpuMonitorOptions opt_;
  std::unique_ptr<GpuSampler> sampler_;
  std::string reason_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<gpu_sample> latest_;
  std::uint64_t taken_ = 0;
  std::uint64_t errors_ = 0;
  std::string last_error_;
  std::exception_ptr first_error_;
  std::thread thread_;
};

//! What lockstep-info prints: one line per GPU NVML sees, read now ("GPU0 NVIDIA H100 80GB
//! HBM3 [00000000:18:00.0]: 0% 0.5/79.6 GiB 31°C 69 W"), or one line saying why it cannot.
inline std::string describe_gpus_now(const std::string& nvml_library = {}) {
  NvmlSampler s({}, nvml_library);
  if (!s.unavailable_reason().empty()) return "GPU monitor: unavailable (" + s.unavailable_reason() + ")\n";
  std::string out;
  for (const auto& g : s.sample()) {
    std::string line = format_gpu_samples({g});
    line.insert(line.find(' '), (g.name.empty() ? "" : " " + g.name) +
                                    (g.pci_bus_id.empty() ? "" : " [" + g.pci_bus_id + "]") + ":");
    out += line + "\n";
  }
  return out;
}

}  // namespace lockstep
