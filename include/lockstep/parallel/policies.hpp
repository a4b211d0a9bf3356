#pragma once
//! The choices DataParallel is configured with: when gradients are synchronised (the
//! accumulation policies EveryStep and Accumulate, tags chosen at compile time), how they are
//! reduced (the strategy: Replicated by default, ShardedOptimizer) and the value structs of
//! its tuning (BucketPolicy, DataParallelOptions).

#include <cstddef>
#include <string>
#include <type_traits>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/detail/pick.hpp"
#include "lockstep/parallel/bucket_hook.hpp"
#include "lockstep/parallel/wire_format.hpp"
#include "lockstep/scaling/loss_scaler.hpp"
#include "lockstep/scaling/scalers.hpp"

namespace lockstep {

// ---- accumulation policies ---------------------------------------------------------------

//! Synchronise gradients on every step (the default).
struct EveryStep {
  static constexpr int steps() noexcept { return 1; }
};

//! K chosen at run time (`Accumulate<>`).
inline constexpr int dynamic_steps = 0;

//! K micro-steps per optimizer step, communication only on the last (no_sync semantics).
//! `Accumulate<4>` fixes K at compile time; `Accumulate<>` takes it at run time
//! (`Accumulate<>(4)`) and may change it between optimizer steps.
template <int K = dynamic_steps>
struct Accumulate {
  static_assert(K >= 1, "lockstep::Accumulate<K>: K must be at least 1");
  static constexpr int steps() noexcept { return K; }
};

template <>
struct Accumulate<dynamic_steps> {
  Accumulate() = default;
  explicit Accumulate(int k) { set_steps(k); }
  int steps() const noexcept { return k_; }
  void set_steps(int k) {
    if (k < 1) throw config_error("lockstep::Accumulate: steps must be at least 1, got " + std::to_string(k));
    k_ = k;
  }

 private:
  int k_ = 1;
};

static_assert(accumulation_policy<EveryStep>);
static_assert(accumulation_policy<Accumulate<4>>);
static_assert(accumulation_policy<Accumulate<>>);

// ---- strategies --------------------------------------------------------------------------
// A strategy policy names the reduction units the reducer runs (parallel/detail/): each is
// its own type, chosen at compile time; without one, DataParallel replicates.

namespace detail {
template <class Comm, class Hook>
class allreduce_units;
template <class Comm, class Hook>
class shard_units;
template <class Comm, class Hook, bool ShardValues>
class block_units;
}  // namespace detail

//! The default strategy (PyTorch DDP's): each bucket is all-reduced, and every rank keeps the
//! whole averaged gradient and its own optimizer state. Nothing to choose; name it where
//! generic code picks a strategy by type (`std::conditional_t<S, ShardedOptimizer, Replicated>`).
struct Replicated {
  template <class Comm, class Hook>
  using units = detail::allreduce_units<Comm, Hook>;
};

//! ZeRO stage 1 (Megatron's distributed optimizer): each bucket is reduce-scattered instead of
//! all-reduced, so every rank holds the average of 1/N of the gradients — its shard; the
//! optimizer, built over DataParallel::shard_parameters(), keeps state for that 1/N only and
//! updates it inside finish(on_shard); each updated shard is then all-gathered back into every
//! rank's parameters. The bucket layout is fixed at construction (no rebuild after the first
//! step: the optimizer's state is laid out along it). docs/sharding.md.
//! `DataParallel dp(ctx, model, lockstep::ShardedOptimizer{.gather_in_forward = true});`
struct ShardedOptimizer {
  //! The all-gather of the updated shards is waited for in the next forward, bucket by
  //! bucket, instead of in finish(). The model calls DataParallel::wait_parameters(i) before
  //! the forward uses parameter i (a gradient for a parameter never waited for is an error),
  //! and wait_all_parameters() before reading the parameters outside a forward (evaluation;
  //! checkpoints do it themselves).
  bool gather_in_forward = false;
  //! With DataParallelOptions::zero_copy: let lockstep own the values too (model.bind_value,
  //! lockstep::model (e)) — no pack before the optimizer, no unpack after the all-gather, one
  //! copy of the weights. Off: they are packed and unpacked (docs/sharding.md has both timed).
  bool bind_values = true;
  //! Over NcclComm (NCCL ≥ 2.28, more than one GPU): the value arena is a symmetric NCCL
  //! window and the all-gathers run on a zero-CTA split of the communicator, i.e. on the GPUs'
  //! copy engines, taking no SMs from the forward they overlap (sync_stats::
  //! gathers_by_copy_engine says whether the window was taken). Off by default: a copy-engine
  //! gather waits for its peers with stream memory operations that NcclComm::abort() cannot
  //! end, so a peer that dies mid-gather leaves this rank's streams waiting for good (end the
  //! process; the watchdog's abort does not release it). Give every rank the same setting
  //! (checked). Other communicators ignore it. docs/sharding.md has it timed.
  bool copy_engine_gather = false;
  //! The same for the reduce-scatters (NcclComm, one node): the gradient arena is a window of
  //! the split too, and each unit's reduce-scatter runs there as an all-to-all on the copy
  //! engines followed by a short kernel that sums the N blocks (fp32, rank order), so backward
  //! keeps its SMs (sync_stats::scatters_by_copy_engine: the arena is a window). Costs staging
  //! windows: the largest unit, plus the smaller sizes the first step grew through. Same
  //! caveat, same setting on every rank.
  bool copy_engine_scatter = false;
  //! The updated fp32 values on the wire (parallel/detail/value_wire.hpp, docs/sharding.md):
  //! fp32, exact; bf16 (half the bytes) or int8 (blockwise, about a quarter). Low-precision,
  //! each rank keeps its shard's fp32 master apart — the optimizer steps it (shard_parameters()
  //! point at it) — and every rank's replica of the model gets the decoded values, the same on
  //! all ranks. wait_all_parameters() (checkpoints, evaluation) makes the replicas exact again
  //! with one fp32 all-gather. Elements of other types go as they are. Same on every rank (checked).
  wire_format gather_wire = wire_format::fp32;
  //! With a low-precision gather_wire: send master − replica (the replica follows the master;
  //! what one step's rounding left goes with the next) rather than the master itself (the
  //! replica is the master rounded).
  bool gather_deltas = true;

