// Loss scaling and optimizers that stay on the device:
//  - grad_ops<CudaMemory> (unscale + flag, sum of squares, clamp) against the host passes,
//    on random segments at odd offsets between NaN-poisoned gaps, all four floating types;
//  - FusedSgd / FusedAdamW against lockstep::Sgd / AdamW (fp32, and bf16 with an fp32 master),
//    stepped bucket by bucket with parameters split over buckets, a skipped step, and
//    checkpoints moved between the CPU and GPU optimizers;
//  - DataParallel<GpuMlp, NcclComm, DeviceDynamicScale> + FusedSgd per bucket on 1, 2 and 4
//    GPUs against one CPU rank (TestMlp + lockstep::Sgd with momentum) over the global batch,
//    with inf injected into one GPU's gradient at one step: every GPU skips it and every GPU's
//    scale follows DynamicScale's; one steady-state step is captured in a CUDA graph (a host
//    synchronisation inside the step would make the capture fail) and replayed.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lockstep/cuda/device_dynamic_scale.cuh>
#include <lockstep/cuda/fused_optimizer.cuh>
#include <lockstep/cuda/grad_ops.cuh>
#include <lockstep/cuda/run_gpus.cuh>
#include <lockstep/cuda/step_graph.cuh>
#include <lockstep/lockstep.hpp>

#include "gpu_mlp.cuh"
#include "gpu_test_util.cuh"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;
using lockstep::dtype;
using lockstep::grad_group;
using lockstep::segment;

static_assert(lockstep::loss_scaler_for<lockstep::DeviceDynamicScale, lockstep::NcclComm>);
static_assert(lockstep::loss_scaler_for<lockstep::DynamicScale, lockstep::NcclComm>);
static_assert(lockstep::loss_scaler_for<lockstep::StaticScale, lockstep::NcclComm>);
static_assert(lockstep::has_grad_ops<lockstep::CudaMemory>);

namespace {

// ---- small utilities ---------------------------------------------------------------------
struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t bytes) { LOCKSTEP_TRY_CUDA(cudaMalloc(&p, bytes ? bytes : 1)); }
  ~DevBuf() { (void)cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

using lockstep::test::Stream;

// A pageable cudaMemcpy to the device may return before its DMA lands, and the kernels run on
// non-blocking streams: wait for the device before they read.
template <class T>
void upload(void* dst, const std::vector<T>& v) {
  LOCKSTEP_TRY_CUDA(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
}
template <class T>
std::vector<T> download(const void* src, std::size_t n) {
  std::vector<T> v(n);
  LOCKSTEP_TRY_CUDA(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// Host conversions of the reference (cuda_fp16/bf16's host functions, not the kernels').
template <class T>
float to_f(T x) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else return static_cast<float>(x);
}
template <class T>
T from_d(double x) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(static_cast<float>(x));
  else return static_cast<T>(x);
}
template <class T>
double to_d(T x) {
  if constexpr (std::is_floating_point_v<T>) return static_cast<double>(x);
  else return static_cast<double>(to_f(x));
}
template <class T>
bool nonfinite(T x) {
  return !std::isfinite(to_d(x));
}
template <class T>
constexpr bool is_half_v = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;
template <class T>
constexpr dtype dtype_v = std::is_same_v<T, float>    ? dtype::f32
                          : std::is_same_v<T, double> ? dtype::f64
                          : std::is_same_v<T, __half> ? dtype::f16
                                                      : dtype::bf16;
template <class T>
const char* type_name() {
  return lockstep::name_of(dtype_v<T>);
}

// ---- grad_ops<CudaMemory> ------------------------------------------------------------------
// Segments of random sizes (empty, tiny, several chunks) at random offsets of one buffer; the
// gaps between them hold 0xFF bytes (NaN in every floating type): a pass that reads them would
// raise the flag or poison the sum, one that writes them changes their bits.
template <class T>
struct layout {
  std::vector<T> host;
  std::vector<std::pair<std::size_t, std::size_t>> segs;  // (offset, count)

  layout(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_int_distribution<int> nseg(3, 45), gap(0, 37), kind(0, 9);
    std::uniform_int_distribution<std::size_t> small(1, 300), big(16000, 70000);
    std::uniform_real_distribution<double> val(lo, hi);
    std::size_t at = static_cast<std::size_t>(gap(rng));
    const int n = nseg(rng);
    for (int i = 0; i < n; ++i) {
      const int k = kind(rng);
      const std::size_t count = k == 0 && i > 0 ? 0 : (k < 8 ? small(rng) : big(rng));
      segs.emplace_back(at, count);
      at += count + static_cast<std::size_t>(gap(rng));
    }
    host.resize(at + static_cast<std::size_t>(gap(rng)));
    std::memset(static_cast<void*>(host.data()), 0xFF, host.size() * sizeof(T));
    for (auto [off, count] : segs)
      for (std::size_t i = 0; i < count; ++i) host[off + i] = from_d<T>(val(rng));
  }
  std::size_t elements() const {
    std::size_t n = 0;
    for (auto [o, c] : segs) n += c;
    return n;
  }
  // A random element of a non-empty segment.
  std::size_t pick(std::mt19937_64& rng) const {
    std::vector<std::size_t> live;
    for (std::size_t i = 0; i < segs.size(); ++i)
      if (segs[i].second) live.push_back(i);
    const auto [off, count] = segs[live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng)]];
    return off + std::uniform_int_distribution<std::size_t>(0, count - 1)(rng);
  }
  std::vector<segment> segments(void* base) const {
    std::vector<segment> out;
    for (auto [off, count] : segs) out.push_back({static_cast<T*>(base) + off, count});
    return out;
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

//! As same_bits, except that any NaN equals any NaN: arithmetic on a NaN may return the
//! GPU's canonical NaN rather than the input's payload (seen on H200), which is no error.
template <class T>
bool same_bits_or_nan(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) == 0) continue;
    const double x = static_cast<double>(static_cast<float>(a[i]));
    const double y = static_cast<double>(static_cast<float>(b[i]));
    if (!(std::isnan(x) && std::isnan(y))) return false;
  }
  return true;
}

// Host references. f32/f64: the host grad_ops themselves; halves (which the host passes do not
// take): the same rule written out, arithmetic in float then rounded.
template <class T>
int ref_unscale(layout<T>& L, double inv) {
  if constexpr (!is_half_v<T>) {
    auto segs = L.segments(L.host.data());
    grad_group g{dtype_v<T>, segs};
    std::int32_t flag = 0;
    lockstep::grad_ops<lockstep::HostMemory>::unscale_and_flag({}, std::span<const grad_group>(&g, 1), inv, &flag);
    return flag;
  } else {
    int flag = 0;
    const float f = static_cast<float>(inv);
    for (auto [off, count] : L.segs)
      for (std::size_t i = off; i < off + count; ++i) {
        if (inv != 1.0) L.host[i] = from_d<T>(to_f(L.host[i]) * f);
        flag |= nonfinite(L.host[i]) ? 1 : 0;
      }
    return flag;
  }
}

template <class T>
double ref_sumsq(layout<T>& L) {
  if constexpr (!is_half_v<T>) {
    auto segs = L.segments(L.host.data());
    grad_group g{dtype_v<T>, segs};
    return lockstep::grad_ops<lockstep::HostMemory>::sum_of_squares({}, std::span<const grad_group>(&g, 1));
  } else {
    long double s = 0;
    for (auto [off, count] : L.segs)
      for (std::size_t i = off; i < off + count; ++i) s += static_cast<long double>(to_d(L.host[i])) * to_d(L.host[i]);
    return static_cast<double>(s);
  }
}

template <class T>
void ref_clamp(layout<T>& L, double lo, double hi) {
  if constexpr (!is_half_v<T>) {
    auto segs = L.segments(L.host.data());
    grad_group g{dtype_v<T>, segs};
    lockstep::grad_ops<lockstep::HostMemory>::clamp({}, std::span<const grad_group>(&g, 1), lo, hi);
  } else {
    const double big = std::is_same_v<T, __half> ? 65504.0 : 3.3895313892515355e38;
    const T l = lo < -big ? from_d<T>(-INFINITY) : from_d<T>(lo);
    const T h = hi > big ? from_d<T>(INFINITY) : from_d<T>(hi);
    for (auto [off, count] : L.segs)
      for (std::size_t i = off; i < off + count; ++i) {
        const float v = to_f(L.host[i]);
        if (v < to_f(l)) L.host[i] = l;
        else if (to_f(h) < v) L.host[i] = h;
      }
  }
}

