#pragma once
//! Checkpoints: everything needed to resume training bit for bit, written atomically and
//! verified on load. Format and guarantees: docs/checkpoint.md.
//!
//! A Checkpoint is an in-memory bundle: the model's parameters, the meta counters
//! (step, epoch, sample position) and named sections (optimizer, loss scale, RNG, ...).
//! Sections are serialized when added, so a throwing hook fails before any file is touched.
//!
//! \code
//!   // save: only rank 0 builds and writes; every rank returns once the file is in place
//!   lockstep::save_checkpoint_rank0(comm, "run/ckpt.lsck", [&](lockstep::Checkpoint& ck) {
//!     ck.meta = {.step = step, .epoch = epoch, .sample_position = pos};
//!     ck.add_parameters(model.parameters(), comm.memory());
//!     ck.add("optimizer", optimizer);          // lockstep::serializable
//!     ck.add_value("loss_scale", scaler_state); // trivially copyable struct
//!     ck.add_streamed("rng", rng);              // anything with << and >>
//!   });
//!   // resume: every rank reads and verifies the file, then restores
//!   auto ck = lockstep::load_checkpoint("run/ckpt.lsck");
//!   lockstep::restore_parameters(ck, model.parameters(), comm.memory());
//!   ck.restore("optimizer", optimizer);
//!   ck.restore_value("loss_scale", scaler_state);
//!   ck.restore_streamed("rng", rng);
//! \endcode

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <ios>
#include <limits>
#include <locale>
#include <memory>
#include <ranges>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lockstep/concepts.hpp"
#include "lockstep/detail/byte_io.hpp"
#include "lockstep/detail/checksum.hpp"
#include "lockstep/detail/host_collectives.hpp"
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"
#include "lockstep/parameter.hpp"
#include "lockstep/reduce_op.hpp"
#include "lockstep/version.hpp"

namespace lockstep {

// ---------------------------------------------------------------------------------------
//! byte_writer — appends values to a byte buffer in a fixed little-endian encoding, so a
//! section written on one host reads the same on any other.
class byte_writer {
 public:
  void write_bytes(const void* src, std::size_t n) {
    if (n == 0) return;
    const auto* p = static_cast<const std::byte*>(src);
    buf_.insert(buf_.end(), p, p + n);
  }
  template <class T>
    requires detail::le_scalar<T> || std::same_as<T, bool>
  void write(T v) {
    if constexpr (std::same_as<T, bool>) {
      write(static_cast<std::uint8_t>(v ? 1 : 0));
    } else {
      std::byte b[sizeof(T)];
      detail::store_le(b, v);
      write_bytes(b, sizeof(T));
    }
  }
  //! u64 length, then the bytes.
  void write_string(std::string_view s) {
    write(static_cast<std::uint64_t>(s.size()));
    write_bytes(s.data(), s.size());
  }
  //! u64 count, then each element little-endian.
  template <detail::le_scalar T>
  void write_array(std::span<const T> v) {
    write(static_cast<std::uint64_t>(v.size()));
    if constexpr (std::endian::native == std::endian::little) {
      write_bytes(v.data(), v.size_bytes());
    } else {
      for (const T& x : v) write(x);
    }
  }
  template <detail::le_scalar T>
  void write_array(const std::vector<T>& v) {
    write_array(std::span<const T>(v));
  }

  std::size_t size() const noexcept { return buf_.size(); }
  std::span<const std::byte> bytes() const noexcept { return buf_; }
  std::vector<std::byte> release() && noexcept { return std::move(buf_); }

 private:
  std::vector<std::byte> buf_;
};

//! byte_reader — reads what byte_writer wrote. Reading past the end, or a malformed
//! value, throws checkpoint_error naming `what` (the section) and the offset.
class byte_reader {
 public:
  explicit byte_reader(std::span<const std::byte> data, std::string what = "data")
      : data_(data), what_(std::move(what)) {}

