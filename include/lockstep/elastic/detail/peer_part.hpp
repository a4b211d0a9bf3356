#pragma once
//! PeerCopy's pieces (elastic/peer_copy.hpp): what one rank's part of a snapshot holds and
//! where, how it is copied into the communicator's memory without a synchronisation, and
//! how a held part becomes the bytes of a sharded checkpoint section again, and how the
//! parameters are put together from the parts.
//!
//! A part, in the communicator's memory space: each shard parameter's values, in shard
//! order, then the optimizer's state — a copy of its state_image() (imaged_optimizer), or
//! what its save() wrote. Its head (host bytes, handed to the rank before it with the part):
//! the shard map (sharded_map_of), each shard's element count and type, the state's kind and
//! length.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/checkpoint/checkpoint.hpp"
#include "lockstep/checkpoint/sharded.hpp"
#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/host_memory.hpp"
#include "lockstep/core/codec.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/optim/optimizer.hpp"

namespace lockstep::detail {

struct peer_part_head {
  std::string map;                  // sharded_map_of
  std::vector<param_shape> shards;  // each shard parameter: its values' count and type
  bool imaged = false;              // the state: an image (imaged_optimizer), else save()'s bytes
  std::uint64_t state_bytes = 0;

  std::size_t value_bytes() const {
    std::size_t b = 0;
    for (const auto& s : shards) b += s.numel * size_of(s.type);
    return b;
  }
  std::size_t bytes() const { return value_bytes() + static_cast<std::size_t>(state_bytes); }
  bool operator==(const peer_part_head&) const = default;

  std::string encode() const {
    byte_writer w;
    w.write_string(map);
    w.write(static_cast<std::uint64_t>(shards.size()));
    for (const auto& s : shards) {
      w.write(static_cast<std::uint64_t>(s.numel));
      w.write(static_cast<std::uint8_t>(s.type));
    }
    w.write(static_cast<std::uint8_t>(imaged ? 1 : 0));
    w.write(state_bytes);
    const auto b = std::move(w).release();
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  static peer_part_head decode(std::string_view s) {
    byte_reader r(std::as_bytes(std::span(s.data(), s.size())), "the head of a peer copy's part");
    peer_part_head h;
    h.map = r.read_string();
    const auto n = r.read<std::uint64_t>();
    if (n > r.remaining() / 9) r.fail("claims " + std::to_string(n) + " shards");
    for (std::uint64_t j = 0; j < n; ++j) {
      param_shape p;
      p.numel = static_cast<std::size_t>(r.read<std::uint64_t>());
      const auto t = r.read<std::uint8_t>();
      if (t > static_cast<std::uint8_t>(dtype::f64)) r.fail("names element type " + std::to_string(t));
      p.type = static_cast<dtype>(t);
      h.shards.push_back(p);
    }
    h.imaged = r.read<std::uint8_t>() != 0;
    h.state_bytes = r.read<std::uint64_t>();
    return h;
  }
};

//! What a survivor that holds a snapshot tells the others at a restore, so that every rank —
//! a replacement that joined holds none — knows it: the snapshot's members (job ranks when it
//! was taken), its replicated training state (no parameters) and the layout it was cut from.
struct peer_snapshot {
  std::vector<int> members;
  Checkpoint state;
  sharded_origin origin;

