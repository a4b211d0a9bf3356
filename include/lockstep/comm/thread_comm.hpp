#pragma once
//! ThreadComm — the reference communicator: N ranks as host threads of one process.
//! Simple and exact: every rank sums the ranks' contributions in rank order 0..N−1, so
//! results are deterministic and bit-identical on every rank. Every call checks that
//! all ranks called the same collective with the same count and type, and every wait
//! has a timeout (LOCKSTEP_TIMEOUT, default 60 s).

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/detail/rendezvous.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/host_memory.hpp"

namespace lockstep {

namespace detail {

//! One rank's call as posted to the group: what it is and where its buffers are.
struct posted_call {
  collective what;
  const void* send = nullptr;
  void* recv = nullptr;
};

struct thread_group;

//! Every group of one job — the one run(Threads) made and those split() made from it — so a
//! failure anywhere releases every rank (abort), and a rank whose body returned is known to
//! have left every group it belongs to.
struct thread_family {
  std::mutex m;
  std::vector<std::weak_ptr<thread_group>> groups;
  //! The job's first failure: every group is aborted with it, whoever calls abort() later
  //! (a rank released by it reports itself failed too), so every rank names the same cause.
  std::string reason;  // under m; empty until the first abort
  //! ThreadComm::regroup(): the groups being made after a failure, by change number; the
  //! first member to arrive creates one, the last to take it removes the entry. Under m.
  std::map<std::uint64_t, std::pair<std::shared_ptr<thread_group>, int>> regrouping;
  std::vector<int> failed;  // job ranks whose bodies threw (ThreadComm::fail), under m
  void abort(const std::string& reason);
  void leave(int world_rank);
};

struct thread_group {
  thread_group(int n, std::chrono::milliseconds timeout, std::shared_ptr<thread_family> f, std::vector<int> world)
      : sync(n, timeout, world), calls(static_cast<std::size_t>(n)), family(std::move(f)),
        world_ranks(std::move(world)) {}
  local_rendezvous sync;
  std::vector<posted_call> calls;
  std::shared_ptr<thread_family> family;
  std::vector<int> world_ranks;  // this group's rank r is rank world_ranks[r] of the job's first group
  // split(): the sub-groups being made, by (sequence number, colour); the first member to
  // arrive creates one, the last to take it removes the entry.
  std::mutex split_m;
  std::map<std::pair<std::size_t, std::int64_t>, std::pair<std::shared_ptr<thread_group>, int>> splitting;
};

inline void thread_family::abort(const std::string& why) {
  std::vector<std::shared_ptr<thread_group>> live;
  std::string first;
  {
    std::lock_guard lk(m);
    if (reason.empty()) reason = why;
    first = reason;
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  for (auto& g : live) g->sync.abort(first);
}

inline void thread_family::leave(int world_rank) {
  std::vector<std::shared_ptr<thread_group>> live;
  {
    std::lock_guard lk(m);
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  for (auto& g : live)
    for (std::size_t r = 0; r < g->world_ranks.size(); ++r)
      if (g->world_ranks[r] == world_rank) g->sync.leave(static_cast<int>(r));
}

template <class T>
T combine(T a, T b, reduce_op op) {
  switch (op) {
    case reduce_op::max: return b > a ? b : a;
    case reduce_op::min: return b < a ? b : a;
    default: return static_cast<T>(a + b);
  }
}

//! tmp ← op over ranks (in rank order 0..N−1) of calls[r].send[offset, offset + count).
inline void reduce_calls(const std::vector<posted_call>& calls, std::size_t offset, std::size_t count, dtype t,
                         reduce_op op, std::vector<unsigned char>& tmp) {
  if (is_half(t)) {  // f16/bf16: combined in float in rank order, rounded once
    with_half_codec(t, [&](auto to_float, auto from_float) {
      std::vector<float> acc(count);
      const auto* first = static_cast<const std::uint16_t*>(calls[0].send) + offset;
      for (std::size_t i = 0; i < count; ++i) acc[i] = to_float(first[i]);
      for (std::size_t r = 1; r < calls.size(); ++r) {
        const auto* in = static_cast<const std::uint16_t*>(calls[r].send) + offset;
        for (std::size_t i = 0; i < count; ++i) acc[i] = combine(acc[i], to_float(in[i]), op);
      }
      const float n = op == reduce_op::avg ? static_cast<float>(calls.size()) : 1.0f;
      tmp.resize(count * sizeof(std::uint16_t));
      auto* out = reinterpret_cast<std::uint16_t*>(tmp.data());
      for (std::size_t i = 0; i < count; ++i) out[i] = from_float(n == 1.0f ? acc[i] : acc[i] / n);
    });
    return;
  }
  visit_host_dtype(t, [&]<class T>(T) {
    tmp.resize(count * sizeof(T));
    T* out = reinterpret_cast<T*>(tmp.data());
    const T* first = static_cast<const T*>(calls[0].send) + offset;
    std::copy(first, first + count, out);
    for (std::size_t r = 1; r < calls.size(); ++r) {
      const T* in = static_cast<const T*>(calls[r].send) + offset;
      for (std::size_t i = 0; i < count; ++i) out[i] = combine(out[i], in[i], op);
    }
    if (op == reduce_op::avg) {
      const auto n = static_cast<T>(calls.size());
      for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<T>(out[i] / n);
    }
  });
}

}  // namespace detail

class ThreadComm {
 public:
  using work_type = ready_work;

  //! One communicator per rank of a new group of n ranks. Hand element r to thread r.
  static std::vector<ThreadComm> create_group(int n, std::chrono::milliseconds timeout = detail::default_timeout()) {
    if (n < 1) throw config_error("ThreadComm: a group needs at least 1 rank, got " + std::to_string(n));
    std::vector<int> world(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) world[static_cast<std::size_t>(r)] = r;
    auto family = std::make_shared<detail::thread_family>();
    auto g = std::make_shared<detail::thread_group>(n, timeout, family, std::move(world));
    family->groups.push_back(g);
    std::vector<ThreadComm> out;
    out.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) out.push_back(ThreadComm(g, r));
    return out;
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return g_->sync.size(); }
  HostMemory memory() const noexcept { return {}; }

  //! Releases every rank blocked in this group and in every group split from the same job
  //! (used when one rank fails).
  void abort(const std::string& reason) { g_->family->abort(reason); }

  //! This rank will issue no more collectives (its body returned; run(Threads) calls it): a
  //! peer that waits for it in a collective — of this group or of any group split from the
  //! job's — fails at once with mismatch_error naming both, instead of waiting out LOCKSTEP_TIMEOUT.
  void leave() { g_->family->leave(g_->world_ranks[static_cast<std::size_t>(rank_)]); }

  //! This rank's body failed (run(Threads) calls it before releasing the others): the job
  //! ranks that did so far are failed_ranks(), for the survivors of a failure to name
  //! (agree_on_survivors) instead of waiting for them to report.
  void fail() {
    std::lock_guard lk(g_->family->m);
    g_->family->failed.push_back(g_->world_ranks[static_cast<std::size_t>(rank_)]);
  }
  std::vector<int> failed_ranks() const {
    std::lock_guard lk(g_->family->m);
    return g_->family->failed;
  }

  //! A communicator over the ranks that pass the same colour (≥ 0), ordered by key (ties: by
  //! rank here), like MPI_Comm_split. Collective over this group. The new group shares the
  //! job's failure handling: the timeout, abort (a failure in any group releases all) and
  //! leave; its collectives are checked and numbered on their own.
  ThreadComm split(int color, int key) {
    if (color < 0)
      throw config_error("ThreadComm::split: colour " + std::to_string(color) +
                         " is negative; give every rank a colour >= 0 (ranks of one colour form a group)");
    const std::int64_t mine[2] = {color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
    all_gather(mine, all.data(), 2, dtype::i64);
    const std::size_t id = seq_;  // the same on every rank: this split's number
    std::vector<int> members;     // ranks of this group with my colour, in their new order
    for (int r = 0; r < size(); ++r)
      if (all[2 * static_cast<std::size_t>(r)] == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1];
    });
    const int n = static_cast<int>(members.size());
    const int me = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    std::shared_ptr<detail::thread_group> sub;
    {
      std::lock_guard lk(g_->split_m);
      auto& [group, taken] = g_->splitting[{id, color}];
      if (!group) {
        std::vector<int> world;
        for (int r : members) world.push_back(g_->world_ranks[static_cast<std::size_t>(r)]);
        group = std::make_shared<detail::thread_group>(n, g_->sync.timeout(), g_->family, std::move(world));
        std::lock_guard fl(g_->family->m);
        std::erase_if(g_->family->groups, [](const auto& w) { return w.expired(); });
        g_->family->groups.push_back(group);
      }
      sub = group;
      if (++taken == n) g_->splitting.erase({id, color});
    }
    return ThreadComm(std::move(sub), me);
  }

