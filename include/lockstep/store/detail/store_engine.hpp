#pragma once
//! TcpStore's server state machine (`store_engine`): values, counters, waits and watches, one
//! session per connection, driven by bytes and times alone (it owns no socket and reads no
//! clock), so the fuzzer drives it directly. The frames it reads and writes: wire.hpp.

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
#include "lockstep/store/detail/wire.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep::detail::wire {

//! The server's state: values, counters and one session per connection. The socket loop
//! feeds it received bytes (receive), sends what out() holds, closes what should_close()
//! says, and calls tick() at next_deadline(). No method throws except on allocation
//! failure; a client's misbehaviour only closes that client's connection.
class store_engine {
 public:
  using clock = std::chrono::steady_clock;
  using conn_id = std::uint64_t;

  //! token: the job token, which is the run id. instance: this server's random non-zero
  //! number (0 is taken as 1), which a client presents when it reconnects.
  store_engine(std::string token, store_limits lim, std::size_t max_connections, std::chrono::milliseconds auth_timeout,
               std::uint64_t instance = 1)
      : token_(std::move(token)), run_(run_id_of(token_)), lim_(lim), max_conns_(max_connections),
        auth_timeout_(auth_timeout), instance_(instance == 0 ? 1 : instance) {}

  std::uint64_t instance() const noexcept { return instance_; }
  //! Whether a value (not a counter) is stored under key.
  bool has(std::string_view key) const { return values_.find(key) != values_.end(); }
  //! run_id_of(the job token).
  const std::string& run_id() const noexcept { return run_; }

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
      fire(it->second,
           "left: its connection to the store closed before it finished (the process exited or was killed)");
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
        std::string msg =
            std::to_string(missing.size()) + " of " + std::to_string(c.keys.size()) + " key(s) never set: ";
        for (std::size_t i = 0; i < missing.size() && i < 4; ++i) msg += (i ? ", " : "") + printable_key(missing[i]);
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
        reply_err(c, err_code::bad_token,
                  "protocol version " + std::to_string(f.arg) + " is not " + std::to_string(protocol_version) +
                      "; use the same lockstep on every rank");
        c.closing = true;
      } else {
        hello(c, f);
      }
      return;
    }
    switch (f.type) {
      case op::set: {
        if (f.arg == 1 && values_.find(f.key) != values_.end()) return reply_ok(c, 0);  // only if absent: it is not
        if (!put_value(f.key, std::move(f.value)))
          return reply_err(c, err_code::full,
                           "the store would hold more than " + std::to_string(lim_.max_total_bytes) +
                               " bytes (store_limits::max_total_bytes)");
        return reply_ok(c, 1);
      }
      case op::watch:
        c.watched = true;
        c.watch_key = std::move(f.key);
        c.watch_who.assign(reinterpret_cast<const char*>(f.value.data()), f.value.size());
        c.watch_limit = std::chrono::milliseconds(std::min<std::int64_t>(f.arg, 86'400'000));
        return reply_ok(c, 0);
      case op::unwatch: c.watched = false; return reply_ok(c, 0);
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

  //! A hello of this protocol version: admitted, or refused as of another run.
  void hello(conn& c, const frame& f) {
    std::uint64_t joined = 0;
    std::span<const std::byte> token;
    if (!decode_hello(f.value, joined, token)) {
      log_.push_back("rejected the connection from " + c.peer + ": malformed hello");
      reply_err(c, err_code::malformed, "malformed hello (shorter than its 8-byte store instance)");
      c.closing = true;
      return;
    }
    const bool same_token = token_equal(token, token_);
    const std::string theirs = label_of(token, same_token);
    const std::string ours = run_label(run_);
    if (joined != 0 && joined != instance_) {
      // Its store is gone and this is a new one at the same address: it is left over.
      log_.push_back("refused the connection from " + c.peer + ": a process left over from an earlier run (" + theirs +
                     ") reconnected; it joined store " + instance_text(joined) + " at this address, this is store " +
                     instance_text(instance_) + " of " + ours + ". This run goes on");
      reply_err(c, err_code::other_run,
                "this process joined store " + instance_text(joined) + " at this address, which is gone; store " +
                    instance_text(instance_) + " of " + ours + " listens there now (this process is of " + theirs +
                    ")");
      c.closing = true;
    } else if (!same_token) {
      log_.push_back("refused the connection from " + c.peer + ": it is of " + theirs + ", this store belongs to " +
                     ours + " (a process of an earlier run, or of another job, reached this port). This run goes on");
      reply_err(c, err_code::other_run,
                "the store at this address belongs to " + ours + ", this process is of " + theirs);
      c.closing = true;
    } else {
      c.authed = true;
      reply_ok(c, protocol_version, encode_welcome(lim_, instance_));
    }
  }

  //! How a presented token is named: its run id, and when that equals ours though the
  //! tokens differ (1 in 4 billion), says so.
  std::string label_of(std::span<const std::byte> token, bool same_token) const {
    const std::string id = run_id_of(std::string_view(reinterpret_cast<const char*>(token.data()), token.size()));
    std::string label = run_label(id);
    if (!same_token && id == run_) label += " (the same run id, but another job token)";
    return label;
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

  //! A watched connection died or went silent: set its key, unless a failure is there already,
  //! and "<key>/<who>" in any case (which of several connections fired: wire.hpp).
  void fire(conn& c, const std::string& what) {
    c.watched = false;
    const std::string text = c.watch_who + " " + what;
    log_.push_back(text);
    const auto* p = reinterpret_cast<const std::byte*>(text.data());
    for (const std::string& key : {c.watch_key + "/" + c.watch_who, c.watch_key}) {
      if (key == c.watch_key && values_.find(key) != values_.end()) continue;
      if (!put_value(key, std::vector<std::byte>(p, p + text.size())))
        log_.push_back("could not record it under " + printable_key(key) + ": the store is full");
    }
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
  std::string run_;
  store_limits lim_;
  std::size_t max_conns_;
  std::chrono::milliseconds auth_timeout_;
  std::uint64_t instance_;
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
