#pragma once
//! Who is still missing at the start-up rendezvous. Each rank announces itself with a key
//! (arrival_key); the host of a TcpStore watches those keys on its server thread and, while
//! some are missing, reports which (core/progress.hpp throttles the lines). Plain set()s, so
//! the wire protocol is unchanged.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/core/progress.hpp"

namespace lockstep::detail {

//! The key rank r sets once it reached the job's store.
inline std::string arrival_key(int rank) { return "lockstep/arrived/" + std::to_string(rank); }

//! Sorted ranks as short text: "3, 7", "0-5, 9"; after 16 groups "(+N more)".
inline std::string rank_list_text(const std::vector<int>& ranks) {
  std::string out;
  std::size_t groups = 0, i = 0;
  while (i < ranks.size()) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (groups == 16) {
      out += " (+" + std::to_string(ranks.size() - i) + " more)";
      break;
    }
    out += (groups ? ", " : "") + std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    ++groups;
    i = j + 1;
  }
  return out;
}

//! "lockstep: waiting for ranks 3, 7 (2 of 8 missing) for 15 s at host:port".
inline std::string waiting_for_ranks_line(const std::vector<int>& missing, int world, double seconds,
                                          std::string_view where) {
  return std::string("lockstep: waiting for rank") + (missing.size() == 1 ? " " : "s ") + rank_list_text(missing) +
         " (" + std::to_string(missing.size()) + " of " + std::to_string(world) + " missing) for " +
         duration_text(seconds) + " at " + std::string(where);
}

//! The host's watch over the world's arrival keys. poll() is called from the server's loop
//! with a way to test a key; it looks at the keys only when a line is due or, once it has
//! reported, to notice the last arrival (then a closing line). Arrived ranks are not asked
//! again.
class arrival_watch {
 public:
  arrival_watch(int world, std::string where, progress p)
      : world_(world), where_(std::move(where)), p_(std::move(p)), arrived_(static_cast<std::size_t>(world), false) {}

  //! Whether the watch is over (every rank arrived, or progress is off).
  template <class Has>
  bool poll(Has&& has) {
    if (!p_.enabled()) return true;
    if (!p_.reported() && !p_.due()) return false;
    std::vector<int> missing;
    for (int r = 0; r < world_; ++r) {
      if (arrived_[static_cast<std::size_t>(r)]) continue;
      if (has(arrival_key(r))) arrived_[static_cast<std::size_t>(r)] = true;
      else missing.push_back(r);
    }
    if (missing.empty()) {
      p_.finish("lockstep: all " + std::to_string(world_) + " ranks arrived after " + duration_text(p_.seconds()) +
                " at " + where_);
      return true;
    }
    if (p_.due()) p_.report(waiting_for_ranks_line(missing, world_, p_.seconds(), where_));
    return false;
  }

  //! When poll() next has something to do: the next line, or soon once it has reported.
  progress::clock::time_point next_check() const {
    if (!p_.reported()) return p_.next_due();
    return std::min(p_.next_due(), progress::clock::now() + std::chrono::milliseconds(200));
  }

 private:
  int world_;
  std::string where_;
  progress p_;
  std::vector<bool> arrived_;
};

}  // namespace lockstep::detail
