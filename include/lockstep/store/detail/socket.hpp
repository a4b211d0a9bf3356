#pragma once
//! Small POSIX socket helpers of TcpStore's client and server (Linux, IPv4).

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace lockstep::detail {

inline std::string errno_text(int e) { return std::string(std::strerror(e)); }

inline int poll_ms(std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::clamp<long long>(left.count() + 1, 0, 1000));
}

inline void close_fd(int& fd) noexcept {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

//! IPv4 addresses of host (a name or dotted quad); empty with `why` set when it does not resolve.
inline std::vector<sockaddr_in> resolve_ipv4(const std::string& host, int port, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  std::vector<sockaddr_in> out;
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    why = std::string("cannot resolve '") + host + "': " + ::gai_strerror(rc);
    return out;
  }
  for (addrinfo* a = res; a != nullptr; a = a->ai_next)
    if (a->ai_family == AF_INET && a->ai_addrlen == sizeof(sockaddr_in))
      out.push_back(*reinterpret_cast<const sockaddr_in*>(a->ai_addr));
  ::freeaddrinfo(res);
  if (out.empty()) why = "'" + host + "' has no IPv4 address";
  return out;
}

inline std::string peer_text(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

}  // namespace lockstep::detail