template <class T>
void check_grad_ops(std::mt19937_64& rng) {
  CAPTURE(type_name<T>());
  Stream st;
  const lockstep::CudaMemory mem(0, st.s);
  using ops = lockstep::grad_ops<lockstep::CudaMemory>;
  DevBuf flag(sizeof(std::int32_t));
  auto get_flag = [&] {
    std::int32_t f = -1;
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st.s));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(&f, flag.p, sizeof f, cudaMemcpyDeviceToHost));
    return f;
  };
  auto set_flag = [&](std::int32_t v) { upload(flag.p, std::vector<std::int32_t>{v}); };

  // 1. unscale + flag: clean data with several factors (1 = read only; a power of two; others
  //    that round), then one inf or NaN, then an overflow made by the unscaling itself.
  const double max_t = is_half_v<T> ? (std::is_same_v<T, __half> ? 65504.0 : 3.0e38)
                                    : static_cast<double>(std::numeric_limits<T>::max());
  for (int c = 0; c < 6; ++c) {
    CAPTURE(c);
    layout<T> L(rng, -4.0, 4.0);
    double inv = c == 0 ? 1.0 : c == 1 ? 1.0 / 1024 : c == 2 ? 0.3 : 3.0;
    if (c == 3) L.host[L.pick(rng)] = from_d<T>(rng() % 2 ? INFINITY : NAN);
    if (c == 4) L.host[L.pick(rng)] = from_d<T>(rng() % 2 ? -INFINITY : NAN), inv = 1.0;
    if (c == 5) L.host[L.pick(rng)] = from_d<T>(max_t / 2), inv = 4.0;
    CAPTURE(inv);
    DevBuf d(L.host.size() * sizeof(T));
    upload(d.p, L.host);
    const auto segs = L.segments(d.p);
    const grad_group g{dtype_v<T>, segs};
    const std::int32_t preset = c == 0 ? 5 : 0;  // a clean pass never stores 0
    set_flag(preset);
    ops::unscale_and_flag(mem, std::span<const grad_group>(&g, 1), inv, flag.p);
    const int want_flag = ref_unscale(L, inv);
    CHECK(want_flag == (c >= 3 ? 1 : 0));  // the reference itself sees what was planted
    CHECK(get_flag() == (want_flag ? 1 : preset));
    CHECK(same_bits_or_nan(download<T>(d.p, L.host.size()), L.host));  // gaps untouched too
  }

  // 2. sum of squares: against the host within rounding; the same bits on every call.
  for (int c = 0; c < 2; ++c) {
    layout<T> L(rng, -3.0, 3.0);
    if (c == 1) L.host[L.pick(rng)] = from_d<T>(NAN);
    DevBuf d(L.host.size() * sizeof(T));
    upload(d.p, L.host);
    const auto segs = L.segments(d.p);
    const grad_group g{dtype_v<T>, segs};
    const double got = ops::sum_of_squares(mem, std::span<const grad_group>(&g, 1));
    const double again = lockstep::grad_norm(mem, std::span<const grad_group>(&g, 1));
    const double want = ref_sumsq(L);
    CAPTURE(got);
    CAPTURE(want);
    if (c == 1) {
      CHECK(std::isnan(got));
    } else {
      CHECK(L.elements() > 0);
      CHECK(want > 0);
      CHECK(std::fabs(got - want) <= 1e-12 * want);
      const double twice = ops::sum_of_squares(mem, std::span<const grad_group>(&g, 1));
      CHECK(std::memcmp(&twice, &got, sizeof got) == 0);  // reproducible, bit for bit
      CHECK(again == std::sqrt(got));
    }
  }

  // 3. clamp: NaN planted inside segments passes through bit for bit; gaps untouched; a bound
  //    beyond the type's range is no bound.
  for (int c = 0; c < 3; ++c) {
    layout<T> L(rng, -5.0, 5.0);
    for (int k = 0; k < 5; ++k) L.host[L.pick(rng)] = from_d<T>(NAN);
    const double lo = c == 2 ? -1e300 : -std::uniform_real_distribution<double>(0.1, 2.0)(rng);
    const double hi = c == 1 ? 1e300 : std::uniform_real_distribution<double>(0.1, 2.0)(rng);
    CAPTURE(lo);
    CAPTURE(hi);
    DevBuf d(L.host.size() * sizeof(T));
    upload(d.p, L.host);
    const auto before = L.host;
    const auto segs = L.segments(d.p);
    const grad_group g{dtype_v<T>, segs};
    ops::clamp(mem, std::span<const grad_group>(&g, 1), lo, hi);
    ref_clamp(L, lo, hi);
    CHECK(!same_bits(before, L.host));  // the bounds did cut something
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st.s));
    CHECK(same_bits(download<T>(d.p, L.host.size()), L.host));
  }
}

// ---- fused optimizers against the CPU ones -------------------------------------------------
using lockstep::test::parse_blob;
using lockstep::test::parsed_blob;

template <class V>
std::vector<double> as_double(std::span<const V> s) {
  return std::vector<double>(s.begin(), s.end());
}

template <bool AdamW>
struct opt_traits;
template <>
struct opt_traits<false> {
  using gpu = lockstep::FusedSgd;
  using cpu = lockstep::Sgd;
  static lockstep::SgdOptions options(std::mt19937_64& rng) {
    const bool nesterov = rng() % 2;
    return {.lr = 0.05, .momentum = 0.9, .dampening = nesterov ? 0.0 : 0.1, .weight_decay = 0.01, .nesterov = nesterov};
  }
};
template <>
struct opt_traits<true> {
  using gpu = lockstep::FusedAdamW;
  using cpu = lockstep::AdamW;
  static lockstep::AdamWOptions options(std::mt19937_64&) {
    return {.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.05};
  }
};

// Compares the CPU optimizer's state with a parsed GPU blob, slot by slot.
template <bool AdamW>
void check_state(const typename opt_traits<AdamW>::cpu& cpu, const parsed_blob& b, std::int64_t steps) {
  REQUIRE(b.slots.size() == cpu.slot_count());
  for (std::size_t i = 0; i < b.slots.size(); ++i) {
    CAPTURE(i);
    const auto& s = b.slots[i];
    CHECK(s.has == 1);
    CHECK(s.type == static_cast<int>(dtype::f32));
    if constexpr (AdamW) {
      CHECK(s.step == steps);
      CHECK(cpu.step_count(i) == steps);
      CHECK(max_rel_diff(s.a, as_double(cpu.template exp_avg<float>(i))) <= 1e-5);
      CHECK(max_rel_diff(s.b, as_double(cpu.template exp_avg_sq<float>(i))) <= 1e-5);
    } else {
      CHECK(max_rel_diff(s.a, as_double(cpu.template momentum_buffer<float>(i))) <= 1e-5);
    }
  }
}

