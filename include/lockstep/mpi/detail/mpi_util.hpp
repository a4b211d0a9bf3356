#pragma once
//! What MpiComm needs from MPI beyond the collectives: error checking (LOCKSTEP_TRY_MPI),
//! lockstep's element types and reductions as MPI's, and initialising MPI on demand.

#include <mpi.h>

#include <cstdint>
#include <string>

#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"

//! Throws lockstep::mpi_error naming the call, file:line and MPI_Error_string's text when an
//! MPI call does not return MPI_SUCCESS (needs MPI_ERRORS_RETURN on its communicator).
#define LOCKSTEP_TRY_MPI(...) ::lockstep::detail::check_mpi((__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)

namespace lockstep {

namespace detail {

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

inline void check_mpi(int code, const char* call, const char* file, int line) {
  if (code != MPI_SUCCESS) throw mpi_error(call_failure(call, file, line, mpi_error_string(code)));
}

inline MPI_Datatype mpi_type_of(dtype t) {
  switch (t) {
    case dtype::u8: return MPI_UNSIGNED_CHAR;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    default: break;
  }
  throw config_error(std::string("MpiComm: element type ") + name_of(t) +
                     " has no MPI datatype; reduce f32/f64 gradients on the CPU, or use "
                     "NcclComm for half precision");
}

//! u8 sum that wraps modulo 256. Open MPI 4.1.x's vectorised MPI_SUM on MPI_UNSIGNED_CHAR
//! saturates at 255 for longer buffers (seen with 4.1.4: wrong from 64 elements on), so u8
//! sums use this user-defined operation instead.
inline MPI_Op mpi_u8_sum() {
  static const MPI_Op op = [] {
    MPI_Op o = MPI_OP_NULL;
    LOCKSTEP_TRY_MPI(MPI_Op_create(
        [](void* in, void* inout, int* len, MPI_Datatype*) {
          const auto* a = static_cast<const unsigned char*>(in);
          auto* b = static_cast<unsigned char*>(inout);
          for (int i = 0; i < *len; ++i) b[i] = static_cast<unsigned char>(b[i] + a[i]);
        },
        1, &o));
    return o;
  }();
  return op;
}

inline MPI_Op mpi_op_of(reduce_op op, dtype t) {
  if (t == dtype::u8 && (op == reduce_op::sum || op == reduce_op::avg)) return mpi_u8_sum();
  switch (op) {
    case reduce_op::max: return MPI_MAX;
    case reduce_op::min: return MPI_MIN;
    default: return MPI_SUM;  // avg = sum, then a division by the number of ranks
  }
}

//! Whether [a, a+an) and [b, b+bn) share a byte.
inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return an != 0 && bn != 0 && x < y + bn && y < x + an;
}

//! Initialises MPI (MPI_THREAD_FUNNELED) unless the application already did; when lockstep
//! initialised it, MPI_Finalize runs at exit (static destruction).
inline void mpi_init() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    throw config_error("MpiComm: MPI was already finalized; create communicators before "
                       "MPI_Finalize");
  int ready = 0;
  MPI_Initialized(&ready);
  if (ready) return;
  struct finalizer {
    finalizer() {
      int provided = 0;
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      if (rc != MPI_SUCCESS) throw mpi_error(call_failure("MPI_Init_thread", __FILE__, __LINE__, mpi_error_string(rc)));
    }
    ~finalizer() {
      int done = 0;
      MPI_Finalized(&done);
      if (!done) MPI_Finalize();
    }
  };
  static finalizer once;
}

}  // namespace detail
}  // namespace lockstep
