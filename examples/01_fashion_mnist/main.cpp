// lockstep example 01: an MLP learns Fashion-MNIST, data-parallel over CPU threads.
//
//   sudo apt-get install dataset-fashion-mnist       # the data (or pass --data DIR)
//   cmake -S . -B build -DLOCKSTEP_ENABLE_CUDA=OFF && cmake --build build --target fashion_mnist
//   ./build/examples/01_fashion_mnist/fashion_mnist --ranks 2 --epochs 5
//   ./build/examples/01_fashion_mnist/fashion_mnist --checkpoint run.lsck --stop-after 2
//   ./build/examples/01_fashion_mnist/fashion_mnist --resume run.lsck          # epochs 3..5
//
// What it shows: the data set is loaded once and shared read-only by every rank; each rank
// builds the same model (lockstep::model_seed), wraps it in lockstep::DataParallel (zero-copy
// gradients through bind_gradient, buckets reduced as backward reports gradients ready),
// reads its own shard through lockstep::DistributedSampler, and steps lockstep::Sgd after
// finish(). --batch is the GLOBAL batch (split across the ranks), so the training does not
// depend on the number of ranks. Test accuracy is computed distributed (each rank its slice
// of the test set, counts all-reduced). Checkpoints resume bit for bit. See
// docs/example_fashion_mnist.md.
//
// Exit status: 0 done, 1 error (bad data, checkpoint, ...), 2 bad command line,
// 77 data not installed (ctest counts that as skipped).
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>  // isatty

#include <lockstep/checkpoint.hpp>
#include <lockstep/distributed_sampler.hpp>
#include <lockstep/lockstep.hpp>
#include <lockstep/lr_schedule.hpp>
#include <lockstep/metrics.hpp>
#include <lockstep/seeding.hpp>
#include <lockstep/sgd.hpp>

#include "idx.hpp"
#include "mlp.hpp"

