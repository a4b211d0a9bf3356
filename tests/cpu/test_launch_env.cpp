// detect_launcher(): each launcher's variables, their precedence, overrides, and the errors
// for missing, malformed and contradictory values; Slurm's hostlist and task-count syntax
// checked against lists built independently in the test.
#include <doctest/doctest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <lockstep/core/detail/env.hpp>
#include <lockstep/launch/detail/same_job.hpp>
#include <lockstep/launch/launch_env.hpp>
#include <lockstep/store/hash_store.hpp>

#include "test_util.hpp"

using lockstep::config_error;
using lockstep::detect_launcher;
using lockstep::launch_overrides;
using lockstep_test::fresh_seed;

namespace {

//! Every variable detect_launcher reads. The guard clears them all (CI may run under a
//! launcher itself) and restores them afterwards.
const char* const all_vars[] = {"LOCKSTEP_RANK",
                                "LOCKSTEP_WORLD_SIZE",
                                "LOCKSTEP_LOCAL_RANK",
                                "LOCKSTEP_LOCAL_WORLD_SIZE",
                                "LOCKSTEP_MASTER_ADDR",
                                "LOCKSTEP_MASTER_PORT",
                                "LOCKSTEP_JOB_TOKEN",
                                "RANK",
                                "WORLD_SIZE",
                                "LOCAL_RANK",
                                "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR",
                                "MASTER_PORT",
                                "TORCHELASTIC_RUN_ID",
                                "OMPI_COMM_WORLD_RANK",
                                "OMPI_COMM_WORLD_SIZE",
                                "OMPI_COMM_WORLD_LOCAL_RANK",
                                "OMPI_COMM_WORLD_LOCAL_SIZE",
                                "SLURM_PROCID",
                                "SLURM_NTASKS",
                                "SLURM_NPROCS",
                                "SLURM_LOCALID",
                                "SLURM_NODEID",
                                "SLURM_NTASKS_PER_NODE",
                                "SLURM_TASKS_PER_NODE",
                                "SLURM_STEP_TASKS_PER_NODE",
                                "SLURM_JOB_NODELIST",
                                "SLURM_NODELIST",
                                "SLURM_STEP_NODELIST",
                                "SLURM_JOB_ID",
                                "SLURM_JOBID",
                                "SLURM_STEP_ID",
                                "SLURM_STEPID",
                                "PMI_RANK",
                                "PMI_SIZE",
                                "MPI_LOCALRANKID",
                                "MPI_LOCALNRANKS"};

class env_guard {
 public:
  env_guard() {
    for (const char* v : all_vars) {
      if (const char* s = std::getenv(v)) saved_[v] = s;
      ::unsetenv(v);
    }
  }
  ~env_guard() {
    for (const char* v : all_vars) ::unsetenv(v);
    for (const auto& [k, v] : saved_) ::setenv(k.c_str(), v.c_str(), 1);
  }
  void set(const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); }
  void set(const char* k, long v) { set(k, std::to_string(v)); }
  void unset(const char* k) { ::unsetenv(k); }
  void clear() {
    for (const char* v : all_vars) ::unsetenv(v);
  }

 private:
  std::map<std::string, std::string> saved_;
};

//! Expects config_error whose message names every string in `names`.
void expect_config_error(const std::vector<std::string>& names, const launch_overrides& o = {}) {
  try {
    auto r = detect_launcher(o);
    FAIL_CHECK("no config_error; launcher ", (r ? r->launcher : std::string("none")));
  } catch (const config_error& e) {
    const std::string m = e.what();
    for (const auto& n : names) CHECK_MESSAGE(m.find(n) != std::string::npos, "message '", m, "' lacks ", n);
  }
}

struct layout {
  int world, rank, local_world, local_rank;
};
layout random_layout(std::mt19937_64& rng) {
  const int local_world = std::uniform_int_distribution<int>(1, 8)(rng);
  const int nodes = std::uniform_int_distribution<int>(1, 16)(rng);
  const int world = local_world * nodes;
  const int rank = std::uniform_int_distribution<int>(0, world - 1)(rng);
  return {world, rank, local_world, rank % local_world};
}

