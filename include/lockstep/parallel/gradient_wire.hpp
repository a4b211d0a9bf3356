#pragma once
//! Low-precision wires: bucket hooks (parallel/bucket_hook.hpp) that send fp32 gradients in
//! fewer bytes and sum them in fp32, never in the wire's precision.
//!
//! Both run the same schedule, with a codec that says how values are written for the wire:
//! every rank encodes its bucket as N chunks (chunk k: the k-th N-th of the bucket), an
//! all-to-all gives rank k every rank's chunk k, and rank k decodes them and sums them in fp32
//! in rank order (the same order on every rank), times 1/N: its block of the mean, in fp32 — a
//! reduce-scatter (ShardedOptimizer's buckets) stops there. An all-reduce encodes that mean
//! again and all-gathers it, and every rank — its own block included — decodes what went over
//! the wire, so all ranks hold the same values. A tail the rank count does not divide takes one
//! exact fp32 all-reduce; a bucket smaller than the rank count goes whole that way. Other
//! element types than fp32 (and one rank) take the plain collective.
//!  - Bf16Wire: bf16, round to nearest even: 2 bytes per value (half of fp32).
//!  - Int8Wire: blockwise int8 (core/detail/int8_blocks.hpp): an fp32 scale per 256 values, a
//!    byte per value — 1.016 bytes per value (about a quarter of fp32).
//!  - On NcclComm (include lockstep/cuda.cuh, cuda/nccl_wire.cuh): the codec's kernels run on the
//!    communication stream between the collectives, so the compute stream is not held; staging
//!    costs twice the encoded bucket.
//!  - On host communicators (ThreadComm, MpiComm) the same numbers, bit for bit (but for the
//!    tails: each communicator's own fp32 mean), for tests and CPU ranks: every rank's encoded
//!    bucket is all-gathered whole — the numbers of the wire, not its bytes, at N times the
//!    memory and traffic of the bucket per rank.
//!  - Bit for bit also assumes the device code keeps subnormals: a translation unit compiled with
//!    --use_fast_math (flush to zero) differs from the host on blocks of subnormal values.
//!  - The fp32 sum comes before the 1/N: finite gradients whose sum overflows fp32 become inf (a
//!    skipped step with loss scaling), as in an fp32 all-reduce that sums first.
//!  - Error feedback (WireOptions::error_feedback, parallel/detail/wire_feedback.hpp): what the
//!    wire rounded off a rank's gradients is added to its next step's before they are encoded,
//!    at 4 bytes per gradient value of memory per rank (plus 4 per value of its block of an
//!    all-reduce's mean); off by default.
//! \code
//!   lockstep::DataParallel dp(ctx, model, lockstep::Int8Wire{});
//! \endcode
//! With error feedback:
//! \code
//!   lockstep::DataParallel dp(ctx, model, lockstep::Int8Wire({.error_feedback = true}));
//! \endcode

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/detail/half.hpp"
#include "lockstep/core/detail/int8_blocks.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/parallel/detail/wire_feedback.hpp"
#include "lockstep/parallel/wire_format.hpp"

namespace lockstep {

//! How a low-precision gradient wire sends (Bf16Wire, Int8Wire, AnyWire).
struct WireOptions {
  bool on = true;  //!< false: the plain fp32 all-reduce (to choose the wire at run time with one type)
  //! Carry what the wire rounds off each rank's gradients into its next step's (error feedback:
  //! parallel/detail/wire_feedback.hpp). Costs 4 bytes per gradient value per rank, a pass over
  //! it per step; checkpoints keep it with gather_wire_feedback (checkpoint/wire_feedback.hpp).
  bool error_feedback = false;
};

//! Staging buffers of a low-precision wire, one per bucket (keyed by the bucket's address,
//! which stays put from step to step), allocated once in the communicator's memory space.
class wire_staging {
 public:
  template <class Memory>
  void* get(const Memory& mem, const void* key, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    auto& slot = bufs_[key];
    if (slot.first < bytes) slot = {bytes, mem.allocate(bytes)};
    return slot.second.get();
  }
  //! Bytes held (for the memory report).
  std::size_t bytes() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& [k, v] : bufs_) n += v.first;
    return n;
  }

 private:
  mutable std::mutex mutex_;
  std::map<const void*, std::pair<std::size_t, std::shared_ptr<void>>> bufs_;
};

