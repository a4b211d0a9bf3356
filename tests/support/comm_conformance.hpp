#pragma once
// The communicator conformance suite: one test body, written once against the
// lockstep::communicator concept, that every communicator's test file runs on its own ranks
// (Kokkos' "one test body per backend"). See docs/communicator.md.
//
// A body runs on one rank (a thread, a process, a GPU's host thread) and checks that rank's
// results against a reference it computes itself: element i of rank r's input is a hash of
// (seed, case, r, i), so every rank can generate every rank's input and needs nothing from the
// communicator under test to know the right answer. Buffers are touched only through
// comm.memory() (allocate, upload, download, zero), so the same body runs on host and device
// memory. Every rank must run the same bodies with the same options (the seed included):
// the bodies issue the same collectives on every rank.
//
// What a backend's test file supplies: how its N ranks start, a conformance_options (the seed,
// shared by all ranks; its element types; whether sums follow rank order), and on each rank
//   check_collectives(comm, o)               every collective, type, count, op and placement
//   check_order(comm, o)                     on a fresh communicator with its order check on
//   check_order_barrier(comm, o)             idem: a barrier against another collective
//   check_timeout(comm, o, absent, timeout)  on one created with a short timeout
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iomanip>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <lockstep/comm/collective.hpp>
#include <lockstep/core/concepts.hpp>
#include <lockstep/core/dtype.hpp>
#include <lockstep/core/error.hpp>
#include <lockstep/core/reduce_op.hpp>

