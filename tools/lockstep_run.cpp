// lockstep-run — single-node launcher: starts N copies of a program, one per rank, with the
// environment of a torchrun-style launch (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) plus lockstep's own LOCKSTEP_* variables, prefixes every output line
// with its rank, forwards SIGINT/SIGTERM, and stops the whole job when one rank fails.
//
//   lockstep-run --nproc 4 ./train --epochs 3      # 4 ranks
//   lockstep-run ./train                           # one rank per visible GPU
//   lockstep-run --cpu --nproc 2 ./train           # CPU ranks
//
// Linux/POSIX only. See docs/lockstep_run.md for the full behaviour.
#include <fcntl.h>
#include <glob.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

extern char** environ;

namespace {

using clock_type = std::chrono::steady_clock;

constexpr int kMaxRanks = 1024;            // two pipes per rank: stay well inside fd limits
constexpr std::size_t kMaxLine = 1 << 20;  // a longer line without '\n' is split here
constexpr std::size_t kTailLines = 200;    // --rank0-only: stderr kept per hidden rank
constexpr std::size_t kTailBytes = 64 << 10;
constexpr std::size_t kReadChunk = 64 << 10;

constexpr const char* kUsage =
    R"(usage: lockstep-run [options] [--] PROGRAM [ARGS...]

Starts N processes of PROGRAM on this machine, one per rank, and waits for them.

options:
  --nproc N           number of ranks (alias --nproc-per-node). Default: one per visible GPU
                      (CUDA_VISIBLE_DEVICES, else /dev/nvidia<N>, else `nvidia-smi -L`), or with
                      --cpu one per CPU this process may run on.
  --cpu               CPU ranks: the default N is the CPU count, and no GPU is needed.
  --master-port PORT  MASTER_PORT for the ranks' rendezvous (default: a free port on 127.0.0.1).
  --rank0-only        print only rank 0's output; a failing rank's last stderr lines are
                      still printed when it fails.
  --grace SECONDS     after SIGTERM/SIGINT, wait this long before SIGKILL (default 10).
  --timeout SECONDS   stop the job (SIGTERM, then SIGKILL after the grace) after this long,
                      restarts included; exit code 124. Default: no limit.
  --max-restarts N    when a rank fails, stop the others and start the whole job again, up
                      to N times (default 0). Each launch gets LOCKSTEP_RESTART_COUNT (0 for
                      the first), a fresh job token and, without --master-port, a fresh port;
                      the program resumes from its own last checkpoint. Not restarted: a job
                      stopped by a signal to lockstep-run or by --timeout.
  --elastic           a rank other than 0 that fails does not stop the others: they may go on
                      without it (lockstep::ElasticGroup, docs/elastic.md), and with
                      --max-restarts N up to N replacements are started, each with the failed
                      rank's number and LOCKSTEP_ELASTIC_JOIN=1, to join the running job. The
                      job's status is rank 0's: it hosts the store, so its loss stops the job as
                      without --elastic (and --max-restarts then restarts the whole job).
  -h, --help          show this help.

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT,
and LOCKSTEP_RANK, LOCKSTEP_LOCAL_RANK, LOCKSTEP_WORLD_SIZE, LOCKSTEP_LOCAL_WORLD_SIZE,
LOCKSTEP_MASTER_ADDR, LOCKSTEP_MASTER_PORT, LOCKSTEP_JOB_TOKEN, LOCKSTEP_LAUNCHER=lockstep-run;
LOCKSTEP_RESTART_COUNT (and LOCKSTEP_ELASTIC_JOIN=1 for an --elastic replacement); the rest of
the environment (NCCL_NVLS_ENABLE included) is passed on unchanged. The job token is drawn afresh
(16 random bytes) for every launch and is the run's id: lockstep's store refuses a process of an
earlier launch that still reaches the same --master-port.
Output lines are prefixed "[RANK] " (stdout to stdout, stderr to stderr).

interactive: `lockstep-run PROGRAM [ARGS...]` with no option, stdin a terminal, asks how to run
(auto / threads / processes), how many of the GPUs found (or CPU ranks), and whether to scale the
learning rate with the global batch, prints the same command without questions, and runs it.
The answer to the last reaches the program as LOCKSTEP_LR_SCALING=linear|sqrt (lockstep's
lr_scaling_from_env() reads it). It never asks when stdin is not a terminal, nor with
LOCKSTEP_NO_PROMPT=1.

exit status: 0 when every rank exits 0 (in the last launch; with --elastic, when rank 0 does);
the failing rank's exit code, or 128+signal when it was killed; 128+signal when lockstep-run was
interrupted; 124 on --timeout; 2 for usage errors; 127 when PROGRAM cannot be found or run.
)";

// ---------------------------------------------------------------------------------------------
// Small helpers

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "lockstep-run: %s\nRun 'lockstep-run --help' for usage.\n", msg.c_str());
  std::exit(2);
}

std::optional<long> parse_long(std::string_view s) {
  if (s.empty()) return std::nullopt;
  std::string t(s);
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(t.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || end == t.c_str()) return std::nullopt;
  return v;
}

