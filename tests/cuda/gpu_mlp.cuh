#pragma once
// A small ReLU MLP on one GPU for tests: plain kernels (one thread per output), gradients
// *added* into buffers that lockstep may bind into its arena, gradient-ready hook calls
// last layer first. The CPU twin is tests/support/mlp.hpp (TestMlp<float>).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <lockstep/core/parameter.hpp>
#include <lockstep/cuda/error.cuh>

#include "mlp.hpp"

namespace lockstep_test {

namespace k {
__global__ void linear_fwd(const float* W, const float* b, const float* x, float* y, int B, int in, int out,
                           bool relu) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= B * out) return;
  int r = t / out, o = t % out;
  float s = b[o];
  for (int i = 0; i < in; ++i) s += W[o * in + i] * x[r * in + i];
  y[t] = (relu && s < 0.f) ? 0.f : s;
}
__global__ void gather_rows(const float* X, const int* rows, float* x, int B, int in) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= B * in) return;
  x[t] = X[static_cast<std::size_t>(rows[t / in]) * in + t % in];
}
__global__ void softmax_ce_grad(const float* logits, const int* y, const int* rows, float* d, int B, int C,
                                float scale) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= B) return;
  float m = logits[r * C];
  for (int c = 1; c < C; ++c) m = fmaxf(m, logits[r * C + c]);
  float z = 0;
  for (int c = 0; c < C; ++c) z += expf(logits[r * C + c] - m);
  int label = y[rows[r]];
  for (int c = 0; c < C; ++c) d[r * C + c] = (expf(logits[r * C + c] - m) / z - (c == label ? 1.f : 0.f)) * scale / B;
}
__global__ void grad_w(const float* d, const float* x, float* gW, int B, int in, int out) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= in * out) return;
  int o = t / in, i = t % in;
  float s = 0;
  for (int r = 0; r < B; ++r) s += d[r * out + o] * x[r * in + i];
  gW[t] += s;
}
__global__ void grad_b(const float* d, float* gb, int B, int out) {
  int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float s = 0;
  for (int r = 0; r < B; ++r) s += d[r * out + o];
  gb[o] += s;
}
__global__ void grad_x(const float* d, const float* W, const float* act, float* dx, int B, int in, int out) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= B * in) return;
  int r = t / in, i = t % in;
  float s = 0;
  for (int o = 0; o < out; ++o) s += W[o * in + i] * d[r * out + o];
  dx[t] = act[t] > 0.f ? s : 0.f;
}
__global__ void sgd(float* p, const float* g, int n, float lr) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < n) p[t] -= lr * g[t];
}
inline int blocks(long n) { return static_cast<int>((n + 127) / 128); }
}  // namespace k

