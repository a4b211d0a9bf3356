#pragma once
//! lockstep::Bf16Wire on NcclComm (parallel/bucket_hook.hpp has the policy and its contract):
//! an fp32 bucket goes over NCCL in bf16 and is summed in fp32.
//!
//!   comm stream:  to_bf16(bucket → send) · all_to_all(send → recv) · mean_blocks(recv → my
//!                 block, fp32 and bf16) · all_gather(bf16 block → recv) · from_bf16(recv → bucket)
//!
//! Everything runs on the communicator's stream (NcclComm::enqueue between the collectives):
//! the compute stream waits only for the returned work. Bytes per element on the wire:
//! 2·(N−1)/N each way for the all-to-all and the all-gather, half an fp32 ring all-reduce's.
//! A tail the rank count does not divide takes one fp32 all-reduce (exact, the same on every
//! rank); a bucket smaller than the rank count goes whole that way.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/kernels/wire_ops.cuh"
#include "lockstep/cuda/nccl_comm.cuh"
#include "lockstep/parallel/bucket_hook.hpp"

namespace lockstep {

namespace detail {
//! Where the wire's staging lives: on a copy-engine group (ShardedOptimizer's with
//! ShardedOptimizer::copy_engine_scatter) in windows, so that its all-to-all runs on the
//! copy engines; else plain device memory.
struct wire_memory {
  NcclComm& comm;
  std::shared_ptr<void> allocate(std::size_t bytes) const {
#if LOCKSTEP_NCCL_COPY_ENGINE
    if (comm.copy_engines() && comm.size() > 1) return comm.allocate_window(bytes).first;
#endif
    return comm.memory().allocate(bytes);
  }
};
}  // namespace detail

//! data (count fp32, device) ← the mean over ranks, bf16 on the wire, fp32 sum, rounded to bf16.
inline NcclComm::work bf16_wire_all_reduce(NcclComm& comm, wire_staging& st, void* data, std::size_t count) {
  const std::size_t n = static_cast<std::size_t>(comm.size()), per = count / n, main = per * n;
  auto* f = static_cast<float*>(data);
  if (per == 0) return comm.all_reduce(data, data, count, dtype::f32, reduce_op::avg);
  if (main < count)  // the tail, exact; ordered before the rest on the communication stream
    (void)comm.all_reduce(f + main, f + main, count - main, dtype::f32, reduce_op::avg);
  auto* send = static_cast<std::uint16_t*>(st.get(detail::wire_memory{comm}, data, 2 * main * sizeof(std::uint16_t)));
  auto* recv = send + main;
  std::uint16_t* mine = send + static_cast<std::size_t>(comm.rank()) * per;
  (void)comm.enqueue([&](cudaStream_t s) { cuda::kernels::to_bf16(f, send, main, 1.0f, s); });
  (void)comm.all_to_all(send, recv, per, dtype::bf16);
  (void)comm.enqueue([&](cudaStream_t s) { cuda::kernels::mean_blocks(recv, comm.size(), per, nullptr, mine, s); });
  (void)comm.all_gather(mine, recv, per, dtype::bf16);
  return comm.enqueue([&](cudaStream_t s) { cuda::kernels::from_bf16(recv, f, main, s); });
}

//! Block rank() of data (size()·per fp32) ← the fp32 mean over ranks of the bf16-rounded blocks.
inline NcclComm::work bf16_wire_reduce_scatter(NcclComm& comm, wire_staging& st, void* data, void* mine,
                                               std::size_t per) {
  const std::size_t total = per * static_cast<std::size_t>(comm.size());
  auto* send = static_cast<std::uint16_t*>(st.get(detail::wire_memory{comm}, data, 2 * total * sizeof(std::uint16_t)));
  auto* recv = send + total;
  (void)comm.enqueue(
      [&](cudaStream_t s) { cuda::kernels::to_bf16(static_cast<const float*>(data), send, total, 1.0f, s); });
  (void)comm.all_to_all(send, recv, per, dtype::bf16);
  return comm.enqueue([&](cudaStream_t s) {
    cuda::kernels::mean_blocks(recv, comm.size(), per, static_cast<float*>(mine), nullptr, s);
  });
}

}  // namespace lockstep
