#pragma once
//! TcpStore's wire protocol: the frame encoder, a strict, bounded, incremental frame
//! parser, and the server's per-connection state machine (`store_engine`). The engine
//! owns no socket and reads no clock, so the fuzzer drives it with bytes and times alone.
//!
//! A frame, all integers little-endian:
//!   0  'L' 'S'        magic
//!   2  u8  op         request (client → server) or reply (server → client), see `op`
//!   3  u8  0          reserved
//!   4  u16 key_len    1..max_key for set/get/add, 0 otherwise
//!   6  u16 0          reserved
//!   8  u32 value_len  bounded per op (≤ max_value; a token ≤ 256)
//!  12  i64 arg        timeout in ms (get, wait), delta (add), version (hello), code (err),
//!                     flags (set: 1 = only if absent), heartbeat limit in ms (watch)
//!  20  key, value
//!  ..  u32 CRC-32 of everything before it
//! The first request must be `hello` carrying the job token; anything else, a wrong token
//! or a malformed frame gets one `err` reply and the connection is closed.
//!
//! Liveness (protocol 2): a connection may `watch` a key. From then on the server sets that
//! key (unless some value is there already: the first failure wins) when the connection
//! closes without an `unwatch` first — the process died — or, when a heartbeat limit was
//! given, when no request arrived on it for that long — the process is stopped or hung (a
//! request parked on the server does not count as a heartbeat).
//! The value is the watch's own text (e.g. "rank 3") followed by what happened.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/detail/byte_io.hpp"
#include "lockstep/detail/checksum.hpp"
#include "lockstep/store.hpp"

namespace lockstep::detail::wire {

inline constexpr std::byte magic0{'L'};
inline constexpr std::byte magic1{'S'};
inline constexpr std::int64_t protocol_version = 2;
inline constexpr std::size_t header_bytes = 20;
inline constexpr std::size_t trailer_bytes = 4;
inline constexpr std::size_t max_token_bytes = 256;
inline constexpr std::size_t max_message_bytes = 4096;  //!< err reply text
//! Upper bound on any size a server may announce, so a client never trusts a huge one.
inline constexpr std::size_t max_announced_value = std::size_t{1} << 30;

enum class op : std::uint8_t {
  hello = 1,  //!< value: job token; arg: protocol version
  set = 2,    //!< key, value
  get = 3,    //!< key; arg: timeout ms. Answered once the key exists or at the timeout
  add = 4,    //!< key; arg: delta
  wait = 5,   //!< value: key list; arg: timeout ms
  check = 6,  //!< value: key list
  watch = 7,  //!< key: set on failure; value: who (1..max_message bytes); arg: heartbeat limit ms (0: none)
  unwatch = 8,  //!< no key, no value: a clean leave, the watch no longer fires
  ok = 0x81,  //!< reply. get: value; add: arg = new total; check: arg = 0/1; hello: limits
  err = 0x82  //!< reply. arg: err_code; value: message text
};

enum class err_code : std::int64_t {
  malformed = 1,  //!< not a valid frame or request; the connection is closed
  bad_token = 2,  //!< hello missing or wrong job token / version; closed
  too_large = 3,  //!< the value or key list exceeds the server's limits
  timeout = 4,    //!< get/wait deadline passed; value lists what was missing
  full = 5,       //!< the store holds max_total_bytes already
  overflow = 6,   //!< add would overflow int64
  busy = 7        //!< the server has max_connections open; closed
};

inline bool is_request(op o) { return o >= op::hello && o <= op::unwatch; }
inline bool is_reply(op o) { return o == op::ok || o == op::err; }

struct frame {
  op type = op::ok;
  std::int64_t arg = 0;
  std::string key;
  std::vector<std::byte> value;
};

//! Appends one frame to `out`.
inline void encode(std::vector<std::byte>& out, op type, std::int64_t arg, std::string_view key,
                   std::span<const std::byte> value) {
  const std::size_t start = out.size();
  out.resize(start + header_bytes + key.size() + value.size() + trailer_bytes);
  std::byte* p = out.data() + start;
  p[0] = magic0;
  p[1] = magic1;
  p[2] = static_cast<std::byte>(type);
  p[3] = std::byte{0};
  store_le(p + 4, static_cast<std::uint16_t>(key.size()));
  store_le(p + 6, std::uint16_t{0});
  store_le(p + 8, static_cast<std::uint32_t>(value.size()));
  store_le(p + 12, arg);
  std::copy(key.begin(), key.end(), reinterpret_cast<char*>(p + header_bytes));
  std::copy(value.begin(), value.end(), p + header_bytes + key.size());
  const std::size_t body = header_bytes + key.size() + value.size();
  store_le(p + body, crc32_of(p, body));
}

//! A key list (wait, check): u32 count, then per key u16 length + bytes.
inline std::vector<std::byte> encode_key_list(const std::vector<std::string>& keys) {
  std::size_t n = 4;
  for (const auto& k : keys) n += 2 + k.size();
  std::vector<std::byte> out(n);
  store_le(out.data(), static_cast<std::uint32_t>(keys.size()));
  std::size_t at = 4;
  for (const auto& k : keys) {
    store_le(out.data() + at, static_cast<std::uint16_t>(k.size()));
    std::copy(k.begin(), k.end(), reinterpret_cast<char*>(out.data() + at + 2));
    at += 2 + k.size();
  }
  return out;
}

//! Strict inverse of encode_key_list: 1..max_keys keys of 1..max_key bytes, nothing left over.
inline bool decode_key_list(std::span<const std::byte> in, std::size_t max_keys, std::size_t max_key,
                            std::vector<std::string>& keys) {
  keys.clear();
  if (in.size() < 4) return false;
  const std::uint32_t count = load_le<std::uint32_t>(in.data());
  if (count == 0 || count > max_keys) return false;
  std::size_t at = 4;
  keys.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    if (in.size() - at < 2) return false;
    const std::size_t len = load_le<std::uint16_t>(in.data() + at);
    at += 2;
    if (len == 0 || len > max_key || in.size() - at < len) return false;
    keys.emplace_back(reinterpret_cast<const char*>(in.data() + at), len);
    at += len;
  }
  return at == in.size();
}

