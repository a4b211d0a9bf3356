#pragma once
//! Training scalars in files: ScalarLog fans (tag, step, value) out to sinks on rank 0 —
//! TensorBoardWriter (event files TensorBoard reads, written natively: TFRecord framing with
//! masked CRC-32C, the Event / Summary messages encoded by hand, no protobuf dependency),
//! CsvWriter and JsonLinesWriter, or any type that satisfies scalar_sink.
//!
//! \code
//!   lockstep::ScalarLog log(ctx.rank(), {.tensorboard = "runs/mlp", .csv = "runs/mlp.csv"});
//!   log.scalar("train/loss", step, loss);      // rank 0 writes; elsewhere a no-op
//!   log.training(step, dp, r);                 // lockstep's own: loss scale, grad norm, ...
//! \endcode

#include <unistd.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/detail/checksum.hpp"

namespace lockstep {

//! lockstep::scalar_sink — where ScalarLog writes.
//!  1. `s.scalar(tag, step, value, wall_time)`: one value (wall_time: seconds since the epoch).
//!  2. `s.flush()`: what was written so far reaches the file (or wherever the sink writes).
template <class S>
concept scalar_sink = requires(S& s, std::string_view tag, std::int64_t step, double v, double t) {
  s.scalar(tag, step, v, t);
  s.flush();
};

namespace detail {

//! Seconds since the Unix epoch, as TensorBoard's wall_time.
inline double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

//! A sink's file: opened for writing (truncated) with its directory made — config_error names
//! the path — and flushed with a check, so a full disk is an error, not lost scalars.
struct output_file {
  output_file(std::filesystem::path f, std::ios::openmode mode, const char* w) : file(std::move(f)), who(w) {
    std::error_code ec;
    if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
    out.open(file, mode);
    if (!out)
      throw config_error(std::string(who) + ": cannot create '" + file.string() + "': " + std::strerror(errno) +
                         " (check the directory exists or can be made, and is writable)");
  }
  void flush() {
    out.flush();
    if (!out)
      throw error(std::string(who) + ": writing '" + file.string() + "' failed: " + std::strerror(errno) +
                  " (disk full or the file was removed?)");
  }
  std::filesystem::path file;
  const char* who;
  std::ofstream out;
};

// Protocol-buffer pieces (the wire format: varints, tags, little-endian fixed fields).
inline void pb_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
inline void pb_tag(std::string& out, int field, int wire) {
  pb_varint(out, static_cast<std::uint64_t>(field << 3 | wire));
}
template <class U>
void pb_le(std::string& out, U v) {
  for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
inline void pb_bytes(std::string& out, int field, std::string_view b) {
  pb_tag(out, field, 2);
  pb_varint(out, b.size());
  out.append(b);
}

//! TFRecord framing: u64 length, masked CRC-32C of the length, the data, masked CRC-32C of it.
inline std::string tf_record(std::string_view data) {
  const auto masked = [](const void* p, std::size_t n) {
    const std::uint32_t c = crc32c_of(p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
  };
  std::string out, len;
  pb_le(len, static_cast<std::uint64_t>(data.size()));
  out += len;
  pb_le(out, masked(len.data(), len.size()));
  out.append(data);
  pb_le(out, masked(data.data(), data.size()));
  return out;
}

//! An Event message: wall_time (1, double), step (2, int64) and either file_version (3) or
//! a Summary (5) with one Value {tag (1), simple_value (2, float)}.
inline std::string tf_event(double wall_time, std::int64_t step, std::string_view file_version, std::string_view tag,
                            float value) {
  std::string e;
  pb_tag(e, 1, 1);
  pb_le(e, std::bit_cast<std::uint64_t>(wall_time));
  if (step != 0) {
    pb_tag(e, 2, 0);
    pb_varint(e, static_cast<std::uint64_t>(step));
  }
  if (!file_version.empty()) {
    pb_bytes(e, 3, file_version);
    return e;
  }
  std::string v, summary;
  pb_bytes(v, 1, tag);
  pb_tag(v, 2, 5);
  pb_le(v, std::bit_cast<std::uint32_t>(value));
  pb_bytes(summary, 1, v);
  pb_bytes(e, 5, summary);
  return e;
}

inline std::string host_name() {
  char h[256] = {};
  if (gethostname(h, sizeof h - 1) != 0) return "localhost";
  return h;
}

}  // namespace detail

//! TensorBoard's event file in `dir` (made if missing): events.out.tfevents.<time>.<host>.<pid>.
//! Values are stored as float (TensorBoard's simple_value).
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::filesystem::path& dir)
      : now_(detail::wall_seconds()),
        f_(events_file(dir, now_), std::ios::binary | std::ios::trunc, "TensorBoardWriter") {
    f_.out << detail::tf_record(detail::tf_event(now_, 0, "brain.Event:2", {}, 0));
    flush();
  }
  void scalar(std::string_view tag, std::int64_t step, double value, double wall_time) {
    f_.out << detail::tf_record(detail::tf_event(wall_time, step, {}, tag, static_cast<float>(value)));
  }
  void flush() { f_.flush(); }
  const std::filesystem::path& file() const noexcept { return f_.file; }

