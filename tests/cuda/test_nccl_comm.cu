// NcclComm against the reference: every collective, run on the same random host data through
// lockstep::ThreadComm (host threads) and through NcclComm (one host thread per GPU), must give
// the same results — bit for bit where the operation does no arithmetic or is order-free
// (broadcast, gather, max, min, integers), within 1e-5 (float) / 1e-12 (double) of the sum of
// magnitudes where NCCL's summation order differs from ThreadComm's. Outputs are poisoned
// (all bits set: NaN for floats) before each collective so an unwritten element fails.

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <lockstep/comm/thread_comm.hpp>
#include <lockstep/cuda/nccl_comm.cuh>

#include "gpu_test_util.cuh"

namespace {

using lockstep::dtype;
using lockstep::NcclComm;
using lockstep::reduce_op;
using bytes = std::vector<unsigned char>;

static_assert(lockstep::dtype_of<__half> == dtype::f16);
static_assert(lockstep::dtype_of<__nv_bfloat16> == dtype::bf16);

// Runs fn(r) on one host thread per rank; rethrows the first failure on this thread.
template <class F>
void on_ranks(int n, F&& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

std::vector<int> first_devices(int n) {
  std::vector<int> d(static_cast<std::size_t>(n));
  std::iota(d.begin(), d.end(), 0);
  return d;
}

std::string what_of(auto&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

// ---------------------------------------------------------------------------------------
// Random inputs (splitmix64: fast enough for 256 MiB per rank).
struct splitmix {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
};

bytes random_input(dtype t, std::size_t n, std::uint64_t seed) {
  bytes b(n * lockstep::size_of(t));
  splitmix g{seed};
  switch (t) {
    case dtype::f32: {
      auto* p = reinterpret_cast<float*>(b.data());
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<float>(2.0 * g.uniform() - 1.0);
      break;
    }
    case dtype::f64: {
      auto* p = reinterpret_cast<double*>(b.data());
      for (std::size_t i = 0; i < n; ++i) p[i] = 2.0 * g.uniform() - 1.0;
      break;
    }
    case dtype::i32: {  // positive, so no result equals the poison (-1)
      auto* p = reinterpret_cast<std::int32_t*>(b.data());
      for (std::size_t i = 0; i < n; ++i) p[i] = 1 + static_cast<std::int32_t>(g.next() % 1000);
      break;
    }
    case dtype::bf16:
    case dtype::f16: {  // raw bits, never the poison pattern
      auto* p = reinterpret_cast<std::uint16_t*>(b.data());
      for (std::size_t i = 0; i < n; ++i) {
        p[i] = static_cast<std::uint16_t>(g.next());
        if (p[i] == 0xFFFF) p[i] = 0x3F80;
      }
      break;
    }
    default: throw std::logic_error(std::string("no generator for ") + lockstep::name_of(t));
  }
  return b;
}

// ---------------------------------------------------------------------------------------
enum class coll { all_reduce, broadcast, all_gather, reduce_scatter };

struct spec {
  coll kind;
  dtype t;
  reduce_op op;
  std::size_t count;
  int root;
  bool in_place;

  std::string describe() const {
    static const char* names[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter"};
    std::ostringstream s;
    s << names[static_cast<int>(kind)] << " of " << count << " " << lockstep::name_of(t);
    if (kind == coll::all_reduce || kind == coll::reduce_scatter) s << " (" << lockstep::name_of(op) << ")";
    if (kind == coll::broadcast) s << " from root " << root;
    s << (in_place ? ", in place" : ", out of place");
    return s.str();
  }
  std::size_t in_elems(int n) const { return kind == coll::reduce_scatter ? count * static_cast<std::size_t>(n) : count; }
  std::size_t out_elems(int n) const { return kind == coll::all_gather ? count * static_cast<std::size_t>(n) : count; }
  bool exact() const {
    if (kind == coll::broadcast || kind == coll::all_gather) return true;
    return op == reduce_op::max || op == reduce_op::min || !lockstep::is_floating(t);
  }
};

// On one rank, avg of 2^20 + 3 elements out of place is the regression test for NCCL's
// one-rank avg dropping the tail (NVIDIA/nccl#1950, found by this test on NCCL 2.28.9).
std::vector<spec> all_cases(int n) {
  const std::size_t lengths[] = {0, 1, 1001, (std::size_t{1} << 20) + 3};
  std::vector<spec> v;
  for (dtype t : {dtype::f32, dtype::f64})
    for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min})
      for (std::size_t len : lengths)
        for (bool ip : {false, true}) v.push_back({coll::all_reduce, t, op, len, 0, ip});
  for (bool ip : {false, true}) v.push_back({coll::all_reduce, dtype::i32, reduce_op::sum, 1001, 0, ip});
  // 256 MiB: the largest size, for the one collective that carries gradients.
  v.push_back({coll::all_reduce, dtype::f32, reduce_op::sum, (std::size_t{256} << 20) / sizeof(float), 0, false});
  std::vector<int> roots{n - 1};  // a non-zero root whenever there is more than one rank
  if (n > 1) roots.push_back(0);
  for (dtype t : {dtype::f32, dtype::f64, dtype::bf16})
    for (std::size_t len : lengths)
      for (int root : roots) v.push_back({coll::broadcast, t, reduce_op::sum, len, root, true});
  for (dtype t : {dtype::f32, dtype::f64, dtype::bf16})
    for (std::size_t len : lengths)
      for (bool ip : {false, true}) v.push_back({coll::all_gather, t, reduce_op::sum, len, 0, ip});
  for (dtype t : {dtype::f32, dtype::f64})
    for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max})
      for (std::size_t len : lengths)
        for (bool ip : {false, true}) v.push_back({coll::reduce_scatter, t, op, len, 0, ip});
  return v;
}

