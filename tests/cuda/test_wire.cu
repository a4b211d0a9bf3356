// lockstep's low-precision wires on NcclComm (cuda/nccl_wire.cuh): fp32 gradients go over NCCL as
// bf16 (Bf16Wire) or blockwise int8 (Int8Wire) and are summed in fp32. Int8Wire's kernels
// against the host codec (core/detail/int8_blocks.hpp, itself checked by its properties in
// tests/cpu/test_wire_cpu.cpp) bit for bit, on random data with zero, inf/NaN, subnormal and
// huge blocks, aligned or not. The hooks against a CPU reference computed here from the same
// random inputs: the mean of the ranks' values as the codec carries them, summed in fp32 in rank
// order (bit for bit), then carried once more (all-reduce) or kept in fp32 (reduce-scatter); a
// plain low-precision ring sum would miss it on most elements. Tails the rank count does not
// divide: the exact fp32 mean.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <lockstep/cuda.cuh>

#include "device_vector.cuh"
#include "gpu_test_util.cuh"
#include "test_util.hpp"
#include "value_wire_check.hpp"
#include "wire_feedback_check.hpp"

namespace {

using lockstep::dtype;

using lockstep_test::bf16_round;

// A chunk of values as a wire's codec carries them.
template <class Wire>
void through(std::span<float> v) {
  lockstep_test::round_trip(
      std::is_same_v<Wire, lockstep::Bf16Wire> ? lockstep::wire_format::bf16 : lockstep::wire_format::int8, v);
}

// The wire's mean of chunk k (len values at offset + k·len) of every rank's x: Σ_r through(x_r's
// chunk) in fp32, rank order, × 1/N.
template <class Wire>
std::vector<float> wire_mean(const std::vector<std::vector<float>>& x, std::size_t offset, std::size_t k,
                             std::size_t len) {
  std::vector<float> acc(len, 0.0f), part(len);
  for (const auto& v : x) {
    std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(offset + k * len), len, part.begin());
    through<Wire>(std::span<float>(part));
    for (std::size_t i = 0; i < len; ++i) acc[i] += part[i];
  }
  for (auto& f : acc) f *= 1.0f / static_cast<float>(x.size());
  return acc;
}
double exact_mean(const std::vector<std::vector<float>>& x, std::size_t i) {
  double s = 0;
  for (const auto& v : x) s += v[i];
  return s / static_cast<double>(x.size());
}

using lockstep_test::first_gpus;

template <class Wire>
std::size_t chunk_bytes(std::size_t n) {
  if constexpr (std::is_same_v<Wire, lockstep::Bf16Wire>) return lockstep::detail::bf16_codec::chunk_bytes(n);
  else return lockstep::detail::int8_codec::chunk_bytes(n);
}

// The hook alone on n GPUs: all-reduce of `count` elements at `offset` floats into a buffer (an
// offset of 1 takes the unaligned kernels), and reduce-scatter of n·per.
template <class Wire>
void check_hook(int n, std::size_t count, std::size_t offset, std::size_t per) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  CAPTURE(count);
  CAPTURE(offset);
  CAPTURE(per);
  std::mt19937_64 rng(seed);
  const std::size_t un = static_cast<std::size_t>(n), total = per * un;
  std::vector<std::vector<float>> x(un), y(un);
  for (int r = 0; r < n; ++r) {
    x[static_cast<std::size_t>(r)] = lockstep_test::random_vector<float>(count, rng, -3.0 * (r + 1), 2.0 * (r + 1));
    y[static_cast<std::size_t>(r)] = lockstep_test::random_vector<float>(total, rng, -1.0, 1.0);
  }
  std::vector<std::vector<float>> got(un), got_rs(un);
  std::vector<std::size_t> staging(un);
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    auto& comm = ctx.comm();
    float* buf = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&buf, (count + offset + total) * sizeof(float)));
    float* d = buf + offset;
    float* e = buf + offset + count;
    LOCKSTEP_TRY_CUDA(cudaMemcpy(d, x[r].data(), count * sizeof(float), cudaMemcpyHostToDevice));
    if (total) LOCKSTEP_TRY_CUDA(cudaMemcpy(e, y[r].data(), total * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    Wire wire;
    wire.reduce(comm, d, count, dtype::f32).wait();
    wire.reduce_scatter(comm, e, e + r * per, per, dtype::f32).wait();
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(comm.compute_stream()));
    got[r].resize(count);
    got_rs[r].resize(per);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(got[r].data(), d, count * sizeof(float), cudaMemcpyDeviceToHost));
    if (per) LOCKSTEP_TRY_CUDA(cudaMemcpy(got_rs[r].data(), e + r * per, per * sizeof(float), cudaMemcpyDeviceToHost));
    staging[r] = wire.staging_bytes();
    cudaFree(buf);
  });
  const std::size_t len = n > 1 ? count / un : 0, main = len * un;
  std::size_t off_wire = 0, off_tail = 0;
  for (std::size_t k = 0; k < un && len > 0; ++k) {
    auto want = wire_mean<Wire>(x, 0, k, len);
    through<Wire>(std::span<float>(want));  // the all-reduce carries the mean once more
    for (std::size_t i = 0; i < len; ++i)
      if (got[0][k * len + i] != want[i] && off_wire++ < 3)
        MESSAGE("element " << k * len + i << ": got " << got[0][k * len + i] << ", the wire's mean is " << want[i]);
  }
  for (std::size_t i = main; i < count; ++i) {
    const float want = n > 1 ? static_cast<float>(exact_mean(x, i)) : x[0][i];
    if (std::abs(got[0][i] - want) > 1e-6f * std::max(1.0f, std::abs(want)) && off_tail++ < 3)
      MESSAGE("tail element " << i << ": got " << got[0][i] << ", the fp32 mean is " << want);
  }
  CHECK(off_wire == 0);
  CHECK(off_tail == 0);
  for (int r = 1; r < n; ++r)
    CHECK(std::memcmp(got[static_cast<std::size_t>(r)].data(), got[0].data(), count * sizeof(float)) == 0);
  std::size_t off_rs = 0;
  for (std::size_t r = 0; r < un; ++r) {
    const auto want = n > 1 ? wire_mean<Wire>(y, 0, r, per) : y[0];
    for (std::size_t i = 0; i < per; ++i)
      if (got_rs[r][i] != want[i] && off_rs++ < 3)
        MESSAGE("reduce-scatter, rank " << r << " element " << i << ": got " << got_rs[r][i] << ", want " << want[i]);
  }
  CHECK(off_rs == 0);
  if (n > 1 && main > 0) CHECK(staging[0] >= 2 * un * chunk_bytes<Wire>(len));  // the encoded bucket, twice
}

