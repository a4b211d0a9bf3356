// lockstep example 02: example 01's Fashion-MNIST training with one process per rank, on one
// host or many. The same training loop (fmnist::train_rank), model and CPU trainer as example
// 01; only how the ranks are started and connected differs.
//
//   cmake -S . -B build && cmake --build build --target distributed_fashion_mnist   # MPI and/or CUDA
//   mpirun -np 4 ./build/examples/02_distributed/distributed_fashion_mnist --epochs 5
//   mpirun -np 2 ./build/examples/02_distributed/distributed_fashion_mnist --smoke
//   srun --ntasks 8 --ntasks-per-node 4 ./distributed_fashion_mnist      # across hosts (Slurm)
//   mpirun -np 4 ./distributed_fashion_mnist --checkpoint run.lsck --stop-after 2
//   mpirun -np 4 ./distributed_fashion_mnist --resume run.lsck           # epochs 3..5
//
// What it shows: each process loads the data set itself, builds the same model, and trains
// its shard under lockstep::run(lockstep::Mpi{}) with lockstep::Distributed<Mlp, MpiComm>
// (DataParallel driven from a process-per-rank context). --batch is the GLOBAL batch, so with
// 2 processes the run reproduces example 01's `--device cpu --ranks 2` bit for bit (ctest
// checks it). Rank 0 prints the progress, the per-epoch loss and the test accuracy (computed
// distributed: counts all-reduced through the communicator) and a final parameter checksum
// that every rank's must equal.
//
// The mode comes from the launcher: under mpirun or srun, CPU ranks over MPI (MpiComm), with
// lockstep::Distributed<Mlp, MpiComm>. Under lockstep-run or torchrun (or with RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set by hand), one process per GPU:
// lockstep::run(lockstep::Processes{}) with NcclComm and example 01's GPU trainer
// (gpu_train.cu), i.e. Distributed<gpu::Mlp, NcclComm>. A build without MPI or without CUDA
// says which line it cannot serve. Without a launcher it prints the launch lines. See
// docs/example_distributed.md and docs/multinode.md.
//
//   lockstep-run --nproc 4 ./distributed_fashion_mnist --epochs 5              # 4 GPUs
//   torchrun --no-python --nproc-per-node 4 ./distributed_fashion_mnist        # the same
//
// Exit status: 0 done, 1 error (bad data, checkpoint, ranks that disagree, a launcher this
// build cannot serve, a lost rank), 2 bad command line or no launcher, 77 data not installed
// or fewer GPUs than processes on this host (ctest: skip).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

#include <lockstep/core/error.hpp>
#include <lockstep/launch/detect.hpp>
#include <lockstep/launch/launch_env.hpp>
#include <lockstep/observe/metrics.hpp>
#include <lockstep/parallel/data_parallel.hpp>
#if defined(DIST_WITH_MPI)
#include <lockstep/mpi/mpi_comm.hpp>
#include <lockstep/mpi/run_mpi.hpp>
#endif

#include "../01_fashion_mnist/cpu_trainer.hpp"
#include "../01_fashion_mnist/fashion_mnist.hpp"
#include "../01_fashion_mnist/gpu_train.hpp"  // plain C++: the GPU path's entry point
#include "../01_fashion_mnist/idx.hpp"

