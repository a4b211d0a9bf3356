#pragma once
//! Error types. Host code throws these; nothing throws from device code or helper
//! threads (those capture the exception and it is rethrown on the caller's thread).

#include <stdexcept>
#include <string>
#include <utility>

namespace lockstep {

//! Base of every lockstep error.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

//! A configuration or input the user can fix: the message says what and how.
class config_error : public error {
 public:
  using error::error;
};

//! Ranks disagree (model shapes, collective order, bucket plan): continuing would
//! silently corrupt training, so every rank raises this instead.
class mismatch_error : public error {
 public:
  using error::error;
};

//! A wait on another rank ran past its timeout.
class timeout_error : public error {
 public:
  using error::error;
};

//! Another rank failed; this rank stopped waiting for it. cause(): that first failure alone
//! (empty when unknown), so a rank released by it can pass it on unchanged.
class aborted_error : public error {
 public:
  using error::error;
  aborted_error(const std::string& what, std::string cause) : error(what), cause_(std::move(cause)) {}
  const std::string& cause() const noexcept { return cause_; }

 private:
  std::string cause_;
};

//! A failed CUDA runtime call (see LOCKSTEP_TRY_CUDA in lockstep/cuda/error.cuh).
class cuda_error : public error {
 public:
  using error::error;
};

//! A failed NCCL call (see LOCKSTEP_TRY_NCCL).
class nccl_error : public error {
 public:
  using error::error;
};

//! A failed MPI call.
class mpi_error : public error {
 public:
  using error::error;
};

//! A checkpoint that cannot be read or written.
class checkpoint_error : public error {
 public:
  using error::error;
};

namespace detail {
//! "call failed at file:line: library message" — the shape of every library-call error.
inline std::string call_failure(const char* call, const char* file, int line, const std::string& what) {
  return std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " + what;
}
}  // namespace detail

}  // namespace lockstep