// DataParallel with Bf16Wire over a model whose gradients the test writes (the same each of two
// steps) and whose values start at 0, stepped by FusedSgd with lr 1 in finish's per-bucket (or,
// sharded, per-shard) callback: after two steps each value is exactly −2 × the averaged gradient,
// read through the model's own value pointers (which never move). The average is the wire's mean
// (buckets' main parts; sharded: in fp32, unsharded: rounded to bf16) or the exact fp32 mean
// (bucket tails the rank count does not divide).
struct given_grads {
  std::vector<std::size_t> sizes;
  std::vector<float*> vals, grads;
  explicit given_grads(std::vector<std::size_t> s) : sizes(std::move(s)) {
    for (auto n : sizes) {
      float *v = nullptr, *g = nullptr;
      LOCKSTEP_TRY_CUDA(cudaMalloc(&v, n * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&g, n * sizeof(float)));
      LOCKSTEP_TRY_CUDA(cudaMemset(v, 0, n * sizeof(float)));
      vals.push_back(v);
      grads.push_back(g);
    }
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  }
  ~given_grads() {
    for (auto p : vals) cudaFree(p);
  }
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      ps.push_back(
          lockstep::param<float>("p" + std::to_string(i), vals[i], grads[i], {static_cast<std::int64_t>(sizes[i])}));
    return ps;
  }
  void bind_gradient(std::size_t i, void* p) { grads[i] = static_cast<float*>(p); }
};

// copy_engines (sharded): the reduce-scatters' all-to-alls and the all-gathers on the copy
// engines (ShardedOptimizer::copy_engine_scatter/_gather): the same numbers.
// Int8Wire's values depend on where the buckets cut the gradients (a block's scale is its
// largest value's), which the test does not know: there each averaged gradient must lie within
// the codec's bound of the exact mean — half a step of ≤ 2/127 per rank's value, and (unsharded)
// half a step more for the mean carried again — and most must differ from it.
template <class Wire, bool Sharded>
void check_data_parallel(int n, bool copy_engines = false) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  CAPTURE(Sharded);
  CAPTURE(copy_engines);
  std::mt19937_64 rng(seed);
  const std::vector<std::size_t> sizes{4096, 37, 1000, 5, 20000, 333};
  std::vector<std::vector<std::vector<float>>> x(sizes.size());  // [param][rank][element]
  for (std::size_t p = 0; p < sizes.size(); ++p)
    for (int r = 0; r < n; ++r) x[p].push_back(lockstep_test::random_vector<float>(sizes[p], rng, -2.0, 2.0));
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(n));  // [rank][param]
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    cudaStream_t cs = ctx.comm().compute_stream();
    given_grads m(sizes);
    using DP =
        std::conditional_t<Sharded,
                           lockstep::DataParallel<given_grads, lockstep::NcclComm, Wire, lockstep::ShardedOptimizer>,
                           lockstep::DataParallel<given_grads, lockstep::NcclComm, Wire>>;
    const lockstep::DataParallelOptions o{.buckets = {.first_bytes = 4000, .cap_bytes = 30000}};
    auto dp = [&] {
      if constexpr (Sharded)
        return DP(ctx, m, o,
                  lockstep::ShardedOptimizer{.copy_engine_gather = copy_engines, .copy_engine_scatter = copy_engines});
      else return DP(ctx, m, o);
    }();
    const auto& stepped = [&]() -> const std::vector<lockstep::parameter>& {
      if constexpr (Sharded) return dp.shard_parameters();
      else return dp.parameters();
    }();
    lockstep::FusedSgd opt({.lr = 1.0}, stepped, ctx.device());
    for (int step = 0; step < 2; ++step) {
      auto st = dp.step();
      for (std::size_t p = sizes.size(); p-- > 0;) {
        const auto params = dp.parameters();  // where the gradient lives now (the arena once bound)
        LOCKSTEP_TRY_CUDA(
            cudaMemcpyAsync(params[p].grad, x[p][r].data(), sizes[p] * sizeof(float), cudaMemcpyHostToDevice, cs));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
        st.gradient_ready(p);
      }
      (void)st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, cs, nullptr); });
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
    for (std::size_t p = 0; p < sizes.size(); ++p) {
      got[r].emplace_back(sizes[p]);
      LOCKSTEP_TRY_CUDA(cudaMemcpy(got[r][p].data(), m.vals[p], sizes[p] * sizeof(float), cudaMemcpyDeviceToHost));
    }
  });
  std::size_t total = 0, wire_exact = 0;
  std::vector<std::string> problems;
  for (std::size_t p = 0; p < sizes.size(); ++p)
    for (std::size_t i = 0; i < sizes[p]; ++i) {
      ++total;
      const float v = got[0][p][i];
      const float exact = static_cast<float>(exact_mean(x[p], i));
      const float g = -v / 2.0f;
      if constexpr (std::is_same_v<Wire, lockstep::Bf16Wire>) {
        // Each step's bucket layout differs (step 1 runs on the rebuilt plan), so an element may
        // be a tail in one step and go over the wire in the other: v = −(a + b), a and b each
        // the wire's mean or the fp32 mean.
        float wire = wire_mean<Wire>(x[p], i, 0, 1)[0];  // bf16 is element by element
        if (!Sharded) wire = bf16_round(wire);
        const auto near = [&](float want) { return std::abs(v - want) <= 2e-6f * std::max(1.0f, std::abs(want)); };
        if (v == -(wire + wire)) ++wire_exact;
        else if (!near(-(exact + exact)) && !near(-(wire + exact)) && problems.size() < 5)
          problems.push_back("p" + std::to_string(p) + "[" + std::to_string(i) + "] averaged to " + std::to_string(g) +
                             ": neither the wire's mean " + std::to_string(wire) + " nor the fp32 mean " +
                             std::to_string(exact));
      } else {
        const float bound = (1.0f / 127.0f) * (Sharded ? 1.0f : 2.0f) * 1.001f;  // per step; v sums two
        if (std::abs(g - exact) > bound && problems.size() < 5)
          problems.push_back("p" + std::to_string(p) + "[" + std::to_string(i) + "] averaged to " + std::to_string(g) +
                             ", the fp32 mean is " + std::to_string(exact) + ": beyond the int8 wire's bound");
        wire_exact += std::abs(g - exact) > 1e-6f * std::max(1.0f, std::abs(exact));  // (it quantized)
      }
    }
  for (const auto& pr : problems) MESSAGE(pr);
  CHECK(problems.empty());
  for (int r = 1; r < n; ++r)
    for (std::size_t p = 0; p < sizes.size(); ++p) CHECK(got[static_cast<std::size_t>(r)][p] == got[0][p]);
  // Almost everything went over the wire (only bucket tails the rank count does not divide not);
  // one GPU has no wire.
  if (n > 1) CHECK(wire_exact * 100 >= total * 90);
}

