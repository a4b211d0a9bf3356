#pragma once
//! lockstep's low-precision wires on NcclComm (parallel/gradient_wire.hpp has the hooks, Bf16Wire and
//! Int8Wire, and the schedule): fp32 buckets go over NCCL encoded and are summed in fp32.
//!
//!   comm stream:  encode(bucket → send, N chunks) · all_to_all(send → recv) · mean(recv → my
//!                 block: fp32, or encoded again) · all_gather(encoded block → recv) ·
//!                 decode(recv → bucket)
//!
//! The gradient wires run everything on the communicator's stream (NcclComm::enqueue between
//! the collectives; the value gather below decodes on the aside stream):
//! the compute stream waits only for the returned work. Bytes per value on the wire: the
//! codec's chunk bytes · (N−1)/N each way for the all-to-all and the all-gather — half an fp32
//! ring all-reduce's with bf16, about a quarter with int8.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/cuda/kernels/int8_ops.cuh"
#include "lockstep/cuda/kernels/wire_ops.cuh"
#include "lockstep/cuda/detail/nccl_communicator.cuh"
#include "lockstep/parallel/gradient_wire.hpp"

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

//! A codec's kernels: `chunks` chunks of n values each, codec-encoded chunk_bytes(n) apart;
//! encode subtracts base's values first when base is not null and, with fb, adds fb's and keeps
//! in fb what it rounded off (error feedback, parallel/detail/wire_feedback.hpp); decode adds to
//! out's with add.
template <class Codec>
struct device_codec;

template <>
struct device_codec<bf16_codec> {
  static void encode(const float* x, int chunks, std::size_t n, void* out, cudaStream_t s, const float* base = nullptr,
                     float* fb = nullptr) {
    cuda::kernels::to_bf16(x, out, static_cast<std::size_t>(chunks) * n, 1.0f, s, base, fb);
  }
  static void mean(const void* in, int ranks, std::size_t n, float* out32, void* out_enc, cudaStream_t s) {
    cuda::kernels::mean_blocks(in, ranks, n, out32, out_enc, s);
  }
  static void decode(const void* in, int chunks, std::size_t n, float* out, cudaStream_t s, bool add = false) {
    cuda::kernels::from_bf16(in, out, static_cast<std::size_t>(chunks) * n, s, add);
  }
  // Never called: a bf16 wire into bf16 values is the plain gather (block_layout's `wired`).
  static void decode_bf16(const void*, int, std::size_t, void*, cudaStream_t) {
    throw config_error("internal: a bf16 gather into bf16 values does not go through the wire");
  }
};

template <>
struct device_codec<int8_codec> {
  static void encode(const float* x, int chunks, std::size_t n, void* out, cudaStream_t s, const float* base = nullptr,
                     float* fb = nullptr) {
    cuda::kernels::int8_encode(x, chunks, n, out, s, base, fb);
  }
  static void mean(const void* in, int ranks, std::size_t n, float* out32, void* out_enc, cudaStream_t s) {
    cuda::kernels::int8_mean(in, ranks, n, out32, out_enc, s);
  }
  static void decode(const void* in, int chunks, std::size_t n, float* out, cudaStream_t s, bool add = false) {
    cuda::kernels::int8_decode(in, chunks, n, out, s, add);
  }
  static void decode_bf16(const void* in, int chunks, std::size_t n, void* out, cudaStream_t s) {
    cuda::kernels::int8_decode_bf16(in, chunks, n, out, s);
  }
};

//! A gather through a wire inside a CUDA graph capture of the compute stream: refused, `why`.
inline void refuse_capture(NcclComm& comm, const char* why) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  LOCKSTEP_TRY_CUDA(cudaStreamIsCapturing(comm.compute_stream(), &capturing));
  if (capturing != cudaStreamCaptureStatusNone) throw config_error(why);
}

//! This rank's fp32 `master` (per values; minus base's when base is not null) encoded into its
//! slot of `all` (size()·chunk_bytes(per), on the device) and all-gathered there in place, on
//! the communication stream: every rank's chunk, rank order.
template <class Codec>
void encode_and_gather(NcclComm& comm, unsigned char* all, const float* master, std::size_t per, const float* base) {
  const std::size_t n = static_cast<std::size_t>(comm.size()), cb = Codec::chunk_bytes(per);
  unsigned char* mine = all + static_cast<std::size_t>(comm.rank()) * cb;
  const device_range gathered{all, n * cb}, read{master, per * sizeof(float)}, from{base ? base : master, read.bytes};
  (void)comm.enqueue({gathered, read, from},
                     [&](cudaStream_t s) { device_codec<Codec>::encode(master, 1, per, mine, s, base); });
  (void)comm.all_gather(mine, all, cb, dtype::u8);
}
}  // namespace detail

