#pragma once
//! A per-rank timeline of what lockstep does in a step, as Chrome-trace JSON (open it in
//! https://ui.perfetto.dev or chrome://tracing). Off unless LOCKSTEP_TRACE=<dir> is set; then
//! each DataParallel records, on the host clock: the step (step() to the end of finish()), the
//! model's forward and backward in between, every bucket collective from issue to completion
//! (as the host sees it: for a device communicator, until the compute stream is ordered after
//! it), the waits in finish(), unscaling and the inf/NaN check, clipping, each per-bucket
//! callback (the optimizer), and skipped steps; and writes <dir>/lockstep_trace.rank<R>.pid<P>.json
//! when it is destroyed (R: its rank in DataParallel's communicator, P: the process; a second
//! DataParallel of the same rank in one process — the parts of a mesh replica — adds .2, .3…).
//! Off, each record point costs one pointer test.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/observe/detail/nvtx.hpp"

namespace lockstep::detail {

class trace_log {
 public:
  //! Tracks (Chrome's "threads" of this rank's "process").
  enum track : int { host = 1, comm = 2, optimizer = 3 };
  using clock = std::chrono::steady_clock;

  //! From LOCKSTEP_TRACE: a log for this rank, or null when tracing is off.
  static std::unique_ptr<trace_log> from_env(int rank) {
    const auto dir = env("LOCKSTEP_TRACE");
    if (!dir || dir->empty()) return nullptr;
    return std::make_unique<trace_log>(std::filesystem::path(*dir), rank);
  }

  trace_log(std::filesystem::path dir, int rank) : dir_(std::move(dir)), rank_(rank), serial_(next_serial(rank)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (!std::filesystem::is_directory(dir_))
      throw config_error("LOCKSTEP_TRACE=" + dir_.string() + ": not a directory that can be made (" + ec.message() +
                         "); point it at a writable directory, or unset it to trace nothing");
  }
  trace_log(const trace_log&) = delete;
  trace_log& operator=(const trace_log&) = delete;
  ~trace_log() {
    try {
      write();
    } catch (...) {  // a destructor must not throw: the trace is lost, training is not
    }
  }

  clock::time_point now() const { return clock::now(); }

  //! A span [from, to) on a track, with an optional detail (shown as args.detail).
  void span(std::string name, track t, clock::time_point from, clock::time_point to, std::string detail = {}) {
    if (events_.size() >= max_events) return;
    events_.push_back({std::move(name), std::move(detail), us(from), us(to) - us(from), t, 'X'});
  }
  //! A moment on a track.
  void instant(std::string name, track t, std::string detail = {}) {
    if (events_.size() >= max_events) return;
    events_.push_back({std::move(name), std::move(detail), us(now()), 0, t, 'i'});
  }

  const std::filesystem::path& dir() const noexcept { return dir_; }
  std::filesystem::path file() const {
    return dir_ / ("lockstep_trace.rank" + std::to_string(rank_) + ".pid" + std::to_string(::getpid()) +
                   (serial_ > 1 ? "." + std::to_string(serial_) : "") + ".json");
  }

  //! Writes the JSON (again, whole, if called more than once).
  void write() const {
    std::ofstream out(file(), std::ios::trunc);
    if (!out) throw config_error("LOCKSTEP_TRACE: cannot write '" + file().string() + "'");
    out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    const char* names[] = {"", "host", "communication", "optimizer"};
    out << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << rank_ << ",\"args\":{\"name\":\"rank " << rank_
        << "\"}}";
    for (int t = host; t <= optimizer; ++t)
      out << ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << rank_ << ",\"tid\":" << t
          << ",\"args\":{\"name\":\"" << names[t] << "\"}}";
    char num[64];
    for (const auto& e : events_) {
      out << ",\n{\"ph\":\"" << e.ph << "\",\"name\":\"" << escaped(e.name)
          << "\",\"cat\":\"lockstep\",\"pid\":" << rank_ << ",\"tid\":" << static_cast<int>(e.t);
      std::snprintf(num, sizeof num, ",\"ts\":%.3f", e.ts);
      out << num;
      if (e.ph == 'X') {
        std::snprintf(num, sizeof num, ",\"dur\":%.3f", e.dur);
        out << num;
      } else {
        out << ",\"s\":\"t\"";
      }
      if (!e.detail.empty()) out << ",\"args\":{\"detail\":\"" << escaped(e.detail) << "\"}";
      out << '}';
    }
    out << "\n]}\n";
    if (!out) throw config_error("LOCKSTEP_TRACE: writing '" + file().string() + "' failed");
  }

  static constexpr std::size_t max_events = std::size_t{1} << 20;  // ~100 MB of JSON at most

 private:
  struct event {
    std::string name, detail;
    double ts, dur;
    track t;
    char ph;
  };
  // Microseconds on the steady clock's own scale: the ranks of one host line up.
  static double us(clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
  }
  static std::string escaped(const std::string& s) {
    std::string o;
    for (char c : s) {
      if (c == '"' || c == '\\') o += '\\';
      if (static_cast<unsigned char>(c) < 0x20) continue;
      o += c;
    }
    return o;
  }

  // 1 for the first log of this rank number in this process, then 2, 3...
  static int next_serial(int rank) {
    static std::mutex m;
    static std::map<int, int> made;
    std::lock_guard lk(m);
    return ++made[rank];
  }

  std::filesystem::path dir_;
  int rank_;
  int serial_;
  std::vector<event> events_;
};

//! From construction to destruction: a span of the trace when the log is not null, and an
//! NVTX range of the same name (nvtx.hpp) always.
class trace_scope {
 public:
  trace_scope(trace_log* log, const char* name, trace_log::track t)
      : nvtx_(name), log_(log), name_(name), t_(t), t0_(log ? log->now() : trace_log::clock::time_point{}) {}
  trace_scope(const trace_scope&) = delete;
  trace_scope& operator=(const trace_scope&) = delete;
  ~trace_scope() {
    if (log_) log_->span(name_, t_, t0_, log_->now());
  }

 private:
  nvtx_range nvtx_;
  trace_log* log_;
  const char* name_;
  trace_log::track t_;
  trace_log::clock::time_point t0_;
};

}  // namespace lockstep::detail