// GPU optimizer (params of type T; f32 master for halves) against the CPU one on f32 copies.
template <bool AdamW, class T>
void check_fused(std::mt19937_64& rng) {
  using tr = opt_traits<AdamW>;
  CAPTURE(AdamW);
  CAPTURE(type_name<T>());
  const auto o = tr::options(rng);
  const std::vector<std::size_t> sizes{1, 7, 300, 20000, 5003, 40000};
  const std::size_t P = sizes.size();
  Stream st;

  // Initial values are T-representable so both sides start equal.
  std::vector<std::vector<T>> init(P);
  std::vector<std::vector<float>> cpu_vals(P), cpu_grads(P);
  std::vector<DevBuf*> vals, grads;
  std::vector<lockstep::parameter> gpu_params, cpu_params;
  for (std::size_t i = 0; i < P; ++i) {
    std::uniform_real_distribution<double> d(-1, 1);
    init[i].resize(sizes[i]);
    for (auto& x : init[i]) x = from_d<T>(d(rng));
    for (auto x : init[i]) cpu_vals[i].push_back(to_f(x));
    cpu_grads[i].assign(sizes[i], 0.f);
    vals.push_back(new DevBuf(sizes[i] * sizeof(T)));
    grads.push_back(new DevBuf(sizes[i] * sizeof(T)));
    upload(vals[i]->p, init[i]);
    gpu_params.push_back(lockstep::param<T>("p" + std::to_string(i), vals[i]->as<T>(), grads[i]->as<T>(),
                                            {static_cast<std::int64_t>(sizes[i])}));
    cpu_params.push_back(lockstep::param<float>("p" + std::to_string(i), cpu_vals[i].data(), cpu_grads[i].data(),
                                                {static_cast<std::int64_t>(sizes[i])}));
  }
  struct cleanup {
    std::vector<DevBuf*>& a;
    std::vector<DevBuf*>& b;
    ~cleanup() {
      for (auto* x : a) delete x;
      for (auto* x : b) delete x;
    }
  } cl{vals, grads};

  typename tr::gpu gpu(o, gpu_params);
  typename tr::cpu cpu(o);
  DevBuf flag(sizeof(int));
  upload(flag.p, std::vector<int>{0});

  auto gpu_values = [&] {
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st.s));
    std::vector<std::vector<T>> v;
    for (std::size_t i = 0; i < P; ++i) v.push_back(download<T>(vals[i]->p, sizes[i]));
    return v;
  };
  auto flat_gpu = [&] {
    std::vector<double> out;
    for (auto& v : gpu_values())
      for (auto x : v) out.push_back(to_d(x));
    return out;
  };
  auto flat_cpu = [&](bool round) {
    std::vector<double> out;
    for (auto& v : cpu_vals)
      for (auto x : v) out.push_back(round ? to_d(from_d<T>(x)) : static_cast<double>(x));
    return out;
  };

  // Steps: fresh gradients; the GPU takes them in "buckets" of slices, each parameter cut at a
  // random point (offset-0 slices in the first bucket, the rest in a second, then per-parameter
  // calls), or all at once (step_all). One step is skipped through the device flag.
  const int steps = 5, skip = 1 + static_cast<int>(rng() % 3);
  CAPTURE(skip);
  std::int64_t taken = 0;
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    for (std::size_t i = 0; i < P; ++i) {
      std::vector<T> g(sizes[i]);
      std::uniform_real_distribution<double> d(-2, 2);
      for (auto& x : g) x = from_d<T>(d(rng));
      for (std::size_t k = 0; k < sizes[i]; ++k) cpu_grads[i][k] = to_f(g[k]);
      upload(grads[i]->p, g);
    }
    const bool skipped = s == skip;
    upload(flag.p, std::vector<int>{skipped ? 1 : 0});
    const auto before = skipped ? gpu_values() : std::vector<std::vector<T>>{};
    if (s % 2 == 0) {
      std::vector<lockstep::param_slice> first, rest;
      for (std::size_t i = 0; i < P; ++i) {
        const std::size_t cut = std::uniform_int_distribution<std::size_t>(0, sizes[i])(rng);
        const std::size_t es = sizeof(T);
        auto slice = [&](std::size_t off, std::size_t n) {
          return lockstep::param_slice{i,
                                       off,
                                       n,
                                       dtype_v<T>,
                                       static_cast<char*>(vals[i]->p) + off * es,
                                       static_cast<char*>(grads[i]->p) + off * es};
        };
        if (cut == 0) {
          first.push_back(slice(0, sizes[i]));
        } else {
          first.push_back(slice(0, cut));
          if (cut < sizes[i]) rest.push_back(slice(cut, sizes[i] - cut));
        }
      }
      gpu.step(first, st.s, flag.as<int>());
      for (const auto& r : rest) gpu.step(std::span<const lockstep::param_slice>(&r, 1), st.s, flag.as<int>());
    } else {
      gpu.step_all(gpu_params, st.s, flag.as<int>());
    }
    cpu.step(cpu_params, skipped);
    if (skipped) {
      const auto after = gpu_values();
      for (std::size_t i = 0; i < P; ++i) CHECK(same_bits(after[i], before[i]));
    } else {
      ++taken;
    }
  }
  CHECK(max_rel_diff(flat_cpu(false), [&] {
          std::vector<double> v;
          for (auto& x : init)
            for (auto y : x) v.push_back(to_d(y));
          return v;
        }()) > 1e-3);  // the steps moved the parameters

  const std::vector<std::byte> blob = lockstep::to_bytes(gpu);
  const auto parsed = parse_blob(blob, AdamW);
  check_state<AdamW>(cpu, parsed, taken);
  if constexpr (is_half_v<T>) {
    CHECK(parsed.magic == (AdamW ? "LKADWM01" : "LKSGDM01"));
    REQUIRE(parsed.masters.size() == P);
    std::vector<double> masters;
    for (auto& [slot, v] : parsed.masters)
      for (auto x : v) masters.push_back(x);
    CHECK(max_rel_diff(masters, flat_cpu(false)) <= 1e-5);  // the f32 master tracks the CPU
    std::vector<T> rounded;
    for (double x : masters) rounded.push_back(from_d<T>(x));
    std::vector<T> params;
    for (auto& v : gpu_values()) params.insert(params.end(), v.begin(), v.end());
    CHECK(same_bits(params, rounded));  // each parameter is its master rounded to nearest
  } else {
    CHECK(parsed.magic == (AdamW ? "LKADW001" : "LKSGD001"));
    CHECK(max_rel_diff(flat_gpu(), flat_cpu(false)) <= 1e-5);
    // The CPU optimizer reads the GPU's checkpoint, and the GPU the CPU's: one more step each
    // from the other's state lands where the originals land.
    typename tr::cpu cpu2(tr::options(rng));
    lockstep::from_bytes(cpu2, blob);
    typename tr::gpu gpu2(tr::options(rng), gpu_params);
    lockstep::from_bytes(gpu2, lockstep::to_bytes(cpu));
    for (std::size_t i = 0; i < P; ++i)
      for (auto& x : cpu_grads[i]) x = static_cast<float>(std::uniform_real_distribution<double>(-2, 2)(rng));
    for (std::size_t i = 0; i < P; ++i) upload(grads[i]->p, cpu_grads[i]);
    upload(flag.p, std::vector<int>{0});
    // gpu2 (CPU state) steps the GPU values; cpu2 (GPU state) steps a copy of the CPU values;
    // cpu (its own state) steps the CPU values.
    auto copy_vals = cpu_vals;
    std::vector<lockstep::parameter> copy_params;
    for (std::size_t i = 0; i < P; ++i)
      copy_params.push_back(
          lockstep::param<float>("p", copy_vals[i].data(), cpu_grads[i].data(), {static_cast<std::int64_t>(sizes[i])}));
    gpu2.step_all(gpu_params, st.s, flag.as<int>());
    cpu2.step(copy_params);
    cpu.step(cpu_params);
    std::vector<double> copy_flat;
    for (auto& v : copy_vals)
      for (auto x : v) copy_flat.push_back(x);
    CHECK(max_rel_diff(flat_gpu(), flat_cpu(false)) <= 1e-5);
    CHECK(max_rel_diff(copy_flat, flat_cpu(false)) <= 1e-5);
    check_state<AdamW>(cpu, parse_blob(lockstep::to_bytes(gpu2), AdamW), taken + 1);
  }
}

// ---- DataParallel + DeviceDynamicScale + FusedSgd -----------------------------------------
namespace kern {
__global__ void mul(float* g, std::size_t n, const float* d_scale, float h_scale) {
  const float f = d_scale != nullptr ? *d_scale : h_scale;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    g[i] *= f;
}
__global__ void poison(float* g, float v) { *g = v; }
}  // namespace kern

// After the lead's patch, step_result carries the flag; until then it comes from the scaler.
// (The scaler's pointer is the same every step, so a per-bucket callback, which runs before
// finish() returns, takes it from there.) `ok` turns false if the two disagree.
template <class R>
const int* result_flag(const R& r, const int* fallback, bool& ok) {
  if constexpr (requires { r.device_found_inf; }) {
    ok = ok && r.device_found_inf == fallback;
    return r.device_found_inf;
  } else {
    (void)r;
    return fallback;
  }
}

struct dp_config {
  int gpus = 1;
  bool per_bucket = true;  // FusedSgd in finish()'s per-bucket callback, else step_all after it
  bool capture = false;    // capture step `warmup` in a CUDA graph, replay it twice
  bool zero_copy = true;
  lockstep::BucketPolicy buckets{};
  double clip = 0;                 // DataParallelOptions::max_grad_norm (the reference clips alike)
  bool gather_in_forward = false;  // sharded: each parameter waited for just before the forward
  bool copy_engine = true;         // sharded: ShardedOptimizer::copy_engine_gather
  bool copy_scatter = true;        // sharded: ShardedOptimizer::copy_engine_scatter
};

// Whether NCCL can put the sharded all-gathers on the copy engines here: NCCL >= 2.28 and GPUs
// that map each other's memory (a symmetric window needs both).
bool copy_engine_expected(int gpus) {
  if (!LOCKSTEP_NCCL_COPY_ENGINE || gpus < 2) return false;
  for (int a = 0; a < gpus; ++a)
    for (int b = 0; b < gpus; ++b) {
      int ok = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&ok, a, b) != cudaSuccess || !ok)) return false;
    }
  return true;
}

