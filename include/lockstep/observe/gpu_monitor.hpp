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

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/observe/gpu_sampler.hpp"
#include "lockstep/observe/scalars.hpp"

namespace lockstep {

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
    else
      out += num(static_cast<double>(s.mem_used_bytes) / gib, "%.1f") + "/" +
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
  bool start = true;           //!< start sampling at construction (else call start())
  bool require = false;        //!< throw config_error at construction when unavailable
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
    line.insert(line.find(' '),
                (g.name.empty() ? "" : " " + g.name) + (g.pci_bus_id.empty() ? "" : " [" + g.pci_bus_id + "]") + ":");
    out += line + "\n";
  }
  return out;
}

}  // namespace lockstep
