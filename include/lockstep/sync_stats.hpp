#pragma once
#include <cstddef>
#include <cstdint>

namespace lockstep {

//! What gradient synchronisation has cost so far (per rank).
struct sync_stats {
  std::uint64_t micro_steps = 0;      //!< step() calls
  std::uint64_t syncs = 0;            //!< micro-steps that averaged gradients
  std::uint64_t buckets_reduced = 0;  //!< bucket all-reduces issued
  std::uint64_t bytes_reduced = 0;    //!< bytes all-reduced (this rank's buffers)
  double comm_seconds = 0;            //!< host time spent issuing and waiting on collectives
  std::size_t bucket_count = 0;       //!< buckets in the current plan (all element types)
  std::size_t arena_bytes = 0;        //!< gradient arena size (all element types)
  bool zero_copy = false;             //!< the model's gradients live in the arena
  bool rebuilt = false;               //!< the plan was reordered after the first step
};

}  // namespace lockstep