// The reference: the same collective through ThreadComm, out of place, on host memory.
std::vector<bytes> reference(const spec& c, int n, const std::vector<bytes>& in) {
  auto comms = lockstep::ThreadComm::create_group(n);
  std::vector<bytes> out(static_cast<std::size_t>(n));
  on_ranks(n, [&](int r) {
    const auto ur = static_cast<std::size_t>(r);
    auto& tc = comms[ur];
    out[ur].resize(c.out_elems(n) * lockstep::size_of(c.t));
    switch (c.kind) {
      case coll::all_reduce: tc.all_reduce(in[ur].data(), out[ur].data(), c.count, c.t, c.op); break;
      case coll::broadcast:
        out[ur] = in[ur];
        tc.broadcast(out[ur].data(), c.count, c.t, c.root);
        break;
      case coll::all_gather: tc.all_gather(in[ur].data(), out[ur].data(), c.count, c.t); break;
      case coll::reduce_scatter: tc.reduce_scatter(in[ur].data(), out[ur].data(), c.count, c.t, c.op); break;
    }
  });
  return out;
}

// All bits set: NaN for every floating type, -1 for integers.
void poison(NcclComm& comm, void* p, std::size_t nbytes) {
  if (nbytes == 0) return;
  lockstep::detail::device_guard g(comm.device());
  LOCKSTEP_TRY_CUDA(cudaMemsetAsync(p, 0xFF, nbytes, comm.compute_stream()));
}

