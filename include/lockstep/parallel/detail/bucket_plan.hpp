#pragma once
//! The layout of one element type's gradient arena and its buckets.
//!
//! Parameters are laid out in `order` (bucket order: the order gradients are expected to
//! become final). Buckets are element ranges of the arena: the first holds at most
//! first_bytes, the others at most cap_bytes, so a tensor larger than a bucket spans
//! several and a bucket may hold the tails and heads of several tensors. `align` pads
//! each parameter's start (zero-copy arenas align the model's gradient pointers); padding
//! elements stay zero and are reduced harmlessly. `ways` (a sharded optimizer's rank count)
//! makes every bucket length and the arena length a multiple of it, so that each bucket (and
//! each launch unit) splits into `ways` equal shards.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

//! The part of parameter `param` (global index) that lies in one bucket.
struct slice {
  std::size_t param = 0;
  std::size_t param_offset = 0;  //!< first element within the parameter
  std::size_t arena_offset = 0;  //!< first element within the arena
  std::size_t count = 0;
};

struct bucket {
  std::size_t begin = 0, end = 0;  //!< arena element range [begin, end)
  std::vector<slice> slices;
  std::size_t elements() const { return end - begin; }

  //! The slices as the optimizer sees them (values and gradients where `ps` hold them), in out.
  std::span<const param_slice> slices_in(std::span<const parameter> ps, std::vector<param_slice>& out) const {
    out.clear();
    for (const auto& s : slices) {
      const auto& p = ps[s.param];
      const std::size_t es = size_of(p.type);
      out.push_back({s.param, s.param_offset, s.count, p.type, static_cast<char*>(p.value) + s.param_offset * es,
                     static_cast<char*>(p.grad) + s.param_offset * es});
    }
    return out;
  }
  //! The slices' gradients where `ps` hold them (the model's own buffers before binding).
  std::vector<segment> segments_in(std::span<const parameter> ps) const {
    std::vector<segment> segs;
    segs.reserve(slices.size());
    for (const auto& s : slices)
      segs.push_back({static_cast<char*>(ps[s.param].grad) + s.param_offset * size_of(ps[s.param].type), s.count});
    return segs;
  }
};

//! The gradients of buckets [first, last) where `ps` hold them, in arena order.
inline std::vector<segment> segments_of(std::span<const bucket> buckets, std::size_t first, std::size_t last,
                                        std::span<const parameter> ps) {
  std::vector<segment> segs;
  for (std::size_t b = first; b < last; ++b) {
    auto more = buckets[b].segments_in(ps);
    segs.insert(segs.end(), more.begin(), more.end());
  }
  return segs;
}

//! Buckets [first, last) reduced by one collective. Consecutive buckets that hold nothing but
//! slices of one parameter always become complete together (when that parameter does), so
//! they form one unit: fewer, larger all-reduces. Units depend on the plan alone, never on
//! timing, so every rank issues the same collectives.
struct launch_unit {
  std::size_t first = 0, last = 0;
};

struct bucket_plan {
  dtype type = dtype::f32;
  std::vector<launch_unit> units;
  std::vector<std::size_t> order;   //!< global parameter indices, arena order
  std::vector<std::size_t> offset;  //!< arena offset per entry of order
  std::size_t total = 0;            //!< arena length in elements (with padding)
  std::vector<bucket> buckets;
  std::vector<std::vector<std::size_t>> buckets_of;  //!< per entry of order: bucket indices
};

//! The bucket order a first step observed: the parameters in the order `arrivals` first reported
//! them (a repeat, from a later micro-step of the cycle, ignored), then those never reported, in
//! reverse registration order (backward produces the last layer first).
inline std::vector<std::int64_t> observed_order(const std::vector<std::size_t>& arrivals, std::size_t params) {
  std::vector<std::int64_t> order;
  std::vector<bool> seen(params, false);
  for (auto i : arrivals) {
    if (seen[i]) continue;
    order.push_back(static_cast<std::int64_t>(i));
    seen[i] = true;
  }
  for (std::size_t i = params; i-- > 0;)
    if (!seen[i]) order.push_back(static_cast<std::int64_t>(i));
  return order;
}

//! Where a parameter's gradient sits in the reducer: which element-type group, and its
//! position in that group's plan order (PyTorch's Reducer calls this a VariableLocator).
struct gradient_locator {
  std::size_t group = 0;     //!< index into the reducer's groups (one per element type)
  std::size_t position = 0;  //!< index into that group's plan.order / plan.buckets_of
};

inline std::size_t round_up(std::size_t x, std::size_t a) { return a <= 1 ? x : (x + a - 1) / a * a; }

