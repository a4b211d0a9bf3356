#pragma once
//! Checkpoint files: the format (docs/checkpoint.md: a 48-byte header, then the payload),
//! written atomically (save_checkpoint) and verified completely before anything is returned
//! (load_checkpoint). POSIX.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lockstep/checkpoint/checkpoint.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/progress.hpp"
#include "lockstep/detail/byte_io.hpp"
#include "lockstep/detail/checksum.hpp"
#include "lockstep/version.hpp"

namespace lockstep {

// ---------------------------------------------------------------------------------------
// File format (docs/checkpoint.md): a 48-byte header, then the payload.
namespace detail {

inline constexpr unsigned char checkpoint_magic[8] = {0x89, 'L', 'S', 'C', 'K', 'P', 'T', '\n'};
inline constexpr std::uint32_t checkpoint_format_version = 1;
inline constexpr std::size_t checkpoint_header_bytes = 48;
inline constexpr std::uint16_t checkpoint_flag_big_endian = 1;  // tensor bytes in big-endian order

struct checkpoint_header {
  std::uint32_t format_version = checkpoint_format_version;
  std::uint16_t writer_major = static_cast<std::uint16_t>(lockstep::version_major);
  std::uint16_t writer_minor = static_cast<std::uint16_t>(lockstep::version_minor);
  std::uint16_t writer_patch = static_cast<std::uint16_t>(lockstep::version_patch);
  std::uint16_t flags = 0;
  std::uint64_t fingerprint = 0;
  std::uint64_t payload_bytes = 0;
  std::uint32_t payload_crc = 0;

  void encode(std::byte* out) const {
    std::memcpy(out, checkpoint_magic, 8);
    store_le(out + 8, format_version);
    store_le(out + 12, writer_major);
    store_le(out + 14, writer_minor);
    store_le(out + 16, writer_patch);
    store_le(out + 18, flags);
    store_le(out + 20, static_cast<std::uint32_t>(checkpoint_header_bytes));
    store_le(out + 24, fingerprint);
    store_le(out + 32, payload_bytes);
    store_le(out + 40, payload_crc);
    store_le(out + 44, crc32_of(out, 44));
  }
  std::string writer_version() const {
    return std::to_string(writer_major) + "." + std::to_string(writer_minor) + "." + std::to_string(writer_patch);
  }
};

inline std::uint16_t native_tensor_flags() {
  return std::endian::native == std::endian::big ? checkpoint_flag_big_endian : 0;
}

inline std::string file_errno_text(int e) { return std::strerror(e); }

//! POSIX file descriptor that closes itself.
struct unique_fd {
  int fd = -1;
  unique_fd() = default;
  explicit unique_fd(int f) : fd(f) {}
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }
  int release() noexcept { return std::exchange(fd, -1); }
  void reset() noexcept {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

}  // namespace detail

// ---------------------------------------------------------------------------------------
//! Writes `ck` to `path` atomically: a temporary file in the same directory is written,
//! fsync'ed and renamed over `path`, then the directory is fsync'ed. On any failure the
//! temporary file is removed and a previous file at `path` is left as it was; throws
//! checkpoint_error saying what failed and what to do. (POSIX only.) A save that runs past
//! progress.first (default 2 s) reports bytes written and rate, then every progress.every
//! (5 s), and closes with the total.
inline void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck, const progress_options& progress) {
  namespace fs = std::filesystem;
  const std::string target = path.string();
  if (!path.has_filename())
    throw checkpoint_error("cannot save checkpoint '" + target +
                           "': the path names a directory, not a file; add a file name");
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  detail::progress meter(progress, std::chrono::seconds(2), std::chrono::seconds(5));
  static std::atomic<std::uint64_t> counter{0};
  const std::string tmp = target + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
  auto fail = [&](const std::string& problem, const std::string& todo) -> checkpoint_error {
    return checkpoint_error("cannot save checkpoint '" + target + "': " + problem + " (" + todo +
                            "); the previous checkpoint at that path, if any, is unchanged");
  };
  auto io_todo = [](int e) -> std::string {
    if (e == ENOSPC) return "the disk is full: free space or save elsewhere";
    if (e == EDQUOT) return "the disk quota is exhausted: free space or save elsewhere";
    if (e == EACCES || e == EPERM || e == EROFS) return "check the directory's permissions";
    if (e == EFBIG) return "the file size limit was reached: raise it (ulimit -f) or save elsewhere";
    return "check the file system";
  };

  detail::unique_fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.fd < 0) {
    const int e = errno;
    if (e == ENOENT || e == ENOTDIR)
      throw fail("directory '" + dir.string() + "' does not exist", "create it before saving");
    throw fail("cannot create temporary file '" + tmp + "': " + detail::file_errno_text(e), io_todo(e));
  }
  // From here on, any exit before the rename removes the temporary file.
  struct tmp_guard {
    const std::string& name;
    detail::unique_fd& fd;
    bool armed = true;
    ~tmp_guard() {
      if (!armed) return;
      fd.reset();
      ::unlink(name.c_str());
    }
  } guard{tmp, fd};