namespace {

constexpr const char* usage =
    "usage: distributed_fashion_mnist [options], started once per rank by a launcher:\n"
    "  mpirun -np N distributed_fashion_mnist [options]        CPU ranks over MPI\n"
    "  srun --ntasks N distributed_fashion_mnist [options]     the same under Slurm\n"
    "  lockstep-run --nproc N distributed_fashion_mnist [...]  one process per GPU (NCCL)\n"
    "  torchrun --no-python --nproc-per-node N distributed_fashion_mnist [...]  the same\n"
    "options (as in example 01):\n"
    "  --data DIR          directory with {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz\n"
    "                      (default /usr/share/datasets/fashion-mnist), readable by every rank\n"
    "  --batch B           global batch per optimizer step, split across ranks (default 128)\n"
    "  --epochs E          epochs (default 5; 2 with --smoke)\n"
    "  --lr X              peak learning rate for a global batch of 128 (default 0.05)\n"
    "  --momentum M        SGD momentum (default 0.9)\n"
    "  --warmup S          warmup steps (default 100)\n"
    "  --seed S            model initialisation and shuffling seed (default 42)\n"
    "  --limit-train N     use only the first N training images\n"
    "  --limit-test M      use only the first M test images\n"
    "  --smoke             quick run: --limit-train 4096 --limit-test 1000 --epochs 2\n"
    "  --checkpoint PATH   rank 0 saves a checkpoint after every epoch\n"
    "  --resume PATH       continue from a checkpoint (every rank reads it: use a path all\n"
    "                      hosts see)\n"
    "  --stop-after E      stop after epoch E, as if interrupted\n"
    "  --progress SECONDS  progress line interval, 0 = none (default 1)\n"
    "  --bucket-kib K      gradient buckets of K KiB (default: lockstep's)\n";

// The launch lines, for a program started without a launcher.
std::string launch_lines(const std::string& prog) {
  return "  mpirun -np 4 " + prog +
         " [options]                            # CPU ranks over MPI\n"
         "  lockstep-run --nproc 4 " +
         prog +
         " [options]                  # one process per GPU\n"
         "  torchrun --no-python --nproc-per-node 4 " +
         prog + " [options] # the same, by torchrun\n";
}

// An MPI launcher started this process: Open MPI, MPICH/Intel MPI (PMI) or Slurm as
// lockstep::detect_launcher() reads them, or a PMIx-based one it does not read.
bool mpi_launched(const std::optional<lockstep::launch_info>& l) {
  if (l) return l->launcher == "openmpi" || l->launcher == "mpich" || l->launcher == "slurm";
  return std::getenv("PMI_RANK") != nullptr || std::getenv("PMIX_RANK") != nullptr;
}

#if defined(DIST_WITH_MPI)
constexpr bool with_mpi = true;
#else
constexpr bool with_mpi = false;
#endif
#if defined(FASHION_MNIST_WITH_GPUS)
constexpr bool with_gpus = true;
#else
constexpr bool with_gpus = false;
#endif
constexpr const char* built_lines = with_mpi && with_gpus ? "all three lines"
                                    : with_mpi            ? "the mpirun (or srun) line"
                                                          : "the lockstep-run and torchrun lines";

// Where rank 0's header says the ranks run: "4 GPU ranks (one process per GPU, NCCL on 1 host)".
std::string where_of(const fmnist::process_rank& me, bool gpus) {
  return std::to_string(me.ranks) + (gpus ? " GPU rank" : " CPU rank") + (me.ranks == 1 ? "" : "s") + " (" +
         (gpus ? "one process per GPU, NCCL" : "MPI processes") + " on " + std::to_string(me.hosts) + " host" +
         (me.hosts == 1 ? "" : "s") + ")";
}

}  // namespace

