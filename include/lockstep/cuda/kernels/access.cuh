#pragma once
//! The device-side vocabulary of the kernel engine: what an element type is stored as and
//! computed in (element_traits), fragments of N elements in registers, and the vector loads
//! and stores that move them. Nothing here launches anything.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::cuda::kernels {

// ---- element types: storage bits, compute type, conversions --------------------------------

//! element_traits<Element>: storage_t (what memory holds; halves as raw 16-bit patterns, so
//! they are trivially copyable and vectorise), compute_t (f32 for halves and f32, f64 for f64)
//! and the conversions between them, rounding to nearest even.
template <class Element>
struct element_traits;
template <>
struct element_traits<float> {
  using storage_t = float;
  using compute_t = float;
  __device__ static float to_compute(float x) { return x; }
  __device__ static float to_storage(float x) { return x; }
  __device__ static bool finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
};
template <>
struct element_traits<double> {
  using storage_t = double;
  using compute_t = double;
  __device__ static double to_compute(double x) { return x; }
  __device__ static double to_storage(double x) { return x; }
  __device__ static bool finite(double x) {
    return (static_cast<unsigned long long>(__double_as_longlong(x)) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
  }
};
template <>
struct element_traits<__half> {
  using storage_t = unsigned short;
  using compute_t = float;
  __device__ static float to_compute(unsigned short b) { return __half2float(__ushort_as_half(b)); }
  __device__ static unsigned short to_storage(float x) { return __half_as_ushort(__float2half_rn(x)); }
  __device__ static bool finite(unsigned short b) { return (b & 0x7c00u) != 0x7c00u; }
};
template <>
struct element_traits<__nv_bfloat16> {
  using storage_t = unsigned short;
  using compute_t = float;
  __device__ static float to_compute(unsigned short b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  __device__ static unsigned short to_storage(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
  __device__ static bool finite(unsigned short b) { return (b & 0x7f80u) != 0x7f80u; }
};
template <class Element>
using storage_of = typename element_traits<Element>::storage_t;
template <class Element>
using compute_of = typename element_traits<Element>::compute_t;

//! Calls f(std::type_identity<Element>{}) for a floating dtype's device type.
template <class F>
void visit_float(dtype t, const char* who, F&& f) {
  switch (t) {
    case dtype::f32: f(std::type_identity<float>{}); return;
    case dtype::f64: f(std::type_identity<double>{}); return;
    case dtype::f16: f(std::type_identity<__half>{}); return;
    case dtype::bf16: f(std::type_identity<__nv_bfloat16>{}); return;
    default: break;
  }
  throw config_error(std::string(who) + " works on f16, bf16, f32 and f64 elements, not " + name_of(t));
}

//! Unsigned storage of a given byte size, for type-blind copies.
template <std::size_t Bytes>
struct raw_bits;
template <>
struct raw_bits<1> {
  using type = unsigned char;
};
template <>
struct raw_bits<2> {
  using type = unsigned short;
};
template <>
struct raw_bits<4> {
  using type = unsigned int;
};
template <>
struct raw_bits<8> {
  using type = unsigned long long;
};

//! Calls f(std::type_identity<raw_bits<size_of(t)>::type>{}) for any dtype.
template <class F>
void visit_size(dtype t, F&& f) {
  switch (size_of(t)) {
    case 1: f(std::type_identity<unsigned char>{}); return;
    case 2: f(std::type_identity<unsigned short>{}); return;
    case 4: f(std::type_identity<unsigned int>{}); return;
    case 8: f(std::type_identity<unsigned long long>{}); return;
    default: break;
  }
  throw config_error(std::string("unknown element type ") + name_of(t));
}

// ---- vector accesses ---------------------------------------------------------------------

//! N elements of Storage moved as one aligned access (several 16-byte ones when larger).
template <class Storage, int N>
struct alignas(sizeof(Storage) * N) pack_of {
  Storage v[N];
};

//! The machine word of one access of a fragment's size (≤ 16 bytes, or a multiple of 16).
template <std::size_t Bytes>
struct access_word {
  using type = uint4;
};
template <>
struct access_word<8> {
  using type = uint2;
};
template <>
struct access_word<4> {
  using type = unsigned int;
};
template <>
struct access_word<2> {
  using type = unsigned short;
};
template <>
struct access_word<1> {
  using type = unsigned char;
};

template <class Fragment>
__device__ __forceinline__ Fragment load_as(const void* at) {
  using word_t = typename access_word<sizeof(Fragment)>::type;
  static_assert(sizeof(Fragment) <= 16 ? sizeof(word_t) == sizeof(Fragment) : sizeof(Fragment) % 16 == 0);
  constexpr int words = sizeof(Fragment) <= 16 ? 1 : sizeof(Fragment) / 16;
  word_t w[words];
#pragma unroll
  for (int k = 0; k < words; ++k) w[k] = static_cast<const word_t*>(at)[k];
  Fragment f;
  __builtin_memcpy(&f, w, sizeof f);  // registers only: no memory traffic
  return f;
}

//! 16-byte stores go through inline PTX: nvcc 13.0 split plain ones (struct or uint4) into
//! four 4-byte stores in some unrolled positions (49 STG.E and no STG.E.128 in the SASS of
//! the two-list ops): four times the store instructions and partial-sector writes.
template <class Fragment>
__device__ __forceinline__ void store_as(void* at, const Fragment& f) {
  using word_t = typename access_word<sizeof(Fragment)>::type;
  static_assert(sizeof(Fragment) <= 16 ? sizeof(word_t) == sizeof(Fragment) : sizeof(Fragment) % 16 == 0);
  constexpr int words = sizeof(Fragment) <= 16 ? 1 : sizeof(Fragment) / 16;
  word_t w[words];
  __builtin_memcpy(w, &f, sizeof f);
#pragma unroll
  for (int k = 0; k < words; ++k) {
    if constexpr (sizeof(word_t) == 16)  // the one form the compiler never splits
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(static_cast<word_t*>(at) + k), "r"(w[k].x),
                   "r"(w[k].y), "r"(w[k].z), "r"(w[k].w)
                   : "memory");
    else static_cast<word_t*>(at)[k] = w[k];
  }
}
template <int N, class Storage>
__device__ __forceinline__ pack_of<Storage, N> load_pack(const void* base, std::size_t i) {
  return load_as<pack_of<Storage, N>>(static_cast<const Storage*>(base) + i);
}
template <int N, class Storage>
__device__ __forceinline__ void store_pack(void* base, std::size_t i, const pack_of<Storage, N>& x) {
  store_as(static_cast<Storage*>(base) + i, x);
}

// ---- fragments of float elements -----------------------------------------------------------

//! Two 16-bit floats packed in a 32-bit word (element i in the low half), converted a pair at
//! a time: one register per pair rather than one per element, so a thread can hold a whole
//! chunk's share of loads. The conversions round as element_traits' (to nearest even).
template <class Element>
struct pair_ops;
template <>
struct pair_ops<__nv_bfloat16> {
  static constexpr unsigned exponents = 0x7f807f80u, unit = 0x00800080u;
  __device__ static float2 unpack(unsigned w) { return {__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)}; }
  __device__ static unsigned pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    unsigned w;
    __builtin_memcpy(&w, &h, sizeof w);
    return w;
  }
};
template <>
struct pair_ops<__half> {
  static constexpr unsigned exponents = 0x7c007c00u, unit = 0x04000400u;
  __device__ static float2 unpack(unsigned w) {
    __half2 h;
    __builtin_memcpy(&h, &w, sizeof w);
    return __half22float2(h);
  }
  __device__ static unsigned pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    unsigned w;
    __builtin_memcpy(&w, &h, sizeof w);
    return w;
  }
};