// Random values in blocks of different magnitudes, with a zero block, one with −inf, one with a
// NaN, a subnormal one and one holding FLT_MAX (where n has those blocks).
std::vector<float> codec_input(std::size_t n, std::mt19937_64& rng) {
  std::vector<float> x(n);
  const std::size_t blk = lockstep::detail::int8_block;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = i / blk;
    const double mag = std::ldexp(1.0, static_cast<int>(b % 7) * 9 - 30);
    x[i] = static_cast<float>(std::uniform_real_distribution<double>(-mag, mag)(rng));
    if (b % 6 == 1) x[i] = 0.0f;
    if (b % 6 == 4) x[i] = std::ldexp(static_cast<float>(std::uniform_int_distribution<int>(-5000, 5000)(rng)), -149);
  }
  const auto put = [&](std::size_t b, float v) {
    if (b * blk + 17 < n) x[b * blk + 17] = v;
  };
  put(2, -std::numeric_limits<float>::infinity());
  put(3, std::numeric_limits<float>::quiet_NaN());
  put(5, std::numeric_limits<float>::max());
  return x;
}

// The same value: the same bits, or both NaN (a NaN's payload and sign after q · NaN are the
// hardware's: the GPU's canonical NaN, the host's propagated one).
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b)); }

template <class T>
std::vector<T> download(const lockstep_test::device_vector<T>& v, std::size_t offset, std::size_t count) {
  std::vector<T> h(count);
  LOCKSTEP_TRY_CUDA(cudaMemcpy(h.data(), v.p + offset, count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Bf16Wire's kernels (cuda/kernels/wire_ops.cuh) against the host, bit for bit: n values at a
// float offset (1: the unaligned paths) rounded to bf16 (times a scale, minus a base: each one
// fp32 operation, then to nearest even), widened back (onto what is there too: one fp32 add),
// and the fp32 mean of `chunks` bf16 chunks of n in rank order (into fp32 and bf16).
void check_bf16_kernels(std::size_t n, int chunks, std::size_t offset) {
  namespace d = lockstep::detail;
  namespace k = lockstep::cuda::kernels;
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  CAPTURE(chunks);
  CAPTURE(offset);
  std::mt19937_64 rng(seed);
  const std::size_t un = static_cast<std::size_t>(chunks), all = n * un;
  const auto x = codec_input(all, rng), base = lockstep_test::random_vector<float>(all, rng, -1.0, 1.0);
  const float scale = 0.375f;
  std::vector<std::uint16_t> want_enc(all), want_delta(all);
  std::vector<float> want_dec(all), want_onto(all), want_mean(n, 0.0f);
  std::vector<std::uint16_t> want_mean16(n);
  for (std::size_t i = 0; i < all; ++i) {
    want_enc[i] = d::bf16_of_float(x[i] * scale);
    want_delta[i] = d::bf16_of_float((x[i] - base[i]) * scale);
    want_dec[i] = d::float_of_bf16(want_enc[i]);
    want_onto[i] = base[i] + want_dec[i];
  }
  for (std::size_t c = 0; c < un; ++c)
    for (std::size_t i = 0; i < n; ++i) want_mean[i] += want_dec[c * n + i];
  for (std::size_t i = 0; i < n; ++i) {
    want_mean[i] *= 1.0f / static_cast<float>(chunks);
    want_mean16[i] = d::bf16_of_float(want_mean[i]);
  }
  lockstep_test::device_vector<float> src(all + offset), base_d(all + offset), dec(all + offset), onto(all + offset),
      mean32(n + offset);
  lockstep_test::device_vector<std::uint16_t> enc(all + offset), delta(all + offset), mean16(n + offset);
  LOCKSTEP_TRY_CUDA(cudaMemcpy(src.p + offset, x.data(), all * sizeof(float), cudaMemcpyHostToDevice));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(base_d.p + offset, base.data(), all * sizeof(float), cudaMemcpyHostToDevice));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(onto.p + offset, base.data(), all * sizeof(float), cudaMemcpyHostToDevice));
  k::to_bf16(src.p + offset, enc.p + offset, all, scale, nullptr);
  k::to_bf16(src.p + offset, delta.p + offset, all, scale, nullptr, base_d.p + offset);
  k::from_bf16(enc.p + offset, dec.p + offset, all, nullptr);
  k::from_bf16(enc.p + offset, onto.p + offset, all, nullptr, true);
  k::mean_blocks(enc.p + offset, chunks, n, mean32.p + offset, mean16.p + offset, nullptr);
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  const auto count_off = [](const auto& got, const auto& want) {
    std::size_t off = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      if constexpr (std::is_same_v<typename std::decay_t<decltype(want)>::value_type, float>)
        off += !same_bits(got[i], want[i]);
      else off += !same_bits(lockstep::detail::float_of_bf16(got[i]), lockstep::detail::float_of_bf16(want[i]));
    }
    return off;
  };
  CHECK(count_off(download(enc, offset, all), want_enc) == 0);
  CHECK(count_off(download(delta, offset, all), want_delta) == 0);
  CHECK(count_off(download(dec, offset, all), want_dec) == 0);
  CHECK(count_off(download(onto, offset, all), want_onto) == 0);
  CHECK(count_off(download(mean32, offset, n), want_mean) == 0);
  CHECK(count_off(download(mean16, offset, n), want_mean16) == 0);
}

