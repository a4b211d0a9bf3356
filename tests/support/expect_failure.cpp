// Runs a command (an mpirun job) and passes only if it fails — non-zero exit status, its
// output containing an expected message — within a time limit (a hang is killed by ctest's
// TIMEOUT and fails too).
//   mpi_expect_failure <max seconds> <expected text> <command> [args...]
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <max seconds> <expected text> <command> [args...]\n", argv[0]);
    return 2;
  }
  const double limit = std::strtod(argv[1], nullptr);
  const std::string expected = argv[2];
  std::string cmd;
  for (int i = 3; i < argc; ++i) {
    std::string a = argv[i], q = "'";
    for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    cmd += q + "' ";
  }
  cmd += "2>&1";
  std::printf("running: %s\n", cmd.c_str());
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    std::perror("popen");
    return 2;
  }
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s\n--- exit status %d (raw %d) after %.1f s\n", out.c_str(),
              WIFEXITED(status) ? WEXITSTATUS(status) : -1, status, secs);
  bool ok = true;
  if (status == 0) {
    std::printf("FAIL: the job exited with status 0; it should have failed\n");
    ok = false;
  }
  if (out.find(expected) == std::string::npos) {
    std::printf("FAIL: the output lacks '%s'\n", expected.c_str());
    ok = false;
  }
  if (!(secs < limit)) {
    std::printf("FAIL: the job took %.1f s, more than %.1f s\n", secs, limit);
    ok = false;
  }
  if (ok) std::puts("PASS");
  return ok ? 0 : 1;
}
