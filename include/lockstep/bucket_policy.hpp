#pragma once
#include <cstddef>

namespace lockstep {

//! Tuning for gradient buckets, as a value struct: the first bucket is small so that
//! communication starts early in backward; the rest are capped (PyTorch DDP's defaults).
//! Buckets are byte ranges of the gradient arena, so a tensor larger than a bucket simply
//! spans several.
struct BucketPolicy {
  std::size_t first_bytes = std::size_t{1} << 20;  //!< 1 MiB
  std::size_t cap_bytes = std::size_t{25} << 20;   //!< 25 MiB
  bool rebuild_after_first_step = true;            //!< reorder by observed arrival, once
};

}  // namespace lockstep