std::optional<double> parse_seconds(std::string_view s) {
  if (s.empty()) return std::nullopt;
  std::string t(s);
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(t.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v) || v < 0) return std::nullopt;
  return v;
}

std::string signal_name(int sig) {
  struct Entry {
    int sig;
    const char* name;
  };
  static constexpr Entry names[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},   {SIGTRAP, "SIGTRAP"},
      {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},   {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"},
      {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"}, {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"},
      {SIGCHLD, "SIGCHLD"}, {SIGCONT, "SIGCONT"}, {SIGSTOP, "SIGSTOP"}, {SIGTSTP, "SIGTSTP"}, {SIGTTIN, "SIGTTIN"},
      {SIGTTOU, "SIGTTOU"}, {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"}};
  for (const auto& e : names)
    if (e.sig == sig) return e.name;
  return "SIG" + std::to_string(sig);
}

//! The time `seconds` after t.
clock_type::time_point after(clock_type::time_point t, double seconds) {
  return t + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(seconds));
}

std::string format_seconds(double s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

// Writes everything, waiting when the descriptor is non-blocking; a closed reader (EPIPE) turns
// the sink off so the job keeps running without its output rather than dying of SIGPIPE.
struct Sink {
  int fd;
  bool broken = false;
  void write_all(const char* p, std::size_t n) {
    while (n > 0 && !broken) {
      ssize_t w = ::write(fd, p, n);
      if (w > 0) {
        p += w;
        n -= static_cast<std::size_t>(w);
      } else if (w < 0 && errno == EINTR) {
        continue;
      } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd pfd{fd, POLLOUT, 0};
        ::poll(&pfd, 1, 100);
      } else {
        broken = true;
      }
    }
  }
  void write_all(const std::string& s) { write_all(s.data(), s.size()); }
};

Sink g_out{STDOUT_FILENO};
Sink g_err{STDERR_FILENO};

void say(const std::string& msg) { g_err.write_all("lockstep-run: " + msg + "\n"); }

// ---------------------------------------------------------------------------------------------
// Setup: how many ranks, which program, port, token

// Counts GPUs without linking CUDA. The device nodes (or nvidia-smi, e.g. under WSL) give the
// physical count; CUDA_VISIBLE_DEVICES, when set, narrows it the way the CUDA runtime does:
// entries up to the first empty or negative one ("" or "-1" hide every GPU).
int visible_gpus() {
  int physical = 0;
  glob_t g{};
  if (::glob("/dev/nvidia[0-9]*", 0, nullptr, &g) == 0) {
    for (std::size_t i = 0; i < g.gl_pathc; ++i) {
      std::string_view p = g.gl_pathv[i];
      p.remove_prefix(std::strlen("/dev/nvidia"));
      if (!p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; })) ++physical;
    }
  }
  ::globfree(&g);
  if (physical == 0) {
    if (FILE* f = ::popen("nvidia-smi -L 2>/dev/null", "r")) {
      char line[512];
      while (std::fgets(line, sizeof line, f))
        if (std::strncmp(line, "GPU ", 4) == 0) ++physical;
      ::pclose(f);
    }
  }
  const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
  if (cvd == nullptr || physical == 0) return physical;
  int listed = 0;
  std::string_view rest = cvd;
  while (true) {
    auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty() || item.front() == '-') break;
    ++listed;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return std::min(listed, physical);
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

bool is_executable_file(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// Resolved once here, so a missing program is one clear message rather than N failed ranks.
std::optional<std::string> resolve_program(const std::string& prog) {
  if (prog.find('/') != std::string::npos) {
    if (is_executable_file(prog)) return prog;
    return std::nullopt;
  }
  const char* path_env = std::getenv("PATH");
  std::string_view path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    auto colon = path.find(':');
    std::string dir(path.substr(0, colon));
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + prog;
    if (is_executable_file(candidate)) return candidate;
    if (colon == std::string_view::npos) break;
    path.remove_prefix(colon + 1);
  }
  return std::nullopt;
}

// Bind port 0, read the port the kernel chose, close. Another process could take it before
// rank 0 binds it; --master-port avoids that window where it matters.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

// One token per launch: lockstep's store takes it for the run id, so a rank left over from an
// earlier launch on the same port is refused rather than mixed in (docs/reliability.md, 6).
std::optional<std::string> job_token() {
  unsigned char bytes[16];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t r = ::read(fd, bytes + got, sizeof bytes - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<std::size_t>(r);
  }
  ::close(fd);
  if (got != sizeof bytes) return std::nullopt;
  static constexpr char hex[] = "0123456789abcdef";
  std::string s;
  for (unsigned char b : bytes) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  int nproc = 0;  // 0: choose
  bool cpu = false;
  int master_port = 0;  // 0: choose
  bool rank0_only = false;
  double grace = 10;
  double timeout = 0;       // 0: none
  int max_restarts = 0;     // launches of the whole job after a rank failed
  bool elastic = false;     // a failed rank but 0 leaves the others running
  bool any_option = false;  // a launcher option was given (no questions then)
  std::vector<std::string> command;
};