  template <class Comm, class Hook>
  using units = detail::shard_units<Comm, Hook>;
};

//! The block buffers full sharding lends (ShardedGradients, FullySharded): gathered values
//! prefetched ahead of the block in use, and gradients on their way to the reduce-scatter.
struct BlockBuffers {
  //! FullySharded: blocks gathered ahead of the one in use (the next ones in forward, the
  //! previous ones in backward) ...
  int prefetch = 1;
  //! ... as long as the values gathered but not in use stay within this many bytes.
  std::size_t max_prefetch_bytes = std::size_t{1} << 30;
  //! Reduce-scatters in flight before a block's backward waits for the oldest (reusing its
  //! gradient buffer): at least 1; 2 lets one block's reduce-scatter overlap the next backward.
  int scatters_in_flight = 2;
  //! The gradient shards stay from one cycle to the next (each cycle's first reduce-scatter
  //! overwrites them) instead of going back to the model's block_storage — no
  //! allocation per cycle, but their memory is held through the forward and early backward,
  //! where FSDP2 (gradients set to none) and the default hand it to activations.
  bool keep_gradient_shards = false;
};

//! ZeRO stage 2: as ShardedOptimizer, and the gradients are sharded too. The model's
//! parameters are grouped into blocks (model (h), blocks(); one block without it), each reduced
//! by one reduce-scatter. A block's full gradient exists only from the start of its backward
//! (dp.use_block(k, lockstep::pass::backward)) until its reduce-scatter has run: it lives in
//! one of a few block-sized buffers that lockstep lends the model (model (i), attach); the
//! rank keeps the mean of its 1/N in a shard that persists and accumulates over micro-steps
//! (every micro-step reduce-scatters: nothing of the full gradient outlives its block's
//! backward). The values stay whole on every rank, gathered after each update in place.
//! docs/sharding.md.
struct ShardedGradients {
  BlockBuffers buffers{};
  template <class Comm, class Hook>
  using units = detail::block_units<Comm, Hook, false>;
};

//! ZeRO stage 3 (PyTorch FSDP2's fully_shard, DeepSpeed ZeRO-3): as ShardedGradients, and the
//! values are sharded too — outside a block's use, a rank holds only its 1/N of them (the fp32
//! master shard the optimizer steps). dp.use_block(k, pass) all-gathers block k's values into a
//! lent buffer (prefetching the next blocks, within BlockBuffers) and attaches them to the
//! model until the use ends. docs/sharding.md.
struct FullySharded {
  BlockBuffers buffers{};
  //! Keep each block's gathered values from its forward until its backward (FSDP2's
  //! reshard_after_forward = False): no second gather, the whole model's values held at once.
  bool keep_after_forward = false;
  //! The element type fp32 parameters are lent to the model in during a use (FSDP2's
  //! param_dtype): f32, or bf16 — the shards, the optimizer and the reduced gradients stay
  //! fp32 (masters), the gathers move half the bytes and the model computes (and writes its
  //! gradients) in bf16, widened to fp32 before their reduce-scatter (FSDP2's reduce_dtype =
  //! fp32; or Bf16Wire). Parameters of other types are lent as they are. The model needs
  //! attach(i, value, grad, dtype) (lockstep::model (i)); TorchModule has it.
  dtype param_dtype = dtype::f32;
  //! What the gathers of fp32 values carry (ZeRO++'s quantized weights, qwZ): fp32 — the lent
  //! type itself (param_dtype: bf16 halves the bytes); bf16 — widened into an f32 buffer; int8
  //! — blockwise (about a quarter of fp32's bytes), decoded into the lent type. Each rank's fp32
  //! shard stays the exact master; each use gets it as the wire rounds it (no deltas: no copy of
  //! the values outlives a use). wait_all_parameters() (evaluation, checkpoints) gathers fp32,
  //! exact. Same on every rank (checked); elements of other types go as they are.
  //! docs/sharding.md, "Low-precision values on the wire".
  wire_format gather_wire = wire_format::fp32;
  template <class Comm, class Hook>
  using units = detail::block_units<Comm, Hook, true>;
};

//! Which pass a use of a block is for (DataParallel::use_block).
enum class pass { forward, backward };

// ---- tuning ------------------------------------------------------------------------------

//! Gradient buckets: the first is small so that communication starts early in backward; the
//! rest are capped (PyTorch DDP's defaults). Buckets are byte ranges of the gradient arena,
//! so a tensor larger than a bucket simply spans several.
struct BucketPolicy {
  std::size_t first_bytes = std::size_t{1} << 20;  //!< 1 MiB
  std::size_t cap_bytes = std::size_t{25} << 20;   //!< 25 MiB
  bool rebuild_after_first_step = true;            //!< reorder by observed arrival, once
  //! Replicated over a communicator with symmetric windows (NcclComm whose
  //! symmetric_kernels() holds: one process per GPU on one host, peer-connected GPUs, NCCL
  //! 2.28+): the gradient arena (not f16) is one symmetric window and each bucket is
  //! all-reduced by lockstep's peer all-reduce (up to LOCKSTEP_PEER_ALL_REDUCE_MIB) or NCCL's
  //! symmetric kernels (sync_stats::symmetric_memory says whether it is); elsewhere plain
  //! memory. Off by default: the collective alone is faster (1.0-2.4x at 1-256 MiB on 2
  //! H200s), a whole step only where communication dominates (the fp32 MLP 12-14 % faster;
  //! GPT-2 and the bf16 MLP within 1 %, slower); docs/communicator.md §11 has the numbers.
  bool symmetric_memory = false;
  //! Choose cap_bytes from a cost model (with rebuild_after_first_step, on communicators that
  //! give one: NcclComm): the gradient times of synchronising step tune_step, stamped on the
  //! device, and timed all-reduces of a few sizes (parallel/detail/bucket_tuner.hpp).
  //! sync_stats::tuning says what it chose and why.
  bool tune = false;
  //! The synchronising step the tuner times (1 = the first). The first step is often much
  //! slower than the rest (cuBLAS and allocator warm-up: 541 ms against 29 ms on libtorch's
  //! GPT-2) and the second is the first in the rebuilt order, so the default times the third.
  //! The new cap takes effect at the next step; until then the gradients stay out of the
  //! arena (packed buckets), so that they are bound into it once, in the final layout. A
  //! StepGraph must warm up tune_step + 1 steps (StepGraphOptions::warmup).
  int tune_step = 3;
};

struct DataParallelOptions {
  BucketPolicy buckets{};
  //! Let lockstep own the gradients (model.bind_gradient) when the model offers it: once the
  //! layout is final (see lockstep::model (a)); DataParallel::parameters() then returns the
  //! arena pointers. Before that, and with this off, buckets are packed from the model's own.
  bool zero_copy = true;
  //! Copy rank 0's parameter values (trained and frozen, and buffers: lockstep::model (c),
  //! (g)) to every rank at construction.
  bool broadcast_parameters = true;
  //! Copy rank 0's buffers to every rank at the start of every accumulation cycle, before
  //! the forward passes — PyTorch DDP's broadcast_buffers, on by default as there: BatchNorm
  //! statistics stay those of rank 0 (one broadcast per element type of buffer; nothing for
  //! a model without buffers). Off: each rank keeps its own statistics between steps (they
  //! drift apart with the data each rank sees; evaluate and checkpoint on rank 0 only then).
  bool broadcast_buffers = true;
  //! true: gradients are the mean over all N·K micro-batches (each micro-batch's loss
  //! being a mean); false: divide by N only, as PyTorch DDP does (then scale the loss by 1/K).
  bool average_over_accumulation = true;
  //! > 0: finish() clips the averaged, unscaled gradients to this global L2 norm (PyTorch's
  //! clip_grad_norm_) before any per-bucket callback, and reports the norm in
  //! step_result::grad_norm; sharded, the norm is summed over the shards. 0: off.
  double max_grad_norm = 0;
};

namespace detail {
template <class P>
struct is_accumulation_policy : std::bool_constant<accumulation_policy<P>> {};
template <class P>
struct is_loss_scaler : std::bool_constant<loss_scaler<P>> {};
template <class P>
struct is_block_sharded : std::bool_constant<std::is_same_v<P, ShardedGradients> || std::is_same_v<P, FullySharded>> {};
template <class P>
struct is_sharded : std::bool_constant<std::is_same_v<P, ShardedOptimizer> || is_block_sharded<P>::value> {};
template <class P>
struct is_strategy : std::bool_constant<is_sharded<P>::value || std::is_same_v<P, Replicated>> {};

//! DataParallel's policies sorted by kind — each of a known kind, at most one of each — and
//! the defaults for the kinds not given.
template <class Comm, class... Policies>
struct policy_set {
  template <class P>
  struct is_hook : std::bool_constant<bucket_hook<P, Comm>> {};
  template <class P>
  struct is_policy
      : std::bool_constant<accumulation_policy<P> || loss_scaler<P> || bucket_hook<P, Comm> || is_strategy<P>::value> {
  };
  static_assert((is_policy<Policies>::value && ...),
                "lockstep::DataParallel: every policy must be an accumulation_policy "
                "(EveryStep, Accumulate<K>), a loss_scaler (NoScaling, StaticScale, "
                "DynamicScale), a bucket_hook (AllReduceMean) or a strategy (Replicated, ShardedOptimizer, "
                "ShardedGradients, FullySharded) — one of the "
                "Policies is none of these (an accumulation policy needs steps(); a loss scaler needs scale(), "
                "update(), state(); a hook needs reduce(comm, data, count, dtype)). When the "
                "policies are deduced (DataParallel dp(ctx, model, ...)), DataParallelOptions "
                "must come first");
  static_assert(detail::count_v<detail::is_accumulation_policy, Policies...> <= 1,
                "lockstep::DataParallel: give at most one accumulation_policy");
  static_assert(detail::count_v<detail::is_loss_scaler, Policies...> <= 1,
                "lockstep::DataParallel: give at most one loss_scaler");
  static_assert(detail::count_v<is_hook, Policies...> <= 1, "lockstep::DataParallel: give at most one bucket_hook");
  static_assert(detail::count_v<detail::is_strategy, Policies...> <= 1,
                "lockstep::DataParallel: give at most one strategy (Replicated, ShardedOptimizer, ShardedGradients, "
                "FullySharded)");
  using accumulation = pick_t<is_accumulation_policy, EveryStep, Policies...>;
  using scaler = pick_t<is_loss_scaler, NoScaling, Policies...>;
  using hook = pick_t<is_hook, AllReduceMean, Policies...>;
  // AllReduceMean named beside ShardedOptimizer is the default spelled out: its mean becomes
  // the communicator's reduce-scatter (hook_reduce_scatter).
  static_assert(
      detail::count_v<detail::is_sharded, Policies...> == 0 || detail::count_v<is_hook, Policies...> == 0 ||
          std::is_same_v<hook, AllReduceMean> ||
          requires(hook& h, Comm& c, void* p, std::size_t n, dtype t) { h.reduce_scatter(c, p, p, n, t); },
      "lockstep::DataParallel: a sharded strategy reduce-scatters every bucket itself; it combines "
      "only with AllReduceMean (the default) or a bucket_hook that has "
      "reduce_scatter(comm, data, mine, per, dtype) (Bf16Wire)");
  static constexpr bool sharded = count_v<is_sharded, Policies...> > 0;
  //! Blocks used through DataParallel::use_block (ShardedGradients, FullySharded).
  static constexpr bool block_sharded = count_v<is_block_sharded, Policies...> > 0;
  //! The strategy policy (Replicated when none is given) and the reduction units it runs.
  using strategy = pick_t<is_strategy, Replicated, Policies...>;
  using units = typename strategy::template units<Comm, hook>;
};

}  // namespace detail

}  // namespace lockstep