  // The file's size, for the progress lines: the payload's pieces counted without their bytes.
  std::uint64_t file_bytes = detail::checkpoint_header_bytes, written = 0;
  if (meter.enabled()) {
    auto count = [&](const void*, std::size_t n) { file_bytes += n; };
    ck.emit_payload(count);
  }
  const std::string subject = "checkpoint '" + target + "'";

  auto write_all = [&](const void* p, std::size_t n, off_t at, bool positioned) {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      // 64 MiB at a time, so a slow disk still gets a progress line every few seconds.
      const std::size_t chunk = std::min<std::size_t>(n, std::size_t{64} << 20);
      const ssize_t k = positioned ? ::pwrite(fd.fd, c, chunk, at) : ::write(fd.fd, c, chunk);
      if (k < 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        throw fail("writing '" + tmp + "' failed: " + detail::file_errno_text(e), io_todo(e));
      }
      c += k;
      at += k;
      n -= static_cast<std::size_t>(k);
      if (!positioned) written += static_cast<std::uint64_t>(k);
      if (meter.due())
        meter.report("lockstep: saving " + subject + ": " +
                     detail::transfer_text(written, file_bytes, meter.seconds()));
    }
  };

  // Header placeholder first; the real one (with length and CRC) is written at offset 0
  // once the payload is out, so the payload is streamed in one pass.
  std::byte header[detail::checkpoint_header_bytes] = {};
  write_all(header, sizeof header, 0, false);

  constexpr std::size_t cap = std::size_t{1} << 20;
  std::vector<std::byte> buf;
  buf.reserve(cap);
  detail::crc32 crc;
  std::uint64_t length = 0;
  auto sink = [&](const void* p, std::size_t n) {
    if (n == 0) return;
    crc.update(p, n);
    length += n;
    if (buf.size() + n > cap) {
      write_all(buf.data(), buf.size(), 0, false);
      buf.clear();
    }
    if (n >= cap) {
      write_all(p, n, 0, false);
    } else {
      const auto* b = static_cast<const std::byte*>(p);
      buf.insert(buf.end(), b, b + n);
    }
  };
  ck.emit_payload(sink);
  write_all(buf.data(), buf.size(), 0, false);

  detail::checkpoint_header h;
  h.flags = detail::native_tensor_flags();
  h.fingerprint = ck.fingerprint();
  h.payload_bytes = length;
  h.payload_crc = crc.value();
  h.encode(header);
  write_all(header, sizeof header, 0, true);

  if (meter.due() || meter.reported())  // fsync may take long on its own: say what happens
    meter.report("lockstep: saving " + subject + ": " + detail::bytes_text(static_cast<double>(written)) +
                 " written, syncing it to disk");
  if (::fsync(fd.fd) != 0) {
    const int e = errno;
    throw fail("fsync of '" + tmp + "' failed: " + detail::file_errno_text(e), io_todo(e));
  }
  // close() can report a deferred write error (NFS), so check it.
  if (::close(fd.release()) != 0) {
    const int e = errno;
    throw fail("closing '" + tmp + "' failed: " + detail::file_errno_text(e), io_todo(e));
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int e = errno;
    std::string todo = e == EISDIR || e == ENOTEMPTY || e == EEXIST
                           ? "a directory is in the way: remove it or choose another file name"
                           : io_todo(e);
    throw fail("renaming '" + tmp + "' over it failed: " + detail::file_errno_text(e), todo);
  }
  guard.armed = false;

  // Make the rename itself durable.
  detail::unique_fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.fd < 0 || (::fsync(dfd.fd) != 0 && errno != EINVAL && errno != ENOTSUP)) {
    const int e = errno;
    throw checkpoint_error("checkpoint '" + target + "' was written, but syncing directory '" + dir.string() +
                           "' failed: " + detail::file_errno_text(e) +
                           " (after a power loss the previous file may reappear; check the "
                           "file system)");
  }
  meter.finish("lockstep: saved " + subject + ": " + detail::transfer_done_text(written, meter.seconds()));
}