  std::string encode() const {
    byte_writer w;
    std::vector<std::int64_t> ranks(members.begin(), members.end());
    w.write_array(ranks);
    w.write(state.meta.step);
    w.write(state.meta.epoch);
    w.write(state.meta.sample_position);
    const auto names = state.section_names();
    w.write(static_cast<std::uint64_t>(names.size()));
    for (const auto& name : names) {
      const auto b = state.blob(name);
      w.write_string(name);
      w.write_string(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
    }
    w.write(origin.layout);
    w.write_array(origin.lengths);
    const auto b = std::move(w).release();
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  static peer_snapshot decode(std::string_view s) {
    byte_reader r(std::as_bytes(std::span(s.data(), s.size())), "a survivor's account of a peer copy's snapshot");
    peer_snapshot p;
    for (const auto k : r.read_array<std::int64_t>()) p.members.push_back(static_cast<int>(k));
    p.state.meta.step = r.read<std::int64_t>();
    p.state.meta.epoch = r.read<std::int64_t>();
    p.state.meta.sample_position = r.read<std::int64_t>();
    const auto sections = r.read<std::uint64_t>();
    if (sections > r.remaining() / 16) r.fail("claims " + std::to_string(sections) + " sections");
    for (std::uint64_t k = 0; k < sections; ++k) {
      auto name = r.read_string();
      const auto bytes = r.read_string();
      p.state.add_blob(std::move(name), std::string_view(bytes));
    }
    p.origin.layout = r.read<std::uint64_t>();
    p.origin.lengths = r.read_array<std::uint64_t>();
    return p;
  }
};

//! A snapshot a survivor holds, as it tells the others at a restore: its step, whether this
//! rank saw its seal complete, what it is.
struct peer_holding {
  std::int64_t step = -1;
  bool sealed = false;
  peer_snapshot snap;
};

inline std::string encode_holdings(const std::vector<peer_holding>& held) {
  byte_writer w;
  w.write(static_cast<std::uint64_t>(held.size()));
  for (const auto& h : held) {
    w.write(h.step);
    w.write(static_cast<std::uint8_t>(h.sealed ? 1 : 0));
    w.write_string(h.snap.encode());
  }
  const auto b = std::move(w).release();
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}
inline std::vector<peer_holding> decode_holdings(std::string_view s) {
  byte_reader r(std::as_bytes(std::span(s.data(), s.size())), "a survivor's account of its peer copy");
  const auto n = r.read<std::uint64_t>();
  if (n > 2) r.fail("claims " + std::to_string(n) + " snapshots (a rank holds at most 2)");
  std::vector<peer_holding> held(static_cast<std::size_t>(n));
  for (auto& h : held) {
    h.step = r.read<std::int64_t>();
    h.sealed = r.read<std::uint8_t>() != 0;
    h.snap = peer_snapshot::decode(r.read_string());
  }
  return held;
}

//! The snapshot a restore goes on from — the same decision on every survivor, made from what
//! all told (told[i]: what the survivor of job rank ranks[i] holds): the newest of which every
//! member's part is there, held by the member itself or — once a survivor saw its seal
//! complete, so that every copy had arrived — by the rank before it.
struct peer_choice {
  std::int64_t step = -1;  // none can be put together: -1
  bool sealed = false;     // a survivor saw its seal complete
  const peer_snapshot* snap = nullptr;
  std::vector<int> provider;  // the job rank that gives each member's part (in `snap->members` order)
  std::vector<int> lost;      // none: the parts missing from the newest sealed snapshot
};

inline peer_choice choose_peer_snapshot(const std::vector<std::vector<peer_holding>>& told,
                                        std::span<const int> ranks) {
  std::vector<std::int64_t> steps;
  for (const auto& held : told)
    for (const auto& h : held) steps.push_back(h.step);
  std::sort(steps.begin(), steps.end(), std::greater<>());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  peer_choice c;
  bool reported = false;
  for (const std::int64_t s : steps) {
    const peer_holding* any = nullptr;
    bool sealed = false;
    const auto holder = [&](int job_rank) {  // job_rank, alive and holding s
      const auto at = std::find(ranks.begin(), ranks.end(), job_rank);
      if (at == ranks.end()) return false;
      const auto& held = told[static_cast<std::size_t>(at - ranks.begin())];
      return std::any_of(held.begin(), held.end(), [&](const peer_holding& h) { return h.step == s; });
    };
    for (const auto& held : told)
      for (const auto& h : held) {
        if (h.step != s) continue;
        if (any && h.snap.members != any->snap.members)
          throw checkpoint_error("PeerCopy::restore: the survivors hold snapshots of step " + std::to_string(s) +
                                 " taken by different groups; were they saved with the same step numbers?");
        any = any ? any : &h;
        sealed = sealed || h.sealed;
      }
    const auto& m = any->snap.members;
    std::vector<int> provider, missing;
    for (std::size_t q = 0; q < m.size(); ++q) {
      const int before = m[(q + m.size() - 1) % m.size()];
      if (holder(m[q])) provider.push_back(m[q]);
      else if (sealed && holder(before)) provider.push_back(before);
      else missing.push_back(m[q]);
    }
    if (missing.empty()) {
      c.lost.clear();  // (an older snapshot is whole: nothing was lost)
      c.step = s;
      c.sealed = sealed;
      c.snap = &any->snap;
      c.provider = std::move(provider);
      return c;
    }
    if (sealed && !reported) {
      c.lost = std::move(missing);
      reported = true;
    }
  }
  return c;
}

//! This rank's head: `state_bytes` of the state to come.
template <class DP>
peer_part_head peer_head_of(DP& dp, bool imaged, std::size_t state_bytes) {
  peer_part_head h;
  h.map = sharded_map_of(dp);
  for (const auto& p : dp.shard_parameters()) h.shards.push_back({p.numel(), p.type});
  h.imaged = imaged;
  h.state_bytes = state_bytes;
  return h;
}

//! dst ← the byte ranges `from` one after another, copied in the widest unit that divides
//! every length (one pack() of the memory space: a kernel on its stream, or a host copy).
template <class Mem>
void pack_bytes(const Mem& mem, std::span<const std::pair<const void*, std::size_t>> from, void* dst) {
  std::size_t unit = 8;
  for (const auto& [p, n] : from)
    while (unit > 1 && (n % unit != 0 || reinterpret_cast<std::uintptr_t>(p) % unit != 0)) unit /= 2;
  const dtype t = unit == 8 ? dtype::i64 : unit == 4 ? dtype::i32 : unit == 2 ? dtype::bf16 : dtype::u8;
  std::vector<segment> segs;
  for (const auto& [p, n] : from)
    if (n) segs.push_back({const_cast<void*>(p), n / unit});
  if (!segs.empty()) mem.pack(std::span<const segment>(segs), dst, t, 1.0);
}

//! A held part (host bytes, laid out as `h` says) as a part of a sharded section, and its
//! values. `opt`: an optimizer of the same kind (for an image: its save_image()).
template <class Opt>
std::string sharded_part_from(const peer_part_head& h, std::span<const std::byte> held, const Opt& opt) {
  if (held.size() < h.bytes())
    throw checkpoint_error("PeerCopy: a held part has " + std::to_string(held.size()) + " bytes, its head says " +
                           std::to_string(h.bytes()));
  const auto state = held.subspan(h.value_bytes(), static_cast<std::size_t>(h.state_bytes));
  if (!h.imaged) return sharded_part(h.map, state);
  if constexpr (imaged_optimizer<Opt>) {
    byte_writer w;
    opt.save_image(h.shards, state, w);
    const auto bytes = std::move(w).release();
    return sharded_part(h.map, bytes);
  } else {
    throw config_error("PeerCopy::restore: the snapshot holds an optimizer's state image, but the optimizer "
                       "given to restore() reads none; restore with the same kind of optimizer");
  }
}

//! The parameters of a PeerCopy snapshot, put together from every part's shard values through
//! its shard map (parts: sharded parts, heads: their encoded heads), into `ck` (host memory).
template <class DP>
void add_peer_parameters(Checkpoint& ck, DP& dp, const sharded_origin& origin, const std::vector<std::string>& heads,
                         const std::vector<std::string>& parts, const std::vector<std::string>& values) {
  std::vector<parameter> ps(dp.parameters().begin(), dp.parameters().end());
  const auto fail = [](const std::string& why) { throw checkpoint_error("PeerCopy::restore: " + why); };
  if (ps.size() != origin.lengths.size())
    fail("the snapshot is of " + std::to_string(origin.lengths.size()) + " parameters, the DataParallel has " +
         std::to_string(ps.size()));
  std::vector<std::vector<std::byte>> host(ps.size());
  std::vector<std::size_t> filled(ps.size(), 0);
  for (std::size_t i = 0; i < ps.size(); ++i) {
    if (ps[i].numel() != origin.lengths[i])
      fail("parameter '" + ps[i].name + "' has " + std::to_string(ps[i].numel()) + " elements, the snapshot " +
           std::to_string(origin.lengths[i]));
    host[i].resize(ps[i].bytes());
  }
  for (std::size_t q = 0; q < parts.size(); ++q) {
    const auto head = peer_part_head::decode(heads[q]);
    const auto part =
        read_sharded_part(std::as_bytes(std::span(parts[q].data(), parts[q].size())), static_cast<std::uint32_t>(q));
    if (part.map.size() != head.shards.size() || values[q].size() != head.value_bytes())
      fail("part " + std::to_string(q) + "'s head does not match its shard map");
    std::size_t base = 0;  // the shard's first byte in this part's values
    for (std::size_t j = 0; j < part.map.size(); ++j) {
      const std::size_t width = size_of(head.shards[j].type);
      if (part.counts[j] != head.shards[j].numel)
        fail("part " + std::to_string(q) + "'s shard " + std::to_string(j) + " holds " +
             std::to_string(head.shards[j].numel) + " values, its map says " + std::to_string(part.counts[j]));
      for (const auto& s : part.map[j]) {
        if (s.param >= ps.size() || s.param_offset + s.count > ps[s.param].numel() ||
            ps[s.param].type != head.shards[j].type)
          fail("part " + std::to_string(q) + " maps shard " + std::to_string(j) + " outside the parameters");
        std::memcpy(host[s.param].data() + s.param_offset * width, values[q].data() + base + s.slot_offset * width,
                    s.count * width);
        filled[s.param] += s.count;
      }
      base += head.shards[j].numel * width;
    }
  }
  for (std::size_t i = 0; i < ps.size(); ++i) {
    if (filled[i] != ps[i].numel())
      fail("the parts hold " + std::to_string(filled[i]) + " of parameter '" + ps[i].name + "''s " +
           std::to_string(ps[i].numel()) + " elements");
    ps[i].value = host[i].data();
  }
  ck.add_parameters(ps, HostMemory{});
}

//! Every survivor of a PeerCopy::restore throws `problem`, or names another survivor's, when
//! any has one (collective).
template <class Comm>
void peer_agree_or_throw(Comm& comm, const std::string& problem, std::int64_t agreed) {
  std::int64_t bad = problem.empty() ? 0 : 1;
  host_all_reduce(comm, std::span<std::int64_t>(&bad, 1), reduce_op::max);
  if (bad != 0)
    throw checkpoint_error("PeerCopy::restore: " + (problem.empty()
                                                        ? "another survivor cannot restore the snapshot of step " +
                                                              std::to_string(agreed) + " (its error says why)"
                                                        : problem));
}

}  // namespace lockstep::detail
