#pragma once
//! The all-reduce probe of the speed-up estimate (estimate.hpp): measured all-reduce times
//! (probe_point, probe), their file (parse_probe, read_probe, write_probe; the format is in
//! docs/observe.md, "Speed-up estimate"), the time curve read off them (comm_curve) and the
//! measurement itself (measure_all_reduce).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <istream>
#include <ostream>
#include <sstream>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "lockstep/comm/detail/host_collectives.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/reduce_op.hpp"

namespace lockstep {

//! One measured all-reduce: `bytes` per rank on `ranks` ranks took `seconds` (the slowest
//! rank, median of several trials).
struct probe_point {
  int ranks = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
};

//! A probe: measured points and free-text notes (device, date, how it was measured).
struct probe {
  std::vector<probe_point> points;
  std::vector<std::string> notes;
};

//! Reads a probe file (docs/observe.md): a first line `lockstep-probe 1`, then lines
//! `all_reduce ranks=R bytes=N ms=T [dtype=D]`; `#` starts a comment (kept as a note).
//! `source` names the input in error messages.
inline probe parse_probe(std::istream& in, const std::string& source) {
  const std::string form = " (a point is: all_reduce ranks=4 bytes=268435456 ms=1.203)";
  probe p;
  std::string line;
  int n = 0;
  bool header = false;
  while (std::getline(in, line)) {
    ++n;
    if (const auto hash = line.find('#'); hash != std::string::npos) {
      const auto from = line.find_first_not_of("# \t", hash);
      if (line.find_first_not_of(" \t") == hash && from != std::string::npos) p.notes.push_back(line.substr(from));
      line.erase(hash);  // a whole-line comment is a note; a trailing one is dropped
    }
    std::istringstream ss(line);
    std::string kind;
    if (!(ss >> kind)) continue;
    const std::string at = source + ":" + std::to_string(n) + ": ";
    if (!header) {
      std::string v;
      if (kind != "lockstep-probe" || !(ss >> v) || v != "1")
        throw config_error(at + "not a lockstep probe: its first line must be 'lockstep-probe 1' "
                                "(lockstep-info --estimate --save-probe FILE writes one)");
      header = true;
      continue;
    }
    if (kind != "all_reduce")
      throw config_error(at + "unknown kind '" + kind + "'; only all_reduce points are read" + form);
    probe_point pt;
    bool has_ms = false;
    for (std::string kv; ss >> kv;) {
      const auto eq = kv.find('=');
      const std::string key = kv.substr(0, eq), val = eq == std::string::npos ? "" : kv.substr(eq + 1);
      if (key != "ranks" && key != "bytes" && key != "ms" && key != "dtype")
        throw config_error(at + "unknown field '" + kv + "'" + form);
      std::size_t used = 0;
      try {
        if (val.empty() || val[0] == '-' || val[0] == '+') used = 0;  // stoull would wrap "-5"
        else if (key == "ranks") pt.ranks = std::stoi(val, &used);
        else if (key == "bytes") pt.bytes = std::stoull(val, &used);
        else if (key == "ms") pt.seconds = std::stod(val, &used) / 1e3, has_ms = true;
        else used = val.size();            // dtype: a note on what was measured
      } catch (const std::logic_error&) {  // stoi/stod: not a number, or out of range
        used = 0;
      }
      if (used == 0 || used != val.size()) throw config_error(at + "'" + kv + "' is not key=number" + form);
    }
    if (pt.ranks < 2 || pt.bytes == 0 || !has_ms || !(pt.seconds > 0) || !std::isfinite(pt.seconds))
      throw config_error(at + "needs ranks ≥ 2, bytes > 0 and ms > 0" + form);
    p.points.push_back(pt);
  }
  if (!header) throw config_error(source + ": empty; a probe starts with the line 'lockstep-probe 1'");
  if (p.points.empty()) throw config_error(source + ": no all_reduce points" + form);
  return p;
}

inline probe read_probe(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw config_error("cannot open probe file " + path + " (give a file written by --save-probe)");
  return parse_probe(in, path);
}

//! Writes `p` in the format parse_probe reads (notes as comments first).
inline void write_probe(std::ostream& out, const probe& p) {
  out << "lockstep-probe 1\n";
  for (const auto& n : p.notes) out << "# " << n << "\n";
  char buf[128];
  for (const auto& pt : p.points) {
    std::snprintf(buf, sizeof buf, "all_reduce ranks=%d bytes=%llu ms=%.6g\n", pt.ranks,
                  static_cast<unsigned long long>(pt.bytes), pt.seconds * 1e3);
    out << buf;
  }
}

//! All-reduce time as a function of bytes and ranks, from a probe. For each probed rank count:
//! linear between measured sizes; below the smallest, the line from (0, α) to it; above the
//! largest, on from it at the fitted 1/β per byte. α (latency) and β (bandwidth) are the least-squares fit
//! of t = α + x/β in relative error, α ≥ 0. A rank count not probed takes the nearest probed
//! one, p, with the bandwidth part scaled by the bus-bandwidth factor: α + (t_p − α)·k(G)/k(p),
//! k(n) = 2(n−1)/n (same α and bus bandwidth; true for rings within one host, not across).
//! A probed rank count's α is capped by the α of every larger probed count (a ring's latency
//! grows with its length).
class comm_curve {
 public:
  explicit comm_curve(const probe& p) {
    for (const auto& pt : p.points) {
      if (pt.ranks < 2 || pt.bytes == 0 || !(pt.seconds > 0) || !std::isfinite(pt.seconds))
        throw config_error("comm_curve: a probe point needs ranks ≥ 2, bytes > 0 and a time > 0; got ranks=" +
                           std::to_string(pt.ranks) + " bytes=" + std::to_string(pt.bytes));
      auto it = std::find_if(lines_.begin(), lines_.end(), [&](const line& l) { return l.ranks == pt.ranks; });
      if (it == lines_.end()) it = lines_.insert(lines_.end(), line{pt.ranks, {}, 0, 0});
      it->pts.push_back({static_cast<double>(pt.bytes), pt.seconds, 1});
    }
    if (lines_.empty())
      throw config_error("comm_curve: the probe has no points; measure one (lockstep-info --estimate)");
    for (auto& l : lines_) fit(l);
    std::sort(lines_.begin(), lines_.end(), [](const line& a, const line& b) { return a.ranks < b.ranks; });
    // A ring's latency grows with its length: fewer ranks take at most the latency fitted for
    // more (which a probe reaching small sizes pins down; large sizes alone leave it loose).
    for (std::size_t i = lines_.size(); i-- > 1;) lines_[i - 1].alpha = std::min(lines_[i - 1].alpha, lines_[i].alpha);
  }

