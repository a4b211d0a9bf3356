// The kernels a training step runs (one multi-tensor engine: pack/unpack/scale, unscale +
// inf/NaN check + sum of squares, clip_grad_norm, the loss-scale update, FusedSgd and
// FusedAdamW) against host references, on random data: many tensors of odd sizes at unaligned
// offsets (more than one launch's worth), all four floating types, outputs poisoned with NaN
// first. Elementwise kernels whose arithmetic is one rounding per element are compared bit for
// bit; reductions and optimizers to a tolerance.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "gpu_test_util.cuh"
#include "lockstep/cuda.cuh"
#include "lockstep/cuda/kernels/permutation.cuh"

namespace {

namespace k = lockstep::cuda::kernels;
using lockstep::dtype;
using lockstep::segment;

// ---- host-side element conversions (the reference's own, not the kernels') ----------
template <class T>
struct host_el;
template <>
struct host_el<float> {
  using acc = float;
  static float to(float x) { return x; }
  static float from(float x) { return x; }
};
template <>
struct host_el<double> {
  using acc = double;
  static double to(double x) { return x; }
  static double from(double x) { return x; }
};
template <>
struct host_el<__half> {
  using acc = float;
  static float to(__half x) { return __half2float(x); }
  static __half from(float x) { return __float2half_rn(x); }
};
template <>
struct host_el<__nv_bfloat16> {
  using acc = float;
  static float to(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}
template <class T>
bool poisoned(const T& a) {  // the 0xFF fill: NaN in every floating type
  const auto* b = reinterpret_cast<const unsigned char*>(&a);
  return std::all_of(b, b + sizeof(T), [](unsigned char c) { return c == 0xFF; });
}

// ---- device memory and streams ----------------------------------------------------------
struct DevBuf {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit DevBuf(std::size_t b) : bytes(b) { LOCKSTEP_TRY_CUDA(cudaMalloc(&p, b ? b : 1)); }
  ~DevBuf() {
    if (p) (void)cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
  void poison() { LOCKSTEP_TRY_CUDA(cudaMemset(p, 0xFF, bytes)); }
  template <class T>
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() * sizeof(T) <= bytes);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  void upload_value(T v) {
    upload(std::vector<T>{v});
  }
  template <class T>
  std::vector<T> download(std::size_t n) const {
    REQUIRE(n * sizeof(T) <= bytes);
    std::vector<T> h(n);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  template <class T>
  T value() const {
    return download<T>(1)[0];
  }
};

using lockstep::test::Stream;

// ---- layouts: tensors at random (unaligned) element offsets in one arena ---------------
struct Layout {
  std::vector<std::size_t> off, cnt;
  std::size_t span = 0;   // arena elements, gaps included
  std::size_t total = 0;  // Σ cnt
};

Layout make_layout(std::mt19937_64& rng, std::size_t n_small, std::vector<std::size_t> sizes, bool gaps) {
  std::uniform_int_distribution<std::size_t> small(1, 40), gap(0, 7);
  for (std::size_t i = 0; i < n_small; ++i) sizes.push_back(small(rng));
  std::shuffle(sizes.begin(), sizes.end(), rng);
  Layout L;
  std::size_t at = gaps ? gap(rng) : 0;
  for (auto c : sizes) {
    L.off.push_back(at);
    L.cnt.push_back(c);
    L.total += c;
    at += c + (gaps ? gap(rng) : 0);
  }
  L.span = at + 1;
  return L;
}

std::vector<segment> segments_of(const Layout& L, void* base, std::size_t esize) {
  std::vector<segment> s;
  for (std::size_t i = 0; i < L.cnt.size(); ++i)
    s.push_back({static_cast<unsigned char*>(base) + L.off[i] * esize, L.cnt[i]});
  return s;
}

// Sizes that hit every path: single elements, vector tails, chunk borders, a big odd one.
const std::vector<std::size_t> kSpecial{1, 3, 7, 8, 17, 16383, 16384, 16385, 1000003};
const std::vector<std::size_t> kFew{1, 3, 1000003, 17, 4096};
// > one launch for every table: 1-list ≈1630, 2-list ≈1160, SGD ≈740, AdamW ≈610 tensors.
constexpr std::size_t kManySmall = 1800;

template <class T>
std::vector<T> random_values(std::mt19937_64& rng, std::size_t n, double sigma) {
  std::normal_distribution<double> nd(0.0, sigma);
  std::vector<T> v(n);
  for (auto& x : v) x = host_el<T>::from(static_cast<typename host_el<T>::acc>(nd(rng)));
  return v;
}

std::uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

template <class T>
constexpr dtype dt() {
  return lockstep::dtype_of<T>;
}

}  // namespace

// The start of a randomised test on one GPU: skips the test case where none is visible, then
// declares `seed` (fresh; INFO reports it with any failure), `rng` seeded with it and a stream `s`.
#define SEEDED_GPU_TEST()         \
  LOCKSTEP_REQUIRE_GPUS(1);       \
  const auto seed = fresh_seed(); \
  INFO("seed = ", seed);          \
  std::mt19937_64 rng(seed);      \
  Stream s

TEST_SUITE("gpu") {

TEST_CASE_TEMPLATE("kernels: pack - unpack and scale match the host", T, float, double, __half, __nv_bfloat16) {
  using H = host_el<T>;
  using A = typename H::acc;
  SEEDED_GPU_TEST();
  for (int variant = 0; variant < 2; ++variant) {
    CAPTURE(variant);
    const Layout L = variant == 0 ? make_layout(rng, kManySmall, kSpecial, true) : make_layout(rng, 0, kFew, true);
    const auto src = random_values<T>(rng, L.span, 1.0);
    std::vector<T> concat;
    for (std::size_t i = 0; i < L.cnt.size(); ++i)
      concat.insert(concat.end(), src.begin() + L.off[i], src.begin() + L.off[i] + L.cnt[i]);

    DevBuf d_src(L.span * sizeof(T)), d_dst((L.total + 2) * sizeof(T));
    d_src.upload(src);
    T* dst = d_dst.as<T>() + 1;  // one element in: misaligned against most sources
    const auto segs = segments_of(L, d_src.p, sizeof(T));

    for (double factor : {1.0, 0.3, -2.5}) {
      CAPTURE(factor);
      d_dst.poison();
      k::pack(segs, dst, dt<T>(), factor, s.s);
      s.sync();
      const auto out = d_dst.download<T>(L.total + 2);
      std::size_t bad = 0, first_bad = 0;
      for (std::size_t i = 0; i < L.total; ++i) {
        const T want = factor == 1.0 ? concat[i] : H::from(H::to(concat[i]) * static_cast<A>(factor));
        if (!same_bits(out[i + 1], want) && bad++ == 0) first_bad = i;
      }
      CAPTURE(first_bad);
      CHECK(bad == 0);
      CHECK(poisoned(out.front()));  // nothing written outside [dst, dst + total)
      CHECK(poisoned(out.back()));
    }

    // unpack scatters the packed copy back; the gaps between segments stay untouched.
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dst, concat.data(), L.total * sizeof(T), cudaMemcpyHostToDevice));
    DevBuf d_back(L.span * sizeof(T));
    d_back.poison();
    k::unpack(dst, segments_of(L, d_back.p, sizeof(T)), dt<T>(), s.s);
    s.sync();
    const auto back = d_back.download<T>(L.span);
    std::vector<char> inside(L.span, 0);
    for (std::size_t i = 0; i < L.cnt.size(); ++i) std::fill_n(inside.begin() + L.off[i], L.cnt[i], 1);
    std::size_t bad = 0;
    for (std::size_t e = 0; e < L.span; ++e)
      if (inside[e] ? !same_bits(back[e], src[e]) : !poisoned(back[e])) ++bad;
    CHECK(bad == 0);

    // scale in place, on the misaligned packed buffer and on one odd-sized segment
    k::scale(dst, L.total, dt<T>(), 3.0, s.s);
    k::scale(dst, L.total, dt<T>(), 1.0, s.s);  // a no-op
    s.sync();
    const auto scaled = d_dst.download<T>(L.total + 2);
    bad = 0;
    for (std::size_t i = 0; i < L.total; ++i)
      if (!same_bits(scaled[i + 1], H::from(H::to(concat[i]) * static_cast<A>(3.0)))) ++bad;
    CHECK(bad == 0);
  }
}

TEST_CASE("kernels: pack and unpack copy any element type exactly") {
  SEEDED_GPU_TEST();
  const Layout L = make_layout(rng, 1300, kSpecial, true);
  for (dtype t : {dtype::u8, dtype::i32, dtype::i64, dtype::f16}) {
    CAPTURE(lockstep::name_of(t));
    const std::size_t es = lockstep::size_of(t);
    std::vector<unsigned char> src(L.span * es);
    for (auto& b : src) b = static_cast<unsigned char>(rng());
    DevBuf d_src(src.size()), d_dst((L.total + 3) * es), d_back(src.size());
    d_src.upload(src);
    d_dst.poison();
    auto* dst = d_dst.as<unsigned char>() + es * 3;
    k::pack(segments_of(L, d_src.p, es), dst, t, 1.0, s.s);
    d_back.poison();
    k::unpack(dst, segments_of(L, d_back.p, es), t, s.s);
    s.sync();
    const auto out = d_dst.download<unsigned char>((L.total + 3) * es);
    const auto back = d_back.download<unsigned char>(src.size());
    std::size_t at = 3 * es, bad = 0;
    for (std::size_t i = 0; i < L.cnt.size(); ++i) {
      const std::size_t b = L.cnt[i] * es;
      if (std::memcmp(out.data() + at, src.data() + L.off[i] * es, b) != 0) ++bad;
      if (std::memcmp(back.data() + L.off[i] * es, src.data() + L.off[i] * es, b) != 0) ++bad;
      at += b;
    }
    CHECK(bad == 0);
    CHECK(std::all_of(out.begin(), out.begin() + 3 * es, [](unsigned char c) { return c == 0xFF; }));
  }
  // Integers cannot be scaled; the call says so before touching the device.
  DevBuf tmp(64);
  std::vector<segment> none;
  CHECK_THROWS_AS(k::pack(none, tmp.p, dtype::i32, 0.5, s.s), lockstep::config_error);
  std::vector<segment> nullseg{{nullptr, 5}};
  CHECK_THROWS_AS(k::pack(nullseg, tmp.p, dtype::f32, 1.0, s.s), lockstep::config_error);
}

TEST_CASE_TEMPLATE("kernels: unscale multiplies in place - flags inf/NaN results - sums squares per chunk", T, float,
                   double, __half, __nv_bfloat16) {
  using H = host_el<T>;
  using A = typename H::acc;
  SEEDED_GPU_TEST();
  const double rel = std::is_same_v<T, double> ? 1e-12 : 1e-5;
  DevBuf d_factor(sizeof(double)), d_found(sizeof(int));
  for (int variant = 0; variant < 2; ++variant) {
    CAPTURE(variant);
    const Layout L = variant == 0 ? make_layout(rng, kManySmall, kSpecial, true) : make_layout(rng, 0, kFew, true);
    const auto g0 = random_values<T>(rng, L.span, 50.0);
    DevBuf d_g(L.span * sizeof(T));
    const auto segs = segments_of(L, d_g.p, sizeof(T));
    const std::size_t chunks = k::unscale_chunks<T>(segs);
    DevBuf d_partials(chunks * sizeof(double));

    // The factor from the host and from device memory (DeviceDynamicScale's path), as the
    // scalers use it: 1/scale, a non-power of two, and 1 (read only: the check alone).
    for (double f : {1.0 / 1024, 0.3, 1.0})
      for (bool on_device : {false, true}) {
        CAPTURE(f);
        CAPTURE(on_device);
        d_g.upload(g0);
        d_factor.upload_value(f);
        d_found.upload_value(0);
        d_partials.poison();
        const std::size_t n =
            k::unscale(segs, dt<T>(), on_device ? 0.5 : f, on_device ? d_factor.as<double>() : nullptr,
                       d_found.as<int>(), d_partials.as<double>(), s.s);
        s.sync();
        CHECK(n == chunks);
        const auto g = d_g.download<T>(L.span);
        std::vector<char> inside(L.span, 0);
        long double ref = 0;
        std::size_t bad = 0;
        for (std::size_t i = 0; i < L.cnt.size(); ++i)
          for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e) {
            inside[e] = 1;
            const T want = f == 1.0 ? g0[e] : H::from(H::to(g0[e]) * static_cast<A>(f));
            if (!same_bits(g[e], want)) ++bad;
            const long double x = static_cast<long double>(H::to(want));
            ref += x * x;
          }
        for (std::size_t e = 0; e < L.span; ++e)
          if (!inside[e] && !same_bits(g[e], g0[e])) ++bad;  // gaps untouched
        CHECK(bad == 0);
        CHECK(d_found.value<int>() == 0);
        const auto partials = d_partials.download<double>(chunks);
        long double got = 0;
        for (double x : partials) got += x;  // every chunk wrote its sum (no NaN poison left)
        CAPTURE(static_cast<double>(got));
        CAPTURE(static_cast<double>(ref));
        CHECK(std::abs(static_cast<double>(got - ref)) <= rel * static_cast<double>(ref));
      }

    // The flag is never reset by the kernel.
    d_g.upload(g0);
    d_found.upload_value(1);
    k::unscale(segs, dt<T>(), 0.5, nullptr, d_found.as<int>(), nullptr, s.s);
    s.sync();
    CHECK(d_found.value<int>() == 1);

    // One non-finite value anywhere in one tensor sets it; so does a finite value that the
    // factor pushes past the largest finite value (the result is checked, as on the host).
    const T specials[] = {H::from(std::numeric_limits<A>::infinity()), H::from(-std::numeric_limits<A>::infinity()),
                          H::from(std::numeric_limits<A>::quiet_NaN()),
                          H::from(static_cast<A>(std::is_same_v<T, __half>   ? 60000.0
                                                 : std::is_same_v<T, double> ? 1e308
                                                                             : 3e38))};
    for (int kind = 0; kind < 4; ++kind)
      for (int where = 0; where < 3; ++where) {
        CAPTURE(kind);
        CAPTURE(where);
        const double f = kind == 3 ? 4.0 : 0.5;
        const std::size_t ti = std::uniform_int_distribution<std::size_t>(0, L.cnt.size() - 1)(rng);
        const std::size_t n = L.cnt[ti];
        const std::size_t pos = L.off[ti] + (where == 0   ? 0
                                             : where == 1 ? n - 1
                                                          : std::uniform_int_distribution<std::size_t>(0, n - 1)(rng));
        auto g = g0;
        for (auto& x : g) x = H::from(H::to(x) / static_cast<A>(64));  // small enough for f = 4
        g[pos] = specials[kind];
        d_g.upload(g);
        d_found.upload_value(0);
        k::unscale(segs, dt<T>(), f, nullptr, d_found.as<int>(), nullptr, s.s);
        s.sync();
        CHECK(d_found.value<int>() == 1);
        const auto out = d_g.download<T>(L.span);
        CHECK(!std::isfinite(static_cast<double>(H::to(out[pos]))));
        std::size_t bad = 0;  // everything else was still multiplied
        for (std::size_t i = 0; i < L.cnt.size(); ++i)
          for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e)
            if (e != pos && !same_bits(out[e], H::from(H::to(g[e]) * static_cast<A>(f)))) ++bad;
        CHECK(bad == 0);
      }
  }
}