// Sharded: DataParallel with ShardedOptimizer, FusedSgd over dp.shard_parameters() stepping in
// finish(on_shard) — the same numbers as unsharded, with 1/N of the optimizer state.
template <class Scaler, bool Sharded = false>
void check_dp_scaled(const dp_config& c) {
  constexpr bool on_device = std::is_same_v<Scaler, lockstep::DeviceDynamicScale>;
  const auto seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int steps = 9, warmup = 3;  // graph: step 3 captured, 4 and 5 replay it
  const int inf_step = std::vector<int>{0, 1, 2, 6, 7, 8}[rng() % 6];
  const int inf_rank = static_cast<int>(rng() % static_cast<unsigned>(c.gpus));
  const std::vector<int> dims{37, 64, 33, 10};
  const std::size_t inf_param = rng() % (2 * (dims.size() - 1));
  const lockstep::DynamicScaleOptions so{.init_scale = std::ldexp(1.0, 4 + static_cast<int>(rng() % 9)),
                                         .growth_interval = 3};
  const lockstep::SgdOptions sgd{.lr = 0.05, .momentum = 0.9, .dampening = 0.0, .weight_decay = 1e-3};
  CAPTURE(seed);
  CAPTURE(c.gpus);
  CAPTURE(c.per_bucket);
  CAPTURE(c.capture);
  CAPTURE(c.zero_copy);
  CAPTURE(c.buckets.cap_bytes);
  CAPTURE(on_device);
  CAPTURE(inf_step);
  CAPTURE(inf_rank);
  CAPTURE(inf_param);
  CAPTURE(so.init_scale);
  CAPTURE(Sharded);
  CAPTURE(c.clip);
  CAPTURE(c.gather_in_forward);
  CAPTURE(c.copy_engine);
  CAPTURE(c.copy_scatter);

  const std::size_t samples = 2048;
  const int batch = 16;
  auto X = random_vector<float>(samples * dims[0], rng, -2, 2);
  std::vector<int> y(samples);
  std::uniform_int_distribution<int> lab(0, 9);
  for (auto& v : y) v = lab(rng);
  const std::size_t global = static_cast<std::size_t>(batch * c.gpus);

  // CPU reference: one rank, the global batch, no scaling, the inf step skipped.
  TestMlp<float> ref(dims, seed + 1);
  lockstep::Sgd ref_opt(sgd);
  lockstep::DynamicScale ref_scale(so);
  std::vector<lockstep::loss_scale_state> want_states;
  // A learning-rate schedule: replays of a captured step must follow it (FusedSgd::set_lr).
  const auto lr_at = [&](int s) { return sgd.lr * (1.0 + 0.125 * s); };
  for (int s = 0; s < steps; ++s) {
    ref.zero_grad();
    ref_opt.set_lr(lr_at(s));
    std::vector<std::size_t> rows(global);
    for (std::size_t i = 0; i < global; ++i) rows[i] = (s * global + i) % samples;
    ref.forward_backward(X, y, rows, [](std::size_t) {});
    if (c.clip > 0 && s != inf_step) {  // torch.nn.utils.clip_grad_norm_'s rule, in double
      double sq = 0;
      for (auto& p : ref.parameters())
        for (float g : std::span(static_cast<const float*>(p.grad), p.numel())) sq += double(g) * g;
      const double coef = c.clip / (std::sqrt(sq) + 1e-6);
      if (coef < 1)
        for (auto& p : ref.parameters())
          for (float& g : std::span(static_cast<float*>(p.grad), p.numel())) g = static_cast<float>(g * coef);
    }
    ref_opt.step(ref.parameters(), s == inf_step);
    ref_scale.update(s == inf_step);
    want_states.push_back(ref_scale.state());
  }
  const auto want = ref.flat_values();

  std::vector<int> devices(static_cast<std::size_t>(c.gpus));
  for (int i = 0; i < c.gpus; ++i) devices[static_cast<std::size_t>(i)] = i;
  std::vector<std::vector<float>> got(devices.size());
  std::vector<std::vector<lockstep::loss_scale_state>> states(devices.size());
  std::vector<int> unchanged_at_inf(devices.size(), -1);
  // Rank threads record what they saw; doctest checks it on this thread afterwards.
  std::vector<std::vector<std::string>> problems(devices.size());
  lockstep::run(lockstep::Gpus{devices}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(dims, seed + 1 + rank * 7919);  // differs per rank: rank 0's is broadcast
    GpuMlp m(dims, split_params(init), s);
    using DP = std::conditional_t<
        Sharded,
        lockstep::DataParallel<GpuMlp, lockstep::NcclComm, lockstep::EveryStep, Scaler, lockstep::ShardedOptimizer>,
        lockstep::DataParallel<GpuMlp, lockstep::NcclComm, lockstep::EveryStep, Scaler>>;
    const lockstep::DataParallelOptions o{.buckets = c.buckets, .zero_copy = c.zero_copy, .max_grad_norm = c.clip};
    auto dp = [&] {
      if constexpr (Sharded)
        return DP(ctx, m, o, lockstep::EveryStep{}, Scaler(so),
                  lockstep::ShardedOptimizer{.gather_in_forward = c.gather_in_forward,
                                             .copy_engine_gather = c.copy_engine,
                                             .copy_engine_scatter = c.copy_scatter});
      else return DP(ctx, m, o, lockstep::EveryStep{}, Scaler(so));
    }();
    const float* d_scale = nullptr;
    const int* d_flag = nullptr;
    if constexpr (on_device) {
      dp.scaler().attach(dp.comm());
      d_scale = dp.scaler().device_scale();
      d_flag = dp.scaler().device_found_inf();
    }
    const auto& stepped = [&]() -> const std::vector<lockstep::parameter>& {
      if constexpr (Sharded) return dp.shard_parameters();
      else return dp.parameters();
    }();
    lockstep::FusedSgd opt(sgd, stepped, ctx.device());
    // Asked for where the GPUs allow it, the window must be taken; not asked for, never. (Asked
    // for without peer access NCCL may still hand back a local window: not checked.)
    const bool asked = Sharded && c.copy_engine && c.gpus > 1;
    if (asked && copy_engine_expected(c.gpus) && !dp.stats().gathers_by_copy_engine)
      problems[rank].push_back("the all-gathers do not run on the copy engines (copy_engine_gather)");
    if (!asked && dp.stats().gathers_by_copy_engine)
      problems[rank].push_back("the all-gathers run on the copy engines, not asked for (copy_engine_gather)");
    const bool asked_scatter = Sharded && c.copy_scatter && c.gpus > 1;
    if (asked_scatter && copy_engine_expected(c.gpus) && !dp.stats().scatters_by_copy_engine)
      problems[rank].push_back("the reduce-scatters do not run on the copy engines (copy_engine_scatter)");
    if (!asked_scatter && dp.stats().scatters_by_copy_engine)
      problems[rank].push_back("the reduce-scatters run on the copy engines, not asked for (copy_engine_scatter)");
    if (rank == 0) {  // optimizer state per GPU: 1/N of the unsharded (momentum, 4 bytes each)
      std::size_t P = 0;
      for (const auto& p : dp.parameters()) P += p.numel();
      const std::size_t N = devices.size(), shard = Sharded ? (P + N - 1) / N : P;
      std::size_t elements = 0;
      for (const auto& p : stepped) elements += p.numel();
      if (elements != shard)
        problems[rank].push_back("the optimizer steps " + std::to_string(elements) + " elements, expected " +
                                 std::to_string(shard));
      if (opt.state_bytes() > shard * 4 + 4096)
        problems[rank].push_back("optimizer state " + std::to_string(opt.state_bytes()) + " bytes for " +
                                 std::to_string(shard) + " elements");
      MESSAGE("optimizer state on GPU 0: " << opt.state_bytes() << " bytes for " << elements << " of " << P
                                           << " parameters");
    }
    float* dX = nullptr;
    int *dy = nullptr, *drows = nullptr;
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dX, X.size() * sizeof(float)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&dy, y.size() * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMalloc(&drows, batch * sizeof(int)));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dX, X.data(), X.size() * sizeof(float), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dy, y.data(), y.size() * sizeof(int), cudaMemcpyHostToDevice));
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
    auto upload_rows = [&](int st) {
      std::vector<int> rows(batch);
      const std::size_t first = st * global + rank * batch;
      for (int i = 0; i < batch; ++i) rows[static_cast<std::size_t>(i)] = static_cast<int>((first + i) % samples);
      LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(drows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice, s));
      LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
    };

    // One training step, with nothing the host waits for (unless the scaler is a host one).
    auto one_step = [&](int st) {
      auto step = dp.step();
      const auto params = dp.parameters();  // the arena's gradient pointers (rebound after step 0)
      const float h_scale = on_device ? 1.0f : static_cast<float>(step.loss_scale());
      auto hook = step.on_gradient_ready();
      if (c.gather_in_forward)  // a layer-by-layer forward would wait for each layer's parameters
        for (std::size_t i = 0; i < params.size(); ++i) dp.wait_parameters(i);
      // The loss-scale multiply the loss kernel would do (exact: the scale is a power of two),
      // and the planted inf, right before each gradient is reported final.
      m.forward_backward(dX, dy, drows, batch, [&](std::size_t i) {
        auto* g = static_cast<float*>(params[i].grad);
        kern::mul<<<8, 256, 0, s>>>(g, params[i].numel(), d_scale, h_scale);
        LOCKSTEP_CHECK_LAUNCH();
        if (st == inf_step && static_cast<int>(rank) == inf_rank && i == inf_param) {
          kern::poison<<<1, 1, 0, s>>>(g + params[i].numel() / 2, st % 2 ? INFINITY : NAN);
          LOCKSTEP_CHECK_LAUNCH();
        }
        hook(i);
      });
      bool ok = true;
      if (c.per_bucket) {
        auto r = step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, s, d_flag); });
        if (on_device) (void)result_flag(r, d_flag, ok);
        else ok = static_cast<bool>(r) == (st != inf_step);
      } else {
        auto r = step.finish();
        if constexpr (on_device) {
          ok = static_cast<bool>(r);  // the host does not know: the device decides
          opt.step_all(dp.parameters(), s, result_flag(r, d_flag, ok));
        } else if (r) {
          opt.step_all(dp.parameters(), s);
        }
      }
      if (!ok) problems[rank].push_back("step " + std::to_string(st) + ": unexpected step_result");
    };

    // Steps [warmup, warmup + 3) through a StepGraph: the first captured (it fails if anything
    // in the step synchronised with the host or allocated), the next two replays of it.
    lockstep::StepGraph graph(ctx.comm(), {.warmup = 0});
    for (int st = 0; st < steps; ++st) {
      upload_rows(st);
      opt.set_lr(lr_at(st));
      if (c.gather_in_forward && st == inf_step) dp.wait_all_parameters();  // read on the host
      const auto before = st == inf_step ? m.flat_values() : std::vector<float>{};
      if (c.capture && st >= warmup && st < warmup + 3) {
        if (!graph.run([&] { one_step(st); }))
          problems[rank].push_back("step " + std::to_string(st) + " did not run as the graph");
      } else {
        one_step(st);
      }
      if (c.gather_in_forward && st == inf_step) dp.wait_all_parameters();
      if (st == inf_step) unchanged_at_inf[rank] = m.flat_values() == before ? 1 : 0;
      states[rank].push_back(dp.scaler().state());  // synchronises: outside the step
    }
    if (c.capture && (graph.replays() != 3 || graph.nodes() == 0))
      problems[rank].push_back("the graph ran " + std::to_string(graph.replays()) + " times with " +
                               std::to_string(graph.nodes()) + " nodes");
    dp.wait_all_parameters();
    got[rank] = m.flat_values();
    cudaFree(dX);
    cudaFree(dy);
    cudaFree(drows);
  });

  TestMlp<float> init(dims, seed + 1);
  CHECK(max_rel_diff(init.flat_values(), want) > 1e-3);  // training moved the parameters
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    for (const auto& p : problems[r]) FAIL_CHECK(p);
    CHECK(unchanged_at_inf[r] == 1);  // every GPU skipped the step with one GPU's inf
    CHECK(max_rel_diff(got[r], want) <= 1e-5);
    CHECK(got[r] == got[0]);  // bit for bit on every GPU
    REQUIRE(states[r].size() == want_states.size());
    for (int st = 0; st < steps; ++st) {
      CAPTURE(st);
      CHECK(states[r][static_cast<std::size_t>(st)] == want_states[static_cast<std::size_t>(st)]);
    }
  }
  // The skip halved the scale (DynamicScale's rule, checked above step by step; here plainly).
  const double before_inf = inf_step == 0 ? so.init_scale : want_states[static_cast<std::size_t>(inf_step - 1)].scale;
  CHECK(want_states[static_cast<std::size_t>(inf_step)].scale == before_inf * 0.5);
  CHECK(want_states.back().skipped_steps == 1);
}

}  // namespace

