#pragma once
// tp_mlp.hpp's tensor-parallel classifier on a GPU: the same network, parameter layout
// ([out, in] row-major weights), names, order and initial values (taken from the host TpMlp of
// the same part and seed, so any split of one seed is the same function), fp32 throughout.
//
//   x ─ fc1 ─ relu ─ f ─ fc2 (part k's rows) ─ relu ─ fc3 (part k's columns) ─ g ─ +b3 ─ relu ─ fc4
//
// The matmuls are cuBLAS (plain fp32, no TF32) and the rest example 01's kernels
// (../01_fashion_mnist/gpu_mlp.cuh), all queued on one stream: the rank's compute stream. The
// two tensor-parallel collectives are NcclComm all-reduces on the model axis — g (forward: the
// parts' partial fc3 outputs summed) and f (backward: the parts' partial input gradients of fc2
// summed) — whose work.wait() orders the compute stream after them: no host synchronisation
// anywhere in forward_backward. With parts = 1 and no communicator it is the unsplit network.
//
// It meets lockstep::model as example 01's gpu::Mlp does: device pointers in parameters(),
// bind_gradient(i, p) for the zero-copy arena, backward ADDS into the gradients and calls
// ready(i) once gradient i is final, last layer first.
//
// cuBLAS is column-major: a row-major M[r×c] is the column-major Mᵀ with leading dimension c.
// With W[out×in] and X[rows×in] row-major, Y = X·Wᵀ is Yᵀ = W·Xᵀ (gemm T,N on the stored
// arrays), dW += dYᵀ·X is dWᵀ += Xᵀ·dY (N,T) and dX = dY·W is dXᵀ = Wᵀ·dYᵀ (N,N).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include <lockstep/core/error.hpp>
#include <lockstep/core/parameter.hpp>
#include <lockstep/cuda/error.cuh>
#include <lockstep/cuda/memory.cuh>
#include <lockstep/cuda/nccl_comm.cuh>

#include "../01_fashion_mnist/gpu_mlp.cuh"
#include "tp_mlp.hpp"

namespace hybrid {

//! Which tensor-parallel all-reduce to leave out: only for showing that the equivalence
//! check (--check-equivalence --check-omit) fails without it.
enum class omit_collective { none, f, g };

class GpuTpMlp {
 public:
  static constexpr std::size_t count = 8;  // fc1.weight, fc1.bias, ..., fc4.bias

  //! Part `part` of `parts`; model_comm: the model axis (nullptr when parts == 1), whose
  //! compute stream must be mem's stream (lockstep's compute stream of this rank). max_rows:
  //! the largest batch forward will see.
  GpuTpMlp(dims d, int part, int parts, lockstep::NcclComm* model_comm, std::uint64_t seed,
           const lockstep::CudaMemory& mem, std::size_t max_rows)
      : d_(d), parts_(parts), comm_(model_comm), mem_(mem), rows_(max_rows) {
    namespace k = fmnist::gpu::kernels;
    if (d.in != k::pixels || d.classes != k::classes)
      throw lockstep::config_error("GpuTpMlp: example 01's kernels take " + std::to_string(k::pixels) + " inputs and " +
                                   std::to_string(k::classes) + " classes");
    if (comm_ != nullptr && comm_->compute_stream() != mem_.stream())
      throw lockstep::config_error("GpuTpMlp: the model axis orders its all-reduces on another stream than the "
                                   "model's kernels; give CudaMemory(device, comm.compute_stream())");
    // The host model of this part: its checks (parts divide hidden, comm of that size), its
    // names, shapes and initial values. It never communicates here.
    TpMlp<lockstep::NcclComm> host(d, part, parts, model_comm, seed);
    h_ = static_cast<std::size_t>(d.hidden / parts);
    const auto initial = host.parameters();
    std::size_t total = 0;
    for (std::size_t i = 0; i < count; ++i) {
      names_[i] = initial[i].name;
      shapes_[i] = initial[i].shape;
      numel_[i] = initial[i].numel();
      total += numel_[i];
    }
    lockstep::detail::device_guard g(mem_.device());
    values_mem_ = mem_.allocate(total * sizeof(float));
    grads_mem_ = mem_.allocate(total * sizeof(float));  // zeroed
    for (std::size_t i = 0, at = 0; i < count; at += numel_[i], ++i) {
      values_[i] = static_cast<float*>(values_mem_.get()) + at;
      grads_[i] = static_cast<float*>(grads_mem_.get()) + at;
      mem_.upload(values_[i], initial[i].value, numel_[i] * sizeof(float));
    }
    const std::size_t W = width(), C = classes();
    act_mem_ = mem_.allocate(rows_ * (4 * W + 2 * h_ + 2 * C) * sizeof(float));
    float* p = static_cast<float*>(act_mem_.get());
    for (auto [buf, n] :
         {std::pair{&a1_, W}, {&a2_, h_}, {&a3_, W}, {&z4_, C}, {&d4_, C}, {&d3_, W}, {&d2_, h_}, {&d1_, W}}) {
      *buf = p;
      p += rows_ * n;
    }
    loss_mem_ = mem_.allocate(rows_ * sizeof(double));
    cublasHandle_t h = nullptr;
    FMNIST_TRY_CUBLAS(cublasCreate(&h));
    blas_ = decltype(blas_)(h, fmnist::gpu::blas_deleter{mem_.device()});
    FMNIST_TRY_CUBLAS(cublasSetStream(h, mem_.stream()));
    FMNIST_TRY_CUBLAS(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));  // fp32, no TF32 rounding
  }

