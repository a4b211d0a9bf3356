#pragma once
//! Little-endian encoding of scalars, so checkpoint structure reads the same on any host.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace lockstep::detail {

//! Scalars with a fixed little-endian encoding: integers, float/double, enums (not bool,
//! whose byte must be validated on reading).
template <class T>
concept le_scalar = (std::is_arithmetic_v<T> || std::is_enum_v<T>) && !std::is_same_v<T, bool> &&
                    (sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8);

template <std::size_t N>
struct uint_of_size;
template <>
struct uint_of_size<1> {
  using type = std::uint8_t;
};
template <>
struct uint_of_size<2> {
  using type = std::uint16_t;
};
template <>
struct uint_of_size<4> {
  using type = std::uint32_t;
};
template <>
struct uint_of_size<8> {
  using type = std::uint64_t;
};

template <le_scalar T>
void store_le(std::byte* dst, T v) noexcept {
  using U = typename uint_of_size<sizeof(T)>::type;
  const U u = std::bit_cast<U>(v);
  for (std::size_t i = 0; i < sizeof(T); ++i) dst[i] = static_cast<std::byte>(u >> (8 * i));
}

template <le_scalar T>
T load_le(const std::byte* src) noexcept {
  using U = typename uint_of_size<sizeof(T)>::type;
  U u = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) u |= static_cast<U>(static_cast<U>(src[i]) << (8 * i));
  return std::bit_cast<T>(u);
}

}  // namespace lockstep::detail
