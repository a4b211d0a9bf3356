// A job that loses ranks and goes on (issue 29, docs/elastic.md): one process per GPU under
// `lockstep-run --elastic`, an ElasticGroup on run(Processes)'s context. The ranks of --kill
// (default: the last) SIGKILL themselves at step --at (default 3), in --phase:
//   forward   before the step's first kernel;
//   backward  once the step's second gradient is ready (bucket all-reduces in flight);
//   update    after finish() and ElasticGroup::commit(): the others complete the step first.
// The survivors agree, make a smaller NcclComm through the job's store, rebuild DataParallel
// (rank 0's parameters broadcast), keep the per-rank batch and redo the interrupted step over
// the rest of the data. Each survivor checks: one change, the killed ranks gone, the step the
// change came at, its parameters against a CPU run that switched rank counts there (fp32, rel.
// diff <= 1e-5), and every survivor's parameters identical; rank 0 prints PASS or FAIL for all.
// Each prints the time from the (first) kill to its next applied step ("recovered in").
//   --rejoin  (under lockstep-run --elastic --max-restarts 1) the killed rank's replacement
//   joins the running job (LOCKSTEP_ELASTIC_JOIN=1): the members admit it at a step boundary,
//   the job is back at its size and ends where a CPU run that switched rank counts at both
//   steps ends; the replacement prints how long from its start to its first applied step.
//   Steps take --step-ms (with --rejoin 100 ms) so that it arrives before the end.
//   --peer-copy  ShardedOptimizer with FusedSgd (momentum 0.9) on each rank's shards and a
//   lockstep::PeerCopy snapshot after every step: the survivors restore the lost rank's shard
//   (values and momentum) from the copy the rank before it held, resharded for their number,
//   and go on from the snapshot's step (the one before the interrupted step's, or that one:
//   the newest whose seal a survivor saw); the CPU reference (lockstep::Sgd) switches there.
//   With --rejoin too, the replacement restores with the members, who cut their newest
//   snapshot (of the step the group grew at) for the grown group.
//   --time N  no failure: the steady step of a larger MLP (1024-1024-1024-10, batch 64 per rank)
//   timed over N steps with plain DataParallel and with the same loop through
//   ElasticGroup::attempt and commit() (a host wait and an 8-byte all-reduce per step),
//   alternated twice; rank 0 prints both and the difference ("elastic step overhead"). Two
//   or more ranks (the options are checked as for a kill).
// Inputs are random, drawn by rank 0 for each run. "[lockstep-skip]" with too few GPUs.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/cuda/fused_optimizer.cuh>
#include <lockstep/cuda/run_processes.cuh>
#include <lockstep/elastic/elastic_group.hpp>
#include <lockstep/elastic/peer_copy.hpp>
#include <lockstep/lockstep.hpp>
#include <lockstep/parallel/data_parallel.hpp>

#include "device_vector.cuh"
#include "gpu_mlp.cuh"
#include "launched.hpp"
#include "mlp.hpp"
#include "test_util.hpp"

using namespace lockstep_test;
using clk = std::chrono::steady_clock;  // CLOCK_MONOTONIC: one clock for every process of the host

namespace {

std::string kill_stamp_path() {
  const char* token = std::getenv("LOCKSTEP_JOB_TOKEN");
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp && *tmp ? tmp : "/tmp") + "/lockstep_elastic_kill_" + (token ? token : "none");
}

[[noreturn]] void die_now(int rank, const char* phase) {
  std::printf("rank %d: killing itself (%s)\n", rank, phase);
  std::fflush(stdout);
  {
    std::ofstream(kill_stamp_path(), std::ios::trunc) << clk::now().time_since_epoch().count();
  }
  ::raise(SIGKILL);
  std::abort();
}

