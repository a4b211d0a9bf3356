#pragma once
//! Progress lines for long phases (docs/observe.md, "Progress on long phases"): the start-up
//! rendezvous (which ranks are still missing) and saving or loading a large checkpoint. A
//! phase that ends quickly prints nothing; one that runs long prints its first line after
//! `first`, then at most one per `every`, and a closing line with the total once it printed
//! any. LOCKSTEP_PROGRESS=0 turns every such line off.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

//! When and where a long phase reports. Unset intervals take the phase's own defaults (the
//! rendezvous: first after 5 s, then every 10 s; a checkpoint save or load: 2 s, then 5 s).
struct progress_options {
  bool enabled = true;                               //!< false (or LOCKSTEP_PROGRESS=0): no lines
  std::optional<std::chrono::milliseconds> first{};  //!< the first line once the phase ran this long
  std::optional<std::chrono::milliseconds> every{};  //!< then at most one line per this
  std::function<void(std::string_view)> sink{};      //!< each line, without '\n'; empty: stderr
};

namespace detail {

//! LOCKSTEP_PROGRESS: unset or 1 lets progress lines through, 0 turns them off.
inline bool progress_allowed_by_env() {
  const auto v = env("LOCKSTEP_PROGRESS");
  if (!v || *v == "1") return true;
  if (*v == "0") return false;
  throw config_error("LOCKSTEP_PROGRESS='" + *v +
                     "' is neither 0 nor 1; set LOCKSTEP_PROGRESS=0 to silence the progress lines of long "
                     "phases (rendezvous, checkpoint save and load), or unset it");
}

//! "812 MB", "4.25 GB", "17 kB": decimal units, three significant digits at most.
inline std::string bytes_text(double bytes) {
  static constexpr const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  int u = 0;
  while (bytes >= 1000.0 && u < 5) {
    bytes /= 1000.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf,
                bytes < 10.0 && u > 0    ? "%.2f %s"
                : bytes < 100.0 && u > 0 ? "%.1f %s"
                                         : "%.0f %s",
                bytes, units[u]);
  return buf;
}

//! "15 s", "2.4 s", "0.31 s".
inline std::string duration_text(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, seconds >= 10.0 ? "%.0f s" : seconds >= 1.0 ? "%.1f s" : "%.2f s", seconds);
  return buf;
}

//! "812 MB of 4.00 GB (20 %), 410 MB/s" — a transfer under way.
inline std::string transfer_text(std::uint64_t done, std::uint64_t total, double seconds) {
  const double pct = total == 0 ? 100.0 : 100.0 * static_cast<double>(done) / static_cast<double>(total);
  char buf[32];
  std::snprintf(buf, sizeof buf, " (%.0f %%), ", pct);
  return bytes_text(static_cast<double>(done)) + " of " + bytes_text(static_cast<double>(total)) + buf +
         bytes_text(seconds > 0 ? static_cast<double>(done) / seconds : 0.0) + "/s";
}

//! "4.00 GB in 9.8 s (408 MB/s)" — a transfer done.
inline std::string transfer_done_text(std::uint64_t total, double seconds) {
  return bytes_text(static_cast<double>(total)) + " in " + duration_text(seconds) + " (" +
         bytes_text(seconds > 0 ? static_cast<double>(total) / seconds : 0.0) + "/s)";
}

//! Throttles one phase's progress lines. due() is cheap (a clock read), so a loop may ask
//! after every chunk; report() writes a line and schedules the next one `every` later;
//! finish() writes its line only when the phase reported before, so a fast phase is silent.
//! The clock can be injected (tests).
class progress {
 public:
  using clock = std::chrono::steady_clock;
  using now_fn = std::function<clock::time_point()>;

  //! first/every: the phase's defaults, for what `opt` leaves unset. Reads LOCKSTEP_PROGRESS
  //! (a malformed value is a config_error).
  progress(const progress_options& opt, std::chrono::milliseconds first, std::chrono::milliseconds every,
           now_fn now = {})
      : enabled_(opt.enabled && progress_allowed_by_env()), every_(opt.every.value_or(every)), sink_(opt.sink),
        now_(std::move(now)) {
    const auto f = opt.first.value_or(first);
    if (f.count() < 0 || every_.count() <= 0)
      throw config_error("progress_options: first must not be negative and every must be positive (got first " +
                         std::to_string(f.count()) + " ms, every " + std::to_string(every_.count()) + " ms)");
    start_ = read_clock();
    next_ = start_ + f;
  }

  bool enabled() const noexcept { return enabled_; }
  //! Whether a line is due now (never when disabled).
  bool due() const { return enabled_ && read_clock() >= next_; }
  //! When the next line is due (for a caller that sleeps until then).
  clock::time_point next_due() const noexcept { return next_; }
  //! Seconds since the phase began.
  double seconds() const { return std::chrono::duration<double>(read_clock() - start_).count(); }
  //! Whether any line was written.
  bool reported() const noexcept { return reported_; }

  //! Writes `line` and schedules the next one `every` from now.
  void report(std::string_view line) {
    if (!enabled_) return;
    emit(line);
    reported_ = true;
    next_ = read_clock() + every_;
  }
  //! The closing line: written only when the phase reported before.
  void finish(std::string_view line) {
    if (reported_) emit(line);
  }

 private:
  clock::time_point read_clock() const { return now_ ? now_() : clock::now(); }
  void emit(std::string_view line) {
    if (sink_) {
      sink_(line);
      return;
    }
    std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    std::fflush(stderr);
  }

  bool enabled_;
  std::chrono::milliseconds every_;
  std::function<void(std::string_view)> sink_;
  now_fn now_;
  clock::time_point start_{}, next_{};
  bool reported_ = false;
};

}  // namespace detail
}  // namespace lockstep