// DeviceDynamicScale names the rank whose own gradients were non-finite, as DynamicScale does:
// one rank (drawn) poisons a gradient in every step from a drawn step on; DataParallel, once the
// host sees skips in a row, checks each rank's gradients into the scaler's found-inf vote, and
// the skip-limit error (thrown on every rank) names that rank and the step that found it. The
// host waits for the device every `log_every` steps (a loop that logs its loss), so it sees the
// skips that late: the limit must leave it time to (with a limit of 3 and no waiting at all, the
// limit would be reached before any rank checked, and the error could name no rank).
void check_device_origin(int gpus, int log_every) {
  const auto seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const int bad = static_cast<int>(rng() % static_cast<unsigned>(gpus));
  const int first_bad = static_cast<int>(rng() % 4);
  const int limit = (log_every == 1 ? 3 : 2 * log_every + 5) + static_cast<int>(rng() % 4);
  CAPTURE(seed);
  CAPTURE(gpus);
  CAPTURE(bad);
  CAPTURE(first_bad);
  CAPTURE(limit);
  CAPTURE(log_every);
  const std::vector<int> dims{19, 32, 10};
  const int batch = 8;
  const std::size_t samples = 256;
  auto X = random_vector<float>(samples * dims[0], rng, -2, 2);
  std::vector<int> y(samples);
  for (auto& v : y) v = static_cast<int>(rng() % 10);
  std::vector<int> devices(static_cast<std::size_t>(gpus));
  for (int i = 0; i < gpus; ++i) devices[static_cast<std::size_t>(i)] = i;
  std::vector<std::string> seen(devices.size());  // what ended each rank
  std::vector<int> steps(devices.size(), 0);
  const auto body = [&](lockstep::context<lockstep::NcclComm>& ctx) {
    const auto rank = static_cast<std::size_t>(ctx.rank());
    cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(dims, seed + 1);
    GpuMlp m(dims, split_params(init), s);
    lockstep::DataParallel<GpuMlp, lockstep::NcclComm, lockstep::EveryStep, lockstep::DeviceDynamicScale> dp(
        ctx, m, {.buckets = {.first_bytes = 512, .cap_bytes = 1024}}, lockstep::EveryStep{},
        lockstep::DeviceDynamicScale({.init_scale = 256.0, .max_consecutive_skips = limit}));
    dp.scaler().attach(dp.comm());
    DevBuf dX(X.size() * sizeof(float)), dy(y.size() * sizeof(int)), drows(batch * sizeof(int));
    upload(static_cast<float*>(dX.p), X);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(dy.p, y.data(), y.size() * sizeof(int), cudaMemcpyHostToDevice));
    std::vector<int> rows(batch);
    for (int i = 0; i < batch; ++i) rows[static_cast<std::size_t>(i)] = static_cast<int>((rank * batch + i) % samples);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(drows.p, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice));
    try {
      for (int k = 0; k < 400; ++k) {
        auto st = dp.step();
        const auto params = dp.parameters();
        auto hook = st.on_gradient_ready();
        m.forward_backward(static_cast<float*>(dX.p), static_cast<int*>(dy.p), static_cast<int*>(drows.p), batch,
                           [&](std::size_t i) {
                             if (static_cast<int>(rank) == bad && k >= first_bad && i == 1) {
                               kern::poison<<<1, 1, 0, s>>>(static_cast<float*>(params[i].grad), NAN);
                               LOCKSTEP_CHECK_LAUNCH();
                             }
                             hook(i);
                           });
        (void)st.finish();
        if ((k + 1) % log_every == 0) LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s));
        steps[rank] = k + 1;
      }
    } catch (const std::exception& e) {
      seen[rank] = e.what();
      throw;
    }
  };
  const std::string stop = std::to_string(limit) + " steps in a row had inf/NaN gradients";
  const std::string origin = "the non-finite values came from rank " + std::to_string(bad) + ": its own gradients";
  std::string thrown;
  try {
    lockstep::run(lockstep::Gpus{devices}, body);
  } catch (const std::exception& e) {
    thrown = e.what();
  }
  CAPTURE(thrown);
  CHECK(thrown.find(stop) != std::string::npos);
  CHECK(thrown.find(origin) != std::string::npos);
  // Every rank stopped within a few steps of the limit (the host runs ahead of the device);
  // a rank that threw on its own gives the same cause.
  for (std::size_t r = 0; r < devices.size(); ++r) {
    CAPTURE(r);
    CAPTURE(seen[r]);
    CHECK(steps[r] >= first_bad + limit);
    CHECK(steps[r] <= first_bad + limit + 2 * log_every + 2);
    if (seen[r].find("DeviceDynamicScale") != std::string::npos) CHECK(seen[r].find(origin) != std::string::npos);
  }
}

