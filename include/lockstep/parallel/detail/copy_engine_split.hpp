#pragma once
//! ShardedOptimizer's copy-engine options (policies.hpp; shard_units.hpp): the zero-CTA split of
//! the communicator its all-gathers (copy_engine_gather) and reduce-scatters
//! (copy_engine_scatter) run on, and the arenas it registers as windows of that split. Every
//! rank must pass the same settings (require_same_settings: a rank alone on the split would
//! wait there for ever).

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"

namespace lockstep::detail {

template <class Comm>
class copy_engine_split {
 public:
  //! The split and its windows exist on this communicator (NcclComm on NCCL ≥ 2.28).
  static constexpr bool offered = requires(Comm& c) {
    c.copy_engine_group();
    c.allocate_window(std::size_t{});
  };

  copy_engine_split(Comm& comm, bool gather, bool scatter) : comm_(comm), gather_(gather), scatter_(scatter) {}

  //! A gradient arena: with copy_engine_scatter where offered, a window of the split (every
  //! rank asks: the first call checks the settings, a collective).
  std::shared_ptr<void> allocate_gradients(std::size_t bytes) {
    if constexpr (offered) {
      if (agreed() && scatter_) {
        auto [p, registered] = made().allocate_window(bytes);
        grad_windows_.emplace_back(p.get(), registered);
        return std::move(p);
      }
    }
    return comm_.memory().allocate(bytes);
  }
  //! A value arena, and whether it is a window of the split (copy_engine_gather where offered;
  //! every rank takes the same branch: the plans and options agree).
  std::pair<std::shared_ptr<void>, bool> allocate_values(std::size_t bytes) {
    if constexpr (offered) {
      if (agreed() && gather_) return made().allocate_window(bytes);
    }
    return {comm_.memory().allocate(bytes), false};
  }
  //! Whether allocate_gradients made `arena` a registered window of the split.
  bool gradient_window(const void* arena) const {
    for (const auto& [p, registered] : grad_windows_)
      if (p == arena) return registered;
    return false;
  }
  //! The split (once a window was taken).
  Comm& split() { return *engine_; }
  //! No window was taken after all: the split goes.
  void drop_unless(bool used) {
    if (!used) engine_.reset();
  }

 private:
  // The split, made at the first window.
  Comm& made()
    requires offered
  {
    if (!engine_) engine_ = std::make_unique<Comm>(comm_.copy_engine_group());
    return *engine_;
  }
  // Whether the options apply (more than one rank); the first call checks them across ranks.
  bool agreed() {
    if (comm_.size() == 1) return false;
    if (!agreed_)
      require_same_settings(comm_, "ShardedOptimizer",
                            {{"copy_engine_gather", gather_}, {"copy_engine_scatter", scatter_}});
    agreed_ = true;
    return true;
  }

  Comm& comm_;
  bool gather_ = false, scatter_ = false, agreed_ = false;
  std::unique_ptr<Comm> engine_;                            // the zero-CTA split (outlives the arenas' users)
  std::vector<std::pair<const void*, bool>> grad_windows_;  // allocate_gradients: (arena, window taken)
};

}  // namespace lockstep::detail
