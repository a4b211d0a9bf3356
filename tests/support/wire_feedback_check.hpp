#pragma once
// The host's numbers for the gradient wires' error feedback (WireOptions::error_feedback,
// parallel/detail/wire_feedback.hpp), written out here from its definition: a case of several
// calls of a wire's all-reduce and reduce-scatter on the same buckets, and the check of what
// every rank got against the schedule with every rank's residuals kept here. CPU ranks
// (tests/cpu/test_wire_cpu.cpp) and GPUs (tests/cuda/test_wire.cu) are checked against it.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include <doctest/doctest.h>

#include "test_util.hpp"
#include "value_wire_check.hpp"

namespace lockstep_test {

//! What a value x goes to the wire as with residual r: v = x + r reads back as through(v) (the
//! codec's round trip), and r keeps v − that, 0 where it is not finite.
template <class Through>
std::vector<float> send_with(std::span<const float> x, std::span<float> r, Through through) {
  std::vector<float> v(x.size()), back;
  for (std::size_t i = 0; i < x.size(); ++i) v[i] = x[i] + r[i];
  back = v;
  through(std::span<float>(back));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float d = v[i] - back[i];
    r[i] = std::isfinite(d) ? d : 0.0f;
  }
  return back;
}

//! `calls` calls on n ranks' two buckets: an all-reduce of count = n·per + n − 1 values (n chunks
//! and a tail), a reduce-scatter of n·rs; x[c][r] and y[c][r] rank r's values at call c, fresh
//! each call; call 1 has an inf in rank 0's first chunk of both. got / got_rs: what each rank
//! had after each call (its all-reduce bucket, its block of the reduce-scatter).
struct feedback_case {
  int n = 0, calls = 4;
  std::size_t per = 0, count = 0, rs = 0;
  std::vector<std::vector<std::vector<float>>> x, y, got, got_rs;

  feedback_case(int ranks, std::mt19937_64& rng) : n(ranks) {
    const auto un = static_cast<std::size_t>(n);
    per = 300 + 37 * un;
    count = per * un + un - 1;
    rs = 129 + 64 * un;
    x.resize(static_cast<std::size_t>(calls));
    y.resize(x.size());
    for (int c = 0; c < calls; ++c)
      for (int r = 0; r < n; ++r) {
        x[static_cast<std::size_t>(c)].push_back(random_vector<float>(count, rng, -3.0, 2.0 + r));
        y[static_cast<std::size_t>(c)].push_back(random_vector<float>(rs * un, rng, -1.0, 1.0));
      }
    x[1][0][7] = std::numeric_limits<float>::infinity();
    y[1][0][3] = std::numeric_limits<float>::infinity();
    got.assign(x.size(), std::vector<std::vector<float>>(un));
    got_rs = got;
  }

  //! Every rank's results against the schedule with the residuals kept here, bit for bit (a NaN
  //! for a NaN) but for the tail — the communicator's fp32 mean, within tail_tolerance of the
  //! rank-order one (0: equal) — and every result finite again after the inf.
  template <class Through>
  void check(Through through, float tail_tolerance) const {
    const auto un = static_cast<std::size_t>(n);
    std::vector<std::vector<float>> r1(un, std::vector<float>(per * un)), r2(un, std::vector<float>(per)),
        rr(un, std::vector<float>(rs * un));
    const auto same_bits = [](std::span<const float> a, std::span<const float> b) {  // NaN: any payload (the GPU's)
      if (a.size() != b.size()) return false;
      for (std::size_t i = 0; i < a.size(); ++i)
        if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0 && !(std::isnan(a[i]) && std::isnan(b[i]))) return false;
      return true;
    };
    const auto mean_through = [&](const std::vector<std::vector<float>>& v, std::vector<std::vector<float>>& res,
                                  std::size_t k, std::size_t len) {
      std::vector<float> acc(len, 0.0f);
      for (std::size_t r = 0; r < un; ++r) {
        const auto part = send_with(std::span<const float>(v[r]).subspan(k * len, len),
                                    std::span<float>(res[r]).subspan(k * len, len), through);
        for (std::size_t i = 0; i < len; ++i) acc[i] += part[i];
      }
      for (auto& f : acc) f *= 1.0f / static_cast<float>(n);
      return acc;
    };
    for (std::size_t c = 0; c < x.size(); ++c) {
      CAPTURE(c);
      std::size_t off = 0, off_rs = 0, off_tail = 0;
      for (std::size_t k = 0; k < un; ++k) {
        const auto mean = mean_through(x[c], r1, k, per);
        const auto want = send_with(std::span<const float>(mean), std::span<float>(r2[k]), through);  // owner k's
        for (std::size_t r = 0; r < un; ++r)
          off += !same_bits(std::span<const float>(got[c][r]).subspan(k * per, per), want);
        off_rs += !same_bits(got_rs[c][k], mean_through(y[c], rr, k, rs));
      }
      for (std::size_t i = per * un; i < count; ++i) {  // the tail: the fp32 mean, no residual
        float acc = 0;
        for (const auto& v : x[c]) acc += v[i];
        const float want = acc / static_cast<float>(n);
        for (std::size_t r = 0; r < un; ++r)
          off_tail += !(std::abs(got[c][r][i] - want) <= tail_tolerance * std::max(1.0f, std::abs(want)));
      }
      CHECK(off == 0);
      CHECK(off_rs == 0);
      CHECK(off_tail == 0);
      bool finite = true;
      for (const auto& g : got[c])
        for (float f : g) finite = finite && std::isfinite(f);
      CHECK(finite == (c != 1));  // the inf reached every rank, and left no NaN behind
    }
  }
};

}  // namespace lockstep_test
