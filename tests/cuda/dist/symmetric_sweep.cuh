#pragma once
// distributed_equivalence --sweep: the all-reduce of buffers in a symmetric window
// (NcclComm::allocate_symmetric) against each rank's own CPU sum of every rank's input. Random
// cases, fresh per run (rank 0's seed, printed): f32, bf16, f16, f64; sum and mean; sizes from
// one element to 6 MiB; offsets that leave the buffer unaligned; in place and out of place
// (the elements around the output must stay as they were), and fixed edge counts (1, fewer
// than the ranks, a vector's width ± 1 per rank). Buffers up to the limit symmetric_kernels()
// names (LOCKSTEP_PEER_ALL_REDUCE_MIB, default 1024) go to lockstep's peer kernel, which sums
// in rank order in f32 (f64), multiplies by float(1/N) (1/N for f64) and rounds once: the CPU
// does the same, so they must agree bit for bit; larger ones (f32, bf16) go to NCCL's
// symmetric kernels: within rounding. The peer kernel off for any reason but
// LOCKSTEP_PEER_ALL_REDUCE_MIB=0 is a failure that names it.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <bit>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <lockstep/core/detail/half.hpp>
#include <lockstep/cuda/nccl_comm.cuh>
#include <lockstep/lockstep.hpp>

namespace lockstep_test {

// Element i of rank q's input, as its bits, and the value it stands for.
inline std::uint64_t sweep_bits(lockstep::dtype t, std::uint64_t seed, int q, std::size_t i, double& value) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (static_cast<std::uint64_t>(q) + 1) + i * 0xd1b54a32d192ed03ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64's finaliser
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const double x = -2.0 + 4.0 * static_cast<double>(z >> 11) * 0x1p-53;
  using lockstep::dtype;
  switch (t) {
    case dtype::f64: value = x; return std::bit_cast<std::uint64_t>(x);
    case dtype::f32: value = static_cast<float>(x); return std::bit_cast<std::uint32_t>(static_cast<float>(x));
    case dtype::bf16: {
      const auto b = lockstep::detail::bf16_of_float(static_cast<float>(x));
      value = lockstep::detail::float_of_bf16(b);
      return b;
    }
    default: {
      const auto h = lockstep::detail::f16_of_float(static_cast<float>(x));
      value = lockstep::detail::float_of_f16(h);
      return h;
    }
  }
}

// What the peer kernel must produce: the sum in rank order in f32 (f64), × float(1/N) for a
// mean, rounded once.
inline std::uint64_t sweep_expected(lockstep::dtype t, std::uint64_t seed, int ranks, std::size_t i, bool mean) {
  double v = 0;
  if (t == lockstep::dtype::f64) {
    double acc = 0;
    for (int q = 0; q < ranks; ++q) {
      sweep_bits(t, seed, q, i, v);
      acc = q == 0 ? v : acc + v;
    }
    const double r = acc * (mean ? 1.0 / static_cast<double>(ranks) : 1.0);
    return std::bit_cast<std::uint64_t>(r);
  }
  float acc = 0;
  for (int q = 0; q < ranks; ++q) {
    sweep_bits(t, seed, q, i, v);
    acc = q == 0 ? static_cast<float>(v) : acc + static_cast<float>(v);
  }
  const float r = acc * (mean ? static_cast<float>(1.0 / static_cast<double>(ranks)) : 1.0f);
  switch (t) {
    case lockstep::dtype::f32: return std::bit_cast<std::uint32_t>(r);
    case lockstep::dtype::bf16: return lockstep::detail::bf16_of_float(r);
    default: return lockstep::detail::f16_of_float(r);
  }
}

inline double sweep_value(lockstep::dtype t, std::uint64_t bits) {
  switch (t) {
    case lockstep::dtype::f64: return std::bit_cast<double>(bits);
    case lockstep::dtype::f32: return std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    case lockstep::dtype::bf16: return lockstep::detail::float_of_bf16(static_cast<std::uint16_t>(bits));
    default: return lockstep::detail::float_of_f16(static_cast<std::uint16_t>(bits));
  }
}