int main(int argc, char** argv) {
  const auto t_start = std::chrono::steady_clock::now();
  const std::string prog = argc > 0 ? argv[0] : "distributed_fashion_mnist";

  // 1. The command line: example 01's parser, minus the options that choose devices and
  //    rank counts here (the launcher does).
  fmnist::options opt;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::cout << usage << "launch lines:\n" << launch_lines(prog);
        return 0;
      }
      if (a == "--device" || a == "--ranks" || a == "--gpus" || a == "--check")
        throw fmnist::usage_error(a + " is example 01's; here the launcher sets the ranks (mpirun -np N)");
    }
    opt = fmnist::parse(argc, argv);
  } catch (const fmnist::usage_error& e) {
    std::cerr << "distributed_fashion_mnist: " << e.what() << "\n" << usage;
    return 2;
  }

  // 2. Who started us. Every rank decides alike (same variables), so each prints its own
  //    message: with mpirun a rank that exits first may end the others before they print.
  //    mpirun/srun: CPU ranks over MPI. lockstep-run/torchrun (or the variables set by hand):
  //    one process per GPU.
  std::optional<lockstep::launch_info> launch;
  int visible_gpus = 0;
  try {
    const auto env = lockstep::detect();
    launch = env.launcher;
    visible_gpus = static_cast<int>(env.gpus.size());
  } catch (const lockstep::error& e) {
    std::cerr << "distributed_fashion_mnist: error: " << e.what() << "\n";
    return 1;
  }
  const bool on_mpi = mpi_launched(launch);
  if (!launch && !on_mpi) {
    std::cerr << "distributed_fashion_mnist: no launcher started this process; it runs as one "
                 "process per rank. Start it with one of:\n"
              << launch_lines(prog) << "This build runs " << built_lines
              << "; for ranks as threads of one process use example 01 (fashion_mnist --ranks 4).\n";
    return 2;
  }
  if (on_mpi && !with_mpi) {
    std::cerr << "distributed_fashion_mnist: error: started by an MPI launcher, but this build has no "
                 "MPI part (lockstep::mpi); start it with lockstep-run --nproc N (one process per GPU), "
                 "or install MPI and rebuild\n";
    return 1;
  }
  if (!on_mpi) {
    if (!with_gpus) {
      std::cerr << "distributed_fashion_mnist: error: started by " << launch->launcher << " as rank " << launch->rank
                << " of " << launch->world
                << ". Outside MPI, one process per rank is the GPU path (lockstep::run("
                   "lockstep::Processes{}) with NcclComm), which this build does not have (no "
                   "lockstep::cuda); its CPU ranks need MPI: start it with `mpirun -np "
                << launch->world << " " << prog << "`. See docs/example_distributed.md.\n";
      return 1;
    }
    if (launch->local_world > visible_gpus) {  // before any rank waits for the others
      std::cerr << "[lockstep-skip] distributed_fashion_mnist: rank " << launch->rank << ": " << launch->local_world
                << " processes on this host need as many GPUs; " << visible_gpus
                << " visible. Start at most one process per GPU (lockstep-run --nproc " << visible_gpus << ")\n";
      return 77;
    }
  }

  // 3. The data: every process decodes its own copy (≈ 55 MB for all of Fashion-MNIST).
  fmnist::dataset data;
  try {
    const auto none = std::numeric_limits<std::size_t>::max();
    data.train = fmnist::load_split(opt.data, "train", opt.limit_train.value_or(none));
    data.test = fmnist::load_split(opt.data, "t10k", opt.limit_test.value_or(none));
  } catch (const fmnist::data_error& e) {
    std::cerr << "distributed_fashion_mnist: error"
              << (launch ? " (rank " + std::to_string(launch->rank) + ")" : std::string()) << ": " << e.what() << "\n";
    return e.missing ? 77 : 1;
  }
  fmnist::make_table(data);
  const double load_s = fmnist::seconds_since(t_start);

  // 4. The SPMD body, once in this process. A rank that throws ends the whole job: under MPI,
  //    run(Mpi{}) prints "lockstep: rank r failed: ..." and calls MPI_Abort; on GPUs,
  //    run(Processes{}) reports it to the other ranks, whose watchdogs stop them too.
  fmnist::final_result result;
  fmnist::process_rank me;
  auto t_train = std::chrono::steady_clock::now();
  // Once the communicator is up, on every rank: the plan, printed by rank 0.
  auto start = [&](const fmnist::process_rank& who) {
    me = who;
    const fmnist::training_plan plan = fmnist::make_plan(opt, data.train.size, who.ranks, !on_mpi);
    if (who.rank == 0) fmnist::print_header(where_of(who, !on_mpi), opt, data, plan, load_s);
    t_train = std::chrono::steady_clock::now();
    return plan;
  };
  try {
    if (on_mpi) {
#if defined(DIST_WITH_MPI)
      lockstep::run(lockstep::Mpi{}, [&](lockstep::context<lockstep::MpiComm>& ctx) {
        const int ranks = ctx.size();
        if (launch && launch->world != ranks)
          throw lockstep::config_error(
              launch->launcher + " says the job has " + std::to_string(launch->world) +
              " processes but MPI_COMM_WORLD has " + std::to_string(ranks) +
              ": this process was not started by the MPI launcher it sees (e.g. run directly in an "
              "sbatch script: start it with srun or mpirun)");
        // Hosts: the ranks with local rank 0 (from the launcher, else MPI's shared-memory split).
        std::int64_t hosts = ctx.local_rank() == 0 ? 1 : 0;
        lockstep::all_reduce_scalars(ctx.comm(), std::span<std::int64_t>(&hosts, 1), lockstep::reduce_op::sum);
        const fmnist::training_plan plan = start({ctx.rank(), ranks, static_cast<long long>(hosts), -1});
        fmnist::CpuTrainer trainer(data, opt.seed);
        // train_rank wraps the model in a lockstep::DataParallel with its policies (Bf16Wire, or
        // Deterministic and Accumulate): from a context<MpiComm>, a lockstep::Distributed<fmnist::Mlp,
        // lockstep::MpiComm, ...>, as the plain form deduces:
        static_assert(
            std::is_same_v<decltype(lockstep::DataParallel(ctx, trainer.model(), lockstep::DataParallelOptions{})),
                           lockstep::Distributed<fmnist::Mlp, lockstep::MpiComm>>);
        fmnist::train_rank(ctx, trainer, opt, plan, data, result);
      });
#endif
    } else {
#if defined(FASHION_MNIST_WITH_GPUS)
      // lockstep::run(Processes{}) with NcclComm: Distributed<gpu::Mlp, NcclComm> (gpu_train.cu).
      fmnist::train_as_gpu_process(opt, data, start, result, me);
#endif
    }
  } catch (const std::exception& e) {
    // run() printed "lockstep: rank r failed: ..." already when the body threw.
    std::cerr << "distributed_fashion_mnist: rank " << (launch ? launch->rank : me.rank) << " stops: " << e.what()
              << "\n";
    return 1;
  }
  if (me.rank != 0) return 0;
  fmnist::print_final(result, fmnist::seconds_since(t_train));
  return result.ranks_agree ? 0 : 1;
}
