// The multi-tensor kernels and fused optimizers against host references, on random data:
// many tensors of odd sizes at unaligned offsets (more than one launch's worth), all four
// floating types, outputs poisoned with NaN first. Elementwise kernels whose arithmetic is
// one rounding per element are compared bit for bit; reductions and optimizers to a tolerance.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
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
#include "lockstep/adamw.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/multi_tensor.cuh"
#include "lockstep/cuda/kernels/optimizers.cuh"
#include "lockstep/sgd.hpp"

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
  T* as() const { return static_cast<T*>(p); }
  void poison() { LOCKSTEP_TRY_CUDA(cudaMemset(p, 0xFF, bytes)); }
  template <class T>
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() * sizeof(T) <= bytes);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T>
  void upload_value(T v) { upload(std::vector<T>{v}); }
  template <class T>
  std::vector<T> download(std::size_t n) const {
    REQUIRE(n * sizeof(T) <= bytes);
    std::vector<T> h(n);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  template <class T>
  T value() const { return download<T>(1)[0]; }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void sync() const { LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s)); }  // also surfaces kernel faults
};

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

TEST_SUITE("gpu") {

TEST_CASE_TEMPLATE("kernels: pack - unpack and scale match the host", T, float, double, __half,
                   __nv_bfloat16) {
  LOCKSTEP_REQUIRE_GPUS(1);
  using H = host_el<T>;
  using A = typename H::acc;
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  Stream s;
  for (int variant = 0; variant < 2; ++variant) {
    CAPTURE(variant);
    const Layout L = variant == 0 ? make_layout(rng, kManySmall, kSpecial, true)
                                  : make_layout(rng, 0, kFew, true);
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
    for (std::size_t i = 0; i < L.cnt.size(); ++i)
      std::fill_n(inside.begin() + L.off[i], L.cnt[i], 1);
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
  LOCKSTEP_REQUIRE_GPUS(1);
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  Stream s;
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

TEST_CASE_TEMPLATE("kernels: unscale_check unscales - flags inf/NaN and sums squares", T, float, double,
                   __half, __nv_bfloat16) {
  LOCKSTEP_REQUIRE_GPUS(1);
  using H = host_el<T>;
  using A = typename H::acc;
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  Stream s;
  const double rel = std::is_same_v<T, double> ? 1e-12 : 1e-5;
  DevBuf d_inv(sizeof(float)), d_found(sizeof(int)), d_sumsq(sizeof(double));
  for (int variant = 0; variant < 2; ++variant) {
    CAPTURE(variant);
    const Layout L = variant == 0 ? make_layout(rng, kManySmall, kSpecial, true)
                                  : make_layout(rng, 0, kFew, true);
    const auto g0 = random_values<T>(rng, L.span, 50.0);
    DevBuf d_g(L.span * sizeof(T));
    const auto segs = segments_of(L, d_g.p, sizeof(T));

    for (float inv : {1.0f / 1024, 0.3f, 1.0f}) {
      CAPTURE(inv);
      d_g.upload(g0);
      d_inv.upload_value(inv);
      d_found.upload_value(0);
      d_sumsq.upload_value(0.0);
      k::unscale_check(segs, dt<T>(), d_inv.as<float>(), d_found.as<int>(), d_sumsq.as<double>(), s.s);
      s.sync();
      const auto g = d_g.download<T>(L.span);
      std::vector<char> inside(L.span, 0);
      long double ref = 0;
      std::size_t bad = 0;
      for (std::size_t i = 0; i < L.cnt.size(); ++i)
        for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e) {
          inside[e] = 1;
          const T want = inv == 1.0f ? g0[e] : H::from(H::to(g0[e]) * static_cast<A>(inv));
          if (!same_bits(g[e], want)) ++bad;
          const long double x = static_cast<long double>(H::to(want));
          ref += x * x;
        }
      for (std::size_t e = 0; e < L.span; ++e)
        if (!inside[e] && !same_bits(g[e], g0[e])) ++bad;  // gaps untouched
      CHECK(bad == 0);
      CHECK(d_found.value<int>() == 0);
      const double got = d_sumsq.value<double>();
      CAPTURE(got);
      CAPTURE(static_cast<double>(ref));
      CHECK(std::abs(got - static_cast<double>(ref)) <= rel * static_cast<double>(ref));
    }

    // The flag is never reset by the kernel.
    d_g.upload(g0);
    d_found.upload_value(1);
    k::unscale_check(segs, dt<T>(), d_inv.as<float>(), d_found.as<int>(), nullptr, s.s);
    s.sync();
    CHECK(d_found.value<int>() == 1);

    // One non-finite value anywhere in one tensor sets it.
    const T specials[] = {H::from(std::numeric_limits<A>::infinity()),
                          H::from(-std::numeric_limits<A>::infinity()),
                          H::from(std::numeric_limits<A>::quiet_NaN())};
    for (int kind = 0; kind < 3; ++kind)
      for (int where = 0; where < 3; ++where) {
        CAPTURE(kind);
        CAPTURE(where);
        const std::size_t ti = std::uniform_int_distribution<std::size_t>(0, L.cnt.size() - 1)(rng);
        const std::size_t n = L.cnt[ti];
        const std::size_t pos =
            L.off[ti] + (where == 0 ? 0 : where == 1 ? n - 1 : std::uniform_int_distribution<std::size_t>(0, n - 1)(rng));
        auto g = g0;
        g[pos] = specials[kind];
        d_g.upload(g);
        d_inv.upload_value(0.5f);
        d_found.upload_value(0);
        d_sumsq.upload_value(0.0);
        k::unscale_check(segs, dt<T>(), d_inv.as<float>(), d_found.as<int>(), d_sumsq.as<double>(), s.s);
        s.sync();
        CHECK(d_found.value<int>() == 1);
        const auto out = d_g.download<T>(L.span);
        CHECK(!std::isfinite(static_cast<double>(H::to(out[pos]))));
        std::size_t bad = 0;  // everything else was still unscaled
        for (std::size_t i = 0; i < L.cnt.size(); ++i)
          for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e)
            if (e != pos && !same_bits(out[e], H::from(H::to(g0[e]) * static_cast<A>(0.5f)))) ++bad;
        CHECK(bad == 0);
      }
  }
}

TEST_CASE_TEMPLATE("kernels: scale_by_clip scales by min(1 - max_norm / norm)", T, float, double, __half,
                   __nv_bfloat16) {
  LOCKSTEP_REQUIRE_GPUS(1);
  using H = host_el<T>;
  using A = typename H::acc;
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  Stream s;
  const Layout L = make_layout(rng, kManySmall, kSpecial, true);
  const auto g0 = random_values<T>(rng, L.span, 1.0);
  DevBuf d_g(L.span * sizeof(T)), d_sumsq(sizeof(double));
  const auto segs = segments_of(L, d_g.p, sizeof(T));
  for (double sumsq : {2.5e6, 0.01}) {  // norm 1581 > max_norm 7 → clip; norm 0.1 → untouched
    CAPTURE(sumsq);
    const float max_norm = 7.0f;
    d_g.upload(g0);
    d_sumsq.upload_value(sumsq);
    k::scale_by_clip(segs, dt<T>(), d_sumsq.as<double>(), max_norm, s.s);
    s.sync();
    const auto g = d_g.download<T>(L.span);
    const double c = static_cast<double>(max_norm) / (std::sqrt(sumsq) + 1e-6);
    std::vector<char> inside(L.span, 0);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < L.cnt.size(); ++i)
      for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e) {
        inside[e] = 1;
        const T want = c < 1 ? H::from(H::to(g0[e]) * static_cast<A>(c)) : g0[e];
        if (!same_bits(g[e], want)) ++bad;
      }
    for (std::size_t e = 0; e < L.span; ++e)
      if (!inside[e] && !same_bits(g[e], g0[e])) ++bad;
    CHECK(bad == 0);
  }
}