namespace {

constexpr std::size_t base_batch = 128;  // --lr is the rate for this global batch

struct options {
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  int ranks = 0;  // 0: lockstep::decide(lockstep::detect())
  std::size_t batch = base_batch;
  std::optional<int> epochs;
  double lr = 0.05;
  double momentum = 0.9;
  std::uint64_t warmup = 100;  // optimizer steps
  std::uint64_t seed = 42;
  std::optional<std::size_t> limit_train, limit_test;
  std::filesystem::path checkpoint, resume;
  int stop_after = 0;  // 0: run all epochs
  double progress = 1.0;
  std::size_t bucket_kib = 0;  // 0: lockstep's default buckets (1 MiB first, 25 MiB cap)
  bool smoke = false;
};

const char* usage =
    "usage: fashion_mnist [options]\n"
    "  --data DIR          directory with {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz\n"
    "                      (default /usr/share/datasets/fashion-mnist)\n"
    "  --ranks N           CPU ranks (threads); default LOCKSTEP_CPU_RANKS or one per\n"
    "                      hardware thread\n"
    "  --batch B           global batch per optimizer step, split across ranks (default 128)\n"
    "  --epochs E          epochs (default 5; 2 with --smoke)\n"
    "  --lr X              peak learning rate for a global batch of 128, scaled linearly for\n"
    "                      other batches (default 0.05); linear warmup, then cosine decay to 0\n"
    "  --momentum M        SGD momentum (default 0.9)\n"
    "  --warmup S          warmup steps (default 100)\n"
    "  --seed S            model initialisation and shuffling seed (default 42)\n"
    "  --limit-train N     use only the first N training images\n"
    "  --limit-test M      use only the first M test images\n"
    "  --smoke             quick run: --limit-train 4096 --limit-test 1000 --epochs 2\n"
    "  --checkpoint PATH   save a checkpoint at the end of every epoch (rank 0 writes it)\n"
    "  --resume PATH       continue from a checkpoint (with the same options, the result is\n"
    "                      bit for bit that of an uninterrupted run)\n"
    "  --stop-after E      stop after epoch E, as if interrupted (the schedule still spans\n"
    "                      --epochs)\n"
    "  --progress SECONDS  progress line interval, 0 = none (default 1)\n"
    "  --bucket-kib K      gradient buckets of K KiB (default: lockstep's 1 MiB first bucket,\n"
    "                      which holds this whole 0.9 MiB model)\n";

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class T>
T parse_number(const std::string& opt, const std::string& text) {
  std::size_t used = 0;
  T v{};
  try {
    if constexpr (std::is_floating_point_v<T>) v = static_cast<T>(std::stod(text, &used));
    else if constexpr (std::is_signed_v<T>) v = static_cast<T>(std::stoll(text, &used));
    else {
      if (!text.empty() && text[0] == '-') throw std::invalid_argument("negative");
      v = static_cast<T>(std::stoull(text, &used));
    }
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw usage_error(opt + " expects a number, got '" + text + "'");
  return v;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      std::exit(0);
    } else if (a == "--data") o.data = value();
    else if (a == "--ranks") o.ranks = parse_number<int>(a, value());
    else if (a == "--batch") o.batch = parse_number<std::size_t>(a, value());
    else if (a == "--epochs") o.epochs = parse_number<int>(a, value());
    else if (a == "--lr") o.lr = parse_number<double>(a, value());
    else if (a == "--momentum") o.momentum = parse_number<double>(a, value());
    else if (a == "--warmup") o.warmup = parse_number<std::uint64_t>(a, value());
    else if (a == "--seed") o.seed = parse_number<std::uint64_t>(a, value());
    else if (a == "--limit-train") o.limit_train = parse_number<std::size_t>(a, value());
    else if (a == "--limit-test") o.limit_test = parse_number<std::size_t>(a, value());
    else if (a == "--smoke") o.smoke = true;
    else if (a == "--checkpoint") o.checkpoint = value();
    else if (a == "--resume") o.resume = value();
    else if (a == "--stop-after") o.stop_after = parse_number<int>(a, value());
    else if (a == "--progress") o.progress = parse_number<double>(a, value());
    else if (a == "--bucket-kib") o.bucket_kib = parse_number<std::size_t>(a, value());
    else throw usage_error("unknown option '" + a + "'");
  }
  if (o.smoke) {  // explicit options win, whatever their order
    if (!o.limit_train) o.limit_train = 4096;
    if (!o.limit_test) o.limit_test = 1000;
    if (!o.epochs) o.epochs = 2;
  }
  if (!o.epochs) o.epochs = 5;
  if (o.ranks < 0) throw usage_error("--ranks must be at least 1");
  if (o.batch == 0) throw usage_error("--batch must be at least 1");
  if (*o.epochs < 1) throw usage_error("--epochs must be at least 1");
  if (!(o.lr > 0) || !std::isfinite(o.lr)) throw usage_error("--lr must be a positive number");
  if (!(o.momentum >= 0 && o.momentum < 1)) throw usage_error("--momentum must be in [0, 1)");
  if (o.stop_after < 0) throw usage_error("--stop-after must be at least 1");
  if (!(o.progress >= 0)) throw usage_error("--progress must be >= 0 seconds");
  if ((o.limit_train && *o.limit_train == 0) || (o.limit_test && *o.limit_test == 0))
    throw usage_error("--limit-train and --limit-test must be at least 1");
  if (!o.checkpoint.empty()) {
    const auto dir = std::filesystem::absolute(o.checkpoint).parent_path();
    if (!std::filesystem::is_directory(dir))
      throw usage_error("--checkpoint " + o.checkpoint.string() + ": directory '" + dir.string() +
                        "' does not exist; create it first");
  }
  return o;
}

// What a checkpoint records about the run, to warn when a resume changes it.
struct run_config {
  std::uint64_t seed;
  std::uint64_t global_batch;
  std::uint64_t train_size;
  std::int32_t ranks;
  std::int32_t epochs;
  double lr;
  double momentum;
  std::uint64_t warmup;
  bool operator==(const run_config&) const = default;
};

// FNV-1a over the parameters' bytes: equal values → equal checksum (to compare runs).
std::uint64_t checksum(const std::vector<lockstep::parameter>& ps) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const auto& p : ps) {
    const auto* b = static_cast<const unsigned char*>(p.value);
    for (std::size_t i = 0; i < p.bytes(); ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  }
  return h;
}

// Rows `rows` of the split as normalised floats ((pixel/255 − mean)/std via a table).
void gather(const fmnist::split& s, std::span<const std::size_t> rows, const float* table,
            std::vector<float>& x, std::vector<std::uint8_t>& y) {
  constexpr std::size_t P = fmnist::image_pixels;
  x.resize(rows.size() * P);
  y.resize(rows.size());
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const std::uint8_t* src = s.pixels.data() + rows[r] * P;
    float* dst = x.data() + r * P;
    for (std::size_t k = 0; k < P; ++k) dst[k] = table[src[k]];
    y[r] = s.labels[rows[r]];
  }
}