TEST_CASE_TEMPLATE("kernels: sum_of_squares over groups is the host's - clip_grad_norm on device scales by its rule", T,
                   float, double, __half, __nv_bfloat16) {
  using H = host_el<T>;
  using A = typename H::acc;
  SEEDED_GPU_TEST();
  const double rel = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  const Layout L = make_layout(rng, kManySmall, kSpecial, true);
  const auto g0 = random_values<T>(rng, L.span, 1.0);
  // A second group of another type: the sum runs over every group, in order.
  const auto f0 = random_values<float>(rng, 12345, 1.0);
  DevBuf d_g(L.span * sizeof(T)), d_f(f0.size() * sizeof(float));
  d_f.upload(f0);
  const auto segs = segments_of(L, d_g.p, sizeof(T));
  const std::vector<segment> fsegs{{d_f.p, f0.size()}};
  const std::vector<lockstep::grad_group> groups{{dt<T>(), segs}, {dtype::f32, fsegs}};
  long double ref = 0;
  for (std::size_t i = 0; i < L.cnt.size(); ++i)
    for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e)
      ref += static_cast<long double>(H::to(g0[e])) * H::to(g0[e]);
  for (float x : f0) ref += static_cast<long double>(x) * x;
  const double norm_ref = std::sqrt(static_cast<double>(ref));
  for (double max_norm : {0.25 * norm_ref, 4.0 * norm_ref}) {  // clips, then leaves alone
    CAPTURE(max_norm);
    d_g.upload(g0);
    d_f.upload(f0);
    lockstep::CudaMemory mem(0, s.s);
    const double norm = lockstep::clip_grad_norm(mem, groups, max_norm);
    s.sync();
    CHECK(std::abs(norm - norm_ref) <= rel * norm_ref);
    const double coef = max_norm / (norm + 1e-6);
    const auto g = d_g.download<T>(L.span);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < L.cnt.size(); ++i)
      for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e) {
        const T want = coef < 1 ? H::from(H::to(g0[e]) * static_cast<A>(coef)) : g0[e];
        if (!same_bits(g[e], want)) ++bad;
      }
    CHECK(bad == 0);
  }
  // Equal inputs, equal sums: the order is fixed by the layout (what keeps ranks' norms equal).
  d_g.upload(g0);
  const double a = k::sum_of_squares(groups, s.s), b = k::sum_of_squares(groups, s.s);
  CHECK(std::memcmp(&a, &b, sizeof a) == 0);
}

