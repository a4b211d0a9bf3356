#pragma once
// What the CPU and GPU runs of example 01 share: the command line, the data set with its
// normalisation, the training plan (batch split, learning-rate schedule) and the training
// loop itself, written once over a *trainer* — the part that differs by device:
//
//   model()                        the model DataParallel wraps (host or device parameters)
//   attach(params, lr, momentum)   make the optimizer, once DataParallel owns the gradients
//   set_lr(lr)
//   begin_epoch(indices, batches)  this rank's sample order for the epoch (sampler.indices())
//                                  and the batches still to come (spans into it), in order
//   forward_backward(batch, hook)  the next of those batches; adds the gradient of the
//                                  batch's mean loss, calls hook(i) per final gradient, adds
//                                  the batch's summed loss to loss_sum()
//   finish(step)                   step.finish() and the optimizer step
//   loss_sum()                     summed per-sample loss since begin_epoch()
//   synchronize()                  wait for queued device work (for timing)
//   count_correct(lo, hi)          correct predictions on test images [lo, hi)
//   save_optimizer(bytes) / load_optimizer(bytes)   lockstep::Sgd's checkpoint layout
//   input_summary(), graph_summary()  (optional) how batches reach the device and how many
//                                  steps ran as a CUDA graph, for the log
//   run_step(batch, step)          (optional) runs step() (the three calls above) for batch,
//                                  eagerly or as a CUDA graph replay
//
// Because both devices run this same loop, they see the same samples in the same order,
// the same schedule and the same global-batch semantics, and train to the same accuracy.
#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
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
#include <utility>
#include <vector>

#include <unistd.h>  // isatty

#include <lockstep/lockstep.hpp>

#include "idx.hpp"

