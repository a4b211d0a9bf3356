#pragma once
//! lockstep::cuda::FusedSgd / FusedAdamW — the fused device optimizers of
//! cuda/kernels/optimizers.cuh with their state owned for you, keyed by parameter index (the
//! order of DataParallel::parameters()), and the skip decision read on the device.
//!
//! \code
//!   lockstep::cuda::FusedAdamW opt({.lr = 1e-3}, dp.parameters());     // on the rank's device
//!   const int* found_inf = dp.scaler().device_found_inf();              // DeviceDynamicScale
//!   auto step = dp.step();
//!   model.backward(..., step.on_gradient_ready());
//!   step.finish([&](std::span<const lockstep::param_slice> s) { opt.step(s, stream, found_inf); });
//!   // or, after finish(): opt.step_all(dp.parameters(), stream, found_inf);
//! \endcode
//!
//! State, allocated at construction on the device (one allocation, zeroed): per parameter the
//! momentum buffer (Sgd, momentum ≠ 0) or exp_avg and exp_avg_sq (AdamW), in f32 (f64 for f64
//! parameters); an f32 master copy for f16/bf16 parameters, filled from the parameter's values
//! the first time the parameter is stepped (so construct the optimizer any time before the first
//! step; capture a step in a CUDA graph only after that first step); and a per-parameter int64
//! step counter. Nothing is allocated or synchronised in step().
//!
//! Step counting. A slice (param, offset, count) may cover part of a parameter (a parameter
//! split over buckets): state is indexed at the slice's offset. A parameter's counter advances —
//! on the device, unless *d_found_inf ≠ 0 — when its slice at offset 0 is stepped, before that
//! slice is updated; slices at later offsets read it. So within one optimizer step, a
//! parameter's offset-0 slice must come first (DataParallel hands buckets over in plan order,
//! where that holds), and every element is stepped once: the counter then advances exactly once
//! per optimizer step, whatever the buckets, and AdamW's bias correction sees step 1, 2, 3...
//! With d_found_inf set and non-zero, parameters, state and counters stay as they were, bit for
//! bit.
//!
//! Checkpoints: save() / load() (they synchronise: they wait for the stream of the last step()
//! and copy to or from the host). For f32/f64 parameters the blob is byte-for-byte the layout of
//! lockstep::Sgd / lockstep::AdamW (see sgd.hpp / adamw.hpp), so a checkpoint moves between the
//! CPU and GPU optimizers both ways. (Sgd's blob records only whether a momentum buffer exists;
//! FusedSgd's counter then restarts at 1.) With f16/bf16 parameters the magic is "LKSGDM01" /
//! "LKADWM01" and a section of masters follows the slots:
//!   u64 master count | per master: u64 slot, u64 count, count f32 values
//! (the CPU optimizers, which update no half parameters, do not read these). load() replaces
//! the state's device allocation: capture CUDA graphs of steps after loading, not before.
//! The optimizers are movable, not copyable (a copy would share the device state).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/adamw.hpp"
#include "lockstep/concepts.hpp"
#include "lockstep/cuda/cuda_memory.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/multi_tensor.cuh"
#include "lockstep/cuda/kernels/optimizers.cuh"
#include "lockstep/detail/reducer.hpp"  // lockstep::param_slice
#include "lockstep/dtype.hpp"
#include "lockstep/error.hpp"
#include "lockstep/parameter.hpp"
#include "lockstep/sgd.hpp"