//! Sets one launcher's four variables (rank, world, local rank, local world) from a layout.
void set_layout(env_guard& g, const char* const (&names)[4], const layout& l) {
  g.set(names[0], l.rank);
  g.set(names[1], l.world);
  g.set(names[2], l.local_rank);
  g.set(names[3], l.local_world);
}

std::string random_host(std::mt19937_64& rng) {
  static const char* names[] = {"node", "gpu-a", "h", "compute", "10.1.2."};
  return names[rng() % 5] + std::to_string(rng() % 250 + 1);
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("detect_launcher: nothing set means no launcher") {
  env_guard g;
  CHECK_FALSE(detect_launcher().has_value());
  g.set("MASTER_ADDR", "h1");  // an address alone is no launch
  g.set("LOCKSTEP_JOB_TOKEN", "t");
  CHECK_FALSE(detect_launcher().has_value());
}

TEST_CASE("detect_launcher: torchrun variables - random valid layouts") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  env_guard g;
  for (int trial = 0; trial < 200; ++trial) {
    g.clear();
    const layout l = random_layout(rng);
    const std::string host = random_host(rng);
    const int port = std::uniform_int_distribution<int>(1, 65535)(rng);
    set_layout(g, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}, l);
    g.set("MASTER_ADDR", host);
    g.set("MASTER_PORT", port);
    const bool with_id = rng() % 2;
    if (with_id) g.set("TORCHELASTIC_RUN_ID", "run" + std::to_string(trial));
    auto info = detect_launcher();
    REQUIRE(info.has_value());
    CHECK(info->launcher == "torchrun");
    CHECK(info->rank == l.rank);
    CHECK(info->world == l.world);
    CHECK(info->local_rank == l.local_rank);
    CHECK(info->local_world == l.local_world);
    CHECK(info->master_addr == host);
    CHECK(info->master_port == port);
    CHECK(info->job_token == (with_id ? "run" + std::to_string(trial) : std::string()));
    if (rng() % 2) {  // LOCKSTEP_JOB_TOKEN wins over torchrun's run id
      g.set("LOCKSTEP_JOB_TOKEN", "secret");
      CHECK(detect_launcher()->job_token == "secret");
    }
  }
}

TEST_CASE("detect_launcher: torchrun without MASTER_* leaves the address unknown") {
  env_guard g;
  g.set("RANK", 0);
  g.set("WORLD_SIZE", 1);
  g.set("LOCAL_RANK", 0);
  g.set("LOCAL_WORLD_SIZE", 1);
  auto info = detect_launcher();
  REQUIRE(info);
  CHECK(info->master_addr.empty());
  CHECK(info->master_port == 0);
  g.set("LOCKSTEP_MASTER_ADDR", "fallback");  // torchrun's own name first, ours as fallback
  g.set("LOCKSTEP_MASTER_PORT", 1234);
  CHECK(detect_launcher()->master_addr == "fallback");
  g.set("MASTER_ADDR", "primary");
  g.set("MASTER_PORT", 4321);
  CHECK(detect_launcher()->master_addr == "primary");
  CHECK(detect_launcher()->master_port == 4321);
}

