#pragma once
//! The concepts a user's type must satisfy. Each lists its numbered requirements;
//! strategies check them with static_asserts whose messages name the missing piece.

#include <concepts>
#include <cstddef>
#include <memory>
#include <ranges>
#include <span>
#include <type_traits>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

//! A contiguous run of `count` elements at `ptr` (host or device memory).
struct segment {
  void* ptr = nullptr;
  std::size_t count = 0;
};

// ---------------------------------------------------------------------------------------
//! lockstep::model — a network whose parameters lockstep keeps in step across ranks.
//!
//! Requirements:
//!  1. `m.parameters()` returns a range of `lockstep::parameter` (value + gradient views,
//!     name, shape, element type). The order, shapes and types must be the same on every
//!     rank; lockstep checks this at construction and names the first difference.
//!  2. The model's backward *adds* into the gradient buffers (as autograd does): lockstep
//!     zeroes them at the start of each accumulation cycle.
//! Optional:
//!  (a) `m.bind_gradient(i, void* storage)`: lockstep gives parameter i a gradient buffer
//!      inside its contiguous arena (zero copy, no pack/unpack); afterwards
//!      `parameters()[i].grad` must be `storage`. Called once per parameter, when the bucket
//!      layout is final (at construction, or at the start of the second accumulation cycle
//!      when the first step's arrival order decides it), so storage the model caches from it
//!      stays valid. Checked by `gradient_binding_model`.
//!  (b) Overlap: backward calls `step.on_gradient_ready()(i)` when gradient i is final, so
//!      each bucket is reduced as soon as its last gradient arrives. The hook's type is
//!      `lockstep::gradient_ready_fn`, the same for every DataParallel. A model that never
//!      calls it still works; its buckets are reduced in `finish()`.
//!  (c) `m.buffers()`: a range of `lockstep::parameter` (grad null) for state that is not
//!      trained but must match across ranks (BatchNorm statistics); DataParallel broadcasts
//!      rank 0's at construction and, on request, every cycle. Checked by `buffer_model`.
//!  (d) `m.unbind_gradients()`: with (a), the model takes its gradients back into storage of
//!      its own; DataParallel calls it when it is destroyed, before the arena is freed.
//!  (e) `m.bind_value(i, void* storage)`: with ShardedOptimizer, lockstep gives parameter i
//!      storage for its values inside the arena its shards are all-gathered into; the model
//!      copies its current values there (stream-ordered on the compute stream for device
//!      memory) and uses that storage from then on (`parameters()[i].value == storage`), so
//!      the all-gather lands in the parameters themselves: no pack before the optimizer, no
//!      unpack after the gather. Called once per parameter, at construction, with (a)'s
//!      zero_copy switch. Checked by `value_binding_model`.
//!  (f) `m.unbind_values()`: with (e), the model copies its values back into storage of its
//!      own; DataParallel calls it when it is destroyed, before the arena is freed.
//!  (g) `m.frozen()`: a range of `lockstep::parameter` (grad null) for parameters that are
//!      not trained (libtorch's requires_grad == false: a frozen embedding, a LoRA base):
//!      never reduced, but like trained ones checked across ranks (names, shapes, types) and
//!      given rank 0's values at construction — PyTorch DDP broadcasts them too. Checked by
//!      `frozen_model`.
//!  (h) `m.blocks()`: with ShardedGradients / FullySharded, a range of integers, one per
//!      parameter: the block it belongs to (0, 1, … in forward order; a transformer block, an
//!      embedding). A block is the unit that is gathered and reduce-scattered at once; its
//!      parameters are used together. Without it the whole model is block 0. Checked by
//!      `block_model`.
//!  (i) `m.attach(i, void* value, void* grad)`: with ShardedGradients / FullySharded,
//!      parameter i's values are at `value` and its gradient at `grad` from now on — no copy:
//!      lockstep has put them there. Either may be null: not held now, the model must not
//!      touch it. lockstep calls it around every use of the parameter's block (so the pointers
//!      change from use to use: read them after DataParallel::use_block, never cache them);
//!      at construction it takes the values over (the model may then free its own storage),
//!      and when DataParallel is destroyed it attaches them whole once more and calls (f)
//!      unbind_values if the model has it. Checked by `attaching_model`.
//!      `m.attach(i, value, grad, lockstep::dtype t)`, where the model has it, is called
//!      instead and names the element type of both: FullySharded::param_dtype hands fp32
//!      parameters over in bf16 during their block's use (and in fp32 when gathered whole by
//!      wait_all_parameters). Required for param_dtype; checked by `typed_attaching_model`.
//!      `m.storage_released()`, where the model has it, is called once at construction after
//!      the values moved into lockstep's shards and every parameter was detached, before the
//!      gradient shards are allocated: a model whose allocator keeps freed memory gives it back
//!      there (TorchModule empties libtorch's CUDA cache), so building needs room for the whole
//!      model and the value shards, never the gradient shards too; and again whenever a block
//!      buffer cannot be allocated, before lockstep tries once more.
//!      `m.block_storage(std::size_t bytes)`, where the model has it, returns storage for a
//!      block buffer from the model's own allocator as a `std::shared_ptr<void>` (or null:
//!      lockstep allocates it): lockstep then drops a buffer when its use ends instead of
//!      pooling it, so the framework reuses that memory for activations between uses, as
//!      FSDP2's all-gather and reduce-scatter buffers share PyTorch's caching allocator. The
//!      memory is used on the communicator's compute stream and released after the last
//!      collective on it was waited for (TorchModule allocates with at::empty: make lockstep's
//!      compute stream libtorch's current one).
//!
//! Example:
//! \code
//!   struct Linear {
//!     std::vector<float> w, gw;
//!     std::vector<lockstep::parameter> parameters() {
//!       return {lockstep::param<float>("w", std::span(w), std::span(gw))};
//!     }
//!   };
//! \endcode
template <class M>
concept model_has_parameters = requires(M& m) {
  { m.parameters() } -> std::ranges::input_range;
  requires std::convertible_to<std::ranges::range_value_t<decltype(m.parameters())>, parameter>;
};

