#pragma once
//! lockstep::TcpStore — the rendezvous store over TCP. Rank 0 hosts it (a server thread
//! polling non-blocking sockets); every rank, rank 0 included, is a client. Clients retry
//! connecting until the timeout, so the ranks may start in any order. A client must first
//! present the job token; a wrong one is rejected, logged and disconnected, as is any
//! malformed frame, and the server keeps serving the others. Wire format and server state
//! machine: store/detail/wire.hpp and engine.hpp. Linux (accept4, SOCK_NONBLOCK, MSG_NOSIGNAL);
//! IPv4, host names resolved with getaddrinfo.
//!
//! Generations never mix: the job token is the run id (run_id_of names it in messages), so a
//! process of another run — an earlier run still alive at this address, or one that outlived
//! its own store — is refused at its hello, both sides saying which runs met. A client that
//! reconnects (after a lost reply) presents the store instance it joined; a new store at the
//! same address refuses it even when the two runs share a token (docs/reliability.md, 6).

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/progress.hpp"
#include "lockstep/store/detail/arrivals.hpp"
#include "lockstep/store/detail/socket.hpp"
#include "lockstep/store/detail/tcp_server.hpp"
#include "lockstep/store/detail/wire.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep {

//! A store reached over TCP; the process constructed with is_server = true hosts it.
class TcpStore {
 public:
  //! host/port: where rank 0 listens (the server binds every interface, or only loopback
  //! when host is a loopback address; port 0 picks a free one, see port()). world: the
  //! number of processes (the server admits 2 × world + 8 connections: one store and one
  //! watchdog per process, and some slack). token: the job token
  //! every process must present. timeout: bound of connecting and of every wait.
  TcpStore(std::string host, int port, bool is_server, int world, std::string token,
           std::chrono::milliseconds timeout = detail::default_timeout(), store_limits limits = {})
      : host_(std::move(host)), port_(port), world_(world), token_(std::move(token)), timeout_(timeout),
        limits_(limits), parser_(true, limits) {
    const std::string who = "TcpStore(" + host_ + ":" + std::to_string(port) + ")";
    if (world < 1) throw config_error(who + ": world is " + std::to_string(world) + "; give at least 1");
    if (timeout.count() <= 0) throw config_error(who + ": the timeout must be positive");
    if (port < 0 || port > 65535 || (port == 0 && !is_server))
      throw config_error(who + ": port " + std::to_string(port) + " is out of range; give 1..65535 (MASTER_PORT)");
    if (token_.size() > detail::wire::max_token_bytes)
      throw config_error(who + ": the job token has " + std::to_string(token_.size()) + " bytes; at most " +
                         std::to_string(detail::wire::max_token_bytes));
    if (host_.empty()) throw config_error(who + ": no host given; set MASTER_ADDR to the host of rank 0");
    if (is_server) {
      server_ = std::make_unique<detail::tcp_store_server>(is_loopback(host_), port, token_, limits_,
                                                           2 * static_cast<std::size_t>(world) + 8, timeout_);
      port_ = server_->port();
    }
    std::lock_guard lk(m_);
    connect_locked(is_server ? std::string("127.0.0.1") : host_);
  }

  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;
  //! For factories (job_store). The source must not be in use; it is left without a
  //! connection or server.
  TcpStore(TcpStore&& o) noexcept
      : host_(std::move(o.host_)), connect_host_(std::move(o.connect_host_)), port_(o.port_), world_(o.world_),
        token_(std::move(o.token_)), timeout_(o.timeout_), limits_(o.limits_), server_(std::move(o.server_)),
        fd_(std::exchange(o.fd_, -1)), joined_(o.joined_), parser_(std::move(o.parser_)), rx_(std::move(o.rx_)) {}

  //! Closes the connection; the server stops (its clients' next requests fail), so rank 0
  //! should pass a barrier first when others may still use the store. Never throws.
  ~TcpStore() {
    detail::close_fd(fd_);
    server_.reset();
  }

  void set(std::string_view key, std::span<const std::byte> value) { put(key, value, 0); }

  std::vector<std::byte> get(std::string_view key) {
    detail::check_store_key(key, limits_, "TcpStore");
    return request(detail::wire::op::get, timeout_.count(), key, {}, "get " + detail::printable_key(key), timeout_)
        .value;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    detail::check_store_keys(keys, limits_, "TcpStore");
    if (keys.empty()) return;
    const auto list = detail::wire::encode_key_list(keys);
    if (list.size() > limits_.max_value_bytes)
      throw config_error("TcpStore: the " + std::to_string(keys.size()) + " keys of one wait take " +
                         std::to_string(list.size()) + " bytes, more than the value limit; wait on fewer at once");
    request(detail::wire::op::wait, std::max<std::int64_t>(0, timeout.count()), {}, list, "wait", timeout);
  }
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

