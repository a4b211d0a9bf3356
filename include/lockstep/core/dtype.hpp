#pragma once
//! Element types that gradients and collectives carry, as a run-time tag.
//! Storage types for half and bfloat16 live with the backends that compute on them;
//! the tag and size are enough for arenas, buckets and communicators.

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "lockstep/core/error.hpp"

namespace lockstep {

enum class dtype : std::uint8_t { u8, i32, i64, f16, bf16, f32, f64 };

inline constexpr std::size_t size_of(dtype t) {
  switch (t) {
    case dtype::u8: return 1;
    case dtype::f16:
    case dtype::bf16: return 2;
    case dtype::i32:
    case dtype::f32: return 4;
    case dtype::i64:
    case dtype::f64: return 8;
  }
  return 0;
}

inline constexpr const char* name_of(dtype t) {
  switch (t) {
    case dtype::u8: return "u8";
    case dtype::i32: return "i32";
    case dtype::i64: return "i64";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::f32: return "f32";
    case dtype::f64: return "f64";
  }
  return "?";
}

inline constexpr bool is_floating(dtype t) {
  return t == dtype::f16 || t == dtype::bf16 || t == dtype::f32 || t == dtype::f64;
}

//! dtype_of<T>: the tag for a C++ element type. Backends specialise dtype_traits for
//! their own half/bfloat16 storage types (e.g. __half, __nv_bfloat16).
template <class T>
struct dtype_traits;
template <>
struct dtype_traits<std::uint8_t> : std::integral_constant<dtype, dtype::u8> {};
template <>
struct dtype_traits<char> : std::integral_constant<dtype, dtype::u8> {};
template <>
struct dtype_traits<std::int32_t> : std::integral_constant<dtype, dtype::i32> {};
template <>
struct dtype_traits<std::int64_t> : std::integral_constant<dtype, dtype::i64> {};
template <>
struct dtype_traits<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct dtype_traits<double> : std::integral_constant<dtype, dtype::f64> {};

template <class T>
concept element = requires { dtype_traits<std::remove_cv_t<T>>::value; };

template <element T>
inline constexpr dtype dtype_of = dtype_traits<std::remove_cv_t<T>>::value;

//! Whether the host can compute on elements of t (f16/bf16 have no host arithmetic here).
inline constexpr bool has_host_arithmetic(dtype t) { return t != dtype::f16 && t != dtype::bf16; }

//! Throws config_error unless the host can compute on elements of t; `who` names the caller.
inline void require_host_arithmetic(dtype t, const char* who) {
  if (!has_host_arithmetic(t))
    throw config_error(std::string(who) + ": element type " + name_of(t) +
                       " has no host arithmetic in this build; use f32/f64 on the CPU or a "
                       "CUDA communicator for half precision");
}

//! Calls f(T{}) with the C++ type of a host-computable dtype; throws for the others.
template <class F>
decltype(auto) visit_host_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::u8: return f(std::uint8_t{});
    case dtype::i32: return f(std::int32_t{});
    case dtype::i64: return f(std::int64_t{});
    case dtype::f32: return f(float{});
    case dtype::f64: return f(double{});
    default: break;
  }
  require_host_arithmetic(t, "lockstep");
  throw config_error(std::string("element type ") + name_of(t) + " is unknown");
}

}  // namespace lockstep
