#pragma once
//! lockstep::detect_launcher() — which launcher started this process, and as which rank.
//!
//! Sources, first match wins (each field of `launch_overrides` beats all of them):
//!   1. lockstep-run: LOCKSTEP_RANK, LOCKSTEP_WORLD_SIZE, LOCKSTEP_LOCAL_RANK,
//!      LOCKSTEP_LOCAL_WORLD_SIZE, LOCKSTEP_MASTER_ADDR, LOCKSTEP_MASTER_PORT (it sets the
//!      torchrun names as well; where both are set they must agree).
//!   2. torchrun (also `torchrun --no-python ./prog`): RANK, WORLD_SIZE, LOCAL_RANK,
//!      LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
//!   3. Open MPI (mpirun): OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; the store
//!      address only from LOCKSTEP_MASTER_* or MASTER_* (else none: MPI can be the store).
//!   4. MPICH / Intel MPI (Hydra's mpiexec): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,
//!      MPI_LOCALNRANKS; the store address as for Open MPI. Where Slurm's variables say the
//!      same rank and size (srun --mpi=pmi2 sets both), Slurm's reading (5) is taken.
//!   5. Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the tasks on this node from
//!      SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE at SLURM_NODEID ("2(x3),1"), else
//!      SLURM_NTASKS_PER_NODE; the store host is the first host of SLURM_STEP_NODELIST /
//!      SLURM_JOB_NODELIST / SLURM_NODELIST and the port 15000 + (16·job id + step id) mod
//!      17000, unless LOCKSTEP_MASTER_* / MASTER_* say otherwise.
//! Job token (the TCP store admits only processes that present it): LOCKSTEP_JOB_TOKEN,
//! else TORCHELASTIC_RUN_ID (torchrun's --rdzv-id), else for Slurm "slurm-<job>.<step>", else
//! for Open MPI "openmpi-<PMIX_NAMESPACE>" (a new one per mpirun). Only LOCKSTEP_JOB_TOKEN can
//! be a secret; the others only keep two jobs apart. The token is also the run id
//! (lockstep::run_id_of): a process of another run is refused by the store, so a new run never
//! mixes with a stale one (docs/reliability.md, scenario 6). lockstep-run draws a fresh random
//! token per launch; torchrun's is "none" unless --rdzv-id or --standalone is given.

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

//! Where this process sits in a job started by a launcher.
struct launch_info {
  int rank = 0;             //!< 0..world-1
  int world = 1;            //!< processes in the job
  int local_rank = 0;       //!< 0..local_world-1: index on this host (picks the GPU)
  int local_world = 1;      //!< processes on this host
  std::string master_addr;  //!< host of the rank-0 store; empty when unknown
  int master_port = 0;      //!< its port; 0 when unknown
  std::string launcher;     //!< "lockstep-run", "torchrun", "openmpi", "slurm" or "explicit"
  std::string job_token;    //!< shared by the job's processes, and its run id (run_id_of); may be empty
};

//! Values given in code; each set field beats every environment variable.
struct launch_overrides {
  std::optional<int> rank, world, local_rank, local_world;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  std::optional<std::string> job_token;
};