//! The limits the server announces in its hello reply (value: three u64).
inline std::vector<std::byte> encode_limits(const store_limits& lim) {
  std::vector<std::byte> v(24);
  store_le(v.data(), static_cast<std::uint64_t>(lim.max_key_bytes));
  store_le(v.data() + 8, static_cast<std::uint64_t>(lim.max_value_bytes));
  store_le(v.data() + 16, static_cast<std::uint64_t>(lim.max_wait_keys));
  return v;
}
inline std::optional<store_limits> decode_limits(std::span<const std::byte> v) {
  if (v.size() != 24) return std::nullopt;
  store_limits lim;
  const auto k = load_le<std::uint64_t>(v.data());
  const auto val = load_le<std::uint64_t>(v.data() + 8);
  const auto w = load_le<std::uint64_t>(v.data() + 16);
  if (k == 0 || k > 65535 || val > max_announced_value || w == 0 || w > (1u << 24)) return std::nullopt;
  lim.max_key_bytes = static_cast<std::size_t>(k);
  lim.max_value_bytes = static_cast<std::size_t>(val);
  lim.max_wait_keys = static_cast<std::size_t>(w);
  return lim;
}

//! Compares a presented token with the expected one in time that does not depend on
//! where they differ.
inline bool token_equal(std::span<const std::byte> given, std::string_view expected) noexcept {
  const std::size_t n = std::max(given.size(), expected.size());
  unsigned diff = given.size() == expected.size() ? 0u : 1u;
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned a = i < given.size() ? static_cast<unsigned>(given[i]) : 0u;
    const unsigned b = i < expected.size() ? static_cast<unsigned char>(expected[i]) : 0u;
    diff |= a ^ b;
  }
  return diff == 0;
}

//! Incremental parser: feed() bytes as they arrive, in pieces of any size; it stops at the
//! end of each frame so the caller can act on it (take()) before feeding the rest. Every
//! bound is checked on the header, before the body is buffered; a failure is final.
class frame_parser {
 public:
  enum class state { need_more, ready, failed };

  //! replies: parse server replies (client side); otherwise requests (server side).
  frame_parser(bool replies, const store_limits& lim) : replies_(replies), lim_(lim) {}

  //! Consumes bytes up to the end of the next frame; returns how many it used.
  std::size_t feed(std::span<const std::byte> in) {
    if (state_ != state::need_more) return 0;
    std::size_t used = 0;
    while (used < in.size()) {
      if (head_n_ < header_bytes) {
        const std::size_t n = std::min(header_bytes - head_n_, in.size() - used);
        std::copy_n(in.data() + used, n, head_.data() + head_n_);
        head_n_ += n;
        used += n;
        if (head_[0] != magic0 || (head_n_ >= 2 && head_[1] != magic1)) return fail(used, "bad magic (not a lockstep store frame)");
        if (head_n_ == header_bytes && !check_header()) return used;
        continue;
      }
      const std::size_t n = std::min(body_need_ - body_.size(), in.size() - used);
      body_.insert(body_.end(), in.begin() + static_cast<std::ptrdiff_t>(used),
                   in.begin() + static_cast<std::ptrdiff_t>(used + n));
      used += n;
      if (body_.size() == body_need_) {
        finish();
        return used;
      }
    }
    return used;
  }