  //! A view of the next n bytes (valid while the underlying buffer lives).
  std::span<const std::byte> take(std::size_t n) {
    if (n > remaining())
      fail("needs " + std::to_string(n) + " more bytes but only " + std::to_string(remaining()) +
           " remain");
    auto s = data_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  void read_bytes(void* dst, std::size_t n) {
    auto s = take(n);
    if (n) std::memcpy(dst, s.data(), n);
  }
  template <class T>
    requires detail::le_scalar<T> || std::same_as<T, bool>
  T read() {
    if constexpr (std::same_as<T, bool>) {
      const auto b = read<std::uint8_t>();
      if (b > 1) fail("holds " + std::to_string(b) + " where a bool (0 or 1) was expected");
      return b == 1;
    } else {
      return detail::load_le<T>(take(sizeof(T)).data());
    }
  }
  template <class T>
    requires detail::le_scalar<T> || std::same_as<T, bool>
  void read(T& v) {
    v = read<T>();
  }
  std::string read_string() {
    const auto n = read<std::uint64_t>();
    if (n > remaining()) fail("holds a string of " + std::to_string(n) + " bytes, past its end");
    auto s = take(static_cast<std::size_t>(n));
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }
  template <detail::le_scalar T>
  std::vector<T> read_array() {
    const auto n = read_count<T>();
    std::vector<T> v(n);
    read_elements(std::span<T>(v));
    return v;
  }
  //! Reads an array whose length must equal out.size() (e.g. optimizer moments of a
  //! parameter whose size is already known).
  template <detail::le_scalar T>
  void read_array(std::span<T> out) {
    const auto n = read_count<T>();
    if (n != out.size())
      fail("holds an array of " + std::to_string(n) + " elements where " +
           std::to_string(out.size()) + " were expected (was it saved from a different model?)");
    read_elements(out);
  }

  std::size_t position() const noexcept { return pos_; }
  std::size_t remaining() const noexcept { return data_.size() - pos_; }
  bool at_end() const noexcept { return pos_ == data_.size(); }
  const std::string& what() const noexcept { return what_; }

  //! Throws checkpoint_error: "<what>, at byte <offset>: <problem>".
  [[noreturn]] void fail(const std::string& problem) const {
    throw checkpoint_error(what_ + ", at byte " + std::to_string(pos_) + ": " + problem);
  }

 private:
  template <class T>
  std::size_t read_count() {
    const auto n = read<std::uint64_t>();
    if (n > remaining() / sizeof(T))
      fail("holds an array of " + std::to_string(n) + " elements of " +
           std::to_string(sizeof(T)) + " bytes, past its end");
    return static_cast<std::size_t>(n);
  }
  template <class T>
  void read_elements(std::span<T> out) {
    if constexpr (std::endian::native == std::endian::little) {
      read_bytes(out.data(), out.size_bytes());
    } else {
      for (T& x : out) x = read<T>();
    }
  }

  std::span<const std::byte> data_;
  std::size_t pos_ = 0;
  std::string what_;
};

// ---------------------------------------------------------------------------------------
//! lockstep::serializable — state that goes into a checkpoint section (optimizer,
//! loss scaler, sampler, ...).
//!
//! Requirements:
//!  1. `t.save(w)` on a const T with a `lockstep::byte_writer& w` writes the state.
//!  2. `t.load(r)` with a `lockstep::byte_reader& r` reads exactly what save wrote.
//!     (Checkpoint::restore checks that load consumed the whole section.)
//!  3. Optional, for all-or-nothing restore: T copyable. Checkpoint::restore then loads
//!     into a copy and assigns it only when load succeeded; otherwise load must itself
//!     leave t unchanged when it throws.
//!
//! Example:
//! \code
//!   struct Sgd {
//!     double lr; std::vector<float> momentum;
//!     void save(lockstep::byte_writer& w) const { w.write(lr); w.write_array(momentum); }
//!     void load(lockstep::byte_reader& r) { r.read(lr); momentum = r.read_array<float>(); }
//!   };
//! \endcode
template <class T>
concept serializable = requires(const T& ct, T& t, byte_writer& w, byte_reader& r) {
  ct.save(w);
  t.load(r);
};

//! Counters that say where training stands. Resuming continues with the next sample of
//! `epoch` after `sample_position` at optimizer step `step`.
struct checkpoint_meta {
  std::int64_t step = 0;
  std::int64_t epoch = 0;
  std::int64_t sample_position = 0;
  friend bool operator==(const checkpoint_meta&, const checkpoint_meta&) = default;
};

//! One parameter as stored in a checkpoint: name, shape, element type and its bytes
//! (host order of the host that wrote it; checked on load).
struct checkpoint_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  dtype type = dtype::f32;
  std::span<const std::byte> data;

