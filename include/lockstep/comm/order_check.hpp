#pragma once
//! The order check of the process communicators (MpiComm, NcclComm): before each collective,
//! every rank's description of it (its *seal*: the collective's descriptor, its label's hash
//! and text) is all-gathered, a small collective of fixed size, and compared with rank 0's.
//! Seals pair up even where the collectives they describe do not (another count or kind, an
//! extra call on one rank), so every rank names both calls: "rank 0 called all_reduce #24 …
//! for bucket 3 … but rank 1 called all_reduce #24 … for bucket 4 …".
//!
//! Modes (order_check_mode_from_env):
//!  - deferred (the default): the seal is issued ahead of the collective and compared once it
//!    has arrived, without waiting for it — when a later collective is issued, while a wait
//!    polls, from the watchdog, at the end of the run — so no step waits on the host. A
//!    mismatch is found one or a few collectives late; the communicator then refuses every
//!    later call with it.
//!  - immediate (LOCKSTEP_DEBUG=1, or LOCKSTEP_CHECK_ORDER=sync): each seal is waited for and
//!    compared before its collective starts, so nothing runs on mismatched calls (a host round
//!    trip per collective).
//!  - off (LOCKSTEP_CHECK_ORDER=off or 0).
//! ThreadComm compares every call anyway, in its rendezvous (no seal).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

enum class order_check_mode : std::uint8_t { off, deferred, immediate };

namespace detail {

//! LOCKSTEP_DEBUG=1 → immediate; else LOCKSTEP_CHECK_ORDER = off|0, deferred (default), sync.
inline order_check_mode order_check_mode_from_env() {
  if (const auto d = env("LOCKSTEP_DEBUG"); d && *d != "0") return order_check_mode::immediate;
  const auto v = env("LOCKSTEP_CHECK_ORDER");
  if (!v || *v == "deferred" || *v == "1") return order_check_mode::deferred;
  if (*v == "off" || *v == "0") return order_check_mode::off;
  if (*v == "sync" || *v == "immediate") return order_check_mode::immediate;
  throw config_error("LOCKSTEP_CHECK_ORDER='" + *v +
                     "' is not a mode of the order check: use deferred (the default), sync (wait for each "
                     "check, as LOCKSTEP_DEBUG=1), or off");
}

//! Who found a mismatch, for the message's tail.
inline std::string order_check_how(order_check_mode m, const std::string& group) {
  std::string how = m == order_check_mode::immediate
                        ? "found by LOCKSTEP_DEBUG=1"
                        : "found by the order check, which compares every collective's description across ranks "
                          "behind the training (LOCKSTEP_CHECK_ORDER=off turns it off)";
  return group.empty() ? how : "in " + group + ", " + how;
}

// A seal's words: the descriptor, the label's hash, then the label's text (truncated to
// label_words·8 − 1 bytes, NUL-padded), so a mismatch names both buckets.
inline constexpr std::size_t label_words = 16;
inline constexpr std::size_t order_words = collective::encoded_size + 1 + label_words;
using seal_words = std::array<std::int64_t, order_words>;

inline seal_words encode_order(const collective& c) {
  seal_words w{};
  const auto e = c.encode();
  std::copy(e.begin(), e.end(), w.begin());
  w[collective::encoded_size] = c.label_hash();
  char text[label_words * 8] = {};
  std::memcpy(text, c.label.data(), std::min(c.label.size(), sizeof text - 1));
  std::memcpy(w.data() + collective::encoded_size + 1, text, sizeof text);
  return w;
}

//! Every rank's call from the gathered words; a label too long for the words ends in "…#<hash>"
//! so that two long labels that differ only past the cut still compare different.
inline std::vector<collective> decode_order(std::span<const std::int64_t> all, int ranks) {
  std::vector<collective> calls;
  for (int r = 0; r < ranks; ++r) {
    const auto w = all.subspan(static_cast<std::size_t>(r) * order_words, order_words);
    collective c = collective::decode(w.first<collective::encoded_size>());
    char text[label_words * 8];
    std::memcpy(text, w.data() + collective::encoded_size + 1, sizeof text);
    text[sizeof text - 1] = '\0';
    c.label = text;
    const std::int64_t hash = w[collective::encoded_size];
    if (c.label.size() == sizeof text - 1 || (hash != 0 && c.label.empty())) c.label += "…#" + std::to_string(hash);
    calls.push_back(std::move(c));
  }
  return calls;
}

//! The mismatch the gathered seals show (every rank's words, rank r's at r · order_words), if
//! any — the same text on every rank, since every rank gathered the same words. The words are
//! compared first; only a mismatch is decoded and described (how(): who found it).
template <class How>
std::optional<std::string> seal_mismatch(std::span<const std::int64_t> all, int ranks, How&& how) {
  const auto mine = all.first(order_words);
  bool same = true;
  for (int r = 1; same && r < ranks; ++r)
    same = std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(r * order_words));
  if (same) return std::nullopt;
  const auto calls = decode_order(all, ranks);
  return collective_mismatch(std::span<const collective>(calls), how());
}

//! Every rank must run the order check alike (a rank that sends seals pairs them with another's
//! collectives): the modes of all ranks, off or not, as one flag each; a config_error naming
//! the variable if they differ. `on` is every rank's (mode != off).
inline void check_same_order_mode(bool any_on, bool all_on) {
  if (any_on != all_on)
    throw config_error("the order check is off on some ranks and on on others (LOCKSTEP_CHECK_ORDER, "
                       "LOCKSTEP_DEBUG): give every rank the same setting — with mpirun on several hosts, "
                       "pass the variable with -x");
}

}  // namespace detail
}  // namespace lockstep
