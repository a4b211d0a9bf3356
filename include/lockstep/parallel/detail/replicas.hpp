#pragma once
//! Every rank holds the same model. Its parameters (lockstep::model 1), frozen parameters
//! (model (g)) and buffers (model (c): BatchNorm running statistics and the like — state that
//! is not trained but must match) are compared across ranks at construction, the first
//! difference named, and rank 0's values are broadcast to every rank; buffers, with
//! DataParallelOptions::broadcast_buffers (on by default, as PyTorch DDP's), also at the
//! start of every accumulation cycle, one broadcast per element type.

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"

namespace lockstep::detail {

//! A model's range of parameter-like views, as lockstep::parameter values.
template <class R>
std::vector<parameter> as_parameters(R&& range) {
  std::vector<parameter> out;
  for (auto&& p : range) out.push_back(static_cast<parameter>(p));
  return out;
}

template <class M>
std::vector<parameter> collect_parameters(M& m) {
  return as_parameters(m.parameters());
}

//! Its buffers (model (c)) and frozen parameters (model (g)); none if its type has none.
template <class M>
std::vector<parameter> collect_buffers(M& m) {
  if constexpr (buffer_model<M>) return as_parameters(m.buffers());
  else return {};
}

template <class M>
std::vector<parameter> collect_frozen(M& m) {
  if constexpr (frozen_model<M>) return as_parameters(m.frozen());
  else return {};
}

//! One line per tensor: name, shape and element type.
inline std::vector<std::string> describe(const std::vector<parameter>& ps) {
  std::vector<std::string> out;
  for (const auto& p : ps) out.push_back(p.name + " " + p.shape_string());
  return out;
}

//! Throws mismatch_error (on every rank alike) if any rank's tensors differ from rank 0's,
//! naming the first difference; `what` says which list ("parameter", "buffer").
template <class Comm>
void check_same_tensors(Comm& comm, const std::vector<parameter>& ps, const std::string& what) {
  std::string mine;
  for (const auto& l : describe(ps)) mine += l + "\n";
  const auto all = host_all_gather_strings(comm, mine);
  const auto lines = [](const std::string& s) {
    std::vector<std::string> out;
    for (std::size_t at = 0, nl; at < s.size(); at = nl + 1) {
      nl = s.find('\n', at);
      out.push_back(s.substr(at, nl - at));
    }
    return out;
  };
  const auto ref = lines(all[0]);
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const auto theirs = lines(all[r]);
    for (std::size_t i = 0; i < std::max(ref.size(), theirs.size()); ++i) {
      if (i < ref.size() && i < theirs.size() && ref[i] == theirs[i]) continue;
      const auto at = [&](const std::vector<std::string>& v) {
        return i < v.size() ? "'" + v[i] + "'" : "nothing (it has " + std::to_string(v.size()) + " " + what + "s)";
      };
      throw mismatch_error("ranks built different models: " + what + " " + std::to_string(i) + " is " + at(ref) +
                           " on rank 0 but " + at(theirs) + " on rank " + std::to_string(r) +
                           " (every rank must construct the same model: same " + what +
                           "s, order, shapes and element types)");
    }
  }
}

//! The model's parameters still are the ones DataParallel was built with — same count, and
//! each the same storage, element type and shape (a rank that rebuilt, resized or reloaded
//! its model into new tensors would otherwise pair wrong buckets with the other ranks, or
//! write freed memory). Local, no communication: the rank that changed throws, and the job's
//! failure handling ends the others. `was`: DataParallel's view; `bound`: its gradients are
//! the model's (zero-copy), which must then stay in place too.
//! storage: check that values (and, bound, gradients) are where they were (not under full
//! sharding, which attaches them anew at each use).
inline void check_unchanged(const std::vector<parameter>& was, const std::vector<parameter>& now, int rank, bool bound,
                            bool storage = true) {
  const auto what = [](const parameter& p) { return "'" + p.name + "' " + p.shape_string(); };
  std::string why;
  if (now.size() != was.size())
    why = "it has " + std::to_string(now.size()) + " parameters, but DataParallel was built with " +
          std::to_string(was.size());
  for (int pass = 0; pass < 2; ++pass)  // a different shape or type first, else new storage
    for (std::size_t i = 0; why.empty() && i < now.size(); ++i)
      if (now[i].type != was[i].type || now[i].shape != was[i].shape ||
          (pass == 1 && storage && now[i].value != was[i].value))
        why = "parameter " + std::to_string(i) + " is " + what(now[i]) +
              (now[i].value != was[i].value ? " in new storage" : "") + ", but DataParallel was built with " +
              what(was[i]);
  // Bound (zero-copy), the gradients must stay the arena's views: a .grad reset elsewhere
  // (libtorch 2.x optimizer.zero_grad() sets it to none) would leave lockstep averaging zeros.
  for (std::size_t i = 0; why.empty() && bound && storage && i < now.size(); ++i)
    if (now[i].grad != was[i].grad)
      why =
          "the gradient of parameter " + std::to_string(i) + " ('" + now[i].name +
          "') no longer is the storage "
          "DataParallel gave it (was it reset, e.g. by optimizer.zero_grad() with set_to_none? call zero_grad(false), "
          "or leave zeroing to DataParallel)";
  if (!why.empty())
    throw mismatch_error("rank " + std::to_string(rank) + ": the model changed after DataParallel was built: " + why +
                         " (rebuild the DataParallel after changing the model, on every rank alike; to load "
                         "values, copy them into the existing parameters, e.g. restore_training_state)");
}