 private:
  static std::filesystem::path events_file(const std::filesystem::path& dir, double now) {
    static std::atomic<int> made{0};  // two writers in one second of one process: distinct files
    const int n = ++made;
    return dir / ("events.out.tfevents." + std::to_string(static_cast<long long>(now)) + "." + detail::host_name() +
                  "." + std::to_string(getpid()) + (n > 1 ? "." + std::to_string(n) : ""));
  }
  double now_;
  detail::output_file f_;
};

//! One row per value: wall_time,step,tag,value (the tag quoted when it holds a comma or quote).
class CsvWriter {
 public:
  explicit CsvWriter(const std::filesystem::path& file) : f_(file, std::ios::trunc, "CsvWriter") {
    f_.out << "wall_time,step,tag,value\n";
  }
  void scalar(std::string_view tag, std::int64_t step, double value, double wall_time) {
    char num[64];
    std::snprintf(num, sizeof num, "%.6f,%lld,", wall_time, static_cast<long long>(step));
    f_.out << num;
    if (tag.find_first_of(",\"\r\n") == std::string_view::npos) {
      f_.out << tag;
    } else {
      f_.out << '"';
      for (char c : tag) f_.out << (c == '"' ? "\"\"" : std::string(1, c));
      f_.out << '"';
    }
    std::snprintf(num, sizeof num, ",%.17g\n", value);
    f_.out << num;
  }
  void flush() { f_.flush(); }

 private:
  detail::output_file f_;
};

//! One JSON object per line: {"wall_time":…,"step":…,"tag":"…","value":…}; a non-finite value
//! (which JSON cannot hold) is written as null.
class JsonLinesWriter {
 public:
  explicit JsonLinesWriter(const std::filesystem::path& file) : f_(file, std::ios::trunc, "JsonLinesWriter") {}
  void scalar(std::string_view tag, std::int64_t step, double value, double wall_time) {
    char num[96];
    std::snprintf(num, sizeof num, "{\"wall_time\":%.6f,\"step\":%lld,\"tag\":\"", wall_time,
                  static_cast<long long>(step));
    f_.out << num;
    for (unsigned char c : tag) {
      if (c == '"' || c == '\\') f_.out << '\\' << c;
      else if (c < 0x20) {
        char u[8];
        std::snprintf(u, sizeof u, "\\u%04x", c);
        f_.out << u;
      } else f_.out << c;
    }
    if (std::isfinite(value)) std::snprintf(num, sizeof num, "\",\"value\":%.17g}\n", value);
    else std::snprintf(num, sizeof num, "\",\"value\":null}\n");
    f_.out << num;
  }
  void flush() { f_.flush(); }

