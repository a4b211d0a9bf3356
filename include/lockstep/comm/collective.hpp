#pragma once
//! A collective as data (nccl-tests' idea): kind, count, element type, reduction, root and
//! sequence number, written once and used by every communicator for what it says about a
//! call — LOCKSTEP_DEBUG order checks, timeout and overdue messages, mismatch errors. A
//! communicator counts its calls, describes each with a collective, and (to check the order)
//! compares every rank's encoded descriptor with rank 0's through its own transport.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

//! graph_replay is not a collective: a CUDA graph replay that holds some (NcclComm::tracked_launch),
//! described like one so that overdue() can name it.
enum class collective_kind : std::uint8_t {
  all_reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  barrier,
  all_to_all,
  graph_replay,
  shift  //!< a ring shift: each rank receives the block of the rank `root` places after it
};

inline constexpr const char* name_of(collective_kind k) {
  switch (k) {
    case collective_kind::all_reduce: return "all_reduce";
    case collective_kind::broadcast: return "broadcast";
    case collective_kind::all_gather: return "all_gather";
    case collective_kind::reduce_scatter: return "reduce_scatter";
    case collective_kind::barrier: return "barrier";
    case collective_kind::all_to_all: return "all_to_all";
    case collective_kind::graph_replay: return "graph_replay";
    case collective_kind::shift: return "shift";
  }
  return "?";
}

struct collective {
  collective_kind kind = collective_kind::barrier;
  std::size_t count = 0;  //!< elements per rank (all_gather, reduce_scatter: one rank's block)
  dtype type = dtype::u8;
  reduce_op op = reduce_op::sum;  //!< all_reduce and reduce_scatter only
  int root = 0;                   //!< broadcast: the root; shift: the distance
  std::uint64_t seq = 0;          //!< this rank's collectives before it
  //! What the caller says the call is for (e.g. "bucket 3: f32 [0, 262144)"), set through a
  //! communicator's label_next(); compared like the rest, so two ranks that pair different
  //! buckets of equal size are told apart. Not part of encode(): see label_hash().
  std::string label{};

  static collective all_reduce(std::size_t n, dtype t, reduce_op o) {
    return {collective_kind::all_reduce, n, t, o, 0, 0};
  }
  static collective broadcast(std::size_t n, dtype t, int r) {
    return {collective_kind::broadcast, n, t, reduce_op::sum, r, 0};
  }
  static collective all_gather(std::size_t n, dtype t) {
    return {collective_kind::all_gather, n, t, reduce_op::sum, 0, 0};
  }
  static collective reduce_scatter(std::size_t n, dtype t, reduce_op o) {
    return {collective_kind::reduce_scatter, n, t, o, 0, 0};
  }
  static collective all_to_all(std::size_t n, dtype t) {
    return {collective_kind::all_to_all, n, t, reduce_op::sum, 0, 0};
  }
  static collective shift(std::size_t n, dtype t, int distance) {
    return {collective_kind::shift, n, t, reduce_op::sum, distance, 0};
  }
  static collective barrier() { return {}; }

  //! "all_reduce #12 of 1048576 f32 (avg)", "broadcast #0 of 10 f64 from root 1", "barrier #3".
  std::string describe() const {
    std::string s = std::string(name_of(kind)) + " #" + std::to_string(seq);
    if (kind == collective_kind::barrier) return s;
    if (kind == collective_kind::graph_replay) return label.empty() ? s : s + " of " + label;
    s += " of " + std::to_string(count) + " " + name_of(type);
    if (kind == collective_kind::all_reduce || kind == collective_kind::reduce_scatter)
      s += std::string(" (") + name_of(op) + ")";
    if (kind == collective_kind::broadcast) s += " from root " + std::to_string(root);
    if (kind == collective_kind::shift) s += " from the rank " + std::to_string(root) + " after";
    if (!label.empty()) s += " for " + label;
    return s;
  }

  //! FNV-1a 64 of the label (0 without one), for transports that compare numbers.
  std::int64_t label_hash() const {
    if (label.empty()) return 0;
    std::uint64_t h = 1469598103934665603ull;
    for (unsigned char ch : label) h = (h ^ ch) * 1099511628211ull;
    return static_cast<std::int64_t>(h >> 1);
  }

  //! The fields every rank must agree on, in order.
  static constexpr std::size_t encoded_size = 6;
  using encoded = std::array<std::int64_t, encoded_size>;
  encoded encode() const {
    return {static_cast<std::int64_t>(seq),  static_cast<std::int64_t>(kind), static_cast<std::int64_t>(count),
            static_cast<std::int64_t>(type), static_cast<std::int64_t>(op),   root};
  }
  static collective decode(std::span<const std::int64_t, encoded_size> f) {
    collective c;
    c.seq = static_cast<std::uint64_t>(f[0]);
    c.kind = static_cast<collective_kind>(f[1]);
    c.count = static_cast<std::size_t>(f[2]);
    c.type = static_cast<dtype>(f[3]);
    c.op = static_cast<reduce_op>(f[4]);
    c.root = static_cast<int>(f[5]);
    return c;
  }
  bool operator==(const collective&) const = default;
};

namespace detail {
//! Labels comm's next collective when the communicator takes labels (ThreadComm, MpiComm have
//! label_next); `make` builds the label only then.
template <class Comm, class Make>
void label_next_collective(Comm& comm, Make&& make) {
  if constexpr (requires { comm.label_next(std::string{}); }) comm.label_next(make());
}
}  // namespace detail

//! The message check_same_collective throws, if the calls differ: rank 0's call and the first
//! rank whose call differs; `how` says who noticed (e.g. "found by LOCKSTEP_DEBUG=1").
inline std::optional<std::string> collective_mismatch(std::span<const collective> all, const std::string& how) {
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    return "ranks called different collectives: rank 0 called " + all[0].describe() + " but rank " + std::to_string(r) +
           " called " + all[r].describe() + " (every rank must issue the same collectives in the same order; " + how +
           ")";
  }
  return std::nullopt;
}
//! The order check, given every rank's call (labels included): throws mismatch_error with that
//! message. Every rank calls it with the same data, so every rank throws the same.
inline void check_same_collective(std::span<const collective> all, const std::string& how) {
  if (auto why = collective_mismatch(all, how)) throw mismatch_error(*why);
}

}  // namespace lockstep