TEST_CASE("detect_launcher: torchrun invalid combinations name the variables") {
  env_guard g;
  auto base = [&] {
    g.clear();
    g.set("RANK", 1);
    g.set("WORLD_SIZE", 4);
    g.set("LOCAL_RANK", 1);
    g.set("LOCAL_WORLD_SIZE", 2);
    g.set("MASTER_PORT", 29500);
  };
  base();
  REQUIRE(detect_launcher());
  base();
  g.unset("WORLD_SIZE");
  expect_config_error({"RANK", "WORLD_SIZE"});
  base();
  g.unset("RANK");
  expect_config_error({"RANK", "WORLD_SIZE"});
  base();
  g.unset("LOCAL_RANK");
  expect_config_error({"LOCAL_RANK"});
  base();
  g.unset("LOCAL_WORLD_SIZE");
  expect_config_error({"LOCAL_WORLD_SIZE"});
  base();
  g.clear();
  g.set("LOCAL_RANK", 0);
  expect_config_error({"RANK"});
  base();
  g.set("RANK", 4);
  expect_config_error({"RANK=4", "WORLD_SIZE=4"});
  base();
  g.set("RANK", 9);
  expect_config_error({"RANK", "WORLD_SIZE"});
  base();
  g.set("LOCAL_RANK", 2);
  expect_config_error({"LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"});
  base();
  g.set("LOCAL_WORLD_SIZE", 8);
  g.set("LOCAL_RANK", 5);
  expect_config_error({"LOCAL_WORLD_SIZE", "WORLD_SIZE"});
  base();
  g.set("WORLD_SIZE", 0);
  expect_config_error({"WORLD_SIZE"});
  base();
  g.set("LOCAL_WORLD_SIZE", 0);
  expect_config_error({"LOCAL_WORLD_SIZE"});
  for (const char* bad : {"abc", "1a", " 1", "1 ", "+1", "0x1", "1.0", "-", "99999999999999999999"}) {
    const std::string value = bad;
    CAPTURE(value);
    base();
    g.set("RANK", std::string(bad));
    expect_config_error({"RANK"});
    base();
    g.set("WORLD_SIZE", std::string(bad));
    expect_config_error({"WORLD_SIZE"});
    base();
    g.set("LOCAL_RANK", std::string(bad));
    expect_config_error({"LOCAL_RANK"});
    base();
    g.set("MASTER_PORT", std::string(bad));
    expect_config_error({"MASTER_PORT"});
  }
  base();
  g.set("RANK", -1);
  expect_config_error({"RANK", "negative"});
  base();
  g.set("LOCAL_RANK", -3);
  expect_config_error({"LOCAL_RANK", "negative"});
  for (long port : {0L, -1L, 65536L, 100000L}) {
    CAPTURE(port);
    base();
    g.set("MASTER_PORT", port);
    expect_config_error({"MASTER_PORT", "65535"});
  }
  base();
  g.set("MASTER_PORT", 65535);
  CHECK(detect_launcher()->master_port == 65535);
  base();
  g.set("MASTER_PORT", 1);
  CHECK(detect_launcher()->master_port == 1);
}

TEST_CASE("detect_launcher: lockstep-run variables win and must agree with torchrun's") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  env_guard g;
  for (int trial = 0; trial < 100; ++trial) {
    g.clear();
    const layout l = random_layout(rng);
    set_layout(g, {"LOCKSTEP_RANK", "LOCKSTEP_WORLD_SIZE", "LOCKSTEP_LOCAL_RANK", "LOCKSTEP_LOCAL_WORLD_SIZE"}, l);
    g.set("LOCKSTEP_MASTER_ADDR", "127.0.0.1");
    g.set("LOCKSTEP_MASTER_PORT", 20000 + trial);
    g.set("LOCKSTEP_JOB_TOKEN", "tok" + std::to_string(trial));
    const bool both = rng() % 2;
    if (both) {  // lockstep-run sets the torchrun names too
      set_layout(g, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}, l);
      g.set("MASTER_ADDR", "elsewhere");
      g.set("MASTER_PORT", 1);
    }
    auto info = detect_launcher();
    REQUIRE(info);
    CHECK(info->launcher == "lockstep-run");
    CHECK(info->rank == l.rank);
    CHECK(info->world == l.world);
    CHECK(info->local_rank == l.local_rank);
    CHECK(info->local_world == l.local_world);
    CHECK(info->master_addr == "127.0.0.1");
    CHECK(info->master_port == 20000 + trial);
    CHECK(info->job_token == "tok" + std::to_string(trial));
    if (both && l.world > 1) {  // a stale torchrun value is an error naming both
      g.set("RANK", (l.rank + 1) % l.world);
      expect_config_error({"LOCKSTEP_RANK", "RANK="});
    }
  }
  g.clear();  // only the global pair: one host, local = global
  g.set("LOCKSTEP_RANK", 2);
  g.set("LOCKSTEP_WORLD_SIZE", 3);
  auto info = detect_launcher();
  REQUIRE(info);
  CHECK(info->local_rank == 2);
  CHECK(info->local_world == 3);
  g.set("LOCKSTEP_LOCAL_RANK", 0);  // half of the local pair is an error
  expect_config_error({"LOCKSTEP_LOCAL_WORLD_SIZE"});
  g.clear();
  g.set("LOCKSTEP_WORLD_SIZE", 3);
  expect_config_error({"LOCKSTEP_RANK"});
  g.set("LOCKSTEP_RANK", 3);
  expect_config_error({"LOCKSTEP_RANK=3", "LOCKSTEP_WORLD_SIZE=3"});
}