TEST_CASE("kernels: update_scale is DynamicScale::update on the device") {
  SEEDED_GPU_TEST();
  namespace kk = lockstep::cuda::kernels;
  for (lockstep::DynamicScaleOptions o :
       {lockstep::DynamicScaleOptions{.init_scale = 1024, .growth_interval = 3, .min_scale = 1, .max_scale = 65536},
        lockstep::DynamicScaleOptions{.init_scale = 3,
                                      .growth_factor = 1.5,
                                      .backoff_factor = 0.3,
                                      .growth_interval = 5,
                                      .min_scale = 0.01,
                                      .max_scale = 1e6},
        lockstep::DynamicScaleOptions{.growth_interval = 1}}) {
    CAPTURE(o.growth_interval);
    lockstep::DynamicScale host(o);
    DevBuf d_state(sizeof(kk::device_scale_state));
    d_state.upload_value(kk::make_device_scale_state(host.state()));
    DevBuf d_votes(2 * sizeof(int));  // the agreed flag, then one rank's own flag (see the watch test)
    std::bernoulli_distribution coin(0.3);
    for (int step = 0; step < 300; ++step) {
      CAPTURE(step);
      // clean runs (growth to the ceiling), inf runs (backoff to the floor), then random
      const int found = step < 80 ? 0 : step < 160 ? 1 : (coin(rng) ? 1 : 0);
      d_votes.upload_value(std::array<int, 2>{found, found});
      kk::update_scale(d_state.as<kk::device_scale_state>(), o, d_votes.as<int>(), 1, s.s);
      s.sync();
      REQUIRE(d_votes.value<std::array<int, 2>>()[1] == 0);  // the rank's own flag is consumed
      host.update(found != 0);
      const auto dev = d_state.value<kk::device_scale_state>();
      const auto want = host.state();
      REQUIRE(dev.scale == want.scale);
      REQUIRE(dev.good_steps == want.good_steps);
      REQUIRE(dev.skipped_steps == want.skipped_steps);
      REQUIRE(dev.steps == want.steps);
      REQUIRE(dev.inv_scale == 1.0 / want.scale);
      REQUIRE(dev.scale_f32 == static_cast<float>(want.scale));
      REQUIRE(dev.found_inf == found);  // the agreed vote, for the optimizers
    }
  }
}

