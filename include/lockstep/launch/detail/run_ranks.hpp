#pragma once
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "lockstep/core/error.hpp"

namespace lockstep {
namespace detail {

//! Runs f(r) on n threads, aborting the group on the first failure; rethrows the root
//! cause (not the aborted_errors it triggered on the other ranks). A rank released by an
//! abort passes the first failure on unchanged, so every group hears the same cause.
template <class F, class Abort>
void run_ranks(int n, F&& f, Abort&& abort) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (const aborted_error& e) {
        // Released by another rank's failure: pass that one on, not this rank's release.
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        abort(e.cause().empty() ? "rank " + std::to_string(r) + " failed: " + e.what() : e.cause());
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        abort("rank " + std::to_string(r) + " failed: " + e.what());
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        abort("rank " + std::to_string(r) + " failed with a non-standard exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const aborted_error&) {
      if (!first) first = e;
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace detail

}  // namespace lockstep
