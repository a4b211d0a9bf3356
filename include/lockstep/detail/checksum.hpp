#pragma once
//! Checksums: CRC-32 over a checkpoint's payload and the store's frames, CRC-32C over
//! TensorBoard's records, FNV-1a 64 for the parameter fingerprint. All are incremental (feed
//! bytes in any number of pieces).

#include <array>
#include <cstddef>
#include <cstdint>

namespace lockstep::detail {

using crc32_table_set = std::array<std::array<std::uint32_t, 256>, 8>;

//! For a reflected polynomial: t[0] the byte-wise table; t[k][i] the CRC of byte i followed
//! by k zero bytes.
constexpr crc32_table_set make_crc32_tables(std::uint32_t poly) {
  crc32_table_set t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  return t;
}
template <std::uint32_t Poly>
inline constexpr crc32_table_set crc32_tables = make_crc32_tables(Poly);

//! A 32-bit CRC with reflected polynomial Poly, initial value 0xFFFFFFFF and final XOR
//! 0xFFFFFFFF. Table-driven "slicing-by-8" (eight 256-entry tables, eight bytes per step;
//! Kounavis & Berry, "A Systematic Approach to Building High Performance Software-based CRC
//! Generators", ISCC 2005), so checksumming a large checkpoint costs little next to writing it.
template <std::uint32_t Poly>
class basic_crc32 {
 public:
  void update(const void* data, std::size_t n) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    std::uint32_t c = state_;
    const auto& t = crc32_tables<Poly>;
    while (n >= 8) {
      const std::uint32_t lo =
          c ^ (std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 | std::uint32_t{p[3]} << 24);
      c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][p[4]] ^
          t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
      p += 8;
      n -= 8;
    }
    while (n--) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    state_ = c;
  }
  std::uint32_t value() const noexcept { return state_ ^ 0xFFFFFFFFu; }

 private:
  std::uint32_t state_ = 0xFFFFFFFFu;
};

//! CRC-32 as in IEEE 802.3 / zlib / PNG / gzip (check value for "123456789": 0xCBF43926).
using crc32 = basic_crc32<0xEDB88320u>;
//! CRC-32C, Castagnoli (iSCSI, TFRecord; check value for "123456789": 0xE3069283).
using crc32c = basic_crc32<0x82F63B78u>;

inline std::uint32_t crc32_of(const void* data, std::size_t n) noexcept {
  crc32 c;
  c.update(data, n);
  return c.value();
}
inline std::uint32_t crc32c_of(const void* data, std::size_t n) noexcept {
  crc32c c;
  c.update(data, n);
  return c.value();
}

//! FNV-1a, 64-bit (Fowler, Noll & Vo; offset basis 0xcbf29ce484222325, prime 2^40 + 0x1b3).
//! Not cryptographic: it fingerprints structure (names, shapes, types), it does not
//! authenticate.
class fnv1a64 {
 public:
  void update(const void* data, std::size_t n) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h_ = (h_ ^ p[i]) * 0x100000001b3ULL;
  }
  //! Feeds v as 8 little-endian bytes, so the hash is the same on every host.
  void update_u64(std::uint64_t v) noexcept {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    update(b, 8);
  }
  std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ULL;
};

}  // namespace lockstep::detail
