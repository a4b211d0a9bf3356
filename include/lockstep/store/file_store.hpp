#pragma once
//! lockstep::FileStore — the rendezvous store as files in a directory every process can
//! see (NFS, Lustre, GPFS, or a local directory for the processes of one host). No server,
//! no open port: useful where ranks cannot reach each other over TCP before NCCL is up.
//!
//! - set() writes a temporary file and rename()s it over the key's file, so a reader sees
//!   the old value, or the whole new one, never a part.
//! - get()/wait() poll with a backoff (1 ms doubling to 50 ms), bounded by the timeout.
//! - add() needs no lock: counter `key` is a directory of entries 0, 1, 2, ..., each holding
//!   one delta; an adder link()s a complete file to the next free number (link fails if it
//!   exists, atomically, also on NFS) and the value is the sum of the entries up to its own.
//!   Each process remembers how far it has summed, so n adds cost O(n) overall.
//! - Keys map to file names byte by byte ([A-Za-z0-9_-] kept, others as %XX) in pieces of
//!   64 key bytes per path component, so any key up to the limit has a valid path.
//! - One run per directory: the file `run` records the run id (run_id_of the job token given;
//!   empty: an unnamed run), created atomically (link) by the first process. A process of
//!   another run is refused with a config_error naming both, so a new run never reads an old
//!   run's keys (an NCCL id, barrier counts) nor shares a directory with a stale process.
//!   Two unnamed runs cannot be told apart: pass the launcher's job token.
//! The directory is not removed afterwards; give each job its own (e.g. with the job id).
//! POSIX only.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/detail/byte_io.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep {

class FileStore {
 public:
  //! dir: created if missing (with parents). world: the number of processes. job_token:
  //! the run's (launch_info::job_token); the directory serves only that run.
  FileStore(std::string dir, int world, std::chrono::milliseconds timeout = detail::default_timeout(),
            store_limits limits = {}, std::string_view job_token = {})
      : dir_(std::move(dir)), world_(world), timeout_(timeout), limits_(limits), run_(run_id_of(job_token)) {
    if (world < 1) throw config_error(who() + ": world is " + std::to_string(world) + "; give at least 1");
    if (timeout.count() <= 0) throw config_error(who() + ": the timeout must be positive");
    if (dir_.empty()) throw config_error("FileStore: empty directory name; give a directory all ranks can see");
    while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
    std::random_device rd;
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    unique_ = std::string(host) + "." + std::to_string(::getpid()) + "." + std::to_string(rd());
    for (char& c : unique_)
      if (c == '/' || c == '\0') c = '_';
    make_dirs(dir_);
    claim_run();
    make_dirs(dir_ + "/values");
    make_dirs(dir_ + "/counters");
  }