// Int8Wire's three kernels against the host codec, bit for bit: `chunks` chunks of n values at
// a float offset (1: the unaligned paths), and the mean of `chunks` encoded chunks.
void check_int8_kernels(std::size_t n, int chunks, std::size_t offset) {
  namespace d = lockstep::detail;
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  CAPTURE(chunks);
  CAPTURE(offset);
  std::mt19937_64 rng(seed);
  const std::size_t un = static_cast<std::size_t>(chunks), cb = d::int8_chunk_bytes(n);
  const auto x = codec_input(n * un, rng);
  // The host's chunks, their decoded values, their mean, and the mean encoded.
  std::vector<unsigned char> want_enc(un * cb), want_mean_enc(cb);
  std::vector<float> want_dec(n * un), want_mean(n, 0.0f);
  for (std::size_t c = 0; c < un; ++c) {
    d::int8_encode(x.data() + c * n, n, want_enc.data() + c * cb);
    d::int8_decode(want_enc.data() + c * cb, n, want_dec.data() + c * n);
    for (std::size_t i = 0; i < n; ++i) want_mean[i] += want_dec[c * n + i];
  }
  for (auto& f : want_mean) f *= 1.0f / static_cast<float>(chunks);
  d::int8_encode(want_mean.data(), n, want_mean_enc.data());

  lockstep_test::device_vector<float> src(n * un + offset), dec(n * un + offset), mean32(n + offset);
  lockstep_test::device_vector<unsigned char> enc(un * cb), mean_enc(cb);
  LOCKSTEP_TRY_CUDA(cudaMemcpy(src.p + offset, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  lockstep::cuda::kernels::int8_encode(src.p + offset, chunks, n, enc.p, nullptr);
  lockstep::cuda::kernels::int8_decode(enc.p, chunks, n, dec.p + offset, nullptr);
  lockstep::cuda::kernels::int8_mean(enc.p, chunks, n, mean32.p + offset, mean_enc.p, nullptr);
  lockstep_test::device_vector<std::uint16_t> dec16(n * un + offset);  // FullySharded's bf16 lent values
  lockstep::cuda::kernels::int8_decode_bf16(enc.p, chunks, n, dec16.p + offset, nullptr);
  // The value gathers' deltas: x − base encoded, and decoded onto base (one fp32 add each); a
  // small base keeps x's special blocks (inf, NaN, the largest float) in x − base.
  const auto base = lockstep_test::random_vector<float>(n * un, rng, -1.0, 1.0);
  std::vector<float> delta(n * un), want_onto(n * un);
  for (std::size_t i = 0; i < delta.size(); ++i) delta[i] = x[i] - base[i];
  std::vector<unsigned char> want_delta_enc(un * cb);
  for (std::size_t c = 0; c < un; ++c) d::int8_encode(delta.data() + c * n, n, want_delta_enc.data() + c * cb);
  for (std::size_t i = 0; i < want_onto.size(); ++i) want_onto[i] = base[i] + want_dec[i];
  lockstep_test::device_vector<float> base_d(n * un + offset), onto(n * un + offset);
  lockstep_test::device_vector<unsigned char> delta_enc(un * cb);
  LOCKSTEP_TRY_CUDA(cudaMemcpy(base_d.p + offset, base.data(), base.size() * sizeof(float), cudaMemcpyHostToDevice));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(onto.p + offset, base.data(), base.size() * sizeof(float), cudaMemcpyHostToDevice));
  lockstep::cuda::kernels::int8_encode(src.p + offset, chunks, n, delta_enc.p, nullptr, base_d.p + offset);
  lockstep::cuda::kernels::int8_decode(enc.p, chunks, n, onto.p + offset, nullptr, true);
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  std::vector<std::uint16_t> got16(n * un);
  LOCKSTEP_TRY_CUDA(
      cudaMemcpy(got16.data(), dec16.p + offset, got16.size() * sizeof(std::uint16_t), cudaMemcpyDeviceToHost));
  std::size_t off16 = 0;
  for (std::size_t i = 0; i < n * un; ++i)  // decoded in fp32, rounded to nearest even
    off16 += !same_bits(d::float_of_bf16(got16[i]), d::float_of_bf16(d::bf16_of_float(want_dec[i])));
  CHECK(off16 == 0);
  std::vector<unsigned char> got_enc(un * cb), got_mean_enc(cb);
  std::vector<float> got_dec(n * un), got_mean(n);
  LOCKSTEP_TRY_CUDA(cudaMemcpy(got_enc.data(), enc.p, got_enc.size(), cudaMemcpyDeviceToHost));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(got_mean_enc.data(), mean_enc.p, cb, cudaMemcpyDeviceToHost));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(got_dec.data(), dec.p + offset, got_dec.size() * sizeof(float), cudaMemcpyDeviceToHost));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(got_mean.data(), mean32.p + offset, n * sizeof(float), cudaMemcpyDeviceToHost));
  // Scales and values, not the padding (the kernels leave it as it was).
  const auto same_chunk = [&](const unsigned char* a, const unsigned char* b) {
    for (std::size_t k = 0; k < d::int8_blocks_of(n); ++k)
      if (!same_bits(d::int8_scale_at(a, k), d::int8_scale_at(b, k))) return false;
    return std::memcmp(a + d::int8_values_at(n), b + d::int8_values_at(n), n) == 0;
  };
  std::size_t off_enc = 0, off_dec = 0, off_mean = 0;
  for (std::size_t c = 0; c < un; ++c) off_enc += !same_chunk(got_enc.data() + c * cb, want_enc.data() + c * cb);
  for (std::size_t i = 0; i < n * un; ++i)
    if (!same_bits(got_dec[i], want_dec[i]) && off_dec++ < 3)
      MESSAGE("decoded " << i << ": got " << got_dec[i] << ", the host's " << want_dec[i]);
  for (std::size_t i = 0; i < n; ++i)
    if (!same_bits(got_mean[i], want_mean[i]) && off_mean++ < 3)
      MESSAGE("mean " << i << ": got " << got_mean[i] << ", the host's " << want_mean[i]);
  const auto got_delta_enc = download(delta_enc, 0, un * cb);
  const auto got_onto = download(onto, offset, n * un);
  std::size_t off_delta = 0, off_onto = 0;
  for (std::size_t c = 0; c < un; ++c)
    off_delta += !same_chunk(got_delta_enc.data() + c * cb, want_delta_enc.data() + c * cb);
  for (std::size_t i = 0; i < n * un; ++i) off_onto += !same_bits(got_onto[i], want_onto[i]);
  CHECK(off_enc == 0);
  CHECK(off_dec == 0);
  CHECK(off_mean == 0);
  CHECK(off_delta == 0);
  CHECK(off_onto == 0);
  CHECK(same_chunk(got_mean_enc.data(), want_mean_enc.data()));
  // The special blocks did what they should, on the GPU as on the host.
  std::size_t nan_blocks = 0, zero_scales = 0;
  for (std::size_t k = 0; k < d::int8_blocks_of(n); ++k) {
    nan_blocks += std::isnan(d::int8_scale_at(got_enc.data(), k));
    zero_scales += d::int8_scale_at(got_enc.data(), k) == 0.0f;
  }
  if (n > 4 * d::int8_block) CHECK(nan_blocks >= 2);
  if (n > 2 * d::int8_block) CHECK(zero_scales >= 1);
}

