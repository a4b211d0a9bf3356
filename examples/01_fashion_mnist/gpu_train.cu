// Example 01 on GPUs: the trainer the shared loop (fashion_mnist.hpp) drives on each GPU
// rank, the --check against the CPU model, and the lockstep::run(Gpus{...}) entry.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <lockstep/core/context.hpp>
#include <lockstep/cuda/deterministic_sum.cuh>
#include <lockstep/cuda/error.cuh>
#include <lockstep/cuda/fused_optimizer.cuh>
#include <lockstep/cuda/memory.cuh>
#include <lockstep/cuda/nccl_comm.cuh>
#include <lockstep/cuda/prefetch.cuh>
#include <lockstep/cuda/run_gpus.cuh>
#include <lockstep/cuda/run_processes.cuh>
#include <lockstep/cuda/step_graph.cuh>
#include <lockstep/data/seeding.hpp>
#include <lockstep/observe/metrics.hpp>
#include <lockstep/optim/sgd.hpp>

#include "fashion_mnist.hpp"
#include "gpu_mlp.cuh"
#include "gpu_train.hpp"
#include "mlp.hpp"

namespace fmnist {

namespace {

constexpr std::size_t eval_rows = 1000;  // test images per forward pass
// A batch of n samples as the host makes it for the device: n × 784 normalised floats, then
// the n labels.
constexpr std::size_t sample_bytes = image_pixels * sizeof(float) + 1;

// A device copy of `count` elements at `src` (blocking).
template <class T>
std::shared_ptr<void> to_device(const lockstep::CudaMemory& mem, const T* src, std::size_t count) {
  auto p = mem.allocate(count * sizeof(T));
  mem.upload(p.get(), src, count * sizeof(T));
  return p;
}

// A split on the device: pixels (size × 784 bytes) and labels, as loaded on the host.
struct device_split {
  std::shared_ptr<void> pixels, labels;
  std::size_t size = 0;
  device_split(const lockstep::CudaMemory& mem, const split& s)
      : pixels(to_device(mem, s.pixels.data(), s.pixels.size())),
        labels(to_device(mem, s.labels.data(), s.labels.size())), size(s.size) {}
  const std::uint8_t* px() const { return static_cast<const std::uint8_t*>(pixels.get()); }
  const std::uint8_t* y() const { return static_cast<const std::uint8_t*>(labels.get()); }
};

// One GPU rank's side of the training loop (see fashion_mnist.hpp): gpu::Mlp, the loss summed
// on the device, lockstep::FusedSgd stepping each bucket as soon as it is averaged, and
// the batches brought in as --input says:
//  - prefetch: a lockstep::Prefetcher gathers each batch on a helper thread into pinned
//    memory (fmnist::gather_into, the CPU path's own gather) and copies it on its copy stream
//    while the previous steps compute; the step makes the compute stream wait for the copy,
//    and nothing synchronises the host;
//  - sync: the step gathers into pageable memory and uploads it (CudaMemory::upload: after
//    the GPU finished everything queued, then a blocking copy) — the loop without prefetch;
//  - device: the training set is copied to the device once; each epoch's indices are
//    uploaded once and a kernel gathers each batch (bit for bit the host's floats).
// The test set stays on the device in every mode (evaluation gathers it with the kernel).
// With a StepGraph (use_graph, --cuda-graph; device input) each full batch's step is one
// graph launch: the batch's indices are copied to a fixed buffer the captured gather reads,
// the learning rate reaches FusedSgd on the device; a last, smaller batch runs eagerly.
class GpuTrainer {
 public:
  GpuTrainer(int device, cudaStream_t stream, const dataset& data, std::uint64_t seed, std::size_t per_rank,
             input_kind input)
      : data_(data), input_(input), per_rank_(per_rank), mem_(device, stream), test_(mem_, data.test),
        table_(to_device(mem_, data.table.data(), data.table.size())), rows_(std::max(per_rank, eval_rows)) {
    fmnist::Mlp host(lockstep::model_seed(seed));  // the CPU model's initial weights
    model_.emplace(host.parameters(), mem_, rows_);
    x_ = mem_.allocate(rows_ * image_pixels * sizeof(float));
    y_ = mem_.allocate(rows_);
    acc_ = mem_.allocate(sizeof(double) + sizeof(unsigned long long));
    switch (input_) {
      case input_kind::device: train_.emplace(mem_, data.train); break;
      case input_kind::sync:
        staged_.resize(per_rank * sample_bytes);
        staged_dev_ = mem_.allocate(staged_.size());
        break;
      case input_kind::prefetch: prefetch_.emplace(device, stream, per_rank * sample_bytes); break;
    }
  }

