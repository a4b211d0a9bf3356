#pragma once
//! ShardedOptimizer::gather_wire (policies.hpp): the all-gather of the updated shards in fewer
//! bytes. Each rank keeps its shard's fp32 master apart from the values the model reads (its
//! replica of the whole model, the same on every rank); what goes on the wire is each master
//! encoded — bf16 or blockwise int8, the codecs of the gradient wires (gradient_wire.hpp) —
//! and every rank, the master's owner included, decodes every rank's chunk into its replica, so
//! that all replicas stay equal bit for bit.
//!  - values: replica ← decode(encode(master)). The replica is the master rounded.
//!  - deltas (the default): replica ← replica + decode(encode(master − replica)). What the wire
//!    rounded off is still in master − replica and goes again with the next step's change
//!    (error feedback without a buffer of its own): the replica follows the master to within
//!    the rounding of one step's change, not of the value.
//! NcclComm: wire_value_gather in cuda/nccl_wire.cuh (nccl_comm.cuh brings it), the encode
//! on the communication stream, the decode on the aside stream (NcclComm::enqueue_aside). Host communicators
//! (ThreadComm, MpiComm): the same numbers bit for bit (every operation one fp32 operation, rounded to nearest) from
//! host_value_gather, which the gradient wires' host path shares (gradient_wire.hpp).
//!
//! FullySharded::gather_wire: the gathers of a block's values into the buffer lent to the model
//! carry each rank's fp32 shard encoded, decoded into the lent type (f32, or bf16 rounded to
//! nearest). No replica outlives a use, so values only (no deltas): each use gets the masters
//! as the wire rounds them, the masters stay exact. NcclComm: wire_block_gather (the decode on
//! the aside stream); host communicators: host_block_gather below, the same numbers.

#include <cstddef>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/parallel/gradient_wire.hpp"
#include "lockstep/parallel/wire_format.hpp"

namespace lockstep::detail {

//! fn(the codec of a low-precision format f): int8_codec, or bf16_codec.
template <class F>
decltype(auto) with_codec(wire_format f, F&& fn) {
  return f == wire_format::int8 ? fn(int8_codec{}) : fn(bf16_codec{});
}

//! The gather of a low-precision format f (bf16 or int8) over comm: the device path where the
//! communicator has one (wire_value_gather, found by argument-dependent lookup; NcclComm's header
//! brings it, so every unit that sees NcclComm compiles the same), else the host's. A device
//! communicator without one is refused when the format is asked for (it compiles for users who
//! never ask).
template <class Comm>
auto value_gather(Comm& comm, wire_staging& st, wire_format f, const float* master, float* unit, std::size_t per,
                  bool deltas) {
  using work_t = decltype(comm.all_gather(nullptr, nullptr, std::size_t{}, dtype::f32));
  const auto through = [&](auto codec) -> work_t {
    if constexpr (requires { wire_value_gather(comm, st, master, unit, per, deltas, codec); }) {
      return wire_value_gather(comm, st, master, unit, per, deltas, codec);
    } else if constexpr (requires { comm.comm_stream(); }) {
      throw config_error("ShardedOptimizer::gather_wire: this device communicator has no low-precision gather "
                         "(wire_value_gather); use gather_wire = fp32, or NcclComm");
    } else {
      host_value_gather<decltype(codec)>(comm, master, unit, per, deltas);
      return work_t{};
    }
  };
  return with_codec(f, through);
}

//! to (size()·per values of type t: f32 or bf16) ← every rank's fp32 `master` (per values)
//! through Codec's wire, on host communicators: host_value_gather's values, bf16 rounded to nearest.
template <class Codec, class Comm>
void host_block_gather(Comm& comm, const float* master, std::size_t per, void* to, dtype t) {
  if (t == dtype::f32) return host_value_gather<Codec>(comm, master, static_cast<float*>(to), per, false);
  std::vector<float> wide(static_cast<std::size_t>(comm.size()) * per);
  host_value_gather<Codec>(comm, master, wide.data(), per, false);
  bf16_codec::encode(wide.data(), wide.size(), static_cast<unsigned char*>(to));  // each rounded to nearest
}

//! FullySharded::gather_wire's gather of a low-precision format f over comm: the device path
//! where the communicator has one (wire_block_gather; `staging` receives the chunks), else the
//! host's (staging unused).
template <class Comm>
auto block_value_gather(Comm& comm, wire_format f, void* staging, const float* master, std::size_t per, void* to,
                        dtype t) {
  using work_t = decltype(comm.all_gather(nullptr, nullptr, std::size_t{}, dtype::f32));
  const auto through = [&](auto codec) -> work_t {
    if constexpr (requires { wire_block_gather(comm, staging, master, per, to, t, codec); }) {
      return wire_block_gather(comm, staging, master, per, to, t, codec);
    } else if constexpr (requires { comm.comm_stream(); }) {
      throw config_error("FullySharded::gather_wire: this device communicator has no low-precision gather "
                         "(wire_block_gather); use gather_wire = fp32, or NcclComm");
    } else {
      host_block_gather<decltype(codec)>(comm, master, per, to, t);
      return work_t{};
    }
  };
  return with_codec(f, through);
}

}  // namespace lockstep::detail