// The values of the CPU twin's parameters, in parameters() order: GpuMlp's host_values.
inline std::vector<std::vector<float>> split_params(TestMlp<float>& m) {
  std::vector<std::vector<float>> out;
  for (auto& p : m.parameters()) {
    auto v = p.value_as<float>();
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

class GpuMlp {
 public:
  // host_values: the initial parameters in parameters() order (e.g. from TestMlp<float>).
  GpuMlp(std::vector<int> dims, const std::vector<std::vector<float>>& host_values, cudaStream_t s)
      : dims_(std::move(dims)), s_(s) {
    const std::size_t L = dims_.size() - 1;
    for (std::size_t l = 0; l < L; ++l) {
      for (int which = 0; which < 2; ++which) {
        const std::size_t n =
            which == 0 ? static_cast<std::size_t>(dims_[l] * dims_[l + 1]) : static_cast<std::size_t>(dims_[l + 1]);
        float *v = nullptr, *g = nullptr;
        LOCKSTEP_TRY_CUDA(cudaMalloc(&v, n * sizeof(float)));
        LOCKSTEP_TRY_CUDA(cudaMalloc(&g, n * sizeof(float)));
        LOCKSTEP_TRY_CUDA(cudaMemcpy(v, host_values[2 * l + which].data(), n * sizeof(float), cudaMemcpyHostToDevice));
        LOCKSTEP_TRY_CUDA(cudaMemset(g, 0, n * sizeof(float)));
        vals_.push_back(v);
        own_vals_.push_back(v);
        own_grads_.push_back(g);
        grads_.push_back(g);
        sizes_.push_back(n);
      }
    }
    // A cudaMemcpy from pageable memory may return before the data lands, and the compute
    // stream is non-blocking: finish the uploads before any kernel reads them.
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  }
  ~GpuMlp() {
    for (auto p : own_vals_) cudaFree(p);
    for (auto p : own_grads_) cudaFree(p);
  }
  std::vector<lockstep::parameter> parameters() {
    std::vector<lockstep::parameter> ps;
    for (std::size_t l = 0; l + 1 < dims_.size(); ++l) {
      ps.push_back(lockstep::param<float>("layer" + std::to_string(l) + ".weight", vals_[2 * l], grads_[2 * l],
                                          {dims_[l + 1], dims_[l]}));
      ps.push_back(lockstep::param<float>("layer" + std::to_string(l) + ".bias", vals_[2 * l + 1], grads_[2 * l + 1],
                                          {dims_[l + 1]}));
    }
    return ps;
  }
  void bind_gradient(std::size_t i, void* p) { grads_[i] = static_cast<float*>(p); }
  // lockstep::model (d): the gradients back in the model's own storage when DataParallel goes
  // (an elastic job rebuilds it after a change).
  void unbind_gradients() {
    for (std::size_t i = 0; i < grads_.size(); ++i)
      if (grads_[i] != own_grads_[i])
        LOCKSTEP_TRY_CUDA(
            cudaMemcpyAsync(own_grads_[i], grads_[i], sizes_[i] * sizeof(float), cudaMemcpyDeviceToDevice, s_));
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s_));  // before lockstep frees its arena
    grads_ = own_grads_;
  }
  // Sharded (lockstep::model (e)): the values move into lockstep's arena, copied on the stream.
  void bind_value(std::size_t i, void* p) {
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(p, vals_.at(i), sizes_[i] * sizeof(float), cudaMemcpyDeviceToDevice, s_));
    vals_[i] = static_cast<float*>(p);
  }
  // Full sharding (lockstep::model (h), (i)): a block per layer; values and gradients where
  // lockstep has put them (null: not held now).
  std::vector<std::size_t> blocks() const {
    std::vector<std::size_t> b;
    for (std::size_t i = 0; i < vals_.size(); ++i) b.push_back(i / 2);
    return b;
  }
  void attach(std::size_t i, void* v, void* g) {
    vals_.at(i) = static_cast<float*>(v);
    grads_.at(i) = static_cast<float*>(g);
  }
  void unbind_values() {
    for (std::size_t i = 0; i < vals_.size(); ++i) {
      LOCKSTEP_TRY_CUDA(
          cudaMemcpyAsync(own_vals_[i], vals_[i], sizes_[i] * sizeof(float), cudaMemcpyDeviceToDevice, s_));
      vals_[i] = own_vals_[i];
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s_));  // before lockstep frees its arena
  }

  // X: device samples × dims[0]; y: device labels; rows: device row indices (B of them).
  // use(l, forward) is held while layer l computes (full sharding requests its block).
  template <class Hook, class Use = no_blocks>
  void forward_backward(const float* X, const int* y, const int* rows, int B, Hook&& hook, float loss_scale = 1.f,
                        Use&& use = {}) {
    const std::size_t L = dims_.size() - 1;
    std::vector<float*> act(L + 1);
    for (std::size_t l = 0; l <= L; ++l) act[l] = scratch(l, static_cast<std::size_t>(B * dims_[l]));
    k::gather_rows<<<k::blocks(B * dims_[0]), 128, 0, s_>>>(X, rows, act[0], B, dims_[0]);
    LOCKSTEP_CHECK_LAUNCH();
    for (std::size_t l = 0; l < L; ++l) {
      [[maybe_unused]] const auto held = use(l, true);
      k::linear_fwd<<<k::blocks(B * dims_[l + 1]), 128, 0, s_>>>(vals_[2 * l], vals_[2 * l + 1], act[l], act[l + 1], B,
                                                                 dims_[l], dims_[l + 1], l + 1 < L);
      LOCKSTEP_CHECK_LAUNCH();
    }
    float* d = scratch(L + 1, static_cast<std::size_t>(B * dims_[L]));
    k::softmax_ce_grad<<<k::blocks(B), 128, 0, s_>>>(act[L], y, rows, d, B, dims_[L], loss_scale);
    LOCKSTEP_CHECK_LAUNCH();
    for (std::size_t l = L; l-- > 0;) {
      [[maybe_unused]] const auto held = use(l, false);
      const int in = dims_[l], out = dims_[l + 1];
      k::grad_w<<<k::blocks(in * out), 128, 0, s_>>>(d, act[l], grads_[2 * l], B, in, out);
      LOCKSTEP_CHECK_LAUNCH();
      k::grad_b<<<k::blocks(out), 128, 0, s_>>>(d, grads_[2 * l + 1], B, out);
      LOCKSTEP_CHECK_LAUNCH();
      hook(2 * l);
      hook(2 * l + 1);
      if (l > 0) {
        float* dx = scratch(L + 2 + (l % 2), static_cast<std::size_t>(B * in));
        k::grad_x<<<k::blocks(B * in), 128, 0, s_>>>(d, vals_[2 * l], act[l], dx, B, in, out);
        LOCKSTEP_CHECK_LAUNCH();
        d = dx;
      }
    }
  }
  void sgd(float lr) {
    for (std::size_t i = 0; i < vals_.size(); ++i) {
      k::sgd<<<k::blocks(static_cast<long>(sizes_[i])), 128, 0, s_>>>(vals_[i], grads_[i], static_cast<int>(sizes_[i]),
                                                                      lr);
      LOCKSTEP_CHECK_LAUNCH();
    }
  }
  std::vector<float> flat_values() {
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(s_));
    std::vector<float> out;
    for (std::size_t i = 0; i < vals_.size(); ++i) {
      std::vector<float> h(sizes_[i]);
      LOCKSTEP_TRY_CUDA(cudaMemcpy(h.data(), vals_[i], sizes_[i] * sizeof(float), cudaMemcpyDeviceToHost));
      out.insert(out.end(), h.begin(), h.end());
    }
    return out;
  }

 private:
  float* scratch(std::size_t slot, std::size_t n) {
    if (scratch_.size() <= slot) scratch_.resize(slot + 1);
    auto& s = scratch_[slot];
    if (s.second < n) {
      if (s.first) LOCKSTEP_TRY_CUDA(cudaFree(s.first));
      LOCKSTEP_TRY_CUDA(cudaMalloc(&s.first, n * sizeof(float)));
      s.second = n;
    }
    return s.first;
  }
  std::vector<int> dims_;
  cudaStream_t s_;
  std::vector<float*> vals_, grads_, own_vals_, own_grads_;
  std::vector<std::size_t> sizes_;
  std::vector<std::pair<float*, std::size_t>> scratch_;
};

}  // namespace lockstep_test