  gpu::Mlp& model() { return *model_; }

  //! Replays each full step as a CUDA graph from now on (device input only).
  void use_graph(lockstep::NcclComm& comm) {
    if (input_ != input_kind::device)
      throw lockstep::config_error("GpuTrainer: a CUDA graph needs --input device (its batch at a fixed address)");
    step_idx_ = mem_.allocate(per_rank_ * sizeof(int));
    graph_.emplace(comm);
  }

  //! step() for `batch`: a graph replay when it is a full batch and a graph is in use.
  template <class Step>
  void run_step(std::span<const std::size_t> batch, Step&& step) {
    if (!graph_ || batch.size() != per_rank_) {
      if (graph_) ++eager_;
      graph_batch_ = nullptr;
      step();
      return;
    }
    // The captured gather reads the indices at step_idx_: bring this batch's there first.
    const auto at = static_cast<std::size_t>(batch.data() - indices_.data());
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(step_idx_.get(), static_cast<const int*>(idx_.get()) + at,
                                      batch.size() * sizeof(int), cudaMemcpyDeviceToDevice, mem_.stream()));
    graph_batch_ = static_cast<const int*>(step_idx_.get());
    if (!graph_->run(step)) ++eager_;
  }
  //! " | N of M steps as one CUDA graph (...)", or "" without one.
  std::string graph_summary() const {
    if (!graph_) return "";
    char s[200];
    std::snprintf(
        s, sizeof s, " | %llu of %llu steps as one CUDA graph (%zu nodes; %d warm-up and partial steps eager)",
        static_cast<unsigned long long>(graph_->replays()), static_cast<unsigned long long>(graph_->replays() + eager_),
        graph_->nodes(), static_cast<int>(eager_));
    return s;
  }

  void attach(const std::vector<lockstep::parameter>& params, double lr, double momentum) {
    sgd_.emplace(lockstep::SgdOptions{.lr = lr, .momentum = momentum}, params, mem_.device());
  }
  void set_lr(double lr) { sgd_->set_lr(lr); }

  void begin_epoch(std::span<const std::size_t> indices, std::span<const std::span<const std::size_t>> batches) {
    indices_ = indices;
    mem_.zero(loss_acc(), sizeof(double));
    if (input_ == input_kind::device) {
      std::vector<int> host(indices.begin(), indices.end());
      if (host.size() > idx_capacity_) {
        idx_ = mem_.allocate(host.size() * sizeof(int));
        idx_capacity_ = host.size();
      }
      mem_.upload(idx_.get(), host.data(), host.size() * sizeof(int));
    } else if (input_ == input_kind::prefetch) {
      // The producer reads its own copy of the epoch's rows: the sampler's may change or go
      // (an exception unwinding train_rank) while a helper thread still gathers.
      prefetch_->stop();
      rows_of_epoch_.assign(indices.begin(), indices.end());
      batch_at_.clear();
      for (const auto b : batches) batch_at_.push_back({static_cast<std::size_t>(b.data() - indices.data()), b.size()});
      prefetch_->start(batch_at_.size(), [this](std::size_t i, std::span<std::byte> host) {
        const auto [at, n] = batch_at_[i];
        auto* x = reinterpret_cast<float*>(host.data());
        auto* y = reinterpret_cast<std::uint8_t*>(host.data() + n * image_pixels * sizeof(float));
        gather_into(data_.train, std::span<const std::size_t>(rows_of_epoch_).subspan(at, n), data_.table.data(), x, y);
        return n * sample_bytes;
      });
    }
  }