// Returns the number of failed checks on this rank.
inline int symmetric_sweep(lockstep::context<lockstep::NcclComm>& ctx) {
  auto& comm = ctx.comm();
  const auto [ok, why] = comm.symmetric_kernels();
  if (ctx.rank() == 0) std::printf("symmetric_kernels(): %s — %s\n", ok ? "yes" : "no", why.c_str());
  if (!ok) {
    if (ctx.rank() == 0) std::printf("[lockstep-skip] no symmetric windows here\n");
    return 0;
  }
  std::vector<double> shared{ctx.rank() == 0 ? static_cast<double>(std::random_device{}() & 0xffffffffu) : 0.0};
  lockstep::all_reduce_scalars(comm, std::span<double>(shared), lockstep::reduce_op::max);
  const auto seed = static_cast<std::uint64_t>(shared[0]);
  // The limit the group agreed on, as symmetric_kernels() says it.
  std::size_t peer_max = 0;
  int failures = 0, peer_cases = 0;
  if (const auto at = why.find("buffers up to "); at != std::string::npos)
    peer_max = std::strtoull(why.c_str() + at + 14, nullptr, 10) << 20;
  else if (why.find("LOCKSTEP_PEER_ALL_REDUCE_MIB=0") == std::string::npos) {
    std::printf("rank %d: lockstep's peer all-reduce is off: %s\n", ctx.rank(), why.c_str());
    ++failures;
  }
  const std::size_t window = std::size_t{14} << 20;
  auto buf = comm.allocate_symmetric(window).first;
  auto* base = static_cast<unsigned char*>(buf.get());
  const lockstep::CudaMemory mem = comm.memory();
  std::mt19937_64 rng(seed + 17);
  const lockstep::dtype types[] = {lockstep::dtype::f32, lockstep::dtype::bf16, lockstep::dtype::f16,
                                   lockstep::dtype::f64};
  std::vector<unsigned char> host(window);
  const auto ranks = static_cast<std::size_t>(ctx.size());
  const std::size_t edges[] = {1, ranks - 1, 8 * ranks - 1, 8 * ranks + 1, 2 * ranks + 1};
  for (int c = 0; c < 68; ++c) {
    const bool edge = c < 20;  // every edge count with every type, then random cases
    const lockstep::dtype t = edge ? types[c % 4] : types[rng() % 4];
    const std::size_t es = lockstep::size_of(t);
    const bool mean = rng() % 2 == 0, in_place = rng() % 3 != 0;
    const int band = static_cast<int>(rng() % 3);  // small, medium, large
    const std::size_t limit = band == 0 ? 5000 : band == 1 ? 300000 : (std::size_t{6} << 20) / es;
    const std::size_t count = edge ? edges[c / 4] : 1 + rng() % limit;
    if (count == 0) continue;  // fewer than the ranks, on one rank
    if (!lockstep::cuda::kernels::peer_reducible(t)) continue;
    const bool peer = count * es <= peer_max;
    if (!peer && t != lockstep::dtype::f32 && t != lockstep::dtype::bf16) continue;  // neither path takes it
    const std::size_t send_at = (rng() % 64) * es,
                      recv_at = in_place ? send_at : send_at + count * es + (rng() % 64) * es;
    // Known bytes everywhere, then this rank's input.
    for (std::size_t i = 0; i < window; ++i) host[i] = static_cast<unsigned char>((i * 131 + c) & 0xff);
    double v = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t b = sweep_bits(t, seed + static_cast<std::uint64_t>(c), ctx.rank(), i, v);
      std::memcpy(host.data() + send_at + i * es, &b, es);  // little-endian: the low bytes
    }
    mem.upload(base, host.data(), window);
    comm.all_reduce(base + send_at, base + recv_at, count, t,
                    mean ? lockstep::reduce_op::avg : lockstep::reduce_op::sum)
        .synchronize();
    std::vector<unsigned char> got(window);
    mem.download(got.data(), base, window);
    std::size_t wrong = 0, first = 0;
    for (std::size_t i = 0; i < count; ++i) {
      std::uint64_t g = 0;
      std::memcpy(&g, got.data() + recv_at + i * es, es);
      const std::uint64_t e = sweep_expected(t, seed + static_cast<std::uint64_t>(c), ctx.size(), i, mean);
      const bool same = peer ? g == e
                             : std::abs(sweep_value(t, g) - sweep_value(t, e)) <=
                                   (t == lockstep::dtype::bf16 ? 2e-2 : 1e-5) * (1 + std::abs(sweep_value(t, e)));
      if (!same && wrong++ == 0) first = i;
    }
    // Out of place: the bytes around the output (and the input) stay as they were.
    std::size_t touched = 0;
    for (std::size_t i = 0; i < window; ++i) {
      const bool out = i >= recv_at && i < recv_at + count * es;
      const bool in = i >= send_at && i < send_at + count * es;
      if (!out && (in ? got[i] != host[i] : got[i] != static_cast<unsigned char>((i * 131 + c) & 0xff))) ++touched;
    }
    peer_cases += peer ? 1 : 0;
    if (wrong || touched) {
      ++failures;
      std::printf("rank %d: case %d (%s %s, %zu elements at byte %zu -> %zu, %s): %zu wrong (first at %zu), %zu bytes "
                  "outside changed; seed %llu\n",
                  ctx.rank(), c, lockstep::name_of(t), mean ? "avg" : "sum", count, send_at, recv_at,
                  peer ? "peer kernel" : "NCCL", wrong, first, touched, static_cast<unsigned long long>(seed));
    }
  }
  if (ctx.rank() == 0)
    std::printf("sweep: seed %llu, %d cases through lockstep's peer kernel, %d mismatched here\n",
                static_cast<unsigned long long>(seed), peer_cases, failures);
  return failures;
}