// given_grads whose values lockstep may take into its arena (lockstep::model (e)).
struct given_grads_bound : given_grads {
  using given_grads::given_grads;
  std::vector<float*> own = vals;  // freed by given_grads
  void bind_value(std::size_t i, void* p) {
    LOCKSTEP_TRY_CUDA(cudaMemcpy(p, vals[i], sizes[i] * sizeof(float), cudaMemcpyDeviceToDevice));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());  // (a device-to-device copy does not wait for itself)
    vals[i] = static_cast<float*>(p);
  }
  void unbind_values() {  // the values back in the model's own memory (DataParallel's end)
    for (std::size_t i = 0; i < vals.size(); ++i)
      if (vals[i] != own[i]) {
        LOCKSTEP_TRY_CUDA(cudaMemcpy(own[i], vals[i], sizes[i] * sizeof(float), cudaMemcpyDeviceToDevice));
        LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
        vals[i] = own[i];
      }
  }
  ~given_grads_bound() { vals = own; }
};

// ShardedOptimizer::gather_wire on n GPUs against the host's numbers (the schedule of
// parallel/detail/value_wire.hpp through the host codec, as tests/cpu/test_wire_cpu.cpp checks
// ThreadComm against): random values, every rank the same random gradients per step (so that
// the fp32 reduce-scatter's mean is exact: the masters are value − gradient, SGD with lr 1),
// and after every step each rank's replica equal to what the host makes of every rank's
// masters and the replica before, bit for bit; after wait_all_parameters(), the masters.
template <class Model>
void check_value_gather(int n, lockstep::wire_format wire, bool deltas, bool deferred, bool copy_engines) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  const std::string format = lockstep::name_of(wire);
  CAPTURE(format);
  CAPTURE(deltas);
  CAPTURE(deferred);
  CAPTURE(copy_engines);
  constexpr bool bound = std::is_same_v<Model, given_grads_bound>;
  CAPTURE(bound);
  std::mt19937_64 rng(seed);
  const std::vector<std::size_t> sizes{4096, 37, 1000, 5, 20000, 333};
  const int steps = 3;
  const auto flat_at = lockstep_test::flat_offsets(sizes);
  const auto init = lockstep_test::random_vector<float>(flat_at.back(), rng, -1.0, 1.0);
  std::vector<std::vector<float>> g;  // per step, flat
  for (int s = 0; s < steps; ++s) g.push_back(lockstep_test::random_vector<float>(flat_at.back(), rng, -0.05, 0.05));
  std::vector<lockstep_test::value_wire_trace> t(static_cast<std::size_t>(n));
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    auto& tr = t[static_cast<std::size_t>(ctx.rank())];
    cudaStream_t cs = ctx.comm().compute_stream();
    Model m(sizes);
    for (std::size_t p = 0; p < sizes.size(); ++p)
      LOCKSTEP_TRY_CUDA(
          cudaMemcpy(m.vals[p], init.data() + flat_at[p], sizes[p] * sizeof(float), cudaMemcpyHostToDevice));
    lockstep::DataParallel dp(ctx, m, {.buckets = {.first_bytes = 4000, .cap_bytes = 30000}},
                              lockstep::ShardedOptimizer{.gather_in_forward = deferred,
                                                         .copy_engine_gather = copy_engines,
                                                         .copy_engine_scatter = copy_engines,
                                                         .gather_wire = wire,
                                                         .gather_deltas = deltas});
    CHECK(dp.stats().gathers_by_copy_engine == copy_engines);  // the option took effect
    lockstep::FusedSgd opt({.lr = 1.0}, dp.shard_parameters(), ctx.device());
    const auto read = [&] {
      std::vector<float> v(flat_at.back());
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
      for (std::size_t p = 0; p < sizes.size(); ++p)
        LOCKSTEP_TRY_CUDA(
            cudaMemcpy(v.data() + flat_at[p], m.vals[p], sizes[p] * sizeof(float), cudaMemcpyDeviceToHost));
      return v;
    };
    for (int s = 0; s < steps; ++s) {
      if (deferred)
        for (std::size_t p = 0; p < sizes.size(); ++p) dp.wait_parameters(p);
      auto st = dp.step();
      for (std::size_t p = sizes.size(); p-- > 0;) {
        const auto params = dp.parameters();
        LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(params[p].grad, g[static_cast<std::size_t>(s)].data() + flat_at[p],
                                          sizes[p] * sizeof(float), cudaMemcpyHostToDevice, cs));
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(cs));
        st.gradient_ready(p);
      }
      REQUIRE(st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, cs, nullptr); }));
      if (deferred)
        for (std::size_t p = 0; p < sizes.size(); ++p) dp.wait_parameters(p);
      tr.replicas.push_back(read());
      auto& ms = tr.masters.emplace_back();
      for (const auto& sp : dp.shard_parameters()) {
        ms.emplace_back(sp.numel());
        LOCKSTEP_TRY_CUDA(cudaMemcpy(ms.back().data(), sp.value, sp.bytes(), cudaMemcpyDeviceToHost));
      }
    }
    CHECK(!dp.stats().values_exact);
    dp.wait_all_parameters();
    CHECK(dp.stats().values_exact);
    tr.exact = read();
    tr.map.assign(dp.shard_map().begin(), dp.shard_map().end());
  });
  // The masters: value − gradient, step after step (the mean of equal gradients is exact).
  std::vector<float> master_flat = init;
  std::size_t off_master = 0, off_replica = 0, rounded = 0;
  auto before = init;
  for (std::size_t s = 0; s < static_cast<std::size_t>(steps); ++s) {
    for (std::size_t i = 0; i < master_flat.size(); ++i) master_flat[i] = master_flat[i] - g[s][i];
    const auto masters = lockstep_test::expected_replica(t, s, before, flat_at, false, lockstep::wire_format::fp32);
    for (std::size_t i = 0; i < masters.size(); ++i) off_master += !same_bits(masters[i], master_flat[i]);
    const auto want = lockstep_test::expected_replica(t, s, before, flat_at, deltas, wire);
    for (const auto& rank : t)
      for (std::size_t i = 0; i < want.size(); ++i)
        if (!same_bits(rank.replicas[s][i], want[i]) && off_replica++ < 3)
          MESSAGE("step " << s << " element " << i << ": replica " << rank.replicas[s][i] << ", the host's "
                          << want[i]);
    before = want;
  }
  for (std::size_t i = 0; i < before.size(); ++i) rounded += before[i] != master_flat[i];
  CHECK(off_master == 0);
  CHECK(off_replica == 0);
  CHECK(rounded > before.size() / 2);  // the wire rounded most values
  for (const auto& rank : t) CHECK(rank.exact == master_flat);
}