namespace lockstep::cuda {

namespace detail {

namespace kd = ::lockstep::cuda::kernels::detail;

//! A multi-tensor launch table whose tensors each carry their own step counter.
template <int D, int Cap>
struct stepped_table {
  void* ptr[Cap][D];
  std::size_t count[Cap];
  const std::int64_t* step[Cap];
  unsigned block_begin[Cap + 1];
  int n;
};
inline constexpr int stepped_capacity = 64;

template <int D>
struct stepped_ref {
  void* p[D];
  std::size_t count;
  const std::int64_t* step;
};

//! multi_tensor_kernel with Op::step set per tensor (the optimizers' ops, unchanged).
template <class Op, int D, int Cap>
__global__ void __launch_bounds__(kd::block_threads, Op::min_blocks)
    stepped_kernel(const __grid_constant__ stepped_table<D, Cap> tab, const __grid_constant__ Op op) {
  const unsigned b = blockIdx.x;
  int lo = 0, hi = tab.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tab.block_begin[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  Op o = op;
  o.step = tab.step[lo];
  typename Op::local st;
  if (!o.begin(st)) return;  // uniform across the block
  const std::size_t start = std::size_t(b - tab.block_begin[lo]) * kd::chunk_elems;
  const std::size_t left = tab.count[lo] - start;
  const unsigned n = static_cast<unsigned>(left < kd::chunk_elems ? left : kd::chunk_elems);
  void* p[D];
#pragma unroll
  for (int k = 0; k < D; ++k) p[k] = tab.ptr[lo][k];
  kd::run_chunk(o, st, p, start, n);
  o.end(st);
}

template <class Op>
void launch_stepped(const Op& op, const std::vector<stepped_ref<Op::lists>>& refs, cudaStream_t s) {
  constexpr int D = Op::lists, Cap = stepped_capacity;
  using table_t = stepped_table<D, Cap>;
  static_assert(sizeof(table_t) + sizeof(Op) + 16 <= kd::max_param_bytes);
  table_t tab;
  tab.n = 0;
  tab.block_begin[0] = 0;
  auto flush = [&] {
    if (tab.n == 0) return;
    stepped_kernel<Op, D, Cap><<<tab.block_begin[tab.n], kd::block_threads, 0, s>>>(tab, op);
    LOCKSTEP_CHECK_LAUNCH();
    tab.n = 0;
  };
  for (const auto& r : refs) {
    if (r.count == 0) continue;
    const std::size_t chunks = (r.count + kd::chunk_elems - 1) / kd::chunk_elems;
    if (chunks > kd::max_blocks)
      throw config_error("fused optimizer: a slice of " + std::to_string(r.count) +
                         " elements is more than one launch can cover");
    if (tab.n == Cap || tab.block_begin[tab.n] + chunks > kd::max_blocks) flush();
    for (int k = 0; k < D; ++k) tab.ptr[tab.n][k] = r.p[k];
    tab.count[tab.n] = r.count;
    tab.step[tab.n] = r.step;
    tab.block_begin[tab.n + 1] = tab.block_begin[tab.n] + static_cast<unsigned>(chunks);
    ++tab.n;
  }
  flush();
}

inline constexpr int advance_capacity = 256;
struct advance_table {
  std::int64_t* p[advance_capacity];
  int n;
};

template <int = 0>
__global__ void advance_steps_kernel(const __grid_constant__ advance_table t, const int* found_inf) {
  if (found_inf != nullptr && *found_inf != 0) return;
  const int i = static_cast<int>(threadIdx.x);
  if (i < t.n) *t.p[i] += 1;
}

inline void advance_steps(const std::vector<std::int64_t*>& counters, const int* found_inf,
                          cudaStream_t s) {
  for (std::size_t at = 0; at < counters.size(); at += advance_capacity) {
    advance_table t{};
    t.n = static_cast<int>(std::min<std::size_t>(advance_capacity, counters.size() - at));
    for (int i = 0; i < t.n; ++i) t.p[i] = counters[at + static_cast<std::size_t>(i)];
    advance_steps_kernel<<<1, advance_capacity, 0, s>>>(t, found_inf);
    LOCKSTEP_CHECK_LAUNCH();
  }
}

template <class T>
__global__ void to_master_kernel(const typename kd::elem<T>::bits* src, float* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = kd::elem<T>::to_acc(src[i]);
}

//! Reads the 8-byte magic: `with_masters` (true) or `plain` (false); anything else throws.
inline bool read_magic(lockstep::detail::state_reader& r, const char (&plain)[9],
                       const char (&with_masters)[9]) {
  r.need(8);
  const bool m = std::memcmp(r.in.data() + r.at, with_masters, 8) == 0;
  r.expect_magic(m ? with_masters : plain);
  return m;
}

//! The state both optimizers keep: per parameter `states` buffers (f32, or f64 for f64
//! parameters), an f32 master for half parameters, and one int64 step counter; all in one
//! zeroed device allocation.
class fused_state {
 public:
  struct meta {
    std::size_t numel = 0;
    dtype type = dtype::f32;
    std::size_t state_off[2] = {0, 0};  // bytes into the arena
    std::size_t master_off = 0;
    bool has_master = false;
  };

  fused_state(const std::vector<parameter>& params, int device, const char* who) : who_(who) {
    if (device < 0) LOCKSTEP_TRY_CUDA(cudaGetDevice(&device));
    device_ = device;
    for (const auto& p : params) {
      if (!is_floating(p.type))
        throw config_error(std::string(who) + ": parameter '" + p.name + "' holds " +
                           name_of(p.type) + " elements; it updates f16, bf16, f32 and f64");
      meta m;
      m.numel = p.numel();
      m.type = p.type;
      m.has_master = p.type == dtype::f16 || p.type == dtype::bf16;
      meta_.push_back(m);
    }
    master_ready_.assign(meta_.size(), false);
  }
  // One owner per state: a copy would alias the device buffers.
  fused_state(const fused_state&) = delete;
  fused_state& operator=(const fused_state&) = delete;
  fused_state(fused_state&&) noexcept = default;
  fused_state& operator=(fused_state&&) noexcept = default;

  //! (Re)allocates a zeroed arena with `states` state buffers per parameter.
  void build(int states) {
    states_ = states;
    auto align = [](std::size_t b) { return (b + 255) / 256 * 256; };
    std::size_t at = align(meta_.size() * sizeof(std::int64_t));
    for (auto& m : meta_) {
      const std::size_t bytes = align(m.numel * state_size(m));
      for (int k = 0; k < 2; ++k) {
        m.state_off[k] = at;
        if (k < states) at += bytes;
      }
      m.master_off = at;
      if (m.has_master) at += align(m.numel * sizeof(float));
    }
    arena_ = CudaMemory(device_, nullptr).allocate(at);
    std::fill(master_ready_.begin(), master_ready_.end(), false);
  }

  std::size_t size() const noexcept { return meta_.size(); }
  int device() const noexcept { return device_; }
  int states() const noexcept { return states_; }
  const meta& at(std::size_t i) const { return meta_[i]; }
  static std::size_t state_size(const meta& m) { return m.type == dtype::f64 ? 8 : 4; }
  static dtype state_type(const meta& m) { return m.type == dtype::f64 ? dtype::f64 : dtype::f32; }

  std::int64_t* counters() const { return static_cast<std::int64_t*>(arena_.get()); }
  char* base() const { return static_cast<char*>(arena_.get()); }
  void* state(std::size_t i, int k, std::size_t offset) const {
    return base() + meta_[i].state_off[k] + offset * state_size(meta_[i]);
  }
  void* master(std::size_t i, std::size_t offset) const {
    return meta_[i].has_master ? base() + meta_[i].master_off + offset * sizeof(float) : nullptr;
  }

  //! Checks the slices, fills masters not yet filled, queues the counter advance of every
  //! parameter whose offset-0 slice is here. Records s as the stream of the last step.
  void prepare(std::span<const param_slice> slices, cudaStream_t s, const int* found_inf) {
    std::vector<std::int64_t*> advance;
    for (const auto& sl : slices) {
      if (sl.param >= meta_.size())
        throw config_error(std::string(who_) + "::step: a slice names parameter " +
                           std::to_string(sl.param) + ", but the optimizer was built for " +
                           std::to_string(meta_.size()));
      const meta& m = meta_[sl.param];
      if (sl.type != m.type || sl.offset > m.numel || sl.count > m.numel - sl.offset)
        throw config_error(std::string(who_) + "::step: the slice [" + std::to_string(sl.offset) +
                           ", +" + std::to_string(sl.count) + ") " + name_of(sl.type) +
                           " of parameter " + std::to_string(sl.param) + " does not fit it (" +
                           std::to_string(m.numel) + " " + name_of(m.type) +
                           " elements); pass the parameters the optimizer was built for");
      if (sl.count == 0) continue;
      if (sl.value == nullptr || sl.grad == nullptr)
        throw config_error(std::string(who_) + "::step: parameter " + std::to_string(sl.param) +
                           " has a null value or gradient pointer");
      if (m.has_master && !master_ready_[sl.param]) {
        const std::size_t es = size_of(m.type);
        const void* whole = static_cast<const char*>(sl.value) - sl.offset * es;
        auto* dst = static_cast<float*>(master(sl.param, 0));
        const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((m.numel + 255) / 256, 1024));
        kd::visit_float(m.type, "fused optimizer master", [&]<class T>(std::type_identity<T>) {
          to_master_kernel<T><<<blocks, 256, 0, s>>>(
              static_cast<const typename kd::elem<T>::bits*>(whole), dst, m.numel);
        });
        LOCKSTEP_CHECK_LAUNCH();
        master_ready_[sl.param] = true;
      }
      if (sl.offset == 0) advance.push_back(counters() + sl.param);
    }
    if (!advance.empty()) advance_steps(advance, found_inf, s);
    last_stream_ = s;
  }

  //! One step's launches: for each float type among the slices, the refs make_ref(slice)
  //! builds, handed to launch(std::type_identity<T>{}, refs).
  template <int D, class MakeRef, class Launch>
  void launch_by_type(std::span<const param_slice> slices, MakeRef&& make_ref, Launch&& launch) const {
    for (dtype t : {dtype::f32, dtype::f64, dtype::f16, dtype::bf16}) {
      std::vector<stepped_ref<D>> refs;
      for (const auto& sl : slices)
        if (sl.type == t && sl.count != 0) refs.push_back(make_ref(sl));
      if (refs.empty()) continue;
      kd::visit_float(t, who_, [&]<class T>(std::type_identity<T> tag) { launch(tag, refs); });
    }
  }

  // ---- checkpoints (synchronous) ----------------------------------------------------------
  //! The optimizers' blob (the CPU optimizers' layout): magic (`with_masters` when there are
  //! half parameters), the options, u64 slot count, per slot its header (has = has_state(step);
  //! the step only when with_steps) and, when it has state, its `states` buffers; then the
  //! masters.
  template <class Options, class HasState>
  void save_blob(std::vector<std::byte>& out, const char (&plain)[9], const char (&with_masters)[9], int states,
                 bool with_steps, const Options& options, HasState&& has_state) const {
    lockstep::detail::device_guard g(device_);
    wait_idle();
    const auto steps = download_counters();
    const bool masters = any_master();
    lockstep::detail::state_writer w{out};
    for (char c : std::string_view(masters ? with_masters : plain, 8)) w.put(c);
    lockstep::detail::put_options(w, options);
    w.put(static_cast<std::uint64_t>(size()));
    for (std::size_t i = 0; i < size(); ++i) {
      const bool has = has_state(steps[i]);
      const meta& m = meta_[i];
      lockstep::detail::put_slot_header(w, {has, has ? state_type(m) : dtype::f32, has ? m.numel : 0, steps[i]},
                                        with_steps);
      if (!has) continue;
      for (int k = 0; k < states; ++k) put_state(w, i, k);
    }
    if (masters) put_masters(w);
  }

  //! Reads what save_blob (or the CPU optimizer) wrote. read_options(r) reads and checks the
  //! options (checkpoint_error when invalid) and returns the state buffers per slot. Without
  //! steps in the blob, a slot with state counts as stepped once. The state is replaced only
  //! when the whole blob is good.
  template <class ReadOptions>
  void load_blob(std::span<const std::byte> in, const char (&plain)[9], const char (&with_masters)[9], bool with_steps,
                 ReadOptions&& read_options) {
    lockstep::detail::device_guard g(device_);
    wait_idle();
    lockstep::detail::state_reader r{in, who_};
    const bool masters_follow = read_magic(r, plain, with_masters);
    const int states = read_options(r);
    const auto n = r.get<std::uint64_t>();
    if (n > size())
      throw checkpoint_error(std::string(who_) + " state has " + std::to_string(n) + " slots, but the optimizer has " +
                             std::to_string(size()) + " parameters");
    std::vector<host_slot> slots;
    for (std::size_t i = 0; i < n; ++i) {
      const auto head = lockstep::detail::get_slot_header(r, i, with_steps, states > 0);
      if (!head.has) continue;
      check_slot(i, head.type, head.count);
      auto& h = slots.emplace_back();
      h.index = i;
      h.step = head.step;
      for (int k = 0; k < states; ++k) read_state(r, h, k);
    }
    host_masters masters;
    if (masters_follow) masters = read_masters(r);
    r.expect_end();
    commit(states, slots, masters);  // nothing changed before this point if the blob was bad
  }

  void wait_idle() const { LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(last_stream_)); }
  std::vector<std::int64_t> download_counters() const {
    std::vector<std::int64_t> c(meta_.size());
    if (!c.empty())
      LOCKSTEP_TRY_CUDA(cudaMemcpy(c.data(), counters(), c.size() * sizeof(std::int64_t),
                                   cudaMemcpyDeviceToHost));
    return c;
  }
  template <class T>
  std::vector<T> download(const void* src, std::size_t n) const {
    std::vector<T> v(n);
    if (n) LOCKSTEP_TRY_CUDA(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  static void upload(void* dst, const void* src, std::size_t bytes) {
    if (bytes) LOCKSTEP_TRY_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  //! Appends state buffer k of parameter i, in the state type, little-endian.
  void put_state(lockstep::detail::state_writer& w, std::size_t i, int k) const {
    const meta& m = meta_[i];
    if (m.type == dtype::f64) w.put_array(download<double>(state(i, k, 0), m.numel));
    else w.put_array(download<float>(state(i, k, 0), m.numel));
  }
  //! A parameter's state as read from a checkpoint, before it is uploaded.
  struct host_slot {
    std::size_t index = 0;
    std::int64_t step = 0;
    std::vector<float> f32[2];
    std::vector<double> f64[2];
  };
  void read_state(lockstep::detail::state_reader& r, host_slot& h, int k) const {
    const meta& m = meta_[h.index];
    if (m.type == dtype::f64) r.get_array(h.f64[k], m.numel);
    else r.get_array(h.f32[k], m.numel);
  }
  void upload_state(const host_slot& h, int k) const {
    const meta& m = meta_[h.index];
    if (m.type == dtype::f64) upload(state(h.index, k, 0), h.f64[k].data(), h.f64[k].size() * sizeof(double));
    else upload(state(h.index, k, 0), h.f32[k].data(), h.f32[k].size() * sizeof(float));
  }
  bool any_master() const {
    return std::any_of(meta_.begin(), meta_.end(), [](const meta& m) { return m.has_master; });
  }
  void put_masters(lockstep::detail::state_writer& w) const {
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < meta_.size(); ++i) n += meta_[i].has_master && master_ready_[i];
    w.put(n);
    for (std::size_t i = 0; i < meta_.size(); ++i) {
      if (!meta_[i].has_master || !master_ready_[i]) continue;
      w.put(static_cast<std::uint64_t>(i));
      w.put(static_cast<std::uint64_t>(meta_[i].numel));
      w.put_array(download<float>(master(i, 0), meta_[i].numel));
    }
  }
  using host_masters = std::vector<std::pair<std::size_t, std::vector<float>>>;
  //! Reads a masters section (uploaded by commit()).
  host_masters read_masters(lockstep::detail::state_reader& r) const {
    host_masters out;
    std::vector<bool> seen(meta_.size(), false);
    const auto n = r.get<std::uint64_t>();
    for (std::uint64_t j = 0; j < n; ++j) {
      const auto i = r.get<std::uint64_t>();
      const auto count = r.get<std::uint64_t>();
      if (i >= meta_.size() || !meta_[i].has_master || count != meta_[i].numel || seen[i])
        throw checkpoint_error(std::string(who_) + " state: master " + std::to_string(j) +
                               " (slot " + std::to_string(i) + ", " + std::to_string(count) +
                               " elements) matches no half-precision parameter of this optimizer");
      seen[i] = true;
      out.emplace_back(static_cast<std::size_t>(i), std::vector<float>{});
      r.get_array(out.back().second, count);
    }
    return out;
  }
  //! Checks a slot header against parameter i.
  void check_slot(std::size_t i, dtype t, std::uint64_t count) const {
    if (i >= meta_.size())
      throw checkpoint_error(std::string(who_) + " state has more slots than the " +
                             std::to_string(meta_.size()) + " parameters of this optimizer");
    const meta& m = meta_[i];
    if (t != state_type(m) || count != m.numel)
      throw checkpoint_error(std::string(who_) + " state slot " + std::to_string(i) + " holds " +
                             std::to_string(count) + " " + name_of(t) + " elements, but parameter " +
                             std::to_string(i) + " needs " + std::to_string(m.numel) + " " +
                             name_of(state_type(m)) + "; load it into an optimizer built for the "
                             "same parameters");
  }
  //! Replaces the whole state with a parsed checkpoint: a fresh zeroed arena with `states`
  //! buffers per parameter, the slots and masters read, counters from the slots (0 elsewhere).
  //! Masters the checkpoint lacks are refilled from the parameters at their next step.
  void commit(int states, const std::vector<host_slot>& slots, const host_masters& masters) {
    build(states);
    std::vector<std::int64_t> steps(meta_.size(), 0);
    for (const auto& h : slots) {
      for (int k = 0; k < states; ++k) upload_state(h, k);
      steps[h.index] = h.step;
    }
    for (const auto& [i, v] : masters) {
      upload(master(i, 0), v.data(), v.size() * sizeof(float));
      master_ready_[i] = true;
    }
    upload(counters(), steps.data(), steps.size() * sizeof(std::int64_t));
    // Pageable uploads may return before their DMA lands; later steps run on other streams.
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  }

 private:
  const char* who_;
  int device_ = 0;
  int states_ = 0;
  std::vector<meta> meta_;
  std::vector<bool> master_ready_;
  std::shared_ptr<void> arena_;
  cudaStream_t last_stream_ = nullptr;
};

inline std::vector<param_slice> whole_parameters(const std::vector<parameter>& params,
                                                 std::size_t expected, const char* who) {
  if (params.size() != expected)
    throw config_error(std::string(who) + "::step_all: got " + std::to_string(params.size()) +
                       " parameters, but the optimizer was built for " + std::to_string(expected));
  std::vector<param_slice> out;
  out.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    out.push_back({i, 0, params[i].numel(), params[i].type, params[i].value, params[i].grad});
  return out;
}

}  // namespace detail

// ----------------------------------------------------------------------------------------------
//! SGD (momentum, dampening, nesterov, weight decay; PyTorch semantics, as lockstep::Sgd) on
//! device parameters.
class FusedSgd {
 public:
  //! params: the parameters in the order slices index them (e.g. DataParallel::parameters()),
  //! on `device` (-1: the current device), where the state is allocated.
  FusedSgd(SgdOptions o, const std::vector<parameter>& params, int device = -1)
      : opt_(o), st_(params, device, "FusedSgd") {
    (void)Sgd(o);
    lockstep::detail::device_guard g(st_.device());
    st_.build(o.momentum != 0 ? 1 : 0);
  }

