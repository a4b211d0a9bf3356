#pragma once
//! lockstep::parameter — one trainable tensor of a model together with its gradient,
//! as a typed view: the element type is recorded as a dtype tag at construction, and
//! typed access checks it.

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep {

struct parameter {
  std::string name;                 //!< for error messages ("layer1.weight")
  std::vector<std::int64_t> shape;  //!< logical shape; numel() is its product
  dtype type = dtype::f32;
  void* value = nullptr;  //!< in the communicator's memory space (host or device)
  void* grad = nullptr;   //!< same element type and length as value

  std::size_t numel() const {
    return static_cast<std::size_t>(std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>{}));
  }
  std::size_t bytes() const { return numel() * size_of(type); }

  template <element T>
  std::span<T> value_as() const {
    check_type<T>();
    return {static_cast<T*>(value), numel()};
  }
  template <element T>
  std::span<T> grad_as() const {
    check_type<T>();
    return {static_cast<T*>(grad), numel()};
  }

  std::string shape_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ",";
      s += std::to_string(shape[i]);
    }
    return s + "] " + name_of(type);
  }

 private:
  template <class T>
  void check_type() const {
    if (dtype_of<T> != type)
      throw config_error("parameter '" + name + "' holds " + name_of(type) + " elements, but was read as " +
                         name_of(dtype_of<T>));
  }
};

namespace detail {
//! count elements of parameter `param` from `param_offset` on sit at `slot_offset` in a shard
//! (the rest of a shard is padding): how a ShardedOptimizer shard maps onto the model, for
//! resharding checkpoints (checkpoint/detail/reshard.hpp).
struct shard_segment {
  std::size_t param = 0, param_offset = 0, count = 0, slot_offset = 0;
};
}  // namespace detail

//! One parameter's part of a reduced bucket, handed to per-bucket callbacks
//! (e.g. an optimizer that updates each bucket as soon as it is averaged).
struct param_slice {
  std::size_t param = 0;   //!< index into parameters()
  std::size_t offset = 0;  //!< first element within the parameter
  std::size_t count = 0;
  dtype type = dtype::f32;
  void* value = nullptr;  //!< value + offset
  void* grad = nullptr;   //!< grad + offset
};

//! A parameter's element count and type: what an optimizer's state layout depends on
//! (FusedOptimizer::save_image).
struct param_shape {
  std::size_t numel = 0;
  dtype type = dtype::f32;
  bool operator==(const param_shape&) const = default;
};

//! Builds a parameter from raw pointers. shape's product is the element count.
template <element T>
parameter param(std::string name, T* value, T* grad, std::vector<std::int64_t> shape) {
  for (auto d : shape)
    if (d < 0) throw config_error("parameter '" + name + "' has a negative dimension");
  return parameter{std::move(name), std::move(shape), dtype_of<T>, value, grad};
}

//! Builds a parameter from spans; their lengths must agree with each other and the shape.
template <element T>
parameter param(std::string name, std::span<T> value, std::span<T> grad, std::vector<std::int64_t> shape) {
  auto p = param<T>(std::move(name), value.data(), grad.data(), std::move(shape));
  if (value.size() != p.numel() || grad.size() != p.numel())
    throw config_error("parameter '" + p.name + "': value has " + std::to_string(value.size()) +
                       " elements and gradient " + std::to_string(grad.size()) + ", but shape " + p.shape_string() +
                       " needs " + std::to_string(p.numel()));
  return p;
}

//! One-dimensional shorthand.
template <element T>
parameter param(std::string name, std::span<T> value, std::span<T> grad) {
  auto n = static_cast<std::int64_t>(value.size());
  return param<T>(std::move(name), value, grad, {n});
}

}  // namespace lockstep
