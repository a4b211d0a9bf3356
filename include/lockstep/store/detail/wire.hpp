#pragma once
//! TcpStore's wire protocol: the frame format, its encoder and a strict, bounded,
//! incremental frame parser. The server's state machine that speaks it: engine.hpp.
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
//! Runs (protocol 3): the job token is the run id, so generations never mix. A hello's
//! value is u64 `joined` — the instance of the store this client was connected to before (0:
//! none; a client reconnects after a lost reply) — then the token. Every server draws a random
//! non-zero instance when it starts; its hello reply (`ok`) carries the limits (three u64) and
//! that instance. A hello with another run's token, or with a `joined` that is not this
//! server's instance (the client's store is gone and this is a new one at the same address:
//! the client is left over from an earlier run), gets `err` other_run naming both runs (by
//! run_id_of, never the token) and the connection is closed.
//!
//! Liveness (protocol 2): a connection may `watch` a key. From then on the server sets that
//! key (unless some value is there already: the first failure wins) when the connection
//! closes without an `unwatch` first — the process died — or, when a heartbeat limit was
//! given, when no request arrived on it for that long — the process is stopped or hung (a
//! request parked on the server does not count as a heartbeat).
//! The value is the watch's own text (e.g. "rank 3") followed by what happened. The same value
//! goes under "<key>/<text>" (e.g. "lockstep/failed/rank 3") whether or not the key was set
//! already: who of several watchers sharing a key is gone (elastic jobs ask, elastic/).

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
#include "lockstep/store/store.hpp"

namespace lockstep::detail::wire {

inline constexpr std::byte magic0{'L'};
inline constexpr std::byte magic1{'S'};
inline constexpr std::int64_t protocol_version = 3;
inline constexpr std::size_t header_bytes = 20;
inline constexpr std::size_t trailer_bytes = 4;
inline constexpr std::size_t max_token_bytes = 256;
inline constexpr std::size_t max_hello_bytes = 8 + max_token_bytes;  //!< joined instance + token
inline constexpr std::size_t welcome_bytes = 32;                     //!< limits + instance
inline constexpr std::size_t max_message_bytes = 4096;               //!< err reply text
//! Upper bound on any size a server may announce, so a client never trusts a huge one.
inline constexpr std::size_t max_announced_value = std::size_t{1} << 30;

enum class op : std::uint8_t {
  hello = 1,    //!< value: u64 joined instance (0: none), job token; arg: protocol version
  set = 2,      //!< key, value
  get = 3,      //!< key; arg: timeout ms. Answered once the key exists or at the timeout
  add = 4,      //!< key; arg: delta
  wait = 5,     //!< value: key list; arg: timeout ms
  check = 6,    //!< value: key list
  watch = 7,    //!< key: set on failure; value: who (1..max_message bytes); arg: heartbeat limit ms (0: none)
  unwatch = 8,  //!< no key, no value: a clean leave, the watch no longer fires
  ok = 0x81,    //!< reply. get: value; add: arg = new total; check: arg = 0/1; hello: limits + instance
  err = 0x82    //!< reply. arg: err_code; value: message text
};

enum class err_code : std::int64_t {
  malformed = 1,  //!< not a valid frame or request; the connection is closed
  bad_token = 2,  //!< no hello first, or another protocol version; closed
  too_large = 3,  //!< the value or key list exceeds the server's limits
  timeout = 4,    //!< get/wait deadline passed; value lists what was missing
  full = 5,       //!< the store holds max_total_bytes already
  overflow = 6,   //!< add would overflow int64
  busy = 7,       //!< the server has max_connections open; closed
  other_run = 8   //!< hello of another run (token), or for a store that is gone (joined); closed
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

//! A hello's value: the instance this client joined before (0: none), then the token.
inline std::vector<std::byte> encode_hello(std::uint64_t joined, std::string_view token) {
  std::vector<std::byte> v(8 + token.size());
  store_le(v.data(), joined);
  std::copy(token.begin(), token.end(), reinterpret_cast<char*>(v.data() + 8));
  return v;
}
//! Strict inverse of encode_hello; false when the value is too short to hold `joined`.
inline bool decode_hello(std::span<const std::byte> v, std::uint64_t& joined, std::span<const std::byte>& token) {
  if (v.size() < 8 || v.size() > max_hello_bytes) return false;
  joined = load_le<std::uint64_t>(v.data());
  token = v.subspan(8);
  return true;
}

//! The hello reply's value: the server's limits, then its instance (non-zero).
inline std::vector<std::byte> encode_welcome(const store_limits& lim, std::uint64_t instance) {
  auto v = encode_limits(lim);
  v.resize(welcome_bytes);
  store_le(v.data() + 24, instance);
  return v;
}
struct welcome {
  store_limits limits;
  std::uint64_t instance = 0;
};
inline std::optional<welcome> decode_welcome(std::span<const std::byte> v) {
  if (v.size() != welcome_bytes) return std::nullopt;
  auto lim = decode_limits(v.first(24));
  const auto instance = load_le<std::uint64_t>(v.data() + 24);
  if (!lim || instance == 0) return std::nullopt;
  return welcome{*lim, instance};
}

//! An instance as it appears in messages: 16 hex digits.
inline std::string instance_text(std::uint64_t instance) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 0; i < 16; ++i) out[static_cast<std::size_t>(i)] = hex[(instance >> (60 - 4 * i)) & 15];
  return out;
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
        if (head_[0] != magic0 || (head_n_ >= 2 && head_[1] != magic1))
          return fail(used, "bad magic (not a lockstep store frame)");
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
      case op::hello: max_value = max_hello_bytes; break;
      case op::set: max_value = lim_.max_value_bytes; break;
      case op::wait:
      case op::check: max_value = lim_.max_value_bytes; break;
      case op::ok: max_value = std::max<std::size_t>(lim_.max_value_bytes, welcome_bytes); break;
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

}  // namespace lockstep::detail::wire
