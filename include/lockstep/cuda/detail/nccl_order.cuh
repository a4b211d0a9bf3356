#pragma once
//! The order check of an NcclComm's collectives (comm/order_check.hpp): each call numbered,
//! its seal all-gathered on the communication stream ahead of the collective, the seals that
//! have arrived compared.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/detail/capture_guard.cuh"
#include "lockstep/cuda/detail/nccl_marker.cuh"
#include "lockstep/cuda/detail/nccl_state.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/memory.cuh"

namespace lockstep::detail {

//! The order check's text for a mismatch on s (comm/order_check.hpp).
inline std::string nccl_order_how(const nccl_state& s) {
  return order_check_how(s.seals.mode(), s.group_name) + ", seen on " + s.who();
}

// Numbers the call (every collective call, zero-length ones too: the "#n" of messages) and
// runs the order check (comm/order_check.hpp): first the comparison of the seals that have
// arrived (deferred: a mismatch found earlier is thrown from here on), then this call's seal —
// its words up, the all-gather, every rank's words back, on the communication stream ahead of
// the collective. Immediate (LOCKSTEP_DEBUG=1): waits for the seal and throws before the
// collective starts, so a rank that skipped a collective or called another one fails with a
// mismatch_error naming both calls on every rank, in step. No seal while the stream is being
// captured into a CUDA graph (every rank captures the same calls; the replays go unchecked).
// With `carry` (the collective's own kernel can carry a seal: lockstep's peer all-reduce) a
// deferred seal is not all-gathered here: its words go to *carry, for a carried_seal.
inline collective nccl_check_order(nccl_state& s, collective c, std::optional<seal_words>* carry = nullptr) {
  c.seq = s.calls++;
  c.label = std::exchange(s.next_label, {});
  const auto mode = s.seals.mode();
  if (mode == order_check_mode::off || s.size == 1) return c;  // one rank has nobody to disagree with
  device_guard g(s.device);
  for (cudaStream_t st : {s.comm_stream, s.compute_stream()})  // this rank is capturing a step
    if (stream_capturing(st)) return c;
  const relaxed_capture relaxed;  // another rank's thread may be capturing (run(Gpus))
  if (auto why = s.seals.poll([&] { return nccl_order_how(s); })) {
    // An abort racing this call kills the seals' all-gathers, whose words are then stale: the
    // abort is what happened.
    if (s.aborted.load(std::memory_order_acquire))
      throw aborted_error(s.who() + " was aborted (" + s.abort_reason + "); create a new communicator to continue");
    throw mismatch_error(*why);
  }
  if (carry != nullptr && mode == order_check_mode::deferred) {
    *carry = encode_order(c);
    return c;
  }
  constexpr std::size_t k = order_words;
  auto e = s.seals.take();
  try {
    const auto mine = encode_order(c);
    std::copy(mine.begin(), mine.end(), e.host);
    std::int64_t* slot = s.seals.gathered() + k * static_cast<std::size_t>(s.rank);
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(slot, e.host, k * sizeof(std::int64_t), cudaMemcpyHostToDevice, s.comm_stream));
    // A collective of its own that a missing peer stalls: overdue() names it, and `c`.
    nccl_marker mark(s, c, true);
    LOCKSTEP_TRY_NCCL(ncclAllGather(slot, s.seals.gathered(), k, ncclInt64, s.comm, s.comm_stream));
    mark.done();
    LOCKSTEP_TRY_CUDA(cudaMemcpyAsync(e.host + k, s.seals.gathered(), k * s.seals.ranks() * sizeof(std::int64_t),
                                      cudaMemcpyDeviceToHost, s.comm_stream));
    LOCKSTEP_TRY_CUDA(cudaEventRecord(e.done, s.comm_stream));
  } catch (...) {
    s.seals.give_back(e);
    throw;
  }
  if (mode == order_check_mode::deferred) {
    s.seals.push(e);
    return c;
  }
  const cudaError_t r = cudaEventSynchronize(e.done);
  auto why = r == cudaSuccess ? s.seals.compare(e, [&] { return nccl_order_how(s); }) : std::nullopt;
  s.seals.give_back(e);
  check_cuda(r, "cudaEventSynchronize(order check)", __FILE__, __LINE__);
  if (why) throw mismatch_error(*why);
  return c;
}

// A seal delivered by the collective's own kernel (lockstep's peer all-reduce): this rank's words
// in place; the kernel writes every rank's, in rank order, at gathered() (pinned host memory),
// then sets the entry's `arrived` word; queued() records the event after the kernel and hands
// the seal to the check, which compares it like an all-gathered one once it arrived. Call
// launching() right before the kernel's launch: from then on a failure leaks the entry (the
// kernel may have been queued and write it), as an aborted communicator's are.
class carried_seal {
 public:
  carried_seal(nccl_state& s, const seal_words& mine) : s_(s), e_(s.seals.take()) {
    std::copy(mine.begin(), mine.end(), e_.host);
    e_.arrived = e_.host + order_words * (1 + s.seals.ranks());
    *e_.arrived = 0;
  }
  ~carried_seal() {
    if (e_.host != nullptr && !launching_) s_.seals.give_back(e_);
  }
  carried_seal(const carried_seal&) = delete;
  carried_seal& operator=(const carried_seal&) = delete;
  std::int64_t* gathered() const noexcept { return e_.device + order_words; }
  void launching() noexcept { launching_ = true; }
  void queued(cudaStream_t stream) {
    LOCKSTEP_TRY_CUDA(cudaEventRecord(e_.done, stream));
    s_.seals.push(e_);
    e_ = {};
  }

 private:
  nccl_state& s_;
  nccl_seals::entry e_;
  bool launching_ = false;
};

}  // namespace lockstep::detail