// One rank of the collective under test; the result lands in out[r].
void one_rank_through_nccl(const spec& c, std::vector<NcclComm>& comms, const std::vector<bytes>& in,
                           std::vector<bytes>& out, int r) {
  const int n = static_cast<int>(comms.size());
  const std::size_t es = lockstep::size_of(c.t);
  const auto ur = static_cast<std::size_t>(r);
  NcclComm& comm = comms[ur];
  const auto mem = comm.memory();
  const std::size_t in_bytes = in[ur].size();
  const std::size_t out_bytes = c.out_elems(n) * es;
  const std::size_t block = c.count * es;
  std::shared_ptr<void> a, b;
  auto at = [](const std::shared_ptr<void>& p, std::size_t off) { return static_cast<unsigned char*>(p.get()) + off; };
  NcclComm::work w;
  const void* result = nullptr;
  switch (c.kind) {
    case coll::all_reduce:
      a = mem.allocate(in_bytes);
      mem.upload(a.get(), in[ur].data(), in_bytes);
      if (c.in_place) {
        w = comm.all_reduce(a.get(), a.get(), c.count, c.t, c.op);
        result = a.get();
      } else {
        b = mem.allocate(out_bytes);
        poison(comm, b.get(), out_bytes);
        w = comm.all_reduce(a.get(), b.get(), c.count, c.t, c.op);
        result = b.get();
      }
      break;
    case coll::broadcast:
      a = mem.allocate(in_bytes);
      mem.upload(a.get(), in[ur].data(), in_bytes);
      w = comm.broadcast(a.get(), c.count, c.t, c.root);
      result = a.get();
      break;
    case coll::all_gather:
      b = mem.allocate(out_bytes);
      poison(comm, b.get(), out_bytes);
      if (c.in_place) {
        unsigned char* mine = at(b, ur * block);
        mem.upload(mine, in[ur].data(), in_bytes);
        w = comm.all_gather(mine, b.get(), c.count, c.t);
      } else {
        a = mem.allocate(in_bytes);
        mem.upload(a.get(), in[ur].data(), in_bytes);
        w = comm.all_gather(a.get(), b.get(), c.count, c.t);
      }
      result = b.get();
      break;
    case coll::reduce_scatter:
      a = mem.allocate(in_bytes);
      mem.upload(a.get(), in[ur].data(), in_bytes);
      if (c.in_place) {
        unsigned char* mine = at(a, ur * block);
        w = comm.reduce_scatter(a.get(), mine, c.count, c.t, c.op);
        result = mine;
      } else {
        b = mem.allocate(out_bytes);
        poison(comm, b.get(), out_bytes);
        w = comm.reduce_scatter(a.get(), b.get(), c.count, c.t, c.op);
        result = b.get();
      }
      break;
  }
  w.wait();
  out[ur].resize(out_bytes);
  mem.download(out[ur].data(), result, out_bytes);
}

// The collective under test, one thread per GPU. Results are read back on the compute stream
// after work::wait(), so they are only right if wait() orders the compute stream after NCCL.
std::vector<bytes> through_nccl(const spec& c, std::vector<NcclComm>& comms, const std::vector<bytes>& in) {
  const int n = static_cast<int>(comms.size());
  std::vector<bytes> out(static_cast<std::size_t>(n));
  on_ranks(n, [&](int r) {
    try {
      one_rank_through_nccl(c, comms, in, out, r);
    } catch (const std::exception& e) {
      // The other ranks may be blocked on this one inside NCCL: release them, so the test
      // fails now instead of hanging until ctest's timeout.
      const std::string why = "rank " + std::to_string(r) + " failed: " + e.what();
      for (auto& comm : comms) comm.abort(why);
      throw;
    }
  });
  return out;
}

// "" when rank r's result is right, else a description of the first wrong element.
template <class T>
std::string compare_floats(const spec& c, int n, int r, const bytes& got_b, const bytes& want_b,
                           const std::vector<bytes>& in, double tol) {
  const auto* got = reinterpret_cast<const T*>(got_b.data());
  const auto* want = reinterpret_cast<const T*>(want_b.data());
  const std::size_t off = c.kind == coll::reduce_scatter ? static_cast<std::size_t>(r) * c.count : 0;
  for (std::size_t i = 0; i < c.count; ++i) {
    double magnitude = 0;  // sum of |inputs|: bounds the rounding of any summation order
    for (const auto& x : in) magnitude += std::fabs(static_cast<double>(reinterpret_cast<const T*>(x.data())[off + i]));
    if (c.op == reduce_op::avg) magnitude /= n;
    const double g = got[i], w = want[i];
    if (!std::isfinite(g) || std::fabs(g - w) > tol * magnitude + 1e-30) {
      std::ostringstream s;
      s << "element " << i << ": got " << g << ", ThreadComm gives " << w << " (tolerance "
        << tol * magnitude << ")";
      return s.str();
    }
  }
  return {};
}