  std::size_t numel() const {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
  std::string shape_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(shape[i]);
    }
    s += "] ";
    return s + name_of(type);
  }
  //! A copy of the values as T (T must match the stored element type).
  template <element T>
  std::vector<T> values() const {
    if (dtype_of<T> != type)
      throw config_error("checkpoint parameter '" + name + "' holds " + name_of(type) +
                         " elements, but was read as " + name_of(dtype_of<T>));
    std::vector<T> v(numel());
    if (!data.empty()) std::memcpy(v.data(), data.data(), data.size());
    return v;
  }
};

namespace detail {
inline void fingerprint_add(fnv1a64& h, std::string_view name, std::span<const std::int64_t> shape,
                            dtype t) {
  h.update_u64(name.size());
  h.update(name.data(), name.size());
  h.update_u64(static_cast<std::uint64_t>(t));
  h.update_u64(shape.size());
  for (auto d : shape) h.update_u64(static_cast<std::uint64_t>(d));
}
}  // namespace detail

//! FNV-1a 64 over each parameter's name, element type and shape, in order (the exact
//! byte sequence is in docs/checkpoint.md). Equal fingerprints: same model layout.
template <std::ranges::input_range R>
  requires std::convertible_to<std::ranges::range_reference_t<R>, const parameter&>
std::uint64_t parameter_fingerprint(R&& params) {
  detail::fnv1a64 h;
  for (const parameter& p : params) detail::fingerprint_add(h, p.name, p.shape, p.type);
  return h.value();
}

class Checkpoint;
inline Checkpoint load_checkpoint(const std::filesystem::path& path);
inline void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck);

// ---------------------------------------------------------------------------------------
//! Checkpoint — an in-memory bundle of parameters, meta counters and named sections.
//! Every add_* is all-or-nothing: if it throws, the bundle is unchanged. Copies are cheap
//! and share the (immutable) bytes.
class Checkpoint {
 public:
  checkpoint_meta meta;

  // --- building ------------------------------------------------------------------------

  //! Copies the values of every parameter (read through `ops`, so they may live in
  //! device memory). Call once per checkpoint.
  template <std::ranges::input_range R, class Ops>
    requires std::convertible_to<std::ranges::range_reference_t<R>, const parameter&> &&
             memory_ops<std::remove_cvref_t<Ops>>
  Checkpoint& add_parameters(R&& params, Ops&& ops) {
    if (has_parameters_)
      throw config_error("Checkpoint::add_parameters called twice; a checkpoint holds one "
                         "model's parameters (pass them all in one range)");
    std::vector<parameter> ps;
    for (const parameter& p : params) ps.push_back(p);
    std::size_t total = 0;
    for (const auto& p : ps) {
      if (p.bytes() != 0 && p.value == nullptr)
        throw config_error("Checkpoint::add_parameters: parameter '" + p.name +
                           "' has no value buffer (value is null)");
      total += p.bytes();
    }
    auto buf = std::shared_ptr<std::byte[]>(new std::byte[total == 0 ? 1 : total]);
    std::vector<checkpoint_tensor> ts;
    ts.reserve(ps.size());
    std::size_t off = 0;
    for (const auto& p : ps) {
      if (p.bytes()) ops.download(buf.get() + off, p.value, p.bytes());
      ts.push_back({p.name, p.shape, p.type, std::span<const std::byte>(buf.get() + off, p.bytes())});
      off += p.bytes();
    }
    params_ = std::move(ts);
    owners_.push_back(std::move(buf));
    has_parameters_ = true;
    return *this;
  }