// Error feedback's encodes against the host (parallel/detail/wire_feedback.hpp), bit for bit:
// `chunks` chunks of n values (codec_input: zero, inf/NaN, subnormal, huge blocks) at a float
// offset, each with a random residual added; the encoded chunks and the residuals left behind
// (0 in the blocks that are not finite) — int8 and bf16.
void check_feedback_kernels(std::size_t n, int chunks, std::size_t offset) {
  namespace d = lockstep::detail;
  namespace k = lockstep::cuda::kernels;
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  CAPTURE(chunks);
  CAPTURE(offset);
  std::mt19937_64 rng(seed);
  const std::size_t un = static_cast<std::size_t>(chunks), all = n * un, cb = d::int8_chunk_bytes(n);
  const auto x = codec_input(all, rng), r0 = lockstep_test::random_vector<float>(all, rng, -0.01, 0.01);
  std::vector<float> want_r8 = r0, want_r16 = r0;
  std::vector<unsigned char> want8(un * cb), want16(2 * all);
  for (std::size_t c = 0; c < un; ++c)
    d::host_encode<d::int8_codec>(x.data() + c * n, n, want8.data() + c * cb, want_r8.data() + c * n);
  d::host_encode<d::bf16_codec>(x.data(), all, want16.data(), want_r16.data());
  lockstep_test::device_vector<float> src(all + offset), r8(all + offset), r16(all + offset);
  lockstep_test::device_vector<unsigned char> enc8(un * cb);
  lockstep_test::device_vector<std::uint16_t> enc16(all + offset);
  LOCKSTEP_TRY_CUDA(cudaMemcpy(src.p + offset, x.data(), all * sizeof(float), cudaMemcpyHostToDevice));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(r8.p + offset, r0.data(), all * sizeof(float), cudaMemcpyHostToDevice));
  LOCKSTEP_TRY_CUDA(cudaMemcpy(r16.p + offset, r0.data(), all * sizeof(float), cudaMemcpyHostToDevice));
  k::int8_encode(src.p + offset, chunks, n, enc8.p, nullptr, nullptr, r8.p + offset);
  k::to_bf16(src.p + offset, enc16.p + offset, all, 1.0f, nullptr, nullptr, r16.p + offset);
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  const auto got8 = download(enc8, 0, un * cb);
  const auto got16 = download(enc16, offset, all);
  const auto got_r8 = download(r8, offset, all), got_r16 = download(r16, offset, all);
  std::size_t off8 = 0, off_r8 = 0, off_r16 = 0, zero_r = 0, moved = 0;
  for (std::size_t c = 0; c < un; ++c) {
    const unsigned char *a = got8.data() + c * cb, *b = want8.data() + c * cb;
    for (std::size_t q = 0; q < d::int8_blocks_of(n); ++q)
      off8 += !same_bits(d::int8_scale_at(a, q), d::int8_scale_at(b, q));
    off8 += std::memcmp(a + d::int8_values_at(n), b + d::int8_values_at(n), n) != 0;
  }
  std::size_t off16 = 0;
  for (std::size_t i = 0; i < all; ++i) {
    std::uint16_t w;
    std::memcpy(&w, want16.data() + 2 * i, sizeof w);
    off16 += !same_bits(d::float_of_bf16(got16[i]), d::float_of_bf16(w));  // (a NaN's payload is the hardware's)
    off_r8 += std::memcmp(&got_r8[i], &want_r8[i], sizeof(float)) != 0;    // finite: exactly the same bits
    off_r16 += std::memcmp(&got_r16[i], &want_r16[i], sizeof(float)) != 0;
    zero_r += got_r8[i] == 0.0f;
    moved += got_r8[i] != r0[i];
  }
  CHECK(off8 == 0);
  CHECK(off16 == 0);
  CHECK(off_r8 == 0);
  CHECK(off_r16 == 0);
  CHECK(std::ranges::all_of(got_r8, [](float f) { return std::isfinite(f); }));
  CHECK(moved > all / 2);                                         // the residuals were written
  if (n > 4 * d::int8_block) CHECK(zero_r >= 2 * d::int8_block);  // the inf block's and the NaN block's
}

