#pragma once
// The example's model on a GPU: the MLP of mlp.hpp (784-256-128-10, ReLU, softmax
// cross-entropy), with its three kinds of GEMM in cuBLAS (fp32, no TF32) and small kernels
// for the rest (input gather, bias + ReLU, softmax-cross-entropy gradient, bias gradient,
// ReLU mask, loss sum, correct count). Parameters have mlp.hpp's names, shapes ([in, out]
// weights), order and initial values, so checkpoints move between the devices and --check
// can compare the two models on the same weights.
//
// It meets lockstep::model as the host model does: parameters() returns device pointers,
// bind_gradient(i, p) moves gradient i into lockstep's arena (zero copy), backward ADDS into
// the gradients and calls ready(i) once gradient i is final (last layer first, so its bucket
// can be reduced while the earlier layers still compute). Everything is queued on one
// stream (the rank's compute stream, cuBLAS included); nothing synchronises the host.
//
// cuBLAS is column-major; a row-major M[r×c] is, to cuBLAS, the column-major Mᵀ[c×r] with
// leading dimension c. So row-major Y = X·W is computed as Yᵀ = Wᵀ·Xᵀ (gemm N,N), and the
// backward products dW = Xᵀ·dY and dX = dY·Wᵀ as dWᵀ = dYᵀ·X (N,T) and dXᵀ = W·dYᵀ (T,N).
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
#include <utility>
#include <vector>

#include <lockstep/core/error.hpp>
#include <lockstep/core/parameter.hpp>
#include <lockstep/cuda/error.cuh>
#include <lockstep/cuda/memory.cuh>

#include "idx.hpp"
#include "mlp.hpp"

namespace fmnist::gpu {

inline void check_cublas(cublasStatus_t st, const char* call, const char* file, int line) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw lockstep::cuda_error(lockstep::detail::call_failure(
        call, file, line, std::string(cublasGetStatusName(st)) + ": " + cublasGetStatusString(st)));
}
#define FMNIST_TRY_CUBLAS(call) ::fmnist::gpu::check_cublas((call), #call, __FILE__, __LINE__)

namespace kernels {

inline constexpr int threads = 256;  // gather_rows relies on it (one table entry per thread)
inline constexpr int pixels = image_pixels;
inline constexpr int classes = static_cast<int>(fmnist::Mlp::dims[3]);

inline unsigned blocks(std::size_t n) { return static_cast<unsigned>((n + threads - 1) / threads); }

// x[r, k] = table[pixels[row, k]], y[r] = labels[row], with row = rows[r] (rows non-null) or
// first + r: the host's gather() (fashion_mnist.hpp) on the device, bit for bit.
static __global__ void gather_rows(const std::uint8_t* __restrict__ px, const std::uint8_t* __restrict__ labels,
                                   const int* __restrict__ rows, std::size_t first, const float* __restrict__ table,
                                   float* __restrict__ x, std::uint8_t* __restrict__ y, int n) {
  __shared__ float t[256];
  t[threadIdx.x] = table[threadIdx.x];
  __syncthreads();
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<std::size_t>(n) * pixels) return;
  const std::size_t r = i / pixels, k = i % pixels;
  const std::size_t row = rows ? static_cast<std::size_t>(rows[r]) : first + r;
  x[i] = t[px[row * pixels + k]];
  if (k == 0) y[r] = labels[row];
}

// y[r, o] += b[o], then ReLU (as mlp.hpp: v > 0 ? v : 0) unless `relu` is false.
static __global__ void bias_act(float* __restrict__ y, const float* __restrict__ b, int n, int out, bool relu) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<std::size_t>(n) * out) return;
  const float v = y[i] + b[i % out];
  y[i] = relu ? (v > 0.0f ? v : 0.0f) : v;
}

// One thread per row: softmax of the logits, the row's cross-entropy (in double, as the
// host model sums it) and the gradient of the batch mean, (softmax − onehot) / B.
static __global__ void softmax_xent(const float* __restrict__ logits, const std::uint8_t* __restrict__ y,
                                    float* __restrict__ delta, double* __restrict__ row_loss, int n, float inv_b) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const float* z = logits + static_cast<std::size_t>(r) * classes;
  float m = z[0];
  for (int c = 1; c < classes; ++c) m = z[c] > m ? z[c] : m;
  float e[classes];
  float sum = 0.0f;
  for (int c = 0; c < classes; ++c) sum += (e[c] = expf(z[c] - m));
  const int label = y[r];
  row_loss[r] = log(static_cast<double>(sum)) - static_cast<double>(z[label] - m);
  for (int c = 0; c < classes; ++c)
    delta[static_cast<std::size_t>(r) * classes + c] = (e[c] / sum - (c == label ? 1.0f : 0.0f)) * inv_b;
}