  //! A named section holding these bytes (copied).
  Checkpoint& add_blob(std::string name, std::span<const std::byte> bytes) {
    return add_blob(std::move(name), std::vector<std::byte>(bytes.begin(), bytes.end()));
  }
  //! A named section taking ownership of `bytes`.
  Checkpoint& add_blob(std::string name, std::vector<std::byte> bytes) {
    check_new_name(name);
    auto owned = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
    blobs_.push_back({std::move(name), std::span<const std::byte>(*owned)});
    owners_.push_back(std::move(owned));
    return *this;
  }
  //! A named section holding text.
  Checkpoint& add_blob(std::string name, std::string_view text) {
    const auto* p = reinterpret_cast<const std::byte*>(text.data());
    return add_blob(std::move(name), std::vector<std::byte>(p, p + text.size()));
  }
  //! A named section written by `obj.save(byte_writer&)`.
  template <serializable T>
  Checkpoint& add(std::string name, const T& obj) {
    check_new_name(name);
    byte_writer w;
    obj.save(w);
    return add_blob(std::move(name), std::move(w).release());
  }
  //! A named section holding the object representation of a trivially copyable value
  //! (e.g. a loss scaler's struct of doubles and counters). Host-specific layout; the
  //! size is checked on restore.
  template <class T>
    requires std::is_trivially_copyable_v<T>
  Checkpoint& add_value(std::string name, const T& v) {
    return add_blob(std::move(name),
                    std::span<const std::byte>(reinterpret_cast<const std::byte*>(&v), sizeof(T)));
  }
  //! A named section holding the text `out << v` writes (classic locale), e.g. the state
  //! of a std::mt19937_64. Restored with `in >> v`.
  template <class T>
    requires requires(std::ostream& o, const T& x) { o << x; }
  Checkpoint& add_streamed(std::string name, const T& v) {
    std::ostringstream out;
    out.imbue(std::locale::classic());
    out << v;
    if (!out)
      throw config_error("Checkpoint::add_streamed: writing section '" + name +
                         "' with operator<< failed");
    return add_blob(std::move(name), std::string_view(out.str()));
  }

  // --- reading -------------------------------------------------------------------------

  bool has_parameters() const noexcept { return has_parameters_; }
  const std::vector<checkpoint_tensor>& parameters() const noexcept { return params_; }
  std::uint64_t fingerprint() const {
    detail::fnv1a64 h;
    for (const auto& t : params_) detail::fingerprint_add(h, t.name, t.shape, t.type);
    return h.value();
  }

  bool contains(std::string_view name) const noexcept { return find(name) != nullptr; }
  std::vector<std::string> section_names() const {
    std::vector<std::string> out;
    for (const auto& b : blobs_) out.push_back(b.name);
    return out;
  }
  //! The bytes of a section; throws checkpoint_error if there is none by that name.
  std::span<const std::byte> blob(std::string_view name) const { return get(name).bytes; }
  std::string blob_text(std::string_view name) const {
    auto b = blob(name);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  //! Loads `obj` from a section written by add(). All-or-nothing when T is copyable.
  template <serializable T>
  void restore(std::string_view name, T& obj) const {
    const auto& s = get(name);
    byte_reader r(s.bytes, describe() + " section '" + s.name + "'");
    auto run = [&](T& target) {
      target.load(r);
      if (!r.at_end())
        throw checkpoint_error(r.what() + ": load() read " + std::to_string(r.position()) +
                               " of its " + std::to_string(s.bytes.size()) +
                               " bytes; save() and load() of this type disagree");
    };
    if constexpr (std::copy_constructible<T> && std::is_move_assignable_v<T>) {
      T tmp(obj);
      run(tmp);
      obj = std::move(tmp);
    } else {
      run(obj);
    }
  }
  template <class T>
    requires std::is_trivially_copyable_v<T>
  void restore_value(std::string_view name, T& v) const {
    const auto& s = get(name);
    if (s.bytes.size() != sizeof(T))
      throw checkpoint_error(describe() + " section '" + s.name + "' holds " +
                             std::to_string(s.bytes.size()) + " bytes, but the value to restore has " +
                             std::to_string(sizeof(T)) +
                             " (a different type, or one whose layout changed since the save)");
    std::memcpy(static_cast<void*>(&v), s.bytes.data(), sizeof(T));
  }
  template <class T>
    requires requires(std::istream& i, T& x) { i >> x; } && std::copy_constructible<T> &&
             std::is_move_assignable_v<T>
  void restore_streamed(std::string_view name, T& v) const {
    const auto& s = get(name);
    std::istringstream in(std::string(reinterpret_cast<const char*>(s.bytes.data()), s.bytes.size()));
    in.imbue(std::locale::classic());
    T tmp(v);
    in >> tmp;
    if (in.fail())
      throw checkpoint_error(describe() + " section '" + s.name +
                             "' could not be read back with operator>> (was it written by "
                             "add_streamed for this type?)");
    v = std::move(tmp);
  }

  //! The file this bundle was loaded from (empty if it was built in memory).
  const std::filesystem::path& source() const noexcept { return source_; }
  //! "checkpoint '<path>'" or "checkpoint" — the subject of error messages.
  std::string describe() const {
    return source_.empty() ? std::string("checkpoint") : "checkpoint '" + source_.string() + "'";
  }

 private:
  struct section {
    std::string name;
    std::span<const std::byte> bytes;
  };

  const section* find(std::string_view name) const noexcept {
    for (const auto& b : blobs_)
      if (b.name == name) return &b;
    return nullptr;
  }
  const section& get(std::string_view name) const {
    if (const auto* s = find(name)) return *s;
    std::string have;
    for (const auto& b : blobs_) have += (have.empty() ? "'" : ", '") + b.name + "'";
    throw checkpoint_error(describe() + " has no section '" + std::string(name) + "' (it has " +
                           (have.empty() ? std::string("none") : have) +
                           "); was it saved with this name?");
  }
  void check_new_name(const std::string& name) const {
    if (name.empty()) throw config_error("Checkpoint: a section needs a non-empty name");
    if (find(name))
      throw config_error("Checkpoint: section '" + name + "' was added twice; names must be unique");
  }

  friend Checkpoint load_checkpoint(const std::filesystem::path& path);
  friend void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck);