// `Wire` with error feedback on n GPUs: the calls of a feedback_case (wire_feedback_check.hpp) on
// device buckets that stay put, against the host's numbers bit for bit (the tails: NCCL's fp32
// mean, within 1e-6).
template <class Wire>
void check_feedback_hook(int n) {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(n);
  std::mt19937_64 rng(seed);
  lockstep_test::feedback_case fc(n, rng);
  const auto un = static_cast<std::size_t>(n);
  lockstep::run(lockstep::Gpus{first_gpus(n)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    auto& comm = ctx.comm();
    lockstep_test::device_vector<float> a(fc.count), b(fc.rs * un);
    Wire w(lockstep::WireOptions{.error_feedback = true});
    for (std::size_t c = 0; c < fc.x.size(); ++c) {
      LOCKSTEP_TRY_CUDA(cudaMemcpy(a.p, fc.x[c][r].data(), fc.count * sizeof(float), cudaMemcpyHostToDevice));
      LOCKSTEP_TRY_CUDA(cudaMemcpy(b.p, fc.y[c][r].data(), fc.rs * un * sizeof(float), cudaMemcpyHostToDevice));
      LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
      w.reduce(comm, a.p, fc.count, dtype::f32).wait();
      w.reduce_scatter(comm, b.p, b.p + r * fc.rs, fc.rs, dtype::f32).wait();
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(comm.compute_stream()));
      fc.got[c][r] = download(a, 0, fc.count);
      fc.got_rs[c][r] = download(b, r * fc.rs, fc.rs);
    }
  });
  fc.check([](std::span<float> v) { through<Wire>(v); }, 1e-6f);
}
}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("int8 wire kernels on 1 GPU: encode - decode - mean of chunks - bit for bit with the host codec") {
  LOCKSTEP_REQUIRE_GPUS(1);
  for (const std::size_t n : {std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{257}, std::size_t{1540},
                              std::size_t{8192}, std::size_t{5003}})
    for (const int chunks : {1, 2, 3, 4})
      for (const std::size_t offset : {std::size_t{0}, std::size_t{1}}) check_int8_kernels(n, chunks, offset);
  // Past one sweep of the grid (8192 blocks of 8 warps, a block of 256 values each: 16.8 M
  // values), aligned (the 16-byte paths) and not; many chunks of millions; the mean's own sweep.
  check_int8_kernels(34'000'000, 2, 0);
  check_int8_kernels(20'000'003, 5, 1);
}
TEST_CASE("bf16 wire kernels on 1 GPU: encode - deltas - decode - onto - mean of chunks - bit for bit with the host") {
  LOCKSTEP_REQUIRE_GPUS(1);
  for (const std::size_t n :
       {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9}, std::size_t{1003}, std::size_t{4096}})
    for (const int chunks : {1, 2, 3})
      for (const std::size_t offset : {std::size_t{0}, std::size_t{1}}) check_bf16_kernels(n, chunks, offset);
  check_bf16_kernels(20'000'003, 2, 0);  // past one sweep of the grid (8192 blocks of 256 threads, 8 values each)
}
TEST_CASE("wire error feedback kernels on 1 GPU: int8 and bf16 encodes with residuals - bit for bit with the host") {
  LOCKSTEP_REQUIRE_GPUS(1);
  for (const std::size_t n : {std::size_t{1}, std::size_t{255}, std::size_t{257}, std::size_t{1540}, std::size_t{5003}})
    for (const int chunks : {1, 3})
      for (const std::size_t offset : {std::size_t{0}, std::size_t{1}}) check_feedback_kernels(n, chunks, offset);
  check_feedback_kernels(20'000'003, 2, 0);  // past one sweep of either grid
}
TEST_CASE("low-precision wires on 1 GPU: the hooks are the identity - sharded and not") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_hook<lockstep::Bf16Wire>(1, 1003, 0, 77);
  check_hook<lockstep::Int8Wire>(1, 1003, 0, 77);
  check_data_parallel<lockstep::Bf16Wire, false>(1);
  check_data_parallel<lockstep::Int8Wire, false>(1);
}
}