namespace detail {

//! A strict decimal integer in [lo, hi]; `what` names the variable for the message.
inline int parse_launch_int(std::string_view text, const std::string& what, long lo, long hi, const char* meaning) {
  long v = 0;
  const char* b = text.data();
  const char* e = b + text.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (text.empty() || ec == std::errc::invalid_argument || p != e || (text[0] == '-' && text.size() == 1))
    throw config_error(what + "='" + std::string(text) + "' is not an integer; it should be " + meaning);
  if (ec == std::errc::result_out_of_range || v < lo || v > hi)
    throw config_error(what + "=" + std::string(text) + " is " + (v < 0 && lo >= 0 ? "negative" : "out of range") +
                       "; it should be " + meaning + " (" + std::to_string(lo) + ".." + std::to_string(hi) + ")");
  return static_cast<int>(v);
}

//! The first host of a Slurm hostlist: "node[01-04,07]" → "node01", "a1,b2" → "a1",
//! "gpu-[3,5]" → "gpu-3", "r[1-2]-n[08-09]" → "r1-n08".
inline std::string slurm_first_host(std::string_view list, const char* var = "SLURM_JOB_NODELIST") {
  auto bad = [&](const char* why) {
    return config_error(std::string(var) + "='" + std::string(list) + "' is not a Slurm hostlist (" + why +
                        "); set MASTER_ADDR to the host of rank 0 instead");
  };
  auto digits = [](std::string_view s) {
    if (s.empty()) return false;
    for (char c : s)
      if (c < '0' || c > '9') return false;
    return true;
  };
  std::string host;
  std::size_t i = 0;
  while (i < list.size() && list[i] != ',') {
    const char c = list[i];
    if (c == ']') throw bad("']' without '['");
    if (c == '[') {
      const std::size_t close = list.find(']', i);
      if (close == std::string_view::npos) throw bad("'[' without ']'");
      const std::string_view inner = list.substr(i + 1, close - i - 1);
      if (inner.find('[') != std::string_view::npos) throw bad("nested '['");
      std::string_view first;
      std::size_t at = 0;
      while (true) {  // validate every "a" or "a-b" item, keep the first a
        const std::size_t comma = inner.find(',', at);
        const std::string_view item = inner.substr(at, comma == std::string_view::npos ? inner.npos : comma - at);
        const std::size_t dash = item.find('-');
        const std::string_view a = item.substr(0, dash);
        if (!digits(a) || (dash != std::string_view::npos && !digits(item.substr(dash + 1))))
          throw bad("a range in [] is not digits or digits-digits");
        if (first.empty()) first = a;
        if (comma == std::string_view::npos) break;
        at = comma + 1;
      }
      host += first;
      i = close + 1;
      continue;
    }
    if (static_cast<unsigned char>(c) <= ' ') throw bad("blank or control character");
    host += c;
    ++i;
  }
  if (host.empty()) throw bad("empty first host");
  return host;
}

//! Tasks on node `node` from a Slurm per-node count list such as "2(x3),1" (= 2,2,2,1).
//! node < 0: the count when every node has the same one, else nullopt.
inline std::optional<int> slurm_tasks_on_node(std::string_view spec, int node, const char* var) {
  auto bad = [&] {
    return config_error(std::string(var) + "='" + std::string(spec) +
                        "' is not a Slurm task count list like \"2(x3),1\"; unset it or set "
                        "LOCAL_WORLD_SIZE / launch_overrides::local_world");
  };
  auto number = [&](std::string_view s) {
    long v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc{} || p != s.data() + s.size() || v < 1 || v > 1'000'000'000) throw bad();
    return static_cast<int>(v);
  };
  std::vector<std::pair<int, long long>> runs;  // (count, repeat), all parsed before any answer
  std::size_t at = 0;
  while (true) {
    const std::size_t comma = spec.find(',', at);
    std::string_view item = spec.substr(at, comma == std::string_view::npos ? spec.npos : comma - at);
    long long repeat = 1;
    if (const std::size_t paren = item.find('('); paren != std::string_view::npos) {
      if (item.size() < paren + 4 || item.substr(paren, 2) != "(x" || item.back() != ')') throw bad();
      repeat = number(item.substr(paren + 2, item.size() - paren - 3));
      item = item.substr(0, paren);
    }
    runs.emplace_back(number(item), repeat);
    if (comma == std::string_view::npos) break;
    at = comma + 1;
  }
  long long seen = 0;
  bool mixed = false;
  for (const auto& [count, repeat] : runs) {
    if (node >= 0 && node < seen + repeat) return count;
    seen += repeat;
    mixed = mixed || count != runs.front().first;
  }
  if (node >= 0)
    throw config_error(std::string(var) + "='" + std::string(spec) + "' lists " + std::to_string(seen) +
                       " node(s) but SLURM_NODEID=" + std::to_string(node) +
                       "; the Slurm variables disagree (stale exports?)");
  if (mixed) return std::nullopt;
  return runs.front().first;
}

//! What one source (or the overrides) says, field by field, with the variable names
//! used, so that messages name what to fix.
struct launch_partial {
  std::string launcher;
  std::optional<int> rank, world, local_rank, local_world, master_port;
  std::optional<std::string> master_addr, job_token;
  std::string rank_var, world_var, local_rank_var, local_world_var;
};

inline constexpr const char* rank_meaning = "this process's rank, from 0 to the world size - 1";
inline constexpr const char* world_meaning = "the number of processes in the job";
inline constexpr const char* port_meaning = "the TCP port of the rank-0 store";

inline std::optional<int> launch_env_int(const char* name, long lo, long hi, const char* meaning) {
  auto v = env(name);
  if (!v) return std::nullopt;
  return parse_launch_int(*v, name, lo, hi, meaning);
}

//! Fills the store address and token the way every source shares.
inline void launch_common(launch_partial& p, bool lockstep_first) {
  const char* addr_vars[2] = {"LOCKSTEP_MASTER_ADDR", "MASTER_ADDR"};
  const char* port_vars[2] = {"LOCKSTEP_MASTER_PORT", "MASTER_PORT"};
  if (!lockstep_first) {  // torchrun: its own names first
    std::swap(addr_vars[0], addr_vars[1]);
    std::swap(port_vars[0], port_vars[1]);
  }
  for (const char* v : addr_vars)
    if (!p.master_addr) p.master_addr = env(v);
  for (const char* v : port_vars)
    if (!p.master_port) p.master_port = launch_env_int(v, 1, 65535, port_meaning);
  p.job_token = env("LOCKSTEP_JOB_TOKEN");
  if (!p.job_token) p.job_token = env("TORCHELASTIC_RUN_ID");
}

//! A launcher that names rank, world, local rank and local world in four variables:
//! present when any of the first `signal` is set; the store address as launch_common says.
inline std::optional<launch_partial> launch_from_vars(const char* launcher, const char* const (&v)[4], int signal,
                                                      bool lockstep_first) {
  bool present = false;
  for (int i = 0; i < signal; ++i) present = present || env(v[i]).has_value();
  if (!present) return std::nullopt;
  launch_partial p{launcher, {}, {}, {}, {}, {}, {}, {}, v[0], v[1], v[2], v[3]};
  p.rank = launch_env_int(v[0], 0, 1 << 30, rank_meaning);
  p.world = launch_env_int(v[1], 1, 1 << 30, world_meaning);
  p.local_rank = launch_env_int(v[2], 0, 1 << 30, rank_meaning);
  p.local_world = launch_env_int(v[3], 1, 1 << 30, world_meaning);
  launch_common(p, lockstep_first);
  return p;
}

inline std::optional<launch_partial> launch_from_lockstep_run() {
  static constexpr const char* ours[4] = {"LOCKSTEP_RANK", "LOCKSTEP_WORLD_SIZE", "LOCKSTEP_LOCAL_RANK",
                                          "LOCKSTEP_LOCAL_WORLD_SIZE"};
  auto found = launch_from_vars("lockstep-run", ours, 4, true);
  if (!found) return std::nullopt;
  launch_partial& p = *found;
  // lockstep-run sets the torchrun names too; a different value means a stale export.
  const std::pair<const char*, std::optional<int>*> pairs[] = {
      {"RANK", &p.rank}, {"WORLD_SIZE", &p.world}, {"LOCAL_RANK", &p.local_rank}, {"LOCAL_WORLD_SIZE", &p.local_world}};
  for (int i = 0; i < 4; ++i) {
    auto other = env(pairs[i].first);
    if (!other || !*pairs[i].second) continue;
    const int v = parse_launch_int(*other, pairs[i].first, -(1L << 30), 1L << 30, "an integer");
    if (v != **pairs[i].second)
      throw config_error(std::string(ours[i]) + "=" + std::to_string(**pairs[i].second) + " but " + pairs[i].first +
                         "=" + *other + ": the two launchers' variables disagree; unset the stale " + pairs[i].first +
                         " (lockstep-run sets both)");
  }
  // lockstep-run starts all ranks on one host: local defaults to global.
  if (!p.local_rank && !p.local_world) {
    p.local_rank = p.rank;
    p.local_world = p.world;
  }
  return found;
}

inline std::optional<launch_partial> launch_from_torchrun() {
  return launch_from_vars("torchrun", {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}, 4, false);
}

inline std::optional<launch_partial> launch_from_openmpi() {
  auto p = launch_from_vars(
      "openmpi",
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}, 2,
      true);
  // mpirun names each job's PMIx namespace afresh: a run id that no earlier run shares.
  if (p && !p->job_token)
    if (auto ns = env("PMIX_NAMESPACE"); ns && !ns->empty()) p->job_token = "openmpi-" + *ns;
  return p;
}