namespace detail {

//! A wire's codec: chunk_bytes(n), the bytes n values take; encode(x, n, out) and decode(in, n,
//! out) on the host. cuda/nccl_wire.cuh has each codec's kernels.
struct bf16_codec {
  static constexpr std::size_t chunk_bytes(std::size_t n) noexcept { return 2 * n; }
  static void encode(const float* x, std::size_t n, unsigned char* out) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t b = bf16_of_float(x[i]);
      std::memcpy(out + 2 * i, &b, sizeof b);
    }
  }
  static void decode(const unsigned char* in, std::size_t n, float* out) {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t b;
      std::memcpy(&b, in + 2 * i, sizeof b);
      out[i] = float_of_bf16(b);
    }
  }
};

struct int8_codec {
  static constexpr std::size_t chunk_bytes(std::size_t n) noexcept { return int8_chunk_bytes(n); }
  static void encode(const float* x, std::size_t n, unsigned char* out) { int8_encode(x, n, out); }
  static void decode(const unsigned char* in, std::size_t n, float* out) { int8_decode(in, n, out); }
};

//! mine[0, per) ← (Σ_r decode(rank r's chunk rank()) in fp32, rank order) · (1/N), for the
//! bucket x of N·per values on every rank; host communicators (the chunks all-gathered whole).
//! mine may be x's own block: it is written after x was read.
//! With fb (N·per residuals, wire_feedback.hpp) each chunk goes with its residual added.
template <class Codec, class Comm>
void host_wire_mean(Comm& comm, const float* x, std::size_t per, float* mine, float* fb = nullptr) {
  const std::size_t n = static_cast<std::size_t>(comm.size()), cb = Codec::chunk_bytes(per);
  std::vector<unsigned char> enc(n * cb), all(n * n * cb);
  for (std::size_t k = 0; k < n; ++k)
    host_encode<Codec>(x + k * per, per, enc.data() + k * cb, fb ? fb + k * per : nullptr);
  comm.all_gather(enc.data(), all.data(), n * cb, dtype::u8).wait();
  std::vector<float> acc(per, 0.0f), v(per);
  for (std::size_t r = 0; r < n; ++r) {
    Codec::decode(all.data() + (r * n + static_cast<std::size_t>(comm.rank())) * cb, per, v.data());
    for (std::size_t i = 0; i < per; ++i) acc[i] = acc[i] + v[i];
  }
  const float inv = 1.0f / static_cast<float>(n);
  for (std::size_t i = 0; i < per; ++i) mine[i] = acc[i] * inv;
}

//! unit (size()·per fp32; block r rank r's) ← every rank's `master` through Codec's wire, on
//! host communicators: deltas, each block plus the decoded master − block (ShardedOptimizer::
//! gather_wire, parallel/detail/value_wire.hpp); else the decoded master (the all-reduce's
//! second half, with fb: the residual of this rank's block, wire_feedback.hpp). master may be
//! this rank's block of unit: it is read before unit is written.
template <class Codec, class Comm>
void host_value_gather(Comm& comm, const float* master, float* unit, std::size_t per, bool deltas,
                       float* fb = nullptr) {
  const std::size_t n = static_cast<std::size_t>(comm.size()), cb = Codec::chunk_bytes(per);
  const float* own = unit + static_cast<std::size_t>(comm.rank()) * per;
  std::vector<float> x(per), v(per);
  for (std::size_t i = 0; i < per; ++i) x[i] = deltas ? master[i] - own[i] : master[i];
  std::vector<unsigned char> mine(cb), all(n * cb);
  host_encode<Codec>(x.data(), per, mine.data(), fb);
  comm.all_gather(mine.data(), all.data(), cb, dtype::u8).wait();
  for (std::size_t k = 0; k < n; ++k) {
    Codec::decode(all.data() + k * cb, per, v.data());
    float* block = unit + k * per;
    for (std::size_t i = 0; i < per; ++i) block[i] = deltas ? block[i] + v[i] : v[i];
  }
}