// *acc += Σ v[0, n), one block, in a fixed order (deterministic, unlike atomics on doubles).
static __global__ void add_sum(const double* __restrict__ v, int n, double* __restrict__ acc) {
  __shared__ double s[threads];
  double t = 0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += threads) t += v[i];
  s[threadIdx.x] = t;
  __syncthreads();
  for (int w = threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *acc += s[0];
}

// gb[o] += Σ_r d[r, o], rows in order (threads read consecutive columns: coalesced).
static __global__ void bias_grad(const float* __restrict__ d, float* __restrict__ gb, int n, int out) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float s = 0.0f;
  for (int r = 0; r < n; ++r) s += d[static_cast<std::size_t>(r) * out + o];
  gb[o] += s;
}

// Backward through ReLU: dx = act > 0 ? dx : 0.
static __global__ void relu_mask(float* __restrict__ dx, const float* __restrict__ act, std::size_t count) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < count && !(act[i] > 0.0f)) dx[i] = 0.0f;
}

// *count += rows whose first maximal logit is the label (mlp.hpp's tie rule).
static __global__ void count_correct(const float* __restrict__ logits, const std::uint8_t* __restrict__ y, int n,
                                     unsigned long long* __restrict__ count) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const float* z = logits + static_cast<std::size_t>(r) * classes;
  int best = 0;
  for (int c = 1; c < classes; ++c)
    if (z[c] > z[best]) best = c;
  if (best == y[r]) atomicAdd(count, 1ULL);
}

}  // namespace kernels

//! Gathers normalised rows of a device-resident split into a batch (the input pipeline).
inline void gather_rows(const std::uint8_t* px, const std::uint8_t* labels, const int* rows, std::size_t first,
                        const float* table, float* x, std::uint8_t* y, int n, cudaStream_t s) {
  if (n == 0) return;
  kernels::gather_rows<<<kernels::blocks(static_cast<std::size_t>(n) * kernels::pixels), kernels::threads, 0, s>>>(
      px, labels, rows, first, table, x, y, n);
  LOCKSTEP_CHECK_LAUNCH();
}

//! A cuBLAS handle's deleter (for a std::unique_ptr): destroys it on its device.
struct blas_deleter {
  int device;
  void operator()(cublasHandle_t h) const noexcept {
    lockstep::detail::device_guard g(device, std::nothrow);
    (void)cublasDestroy(h);
  }
};

//! A non-blocking CUDA stream on `device`, destroyed with its owner.
struct stream_owner {
  cudaStream_t s = nullptr;
  explicit stream_owner(int device) {
    lockstep::detail::device_guard g(device);
    LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  ~stream_owner() { (void)cudaStreamDestroy(s); }
  stream_owner(const stream_owner&) = delete;
  stream_owner& operator=(const stream_owner&) = delete;
};

//! n as an int, or config_error (naming `model`) unless a model sized for max_rows rows takes
//! a batch of n rows (1..max_rows).
inline int checked_rows(std::size_t n, std::size_t max_rows, const char* model) {
  if (n == 0 || n > max_rows)
    throw lockstep::config_error(std::string(model) + ": a batch of " + std::to_string(n) +
                                 " rows; this model was sized for 1.." + std::to_string(max_rows));
  return static_cast<int>(n);
}

class Mlp {
 public:
  static constexpr auto dims = fmnist::Mlp::dims;
  static constexpr std::size_t layers = fmnist::Mlp::layers;