Options parse_options(int argc, char** argv) {
  Options o;
  int i = 1;
  // Accepts "--name value" and "--name=value".
  auto value_of = [&](std::string_view arg, std::string_view name) -> std::optional<std::string> {
    if (arg == name) {
      if (i + 1 >= argc) usage_error("option " + std::string(name) + " needs a value");
      return std::string(argv[++i]);
    }
    if (arg.size() > name.size() && arg.substr(0, name.size()) == name && arg[name.size()] == '=')
      return std::string(arg.substr(name.size() + 1));
    return std::nullopt;
  };
  for (; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.empty() || a[0] != '-') break;  // the program: everything from here is its command line
    o.any_option = true;
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a == "--cpu") {
      o.cpu = true;
    } else if (a == "--elastic") {
      o.elastic = true;
    } else if (a == "--rank0-only") {
      o.rank0_only = true;
    } else if (auto v = value_of(a, "--nproc"); v || (v = value_of(a, "--nproc-per-node"))) {
      auto n = parse_long(*v);
      if (!n || *n < 1 || *n > kMaxRanks)
        usage_error("--nproc wants a whole number from 1 to " + std::to_string(kMaxRanks) + ", got '" + *v + "'");
      o.nproc = static_cast<int>(*n);
    } else if (auto v = value_of(a, "--master-port")) {
      auto p = parse_long(*v);
      if (!p || *p < 1 || *p > 65535) usage_error("--master-port wants a port from 1 to 65535, got '" + *v + "'");
      o.master_port = static_cast<int>(*p);
    } else if (auto v = value_of(a, "--grace")) {
      auto s = parse_seconds(*v);
      if (!s) usage_error("--grace wants a number of seconds >= 0, got '" + *v + "'");
      o.grace = *s;
    } else if (auto v = value_of(a, "--max-restarts")) {
      auto n = parse_long(*v);
      if (!n || *n < 0 || *n > 1000000)
        usage_error("--max-restarts wants a whole number from 0 to 1000000, got '" + *v + "'");
      o.max_restarts = static_cast<int>(*n);
    } else if (auto v = value_of(a, "--timeout")) {
      auto s = parse_seconds(*v);
      if (!s || *s <= 0) usage_error("--timeout wants a number of seconds > 0, got '" + *v + "'");
      o.timeout = *s;
    } else {
      usage_error("unknown option '" + std::string(a) + "' (put '--' before a program whose name starts with '-')");
    }
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.command.empty()) usage_error("no program given: lockstep-run [options] PROGRAM [ARGS...]");
  return o;
}

// ---------------------------------------------------------------------------------------------
// Signals: the handler only records the signal and wakes poll() through a pipe.

volatile sig_atomic_t g_last_signal = 0;
volatile sig_atomic_t g_signal_count = 0;
int g_wake_write = -1;

extern "C" void on_signal(int sig) {
  int saved = errno;
  if (sig != SIGCHLD) {
    g_last_signal = sig;
    g_signal_count = g_signal_count + 1;  // handlers are masked against each other (sa_mask)
  }
  char c = 0;
  [[maybe_unused]] ssize_t r = ::write(g_wake_write, &c, 1);
  errno = saved;
}