namespace lockstep_test {

//! What a backend's test file says about its communicator. Identical on every rank.
struct conformance_options {
  //! Fresh per run (lockstep_test::fresh_seed(); MPI: rank 0's, broadcast), the same on every
  //! rank. Each body INFOs it; LOCKSTEP_TEST_SEED=<seed> replays a failure.
  std::uint64_t seed = 0;
  //! Element types the communicator reduces and moves.
  std::vector<lockstep::dtype> types = {lockstep::dtype::u8, lockstep::dtype::i32, lockstep::dtype::i64,
                                        lockstep::dtype::f32, lockstep::dtype::f64};
  //! Element types whose reductions must throw config_error (no arithmetic for them).
  std::vector<lockstep::dtype> unsupported = {lockstep::dtype::f16, lockstep::dtype::bf16};
  //! Counts run for every type: none, one, odd ones, one past a power-of-two-ish boundary.
  std::vector<std::size_t> counts = {0, 1, 3, 17, 4099};
  //! Counts run for large_types only (all_gather / reduce_scatter: about count / size() per rank).
  std::vector<std::size_t> large_counts = {1000003};
  std::vector<lockstep::dtype> large_types = {lockstep::dtype::i32, lockstep::dtype::f32};
  //! Sums (and averages) are computed in T in rank order 0..N−1, as the reference does
  //! (ThreadComm): float results are then compared bit for bit. Otherwise (MPI, NCCL: no
  //! promised order) within (N+1)·ε(T) of the sum of magnitudes.
  bool rank_order_sums = false;
  //! Every rank's all_reduce result holds the same bits (checked through an all_gather).
  bool identical_results = true;
  //! Ranks share a steady clock (one host): the barrier check compares times across ranks.
  bool shared_clock = true;
};

//! What ThreadComm (and each group split from one) promises: every element type — u8, i32,
//! i64, f32 and f64 reduced in the type itself in rank order (float sums compared bit for bit),
//! f16 and bf16 in float, rounded once (judged by the suite's tolerance for halves).
inline conformance_options thread_comm_options(std::uint64_t seed) {
  conformance_options o;
  o.seed = seed;
  o.types = {lockstep::dtype::u8,   lockstep::dtype::i32, lockstep::dtype::i64, lockstep::dtype::f16,
             lockstep::dtype::bf16, lockstep::dtype::f32, lockstep::dtype::f64};
  o.unsupported = {};
  o.rank_order_sums = true;
  return o;
}

namespace conformance_detail {

using lockstep::dtype;
using lockstep::reduce_op;
using bytes = std::vector<unsigned char>;

inline constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min};

inline std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

//! The per-(case, rank) start of the input stream; element i's hash is element_hash(base, i).
inline std::uint64_t rank_base(std::uint64_t seed, std::uint64_t salt, int rank) {
  return splitmix(seed ^ splitmix(salt * 0x2545f4914f6cdd1dull + static_cast<std::uint64_t>(rank)));
}
inline std::uint64_t element_hash(std::uint64_t base, std::size_t i) {
  return splitmix(base ^ (static_cast<std::uint64_t>(i) * 0x9e3779b97f4a7c15ull));
}

//! A case's identity, so that every case draws different inputs.
inline std::uint64_t case_salt(lockstep::collective_kind k, dtype t, std::size_t count, reduce_op op, int variant) {
  std::uint64_t s = splitmix(static_cast<std::uint64_t>(k) + 1);
  for (std::uint64_t f : {static_cast<std::uint64_t>(t), static_cast<std::uint64_t>(count),
                          static_cast<std::uint64_t>(op), static_cast<std::uint64_t>(variant)})
    s = splitmix(s ^ f);
  return s;
}

// ---------------------------------------------------------------------------------------
// Element types on the host: how inputs are drawn and how results are judged.
enum class elem_kind { integer, floating, half };

template <dtype D>
struct elem;
template <>
struct elem<dtype::u8> {
  using type = std::uint8_t;
  static constexpr elem_kind kind = elem_kind::integer;
  static type make(std::uint64_t h) { return static_cast<type>(h >> 56); }  // full range: sums wrap
};
template <>
struct elem<dtype::i32> {
  using type = std::int32_t;
  static constexpr elem_kind kind = elem_kind::integer;
  // |x| ≤ 10^6, signed: sums of thousands of ranks stay far from overflow.
  static type make(std::uint64_t h) { return static_cast<type>(static_cast<std::int64_t>(h % 2000001) - 1000000); }
};
template <>
struct elem<dtype::i64> {
  using type = std::int64_t;
  static constexpr elem_kind kind = elem_kind::integer;
  static type make(std::uint64_t h) {
    return static_cast<type>(h % 2000000000001ull) - 1000000000000ll;  // beyond 32 bits
  }
};
template <>
struct elem<dtype::f32> {
  using type = float;
  static constexpr elem_kind kind = elem_kind::floating;
  static type make(std::uint64_t h) { return static_cast<float>(static_cast<double>(h >> 40) * 0x1p-23 - 1.0); }
  static double to_double(type x) { return x; }
  static constexpr double epsilon = 0x1p-23;
};
template <>
struct elem<dtype::f64> {
  using type = double;
  static constexpr elem_kind kind = elem_kind::floating;
  static type make(std::uint64_t h) { return static_cast<double>(h >> 11) * 0x1p-52 - 1.0; }
  static double to_double(type x) { return x; }
  static constexpr double epsilon = 0x1p-52;
};
// Halves are raw bits on the host (no host arithmetic); inputs are normal numbers of magnitude
// [0.25, 2), so results never leave the type's range.
template <>
struct elem<dtype::f16> {
  using type = std::uint16_t;
  static constexpr elem_kind kind = elem_kind::half;
  static type make(std::uint64_t h) {
    return static_cast<type>(((h & 1) << 15) | ((13 + (h >> 1) % 3) << 10) | ((h >> 8) & 0x3ff));
  }
  static double to_double(type b) {
    const int e = (b >> 10) & 0x1f, m = b & 0x3ff;
    const double v = e == 0 ? std::ldexp(m, -24)
                     : e == 31
                         ? (m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity())
                         : std::ldexp(1024 + m, e - 25);
    return (b & 0x8000) ? -v : v;
  }
  static constexpr double epsilon = 0x1p-10;
};
template <>
struct elem<dtype::bf16> {
  using type = std::uint16_t;
  static constexpr elem_kind kind = elem_kind::half;
  static type make(std::uint64_t h) {
    return static_cast<type>(((h & 1) << 15) | ((125 + (h >> 1) % 3) << 7) | ((h >> 8) & 0x7f));
  }
  static double to_double(type b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }
  static constexpr double epsilon = 0x1p-7;
};

//! Calls f(elem<D>{}) for the run-time type t.
template <class F>
decltype(auto) with_elem(dtype t, F&& f) {
  switch (t) {
    case dtype::u8: return f(elem<dtype::u8>{});
    case dtype::i32: return f(elem<dtype::i32>{});
    case dtype::i64: return f(elem<dtype::i64>{});
    case dtype::f16: return f(elem<dtype::f16>{});
    case dtype::bf16: return f(elem<dtype::bf16>{});
    case dtype::f32: return f(elem<dtype::f32>{});
    case dtype::f64: return f(elem<dtype::f64>{});
  }
  throw std::logic_error("conformance: unknown dtype");
}

template <class E>
std::string show(typename E::type x) {
  std::ostringstream s;
  if constexpr (E::kind == elem_kind::integer) {
    s << static_cast<long long>(x);
  } else {
    s << std::setprecision(17) << E::to_double(x);
    if constexpr (E::kind == elem_kind::half) s << " (bits 0x" << std::hex << x << ")";
  }
  return s.str();
}

inline std::string number(double x) {
  std::ostringstream s;
  s << std::setprecision(17) << x;
  return s.str();
}

//! Element i of a byte buffer (memcpy: the bytes hold no T object).
template <class T>
T at(const void* p, std::size_t i) {
  T x;
  std::memcpy(&x, static_cast<const unsigned char*>(p) + i * sizeof(T), sizeof(T));
  return x;
}

//! Judges `count` elements: ok(i, nullptr) says whether element i is right; ok(i, &why) also
//! says what is wrong with it (asked for the first wrong element only: strings are slow).
template <class Ok>
std::string judge(std::size_t count, Ok&& ok) {
  std::size_t wrong = 0;
  std::string first;
  for (std::size_t i = 0; i < count; ++i) {
    if (ok(i, nullptr)) continue;
    if (wrong++ == 0) {
      ok(i, &first);
      first = "element " + std::to_string(i) + ": " + first;
    }
  }
  if (wrong == 0) return {};
  return std::to_string(wrong) + " of " + std::to_string(count) + " elements wrong; first: " + first;
}

}  // namespace conformance_detail

// ---------------------------------------------------------------------------------------
// The reference. Public so a backend's own tests (other placements, work handles) can use it.

//! Rank `rank`'s input elements [first, first + count) for case `salt`, as bytes.
inline std::vector<unsigned char> conformance_input(lockstep::dtype t, std::uint64_t seed, std::uint64_t salt, int rank,
                                                    std::size_t first, std::size_t count) {
  using namespace conformance_detail;
  return with_elem(t, [&]<class E>(E) {
    using T = typename E::type;
    bytes out(count * sizeof(T));
    const std::uint64_t base = rank_base(seed, salt, rank);
    for (std::size_t i = 0; i < count; ++i) {
      const T x = E::make(element_hash(base, first + i));
      std::memcpy(out.data() + i * sizeof(T), &x, sizeof(T));
    }
    return out;
  });
}