// --time: ms per step of plain DataParallel and of the elastic loop (attempt + commit).
void time_elastic_step(lockstep::context<lockstep::NcclComm>& ctx, int n) {
  const std::vector<int> dims{1024, 1024, 1024, 10};
  const int batch = 64, samples = 4096;
  std::mt19937_64 rng(7);
  const auto X = random_vector<float>(static_cast<std::size_t>(samples) * dims[0], rng, -1, 1);
  std::vector<int> y(samples), rows(batch);
  for (auto& v : y) v = static_cast<int>(rng() % 10);
  for (int i = 0; i < batch; ++i) rows[static_cast<std::size_t>(i)] = (ctx.rank() * batch + i) % samples;
  cudaStream_t st = ctx.comm().compute_stream();
  TestMlp<float> init(dims, 11);
  std::vector<std::vector<float>> values;
  for (auto& p : init.parameters()) {
    auto v = p.value_as<float>();
    values.emplace_back(v.begin(), v.end());
  }
  GpuMlp m(dims, values, st);
  const device_vector<float> dX(X);
  const device_vector<int> dy(y), drows(rows);
  lockstep::ElasticGroup group(ctx, {.min_ranks = 1});
  using DP = lockstep::DataParallel<GpuMlp, lockstep::NcclComm>;
  const auto one = [&](DP& dp, bool elastic) {
    auto step = dp.step();
    m.forward_backward(dX.p, dy.p, drows.p, batch, step.on_gradient_ready());
    if (step.finish()) {
      if (elastic) group.commit();
      m.sgd(0.01f);
    }
  };
  double ms[2] = {1e30, 1e30};
  for (int round = 0; round < 4; ++round) {
    const bool elastic = round % 2 == 1;
    std::optional<DP> dp(std::in_place, group.comm(), m);
    for (int s = 0; s < 20; ++s) one(*dp, false);  // warm-up
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
    ctx.comm().barrier();
    const auto t0 = clk::now();
    for (int s = 0; s < n; ++s) {
      if (elastic) (void)group.attempt([&] { one(*dp, true); });
      else one(*dp, false);
    }
    LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
    const double t = std::chrono::duration<double, std::milli>(clk::now() - t0).count() / n;
    ms[elastic] = std::min(ms[elastic], t);
  }
  if (ctx.rank() == 0)
    std::printf("steady step (MLP 1024-1024-1024-10, batch %d per rank, %d ranks, best of 2 x %d steps): plain "
                "DataParallel %.4f ms, through ElasticGroup (attempt + commit) %.4f ms; elastic step overhead %.4f ms "
                "(%.1f %%)\n",
                batch, ctx.size(), n, ms[0], ms[1], ms[1] - ms[0], 100.0 * (ms[1] - ms[0]) / ms[0]);
}

}  // namespace