template <class M>
concept model = model_has_parameters<M>;

template <class M>
concept gradient_binding_model = model<M> && requires(M& m, std::size_t i, void* p) { m.bind_gradient(i, p); };

template <class M>
concept buffer_model = model<M> && requires(M& m) {
  { m.buffers() } -> std::ranges::input_range;
  requires std::convertible_to<std::ranges::range_value_t<decltype(m.buffers())>, parameter>;
};

template <class M>
concept frozen_model = model<M> && requires(M& m) {
  { m.frozen() } -> std::ranges::input_range;
  requires std::convertible_to<std::ranges::range_value_t<decltype(m.frozen())>, parameter>;
};

template <class M>
concept gradient_unbinding_model = gradient_binding_model<M> && requires(M& m) { m.unbind_gradients(); };

template <class M>
concept value_binding_model = model<M> && requires(M& m, std::size_t i, void* p) {
  m.bind_value(i, p);
  m.unbind_values();
};

template <class M>
concept block_model = model<M> && requires(M& m) {
  { m.blocks() } -> std::ranges::input_range;
  requires std::convertible_to<std::ranges::range_value_t<decltype(m.blocks())>, std::size_t>;
};

template <class M>
concept attaching_model = model<M> && requires(M& m, std::size_t i, void* p) { m.attach(i, p, p); };
template <class M>
concept typed_attaching_model = model<M> && requires(M& m, std::size_t i, void* p, dtype t) { m.attach(i, p, p, t); };

// ---------------------------------------------------------------------------------------
//! lockstep::work — a handle to a collective that may still be in flight.
//!  1. `w.wait()` returns once the result is in the receive buffer (for device
//!     communicators: once it is ordered before later work on the compute stream).
template <class W>
concept work = std::movable<W> && requires(W& w) { w.wait(); };

//! A handle for a collective that completed before it was returned.
struct ready_work {
  void wait() noexcept {}
};

