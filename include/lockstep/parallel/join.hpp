#pragma once
//! lockstep::Join — uneven inputs: ranks with different numbers of batches finish an epoch
//! together, without a hang, and every step averages over the data actually contributed.
//!
//! \code
//!   auto update = [&](lockstep::step_result r) { if (r) optimizer.update(model); };
//!   {
//!     auto join = dp.join(update);                  // every rank enters, between steps
//!     for (auto& batch : my_batches) {              // any number, 0 included
//!       auto step = dp.step();                      // syncing steps agree who contributes
//!       model.backward(batch, step.on_gradient_ready());
//!       update(step.finish());
//!     }
//!   }   // leaving: while other ranks still step, take part in their averages with zero
//!       // gradients and call update(result) for each; then every rank leaves together
//! \endcode
//!
//! Semantics:
//!  - Inside the scope each syncing micro-step starts with one small all-reduce: how many
//!    micro-batches each rank accumulated in this cycle. The gradients are then the mean
//!    over the micro-batches contributed (`average_over_accumulation`, the default) or over
//!    the contributing ranks (off: PyTorch's divide-by-ranks), so a step equals a run over
//!    only the contributing ranks' data. With every rank in, it is exactly the usual average.
//!  - A rank that leaves the scope in the middle of an accumulation cycle contributes the
//!    micro-batches it has (weighted as one each); the cycle's update counts them.
//!  - A rank that has left contributes zeros to the same collectives, in the same order
//!    (same buckets and launch units, fused or not, the loss scaler's found-inf flag), and
//!    receives the same averaged, unscaled gradients. on_shadow_step is called with each such
//!    step's result; applying the same update there keeps parameters, optimizer state and
//!    the loss scaler identical on every rank (lockstep does not broadcast parameters at the
//!    end: the callback is the rule, so that optimizer state stays in sync too).
//!  - ShardedGradients / FullySharded: a rank out of data replays its last syncing micro-step's
//!    block uses (all-gathers, zero-gradient reduce-scatters) in every micro-step it shadows.
//!    With several micro-steps per cycle every one of them reduce-scatters, so each cycle also
//!    begins with an agreement, and the shards are rescaled once the cycle's sums are in.
//!  - Outside a scope nothing changes and nothing is added to a step.
//! Every wait is one of the communicator's, with its timeout: a rank that never enters the
//! scope, or leaves the job, makes the others fail with timeout_error / mismatch_error.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/reduce_op.hpp"

#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/block_use.hpp"
#include "lockstep/parallel/deterministic.hpp"
#include "lockstep/parallel/step.hpp"

namespace lockstep {

template <class DP>
class Join {
 public:
  using shadow_fn = std::function<void(step_result)>;
  using shard_fn = std::function<void(std::span<const param_slice>)>;

  //! Enters the scope (no communication). Use between steps; scopes do not nest. With
  //! ShardedOptimizer, on_shard is the optimizer's shard step (what the stepping ranks pass to
  //! finish): a rank out of data still updates its shard of every parameter in each shadow step.
  Join(DP& dp, shadow_fn on_shadow_step, shard_fn on_shard = {})
      : dp_(dp), on_shadow_step_(std::move(on_shadow_step)), on_shard_(std::move(on_shard)),
        uncaught_(std::uncaught_exceptions()) {
    static_assert(!detail::fixed_point_hook_v<typename DP::hook_type>,
                  "lockstep::Join with Deterministic: a rank out of data changes the number of micro-batches a "
                  "mean is over, which the deterministic sums do not follow; give every rank the same number of "
                  "batches (the sampler's Pad or DropLast tail)");
    if (DP::sharded != static_cast<bool>(on_shard_))
      throw config_error(DP::sharded ? "lockstep::Join with a sharded strategy: pass the optimizer's shard step too, "
                                       "dp.join(on_shadow_step, [&](std::span<const lockstep::param_slice> s) { "
                                       "opt.step(s); }): each rank updates its own shard, with data or without"
                                     : "lockstep::Join: on_shard is for the sharded strategies (ShardedOptimizer, "
                                       "ShardedGradients, FullySharded); this DataParallel is not sharded");
    if (!on_shadow_step_)
      throw config_error("lockstep::Join: on_shadow_step is empty; pass the optimizer update "
                         "the stepping ranks apply (e.g. [&](lockstep::step_result r) { if (r) "
                         "opt.update(model); }) so that a rank out of data stays in sync");
    if (dp_.joining_)
      throw config_error("lockstep::Join: a Join scope is already open on this DataParallel; "
                         "scopes do not nest");
    if (dp_.open_)
      throw config_error("lockstep::Join: a step is open; enter the scope between steps "
                         "(after finish())");
    dp_.joining_ = true;
    dp_.join_steps_ = dp_.acc_.steps();
    dp_.stepped_ = false;  // nothing stepped in this scope yet
  }

  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  //! Leaves the scope (as leave()) unless an exception is unwinding the stack: then it only
  //! closes the scope — the failing rank's communicator aborts or times out the others.
  ~Join() noexcept(false) {
    if (done_) return;
    if (std::uncaught_exceptions() > uncaught_) {
      done_ = true;
      dp_.joining_ = false;
      return;
    }
    leave();
  }