TEST_SUITE("multigpu") {
TEST_CASE("bf16 wire on 2 GPUs: fp32 sum of bf16 values - tails - unaligned - DataParallel - sharded - copy engines") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_hook<lockstep::Bf16Wire>(2, 8 * 2 * 1234, 0, 8 * 300);
  check_hook<lockstep::Bf16Wire>(2, 8 * 2 * 1234 + 1, 1, 5);
  check_hook<lockstep::Bf16Wire>(2, 1, 0, 3);
  check_data_parallel<lockstep::Bf16Wire, false>(2);
  check_data_parallel<lockstep::Bf16Wire, true>(2);
  check_data_parallel<lockstep::Bf16Wire, true>(2, true);
}
TEST_CASE("int8 wire on 2 GPUs: fp32 sum of int8 blocks - tails - unaligned - DataParallel - sharded - copy engines") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_hook<lockstep::Int8Wire>(2, 8 * 2 * 1234, 0, 8 * 300);
  check_hook<lockstep::Int8Wire>(2, 2 * 1000 + 1, 1, 5);
  check_hook<lockstep::Int8Wire>(2, 1, 0, 3);
  check_data_parallel<lockstep::Int8Wire, false>(2);
  check_data_parallel<lockstep::Int8Wire, true>(2);
  check_data_parallel<lockstep::Int8Wire, true>(2, true);
}
TEST_CASE("wire error feedback on 2 GPUs: every rank's residuals carried into its next call - the host's numbers") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_feedback_hook<lockstep::Int8Wire>(2);
  check_feedback_hook<lockstep::Bf16Wire>(2);
}
TEST_CASE("value gather wire on 2 GPUs: bf16 and int8 - deltas and values - the host's numbers bit for bit") {
  LOCKSTEP_REQUIRE_GPUS(2);
  using lockstep::wire_format;
  for (const auto wire : {wire_format::bf16, wire_format::int8})
    for (const bool deltas : {true, false}) check_value_gather<given_grads_bound>(2, wire, deltas, false, false);
  check_value_gather<given_grads>(2, wire_format::int8, true, true, false);       // packed, deferred
  check_value_gather<given_grads_bound>(2, wire_format::int8, true, true, true);  // copy engines
  check_value_gather<given_grads>(2, wire_format::bf16, true, false, true);
}
// A captured step's replays would leave the host's values_exact stale (and a checkpoint with
// rounded values): a capture of a gather_wire step is refused by name, on every rank.
TEST_CASE("value gather wire on 2 GPUs: a StepGraph capture is refused naming gather_wire") {
  LOCKSTEP_REQUIRE_GPUS(2);
  std::vector<std::string> seen(2);
  lockstep::run(lockstep::Gpus{first_gpus(2)}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    cudaStream_t cs = ctx.comm().compute_stream();
    const std::vector<std::size_t> sizes{3000, 77};
    given_grads_bound m(sizes);
    lockstep::DataParallel dp(ctx, m, lockstep::ShardedOptimizer{.gather_wire = lockstep::wire_format::int8});
    lockstep::FusedSgd opt({.lr = 0.5}, dp.shard_parameters(), ctx.device());
    lockstep_test::device_vector<float> g0(sizes[0]), g1(sizes[1]);  // fixed addresses: capturable
    std::mt19937_64 rng(lockstep_test::fresh_seed());
    const auto h0 = lockstep_test::random_vector<float>(sizes[0], rng, -1.0, 1.0);
    const auto h1 = lockstep_test::random_vector<float>(sizes[1], rng, -1.0, 1.0);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(g0.p, h0.data(), h0.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(g1.p, h1.data(), h1.size() * sizeof(float), cudaMemcpyHostToDevice));
    const auto one_step = [&] {
      auto st = dp.step();
      const auto params = dp.parameters();
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(params[1].grad, g1.p, sizes[1] * sizeof(float), cudaMemcpyDeviceToDevice, cs));
      st.gradient_ready(1);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(params[0].grad, g0.p, sizes[0] * sizeof(float), cudaMemcpyDeviceToDevice, cs));
      st.gradient_ready(0);
      (void)st.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, cs, nullptr); });
    };
    lockstep::StepGraph graph(ctx.comm(), {.warmup = 1});
    CHECK_FALSE(graph.run(one_step));  // eager
    try {
      graph.run(one_step);
      seen[static_cast<std::size_t>(ctx.rank())] = "captured";
    } catch (const lockstep::config_error& e) {
      seen[static_cast<std::size_t>(ctx.rank())] = e.what();
    }
    CHECK_FALSE(graph.captured());
  });
  for (const auto& s : seen)
    CHECK(s.find("ShardedOptimizer::gather_wire in a CUDA graph capture") != std::string::npos);
}
TEST_CASE("value gather wire on 4 GPUs: bf16 and int8 - the host's numbers bit for bit") {
  LOCKSTEP_REQUIRE_GPUS(4);
  using lockstep::wire_format;
  for (const auto wire : {wire_format::bf16, wire_format::int8})
    for (const bool deltas : {true, false}) check_value_gather<given_grads_bound>(4, wire, deltas, deltas, !deltas);
}
TEST_CASE("low-precision wires on 4 GPUs: fp32 sums - tails - DataParallel - sharded - copy engines") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_feedback_hook<lockstep::Int8Wire>(4);
  check_feedback_hook<lockstep::Bf16Wire>(4);
  check_hook<lockstep::Bf16Wire>(4, 8 * 4 * 5000 + 3, 0, 8 * 1000);
  check_hook<lockstep::Bf16Wire>(4, 4 * 999, 1, 13);
  check_hook<lockstep::Int8Wire>(4, 8 * 4 * 5000 + 3, 0, 8 * 1000);
  check_hook<lockstep::Int8Wire>(4, 4 * 999, 1, 13);
  for (const bool engines : {false, true}) {
    check_data_parallel<lockstep::Bf16Wire, true>(4, engines);
    check_data_parallel<lockstep::Int8Wire, true>(4, engines);
  }
  check_data_parallel<lockstep::Bf16Wire, false>(4);
  check_data_parallel<lockstep::Int8Wire, false>(4);
}
}