constexpr int kHandled[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

// ---------------------------------------------------------------------------------------------
// Ranks and their output

struct Stream {
  int fd = -1;
  bool is_err = false;
  std::string partial;  // the current line, not yet ended by '\n'
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool reaped = false;
  Stream out, err;
  std::deque<std::string> tail;  // --rank0-only: last stderr lines, shown if this rank fails
  std::size_t tail_bytes = 0;
};

class Launcher {
 public:
  //! Launch number `restart` (0: the first) of a job that began at `began` (--timeout counts
  //! from there).
  Launcher(Options o, int restart, clock_type::time_point began)
      : opt_(std::move(o)), restart_(restart), began_(began) {}
  int run();
  //! Why the launch failed when a rank failed first (not a timeout or setup failure): "rank 1
  //! exited with code 3"; empty otherwise. Only such a launch is restarted (and only when
  //! lockstep-run received no signal: main checks g_signal_count).
  const std::string& rank_failure() const noexcept { return rank_failure_; }
  //! SIGKILL to what is left of the ranks' process groups (helpers of a failed rank), before
  //! the next launch.
  void kill_leftovers() const {
    for (const auto& r : ranks_)
      if (r.pid > 0) ::kill(-r.pid, SIGKILL);
  }

 private:
  bool start_rank(Rank& r, const std::string& path, const std::vector<std::string>& base_env,
                  const sigset_t& original_mask, int stdin_fd);
  void emit(Rank& r, Stream& s, std::string lines);
  void feed(Rank& r, Stream& s, const char* data, std::size_t n);
  bool read_some(Rank& r, Stream& s);  // false at EOF/error (fd closed)
  void drain(Rank& r);
  void flush_partial(Rank& r, Stream& s);
  void reap();
  void stop_all(int sig, const std::string& why);
  void signal_unreaped(int sig);
  std::string still_running() const;
  void start_replacements(int stdin_fd);

  Options opt_;
  int world_ = 0;
  // What a replacement (--elastic --max-restarts) is started with, as the first launch was.
  std::string path_;
  std::vector<std::string> base_env_;
  const sigset_t* mask_ = nullptr;
  std::vector<int> to_replace_;  // ranks that failed under --elastic and are to be started again
  int replaced_ = 0;
  bool rank0_ended_ = false;  // rank 0 (the store's host) was reaped
  int restart_ = 0;
  clock_type::time_point began_;
  std::string rank_failure_;
  std::vector<Rank> ranks_;
  int alive_ = 0;
  bool stopping_ = false;
  bool killed_ = false;
  clock_type::time_point kill_at_{};
  int exit_code_ = 0;
};

std::string prefix_of(int rank) {
  std::string p = "[";
  p.append(std::to_string(rank)).append("] ");
  return p;
}

void Launcher::emit(Rank& r, Stream& s, std::string lines) {
  if (lines.empty()) return;
  if (!opt_.rank0_only || r.rank == 0) {
    (s.is_err ? g_err : g_out).write_all(lines);
    return;
  }
  if (!s.is_err) return;
  // Keep the tail of a hidden rank's stderr, line by line, within the bounds.
  std::size_t pos = 0;
  while (pos < lines.size()) {
    std::size_t nl = lines.find('\n', pos);
    std::size_t end = nl == std::string::npos ? lines.size() : nl + 1;
    r.tail.emplace_back(lines, pos, end - pos);
    r.tail_bytes += end - pos;
    pos = end;
    while (!r.tail.empty() && (r.tail.size() > kTailLines || r.tail_bytes > kTailBytes)) {
      r.tail_bytes -= r.tail.front().size();
      r.tail.pop_front();
    }
  }
}

// Complete lines go out whole, one write per chunk read, so lines never mix: lockstep-run is
// the only writer of its stdout/stderr and writes whole lines only.
void Launcher::feed(Rank& r, Stream& s, const char* data, std::size_t n) {
  const std::string prefix = prefix_of(r.rank);
  std::string out;
  std::size_t start = 0;
  while (start < n) {
    const void* hit = std::memchr(data + start, '\n', n - start);
    if (!hit) break;
    std::size_t nl = static_cast<std::size_t>(static_cast<const char*>(hit) - data);
    out += prefix;
    out += s.partial;
    out.append(data + start, nl - start + 1);
    s.partial.clear();
    start = nl + 1;
  }
  s.partial.append(data + start, n - start);
  if (s.partial.size() >= kMaxLine) {  // bound memory for output that never ends a line
    out.append(prefix).append(s.partial).push_back('\n');
    s.partial.clear();
  }
  emit(r, s, std::move(out));
}

void Launcher::flush_partial(Rank& r, Stream& s) {
  if (s.partial.empty()) return;
  std::string line = prefix_of(r.rank);
  line.append(s.partial).push_back('\n');
  s.partial.clear();
  emit(r, s, std::move(line));
}

bool Launcher::read_some(Rank& r, Stream& s) {
  if (s.fd < 0) return false;
  char buf[kReadChunk];
  while (true) {
    ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n > 0) {
      feed(r, s, buf, static_cast<std::size_t>(n));
      return true;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    ::close(s.fd);  // EOF or error
    s.fd = -1;
    flush_partial(r, s);
    return false;
  }
}

// Everything an exited process wrote is already in the pipe: read until empty (not until EOF,
// which a grandchild holding the pipe could postpone forever; the read count is bounded for a
// grandchild that keeps writing).
void Launcher::drain(Rank& r) {
  for (Stream* s : {&r.out, &r.err}) {
    for (int reads = 0; s->fd >= 0 && reads < 1024; ++reads) {
      pollfd pfd{s->fd, POLLIN, 0};
      if (::poll(&pfd, 1, 0) <= 0 || !(pfd.revents & (POLLIN | POLLHUP | POLLERR))) break;
      if (!read_some(r, *s)) break;
    }
  }
}

void Launcher::signal_unreaped(int sig) {
  for (auto& r : ranks_) {
    if (r.reaped) continue;
    // The whole process group, so helpers the rank started hear it too.
    if (::kill(-r.pid, sig) != 0) ::kill(r.pid, sig);
    // A stopped process would only act on the signal once continued.
    if (sig != SIGKILL && sig != SIGCONT && ::kill(-r.pid, SIGCONT) != 0) ::kill(r.pid, SIGCONT);
  }
}

std::string Launcher::still_running() const {
  std::string list;
  int count = 0;
  for (const auto& r : ranks_) {
    if (r.reaped) continue;
    list += (count++ ? ", " : "") + std::to_string(r.rank);
  }
  return (count == 1 ? "rank " : "ranks ") + list;
}

void Launcher::stop_all(int sig, const std::string& why) {
  stopping_ = true;
  kill_at_ = after(clock_type::now(), opt_.grace);
  if (alive_ > 0) {
    say(why + "; sending " + signal_name(sig) + " to " + still_running() + " (SIGKILL after " +
        format_seconds(opt_.grace) + ")");
    signal_unreaped(sig);
  } else {
    say(why);
  }
}

void Launcher::reap() {
  while (alive_ > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid == 0) return;
    if (pid < 0) {
      if (errno == EINTR) continue;
      // ECHILD: nothing left to wait for, which would mean our bookkeeping is off; do not hang.
      for (auto& r : ranks_) r.reaped = true;
      alive_ = 0;
      return;
    }
    // Not a reaped one: a replacement may have got a pid an earlier process of its rank had.
    auto it = std::find_if(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return r.pid == pid && !r.reaped; });
    if (it == ranks_.end()) continue;  // not one of ours (e.g. an adopted process)
    Rank& r = *it;
    r.reaped = true;
    --alive_;
    if (r.rank == 0) rank0_ended_ = true;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!failed || stopping_) continue;  // ranks exiting after we told them to stop are expected
    drain(r);                            // its last words first, then ours
    std::string how;
    int code = 0;
    if (WIFEXITED(status)) {
      code = WEXITSTATUS(status);
      how = "exited with code " + std::to_string(code);
    } else {
      const int sig = WTERMSIG(status);
      code = 128 + sig;
      how = "was killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")";
