// bench_gather: what NCCL's copy-engine all-gather buys (ShardedOptimizer::copy_engine_gather).
// On all visible GPUs, one process: in-place and out-of-place all-gathers and f32/bf16
// reduce-scatters of 154 MB (GPT-2's embedding) and 268 MB, each alone and next to back-to-back
// bf16 GEMMs on another stream (the op's time, and how much it slows the GEMMs), under NCCL's
// default, efficiency and zero-CTA policies, with cudaMalloc buffers and with a symmetric window
// (ncclMemAlloc + ncclCommWindowRegister); and a reduce-scatter done as an all-to-all into a
// staging area plus lockstep's block-sum kernel (what NcclComm's copy-engine group does: with
// the zero-CTA policy and a window, the all-to-all runs on the copy engines). Raw NCCL and
// cuBLAS otherwise: the mechanism, not the library. NCCL >= 2.28. `bench_gather` (PROBE_ONLY=a..e
// runs one configuration).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lockstep/cuda/kernels/wire_ops.cuh"

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)

#define CK(x)                                                           \
  [&] {                                                                 \
    cudaError_t e_ = (x);                                               \
    if (e_ != cudaSuccess) {                                            \
      std::printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                     \
    }                                                                   \
  }()
#define NK(x)                                                           \
  [&] {                                                                 \
    ncclResult_t r_ = (x);                                              \
    if (r_ != ncclSuccess) {                                            \
      std::printf("NCCL %s at %d\n", ncclGetErrorString(r_), __LINE__); \
      std::exit(1);                                                     \
    }                                                                   \
  }()

struct rank_t {
  ncclComm_t comm{};
  cudaStream_t cs{}, ws{};
  void* buf = nullptr;  // symmetric (ncclMemAlloc) or cudaMalloc
  ncclWindow_t win{};
  cublasHandle_t blas{};
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
};

int n = 0;
std::vector<rank_t> R;
const size_t kBytes = 600ull << 20;
const int M = 8192;

void setup(int policy, bool symmetric) {
  ncclUniqueId id;
  NK(ncclGetUniqueId(&id));
  NK(ncclGroupStart());
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(r));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.CTAPolicy = policy;
    NK(ncclCommInitRankConfig(&R[r].comm, n, id, r, &cfg));
  }
  NK(ncclGroupEnd());
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(r));
    if (symmetric) NK(ncclMemAlloc(&R[r].buf, kBytes));
    else CK(cudaMalloc(&R[r].buf, kBytes));
    CK(cudaMemset(R[r].buf, 1, kBytes));
  }
  if (symmetric) {
    NK(ncclGroupStart());
    for (int r = 0; r < n; ++r) {
      CK(cudaSetDevice(r));
      NK(ncclCommWindowRegister(R[r].comm, R[r].buf, kBytes, &R[r].win, NCCL_WIN_COLL_SYMMETRIC));
    }
    NK(ncclGroupEnd());
  }
  for (int r = 0; r < n; ++r) CK(cudaSetDevice(r)), CK(cudaDeviceSynchronize());
}

void teardown(bool symmetric) {
  for (int r = 0; r < n; ++r) CK(cudaSetDevice(r)), CK(cudaDeviceSynchronize());
  if (symmetric) {
    NK(ncclGroupStart());
    for (int r = 0; r < n; ++r) CK(cudaSetDevice(r)), NK(ncclCommWindowDeregister(R[r].comm, R[r].win));
    NK(ncclGroupEnd());
  }
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(r));
    if (symmetric) NK(ncclMemFree(R[r].buf));
    else CK(cudaFree(R[r].buf));
    NK(ncclCommDestroy(R[r].comm));
  }
}

enum op_t { AG_INPLACE, AG_OUT, RS_F32, RS_BF16, RS_A2A_F32, RS_A2A_BF16 };
const char* names[] = {"all-gather in place", "all-gather out of place", "reduce-scatter f32",
                       "reduce-scatter bf16", "all-to-all + sum f32",    "all-to-all + sum bf16"};

void issue(op_t op, size_t bytes) {  // bytes: the full (gathered / scattered) size
  NK(ncclGroupStart());
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(r));
    char* base = static_cast<char*>(R[r].buf);
    if (op == AG_INPLACE) {
      size_t per = bytes / n / 4;
      NK(ncclAllGather(base + r * per * 4, base, per, ncclFloat32, R[r].comm, R[r].cs));
    } else if (op == AG_OUT) {
      size_t per = bytes / n / 4;
      NK(ncclAllGather(base + bytes, base, per, ncclFloat32, R[r].comm, R[r].cs));
    } else if (op == RS_F32) {
      size_t per = bytes / n / 4;
      NK(ncclReduceScatter(base, base + r * per * 4, per, ncclFloat32, ncclSum, R[r].comm, R[r].cs));
    } else if (op == RS_BF16) {
      size_t per = bytes / n / 2;
      NK(ncclReduceScatter(base, base + r * per * 2, per, ncclBfloat16, ncclSum, R[r].comm, R[r].cs));
    } else {  // the blocks to a staging area after the data, then this rank's block summed in place
      const size_t es = op == RS_A2A_F32 ? 4 : 2, per = bytes / n / es;
      NK(ncclAlltoAll(base, base + bytes, per, es == 4 ? ncclFloat32 : ncclBfloat16, R[r].comm, R[r].cs));
    }
  }
  NK(ncclGroupEnd());
  if (op == RS_A2A_F32 || op == RS_A2A_BF16)
    for (int r = 0; r < n; ++r) {
      CK(cudaSetDevice(r));
      char* base = static_cast<char*>(R[r].buf);
      const size_t es = op == RS_A2A_F32 ? 4 : 2, per = bytes / n / es;
      lockstep::cuda::kernels::sum_blocks(base + bytes, es == 2, n, per, 1.0f, base + r * per * es, R[r].cs);
    }
}