  //! After a failure aborted this group's job (docs/elastic.md): a communicator over the job
  //! ranks `members` (ascending, the same on every member, as agree_on_survivors decides),
  //! for the `change`-th change of the job's membership. Every member calls it, each rank's
  //! place in `members` its new rank; ranks of the job not in it take no part. The new group
  //! shares the job's failure handling (a later failure aborts it too); the failure that
  //! ended the old one is forgotten, so a later one is named on its own. A rank that regroups
  //! is alive: a failed rank started again (run(Threads) with max_restarts) that joins a new
  //! group is no longer among failed_ranks().
  ThreadComm regroup(std::uint64_t change, std::span<const int> members) {
    const int job = g_->world_ranks[static_cast<std::size_t>(rank_)];
    const auto at = std::find(members.begin(), members.end(), job);
    if (at == members.end() || !std::is_sorted(members.begin(), members.end()) ||
        std::adjacent_find(members.begin(), members.end()) != members.end())
      throw config_error("ThreadComm::regroup: the members (" + std::to_string(members.size()) +
                         " job ranks) must be ascending, distinct and include this rank's job rank " +
                         std::to_string(job) + "; pass what agree_on_survivors decided");
    const int n = static_cast<int>(members.size());
    detail::thread_family& f = *g_->family;
    std::shared_ptr<detail::thread_group> group;
    {
      std::lock_guard lk(f.m);
      auto& [made, taken] = f.regrouping[change];
      if (!made) {
        made = std::make_shared<detail::thread_group>(n, g_->sync.timeout(), g_->family,
                                                      std::vector<int>(members.begin(), members.end()));
        std::erase_if(f.groups, [](const auto& w) { return w.expired(); });
        f.groups.push_back(made);
        f.reason.clear();
      } else if (!std::equal(members.begin(), members.end(), made->world_ranks.begin(), made->world_ranks.end())) {
        throw mismatch_error("ThreadComm::regroup: job rank " + std::to_string(job) +
                             " names other members for change " + std::to_string(change) +
                             " than a rank before it; every member must pass the same");
      }
      group = made;
      if (++taken == n) f.regrouping.erase(change);
      std::erase(f.failed, job);
    }
    return ThreadComm(std::move(group), static_cast<int>(at - members.begin()));
  }