std::string compare(const spec& c, int n, int r, const bytes& got, const bytes& want, const std::vector<bytes>& in) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + " bytes, expected " + std::to_string(want.size());
  if (c.exact()) {
    if (got.empty() || std::memcmp(got.data(), want.data(), got.size()) == 0) return {};
    const std::size_t es = lockstep::size_of(c.t);
    std::size_t i = 0;
    while (std::memcmp(got.data() + i * es, want.data() + i * es, es) == 0) ++i;
    return "element " + std::to_string(i) + " differs (bitwise) from ThreadComm's" +
           (std::all_of(got.data() + i * es, got.data() + (i + 1) * es, [](unsigned char x) { return x == 0xFF; })
                ? " and still holds the poison: it was never written"
                : "");
  }
  if (c.t == dtype::f32) return compare_floats<float>(c, n, r, got, want, in, 1e-5);
  return compare_floats<double>(c, n, r, got, want, in, 1e-12);
}

void check_every_collective(int n) {
  const std::uint64_t seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  INFO("seed = " << seed << ", ranks = " << n);
  auto comms = NcclComm::create_local(first_devices(n));
  REQUIRE(comms.size() == static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    CHECK(comms[static_cast<std::size_t>(r)].rank() == r);
    CHECK(comms[static_cast<std::size_t>(r)].size() == n);
    CHECK(comms[static_cast<std::size_t>(r)].device() == r);
  }

  const auto cases = all_cases(n);
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const spec& c = cases[k];
    INFO("case " << k << ": " << c.describe());
    std::vector<bytes> in(static_cast<std::size_t>(n));
    on_ranks(n, [&](int r) {
      in[static_cast<std::size_t>(r)] = random_input(c.t, c.in_elems(n), seed + 1000 * k + static_cast<std::uint64_t>(r));
    });
    const auto want = reference(c, n, in);
    const auto got = through_nccl(c, comms, in);
    for (int r = 0; r < n; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      const std::string err = compare(c, n, r, got[ur], want[ur], in);
      CHECK_MESSAGE(err.empty(), "rank " << r << ": " << err);
    }
  }

  // barrier(): nobody leaves before everyone has arrived (rank 0 arrives late on purpose).
  std::atomic<int> arrived{0};
  std::vector<int> early(static_cast<std::size_t>(n), 0);
  on_ranks(n, [&](int r) {
    for (int round = 1; round <= 3; ++round) {
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      arrived.fetch_add(1);
      comms[static_cast<std::size_t>(r)].barrier();
      if (arrived.load() < round * n) early[static_cast<std::size_t>(r)]++;
    }
  });
  for (int r = 0; r < n; ++r) CHECK_MESSAGE(early[static_cast<std::size_t>(r)] == 0, "rank " << r << " left a barrier early");
}

// Spins ~`cycles` GPU clocks, then writes p[i] = i % 4096 + base: a slow producer, so a
// consumer that is not ordered after it reads the old contents.
__global__ void slow_fill(float* p, std::size_t n, float base, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += static_cast<std::size_t>(blockDim.x) * gridDim.x)
    p[i] = static_cast<float>(i % 4096) + base;
}

constexpr long long kSpinCycles = 300'000'000;  // ~0.15-0.2 s on an H100

}  // namespace