int main(int argc, char** argv) {
  const auto started = clk::now();
  try {
    std::string phase = "backward";
    int at = 3, steps = 8, step_ms = -1, time_steps = 0;
    bool rejoin = false, peer = false;
    std::set<int> victims;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has = i + 1 < argc;
      if (a == "--phase" && has) phase = argv[++i];
      else if (a == "--at" && has) at = std::atoi(argv[++i]);
      else if (a == "--steps" && has) steps = std::atoi(argv[++i]);
      else if (a == "--step-ms" && has) step_ms = std::atoi(argv[++i]);
      else if (a == "--rejoin") rejoin = true;
      else if (a == "--peer-copy") peer = true;
      else if (a == "--time" && has) time_steps = std::atoi(argv[++i]);
      else if (a == "--kill" && has) {
        std::stringstream list(argv[++i]);
        for (std::string r; std::getline(list, r, ',');) victims.insert(std::atoi(r.c_str()));
      } else {
        std::fprintf(stderr,
                     "elastic_nccl: unknown option '%s' (--phase forward|backward|update, --at K, --steps S, "
                     "--kill R[,R...], --rejoin, --peer-copy, --step-ms M)\n",
                     a.c_str());
        return 2;
      }
    }
    if (phase != "forward" && phase != "backward" && phase != "update") {
      std::fprintf(stderr, "elastic_nccl: --phase is forward, backward or update, not '%s'\n", phase.c_str());
      return 2;
    }
    int exit_code = 0;
    const auto here = launched_on_gpus("elastic_nccl", "lockstep-run --elastic", exit_code);
    if (!here) return exit_code;
    const auto* info = &here->info;
    if (victims.empty()) victims.insert(info->world - 1);
    if (victims.count(0) || *victims.rbegin() >= info->world || at < 0 || at >= steps) {
      std::fprintf(stderr, "elastic_nccl: --kill names ranks 1..%d (rank 0 hosts the store), --at a step < --steps\n",
                   info->world - 1);
      return 2;
    }
    const std::vector<int> dims{37, 64, 33, 10};
    const std::size_t samples = 1999;
    const int batch = 16;
    const float lr = 0.1f;
    int failures = 0;
    if (step_ms < 0) step_ms = rejoin ? 100 : 0;
    const char* join_env = std::getenv("LOCKSTEP_ELASTIC_JOIN");
    const bool joiner = join_env && std::string(join_env) == "1";  // a replacement
    if (time_steps > 0) {
      lockstep::run(lockstep::Processes{},
                    [&](lockstep::context<lockstep::NcclComm>& ctx) { time_elastic_step(ctx, time_steps); });
      return 0;
    }
    lockstep::run(lockstep::Processes{}, [&](lockstep::context<lockstep::NcclComm>& ctx) {
      const int job_rank = ctx.rank(), world0 = info->world;
      // A fresh seed each run, rank 0's (a replacement gets it with the history, below).
      std::uint64_t seed = 0;
      if (!joiner) {
        std::vector<double> drawn{job_rank == 0 ? static_cast<double>(std::random_device{}() % (1u << 30)) : 0.0};
        lockstep::all_reduce_scalars(ctx.comm(), std::span<double>(drawn), lockstep::reduce_op::max);
        seed = static_cast<std::uint64_t>(drawn[0]);
        if (job_rank == 0) std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
      }
      cudaStream_t st = ctx.comm().compute_stream();
      // Each rank starts elsewhere: DataParallel broadcasts rank 0's, also when rebuilt.
      TestMlp<float> init(dims, seed + 1 + static_cast<std::uint64_t>(job_rank) * 7919);
      std::vector<std::vector<float>> values;
      for (auto& p : init.parameters()) {
        auto v = p.value_as<float>();
        values.emplace_back(v.begin(), v.end());
      }
      GpuMlp m(dims, values, st);
      std::vector<float> X;
      std::vector<int> y(samples);
      device_vector<float> dX(static_cast<std::size_t>(samples * dims[0]));
      device_vector<int> dy(y.size()), drows(static_cast<std::size_t>(batch));
      const auto make_data = [&] {
        std::mt19937_64 rng(seed);
        X = random_vector<float>(samples * dims[0], rng, -2, 2);
        std::uniform_int_distribution<int> lab(0, 9);
        for (auto& v : y) v = lab(rng);
        dX.upload(X);
        dy.upload(y);
      };
      if (!joiner) make_data();

      lockstep::ElasticGroup group(ctx, {.min_ranks = 1});
      const lockstep::DataParallelOptions opts{.buckets = {.first_bytes = 2000, .cap_bytes = 6000}};

      std::vector<int> worlds;  // the group's size at each applied step
      // What a replacement needs besides the parameters: the seed and the sizes so far, rank 0's.
      const auto share_history = [&] {
        std::vector<double> v(static_cast<std::size_t>(steps) + 2, 0.0);
        if (group.rank() == 0) {
          v[0] = static_cast<double>(seed);
          v[1] = static_cast<double>(worlds.size());
          for (std::size_t i = 0; i < worlds.size(); ++i) v[i + 2] = worlds[i];
        }
        lockstep::all_reduce_scalars(group.comm(), std::span<double>(v), lockstep::reduce_op::max);
        seed = static_cast<std::uint64_t>(v[0]);
        worlds.assign(static_cast<std::size_t>(v[1]), 0);
        for (std::size_t i = 0; i < worlds.size(); ++i) worlds[i] = static_cast<int>(v[i + 2]);
      };
      if (group.replacement() != joiner) {
        std::printf("rank %d: FAIL: ElasticGroup::replacement() says %d\n", job_rank, group.replacement() ? 1 : 0);
        ++failures;
      }
      // --peer-copy: ShardedOptimizer, FusedSgd with momentum on this rank's shards, a PeerCopy
      // snapshot after every step; the survivors restore the lost shard from it. Else the
      // replicated step (its parameters, rank 0's after a change) and plain SGD.
      const lockstep::SgdOptions momentum{.lr = lr, .momentum = 0.9};
      const auto train = [&]<class Strategy>(Strategy) {
        constexpr bool sharded = std::is_same_v<Strategy, lockstep::ShardedOptimizer>;
        using DP = lockstep::DataParallel<GpuMlp, lockstep::NcclComm, Strategy>;
        std::optional<DP> dp(std::in_place, group.comm(), m, opts);
        std::optional<lockstep::FusedSgd> opt;
        if constexpr (sharded) opt.emplace(momentum, dp->shard_parameters(), ctx.device());
        lockstep::PeerCopy copies;
        std::int64_t done = group.steps(), restored = -1;  // steps applied; sharded: the shrink's snapshot
        if (group.replacement()) {                         // after its DataParallel, as the members do in on_change
          if constexpr (sharded) {
            const auto at = copies.restore(group.members(), *dp, *opt);
            if (!at) throw std::runtime_error("PeerCopy::restore (a replacement): " + copies.why());
            done = *at;
          }
          share_history();
          make_data();
          std::printf("rank %d: joined at step %lld as %d of %d\n", job_rank, static_cast<long long>(group.steps()),
                      group.rank(), group.size());
        }
        group.on_change([&](const lockstep::membership_change& c) {
          dp.reset();  // the model takes its gradients back
          dp.emplace(group.comm(), m, opts);
          if constexpr (sharded) {
            opt.reset();
            opt.emplace(momentum, dp->shard_parameters(), ctx.device());
            const auto at = copies.restore(group.members(), *dp, *opt);
            if (!at) throw std::runtime_error("PeerCopy::restore: " + copies.why());
            if (c.joined.empty() && restored < 0) restored = *at;
            if (!c.joined.empty() && *at != done) {  // a grow: nobody lost, nothing redone
              std::printf("rank %d: FAIL: the grow restored step %lld at step %lld\n", job_rank,
                          static_cast<long long>(*at), static_cast<long long>(done));
              ++failures;
            }
            done = *at;
          } else {
            done = group.steps();
          }
          if (!c.joined.empty()) share_history();  // as the replacement does after its DataParallel
        });
        std::optional<clk::time_point> changed_at;
        double recovered_s = -1;
        bool died = false;
        while (done < steps) {
          const auto s = static_cast<std::size_t>(done);
          worlds.resize(s);  // after a change: the coordinator's count (sharded: the snapshot's)
          std::size_t pos = 0;
          for (int w : worlds) pos += static_cast<std::size_t>(w * batch);
          std::vector<int> rows(static_cast<std::size_t>(batch));
          for (int i = 0; i < batch; ++i)
            rows[static_cast<std::size_t>(i)] =
                static_cast<int>((pos + static_cast<std::size_t>(group.rank() * batch + i)) % samples);
          drows.upload(rows, st, true);
          LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
          const bool die = !joiner && victims.count(job_rank) && static_cast<int>(s) == at && !died;
          const auto change = group.attempt([&] {
            if (die && phase == "forward") die_now(job_rank, "forward");
            auto step = dp->step();
            auto ready = step.on_gradient_ready();
            int seen = 0;
            m.forward_backward(dX.p, dy.p, drows.p, batch, [&](std::size_t i) {
              ready(i);
              if (die && phase == "backward" && ++seen == 2) die_now(job_rank, "backward");
            });
            if constexpr (sharded) {
              (void)step.finish([&](std::span<const lockstep::param_slice> sl) { opt->step(sl, st, nullptr); });
              group.commit();
              if (die && phase == "update") die_now(job_rank, "update");
              copies.save(done + 1, group.members(), *dp, *opt);
            } else if (step.finish()) {
              group.commit();
              if (die && phase == "update") die_now(job_rank, "update");
              m.sgd(lr);
            }
          });
          if (change) {
            if (!changed_at) changed_at = clk::now();
            std::printf("rank %d: change %llu at step %lld: %d -> %d ranks, agreed in %lld ms\n", job_rank,
                        static_cast<unsigned long long>(change->after.epoch), static_cast<long long>(change->steps),
                        change->before.size(), change->after.size(), static_cast<long long>(change->agreement.count()));
            continue;
          }
          ++done;
          worlds.push_back(group.size());
          if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
          if (joiner && recovered_s < 0) {
            LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
            recovered_s = std::chrono::duration<double>(clk::now() - started).count();
            std::printf("rank %d: joined in %.3f s (its start to its first applied step)\n", job_rank, recovered_s);
          }
          if (changed_at && recovered_s < 0) {
            LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
            long long killed = 0;
            std::ifstream(kill_stamp_path()) >> killed;
            const auto now = clk::now();
            recovered_s = std::chrono::duration<double>(now.time_since_epoch() - clk::duration(killed)).count();
            std::printf("rank %d: recovered in %.3f s (the kill to its next applied step; the change took %.3f s)\n",
                        job_rank, recovered_s, std::chrono::duration<double>(now - *changed_at).count());
          }
        }
        LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(st));
        // What the members must have seen: one shrink at the step the phase says (the killed
        // ranks gone) and, with --rejoin, one growth back to the job's size (a replacement: none).
        // Sharded: the step of the newest snapshot a survivor saw sealed, the one before the
        // interrupted step's or that one.
        if (sharded && joiner)  // (the members check it; the replacement has the history's)
          restored = std::find_if(worlds.begin(), worlds.end(), [&](int w) { return w != world0; }) - worlds.begin();
        const int expect_switch = sharded ? static_cast<int>(restored) : phase == "update" ? at + 1 : at;
        if (sharded && !joiner &&
            !(restored == at - 1 || restored == at || (phase == "update" && restored == at + 1))) {
          std::printf("rank %d: FAIL: PeerCopy restored step %lld after a kill in step %d\n", job_rank,
                      static_cast<long long>(restored), at);
          ++failures;
        }
        const int fewer = world0 - static_cast<int>(victims.size());
        const auto& changes = group.changes();
        const std::vector<int> gone(victims.begin(), victims.end());
        const std::size_t expect_changes = joiner ? 0 : rejoin ? 2 : 1;
        bool ok = changes.size() == expect_changes && group.size() == (rejoin ? world0 : fewer);
        if (ok && !joiner) ok = changes[0].gone == gone && (sharded || changes[0].steps == expect_switch);
        if (ok && rejoin && !joiner) ok = changes[1].joined == gone && changes[1].gone.empty();
        // The sizes: world0 until the shrink, then `fewer` (with --rejoin: at least one step,
        // then world0 again to the end).
        std::size_t s = 0;
        while (s < worlds.size() && worlds[s] == world0) ++s;
        ok = ok && static_cast<int>(s) == expect_switch;
        const std::size_t low = s;
        while (s < worlds.size() && worlds[s] == fewer) ++s;
        ok = ok && s > low && (rejoin ? s < worlds.size() : s == worlds.size());
        while (rejoin && s < worlds.size() && worlds[s] == world0) ++s;
        ok = ok && s == worlds.size() && worlds.size() == static_cast<std::size_t>(steps);
        if (!ok) {
          std::string sizes;
          for (int w : worlds) sizes += std::to_string(w);
          std::printf("rank %d: FAIL: %zu change(s) (expected %zu), %d ranks at the end, sizes by step %s; expected "
                      "the shrink at step %d with ranks %s gone\n",
                      job_rank, changes.size(), expect_changes, group.size(), sizes.c_str(), expect_switch,
                      lockstep::detail::rank_list(gone).c_str());
          ++failures;
        }
        // The CPU reference: rank 0's start, each step the mean gradient over the rows the
        // group's ranks took together.
        TestMlp<float> ref(dims, seed + 1);
        lockstep::Sgd ref_opt(momentum);
        std::size_t pos = 0;
        for (int w : worlds) {
          ref.zero_grad();
          std::vector<std::size_t> rows(static_cast<std::size_t>(w * batch));
          for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = (pos + i) % samples;
          pos += rows.size();
          ref.forward_backward(X, y, rows, [](std::size_t) {});
          if (sharded) ref_opt.step(ref.parameters());
          else ref.sgd(lr);
        }
        const auto got = m.flat_values();
        const double err = max_rel_diff(got, ref.flat_values());
        double sum = 0;
        for (float v : got) sum += static_cast<double>(v) * 1.000001;
        std::vector<double> mx{sum}, mn{-sum}, failed{static_cast<double>(failures)};
        lockstep::all_reduce_scalars(group.comm(), std::span<double>(mx), lockstep::reduce_op::max);
        lockstep::all_reduce_scalars(group.comm(), std::span<double>(mn), lockstep::reduce_op::max);
        const bool same = mx[0] == -mn[0];
        std::printf("rank %d (now %d of %d): rel. diff to the CPU reference %.3g, survivors identical: %s\n", job_rank,
                    group.rank(), group.size(), err, same ? "yes" : "NO");
        if (!(err <= 1e-5) || !same) ++failures;
        failed[0] = failures;
        lockstep::all_reduce_scalars(group.comm(), std::span<double>(failed), lockstep::reduce_op::sum);
        failures = static_cast<int>(failed[0]);
      };
      if (peer) train(lockstep::ShardedOptimizer{});
      else train(lockstep::Replicated{});
    });
    if (info->rank == 0) {
      std::remove(kill_stamp_path().c_str());
      std::printf("%s\n", failures ? "FAIL" : "PASS");
    }
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_nccl: %s\n", e.what());
    return 1;
  }
}