//! MPICH and Intel MPI (Hydra's process manager; also Slurm's PMI-2): PMI_RANK, PMI_SIZE,
//! and the node-local MPI_LOCALRANKID / MPI_LOCALNRANKS Hydra sets.
inline std::optional<launch_partial> launch_from_pmi() {
  return launch_from_vars("mpich", {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}, 2, true);
}

inline std::optional<launch_partial> launch_from_slurm() {
  if (!env("SLURM_PROCID")) return std::nullopt;
  const bool has_ntasks = env("SLURM_NTASKS") || !env("SLURM_NPROCS");
  launch_partial p{
      "slurm",         {}, {}, {}, {}, {}, {}, {}, "SLURM_PROCID", has_ntasks ? "SLURM_NTASKS" : "SLURM_NPROCS",
      "SLURM_LOCALID", ""};
  p.rank = launch_env_int("SLURM_PROCID", 0, 1 << 30, rank_meaning);
  p.world = launch_env_int(has_ntasks ? "SLURM_NTASKS" : "SLURM_NPROCS", 1, 1 << 30, world_meaning);
  p.local_rank = launch_env_int("SLURM_LOCALID", 0, 1 << 30, rank_meaning);
  // Tasks on this node: the per-node list at this node's index is exact (the last node of
  // an uneven job has fewer); SLURM_NTASKS_PER_NODE is only the requested maximum.
  const auto node = launch_env_int("SLURM_NODEID", 0, 1 << 30, "this node's index in the job");
  const char* list_var = env("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  const auto list = env(list_var);
  if (list && node) {
    p.local_world = slurm_tasks_on_node(*list, *node, list_var);
    p.local_world_var = list_var;
  } else if (auto n = launch_env_int("SLURM_NTASKS_PER_NODE", 1, 1 << 30, "tasks per node")) {
    p.local_world = n;
    p.local_world_var = "SLURM_NTASKS_PER_NODE";
  } else if (list) {
    p.local_world = slurm_tasks_on_node(*list, -1, list_var);
    if (p.local_world) p.local_world_var = list_var;
  }
  if (p.local_world_var.empty())
    p.local_world_var = "SLURM_NTASKS_PER_NODE (or SLURM_NODEID with SLURM_TASKS_PER_NODE)";
  launch_common(p, true);
  if (!p.master_addr) {
    for (const char* v : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})
      if (auto l = env(v)) {
        p.master_addr = slurm_first_host(*l, v);
        break;
      }
  }
  const auto job = env("SLURM_JOB_ID") ? env("SLURM_JOB_ID") : env("SLURM_JOBID");
  const auto step = env("SLURM_STEP_ID") ? env("SLURM_STEP_ID") : env("SLURM_STEPID");
  if (job) {
    const long long j = std::strtoll(job->c_str(), nullptr, 10);
    const long long s = step ? std::strtoll(step->c_str(), nullptr, 10) : 0;
    if (!p.master_port) p.master_port = static_cast<int>(15000 + (((j % 17000) * 16 + (s & 15)) % 17000));
    if (!p.job_token) p.job_token = "slurm-" + *job + "." + (step ? *step : std::string("0"));
  }
  return p;
}

}  // namespace detail

