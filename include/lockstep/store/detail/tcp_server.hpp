#pragma once
//! The server half of TcpStore: one thread, poll() over the listening socket, a wake-up pipe
//! and the clients, all non-blocking; its state machine is store_engine (engine.hpp).

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
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/store/detail/arrivals.hpp"
#include "lockstep/store/detail/store_engine.hpp"
#include "lockstep/store/detail/socket.hpp"
#include "lockstep/store/detail/wire.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep::detail {

//! The server half of TcpStore: one thread, poll() over the listening socket, a wake-up
//! pipe and the clients, all non-blocking. Its state machine is wire::store_engine.
class tcp_store_server {
 public:
  tcp_store_server(bool loopback_only, int port, std::string token, const store_limits& lim,
                   std::size_t max_connections, std::chrono::milliseconds auth_timeout)
      : engine_(std::move(token), lim, max_connections, auth_timeout, fresh_instance()) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (listen_fd_ < 0) throw error("TcpStore: socket() failed: " + errno_text(errno));
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(loopback_only ? INADDR_LOOPBACK : INADDR_ANY);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      const int e = errno;
      close_fd(listen_fd_);
      throw config_error("TcpStore: cannot listen on port " + std::to_string(port) + ": " + errno_text(e) +
                         (e == EADDRINUSE ? " (another job, or an earlier run of this one, holds it: stop it (on this "
                                            "host, `ss -ltnp 'sport = :" +
                                                std::to_string(port) +
                                                "'` names it) or "
                                                "choose another MASTER_PORT)"
                                          : ""));
    }
    if (::listen(listen_fd_, 1024) != 0) {
      const int e = errno;
      close_fd(listen_fd_);
      throw error("TcpStore: listen() failed: " + errno_text(e));
    }
    socklen_t len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    int p[2];
    if (::pipe(p) != 0) {
      const int e = errno;
      close_fd(listen_fd_);
      throw error("TcpStore: pipe() failed: " + errno_text(e));
    }
    wake_read_ = p[0];
    wake_write_ = p[1];
    for (int fd : p) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    thread_ = std::thread([this] { loop(); });
  }

  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;

  ~tcp_store_server() {
    stop_.store(true);
    const char b = 1;
    [[maybe_unused]] auto n = ::write(wake_write_, &b, 1);
    if (thread_.joinable()) thread_.join();
    for (auto& [id, fd] : fds_) close_fd(fd);
    close_fd(listen_fd_);
    close_fd(wake_read_);
    close_fd(wake_write_);
  }

  int port() const noexcept { return port_; }
  //! This server's random instance: a client that reconnects must present it.
  std::uint64_t instance() const noexcept { return engine_.instance(); }

  //! From now on, until every rank has set its arrival key, the server thread reports the
  //! missing ones (arrivals.hpp). Replaces an earlier watch.
  void watch_arrivals(arrival_watch w) {
    {
      std::lock_guard lk(arrivals_m_);
      arrivals_.emplace(std::move(w));
    }
    const char b = 1;
    [[maybe_unused]] auto n = ::write(wake_write_, &b, 1);  // recompute the poll timeout
  }

 private:
  using clock = std::chrono::steady_clock;

  //! A random non-zero number per server, so that a new store at an old address is told
  //! from the one a client joined, even when both runs have the same (or no) job token.
  static std::uint64_t fresh_instance() {
    std::random_device rd;
    std::uint64_t v = 0;
    while (v == 0)
      v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
          static_cast<std::uint64_t>(clock::now().time_since_epoch().count());
    return v;
  }

  void loop() noexcept {
    try {
      run();
    } catch (const std::exception& e) {  // bad_alloc: clients time out with a clear message
      std::fprintf(stderr, "lockstep TcpStore server stopped: %s\n", e.what());
    }
  }

  void run() {
    std::vector<pollfd> pfds;
    std::vector<wire::store_engine::conn_id> ids;
    std::vector<std::byte> buf(64 << 10);
    while (!stop_.load()) {
      pfds.assign({{wake_read_, POLLIN, 0}, {listen_fd_, POLLIN, 0}});
      ids.assign(2, 0);
      for (auto& [id, fd] : fds_) {
        short ev = 0;
        if (engine_.wants_read(id)) ev |= POLLIN;
        if (!engine_.out(id).empty()) ev |= POLLOUT;
#ifdef POLLRDHUP
        ev |= POLLRDHUP;  // notice a peer that left while its wait is parked
#endif
        pfds.push_back({fd, ev, 0});
        ids.push_back(id);
      }
      int wait_ms = 1000;
      if (auto d = engine_.next_deadline()) wait_ms = std::min(wait_ms, poll_ms(*d));
      if (auto d = poll_arrivals()) wait_ms = std::min(wait_ms, poll_ms(*d));
      const int rc = ::poll(pfds.data(), pfds.size(), wait_ms);
      if (rc < 0 && errno != EINTR) throw error("poll() failed: " + errno_text(errno));
      const auto now = clock::now();
      if (rc > 0) {
        if (pfds[0].revents) {  // stop, or a new arrival watch
          char drain[64];
          while (::read(wake_read_, drain, sizeof drain) > 0) {
          }
          if (stop_.load()) break;
        }
        if (pfds[1].revents & POLLIN) accept_all(now);
        for (std::size_t i = 2; i < pfds.size(); ++i) {
          const auto id = ids[i];
          const short re = pfds[i].revents;
          if (re == 0) continue;
          // An error, or a peer gone with nothing left to read (even while its wait is parked).
          bool drop = (re & (POLLERR | POLLNVAL)) != 0 || ((re & POLLHUP) && !(re & POLLIN));
#ifdef POLLRDHUP
          if ((re & POLLRDHUP) && !(re & POLLIN)) drop = true;
#endif
          if (!drop && (re & POLLIN)) drop = !read_from(id, buf, now);
          if (!drop && (re & POLLOUT)) drop = !flush(id, now);
          if (drop) drop_conn(id);
        }
      }
      engine_.tick(clock::now());
      // Send replies now rather than one poll round later; close whom the engine dropped.
      for (auto it = fds_.begin(); it != fds_.end();) {
        const auto id = it->first;
        ++it;
        bool drop = !engine_.out(id).empty() && !flush(id, clock::now());
        if (drop || engine_.should_close(id)) drop_conn(id);
      }
      for (const auto& line : engine_.take_log()) std::fprintf(stderr, "lockstep TcpStore server: %s\n", line.c_str());
    }
    linger();
  }

  //! Runs the arrival watch, if any; when it next wants to run. A failing report (a sink
  //! that throws) ends the watch, never the server.
  std::optional<clock::time_point> poll_arrivals() {
    std::lock_guard lk(arrivals_m_);
    if (!arrivals_) return std::nullopt;
    try {
      if (!arrivals_->poll([&](const std::string& key) { return engine_.has(key); })) return arrivals_->next_check();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "lockstep TcpStore server: stopped reporting missing ranks: %s\n", e.what());
    }
    arrivals_.reset();
    return std::nullopt;
  }

  //! On shutdown, replies already decided (e.g. the last barrier's) still go out: up to 1 s.
  void linger() {
    const auto deadline = clock::now() + std::chrono::seconds(1);
    while (clock::now() < deadline) {
      std::vector<pollfd> pfds;
      std::vector<wire::store_engine::conn_id> ids;
      for (auto& [id, fd] : fds_)
        if (!engine_.out(id).empty()) {
          pfds.push_back({fd, POLLOUT, 0});
          ids.push_back(id);
        }
      if (pfds.empty()) return;
      if (::poll(pfds.data(), pfds.size(), poll_ms(deadline)) <= 0) continue;
      for (std::size_t i = 0; i < pfds.size(); ++i)
        if (pfds[i].revents & (POLLERR | POLLHUP | POLLNVAL)) drop_conn(ids[i]);
        else if ((pfds[i].revents & POLLOUT) && !flush(ids[i], clock::now())) drop_conn(ids[i]);
    }
  }

  void accept_all(clock::time_point now) {
    while (true) {
      sockaddr_in peer{};
      socklen_t len = sizeof peer;
      int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a transient error (EMFILE, ECONNABORTED): next round
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      auto id = engine_.open(peer_text(peer), now);
      if (!id) {  // say why before closing, so the client's error is not a bare "lost"
        std::vector<std::byte> f;
        const std::string_view msg = "the store admits 2 x world + 8 connections and all are in use";
        wire::encode(f, wire::op::err, static_cast<std::int64_t>(wire::err_code::busy), {},
                     {reinterpret_cast<const std::byte*>(msg.data()), msg.size()});
        [[maybe_unused]] auto n = ::send(fd, f.data(), f.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(fd);
        continue;
      }
      fds_.emplace(*id, fd);
    }
  }

  bool read_from(wire::store_engine::conn_id id, std::vector<std::byte>& buf, clock::time_point now) {
    if (!engine_.wants_read(id)) return true;
    const ssize_t n = ::recv(fds_.at(id), buf.data(), buf.size(), 0);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    engine_.receive(id, std::span<const std::byte>(buf.data(), static_cast<std::size_t>(n)), now);
    return true;
  }

  bool flush(wire::store_engine::conn_id id, clock::time_point now) {
    const auto& out = engine_.out(id);
    if (out.empty()) return true;
    const ssize_t n = ::send(fds_.at(id), out.data(), out.size(), MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    engine_.sent(id, static_cast<std::size_t>(n), now);
    return true;
  }

  void drop_conn(wire::store_engine::conn_id id) {
    auto it = fds_.find(id);
    if (it == fds_.end()) return;
    close_fd(it->second);
    fds_.erase(it);
    engine_.close(id);
  }

  wire::store_engine engine_;
  std::unordered_map<wire::store_engine::conn_id, int> fds_;
  int listen_fd_ = -1, wake_read_ = -1, wake_write_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex arrivals_m_;  // the watch is set by the store's owner, run by the server thread
  std::optional<arrival_watch> arrivals_;
  std::thread thread_;
};

}  // namespace lockstep::detail