  void set(std::string_view key, std::span<const std::byte> value) {
    detail::check_store_key(key, limits_, "FileStore");
    detail::check_store_value(key, value.size(), limits_.max_value_bytes, "FileStore");
    const std::string path = key_path("values", key, ".v");
    const std::string tmp = temp_name(path);
    write_file(tmp, value);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      throw error(who() + ": rename(" + tmp + ", " + path + ") failed: " + std::strerror(e));
    }
  }

  std::vector<std::byte> get(std::string_view key) {
    detail::check_store_key(key, limits_, "FileStore");
    const std::string path = key_path("values", key, ".v", false);
    std::vector<std::byte> out;
    const auto deadline = clock::now() + timeout_;
    for (auto backoff = first_backoff;; backoff = next(backoff)) {
      if (read_value(path, key, out)) return out;
      if (clock::now() >= deadline)
        throw timeout_error(detail::store_timeout_message(who(), "get", {std::string(key)}, 1, timeout_, world_));
      sleep_until_next(backoff, deadline);
    }
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    detail::check_store_keys(keys, limits_, "FileStore");
    const auto deadline = clock::now() + timeout;
    std::size_t first_missing = 0;  // keys never disappear: check each only until it exists
    for (auto backoff = first_backoff;; backoff = next(backoff)) {
      while (first_missing < keys.size() && exists(keys[first_missing])) ++first_missing;
      if (first_missing == keys.size()) return;
      if (clock::now() >= deadline) {
        std::vector<std::string> missing;
        for (std::size_t i = first_missing; i < keys.size(); ++i)
          if (!exists(keys[i])) missing.push_back(keys[i]);
        if (missing.empty()) return;
        throw timeout_error(detail::store_timeout_message(who(), "wait", missing, keys.size(), timeout, world_));
      }
      sleep_until_next(backoff, deadline);
    }
  }
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

  bool check(const std::vector<std::string>& keys) {
    detail::check_store_keys(keys, limits_, "FileStore");
    for (const auto& k : keys)
      if (!exists(k)) return false;
    return true;
  }

  std::int64_t add(std::string_view key, std::int64_t delta) {
    detail::check_store_key(key, limits_, "FileStore");
    const std::string dir = key_path("counters", key, ".c");
    make_dirs(dir);
    std::byte bytes[8];
    detail::store_le(bytes, delta);
    const std::string tmp = temp_name(dir + "/t");
    write_file(tmp, bytes);
    std::lock_guard lk(m_);
    auto& c = counters_[dir];
    const auto deadline = clock::now() + timeout_;
    for (auto backoff = first_backoff;;) {
      sum_forward(dir, c, key);
      const std::string entry = dir + "/" + std::to_string(c.next);
      bool mine = ::link(tmp.c_str(), entry.c_str()) == 0;
      if (!mine && errno == EEXIST) {
        // NFS may retry a link that succeeded and report EEXIST: the link count tells.
        struct stat st{};
        mine = ::stat(tmp.c_str(), &st) == 0 && st.st_nlink == 2;
      } else if (!mine) {
        const int e = errno;
        ::unlink(tmp.c_str());
        throw error(who() + ": link(" + tmp + ", " + entry + ") failed: " + std::strerror(e));
      }
      if (mine) {
        ::unlink(tmp.c_str());
        c.sum = detail::checked_add(c.sum, delta, key, "FileStore");
        ++c.next;
        return c.sum;
      }
      // Someone else took this number; read it (a cached "no such file" may lag).
      if (clock::now() >= deadline) {
        ::unlink(tmp.c_str());
        throw timeout_error(who() + ": add on counter " + detail::printable_key(key) + " found entry " + entry +
                            " taken but unreadable for " + detail::seconds_text(timeout_) +
                            "; is the shared filesystem consistent across hosts?");
      }
      if (!entry_exists(entry)) {
        sleep_until_next(backoff, deadline);
        backoff = next(backoff);
      }
    }
  }

  int world() const noexcept { return world_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const std::string& directory() const noexcept { return dir_; }
  //! The run this directory serves (run_id_of the job token; "" when unnamed).
  const std::string& run_id() const noexcept { return run_; }
  const store_limits& limits() const noexcept { return limits_; }

 private:
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds first_backoff{1};
  static std::chrono::milliseconds next(std::chrono::milliseconds b) {
    return std::min(b * 2, std::chrono::milliseconds(50));
  }

  struct counter_cache {
    std::uint64_t next = 0;  // entries [0, next) are summed
    std::int64_t sum = 0;
  };

  std::string who() const { return "FileStore(" + dir_ + ")"; }

  static void sleep_until_next(std::chrono::milliseconds backoff, clock::time_point deadline) {
    const auto now = clock::now();
    if (now < deadline) std::this_thread::sleep_for(std::min<clock::duration>(backoff, deadline - now));
  }

  //! Records this run in <dir>/run, or checks the record there: a link() of a complete
  //! file, so exactly one process creates it and every other reads it whole.
  void claim_run() {
    const std::string record = dir_ + "/run";
    const std::string tmp = temp_name(record);
    write_file(tmp, bytes_of(run_));
    const bool created = ::link(tmp.c_str(), record.c_str()) == 0;
    const int e = errno;
    ::unlink(tmp.c_str());
    if (created) return;
    if (e != EEXIST) throw error(who() + ": cannot create " + record + ": " + std::strerror(e));
    std::vector<std::byte> text;
    if (!read_value(record, "run", text, 64))  // a run id is 8 bytes
      throw error(who() + ": " + record + " vanished while this process read it; is another program cleaning it?");
    const std::string theirs = string_of(text);
    if (theirs == run_) return;
    throw config_error(who() + ": the directory holds the store of " + detail::run_label(theirs) +
                       " but this process is of " + detail::run_label(run_) +
                       ". A store directory serves one run: another run's keys (an NCCL id, barrier counts) must "
                       "not be read by this one, and a process of that run may still write there. Give this run "
                       "a directory of its own (e.g. named after the job id), or remove " +
                       dir_ + " once no process of " + detail::run_label(theirs) + " runs");
  }

  void make_dirs(const std::string& path) const {
    for (std::size_t at = 1; at <= path.size(); ++at) {
      if (at != path.size() && path[at] != '/') continue;
      const std::string part = path.substr(0, at);
      if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST)
        throw config_error(who() + ": cannot create directory " + part + ": " + std::strerror(errno) +
                           "; give a directory every rank can write");
    }
  }

  //! <dir>/<space>/<piece>.d/.../<last piece><suffix>; creates the parent directories when asked.
  std::string key_path(const char* space, std::string_view key, const char* suffix, bool create = true) const {
    static constexpr char hex[] = "0123456789ABCDEF";
    std::string path = dir_ + "/" + space;
    for (std::size_t at = 0; at < key.size(); at += 64) {
      const std::string_view piece = key.substr(at, 64);
      path += '/';
      for (char ch : piece) {
        const auto c = static_cast<unsigned char>(ch);
        if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-') {
          path += ch;
        } else {
          path += '%';
          path += hex[c >> 4];
          path += hex[c & 15];
        }
      }
      if (at + 64 < key.size()) {
        path += ".d";
        if (create && ::mkdir(path.c_str(), 0777) != 0 && errno != EEXIST)
          throw error(who() + ": cannot create directory " + path + ": " + std::strerror(errno));
      }
    }
    return path + suffix;
  }

  std::string temp_name(const std::string& path) {
    return path + ".tmp." + unique_ + "." + std::to_string(seq_.fetch_add(1));
  }

  void write_file(const std::string& path, std::span<const std::byte> data) const {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) throw error(who() + ": cannot create " + path + ": " + std::strerror(errno));
    std::size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = errno;
        ::close(fd);
        ::unlink(path.c_str());
        throw error(who() + ": cannot write " + path + ": " + std::strerror(e));
      }
      done += static_cast<std::size_t>(n);
    }
    if (::close(fd) != 0) {  // NFS reports write-back errors here
      const int e = errno;
      ::unlink(path.c_str());
      throw error(who() + ": cannot write " + path + ": " + std::strerror(e));
    }
  }

  //! Reads path whole; false when it does not exist (yet).
  bool read_value(const std::string& path, std::string_view key, std::vector<std::byte>& out) const {
    return read_value(path, key, out, limits_.max_value_bytes);
  }
  bool read_value(const std::string& path, std::string_view key, std::vector<std::byte>& out,
                  std::size_t max_bytes) const {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT || errno == ENOTDIR) return false;
      throw error(who() + ": cannot open " + path + ": " + std::strerror(errno));
    }
    out.clear();
    std::byte buf[16384];
    while (true) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int e = errno;
        ::close(fd);
        throw error(who() + ": cannot read " + path + ": " + std::strerror(e));
      }
      if (n == 0) break;
      out.insert(out.end(), buf, buf + n);
      if (out.size() > max_bytes) {
        ::close(fd);
        throw error(who() + ": the file of key " + detail::printable_key(key) + " holds more than " +
                    std::to_string(max_bytes) + " bytes; was it written by something else?");
      }
    }
    ::close(fd);
    return true;
  }

  bool exists(const std::string& key) const {
    detail::check_store_key(key, limits_, "FileStore");
    struct stat st{};
    return ::stat(key_path("values", key, ".v", false).c_str(), &st) == 0;
  }

  static bool entry_exists(const std::string& path) {
    struct stat st{};
    return ::stat(path.c_str(), &st) == 0;
  }

  //! Adds the entries other processes made since this one last looked.
  void sum_forward(const std::string& dir, counter_cache& c, std::string_view key) const {
    while (true) {
      const std::string entry = dir + "/" + std::to_string(c.next);
      const int fd = ::open(entry.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        if (errno == ENOENT) return;
        throw error(who() + ": cannot open " + entry + ": " + std::strerror(errno));
      }
      std::byte b[9];
      std::size_t got = 0;
      while (got < sizeof b) {  // one byte more than expected, to notice a longer file
        const ssize_t n = ::read(fd, b + got, sizeof b - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += static_cast<std::size_t>(n);
      }
      ::close(fd);
      if (got != 8)
        throw error(who() + ": counter entry " + entry + " has " + std::to_string(got) +
                    " bytes instead of 8; something else wrote into the store's directory");
      c.sum = detail::checked_add(c.sum, detail::load_le<std::int64_t>(b), key, "FileStore");
      ++c.next;
    }
  }

  std::string dir_;
  int world_;
  std::chrono::milliseconds timeout_;
  store_limits limits_;
  std::string run_;
  std::string unique_;
  std::atomic<std::uint64_t> seq_{0};
  std::mutex m_;
  std::map<std::string, counter_cache> counters_;
};

static_assert(store<FileStore>);

}  // namespace lockstep