  state status() const noexcept { return state_; }
  const std::string& error() const noexcept { return error_; }

  //! The parsed frame; the parser then waits for the next one. Requires status() == ready.
  frame take() {
    state_ = state::need_more;
    return std::move(frame_);
  }

  //! After the hello reply the client adopts the server's limits.
  void set_limits(const store_limits& lim) { lim_ = lim; }

 private:
  std::size_t fail(std::size_t used, const char* why) {
    state_ = state::failed;
    error_ = why;
    return used;
  }

  bool check_header() {
    const auto type = static_cast<op>(head_[2]);
    const std::size_t key_len = load_le<std::uint16_t>(head_.data() + 4);
    const std::size_t value_len = load_le<std::uint32_t>(head_.data() + 8);
    const auto arg = load_le<std::int64_t>(head_.data() + 12);
    if (head_[3] != std::byte{0} || load_le<std::uint16_t>(head_.data() + 6) != 0)
      return fail(0, "reserved header bytes are not zero"), false;
    if (replies_ ? !is_reply(type) : !is_request(type)) return fail(0, "unknown op"), false;
    const bool keyed = type == op::set || type == op::get || type == op::add || type == op::watch;
    if (keyed ? (key_len == 0 || key_len > lim_.max_key_bytes) : key_len != 0)
      return fail(0, "key length out of bounds"), false;
    std::size_t max_value = 0;
    switch (type) {
      case op::hello: max_value = max_token_bytes; break;
      case op::set: max_value = lim_.max_value_bytes; break;
      case op::wait:
      case op::check: max_value = lim_.max_value_bytes; break;
      case op::ok: max_value = std::max<std::size_t>(lim_.max_value_bytes, 24); break;
      case op::err:
      case op::watch: max_value = max_message_bytes; break;
      default: max_value = 0; break;
    }
    if (value_len > max_value) return fail(0, "value length exceeds the limit"), false;
    if (type == op::watch && value_len == 0) return fail(0, "a watch without its text"), false;
    if (type == op::set && arg != 0 && arg != 1) return fail(0, "unknown set flags"), false;
    if (type == op::watch && arg < 0) return fail(0, "negative heartbeat limit"), false;
    if ((type == op::wait || type == op::check) && value_len < 4) return fail(0, "empty key list"), false;
    if ((type == op::get || type == op::wait) && arg < 0) return fail(0, "negative timeout"), false;
    frame_.type = type;
    frame_.arg = arg;
    key_len_ = key_len;
    body_need_ = key_len + value_len + trailer_bytes;
    body_.clear();
    return true;
  }

  void finish() {
    crc32 c;
    c.update(head_.data(), header_bytes);
    c.update(body_.data(), body_.size() - trailer_bytes);
    if (c.value() != load_le<std::uint32_t>(body_.data() + body_.size() - trailer_bytes)) {
      fail(0, "CRC mismatch");
      return;
    }
    frame_.key.assign(reinterpret_cast<const char*>(body_.data()), key_len_);
    frame_.value.assign(body_.begin() + static_cast<std::ptrdiff_t>(key_len_), body_.end() - trailer_bytes);
    head_n_ = 0;
    body_.clear();
    body_.shrink_to_fit();  // a large value must not stay allocated per connection
    state_ = state::ready;
  }

  bool replies_;
  store_limits lim_;
  state state_ = state::need_more;
  std::string error_;
  std::array<std::byte, header_bytes> head_{};
  std::size_t head_n_ = 0;
  std::size_t key_len_ = 0;
  std::size_t body_need_ = 0;
  std::vector<std::byte> body_;
  frame frame_;
};

//! The server's state: values, counters and one session per connection. The socket loop
//! feeds it received bytes (receive), sends what out() holds, closes what should_close()
//! says, and calls tick() at next_deadline(). No method throws except on allocation
//! failure; a client's misbehaviour only closes that client's connection.
class store_engine {
 public:
  using clock = std::chrono::steady_clock;
  using conn_id = std::uint64_t;