  static double bus_factor(int ranks) { return 2.0 * (ranks - 1) / ranks; }

  //! Seconds for an all-reduce of `bytes` per rank on `ranks` ranks (0 on one rank).
  double all_reduce(int ranks, double bytes) const {
    if (ranks <= 1 || bytes <= 0) return 0;
    const line& l = nearest(ranks);
    return l.alpha + (along(l, bytes) - l.alpha) * bus_factor(ranks) / bus_factor(l.ranks);
  }
  //! A reduce-scatter (or all-gather) of `bytes` in all: α plus half the all-reduce's bandwidth part.
  double reduce_scatter(int ranks, double bytes) const {
    if (ranks <= 1 || bytes <= 0) return 0;
    const double a = nearest(ranks).alpha;
    return a + (all_reduce(ranks, bytes) - a) / 2;
  }
  double latency(int ranks) const { return nearest(ranks).alpha; }
  //! nccl-tests' bus bandwidth (bytes/s) of the fit, k(p)·β; the same for every rank count.
  double bus_bandwidth(int ranks) const {
    const line& l = nearest(ranks);
    return bus_factor(l.ranks) / l.per_byte;
  }
  //! The probed rank count the curve uses for `ranks`, and the probed size range there.
  int probed_ranks(int ranks) const { return nearest(ranks).ranks; }
  double smallest_bytes(int ranks) const { return nearest(ranks).pts.front().x; }
  double largest_bytes(int ranks) const { return nearest(ranks).pts.back().x; }
  std::vector<int> ranks_probed() const {
    std::vector<int> r;
    for (const auto& l : lines_) r.push_back(l.ranks);
    return r;
  }

 private:
  struct pt {
    double x, t;
    int n;
  };
  struct line {
    int ranks;
    std::vector<pt> pts;
    double alpha, per_byte;  // seconds, seconds per byte (1/β)
  };
  std::vector<line> lines_;