//! The wires' hook (Bf16Wire, Int8Wire): the schedule above with Codec.
template <class Codec>
class basic_wire {
 public:
  basic_wire() = default;
  //! on = false: the plain fp32 all-reduce, for choosing the wire at run time (a flag) without
  //! a second DataParallel type.
  explicit basic_wire(bool on) : basic_wire(WireOptions{.on = on}) {}
  explicit basic_wire(WireOptions o) : on_(o.on), feedback_(o.error_feedback) {}
  bool on() const noexcept { return on_; }
  bool error_feedback() const noexcept { return feedback_; }

  template <communicator Comm>
  auto reduce(Comm& comm, void* data, std::size_t count, dtype t) {
    using work_t = decltype(comm.all_reduce(data, data, count, t, reduce_op::avg));
    if (!on_ || t != dtype::f32 || comm.size() == 1) return comm.all_reduce(data, data, count, t, reduce_op::avg);
    const std::size_t n = static_cast<std::size_t>(comm.size()), per = count / n, main = per * n;
    if (per == 0) return comm.all_reduce(data, data, count, t, reduce_op::avg);
    float* fb = residual(comm, data, main + per);  // the chunks', then this rank's block of the mean's
    if constexpr (requires { wire_all_reduce(comm, *staging_, data, count, Codec{}, fb); }) {
      return wire_all_reduce(comm, *staging_, data, count, Codec{}, fb);
    } else {
      host_only(comm);
      auto* f = static_cast<float*>(data);
      if (main < count) comm.all_reduce(f + main, f + main, count - main, t, reduce_op::avg).wait();
      float* mean = f + static_cast<std::size_t>(comm.rank()) * per;
      host_wire_mean<Codec>(comm, f, per, mean, fb);
      host_value_gather<Codec>(comm, mean, f, per, false, fb ? fb + main : nullptr);  // every rank's mean as sent
      return work_t{};
    }
  }

  //! Block rank() of data (size()·per elements) ← the fp32 mean over ranks of the blocks as
  //! they went over the wire; mine points at that block. key names the bucket for its error
  //! feedback residual when data's address does not (pooled buffers); null: data.
  template <communicator Comm>
  auto reduce_scatter(Comm& comm, void* data, void* mine, std::size_t per, dtype t, const void* key = nullptr) {
    using work_t = decltype(comm.reduce_scatter(data, mine, per, t, reduce_op::avg));
    if (!on_ || t != dtype::f32 || comm.size() == 1) return comm.reduce_scatter(data, mine, per, t, reduce_op::avg);
    float* fb = residual(comm, key ? key : data, per * static_cast<std::size_t>(comm.size()));
    if constexpr (requires { wire_reduce_scatter(comm, *staging_, data, mine, per, Codec{}, fb); }) {
      return wire_reduce_scatter(comm, *staging_, data, mine, per, Codec{}, fb);
    } else {
      host_only(comm);
      host_wire_mean<Codec>(comm, static_cast<const float*>(data), per, static_cast<float*>(mine), fb);
      return work_t{};
    }
  }

  //! Staging bytes held on this rank (and error feedback's residuals).
  std::size_t staging_bytes() const { return staging_->bytes() + residuals_->bytes(); }

  //! DataParallel's call when the gradient layout is going away (hook_layout_changed): the
  //! residuals are dropped.
  void layout_changed() { residuals_->clear(); }
  //! This rank's error feedback residuals, as bytes (checkpoint/wire_feedback.hpp; every rank's
  //! differ). Call between steps.
  template <communicator Comm>
  std::string save_feedback(Comm& comm) const {
    return residuals_->save(comm.memory());
  }
  //! Residuals save_feedback wrote, taken by the buckets in the order they were saved.
  void load_feedback(std::span<const std::byte> bytes) { residuals_->load(bytes); }

