#pragma once
//! lockstep::store — the rendezvous key-value store through which the processes of one job
//! find each other (exchange NCCL unique ids, addresses) and line up (barrier). Models:
//! TcpStore (rank 0 hosts it), FileStore (a shared directory), HashStore (one process,
//! here) and MpiStore. Every wait is bounded by a timeout, so a dead rank becomes a
//! timeout_error that names what was missing, never a hang.
//!
//! Values set with set() and counters driven by add() live in separate name spaces: get()
//! and wait() see only set() keys, add(key, 0) reads a counter. (A counter cannot be kept
//! atomic as an ordinary file on a shared filesystem, so FileStore keeps it apart; the
//! rule is the same for every store so code that works on one works on all.)

#include <algorithm>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/detail/checksum.hpp"

namespace lockstep {

//! Bounds every store enforces; the TCP server also uses them to cap what one client may
//! make it hold. A client learns the server's value limit when it connects.
struct store_limits {
  std::size_t max_key_bytes = 512;                       //!< keys are 1..512 bytes
  std::size_t max_value_bytes = std::size_t{1} << 20;    //!< one value: 1 MiB
  std::size_t max_total_bytes = std::size_t{256} << 20;  //!< all values of one store
  std::size_t max_wait_keys = 4096;                      //!< keys in one wait()/check()
};

//! A rendezvous key-value store shared by the `world()` processes of one job.
//!
//! Requirements, for `S& s`, `std::string_view key`, `std::span<const std::byte> value`,
//! `std::vector<std::string> keys`, `std::chrono::milliseconds t`, `std::int64_t d`:
//!  1. `s.set(key, value)` stores a copy of value under key (overwriting), visible to every
//!     process of the job once it returns.
//!  2. `s.get(key)` returns the value, waiting until some process set it, at most
//!     `s.timeout()`; then throws timeout_error naming the key.
//!  3. `s.wait(keys, t)` returns once every key was set; after t throws timeout_error
//!     naming the missing keys.
//!  4. `s.check(keys)` returns whether every key is set, without waiting.
//!  5. `s.add(key, d)` atomically adds d to the counter key (starting at 0) and returns
//!     the new value; counters are apart from set() values (see the file comment).
//!  6. `s.world()` is the number of processes; `s.timeout()` the default wait bound.
//!  7. Keys are 1..store_limits::max_key_bytes bytes, values at most max_value_bytes;
//!     a larger one is a config_error raised before anything is sent.
//!
//! Example:
//! \code
//!   lockstep::TcpStore st(info.master_addr, info.master_port, info.rank == 0, info.world,
//!                         info.job_token);
//!   if (info.rank == 0) st.set("nccl_id", id_bytes);
//!   auto id = st.get("nccl_id");           // waits for rank 0, bounded by LOCKSTEP_TIMEOUT
//!   lockstep::barrier(st, "ready");        // everyone got it
//! \endcode
template <class S>
concept store = requires(S& s, const S& cs, std::string_view key, std::span<const std::byte> value,
                         const std::vector<std::string>& keys, std::chrono::milliseconds t, std::int64_t d) {
  s.set(key, value);
  { s.get(key) } -> std::same_as<std::vector<std::byte>>;
  s.wait(keys, t);
  { s.check(keys) } -> std::same_as<bool>;
  { s.add(key, d) } -> std::same_as<std::int64_t>;
  { cs.world() } -> std::convertible_to<int>;
  { cs.timeout() } -> std::convertible_to<std::chrono::milliseconds>;
};

//! The bytes of a string, for set(); and back, for what get() returned.
inline std::span<const std::byte> bytes_of(std::string_view s) noexcept {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
inline std::string string_of(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

//! The run id of a job token: 8 hex digits that name the run in messages and in a
//! FileStore's directory; "" for no token (an unnamed run). The job token is the run id
//! (launch_info::job_token: LOCKSTEP_JOB_TOKEN, torchrun's run id, Slurm's job and step,
//! Open MPI's job); this is a short fingerprint of it (32 bits of FNV-1a), so a secret token
//! is never printed or written, while two runs' ids differ but for a 1 in 4 billion chance.
inline std::string run_id_of(std::string_view job_token) {
  if (job_token.empty()) return {};
  detail::fnv1a64 h;
  static constexpr std::string_view domain = "lockstep run id:";
  h.update(domain.data(), domain.size());
  h.update(job_token.data(), job_token.size());
  static constexpr char hex[] = "0123456789abcdef";
  const auto v = static_cast<std::uint32_t>(h.value() >> 32);
  std::string out(8, '0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = hex[(v >> (28 - 4 * i)) & 15];
  return out;
}

namespace detail {

//! "run 1a2b3c4d", or "an unnamed run (no job token)", from a run id (run_id_of).
inline std::string run_label(std::string_view run_id) {
  return run_id.empty() ? std::string("an unnamed run (no job token)") : "run " + std::string(run_id);
}

//! A key as it appears in messages: printable, escaped, shortened.
inline std::string printable_key(std::string_view key) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < key.size() && i < 96; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (key.size() > 96) out += "...";
  return out + "'";
}

inline std::string seconds_text(std::chrono::milliseconds t) {
  const auto ms = t.count();
  std::string s = std::to_string(ms / 1000);
  if (ms % 1000 != 0) {
    std::string frac = std::to_string(1000 + ms % 1000).substr(1);
    while (frac.back() == '0') frac.pop_back();
    s += "." + frac;
  }
  return s + " s";
}

inline void check_store_key(std::string_view key, const store_limits& lim, const char* who) {
  if (key.empty()) throw config_error(std::string(who) + ": empty key; give every key a name");
  if (key.size() > lim.max_key_bytes)
    throw config_error(std::string(who) + ": key " + printable_key(key) + " has " + std::to_string(key.size()) +
                       " bytes, more than the limit of " + std::to_string(lim.max_key_bytes) +
                       " (store_limits::max_key_bytes)");
}

inline void check_store_value(std::string_view key, std::size_t n, std::size_t limit, const char* who) {
  if (n > limit)
    throw config_error(std::string(who) + ": value for key " + printable_key(key) + " has " + std::to_string(n) +
                       " bytes, more than the store's limit of " + std::to_string(limit) +
                       " (store_limits::max_value_bytes); split it or raise the limit on every rank");
}

inline void check_store_keys(const std::vector<std::string>& keys, const store_limits& lim, const char* who) {
  if (keys.size() > lim.max_wait_keys)
    throw config_error(std::string(who) + ": " + std::to_string(keys.size()) +
                       " keys in one wait/check, more than the limit of " + std::to_string(lim.max_wait_keys) +
                       " (store_limits::max_wait_keys)");
  for (const auto& k : keys) check_store_key(k, lim, who);
}

//! "wait for 'a', 'b' (+3 more)" — the missing keys of a timed-out wait.
inline std::string store_timeout_message(const std::string& who, const char* op,
                                         const std::vector<std::string>& missing, std::size_t asked,
                                         std::chrono::milliseconds t, int world) {
  std::string m =
      who + ": " + op + " timed out after " + seconds_text(t) + " (world of " + std::to_string(world) + "); ";
  if (missing.empty()) {
    m += "no reply in time";
  } else {
    m += std::to_string(missing.size()) + " of " + std::to_string(asked) + " key(s) never set: ";
    for (std::size_t i = 0; i < missing.size() && i < 4; ++i) m += (i ? ", " : "") + printable_key(missing[i]);
    if (missing.size() > 4) m += " (+" + std::to_string(missing.size() - 4) + " more)";
  }
  return m + ". The rank that sets it failed, hangs, or is slow (then raise LOCKSTEP_TIMEOUT, seconds)";
}

inline std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view key, const char* who) {
  std::int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw config_error(std::string(who) + ": add on counter " + printable_key(key) + " overflows int64");
  return r;
}

}  // namespace detail

namespace detail {
//! s.wait(keys, timeout), but in slices of at most 200 ms, between which `hopeless()` may end
//! the wait by throwing (the keys will never come: e.g. the party that sets them went away).
//! timeout_error after `timeout`, as s.wait.
template <store S, class Hopeless>
  requires std::invocable<Hopeless&>
void wait_unless(S& s, const std::vector<std::string>& keys, std::chrono::milliseconds timeout, Hopeless&& hopeless) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const auto slice = std::min(std::max(left, std::chrono::milliseconds(1)), std::chrono::milliseconds(200));
    try {
      s.wait(keys, slice);
      return;
    } catch (const timeout_error& e) {
      hopeless();
      if (left <= slice)
        throw timeout_error(std::string(e.what()) + " (the last slice of a wait of " + seconds_text(timeout) +
                            " in all)");
    }
  }
}
//! The same, where a set `abort_key` (e.g. the key a failing rank sets) ends the wait with
//! aborted_error carrying its value. An empty abort_key is a plain wait.
template <store S>
void wait_unless(S& s, const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                 std::string_view abort_key) {
  if (abort_key.empty()) {
    s.wait(keys, timeout);
    return;
  }
  wait_unless(s, keys, timeout, [&] {
    if (s.check({std::string(abort_key)})) throw aborted_error("stopped waiting: " + string_of(s.get(abort_key)));
  });
}
}  // namespace detail

