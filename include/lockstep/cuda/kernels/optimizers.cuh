#pragma once
//! Fused optimizer steps on the device: SGD (momentum, dampening, nesterov, weight decay)
//! and AdamW, PyTorch semantics, the same formulas as lockstep::Sgd / lockstep::AdamW.
//! One call updates a list of tensors (e.g. one bucket) through multi-tensor apply.
//!
//! Device-side control, no host synchronisation:
//!  - d_found_inf (nullable): when *d_found_inf ≠ 0 the step is skipped: parameters, state
//!    and the step counter are left untouched, bit for bit.
//!  - d_step: the step counter of this list of tensors (one std::int64_t in device memory,
//!    zero before the first step). A tiny kernel increments it (unless skipped) before the
//!    update reads it: AdamW's bias corrections use it; SGD uses it to start the momentum
//!    buffer (buffer ← gradient on step 1). Keep one counter per list you step separately
//!    (per bucket), and save it with the state for checkpoints.
//!
//! Element types: parameters (and their gradients, same type) f32 or f64, updated in place;
//! or f16/bf16 with an fp32 master copy: the update runs on the master and the parameter
//! receives it rounded to nearest. Optimizer state (momentum, exp_avg, exp_avg_sq) and
//! the master are fp32 (f64 for f64 parameters). All segments of one tensor have the same
//! element count. Hyperparameters are taken in double and rounded once to the compute type.

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "lockstep/adamw.hpp"
#include "lockstep/concepts.hpp"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/multi_tensor.cuh"
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"
#include "lockstep/sgd.hpp"

namespace lockstep::cuda::kernels {

namespace detail {
//! Multiply and add rounded separately (never fused into an FMA by the compiler).
__device__ __forceinline__ float rn_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double rn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float rn_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double rn_add(double a, double b) { return __dadd_rn(a, b); }
}  // namespace detail

//! One tensor of an SGD step.
struct sgd_tensor {
  segment param;     //!< f32/f64: updated in place; f16/bf16: receives round(master)
  segment grad;      //!< same element type as param
  segment momentum;  //!< state (fp32; f64 for f64): needed when momentum ≠ 0, else empty
  segment master;    //!< fp32 master for f16/bf16 params; empty for f32/f64
};

//! One tensor of an AdamW step.
struct adamw_tensor {
  segment param;
  segment grad;
  segment exp_avg;     //!< first moment, fp32 (f64 for f64), zero before step 1
  segment exp_avg_sq;  //!< second moment, likewise
  segment master;      //!< fp32 master for f16/bf16 params; empty for f32/f64
};

namespace detail {

template <int = 0>
__global__ void advance_step_kernel(std::int64_t* step, const int* found_inf) {
  if (found_inf == nullptr || *found_inf == 0) *step += 1;
}

//! Lists shared by both optimizers: 0 = param (T), 1 = grad (T), 2.. = state (acc),
//! last = master (acc, only when T is a half type).
template <class T>
struct opt_types {
  using E = elem<T>;
  using B = typename E::bits;
  using A = typename E::acc;
  static constexpr bool has_master = sizeof(B) == 2;
  static constexpr int width = 16 / int(sizeof(B));
  // Registers per vector grow with the lists; keep ≤ 128 registers at 512 threads, no spills.
  static constexpr int unroll = sizeof(B) == 2 ? 1 : 2;
};

template <class T>
struct sgd_op {
  using TT = opt_types<T>;
  using E = typename TT::E;
  using B = typename TT::B;
  using A = typename TT::A;
  static constexpr bool master = TT::has_master;
  static constexpr int lists = 4, width = TT::width, unroll = TT::unroll, min_blocks = 1;
  __host__ __device__ static constexpr int elem_bytes(int k) { return k < 2 ? sizeof(B) : sizeof(A); }
  static constexpr bool list_required(int k) { return k < 2 || (k == 3 && master); }
  struct local {
    bool first;
  };
  template <int N>
  struct frag {
    pack_of<B, N> p, g;
    pack_of<A, N> buf, w;
  };
  A lr, momentum, dampening1, weight_decay;  // dampening1 = 1 − dampening
  bool nesterov;
  const std::int64_t* step;  // null when momentum == 0
  const int* found_inf;