  ready_work all_reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    // Refused before the call is posted, so a rank that catches the error stays in step.
    run({collective::all_reduce(count, t, op), send, recv}, [&](const auto& calls, auto& tmp) {
      detail::reduce_calls(calls, 0, count, t, op, tmp);
      return recv;
    });
    return {};
  }

  ready_work broadcast(void* buf, std::size_t count, dtype t, int root) {
    if (root < 0 || root >= size())
      throw config_error("ThreadComm::broadcast: root " + std::to_string(root) + " is not a rank of this group of " +
                         std::to_string(size()));
    run({collective::broadcast(count, t, root), buf, buf}, [&](const auto& calls, auto& tmp) {
      const std::size_t bytes = count * size_of(t);
      tmp.resize(bytes);
      if (bytes) std::memcpy(tmp.data(), calls[static_cast<std::size_t>(root)].send, bytes);
      return buf;
    });
    return {};
  }

  ready_work all_gather(const void* send, void* recv, std::size_t count, dtype t) {
    run({collective::all_gather(count, t), send, recv}, [&](const auto& calls, auto& tmp) {
      const std::size_t bytes = count * size_of(t);
      tmp.resize(bytes * calls.size());
      for (std::size_t r = 0; r < calls.size(); ++r)
        if (bytes) std::memcpy(tmp.data() + r * bytes, calls[r].send, bytes);
      return recv;
    });
    return {};
  }