  static void fit(line& l) {
    std::sort(l.pts.begin(), l.pts.end(), [](const pt& a, const pt& b) { return a.x < b.x; });
    std::vector<pt> merged;  // repeated sizes: their mean
    for (const auto& p : l.pts) {
      if (!merged.empty() && merged.back().x == p.x) {
        auto& m = merged.back();
        m.t = (m.t * m.n + p.t) / (m.n + 1), ++m.n;
      } else {
        merged.push_back(p);
      }
    }
    l.pts = merged;
    // Weighted least squares, weight 1/t²: minimises Σ((α + s·x − t)/t)².
    double w = 0, wx = 0, wxx = 0, wt = 0, wxt = 0;
    for (const auto& p : l.pts) {
      const double k = 1 / (p.t * p.t);
      w += k, wx += k * p.x, wxx += k * p.x * p.x, wt += k * p.t, wxt += k * p.x * p.t;
    }
    const double det = w * wxx - wx * wx;
    l.alpha = l.pts.size() > 1 && det > 0 ? (wt * wxx - wx * wxt) / det : 0;
    l.per_byte = l.pts.size() > 1 && det > 0 ? (w * wxt - wx * wt) / det : 0;
    if (l.alpha < 0 || l.per_byte <= 0) l.alpha = 0, l.per_byte = wxt / wxx;  // through the origin
    l.alpha = std::min(l.alpha, l.pts.front().t);
  }
  const line& nearest(int ranks) const {
    const line* best = &lines_.front();
    for (const auto& l : lines_)
      if (std::abs(l.ranks - ranks) <= std::abs(best->ranks - ranks)) best = &l;
    return *best;
  }
  static double along(const line& l, double x) {
    const auto& p = l.pts;
    if (x <= p.front().x) return l.alpha + (p.front().t - l.alpha) * x / p.front().x;
    if (x >= p.back().x) return p.back().t + (x - p.back().x) * l.per_byte;
    std::size_t i = 1;
    while (p[i].x < x) ++i;
    return p[i - 1].t + (p[i].t - p[i - 1].t) * (x - p[i - 1].x) / (p[i].x - p[i - 1].x);
  }
};

//! Measures all-reduce (avg) of `t` elements on `comm` at each size in bytes: a collective;
//! every rank returns the same points. Per size: warm-up calls, then `trials` batches of
//! back-to-back calls between barriers (host clock; a barrier waits for the device), minus the
//! time of a barrier alone, per call; the slowest rank of each batch; the median batch.
template <communicator C>
std::vector<probe_point> measure_all_reduce(C& comm, std::span<const std::uint64_t> sizes, dtype t, int trials = 7) {
  std::vector<probe_point> out;
  if (comm.size() < 2 || sizes.empty()) return out;
  using clock = std::chrono::steady_clock;
  const std::uint64_t most = *std::max_element(sizes.begin(), sizes.end());
  auto mem = comm.memory();
  auto buf = mem.allocate(most);
  mem.zero(buf.get(), most);
  auto slowest_median = [&](std::vector<double> v) {
    detail::host_all_reduce(comm, std::span<double>(v), reduce_op::max);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> v(static_cast<std::size_t>(std::max(trials, 1)));
  for (auto& x : v) {
    comm.barrier();
    const auto t0 = clock::now();
    comm.barrier();
    x = std::chrono::duration<double>(clock::now() - t0).count();
  }
  const double barrier_alone = slowest_median(v);
  for (const std::uint64_t bytes : sizes) {
    const std::size_t count = bytes / size_of(t);
    const int reps = static_cast<int>(
        std::clamp<std::uint64_t>((std::uint64_t{256} << 20) / std::max<std::uint64_t>(bytes, 1), 2, 64));
    for (int i = 0; i < 3; ++i) comm.all_reduce(buf.get(), buf.get(), count, t, reduce_op::avg).wait();
    for (auto& x : v) {
      comm.barrier();
      const auto t0 = clock::now();
      for (int i = 0; i < reps; ++i) comm.all_reduce(buf.get(), buf.get(), count, t, reduce_op::avg).wait();
      comm.barrier();
      x = std::max(0.0, std::chrono::duration<double>(clock::now() - t0).count() - barrier_alone) / reps;
    }
    out.push_back({comm.size(), count * size_of(t), std::max(slowest_median(v), 1e-9)});
  }
  return out;
}

}  // namespace lockstep