// The skip watch (mapped host memory the host reads without waiting): the first step of a run
// of skips whose votes name ranks is recorded (count, ranks, step), a clean step forgets it, and
// at max_consecutive_skips the count is raised and the watch freezes for the error message.
TEST_CASE("kernels: update_scale skip watch records the ranks that voted - clean steps forget - frozen at the limit") {
  SEEDED_GPU_TEST();
  namespace kk = lockstep::cuda::kernels;
  const int world = 2 + static_cast<int>(rng() % 70);  // ranks past 63 are counted, not listed
  const int limit = 4;
  CAPTURE(world);
  const lockstep::DynamicScaleOptions o{.init_scale = 1024, .max_consecutive_skips = limit};
  DevBuf d_state(sizeof(kk::device_scale_state));
  d_state.upload_value(kk::make_device_scale_state(lockstep::DynamicScale(o).state()));
  DevBuf d_votes((1 + static_cast<std::size_t>(world)) * sizeof(int));
  kk::skip_watch* w = nullptr;
  LOCKSTEP_TRY_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&w), sizeof *w, cudaHostAllocMapped));
  *w = {};
  kk::skip_watch* dw = nullptr;
  LOCKSTEP_TRY_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dw), w, 0));
  std::int64_t step = 0;
  const auto one = [&](int found, std::vector<int> ranks) {
    std::vector<int> v(1 + static_cast<std::size_t>(world), 0);
    v[0] = found;
    for (int r : ranks) v[1 + static_cast<std::size_t>(r)] = 1;
    LOCKSTEP_TRY_CUDA(cudaMemcpy(d_votes.p, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice));
    kk::update_scale(d_state.as<kk::device_scale_state>(), o, d_votes.as<int>(), world, s.s, dw);
    s.sync();
    ++step;
    std::vector<int> after(v.size());
    LOCKSTEP_TRY_CUDA(cudaMemcpy(after.data(), d_votes.p, after.size() * sizeof(int), cudaMemcpyDeviceToHost));
    for (std::size_t r = 1; r < after.size(); ++r) REQUIRE(after[r] == 0);  // consumed
  };
  const int a = static_cast<int>(rng() % static_cast<unsigned>(world));
  const int b = static_cast<int>((static_cast<unsigned>(a) + 1 + rng() % static_cast<unsigned>(world - 1)) %
                                 static_cast<unsigned>(world));
  CAPTURE(a);
  CAPTURE(b);
  one(1, {});  // a skip nobody checked: nothing recorded
  CHECK(w->in_a_row == 1);
  CHECK(w->origin_step == 0);
  one(1, {a});  // found: rank a, step 2
  CHECK(w->origin_step == 2);
  CHECK(w->origin_ranks == 1);
  CHECK(w->origin_mask == (a < 64 ? std::uint64_t{1} << a : 0));
  one(1, {b});  // the first finding stays
  CHECK(w->origin_step == 2);
  CHECK(w->origin_mask == (a < 64 ? std::uint64_t{1} << a : 0));
  one(0, {});  // a clean step ends the run
  CHECK(w->in_a_row == 0);
  CHECK(w->origin_step == 0);
  CHECK(w->stalled == 0);
  one(1, {a, b});  // steps 5..8: limit 4
  CHECK(w->origin_step == 5);
  CHECK(w->origin_ranks == 2);
  CHECK(w->origin_mask == ((a < 64 ? std::uint64_t{1} << a : 0) | (b < 64 ? std::uint64_t{1} << b : 0)));
  for (int i = 0; i < limit - 1; ++i) one(1, {});
  CHECK(w->stalled == limit);
  one(0, {});  // frozen: the host still reads the cause
  CHECK(w->stalled == limit);
  CHECK(w->origin_step == 5);
  CHECK(d_state.value<kk::device_scale_state>().steps == step);
  LOCKSTEP_TRY_CUDA(cudaFreeHost(w));
}