//! "" if `got` (count elements of t, host memory) is rank `rank`'s input [first, first + count)
//! bit for bit, else what differs.
inline std::string conformance_compare_input(lockstep::dtype t, const void* got, std::size_t count, std::uint64_t seed,
                                             std::uint64_t salt, int rank, std::size_t first) {
  using namespace conformance_detail;
  return with_elem(t, [&]<class E>(E) {
    using T = typename E::type;
    const std::uint64_t base = rank_base(seed, salt, rank);
    return judge(count, [&](std::size_t i, std::string* why) {
      const T want = E::make(element_hash(base, first + i));
      const T g = at<T>(got, i);
      if (std::memcmp(&g, &want, sizeof(T)) == 0) return true;
      if (why) *why = "got " + show<E>(g) + ", expected rank " + std::to_string(rank) + "'s " + show<E>(want);
      return false;
    });
  });
}

//! "" if `got` (count elements of t, host memory) is `op` over ranks 0..ranks−1 of their inputs
//! [first, first + count), else what differs. Integers: exact (sums wrap as T; avg = the sum
//! divided by N, truncating). max/min: exact. Float sums: bit for bit when rank_order_sums
//! (summed in T in rank order, avg = sum / T(N)), else within (N+1)·ε(T)·Σ|x| (÷N for avg).
inline std::string conformance_compare_reduced(lockstep::dtype t, const void* got, std::size_t count,
                                               std::uint64_t seed, std::uint64_t salt, int ranks, std::size_t first,
                                               lockstep::reduce_op op, bool rank_order_sums) {
  using namespace conformance_detail;
  std::vector<std::uint64_t> base;
  for (int q = 0; q < ranks; ++q) base.push_back(rank_base(seed, salt, q));
  const auto n = static_cast<std::size_t>(ranks);
  return with_elem(t, [&]<class E>(E) {
    using T = typename E::type;
    std::vector<T> x(n);
    return judge(count, [&](std::size_t i, std::string* why) {
      for (std::size_t q = 0; q < n; ++q) x[q] = E::make(element_hash(base[q], first + i));
      const T g = at<T>(got, i);
      std::string expected;  // filled only for `why`: formatting is slow
      if constexpr (E::kind == elem_kind::integer) {
        T acc = x[0];
        for (std::size_t q = 1; q < n; ++q)
          acc = op == reduce_op::max   ? std::max(acc, x[q])
                : op == reduce_op::min ? std::min(acc, x[q])
                                       : static_cast<T>(acc + x[q]);
        if (op == reduce_op::avg) acc = static_cast<T>(static_cast<std::int64_t>(acc) / static_cast<std::int64_t>(n));
        if (g == acc) return true;
        if (why) expected = show<E>(acc);
      } else {
        bool done = false;
        if (op == reduce_op::max || op == reduce_op::min) {
          // Exact whatever the order; halves compare by value (their decode is exact).
          double want = E::to_double(x[0]);
          for (std::size_t q = 1; q < n; ++q)
            want = op == reduce_op::max ? std::max(want, E::to_double(x[q])) : std::min(want, E::to_double(x[q]));
          if (E::to_double(g) == want) return true;
          if (why) expected = number(want);
          done = true;
        }
        if constexpr (E::kind == elem_kind::floating) {
          if (!done && rank_order_sums) {
            T acc = x[0];
            for (std::size_t q = 1; q < n; ++q) acc = static_cast<T>(acc + x[q]);
            if (op == reduce_op::avg) acc = static_cast<T>(acc / static_cast<T>(n));
            if (g == acc) return true;
            if (why) expected = show<E>(acc) + " (the rank-order sum, bit for bit)";
            done = true;
          }
        }
        if (!done) {
          // Any summation order in T is off by at most (N−1)·u·Σ|x| (u = ε/2), an average
          // premultiplied by 1/N by (N+1)·u·Σ|x|/N; the tolerance allows twice that, which
          // also covers this reference's own rounding in double.
          double sum = 0, magnitude = 0;
          for (std::size_t q = 0; q < n; ++q) {
            const double v = E::to_double(x[q]);
            sum += v;
            magnitude += std::fabs(v);
          }
          if (op == reduce_op::avg) sum /= static_cast<double>(n), magnitude /= static_cast<double>(n);
          const double tol = static_cast<double>(n + 1) * E::epsilon * magnitude;
          const double err = std::fabs(E::to_double(g) - sum);
          if (err <= tol) return true;  // NaN fails too
          if (why) expected = number(sum) + " within " + number(tol) + " (off by " + number(err) + ")";
        }
      }
      if (why) *why = "got " + show<E>(g) + ", expected " + expected;
      return false;
    });
  });
}

