#pragma once
//! The byte codec of every saved state: byte_writer / byte_reader (a fixed little-endian
//! encoding, so what one host writes reads the same on any other) and the serializable
//! concept. Checkpoint sections, optimizer states and anything users add are written with it.

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/detail/byte_io.hpp"

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
    write_elements(v);
  }
  template <detail::le_scalar T>
  void write_array(const std::vector<T>& v) {
    write_array(std::span<const T>(v));
  }
  //! The elements alone, little-endian, no count (the reader knows it from elsewhere).
  template <detail::le_scalar T>
  void write_elements(std::span<const T> v) {
    if constexpr (std::endian::native == std::endian::little) {
      write_bytes(v.data(), v.size_bytes());
    } else {
      for (const T& x : v) write(x);
    }
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
      fail("needs " + std::to_string(n) + " more bytes but only " + std::to_string(remaining()) + " remain");
    auto s = data_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  //! The next n bytes without reading them (fewer when fewer remain).
  std::span<const std::byte> peek(std::size_t n) const noexcept {
    return data_.subspan(pos_, n < remaining() ? n : remaining());
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
      fail("holds an array of " + std::to_string(n) + " elements where " + std::to_string(out.size()) +
           " were expected (was it saved from a different model?)");
    read_elements(out);
  }

  //! Reads out.size() elements written by write_elements (no count in the data).
  template <detail::le_scalar T>
  void read_elements(std::span<T> out) {
    if (out.size() > remaining() / sizeof(T))
      fail("needs " + std::to_string(out.size()) + " elements of " + std::to_string(sizeof(T)) + " bytes but only " +
           std::to_string(remaining()) + " bytes remain");
    if constexpr (std::endian::native == std::endian::little) {
      read_bytes(out.data(), out.size_bytes());
    } else {
      for (T& x : out) x = read<T>();
    }
  }
  //! Reads n bytes that must equal `expected` (a format's magic); names `who` otherwise.
  void expect_magic(std::string_view expected, std::string_view who) {
    auto got = take(expected.size());
    if (std::memcmp(got.data(), expected.data(), expected.size()) != 0)
      fail("does not start with \"" + std::string(expected) + "\": it was not written by " + std::string(who));
  }
  //! Throws unless every byte was read.
  void expect_end() const {
    if (!at_end()) fail("has " + std::to_string(remaining()) + " bytes after its end");
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
      fail("holds an array of " + std::to_string(n) + " elements of " + std::to_string(sizeof(T)) +
           " bytes, past its end");
    return static_cast<std::size_t>(n);
  }
  std::span<const std::byte> data_;
  std::size_t pos_ = 0;
  std::string what_;
};

// ---------------------------------------------------------------------------------------
//! lockstep::serializable — state that goes into a checkpoint section (lockstep's optimizers,
//! a sampler, your own state, ...).
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
//!   struct MyOptimizerState {
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

//! The bytes `t.save` writes (e.g. to keep a state in memory or send it elsewhere).
template <serializable T>
std::vector<std::byte> to_bytes(const T& t) {
  byte_writer w;
  t.save(w);
  return std::move(w).release();
}

//! Loads what to_bytes wrote; checkpoint_error (naming `what`) if it does not read exactly
//! all of `bytes`.
template <serializable T>
void from_bytes(T& t, std::span<const std::byte> bytes, std::string what = "state") {
  byte_reader r(bytes, std::move(what));
  t.load(r);
  r.expect_end();
}

}  // namespace lockstep
