#pragma once
//! Small collectives on host data for any communicator: staged through the
//! communicator's memory space (device buffers for GPU communicators).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::detail {

//! values ← op over ranks of values (host memory), staged through the communicator's memory.
//! Issued even for an empty span, so every rank's sequence of collectives stays the same.
template <class Comm, class T>
void host_all_reduce(Comm& comm, std::span<T> values, reduce_op op) {
  auto mem = comm.memory();
  const std::size_t bytes = values.size() * sizeof(T);
  auto buf = mem.allocate(bytes);
  if (bytes) mem.upload(buf.get(), values.data(), bytes);
  comm.all_reduce(buf.get(), buf.get(), values.size(), dtype_of<T>, op).wait();
  if (bytes) mem.download(values.data(), buf.get(), bytes);
}

template <class Comm, class T>
void host_broadcast(Comm& comm, std::vector<T>& v, int root) {
  auto mem = comm.memory();
  const std::size_t bytes = v.size() * sizeof(T);
  auto buf = mem.allocate(bytes);
  mem.upload(buf.get(), v.data(), bytes);
  comm.broadcast(buf.get(), v.size(), dtype_of<T>, root).wait();
  mem.download(v.data(), buf.get(), bytes);
}

//! Every rank's string, indexed by rank.
template <class Comm>
std::vector<std::string> host_all_gather_strings(Comm& comm, const std::string& mine) {
  const int n = comm.size();
  auto mem = comm.memory();
  std::vector<std::int64_t> len{static_cast<std::int64_t>(mine.size())};
  auto lbuf = mem.allocate(sizeof(std::int64_t) * static_cast<std::size_t>(n));
  auto lsend = mem.allocate(sizeof(std::int64_t));
  mem.upload(lsend.get(), len.data(), sizeof(std::int64_t));
  comm.all_gather(lsend.get(), lbuf.get(), 1, dtype::i64).wait();
  std::vector<std::int64_t> lens(static_cast<std::size_t>(n));
  mem.download(lens.data(), lbuf.get(), lens.size() * sizeof(std::int64_t));
  const auto width = static_cast<std::size_t>(*std::max_element(lens.begin(), lens.end()));
  std::vector<char> padded(width, '\0');
  std::memcpy(padded.data(), mine.data(), mine.size());
  auto send = mem.allocate(width);
  auto recv = mem.allocate(width * static_cast<std::size_t>(n));
  mem.upload(send.get(), padded.data(), width);
  comm.all_gather(send.get(), recv.get(), width, dtype::u8).wait();
  std::vector<char> all(width * static_cast<std::size_t>(n));
  mem.download(all.data(), recv.get(), all.size());
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r)
    out.emplace_back(all.data() + static_cast<std::size_t>(r) * width,
                     static_cast<std::size_t>(lens[static_cast<std::size_t>(r)]));
  return out;
}

//! Every rank's string on `root`, indexed by rank (empty strings on the other ranks): one
//! rank's at a time, so each rank holds one other string at most — not all of them, as
//! host_all_gather_strings does (for large per-rank state).
template <class Comm>
std::vector<std::string> host_gather_strings(Comm& comm, const std::string& mine, int root) {
  const auto n = static_cast<std::size_t>(comm.size()), me = static_cast<std::size_t>(comm.rank());
  std::vector<std::int64_t> lens(n, 0);
  lens[me] = static_cast<std::int64_t>(mine.size());
  host_all_reduce(comm, std::span<std::int64_t>(lens), reduce_op::sum);
  std::vector<std::string> out(n);
  for (std::size_t r = 0; r < n; ++r) {
    if (static_cast<int>(r) == root) {
      if (me == r) out[r] = mine;
      continue;
    }
    std::vector<std::uint8_t> v(static_cast<std::size_t>(lens[r]));
    if (me == r) std::memcpy(v.data(), mine.data(), v.size());
    if (!v.empty()) host_broadcast(comm, v, static_cast<int>(r));
    if (static_cast<int>(me) == root) out[r].assign(v.begin(), v.end());
  }
  return out;
}

//! The string of the rank `distance` places after this one (mod size()), through the
//! communicator's ring shift: each rank sends its string once, to one rank (padded to the
//! longest, whose length a small max all-reduce agrees on).
template <class Comm>
std::string host_shift_string(Comm& comm, const std::string& mine, int distance) {
  auto mem = comm.memory();
  std::int64_t width = static_cast<std::int64_t>(mine.size());
  host_all_reduce(comm, std::span<std::int64_t>(&width, 1), reduce_op::max);
  const auto w = static_cast<std::size_t>(width);
  std::vector<char> padded(w + sizeof(std::int64_t), '\0');
  const auto len = static_cast<std::int64_t>(mine.size());
  std::memcpy(padded.data(), &len, sizeof len);
  std::memcpy(padded.data() + sizeof len, mine.data(), mine.size());
  auto send = mem.allocate(padded.size());
  auto recv = mem.allocate(padded.size());
  mem.upload(send.get(), padded.data(), padded.size());
  comm.shift(send.get(), recv.get(), padded.size(), dtype::u8, distance).wait();
  mem.download(padded.data(), recv.get(), padded.size());
  std::int64_t got = 0;
  std::memcpy(&got, padded.data(), sizeof got);
  return std::string(padded.data() + sizeof got, static_cast<std::size_t>(got));
}

//! Throws mismatch_error naming the first of `settings` (name, value) whose value differs
//! across ranks (collective: every rank calls it with the same names).
template <class Comm>
void require_same_settings(Comm& comm, std::string_view owner,
                           std::initializer_list<std::pair<const char*, std::int64_t>> settings) {
  std::vector<std::int64_t> v;
  for (const auto& s : settings) v.push_back(s.second);
  for (const auto& s : settings) v.push_back(-s.second);  // max of x and of −x: equal iff every rank's x agrees
  host_all_reduce(comm, std::span<std::int64_t>(v), reduce_op::max);
  std::size_t i = 0;
  for (const auto& s : settings) {
    if (v[i] != -v[i + settings.size()])
      throw mismatch_error("ranks passed different " + std::string(owner) + "::" + s.first +
                           "; give every rank the same setting");
    ++i;
  }
}

}  // namespace lockstep::detail