 private:
  detail::output_file f_;
};

//! Which files a ScalarLog writes (empty: not that one).
struct ScalarLogOptions {
  std::filesystem::path tensorboard{};  //!< a directory for TensorBoard's event file
  std::filesystem::path csv{};          //!< a CSV file
  std::filesystem::path jsonl{};        //!< a JSON-lines file
};

//! Scalars from rank 0 to every sink; on other ranks (and without sinks) every call returns at
//! once, and no file is made. Sinks flush at least once a second and when the log goes away.
class ScalarLog {
 public:
  ScalarLog() = default;
  ScalarLog(int rank, const ScalarLogOptions& o) : rank_(rank) {
    if (rank_ != 0) return;
    if (!o.tensorboard.empty()) add(TensorBoardWriter(o.tensorboard));
    if (!o.csv.empty()) add(CsvWriter(o.csv));
    if (!o.jsonl.empty()) add(JsonLinesWriter(o.jsonl));
  }
  ScalarLog(ScalarLog&&) noexcept = default;
  ScalarLog& operator=(ScalarLog&&) noexcept = default;
  ~ScalarLog() {
    try {
      flush();
    } catch (...) {  // a destructor must not throw; flush() reports it when called
    }
  }

  //! Adds a sink (kept on rank 0 only).
  template <scalar_sink S>
  void add(S sink) {
    if (rank_ == 0) sinks_.push_back(std::make_unique<held<S>>(std::move(sink)));
  }
  //! Whether anything is written (rank 0 with at least one sink).
  bool active() const noexcept { return rank_ == 0 && !sinks_.empty(); }

  void scalar(std::string_view tag, std::int64_t step, double value) {
    if (!active()) return;
    const double now = detail::wall_seconds();
    for (auto& s : sinks_) s->scalar(tag, step, value, now);
    if (now - last_flush_ >= 1.0) flush();
  }

  //! What lockstep knows of an optimizer step (dp: a DataParallel, r: its step_result): "lockstep/loss_scale",
  //! "lockstep/skipped_steps" (so far), "lockstep/grad_norm" (when finish() clipped), "lockstep/comm_seconds" (host
  //! time in collectives since the previous call).
  template <class DP, class StepResult>
  void training(std::int64_t step, DP& dp, const StepResult& r) {
    if (!active()) return;
    if (r.synced && !r.applied) ++skipped_;
    scalar("lockstep/loss_scale", step, dp.scaler().scale());
    scalar("lockstep/skipped_steps", step, static_cast<double>(skipped_));
    if (!std::isnan(r.grad_norm)) scalar("lockstep/grad_norm", step, r.grad_norm);
    const double comm = dp.stats().comm_seconds;
    scalar("lockstep/comm_seconds", step, comm - comm_seen_);
    comm_seen_ = comm;
  }

  void flush() {
    last_flush_ = detail::wall_seconds();
    for (auto& s : sinks_) s->flush();
  }

 private:
  struct sink {
    virtual ~sink() = default;
    virtual void scalar(std::string_view tag, std::int64_t step, double value, double wall_time) = 0;
    virtual void flush() = 0;
  };
  template <class S>
  struct held final : sink {
    explicit held(S s) : s_(std::move(s)) {}
    void scalar(std::string_view tag, std::int64_t step, double value, double wall_time) override {
      s_.scalar(tag, step, value, wall_time);
    }
    void flush() override { s_.flush(); }
    S s_;
  };

  int rank_ = -1;
  std::vector<std::unique_ptr<sink>> sinks_;
  double last_flush_ = 0;
  double comm_seen_ = 0;
  std::uint64_t skipped_ = 0;
};

static_assert(scalar_sink<TensorBoardWriter> && scalar_sink<CsvWriter> && scalar_sink<JsonLinesWriter>);

}  // namespace lockstep
