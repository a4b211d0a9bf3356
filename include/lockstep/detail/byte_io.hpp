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

//! The unsigned integer of N bytes (N: 1, 2, 4 or 8, as le_scalar allows).
template <std::size_t N>
using uint_of_size = std::conditional_t<
    N == 1, std::uint8_t,
    std::conditional_t<N == 2, std::uint16_t, std::conditional_t<N == 4, std::uint32_t, std::uint64_t>>>;

template <le_scalar T>
void store_le(std::byte* dst, T v) noexcept {
  using U = uint_of_size<sizeof(T)>;
  const U u = std::bit_cast<U>(v);
  for (std::size_t i = 0; i < sizeof(T); ++i) dst[i] = static_cast<std::byte>(u >> (8 * i));
}

template <le_scalar T>
T load_le(const std::byte* src) noexcept {
  using U = uint_of_size<sizeof(T)>;
  U u = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) u |= static_cast<U>(static_cast<U>(src[i]) << (8 * i));
  return std::bit_cast<T>(u);
}

}  // namespace lockstep::detail
