#pragma once
//! The kernels behind CudaMemory (memory_ops): pack many gradients into one bucket (folding a
//! scale in), unpack a bucket into them, scale a range in place. On the multi-tensor engine.
//! Every call queues work on stream `s` and checks the launch (cuda_error on failure).
//! Segments handed to one call must not overlap one another, except that pack/unpack source
//! and destination may be identical (an in-place no-op copy).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/cuda/kernels/access.cuh"
#include "lockstep/cuda/kernels/engine.cuh"

namespace lockstep::cuda::kernels {

//! dst ← src as raw bits of Bits (any element type of that size). Lists: 0 = src, 1 = dst.
//! Whole vectors move as 16-byte words, whatever Bits is (no per-element unpacking).
template <class Bits>
struct copy_op : op_base<Bits> {
  static constexpr int lists = 2;
  template <int N>
  using frag = std::conditional_t<N == 1, Bits, uint4>;
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, typename op_base<Bits>::local&) const {
    f = load_as<frag<N>>(static_cast<const Bits*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, typename op_base<Bits>::local&) const {
    store_as(static_cast<Bits*>(p[1]) + i, f);
  }
};

//! dst ← src · factor in Element's compute type, one rounding. Lists: 0 = src, 1 = dst
//! (may be src: an in-place scale).
template <class Element>
struct scale_op : op_base<storage_of<Element>> {
  using compute_t = compute_of<Element>;
  using local = typename op_base<storage_of<Element>>::local;
  static constexpr int lists = 2;
  template <int N>
  using frag = vfrag<Element, N>;
  compute_t factor;
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_as<frag<N>>(static_cast<const storage_of<Element>*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local&) const {
    map_elems<Element, N>(f, [&](compute_t x) { return x * factor; });
    store_as(static_cast<storage_of<Element>*>(p[1]) + i, f);
  }
};

//! dst ← dst + src in Element's compute type, one rounding. Lists: 0 = src, 1 = dst.
template <class Element>
struct add_op : op_base<storage_of<Element>> {
  using compute_t = compute_of<Element>;
  using local = typename op_base<storage_of<Element>>::local;
  static constexpr int lists = 2;
  template <int N>
  using frag = vfrag<Element, N>;
  template <int N>
  __device__ void load(frag<N>& f, void* const* p, std::size_t i, local&) const {
    f = load_as<frag<N>>(static_cast<const storage_of<Element>*>(p[0]) + i);
  }
  template <int N>
  __device__ void store(frag<N>& f, void* const* p, std::size_t i, local&) const {
    compute_t x[N];
    int k = 0;
    visit_elems<Element, N>(f, [&](compute_t v) { x[k++] = v; });
    auto* at = static_cast<storage_of<Element>*>(p[1]) + i;
    frag<N> d = load_as<frag<N>>(at);
    k = 0;
    map_elems<Element, N>(d, [&](compute_t y) { return y + x[k++]; });
    store_as(at, d);
  }
};

namespace detail {
//! Copies between scattered segments and one packed range, in segment order.
template <class Bits>
void copy_segments(std::span<const segment> segs, void* packed, bool to_packed, cudaStream_t s, const char* who) {
  auto* base = static_cast<Bits*>(packed);
  std::size_t offset = 0;  // get() is called in order, so a running offset suffices
  launch(
      copy_op<Bits>{}, segs.size(),
      [&](std::size_t i) {
        tensor_ref<2> r{{segs[i].ptr, base + offset}, segs[i].count};
        if (!to_packed) std::swap(r.p[0], r.p[1]);
        offset += segs[i].count;
        return r;
      },
      s, who);
}
}  // namespace detail

//! dst ← concat(src) · scale. Any dtype when scale == 1 (a copy); floating types otherwise.
inline void pack(std::span<const segment> src, void* dst, dtype t, double scale, cudaStream_t s) {
  check_segments(src, "pack");
  if (dst == nullptr) {
    for (const auto& g : src)
      if (g.count) throw config_error("pack: the destination is null");
    return;
  }
  if (scale == 1.0) {
    visit_size(t,
               [&]<class Bits>(std::type_identity<Bits>) { detail::copy_segments<Bits>(src, dst, true, s, "pack"); });
    return;
  }
  visit_float(t, "pack with a scale ≠ 1", [&]<class Element>(std::type_identity<Element>) {
    auto* base = static_cast<storage_of<Element>*>(dst);
    std::size_t offset = 0;
    launch(
        scale_op<Element>{{}, static_cast<compute_of<Element>>(scale)}, src.size(),
        [&](std::size_t i) {
          tensor_ref<2> r{{src[i].ptr, base + offset}, src[i].count};
          offset += src[i].count;
          return r;
        },
        s, "pack");
  });
}

//! Scatters contiguous src into the segments dst (any dtype).
inline void unpack(const void* src, std::span<const segment> dst, dtype t, cudaStream_t s) {
  check_segments(dst, "unpack");
  if (src == nullptr) {
    for (const auto& g : dst)
      if (g.count) throw config_error("unpack: the source is null");
    return;
  }
  visit_size(t, [&]<class Bits>(std::type_identity<Bits>) {
    detail::copy_segments<Bits>(dst, const_cast<void*>(src), false, s, "unpack");
  });
}

//! p[0..count) ← p · factor (floating types; a no-op for factor == 1).
inline void scale(void* p, std::size_t count, dtype t, double factor, cudaStream_t s) {
  if (count == 0 || factor == 1.0) return;
  if (p == nullptr) throw config_error("scale: null pointer for " + std::to_string(count) + " elements");
  visit_float(t, "scale", [&]<class Element>(std::type_identity<Element>) {
    launch(
        scale_op<Element>{{}, static_cast<compute_of<Element>>(factor)}, 1,
        [&](std::size_t) { return tensor_ref<2>{{p, p}, count}; }, s, "scale");
  });
}

//! dst[0..count) ← dst + src (floating types).
inline void add(void* dst, const void* src, std::size_t count, dtype t, cudaStream_t s) {
  if (count == 0) return;
  if (dst == nullptr || src == nullptr)
    throw config_error("add: null pointer for " + std::to_string(count) + " elements");
  visit_float(t, "add", [&]<class Element>(std::type_identity<Element>) {
    launch(
        add_op<Element>{}, 1, [&](std::size_t) { return tensor_ref<2>{{const_cast<void*>(src), dst}, count}; }, s,
        "add");
  });
}

}  // namespace lockstep::cuda::kernels