  __device__ bool begin(local& st) const {
    if (found_inf != nullptr && *found_inf != 0) return false;
    st.first = step != nullptr && *step == 1;
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local& st) const {
    if constexpr (master) f.w = load_pack<N, A>(p[3], i);
    else f.p = load_pack<N, B>(p[0], i);
    f.g = load_pack<N, B>(p[1], i);
    if (momentum != A(0) && !st.first) f.buf = load_pack<N, A>(p[2], i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local& st) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      A w;
      if constexpr (master) w = f.w.v[j];
      else w = E::to_acc(f.p.v[j]);
      A d = E::to_acc(f.g.v[j]);
      if (weight_decay != A(0)) d = d + weight_decay * w;
      if (momentum != A(0)) {
        const A b = st.first ? d : momentum * f.buf.v[j] + dampening1 * d;
        f.buf.v[j] = b;
        d = nesterov ? d + momentum * b : b;
      }
      w = w - lr * d;
      if constexpr (master) f.w.v[j] = w;
      f.p.v[j] = E::from_acc(w);
    }
    if (momentum != A(0)) store_pack<N, A>(p[2], i, f.buf);
    if constexpr (master) store_pack<N, A>(p[3], i, f.w);
    store_pack<N, B>(p[0], i, f.p);
  }
  __device__ void end(local&) const {}
};

template <class T>
struct adamw_op {
  using TT = opt_types<T>;
  using E = typename TT::E;
  using B = typename TT::B;
  using A = typename TT::A;
  static constexpr bool master = TT::has_master;
  static constexpr int lists = 5, width = TT::width, unroll = TT::unroll, min_blocks = 1;
  __host__ __device__ static constexpr int elem_bytes(int k) { return k < 2 ? sizeof(B) : sizeof(A); }
  static constexpr bool list_required(int k) { return k < 4 || master; }
  struct local {
    A step_size, bc2_sqrt;
  };
  template <int N>
  struct frag {
    pack_of<B, N> p, g;
    pack_of<A, N> m, v, w;
  };
  double lr, beta1d, beta2d;
  A decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  const std::int64_t* step;
  const int* found_inf;

  __device__ bool begin(local& st) const {
    if (found_inf != nullptr && *found_inf != 0) return false;
    // Bias corrections in double, rounded once, as lockstep::AdamW does on the host.
    const double t = static_cast<double>(*step);
    st.step_size = static_cast<A>(lr / (1.0 - pow(beta1d, t)));
    st.bc2_sqrt = static_cast<A>(sqrt(1.0 - pow(beta2d, t)));
    return true;
  }
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    if constexpr (master) f.w = load_pack<N, A>(p[4], i);
    else f.p = load_pack<N, B>(p[0], i);
    f.g = load_pack<N, B>(p[1], i);
    f.m = load_pack<N, A>(p[2], i);
    f.v = load_pack<N, A>(p[3], i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local& st) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      A w;
      if constexpr (master) w = f.w.v[j];
      else w = E::to_acc(f.p.v[j]);
      const A g = E::to_acc(f.g.v[j]);
      // Rounded multiplies and adds (no FMA contraction): the same operations, in the same
      // order, as lockstep::AdamW on the host, so GPU and CPU agree to the last bit.
      w = rn_mul(w, decay);
      const A m = rn_add(rn_mul(beta1, f.m.v[j]), rn_mul(one_minus_beta1, g));
      const A v = rn_add(rn_mul(beta2, f.v.v[j]), rn_mul(rn_mul(one_minus_beta2, g), g));
      const A denom = rn_add(sqrt(v) / st.bc2_sqrt, eps);
      w = rn_add(w, -rn_mul(st.step_size, m / denom));
      f.m.v[j] = m;
      f.v.v[j] = v;
      if constexpr (master) f.w.v[j] = w;
      f.p.v[j] = E::from_acc(w);
    }
    store_pack<N, A>(p[2], i, f.m);
    store_pack<N, A>(p[3], i, f.v);
    if constexpr (master) store_pack<N, A>(p[4], i, f.w);
    store_pack<N, B>(p[0], i, f.p);
  }
  __device__ void end(local&) const {}
};

inline void check_optimizer_segment(const segment& s, std::size_t count, bool required, std::size_t i,
                                    const char* who, const char* what) {
  if (!required) {
    if (s.count != 0 || s.ptr != nullptr)
      throw config_error(std::string(who) + ": tensor " + std::to_string(i) + " has a " + what +
                         " segment, but this configuration uses none; leave it empty");
    return;
  }
  if (s.count != count)
    throw config_error(std::string(who) + ": tensor " + std::to_string(i) + " has " +
                       std::to_string(count) + " parameters but " + std::to_string(s.count) + " " +
                       what + " elements; every segment of a tensor has the same count");
  if (count != 0 && s.ptr == nullptr)
    throw config_error(std::string(who) + ": tensor " + std::to_string(i) + ": null " + what + " pointer");
}