//! sizes[i]: element count of global parameter i (only those listed in order are used).
inline bucket_plan make_bucket_plan(dtype t, std::vector<std::size_t> order, const std::vector<std::size_t>& sizes,
                                    const BucketPolicy& policy, std::size_t align, std::size_t ways = 1) {
  if (policy.first_bytes == 0 || policy.cap_bytes == 0)
    throw config_error("BucketPolicy: first_bytes and cap_bytes must be positive");
  bucket_plan p;
  p.type = t;
  p.order = std::move(order);
  const std::size_t es = size_of(t);
  std::size_t at = 0;
  for (std::size_t k = 0; k < p.order.size(); ++k) {
    at = round_up(at, align);
    p.offset.push_back(at);
    at += sizes[p.order[k]];
  }
  // Bucket boundaries: element counts from the byte caps, kept aligned (and divisible by ways).
  const std::size_t grain = std::lcm(std::max<std::size_t>(align, 1), std::max<std::size_t>(ways, 1));
  p.total = round_up(at, grain);
  const std::size_t first =
      std::max<std::size_t>(round_up(std::max<std::size_t>(policy.first_bytes / es, 1), grain), 1);
  const std::size_t cap = std::max<std::size_t>(round_up(std::max<std::size_t>(policy.cap_bytes / es, 1), grain), 1);
  for (std::size_t b = 0; b < p.total;) {
    const std::size_t len = p.buckets.empty() ? first : cap;
    bucket bk;
    bk.begin = b;
    bk.end = std::min(p.total, b + len);
    p.buckets.push_back(std::move(bk));
    b = p.buckets.back().end;
  }
  // Slices: walk each parameter across the buckets it overlaps.
  p.buckets_of.resize(p.order.size());
  std::size_t bi = 0;
  for (std::size_t k = 0; k < p.order.size(); ++k) {
    const std::size_t n = sizes[p.order[k]];
    std::size_t pos = p.offset[k], end = p.offset[k] + n;
    while (bi < p.buckets.size() && p.buckets[bi].end <= pos) ++bi;
    std::size_t bj = bi;
    while (pos < end) {
      auto& bk = p.buckets[bj];
      const std::size_t take = std::min(end, bk.end) - pos;
      bk.slices.push_back({p.order[k], pos - p.offset[k], pos, take});
      p.buckets_of[k].push_back(bj);
      pos += take;
      if (pos >= bk.end) ++bj;
    }
  }
  // Launch units: merge runs of buckets that each hold slices of one and the same parameter.
  auto sole = [&](const bucket& b) -> std::ptrdiff_t {
    if (b.slices.empty()) return -1;
    for (const auto& s : b.slices)
      if (s.param != b.slices.front().param) return -1;
    return static_cast<std::ptrdiff_t>(b.slices.front().param);
  };
  for (std::size_t b = 0; b < p.buckets.size();) {
    std::size_t e = b + 1;
    const auto owner = sole(p.buckets[b]);
    if (owner >= 0)
      while (e < p.buckets.size() && sole(p.buckets[e]) == owner) ++e;
    p.units.push_back({b, e});
    b = e;
  }
  return p;
}

//! The layout of full sharding (block_units): one bucket and one launch unit per block of the
//! model that has parameters of this type, in backward order (the last block first), each
//! padded to a multiple of `ways` elements; within a block, parameters keep their order in
//! `order`. block_of[i]: global parameter i's block. Fills `blocks`: per unit, its block.
inline bucket_plan make_block_plan(dtype t, const std::vector<std::size_t>& order,
                                   const std::vector<std::size_t>& sizes, const std::vector<std::size_t>& block_of,
                                   std::size_t align, std::size_t ways, std::vector<std::size_t>& blocks) {
  bucket_plan p;
  p.type = t;
  p.order = order;
  std::stable_sort(p.order.begin(), p.order.end(),
                   [&](std::size_t a, std::size_t b) { return block_of[a] > block_of[b]; });
  const std::size_t grain = std::lcm(std::max<std::size_t>(align, 1), std::max<std::size_t>(ways, 1));
  blocks.clear();
  p.buckets_of.resize(p.order.size());
  std::size_t at = 0;
  for (std::size_t k = 0; k < p.order.size(); ++k) {
    const std::size_t i = p.order[k];
    if (k == 0 || block_of[i] != block_of[p.order[k - 1]]) {  // a new block: close the last one
      if (k) {
        at = round_up(at, grain);
        p.buckets.back().end = at;
      }
      bucket bk;
      bk.begin = at;
      p.buckets.push_back(std::move(bk));
      p.units.push_back({p.buckets.size() - 1, p.buckets.size()});
      blocks.push_back(block_of[i]);
    }
    at = round_up(at, align);
    p.offset.push_back(at);
    p.buckets.back().slices.push_back({i, 0, at, sizes[i]});
    p.buckets_of[k].push_back(p.buckets.size() - 1);
    at += sizes[i];
  }
  p.total = round_up(at, grain);
  if (!p.buckets.empty()) p.buckets.back().end = p.total;
  return p;
}

