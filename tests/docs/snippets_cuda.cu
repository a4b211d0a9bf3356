// The CUDA headers' code blocks (verbatim between snippet markers, compared by
// check_snippets.py), compiled only: running them needs GPUs, and the GPU tests
// (tests/cuda) run the same calls. What a block presumes is declared around it.
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <lockstep/cuda.cuh>
#include <lockstep/lockstep.hpp>

#include "lion_rule.hpp"

using Batch = std::span<const std::size_t>;

//! A model whose parameters live on the device (declared only: this file is not linked).
struct GpuModel {
  std::vector<lockstep::parameter> parameters();
  void backward(Batch batch, lockstep::gradient_ready_fn ready);
  void forward_backward(Batch batch, const float* loss_scale, lockstep::gradient_ready_fn ready);
};
using Model = GpuModel;

void fused_optimizer_snippet(lockstep::context<lockstep::NcclComm>& ctx, GpuModel& model, Batch batch) {
  lockstep::DataParallel dp(ctx, model, lockstep::DeviceDynamicScale());
  dp.scaler().attach(dp.comm());
  cudaStream_t stream = ctx.comm().compute_stream();
  // [snippet include/lockstep/cuda/fused_optimizer.cuh#1]
  lockstep::FusedAdamW opt({.lr = 1e-3}, dp.parameters());  // on the rank's device
  const int* found_inf = dp.scaler().device_found_inf();    // DeviceDynamicScale
  auto step = dp.step();
  model.backward(batch, step.on_gradient_ready());
  step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s, stream, found_inf); });
  // or, after finish(): opt.step_all(dp.parameters(), stream, found_inf);
  // [end snippet]
  opt.step_all(dp.parameters(), stream, found_inf);
}

void step_graph_snippet(lockstep::context<lockstep::NcclComm>& ctx, GpuModel& model, Batch batch, int steps) {
  const auto schedule = [](int s) { return 1e-3 / (1 + s); };
  // [snippet docs/graphs.md#1]
  lockstep::DataParallel dp(ctx, model, lockstep::DeviceDynamicScale());  // the scale stays on the device
  dp.scaler().attach(dp.comm());
  lockstep::FusedAdamW opt({.lr = 1e-3}, dp.parameters());
  const int* found_inf = dp.scaler().device_found_inf();
  cudaStream_t stream = ctx.comm().compute_stream();
  lockstep::StepGraph graph(ctx.comm());  // two eager steps, one captured, then replays
  for (int s = 0; s < steps; ++s) {
    opt.set_lr(schedule(s));  // read on the device: the replays follow it
    graph.run([&] {           // the batch lies at fixed device addresses
      auto step = dp.step();
      model.backward(batch, step.on_gradient_ready());
      step.finish([&](std::span<const lockstep::param_slice> sl) { opt.step(sl, stream, found_inf); });
    });
  }
  // [end snippet]
}

void sharded_snippet(lockstep::context<lockstep::NcclComm>& ctx, GpuModel& model, Batch batch) {
  cudaStream_t stream = ctx.comm().compute_stream();
  // [snippet docs/sharding.md#2]
  lockstep::DataParallel dp(ctx, model, lockstep::ShardedOptimizer{}, lockstep::DeviceDynamicScale());
  dp.scaler().attach(dp.comm());
  lockstep::FusedAdamW opt({.lr = 3e-4}, dp.shard_parameters());  // state for the shards only
  const int* found_inf = dp.scaler().device_found_inf();
  auto step = dp.step();
  model.backward(batch, step.on_gradient_ready());
  step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s, stream, found_inf); });
  // [end snippet]
}

void device_dynamic_scale_snippet(lockstep::context<lockstep::NcclComm>& ctx, Model& model,
                                  const std::vector<std::vector<std::size_t>>& my_batches) {
  cudaStream_t stream = ctx.comm().compute_stream();
  // [snippet include/lockstep/cuda/device_dynamic_scale.cuh#1]
  lockstep::DataParallel<Model, lockstep::NcclComm, lockstep::DeviceDynamicScale> dp(ctx, model);
  dp.scaler().attach(dp.comm());  // once: allocates the state on the device
  const float* scale = dp.scaler().device_scale();
  const int* found_inf = dp.scaler().device_found_inf();
  lockstep::FusedAdamW opt({.lr = 1e-3}, dp.parameters());
  for (auto& batch : my_batches) {
    auto step = dp.step();
    model.forward_backward(batch, scale, step.on_gradient_ready());  // its loss kernel reads *scale
    step.finish([&](auto slices) { opt.step(slices, stream, found_inf); });
  }
  // [end snippet]
}