inline void launch_advance_step(std::int64_t* d_step, const int* d_found_inf, cudaStream_t s) {
  advance_step_kernel<<<1, 1, 0, s>>>(d_step, d_found_inf);
  LOCKSTEP_CHECK_LAUNCH();
}

}  // namespace detail

//! SGD step over `tensors` (param_type: f32, f64, f16 or bf16). d_step is required when
//! o.momentum ≠ 0 (see the header comment) and may be null otherwise.
inline void sgd_step(std::span<const sgd_tensor> tensors, dtype param_type, const SgdOptions& o,
                     std::int64_t* d_step, const int* d_found_inf, cudaStream_t s) {
  (void)Sgd(o);  // validates the options as the CPU optimizer does
  const bool mom = o.momentum != 0;
  if (mom && d_step == nullptr)
    throw config_error("sgd_step: momentum ≠ 0 needs a device step counter (d_step)");
  detail::visit_float(param_type, "sgd_step", [&]<class T>(std::type_identity<T>) {
    using op_t = detail::sgd_op<T>;
    using A = typename op_t::A;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& x = tensors[i];
      const std::size_t n = x.param.count;
      detail::check_optimizer_segment(x.param, n, true, i, "sgd_step", "param");
      detail::check_optimizer_segment(x.grad, n, true, i, "sgd_step", "grad");
      detail::check_optimizer_segment(x.momentum, n, mom, i, "sgd_step", "momentum");
      detail::check_optimizer_segment(x.master, n, op_t::master, i, "sgd_step", "master");
    }
    if (mom) detail::launch_advance_step(d_step, d_found_inf, s);
    const op_t op{static_cast<A>(o.lr), static_cast<A>(o.momentum), static_cast<A>(1.0 - o.dampening),
                  static_cast<A>(o.weight_decay), o.nesterov, mom ? d_step : nullptr, d_found_inf};
    detail::launch_multi_tensor(op, tensors.size(), [&](std::size_t i) {
      const auto& x = tensors[i];
      return detail::tensor_ref<4>{{x.param.ptr, x.grad.ptr, mom ? x.momentum.ptr : nullptr,
                                    op_t::master ? x.master.ptr : nullptr},
                                   x.param.count};
    }, s, "sgd_step");
  });
}

//! AdamW step over `tensors` (param_type: f32, f64, f16 or bf16); d_step is required.
inline void adamw_step(std::span<const adamw_tensor> tensors, dtype param_type, const AdamWOptions& o,
                       std::int64_t* d_step, const int* d_found_inf, cudaStream_t s) {
  (void)AdamW(o);
  if (d_step == nullptr) throw config_error("adamw_step needs a device step counter (d_step)");
  detail::visit_float(param_type, "adamw_step", [&]<class T>(std::type_identity<T>) {
    using op_t = detail::adamw_op<T>;
    using A = typename op_t::A;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& x = tensors[i];
      const std::size_t n = x.param.count;
      detail::check_optimizer_segment(x.param, n, true, i, "adamw_step", "param");
      detail::check_optimizer_segment(x.grad, n, true, i, "adamw_step", "grad");
      detail::check_optimizer_segment(x.exp_avg, n, true, i, "adamw_step", "exp_avg");
      detail::check_optimizer_segment(x.exp_avg_sq, n, true, i, "adamw_step", "exp_avg_sq");
      detail::check_optimizer_segment(x.master, n, op_t::master, i, "adamw_step", "master");
    }
    detail::launch_advance_step(d_step, d_found_inf, s);
    const op_t op{o.lr, o.beta1, o.beta2,
                  static_cast<A>(1.0 - o.lr * o.weight_decay),
                  static_cast<A>(o.beta1), static_cast<A>(1.0 - o.beta1),
                  static_cast<A>(o.beta2), static_cast<A>(1.0 - o.beta2),
                  static_cast<A>(o.eps), d_step, d_found_inf};
    detail::launch_multi_tensor(op, tensors.size(), [&](std::size_t i) {
      const auto& x = tensors[i];
      return detail::tensor_ref<5>{{x.param.ptr, x.grad.ptr, x.exp_avg.ptr, x.exp_avg_sq.ptr,
                                    op_t::master ? x.master.ptr : nullptr},
                                   x.param.count};
    }, s, "adamw_step");
  });
}

}  // namespace lockstep::cuda::kernels
