#pragma once
// Captures what this process writes to stderr (lockstep's own messages) for a scope.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace lockstep_test {

//! Everything written to stderr from construction until finish() (or the end of the scope),
//! then stderr is restored; with `echo`, the captured text is written to it again (still shown).
class stderr_capture {
 public:
  explicit stderr_capture(bool echo = false) : echo_(echo) {
    std::fflush(stderr);
    saved_ = ::dup(STDERR_FILENO);
    char tmpl[] = "/tmp/lockstep_stderr_XXXXXX";
    fd_ = ::mkstemp(tmpl);
    REQUIRE(fd_ >= 0);
    ::unlink(tmpl);
    ::dup2(fd_, STDERR_FILENO);
  }
  ~stderr_capture() { finish(); }
  stderr_capture(const stderr_capture&) = delete;
  stderr_capture& operator=(const stderr_capture&) = delete;

  std::string finish() {
    if (saved_ < 0) return text_;
    std::fflush(stderr);
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
    saved_ = -1;
    char buf[4096];
    ssize_t n = 0;
    ::lseek(fd_, 0, SEEK_SET);
    while ((n = ::read(fd_, buf, sizeof buf)) > 0) text_.append(buf, static_cast<std::size_t>(n));
    ::close(fd_);
    if (echo_) std::fputs(text_.c_str(), stderr);
    return text_;
  }

 private:
  bool echo_;
  int saved_ = -1, fd_ = -1;
  std::string text_;
};

}  // namespace lockstep_test