  const SgdOptions& options() const noexcept { return opt_; }
  void set_lr(double lr) {
    SgdOptions o = opt_;
    o.lr = lr;
    (void)Sgd(o);
    opt_ = o;
  }
  //! Per-parameter step counters (device memory). For Sgd only "≥ 1" matters: the momentum
  //! buffer exists.
  const std::int64_t* device_steps() const noexcept { return st_.counters(); }

  //! Updates the slices (e.g. one bucket), queued on s; skipped entirely when d_found_inf is
  //! set and *d_found_inf ≠ 0. No synchronisation.
  void step(std::span<const param_slice> slices, cudaStream_t s, const int* d_found_inf = nullptr) {
    if (slices.empty()) return;
    lockstep::detail::device_guard g(st_.device());
    st_.prepare(slices, s, d_found_inf);
    const bool mom = opt_.momentum != 0;
    st_.launch_by_type<4>(
        slices,
        [&](const param_slice& sl) {
          return detail::stepped_ref<4>{{sl.value, sl.grad, mom ? st_.state(sl.param, 0, sl.offset) : nullptr,
                                         st_.master(sl.param, sl.offset)},
                                        sl.count,
                                        mom ? st_.counters() + sl.param : nullptr};
        },
        [&]<class T>(std::type_identity<T>, const std::vector<detail::stepped_ref<4>>& refs) {
          using op_t = kernels::detail::sgd_op<T>;
          using A = typename op_t::A;
          const op_t op{static_cast<A>(opt_.lr), static_cast<A>(opt_.momentum),
                        static_cast<A>(1.0 - opt_.dampening), static_cast<A>(opt_.weight_decay),
                        opt_.nesterov, nullptr, d_found_inf};
          detail::launch_stepped(op, refs, s);
        });
  }