 private:
  template <class Comm>
  static void host_only(Comm& comm) {
    static_assert(
        !requires { comm.comm_stream(); },
        "lockstep's low-precision wires on a device communicator: include lockstep/cuda.cuh (their kernels)");
  }
  template <class Comm>
  float* residual(Comm& comm, const void* key, std::size_t count) {
    return feedback_ ? residuals_->get(comm.memory(), key, count) : nullptr;
  }
  std::shared_ptr<wire_staging> staging_ = std::make_shared<wire_staging>();
  own_residuals residuals_;
  bool on_ = true, feedback_ = false;
};

}  // namespace detail

//! Gradients in bf16 on the wire, summed in fp32: half the bytes of an fp32 all-reduce; every
//! rank ends with the same bf16-rounded mean (with ShardedOptimizer: the shard's mean in fp32).
class Bf16Wire : public detail::basic_wire<detail::bf16_codec> {
 public:
  using basic_wire::basic_wire;
};

//! Gradients as blockwise int8 on the wire (an fp32 scale per 256 values), summed in fp32:
//! about a quarter of the bytes of an fp32 all-reduce. Each value reads back within half a
//! step of its block's scale (max|x| / 127) — coarse for a block whose values span several
//! orders of magnitude; every rank ends with the same values (with ShardedOptimizer: the
//! shard's mean in fp32, as it came out of the fp32 sum).
class Int8Wire : public detail::basic_wire<detail::int8_codec> {
 public:
  using basic_wire::basic_wire;
};

//! One of the wires, chosen at run time — the plain fp32 all-reduce (AllReduceMean), Bf16Wire
//! or Int8Wire — with one DataParallel type for all three (name the type, Bf16Wire or Int8Wire,
//! where the choice is made at compile time).
//! \code
//!   lockstep::DataParallel dp(ctx, model, lockstep::AnyWire(lockstep::wire_format_of(flag)));
//! \endcode
class AnyWire {
 public:
  AnyWire() = default;
  //! o.on is ignored (fp32 is the plain all-reduce); o.error_feedback applies to bf16 and int8.
  explicit AnyWire(wire_format f, WireOptions o = {}) : format_(f), bf16_(with_on(o)), int8_(with_on(o)) {}
  wire_format format() const noexcept { return format_; }
  bool error_feedback() const noexcept { return bf16_.error_feedback(); }

  template <communicator Comm>
  auto reduce(Comm& comm, void* data, std::size_t count, dtype t) {
    if (format_ == wire_format::bf16) return bf16_.reduce(comm, data, count, t);
    if (format_ == wire_format::int8) return int8_.reduce(comm, data, count, t);
    return comm.all_reduce(data, data, count, t, reduce_op::avg);
  }
  template <communicator Comm>
  auto reduce_scatter(Comm& comm, void* data, void* mine, std::size_t per, dtype t, const void* key = nullptr) {
    if (format_ == wire_format::bf16) return bf16_.reduce_scatter(comm, data, mine, per, t, key);
    if (format_ == wire_format::int8) return int8_.reduce_scatter(comm, data, mine, per, t, key);
    return comm.reduce_scatter(data, mine, per, t, reduce_op::avg);
  }
  std::size_t staging_bytes() const { return bf16_.staging_bytes() + int8_.staging_bytes(); }

  void layout_changed() {
    bf16_.layout_changed();
    int8_.layout_changed();
  }
  //! The chosen wire's residuals (an empty state for fp32).
  template <communicator Comm>
  std::string save_feedback(Comm& comm) const {
    return format_ == wire_format::int8 ? int8_.save_feedback(comm) : bf16_.save_feedback(comm);
  }
  void load_feedback(std::span<const std::byte> bytes) {
    if (format_ == wire_format::int8) int8_.load_feedback(bytes);
    else bf16_.load_feedback(bytes);
  }

 private:
  static WireOptions with_on(WireOptions o) {
    o.on = true;
    return o;
  }
  wire_format format_ = wire_format::fp32;
  Bf16Wire bf16_;
  Int8Wire int8_;
};

}  // namespace lockstep