void gemms(int k) {
  const float one = 1, zero = 0;
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(r));
    for (int i = 0; i < k; ++i)
      cublasGemmEx(R[r].blas, CUBLAS_OP_N, CUBLAS_OP_N, M, M, M, &one, R[r].a, CUDA_R_16BF, M, R[r].b, CUDA_R_16BF, M,
                   &zero, R[r].c, CUDA_R_16BF, M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
}

struct timer {
  std::vector<cudaEvent_t> e0, e1;
  timer() : e0(n), e1(n) {
    for (int r = 0; r < n; ++r) CK(cudaSetDevice(r)), CK(cudaEventCreate(&e0[r])), CK(cudaEventCreate(&e1[r]));
  }
  void start(bool comm) {
    for (int r = 0; r < n; ++r) CK(cudaSetDevice(r)), CK(cudaEventRecord(e0[r], comm ? R[r].cs : R[r].ws));
  }
  void stop(bool comm) {
    for (int r = 0; r < n; ++r) CK(cudaSetDevice(r)), CK(cudaEventRecord(e1[r], comm ? R[r].cs : R[r].ws));
  }
  float ms() {
    float worst = 0;
    for (int r = 0; r < n; ++r) {
      CK(cudaSetDevice(r));
      CK(cudaEventSynchronize(e1[r]));
      float t;
      CK(cudaEventElapsedTime(&t, e0[r], e1[r]));
      worst = std::max(worst, t);
    }
    return worst;
  }
};

void sync_all() {
  for (int r = 0; r < n; ++r) CK(cudaSetDevice(r)), CK(cudaDeviceSynchronize());
}

void run(const char* label, int policy, bool symmetric) {
  setup(policy, symmetric);
  const int iters = 10, G = 10;
  timer tc, tg;
  std::printf("== %s\n", label);
  // GEMMs alone
  gemms(2);
  sync_all();
  tg.start(false);
  gemms(G);
  tg.stop(false);
  const float g_alone = tg.ms();
  std::printf("  %d bf16 GEMMs %d^3 alone: %.3f ms\n", G, M, g_alone);
  for (op_t op : {AG_INPLACE, AG_OUT, RS_F32, RS_BF16, RS_A2A_F32, RS_A2A_BF16})
    for (size_t mb : {size_t(154), size_t(268)}) {
      const size_t bytes = mb << 20;
      issue(op, bytes);
      sync_all();
      tc.start(true);
      for (int i = 0; i < iters; ++i) issue(op, bytes);
      tc.stop(true);
      const float alone = tc.ms() / iters;
      sync_all();
      tg.start(false);
      tc.start(true);
      gemms(G);
      for (int i = 0; i < iters; ++i) issue(op, bytes);
      tg.stop(false);
      tc.stop(true);
      const float gm = tg.ms(), cm = tc.ms() / iters;
      std::printf(
          "  %-24s %3zu MB: alone %.3f ms (%.0f GB/s algbw) | with GEMMs: op %.3f ms, GEMMs %.3f ms (+%.1f %%)\n",
          names[op], mb, alone, bytes / alone / 1e6, cm, gm, 100.0 * (gm - g_alone) / g_alone);
    }
  teardown(symmetric);
}

int main() {
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("bench_gather: %d GPU(s) visible; needs 2 or more\n", n);
    return 0;
  }
  R.resize(n);
  std::printf("%d GPUs\n", n);
  for (int r = 0; r < n; ++r) {
    CK(cudaSetDevice(r));
    int lo, hi;
    CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    CK(cudaStreamCreateWithPriority(&R[r].cs, cudaStreamNonBlocking, hi));
    CK(cudaStreamCreateWithFlags(&R[r].ws, cudaStreamNonBlocking));
    cublasCreate(&R[r].blas);
    cublasSetStream(R[r].blas, R[r].ws);
    CK(cudaMalloc(&R[r].a, size_t(M) * M * 2));
    CK(cudaMalloc(&R[r].b, size_t(M) * M * 2));
    CK(cudaMalloc(&R[r].c, size_t(M) * M * 2));
    CK(cudaMemset(R[r].a, 0x3c, size_t(M) * M * 2));
    CK(cudaMemset(R[r].b, 0x3c, size_t(M) * M * 2));
  }
  const char* only = std::getenv("PROBE_ONLY");
  if (!only || only[0] == 'a') run("default policy, cudaMalloc buffers", NCCL_CTA_POLICY_DEFAULT, false);
  if (!only || only[0] == 'b') run("default policy, symmetric window", NCCL_CTA_POLICY_DEFAULT, true);
  if (!only || only[0] == 'c') run("efficiency policy, symmetric window", NCCL_CTA_POLICY_EFFICIENCY, true);
  if (!only || only[0] == 'd') run("zero-CTA policy, symmetric window", NCCL_CTA_POLICY_ZERO, true);
  if (!only || only[0] == 'e') run("zero-CTA policy, cudaMalloc buffers", NCCL_CTA_POLICY_ZERO, false);
  return 0;
}

#else
int main() {
  std::printf("bench_gather: needs NCCL >= 2.28 (zero-CTA policy, symmetric windows)\n");
  return 0;
}
#endif
