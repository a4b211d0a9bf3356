// 16-bit floats on the host (core/detail/half.hpp): every bit pattern round-trips, random floats
// round to the nearest representable value (ties to even) by brute force against a decoder
// written here independently, and HostMemory scales and packs halves through float.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <lockstep/core/detail/half.hpp>
#include <lockstep/core/host_memory.hpp>

#include "test_util.hpp"

namespace {

// Independent decoders: the value of each code from its fields (sign, ExpBits of exponent with
// bias 2^(ExpBits-1) - 1, the other 15 - ExpBits bits of mantissa), in double.
template <int ExpBits>
double value_of(std::uint16_t b) {
  constexpr int man_bits = 15 - ExpBits, max_e = (1 << ExpBits) - 1, bias = max_e / 2;
  const int e = (b >> man_bits) & max_e, m = b & ((1 << man_bits) - 1);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const double v = e == 0       ? std::ldexp(m, 1 - bias - man_bits)
                   : e == max_e ? (m ? nan : inf)
                                : std::ldexp((1 << man_bits) + m, e - bias - man_bits);
  return (b & 0x8000) ? -v : v;
}
double f16_value(std::uint16_t b) { return value_of<5>(b); }   // e 0x1f << 10, m 0x3ff
double bf16_value(std::uint16_t b) { return value_of<8>(b); }  // e 0xff << 7, m 0x7f

// The nearest code to x among the finite non-negative codes (ascending values), ties to the
// even code; beyond the largest finite value by half an ulp or more: inf.
std::uint16_t nearest(double x, double (*value)(std::uint16_t), std::uint16_t inf_code) {
  const bool neg = std::signbit(x);
  const double a = std::fabs(x);
  std::uint16_t lo = 0, hi = inf_code;  // value(lo) <= a < value(hi)
  while (hi - lo > 1) {
    const auto mid = static_cast<std::uint16_t>((lo + hi) / 2);
    (value(mid) <= a ? lo : hi) = mid;
  }
  const double top = value(static_cast<std::uint16_t>(inf_code - 1));
  std::uint16_t r;
  if (hi == inf_code) {
    const double ulp = top - value(static_cast<std::uint16_t>(inf_code - 2));
    r = a - top < ulp / 2 || (a - top == ulp / 2 && ((inf_code - 1) & 1) == 0)
            ? static_cast<std::uint16_t>(inf_code - 1)
            : inf_code;
  } else {
    const double dl = a - value(lo), dh = value(hi) - a;
    r = dl < dh ? lo : dh < dl ? hi : ((lo & 1) == 0 ? lo : hi);
  }
  return static_cast<std::uint16_t>(r | (neg ? 0x8000 : 0));
}

// Code h decodes (to_float) to its value by the decoder here and encodes (of_float) back to
// itself; a NaN code decodes to NaN and encodes to a NaN code.
void check_code(std::uint16_t h, double (*value)(std::uint16_t), auto to_float, auto of_float) {
  if (std::isnan(value(h))) {
    CHECK(std::isnan(to_float(h)));
    CHECK(std::isnan(value(of_float(to_float(h)))));
  } else {
    REQUIRE(static_cast<double>(to_float(h)) == value(h));
    REQUIRE(of_float(to_float(h)) == h);
  }
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("halves: every code decodes to its value and encodes back to itself") {
  using namespace lockstep::detail;
  for (std::uint32_t c = 0; c <= 0xffff; ++c) {
    const auto h = static_cast<std::uint16_t>(c);
    CAPTURE(c);
    check_code(h, f16_value, float_of_f16, f16_of_float);
    check_code(h, bf16_value, float_of_bf16, bf16_of_float);
  }
}

TEST_CASE("halves: random floats round to the nearest code - ties to even") {
  using namespace lockstep::detail;
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  std::uniform_int_distribution<int> exponent(-30, 18);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  for (int k = 0; k < 200000; ++k) {
    float x = static_cast<float>(std::ldexp(mantissa(rng), exponent(rng)));
    if (k % 7 == 0) {  // exact halfway points between neighbouring f16 / bf16 codes
      const auto h = static_cast<std::uint16_t>(rng() % 0x7bff);
      x = static_cast<float>((f16_value(h) + f16_value(static_cast<std::uint16_t>(h + 1))) / 2);
    }
    if (rng() & 1) x = -x;
    CAPTURE(x);
    REQUIRE(f16_of_float(x) == nearest(x, f16_value, 0x7c00));
    REQUIRE(bf16_of_float(x) == nearest(x, bf16_value, 0x7f80));
  }
  CHECK(f16_of_float(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(f16_of_float(65520.0f) == 0x7c00);  // halfway to the next binade rounds to even: inf
  CHECK(f16_of_float(65519.0f) == 0x7bff);
  CHECK(bf16_of_float(-std::numeric_limits<float>::infinity()) == 0xff80);
}

TEST_CASE("halves: HostMemory scales and packs f16 and bf16 in float - rounding once") {
  using namespace lockstep::detail;
  std::mt19937_64 rng(lockstep_test::fresh_seed());
  lockstep::HostMemory mem;
  for (auto t : {lockstep::dtype::f16, lockstep::dtype::bf16}) {
    CAPTURE(std::string(lockstep::name_of(t)));
    auto enc = t == lockstep::dtype::f16 ? &f16_of_float : &bf16_of_float;
    auto dec = t == lockstep::dtype::f16 ? &float_of_f16 : &float_of_bf16;
    std::vector<std::uint16_t> a(101), b(37);
    for (auto& v : a) v = enc(static_cast<float>(std::uniform_real_distribution<double>(-3, 3)(rng)));
    for (auto& v : b) v = enc(static_cast<float>(std::uniform_real_distribution<double>(-3, 3)(rng)));
    const double s = 0.125 * (1 + static_cast<double>(rng() % 7));
    std::vector<std::uint16_t> packed(a.size() + b.size());
    const lockstep::segment segs[2] = {{a.data(), a.size()}, {b.data(), b.size()}};
    mem.pack(segs, packed.data(), t, s);
    for (std::size_t i = 0; i < packed.size(); ++i) {
      const std::uint16_t in = i < a.size() ? a[i] : b[i - a.size()];
      REQUIRE(packed[i] == enc(dec(in) * static_cast<float>(s)));
    }
    auto c = a;
    mem.scale(c.data(), c.size(), t, s);
    for (std::size_t i = 0; i < c.size(); ++i) REQUIRE(c[i] == enc(dec(a[i]) * static_cast<float>(s)));
    mem.pack(segs, packed.data(), t, 1.0);  // a copy
    CHECK(std::equal(a.begin(), a.end(), packed.begin()));
  }
}

}  // TEST_SUITE