  template <class Hook>
  void forward_backward(std::span<const std::size_t> batch, Hook&& ready) {
    const auto at = batch.data() - indices_.data();
    if (at < 0 || static_cast<std::size_t>(at) + batch.size() > indices_.size())
      throw lockstep::config_error("GpuTrainer: the batch is not a part of this epoch's indices");
    const std::size_t n = batch.size();
    const float* x = this->x();
    const std::uint8_t* y = this->y();
    switch (input_) {
      case input_kind::device: {
        const int* rows = graph_batch_ != nullptr ? graph_batch_ : static_cast<const int*>(idx_.get()) + at;
        gpu::gather_rows(train_->px(), train_->y(), rows, 0, table(), this->x(), this->y(), static_cast<int>(n),
                         mem_.stream());
        break;
      }
      case input_kind::sync: {
        auto* hx = reinterpret_cast<float*>(staged_.data());
        gather_into(data_.train, batch, data_.table.data(), hx, reinterpret_cast<std::uint8_t*>(hx + n * image_pixels));
        mem_.upload(staged_dev_.get(), staged_.data(), n * sample_bytes);  // waits for the GPU, then copies
        x = static_cast<const float*>(staged_dev_.get());
        y = reinterpret_cast<const std::uint8_t*>(x + n * image_pixels);
        break;
      }
      case input_kind::prefetch: {
        const lockstep::prefetched_batch b = prefetch_->next();  // the compute stream waits for its copy
        if (batch_at_[b.index].at != static_cast<std::size_t>(at) || batch_at_[b.index].n != n)
          throw lockstep::config_error("GpuTrainer: batches must be trained in the order begin_epoch() was given");
        x = b.as<const float>();
        y = b.as<const std::uint8_t>(n * image_pixels * sizeof(float));
        break;
      }
    }
    model_->forward_backward(x, y, n, loss_acc(), ready);
  }

  template <class Step>
  void finish(Step& st) {
    // Each bucket is stepped once its average has landed; later buckets may still be in flight.
    st.finish([this](std::span<const lockstep::param_slice> s) { sgd_->step(s, mem_.stream()); });
  }

  double loss_sum() const {
    double v = 0;
    mem_.download(&v, acc_.get(), sizeof v);  // waits for the queued steps
    return v;
  }
  void synchronize() {
    lockstep::detail::device_guard g(mem_.device());
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(mem_.stream()));
  }

  std::size_t count_correct(std::size_t lo, std::size_t hi) {
    mem_.zero(correct_acc(), sizeof(unsigned long long));
    for (std::size_t at = lo; at < hi; at += eval_rows) {
      const std::size_t n = std::min(eval_rows, hi - at);
      gpu::gather_rows(test_.px(), test_.y(), nullptr, at, table(), x(), y(), static_cast<int>(n), mem_.stream());
      model_->count_correct(x(), y(), n, correct_acc());
    }
    unsigned long long c = 0;
    mem_.download(&c, correct_acc(), sizeof c);
    return static_cast<std::size_t>(c);
  }

  //! The optimizer (serializable: it goes into checkpoints as a section).
  lockstep::FusedSgd& optimizer() { return *sgd_; }

  //! How the batches reached the device (the log's "input:" line).
  std::string input_summary() const {
    char s[256];
    switch (input_) {
      case input_kind::prefetch:
        std::snprintf(s, sizeof s,
                      "prefetch (lockstep::Prefetcher, %zu slots of %.0f KiB pinned, 1 helper thread; "
                      "next() waited %.3f s in all)",
                      prefetch_->slots(), static_cast<double>(prefetch_->slot_bytes()) / 1024.0,
                      prefetch_->wait_seconds());
        return s;
      case input_kind::sync: return "sync (gathered and copied within each step)";
      case input_kind::device: return "device (training set on the GPU, batches gathered by a kernel)";
    }
    return "";
  }

 private:
  struct batch_span {
    std::size_t at, n;  // offset into the epoch's indices, and size
  };

  const float* table() const { return static_cast<const float*>(table_.get()); }
  float* x() const { return static_cast<float*>(x_.get()); }
  std::uint8_t* y() const { return static_cast<std::uint8_t*>(y_.get()); }
  double* loss_acc() const { return static_cast<double*>(acc_.get()); }
  unsigned long long* correct_acc() const {
    return reinterpret_cast<unsigned long long*>(static_cast<char*>(acc_.get()) + sizeof(double));
  }

  const dataset& data_;
  input_kind input_;
  std::size_t per_rank_;
  lockstep::CudaMemory mem_;
  std::optional<device_split> train_;  // --input device only
  device_split test_;
  std::shared_ptr<void> table_;
  std::size_t rows_;
  std::optional<gpu::Mlp> model_;
  std::optional<lockstep::FusedSgd> sgd_;
  std::shared_ptr<void> x_, y_, acc_, idx_;
  std::size_t idx_capacity_ = 0;
  std::span<const std::size_t> indices_;
  std::vector<std::byte> staged_;                 // --input sync: the batch on the host ...
  std::shared_ptr<void> staged_dev_;              // ... and on the device
  std::vector<std::size_t> rows_of_epoch_;        // --input prefetch: what the producer reads;
  std::vector<batch_span> batch_at_;              // declared before prefetch_, which outlives
  std::optional<lockstep::Prefetcher> prefetch_;  // neither (its helper threads read them)
  std::shared_ptr<void> step_idx_;                // --cuda-graph: the batch's indices, at a fixed address
  const int* graph_batch_ = nullptr;              // step_idx_ while a graph step runs
  std::optional<lockstep::StepGraph> graph_;      // declared last: destroyed (synchronised) first
  std::size_t eager_ = 0;                         // steps run eagerly while a graph was in use
};