// distributed_equivalence --sweep_order: the order check when lockstep's peer kernel carries the
// seals (deferred mode). Ten agreed calls of random sizes (the same on every rank) must pass
// verify_order(); then rank 0 issues one call with another label and size than the others, and
// verify_order() (or the watchdog, which may abort first) must report a mismatch naming both
// labels within the test's time, not after the kernel's LOCKSTEP_TIMEOUT + 2 s. The
// communicator is unusable after that, so run() ends with the mismatch as well (the caller
// checks that). Returns the failed checks on this rank, or −1 where the peer kernel or the
// deferred check is off; `reached` is set once the report was checked (an exception before
// that, a false mismatch among the agreed calls included, leaves it unset).
inline int symmetric_order_sweep(lockstep::context<lockstep::NcclComm>& ctx, bool& reached) {
  auto& comm = ctx.comm();
  const auto [ok, why] = comm.symmetric_kernels();
  if (!ok || why.find("buffers up to ") == std::string::npos ||
      comm.order_check() != lockstep::order_check_mode::deferred) {
    if (ctx.rank() == 0)
      std::printf("[lockstep-skip] no peer kernel or no deferred order check here: %s\n", why.c_str());
    return -1;
  }
  std::vector<double> shared{ctx.rank() == 0 ? static_cast<double>(std::random_device{}() & 0xffffffffu) : 0.0};
  lockstep::all_reduce_scalars(comm, std::span<double>(shared), lockstep::reduce_op::max);
  std::mt19937_64 rng(static_cast<std::uint64_t>(shared[0]));  // the same sizes on every rank
  const std::size_t most = std::size_t{1} << 20;
  auto buf = comm.allocate_symmetric(most * sizeof(float)).first;
  auto* x = static_cast<float*>(buf.get());
  std::vector<float> host(most);
  std::mt19937 values(std::random_device{}());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : host) v = u(values);
  comm.memory().upload(x, host.data(), most * sizeof(float));
  int failures = 0;
  for (int i = 0; i < 10; ++i) {
    comm.label_next("sweep order: agreed call " + std::to_string(i));
    comm.all_reduce(x, x, 1 + rng() % most, lockstep::dtype::f32, lockstep::reduce_op::avg);
  }
  try {
    comm.verify_order();
  } catch (const std::exception& e) {
    std::printf("rank %d: agreed calls were reported: %s\n", ctx.rank(), e.what());
    return failures + 1;
  }
  // Other sizes too: rank 0's kernel runs one block, the others' 16, whose blocks past the first
  // wait for partners that never come — the seals (block 0's) must be compared all the same.
  comm.label_next(ctx.rank() == 0 ? "sweep order: rank 0's label" : "sweep order: the others' label");
  comm.all_reduce(x, x, ctx.rank() == 0 ? 1000 : most, lockstep::dtype::f32, lockstep::reduce_op::sum);
  try {
    comm.verify_order();
    std::printf("rank %d: a call labelled differently went unnoticed\n", ctx.rank());
    ++failures;
  } catch (const std::exception& e) {
    const std::string m = e.what();
    if (m.find("sweep order: rank 0's label") == std::string::npos ||
        m.find("sweep order: the others' label") == std::string::npos) {
      std::printf("rank %d: the report does not name both labels: %s\n", ctx.rank(), e.what());
      ++failures;
    } else {
      std::printf("rank %d: the mismatch was named: %s\n", ctx.rank(), e.what());
    }
  }
  reached = true;
  return failures;
}

}  // namespace lockstep_test