#ifdef WCOREDUMP
      if (WCOREDUMP(status)) how += ", core dumped";
#endif
    }
    const std::string what = "rank " + std::to_string(r.rank) + " " + how;
    const bool go_on = opt_.elastic && r.rank != 0;
    if (opt_.rank0_only && r.rank != 0) {
      flush_partial(r, r.err);
      if (!r.tail.empty()) {
        say(what + "; its last stderr lines:");
        for (const auto& line : r.tail) g_err.write_all(line);
        r.tail.clear();
        r.tail_bytes = 0;
      }
    }
    if (go_on) {
      // Not once rank 0 has ended: the job is over, a replacement would wait for nothing.
      const bool replace = replaced_ < opt_.max_restarts && !rank0_ended_;
      say(what + "; the other ranks go on without it (--elastic)" +
          (replace ? ", and a replacement joins them (restart " + std::to_string(replaced_ + 1) + " of " +
                         std::to_string(opt_.max_restarts) + ")"
                   : std::string()));
      if (replace) {
        ++replaced_;
        to_replace_.push_back(r.rank);
      }
      continue;
    }
    exit_code_ = code;
    rank_failure_ = what;
    stop_all(SIGTERM, what);
  }
}

bool Launcher::start_rank(Rank& r, const std::string& path, const std::vector<std::string>& base_env,
                          const sigset_t& original_mask, int stdin_fd) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return false;
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    return false;
  }
  const std::string rank = std::to_string(r.rank), size = std::to_string(world_);
  std::vector<std::string> env = base_env;
  for (const char* name : {"RANK", "LOCAL_RANK", "LOCKSTEP_RANK", "LOCKSTEP_LOCAL_RANK"})
    env.push_back(std::string(name) + "=" + rank);
  for (const char* name : {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCKSTEP_WORLD_SIZE", "LOCKSTEP_LOCAL_WORLD_SIZE"})
    env.push_back(std::string(name) + "=" + size);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = opt_.command;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();

  // Signals stay blocked across fork so our handler never runs in the child before exec.
  sigset_t all, before;
  sigfillset(&all);
  ::sigprocmask(SIG_SETMASK, &all, &before);
  pid_t pid = ::fork();
  if (pid == 0) {
    // Child: only async-signal-safe calls from here to exec.
    ::setpgid(0, 0);
#if defined(__linux__)
    // If lockstep-run itself dies (even by SIGKILL), take the rank down rather than orphan it.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
#endif
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    if (stdin_fd >= 0 && stdin_fd != STDIN_FILENO) ::dup2(stdin_fd, STDIN_FILENO);
    struct sigaction dfl{};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int sig : kHandled) ::sigaction(sig, &dfl, nullptr);
    ::sigaction(SIGPIPE, &dfl, nullptr);
    ::sigprocmask(SIG_SETMASK, &original_mask, nullptr);
    ::execve(path.c_str(), argv.data(), envp.data());
    const int e = errno;
    const char* parts[] = {"lockstep-run: cannot execute ", path.c_str(), ": ", ::strerror(e), "\n"};
    for (const char* p : parts) [[maybe_unused]]
      ssize_t w = ::write(STDERR_FILENO, p, std::strlen(p));
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &before, nullptr);
  ::close(out[1]);
  ::close(err[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    errno = fork_errno;
    return false;
  }
  ::setpgid(pid, pid);  // also here, so the group exists before we could signal it
  r.pid = pid;
  r.out.fd = out[0];
  r.err.fd = err[0];
  r.err.is_err = true;
  for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  ++alive_;
  return true;
}

// --elastic --max-restarts: a failed rank's replacement, with the same rank and the launch's
// environment, told to join the running job (LOCKSTEP_ELASTIC_JOIN=1) as restart k.
void Launcher::start_replacements(int stdin_fd) {
  for (int rank : std::exchange(to_replace_, {})) {
    if (rank0_ended_) break;
    std::vector<std::string> env;
    for (const auto& kv : base_env_)
      if (kv.rfind("LOCKSTEP_RESTART_COUNT=", 0) != 0) env.push_back(kv);
    env.push_back("LOCKSTEP_RESTART_COUNT=" + std::to_string(restart_ + replaced_));
    env.push_back("LOCKSTEP_ELASTIC_JOIN=1");
    ranks_.emplace_back();  // reserved: the references into ranks_ stay valid
    Rank& r = ranks_.back();
    r.rank = rank;
    if (!start_rank(r, path_, env, *mask_, stdin_fd)) {
      r.reaped = true;
      say("cannot start a replacement for rank " + std::to_string(rank) + ": " + std::strerror(errno));
    } else {
      say("started a replacement for rank " + std::to_string(rank) + " (pid " + std::to_string(r.pid) +
          ", LOCKSTEP_ELASTIC_JOIN=1)");
    }
  }
}

int Launcher::run() {
  // --- what to run, how many, where -------------------------------------------------------
  auto path = resolve_program(opt_.command[0]);
  if (!path) {
    say("cannot find an executable program '" + opt_.command[0] + "'" +
        (opt_.command[0].find('/') == std::string::npos ? " in PATH" : ""));
    return 127;
  }
  int n = opt_.nproc;
  if (n == 0) {
    n = opt_.cpu ? usable_cpus() : visible_gpus();
    if (n == 0) {
      say("no GPU is visible (CUDA_VISIBLE_DEVICES, /dev/nvidia*, nvidia-smi -L), so the number of "
          "ranks is unknown: pass --nproc N, or --cpu to run CPU ranks");
      return 2;
    }
    n = std::min(n, kMaxRanks);
  }
  int port = opt_.master_port;
  if (port == 0 && (port = free_port()) <= 0) {
    say(std::string("cannot find a free port on 127.0.0.1 (") + std::strerror(errno) + "): pass --master-port PORT");
    return 1;
  }
  auto token = job_token();
  if (!token) {
    say(std::string("cannot read /dev/urandom for the job token: ") + std::strerror(errno));
    return 1;
  }

  // The environment shared by every rank: ours, minus what the launch sets. NCCL_NVLS_ENABLE
  // and everything else pass through untouched.
  static constexpr std::string_view set_per_launch[] = {"RANK",
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
                                                        "LOCKSTEP_ELASTIC_JOIN"};
  std::vector<std::string> base_env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv = *e;
    std::string_view name = kv.substr(0, kv.find('='));
    if (std::find(std::begin(set_per_launch), std::end(set_per_launch), name) == std::end(set_per_launch))
      base_env.emplace_back(kv);
  }
  const std::string port_s = std::to_string(port);
  for (const char* v : {"MASTER_ADDR=127.0.0.1", "LOCKSTEP_MASTER_ADDR=127.0.0.1", "LOCKSTEP_LAUNCHER=lockstep-run"})
    base_env.emplace_back(v);
  base_env.push_back("MASTER_PORT=" + port_s);
  base_env.push_back("LOCKSTEP_MASTER_PORT=" + port_s);
  base_env.push_back("LOCKSTEP_JOB_TOKEN=" + *token);
  base_env.push_back("LOCKSTEP_RESTART_COUNT=" + std::to_string(restart_));

  // Ranks run in their own process groups, so they are not in the terminal's foreground group
  // and a read from the terminal would stop them (SIGTTIN): only a non-terminal stdin is handed
  // on, and only to rank 0; the others read /dev/null.
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const bool stdin_ok = ::fcntl(STDIN_FILENO, F_GETFD) != -1 && !::isatty(STDIN_FILENO);

  // --- signals -----------------------------------------------------------------------------
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    say(std::string("cannot create a pipe: ") + std::strerror(errno));
    return 1;
  }
  g_wake_write = wake[1];
  // The mask lockstep-run started with, for the ranks: read once (a restart's launch runs after
  // this one unblocked the handled signals).
  static const sigset_t original_mask = [] {
    sigset_t m;
    ::sigprocmask(SIG_SETMASK, nullptr, &m);
    return m;
  }();
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : kHandled) sigaddset(&sa.sa_mask, sig);
  sa.sa_flags = SA_RESTART;
  // Installed even where the shell left SIGINT ignored (a background job), so it is forwarded.
  for (int sig : kHandled) ::sigaction(sig, &sa, nullptr);
  struct sigaction ign{};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  ::sigaction(SIGPIPE, &ign, nullptr);
  sigset_t handled;
  sigemptyset(&handled);
  for (int sig : kHandled) sigaddset(&handled, sig);
  ::sigprocmask(SIG_UNBLOCK, &handled, nullptr);

  // --- start ---------------------------------------------------------------------------------
  world_ = n;
  path_ = *path;
  base_env_ = base_env;
  mask_ = &original_mask;
  ranks_.reserve(static_cast<std::size_t>(n) + static_cast<std::size_t>(opt_.elastic ? opt_.max_restarts : 0));
  ranks_.resize(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) ranks_[static_cast<std::size_t>(i)].rank = i;
  for (auto& r : ranks_) {
    const int in = (r.rank == 0 && stdin_ok) ? STDIN_FILENO : devnull;
    if (!start_rank(r, *path, base_env, original_mask, in)) {
      const int e = errno;
      for (auto& q : ranks_) q.reaped = q.pid < 0;  // never started: nothing to wait for
      exit_code_ = 1;
      stop_all(SIGTERM, "cannot start rank " + std::to_string(r.rank) + ": " + std::strerror(e));
      break;
    }
  }

  // --- supervise: until every rank has been reaped (not until EOF: a rank may close its
  // output and go on running, or leave a helper holding the pipes) ---------------------------
  const bool has_deadline = opt_.timeout > 0;
  const auto deadline = after(began_, has_deadline ? opt_.timeout : 0.0);
  sig_atomic_t signals_seen = 0;
  std::vector<pollfd> pfds;
  std::vector<std::pair<Rank*, Stream*>> owners;
  while (alive_ > 0) {
    int wait_ms = -1;
    auto until = [&](clock_type::time_point t) {
      auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - clock_type::now()).count();
      int v = static_cast<int>(std::clamp<long long>(ms, 0, 60'000));
      wait_ms = wait_ms < 0 ? v : std::min(wait_ms, v);
    };
    if (stopping_ && !killed_) until(kill_at_);
    if (!stopping_ && has_deadline) until(deadline);

    pfds.assign(1, pollfd{wake[0], POLLIN, 0});
    owners.assign(1, {nullptr, nullptr});
    for (auto& r : ranks_)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          pfds.push_back(pollfd{s->fd, POLLIN, 0});
          owners.emplace_back(&r, s);
        }
    if (::poll(pfds.data(), pfds.size(), wait_ms) < 0 && errno != EINTR) {
      say(std::string("poll failed: ") + std::strerror(errno));
      break;
    }
    if (pfds[0].revents & POLLIN) {
      char buf[256];
      while (::read(wake[0], buf, sizeof buf) > 0) {
      }
    }
    for (std::size_t k = 1; k < pfds.size(); ++k)
      if (pfds[k].revents & (POLLIN | POLLHUP | POLLERR)) read_some(*owners[k].first, *owners[k].second);

    if (g_signal_count != signals_seen) {
      signals_seen = g_signal_count;
      const int sig = g_last_signal;
      if (!stopping_) {
        exit_code_ = 128 + sig;
        stop_all(sig, "received " + signal_name(sig));
      } else if (!killed_ && alive_ > 0) {
        say("received " + signal_name(sig) + " again; sending SIGKILL to " + still_running());
        signal_unreaped(SIGKILL);
        killed_ = true;
        if (exit_code_ == 0) exit_code_ = 128 + sig;
      }
    }
    reap();
    if (!stopping_) start_replacements(devnull);
    const auto now = clock_type::now();
    if (!stopping_ && has_deadline && now >= deadline) {
      exit_code_ = 124;
      stop_all(SIGTERM, "timeout: the job ran longer than " + format_seconds(opt_.timeout));
    }
    if (stopping_ && !killed_ && alive_ > 0 && now >= kill_at_) {
      say(still_running() + " still running " + format_seconds(opt_.grace) +
          " after being told to stop; sending SIGKILL");
      signal_unreaped(SIGKILL);
      killed_ = true;
    }
  }

  for (auto& r : ranks_) {
    drain(r);
    for (Stream* s : {&r.out, &r.err}) {
      if (s->fd >= 0) ::close(s->fd);
      s->fd = -1;
      flush_partial(r, *s);
    }
  }
  if (devnull >= 0) ::close(devnull);
  g_wake_write = -1;
  ::close(wake[0]);
  ::close(wake[1]);
  return exit_code_;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Interactive mode