//! The launch this process is part of, or nullopt when no launcher variable is set and
//! no override is given. Throws config_error, naming the variables and the fix, when they
//! are incomplete (RANK without WORLD_SIZE), malformed, negative or contradictory
//! (rank ≥ world, local_rank ≥ local_world, a port outside 1..65535).
inline std::optional<launch_info> detect_launcher(const launch_overrides& o = {}) {
  using detail::launch_partial;
  std::optional<launch_partial> found = detail::launch_from_lockstep_run();
  if (!found) found = detail::launch_from_torchrun();
  if (!found) found = detail::launch_from_openmpi();
  if (!found) {
    // srun --mpi=pmi2 sets PMI_* and SLURM_* alike: Slurm's then (it knows the store host).
    // Hydra's mpiexec inside a Slurm allocation leaves SLURM_PROCID of its proxy: PMI's then.
    auto pmi = detail::launch_from_pmi();
    auto slurm = detail::launch_from_slurm();
    const bool agree = pmi && slurm && pmi->rank == slurm->rank && pmi->world == slurm->world;
    found = pmi && !agree ? std::move(pmi) : std::move(slurm);
  }

  const bool any_override =
      o.rank || o.world || o.local_rank || o.local_world || o.master_addr || o.master_port || o.job_token;
  if (!found && !any_override) return std::nullopt;
  if (!found) {
    if (!o.rank || !o.world)
      throw config_error("launch_overrides gives no rank and world and no launcher variables are set "
                         "(RANK/WORLD_SIZE, LOCKSTEP_*, OMPI_COMM_WORLD_*, PMI_*, SLURM_*): set rank and world, "
                         "or start the program with a launcher (torchrun, lockstep-run, mpirun, srun)");
    found = launch_partial{"explicit",
                           {},
                           {},
                           {},
                           {},
                           {},
                           {},
                           {},
                           "launch_overrides::rank",
                           "launch_overrides::world",
                           "launch_overrides::local_rank",
                           "launch_overrides::local_world"};
    if (!o.local_rank && !o.local_world) {  // nothing says otherwise: one host
      found->local_rank = *o.rank;
      found->local_world = *o.world;
    }
  }
  launch_partial& p = *found;
  auto take = [&](const std::optional<int>& v, std::optional<int>& field, std::string& var, const char* name) {
    if (!v) return;
    field = v;
    var = std::string("launch_overrides::") + name;
  };
  if (o.rank || o.world) p.launcher = "explicit";
  take(o.rank, p.rank, p.rank_var, "rank");
  take(o.world, p.world, p.world_var, "world");
  take(o.local_rank, p.local_rank, p.local_rank_var, "local_rank");
  take(o.local_world, p.local_world, p.local_world_var, "local_world");
  if (o.master_addr) p.master_addr = o.master_addr;
  if (o.job_token) p.job_token = o.job_token;
  if (o.master_port) {
    if (*o.master_port < 1 || *o.master_port > 65535)
      throw config_error("launch_overrides::master_port=" + std::to_string(*o.master_port) +
                         " is out of range; give a TCP port from 1 to 65535");
    p.master_port = o.master_port;
  }

  const std::string from = " (" + p.launcher + ")";
  auto need = [&](const std::optional<int>& v, const std::string& var, const std::string& have) {
    if (!v)
      throw config_error(have + " is set but " + var + " is not" + from + ": set " + var +
                         ", or start the program with its launcher, which sets all of them");
    return *v;
  };
  const std::string anchor = p.rank ? p.rank_var : (p.world ? p.world_var : p.local_rank_var);
  const int rank = need(p.rank, p.rank_var, anchor);
  const int world = need(p.world, p.world_var, p.rank_var);
  const int local_rank = need(p.local_rank, p.local_rank_var, p.rank_var);
  const int local_world = need(p.local_world, p.local_world_var, p.local_rank_var);
  auto check_range = [&](int v, const char* what, int lo) {
    if (v < lo)
      throw config_error(std::string(what) + "=" + std::to_string(v) + " must be at least " + std::to_string(lo) +
                         from);
  };
  check_range(rank, p.rank_var.c_str(), 0);
  check_range(world, p.world_var.c_str(), 1);
  check_range(local_rank, p.local_rank_var.c_str(), 0);
  check_range(local_world, p.local_world_var.c_str(), 1);
  if (rank >= world)
    throw config_error(p.rank_var + "=" + std::to_string(rank) + " but " + p.world_var + "=" + std::to_string(world) +
                       from + ": a rank must be below the world size; check for stale exported variables");
  if (local_rank >= local_world)
    throw config_error(p.local_rank_var + "=" + std::to_string(local_rank) + " but " + p.local_world_var + "=" +
                       std::to_string(local_world) + from +
                       ": a local rank must be below the number of processes on the host");
  if (local_world > world)
    throw config_error(p.local_world_var + "=" + std::to_string(local_world) + " but " + p.world_var + "=" +
                       std::to_string(world) + from + ": a host cannot hold more processes than the job");

  launch_info info;
  info.rank = rank;
  info.world = world;
  info.local_rank = local_rank;
  info.local_world = local_world;
  info.master_addr = p.master_addr.value_or("");
  info.master_port = p.master_port.value_or(0);
  info.launcher = p.launcher;
  info.job_token = p.job_token.value_or("");
  return info;
}

}  // namespace lockstep