namespace fmnist {

inline constexpr std::size_t base_batch = 128;  // --lr is the rate for this global batch

enum class device_kind { automatic, cpu, gpu };

// How a GPU rank's batches reach its device (--input); the CPU gathers in the step.
enum class input_kind {
  prefetch,  // gathered on the host ahead of time, copied on a copy stream (lockstep::Prefetcher)
  sync,      // gathered and copied in the step, after the GPU finished the previous one
  device,    // the training set on the device, batches gathered there by a kernel
};

struct options {
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  device_kind device = device_kind::automatic;
  int ranks = 0;  // CPU ranks; 0: lockstep::decide(lockstep::detect())
  int gpus = 0;   // GPU ranks; 0: every visible GPU (or LOCKSTEP_DEVICES)
  std::size_t batch = base_batch;
  std::optional<int> epochs;
  double lr = 0.05;
  double momentum = 0.9;
  std::uint64_t warmup = 100;  // optimizer steps
  std::uint64_t seed = 42;
  std::optional<std::size_t> limit_train, limit_test;
  std::filesystem::path checkpoint, resume;
  std::filesystem::path logdir;  // TensorBoard event file (and scalars.csv) here
  int stop_after = 0;            // 0: run all epochs
  double progress = 1.0;
  std::size_t bucket_kib = 0;                                // 0: lockstep's default buckets (1 MiB first, 25 MiB cap)
  lockstep::wire_format wire = lockstep::wire_format::fp32;  // --wire: lockstep::AnyWire (CPU ranks)
  bool wire_feedback = false;                                // --wire-feedback: WireOptions::error_feedback
  std::optional<lockstep::wire_format> gather_wire;          // --gather-wire: ShardedOptimizer (CPU ranks)
  bool smoke = false;
  bool check = false;  // compare the GPU model with the CPU model before training
  input_kind input = input_kind::prefetch;
  bool input_given = false;
  bool cuda_graph = false;      // (GPU) each full step replayed as one CUDA graph (lockstep::StepGraph)
  bool symmetric = false;       // (GPU) BucketPolicy::symmetric_memory: NCCL's symmetric kernels
  std::size_t micro_batch = 0;  // --deterministic M: lockstep::Deterministic, forwards of M samples
};

inline constexpr const char* usage =
    "usage: fashion_mnist [options]\n"
    "  --data DIR          directory with {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz\n"
    "                      (default /usr/share/datasets/fashion-mnist)\n"
    "  --device D          auto (default): the GPUs when this build has CUDA and a GPU is\n"
    "                      visible (unless --ranks or LOCKSTEP_CPU_RANKS asks for CPU ranks),\n"
    "                      else CPU threads; cpu; gpu\n"
    "  --ranks N           CPU ranks (threads); default LOCKSTEP_CPU_RANKS or one per\n"
    "                      hardware thread\n"
    "  --gpus N            use the first N GPUs (of LOCKSTEP_DEVICES, else of all visible);\n"
    "                      default all\n"
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
    "  --check             (GPU) first compare two training steps of the GPU model with the\n"
    "                      CPU model on the same weights and data; exit 1 if they differ\n"
    "                      by more than 1e-4 (relative)\n"
    "  --checkpoint PATH   save a checkpoint at the end of every epoch (rank 0 writes it)\n"
    "  --resume PATH       continue from a checkpoint (with the same options and device, the\n"
    "                      result is bit for bit that of an uninterrupted run)\n"
    "  --stop-after E      stop after epoch E, as if interrupted (the schedule still spans\n"
    "                      --epochs)\n"
    "  --progress SECONDS  progress line interval, 0 = none (default 1)\n"
    "  --logdir DIR        write TensorBoard scalars (train/loss and train/lr per step; test\n"
    "                      accuracy, samples/s, lockstep/* per epoch) and DIR/scalars.csv\n"
    "  --bucket-kib K      gradient buckets of K KiB (default: lockstep's 1 MiB first bucket,\n"
    "                      which holds this whole 0.9 MiB model)\n"
    "  --wire W            (CPU ranks) gradients on the wire: fp32 (default); bf16: each\n"
    "                      rank's rounded to bf16 and summed in fp32, as lockstep::Bf16Wire does;\n"
    "                      int8: blockwise int8 (a scale per 256 values), as lockstep::Int8Wire\n"
    "  --wire-feedback     (--wire bf16|int8) what the wire rounds off each rank's gradients goes\n"
    "                      with its next step's (error feedback); not with --checkpoint/--resume\n"
    "  --gather-wire W     (CPU ranks) ShardedOptimizer, each rank's SGD on its shard, the\n"
    "                      updated values all-gathered in W: fp32, bf16 or int8 (gather_wire,\n"
    "                      the change since the last gather); not with --checkpoint/--resume\n"
    "  --input MODE        (GPU) how batches reach the device: prefetch (default): gathered on\n"
    "                      the host by a helper thread into pinned memory and copied on a copy\n"
    "                      stream while the previous step computes (lockstep::Prefetcher);\n"
    "                      sync: gathered and copied within the step, after the GPU finished\n"
    "                      the previous one; device: the training set copied to each GPU\n"
    "                      once, batches gathered there by a kernel\n"
    "  --no-prefetch       the same as --input sync\n"
    "  --cuda-graph        (GPU) capture the training step (forward, backward, lockstep's\n"
    "                      collectives, SGD) once into a CUDA graph and replay it for every\n"
    "                      full batch (lockstep::StepGraph); implies --input device\n"
    "  --symmetric         (GPU, one process per GPU) gradient buckets in a symmetric window,\n"
    "                      all-reduced by NCCL's symmetric kernels (BucketPolicy::symmetric_memory)\n"
    "  --deterministic M   sum gradients in fixed point (lockstep::Deterministic): every forward is\n"
    "                      a micro-batch of M samples taken by global position, each rank\n"
    "                      accumulates its share of the global batch (a multiple of M x ranks),\n"
    "                      and the parameters do not depend on the number of ranks, the buckets\n"
    "                      or threads vs processes (docs/determinism.md)\n";

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
  if (used == 0 || used != text.size()) throw usage_error(opt + " expects a number, got '" + text + "'");
  return v;
}