TEST_CASE("kernels: device_permutation is a seeded permutation") {
  LOCKSTEP_REQUIRE_GPUS(1);
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  Stream s;
  for (std::size_t n : {std::size_t{1}, std::size_t{2}, std::size_t{1000}, std::size_t{1000003}}) {
    CAPTURE(n);
    DevBuf a(n * 8), b(n * 8), c(n * 8);
    a.poison();
    k::device_permutation(seed, n, a.as<std::uint64_t>(), s.s);
    k::device_permutation(seed, n, b.as<std::uint64_t>(), s.s);
    k::device_permutation(seed + 1, n, c.as<std::uint64_t>(), s.s);
    s.sync();
    const auto pa = a.download<std::uint64_t>(n), pb = b.download<std::uint64_t>(n), pc = c.download<std::uint64_t>(n);
    CHECK(pa == pb);  // deterministic
    auto sorted = pa;
    std::sort(sorted.begin(), sorted.end());
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += sorted[i] != i;
    CHECK(bad == 0);  // every index exactly once
    if (n >= 1000) {
      CHECK(pa != pc);  // the seed matters
      std::size_t fixed = 0;
      for (std::size_t i = 0; i < n; ++i) fixed += pa[i] == i;
      CHECK(fixed < 20);  // shuffled (≈1 fixed point expected), not the identity
    }
  }
}