  //! initial: a host model's parameters() (fmnist::Mlp: same names, shapes, order), copied to
  //! mem's device; work is queued on mem's stream. max_rows: the largest batch to be seen.
  Mlp(const std::vector<lockstep::parameter>& initial, const lockstep::CudaMemory& mem, std::size_t max_rows)
      : mem_(mem), max_rows_(max_rows) {
    if (initial.size() != 2 * layers)
      throw lockstep::config_error("gpu::Mlp: expected " + std::to_string(2 * layers) +
                                   " initial parameters (fc1.weight, fc1.bias, ...), got " +
                                   std::to_string(initial.size()));
    lockstep::detail::device_guard g(mem_.device());
    std::size_t total = 0;
    for (std::size_t i = 0; i < 2 * layers; ++i) {
      const std::size_t want = i % 2 == 0 ? dims[i / 2] * dims[i / 2 + 1] : dims[i / 2 + 1];
      if (initial[i].type != lockstep::dtype::f32 || initial[i].numel() != want)
        throw lockstep::config_error("gpu::Mlp: initial parameter '" + initial[i].name + "' is " +
                                     initial[i].shape_string() + "; expected " + std::to_string(want) +
                                     " f32 elements");
      numel_[i] = want;
      total += want;
    }
    values_mem_ = mem_.allocate(total * sizeof(float));
    grads_mem_ = mem_.allocate(total * sizeof(float));  // zeroed
    auto* v = static_cast<float*>(values_mem_.get());
    auto* gr = static_cast<float*>(grads_mem_.get());
    for (std::size_t i = 0, at = 0; i < 2 * layers; at += numel_[i], ++i) {
      values_[i] = v + at;
      grads_[i] = gr + at;
      mem_.upload(values_[i], initial[i].value, numel_[i] * sizeof(float));
    }
    // Activations act_[1..3] (act_[0] is the caller's input), two backward buffers, row losses.
    const std::size_t widest = *std::max_element(dims.begin() + 1, dims.end());
    act_mem_ = mem_.allocate(max_rows_ * (dims[1] + dims[2] + dims[3] + 2 * widest) * sizeof(float));
    float* a = static_cast<float*>(act_mem_.get());
    for (std::size_t l = 1; l <= layers; ++l) {
      act_[l] = a;
      a += max_rows_ * dims[l];
    }
    delta_ = a;
    prev_ = a + max_rows_ * widest;
    loss_mem_ = mem_.allocate(max_rows_ * sizeof(double));
    cublasHandle_t h = nullptr;
    FMNIST_TRY_CUBLAS(cublasCreate(&h));
    blas_ = decltype(blas_)(h, blas_deleter{mem_.device()});
    FMNIST_TRY_CUBLAS(cublasSetStream(h, mem_.stream()));
    // Plain fp32 (no TF32 tensor-core rounding), so the result matches the CPU model to ~1e-6.
    FMNIST_TRY_CUBLAS(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }

  Mlp(const Mlp&) = delete;
  Mlp& operator=(const Mlp&) = delete;

  //! As fmnist::Mlp: fc1.weight [784,256], fc1.bias [256], fc2..., device pointers.
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t l = 0; l < layers; ++l) {
      const std::string n = "fc" + std::to_string(l + 1);
      const auto in = static_cast<std::int64_t>(dims[l]), out = static_cast<std::int64_t>(dims[l + 1]);
      ps.push_back(lockstep::param<float>(n + ".weight", values_[2 * l], grads_[2 * l], {in, out}));
      ps.push_back(lockstep::param<float>(n + ".bias", values_[2 * l + 1], grads_[2 * l + 1], {out}));
    }
    return ps;
  }

  //! lockstep's arena now holds gradient i (device memory on our device).
  void bind_gradient(std::size_t i, void* p) { grads_.at(i) = static_cast<float*>(p); }

  //! Zeroes the gradients (wherever they are bound); DataParallel does this itself.
  void zero_grad() {
    lockstep::detail::device_guard g(mem_.device());
    for (std::size_t i = 0; i < 2 * layers; ++i) mem_.zero(grads_[i], numel_[i] * sizeof(float));
  }