TEST_CASE("detect_launcher: Open MPI") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  env_guard g;
  for (int trial = 0; trial < 100; ++trial) {
    g.clear();
    const layout l = random_layout(rng);
    set_layout(
        g, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
        l);
    const int addr_kind = static_cast<int>(rng() % 3);  // none, MASTER_*, LOCKSTEP_MASTER_*
    if (addr_kind == 1) {
      g.set("MASTER_ADDR", "m1");
      g.set("MASTER_PORT", 1111);
    } else if (addr_kind == 2) {
      g.set("LOCKSTEP_MASTER_ADDR", "m2");
      g.set("LOCKSTEP_MASTER_PORT", 2222);
      g.set("MASTER_ADDR", "m1");
    }
    auto info = detect_launcher();
    REQUIRE(info);
    CHECK(info->launcher == "openmpi");
    CHECK(info->rank == l.rank);
    CHECK(info->world == l.world);
    CHECK(info->local_rank == l.local_rank);
    CHECK(info->local_world == l.local_world);
    CHECK(info->master_addr == (addr_kind == 0 ? "" : addr_kind == 1 ? "m1" : "m2"));
    CHECK(info->master_port == (addr_kind == 0 ? 0 : addr_kind == 1 ? 1111 : 2222));
  }
  g.clear();
  g.set("OMPI_COMM_WORLD_RANK", 0);
  g.set("OMPI_COMM_WORLD_SIZE", 2);
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  expect_config_error({"OMPI_COMM_WORLD_LOCAL_SIZE"});
  g.set("OMPI_COMM_WORLD_LOCAL_SIZE", 2);
  g.set("OMPI_COMM_WORLD_RANK", 2);
  expect_config_error({"OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2"});
  g.set("OMPI_COMM_WORLD_RANK", 1);
  g.set("RANK", 0);  // torchrun's variables come before MPI's
  g.set("WORLD_SIZE", 1);
  g.set("LOCAL_RANK", 0);
  g.set("LOCAL_WORLD_SIZE", 1);
  CHECK(detect_launcher()->launcher == "torchrun");
}

TEST_CASE("detect_launcher: MPICH and Intel MPI (PMI)") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  env_guard g;
  for (int trial = 0; trial < 100; ++trial) {
    g.clear();
    const layout l = random_layout(rng);
    set_layout(g, {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}, l);
    const bool addr = rng() % 2 == 0;
    if (addr) {
      g.set("MASTER_ADDR", "m1");
      g.set("MASTER_PORT", 1234);
    }
    if (l.world > 1 && rng() % 2 == 0) {  // Hydra under Slurm: its proxy's SLURM_PROCID differs
      g.set("SLURM_PROCID", (l.rank + 1) % l.world);
      g.set("SLURM_NTASKS", l.world);
    }
    auto info = detect_launcher();
    REQUIRE(info);
    CHECK(info->launcher == "mpich");
    CHECK(info->rank == l.rank);
    CHECK(info->world == l.world);
    CHECK(info->local_rank == l.local_rank);
    CHECK(info->local_world == l.local_world);
    CHECK(info->master_addr == (addr ? "m1" : ""));
    CHECK(info->master_port == (addr ? 1234 : 0));
  }
  g.clear();
  g.set("PMI_RANK", 1);
  g.set("PMI_SIZE", 4);
  expect_config_error({"MPI_LOCALRANKID"});
  g.set("MPI_LOCALRANKID", 1);
  expect_config_error({"MPI_LOCALNRANKS"});
  g.set("MPI_LOCALNRANKS", 2);
  g.set("PMI_RANK", 4);
  expect_config_error({"PMI_RANK=4", "PMI_SIZE=4"});
  g.set("PMI_RANK", "x");
  expect_config_error({"PMI_RANK"});
  g.set("PMI_RANK", 1);
  // srun --mpi=pmi2: PMI and Slurm agree, and Slurm's reading (store host, token) is taken.
  g.set("SLURM_PROCID", 1);
  g.set("SLURM_NTASKS", 4);
  g.set("SLURM_LOCALID", 1);
  g.set("SLURM_NTASKS_PER_NODE", 2);
  g.set("SLURM_JOB_NODELIST", "node[3-4]");
  g.set("SLURM_JOB_ID", 77);
  auto both = detect_launcher();
  REQUIRE(both);
  CHECK(both->launcher == "slurm");
  CHECK(both->master_addr == "node3");
  g.set("SLURM_PROCID", 2);  // they disagree: Hydra's PMI rank is the MPI rank
  CHECK(detect_launcher()->launcher == "mpich");
  CHECK(detect_launcher()->rank == 1);
  g.set("OMPI_COMM_WORLD_RANK", 0);  // Open MPI's variables come first
  g.set("OMPI_COMM_WORLD_SIZE", 1);
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  g.set("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  CHECK(detect_launcher()->launcher == "openmpi");
}

