#pragma once
//! MpiStore — a lockstep::store for jobs started by an MPI launcher, built on MPI
//! collectives (through MpiComm, so every wait has LOCKSTEP_TIMEOUT). MPI already connects
//! the processes, so no address or port is needed.
//!
//! It is a *collective* store: set() is local (the value stays on the rank that set it), and
//! get, wait, check and add are collectives that every rank calls in the same order:
//!  - get(key): the lowest rank holding key broadcasts its value to all. A key that no rank
//!    has set cannot appear any more (every rank is inside get): timeout_error at once.
//!  - wait(keys, t) / check(keys): whether each key is set on some rank (wait throws
//!    timeout_error naming the missing ones, at once, for the same reason).
//!  - add(key, d): every rank adds its d; the counter grows by their sum and every rank gets
//!    the same new value (so lockstep::barrier(store, name) works: all ranks arrive at once).
//! This covers rendezvous as lockstep does it (rank 0 sets an id, every rank gets it;
//! barriers). A rank that polls a key another rank sets later, at its own pace, needs an
//! asynchronous store: TcpStore or FileStore.
//!
//! \code
//!   lockstep::MpiStore st;                                   // over MPI_COMM_WORLD
//!   if (st.rank() == 0) st.set("nccl_id", id_bytes);
//!   auto id = st.get("nccl_id");                              // every rank
//!   auto cfg = st.broadcast_bytes(0, local_bytes);            // or simply: rank 0's bytes
//! \endcode

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/mpi/mpi_comm.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep {

class MpiStore {
 public:
  //! Over a dup of `comm` (collective). Initialise MPI first, or use the default (world).
  explicit MpiStore(MPI_Comm comm, std::chrono::milliseconds timeout = detail::default_timeout(),
                    store_limits limits = {})
      : comm_(comm, timeout), timeout_(timeout), limits_(limits) {}
  //! Over MPI_COMM_WORLD, initialising MPI when nobody did.
  MpiStore() : comm_(MpiComm::world()), timeout_(detail::default_timeout()) {}

  int rank() const noexcept { return comm_.rank(); }
  int world() const noexcept { return comm_.size(); }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const store_limits& limits() const noexcept { return limits_; }

  //! Root's bytes on every rank (collective; the others' `bytes` are ignored).
  std::vector<std::byte> broadcast_bytes(int root, std::span<const std::byte> bytes) {
    if (root < 0 || root >= world())
      throw config_error("MpiStore::broadcast_bytes: root " + std::to_string(root) + " is not a rank of this job of " +
                         std::to_string(world()));
    std::int64_t n = static_cast<std::int64_t>(bytes.size());
    comm_.broadcast(&n, 1, dtype::i64, root).wait();
    std::vector<std::byte> out(static_cast<std::size_t>(n));
    if (rank() == root) out.assign(bytes.begin(), bytes.end());
    comm_.broadcast(out.data(), out.size(), dtype::u8, root).wait();
    return out;
  }

  //! Local: no communication. The value becomes visible through the next collective get.
  void set(std::string_view key, std::span<const std::byte> value) {
    detail::check_store_key(key, limits_, "MpiStore");
    detail::check_store_value(key, value.size(), limits_.max_value_bytes, "MpiStore");
    values_[std::string(key)].assign(value.begin(), value.end());
  }

  //! Collective: the value of the lowest rank that set key.
  std::vector<std::byte> get(std::string_view key) {
    detail::check_store_key(key, limits_, "MpiStore");
    std::int32_t owner = values_.count(std::string(key)) ? rank() : world();
    comm_.all_reduce(&owner, &owner, 1, dtype::i32, reduce_op::min).wait();
    if (owner >= world())
      throw timeout_error("MpiStore: get " + detail::printable_key(key) +
                          ": no rank set this key before every rank called get (MpiStore's get "
                          "is collective: set the key first, on any rank)");
    const auto it = values_.find(std::string(key));
    return broadcast_bytes(owner,
                           owner == rank() ? std::span<const std::byte>(it->second) : std::span<const std::byte>());
  }

  //! Collective: throws timeout_error naming the keys that no rank has set.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds t) {
    auto missing = missing_keys(keys);
    if (!missing.empty())
      throw timeout_error(detail::store_timeout_message("MpiStore", "wait", missing, keys.size(), t, world()) +
                          " (MpiStore's wait is collective: keys must be set before it)");
  }
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

  //! Collective: whether every key is set on some rank.
  bool check(const std::vector<std::string>& keys) { return missing_keys(keys).empty(); }

  //! Collective: adds every rank's delta; each rank gets the same new value.
  std::int64_t add(std::string_view key, std::int64_t delta) {
    detail::check_store_key(key, limits_, "MpiStore");
    std::int64_t sum = delta;
    comm_.all_reduce(&sum, &sum, 1, dtype::i64, reduce_op::sum).wait();
    auto& c = counters_[std::string(key)];
    c = detail::checked_add(c, sum, key, "MpiStore");
    return c;
  }

 private:
  std::vector<std::string> missing_keys(const std::vector<std::string>& keys) {
    detail::check_store_keys(keys, limits_, "MpiStore");
    std::vector<std::int32_t> have(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) have[i] = values_.count(keys[i]) ? 1 : 0;
    comm_.all_reduce(have.data(), have.data(), have.size(), dtype::i32, reduce_op::max).wait();
    std::vector<std::string> missing;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (!have[i]) missing.push_back(keys[i]);
    return missing;
  }

  MpiComm comm_;
  std::chrono::milliseconds timeout_;
  store_limits limits_;
  std::map<std::string, std::vector<std::byte>, std::less<>> values_;
  std::map<std::string, std::int64_t, std::less<>> counters_;
};

static_assert(store<MpiStore>);

}  // namespace lockstep