  //! Calls sink(ptr, bytes) for each piece of the payload, in order (see docs/checkpoint.md).
  template <class Sink>
  void emit_payload(Sink& sink) const {
    byte_writer w;  // small structural pieces; tensor and section bytes go to the sink directly
    auto flush = [&] {
      sink(w.bytes().data(), w.size());
      w = byte_writer{};
    };
    w.write(meta.step);
    w.write(meta.epoch);
    w.write(meta.sample_position);
    w.write(has_parameters_);
    w.write(static_cast<std::uint64_t>(params_.size()));
    for (const auto& t : params_) {
      w.write_string(t.name);
      w.write(static_cast<std::uint8_t>(t.type));
      w.write_array(std::span<const std::int64_t>(t.shape));
      w.write(static_cast<std::uint64_t>(t.data.size()));
      flush();
      sink(t.data.data(), t.data.size());
    }
    w.write(static_cast<std::uint64_t>(blobs_.size()));
    for (const auto& b : blobs_) {
      w.write_string(b.name);
      w.write(static_cast<std::uint64_t>(b.bytes.size()));
      flush();
      sink(b.bytes.data(), b.bytes.size());
    }
    flush();
  }

  std::vector<checkpoint_tensor> params_;
  bool has_parameters_ = false;
  std::vector<section> blobs_;
  std::vector<std::shared_ptr<const void>> owners_;  // keep the spans' bytes alive
  std::filesystem::path source_;
};

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
    return std::to_string(writer_major) + "." + std::to_string(writer_minor) + "." +
           std::to_string(writer_patch);
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
//! checkpoint_error saying what failed and what to do. (POSIX only.)
inline void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck) {
  namespace fs = std::filesystem;
  const std::string target = path.string();
  if (!path.has_filename())
    throw checkpoint_error("cannot save checkpoint '" + target +
                           "': the path names a directory, not a file; add a file name");
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  static std::atomic<std::uint64_t> counter{0};
  const std::string tmp = target + ".tmp-" + std::to_string(::getpid()) + "-" +
                          std::to_string(counter.fetch_add(1));
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

  auto write_all = [&](const void* p, std::size_t n, off_t at, bool positioned) {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      const std::size_t chunk = std::min<std::size_t>(n, std::size_t{1} << 30);
      const ssize_t k = positioned ? ::pwrite(fd.fd, c, chunk, at) : ::write(fd.fd, c, chunk);
      if (k < 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        throw fail("writing '" + tmp + "' failed: " + detail::file_errno_text(e), io_todo(e));
      }
      c += k;
      at += k;
      n -= static_cast<std::size_t>(k);
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
    throw checkpoint_error("checkpoint '" + target + "' was written, but syncing directory '" +
                           dir.string() + "' failed: " + detail::file_errno_text(e) +
                           " (after a power loss the previous file may reappear; check the "
                           "file system)");
  }
}

