#pragma once
#include <cstdint>

namespace lockstep {

//! Reduction operators every communicator supports.
enum class reduce_op : std::uint8_t { sum, avg, max, min };

inline constexpr const char* name_of(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "?";
}

}  // namespace lockstep
