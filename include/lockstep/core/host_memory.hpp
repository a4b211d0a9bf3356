#pragma once
//! HostMemory — memory_ops for communicators whose buffers live in host memory.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/detail/half.hpp"

namespace lockstep {

struct HostMemory {
  std::shared_ptr<void> allocate(std::size_t bytes) const {
    std::size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, rounded == 0 ? 64 : rounded);
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }
  void upload(void* dst, const void* src, std::size_t bytes) const { copy(dst, src, bytes); }
  void download(void* dst, const void* src, std::size_t bytes) const { copy(dst, src, bytes); }
  void zero(void* p, std::size_t bytes) const {
    if (bytes) std::memset(p, 0, bytes);
  }
  void pack(std::span<const segment> src, void* dst, dtype t, double s) const {
    if (detail::is_half(t) && s != 1.0) {  // computed in float, rounded once
      detail::with_half_codec(t, [&](auto to_float, auto from_float) {
        auto* out = static_cast<std::uint16_t*>(dst);
        const float f = static_cast<float>(s);
        for (const auto& seg : src) {
          const auto* in = static_cast<const std::uint16_t*>(seg.ptr);
          for (std::size_t i = 0; i < seg.count; ++i) out[i] = from_float(to_float(in[i]) * f);
          out += seg.count;
        }
      });
      return;
    }
    if (detail::is_half(t)) {
      auto* out = static_cast<unsigned char*>(dst);
      for (const auto& seg : src) {
        copy(out, seg.ptr, seg.count * size_of(t));
        out += seg.count * size_of(t);
      }
      return;
    }
    visit_host_dtype(t, [&]<class T>(T) {
      T* out = static_cast<T*>(dst);
      for (const auto& seg : src) {
        const T* in = static_cast<const T*>(seg.ptr);
        if (s == 1.0) {
          copy(out, in, seg.count * sizeof(T));
        } else {
          const T f = static_cast<T>(s);
          for (std::size_t i = 0; i < seg.count; ++i) out[i] = in[i] * f;
        }
        out += seg.count;
      }
    });
  }
  void unpack(const void* src, std::span<const segment> dst, dtype t) const {
    const auto* in = static_cast<const unsigned char*>(src);
    for (const auto& seg : dst) {
      copy(seg.ptr, in, seg.count * size_of(t));
      in += seg.count * size_of(t);
    }
  }
  void scale(void* p, std::size_t count, dtype t, double s) const {
    if (s == 1.0) return;
    if (detail::is_half(t)) {
      detail::with_half_codec(t, [&](auto to_float, auto from_float) {
        auto* x = static_cast<std::uint16_t*>(p);
        const float f = static_cast<float>(s);
        for (std::size_t i = 0; i < count; ++i) x[i] = from_float(to_float(x[i]) * f);
      });
      return;
    }
    visit_host_dtype(t, [&]<class T>(T) {
      T* x = static_cast<T*>(p);
      const T f = static_cast<T>(s);
      for (std::size_t i = 0; i < count; ++i) x[i] *= f;
    });
  }
  //! dst ← dst + src (count elements of t; halves summed in float, rounded once).
  void add(void* dst, const void* src, std::size_t count, dtype t) const {
    if (detail::is_half(t)) {
      detail::with_half_codec(t, [&](auto to_float, auto from_float) {
        auto* x = static_cast<std::uint16_t*>(dst);
        const auto* y = static_cast<const std::uint16_t*>(src);
        for (std::size_t i = 0; i < count; ++i) x[i] = from_float(to_float(x[i]) + to_float(y[i]));
      });
      return;
    }
    visit_host_dtype(t, [&]<class T>(T) {
      T* x = static_cast<T*>(dst);
      const T* y = static_cast<const T*>(src);
      for (std::size_t i = 0; i < count; ++i) x[i] += y[i];
    });
  }
  //! dst ← src rounded to dst_t (to nearest, ties to even): between f32, f64 and the 16-bit
  //! floats (through float), or a copy when the types are the same.
  void convert(void* dst, dtype dst_t, const void* src, dtype src_t, std::size_t count) const {
    if (dst_t == src_t) return copy(dst, src, count * size_of(dst_t));
    if (!is_floating(dst_t) || !is_floating(src_t))
      throw config_error(std::string("HostMemory::convert: ") + name_of(src_t) + " -> " + name_of(dst_t) +
                         " is not a conversion between floating types");
    const auto read = [&](std::size_t i) -> double {
      if (detail::is_half(src_t))
        return detail::with_half_codec(
            src_t, [&](auto to_float, auto) { return double{to_float(static_cast<const std::uint16_t*>(src)[i])}; });
      if (src_t == dtype::f64) return static_cast<const double*>(src)[i];
      return static_cast<const float*>(src)[i];
    };
    for (std::size_t i = 0; i < count; ++i) {
      const double v = read(i);
      if (detail::is_half(dst_t))
        static_cast<std::uint16_t*>(dst)[i] =
            detail::with_half_codec(dst_t, [&](auto, auto from_float) { return from_float(static_cast<float>(v)); });
      else if (dst_t == dtype::f64) static_cast<double*>(dst)[i] = v;
      else static_cast<float*>(dst)[i] = static_cast<float>(v);
    }
  }

 private:
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes && dst != src) std::memmove(dst, src, bytes);
  }
};
static_assert(memory_ops_with_add<HostMemory> && memory_ops_with_convert<HostMemory>);

}  // namespace lockstep