  //! Updates every parameter (params: the same parameters, in the same order).
  void step_all(const std::vector<parameter>& params, cudaStream_t s, const int* d_found_inf = nullptr) {
    const auto slices = detail::whole_parameters(params, st_.size(), "FusedSgd");
    step(slices, s, d_found_inf);
  }

  //! lockstep::Sgd's layout (see the header comment). Synchronises.
  void save(std::vector<std::byte>& out) const {
    st_.save_blob(out, "LKSGD001", "LKSGDM01", 1, false, opt_,
                  [&](std::int64_t step) { return opt_.momentum != 0 && step > 0; });
  }

  //! Reads what save() or lockstep::Sgd::save() wrote (options included). Synchronises.
  void load(std::span<const std::byte> in) {
    SgdOptions o{};
    st_.load_blob(in, "LKSGD001", "LKSGDM01", false, [&](lockstep::detail::state_reader& r) {
      lockstep::detail::get_options(r, o);
      try {
        (void)Sgd(o);
      } catch (const config_error& e) {
        throw checkpoint_error(std::string("FusedSgd state holds invalid options: ") + e.what());
      }
      return o.momentum != 0 ? 1 : 0;  // Sgd's blob says only whether the buffer exists
    });
    opt_ = o;
  }

 private:
  SgdOptions opt_;
  detail::fused_state st_;
};

// ----------------------------------------------------------------------------------------------
//! AdamW (PyTorch semantics, as lockstep::AdamW) on device parameters.
class FusedAdamW {
 public:
  FusedAdamW(AdamWOptions o, const std::vector<parameter>& params, int device = -1)
      : opt_(o), st_(params, device, "FusedAdamW") {
    (void)AdamW(o);
    lockstep::detail::device_guard g(st_.device());
    st_.build(2);
  }