//! Blocks until all `s.world()` processes called barrier(s, name) (the same number of
//! times), for at most `timeout`. Built on add() + wait(), so it works with any store.
//! Each use leaves one small key in the store: meant for rendezvous points, not per step.
//! With an abort_key, a rank's failure (that key set) ends the wait at once (aborted_error).
template <store S>
void barrier(S& s, std::string_view name, std::chrono::milliseconds timeout, std::string_view abort_key = {}) {
  const std::string base = "lockstep/barrier/" + std::string(name);
  const std::string counter = base + "/count";
  const std::int64_t world = s.world();
  const std::int64_t n = s.add(counter, 1);
  const std::int64_t generation = (n - 1) / world;
  const std::string done = base + "/done/" + std::to_string(generation);
  if (n % world == 0) {
    static constexpr std::byte one[1] = {std::byte{1}};
    s.set(done, one);
    return;
  }
  try {
    detail::wait_unless(s, {done}, timeout, abort_key);
  } catch (const timeout_error&) {
    std::int64_t arrived = world;
    try {
      arrived = std::min(world, s.add(counter, 0) - generation * world);
    } catch (const error&) {
    }
    throw timeout_error("barrier '" + std::string(name) + "' timed out after " + detail::seconds_text(timeout) + ": " +
                        std::to_string(arrived) + " of " + std::to_string(world) +
                        " ranks arrived. The others failed, hang, or never call this barrier; "
                        "raise LOCKSTEP_TIMEOUT (seconds) if they are only slow");
  }
}
template <store S>
void barrier(S& s, std::string_view name) {
  barrier(s, name, std::chrono::milliseconds(s.timeout()));
}

