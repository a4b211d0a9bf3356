#pragma once
//! Speed-up estimate: what data parallelism will cost a model on this machine, before
//! running it. Inputs: the gradients (a parameter count, or tensor sizes, and the bytes of one
//! element), the 1-GPU step time T, the fraction of T that is backward, the optimizer's share,
//! the bucket sizes, and an all-reduce time curve measured here (a probe). Output, for 1..G
//! GPUs: the step time, speed-up and scaling efficiency with no overlap, with overlap (what
//! DataParallel does) and sharded (ShardedOptimizer). `lockstep-info --estimate` measures the
//! probe and prints the table; docs/observe.md ("Speed-up estimate") has the formulas, the probe
//! file format and the model's check against bench/RESULTS.md.
//!
//! The model, all times in seconds, S = gradient bytes, B = backward_fraction·T, O = the
//! optimizer's part of T, pre = T − B − O (forward and the rest, never overlapped):
//!  - A(x): all-reduce of x bytes on G ranks, read off the probe (comm_curve);
//!    RS(x) = AG(x) = α + (A(x) − α)/2: a ring all-reduce is a reduce-scatter then an
//!    all-gather, each moving (G−1)/G of the bytes.
//!  - Launch units u (bytes s_u) with ready times r_u: the gradient bytes, in the order
//!    backward makes them final, cut into buckets (first_bucket_bytes, then bucket_bytes);
//!    consecutive buckets holding one tensor only go out together (DataParallel's launch
//!    units). Backward time is spent ∝ bytes; a late tensor (a tied embedding) is computed
//!    first but final only at the end of backward.
//!  - no overlap:  step = T + A(S)                (one all-reduce after backward)
//!  - overlap:     e_u = max(r_u, e_{u−1}) + A(s_u)            (collectives in order)
//!                 o_u = max(B, e_u, o_{u−1}) + O·s_u/S        (optimizer per unit)
//!                 step = pre + o_last;  with O = 0: T + max(0, e_last − B)
//!  - sharded:     as overlap with RS for A and O/G for O, then the all-gathers, queued
//!                 behind the reduce-scatters: a_0 = e_last, a_u = max(o_u, a_{u−1}) + AG(s_u);
//!                 step = pre + a_last
//!  - speed-up = G·T/step (samples per second, per-GPU batch fixed); efficiency = T/step.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/observe/probe.hpp"

namespace lockstep {

//! A gradient tensor, in the model's registration order. `late`: final only at the end of
//! backward although computed at its start (a tied embedding's gradient).
struct grad_tensor {
  std::string name;
  std::uint64_t bytes = 0;
  bool late = false;
};

//! Reads tensor shapes, one per line `name dim dim ...` (`#` comments), as bench_sync's
//! --shapes files; each tensor's bytes = product of dims × element_bytes.
inline std::vector<grad_tensor> parse_shapes(std::istream& in, const std::string& source, std::size_t element_bytes) {
  std::vector<grad_tensor> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    line.erase(std::min(line.find('#'), line.size()));
    std::istringstream ss(line);
    grad_tensor t;
    if (!(ss >> t.name)) continue;
    std::uint64_t count = 1;
    int dims = 0;
    for (std::string d; ss >> d; ++dims) {
      if (d.find_first_not_of("0123456789") != std::string::npos || d.size() > 12 || std::stoull(d) == 0)
        throw config_error(source + ":" + std::to_string(n) + ": '" + d +
                           "' is not a positive dimension (a line is: name 768 3072)");
      count *= std::stoull(d);
    }
    if (dims == 0)
      throw config_error(source + ":" + std::to_string(n) + ": " + t.name +
                         " has no dimensions (a line is: name 768 3072)");
    t.bytes = count * element_bytes;
    out.push_back(t);
  }
  if (out.empty()) throw config_error(source + ": no tensors (a line is: name 768 3072)");
  return out;
}

//! The model's inputs (seconds and bytes). Defaults: backward 2/3 of the step (backward costs
//! about twice the forward), no separate optimizer time, lockstep's default buckets.
struct estimate_input {
  std::uint64_t params = 0;          //!< used when `tensors` is empty
  std::size_t element_bytes = 4;     //!< of one gradient element: 4 f32, 2 bf16/f16
  std::vector<grad_tensor> tensors;  //!< optional, registration order; bytes already × element
  double step_seconds = 0;           //!< T: one step on one GPU, everything included
  double backward_fraction = 2.0 / 3.0;
  double optimizer_seconds = 0;  //!< O: part of T, run per bucket after backward
  std::uint64_t first_bucket_bytes = std::uint64_t{1} << 20;
  std::uint64_t bucket_bytes = std::uint64_t{25} << 20;

  std::uint64_t gradient_bytes() const {
    std::uint64_t s = 0;
    for (const auto& t : tensors) s += t.bytes;
    return tensors.empty() ? params * element_bytes : s;
  }
};

//! One all-reduce launch: its bytes and when, into backward, its last gradient is final.
struct launch_unit {
  std::uint64_t bytes = 0;
  double ready_seconds = 0;
};