struct final_result {
  double accuracy = 0;
  std::uint64_t checksum = 0;
  bool ranks_agree = false;
  int epochs_run = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const auto t_start = std::chrono::steady_clock::now();
  options opt;
  try {
    opt = parse(argc, argv);
  } catch (const usage_error& e) {
    std::cerr << "fashion_mnist: " << e.what() << "\n" << usage;
    return 2;
  }
  const int epochs = *opt.epochs;

  // 1. The data, loaded once; every rank reads it (read-only) from its own thread.
  fmnist::split train, test;
  try {
    const auto none = std::numeric_limits<std::size_t>::max();
    train = fmnist::load_split(opt.data, "train", opt.limit_train.value_or(none));
    test = fmnist::load_split(opt.data, "t10k", opt.limit_test.value_or(none));
  } catch (const fmnist::data_error& e) {
    std::cerr << "fashion_mnist: error: " << e.what() << "\n";
    return e.missing ? 77 : 1;
  }
  // Normalise by the training set's mean and standard deviation (≈ 0.286, 0.353).
  double sum = 0, sum2 = 0;
  for (auto v : train.pixels) {
    sum += v;
    sum2 += static_cast<double>(v) * v;
  }
  const double n_px = static_cast<double>(train.pixels.size());
  const double mean = sum / n_px / 255.0;
  const double stdev = std::max(1e-6, std::sqrt(std::max(0.0, sum2 / n_px / (255.0 * 255.0) - mean * mean)));
  float table[256];
  for (int v = 0; v < 256; ++v) table[v] = static_cast<float>((v / 255.0 - mean) / stdev);
  const double load_s = seconds_since(t_start);

