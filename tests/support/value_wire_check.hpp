#pragma once
// The host's numbers for the value gathers on the wire (ShardedOptimizer::gather_wire,
// FullySharded::gather_wire; parallel/detail/value_wire.hpp): what every rank's model holds after
// a step, made here from every rank's masters and shard map through the codec's round trip.
// CPU ranks (tests/cpu/test_wire_cpu.cpp) and GPUs (tests/cuda/test_wire.cu,
// tests/cuda/test_fullshard_gpu.cu) are checked against it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <lockstep/core/detail/half.hpp>
#include <lockstep/core/detail/int8_blocks.hpp>
#include <lockstep/core/dtype.hpp>
#include <lockstep/core/parameter.hpp>
#include <lockstep/parallel/wire_format.hpp>

namespace lockstep_test {

inline float bf16_round(float f) { return lockstep::detail::float_of_bf16(lockstep::detail::bf16_of_float(f)); }

//! v as `wire` carries it: bf16-rounded, through the blockwise int8 codec, or as it is (fp32).
inline void round_trip(lockstep::wire_format wire, std::span<float> v) {
  if (wire == lockstep::wire_format::bf16) {
    for (auto& f : v) f = bf16_round(f);
  } else if (wire == lockstep::wire_format::int8) {
    std::vector<unsigned char> enc(lockstep::detail::int8_chunk_bytes(v.size()));
    lockstep::detail::int8_encode(v.data(), v.size(), enc.data());
    lockstep::detail::int8_decode(enc.data(), v.size(), v.data());
  }
}

//! What one rank saw in a run with a value gather wire: per step, its model's values (flat, in
//! parameter order) and its masters (shard_parameters(), per shard); after the loop, its values
//! once wait_all_parameters() made them exact, and its shard map.
struct value_wire_trace {
  std::vector<std::vector<float>> replicas;
  std::vector<std::vector<std::vector<float>>> masters;
  std::vector<float> exact;
  std::vector<std::vector<lockstep::detail::shard_segment>> map;
};

//! The values the schedule makes after step `step` of every rank's masters: each rank's shard j
//! (padding included) through the wire's round trip — of the master itself (values), or of
//! master − the values before the step, added to them (deltas). flat_at[p]: parameter p's first
//! element in the flat values. A value no shard covers keeps `before`'s.
inline std::vector<float> expected_replica(const std::vector<value_wire_trace>& t, std::size_t step,
                                           const std::vector<float>& before, const std::vector<std::size_t>& flat_at,
                                           bool deltas, lockstep::wire_format wire) {
  auto want = before;
  for (const auto& rank : t)
    for (std::size_t j = 0; j < rank.map.size(); ++j) {
      const auto& master = rank.masters[step][j];
      std::vector<float> prev(master.size(), 0.0f), x(master.size());  // padding: zero
      for (const auto& g : rank.map[j])
        for (std::size_t i = 0; i < g.count; ++i)
          prev[g.slot_offset + i] = before[flat_at[g.param] + g.param_offset + i];
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = deltas ? master[i] - prev[i] : master[i];
      round_trip(wire, std::span<float>(x));
      for (const auto& g : rank.map[j])
        for (std::size_t i = 0; i < g.count; ++i) {
          const std::size_t k = g.slot_offset + i;
          want[flat_at[g.param] + g.param_offset + i] = deltas ? prev[k] + x[k] : x[k];
        }
    }
  return want;
}

//! flat_at[p]: parameter p's first element when parameters of `sizes` lie end to end.
inline std::vector<std::size_t> flat_offsets(const std::vector<std::size_t>& sizes) {
  std::vector<std::size_t> at{0};
  for (auto n : sizes) at.push_back(at.back() + n);
  return at;
}
//! The same for a TestMlp of `dims` (weight, bias per layer).
inline std::vector<std::size_t> mlp_flat_offsets(const std::vector<int>& dims) {
  std::vector<std::size_t> sizes;
  for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
    sizes.push_back(static_cast<std::size_t>(dims[l] * dims[l + 1]));
    sizes.push_back(static_cast<std::size_t>(dims[l + 1]));
  }
  return flat_offsets(sizes);
}

//! A model with no compute for what full sharding lends (lockstep::model (h), (i), typed):
//! fp32 parameters in the test's storage (host or device), each its own block. vals[i] and
//! type[i] are where parameter i's values are now and their element type (null: not held).
struct lent_probe {
  std::vector<void*> vals, grads;
  std::vector<std::size_t> sizes;
  std::vector<lockstep::dtype> type;
  lent_probe(std::vector<void*> v, std::vector<void*> g, std::vector<std::size_t> n)
      : vals(std::move(v)), grads(std::move(g)), sizes(std::move(n)), type(vals.size(), lockstep::dtype::f32) {}
  std::vector<lockstep::parameter> parameters() const {
    std::vector<lockstep::parameter> ps;
    for (std::size_t i = 0; i < vals.size(); ++i)
      ps.push_back(lockstep::param<float>("p" + std::to_string(i), static_cast<float*>(vals[i]),
                                          static_cast<float*>(grads[i]), {static_cast<std::int64_t>(sizes[i])}));
    return ps;
  }
  std::vector<std::size_t> blocks() const {
    std::vector<std::size_t> b(vals.size());
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = i;
    return b;
  }
  void attach(std::size_t i, void* v, void* g, lockstep::dtype t) {
    vals[i] = v;
    grads[i] = g;
    type[i] = t;
  }
};

//! n lent values of type `lent` (f32 or bf16) at `raw`, appended to `out` as floats (exactly).
inline void widen(const unsigned char* raw, std::size_t n, lockstep::dtype lent, std::vector<float>& out) {
  for (std::size_t e = 0; e < n; ++e) {
    std::uint16_t b = 0;
    float f = 0;
    if (lent == lockstep::dtype::bf16) std::memcpy(&b, raw + 2 * e, 2);
    else std::memcpy(&f, raw + 4 * e, 4);
    out.push_back(lent == lockstep::dtype::bf16 ? lockstep::detail::float_of_bf16(b) : f);
  }
}

//! How many of the values every rank was lent at step `step` (t[r].replicas[step], flat,
//! widened from `lent`) differ from every rank's master (t[r].masters[step]) through `wire`,
//! rounded to `lent` — summed over the ranks. A value no shard covers counts (NaN).
inline std::size_t lent_mismatches(const std::vector<value_wire_trace>& t, const std::vector<std::size_t>& flat_at,
                                   lockstep::wire_format wire, lockstep::dtype lent, std::size_t step = 0) {
  const std::vector<float> none(flat_at.back(), std::numeric_limits<float>::quiet_NaN());
  auto want = expected_replica(t, step, none, flat_at, false, wire);
  if (lent == lockstep::dtype::bf16)
    for (auto& f : want) f = bf16_round(f);
  std::size_t off = 0;
  for (const auto& rank : t)
    for (std::size_t i = 0; i < want.size(); ++i) off += !(rank.replicas[step][i] == want[i]);
  return off;
}

}  // namespace lockstep_test
