#pragma once
// One CPU rank's side of example 01's training loop (see fashion_mnist.hpp): the host MLP of
// mlp.hpp, batches gathered from the shared data set, lockstep::Sgd. Used by example 01
// (ranks as threads) and example 02 (ranks as MPI processes).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <lockstep/core/parameter.hpp>
#include <lockstep/data/seeding.hpp>
#include <lockstep/optim/sgd.hpp>

#include "fashion_mnist.hpp"
#include "mlp.hpp"

namespace fmnist {

class CpuTrainer {
 public:
  CpuTrainer(const dataset& data, std::uint64_t seed)
      : data_(data), model_(lockstep::model_seed(seed)) {}  // same on every rank anyway

  Mlp& model() { return model_; }
  void attach(const std::vector<lockstep::parameter>&, double lr, double momentum) {
    sgd_.emplace(lockstep::SgdOptions{.lr = lr, .momentum = momentum});
  }
  void set_lr(double lr) { sgd_->set_lr(lr); }
  void begin_epoch(std::span<const std::size_t>, std::span<const std::span<const std::size_t>>) { loss_sum_ = 0; }

  template <class Hook>
  void forward_backward(std::span<const std::size_t> batch, Hook&& ready) {
    gather(data_.train, batch, data_.table.data(), x_, y_);
    const double loss = model_.forward_backward(x_.data(), y_.data(), batch.size(), ready);
    loss_sum_ += loss * static_cast<double>(batch.size());
  }

  template <class Step>
  void finish(Step& st) {
    if (st.finish()) sgd_->step(model_.parameters());  // gradients are averaged over ranks
  }

  //! Sharded (--gather-wire): the optimizer on this rank's shard of the averaged gradients.
  void step_shard(std::span<const lockstep::param_slice> shard) { sgd_->step(shard); }

  double loss_sum() const { return loss_sum_; }
  void synchronize() {}

  std::size_t count_correct(std::size_t lo, std::size_t hi) {
    std::size_t correct = 0;
    std::vector<std::size_t> rows;
    for (std::size_t at = lo; at < hi; at += 500) {
      rows.resize(std::min<std::size_t>(500, hi - at));
      for (std::size_t k = 0; k < rows.size(); ++k) rows[k] = at + k;
      gather(data_.test, rows, data_.table.data(), x_, y_);
      correct += model_.count_correct(x_.data(), y_.data(), rows.size());
    }
    return correct;
  }

  //! The optimizer (serializable: it goes into checkpoints as a section).
  lockstep::Sgd& optimizer() { return *sgd_; }

 private:
  const dataset& data_;
  Mlp model_;
  std::optional<lockstep::Sgd> sgd_;
  double loss_sum_ = 0;
  std::vector<float> x_;
  std::vector<std::uint8_t> y_;
};

}  // namespace fmnist