inline options parse(int argc, char** argv) {
  options o;
  bool ranks_given = false, gpus_given = false;
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
    else if (a == "--device") {
      const std::string d = value();
      if (d == "auto") o.device = device_kind::automatic;
      else if (d == "cpu") o.device = device_kind::cpu;
      else if (d == "gpu") o.device = device_kind::gpu;
      else throw usage_error("--device expects auto, cpu or gpu, got '" + d + "'");
    } else if (a == "--ranks") {
      o.ranks = parse_number<int>(a, value());
      ranks_given = true;
    } else if (a == "--gpus") {
      o.gpus = parse_number<int>(a, value());
      gpus_given = true;
    } else if (a == "--batch") o.batch = parse_number<std::size_t>(a, value());
    else if (a == "--epochs") o.epochs = parse_number<int>(a, value());
    else if (a == "--lr") o.lr = parse_number<double>(a, value());
    else if (a == "--momentum") o.momentum = parse_number<double>(a, value());
    else if (a == "--warmup") o.warmup = parse_number<std::uint64_t>(a, value());
    else if (a == "--seed") o.seed = parse_number<std::uint64_t>(a, value());
    else if (a == "--limit-train") o.limit_train = parse_number<std::size_t>(a, value());
    else if (a == "--limit-test") o.limit_test = parse_number<std::size_t>(a, value());
    else if (a == "--smoke") o.smoke = true;
    else if (a == "--check") o.check = true;
    else if (a == "--checkpoint") o.checkpoint = value();
    else if (a == "--resume") o.resume = value();
    else if (a == "--stop-after") o.stop_after = parse_number<int>(a, value());
    else if (a == "--progress") o.progress = parse_number<double>(a, value());
    else if (a == "--logdir") o.logdir = value();
    else if (a == "--bucket-kib") o.bucket_kib = parse_number<std::size_t>(a, value());
    else if (a == "--wire") {
      try {
        o.wire = lockstep::wire_format_of(value());
      } catch (const lockstep::config_error& e) {
        throw usage_error(std::string("--wire: ") + e.what());
      }
    } else if (a == "--wire-feedback") {
      o.wire_feedback = true;
    } else if (a == "--gather-wire") {
      try {
        o.gather_wire = lockstep::wire_format_of(value());
      } catch (const lockstep::config_error& e) {
        throw usage_error(std::string("--gather-wire: ") + e.what());
      }
    } else if (a == "--input") {
      const std::string m = value();
      if (m == "prefetch") o.input = input_kind::prefetch;
      else if (m == "sync") o.input = input_kind::sync;
      else if (m == "device") o.input = input_kind::device;
      else throw usage_error("--input expects prefetch, sync or device, got '" + m + "'");
      o.input_given = true;
    } else if (a == "--no-prefetch") {
      o.input = input_kind::sync;
      o.input_given = true;
    } else if (a == "--cuda-graph") o.cuda_graph = true;
    else if (a == "--symmetric") o.symmetric = true;
    else if (a == "--deterministic") {
      o.micro_batch = parse_number<std::size_t>(a, value());
      if (o.micro_batch == 0) throw usage_error("--deterministic expects a micro-batch of at least 1 sample");
    } else throw usage_error("unknown option '" + a + "'");
  }
  if (o.smoke) {  // explicit options win, whatever their order
    if (!o.limit_train) o.limit_train = 4096;
    if (!o.limit_test) o.limit_test = 1000;
    if (!o.epochs) o.epochs = 2;
  }
  if (!o.epochs) o.epochs = 5;
  if (o.ranks < 0) throw usage_error("--ranks must be at least 1");
  if (gpus_given && o.gpus < 1) throw usage_error("--gpus must be at least 1");
  // --ranks counts CPU threads, --gpus and --check are about GPUs: each settles `auto`.
  const bool wants_gpu = gpus_given || o.check;
  if (ranks_given && wants_gpu)
    throw usage_error("--ranks (CPU threads) cannot be combined with --gpus or --check (GPUs)");
  if (o.device == device_kind::cpu && wants_gpu)
    throw usage_error("--gpus and --check need --device gpu (or auto), not --device cpu");
  if (o.device == device_kind::gpu && ranks_given)
    throw usage_error("--ranks sets CPU threads; with --device gpu use --gpus N");
  if (o.device == device_kind::automatic && ranks_given) o.device = device_kind::cpu;
  if (o.device == device_kind::automatic && wants_gpu) o.device = device_kind::gpu;
  if (o.cuda_graph) {  // a graph reads its batch from fixed device addresses
    if (o.device == device_kind::cpu) throw usage_error("--cuda-graph needs GPUs, not --device cpu");
    if (o.input_given && o.input != input_kind::device)
      throw usage_error("--cuda-graph replays a step whose batch is gathered on the device: use --input device");
    o.input = input_kind::device;
  }
  if (o.gather_wire && (o.micro_batch > 0 || !o.checkpoint.empty() || !o.resume.empty()))
    throw usage_error(
        "--gather-wire shards the optimizer's state, which this example's checkpoints and --deterministic do not "
        "handle; leave one out");
  if (o.wire_feedback && (o.wire == lockstep::wire_format::fp32 || !o.checkpoint.empty() || !o.resume.empty()))
    throw usage_error(
        "--wire-feedback goes with --wire bf16 or int8, and not with --checkpoint/--resume (this example's "
        "checkpoints do not keep the residuals: lockstep::gather_wire_feedback does)");
  if (o.micro_batch > 0) {
    if (o.wire != lockstep::wire_format::fp32)
      throw usage_error("--deterministic sums in fixed point: it cannot be combined with --wire bf16 or int8");
    if (o.cuda_graph)
      throw usage_error("--deterministic accumulates micro-steps, which --cuda-graph does not capture; drop one");
  }
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