// ---------------------------------------------------------------------------------------
//! Reads `path` and verifies it completely (magic, format version, header checksum,
//! length, payload CRC-32, structure, fingerprint) before returning; nothing is applied to
//! any model. Throws checkpoint_error naming the path, the problem and what to do.
inline Checkpoint load_checkpoint(const std::filesystem::path& path) {
  const std::string name = path.string();
  const std::string subject = "checkpoint '" + name + "'";
  const std::string use_other =
      "the file was damaged after it was written (disk, copy or transfer): use an earlier "
      "checkpoint or copy it again";

  detail::unique_fd fd(::open(name.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) {
    const int e = errno;
    throw checkpoint_error("cannot open " + subject + ": " + detail::file_errno_text(e) +
                           (e == ENOENT ? " (check the path; was the checkpoint saved?)" : ""));
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) {
    const int e = errno;
    throw checkpoint_error("cannot stat " + subject + ": " + detail::file_errno_text(e));
  }
  if (!S_ISREG(st.st_mode))
    throw checkpoint_error(subject + " is not a regular file; check the path");
  const auto size = static_cast<std::size_t>(st.st_size);
  auto data = std::shared_ptr<std::byte[]>(new std::byte[size == 0 ? 1 : size]);
  std::size_t got = 0;
  while (got < size) {
    const ssize_t k = ::read(fd.fd, data.get() + got, std::min<std::size_t>(size - got, std::size_t{1} << 30));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      const int e = errno;
      throw checkpoint_error("reading " + subject + " failed: " + detail::file_errno_text(e));
    }
    if (k == 0) break;  // shrank while we read: the checks below report it
    got += static_cast<std::size_t>(k);
  }
  fd.reset();
  const std::byte* b = data.get();
  const std::size_t n = got;
  constexpr std::size_t H = detail::checkpoint_header_bytes;

  // Magic (or as much of it as there is), then truncation of the header.
  const std::size_t magic_seen = std::min<std::size_t>(n, 8);
  if (std::memcmp(b, detail::checkpoint_magic, magic_seen) != 0)
    throw checkpoint_error("'" + name +
                           "' is not a lockstep checkpoint (it does not start with the "
                           "checkpoint magic bytes); check the path");
  if (n < H)
    throw checkpoint_error(subject + " is truncated: it holds " + std::to_string(n) +
                           " bytes, less than the " + std::to_string(H) +
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
  // The version word sits at a fixed offset in every format, so it is checked before the
  // rest of the header (whose layout it decides).
  if (h.format_version != detail::checkpoint_format_version)
    throw checkpoint_error(subject + " has format version " + std::to_string(h.format_version) +
                           " (written by lockstep " + h.writer_version() + "), but lockstep " +
                           version_string + " reads format version " +
                           std::to_string(detail::checkpoint_format_version) +
                           ": load it with a matching lockstep version");
  if (detail::load_le<std::uint32_t>(b + 44) != detail::crc32_of(b, 44) ||
      detail::load_le<std::uint32_t>(b + 20) != H)
    throw checkpoint_error(subject + " has a corrupt header (its checksum does not match): " +
                           use_other);
  if (h.flags != detail::native_tensor_flags())
    throw checkpoint_error(subject + " was written on a host of the other byte order; load it "
                           "on a host like the one that saved it");
  if (h.payload_bytes > n - H)
    throw checkpoint_error(subject + " is truncated: its header announces " +
                           std::to_string(h.payload_bytes) + " payload bytes but only " +
                           std::to_string(n - H) +
                           " follow the header (the write or copy was cut short): use an "
                           "earlier checkpoint or copy it again");
  if (h.payload_bytes < n - H)
    throw checkpoint_error(subject + " has " + std::to_string(n - H - h.payload_bytes) +
                           " unexpected bytes after its payload: " + use_other);
  const std::span<const std::byte> payload(b + H, static_cast<std::size_t>(h.payload_bytes));
  const std::uint32_t crc = detail::crc32_of(payload.data(), payload.size());
  if (crc != h.payload_crc) {
    char msg[64];
    std::snprintf(msg, sizeof msg, "CRC-32 0x%08x, header records 0x%08x", crc, h.payload_crc);
    throw checkpoint_error(subject + " is corrupt: checksum mismatch (payload " + msg + "): " +
                           use_other);
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
    if (numel > std::numeric_limits<std::uint64_t>::max() / size_of(t.type) ||
        bytes != numel * size_of(t.type))
      r.fail("parameter '" + t.name + "' " + t.shape_string() + " stores " +
             std::to_string(bytes) + " bytes, not " + std::to_string(numel * size_of(t.type)));
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
  return ck;
}

// ---------------------------------------------------------------------------------------
//! Writes the checkpoint's parameters into the model's (through `ops`). First checks that
//! the model has the same parameters in the same order (name, shape, element type) and
//! throws checkpoint_error naming the first difference; the model is untouched unless
//! every check passed.
template <std::ranges::input_range R, class Ops>
  requires std::convertible_to<std::ranges::range_reference_t<R>, const parameter&> &&
           memory_ops<std::remove_cvref_t<Ops>>
void restore_parameters(const Checkpoint& ck, R&& params, Ops&& ops) {
  std::vector<parameter> ps;
  for (const parameter& p : params) ps.push_back(p);
  const auto& ts = ck.parameters();
  const std::string subject = ck.describe();
  if (!ck.has_parameters())
    throw checkpoint_error(subject + " holds no parameters (it was saved without "
                           "add_parameters); restore only its sections");
  const std::string todo =
      "; load it into the model it was saved from (same parameters, order, shapes and types)";
  // Field by field rather than by fingerprint alone, to name the first difference (and
  // so that a hash collision can never pass).
  const std::size_t common = std::min(ps.size(), ts.size());
  for (std::size_t i = 0; i < common; ++i) {
    const auto& p = ps[i];
    const auto& t = ts[i];
    if (p.name != t.name || p.shape != t.shape || p.type != t.type)
      throw checkpoint_error(subject + " does not match the model at parameter #" +
                             std::to_string(i) + ": the checkpoint has '" + t.name + "' " +
                             t.shape_string() + ", the model has '" + p.name + "' " +
                             p.shape_string() + todo);
  }
  if (ps.size() != ts.size()) {
    const std::string extra = ps.size() > ts.size()
                                  ? "the model's '" + ps[common].name + "' is not in the checkpoint"
                                  : "the checkpoint's '" + ts[common].name + "' is not in the model";
    throw checkpoint_error(subject + " holds " + std::to_string(ts.size()) +
                           " parameters but the model has " + std::to_string(ps.size()) +
                           " (parameter #" + std::to_string(common) + ": " + extra + ")" + todo);
  }
  for (const auto& p : ps)
    if (p.bytes() != 0 && p.value == nullptr)
      throw config_error("restore_parameters: parameter '" + p.name + "' has no value buffer");
  for (std::size_t i = 0; i < ps.size(); ++i)
    if (ps[i].bytes()) ops.upload(ps[i].value, ts[i].data.data(), ps[i].bytes());
}

// ---------------------------------------------------------------------------------------
//! Rank 0 calls `build(Checkpoint&)` and saves the result to `path`; the other ranks do
//! neither. Every rank returns only once rank 0 has finished (the file is in place, so
//! any rank may load it next), and if rank 0 failed every rank throws: rank 0 its own
//! error, the others a checkpoint_error that points to it. Collective: every rank calls it.
template <communicator C, class Build>
  requires std::invocable<Build&, Checkpoint&>
void save_checkpoint_rank0(C& comm, const std::filesystem::path& path, Build&& build) {
  std::exception_ptr failure;
  if (comm.rank() == 0) {
    try {
      Checkpoint ck;
      build(ck);
      save_checkpoint(path, ck);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // The status exchange is also the barrier: no rank leaves before rank 0 is done.
  std::int32_t status = failure ? 1 : 0;
  detail::host_all_reduce(comm, std::span<std::int32_t>(&status, 1), reduce_op::max);
  if (failure) std::rethrow_exception(failure);
  if (status != 0)
    throw checkpoint_error("rank 0 failed to save checkpoint '" + path.string() +
                           "' (rank 0's error says why); no new checkpoint was written and the "
                           "previous one at that path, if any, is unchanged");
}

//! Same, for a checkpoint already built on every rank (only rank 0's is written).
template <communicator C>
void save_checkpoint_rank0(C& comm, const std::filesystem::path& path, const Checkpoint& ck) {
  save_checkpoint_rank0(comm, path, [&](Checkpoint& out) { out = ck; });
}

}  // namespace lockstep