void nccl_comm_snippet() {
  // [snippet include/lockstep/cuda/detail/nccl_communicator.cuh#1]
  std::vector<int> devices{0, 1, 2, 3};
  auto comms = lockstep::NcclComm::create_local(devices);
  // on thread r: auto w = comms[r].all_reduce(g, g, n, lockstep::dtype::f32,
  //                                           lockstep::reduce_op::avg);
  //              w.wait();   // later kernels on comms[r].compute_stream() see the average
  // [end snippet]
  const std::size_t n = 1024;
  float* g = nullptr;
  auto w = comms[0].all_reduce(g, g, n, lockstep::dtype::f32, lockstep::reduce_op::avg);
  w.wait();
}

//! docs/optimizer.md's rule as a fused optimizer: the same rule compiles for the device.
void fused_lion(const std::vector<lockstep::parameter>& params, cudaStream_t stream, const int* found_inf) {
  lockstep::FusedOptimizer<LionRule> opt({.lr = 1e-4}, params);
  opt.step_all(params, stream, found_inf);
}

//! A tensor-parallel model on the device (declared only): its layers all-reduce on the model axis.
struct TpGpuModel {
  TpGpuModel(int part, int parts, lockstep::NcclComm& model_axis);
  std::vector<lockstep::parameter> parameters();
};

void hybrid_snippet() {
  // [snippet docs/hybrid.md#3]
  // one process driving 4 GPUs: 2 replicas × 2 parts (or Processes{} under a launcher)
  lockstep::run(lockstep::Hybrid{.model_parallel = 2, .inner = lockstep::Gpus{}}, [&](auto& mesh) {
    TpGpuModel model(mesh.part(), mesh.parts(), mesh.model);  // its all-reduces on mesh.model
    lockstep::DataParallel dp(mesh.data, model);
  });
  // [end snippet]
  lockstep::run(lockstep::Hybrid{.model_parallel = 2, .inner = lockstep::Processes{}}, [&](auto& mesh) {
    TpGpuModel model(mesh.part(), mesh.parts(), mesh.model);
    lockstep::DataParallel dp(mesh.data, model);
  });
  // Hybrid{} in a CUDA translation unit: the body is instantiated for every mode Auto can pick.
  lockstep::run(lockstep::Hybrid{}, [&](auto& mesh) {
    GpuModel model;
    lockstep::DataParallel dp(mesh.data, model);
    (void)mesh.world().size();
  });
}

//! What docs/elastic.md's loop over processes presumes (declared only).
struct PlainUpdate {
  void update(GpuModel& model) const;
};
Batch batch_for(std::int64_t step, int rank, int ranks);
void share_loop_state(lockstep::NcclComm& comm);

void elastic_processes_snippet(GpuModel& model, const PlainUpdate& optimizer, std::int64_t steps) {
  // [snippet docs/elastic.md#4]
  lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
    lockstep::ElasticGroup group(ctx, {.min_ranks = 1});  // the job's store, lent by run()
    using DP = lockstep::DataParallel<GpuModel, lockstep::NcclComm>;
    std::optional<DP> dp(std::in_place, group.comm(), model);    // rank 0's parameters everywhere
    group.on_change([&](const lockstep::membership_change& c) {  // ranks gone, or joined
      dp.reset();
      dp.emplace(group.comm(), model);                        // a replacement builds the same, in the same order
      if (!c.joined.empty()) share_loop_state(group.comm());  // what is not the model's, from rank 0
    });
    if (group.replacement()) share_loop_state(group.comm());  // as the members do in on_change
    while (group.steps() < steps) {
      const auto batch = batch_for(group.steps(), group.rank(), group.size());
      const auto changed = group.attempt([&] {
        auto step = dp->step();
        model.backward(batch, step.on_gradient_ready());
        if (step.finish()) {
          group.commit();  // the step's collectives completed here; and: does anyone join?
          optimizer.update(model);
        }
      });
      if (changed) continue;  // ranks gone: redo the step; a replacement: this step, for all
    }
  });
  // [end snippet]
}