TEST_CASE("kernels: update_dynamic_scale follows GradScaler") {
  LOCKSTEP_REQUIRE_GPUS(1);
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  Stream s;
  struct Cfg {
    float growth, backoff;
    int interval;
    float min_s, max_s;
  };
  for (Cfg cfg : {Cfg{2.0f, 0.5f, 3, 1.0f, 16777216.0f}, Cfg{1.5f, 0.3f, 5, 0.01f, 1e6f}, Cfg{2.0f, 0.5f, 1, 1.0f, 3e38f}}) {
    CAPTURE(cfg.interval);
    // Reference: PyTorch's _amp_update_scale, then the clamp, inv = 1/scale via double.
    float scale = 65536.0f;
    int tracker = 0;
    DevBuf d_scale(4), d_inv(4), d_tracker(4), d_found(4);
    d_scale.upload_value(scale);
    d_tracker.upload_value(0);
    std::bernoulli_distribution coin(0.3);
    for (int step = 0; step < 300; ++step) {
      CAPTURE(step);
      // clean runs (growth to the max), inf runs (backoff to the min), then random
      const int found = step < 80 ? 0 : step < 160 ? 1 : (coin(rng) ? 1 : 0);
      d_found.upload_value(found);
      k::update_dynamic_scale(d_scale.as<float>(), d_inv.as<float>(), d_tracker.as<int>(), d_found.as<int>(),
                              cfg.growth, cfg.backoff, cfg.interval, cfg.min_s, cfg.max_s, s.s);
      s.sync();
      if (found) {
        scale *= cfg.backoff;
        tracker = 0;
      } else if (++tracker == cfg.interval) {
        const float grown = scale * cfg.growth;
        if (std::isfinite(grown)) scale = grown;
        tracker = 0;
      }
      scale = std::min(std::max(scale, cfg.min_s), cfg.max_s);
      REQUIRE(d_scale.value<float>() == scale);
      REQUIRE(d_tracker.value<int>() == tracker);
      REQUIRE(d_inv.value<float>() == static_cast<float>(1.0 / static_cast<double>(scale)));
    }
  }
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
    const auto pa = a.download<std::uint64_t>(n), pb = b.download<std::uint64_t>(n),
               pc = c.download<std::uint64_t>(n);
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

//! One optimizer test world: parameters, gradients, state and masters in arenas with the
//! same layout (so the vector path runs), or gradients shifted one element (scalar path).
template <class T>
struct OptWorld {
  using H = host_el<T>;
  using A = typename H::acc;
  static constexpr bool half = sizeof(T) == 2;
  Layout L;
  std::size_t shift;                // gradient arena offset in elements
  DevBuf p, g, s1, s2, master, step, found;
  std::vector<A> host_w;            // CPU optimizer's parameters (the masters for halves)
  OptWorld(std::mt19937_64& rng, Layout lay, std::size_t grad_shift)
      : L(std::move(lay)), shift(grad_shift), p(L.span * sizeof(T)), g((L.span + 1) * sizeof(T)),
        s1(L.span * sizeof(A)), s2(L.span * sizeof(A)), master(L.span * sizeof(A)),
        step(sizeof(std::int64_t)), found(sizeof(int)) {
    std::normal_distribution<double> nd(0.0, 1.0);
    host_w.resize(L.span);
    for (auto& x : host_w) x = static_cast<A>(nd(rng));
    std::vector<T> pv(L.span);
    for (std::size_t e = 0; e < L.span; ++e) {
      pv[e] = H::from(host_w[e]);
      if (!half) host_w[e] = H::to(pv[e]);
    }
    p.upload(pv);
    if (half) master.upload(host_w);
    LOCKSTEP_TRY_CUDA(cudaMemset(s1.p, 0, s1.bytes));
    LOCKSTEP_TRY_CUDA(cudaMemset(s2.p, 0, s2.bytes));
    step.upload_value<std::int64_t>(0);
    found.upload_value(0);
  }
  segment seg(const DevBuf& b, std::size_t i, std::size_t esize, std::size_t extra = 0) const {
    return {static_cast<unsigned char*>(b.p) + (L.off[i] + extra) * esize, L.cnt[i]};
  }
  //! New random gradients: device copy, and the CPU view (as A) in `hg`.
  void new_grads(std::mt19937_64& rng, std::vector<A>& hg) {
    auto gv = random_values<T>(rng, L.span + 1, 1.0);
    g.upload(gv);
    hg.resize(L.span);
    for (std::size_t e = 0; e < L.span; ++e) hg[e] = H::to(gv[e + shift]);
  }
  //! Everything the step may touch, as bytes, to test that a skipped step changes nothing.
  std::vector<unsigned char> snapshot() const {
    std::vector<unsigned char> all;
    for (const DevBuf* b : {&p, &s1, &s2, &master, &step}) {
      auto v = b->download<unsigned char>(b->bytes);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  template <class Ref>
  void compare(Ref ref_state, const char* what, const DevBuf& buf, double tol, double rel_floor) const {
    const auto got = buf.download<A>(L.span);
    std::size_t bad = 0, first = 0;
    double worst = 0;
    for (std::size_t i = 0; i < L.cnt.size(); ++i) {
      const auto want = ref_state(i);
      REQUIRE(want.size() == L.cnt[i]);
      for (std::size_t j = 0; j < L.cnt[i]; ++j) {
        const double w = static_cast<double>(want[j]), x = static_cast<double>(got[L.off[i] + j]);
        const double err = std::abs(x - w) / std::max(rel_floor, std::abs(w));  // relative above rel_floor
        worst = std::max(worst, err);
        if (!(err <= tol) && bad++ == 0) first = L.off[i] + j;
      }
    }
    INFO(what, ": worst relative error ", worst, ", first bad element ", first);
    CHECK(bad == 0);
  }
  //! Parameters (A) as the device holds them: masters for halves (and the parameter must be
  //! the master rounded), the parameters themselves otherwise.
  void compare_params(const std::vector<A>& cpu_w, double tol) const {
    const auto pv = p.download<T>(L.span);
    std::vector<A> got(L.span);
    if (half) {
      got = master.download<A>(L.span);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < L.cnt.size(); ++i)
        for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e)
          if (!same_bits(pv[e], H::from(got[e]))) ++bad;
      CHECK(bad == 0);
    } else {
      for (std::size_t e = 0; e < L.span; ++e) got[e] = H::to(pv[e]);
    }
    std::size_t bad = 0;
    double worst = 0;
    for (std::size_t i = 0; i < L.cnt.size(); ++i)
      for (std::size_t e = L.off[i]; e < L.off[i] + L.cnt[i]; ++e) {
        const double w = static_cast<double>(cpu_w[e]);
        const double err = std::abs(static_cast<double>(got[e]) - w) / std::max(1.0, std::abs(w));
        worst = std::max(worst, err);
        if (!(err <= tol)) ++bad;
      }
    INFO("parameters: worst relative error ", worst);
    CHECK(bad == 0);
  }
  //! CPU segments of host_w / hg for lockstep::Sgd/AdamW::step_segments (slot = tensor index).
  void cpu_segments(std::vector<A>& hg, std::vector<std::size_t>& slots, std::vector<segment>& v,
                    std::vector<segment>& gs) {
    slots.clear();
    v.clear();
    gs.clear();
    for (std::size_t i = 0; i < L.cnt.size(); ++i) {
      slots.push_back(i);
      v.push_back({host_w.data() + L.off[i], L.cnt[i]});
      gs.push_back({hg.data() + L.off[i], L.cnt[i]});
    }
  }
};

template <class T>
double opt_tol() {
  return std::is_same_v<T, double> ? 1e-13 : 2e-6;
}

}  // namespace