// =======================================================================================
TEST_SUITE("gpu") {
  TEST_CASE("to_nccl maps every element type and reduction") {
    CHECK(lockstep::to_nccl(dtype::u8) == ncclUint8);
    CHECK(lockstep::to_nccl(dtype::i32) == ncclInt32);
    CHECK(lockstep::to_nccl(dtype::i64) == ncclInt64);
    CHECK(lockstep::to_nccl(dtype::f16) == ncclFloat16);
    CHECK(lockstep::to_nccl(dtype::bf16) == ncclBfloat16);
    CHECK(lockstep::to_nccl(dtype::f32) == ncclFloat32);
    CHECK(lockstep::to_nccl(dtype::f64) == ncclFloat64);
    CHECK(lockstep::to_nccl(reduce_op::sum) == ncclSum);
    CHECK(lockstep::to_nccl(reduce_op::avg) == ncclAvg);
    CHECK(lockstep::to_nccl(reduce_op::max) == ncclMax);
    CHECK(lockstep::to_nccl(reduce_op::min) == ncclMin);
  }

  TEST_CASE("a failed CUDA call throws cuda_error naming the call and the place") {
    // Fails on every machine: an invalid device without a GPU, no device/driver without one.
    const std::string msg = what_of([] { LOCKSTEP_TRY_CUDA(cudaSetDevice(-1)); });
    CHECK(msg.find("cudaSetDevice(-1) failed at") != std::string::npos);
    CHECK(msg.find("test_nccl_comm.cu:") != std::string::npos);
    CHECK(msg.find("cudaError") != std::string::npos);  // the error's name
    CHECK_THROWS_AS(LOCKSTEP_TRY_CUDA(cudaSetDevice(-1)), lockstep::cuda_error);
    CHECK(lockstep::test::visible_gpus() >= 0);
  }

  TEST_CASE("CudaMemory and kernel launches report CUDA failures as cuda_error") {
    LOCKSTEP_REQUIRE_GPUS(1);
    lockstep::CudaMemory mem(0, nullptr);
    const std::string msg = what_of([&] { (void)mem.allocate(std::size_t{1} << 60); });
    CHECK(msg.find("cudaMalloc") != std::string::npos);
    CHECK(msg.find("cudaErrorMemoryAllocation") != std::string::npos);
    CHECK_THROWS_AS((void)mem.allocate(std::size_t{1} << 60), lockstep::cuda_error);
    // The failure was reported once, not left behind for the next check.
    CHECK(cudaGetLastError() == cudaSuccess);
    auto p = mem.allocate(16);
    CHECK(p != nullptr);

    LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
    slow_fill<<<1, 4096>>>(static_cast<float*>(p.get()), 4, 0.f, 0);  // too many threads per block
    const std::string launch = what_of([] { LOCKSTEP_CHECK_LAUNCH(); });
    INFO("message: " << launch);
    CHECK(launch.find("kernel launch (cudaGetLastError) failed at") != std::string::npos);
    CHECK(launch.find("test_nccl_comm.cu:") != std::string::npos);
    CHECK(launch.find("cudaError") != std::string::npos);
    CHECK(cudaGetLastError() == cudaSuccess);
  }

  TEST_CASE("a failed NCCL call throws nccl_error naming the call") {
    LOCKSTEP_REQUIRE_GPUS(1);
    auto comms = NcclComm::create_local({0});
    auto buf = comms[0].memory().allocate(64);
    auto bad = [&] {  // an element type NCCL does not know: rejected before anything runs
      LOCKSTEP_TRY_NCCL(ncclAllReduce(buf.get(), buf.get(), 1, static_cast<ncclDataType_t>(ncclNumTypes),
                                      ncclSum, comms[0].raw(), comms[0].comm_stream()));
    };
    CHECK_THROWS_AS(bad(), lockstep::nccl_error);
    const std::string msg = what_of(bad);
    CHECK(msg.find("ncclAllReduce(") != std::string::npos);
    CHECK(msg.find("ncclInvalidArgument") != std::string::npos);
    CHECK(msg.find("test_nccl_comm.cu:") != std::string::npos);
    CHECK_NOTHROW(comms[0].check_async_error());
  }

  TEST_CASE("NcclComm rejects bad arguments with config_error") {
    LOCKSTEP_REQUIRE_GPUS(1);
    const int visible = lockstep::test::visible_gpus();
    CHECK_THROWS_AS(NcclComm::create_local(std::span<const int>{}), lockstep::config_error);
    const std::string missing = what_of([&] { (void)NcclComm::create_local({visible}); });
    CHECK(missing.find("does not exist") != std::string::npos);
    CHECK_THROWS_AS(NcclComm::create_local({0, visible + 3}), lockstep::config_error);
    CHECK_THROWS_AS(NcclComm::create_local({-1}), lockstep::config_error);
    CHECK(what_of([] { (void)NcclComm::create_local({0, 0}); }).find("twice") != std::string::npos);
    ncclUniqueId id{};
    CHECK_THROWS_AS(NcclComm(id, 2, 2, 0), lockstep::config_error);
    CHECK_THROWS_AS(NcclComm(id, 0, 1, visible), lockstep::config_error);

    auto comms = NcclComm::create_local({0});
    auto buf = comms[0].memory().allocate(16);
    CHECK_THROWS_AS(comms[0].broadcast(buf.get(), 1, dtype::f32, 1), lockstep::config_error);
    CHECK_THROWS_AS(comms[0].broadcast(buf.get(), 1, dtype::f32, -1), lockstep::config_error);
    CHECK_THROWS_AS(comms[0].all_reduce(nullptr, buf.get(), 1, dtype::f32, reduce_op::sum), lockstep::config_error);

    NcclComm moved = std::move(comms[0]);
    CHECK(moved.rank() == 0);
    CHECK_THROWS_AS(comms[0].all_reduce(buf.get(), buf.get(), 1, dtype::f32, reduce_op::sum), lockstep::config_error);
  }

  TEST_CASE("NcclComm: collectives wait for the compute stream and work handles order or block on the result") {
    LOCKSTEP_REQUIRE_GPUS(1);
    auto comms = NcclComm::create_local({0});
    NcclComm& comm = comms[0];
    LOCKSTEP_TRY_CUDA(cudaSetDevice(0));
    cudaStream_t user = nullptr;
    LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking));
    comm.set_compute_stream(user);
    CHECK(comm.compute_stream() == user);
    CHECK(comm.memory().stream() == user);
    CHECK(comm.comm_stream() != user);

    const std::size_t n = std::size_t{1} << 20;
    auto mem = comm.memory();
    auto src = mem.allocate(n * sizeof(float));
    auto dst = mem.allocate(n * sizeof(float));
    poison(comm, src.get(), n * sizeof(float));
    poison(comm, dst.get(), n * sizeof(float));
    const float base = static_cast<float>(std::random_device{}() % 1000) + 1.f;
    INFO("base = " << base);
    slow_fill<<<64, 256, 0, user>>>(static_cast<float*>(src.get()), n, base, kSpinCycles);
    LOCKSTEP_CHECK_LAUNCH();
    NcclComm::work w = comm.all_reduce(src.get(), dst.get(), n, dtype::f32, reduce_op::sum);
    // The collective waits behind the slow producer, so it cannot have finished yet.
    CHECK_FALSE(w.query());
    NcclComm::work moved = std::move(w);
    CHECK(w.query());  // a moved-from handle is empty, hence complete
    moved.synchronize();
    CHECK(moved.query());
    moved.wait();
    std::vector<float> out(n);
    mem.download(out.data(), dst.get(), n * sizeof(float));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (out[i] != static_cast<float>(i % 4096) + base) ++wrong;
    CHECK_MESSAGE(wrong == 0, wrong << " of " << n << " elements do not hold the producer's values");

    NcclComm::work empty;
    CHECK(empty.query());
    empty.wait();
    empty.synchronize();
    CHECK(comm.all_reduce(nullptr, nullptr, 0, dtype::f32, reduce_op::sum).query());  // zero length

    comm.set_compute_stream(nullptr);  // before `user` goes away
    LOCKSTEP_TRY_CUDA(cudaStreamDestroy(user));
  }

  TEST_CASE("NcclComm: abort() stops the communicator and later calls say why") {
    LOCKSTEP_REQUIRE_GPUS(1);
    auto comms = NcclComm::create_local({0});
    auto buf = comms[0].memory().allocate(16);
    comms[0].barrier();
    CHECK_FALSE(comms[0].aborted());
    comms[0].abort("test-requested abort");
    comms[0].abort("second call is a no-op");
    CHECK(comms[0].aborted());
    CHECK_THROWS_AS(comms[0].all_reduce(buf.get(), buf.get(), 1, dtype::f32, reduce_op::sum), lockstep::aborted_error);
    CHECK(what_of([&] { comms[0].barrier(); }).find("test-requested abort") != std::string::npos);
  }

  TEST_CASE("NcclComm on 1 GPU: every collective matches ThreadComm") {
    LOCKSTEP_REQUIRE_GPUS(1);
    check_every_collective(1);
  }
}