// Words safe to show unquoted in a shell command; anything else in single quotes.
std::string shell_word(const std::string& w) {
  const bool plain = !w.empty() && w.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                       "0123456789_-./=:,+@%") == std::string::npos;
  if (plain) return w;
  std::string q = "'";
  for (char c : w) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Asks until an answer passes `ok` (an empty line takes `dflt`); nullopt at the end of input.
std::optional<std::string> ask(const std::string& question, const std::string& dflt, const std::string& hint,
                               bool (*ok)(const std::string&, int), int limit) {
  while (true) {
    std::printf("%s [%s]: ", question.c_str(), dflt.c_str());
    std::fflush(stdout);
    std::string line;
    int c;
    while ((c = std::getchar()) != EOF && c != '\n') line += static_cast<char>(c);
    if (c == EOF && line.empty()) return std::nullopt;
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.pop_back();
    while (!line.empty() && line.front() == ' ') line.erase(line.begin());
    if (line.empty()) line = dflt;
    if (ok(line, limit)) return line;
    std::printf("  please answer %s\n", hint.c_str());
  }
}

// Returns the exit status when the questions end the run (no answer, or the program ran in
// this process's place and could not start); otherwise adjusts opt for the launch and returns
// nullopt. Threads mode replaces this process with PROGRAM (execv).
std::optional<int> interactive(Options& opt) {
  const int gpus = visible_gpus(), cpus = usable_cpus();
  const bool on_gpus = gpus > 0;
  std::printf("lockstep-run: %s\n", on_gpus
                                        ? (std::to_string(gpus) + " GPU" + (gpus == 1 ? "" : "s") + " found").c_str()
                                        : "no GPU found: CPU ranks");
  const auto mode = ask(
      "Run as [a]uto (one process per GPU; CPU ranks as threads of one process), [t]hreads (one "
      "process drives every rank) or [p]rocesses (one per rank)?",
      "a", "a, t or p", [](const std::string& a, int) { return a == "a" || a == "t" || a == "p"; }, 0);
  const auto no_answer = [] {
    std::fprintf(stderr, "\nlockstep-run: no answer (end of input); nothing was run\n");
    return 2;
  };
  if (!mode) return no_answer();
  const int most = on_gpus ? gpus : cpus;
  const auto count = ask(
      on_gpus ? "How many of the " + std::to_string(gpus) + " GPUs (1-" + std::to_string(gpus) + ")?"
              : "How many CPU ranks (1-" + std::to_string(cpus) + ")?",
      std::to_string(most), "a whole number from 1 to " + std::to_string(most),
      [](const std::string& a, int limit) {
        auto n = parse_long(a);
        return n && *n >= 1 && *n <= limit;
      },
      most);
  if (!count) return no_answer();
  const auto lr = ask(
      "Scale the learning rate with the global batch: [n]o, [l]inear or [s]quare root?", "n", "n, l or s",
      [](const std::string& a, int) { return a == "n" || a == "l" || a == "s"; }, 0);
  if (!lr) return no_answer();
  const int n = static_cast<int>(*parse_long(*count));
  const bool processes = *mode == "p" || (*mode == "a" && on_gpus);
  std::vector<std::string> env;
  if (*lr != "n") env.push_back(std::string("LOCKSTEP_LR_SCALING=") + (*lr == "l" ? "linear" : "sqrt"));
  std::vector<std::string> cmd;
  if (processes) {
    cmd = {"lockstep-run", "--nproc", std::to_string(n)};
    if (!on_gpus) cmd.push_back("--cpu");
  } else if (on_gpus) {
    std::string list;
    for (int d = 0; d < n; ++d) list += (d ? "," : "") + std::to_string(d);
    env.push_back("LOCKSTEP_DEVICES=" + list);
  } else {
    env.push_back("LOCKSTEP_CPU_RANKS=" + std::to_string(n));
  }
  std::string line;
  for (const auto& e : env) line += shell_word(e) + " ";
  for (const auto& w : cmd) line += shell_word(w) + " ";
  for (const auto& w : opt.command) line += shell_word(w) + " ";
  line.pop_back();
  std::printf("lockstep-run: the same without questions:\n  %s\n", line.c_str());
  std::fflush(stdout);
  for (const auto& e : env) ::putenv(::strdup(e.c_str()));
  if (processes) {
    opt.nproc = n;
    opt.cpu = !on_gpus;
    return std::nullopt;
  }
  // Threads: the program itself drives the ranks (run(Auto) in one process).
  const auto path = resolve_program(opt.command[0]);
  if (!path) {
    std::fprintf(stderr, "lockstep-run: cannot find an executable program '%s'\n", opt.command[0].c_str());
    return 127;
  }
  std::vector<char*> argv;
  for (auto& w : opt.command) argv.push_back(w.data());
  argv.push_back(nullptr);
  ::execv(path->c_str(), argv.data());
  std::fprintf(stderr, "lockstep-run: cannot run '%s': %s\n", path->c_str(), std::strerror(errno));
  return 127;
}