  store_engine(std::string token, store_limits lim, std::size_t max_connections,
               std::chrono::milliseconds auth_timeout)
      : token_(std::move(token)), lim_(lim), max_conns_(max_connections), auth_timeout_(auth_timeout) {}

  //! A new connection from `peer` (for logs); nullopt when max_connections are open.
  std::optional<conn_id> open(std::string peer, clock::time_point now) {
    if (conns_.size() >= max_conns_) {
      log_.push_back("refused a connection from " + peer + ": " + std::to_string(max_conns_) +
                     " connections are open already (world + slack)");
      return std::nullopt;
    }
    const conn_id id = next_id_++;
    auto& c = conns_.emplace(id, conn(lim_)).first->second;
    c.peer = std::move(peer);
    c.auth_deadline = now + auth_timeout_;
    return id;
  }

  void close(conn_id id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    unpark(it->second, id);
    if (it->second.watched)
      fire(it->second, "left: its connection to the store closed before it finished (the process exited or was killed)");
    conns_.erase(it);
  }

  //! Bytes received on `id`; only call while wants_read(id).
  void receive(conn_id id, std::span<const std::byte> data, clock::time_point now) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    it->second.in.insert(it->second.in.end(), data.begin(), data.end());
    runnable_.push_back(id);
    drain(now);
  }

  //! The first n bytes of out(id) were sent.
  void sent(conn_id id, std::size_t n, clock::time_point now) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    auto& out = it->second.out;
    out.erase(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(std::min(n, out.size())));
    runnable_.push_back(id);
    drain(now);
  }

  //! Answers waits whose deadline passed and closes connections that never authenticated.
  void tick(clock::time_point now) {
    for (auto& [id, c] : conns_) {
      if (c.parked && c.deadline <= now) {
        std::vector<std::string> missing;
        for (std::size_t i = c.cursor; i < c.keys.size(); ++i)
          if (values_.find(c.keys[i]) == values_.end()) missing.push_back(c.keys[i]);
        std::string msg = std::to_string(missing.size()) + " of " + std::to_string(c.keys.size()) +
                          " key(s) never set: ";
        for (std::size_t i = 0; i < missing.size() && i < 4; ++i)
          msg += (i ? ", " : "") + printable_key(missing[i]);
        if (missing.size() > 4) msg += " (+" + std::to_string(missing.size() - 4) + " more)";
        unpark(c, id);
        reply_err(c, err_code::timeout, msg);
        runnable_.push_back(id);
      }
      if (!c.authed && !c.closing && c.auth_deadline <= now) {
        log_.push_back("closed the connection from " + c.peer + ": no hello with the job token in time");
        c.closing = true;
      }
      if (c.watched && c.watch_limit.count() > 0 && c.last_seen + c.watch_limit <= now)
        fire(c, "stopped responding: no heartbeat for " + seconds_text(c.watch_limit) +
                    " (the process is stopped, hung or cut off)");
    }
    drain(now);
  }

  std::optional<clock::time_point> next_deadline() const {
    std::optional<clock::time_point> t;
    for (const auto& [id, c] : conns_) {
      if (c.parked && (!t || c.deadline < *t)) t = c.deadline;
      if (!c.authed && !c.closing && (!t || c.auth_deadline < *t)) t = c.auth_deadline;
      if (c.watched && c.watch_limit.count() > 0 && (!t || c.last_seen + c.watch_limit < *t))
        t = c.last_seen + c.watch_limit;
    }
    return t;
  }

  bool exists(conn_id id) const { return conns_.find(id) != conns_.end(); }
  //! Whether the loop should read from id now (it is not parked and has room to reply).
  bool wants_read(conn_id id) const {
    auto it = conns_.find(id);
    if (it == conns_.end()) return false;
    const conn& c = it->second;
    return !c.closing && !c.parked && c.in.empty() && c.out.size() < out_soft_cap;
  }
  //! Whether id should be closed: it misbehaved and its last reply went out.
  bool should_close(conn_id id) const {
    auto it = conns_.find(id);
    return it != conns_.end() && it->second.closing && it->second.out.empty();
  }
  const std::vector<std::byte>& out(conn_id id) const { return conns_.at(id).out; }
  //! Log lines (rejections) since the last call.
  std::vector<std::string> take_log() { return std::exchange(log_, {}); }

  std::size_t connections() const noexcept { return conns_.size(); }
  std::size_t value_bytes() const noexcept { return total_; }

  //! The loop stops reading a connection whose unsent replies exceed this.
  static constexpr std::size_t out_soft_cap = std::size_t{64} << 10;

 private:
  struct conn {
    explicit conn(const store_limits& lim) : parser(false, lim) {}
    frame_parser parser;
    std::string peer;
    std::vector<std::byte> in;   // received, not yet parsed (while parked or replies are unsent)
    std::vector<std::byte> out;  // replies not yet sent
    bool authed = false;
    bool closing = false;
    clock::time_point auth_deadline{};
    bool parked = false;  // a get/wait waiting for keys
    bool parked_get = false;
    std::vector<std::string> keys;
    std::size_t cursor = 0;  // keys[..cursor) are known to exist
    clock::time_point deadline{};
    bool watched = false;  // op::watch: set watch_key if this connection dies or goes silent
    std::string watch_key, watch_who;
    std::chrono::milliseconds watch_limit{0};
    clock::time_point last_seen{};
  };

  void drain(clock::time_point now) {
    while (!runnable_.empty()) {
      const conn_id id = runnable_.back();
      runnable_.pop_back();
      auto it = conns_.find(id);
      if (it != conns_.end()) pump(it->second, id, now);
    }
  }

  void pump(conn& c, conn_id id, clock::time_point now) {
    std::size_t off = 0;
    while (!c.closing && !c.parked && c.out.size() < out_soft_cap && off < c.in.size()) {
      off += c.parser.feed(std::span<const std::byte>(c.in).subspan(off));
      if (c.parser.status() == frame_parser::state::failed) {
        if (!c.authed) log_.push_back("closed the connection from " + c.peer + ": " + c.parser.error());
        reply_err(c, err_code::malformed, std::string("malformed frame: ") + c.parser.error());
        c.closing = true;
      } else if (c.parser.status() == frame_parser::state::ready) {
        c.last_seen = now;
        handle(c, id, c.parser.take(), now);
      }
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(off));
    if (c.closing) c.in.clear();
  }

  void reply_ok(conn& c, std::int64_t arg, std::span<const std::byte> value = {}) {
    encode(c.out, op::ok, arg, {}, value);
  }
  void reply_err(conn& c, err_code code, std::string_view msg) {
    msg = msg.substr(0, max_message_bytes);
    encode(c.out, op::err, static_cast<std::int64_t>(code), {},
           {reinterpret_cast<const std::byte*>(msg.data()), msg.size()});
  }

  void handle(conn& c, conn_id id, frame f, clock::time_point now) {
    if (!c.authed) {
      if (f.type != op::hello) {
        log_.push_back("rejected the connection from " + c.peer + ": it sent no job token first");
        reply_err(c, err_code::bad_token, "the first message must be hello with the job token");
        c.closing = true;
      } else if (f.arg != protocol_version) {
        log_.push_back("rejected the connection from " + c.peer + ": protocol version " + std::to_string(f.arg));
        reply_err(c, err_code::bad_token, "protocol version " + std::to_string(f.arg) + " is not " +
                                              std::to_string(protocol_version) + "; use the same lockstep on every rank");
        c.closing = true;
      } else if (!token_equal(f.value, token_)) {
        log_.push_back("rejected the connection from " + c.peer + ": wrong job token");
        reply_err(c, err_code::bad_token, "wrong job token");
        c.closing = true;
      } else {
        c.authed = true;
        reply_ok(c, protocol_version, encode_limits(lim_));
      }
      return;
    }
    switch (f.type) {
      case op::set: {
        if (f.arg == 1 && values_.find(f.key) != values_.end()) return reply_ok(c, 0);  // only if absent: it is not
        if (!put_value(f.key, std::move(f.value)))
          return reply_err(c, err_code::full, "the store would hold more than " + std::to_string(lim_.max_total_bytes) +
                                                  " bytes (store_limits::max_total_bytes)");
        return reply_ok(c, 1);
      }
      case op::watch:
        c.watched = true;
        c.watch_key = std::move(f.key);
        c.watch_who.assign(reinterpret_cast<const char*>(f.value.data()), f.value.size());
        c.watch_limit = std::chrono::milliseconds(std::min<std::int64_t>(f.arg, 86'400'000));
        return reply_ok(c, 0);
      case op::unwatch:
        c.watched = false;
        return reply_ok(c, 0);
      case op::get: {
        auto it = values_.find(f.key);
        if (it != values_.end()) return reply_ok(c, 0, it->second);
        c.keys.assign(1, std::move(f.key));
        park(c, id, true, f.arg, now);
        return;
      }
      case op::add: {
        auto& v = counters_[f.key];
        std::int64_t r = 0;
        if (__builtin_add_overflow(v, f.arg, &r)) return reply_err(c, err_code::overflow, "counter overflows int64");
        v = r;
        return reply_ok(c, r);
      }
      case op::wait:
      case op::check: {
        if (!decode_key_list(f.value, lim_.max_wait_keys, lim_.max_key_bytes, c.keys)) {
          reply_err(c, err_code::malformed, "malformed key list");
          c.closing = true;
          return;
        }
        if (f.type == op::check) {
          bool all = true;
          for (const auto& k : c.keys) all = all && values_.find(k) != values_.end();
          c.keys.clear();
          return reply_ok(c, all ? 1 : 0);
        }
        park(c, id, false, f.arg, now);
        return;
      }
      default:  // a second hello
        reply_err(c, err_code::malformed, "unexpected hello");
        c.closing = true;
        return;
    }
  }

  void park(conn& c, conn_id id, bool is_get, std::int64_t timeout_ms, clock::time_point now) {
    c.cursor = 0;
    c.parked_get = is_get;
    // Clamp so now + timeout cannot overflow the clock (a day is longer than any wait).
    const auto t = std::chrono::milliseconds(std::min<std::int64_t>(timeout_ms, 86'400'000));
    c.deadline = now + t;
    c.parked = true;
    advance(c, id);
  }

  //! Moves the cursor past keys that exist; answers when none is missing, else registers
  //! the connection under the first missing key.
  void advance(conn& c, conn_id id) {
    while (c.cursor < c.keys.size() && values_.find(c.keys[c.cursor]) != values_.end()) ++c.cursor;
    if (c.cursor < c.keys.size()) {
      waiting_.emplace(c.keys[c.cursor], id);
      return;
    }
    c.parked = false;
    if (c.parked_get) reply_ok(c, 0, values_.find(c.keys[0])->second);
    else reply_ok(c, 0);
    c.keys.clear();
    runnable_.push_back(id);
  }

  void wake(const std::string& key) {
    auto [lo, hi] = waiting_.equal_range(key);
    std::vector<conn_id> ids;
    for (auto it = lo; it != hi; ++it) ids.push_back(it->second);
    waiting_.erase(lo, hi);
    for (conn_id id : ids) {
      auto it = conns_.find(id);
      if (it != conns_.end() && it->second.parked) advance(it->second, id);
    }
  }

  //! A watched connection died or went silent: set its key, unless a failure is there already.
  void fire(conn& c, const std::string& what) {
    c.watched = false;
    const std::string text = c.watch_who + " " + what;
    log_.push_back(text);
    if (values_.find(c.watch_key) != values_.end()) return;
    const auto* p = reinterpret_cast<const std::byte*>(text.data());
    if (!put_value(c.watch_key, std::vector<std::byte>(p, p + text.size())))
      log_.push_back("could not record it under " + printable_key(c.watch_key) + ": the store is full");
  }

  //! Stores (or replaces) a value within max_total_bytes and wakes its waiters; false, with
  //! nothing changed, when it would not fit.
  bool put_value(const std::string& key, std::vector<std::byte> value) {
    auto it = values_.find(key);
    const std::size_t old = it == values_.end() ? 0 : it->first.size() + it->second.size();
    const std::size_t now_total = total_ - old + key.size() + value.size();
    if (now_total > lim_.max_total_bytes) return false;
    total_ = now_total;
    if (it == values_.end()) values_.emplace(key, std::move(value));
    else it->second = std::move(value);
    wake(key);
    return true;
  }

  void unpark(conn& c, conn_id id) {
    if (!c.parked) return;
    auto [lo, hi] = waiting_.equal_range(c.keys[c.cursor]);
    for (auto it = lo; it != hi; ++it)
      if (it->second == id) {
        waiting_.erase(it);
        break;
      }
    c.parked = false;
    c.keys.clear();
  }

  std::string token_;
  store_limits lim_;
  std::size_t max_conns_;
  std::chrono::milliseconds auth_timeout_;
  conn_id next_id_ = 1;
  std::unordered_map<conn_id, conn> conns_;
  std::map<std::string, std::vector<std::byte>, std::less<>> values_;
  std::map<std::string, std::int64_t, std::less<>> counters_;
  std::multimap<std::string, conn_id, std::less<>> waiting_;
  std::vector<conn_id> runnable_;
  std::vector<std::string> log_;
  std::size_t total_ = 0;
};

}  // namespace lockstep::detail::wire