  try {
    const int ranks = opt.ranks > 0 ? opt.ranks : lockstep::decide(lockstep::detect()).ranks;
    // --batch is global: each rank takes its share, so 1, 2 or 4 ranks train alike.
    const std::size_t per_rank = std::max<std::size_t>(1, opt.batch / static_cast<std::size_t>(ranks));
    const std::size_t global = lockstep::effective_batch(per_rank, ranks);
    const double peak_lr = lockstep::scaled_lr(opt.lr, base_batch, global);
    // Every rank has the same number of samples (DistributedSampler pads), hence of steps.
    const std::size_t per_rank_samples = (train.size + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    const std::size_t steps_per_epoch = (per_rank_samples + per_rank - 1) / per_rank;
    const lockstep::LinearWarmup schedule{.peak_lr = peak_lr,
                                          .warmup_steps = opt.warmup,
                                          .decay = lockstep::Decay::cosine,
                                          .total_steps = std::max<std::uint64_t>(opt.warmup, steps_per_epoch * static_cast<std::uint64_t>(epochs)),
                                          .final_lr = 0.0};
    const run_config config{opt.seed, global, train.size, ranks, epochs, opt.lr, opt.momentum, opt.warmup};
    const bool tty = isatty(fileno(stdout)) == 1;

    std::printf("Fashion-MNIST: %zu train / %zu test images from %s (loaded in %.2f s)\n", train.size,
                test.size, opt.data.string().c_str(), load_s);
    std::printf("%d CPU rank%s (threads), global batch %zu (%zu per rank), %d epoch%s, SGD lr %.4g "
                "momentum %.2f, warmup %llu steps + cosine decay\n",
                ranks, ranks == 1 ? "" : "s", global, per_rank, epochs, epochs == 1 ? "" : "s", peak_lr, opt.momentum,
                static_cast<unsigned long long>(opt.warmup));
    if (global != opt.batch)
      std::printf("note: --batch %zu is not a multiple of %d ranks; using %zu (lr scaled to match)\n",
                  opt.batch, ranks, global);
    std::fflush(stdout);

    final_result result;
    const auto t_train = std::chrono::steady_clock::now();

    // 2. The SPMD body: runs once per rank, each on its own thread.
    lockstep::run(lockstep::Threads{ranks}, [&](auto& ctx) {
      auto& comm = ctx.comm();
      lockstep::Rank0Logger log(ctx.rank());
      fmnist::Mlp model(lockstep::model_seed(opt.seed));  // same on every rank anyway
      lockstep::DataParallelOptions dp_opts;  // zero_copy (bind_gradient) is on by default
      if (opt.bucket_kib > 0) dp_opts.buckets.first_bytes = dp_opts.buckets.cap_bytes = opt.bucket_kib << 10;
      auto dp = lockstep::make_data_parallel(ctx, model, dp_opts);  // checks shapes, broadcasts rank 0's
      lockstep::Sgd sgd({.lr = peak_lr, .momentum = opt.momentum});
      lockstep::DistributedSampler<> sampler(train.size, ctx, {.seed = opt.seed});

      std::uint64_t step = 0;
      int first_epoch = 0;
      if (!opt.resume.empty()) {
        // Every rank reads and verifies the file and restores the same state.
        const auto ck = lockstep::load_checkpoint(opt.resume);
        lockstep::restore_parameters(ck, model.parameters(), comm.memory());
        sgd.load(ck.blob("optimizer"));
        run_config saved{};
        ck.restore_value("run", saved);
        step = static_cast<std::uint64_t>(ck.meta.step);
        first_epoch = static_cast<int>(ck.meta.epoch);
        if (ck.meta.sample_position != 0)
          throw lockstep::checkpoint_error("checkpoint '" + opt.resume.string() +
                                           "' was saved mid-epoch; this example saves and resumes "
                                           "at epoch boundaries only");
        if (ctx.is_root()) {
          std::printf("resumed from %s: %d epoch%s done, %llu steps\n", opt.resume.string().c_str(),
                      first_epoch, first_epoch == 1 ? "" : "s", static_cast<unsigned long long>(step));
          if (saved != config)
            std::fprintf(stderr,
                         "fashion_mnist: warning: the checkpoint was saved by a run with other "
                         "options (seed, batch, data size, ranks, epochs, lr, momentum or "
                         "warmup); training continues with this run's options (but the checkpoint's "
                         "momentum), and will not match an uninterrupted run\n");
          std::fflush(stdout);
        }
      }

      std::vector<float> x;
      std::vector<std::uint8_t> y;
      int last_epoch = epochs;
      if (opt.stop_after > 0) last_epoch = std::min(last_epoch, opt.stop_after);
      for (int epoch = first_epoch; epoch < last_epoch; ++epoch) {
        // --- train ---
        sampler.set_epoch(static_cast<std::uint64_t>(epoch));  // (seed, epoch) → the order
        const auto batches = sampler.batches(per_rank);
        lockstep::ThroughputMeter meter;
        meter.start();
        const auto t0 = std::chrono::steady_clock::now();
        double next_report = opt.progress;
        double loss_sum = 0;
        std::size_t seen = 0;
        for (std::size_t b = 0; b < batches.size(); ++b) {
          gather(train, batches[b], table, x, y);
          sgd.set_lr(schedule(step));
          auto st = dp.step();
          const double loss = model.forward_backward(x.data(), y.data(), batches[b].size(),
                                                     st.on_gradient_ready());
          if (st.finish()) sgd.step(model.parameters());  // gradients are averaged over ranks
          ++step;
          sampler.advance(batches[b].size());
          loss_sum += loss * static_cast<double>(batches[b].size());
          seen += batches[b].size();
          if (ctx.is_root() && opt.progress > 0) {
            const double t = seconds_since(t0);
            if (t >= next_report) {
              next_report = t + opt.progress;
              // Rank 0's running loss; throughput estimated as its rate × ranks (no collective).
              log.progress(lockstep::progress_line(epoch + 1, static_cast<std::int64_t>(b + 1),
                                                   static_cast<std::int64_t>(batches.size()),
                                                   loss_sum / static_cast<double>(seen),
                                                   static_cast<double>(seen) * ranks / t),
                           tty);
            }
          }
        }
        meter.stop(static_cast<std::int64_t>(seen));
        const double train_s = seconds_since(t0);

        // --- evaluate: rank r takes test[r·N/R, (r+1)·N/R), each sample exactly once ---
        const auto te = std::chrono::steady_clock::now();
        const std::size_t R = static_cast<std::size_t>(ctx.size()), r = static_cast<std::size_t>(ctx.rank());
        const std::size_t lo = test.size * r / R, hi = test.size * (r + 1) / R;
        lockstep::eval_counts local;
        std::vector<std::size_t> rows;
        for (std::size_t at = lo; at < hi; at += 500) {
          rows.resize(std::min<std::size_t>(500, hi - at));
          for (std::size_t k = 0; k < rows.size(); ++k) rows[k] = at + k;
          gather(test, rows, table, x, y);
          local.correct += static_cast<std::int64_t>(model.count_correct(x.data(), y.data(), rows.size()));
          local.total += static_cast<std::int64_t>(rows.size());
        }
        const auto counts = lockstep::all_reduce_counts(comm, local);
        double loss_stats[2] = {loss_sum, static_cast<double>(seen)};
        lockstep::all_reduce_scalars(comm, std::span<double>(loss_stats), lockstep::reduce_op::sum);
        const double samples_per_s = meter.global_samples_per_s(comm);
        const double eval_s = seconds_since(te);
        if (counts.total != static_cast<std::int64_t>(test.size))
          throw lockstep::mismatch_error("evaluated " + std::to_string(counts.total) + " of " +
                                         std::to_string(test.size) + " test images");
        if (ctx.is_root()) {
          char line[256];
          std::snprintf(line, sizeof line,
                        "epoch %d/%d | train loss %.4f | test accuracy %.2f%% (%lld/%lld) | "
                        "%.1f s + eval %.2f s | %.0f samples/s",
                        epoch + 1, epochs, loss_stats[0] / loss_stats[1], 100.0 * counts.accuracy(),
                        static_cast<long long>(counts.correct), static_cast<long long>(counts.total),
                        train_s, eval_s, samples_per_s);
          log(line);
          result.accuracy = counts.accuracy();
        }

        // --- checkpoint: rank 0 writes; every rank returns once the file is in place ---
        if (!opt.checkpoint.empty()) {
          lockstep::save_checkpoint_rank0(comm, opt.checkpoint, [&](lockstep::Checkpoint& ck) {
            ck.meta = {.step = static_cast<std::int64_t>(step), .epoch = epoch + 1, .sample_position = 0};
            ck.add_parameters(model.parameters(), comm.memory());
            std::vector<std::byte> sgd_state;
            sgd.save(sgd_state);  // momentum buffers (and options)
            ck.add_blob("optimizer", std::move(sgd_state));
            ck.add_value("run", config);
          });
        }
        if (ctx.is_root()) result.epochs_run = epoch + 1;
      }

      if (ctx.is_root() && ctx.size() > 1 && dp.stats().syncs > 0) {
        const auto& s = dp.stats();
        char line[256];
        std::snprintf(line, sizeof line,
                      "sync (rank 0): %llu steps, %zu bucket%s, %.2f MiB gradient arena (%s), "
                      "%.1f MiB all-reduced per step, %.1f s in collectives (incl. waiting for "
                      "the other ranks)",
                      static_cast<unsigned long long>(s.syncs), s.bucket_count,
                      s.bucket_count == 1 ? "" : "s", s.arena_bytes / 1048576.0,
                      s.zero_copy ? "zero-copy" : "packed",
                      static_cast<double>(s.bytes_reduced) / static_cast<double>(s.syncs) / 1048576.0,
                      s.comm_seconds);
        log(line);
      }

      // Final state: the checksum of the parameters, and whether every rank holds the same.
      const auto ps = model.parameters();
      const std::uint64_t h = checksum(ps);
      std::int64_t lohi[2] = {std::bit_cast<std::int64_t>(h), -std::bit_cast<std::int64_t>(h)};
      lockstep::all_reduce_scalars(comm, std::span<std::int64_t>(lohi), lockstep::reduce_op::min);
      if (ctx.is_root()) {
        result.checksum = h;
        result.ranks_agree = lohi[0] == std::bit_cast<std::int64_t>(h) &&
                             lohi[1] == -std::bit_cast<std::int64_t>(h);
        if (first_epoch >= last_epoch) {  // nothing left to train: report the loaded model
          lockstep::eval_counts all;
          std::vector<std::size_t> rows(test.size);
          for (std::size_t k = 0; k < rows.size(); ++k) rows[k] = k;
          gather(test, rows, table, x, y);
          all.correct = static_cast<std::int64_t>(model.count_correct(x.data(), y.data(), rows.size()));
          all.total = static_cast<std::int64_t>(rows.size());
          result.accuracy = all.accuracy();
          result.epochs_run = first_epoch;
        }
      }
    });

    std::printf("final: test accuracy %.2f%% after %d epoch%s | %.1f s training | parameters "
                "fnv1a 0x%016llx (%s)\n",
                100.0 * result.accuracy, result.epochs_run, result.epochs_run == 1 ? "" : "s",
                seconds_since(t_train), static_cast<unsigned long long>(result.checksum),
                result.ranks_agree ? "identical on all ranks" : "RANKS DIFFER");
    return result.ranks_agree ? 0 : 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::cerr << "fashion_mnist: error: " << e.what() << "\n";
    return 1;
  }
}