namespace {

// One batch of a small classifier (19 -> 24 -> 7) for the capture tests: 64 samples drawn from
// `seed` in [-2, 2], labels below 7, 8 of them picked; on a rank's GPU by upload().
struct capture_batch {
  const std::vector<int> dims{19, 24, 7};
  static constexpr int batch = 8, samples = 64;
  std::vector<float> X;
  std::vector<int> y = std::vector<int>(samples), rows = std::vector<int>(batch);
  explicit capture_batch(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    X = random_vector<float>(samples * dims[0], rng, -2, 2);
    for (auto& v : y) v = static_cast<int>(rng() % 7);
    for (auto& r : rows) r = static_cast<int>(rng() % samples);
  }
  struct on_device {
    std::shared_ptr<void> X, y, rows;
  };
  on_device upload(const lockstep::CudaMemory& mem) const {
    on_device d{mem.allocate(X.size() * sizeof(float)), mem.allocate(y.size() * sizeof(int)),
                mem.allocate(rows.size() * sizeof(int))};
    mem.upload(d.X.get(), X.data(), X.size() * sizeof(float));
    mem.upload(d.y.get(), y.data(), y.size() * sizeof(int));
    mem.upload(d.rows.get(), rows.data(), rows.size() * sizeof(int));
    return d;
  }
};

// One training step of dp over m on the batch d: every gradient reported, FusedSgd on each bucket.
template <class DP>
void capture_step(DP& dp, GpuMlp& m, lockstep::FusedSgd& opt, const capture_batch::on_device& d, cudaStream_t s) {
  auto step = dp.step();
  auto hook = step.on_gradient_ready();
  m.forward_backward(static_cast<const float*>(d.X.get()), static_cast<const int*>(d.y.get()),
                     static_cast<const int*>(d.rows.get()), capture_batch::batch, [&](std::size_t i) { hook(i); });
  step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, s); });
}

}  // namespace

TEST_SUITE("gpu") {
TEST_CASE("grad_ops<CudaMemory> == host grad_ops: unscale + flag - sum of squares - clamp (f32 f64 f16 bf16)") {
  LOCKSTEP_REQUIRE_GPUS(1);
  LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  check_grad_ops<float>(rng);
  check_grad_ops<double>(rng);
  check_grad_ops<__half>(rng);
  check_grad_ops<__nv_bfloat16>(rng);
}

TEST_CASE("FusedSgd / FusedAdamW == lockstep::Sgd / AdamW: split slices - skipped step - CPU<->GPU checkpoints") {
  LOCKSTEP_REQUIRE_GPUS(1);
  LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  check_fused<false, float>(rng);
  check_fused<true, float>(rng);
  check_fused<false, __nv_bfloat16>(rng);
  check_fused<true, __nv_bfloat16>(rng);
}

TEST_CASE("DeviceDynamicScale: host mirror - load_state - copies - one clean and one inf step") {
  LOCKSTEP_REQUIRE_GPUS(1);
  auto comms = lockstep::NcclComm::create_local({0});
  {
    struct {
      lockstep::NcclComm& c;
      lockstep::NcclComm& comm() { return c; }
    } ctx{comms[0]};
    LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
    lockstep::DeviceDynamicScale sc({.init_scale = 256.0, .growth_interval = 5});
    CHECK_THROWS_AS((void)sc.device_scale(), lockstep::config_error);
    CHECK(sc.scale() == 256.0);
    sc.attach(ctx.comm());
    float f = 0;
    LOCKSTEP_TRY_CUDA(cudaMemcpy(&f, sc.device_scale(), sizeof f, cudaMemcpyDeviceToHost));
    CHECK(f == 256.0f);
    const lockstep::loss_scale_state st{1024.0, 3, 2, 9};
    sc.load_state(st);
    CHECK(sc.state() == st);
    LOCKSTEP_TRY_CUDA(cudaMemcpy(&f, sc.device_scale(), sizeof f, cudaMemcpyDeviceToHost));
    CHECK(f == 1024.0f);
    CHECK_THROWS_AS(sc.load_state({1024.0, 5, 0, 9}), lockstep::checkpoint_error);  // good ≥ interval
    lockstep::DeviceDynamicScale copy = sc;
    CHECK(!copy.attached());
    CHECK(copy.state() == st);
    // One clean and one overflowing unscale on real device gradients, against DynamicScale.
    DevBuf g(64 * sizeof(float));
    std::vector<float> h(64, 2048.0f);
    upload(g.p, h);
    const segment seg{g.p, 64};
    const grad_group grp{dtype::f32, std::span<const segment>(&seg, 1)};
    lockstep::DynamicScale ref({.init_scale = 256.0, .growth_interval = 5});
    ref.load_state(st);
    CHECK(!sc.unscale_and_check(ctx.comm(), std::span<const grad_group>(&grp, 1)));
    ref.update(false);
    CHECK(sc.state() == ref.state());
    CHECK(download<float>(g.p, 64) == std::vector<float>(64, 2.0f));  // 2048 / 1024
    h[17] = INFINITY;
    upload(g.p, h);
    (void)sc.unscale_and_check(ctx.comm(), std::span<const grad_group>(&grp, 1));
    int found = 0;
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(ctx.comm().compute_stream()));
    LOCKSTEP_TRY_CUDA(cudaMemcpy(&found, sc.device_found_inf(), sizeof found, cudaMemcpyDeviceToHost));
    CHECK(found == 1);
    ref.update(true);
    CHECK(sc.state() == ref.state());
    CHECK(sc.scale() == 512.0);
  }
}

// The skip limit on the device: the update kernel counts skipped steps in a row and raises a
// mapped host word at the limit; the next unscale_and_check throws. A clean step resets the count.
TEST_CASE("DeviceDynamicScale: max_consecutive_skips stops training - a clean step resets the count") {
  LOCKSTEP_REQUIRE_GPUS(1);
  auto comms = lockstep::NcclComm::create_local({0});
  LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
  std::mt19937_64 rng(fresh_seed());
  const int limit = 2 + static_cast<int>(rng() % 5);
  CAPTURE(limit);
  lockstep::DeviceDynamicScale sc({.init_scale = 65536.0, .max_consecutive_skips = limit});
  DevBuf g(64 * sizeof(float));
  std::vector<float> h = random_vector<float>(64, rng, -4, 4);
  const segment seg{g.p, 64};
  const grad_group grp{dtype::f32, std::span<const segment>(&seg, 1)};
  const auto one = [&](bool bad) {
    auto v = h;
    if (bad) v[rng() % 64] = (rng() % 2) ? INFINITY : NAN;
    upload(g.p, v);
    (void)sc.unscale_and_check(comms[0], std::span<const grad_group>(&grp, 1));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(comms[0].compute_stream()));
  };
  for (int i = 0; i < limit - 1; ++i) one(true);
  one(false);  // the run of skips ends one short of the limit
  for (int i = 0; i < limit - 1; ++i) one(true);
  CHECK(sc.stalled_steps() == 0);
  CHECK(sc.state().skipped_steps == 2 * (limit - 1));
  one(true);  // the limit-th in a row: the device raises the word...
  CHECK(sc.stalled_steps() == limit);
  // ...and the next call says so, naming the count, the floor and the option.
  CHECK_THROWS_WITH_AS(
      one(true),
      doctest::Contains(
          ("DeviceDynamicScale: " + std::to_string(limit) + " steps in a row had inf/NaN gradients").c_str()),
      lockstep::error);
  CHECK_THROWS_WITH_AS(one(false), doctest::Contains("max_consecutive_skips sets this limit"), lockstep::error);
  try {  // no DataParallel checked the ranks' own gradients: the error names no rank
    one(true);
  } catch (const lockstep::error& e) {
    CHECK(std::string(e.what()).find("came from rank") == std::string::npos);
  }
  sc.load_state(sc.state());  // a restored state starts counting again
  CHECK(sc.stalled_steps() == 0);
  CHECK_NOTHROW(one(true));
  lockstep::DeviceDynamicScale unlimited({.init_scale = 65536.0, .max_consecutive_skips = 0});
  for (int i = 0; i < 3 * limit; ++i) {
    upload(g.p, std::vector<float>(64, NAN));
    CHECK_NOTHROW((void)unlimited.unscale_and_check(comms[0], std::span<const grad_group>(&grp, 1)));
  }
  CHECK(unlimited.stalled_steps() == 0);
}