  bool check(const std::vector<std::string>& keys) {
    detail::check_store_keys(keys, limits_, "TcpStore");
    if (keys.empty()) return true;
    const auto list = detail::wire::encode_key_list(keys);
    if (list.size() > limits_.max_value_bytes)
      throw config_error("TcpStore: the keys of one check take " + std::to_string(list.size()) +
                         " bytes, more than the value limit; check fewer at once");
    return request(detail::wire::op::check, 0, {}, list, "check", timeout_).arg != 0;
  }

  //! Sets key only if no value is there yet; returns whether this call set it. The first
  //! of several racing writers wins (e.g. the first failure report of a job).
  bool set_if_absent(std::string_view key, std::span<const std::byte> value) { return put(key, value, 1); }

  //! Liveness: from now on the server sets `key` to "<who> left: ..." if this connection
  //! closes before unwatch() (the process died), and — when heartbeat_limit > 0 — to "<who>
  //! stopped responding: ..." if no request arrives on it for that long. Any request is a
  //! heartbeat (check() is a cheap one); a get()/wait() parked on the server is not, so a
  //! watched connection should not park for longer than the limit (the Watchdog keeps a
  //! connection of its own for this). An existing value is never overwritten.
  void watch(std::string_view key, std::string_view who, std::chrono::milliseconds heartbeat_limit) {
    detail::check_store_key(key, limits_, "TcpStore");
    if (who.empty() || who.size() > detail::wire::max_message_bytes)
      throw config_error("TcpStore::watch: the text naming this process must have 1.." +
                         std::to_string(detail::wire::max_message_bytes) + " bytes");
    request(detail::wire::op::watch, std::max<std::int64_t>(0, heartbeat_limit.count()), key, bytes_of(who),
            "watch " + detail::printable_key(key), timeout_);
  }
  //! A clean leave: the watch set by watch() no longer fires.
  void unwatch() { request(detail::wire::op::unwatch, 0, {}, {}, "unwatch", timeout_); }

  //! The start-up rendezvous: this process is `rank` of the world and reached the store
  //! (sets detail::arrival_key(rank)). The host's report_arrivals() waits for these.
  void announce(int rank) {
    if (rank < 0 || rank >= world_)
      throw config_error(who() + ": announce(" + std::to_string(rank) + "): a rank of the world of " +
                         std::to_string(world_) + " is 0.." + std::to_string(world_ - 1));
    static constexpr std::byte one[1] = {std::byte{1}};
    set(detail::arrival_key(rank), one);
  }

  //! Host only (is_server): until every rank of the world announce()d itself, the server
  //! thread reports which have not — "lockstep: waiting for ranks 3, 7 (2 of 8 missing) for
  //! 15 s at host:port", first after 5 s, then every 10 s (progress_options), and "lockstep:
  //! all 8 ranks arrived after 23 s at host:port" if it reported. Nothing when every rank
  //! arrives in time, or with LOCKSTEP_PROGRESS=0. Does not wait. job_store() calls both.
  void report_arrivals(const progress_options& opt = {}) {
    if (!server_)
      throw config_error(who() + ": report_arrivals() is for the process that hosts the store (rank 0, "
                                 "is_server = true); the other ranks call announce(rank)");
    detail::progress p(opt, std::chrono::seconds(5), std::chrono::seconds(10));
    if (!p.enabled()) return;
    server_->watch_arrivals(detail::arrival_watch(world_, host_ + ":" + std::to_string(port_), std::move(p)));
  }

  std::int64_t add(std::string_view key, std::int64_t delta) {
    detail::check_store_key(key, limits_, "TcpStore");
    return request(detail::wire::op::add, delta, key, {}, "add " + detail::printable_key(key), timeout_).arg;
  }