TEST_CASE("Slurm hostlist: first host") {
  using lockstep::detail::slurm_first_host;
  CHECK(slurm_first_host("node[01-04,07]") == "node01");
  CHECK(slurm_first_host("a1,b2") == "a1");
  CHECK(slurm_first_host("gpu-[3,5]") == "gpu-3");
  CHECK(slurm_first_host("single") == "single");
  CHECK(slurm_first_host("n[7]") == "n7");
  CHECK(slurm_first_host("r[1-2]-n[08-09],x") == "r1-n08");
  CHECK(slurm_first_host("[5-6]x") == "5x");
  CHECK(slurm_first_host("node[001-100]-ib,other[1-3]") == "node001-ib");
  for (const char* bad :
       {"", ",a", "node[1-2", "node1-2]", "n[]", "n[a-b]", "n[1-]", "n[,1]", "n[1,]", "n[[1]]", "n[1-2x]", "a b"}) {
    const std::string list = bad;
    CAPTURE(list);
    CHECK_THROWS_AS(slurm_first_host(bad), config_error);
  }
  // Random lists built piece by piece; the expected first host is assembled separately.
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 500; ++trial) {
    std::string list, first;
    const int groups = static_cast<int>(rng() % 3);
    std::string prefix = std::string(1, static_cast<char>('a' + rng() % 26)) + (rng() % 2 ? "-" : "");
    list += prefix;
    first += prefix;
    for (int gi = 0; gi < groups; ++gi) {
      const int width = 1 + static_cast<int>(rng() % 4);
      auto num = [&](unsigned v) {
        std::string s = std::to_string(v);
        if (static_cast<int>(s.size()) < width) s.insert(0, static_cast<std::size_t>(width) - s.size(), '0');
        return s;
      };
      const int items = 1 + static_cast<int>(rng() % 4);
      list += "[";
      for (int i = 0; i < items; ++i) {
        const unsigned lo = static_cast<unsigned>(rng() % 50);
        const std::string a = num(lo);
        if (i == 0) first += a;
        if (i) list += ',';
        list += a;
        if (rng() % 2) {
          list += '-';
          list += num(lo + static_cast<unsigned>(rng() % 9));
        }
      }
      list += "]";
      if (rng() % 2) {
        list += "-s";
        first += "-s";
      }
    }
    if (rng() % 2) list += ",other[1-3],x";
    CAPTURE(list);
    CHECK(slurm_first_host(list) == first);
  }
}