TEST_CASE_TEMPLATE("kernels: fused SGD matches lockstep::Sgd - and skips bit-exactly", T, float, double,
                   __half, __nv_bfloat16) {
  LOCKSTEP_REQUIRE_GPUS(1);
  using A = typename host_el<T>::acc;
  constexpr dtype At = lockstep::dtype_of<A>;
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  Stream s;
  const std::vector<lockstep::SgdOptions> configs{
      {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
      {.lr = 0.02, .momentum = 0.8, .weight_decay = 0.05, .nesterov = true},
      {.lr = 0.1, .weight_decay = 0.1},
  };
  for (std::size_t c = 0; c < configs.size(); ++c)
    for (std::size_t shift : {0, 1}) {
      CAPTURE(c);
      CAPTURE(shift);
      const auto& o = configs[c];
      OptWorld<T> w(rng, make_layout(rng, 800, kSpecial, true), shift);
      lockstep::Sgd cpu(o);
      std::vector<k::sgd_tensor> ts;
      for (std::size_t i = 0; i < w.L.cnt.size(); ++i)
        ts.push_back({w.seg(w.p, i, sizeof(T)), w.seg(w.g, i, sizeof(T), shift),
                      o.momentum != 0 ? w.seg(w.s1, i, sizeof(A)) : segment{},
                      w.half ? w.seg(w.master, i, sizeof(A)) : segment{}});
      std::vector<A> hg;
      std::vector<std::size_t> slots;
      std::vector<segment> hv, hgs;
      for (int st = 0; st < 5; ++st) {
        CAPTURE(st);
        w.new_grads(rng, hg);
        const bool skip = st == 2;
        w.found.upload_value(skip ? 1 : 0);
        const auto before = skip ? w.snapshot() : std::vector<unsigned char>{};
        k::sgd_step(ts, dt<T>(), o, w.step.template as<std::int64_t>(), w.found.template as<int>(), s.s);
        s.sync();
        if (skip) CHECK(w.snapshot() == before);
        w.cpu_segments(hg, slots, hv, hgs);
        cpu.step_segments(slots, hv, hgs, At, skip);
      }
      w.compare_params(w.host_w, opt_tol<T>());
      if (o.momentum != 0) {
        w.compare([&](std::size_t i) { return cpu.template momentum_buffer<A>(i); }, "momentum", w.s1,
                  opt_tol<T>(), 1.0);
        CHECK(w.step.template value<std::int64_t>() == 4);
      }
    }
  // A mismatched state segment is refused before anything is queued.
  OptWorld<T> w(rng, make_layout(rng, 0, {5}, false), 0);
  std::vector<k::sgd_tensor> bad{{w.seg(w.p, 0, sizeof(T)), w.seg(w.g, 0, sizeof(T)), segment{w.s1.p, 4},
                                  w.half ? w.seg(w.master, 0, sizeof(A)) : segment{}}};
  CHECK_THROWS_AS(k::sgd_step(bad, dt<T>(), configs[0], w.step.template as<std::int64_t>(), nullptr, s.s),
                  lockstep::config_error);
}

TEST_CASE_TEMPLATE("kernels: fused AdamW matches lockstep::AdamW - and skips bit-exactly", T, float, double,
                   __half, __nv_bfloat16) {
  LOCKSTEP_REQUIRE_GPUS(1);
  using A = typename host_el<T>::acc;
  constexpr dtype At = lockstep::dtype_of<A>;
  const auto seed = fresh_seed();
  INFO("seed = ", seed);
  std::mt19937_64 rng(seed);
  Stream s;
  const std::vector<lockstep::AdamWOptions> configs{
      {.lr = 1e-2},
      {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1},
  };
  for (std::size_t c = 0; c < configs.size(); ++c)
    for (std::size_t shift : {0, 1}) {
      CAPTURE(c);
      CAPTURE(shift);
      const auto& o = configs[c];
      OptWorld<T> w(rng, make_layout(rng, 700, kSpecial, true), shift);
      lockstep::AdamW cpu(o);
      std::vector<k::adamw_tensor> ts;
      for (std::size_t i = 0; i < w.L.cnt.size(); ++i)
        ts.push_back({w.seg(w.p, i, sizeof(T)), w.seg(w.g, i, sizeof(T), shift), w.seg(w.s1, i, sizeof(A)),
                      w.seg(w.s2, i, sizeof(A)), w.half ? w.seg(w.master, i, sizeof(A)) : segment{}});
      std::vector<A> hg;
      std::vector<std::size_t> slots;
      std::vector<segment> hv, hgs;
      for (int st = 0; st < 6; ++st) {
        CAPTURE(st);
        w.new_grads(rng, hg);
        const bool skip = st == 0 || st == 3;  // also a skipped *first* step
        w.found.upload_value(skip ? 1 : 0);
        const auto before = skip ? w.snapshot() : std::vector<unsigned char>{};
        k::adamw_step(ts, dt<T>(), o, w.step.template as<std::int64_t>(), w.found.template as<int>(), s.s);
        s.sync();
        if (skip) CHECK(w.snapshot() == before);
        w.cpu_segments(hg, slots, hv, hgs);
        cpu.step_segments(slots, hv, hgs, At, skip);
      }
      CHECK(w.step.template value<std::int64_t>() == 4);
      CHECK(cpu.step_count(0) == 4);
      w.compare_params(w.host_w, opt_tol<T>());
      w.compare([&](std::size_t i) { return cpu.template exp_avg<A>(i); }, "exp_avg", w.s1, opt_tol<T>(), 1e-2);
      w.compare([&](std::size_t i) { return cpu.template exp_avg_sq<A>(i); }, "exp_avg_sq", w.s2, opt_tol<T>(), 1e-5);
    }
}

}  // TEST_SUITE
