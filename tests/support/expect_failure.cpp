// Runs a command (an mpirun or lockstep-run job) and passes only if it fails — non-zero exit
// status, its output containing the expected messages — within a time limit (a hang is
// killed by ctest's TIMEOUT and fails too).
//   expect_failure <max seconds> <expected> <command> [args...]
// <expected>: texts separated by " && ", each of which must appear; "N*text" must appear at
// least N times (e.g. once per rank).
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <max seconds> <expected> <command> [args...]\n", argv[0]);
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
  for (std::size_t from = 0; from <= expected.size();) {
    std::size_t to = expected.find(" && ", from);
    if (to == std::string::npos) to = expected.size();
    std::string want = expected.substr(from, to - from);
    from = to + 4;
    if (want.empty()) continue;
    int times = 1;
    if (const auto star = want.find('*');
        star != std::string::npos && star > 0 && want.find_first_not_of("0123456789") == star) {
      times = std::atoi(want.substr(0, star).c_str());
      want = want.substr(star + 1);
    }
    int found = 0;
    for (std::size_t at = out.find(want); at != std::string::npos; at = out.find(want, at + want.size())) ++found;
    if (found < times) {
      std::printf("FAIL: the output has '%s' %d times, expected at least %d\n", want.c_str(), found, times);
      ok = false;
    }
  }
  if (!(secs < limit)) {
    std::printf("FAIL: the job took %.1f s, more than %.1f s\n", secs, limit);
    ok = false;
  }
  if (ok) std::puts("PASS");
  return ok ? 0 : 1;
}