// ---------------------------------------------------------------------------------------
namespace conformance_detail {

//! Host bytes into new memory of the communicator's space, and back.
template <class Mem>
std::shared_ptr<void> to_memory(const Mem& mem, const bytes& host) {
  auto p = mem.allocate(host.size());
  if (!host.empty()) mem.upload(p.get(), host.data(), host.size());
  return p;
}
template <class Mem>
bytes from_memory(const Mem& mem, const void* p, std::size_t n) {
  bytes out(n);
  if (n) mem.download(out.data(), p, n);
  return out;
}
//! All bits set: NaN for floats, −1 for signed integers, 255 for u8. An element the collective
//! never wrote keeps it and fails its comparison.
inline bytes poison(std::size_t n) { return bytes(n, 0xFF); }

inline unsigned char* offset(const std::shared_ptr<void>& p, std::size_t byte_offset) {
  return static_cast<unsigned char*>(p.get()) + byte_offset;
}

template <class T, class Comm>
std::vector<T> host_all_gather(Comm& comm, T mine) {
  auto mem = comm.memory();
  const auto n = static_cast<std::size_t>(comm.size());
  auto send = mem.allocate(sizeof(T));
  auto recv = mem.allocate(sizeof(T) * n);
  mem.upload(send.get(), &mine, sizeof(T));
  comm.all_gather(send.get(), recv.get(), 1, lockstep::dtype_of<T>).wait();
  std::vector<T> all(n);
  mem.download(all.data(), recv.get(), sizeof(T) * n);
  return all;
}

//! Whether every rank holds the same bytes (an all_gather of their hashes).
template <class Comm>
bool same_on_every_rank(Comm& comm, const bytes& b) {
  // Eight bytes at a time: this hashes every all_reduce result (megabytes).
  std::uint64_t h = splitmix(b.size());
  std::size_t i = 0;
  for (; i + 8 <= b.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, b.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ull + (h >> 29);
  }
  for (; i < b.size(); ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  const auto all = host_all_gather<std::int64_t>(comm, static_cast<std::int64_t>(h));
  return std::all_of(all.begin(), all.end(), [&](std::int64_t x) { return x == all[0]; });
}

inline bool contains(const std::vector<dtype>& v, dtype t) { return std::find(v.begin(), v.end(), t) != v.end(); }

//! The counts run for type t; `per_rank_block`: all_gather / reduce_scatter move size()·count
//! elements, so a large count becomes about count / ranks per rank (kept odd).
inline std::vector<std::size_t> counts_for(const conformance_options& o, dtype t, int ranks, bool per_rank_block) {
  std::vector<std::size_t> c = o.counts;
  if (contains(o.large_types, t))
    for (std::size_t large : o.large_counts)
      c.push_back(per_rank_block ? std::max<std::size_t>(1, large / static_cast<std::size_t>(ranks)) | 1 : large);
  return c;
}

inline std::string describe(const char* what, dtype t, std::size_t count, const char* op, const std::string& how,
                            int rank, int ranks) {
  std::string s = std::string(what) + " of " + std::to_string(count) + " " + lockstep::name_of(t);
  if (op) s += std::string(" (") + op + ")";
  return s + ", " + how + ", on rank " + std::to_string(rank) + " of " + std::to_string(ranks);
}

}  // namespace conformance_detail

#define LOCKSTEP_CONFORMANCE_INFO(comm, o)                                                             \
  INFO("conformance seed " << (o).seed << " (LOCKSTEP_TEST_SEED=" << (o).seed << " replays it), rank " \
                           << (comm).rank() << " of " << (comm).size())

// ---------------------------------------------------------------------------------------
// One case of each collective (public: a backend may add a case of its own, e.g. a huge count).

//! all_reduce of `count` elements; in place: send == recv.
template <class Comm>
void check_all_reduce_case(Comm& comm, const conformance_options& o, lockstep::dtype t, std::size_t count,
                           lockstep::reduce_op op, bool in_place) {
  using namespace conformance_detail;
  const int n = comm.size(), me = comm.rank();
  const auto mem = comm.memory();
  const std::size_t nbytes = count * lockstep::size_of(t);
  const std::uint64_t salt = case_salt(lockstep::collective_kind::all_reduce, t, count, op, in_place);
  const bytes mine = conformance_input(t, o.seed, salt, me, 0, count);
  const auto send = to_memory(mem, mine);
  const auto recv = in_place ? send : to_memory(mem, poison(nbytes));
  comm.all_reduce(send.get(), recv.get(), count, t, op).wait();
  const bytes got = from_memory(mem, recv.get(), nbytes);
  const std::string what =
      describe("all_reduce", t, count, lockstep::name_of(op), in_place ? "in place" : "out of place", me, n);
  const std::string bad = conformance_compare_reduced(t, got.data(), count, o.seed, salt, n, 0, op, o.rank_order_sums);
  CHECK_MESSAGE(bad.empty(), what << ": " << bad);
  if (!in_place) CHECK_MESSAGE(from_memory(mem, send.get(), nbytes) == mine, what << ": the send buffer changed");
  if (o.identical_results) CHECK_MESSAGE(same_on_every_rank(comm, got), what << ": the ranks' results differ");
}

//! broadcast of `count` elements from `root` (in place: the only form).
template <class Comm>
void check_broadcast_case(Comm& comm, const conformance_options& o, lockstep::dtype t, std::size_t count, int root) {
  using namespace conformance_detail;
  const int n = comm.size(), me = comm.rank();
  const auto mem = comm.memory();
  const std::size_t nbytes = count * lockstep::size_of(t);
  const std::uint64_t salt = case_salt(lockstep::collective_kind::broadcast, t, count, reduce_op::sum, root);
  const auto buf = to_memory(mem, conformance_input(t, o.seed, salt, me, 0, count));
  comm.broadcast(buf.get(), count, t, root).wait();
  const bytes got = from_memory(mem, buf.get(), nbytes);
  const std::string bad = conformance_compare_input(t, got.data(), count, o.seed, salt, root, 0);
  CHECK_MESSAGE(bad.empty(), describe("broadcast", t, count, nullptr, "from root " + std::to_string(root), me, n)
                                 << ": " << bad);
}

//! all_gather of `count` elements per rank; in place: send == recv + rank·count.
template <class Comm>
void check_all_gather_case(Comm& comm, const conformance_options& o, lockstep::dtype t, std::size_t count,
                           bool in_place) {
  using namespace conformance_detail;
  const int n = comm.size(), me = comm.rank();
  const auto mem = comm.memory();
  const std::size_t es = lockstep::size_of(t), block = count * es;
  const std::uint64_t salt = case_salt(lockstep::collective_kind::all_gather, t, count, reduce_op::sum, in_place);
  const bytes mine = conformance_input(t, o.seed, salt, me, 0, count);
  const auto recv = to_memory(mem, poison(block * static_cast<std::size_t>(n)));
  std::shared_ptr<void> send;
  const void* from = nullptr;
  if (in_place) {
    if (block) mem.upload(offset(recv, static_cast<std::size_t>(me) * block), mine.data(), block);
    from = offset(recv, static_cast<std::size_t>(me) * block);
  } else {
    send = to_memory(mem, mine);
    from = send.get();
  }
  comm.all_gather(from, recv.get(), count, t).wait();
  const bytes got = from_memory(mem, recv.get(), block * static_cast<std::size_t>(n));
  const std::string what = describe("all_gather", t, count, nullptr, in_place ? "in place" : "out of place", me, n);
  for (int q = 0; q < n; ++q) {
    const std::string bad =
        conformance_compare_input(t, got.data() + static_cast<std::size_t>(q) * block, count, o.seed, salt, q, 0);
    CHECK_MESSAGE(bad.empty(), what << ", block of rank " << q << ": " << bad);
  }
  if (!in_place) CHECK_MESSAGE(from_memory(mem, send.get(), block) == mine, what << ": the send buffer changed");
}

//! reduce_scatter of `count` elements per rank; in place: recv == send + rank·count.
template <class Comm>
void check_reduce_scatter_case(Comm& comm, const conformance_options& o, lockstep::dtype t, std::size_t count,
                               lockstep::reduce_op op, bool in_place) {
  using namespace conformance_detail;
  const int n = comm.size(), me = comm.rank();
  const auto mem = comm.memory();
  const std::size_t es = lockstep::size_of(t), block = count * es;
  const std::size_t first = static_cast<std::size_t>(me) * count;
  const std::uint64_t salt = case_salt(lockstep::collective_kind::reduce_scatter, t, count, op, in_place);
  const bytes mine = conformance_input(t, o.seed, salt, me, 0, count * static_cast<std::size_t>(n));
  const auto send = to_memory(mem, mine);
  std::shared_ptr<void> out;
  void* into = nullptr;
  if (in_place) {
    into = offset(send, first * es);
  } else {
    out = to_memory(mem, poison(block));
    into = out.get();
  }
  comm.reduce_scatter(send.get(), into, count, t, op).wait();
  const bytes got = from_memory(mem, into, block);
  const std::string what =
      describe("reduce_scatter", t, count, lockstep::name_of(op), in_place ? "in place" : "out of place", me, n);
  const std::string bad =
      conformance_compare_reduced(t, got.data(), count, o.seed, salt, n, first, op, o.rank_order_sums);
  CHECK_MESSAGE(bad.empty(), what << ": " << bad);
  if (!in_place) CHECK_MESSAGE(from_memory(mem, send.get(), mine.size()) == mine, what << ": the send buffer changed");
}

// ---------------------------------------------------------------------------------------
// The collectives, over every type, count, op, root and placement of the options.

template <class Comm>
void check_all_reduce(Comm& comm, const conformance_options& o) {
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  for (auto t : o.types)
    for (auto count : conformance_detail::counts_for(o, t, comm.size(), false))
      for (auto op : conformance_detail::all_ops)
        for (bool in_place : {false, true}) check_all_reduce_case(comm, o, t, count, op, in_place);
}

template <class Comm>
void check_broadcast(Comm& comm, const conformance_options& o) {
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  for (auto t : o.types)
    for (auto count : conformance_detail::counts_for(o, t, comm.size(), false))
      for (int root = 0; root < comm.size(); ++root) check_broadcast_case(comm, o, t, count, root);
}

template <class Comm>
void check_all_gather(Comm& comm, const conformance_options& o) {
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  for (auto t : o.types)
    for (auto count : conformance_detail::counts_for(o, t, comm.size(), true))
      for (bool in_place : {false, true}) check_all_gather_case(comm, o, t, count, in_place);
}

template <class Comm>
void check_reduce_scatter(Comm& comm, const conformance_options& o) {
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  for (auto t : o.types)
    for (auto count : conformance_detail::counts_for(o, t, comm.size(), true))
      for (auto op : conformance_detail::all_ops)
        for (bool in_place : {false, true}) check_reduce_scatter_case(comm, o, t, count, op, in_place);
}

//! memory(): allocate gives zeroed memory, upload/download round-trip, zero clears a range.
template <class Comm>
void check_memory(Comm& comm, const conformance_options& o) {
  using namespace conformance_detail;
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  const auto mem = comm.memory();
  constexpr std::size_t n = 1001;
  auto p = mem.allocate(n);
  CHECK_MESSAGE(p != nullptr, "memory().allocate returned null");
  CHECK_MESSAGE(from_memory(mem, p.get(), n) == bytes(n, 0), "memory().allocate: not zero-initialised");
  bytes pattern = conformance_input(dtype::u8, o.seed, 1, comm.rank(), 0, n);
  for (auto& b : pattern) b |= 1;  // no zero byte: the zero() below must show
  mem.upload(p.get(), pattern.data(), n);
  CHECK_MESSAGE(from_memory(mem, p.get(), n) == pattern, "memory(): upload then download differs");
  mem.zero(offset(p, 1), n - 2);
  bytes want(n, 0);
  want.front() = pattern.front();
  want.back() = pattern.back();
  CHECK_MESSAGE(from_memory(mem, p.get(), n) == want, "memory().zero(p + 1, n - 2) did not clear exactly that range");
}

//! rank() and size(): ranks 0..N−1, each once, and the same size everywhere.
template <class Comm>
void check_ranks(Comm& comm, const conformance_options& o) {
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  const int n = comm.size(), me = comm.rank();
  CHECK(n >= 1);
  CHECK(me >= 0);
  CHECK(me < n);
  const auto ranks = conformance_detail::host_all_gather<std::int32_t>(comm, me);
  const auto sizes = conformance_detail::host_all_gather<std::int32_t>(comm, n);
  for (int q = 0; q < n; ++q) {
    CHECK_MESSAGE(ranks[static_cast<std::size_t>(q)] == q,
                  "block " << q << " of an all_gather of rank() holds " << ranks[static_cast<std::size_t>(q)]);
    CHECK(sizes[static_cast<std::size_t>(q)] == n);
  }
}

//! barrier(): no rank leaves before the last one arrived. One rank arrives late on purpose;
//! the ranks then compare their leaving times with its arrival (needs o.shared_clock).
template <class Comm>
void check_barrier(Comm& comm, const conformance_options& o) {
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  using clock = std::chrono::steady_clock;
  const int n = comm.size(), me = comm.rank();
  comm.barrier();
  if (!o.shared_clock) return;
  const auto ns = [](clock::time_point t) {
    return static_cast<std::int64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
  };
  std::vector<int> late_ranks{0};
  if (n > 1) late_ranks.push_back(n - 1);
  for (int late : late_ranks) {
    if (me == late) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    const auto arrived = clock::now();
    comm.barrier();
    const auto left = clock::now();
    const auto when = conformance_detail::host_all_gather<std::int64_t>(comm, ns(arrived));
    const std::int64_t late_arrived = when[static_cast<std::size_t>(late)];
    CHECK_MESSAGE(ns(left) >= late_arrived, "rank " << me << " left the barrier " << (late_arrived - ns(left)) / 1000
                                                    << " µs before rank " << late << " arrived");
  }
}

//! Several collectives in flight at once, their works waited in the reverse order (and one
//! moved before its wait): each result is right.
template <class Comm>
void check_works_in_flight(Comm& comm, const conformance_options& o) {
  using namespace conformance_detail;
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  const int n = comm.size(), me = comm.rank();
  const auto mem = comm.memory();
  const dtype t = contains(o.types, dtype::f64) ? dtype::f64 : o.types.front();
  constexpr std::size_t count = 10007;
  const std::size_t nbytes = count * lockstep::size_of(t);
  const reduce_op ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max};
  std::vector<std::shared_ptr<void>> bufs;
  for (int k = 0; k < 3; ++k)
    bufs.push_back(to_memory(mem, conformance_input(t, o.seed, 900 + static_cast<std::uint64_t>(k), me, 0, count)));
  auto w0 = comm.all_reduce(bufs[0].get(), bufs[0].get(), count, t, ops[0]);
  auto w1 = comm.all_reduce(bufs[1].get(), bufs[1].get(), count, t, ops[1]);
  auto w2 = comm.all_reduce(bufs[2].get(), bufs[2].get(), count, t, ops[2]);
  w2.wait();
  w1.wait();
  auto moved = std::move(w0);  // the moved-to handle owns the collective
  moved.wait();
  for (int k = 0; k < 3; ++k) {
    const bytes got = from_memory(mem, bufs[static_cast<std::size_t>(k)].get(), nbytes);
    const std::string bad = conformance_compare_reduced(
        t, got.data(), count, o.seed, 900 + static_cast<std::uint64_t>(k), n, 0, ops[k], o.rank_order_sums);
    CHECK_MESSAGE(bad.empty(), "all_reduce " << k << " of 3 in flight together (" << lockstep::name_of(ops[k])
                                             << "), waited in reverse order: " << bad);
  }
}