// The data, loaded once by main() and read by every rank; pixels become
// (pixel/255 − mean)/std through `table`, on the CPU and on the GPU alike.
struct dataset {
  split train, test;
  std::array<float, 256> table{};
};

// Normalise by the training set's mean and standard deviation (≈ 0.286, 0.353).
inline void make_table(dataset& d) {
  double sum = 0, sum2 = 0;
  for (auto v : d.train.pixels) {
    sum += v;
    sum2 += static_cast<double>(v) * v;
  }
  const double n_px = static_cast<double>(d.train.pixels.size());
  const double mean = sum / n_px / 255.0;
  const double stdev = std::max(1e-6, std::sqrt(std::max(0.0, sum2 / n_px / (255.0 * 255.0) - mean * mean)));
  for (int v = 0; v < 256; ++v) d.table[static_cast<std::size_t>(v)] = static_cast<float>((v / 255.0 - mean) / stdev);
}

// Rows `rows` of the split as normalised floats into x (rows × 784), their labels into y.
inline void gather_into(const split& s, std::span<const std::size_t> rows, const float* table, float* x,
                        std::uint8_t* y) {
  constexpr std::size_t P = image_pixels;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const std::uint8_t* src = s.pixels.data() + rows[r] * P;
    float* dst = x + r * P;
    for (std::size_t k = 0; k < P; ++k) dst[k] = table[src[k]];
    y[r] = s.labels[rows[r]];
  }
}

// Rows `rows` of the split as normalised floats.
inline void gather(const split& s, std::span<const std::size_t> rows, const float* table, std::vector<float>& x,
                   std::vector<std::uint8_t>& y) {
  x.resize(rows.size() * image_pixels);
  y.resize(rows.size());
  gather_into(s, rows, table, x.data(), y.data());
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
  std::int32_t on_gpus;      // 1: trained on GPUs (other rounding than the CPU's)
  std::int32_t micro_batch;  // --deterministic M (ranks is 0 then: the result does not depend on them), else 0
  bool operator==(const run_config&) const = default;
};

// How the global batch is split and the learning rate scheduled, for `ranks` ranks.
struct training_plan {
  int ranks = 1;
  std::size_t per_rank = 0;     // samples of one forward/backward on a rank
  std::size_t global = 0;       // per optimizer step, all ranks
  std::size_t micro_steps = 1;  // forwards per rank and optimizer step (--deterministic: global / (M x ranks))
  bool deterministic = false;   // --deterministic: micro-batches by global position, lockstep::Deterministic
  double peak_lr = 0;
  lockstep::LinearWarmup schedule{};
  run_config config{};
};

inline training_plan make_plan(const options& opt, std::size_t train_size, int ranks, bool on_gpus) {
  training_plan p;
  const int epochs = *opt.epochs;
  p.ranks = ranks;
  const auto R = static_cast<std::size_t>(ranks);
  std::size_t steps_per_epoch = 0;
  if (opt.micro_batch > 0) {
    // --deterministic: forwards of M samples; the epoch's global batches (full ones only, the
    // same on any number of ranks) split into micro-batches by position (lockstep::micro_batches).
    if (opt.batch % (opt.micro_batch * R) != 0)
      throw lockstep::config_error("--deterministic " + std::to_string(opt.micro_batch) + " on " +
                                   std::to_string(ranks) + " rank(s): --batch " + std::to_string(opt.batch) +
                                   " must be a multiple of " + std::to_string(opt.micro_batch * R) +
                                   " (micro-batch x ranks)");
    p.deterministic = true;
    p.per_rank = opt.micro_batch;
    p.global = opt.batch;
    p.micro_steps = opt.batch / (opt.micro_batch * R);
    steps_per_epoch = train_size / p.global;
    if (steps_per_epoch == 0)
      throw lockstep::config_error("--deterministic: --batch " + std::to_string(opt.batch) +
                                   " is larger than the training set (" + std::to_string(train_size) + " images)");
  } else {
    // --batch is global: each rank takes its share, so 1, 2 or 4 ranks train alike.
    p.per_rank = std::max<std::size_t>(1, opt.batch / R);
    p.global = lockstep::effective_batch(p.per_rank, ranks);
    // Every rank has the same number of samples (DistributedSampler pads), hence of steps.
    const std::size_t per_rank_samples = (train_size + R - 1) / R;
    steps_per_epoch = (per_rank_samples + p.per_rank - 1) / p.per_rank;
  }
  p.peak_lr = lockstep::scaled_lr(opt.lr, base_batch, p.global);
  p.schedule = lockstep::LinearWarmup{
      .peak_lr = p.peak_lr,
      .warmup_steps = opt.warmup,
      .decay = lockstep::Decay::cosine,
      .total_steps = std::max<std::uint64_t>(opt.warmup, steps_per_epoch * static_cast<std::uint64_t>(epochs)),
      .final_lr = 0.0};
  p.config = {opt.seed,        p.global,
              train_size,      p.deterministic ? 0 : ranks,
              epochs,          opt.lr,
              opt.momentum,    opt.warmup,
              on_gpus ? 1 : 0, static_cast<std::int32_t>(opt.micro_batch)};
  return p;
}