int main(int argc, char** argv) {
  Options opt = parse_options(argc, argv);
  const char* no_prompt = std::getenv("LOCKSTEP_NO_PROMPT");
  if (!opt.any_option && ::isatty(STDIN_FILENO) && !(no_prompt && *no_prompt && std::strcmp(no_prompt, "0") != 0))
    if (auto rc = interactive(opt)) return *rc;
  const auto began = clock_type::now();
  for (int restart = 0;; ++restart) {
    Launcher launcher(opt, restart, began);
    const int rc = launcher.run();
    // Not restarted: success, a stop for another reason than a rank's failure, or a signal to
    // lockstep-run (also one that came after the last rank was reaped).
    if (rc == 0 || launcher.rank_failure().empty() || opt.max_restarts == 0 || g_signal_count != 0) return rc;
    if (opt.timeout > 0 && clock_type::now() >= after(began, opt.timeout)) {
      say("timeout: the job ran longer than " + format_seconds(opt.timeout) +
          " (restarts included); not restarting after: " + launcher.rank_failure());
      return 124;
    }
    if (restart == opt.max_restarts) {
      say("giving up: the job failed in each of its " + std::to_string(restart + 1) + " launches (--max-restarts " +
          std::to_string(opt.max_restarts) + "); the last: " + launcher.rank_failure());
      return rc;
    }
    launcher.kill_leftovers();
    say("restarting the job (" + std::to_string(restart + 1) + " of " + std::to_string(opt.max_restarts) +
        " restarts): " + launcher.rank_failure());
  }
}
