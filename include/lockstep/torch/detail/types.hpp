#pragma once
//! Element types between libtorch and lockstep: which torch scalar types lockstep carries (and
//! as what), and the torch type of a floating lockstep type (what TorchModule::attach lends).

#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"

namespace lockstep::detail {

//! lockstep's element type of a torch scalar type, if it carries it.
inline std::optional<dtype> carried_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return dtype::f32;
    case c10::ScalarType::Double: return dtype::f64;
    case c10::ScalarType::Half: return dtype::f16;
    case c10::ScalarType::BFloat16: return dtype::bf16;
    case c10::ScalarType::Int: return dtype::i32;
    case c10::ScalarType::Long: return dtype::i64;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool: return dtype::u8;
    default: return std::nullopt;
  }
}

//! The torch scalar type of a floating lockstep element type (what attach lends).
inline c10::ScalarType torch_type_of(dtype t) {
  switch (t) {
    case dtype::f32: return c10::ScalarType::Float;
    case dtype::f64: return c10::ScalarType::Double;
    case dtype::f16: return c10::ScalarType::Half;
    case dtype::bf16: return c10::ScalarType::BFloat16;
    default: throw config_error(std::string("lockstep::TorchModule: no floating torch type for ") + name_of(t));
  }
}

//! The same, or config_error; what = a name for the message.
inline dtype dtype_of_torch(c10::ScalarType t, const std::string& what) {
  if (const auto d = carried_dtype(t)) return *d;
  throw config_error("lockstep::TorchModule: " + what + " has torch element type " + std::string(c10::toString(t)) +
                     "; lockstep carries float, double, half, bfloat16, int32, int64, uint8 and bool");
}

}  // namespace lockstep::detail