  //! Finishes this rank's unfinished accumulation cycle, if any, then shadows the other
  //! ranks' steps until no rank contributes; calls on_shadow_step for each of these steps.
  //! Returns their number (the same as shadow_steps()). Collective: every rank of the
  //! communicator must leave its scope. Called by the destructor if not called before.
  std::size_t leave() {
    if (done_) return shadow_steps_;
    if (dp_.open_)
      throw config_error("lockstep::Join::leave: a step is still open; call finish() on the "
                         "last step before leaving the Join scope");
    done_ = true;  // a failure below is not retried by the destructor
    struct close_scope {
      DP& dp;
      ~close_scope() { dp.joining_ = false; }
    } close{dp_};
    while (auto r = shadow_step()) {
      ++shadow_steps_;
      on_shadow_step_(*r);
    }
    return shadow_steps_;
  }

  //! Steps this rank completed inside leave(): the flush of an unfinished cycle, if any,
  //! and every step it shadowed.
  std::size_t shadow_steps() const noexcept { return shadow_steps_; }
  //! Ranks that contributed data at the latest agreement (0 after the final one).
  int active_ranks() const noexcept { return dp_.join_active_; }

 private:
  friend DP;  // its step() agrees and broadcasts through these

  // ShardedGradients / FullySharded with several micro-steps per cycle: every micro-step
  // gathers and reduce-scatters, so a rank out of data must know at a cycle's start whether
  // any rank steps it — one agreement there ({1, 1} from a stepping rank, {0, 0} from one out
  // of data), then the usual one at the syncing micro-step.
  static bool shadows_micro_steps(const DP& dp) { return DP::block_sharded && dp.k_ > 1; }
  static void cycle_begins(DP& dp) {
    if (shadows_micro_steps(dp)) (void)agree(dp, 1);
  }
  // The accumulation policy's K, which under block sharding must stay what it was when the
  // scope opened: a rank out of data shadows that many micro-steps per cycle and cannot see
  // another rank change it (the agreements would pair with the wrong collectives).
  static int steps_in_scope(const DP& dp) {
    const int k = dp.acc_.steps();
    if (DP::block_sharded && k != dp.join_steps_)
      throw config_error("lockstep::Join with ShardedGradients / FullySharded: the accumulation changed from " +
                         std::to_string(dp.join_steps_) + " to " + std::to_string(k) +
                         " micro-steps inside a Join scope; every micro-step reduce-scatters and a rank out of data "
                         "shadows the scope's count: change it between scopes");
    return k;
  }
  // The prescale of a syncing micro-step from the agreement. With several micro-steps under
  // block sharding the earlier ones were reduce-scattered with the usual 1/K already: they all
  // keep it, and the shards are scaled by the ratio once the cycle's sums are in.
  static double sync_prescale(DP& dp, const std::array<std::int64_t, 2>& agreed) {
    const double p = prescale(dp, agreed);
    if constexpr (DP::block_sharded)
      if (shadows_micro_steps(dp)) {
        dp.reducer_.units().scale_cycle(p / dp.usual_prescale());
        return dp.usual_prescale();
      }
    return p;
  }

  // The highest rank whose `mine` is true (-1 if none): one all-reduce (max) of rank or -1 —
  // DDP's _find_common_rank. Whose buffers the cycle starts from, and, when the scope ends,
  // whose the model ends with.
  static int common_rank(DP& dp, bool mine) {
    std::int64_t v = mine ? dp.comm_.rank() : -1;
    auto mem = dp.comm_.memory();
    if (!dp.join_buf_) dp.join_buf_ = mem.allocate(2 * sizeof(std::int64_t));
    mem.upload(dp.join_buf_.get(), &v, sizeof v);
    dp.comm_.all_reduce(dp.join_buf_.get(), dp.join_buf_.get(), 1, dtype::i64, reduce_op::max).wait();
    mem.download(&v, dp.join_buf_.get(), sizeof v);
    return static_cast<int>(v);
  }

  // Inside a scope every syncing micro-step starts with one all-reduce (sum) of {micro-batches
  // this rank accumulated in the cycle, 1 if that is > 0}; a rank that ran out contributes
  // {0, 0}. The sums give the divisor and tell joined ranks whether anybody still steps. The
  // buffer is kept for the DataParallel's lifetime (no allocation per step).
  static std::array<std::int64_t, 2> agree(DP& dp, std::int64_t micro_batches) {
    std::array<std::int64_t, 2> v{micro_batches, micro_batches > 0 ? 1 : 0};
    if (dp.comm_.size() > 1) {
      auto mem = dp.comm_.memory();
      if (!dp.join_buf_) dp.join_buf_ = mem.allocate(sizeof v);
      mem.upload(dp.join_buf_.get(), v.data(), sizeof v);
      dp.comm_.all_reduce(dp.join_buf_.get(), dp.join_buf_.get(), v.size(), dtype::i64, reduce_op::sum).wait();
      mem.download(v.data(), dp.join_buf_.get(), sizeof v);
    }
    dp.join_active_ = static_cast<int>(v[1]);
    return v;
  }