// ---------------------------------------------------------------------------------------
//! Reads `path` and verifies it completely (magic, format version, header checksum,
//! length, payload CRC-32, structure, fingerprint) before returning; nothing is applied to
//! any model. Throws checkpoint_error naming the path, the problem and what to do. A load
//! that runs past progress.first (default 2 s) reports bytes read and rate, then every
//! progress.every (5 s), and closes with the total.
inline Checkpoint load_checkpoint(const std::filesystem::path& path, const progress_options& progress) {
  const std::string name = path.string();
  const std::string subject = "checkpoint '" + name + "'";
  const std::string use_other = "the file was damaged after it was written (disk, copy or transfer): use an earlier "
                                "checkpoint or copy it again";

  detail::unique_fd fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) {
    const int e = errno;
    throw checkpoint_error("cannot open " + subject + ": " + detail::file_errno_text(e) +
                           (e == ENOENT ? " (check the path; was the checkpoint saved?)" : ""));
  }
  struct stat st{};
  if (::fstat(fd.fd, &st) != 0) {
    const int e = errno;
    throw checkpoint_error("cannot stat " + subject + ": " + detail::file_errno_text(e));
  }
  if (!S_ISREG(st.st_mode)) throw checkpoint_error(subject + " is not a regular file; check the path");
  const auto size = static_cast<std::size_t>(st.st_size);
  auto data = std::shared_ptr<std::byte[]>(new std::byte[size == 0 ? 1 : size]);
  constexpr std::size_t H = detail::checkpoint_header_bytes;
  detail::progress meter(progress, std::chrono::seconds(2), std::chrono::seconds(5));
  // The CRC-32 of everything after the header, taken while the bytes are fresh from read():
  // once the checks below found the payload to be exactly that, it is the payload's CRC.
  detail::crc32 running;
  std::size_t got = 0;
  while (got < size) {
    // 64 MiB at a time, so a slow disk still gets a progress line every few seconds.
    const ssize_t k = ::read(fd.fd, data.get() + got, std::min<std::size_t>(size - got, std::size_t{64} << 20));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      const int e = errno;
      throw checkpoint_error("reading " + subject + " failed: " + detail::file_errno_text(e));
    }
    if (k == 0) break;  // shrank while we read: the checks below report it
    const std::size_t end = got + static_cast<std::size_t>(k), from = std::max(got, H);
    if (end > from) running.update(data.get() + from, end - from);
    got = end;
    if (meter.due())
      meter.report("lockstep: loading " + subject + ": " + detail::transfer_text(got, size, meter.seconds()));
  }
  fd.reset();
  const std::byte* b = data.get();
  const std::size_t n = got;

  // Magic (or as much of it as there is), then truncation of the header.
  const std::size_t magic_seen = std::min<std::size_t>(n, 8);
  if (std::memcmp(b, detail::checkpoint_magic, magic_seen) != 0)
    throw checkpoint_error("'" + name +
                           "' is not a lockstep checkpoint (it does not start with the "
                           "checkpoint magic bytes); check the path");
  if (n < H)
    throw checkpoint_error(subject + " is truncated: it holds " + std::to_string(n) + " bytes, less than the " +
                           std::to_string(H) +
                           "-byte header (the write or copy was cut short): use an earlier "
                           "checkpoint or copy it again");
  detail::checkpoint_header h;
  h.format_version = detail::load_le<std::uint32_t>(b + 8);
  h.writer_major = detail::load_le<std::uint16_t>(b + 12);
  h.writer_minor = detail::load_le<std::uint16_t>(b + 14);
  h.writer_patch = detail::load_le<std::uint16_t>(b + 16);
  h.flags = detail::load_le<std::uint16_t>(b + 18);
  h.fingerprint = detail::load_le<std::uint64_t>(b + 24);
  h.payload_bytes = detail::load_le<std::uint64_t>(b + 32);
  h.payload_crc = detail::load_le<std::uint32_t>(b + 40);
  // The header's own length (offset 20) and checksum (its last 4 bytes) come first, in every
  // format: a damaged version word must read as damage, not as a file from another lockstep.
  const auto header_len = detail::load_le<std::uint32_t>(b + 20);
  if (header_len < H || header_len > n ||
      detail::load_le<std::uint32_t>(b + header_len - 4) != detail::crc32_of(b, header_len - 4))
    throw checkpoint_error(subject + " has a corrupt header (its checksum does not match): " + use_other);
  if (h.format_version != detail::checkpoint_format_version || header_len != H)
    throw checkpoint_error(subject + " has format version " + std::to_string(h.format_version) +
                           " (written by lockstep " + h.writer_version() + "), but lockstep " + version_string +
                           " reads format version " + std::to_string(detail::checkpoint_format_version) +
                           ": load it with a matching lockstep version");
  if (h.flags != detail::native_tensor_flags())
    throw checkpoint_error(subject + " was written on a host of the other byte order; load it "
                                     "on a host like the one that saved it");
  if (h.payload_bytes > n - H)
    throw checkpoint_error(subject + " is truncated: its header announces " + std::to_string(h.payload_bytes) +
                           " payload bytes but only " + std::to_string(n - H) +
                           " follow the header (the write or copy was cut short): use an "
                           "earlier checkpoint or copy it again");
  if (h.payload_bytes < n - H)
    throw checkpoint_error(subject + " has " + std::to_string(n - H - h.payload_bytes) +
                           " unexpected bytes after its payload: " + use_other);
  const std::span<const std::byte> payload(b + H, static_cast<std::size_t>(h.payload_bytes));
  const std::uint32_t crc = running.value();  // payload == bytes [H, n), checked just above
  if (crc != h.payload_crc) {
    char msg[64];
    std::snprintf(msg, sizeof msg, "CRC-32 0x%08x, header records 0x%08x", crc, h.payload_crc);
    throw checkpoint_error(subject + " is corrupt: checksum mismatch (payload " + msg + "): " + use_other);
  }

  // Structure. The CRC matched, so a failure here is a writer bug, not damage.
  Checkpoint ck;
  ck.source_ = path;
  byte_reader r(payload, subject + " payload");
  ck.meta.step = r.read<std::int64_t>();
  ck.meta.epoch = r.read<std::int64_t>();
  ck.meta.sample_position = r.read<std::int64_t>();
  ck.has_parameters_ = r.read<bool>();
  const auto count = r.read<std::uint64_t>();
  if (count > r.remaining()) r.fail("announces " + std::to_string(count) + " parameters");
  for (std::uint64_t i = 0; i < count; ++i) {
    checkpoint_tensor t;
    t.name = r.read_string();
    const auto ty = r.read<std::uint8_t>();
    if (ty > static_cast<std::uint8_t>(dtype::f64))
      r.fail("parameter '" + t.name + "' has unknown element type " + std::to_string(ty));
    t.type = static_cast<dtype>(ty);
    t.shape = r.read_array<std::int64_t>();
    std::uint64_t numel = 1;
    for (auto d : t.shape) {
      if (d < 0 || (d != 0 && numel > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(d)))
        r.fail("parameter '" + t.name + "' has an invalid shape");
      numel *= static_cast<std::uint64_t>(d);
    }
    const auto bytes = r.read<std::uint64_t>();
    if (numel > std::numeric_limits<std::uint64_t>::max() / size_of(t.type) || bytes != numel * size_of(t.type))
      r.fail("parameter '" + t.name + "' " + t.shape_string() + " stores " + std::to_string(bytes) + " bytes, not " +
             std::to_string(numel * size_of(t.type)));
    t.data = r.take(static_cast<std::size_t>(bytes));
    ck.params_.push_back(std::move(t));
  }
  const auto sections = r.read<std::uint64_t>();
  if (sections > r.remaining()) r.fail("announces " + std::to_string(sections) + " sections");
  for (std::uint64_t i = 0; i < sections; ++i) {
    Checkpoint::section s;
    s.name = r.read_string();
    if (ck.find(s.name)) r.fail("holds section '" + s.name + "' twice");
    s.bytes = r.take(static_cast<std::size_t>(r.read<std::uint64_t>()));
    ck.blobs_.push_back(std::move(s));
  }
  if (!r.at_end()) r.fail("has " + std::to_string(r.remaining()) + " bytes after its last section");
  if (ck.fingerprint() != h.fingerprint)
    throw checkpoint_error(subject + ": the parameter fingerprint in the header does not match "
                                     "its parameter table (a writer bug): use an earlier checkpoint");
  ck.owners_.push_back(std::shared_ptr<const void>(data, data.get()));
  meter.finish("lockstep: loaded " + subject + ": " + detail::transfer_done_text(n, meter.seconds()));
  return ck;
}

}  // namespace lockstep