//! Misuse every rank commits alike: a root outside 0..size()−1 is a config_error, and so is a
//! reduction of an element type without arithmetic (o.unsupported); afterwards the ranks are
//! still in step.
template <class Comm>
void check_misuse(Comm& comm, const conformance_options& o) {
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  const int n = comm.size();
  const auto mem = comm.memory();
  auto buf = mem.allocate(64);
  CHECK_THROWS_AS(comm.broadcast(buf.get(), 1, lockstep::dtype::f32, n).wait(), lockstep::config_error);
  CHECK_THROWS_AS(comm.broadcast(buf.get(), 1, lockstep::dtype::f32, -1).wait(), lockstep::config_error);
  for (auto t : o.unsupported) {
    CAPTURE(std::string(lockstep::name_of(t)));
    CHECK_THROWS_AS(comm.all_reduce(buf.get(), buf.get(), 4, t, lockstep::reduce_op::sum).wait(),
                    lockstep::config_error);
    CHECK_THROWS_AS(comm.reduce_scatter(buf.get(), buf.get(), 1, t, lockstep::reduce_op::sum).wait(),
                    lockstep::config_error);
  }
  const std::int32_t one = 1;
  mem.upload(buf.get(), &one, sizeof one);
  comm.all_reduce(buf.get(), buf.get(), 1, lockstep::dtype::i32, lockstep::reduce_op::sum).wait();
  std::int32_t total = 0;
  mem.download(&total, buf.get(), sizeof total);
  CHECK_MESSAGE(total == n, "after rejected calls, an all_reduce of 1s gives " << total << " on " << n << " ranks");
}