// ‖a − b‖ / ‖b‖ (b: the reference).
double rel_diff(std::span<const float> a, std::span<const float> b) {
  double d = 0, n = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d) / std::max(std::sqrt(n), 1e-30);
}

// Keeps the largest difference and where it was; a NaN sticks (and fails the check).
void track(double& worst, std::string& where, double d, const std::string& name) {
  if (std::isnan(worst)) return;
  if (std::isnan(d) || d > worst || where == "-") {
    worst = d;
    where = name;
  }
}

}  // namespace

bool check_gpu_model(int device, const dataset& data, const options& opt) {
  constexpr double tolerance = 1e-4;
  constexpr int steps = 2;  // the second one uses the momentum buffers the first one made
  lockstep::detail::device_guard g(device);
  gpu::stream_owner stream(device);
  bool ok = true;
  {
    const lockstep::CudaMemory mem(device, stream.s);
    // A batch spread over the training set, gathered on the host and on the device.
    const std::size_t B = std::min<std::size_t>(base_batch, data.train.size);
    std::vector<std::size_t> rows(B);
    for (std::size_t r = 0; r < B; ++r) rows[r] = (r * 7919 + 13) % data.train.size;
    std::vector<float> x;
    std::vector<std::uint8_t> y;
    gather(data.train, rows, data.table.data(), x, y);
    const device_split train(mem, data.train), test(mem, data.test);
    const auto table = to_device(mem, data.table.data(), data.table.size());
    const std::vector<int> rows_i(rows.begin(), rows.end());
    const auto d_rows = to_device(mem, rows_i.data(), rows_i.size());
    const std::size_t n_eval = std::min(eval_rows, data.test.size);
    const std::size_t cap = std::max(B, n_eval);
    const auto d_x = mem.allocate(cap * image_pixels * sizeof(float));
    const auto d_y = mem.allocate(cap);
    const auto d_acc = mem.allocate(sizeof(double) + sizeof(unsigned long long));
    auto* fx = static_cast<float*>(d_x.get());
    auto* fy = static_cast<std::uint8_t*>(d_y.get());
    auto* loss_acc = static_cast<double*>(d_acc.get());
    auto* count_acc = reinterpret_cast<unsigned long long*>(static_cast<char*>(d_acc.get()) + sizeof(double));
    gpu::gather_rows(train.px(), train.y(), static_cast<const int*>(d_rows.get()), 0,
                     static_cast<const float*>(table.get()), fx, fy, static_cast<int>(B), stream.s);
    std::vector<float> gx(x.size());
    std::vector<std::uint8_t> gy(y.size());
    mem.download(gx.data(), fx, gx.size() * sizeof(float));
    mem.download(gy.data(), fy, gy.size());
    const bool inputs_equal = std::memcmp(gx.data(), x.data(), x.size() * sizeof(float)) == 0 && gy == y;

    fmnist::Mlp cpu(lockstep::model_seed(opt.seed));
    gpu::Mlp gm(cpu.parameters(), mem, cap);
    const lockstep::SgdOptions so{.lr = opt.lr, .momentum = opt.momentum};
    lockstep::Sgd cpu_sgd(so);
    lockstep::FusedSgd gpu_sgd(so, gm.parameters(), device);
    double loss_diff = 0, grad_diff = 0, param_diff = 0;
    std::string worst_grad = "-", worst_param = "-";
    std::vector<float> host;
    for (int step = 0; step < steps; ++step) {
      for (auto& p : cpu.parameters()) std::fill_n(static_cast<float*>(p.grad), p.numel(), 0.0f);
      gm.zero_grad();
      mem.zero(loss_acc, sizeof(double));
      const double cpu_loss = cpu.forward_backward(x.data(), y.data(), B, [](std::size_t) {});
      gm.forward_backward(fx, fy, B, loss_acc, [](std::size_t) {});
      double gpu_loss = 0;
      mem.download(&gpu_loss, loss_acc, sizeof gpu_loss);
      gpu_loss /= static_cast<double>(B);
      std::string unused;
      track(loss_diff, unused, std::abs(gpu_loss - cpu_loss) / std::max(std::abs(cpu_loss), 1e-30), "loss");
      const auto cp = cpu.parameters(), gp = gm.parameters();
      for (std::size_t i = 0; i < cp.size(); ++i) {
        host.resize(cp[i].numel());
        mem.download(host.data(), gp[i].grad, host.size() * sizeof(float));
        track(grad_diff, worst_grad, rel_diff(host, cp[i].grad_as<float>()), cp[i].name);
      }
      cpu_sgd.step(cp);
      gpu_sgd.step_all(gp, stream.s);
    }
    const auto cp = cpu.parameters(), gp = gm.parameters();
    for (std::size_t i = 0; i < cp.size(); ++i) {
      host.resize(cp[i].numel());
      mem.download(host.data(), gp[i].value, host.size() * sizeof(float));
      track(param_diff, worst_param, rel_diff(host, cp[i].value_as<float>()), cp[i].name);
    }
    // Predictions on the first test images (after the two steps).
    std::vector<std::size_t> test_rows(n_eval);
    for (std::size_t r = 0; r < n_eval; ++r) test_rows[r] = r;
    gather(data.test, test_rows, data.table.data(), x, y);
    const std::size_t cpu_correct = cpu.count_correct(x.data(), y.data(), n_eval);
    mem.zero(count_acc, sizeof(unsigned long long));
    gpu::gather_rows(test.px(), test.y(), nullptr, 0, static_cast<const float*>(table.get()), fx, fy,
                     static_cast<int>(n_eval), stream.s);
    gm.count_correct(fx, fy, n_eval, count_acc);
    unsigned long long gpu_correct = 0;
    mem.download(&gpu_correct, count_acc, sizeof gpu_correct);
    // A prediction may flip where two logits tie to within rounding; allow 1 in 500.
    const std::size_t flips = gpu_correct > cpu_correct ? gpu_correct - cpu_correct : cpu_correct - gpu_correct;
    const bool eval_ok = flips <= std::max<std::size_t>(1, n_eval / 500);
    ok = inputs_equal && loss_diff <= tolerance && grad_diff <= tolerance && param_diff <= tolerance && eval_ok;
    std::printf("check: GPU %d vs the CPU model, batch %zu, %d SGD steps: inputs %s | loss rel. diff %.2e | "
                "gradients %.2e (worst %s) | parameters %.2e (worst %s) | %zu test images: %llu vs %zu "
                "correct | %s (tolerance %.0e)\n",
                device, B, steps, inputs_equal ? "identical" : "DIFFER", loss_diff, grad_diff, worst_grad.c_str(),
                param_diff, worst_param.c_str(), n_eval, gpu_correct, cpu_correct, ok ? "PASS" : "FAIL", tolerance);
    std::fflush(stdout);
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(stream.s));
  }
  if (!ok) std::fprintf(stderr, "fashion_mnist: error: --check: the GPU model does not match the CPU model\n");
  return ok;
}