//! The launch units of `in` (see the model at the top of this file).
inline std::vector<launch_unit> launch_units(const estimate_input& in) {
  const double S = static_cast<double>(in.gradient_bytes()), B = in.backward_fraction * in.step_seconds;
  std::vector<launch_unit> units;
  if (in.tensors.empty()) {  // a stream of bytes made at an even rate: one unit per bucket
    std::uint64_t cap = in.first_bucket_bytes;
    for (std::uint64_t done = 0; done < in.gradient_bytes(); cap = in.bucket_bytes) {
      const std::uint64_t b = std::min(cap, in.gradient_bytes() - done);
      done += b;
      units.push_back({b, B * static_cast<double>(done) / S});
    }
    return units;
  }
  // Backward order: reverse registration, late tensors last; the time each one is final.
  std::vector<std::pair<const grad_tensor*, double>> order;
  double t = 0;
  for (const auto& x : in.tensors)
    if (x.late) t += B * static_cast<double>(x.bytes) / S;  // computed first
  for (auto it = in.tensors.rbegin(); it != in.tensors.rend(); ++it)
    if (!it->late) order.push_back({&*it, t += B * static_cast<double>(it->bytes) / S});
  for (const auto& x : in.tensors)
    if (x.late) order.push_back({&x, B});
  // Buckets: byte ranges in that order; `only`: the bucket's one tensor (null when several).
  struct bucket {
    std::uint64_t bytes = 0, cap = 0;
    double ready = 0;
    const grad_tensor* only = nullptr;
  };
  std::vector<bucket> buckets;
  for (const auto& [x, ready] : order) {
    for (std::uint64_t left = x->bytes; left > 0;) {
      if (buckets.empty() || buckets.back().bytes == buckets.back().cap)
        buckets.push_back({0, buckets.empty() ? in.first_bucket_bytes : in.bucket_bytes, 0, x});
      bucket& b = buckets.back();
      const std::uint64_t take = std::min(left, b.cap - b.bytes);
      if (b.only != x) b.only = nullptr;
      b.bytes += take, left -= take, b.ready = std::max(b.ready, ready);
    }
  }
  // Consecutive buckets holding one and the same tensor only go out as one launch unit.
  const grad_tensor* unit_only = nullptr;
  for (const auto& b : buckets) {
    if (!units.empty() && b.only != nullptr && b.only == unit_only) {
      units.back().bytes += b.bytes;
      units.back().ready_seconds = std::max(units.back().ready_seconds, b.ready);
    } else {
      units.push_back({b.bytes, b.ready});
      unit_only = b.only;
    }
  }
  return units;
}

//! One way of running on G GPUs: step seconds, speed-up G·T/step, efficiency T/step.
struct mode_estimate {
  double step_seconds = 0;
  double speedup = 0;
  double efficiency = 0;
};

struct estimate_row {
  int gpus = 1;
  mode_estimate no_overlap, overlap, sharded;
};

inline void check_input(const estimate_input& in) {
  if (in.gradient_bytes() == 0) throw config_error("estimate: no gradients (give a parameter count or tensors)");
  if (in.element_bytes == 0) throw config_error("estimate: element_bytes is 0 (4 for f32, 2 for bf16/f16)");
  if (!(in.step_seconds > 0))
    throw config_error("estimate: the 1-GPU step time must be > 0 (measure one step on one GPU)");
  if (!(in.backward_fraction > 0 && in.backward_fraction <= 1))
    throw config_error("estimate: backward_fraction must be in (0, 1] (default 2/3)");
  if (!(in.optimizer_seconds >= 0) ||
      in.backward_fraction * in.step_seconds + in.optimizer_seconds > in.step_seconds * (1 + 1e-12))
    throw config_error("estimate: backward (backward_fraction × step) plus the optimizer time exceed the step time");
  if (in.bucket_bytes == 0 || in.first_bucket_bytes == 0) throw config_error("estimate: bucket sizes must be > 0");
}

//! The estimate for 1..max_gpus GPUs (see the model at the top of this file).
inline std::vector<estimate_row> estimate(const estimate_input& in, const comm_curve& curve, int max_gpus) {
  check_input(in);
  const double T = in.step_seconds, B = in.backward_fraction * T, O = in.optimizer_seconds, pre = T - B - O;
  const double S = static_cast<double>(in.gradient_bytes());
  const auto units = launch_units(in);
  auto mode = [&](int g, double step) { return mode_estimate{step, g * T / step, T / step}; };
  std::vector<estimate_row> rows;
  for (int g = 1; g <= max_gpus; ++g) {
    estimate_row r{g, mode(g, T), mode(g, T), mode(g, T)};
    if (g > 1) {
      r.no_overlap = mode(g, T + curve.all_reduce(g, S));
      double e = 0, o = B;                   // overlap
      std::vector<double> es(units.size());  // sharded: reduce-scatters end
      for (std::size_t i = 0; i < units.size(); ++i) {
        const double s = static_cast<double>(units[i].bytes);
        e = std::max(units[i].ready_seconds, e) + curve.all_reduce(g, s);
        o = std::max({B, e, o}) + O * s / S;
        es[i] = std::max(units[i].ready_seconds, i ? es[i - 1] : 0.0) + curve.reduce_scatter(g, s);
      }
      // The all-gathers queue behind every reduce-scatter on the one communication stream.
      double os = B, a = es.empty() ? 0 : es.back();
      for (std::size_t i = 0; i < units.size(); ++i) {
        const double s = static_cast<double>(units[i].bytes);
        os = std::max({B, es[i], os}) + O / g * s / S;
        a = std::max(os, a) + curve.reduce_scatter(g, s);  // an all-gather moves what a reduce-scatter does
      }
      r.overlap = mode(g, pre + o);
      r.sharded = mode(g, pre + a);
    }
    rows.push_back(r);
  }
  return rows;
}

}  // namespace lockstep