//! final_barrier's second half over some ranks of the job only (`members`: job ranks, rank 0
//! among them as it hosts the store; an elastic job's survivors, who need no barrier first): each member but rank 0
//! says it has passed, and rank 0 returns once all have (bounded by `timeout`).
template <store S>
void final_barrier_of(S& s, std::string_view name, int rank, std::span<const int> members,
                      std::chrono::milliseconds timeout, std::string_view abort_key = {}) {
  const std::string base = "lockstep/barrier/" + std::string(name) + "/passed/";
  if (rank != 0) {
    static constexpr std::byte one[1] = {std::byte{1}};
    s.set(base + std::to_string(rank), one);
    return;
  }
  std::vector<std::string> keys;
  for (int r : members)
    if (r != 0) keys.push_back(base + std::to_string(r));
  if (!keys.empty()) detail::wait_unless(s, keys, timeout, abort_key);
}

//! The job's last barrier, before the process that hosts the store (rank 0 of a TcpStore)
//! exits. A plain barrier lets its last arriver return while the others may still be on
//! their way to the server to learn that it is done; if that arriver is the host, they would
//! find it gone. Here every rank but 0 says it has passed, and rank 0 returns only once all
//! have: after that nobody needs the store. Each of its two waits is bounded by `timeout`
//! (rank 0 may take up to twice that). Use each name once: it is the job's last barrier.
template <store S>
void final_barrier(S& s, std::string_view name, int rank, std::chrono::milliseconds timeout,
                   std::string_view abort_key = {}) {
  barrier(s, name, timeout, abort_key);
  std::vector<int> everyone(static_cast<std::size_t>(s.world()));
  for (int r = 0; r < s.world(); ++r) everyone[static_cast<std::size_t>(r)] = r;
  final_barrier_of(s, name, rank, everyone, timeout, abort_key);
}
template <store S>
void final_barrier(S& s, std::string_view name, int rank) {
  final_barrier(s, name, rank, std::chrono::milliseconds(s.timeout()));
}

}  // namespace lockstep
