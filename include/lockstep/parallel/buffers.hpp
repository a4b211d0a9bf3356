#pragma once
//! Model buffers (BatchNorm running statistics and the like: state that is not trained but
//! must be the same on every rank): the optional `buffers()` of lockstep::model (c).
//! DataParallel checks them across ranks and broadcasts rank 0's at construction and, with
//! DataParallelOptions::broadcast_buffers, at the start of every accumulation cycle (PyTorch
//! DDP's broadcast_buffers).

#include <string>
#include <vector>

#include "lockstep/comm/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"

namespace lockstep::detail {

template <class M>
std::vector<parameter> collect_buffers(M& m) {
  std::vector<parameter> out;
  if constexpr (buffer_model<M>)
    for (auto&& b : m.buffers()) out.push_back(static_cast<parameter>(b));
  (void)m;
  return out;
}

//! Every rank holds the same buffers (names, shapes, types), or a mismatch_error names the
//! first difference.
template <class Comm>
void check_same_buffers(Comm& comm, const std::vector<parameter>& bs) {
  std::string mine;
  for (const auto& b : bs) mine += b.name + " " + b.shape_string() + "\n";
  const auto all = host_all_gather_strings(comm, mine);
  for (std::size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0])
      throw mismatch_error("ranks built different models: the buffers of rank " + std::to_string(r) +
                           " differ from rank 0's (rank 0:\n" + all[0] + "rank " + std::to_string(r) + ":\n" +
                           all[r] + "); every rank must construct the same model");
}

//! Rank 0's buffer values to every rank.
template <class Comm>
void broadcast_buffers(Comm& comm, const std::vector<parameter>& bs) {
  for (const auto& b : bs)
    if (b.numel()) comm.broadcast(b.value, b.numel(), b.type, 0).wait();
}

}  // namespace lockstep::detail