//! data (count fp32, device) ← the mean over ranks through Codec's wire: every rank the same values.
//! fb (error feedback, or null): the residuals of the N·per chunks, then of this rank's block of
//! the mean (which then goes into data's block in fp32 first, and is encoded from there).
template <class Codec>
NcclComm::work wire_all_reduce(NcclComm& comm, wire_staging& st, void* data, std::size_t count, Codec,
                               float* fb = nullptr) {
  using dev = detail::device_codec<Codec>;
  const int ranks = comm.size();
  const std::size_t n = static_cast<std::size_t>(ranks), per = count / n, main = per * n;
  auto* f = static_cast<float*>(data);
  if (per == 0) return comm.all_reduce(data, data, count, dtype::f32, reduce_op::avg);
  if (main < count)  // the tail, exact; ordered before the rest on the communication stream
    (void)comm.all_reduce(f + main, f + main, count - main, dtype::f32, reduce_op::avg);
  const std::size_t cb = Codec::chunk_bytes(per);
  auto* send = static_cast<unsigned char*>(st.get(detail::wire_memory{comm}, data, 2 * n * cb));
  auto* recv = send + n * cb;
  unsigned char* mine = send + static_cast<std::size_t>(comm.rank()) * cb;
  float* block = f + static_cast<std::size_t>(comm.rank()) * per;
  (void)comm.enqueue([&](cudaStream_t s) { dev::encode(f, ranks, per, send, s, nullptr, fb); });
  (void)comm.all_to_all(send, recv, cb, dtype::u8);
  (void)comm.enqueue([&](cudaStream_t s) {
    if (!fb) return dev::mean(recv, ranks, per, nullptr, mine, s);
    dev::mean(recv, ranks, per, block, nullptr, s);
    dev::encode(block, 1, per, mine, s, nullptr, fb + main);
  });
  (void)comm.all_gather(mine, recv, cb, dtype::u8);
  return comm.enqueue([&](cudaStream_t s) { dev::decode(recv, ranks, per, f, s); });
}

//! Block rank() of data (size()·per fp32) ← the fp32 mean over ranks of the blocks as Codec's
//! wire carried them (fb: the chunks' residuals, or null).
template <class Codec>
NcclComm::work wire_reduce_scatter(NcclComm& comm, wire_staging& st, void* data, void* mine, std::size_t per, Codec,
                                   float* fb = nullptr) {
  using dev = detail::device_codec<Codec>;
  const int ranks = comm.size();
  const std::size_t n = static_cast<std::size_t>(ranks), cb = Codec::chunk_bytes(per);
  auto* send = static_cast<unsigned char*>(st.get(detail::wire_memory{comm}, data, 2 * n * cb));
  auto* recv = send + n * cb;
  (void)comm.enqueue(
      [&](cudaStream_t s) { dev::encode(static_cast<const float*>(data), ranks, per, send, s, nullptr, fb); });
  (void)comm.all_to_all(send, recv, cb, dtype::u8);
  return comm.enqueue([&](cudaStream_t s) { dev::mean(recv, ranks, per, static_cast<float*>(mine), nullptr, s); });
}

//! ShardedOptimizer::gather_wire's all-gather (parallel/detail/value_wire.hpp): unit (size()·per
//! fp32, rank r's block its replica of rank r's master) ← every rank's master as Codec's wire
//! carries it — encoded on the communication stream (deltas: master − this rank's block),
//! all-gathered as bytes, and every block decoded (deltas: added to the replica) on the aside
//! stream (NcclComm::enqueue_aside), so that the next unit's encode and gather need not wait for
//! this decode: with the gathers in the forward, the decode of unit u overlaps the transfer of
//! u + 1 (bench/RESULTS.md, session 33: the MLP step over NVLink 0.22–0.26 ms faster). Each
//! unit has staging of its own (wire_staging, by the unit's address).
template <class Codec>
NcclComm::work wire_value_gather(NcclComm& comm, wire_staging& st, const float* master, float* unit, std::size_t per,
                                 bool deltas, Codec) {
  using dev = detail::device_codec<Codec>;
  detail::refuse_capture(comm,  // replays would leave values_exact stale
                         "ShardedOptimizer::gather_wire in a CUDA graph capture (StepGraph) is not supported: the "
                         "host could not tell when replays left the values rounded; capture with gather_wire = fp32");
  const int ranks = comm.size();
  const std::size_t n = static_cast<std::size_t>(ranks), cb = Codec::chunk_bytes(per);
  auto* all = static_cast<unsigned char*>(st.get(detail::wire_memory{comm}, unit, n * cb));
  detail::encode_and_gather<Codec>(comm, all, master, per,
                                   deltas ? unit + static_cast<std::size_t>(comm.rank()) * per : nullptr);
  const device_range gathered{all, n * cb}, values{unit, n * per * sizeof(float)};
  return comm.enqueue_aside({gathered, values}, [&](cudaStream_t s) { dev::decode(all, ranks, per, unit, s, deltas); });
}

//! FullySharded::gather_wire's all-gather (parallel/detail/value_wire.hpp): `to` (size()·per
//! values of type t, f32 or bf16: a block buffer lent to the model) ← every rank's fp32 shard
//! `master` as Codec's wire carries it, decoded (bf16: each decoded value rounded to nearest).
//! `staging` (size()·chunk_bytes(per) bytes, 16-byte aligned) holds the chunks until the decode,
//! which runs on the aside stream as gather_wire's does (the work returned covers it).
template <class Codec>
NcclComm::work wire_block_gather(NcclComm& comm, void* staging, const float* master, std::size_t per, void* to, dtype t,
                                 Codec) {
  using dev = detail::device_codec<Codec>;
  detail::refuse_capture(comm,  // replays would write buffers the host has since given to other uses
                         "FullySharded::gather_wire in a CUDA graph capture is not supported: its staging buffers are "
                         "pooled (or the model's allocator's) and reused by the host between replays; capture with "
                         "gather_wire = fp32");
  const int ranks = comm.size();
  const std::size_t n = static_cast<std::size_t>(ranks), cb = Codec::chunk_bytes(per);
  auto* all = static_cast<unsigned char*>(staging);
  detail::encode_and_gather<Codec>(comm, all, master, per, nullptr);
  const device_range gathered{all, n * cb}, values{to, n * per * size_of(t)};
  return comm.enqueue_aside({gathered, values}, [&](cudaStream_t s) {
    if (t == dtype::bf16) dev::decode_bf16(all, ranks, per, to, s);
    else dev::decode(all, ranks, per, static_cast<float*>(to), s);
  });
}

}  // namespace lockstep
