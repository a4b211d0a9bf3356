#pragma once
//! The number formats lockstep can put fp32 numbers on the wire in: a run-time value, for the
//! gradient wire (AnyWire, parallel/gradient_wire.hpp) and the values' all-gather
//! (ShardedOptimizer::gather_wire, parallel/policies.hpp).

#include <string>
#include <string_view>

#include "lockstep/core/error.hpp"

namespace lockstep {

//! fp32 (exact, 4 bytes per value), bf16 (round to nearest even, 2 bytes) or int8 (blockwise:
//! an fp32 scale per 256 values, about 1.016 bytes; core/detail/int8_blocks.hpp).
enum class wire_format { fp32, bf16, int8 };

//! "fp32", "bf16" or "int8"; anything else is refused, naming the three.
inline wire_format wire_format_of(std::string_view name) {
  if (name == "fp32") return wire_format::fp32;
  if (name == "bf16") return wire_format::bf16;
  if (name == "int8") return wire_format::int8;
  throw config_error("lockstep: no wire called '" + std::string(name) + "'; say fp32, bf16 or int8");
}

//! The name wire_format_of reads.
constexpr const char* name_of(wire_format f) noexcept {
  return f == wire_format::bf16 ? "bf16" : f == wire_format::int8 ? "int8" : "fp32";
}

}  // namespace lockstep
