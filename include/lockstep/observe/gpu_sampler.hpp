#pragma once
//! Where lockstep::GpuMonitor's readings come from: gpu_sample (one reading of one GPU), the
//! GpuSampler interface (tests inject fakes) and NvmlSampler, which reads real GPUs through
//! NVML loaded at run time (dlopen of libnvidia-ml.so.1): no NVML header or library is needed
//! to build.

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/observe/detail/nvml_api.hpp"
#include "lockstep/observe/scalars.hpp"  // detail::wall_seconds

namespace lockstep {

//! One reading of one GPU. A value the GPU does not report (power on some boards,
//! utilisation under MIG) is NaN, or 0 for the memory sizes.
struct gpu_sample {
  int device = 0;                                              //!< the label: NVML index, or position in pci_bus_ids
  std::string name;                                            //!< e.g. "NVIDIA H100 80GB HBM3" ("" when not reported)
  std::string pci_bus_id;                                      //!< e.g. "00000000:18:00.0" ("" when not reported)
  double util_pct = std::numeric_limits<double>::quiet_NaN();  //!< kernel time share, 0..100
  double mem_util_pct = std::numeric_limits<double>::quiet_NaN();  //!< memory-controller busy share
  std::uint64_t mem_used_bytes = 0;
  std::uint64_t mem_total_bytes = 0;
  double temp_c = std::numeric_limits<double>::quiet_NaN();   //!< GPU die, °C
  double power_w = std::numeric_limits<double>::quiet_NaN();  //!< board power draw, W
  double wall_time = 0;                                       //!< when it was read: seconds since the Unix epoch
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

}  // namespace lockstep