//! Rank 0's values to every rank, one broadcast per tensor (in place: no staging, so a
//! model's worth of values costs no extra memory).
template <class Comm>
void broadcast_values(Comm& comm, const std::vector<parameter>& ps) {
  for (const auto& p : ps)
    if (p.numel()) comm.broadcast(p.value, p.numel(), p.type, 0).wait();
}

//! `root`'s values of many small tensors (buffers) to every rank, one broadcast per element
//! type, as DDP's coalesced broadcasts: packed into a staging buffer (kept for the next call,
//! in the communicator's memory space), broadcast, unpacked on the other ranks. A ResNet's
//! hundred and sixty BatchNorm buffers cost two collectives a step, not a hundred and sixty.
template <class Comm>
class coalesced_broadcast {
 public:
  void operator()(Comm& comm, const std::vector<parameter>& ps, int root = 0) {
    if (comm.size() == 1) return;
    std::map<dtype, std::vector<segment>> by_type;
    std::size_t most = 0;
    for (const auto& p : ps)
      if (p.numel()) by_type[p.type].push_back({p.value, p.numel()});
    for (const auto& [t, segs] : by_type) {
      std::size_t n = 0;
      for (const auto& s : segs) n += s.count;
      most = std::max(most, n * size_of(t));
    }
    auto mem = comm.memory();
    if (most > bytes_) {
      staging_ = mem.allocate(most);
      bytes_ = most;
    }
    for (const auto& [t, segs] : by_type) {
      std::size_t n = 0;
      for (const auto& s : segs) n += s.count;
      if (comm.rank() == root) mem.pack(segs, staging_.get(), t, 1.0);
      comm.broadcast(staging_.get(), n, t, root).wait();
      if (comm.rank() != root) mem.unpack(staging_.get(), segs, t);
    }
  }

 private:
  std::shared_ptr<void> staging_;
  std::size_t bytes_ = 0;
};

//! A DataParallel's trained parameters at construction: floating point, checked alike across
//! ranks, and (broadcast) rank 0's values everywhere.
template <class Comm, class Model>
std::vector<parameter> initial_parameters(Comm& comm, Model& model, bool broadcast) {
  auto ps = collect_parameters(model);
  for (const auto& p : ps)
    if (!is_floating(p.type))
      throw config_error("parameter '" + p.name + "' has element type " + name_of(p.type) +
                         "; gradients must be floating point (f16, bf16, f32, f64)");
  if (comm.size() > 1) {
    check_same_tensors(comm, ps, "parameter");
    if (broadcast) broadcast_values(comm, ps);
  }
  return ps;
}

//! A DataParallel's frozen parameters and buffers at construction (each list only where the
//! model's type has it): checked alike across ranks, and rank 0's values everywhere.
template <class Comm>
void share_extras(Comm& comm, bool has_frozen, const std::vector<parameter>& frozen, bool has_buffers,
                  const std::vector<parameter>& buffers, bool broadcast, coalesced_broadcast<Comm>& broadcast_buffers) {
  if (comm.size() == 1) return;
  if (has_frozen) {
    check_same_tensors(comm, frozen, "frozen parameter");
    if (broadcast) broadcast_values(comm, frozen);
  }
  if (has_buffers) {
    check_same_tensors(comm, buffers, "buffer");
    if (broadcast) broadcast_buffers(comm, buffers);
  }
}

}  // namespace lockstep::detail