TEST_CASE("DataParallel + DeviceDynamicScale + FusedSgd on 1 GPU == CPU reference - a step captured in a CUDA graph") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_dp_scaled<lockstep::DeviceDynamicScale>({.gpus = 1, .capture = true});
  check_dp_scaled<lockstep::DeviceDynamicScale>({.gpus = 1, .per_bucket = false});
  check_dp_scaled<lockstep::DynamicScale>({.gpus = 1});
}

TEST_CASE("DeviceDynamicScale names the rank whose gradients were non-finite: 1 GPU") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_device_origin(1, 1);
  check_device_origin(1, 10);
}

// The capture check can fail: a step whose loss scaler reads the inf flag on the host
// (DynamicScale) and a step that allocates are refused by name, and nothing is replayed.
TEST_CASE("StepGraph refuses a step that synchronises with the host or allocates") {
  LOCKSTEP_REQUIRE_GPUS(1);
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const capture_batch data(seed);
  std::vector<std::string> seen;
  lockstep::run(lockstep::Gpus{{0}}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    cudaStream_t s = ctx.comm().compute_stream();
    TestMlp<float> init(data.dims, seed + 1);
    GpuMlp m(data.dims, split_params(init), s);
    lockstep::DataParallel dp(ctx, m, {}, lockstep::EveryStep{}, lockstep::DynamicScale{});
    lockstep::FusedSgd opt({.lr = 0.1}, dp.parameters(), ctx.device());
    const lockstep::CudaMemory mem = ctx.comm().memory();
    const auto d = data.upload(mem);
    auto one_step = [&] { capture_step(dp, m, opt, d, s); };
    lockstep::StepGraph graph(ctx.comm());  // 2 eager steps, then the capture
    CHECK_FALSE(graph.run(one_step));
    CHECK_FALSE(graph.run(one_step));
    const auto before = m.flat_values();
    try {
      graph.run(one_step);
      seen.push_back("captured a step that reads the inf flag on the host");
    } catch (const lockstep::config_error& e) {
      seen.push_back(e.what());
    }
    CHECK_FALSE(graph.captured());
    CHECK(m.flat_values() == before);  // nothing ran
    lockstep::StepGraph alloc(ctx.comm(), {.warmup = 0});
    try {
      alloc.run([&] { (void)mem.allocate(4096); });
      seen.push_back("allocated inside a capture");
    } catch (const lockstep::config_error& e) {
      seen.push_back(e.what());
    }
  });
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].find("could not be captured") != std::string::npos);
  CHECK(seen[1].find("CudaMemory::allocate: asked for 4096 bytes") != std::string::npos);
  CHECK(seen[1].find("captured into a CUDA graph") != std::string::npos);
}

// A fused optimizer's step captured by hand (stream capture + CaptureScope), replayed beside
// the same optimizer run eagerly, bf16 parameters (fp32 masters) and a learning rate changed
// before every step: the first step (which fills the masters) is refused inside a capture,
// set_lr() inside one is refused, replays follow set_lr() bit for bit, and an optimizer that
// load()ed the state is captured at once and follows it too.
TEST_CASE("fused optimizer in a captured step: masters filled eagerly - set_lr across replays - after load") {
  LOCKSTEP_REQUIRE_GPUS(1);
  LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  using T = __nv_bfloat16;
  const std::vector<std::size_t> sizes{3, 700, 9001};
  Stream st;
  std::vector<std::unique_ptr<DevBuf>> bufs;  // eager values, graph values, shared gradients
  std::vector<lockstep::parameter> eager_p, graph_p;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<T> init(sizes[i]);
    for (auto& x : init) x = from_d<T>(std::uniform_real_distribution<double>(-1, 1)(rng));
    DevBuf* a = bufs.emplace_back(std::make_unique<DevBuf>(sizes[i] * sizeof(T))).get();
    DevBuf* b = bufs.emplace_back(std::make_unique<DevBuf>(sizes[i] * sizeof(T))).get();
    DevBuf* g = bufs.emplace_back(std::make_unique<DevBuf>(sizes[i] * sizeof(T))).get();
    upload(a->p, init);
    upload(b->p, init);
    const std::vector<std::int64_t> shape{static_cast<std::int64_t>(sizes[i])};
    eager_p.push_back(lockstep::param<T>("p" + std::to_string(i), a->as<T>(), g->as<T>(), shape));
    graph_p.push_back(lockstep::param<T>("p" + std::to_string(i), b->as<T>(), g->as<T>(), shape));
  }
  auto new_grads = [&] {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<T> g(sizes[i]);
      for (auto& x : g) x = from_d<T>(std::uniform_real_distribution<double>(-2, 2)(rng));
      upload(bufs[3 * i + 2]->p, g);
    }
  };
  auto values = [&](const std::vector<lockstep::parameter>& ps) {
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st.s));
    std::vector<T> out;
    for (const auto& p : ps) {
      const auto v = download<T>(p.value, static_cast<std::size_t>(p.numel()));
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  };
  const auto initial = values(graph_p);
  const lockstep::AdamWOptions o{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.05};
  lockstep::FusedAdamW eager(o, eager_p), first(o, graph_p);
  // Captures fused.step_all(graph_p) on st (throws what the capture threw, after ending it).
  auto capture = [&](lockstep::FusedAdamW& fused, auto&& inside) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    {
      const lockstep::CaptureScope scope(0);
      LOCKSTEP_TRY_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
      try {
        inside();
        fused.step_all(graph_p, st.s);
      } catch (...) {
        (void)cudaStreamEndCapture(st.s, &g);
        if (g != nullptr) (void)cudaGraphDestroy(g);
        throw;
      }
      LOCKSTEP_TRY_CUDA(cudaStreamEndCapture(st.s, &g));
    }
    LOCKSTEP_TRY_CUDA(cudaGraphInstantiate(&exec, g, 0));
    LOCKSTEP_TRY_CUDA(cudaGraphDestroy(g));
    return exec;
  };
  auto refusal = [&](lockstep::FusedAdamW& fused, auto&& inside) {
    try {
      LOCKSTEP_TRY_CUDA(cudaGraphExecDestroy(capture(fused, inside)));
    } catch (const lockstep::config_error& e) {
      return std::string(e.what());
    }
    return std::string("nothing refused");
  };
  // The first step fills the fp32 masters from the bf16 values: not inside a capture.
  const std::string masters = refusal(first, [] {});
  CHECK(masters.find("fp32 master of parameter 0") != std::string::npos);
  CHECK(masters.find("run one step eagerly") != std::string::npos);
  {  // set_lr before the first step writes at once: not while a capture is open on the device
    lockstep::FusedAdamW fresh(o, graph_p);
    const lockstep::CaptureScope scope(0);
    CHECK_THROWS_WITH_AS(fresh.set_lr(0.3), doctest::Contains("inside a CUDA graph capture on device 0"),
                         lockstep::config_error);
    CHECK(fresh.options().lr == o.lr);
  }
  double lr = o.lr;
  auto both_eager = [&] {
    new_grads();
    lr *= 0.8;
    eager.set_lr(lr);
    first.set_lr(lr);
    eager.step_all(eager_p, st.s);
    first.step_all(graph_p, st.s);
  };
  both_eager();
  // set_lr() inside a capture would bake the rate into the graph.
  const std::string inside = refusal(first, [&] { first.set_lr(0.5); });
  CHECK(inside.find("inside the CUDA graph being captured") != std::string::npos);
  CHECK(first.options().lr == lr);  // the refused rate was not kept
  // Replays with a new rate each, against the eager optimizer.
  auto replays = [&](lockstep::FusedAdamW& fused, cudaGraphExec_t exec, int n) {
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      new_grads();
      lr *= 0.8;
      eager.set_lr(lr);
      fused.set_lr(lr);
      eager.step_all(eager_p, st.s);
      LOCKSTEP_TRY_CUDA(cudaGraphLaunch(exec, st.s));
      const auto a = values(eager_p), b = values(graph_p);
      CHECK(same_bits(a, b));
    }
  };
  cudaGraphExec_t exec = capture(first, [] {});
  replays(first, exec, 3);
  LOCKSTEP_TRY_CUDA(cudaGraphExecDestroy(exec));
  // A fresh optimizer that loads the state (masters and rate included; the rate it was built
  // with is not the one saved) captures its first step at once and keeps following set_lr().
  lockstep::FusedAdamW second({.lr = 123.0}, graph_p);
  lockstep::from_bytes(second, lockstep::to_bytes(first));
  CHECK(second.options().lr == lr);
  exec = capture(second, [] {});
  replays(second, exec, 3);
  LOCKSTEP_TRY_CUDA(cudaGraphExecDestroy(exec));
  CHECK_FALSE(same_bits(values(graph_p), initial));  // the steps moved the parameters
}