  ready_work reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    run({collective::reduce_scatter(count, t, op), send, recv}, [&](const auto& calls, auto& tmp) {
      detail::reduce_calls(calls, static_cast<std::size_t>(rank_) * count, count, t, op, tmp);
      return recv;
    });
    return {};
  }

  //! A ring shift: recv ← the `count` elements that the rank `distance` places after this one
  //! (mod size()) sent. Every rank calls it with the same count and distance.
  ready_work shift(const void* send, void* recv, std::size_t count, dtype t, int distance) {
    run({collective::shift(count, t, distance), send, recv}, [&](const auto& calls, auto& tmp) {
      const std::size_t bytes = count * size_of(t);
      const auto n = static_cast<long long>(calls.size());
      const auto from = static_cast<std::size_t>(((rank_ + static_cast<long long>(distance)) % n + n) % n);
      tmp.resize(bytes);
      if (bytes) std::memcpy(tmp.data(), calls[from].send, bytes);
      return recv;
    });
    return {};
  }

  void barrier() {
    run({collective::barrier(), nullptr, nullptr}, [&](const auto&, auto&) -> void* { return nullptr; });
  }

  //! Number of collectives this rank has issued (the sequence number of the next).
  std::size_t sequence() const noexcept { return seq_; }

  //! Names this rank's next collective (e.g. the bucket it reduces): compared across ranks
  //! with the rest of the call and shown in mismatch messages. DataParallel labels its buckets.
  void label_next(std::string label) { next_label_ = std::move(label); }

 private:
  ThreadComm(std::shared_ptr<detail::thread_group> g, int r) : g_(std::move(g)), rank_(r) {}

  // Protocol: post the call, wait for all; check every rank posted the same call;
  // compute this rank's result into a private buffer while the inputs are read-only;
  // wait again (so nobody still reads our send buffer); write the result.
  template <class Compute>
  void run(detail::posted_call call, Compute&& compute) {
    call.what.seq = seq_++;
    call.what.label = std::exchange(next_label_, {});
    auto& calls = g_->calls;
    const std::string what = call.what.describe();
    calls[static_cast<std::size_t>(rank_)] = call;
    g_->sync.arrive_and_wait(rank_, what);
    for (std::size_t r = 1; r < calls.size(); ++r) {
      if (!(calls[r].what == calls[0].what)) {
        // Every rank reads the calls and throws the same error; then they may all leave.
        std::vector<collective> all;
        for (const auto& c : calls) all.push_back(c.what);
        g_->sync.arrive_and_wait(rank_, what);
        check_same_collective(std::span<const collective>(all), "ThreadComm checks every call");
      }
    }
    std::vector<unsigned char>& tmp = scratch_;
    void* dst = compute(calls, tmp);
    g_->sync.arrive_and_wait(rank_, what);
    if (dst && !tmp.empty()) std::memcpy(dst, tmp.data(), tmp.size());
  }

  std::shared_ptr<detail::thread_group> g_;
  int rank_ = 0;
  std::size_t seq_ = 0;
  std::string next_label_;
  std::vector<unsigned char> scratch_;
};

static_assert(communicator<ThreadComm>);
static_assert(splittable_communicator<ThreadComm>);

}  // namespace lockstep