  // The all-reduce's avg divides by size() = N, so a prescale N/M makes the result the mean
  // over the M micro-batches actually contributed (N/A: over the A contributing ranks, when
  // average_over_accumulation is off). With every rank in, N/(N·K) rounds to exactly 1/K:
  // the same numbers as outside a scope.
  static double prescale(const DP& dp, const std::array<std::int64_t, 2>& agreed) {
    const double n = static_cast<double>(dp.comm_.size());
    return n / static_cast<double>(dp.opts_.average_over_accumulation ? agreed[0] : agreed[1]);
  }

  // One step of a rank inside leave(). It contributes what it accumulated in an unfinished
  // cycle, else zeros, to exactly the collectives the stepping ranks issue, in their order: a
  // pending plan rebuild's check (they apply it when their cycle starts, before its
  // agreement), the buffers' broadcast (from the highest rank still stepping), the agreement,
  // the bucket all-reduces (arrival order replayed) and the loss scaler's found-inf flag.
  // nullopt once no rank contributes any more — then every rank takes the buffers of the
  // highest rank that stepped last (DDP's final sync after join), so the model ends alike.
  std::optional<step_result> shadow_step() {
    DP& dp = dp_;
    dp.settle_abandoned();  // a step an exception left (block_sharded), as step() does first
    const bool stepped_last = dp.stepped_;
    const bool partial = dp.in_cycle_ && dp.micro_ > 0;
    const std::int64_t mine = partial ? dp.micro_ : 0;  // the micro-batches this rank gave the cycle
    if (!partial) dp.reducer_.apply_pending_plan();
    if (!partial && dp.opts_.broadcast_buffers) dp.sync_buffers(/*stepping=*/false);
    bool begun = partial;                                                     // the cycle this step completes has begun
    if (!partial && DP::block_sharded && (dp.k_ = steps_in_scope(dp)) > 1) {  // cycle_begins' agreement
      if (agree(dp, 0)[1] == 0) return scope_ends(dp, stepped_last);
      begin_cycle(dp);
      begun = true;
    }
    try {
      while (shadows_micro_steps(dp) && dp.micro_ + 1 < dp.k_) {  // the begun cycle's other micro-steps
        dp.recorder_.step_begin(/*sync=*/false, /*counted=*/false);
        dp.reducer_.begin_micro(false, dp.usual_prescale());
        open_micro_step(dp);
        (void)dp.finish_step(false, {});
      }
      dp.recorder_.step_begin(/*sync=*/true, /*counted=*/false);
      const auto agreed = agree(dp, mine);
      if (agreed[0] == 0) return scope_ends(dp, stepped_last);
      if (!begun) begin_cycle(dp);
      dp.reducer_.begin_micro(true, sync_prescale(dp, agreed));
      open_micro_step(dp);
      return dp.finish_step(true, on_shard_);
    } catch (...) {  // as a step_handle's: nothing more this step (block_sharded: settled at the next)
      dp.abandon();
      throw;
    }
  }
  static void begin_cycle(DP& dp) {
    dp.reducer_.begin_cycle();  // zero gradients: this rank adds nothing
    dp.micro_ = 0;
    dp.in_cycle_ = true;
  }
  // A micro-step opened as step() opens one (finish ends it), with this rank's part replayed.
  static void open_micro_step(DP& dp) {
    dp.uses_.begin();
    dp.open_ = true;
    if constexpr (DP::block_sharded) replay_uses(dp);
    else dp.reducer_.replay_arrivals();
  }
  // No rank contributes any more: every rank takes the buffers of the highest rank that
  // stepped last (DDP's final sync after join), so the model ends alike.
  static std::optional<step_result> scope_ends(DP& dp, bool stepped_last) {
    if (dp.opts_.broadcast_buffers) dp.sync_buffers(stepped_last);
    return std::nullopt;
  }

  // The blocks' uses of this rank's last step, replayed: their all-gathers, and reduce-scatters
  // of zero gradients.
  static void replay_uses(DP& dp) {
    std::list<block_use<DP>> open;  // begun, not ended yet
    for (const auto& e : dp.uses_.replayed(dp.reducer_.units().blocks())) {
      if (e.begins) {
        open.push_back(dp.use_block(e.block, e.pass));
        continue;
      }
      const auto u = std::find_if(open.begin(), open.end(),
                                  [&](const block_use<DP>& b) { return b.block() == e.block && b.pass() == e.pass; });
      if (u == open.end())
        throw config_error("lockstep::Join: a replayed use of block " + std::to_string(e.block) +
                           " ends without having begun");
      u->end();
      open.erase(u);
    }
  }

  DP& dp_;
  shadow_fn on_shadow_step_;
  shard_fn on_shard_;
  int uncaught_ = 0;
  bool done_ = false;
  std::size_t shadow_steps_ = 0;
};

}  // namespace lockstep
