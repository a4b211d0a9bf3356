#pragma once
//! The kernels of the fused optimizers (FusedOptimizer<Rule>), on the multi-tensor
//! engine: any optimizer_rule (optim/optimizer.hpp) applied to device tensors, with a step
//! counter per tensor and the engine's skip flag; the counters' advance; and the fp32 master
//! copy of f16/bf16 parameters.
//!
//! Element types: parameters (and their gradients, same type) f32 or f64, updated in place;
//! or f16/bf16 with an fp32 master copy: the update runs on the master and the parameter
//! receives it rounded to nearest. States and the master are fp32 (f64 for f64 parameters).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/access.cuh"
#include "lockstep/cuda/kernels/engine.cuh"
#include "lockstep/optim/optimizer.hpp"

namespace lockstep::cuda::kernels {

//! One step of Rule on tensors of Element. Lists: 0 = parameter, 1 = gradient (Element),
//! 2 .. 2 + max_states − 1 = states (compute type), last = fp32 master (f16/bf16 only, else
//! unused). The tensor's step counter (already advanced for this step) feeds Rule::prepare.
template <optimizer_rule Rule, class Element>
struct rule_op : op_base<storage_of<Element>> {
  using storage_t = storage_of<Element>;
  using compute_t = compute_of<Element>;
  static constexpr bool has_master = sizeof(storage_t) == 2;
  static constexpr int max_states = Rule::max_states;
  static constexpr int master_list = 2 + max_states;
  static constexpr int lists = 3 + max_states;
  static constexpr op_kind kind = op_kind::optimizer;
  static constexpr bool stepped = true;
  __host__ __device__ static constexpr int elem_bytes(int k) { return k < 2 ? sizeof(storage_t) : sizeof(compute_t); }
  __host__ __device__ constexpr bool list_required(int k) const {
    return k < 2 || (k < master_list && k - 2 < states) || (k == master_list && has_master);
  }
  struct local {
    typename Rule::template coefficients<compute_t> c;
  };
  template <int N>
  struct frag {
    pack_of<storage_t, N> p, g;
    pack_of<compute_t, N> s[max_states > 0 ? max_states : 1], w;
  };
  typename Rule::options options;
  int states;                  // Rule::states(options): the state lists in use
  const double* lr = nullptr;  // the learning rate on the device (set_lr), read at each launch: a graph replays it

  __device__ bool begin(local& st, const block_info& info) const {
    typename Rule::options o = options;
    if (lr != nullptr) o.lr = *lr;
    st.c = Rule::template prepare<compute_t>(o, *info.step);
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    if constexpr (has_master) f.w = load_pack<N, compute_t>(p[master_list], i);
    else f.p = load_pack<N, storage_t>(p[0], i);
    f.g = load_pack<N, storage_t>(p[1], i);
#pragma unroll
    for (int k = 0; k < max_states; ++k)
      if (k < states) f.s[k] = load_pack<N, compute_t>(p[2 + k], i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local& st) const {
    using traits = element_traits<Element>;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      compute_t w = has_master ? f.w.v[j] : traits::to_compute(f.p.v[j]);
      compute_t s[max_states > 0 ? max_states : 1];
#pragma unroll
      for (int k = 0; k < max_states; ++k) s[k] = f.s[k].v[j];
      Rule::update(st.c, w, traits::to_compute(f.g.v[j]), s);
#pragma unroll
      for (int k = 0; k < max_states; ++k) f.s[k].v[j] = s[k];
      if constexpr (has_master) f.w.v[j] = w;
      f.p.v[j] = traits::to_storage(w);
    }
#pragma unroll
    for (int k = 0; k < max_states; ++k)
      if (k < states) store_pack<N, compute_t>(p[2 + k], i, f.s[k]);
    if constexpr (has_master) store_pack<N, compute_t>(p[master_list], i, f.w);
    store_pack<N, storage_t>(p[0], i, f.p);
  }
};

//! dst (fp32) ← src (a 16-bit Element), exactly: the master copy of a half parameter.
//! Lists: 0 = src, 1 = dst.
template <class Element>
struct widen_op : op_base<storage_of<Element>> {
  using storage_t = storage_of<Element>;
  using local = typename op_base<storage_t>::local;
  static constexpr int lists = 2;
  __host__ __device__ static constexpr int elem_bytes(int k) { return k == 0 ? sizeof(storage_t) : sizeof(float); }
  template <int N>
  struct frag {
    vfrag<Element, N> h;
    pack_of<float, N> f;
  };
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f.h = load_as<vfrag<Element, N>>(static_cast<const storage_t*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local&) const {
    int j = 0;
    visit_elems<Element, N>(f.h, [&](float x) { f.f.v[j++] = x; });
    store_pack<N, float>(p[1], i, f.f);
  }
};

namespace detail {

inline constexpr int advance_capacity = 256;
struct advance_table {
  std::int64_t* p[advance_capacity];
  int n;
};

template <int = 0>
__global__ void advance_steps_kernel(const __grid_constant__ advance_table t, const int* skip) {
  if (skip != nullptr && *skip != 0) return;
  const int i = static_cast<int>(threadIdx.x);
  if (i < t.n) *t.p[i] += 1;
}

template <int = 0>
__global__ void store_scalar_kernel(double* p, double v) {
  *p = v;
}

}  // namespace detail

//! *p ← v, queued on s (a value a captured graph reads from the device).
inline void store_scalar(double* p, double v, cudaStream_t s) {
  detail::store_scalar_kernel<<<1, 1, 0, s>>>(p, v);
  LOCKSTEP_CHECK_LAUNCH();
}

//! *counters[i] += 1 for each i unless *d_skip ≠ 0 (d_skip nullable). Queued on s.
inline void advance_steps(std::span<std::int64_t* const> counters, const int* d_skip, cudaStream_t s) {
  for (std::size_t at = 0; at < counters.size(); at += detail::advance_capacity) {
    detail::advance_table t{};
    t.n = static_cast<int>(std::min<std::size_t>(detail::advance_capacity, counters.size() - at));
    for (int i = 0; i < t.n; ++i) t.p[i] = counters[at + static_cast<std::size_t>(i)];
    detail::advance_steps_kernel<<<1, detail::advance_capacity, 0, s>>>(t, d_skip);
    LOCKSTEP_CHECK_LAUNCH();
  }
}

}  // namespace lockstep::cuda::kernels