  GpuTpMlp(const GpuTpMlp&) = delete;
  GpuTpMlp& operator=(const GpuTpMlp&) = delete;

  //! TpMlp's parameters (names with "[part k/M]" on the split ones), device pointers.
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t i = 0; i < count; ++i)
      ps.push_back(lockstep::param<float>(names_[i], values_[i], grads_[i], shapes_[i]));
    return ps;
  }
  void bind_gradient(std::size_t i, void* p) { grads_.at(i) = static_cast<float*>(p); }

  //! Zeroes the gradients (DataParallel does it itself; for runs without one).
  void zero_grad() {
    for (std::size_t i = 0; i < count; ++i) mem_.zero(grads_[i], numel_[i] * sizeof(float));
  }

  void omit_for_check(omit_collective o) { omit_ = o; }

  //! The batch x (n × in, device), labels y (device): adds the gradient of the mean
  //! cross-entropy into the gradients, calls ready(i) as gradient i becomes final, and adds
  //! the batch's summed loss to *loss_acc (device). Queued on the stream, not waited for.
  template <class Ready>
  void forward_backward(const float* x, const std::uint8_t* y, std::size_t n, double* loss_acc, Ready&& ready) {
    namespace k = fmnist::gpu::kernels;
    lockstep::detail::device_guard g(mem_.device());
    const int rows = fmnist::gpu::checked_rows(n, rows_, "GpuTpMlp");
    const cudaStream_t s = mem_.stream();
    const std::size_t W = width(), C = classes(), I = static_cast<std::size_t>(d_.in);
    forward(x, rows);
    auto* row_loss = static_cast<double*>(loss_mem_.get());
    k::softmax_xent<<<k::blocks(n), k::threads, 0, s>>>(z4_, y, d4_, row_loss, rows, 1.0f / static_cast<float>(rows));
    LOCKSTEP_CHECK_LAUNCH();
    k::add_sum<<<1, k::threads, 0, s>>>(row_loss, rows, loss_acc);
    LOCKSTEP_CHECK_LAUNCH();
    // Each layer: its two gradients, ready (bias first: the reverse of registration order is
    // lockstep's initial bucket order), then the gradient of its input through the ReLU below.
    weight_grads(d4_, C, a3_, W, rows, 6);
    ready(7), ready(6);
    input_grad(d4_, C, values_[6], W, rows, d3_);
    mask(d3_, a3_, rows * W);
    weight_grads(d3_, W, a2_, h_, rows, 4);
    ready(5), ready(4);
    input_grad(d3_, W, values_[4], h_, rows, d2_);  // g backward: identity
    mask(d2_, a2_, rows * h_);
    weight_grads(d2_, h_, a1_, W, rows, 2);
    ready(3), ready(2);
    input_grad(d2_, h_, values_[2], W, rows, d1_);
    if (omit_ != omit_collective::f) sum_over_parts(d1_, rows * W);  // f backward
    mask(d1_, a1_, rows * W);
    weight_grads(d1_, W, x, I, rows, 0);
    ready(1), ready(0);
  }

  //! Adds to *correct (device) how many of the n rows of x are classified as their label
  //! (forward only; collective over the model axis).
  void count_correct(const float* x, const std::uint8_t* y, std::size_t n, unsigned long long* correct) {
    namespace k = fmnist::gpu::kernels;
    lockstep::detail::device_guard g(mem_.device());
    const int rows = fmnist::gpu::checked_rows(n, rows_, "GpuTpMlp");
    forward(x, rows);
    k::count_correct<<<k::blocks(n), k::threads, 0, mem_.stream()>>>(z4_, y, rows, correct);
    LOCKSTEP_CHECK_LAUNCH();
  }

  //! The whole network's values as the unsplit model lays them out, on the host (collective
  //! over the model axis: fc2's rows and fc3's columns are all-gathered from the parts).
  std::vector<float> gathered_values() {
    lockstep::detail::device_guard g(mem_.device());
    const std::size_t W = width(), H = static_cast<std::size_t>(d_.hidden), P = static_cast<std::size_t>(parts_);
    std::vector<float> out;
    const auto append = [&](const std::vector<float>& v) { out.insert(out.end(), v.begin(), v.end()); };
    append(local(0)), append(local(1));
    append(from_all_parts(values_[2], numel_[2]));  // part k's rows, in part order: fc2 whole
    append(from_all_parts(values_[3], numel_[3]));
    const auto blocks = from_all_parts(values_[4], numel_[4]);  // P blocks of W × h
    std::vector<float> w3(W * H);
    for (std::size_t k = 0; k < P; ++k)
      for (std::size_t o = 0; o < W; ++o)
        std::copy_n(blocks.begin() + static_cast<std::ptrdiff_t>(k * W * h_ + o * h_), h_,
                    w3.begin() + static_cast<std::ptrdiff_t>(o * H + k * h_));
    append(w3);
    for (std::size_t i = 5; i < count; ++i) append(local(i));
    return out;
  }

  std::size_t max_rows() const noexcept { return rows_; }

 private:
  std::size_t width() const { return static_cast<std::size_t>(d_.width); }
  std::size_t classes() const { return static_cast<std::size_t>(d_.classes); }

  // The activations of `rows` rows; g's all-reduce is the only communication.
  void forward(const float* x, int rows) {
    const std::size_t W = width(), C = classes(), I = static_cast<std::size_t>(d_.in),
                      r = static_cast<std::size_t>(rows);
    affine(x, I, values_[0], W, rows, a1_);
    bias_act(a1_, values_[1], rows, W, true);
    affine(a1_, W, values_[2], h_, rows, a2_);
    bias_act(a2_, values_[3], rows, h_, true);
    affine(a2_, h_, values_[4], W, rows, a3_);                    // this part's partial sum
    if (omit_ != omit_collective::g) sum_over_parts(a3_, r * W);  // g
    bias_act(a3_, values_[5], rows, W, true);
    affine(a3_, W, values_[6], C, rows, z4_);
    bias_act(z4_, values_[7], rows, C, false);
  }

  // In place, summed over the parts; the compute stream waits for it (no host wait).
  void sum_over_parts(float* v, std::size_t n) {
    if (parts_ > 1) comm_->all_reduce(v, v, n, lockstep::dtype::f32, lockstep::reduce_op::sum).wait();
  }

  // out[r, o] = Σ_i w[o, i] · in[r, i]   (outᵀ = W·inᵀ)
  void affine(const float* in, std::size_t n_in, const float* w, std::size_t n_out, int rows, float* out) {
    const float one = 1.0f, zero = 0.0f;
    const int ni = static_cast<int>(n_in), no = static_cast<int>(n_out);
    FMNIST_TRY_CUBLAS(
        cublasSgemm(blas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, no, rows, ni, &one, w, ni, in, ni, &zero, out, no));
  }
  // Gradients of parameter pair (i, i+1) from the output gradient d (rows × n_out) and the
  // layer's input (rows × n_in): gw[o, i] += Σ_r d[r, o]·in[r, i] (gwᵀ += inᵀ·d), gb[o] += Σ_r d[r, o].
  void weight_grads(const float* d, std::size_t n_out, const float* in, std::size_t n_in, int rows, std::size_t i) {
    namespace k = fmnist::gpu::kernels;
    const float one = 1.0f;
    const int ni = static_cast<int>(n_in), no = static_cast<int>(n_out);
    FMNIST_TRY_CUBLAS(
        cublasSgemm(blas_.get(), CUBLAS_OP_N, CUBLAS_OP_T, ni, no, rows, &one, in, ni, d, no, &one, grads_[i], ni));
    k::bias_grad<<<k::blocks(n_out), k::threads, 0, mem_.stream()>>>(d, grads_[i + 1], rows, no);
    LOCKSTEP_CHECK_LAUNCH();
  }
  // din[r, i] = Σ_o d[r, o]·w[o, i]   (dinᵀ = Wᵀ·dᵀ)
  void input_grad(const float* d, std::size_t n_out, const float* w, std::size_t n_in, int rows, float* din) {
    const float one = 1.0f, zero = 0.0f;
    const int ni = static_cast<int>(n_in), no = static_cast<int>(n_out);
    FMNIST_TRY_CUBLAS(
        cublasSgemm(blas_.get(), CUBLAS_OP_N, CUBLAS_OP_N, ni, rows, no, &one, w, ni, d, no, &zero, din, ni));
  }
  void bias_act(float* y, const float* b, int rows, std::size_t out, bool relu) {
    namespace k = fmnist::gpu::kernels;
    const std::size_t n = static_cast<std::size_t>(rows) * out;
    k::bias_act<<<k::blocks(n), k::threads, 0, mem_.stream()>>>(y, b, rows, static_cast<int>(out), relu);
    LOCKSTEP_CHECK_LAUNCH();
  }
  void mask(float* d, const float* act, std::size_t n) {
    namespace k = fmnist::gpu::kernels;
    k::relu_mask<<<k::blocks(n), k::threads, 0, mem_.stream()>>>(d, act, n);
    LOCKSTEP_CHECK_LAUNCH();
  }

  // n values at src (device) on the host.
  std::vector<float> download(const float* src, std::size_t n) const {
    std::vector<float> v(n);
    mem_.download(v.data(), src, n * sizeof(float));  // after the work queued on the stream
    return v;
  }
  std::vector<float> local(std::size_t i) const { return download(values_[i], numel_[i]); }
  // Every part's n values at src, part k's at k·n, on the host (an all-gather over the model axis).
  std::vector<float> from_all_parts(const float* src, std::size_t n) {
    if (parts_ == 1) return download(src, n);
    const auto buf = mem_.allocate(n * static_cast<std::size_t>(parts_) * sizeof(float));
    comm_->all_gather(src, buf.get(), n, lockstep::dtype::f32).wait();  // orders the stream
    return download(static_cast<const float*>(buf.get()), n * static_cast<std::size_t>(parts_));
  }

  dims d_;
  int parts_;
  lockstep::NcclComm* comm_;
  lockstep::CudaMemory mem_;
  std::size_t rows_;
  std::size_t h_ = 0;  // hidden units of this part
  omit_collective omit_ = omit_collective::none;
  std::array<std::string, count> names_;
  std::array<std::vector<std::int64_t>, count> shapes_;
  std::array<std::size_t, count> numel_{};
  std::array<float*, count> values_{}, grads_{};
  std::shared_ptr<void> values_mem_, grads_mem_, act_mem_, loss_mem_;
  float *a1_ = nullptr, *a2_ = nullptr, *a3_ = nullptr, *z4_ = nullptr;  // activations (a3: z3 first)
  float *d4_ = nullptr, *d3_ = nullptr, *d2_ = nullptr, *d1_ = nullptr;  // their gradients
  std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, fmnist::gpu::blas_deleter> blas_;
};

}  // namespace hybrid