struct final_result {
  double accuracy = 0;
  std::uint64_t checksum = 0;
  bool ranks_agree = false;
  int epochs_run = 0;
};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The run's header (examples 01 and 02): the data, `where` the ranks run, the plan.
inline void print_header(const std::string& where, const options& opt, const dataset& data, const training_plan& plan,
                         double load_s) {
  const int epochs = *opt.epochs;
  std::printf("Fashion-MNIST: %zu train / %zu test images from %s (loaded in %.2f s)\n", data.train.size,
              data.test.size, opt.data.string().c_str(), load_s);
  std::printf("%s, global batch %zu (%zu per rank), %d epoch%s, SGD lr %.4g momentum %.2f, warmup %llu steps + "
              "cosine decay\n",
              where.c_str(), plan.global, plan.per_rank * plan.micro_steps, epochs, epochs == 1 ? "" : "s",
              plan.peak_lr, opt.momentum, static_cast<unsigned long long>(opt.warmup));
  if (plan.deterministic)
    std::printf("deterministic: fixed-point gradient sums (lockstep::Deterministic), micro-batches of %zu by "
                "global position, %zu per rank and step\n",
                plan.per_rank, plan.micro_steps);
  else if (plan.global != opt.batch)
    std::printf("note: --batch %zu is not a multiple of %d ranks; using %zu (lr scaled to match)\n", opt.batch,
                plan.ranks, plan.global);
  std::fflush(stdout);
}

// The run's last line: accuracy, time, and the parameter checksum every rank must share.
inline void print_final(const final_result& r, double train_s) {
  std::printf("final: test accuracy %.2f%% after %d epoch%s | %.1f s training | parameters fnv1a 0x%016llx (%s)\n",
              100.0 * r.accuracy, r.epochs_run, r.epochs_run == 1 ? "" : "s", train_s,
              static_cast<unsigned long long>(r.checksum), r.ranks_agree ? "identical on all ranks" : "RANKS DIFFER");
  std::fflush(stdout);
}

// FNV-1a over the parameters' bytes, fetched through `mem` (host or device memory):
// equal values → equal checksum (to compare ranks and runs).
template <class Memory>
std::uint64_t checksum(const std::vector<lockstep::parameter>& ps, const Memory& mem) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  std::vector<unsigned char> bytes;
  for (const auto& p : ps) {
    bytes.resize(p.bytes());
    mem.download(bytes.data(), p.value, bytes.size());
    for (unsigned char b : bytes) h = (h ^ b) * 0x100000001b3ULL;
  }
  return h;
}

template <class Ctx, class Trainer, class... Policies>
void train_with(Ctx& ctx, Trainer& trainer, const options& opt, const training_plan& plan, const dataset& data,
                final_result& result, Policies... policies);

// The SPMD body: one rank's training, evaluation and checkpoints. `trainer` is this rank's
// (see the top of this file); `result` is written by rank 0.
template <class Ctx, class Trainer>
void train_rank(Ctx& ctx, Trainer& trainer, const options& opt, const training_plan& plan, const dataset& data,
                final_result& result) {
  // --deterministic: gradients summed in fixed point, each rank's share of the global batch
  // accumulated over plan.micro_steps forwards.
  if (plan.deterministic)
    return train_with(ctx, trainer, opt, plan, data, result, lockstep::Deterministic{},
                      lockstep::Accumulate<>(static_cast<int>(plan.micro_steps)));
  // --wire bf16|int8 on CPU ranks: each rank's gradients as the wire carries them, summed in
  // fp32 — the numbers lockstep::Bf16Wire and Int8Wire give over NCCL (bit for bit,
  // tests/cuda/test_wire.cu), for comparing accuracy with the fp32 wire. The GPU path keeps the
  // plain all-reduce here.
  using Comm = std::remove_cvref_t<decltype(ctx.comm())>;
  if constexpr (!requires(Comm& c) { c.comm_stream(); }) {
    const lockstep::AnyWire wire(opt.wire, {.error_feedback = opt.wire_feedback});
    if (opt.gather_wire)  // --gather-wire: sharded, the values all-gathered in that format
      return train_with(ctx, trainer, opt, plan, data, result, wire,
                        lockstep::ShardedOptimizer{.gather_wire = *opt.gather_wire});
    train_with(ctx, trainer, opt, plan, data, result, wire);
  } else {
    if (opt.wire != lockstep::wire_format::fp32 || opt.gather_wire)
      throw lockstep::config_error("--wire and --gather-wire are for CPU ranks in this example (on GPUs see "
                                   "examples/03_gpt2_torch --wire, --gather-wire)");
    train_with(ctx, trainer, opt, plan, data, result, lockstep::AllReduceMean{});
  }
}