  int world() const noexcept { return world_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  //! The server's port (the one chosen when 0 was given).
  int port() const noexcept { return port_; }
  const std::string& host() const noexcept { return host_; }
  //! The limits in force: this process's, lowered to the server's.
  const store_limits& limits() const noexcept { return limits_; }
  //! This run's id (run_id_of the job token; "" when there is none).
  std::string run_id() const { return run_id_of(token_); }

 private:
  using clock = std::chrono::steady_clock;
  using op = detail::wire::op;

  static bool is_loopback(const std::string& host) {
    std::string why;
    auto addrs = detail::resolve_ipv4(host, 1, why);
    if (addrs.empty()) return false;
    for (const auto& a : addrs)
      if ((ntohl(a.sin_addr.s_addr) >> 24) != 127) return false;
    return true;
  }

  std::string who() const { return "TcpStore(" + host_ + ":" + std::to_string(port_) + ")"; }

  //! set (flags 0) or set-if-absent (flags 1); whether the value was stored.
  bool put(std::string_view key, std::span<const std::byte> value, std::int64_t flags) {
    detail::check_store_key(key, limits_, "TcpStore");
    detail::check_store_value(key, value.size(), limits_.max_value_bytes, "TcpStore");
    return request(detail::wire::op::set, flags, key, value, "set " + detail::printable_key(key), timeout_).arg == 1;
  }

  //! Connects (retrying until timeout_: the server may start later) and says hello.
  void connect_locked(const std::string& host) {
    connect_host_ = host;
    const auto deadline = clock::now() + timeout_;
    auto backoff = std::chrono::milliseconds(10);
    std::string last = "no attempt";
    while (true) {
      std::string why;
      for (const auto& addr : detail::resolve_ipv4(host, port_, why)) {
        int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
          why = "socket(): " + detail::errno_text(errno);
          continue;
        }
        int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
        if (rc != 0 && errno == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          while ((rc = ::poll(&p, 1, detail::poll_ms(deadline))) == 0 && clock::now() < deadline) {
          }
          int err = 0;
          socklen_t len = sizeof err;
          if (rc > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
          else err = rc == 0 ? ETIMEDOUT : errno;
          rc = err == 0 ? 0 : -1;
          errno = err;
        }
        if (rc != 0) {
          why = "connect to " + detail::peer_text(addr) + ": " + detail::errno_text(errno);
          ::close(fd);
          continue;
        }
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fd_ = fd;
        hello_locked(deadline);
        return;
      }
      last = why;
      const auto now = clock::now();
      if (now >= deadline)
        throw timeout_error(who() + ": could not connect to the store within " + detail::seconds_text(timeout_) +
                            " (last error: " + last +
                            "). Rank 0 hosts it: check that it runs, that MASTER_ADDR/MASTER_PORT point at it "
                            "and that no firewall blocks the port; raise LOCKSTEP_TIMEOUT if it starts late");
      std::this_thread::sleep_for(std::min<clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    }
  }

  void hello_locked(clock::time_point deadline) {
    parser_ = detail::wire::frame_parser(true, limits_);
    rx_.clear();
    std::vector<std::byte> buf;
    detail::wire::encode(buf, op::hello, detail::wire::protocol_version, {},
                         detail::wire::encode_hello(joined_, token_));
    send_all(buf, deadline, "hello");
    auto f = receive(deadline, "hello");
    if (f.type == op::err) {
      detail::close_fd(fd_);
      const auto code = static_cast<detail::wire::err_code>(f.arg);
      if (code == detail::wire::err_code::busy)
        throw config_error(who() + " rejected this process: " + string_of(f.value) +
                           "; open fewer TcpStore clients per process, or is another job using this port?");
      if (code == detail::wire::err_code::other_run) refused_as_other_run(string_of(f.value));
      throw config_error(who() + " rejected this process: " + string_of(f.value) +
                         "; is a program of another lockstep version, or another program, using this port?");
    }
    auto w = detail::wire::decode_welcome(f.value);
    if (!w) {
      detail::close_fd(fd_);
      throw error(who() + ": the server's hello reply is malformed; is another program listening on this port?");
    }
    if (joined_ != 0 && w->instance != joined_) {  // the server checks this too
      detail::close_fd(fd_);
      refused_as_other_run("this process joined store " + detail::wire::instance_text(joined_) +
                           " at this address, which is gone; store " + detail::wire::instance_text(w->instance) +
                           " listens there now");
    }
    joined_ = w->instance;
    limits_.max_key_bytes = std::min(limits_.max_key_bytes, w->limits.max_key_bytes);
    limits_.max_value_bytes = std::min(limits_.max_value_bytes, w->limits.max_value_bytes);
    limits_.max_wait_keys = std::min(limits_.max_wait_keys, w->limits.max_wait_keys);
    parser_.set_limits(w->limits);
  }

  //! The server said this process is of another run (`why`, naming both). On a first
  //! connection the store's host is the stranger; on a reconnection, this process is.
  [[noreturn]] void refused_as_other_run(const std::string& why) const {
    const std::string at = host_ + ":" + std::to_string(port_);
    if (joined_ != 0)
      throw aborted_error(who() + " refused this process: " + why +
                          ". The rank 0 that hosted this process's store exited and another run now listens at " + at +
                          ": this process is left over from that earlier run and must not join the new one; "
                          "stop it");
    throw config_error(who() + " refused this process: " + why + ". A process of another run listens at " + at +
                       ": an earlier run still alive, or another job. Stop it (on that host, `ss -ltnp 'sport = :" +
                       std::to_string(port_) +
                       "'` names it) or give this run another MASTER_PORT; if both are "
                       "meant to be one run, give every rank the same job token (LOCKSTEP_JOB_TOKEN)");
  }

  [[noreturn]] void lost(const std::string& what) {
    detail::close_fd(fd_);
    throw aborted_error(who() + ": lost the connection to the store during " + what + " (" +
                        "the rank-0 process that hosts it exited or failed?)");
  }

  void send_all(std::span<const std::byte> data, clock::time_point deadline, const std::string& what) {
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n > 0) {
        data = data.subspan(static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) lost(what);
      pollfd p{fd_, POLLOUT, 0};
      if (clock::now() >= deadline) {
        detail::close_fd(fd_);
        throw timeout_error(who() + ": sending " + what + " did not finish within the timeout");
      }
      ::poll(&p, 1, detail::poll_ms(deadline));
    }
  }

  detail::wire::frame receive(clock::time_point deadline, const std::string& what) {
    std::byte buf[64 << 10];
    while (true) {
      if (!rx_.empty()) {
        const std::size_t used = parser_.feed(rx_);
        rx_.erase(rx_.begin(), rx_.begin() + static_cast<std::ptrdiff_t>(used));
      }
      if (parser_.status() == detail::wire::frame_parser::state::failed) {
        detail::close_fd(fd_);
        throw error(who() + ": malformed reply to " + what + " (" + parser_.error() +
                    "); is another program listening on this port?");
      }
      if (parser_.status() == detail::wire::frame_parser::state::ready) return parser_.take();
      if (clock::now() >= deadline) {
        detail::close_fd(fd_);  // a late reply would be taken for the next request's
        throw timeout_error(who() + ": no reply to " + what + " within " + detail::seconds_text(timeout_) +
                            " beyond its own wait; the server (rank 0) is stuck or its host unreachable");
      }
      pollfd p{fd_, POLLIN, 0};
      ::poll(&p, 1, detail::poll_ms(deadline));
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n == 0) lost(what);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        lost(what);
      }
      rx_.insert(rx_.end(), buf, buf + n);
    }
  }

  detail::wire::frame request(op type, std::int64_t arg, std::string_view key, std::span<const std::byte> value,
                              const std::string& what, std::chrono::milliseconds wait_for) {
    std::lock_guard lk(m_);
    if (fd_ < 0) connect_locked(connect_host_);  // after a lost reply: start clean
    std::vector<std::byte> buf;
    detail::wire::encode(buf, type, arg, key, value);
    const auto start = clock::now();
    send_all(buf, start + timeout_, what);
    // The server answers a wait at its deadline; allow it the time to do so, then some.
    auto f = receive(start + wait_for + timeout_, what);
    if (f.type == op::ok) return f;
    const auto code = static_cast<detail::wire::err_code>(f.arg);
    const std::string msg = string_of(f.value);
    if (code == detail::wire::err_code::timeout)
      throw timeout_error(who() + ": " + what + " timed out after " + detail::seconds_text(wait_for) + " (world of " +
                          std::to_string(world_) + "); " + msg +
                          ". The rank that sets it failed, hangs, or is slow (then raise LOCKSTEP_TIMEOUT, seconds)");
    if (code == detail::wire::err_code::malformed || code == detail::wire::err_code::bad_token) {
      detail::close_fd(fd_);
      throw error(who() + ": the server refused " + what + ": " + msg);
    }
    throw config_error(who() + ": " + what + " refused: " + msg);
  }

  std::string host_;
  std::string connect_host_;
  int port_;
  int world_;
  std::string token_;
  std::chrono::milliseconds timeout_;
  store_limits limits_;
  std::unique_ptr<detail::tcp_store_server> server_;
  std::mutex m_;
  int fd_ = -1;
  std::uint64_t joined_ = 0;  // the store instance this client joined (0: not yet)
  detail::wire::frame_parser parser_;
  std::vector<std::byte> rx_;
};

static_assert(store<TcpStore>);

}  // namespace lockstep