TEST_SUITE("multigpu") {
  TEST_CASE("NcclComm on 2 GPUs: every collective matches ThreadComm") {
    LOCKSTEP_REQUIRE_GPUS(2);
    check_every_collective(2);
  }

  TEST_CASE("NcclComm with LOCKSTEP_DEBUG=1 names a collective that differs across GPUs on every rank") {
    LOCKSTEP_REQUIRE_GPUS(2);
    ::setenv("LOCKSTEP_DEBUG", "1", 1);
    auto comms = NcclComm::create_local(first_devices(2));
    ::unsetenv("LOCKSTEP_DEBUG");
    std::vector<std::string> msgs(2);
    on_ranks(2, [&](int r) {
      auto& c = comms[static_cast<std::size_t>(r)];
      auto buf = c.memory().allocate(16 * sizeof(float));
      // Matching calls pass (and keep the sequence numbers in step).
      c.all_reduce(buf.get(), buf.get(), 16, dtype::f32, reduce_op::sum).synchronize();
      c.barrier();
      // Rank 1 reduces one element fewer: both ranks must fail, naming both calls.
      try {
        c.all_reduce(buf.get(), buf.get(), r == 0 ? 16 : 15, dtype::f32, reduce_op::sum).synchronize();
      } catch (const lockstep::mismatch_error& e) {
        msgs[static_cast<std::size_t>(r)] = e.what();
      }
    });
    for (const auto& m : msgs) {
      CAPTURE(m);
      CHECK(m.find("rank 0 called all_reduce #2 of 16 f32 (sum)") != std::string::npos);
      CHECK(m.find("rank 1 called all_reduce #2 of 15 f32 (sum)") != std::string::npos);
    }
  }

  TEST_CASE("NcclComm: overdue() names a collective a peer never issued and abort() releases its waiter") {
    LOCKSTEP_REQUIRE_GPUS(2);
    using namespace std::chrono_literals;
    auto comms = NcclComm::create_local(first_devices(2));
    for (auto& c : comms) c.track_collectives();
    std::random_device rd;
    const std::size_t n = 1 + rd() % 100000;
    CAPTURE(n);
    // Matched collectives complete: nothing is overdue, even with a zero limit.
    on_ranks(2, [&](int r) {
      auto& c = comms[static_cast<std::size_t>(r)];
      auto buf = c.memory().allocate(n * sizeof(float));
      c.all_reduce(buf.get(), buf.get(), n, dtype::f32, reduce_op::sum).synchronize();
    });
    CHECK_FALSE(comms[0].overdue(0ms).has_value());
    CHECK_FALSE(comms[1].overdue(0ms).has_value());
    // Rank 0 issues a second all_reduce that rank 1 never joins.
    auto buf0 = comms[0].memory().allocate(n * sizeof(float));
    auto w = comms[0].all_reduce(buf0.get(), buf0.get(), n, dtype::f32, reduce_op::sum);
    std::this_thread::sleep_for(400ms);
    CHECK_FALSE(w.query());
    CHECK_FALSE(comms[0].overdue(30s).has_value());  // not yet past a long limit
    const auto why = comms[0].overdue(300ms);
    REQUIRE(why.has_value());
    CAPTURE(*why);
    CHECK(why->find("rank 0: all_reduce #1 of " + std::to_string(n) + " f32 has not completed") != std::string::npos);
    CHECK_FALSE(comms[1].overdue(0ms).has_value());
    // A thread blocked on it (as a training loop would be) is released by abort().
    std::atomic<bool> released{false};
    std::thread waiter([&] {
      try {
        w.synchronize();
      } catch (const std::exception&) {
      }
      released = true;
    });
    comms[0].abort(*why);
    comms[1].abort("test: the peer of an aborted rank");
    for (int i = 0; i < 2000 && !released; ++i) std::this_thread::sleep_for(10ms);
    CHECK(released.load());
    waiter.join();
    CHECK(what_of([&] { comms[0].barrier(); }).find("has not completed") != std::string::npos);
  }

  TEST_CASE("NcclComm on all visible GPUs: every collective matches ThreadComm") {
    LOCKSTEP_REQUIRE_GPUS(3);  // with 2 visible, the 2-GPU test already covers it
    check_every_collective(lockstep::test::visible_gpus());
  }
}