// train_rank with DataParallel's policies (a bucket hook; an accumulation policy).
template <class Ctx, class Trainer, class... Policies>
void train_with(Ctx& ctx, Trainer& trainer, const options& opt, const training_plan& plan, const dataset& data,
                final_result& result, Policies... policies) {
  auto& comm = ctx.comm();
  const int epochs = *opt.epochs;
  const bool tty = isatty(fileno(stdout)) == 1;
  lockstep::Rank0Logger log(ctx.rank());
  auto& model = trainer.model();
  lockstep::DataParallelOptions dp_opts;  // zero_copy (bind_gradient) is on by default
  if (opt.bucket_kib > 0) dp_opts.buckets.first_bytes = dp_opts.buckets.cap_bytes = opt.bucket_kib << 10;
  dp_opts.buckets.symmetric_memory = opt.symmetric;
  // checks shapes, broadcasts rank 0's values
  auto dp = lockstep::make_data_parallel<Policies...>(ctx, model, dp_opts, std::move(policies)...);
  trainer.attach(dp.parameters(), plan.peak_lr, opt.momentum);
  // --deterministic: every rank walks the epoch's whole list (a sampler of one rank) and takes
  // its micro-batches of each global batch by position; else the usual per-rank partition.
  lockstep::DistributedSampler<> sampler =
      plan.deterministic ? lockstep::DistributedSampler<>(data.train.size, 0, 1, {.seed = opt.seed})
                         : lockstep::DistributedSampler<>(data.train.size, ctx, {.seed = opt.seed});
  // Rank 0 writes the scalars; with --logdir unset every call below returns at once.
  lockstep::ScalarLog scalars;
  if (!opt.logdir.empty())
    scalars = lockstep::ScalarLog(ctx.rank(), {.tensorboard = opt.logdir, .csv = opt.logdir / "scalars.csv"});

  std::uint64_t step = 0;
  if (!opt.resume.empty()) {
    // Every rank reads and verifies the file and restores the same state: parameters, loss
    // scale, gradient layout and the sampler's epoch and position, in one call.
    const auto ck = lockstep::load_checkpoint(opt.resume);
    lockstep::restore_training_state(ck, dp, sampler);
    ck.restore("optimizer", trainer.optimizer());  // momentum buffers (and options)
    run_config saved{};
    ck.restore_value("run", saved);
    step = static_cast<std::uint64_t>(ck.meta.step);
    const int done = static_cast<int>(sampler.epoch());
    if (ctx.is_root()) {
      std::printf("resumed from %s: %d epoch%s done, %llu steps\n", opt.resume.string().c_str(), done,
                  done == 1 ? "" : "s", static_cast<unsigned long long>(step));
      if (saved != plan.config)
        std::fprintf(stderr,
                     "fashion_mnist: warning: the checkpoint was saved by a run with other "
                     "options (seed, batch, data size, ranks, epochs, lr, momentum, warmup, "
                     "device or --deterministic); training continues with this run's options (but the checkpoint's "
                     "momentum), and will not match an uninterrupted run\n");
      std::fflush(stdout);
    }
  }

  const int first_epoch = static_cast<int>(sampler.epoch());
  int last_epoch = epochs;
  if (opt.stop_after > 0) last_epoch = std::min(last_epoch, opt.stop_after);
  // Rank 0's training time per step, the run's first epoch left out (warm-up) when it has more.
  double timed_s = 0;
  std::size_t timed_steps = 0;
  // The sampler carries the epoch (and, in a resumed run, the position within it); the
  // (seed, epoch) pair decides the order.
  for (; sampler.epoch() < static_cast<std::uint64_t>(last_epoch); sampler.set_epoch(sampler.epoch() + 1)) {
    const int epoch = static_cast<int>(sampler.epoch());
    // --- train: batches[b] is the sampler's (the whole global batch with --deterministic), its
    // forwards on this rank forwards[first[b] .. first[b + 1]) ---
    const auto batches = plan.deterministic ? sampler.batches(plan.global, lockstep::LastBatch::drop_partial)
                                            : sampler.batches(plan.per_rank);
    std::vector<std::span<const std::size_t>> forwards;
    std::vector<std::size_t> first{0};
    for (const auto& batch : batches) {
      if (plan.deterministic)
        for (auto m : lockstep::micro_batches(batch, plan.per_rank, ctx.rank(), ctx.size())) forwards.push_back(m);
      else forwards.push_back(batch);
      first.push_back(forwards.size());
    }
    trainer.begin_epoch(std::span<const std::size_t>(sampler.indices()),
                        std::span<const std::span<const std::size_t>>(forwards));
    lockstep::ThroughputMeter meter;
    meter.start();
    const auto t0 = std::chrono::steady_clock::now();
    double next_report = opt.progress;
    std::size_t seen = 0;
    for (std::size_t b = 0; b < batches.size(); ++b) {
      trainer.set_lr(plan.schedule(step));
      const double loss_before = scalars.active() ? trainer.loss_sum() : 0.0;
      std::size_t mine = 0;  // this rank's samples of the step
      for (std::size_t f = first[b]; f < first[b + 1]; ++f) {
        const auto one_step = [&] {
          auto st = dp.step();
          trainer.forward_backward(forwards[f], st.on_gradient_ready());
          if constexpr (decltype(dp)::sharded)  // each rank's optimizer steps its shard, then the all-gather
            (void)st.finish([&](std::span<const lockstep::param_slice> shard) { trainer.step_shard(shard); });
          else trainer.finish(st);  // the last forward's: gradients averaged over ranks, the optimizer steps
        };
        // A GPU trainer may replay the step as a CUDA graph (--cuda-graph).
        if constexpr (requires { trainer.run_step(forwards[f], one_step); }) trainer.run_step(forwards[f], one_step);
        else one_step();
        mine += forwards[f].size();
      }
      if (scalars.active()) {  // rank 0's batch (reading the loss synchronises a GPU rank)
        const auto s = static_cast<std::int64_t>(step);
        scalars.scalar("train/loss", s, (trainer.loss_sum() - loss_before) / static_cast<double>(mine));
        scalars.scalar("train/lr", s, plan.schedule(step));
      }
      ++step;
      sampler.advance(batches[b].size());
      seen += mine;
      if (ctx.is_root() && opt.progress > 0) {
        const double t = seconds_since(t0);
        if (t >= next_report) {
          next_report = t + opt.progress;
          // Rank 0's running loss; throughput estimated as its rate × ranks (no collective).
          log.progress(lockstep::progress_line(
                           epoch + 1, static_cast<std::int64_t>(b + 1), static_cast<std::int64_t>(batches.size()),
                           trainer.loss_sum() / static_cast<double>(seen), static_cast<double>(seen) * plan.ranks / t),
                       tty);
        }
      }
    }
    if (plan.deterministic) sampler.set_position(sampler.size());  // a last partial global batch is dropped
    trainer.synchronize();  // device work queued by the loop counts in the epoch's time
    meter.stop(static_cast<std::int64_t>(seen));
    const double train_s = seconds_since(t0);
    if (epoch > first_epoch || last_epoch - first_epoch == 1) {
      timed_s += train_s;
      timed_steps += batches.size();
    }

    // --- evaluate: rank r takes test[r·N/R, (r+1)·N/R), each sample exactly once ---
    const auto te = std::chrono::steady_clock::now();
    const std::size_t R = static_cast<std::size_t>(ctx.size()), r = static_cast<std::size_t>(ctx.rank());
    const std::size_t lo = data.test.size * r / R, hi = data.test.size * (r + 1) / R;
    if constexpr (decltype(dp)::sharded) dp.wait_all_parameters();  // every rank: the exact values (the masters)
    lockstep::eval_counts local;
    local.correct = static_cast<std::int64_t>(trainer.count_correct(lo, hi));
    local.total = static_cast<std::int64_t>(hi - lo);
    const auto counts = lockstep::all_reduce_counts(comm, local);
    double loss_stats[2] = {trainer.loss_sum(), static_cast<double>(seen)};
    lockstep::all_reduce_scalars(comm, std::span<double>(loss_stats), lockstep::reduce_op::sum);
    const double samples_per_s = meter.global_samples_per_s(comm);
    const double eval_s = seconds_since(te);
    if (counts.total != static_cast<std::int64_t>(data.test.size))
      throw lockstep::mismatch_error("evaluated " + std::to_string(counts.total) + " of " +
                                     std::to_string(data.test.size) + " test images");
    if (ctx.is_root()) {
      char line[256];
      std::snprintf(line, sizeof line,
                    "epoch %d/%d | train loss %.4f | test accuracy %.2f%% (%lld/%lld) | "
                    "%.1f s + eval %.2f s | %.0f samples/s",
                    epoch + 1, epochs, loss_stats[0] / loss_stats[1], 100.0 * counts.accuracy(),
                    static_cast<long long>(counts.correct), static_cast<long long>(counts.total), train_s, eval_s,
                    samples_per_s);
      log(line);
      result.accuracy = counts.accuracy();
      const auto s = static_cast<std::int64_t>(step);
      scalars.scalar("test/accuracy", s, counts.accuracy());
      scalars.scalar("train/epoch_loss", s, loss_stats[0] / loss_stats[1]);
      scalars.scalar("throughput/samples_per_s", s, samples_per_s);
      scalars.scalar("lockstep/loss_scale", s, dp.scaler().scale());
      scalars.scalar("lockstep/comm_seconds", s, dp.stats().comm_seconds);
      scalars.flush();
    }

    // --- checkpoint: rank 0 writes; every rank returns once the file is in place ---
    if (!opt.checkpoint.empty()) {
      lockstep::save_checkpoint_rank0(comm, opt.checkpoint, [&](lockstep::Checkpoint& ck) {
        ck.meta.step = static_cast<std::int64_t>(step);
        lockstep::add_training_state(ck, dp, sampler);  // the epoch is used up: resumes at the next
        ck.add("optimizer", trainer.optimizer());       // momentum buffers (and options)
        ck.add_value("run", plan.config);
      });
    }
    if (ctx.is_root()) result.epochs_run = epoch + 1;
  }

  if constexpr (requires { trainer.input_summary(); }) {
    if (ctx.is_root() && timed_steps > 0) {
      char line[512];
      std::snprintf(line, sizeof line, "input: %s | %.3f ms per step (rank 0%s)%s", trainer.input_summary().c_str(),
                    1e3 * timed_s / static_cast<double>(timed_steps),
                    last_epoch - first_epoch > 1 ? ", first epoch left out" : "", trainer.graph_summary().c_str());
      log(line);
    }
  }

  if (ctx.is_root() && ctx.size() > 1 && dp.stats().syncs > 0) {
    const auto& s = dp.stats();
    char line[256];
    std::snprintf(line, sizeof line,
                  "sync (rank 0): %llu steps, %zu bucket%s, %.2f MiB gradient arena (%s), "
                  "%.1f MiB all-reduced per step, %.1f s in collectives (incl. waiting for "
                  "the other ranks)",
                  static_cast<unsigned long long>(s.syncs), s.bucket_count, s.bucket_count == 1 ? "" : "s",
                  s.arena_bytes / 1048576.0,
                  s.zero_copy ? (s.symmetric_memory ? "zero-copy, symmetric window" : "zero-copy")
                              : (s.symmetric_memory ? "packed, symmetric window" : "packed"),
                  static_cast<double>(s.bytes_reduced) / static_cast<double>(s.syncs) / 1048576.0, s.comm_seconds);
    log(line);
  }

  // Final state: the checksum of the parameters, and whether every rank holds the same.
  const std::uint64_t h = checksum(model.parameters(), comm.memory());
  std::int64_t lohi[2] = {std::bit_cast<std::int64_t>(h), -std::bit_cast<std::int64_t>(h)};
  lockstep::all_reduce_scalars(comm, std::span<std::int64_t>(lohi), lockstep::reduce_op::min);
  if (ctx.is_root()) {
    result.checksum = h;
    result.ranks_agree = lohi[0] == std::bit_cast<std::int64_t>(h) && lohi[1] == -std::bit_cast<std::int64_t>(h);
    if (first_epoch >= last_epoch) {  // nothing left to train: report the loaded model
      lockstep::eval_counts all;
      all.correct = static_cast<std::int64_t>(trainer.count_correct(0, data.test.size));
      all.total = static_cast<std::int64_t>(data.test.size);
      result.accuracy = all.accuracy();
      result.epochs_run = first_epoch;
    }
  }
}

}  // namespace fmnist