//! "bucket 3: 262144 f32 at 786432" — which bucket's collective a call is (a collective's
//! label): the first bucket of the unit, the elements it reduces and where in the arena.
inline std::string bucket_label(const bucket_plan& p, std::size_t first, std::size_t count,
                                const char* what = "bucket ") {
  return what + std::to_string(first) + ": " + std::to_string(count) + " " + name_of(p.type) + " at " +
         std::to_string(p.buckets[first].begin);
}

//! FNV-1a 64 of a parameter order.
inline std::uint64_t order_hash(const std::vector<std::size_t>& order) {
  std::uint64_t h = 1469598103934665603ull;
  for (auto i : order) {
    h ^= static_cast<std::uint64_t>(i);
    h *= 1099511628211ull;
  }
  return h;
}

//! What ranks compare to check they cut the arena alike: type, sizes, units, order hash.
inline std::string describe_plan(const bucket_plan& p) {
  return std::string(name_of(p.type)) + ": " + std::to_string(p.total) + " elements in " +
         std::to_string(p.buckets.size()) + " buckets (first " +
         std::to_string(p.buckets.empty() ? 0 : p.buckets[0].elements()) + ", units " + std::to_string(p.units.size()) +
         ", order hash " + std::to_string(order_hash(p.order)) + "); ";
}

//! Every rank must cut the arena identically (same BucketPolicy, same zero-copy choice), or
//! their collectives would pair different ranges: each rank's plans against rank 0's.
template <class Comm>
void check_same_plans(Comm& comm, std::span<const bucket_plan* const> plans, bool tuned) {
  if (comm.size() == 1) return;
  std::string mine;
  for (const auto* p : plans) mine += describe_plan(*p);
  if (tuned) mine += "tuned by BucketPolicy::tune; ";  // its probes are collectives
  auto all = host_all_gather_strings(comm, mine);
  for (std::size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0])
      throw mismatch_error("ranks built different gradient bucket plans: rank 0 has " + all[0] + "rank " +
                           std::to_string(r) + " has " + all[r] +
                           "(give every rank the same BucketPolicy and zero_copy setting)");
}

//! The settled layout as a checkpoint holds it: {format 1, observed, fused, n, order...}.
struct plan_state_t {
  bool observed = false;  //!< the first step's arrival order was seen
  bool fused = false;     //!< the model reports no gradient: one all-reduce per type
  std::vector<std::size_t> order;
  std::size_t tuned_cap = 0;  //!< BucketPolicy::tune's cap in bytes (0: not tuned)
};
//! Format 1: {1, observed, fused, n, order...}; format 2, for a tuned plan, adds its cap.
inline std::vector<std::int64_t> encode_plan_state(const plan_state_t& p) {
  std::vector<std::int64_t> st{p.tuned_cap ? 2 : 1, p.observed ? 1 : 0, p.fused ? 1 : 0,
                               static_cast<std::int64_t>(p.order.size())};
  for (auto i : p.order) st.push_back(static_cast<std::int64_t>(i));
  if (p.tuned_cap) st.push_back(static_cast<std::int64_t>(p.tuned_cap));
  return st;
}
//! Reads what encode_plan_state wrote for a model of n parameters; checkpoint_error otherwise.
inline plan_state_t decode_plan_state(std::span<const std::int64_t> st, std::size_t n) {
  const auto bad = [](const std::string& why) {
    return checkpoint_error("the saved gradient bucket layout " + why +
                            "; the checkpoint belongs to another model or is damaged");
  };
  if (st.size() < 4 || (st[0] != 1 && st[0] != 2)) throw bad("has an unknown format");
  const std::size_t extra = st[0] == 2 ? 1 : 0;
  if (static_cast<std::size_t>(st[3]) != n || st.size() != 4 + n + extra)
    throw bad("lists " + std::to_string(st[3]) + " parameters, but the model has " + std::to_string(n));
  plan_state_t p{st[1] != 0, st[2] != 0, {}};
  if (extra) {
    if (st.back() <= 0) throw bad("has a tuned bucket cap of " + std::to_string(st.back()) + " bytes");
    p.tuned_cap = static_cast<std::size_t>(st.back());
  }
  std::vector<bool> seen(n, false);
  for (std::size_t k = 0; k < n; ++k) {
    const auto v = st[4 + k];
    if (v < 0 || static_cast<std::size_t>(v) >= n || seen[static_cast<std::size_t>(v)])
      throw bad("is not a permutation of the parameters");
    seen[static_cast<std::size_t>(v)] = true;
    p.order.push_back(static_cast<std::size_t>(v));
  }
  return p;
}

}  // namespace lockstep::detail