TEST_CASE("Slurm task-count lists") {
  using lockstep::detail::slurm_tasks_on_node;
  CHECK(slurm_tasks_on_node("2(x3),1", 0, "V") == 2);
  CHECK(slurm_tasks_on_node("2(x3),1", 2, "V") == 2);
  CHECK(slurm_tasks_on_node("2(x3),1", 3, "V") == 1);
  CHECK(slurm_tasks_on_node("4", 0, "V") == 4);
  CHECK(slurm_tasks_on_node("4(x2)", -1, "V") == 4);
  CHECK_FALSE(slurm_tasks_on_node("2(x3),1", -1, "V").has_value());
  CHECK_THROWS_AS(slurm_tasks_on_node("2(x3),1", 4, "V"), config_error);
  for (const char* bad : {"", "x", "2(3)", "2(x)", "2(x3", "2x3", "0", "2,", ",2", "2(x0)", "-1", "2(x3),a"}) {
    const std::string spec = bad;
    CAPTURE(spec);
    CHECK_THROWS_AS(slurm_tasks_on_node(bad, 0, "V"), config_error);
  }
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int> per_node;  // the reference: one count per node
    std::string spec;
    const int runs = 1 + static_cast<int>(rng() % 5);
    for (int r = 0; r < runs; ++r) {
      const int count = 1 + static_cast<int>(rng() % 8);
      const int repeat = 1 + static_cast<int>(rng() % 4);
      if (r) spec += ',';
      spec += std::to_string(count);
      if (repeat > 1 || rng() % 4 == 0) spec += "(x" + std::to_string(repeat) + ")";
      per_node.insert(per_node.end(), static_cast<std::size_t>(repeat), count);
    }
    CAPTURE(spec);
    for (std::size_t n = 0; n < per_node.size(); ++n)
      CHECK(slurm_tasks_on_node(spec, static_cast<int>(n), "V") == per_node[n]);
    const bool uniform = std::all_of(per_node.begin(), per_node.end(), [&](int c) { return c == per_node[0]; });
    const auto u = slurm_tasks_on_node(spec, -1, "V");
    CHECK(u.has_value() == uniform);
    if (uniform) CHECK(*u == per_node[0]);
  }
}