  const AdamWOptions& options() const noexcept { return opt_; }
  void set_lr(double lr) {
    AdamWOptions o = opt_;
    o.lr = lr;
    (void)AdamW(o);
    opt_ = o;
  }
  //! Per-parameter step counters (device memory), as AdamW::step_count.
  const std::int64_t* device_steps() const noexcept { return st_.counters(); }

  void step(std::span<const param_slice> slices, cudaStream_t s, const int* d_found_inf = nullptr) {
    if (slices.empty()) return;
    lockstep::detail::device_guard g(st_.device());
    st_.prepare(slices, s, d_found_inf);
    st_.launch_by_type<5>(
        slices,
        [&](const param_slice& sl) {
          return detail::stepped_ref<5>{{sl.value, sl.grad, st_.state(sl.param, 0, sl.offset),
                                         st_.state(sl.param, 1, sl.offset), st_.master(sl.param, sl.offset)},
                                        sl.count,
                                        st_.counters() + sl.param};
        },
        [&]<class T>(std::type_identity<T>, const std::vector<detail::stepped_ref<5>>& refs) {
          using op_t = kernels::detail::adamw_op<T>;
          using A = typename op_t::A;
          const op_t op{opt_.lr, opt_.beta1, opt_.beta2,
                        static_cast<A>(1.0 - opt_.lr * opt_.weight_decay),
                        static_cast<A>(opt_.beta1), static_cast<A>(1.0 - opt_.beta1),
                        static_cast<A>(opt_.beta2), static_cast<A>(1.0 - opt_.beta2),
                        static_cast<A>(opt_.eps), nullptr, d_found_inf};
          detail::launch_stepped(op, refs, s);
        });
  }

  void step_all(const std::vector<parameter>& params, cudaStream_t s, const int* d_found_inf = nullptr) {
    const auto slices = detail::whole_parameters(params, st_.size(), "FusedAdamW");
    step(slices, s, d_found_inf);
  }

  //! lockstep::AdamW's layout (see the header comment). Synchronises.
  void save(std::vector<std::byte>& out) const {
    st_.save_blob(out, "LKADW001", "LKADWM01", 2, true, opt_, [](std::int64_t step) { return step > 0; });
  }

  //! Reads what save() or lockstep::AdamW::save() wrote (options included). Synchronises.
  void load(std::span<const std::byte> in) {
    AdamWOptions o{};
    st_.load_blob(in, "LKADW001", "LKADWM01", true, [&](lockstep::detail::state_reader& r) {
      lockstep::detail::get_options(r, o);
      try {
        (void)AdamW(o);
      } catch (const config_error& e) {
        throw checkpoint_error(std::string("FusedAdamW state holds invalid options: ") + e.what());
      }
      return 2;
    });
    opt_ = o;
  }

 private:
  AdamWOptions opt_;
  detail::fused_state st_;
};

}  // namespace lockstep::cuda
