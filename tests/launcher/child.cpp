// A tiny rank program for lockstep-run's tests. It performs its arguments in order; an action
// written "@R:action" runs only on rank R (rank from RANK). Actions:
//   env          print NAME=VALUE for each launch variable (absent ones as NAME=<unset>)
//   pid          print PID=<pid>
//   out=TEXT     print TEXT as a line on stdout;   err=TEXT  the same on stderr
//   partial=TEXT print TEXT on stdout with no newline (the launcher must still show it)
//   spam=L:B     write L lines "S<rank>:<i>:<payload>#" to stdout and L "E<rank>:<i>:<payload>#"
//                to stderr, each line B bytes of payload, written in several small pieces so
//                lines cross write and pipe-buffer boundaries
//   exit=C       exit with code C;   kill=S  raise signal S
//   exit_first=C exit with code C in the first launch (LOCKSTEP_RESTART_COUNT unset or 0)
//   mark=DIR     create DIR/<restart count>.<rank> (an empty file)
//   await=DIR:N  wait (at most 20 s) until N ranks of this launch have marked DIR
//   ignore=S     ignore signal S
//   trap         on SIGINT/SIGTERM print "CAUGHT <rank> <signal number>" and exit 0
//   sleep=SEC    sleep SEC seconds (fractions allowed; "inf": forever)
//   closeio      close stdout and stderr (and keep running)
//   helper=SEC   start a helper process (prints HELPER=<pid>) that holds stdout/stderr open
//                for SEC seconds, in its own session
// With no exit action it exits 0 at the end.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <chrono>
#include <filesystem>

namespace {

int g_rank = -1;

void write_str(int fd, const std::string& s) {
  const char* p = s.data();
  std::size_t n = s.size();
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w <= 0) return;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

extern "C" void on_trap(int sig) {
  char buf[64];
  int len = std::snprintf(buf, sizeof buf, "CAUGHT %d %d\n", g_rank, sig);
  [[maybe_unused]] ssize_t w = ::write(STDOUT_FILENO, buf, static_cast<std::size_t>(len));
  ::_exit(0);
}

// Small pseudo-random piece sizes so lines are cut at varying places; seeded by rank and pid.
unsigned g_state = 1;
unsigned next_rand() {
  g_state = g_state * 1103515245u + 12345u;
  return (g_state >> 16) & 0x7fff;
}

void spam(const char* tag, int fd, long lines, long bytes) {
  for (long i = 0; i < lines; ++i) {
    std::string line = std::string(tag) + std::to_string(g_rank) + ":" + std::to_string(i) + ":";
    for (long b = 0; b < bytes; ++b) line += static_cast<char>('a' + (i + b) % 26);
    line += "#\n";
    std::size_t pos = 0;
    while (pos < line.size()) {
      std::size_t piece = std::min<std::size_t>(line.size() - pos, 1 + next_rand() % 97);
      write_str(fd, line.substr(pos, piece));
      pos += piece;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* rank_env = std::getenv("RANK");
  g_rank = rank_env ? std::atoi(rank_env) : -1;
  g_state = static_cast<unsigned>(g_rank + 1) * 2654435761u ^ static_cast<unsigned>(::getpid());
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.size() > 1 && a[0] == '@') {
      auto colon = a.find(':');
      if (colon == std::string::npos) return 100;
      if (std::atoi(a.substr(1, colon - 1).c_str()) != g_rank) continue;
      a = a.substr(colon + 1);
    }
    auto eq = a.find('=');
    const std::string name = a.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (name == "env") {
      for (const char* v : {"RANK",
                            "LOCAL_RANK",
                            "WORLD_SIZE",
                            "LOCAL_WORLD_SIZE",
                            "MASTER_ADDR",
                            "MASTER_PORT",
                            "LOCKSTEP_RANK",
                            "LOCKSTEP_LOCAL_RANK",
                            "LOCKSTEP_WORLD_SIZE",
                            "LOCKSTEP_LOCAL_WORLD_SIZE",
                            "LOCKSTEP_MASTER_ADDR",
                            "LOCKSTEP_MASTER_PORT",
                            "LOCKSTEP_JOB_TOKEN",
                            "LOCKSTEP_LAUNCHER",
                            "LOCKSTEP_RESTART_COUNT",
                            "LOCKSTEP_ELASTIC_JOIN",
                            "NCCL_NVLS_ENABLE",
                            "LAUNCHER_TEST_CANARY",
                            "LOCKSTEP_LR_SCALING",
                            "LOCKSTEP_CPU_RANKS",
                            "LOCKSTEP_DEVICES"}) {
        const char* val = std::getenv(v);
        write_str(STDOUT_FILENO, std::string(v) + "=" + (val ? val : "<unset>") + "\n");
      }
    } else if (name == "pid") {
      write_str(STDOUT_FILENO, "PID=" + std::to_string(::getpid()) + "\n");
    } else if (name == "out") {
      write_str(STDOUT_FILENO, value + "\n");
    } else if (name == "err") {
      write_str(STDERR_FILENO, value + "\n");
    } else if (name == "partial") {
      write_str(STDOUT_FILENO, value);
    } else if (name == "spam") {
      long lines = std::atol(value.c_str());
      long bytes = std::atol(value.substr(value.find(':') + 1).c_str());
      spam("S", STDOUT_FILENO, lines, bytes);
      spam("E", STDERR_FILENO, lines, bytes);
    } else if (name == "exit") {
      return std::atoi(value.c_str());
    } else if (name == "mark" || name == "await") {
      const char* n = std::getenv("LOCKSTEP_RESTART_COUNT");
      const std::string dir = value.substr(0, value.find(':')), launch = n ? n : "0";
      if (name == "mark") {
        std::fclose(std::fopen((dir + "/" + launch + "." + std::to_string(g_rank)).c_str(), "w"));
      } else {
        const long want = std::atol(value.substr(value.find(':') + 1).c_str());
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        for (;;) {
          long seen = 0;
          for (const auto& e : std::filesystem::directory_iterator(dir))
            if (e.path().filename().string().rfind(launch + ".", 0) == 0) ++seen;
          if (seen >= want || std::chrono::steady_clock::now() > until) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    } else if (name == "exit_first") {
      const char* n = std::getenv("LOCKSTEP_RESTART_COUNT");
      if (n == nullptr || std::strcmp(n, "0") == 0) return std::atoi(value.c_str());
    } else if (name == "kill") {
      ::raise(std::atoi(value.c_str()));
    } else if (name == "ignore") {
      ::signal(std::atoi(value.c_str()), SIG_IGN);
    } else if (name == "trap") {
      ::signal(SIGINT, on_trap);
      ::signal(SIGTERM, on_trap);
    } else if (name == "sleep") {
      if (value == "inf") {
        for (;;) ::pause();
      }
      auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::atof(value.c_str()));
      while (std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } else if (name == "closeio") {
      ::close(STDOUT_FILENO);
      ::close(STDERR_FILENO);
    } else if (name == "helper") {
      if (::fork() == 0) {
        ::setsid();  // out of the rank's process group: survives signals aimed at the rank
        write_str(STDOUT_FILENO, "HELPER=" + std::to_string(::getpid()) + "\n");
        std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(value.c_str())));
        ::_exit(0);
      }
    } else {
      write_str(STDERR_FILENO, "child: unknown action '" + a + "'\n");
      return 100;
    }
  }
  return 0;
}