namespace {

//! One optimizer test world: many parameters (more than one launch's worth) at odd offsets
//! of one arena, gradients in another, shifted by `shift` elements (1: every tensor takes the
//! scalar path), and the CPU optimizer's view: host_w (the parameters, or for f16/bf16 the
//! fp32 masters they are rounded from) and the gradients as A.
template <class T>
struct OptWorld {
  using H = host_el<T>;
  using A = typename H::acc;
  static constexpr bool half = sizeof(T) == 2;
  Layout L;
  std::size_t shift;
  DevBuf p, g;
  std::vector<A> host_w;
  OptWorld(std::mt19937_64& rng, Layout lay, std::size_t grad_shift)
      : L(std::move(lay)), shift(grad_shift), p(L.span * sizeof(T)), g((L.span + 1) * sizeof(T)) {
    std::normal_distribution<double> nd(0.0, 1.0);
    host_w.resize(L.span);
    std::vector<T> pv(L.span);
    for (std::size_t e = 0; e < L.span; ++e) {
      pv[e] = H::from(static_cast<A>(nd(rng)));
      host_w[e] = H::to(pv[e]);  // the master starts as the parameter's value, exactly
    }
    p.upload(pv);
  }
  //! The device parameters, one per tensor of the layout (the fused optimizer's slots).
  std::vector<lockstep::parameter> params() const {
    std::vector<lockstep::parameter> out;
    for (std::size_t i = 0; i < L.cnt.size(); ++i)
      out.push_back(lockstep::param<T>(std::to_string(i), p.as<T>() + L.off[i], g.as<T>() + L.off[i] + shift,
                                       {static_cast<std::int64_t>(L.cnt[i])}));
    return out;
  }
  //! New random gradients: device copy, and the CPU view (as A) in `hg`.
  void new_grads(std::mt19937_64& rng, std::vector<A>& hg) {
    auto gv = random_values<T>(rng, L.span + 1, 1.0);
    g.upload(gv);
    hg.resize(L.span);
    for (std::size_t e = 0; e < L.span; ++e) hg[e] = H::to(gv[e + shift]);
  }
  //! CPU segments of host_w / hg for the host optimizer's step_segments (slot = tensor).
  void step_cpu(auto& cpu, std::vector<A>& hg, bool skip) {
    std::vector<std::size_t> slots;
    std::vector<segment> v, gs;
    for (std::size_t i = 0; i < L.cnt.size(); ++i) {
      slots.push_back(i);
      v.push_back({host_w.data() + L.off[i], L.cnt[i]});
      gs.push_back({hg.data() + L.off[i], L.cnt[i]});
    }
    cpu.step_segments(slots, v, gs, lockstep::dtype_of<A>, skip);
  }
};

template <class T>
double opt_tol() {
  return std::is_same_v<T, double> ? 1e-13 : 2e-6;
}

double rel_err(double got, double want) { return std::abs(got - want) / std::max(1.0, std::abs(want)); }

//! A host copy of gpu's state image, read by another optimizer of the same options (never
//! stepped, over parameters of the same shapes), gives what gpu.save() writes, byte for byte;
//! an image of other shapes is refused.
template <class Rule, class T>
void check_image(const lockstep::FusedOptimizer<Rule>& gpu, const typename Rule::options& o, const OptWorld<T>& w) {
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  const auto img = gpu.state_image();
  std::vector<std::byte> host(img.size());
  LOCKSTEP_TRY_CUDA(cudaMemcpy(host.data(), img.data(), img.size(), cudaMemcpyDeviceToHost));
  std::vector<lockstep::param_shape> shapes;
  for (const auto& p : w.params()) shapes.push_back({p.numel(), p.type});
  const lockstep::FusedOptimizer<Rule> other(o, w.params());
  lockstep::byte_writer bw;
  other.save_image(shapes, host, bw);
  CHECK(std::move(bw).release() == lockstep::to_bytes(gpu));
  for (int k = 0; k < 40; ++k) shapes.push_back({1000, dt<T>()});  // (40 more step counters: 320 bytes)
  lockstep::byte_writer bad;
  CHECK_THROWS_AS(other.save_image(shapes, host, bad), lockstep::checkpoint_error);
}

//! Fused (rule R, parameters of T) against the host optimizer on A copies over `steps` steps,
//! some skipped through the device flag: parameters, masters and every state buffer agree
//! (within opt_tol: AdamW's pow differs in the last bit between host and device libraries),
//! a skipped step changes nothing at all, and the step counters count the steps taken.
template <class Cpu, class T>
void check_rule(std::mt19937_64& rng, const typename Cpu::options_type& o, int steps, std::vector<int> skipped) {
  using Rule = typename Cpu::rule_type;
  using A = typename host_el<T>::acc;
  for (std::size_t shift : {0, 1}) {
    CAPTURE(shift);
    OptWorld<T> w(rng, make_layout(rng, 800, kSpecial, true), shift);
    Stream s;
    DevBuf found(sizeof(int));
    lockstep::FusedOptimizer<Rule> gpu(o, w.params());
    Cpu cpu(o);
    std::vector<A> hg;
    int taken = 0;
    for (int st = 0; st < steps; ++st) {
      CAPTURE(st);
      w.new_grads(rng, hg);
      const bool skip = std::find(skipped.begin(), skipped.end(), st) != skipped.end();
      found.upload_value(skip ? 1 : 0);
      const auto before = skip ? w.p.template download<unsigned char>(w.p.bytes) : std::vector<unsigned char>{};
      const auto state_before =
          skip ? lockstep::test::parse_blob(lockstep::to_bytes(gpu), Rule::saves_step) : lockstep::test::parsed_blob{};
      gpu.step_all(w.params(), s.s, found.template as<int>());
      s.sync();
      if (skip) {  // parameters, states and step counters as they were, bit for bit
        CHECK(w.p.template download<unsigned char>(w.p.bytes) == before);
        const auto after = lockstep::test::parse_blob(lockstep::to_bytes(gpu), Rule::saves_step);
        REQUIRE(after.slots.size() == state_before.slots.size());
        std::size_t changed = 0;
        for (std::size_t i = 0; i < after.slots.size(); ++i) {
          const auto &x = after.slots[i], &y = state_before.slots[i];
          changed += x.has != y.has || x.step != y.step || x.a != y.a || x.b != y.b;
        }
        CHECK(changed == 0);
        // A half parameter's master is filled from its value at its first step, skipped or
        // not: the values are unchanged, so the master holds them exactly.
        if constexpr (OptWorld<T>::half)
          for (const auto& [slot, m] : after.masters)
            for (std::size_t j = 0; j < m.size(); ++j)
              if (!same_bits(host_el<T>::from(m[j]), host_el<T>::from(static_cast<float>(w.host_w[w.L.off[slot] + j]))))
                ++changed;
        CHECK(changed == 0);
      }
      w.step_cpu(cpu, hg, skip);
      taken += skip ? 0 : 1;
      check_image(gpu, o, w);  // (also after a skipped first step: masters filled, counters 0)
    }
    const auto blob = lockstep::to_bytes(gpu);
    const auto parsed = lockstep::test::parse_blob(blob, Rule::saves_step);
    REQUIRE(parsed.slots.size() == w.L.cnt.size());
    const auto pv = w.p.template download<T>(w.L.span);
    double worst = 0;
    std::size_t bad_round = 0;
    for (std::size_t i = 0; i < w.L.cnt.size(); ++i) {
      const auto& sl = parsed.slots[i];
      if (Rule::saves_step) CHECK(sl.step == taken);
      for (std::size_t j = 0; j < w.L.cnt[i]; ++j) {
        const std::size_t e = w.L.off[i] + j;
        double got = static_cast<double>(host_el<T>::to(pv[e]));
        if constexpr (OptWorld<T>::half) {
          const float m = parsed.masters[i].second[j];
          if (!same_bits(pv[e], host_el<T>::from(m))) ++bad_round;  // the parameter is its master rounded
          got = m;
        }
        worst = std::max(worst, rel_err(got, static_cast<double>(w.host_w[e])));
        const auto s0 = cpu.template state<A>(i, 0), s1 = cpu.template state<A>(i, 1);
        if (!sl.a.empty()) worst = std::max(worst, rel_err(sl.a[j], static_cast<double>(s0[j])));
        if (!sl.b.empty()) worst = std::max(worst, rel_err(sl.b[j], static_cast<double>(s1[j])));
      }
    }
    INFO("worst relative difference to the host optimizer: ", worst);
    CHECK(worst <= opt_tol<T>());
    CHECK(bad_round == 0);
    if constexpr (OptWorld<T>::half) CHECK(parsed.masters.size() == w.L.cnt.size());
  }
}

}  // namespace