TEST_CASE("detect_launcher: Slurm") {
  env_guard g;
  auto base = [&] {
    g.clear();
    g.set("SLURM_PROCID", 6);
    g.set("SLURM_NTASKS", 7);
    g.set("SLURM_LOCALID", 0);
    g.set("SLURM_NODEID", 3);
    g.set("SLURM_TASKS_PER_NODE", "2(x3),1");
    g.set("SLURM_JOB_NODELIST", "gpu[07-10]");
    g.set("SLURM_JOB_ID", 123456);
    g.set("SLURM_STEP_ID", 2);
  };
  base();
  auto info = detect_launcher();
  REQUIRE(info);
  CHECK(info->launcher == "slurm");
  CHECK(info->rank == 6);
  CHECK(info->world == 7);
  CHECK(info->local_rank == 0);
  CHECK(info->local_world == 1);  // the last node of "2(x3),1"
  CHECK(info->master_addr == "gpu07");
  CHECK(info->master_port == 15000 + ((123456 % 17000) * 16 + 2) % 17000);
  CHECK(info->job_token == "slurm-123456.2");

  base();
  g.set("SLURM_NODEID", 1);
  g.set("SLURM_PROCID", 3);
  g.set("SLURM_LOCALID", 1);
  CHECK(detect_launcher()->local_world == 2);
  base();
  g.set("SLURM_STEP_TASKS_PER_NODE", "1(x3),4");
  g.set("SLURM_LOCALID", 3);  // the step's list wins
  CHECK(detect_launcher()->local_world == 4);
  base();
  g.set("SLURM_STEP_NODELIST", "step[2-3]");
  CHECK(detect_launcher()->master_addr == "step2");
  base();
  g.set("MASTER_ADDR", "explicit-host");
  g.set("MASTER_PORT", 3000);
  g.set("LOCKSTEP_JOB_TOKEN", "s3cret");
  info = detect_launcher();
  CHECK(info->master_addr == "explicit-host");
  CHECK(info->master_port == 3000);
  CHECK(info->job_token == "s3cret");
  base();
  g.unset("SLURM_NODEID");
  g.set("SLURM_NTASKS_PER_NODE", 2);
  g.set("SLURM_PROCID", 1);
  g.set("SLURM_LOCALID", 1);
  CHECK(detect_launcher()->local_world == 2);
  base();
  g.unset("SLURM_NODEID");  // uneven list, no node id, no per-node count: cannot tell
  expect_config_error({"SLURM_NTASKS_PER_NODE"});
  base();
  g.unset("SLURM_NODEID");
  g.set("SLURM_TASKS_PER_NODE", "3(x2)");
  g.set("SLURM_NTASKS", 6);
  g.set("SLURM_PROCID", 5);
  g.set("SLURM_LOCALID", 2);
  CHECK(detect_launcher()->local_world == 3);
  base();
  g.set("SLURM_LOCALID", 1);  // node 3 holds one task
  expect_config_error({"SLURM_LOCALID=1", "SLURM_TASKS_PER_NODE"});
  base();
  g.set("SLURM_PROCID", 7);
  expect_config_error({"SLURM_PROCID=7", "SLURM_NTASKS=7"});
  base();
  g.unset("SLURM_NTASKS");
  g.set("SLURM_NPROCS", 7);
  CHECK(detect_launcher()->world == 7);
  base();
  g.unset("SLURM_NTASKS");
  expect_config_error({"SLURM_NTASKS"});
  base();
  g.set("SLURM_JOB_NODELIST", "bad[1-");
  expect_config_error({"SLURM_JOB_NODELIST", "MASTER_ADDR"});
  base();
  g.set("SLURM_NODEID", 9);
  expect_config_error({"SLURM_NODEID=9"});
  base();
  g.set("SLURM_LOCALID", "x");
  expect_config_error({"SLURM_LOCALID"});
  base();
  g.unset("SLURM_JOB_ID");
  g.unset("SLURM_JOB_NODELIST");
  info = detect_launcher();
  CHECK(info->master_addr.empty());
  CHECK(info->master_port == 0);
  CHECK(info->job_token.empty());
  base();
  g.set("OMPI_COMM_WORLD_RANK", 0);
  g.set("OMPI_COMM_WORLD_SIZE", 1);  // mpirun inside an allocation
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  g.set("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  CHECK(detect_launcher()->launcher == "openmpi");
}

TEST_CASE("detect_launcher: overrides beat the environment") {
  env_guard g;
  launch_overrides o;
  o.rank = 1;
  o.world = 2;
  auto info = detect_launcher(o);  // no variables: explicit, one host
  REQUIRE(info);
  CHECK(info->launcher == "explicit");
  CHECK(info->rank == 1);
  CHECK(info->world == 2);
  CHECK(info->local_rank == 1);
  CHECK(info->local_world == 2);
  CHECK(info->master_addr.empty());

  launch_overrides only_port;
  only_port.master_port = 5000;
  expect_config_error({"rank", "world"}, only_port);  // no launcher to complete it

  g.set("RANK", 3);
  g.set("WORLD_SIZE", 8);
  g.set("LOCAL_RANK", 1);
  g.set("LOCAL_WORLD_SIZE", 2);
  g.set("MASTER_ADDR", "env-host");
  g.set("MASTER_PORT", 29500);
  info = detect_launcher(only_port);  // one field replaced, the launcher stays
  CHECK(info->launcher == "torchrun");
  CHECK(info->master_port == 5000);
  CHECK(info->master_addr == "env-host");
  CHECK(info->rank == 3);

  launch_overrides all;
  all.rank = 0;
  all.world = 4;
  all.local_rank = 0;
  all.local_world = 4;
  all.master_addr = "code-host";
  all.master_port = 7000;
  all.job_token = "tok";
  info = detect_launcher(all);
  CHECK(info->launcher == "explicit");
  CHECK(info->rank == 0);
  CHECK(info->world == 4);
  CHECK(info->local_world == 4);
  CHECK(info->master_addr == "code-host");
  CHECK(info->master_port == 7000);
  CHECK(info->job_token == "tok");

  launch_overrides bad = all;
  bad.rank = 4;
  expect_config_error({"launch_overrides::rank=4", "launch_overrides::world=4"}, bad);
  bad = all;
  bad.master_port = 70000;
  expect_config_error({"master_port", "65535"}, bad);
  bad = all;
  bad.local_rank = 5;
  expect_config_error({"launch_overrides::local_rank"}, bad);
  // An override does not hide a malformed variable: the variable is still an error.
  g.set("WORLD_SIZE", "eight");
  expect_config_error({"WORLD_SIZE"}, all);
}

TEST_CASE("env_between: a number in range - else an error naming the variable and the value and the range") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  const char* name = "LOCKSTEP_TEST_ENV_BETWEEN";
  const long lo = static_cast<long>(rng() % 100), hi = lo + 1 + static_cast<long>(rng() % 1000);
  ::unsetenv(name);
  CHECK_FALSE(lockstep::detail::env_between(name, lo, hi, "blocks").has_value());
  const long in = lo + static_cast<long>(rng() % static_cast<std::uint64_t>(hi - lo + 1));
  ::setenv(name, std::to_string(in).c_str(), 1);
  CHECK(lockstep::detail::env_between(name, lo, hi, "blocks") == in);
  for (const std::string bad :
       {std::to_string(lo - 1), std::to_string(hi + 1), std::string("12x"), std::string("1e3")}) {
    CAPTURE(bad);
    ::setenv(name, bad.c_str(), 1);
    const std::string want = std::string(name) + "='" + bad + "' is not a whole number of blocks from " +
                             std::to_string(lo) + " to " + std::to_string(hi);
    CHECK_THROWS_WITH_AS((void)lockstep::detail::env_between(name, lo, hi, "blocks"), doctest::Contains(want.c_str()),
                         config_error);
  }
  ::unsetenv(name);
}