  //! The batch x (n × 784, device), labels y (device): adds the gradient of the mean
  //! cross-entropy into the gradients, calls ready(i) as gradient i becomes final, and adds
  //! the batch's summed (not mean) loss to *loss_acc (device). Queued, not waited for.
  template <class Ready>
  void forward_backward(const float* x, const std::uint8_t* y, std::size_t n, double* loss_acc, Ready&& ready) {
    lockstep::detail::device_guard g(mem_.device());
    const int rows = checked_rows(n, max_rows_, "gpu::Mlp");
    const cudaStream_t s = mem_.stream();
    forward(x, rows);
    auto* row_loss = static_cast<double*>(loss_mem_.get());
    kernels::softmax_xent<<<kernels::blocks(n), kernels::threads, 0, s>>>(act_[layers], y, delta_, row_loss, rows,
                                                                          1.0f / static_cast<float>(rows));
    LOCKSTEP_CHECK_LAUNCH();
    kernels::add_sum<<<1, kernels::threads, 0, s>>>(row_loss, rows, loss_acc);
    LOCKSTEP_CHECK_LAUNCH();
    float* d = delta_;
    float* spare = prev_;
    const float one = 1.0f, zero = 0.0f;
    for (std::size_t l = layers; l-- > 0;) {
      const int in = static_cast<int>(dims[l]), out = static_cast<int>(dims[l + 1]);
      const float* input = l == 0 ? x : act_[l];
      // dWᵀ(out×in) += dYᵀ(out×n) · X(n×in)
      FMNIST_TRY_CUBLAS(cublasSgemm(blas_.get(), CUBLAS_OP_N, CUBLAS_OP_T, out, in, rows, &one, d, out, input, in, &one,
                                    grads_[2 * l], out));
      kernels::bias_grad<<<kernels::blocks(static_cast<std::size_t>(out)), kernels::threads, 0, s>>>(
          d, grads_[2 * l + 1], rows, out);
      LOCKSTEP_CHECK_LAUNCH();
      // Both gradients of layer l are queued: their bucket may go. Bias first, so the
      // arrival order (fc3.bias, fc3.weight, fc2.bias, ...) is lockstep's initial bucket
      // order and the arena is never re-laid out: NCCL's rounding depends on where an
      // element sits in the buffer, so a resumed run must use the layout the
      // uninterrupted one used at the same step to reproduce it bit for bit.
      ready(2 * l + 1);
      ready(2 * l);
      if (l > 0) {
        // dXᵀ(in×n) = W(in×out) · dYᵀ(out×n), then through the ReLU of the layer below.
        FMNIST_TRY_CUBLAS(cublasSgemm(blas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, in, rows, out, &one, values_[2 * l], out,
                                      d, out, &zero, spare, in));
        const std::size_t count = static_cast<std::size_t>(rows) * static_cast<std::size_t>(in);
        kernels::relu_mask<<<kernels::blocks(count), kernels::threads, 0, s>>>(spare, act_[l], count);
        LOCKSTEP_CHECK_LAUNCH();
        std::swap(d, spare);
      }
    }
  }

  //! Adds to *count (device) how many of the n rows of x are classified as their label.
  void count_correct(const float* x, const std::uint8_t* y, std::size_t n, unsigned long long* count) {
    lockstep::detail::device_guard g(mem_.device());
    const int rows = checked_rows(n, max_rows_, "gpu::Mlp");
    forward(x, rows);
    kernels::count_correct<<<kernels::blocks(n), kernels::threads, 0, mem_.stream()>>>(act_[layers], y, rows, count);
    LOCKSTEP_CHECK_LAUNCH();
  }

  std::size_t max_rows() const noexcept { return max_rows_; }

 private:
  // act_[l+1] = relu(act_[l] · W_l + b_l) (no ReLU on the logits); act_[0] is x itself.
  void forward(const float* x, int rows) {
    const float one = 1.0f, zero = 0.0f;
    for (std::size_t l = 0; l < layers; ++l) {
      const int in = static_cast<int>(dims[l]), out = static_cast<int>(dims[l + 1]);
      // Yᵀ(out×n) = Wᵀ(out×in) · Xᵀ(in×n)
      FMNIST_TRY_CUBLAS(cublasSgemm(blas_.get(), CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, &one, values_[2 * l], out,
                                    l == 0 ? x : act_[l], in, &zero, act_[l + 1], out));
      const std::size_t count = static_cast<std::size_t>(rows) * static_cast<std::size_t>(out);
      kernels::bias_act<<<kernels::blocks(count), kernels::threads, 0, mem_.stream()>>>(act_[l + 1], values_[2 * l + 1],
                                                                                        rows, out, l + 1 < layers);
      LOCKSTEP_CHECK_LAUNCH();
    }
  }

  lockstep::CudaMemory mem_;
  std::size_t max_rows_;
  std::shared_ptr<void> values_mem_, grads_mem_, act_mem_, loss_mem_;
  std::array<std::size_t, 2 * layers> numel_{};
  std::array<float*, 2 * layers> values_{}, grads_{};
  std::array<float*, layers + 1> act_{};
  float* delta_ = nullptr;
  float* prev_ = nullptr;
  std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, blas_deleter> blas_;
};

}  // namespace fmnist::gpu
