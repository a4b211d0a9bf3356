#pragma once
//! How a multi-tensor launch is shaped, as one value (CCCL's tuning-policy idea): every
//! launch knob of the kernel engine in a plain aggregate with named fields, ==, and <<, and
//! one constexpr selector that picks it from what an op is (its kind and element size). The
//! engine takes it as a template argument, so a benchmark can sweep it and a test can print
//! it; LOCKSTEP_DEBUG_KERNELS=1 prints each op's tuning at its first launch.

#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>

namespace lockstep::cuda::kernels {

//! What an op does to memory, for the selector.
enum class op_kind {
  streaming,  //!< one or two lists, a few instructions an element: bound by memory latency
  optimizer,  //!< four or five lists and a longer update: bound by registers
};

inline const char* name_of(op_kind k) { return k == op_kind::streaming ? "streaming" : "optimizer"; }

struct tuning {
  int block_threads = 512;  //!< threads per block
  int chunk_elems = 16384;  //!< elements per block (a multiple of every vector width)
  int vector_bytes = 16;    //!< bytes per vector access of list 0
  int unroll = 1;           //!< vector accesses a thread issues before the first use
  int min_blocks = 1;       //!< resident blocks per SM compiled for (caps registers)

  //! Elements per vector access when list 0 holds elem_bytes-byte elements.
  constexpr int width(int elem_bytes) const { return vector_bytes / elem_bytes; }
  constexpr bool operator==(const tuning&) const = default;
};

inline std::ostream& operator<<(std::ostream& os, const tuning& t) {
  return os << "{block_threads " << t.block_threads << ", chunk_elems " << t.chunk_elems << ", vector_bytes "
            << t.vector_bytes << ", unroll " << t.unroll << ", min_blocks " << t.min_blocks << "}";
}
inline std::string to_string(const tuning& t) {
  std::ostringstream os;
  os << t;
  return os.str();
}

//! The tuning of an op of `kind` whose list 0 holds elem_bytes-byte elements (docs/kernels.md
//! has the measurements behind each choice):
//!  - streaming: every load of a chunk issued before the first use (one memory wait per block:
//!    unroll = chunk / (width · threads), at most 8), and 3 blocks per SM for 1- and 2-byte
//!    elements (their registers allow it), 2 otherwise.
//!    The ops that end a chunk with a block reduction (the sum of squares) run the same:
//!    4× longer chunks, so 4× fewer reductions, measured no faster (bench_kernels sweeps it).
//!  - optimizer: 1 (16-bit parameters, whose states are twice as wide) or 2 vectors in flight
//!    and two blocks per SM (registers capped at 64 a thread: no spills, checked with ptxas):
//!    AdamW's IEEE divisions and square roots need the second block's warps to hide their
//!    latency — on an H200, 0.68 → 0.94 of the copy bandwidth (f32) against one block per SM.
constexpr tuning select_tuning(op_kind kind, int elem_bytes) {
  tuning t;
  const int width = t.width(elem_bytes);
  if (kind == op_kind::streaming) {
    const int need = t.chunk_elems / width / t.block_threads;
    t.unroll = need < 1 ? 1 : need < 8 ? need : 8;
    t.min_blocks = elem_bytes <= 2 ? 3 : 2;
  } else {
    t.unroll = elem_bytes == 2 ? 1 : 2;
    t.min_blocks = 2;
  }
  return t;
}

static_assert(select_tuning(op_kind::streaming, 4).unroll == 8);
static_assert(select_tuning(op_kind::streaming, 2).unroll == 4 && select_tuning(op_kind::streaming, 2).min_blocks == 3);

}  // namespace lockstep::cuda::kernels