//! Everything a communicator must do right when every rank behaves.
template <class Comm>
void check_collectives(Comm& comm, const conformance_options& o) {
  static_assert(lockstep::communicator<Comm>);
  check_memory(comm, o);
  check_ranks(comm, o);
  check_all_reduce(comm, o);
  check_broadcast(comm, o);
  check_all_gather(comm, o);
  check_reduce_scatter(comm, o);
  check_barrier(comm, o);
  check_works_in_flight(comm, o);
  check_misuse(comm, o);
}

// ---------------------------------------------------------------------------------------
// Failures that need the backend's cooperation.

namespace conformance_detail {
//! The mismatch_error's message, or "" when the call passed.
template <class F>
std::string mismatch_of(F&& call) {
  try {
    call();
  } catch (const lockstep::mismatch_error& e) {
    return e.what();
  }
  return {};
}
//! The communicator's count of collectives issued so far (0 where it has none to tell).
template <class Comm>
std::uint64_t comm_sequence(const Comm& comm) {
  if constexpr (requires { comm.sequence(); }) return static_cast<std::uint64_t>(comm.sequence());
  else return 0;
}
template <class T, class Mem>
std::vector<T> download_as(const Mem& mem, const std::shared_ptr<void>& p, std::size_t n) {
  std::vector<T> v(n);
  if (n) mem.download(v.data(), p.get(), n * sizeof(T));
  return v;
}
template <class T, class Mem>
void upload_from(const Mem& mem, const std::shared_ptr<void>& p, const std::vector<T>& v) {
  if (!v.empty()) mem.upload(p.get(), v.data(), v.size() * sizeof(T));
}
inline bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace conformance_detail

//! The order check, on a communicator that has issued no collective yet and checks the order
//! (ThreadComm always; MpiComm with LOCKSTEP_DEBUG=1 or set_check_order(true); NcclComm created
//! with LOCKSTEP_DEBUG=1). Matching calls of every kind pass; then the last rank calls another
//! count, collective, type, op or root, and every rank must throw mismatch_error naming rank 0's
//! call and the last rank's ("rank 0 called all_reduce #5 of 4 f64 (sum) but rank 2 called
//! ..."), before touching the buffers, and stay in step. Needs ≥ 2 ranks.
template <class Comm>
void check_order(Comm& comm, const conformance_options& o) {
  using namespace conformance_detail;
  using lockstep::dtype;
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  const int n = comm.size(), me = comm.rank(), odd = n - 1;
  REQUIRE(n >= 2);
  const std::string odd_called = "rank " + std::to_string(odd) + " called ";
  const auto mem = comm.memory();
  const auto un = static_cast<std::size_t>(n);

  // #0–#4: matching calls of every kind pass.
  auto a = mem.allocate(5 * sizeof(float)), g = mem.allocate(5 * un * sizeof(float));
  upload_from(mem, a, std::vector<float>(5, 1.0f));
  comm.all_reduce(a.get(), a.get(), 5, dtype::f32, reduce_op::sum).wait();
  comm.broadcast(a.get(), 5, dtype::f32, odd).wait();
  comm.all_gather(a.get(), g.get(), 5, dtype::f32).wait();
  comm.reduce_scatter(g.get(), a.get(), 5, dtype::f32, reduce_op::max).wait();
  comm.barrier();
  CHECK(download_as<float>(mem, a, 5) == std::vector<float>(5, static_cast<float>(n)));

  // #5: another count. Nothing is reduced; #6 then works.
  auto d = mem.allocate(5 * sizeof(double));
  upload_from(mem, d, std::vector<double>(5, 1.0));
  std::string msg =
      mismatch_of([&] { comm.all_reduce(d.get(), d.get(), me == odd ? 5 : 4, dtype::f64, reduce_op::sum).wait(); });
  CAPTURE(msg);
  CHECK(has(msg, "rank 0 called all_reduce #5 of 4 f64 (sum)"));
  CHECK(has(msg, odd_called + "all_reduce #5 of 5 f64 (sum)"));
  CHECK(download_as<double>(mem, d, 5) == std::vector<double>(5, 1.0));
  comm.all_reduce(d.get(), d.get(), 5, dtype::f64, reduce_op::sum).wait();
  CHECK(download_as<double>(mem, d, 5) == std::vector<double>(5, static_cast<double>(n)));

  auto v = mem.allocate(3 * sizeof(std::int32_t)), vg = mem.allocate(3 * un * sizeof(std::int32_t));
  upload_from(mem, v, std::vector<std::int32_t>(3, 1));
  // #7: another collective.
  msg = mismatch_of([&] {
    if (me == odd) comm.broadcast(v.get(), 3, dtype::i32, 0).wait();
    else comm.all_reduce(v.get(), v.get(), 3, dtype::i32, reduce_op::sum).wait();
  });
  CHECK(has(msg, "rank 0 called all_reduce #7 of 3 i32 (sum) but " + odd_called + "broadcast #7 of 3 i32 from root 0"));
  // #8: another element type (and count).
  msg = mismatch_of([&] {
    comm.all_reduce(v.get(), v.get(), me == odd ? 6 : 3, me == odd ? dtype::u8 : dtype::i32, reduce_op::sum).wait();
  });
  CHECK(has(msg, "rank 0 called all_reduce #8 of 3 i32 (sum) but " + odd_called + "all_reduce #8 of 6 u8 (sum)"));
  // #9: another reduction.
  msg = mismatch_of(
      [&] { comm.all_reduce(v.get(), v.get(), 3, dtype::i32, me == odd ? reduce_op::max : reduce_op::sum).wait(); });
  CHECK(has(msg, odd_called + "all_reduce #9 of 3 i32 (max)"));
  // #10: another root.
  msg = mismatch_of([&] { comm.broadcast(v.get(), 3, dtype::i32, me == odd ? 1 : 0).wait(); });
  CHECK(has(msg, "rank 0 called broadcast #10 of 3 i32 from root 0 but " + odd_called +
                     "broadcast #10 of 3 i32 from root 1"));
  // #11: all_gather against reduce_scatter.
  msg = mismatch_of([&] {
    if (me == odd) comm.reduce_scatter(vg.get(), v.get(), 3, dtype::i32, reduce_op::sum).wait();
    else comm.all_gather(v.get(), vg.get(), 3, dtype::i32).wait();
  });
  CHECK(has(msg, "rank 0 called all_gather #11 of 3 i32 but " + odd_called + "reduce_scatter #11 of 3 i32 (sum)"));
  // #12: still in step, the buffer untouched by the rejected calls.
  comm.all_reduce(v.get(), v.get(), 3, dtype::i32, reduce_op::sum).wait();
  CHECK(download_as<std::int32_t>(mem, v, 3) == std::vector<std::int32_t>(3, n));
}

//! The order check for a barrier against another collective (a fresh communicator, as for
//! check_order): the barrier is a collective of its own kind, "barrier #0".
template <class Comm>
void check_order_barrier(Comm& comm, const conformance_options& o) {
  using namespace conformance_detail;
  using lockstep::dtype;
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  const int n = comm.size(), me = comm.rank(), odd = n - 1;
  REQUIRE(n >= 2);
  const auto mem = comm.memory();
  auto v = mem.allocate(sizeof(std::int32_t));
  upload_from(mem, v, std::vector<std::int32_t>{1});
  // A one-element i32 sum: what a barrier built on all_reduce would look like, were it
  // described as its all_reduce — then this pair would go unnoticed.
  const std::string msg = mismatch_of([&] {
    if (me == odd) comm.barrier();
    else comm.all_reduce(v.get(), v.get(), 1, dtype::i32, reduce_op::sum).wait();
  });
  CAPTURE(msg);
  CHECK(has(msg, "rank 0 called all_reduce #0 of 1 i32 (sum) but rank " + std::to_string(odd) + " called barrier #0"));
  comm.all_reduce(v.get(), v.get(), 1, dtype::i32, reduce_op::sum).wait();
  CHECK(download_as<std::int32_t>(mem, v, 1) == std::vector<std::int32_t>{n});
}

//! The deferred order check (MpiComm and NcclComm by default, comm/order_check.hpp): the last
//! rank labels its call as another bucket of the same size (same count, type and op, so the
//! data pair up and complete — what a skipped bucket does); by verify_order() at the latest
//! every rank throws mismatch_error naming rank 0's call and the last rank's, and from then on
//! the communicator refuses every call with it (so run it last on a communicator). Needs ≥ 2
//! ranks, label_next and verify_order.
template <class Comm>
void check_order_deferred(Comm& comm, const conformance_options& o) {
  using namespace conformance_detail;
  using lockstep::dtype;
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  const int n = comm.size(), me = comm.rank(), odd = n - 1;
  REQUIRE(n >= 2);
  const auto mem = comm.memory();
  auto a = mem.allocate(7 * sizeof(float));
  upload_from(mem, a, std::vector<float>(7, 1.0f));
  const std::uint64_t first = comm_sequence(comm);
  comm.label_next("bucket 0: 7 f32 at 0");
  comm.all_reduce(a.get(), a.get(), 7, dtype::f32, reduce_op::sum).wait();
  CHECK(mismatch_of([&] { comm.verify_order(); }).empty());  // calls that match pass
  // Found while the call is waited for (a host communicator polls the seals then) or by
  // verify_order() at the latest.
  const std::string msg = mismatch_of([&] {
    comm.label_next(me == odd ? "bucket 2: 7 f32 at 14" : "bucket 1: 7 f32 at 7");
    comm.all_reduce(a.get(), a.get(), 7, dtype::f32, reduce_op::sum).wait();
    comm.verify_order();
  });
  CAPTURE(msg);
  const std::string at = "#" + std::to_string(first + 1) + " of 7 f32 (sum) for bucket ";
  CHECK(has(msg, "rank 0 called all_reduce " + at + "1: 7 f32 at 7 but rank " + std::to_string(odd) +
                     " called all_reduce " + at + "2: 7 f32 at 14"));
  // Found, it stays: no later collective runs on this communicator.
  CHECK(mismatch_of([&] { comm.all_reduce(a.get(), a.get(), 7, dtype::f32, reduce_op::sum).wait(); }) == msg);
}

//! What one rank saw in check_timeout.
struct timeout_outcome {
  bool waited = false;  //!< this rank called the collective (it is not the absent one)
  std::string what;     //!< the timeout_error / aborted_error message
  double seconds = 0;   //!< how long the call took to fail
  //! The collective's buffers. A communicator that cannot cancel a collective (MPI) may still
  //! write into them: keep them until the absent rank has matched it, or for good.
  std::vector<std::shared_ptr<void>> keep_alive;
};

//! Rank `absent` never joins an all_reduce of 3 i64 the others issue on a communicator whose
//! waits time out after `timeout`: each of the others must throw timeout_error (or
//! aborted_error, when a peer's timeout released it) naming the all_reduce, within timeout + 5 s
//! (and not before the timeout, for a rank that timed out itself). After a timeout the
//! communicator refuses further collectives (aborted_error): nobody knows where its peers are.
template <class Comm>
timeout_outcome check_timeout(Comm& comm, const conformance_options& o, int absent, std::chrono::milliseconds timeout) {
  using namespace conformance_detail;
  LOCKSTEP_CONFORMANCE_INFO(comm, o);
  timeout_outcome out;
  if (comm.rank() == absent) return out;
  out.waited = true;
  const auto mem = comm.memory();
  auto buf = mem.allocate(3 * sizeof(std::int64_t));
  out.keep_alive.push_back(buf);
  upload_from(mem, buf, std::vector<std::int64_t>{1, 2, 3});
  const auto t0 = std::chrono::steady_clock::now();
  bool timed_out = false, aborted = false;
  try {
    comm.all_reduce(buf.get(), buf.get(), 3, lockstep::dtype::i64, lockstep::reduce_op::sum).wait();
  } catch (const lockstep::timeout_error& e) {
    timed_out = true;
    out.what = e.what();
  } catch (const lockstep::aborted_error& e) {
    aborted = true;
    out.what = e.what();
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double limit = std::chrono::duration<double>(timeout).count();
  CAPTURE(out.what);
  CAPTURE(out.seconds);
  CHECK_MESSAGE((timed_out || aborted), "an all_reduce rank " << absent << " never joined returned normally");
  CHECK(out.seconds < limit + 5.0);
  if (timed_out) CHECK(out.seconds >= 0.95 * limit);
  CHECK(has(out.what, "all_reduce"));
  CHECK_THROWS_AS(comm.barrier(), lockstep::aborted_error);
  return out;
}

}  // namespace lockstep_test