// CaptureScope holds one device: another device's allocations go on (run(Gpus): one rank
// allocating while another captures).
TEST_CASE("CaptureScope refuses allocations on its device only") {
  LOCKSTEP_REQUIRE_GPUS(1);
  const lockstep::CudaMemory mem(0, nullptr);
  {
    const lockstep::CaptureScope other(1);  // device 1 need not exist: nothing runs there
    CHECK(mem.allocate(256) != nullptr);
  }
  const lockstep::CaptureScope here(0);
  try {
    (void)mem.allocate(256);
    FAIL("allocated on a device whose capture is open");
  } catch (const lockstep::config_error& e) {
    CHECK(std::string(e.what()).find("on device 0 while a training step is being captured") != std::string::npos);
  }
}

TEST_CASE("sharded on 1 GPU: FusedSgd over the shards == CPU reference - device scaling - clipping") {
  LOCKSTEP_REQUIRE_GPUS(1);
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 1});
  check_dp_scaled<lockstep::DynamicScale, true>({.gpus = 1, .clip = 0.5});
}
}

TEST_SUITE("multigpu") {
TEST_CASE(
    "DataParallel + DeviceDynamicScale + FusedSgd: 2 GPUs - inf on one GPU skips everywhere - graph-captured step") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_dp_scaled<lockstep::DeviceDynamicScale>({.gpus = 2, .capture = true});
  check_dp_scaled<lockstep::DeviceDynamicScale>(
      {.gpus = 2, .capture = true, .buckets = {.first_bytes = 1000, .cap_bytes = 3000}});
  check_dp_scaled<lockstep::DeviceDynamicScale>({.gpus = 2, .per_bucket = false, .zero_copy = false});
  check_dp_scaled<lockstep::DynamicScale>({.gpus = 2, .buckets = {.first_bytes = 1000, .cap_bytes = 3000}});
}
// BucketPolicy::tune under a graph: the tuner times synchronising step tune_step and re-cuts
// the arena at the next, so a StepGraph that captures a step up to the timed one is refused by
// name (the timed step itself, or one before it: that graph would hold the untuned, unbound
// layout for ever); warmed up past them, the tuned step is captured and trains as the CPU
// reference does (above: tune_step 2, the capture at the fourth step).
TEST_CASE("StepGraph with BucketPolicy::tune: capturing the timed step is refused by name - warmed up past it it is "
          "captured") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_dp_scaled<lockstep::DeviceDynamicScale>(
      {.gpus = 2, .capture = true, .buckets = {.first_bytes = 1000, .cap_bytes = 3000, .tune = true, .tune_step = 2}});
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const capture_batch data(seed);
  struct trial {
    int warmup, tune_step;
  };
  const trial trials[] = {{2, 3}, {2, 5}, {4, 3}};  // the timed step captured, one before it, none
  std::vector<std::vector<std::string>> seen(2, std::vector<std::string>(3));
  std::vector<std::size_t> tuned(2);
  std::vector<std::uint64_t> replays(2);
  lockstep::run(lockstep::Gpus{{0, 1}}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    cudaStream_t s = ctx.comm().compute_stream();
    const auto d = data.upload(ctx.comm().memory());
    for (std::size_t t = 0; t < 3; ++t) {
      TestMlp<float> init(data.dims, seed + 1);
      GpuMlp m(data.dims, split_params(init), s);
      lockstep::DataParallel dp(ctx, m, {.buckets = {.tune = true, .tune_step = trials[t].tune_step}},
                                lockstep::DeviceDynamicScale{});
      lockstep::FusedSgd opt({.lr = 0.1}, dp.parameters(), ctx.device());
      auto one_step = [&] { capture_step(dp, m, opt, d, s); };
      lockstep::StepGraph graph(ctx.comm(), {.warmup = trials[t].warmup});
      const auto r = static_cast<std::size_t>(ctx.rank());
      try {
        for (int st = 0; st < 6; ++st) graph.run(one_step);
        seen[r][t] = "captured";
        tuned[r] = dp.stats().tuned_cap_bytes;
        replays[r] = graph.replays();
      } catch (const lockstep::config_error& e) {
        seen[r][t] = e.what();
      }
    }
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    for (std::size_t t = 0; t < 2; ++t) {
      CAPTURE(t);
      CHECK(seen[r][t].find("BucketPolicy::tune times synchronising step") != std::string::npos);
      CHECK(seen[r][t].find("StepGraphOptions::warmup") != std::string::npos);
    }
    CHECK(seen[r][2] == "captured");
    CHECK(replays[r] == 2);
    CHECK(tuned[r] != 0);
  }
}
TEST_CASE("DeviceDynamicScale names the rank whose gradients were non-finite: 2 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_device_origin(2, 1);
  check_device_origin(2, 10);
}
// ShardedOptimizer on GPUs: reduce-scatter as backward goes, FusedSgd updates this GPU's
// shard, all-gather; an inf on one GPU skips the step on all; clipping sums the shards' squares.
TEST_CASE("sharded on 2 GPUs: FusedSgd over the shards == CPU reference - inf on one GPU - clipping - graph - gather "
          "in forward") {
  LOCKSTEP_REQUIRE_GPUS(2);
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 2, .buckets = {.first_bytes = 1000, .cap_bytes = 3000}});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 2, .zero_copy = false});
  check_dp_scaled<lockstep::DynamicScale, true>(
      {.gpus = 2, .buckets = {.first_bytes = 1000, .cap_bytes = 3000}, .clip = 0.5});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 2, .clip = 0.5});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 2, .capture = true});
  // The gather of the step before the capture, waited for in the captured forward; the
  // captured step's gather, waited for by the eager steps after the replays.
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 2, .capture = true, .gather_in_forward = true});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 2, .gather_in_forward = true});
  check_dp_scaled<lockstep::DynamicScale, true>(
      {.gpus = 2, .buckets = {.first_bytes = 1000, .cap_bytes = 3000}, .clip = 0.5, .gather_in_forward = true});
  // the collectives on NCCL's SM kernels instead of the copy engines, or only one kind there
  check_dp_scaled<lockstep::DeviceDynamicScale, true>(
      {.gpus = 2, .gather_in_forward = true, .copy_engine = false, .copy_scatter = false});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>(
      {.gpus = 2, .capture = true, .copy_engine = false, .copy_scatter = false});
  check_dp_scaled<lockstep::DynamicScale, true>(
      {.gpus = 2, .clip = 0.5, .gather_in_forward = true, .copy_engine = false});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 2, .gather_in_forward = true, .copy_scatter = false});
}

TEST_CASE("DataParallel + DeviceDynamicScale + FusedSgd: 4 GPUs") {
  LOCKSTEP_REQUIRE_GPUS(4);
  check_dp_scaled<lockstep::DeviceDynamicScale>(
      {.gpus = 4, .capture = true, .buckets = {.first_bytes = 1000, .cap_bytes = 5000}});
  check_dp_scaled<lockstep::DeviceDynamicScale>({.gpus = 4, .per_bucket = false, .zero_copy = false});
  check_dp_scaled<lockstep::DynamicScale>({.gpus = 4});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 4, .buckets = {.first_bytes = 1000, .cap_bytes = 5000}});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>(
      {.gpus = 4, .buckets = {.first_bytes = 1000, .cap_bytes = 5000}, .gather_in_forward = true});
  check_dp_scaled<lockstep::DynamicScale, true>({.gpus = 4, .clip = 0.5});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>({.gpus = 4,
                                                       .buckets = {.first_bytes = 1000, .cap_bytes = 5000},
                                                       .gather_in_forward = true,
                                                       .copy_engine = false,
                                                       .copy_scatter = false});
  check_dp_scaled<lockstep::DeviceDynamicScale, true>(
      {.gpus = 4, .capture = true, .buckets = {.first_bytes = 1000, .cap_bytes = 5000}, .copy_engine = false});
}
}
