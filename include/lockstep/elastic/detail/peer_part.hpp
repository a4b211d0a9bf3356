#pragma once
//! PeerCopy's pieces (elastic/peer_copy.hpp): what one rank's part of a snapshot holds and
//! where, how it is copied into the communicator's memory without a synchronisation, and
//! how a held part becomes the bytes of a sharded checkpoint section again.
//!
//! A part, in the communicator's memory space: each shard parameter's values, in shard
//! order, then the optimizer's state — a copy of its state_image() (imaged_optimizer), or
//! what its save() wrote. Its head (host bytes, handed to the rank before it with the part):
//! the shard map (sharded_map_of), each shard's element count and type, the state's kind and
//! length.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/checkpoint/sharded.hpp"
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
    w.write(static_cast<std::uint64_t>(map.size()));
    w.write_bytes(map.data(), map.size());
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
    const auto m = r.read<std::uint64_t>();
    if (m > r.remaining()) r.fail("claims a shard map of " + std::to_string(m) + " bytes");
    const auto mb = r.take(static_cast<std::size_t>(m));
    h.map.assign(reinterpret_cast<const char*>(mb.data()), mb.size());
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

}  // namespace lockstep::detail