TEST_CASE_TEMPLATE("kernels: FusedSgd matches lockstep::Sgd on many tensors - and skips bit-exactly", T, float, double,
                   __half, __nv_bfloat16) {
  LOCKSTEP_REQUIRE_GPUS(1);
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  for (const lockstep::SgdOptions& o :
       {lockstep::SgdOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
        lockstep::SgdOptions{.lr = 0.02, .momentum = 0.8, .weight_decay = 0.05, .nesterov = true},
        lockstep::SgdOptions{.lr = 0.1, .weight_decay = 0.1}}) {
    CAPTURE(o.momentum);
    check_rule<lockstep::Sgd, T>(rng, o, 5, {2});
  }
  // A slice that does not fit its parameter is refused before anything is queued.
  OptWorld<T> w(rng, make_layout(rng, 0, {5}, false), 0);
  lockstep::FusedSgd opt({.lr = 0.1, .momentum = 0.9}, w.params());
  const lockstep::param_slice bad{0, 3, 4, dt<T>(), w.p.p, w.g.p};
  CHECK_THROWS_AS(opt.step(std::span(&bad, 1), nullptr), lockstep::config_error);
}

TEST_CASE_TEMPLATE("kernels: FusedAdamW matches lockstep::AdamW on many tensors - and skips bit-exactly", T, float,
                   double, __half, __nv_bfloat16) {
  LOCKSTEP_REQUIRE_GPUS(1);
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  for (const lockstep::AdamWOptions& o :
       {lockstep::AdamWOptions{.lr = 1e-2},
        lockstep::AdamWOptions{.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1}}) {
    CAPTURE(o.lr);
    check_rule<lockstep::AdamW, T>(rng, o, 6, {0, 3});  // also a skipped *first* step
  }
}

}  // TEST_SUITE