void train_on_gpus(const std::vector<int>& devices, const options& opt, const training_plan& plan, const dataset& data,
                   final_result& result) {
  lockstep::run(lockstep::Gpus{devices}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    GpuTrainer trainer(ctx.device(), ctx.comm().compute_stream(), data, opt.seed, plan.per_rank, opt.input);
    if (opt.cuda_graph) trainer.use_graph(ctx.comm());
    train_rank(ctx, trainer, opt, plan, data, result);
  });
}

void train_as_gpu_process(const options& opt, const dataset& data,
                          const std::function<training_plan(const process_rank&)>& start, final_result& result,
                          process_rank& me) {
  // [snippet docs/example_distributed.md#1]
  lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    std::int64_t hosts = ctx.local_rank() == 0 ? 1 : 0;
    lockstep::all_reduce_scalars(ctx.comm(), std::span<std::int64_t>(&hosts, 1), lockstep::reduce_op::sum);
    me = process_rank{ctx.rank(), ctx.size(), static_cast<long long>(hosts), ctx.device()};
    const training_plan plan = start(me);
    GpuTrainer trainer(ctx.device(), ctx.comm().compute_stream(), data, opt.seed, plan.per_rank, opt.input);
    if (opt.cuda_graph) trainer.use_graph(ctx.comm());
    train_rank(ctx, trainer, opt, plan, data, result);
  });
  // [end snippet]
}

}  // namespace fmnist