// ---------------------------------------------------------------------------------------
//! lockstep::memory_ops — how a communicator's memory space is touched (host loops,
//! CUDA kernels on a stream). Counts are elements of `t`, except where named bytes.
//!  1. `allocate(bytes)` → a `std::shared_ptr<void>` owning zero-initialised memory.
//!  2. `upload(dst, src, bytes)` / `download(dst, src, bytes)`: host ⇄ memory space, blocking.
//!  3. `zero(ptr, bytes)`.
//!  4. `pack(span<const segment> src, dst, t, scale)`: dst ← concat(src) · scale.
//!  5. `unpack(src, span<const segment> dst, t)`: scatter contiguous src into dst.
//!  6. `scale(ptr, count, t, factor)`.
//! Optional: `add(dst, src, count, t)`: dst ← dst + src (ShardedGradients and FullySharded
//! accumulate each micro-step's reduced gradient shard with it; `memory_ops_with_add`).
//! Optional: `convert(dst, dst_t, src, src_t, count)`: dst ← src rounded to dst_t (nearest
//! even), at least between f32 and bf16 (FullySharded::param_dtype; `memory_ops_with_convert`).
template <class O>
concept memory_ops =
    requires(O& o, void* p, const void* cp, std::size_t n, dtype t, double s, std::span<const segment> segs) {
      { o.allocate(n) } -> std::convertible_to<std::shared_ptr<void>>;
      o.upload(p, cp, n);
      o.download(p, cp, n);
      o.zero(p, n);
      o.pack(segs, p, t, s);
      o.unpack(cp, segs, t);
      o.scale(p, n, t, s);
    };

template <class O>
concept memory_ops_with_add =
    memory_ops<O> && requires(O& o, void* p, const void* cp, std::size_t n, dtype t) { o.add(p, cp, n, t); };
template <class O>
concept memory_ops_with_convert =
    memory_ops<O> && requires(O& o, void* p, const void* cp, std::size_t n, dtype t) { o.convert(p, t, cp, t, n); };

// ---------------------------------------------------------------------------------------
//! lockstep::communicator — how bytes move between the ranks of one job.
//!
//! Requirements (counts are elements of `t`; buffers live in the memory space):
//!  1. `c.rank()`, `c.size()`: this rank and the number of ranks.
//!  2. `c.all_reduce(send, recv, count, t, op)` → work; send may equal recv (in place).
//!  3. `c.broadcast(buf, count, t, root)` → work.
//!  4. `c.all_gather(send, recv, count, t)` → work; recv holds size()·count elements,
//!     rank r's block at r·count.
//!  5. `c.reduce_scatter(send, recv, count, t, op)` → work; send holds size()·count
//!     elements, rank r receives the reduction of every rank's block r.
//!  6. `c.barrier()`.
//!  7. `c.memory()` → memory_ops for the buffers it works on.
//! Every rank must call the same collectives in the same order with the same counts.
//!
//! Example: `lockstep::ThreadComm` (ranks as host threads; the reference).
template <class C>
concept communicator_has_rank = requires(const C& c) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
};
template <class C>
concept communicator_has_collectives =
    requires(C& c, const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
      { c.all_reduce(s, r, n, t, op) } -> work;
      { c.broadcast(r, n, t, root) } -> work;
      { c.all_gather(s, r, n, t) } -> work;
      { c.reduce_scatter(s, r, n, t, op) } -> work;
      c.barrier();
    };
template <class C>
concept communicator_has_memory = requires(C& c) {
  { c.memory() } -> memory_ops;
};
template <class C>
concept communicator = communicator_has_rank<C> && communicator_has_collectives<C> && communicator_has_memory<C>;

//! lockstep::splittable_communicator — a communicator that makes sub-communicators (a mesh of
//! data × model parallelism, parallel/mesh.hpp).
//!  1. `c.split(color, key)` → C over the ranks that passed the same colour (≥ 0), ranked by
//!     key (ties by rank in c); collective over c, like MPI_Comm_split. Failures in any
//!     communicator split from a job end the whole job.
//! Example: `lockstep::ThreadComm::split`, `lockstep::MpiComm::split`.
template <class C>
concept splittable_communicator = communicator<C> && requires(C& c, int color, int key) {
  { c.split(color, key) } -> std::same_as<C>;
};

// ---------------------------------------------------------------------------------------
//! lockstep::accumulation_policy — when gradients are synchronised.
//!  1. `p.steps()` → the number K ≥ 1 of micro-steps per optimizer step. The first K−1
//!     micro-steps only accumulate locally (no communication); the K-th averages.
//! Example: `lockstep::EveryStep` (K = 1), `lockstep::Accumulate<4>`, `lockstep::Accumulate<>`
//! (K set at run time).
template <class P>
concept accumulation_policy = requires(const P& p) {
  { p.steps() } -> std::convertible_to<int>;
};

}  // namespace lockstep