TEST_CASE(
    "check_same_job: ranks with another order-check mode or world or launcher than rank 0's are refused by name") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  // Each mode as the environment sets it: {LOCKSTEP_DEBUG, LOCKSTEP_CHECK_ORDER} (null: unset).
  struct mode {
    const char* debug;
    const char* check;
    const char* name;
  };
  const mode modes[] = {{nullptr, nullptr, "deferred"}, {nullptr, "deferred", "deferred"},
                        {nullptr, "off", "off"},        {nullptr, "0", "off"},
                        {"1", nullptr, "immediate"},    {nullptr, "sync", "immediate"}};
  const auto set_mode = [](const mode& m) {
    for (auto [k, v] : {std::pair{"LOCKSTEP_DEBUG", m.debug}, std::pair{"LOCKSTEP_CHECK_ORDER", m.check}})
      v ? ::setenv(k, v, 1) : ::unsetenv(k);
  };
  const auto saved_debug = lockstep::detail::env("LOCKSTEP_DEBUG"),
             saved_check = lockstep::detail::env("LOCKSTEP_CHECK_ORDER");
  for (int trial = 0; trial < 12; ++trial) {
    const mode& m0 = modes[rng() % std::size(modes)];
    const mode& m1 = modes[rng() % std::size(modes)];
    const int world = 2 + static_cast<int>(rng() % 7), other_world = rng() % 4 == 0 ? world + 1 : world;
    const std::string launcher = rng() % 4 == 0 ? "torchrun" : "lockstep-run";
    CAPTURE(m0.name);
    CAPTURE(m1.name);
    CAPTURE(other_world);
    CAPTURE(launcher);
    lockstep::HashStore store(world, std::chrono::seconds(2));
    set_mode(m0);
    lockstep::detail::check_same_job(store, {.rank = 0, .world = world, .launcher = "lockstep-run"});
    set_mode(m1);
    const lockstep::launch_info rank1{.rank = 1, .world = other_world, .launcher = launcher};
    const bool same = std::string(m0.name) == m1.name && other_world == world && launcher == "lockstep-run";
    if (same) {
      CHECK_NOTHROW(lockstep::detail::check_same_job(store, rank1));
    } else {
      try {
        lockstep::detail::check_same_job(store, rank1);
        FAIL_CHECK("rank 1 was let in");
      } catch (const lockstep::mismatch_error& e) {
        const std::string msg = e.what();
        CHECK(msg.find(std::string("order check ") + m1.name + "' but rank 0 runs") != std::string::npos);
        CHECK(msg.find(std::string("order check ") + m0.name + "':") != std::string::npos);
        CHECK(msg.find("world " + std::to_string(other_world) + ", launcher " + launcher) != std::string::npos);
        CHECK(msg.find("LOCKSTEP_CHECK_ORDER / LOCKSTEP_DEBUG") != std::string::npos);
      }
    }
  }
  set_mode({saved_debug ? saved_debug->c_str() : nullptr, saved_check ? saved_check->c_str() : nullptr, ""});
}

}  // TEST_SUITE