//! N elements of Element in registers: pairs of 16-bit floats per word when N is even, else
//! one element of storage per slot.
template <class Element, int N>
inline constexpr bool paired = sizeof(storage_of<Element>) == 2 && N % 2 == 0;
template <class Element, int N>
using vfrag =
    std::conditional_t<paired<Element, N>, pack_of<unsigned, N / 2 + (N % 2)>, pack_of<storage_of<Element>, N>>;

//! v[j] ← f(v[j]) for each element in order, f on the compute type (one rounding to Element).
template <class Element, int N, class F>
__device__ __forceinline__ void map_elems(vfrag<Element, N>& v, F&& f) {
  using traits = element_traits<Element>;
  if constexpr (paired<Element, N>) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x = pair_ops<Element>::unpack(v.v[j]);
      v.v[j] = pair_ops<Element>::pack(f(x.x), f(x.y));
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v.v[j] = traits::to_storage(f(traits::to_compute(v.v[j])));
  }
}
//! f(v[j]) for each element in order, on the compute type.
template <class Element, int N, class F>
__device__ __forceinline__ void visit_elems(const vfrag<Element, N>& v, F&& f) {
  using traits = element_traits<Element>;
  if constexpr (paired<Element, N>) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      const float2 x = pair_ops<Element>::unpack(v.v[j]);
      f(x.x);
      f(x.y);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) f(traits::to_compute(v.v[j]));
  }
}
//! Nonzero when an element of v is inf or NaN (an all-ones exponent). For pairs, one unit
//! added to each half's masked exponent carries into that half's top bit only from all ones.
template <class Element, int N>
__device__ __forceinline__ unsigned nonfinite(const vfrag<Element, N>& v) {
  unsigned any = 0;
  if constexpr (paired<Element, N>) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) any |= (v.v[j] & pair_ops<Element>::exponents) + pair_ops<Element>::unit;
    return any & 0x80008000u;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) any |= element_traits<Element>::finite(v.v[j]) ? 0u : 1u;
    return any;
  }
}

}  // namespace lockstep::cuda::kernels
