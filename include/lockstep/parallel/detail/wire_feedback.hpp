#pragma once
//! Error feedback for the low-precision gradient wires (WireOptions::error_feedback,
//! parallel/gradient_wire.hpp). Each rank keeps, per bucket, the fp32 residual r of what the wire
//! rounded off its gradients and has not yet sent: before a chunk x is encoded it becomes
//! v = x + r, and afterwards r = v − decode(encode(v)) — one fp32 addition and one subtraction
//! per value, rounded to nearest, so the GPU's kernels (cuda/kernels/int8_ops.cuh,
//! wire_ops.cuh) and the host compute the same residuals bit for bit. Over many steps the sum
//! of what the wire delivered follows the sum of the gradients to within one step's rounding
//! instead of drifting by every step's. An all-reduce rounds twice (each rank's chunks, then
//! its block of the mean): the owner of a block keeps a second residual for the second.
//!  - A residual that is not finite (a block with an inf or NaN: that step is skipped) is kept
//!    as 0, so no NaN reaches the next step.
//!  - The residual is in the units of the gradients the wire sees (with loss scaling: times the
//!    scale). When a dynamic scale changes (after a skipped step, or growing every N steps) the
//!    residual carried into the next step is off by that factor once: at most one rounding
//!    step's worth, what the wire without feedback makes every step.
//!  - A bucket's residual is keyed by the bucket (its arena's address, or the unit a sharded
//!    layout names); a new gradient layout (a plan rebuilt, an elastic regroup) drops them all.
//!  - Checkpoints: save() writes every bucket's residual in the order the buckets were first
//!    used, load() hands them back to the buckets in that order (checkpoint/wire_feedback.hpp).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::detail {

//! out ← Codec's encoding of x[0, n), plus fb's elementwise when fb is not null: fb then holds
//! what the encoding rounded off (the top of this file).
template <class Codec>
void host_encode(const float* x, std::size_t n, unsigned char* out, float* fb) {
  if (fb == nullptr) return Codec::encode(x, n, out);
  std::vector<float> v(n), back(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = x[i] + fb[i];
  Codec::encode(v.data(), n, out);
  Codec::decode(out, n, back.data());
  for (std::size_t i = 0; i < n; ++i) {
    const float d = v[i] - back[i];
    fb[i] = std::isfinite(d) ? d : 0.0f;
  }
}

inline constexpr std::string_view wire_feedback_magic = "LSWIREF1";

//! The residuals of one wire: an fp32 buffer per bucket in the communicator's memory space,
//! zeroed when the bucket is first seen (or handed the loaded one), in the order of first use.
class wire_residuals {
 public:
  //! The residual of `count` floats for the bucket `key`.
  template <class Memory>
  float* get(const Memory& mem, const void* key, std::size_t count) {
    std::lock_guard lock(mutex_);
    for (auto& s : slots_) {
      if (s.key != key) continue;
      if (s.count != count) s = {key, count, mem.allocate(count * sizeof(float))};  // another bucket now
      return static_cast<float*>(s.buf.get());
    }
    const std::size_t i = slots_.size();
    if (loaded_ > 0 && i >= loaded_)
      throw config_error("lockstep wire error feedback: this job uses more gradient buckets than the " +
                         std::to_string(loaded_) +
                         " whose residuals were loaded; load them only into the gradient layout they were saved "
                         "from (same model, bucket sizes and rank count, restore_training_state first), or do not "
                         "load them (they start at zero)");
    slots_.push_back({key, count, mem.allocate(count * sizeof(float))});
    if (i < pending_.size()) {
      handed_ = true;
      if (pending_[i].size() != count)
        throw config_error("lockstep wire error feedback: the loaded residuals' bucket #" + std::to_string(i) +
                           " holds " + std::to_string(pending_[i].size()) + " values but this job's holds " +
                           std::to_string(count) +
                           "; load them only into the gradient layout they were saved from (restore_training_state "
                           "first, same buckets and rank count), or do not load them (they start at zero)");
      mem.upload(slots_[i].buf.get(), pending_[i].data(), count * sizeof(float));
      pending_[i] = {};
    }
    return static_cast<float*>(slots_[i].buf.get());
  }

  //! A new gradient layout: the residuals belong to buckets that are gone.
  void clear() {
    std::lock_guard lock(mutex_);
    slots_.clear();
    if (!handed_) return;  // loaded for the layout to come
    pending_.clear();
    loaded_ = 0;
  }

  //! Every residual, in the order of first use (those loaded and not yet used, if none was).
  template <class Memory>
  std::string save(const Memory& mem) const {
    std::lock_guard lock(mutex_);
    byte_writer w;
    w.write_bytes(wire_feedback_magic.data(), wire_feedback_magic.size());
    const bool loaded = slots_.empty() && !handed_;
    w.write(static_cast<std::uint64_t>(loaded ? pending_.size() : slots_.size()));
    std::vector<float> v;
    for (std::size_t i = 0; i < (loaded ? pending_.size() : slots_.size()); ++i) {
      if (loaded) {
        v = pending_[i];
      } else {
        v.resize(slots_[i].count);
        mem.download(v.data(), slots_[i].buf.get(), v.size() * sizeof(float));
      }
      w.write_array(v);
    }
    const auto b = w.bytes();
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }

  //! Residuals save() wrote, for the buckets to take as they come (those held now are dropped).
  void load(std::span<const std::byte> bytes) {
    byte_reader r(bytes, "lockstep wire error feedback state");
    r.expect_magic(wire_feedback_magic, "a low-precision wire's save_feedback");
    const auto n = r.read<std::uint64_t>();
    if (n > r.remaining() / sizeof(std::uint64_t)) r.fail("names " + std::to_string(n) + " buckets, past its end");
    std::vector<std::vector<float>> p(static_cast<std::size_t>(n));
    for (auto& v : p) v = r.read_array<float>();
    r.expect_end();
    std::lock_guard lock(mutex_);
    slots_.clear();
    pending_ = std::move(p);
    loaded_ = pending_.size();
    handed_ = false;
  }

  //! Bytes held (for the memory report).
  std::size_t bytes() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& s : slots_) n += s.count * sizeof(float);
    return n;
  }

 private:
  struct slot {
    const void* key;
    std::size_t count;
    std::shared_ptr<void> buf;
  };
  mutable std::mutex mutex_;
  std::vector<slot> slots_;
  std::vector<std::vector<float>> pending_;  // loaded: slot i takes pending_[i] when it is first used
  bool handed_ = false;                      // some of pending_ was taken
  std::size_t loaded_ = 0;                   // buckets loaded for the layout in use: no more may come
};

//! A wire's residuals, its own: a copy of the wire starts with none. (A wire made once and given
//! to every rank's DataParallel is copied into each; sharing would mix the ranks' residuals in
//! their checkpoints and drop them all at one rank's layout change.)
class own_residuals {
 public:
  own_residuals() = default;
  own_residuals(const own_residuals&) : own_residuals() {}
  own_residuals& operator=(const own_residuals& o) {
    if (this != &o) p_ = std::make_unique<wire_residuals>();
    return *this;
  }
  own_residuals(own_residuals&&) noexcept = default;
  own_residuals& operator=(own_residuals&&) noexcept = default;
  wire_residuals* operator->() const noexcept { return p_.get(); }

 private:
  std::unique_ptr<wire_residuals> p_ = std::make_unique<wire_residuals>();
};

}  // namespace lockstep::detail
