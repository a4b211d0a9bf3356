#pragma once
//! The device state of a fused optimizer (cuda/fused_optimizer.cuh) and its checkpoint codec:
//! per parameter `states` buffers (f32, or f64 for f64 parameters), an f32 master for half
//! parameters, and one int64 step counter; all in one zeroed device allocation.
//!
//! Checkpoints use the host optimizers' layout (optim/optimizer.hpp), byte for byte for f32/f64
//! parameters, so a state moves between lockstep::Sgd/AdamW and the fused optimizers both
//! ways. With f16/bf16 parameters the magic is Rule::magic_with_masters and a section of
//! masters follows the slots:
//!   u64 master count | per master: u64 slot, u64 count, count f32 values
//! (the host optimizers, which update no half parameters, do not read these).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/cuda/detail/capture_guard.cuh"
#include "lockstep/cuda/error.cuh"
#include "lockstep/cuda/kernels/engine.cuh"
#include "lockstep/cuda/kernels/optimizers.cuh"
#include "lockstep/cuda/memory.cuh"
#include "lockstep/optim/optimizer.hpp"

namespace lockstep::detail {

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
    for (const auto& p : params) add(p.numel(), p.type, p.name);
  }
  //! The layout only (nothing allocated): of an optimizer built over parameters of these
  //! shapes, whose state_image() save_image() reads.
  fused_state(std::span<const param_shape> shapes, const char* who) : who_(who) {
    for (std::size_t i = 0; i < shapes.size(); ++i) add(shapes[i].numel, shapes[i].type, "#" + std::to_string(i));
  }
  // One owner per state: a copy would alias the device buffers.
  fused_state(const fused_state&) = delete;
  fused_state& operator=(const fused_state&) = delete;
  fused_state(fused_state&&) noexcept = default;
  fused_state& operator=(fused_state&&) noexcept = default;

  //! (Re)allocates a zeroed arena with `states` (≤ 2) state buffers per parameter, and writes
  //! `lr` to device_lr() before it returns (so a step captured next finds it there).
  void build(int states, double lr) {
    const std::size_t at = lay_out(states);
    arena_ = CudaMemory(device_, nullptr).allocate(at);
    bytes_ = at;
    std::fill(master_ready_.begin(), master_ready_.end(), false);
    write_lr_now(lr);
  }
  //! The arena's layout for `states` buffers a parameter; returns its bytes.
  std::size_t lay_out(int states) {
    states_ = states;
    auto align = [](std::size_t b) { return (b + 255) / 256 * 256; };
    std::size_t at = align(meta_.size() * sizeof(std::int64_t));
    lr_off_ = at;  // the learning rate the kernels read (set_lr)
    at += align(sizeof(double));
    ready_off_ = at;  // per parameter: 1 once its master was filled (so that an image says so)
    at += align(meta_.size());
    for (auto& m : meta_) {
      const std::size_t bytes = align(m.numel * state_size(m));
      for (int k = 0; k < 2; ++k) {
        m.state_off[k] = at;
        if (k < states) at += bytes;
      }
      m.master_off = at;
      if (m.has_master) at += align(m.numel * sizeof(float));
    }
    return at;
  }

  std::size_t size() const noexcept { return meta_.size(); }
  int device() const noexcept { return device_; }
  int states() const noexcept { return states_; }
  //! Bytes of device memory the state takes (counters, buffers, masters).
  std::size_t bytes() const noexcept { return bytes_; }
  static std::size_t state_size(const meta& m) { return m.type == dtype::f64 ? 8 : 4; }
  static dtype state_type(const meta& m) { return m.type == dtype::f64 ? dtype::f64 : dtype::f32; }

  std::int64_t* counters() const { return static_cast<std::int64_t*>(arena_.get()); }
  //! The whole arena (device memory).
  std::span<const std::byte> image() const noexcept {
    return {static_cast<const std::byte*>(arena_.get()), arena_ ? bytes_ : 0};
  }
  //! The learning rate the update kernels read (device memory).
  const double* device_lr() const { return reinterpret_cast<const double*>(base() + lr_off_); }
  //! Makes the kernels that s runs next read lr: nothing when device_lr() holds it already
  //! for s (written before any stream ran, or queued on s), else the write queued on s. A
  //! write that a CUDA graph capture of s would record is refused: every replay would write
  //! this rate again over the ones set_lr() queues between replays.
  void publish_lr(double lr, cudaStream_t s) {
    if (lr == published_lr_ && (lr_everywhere_ || lr_stream_ == s)) return;
    if (stream_capturing(s))
      throw config_error(std::string(who_) + ": the learning rate " + std::to_string(lr) +
                         " would be written inside the CUDA graph being captured (set_lr() was last queued on another "
                         "stream, or called during the capture); call set_lr() outside the capture and run every "
                         "step on the stream that is captured");
    cuda::kernels::store_scalar(reinterpret_cast<double*>(base() + lr_off_), lr, s);
    published_lr_ = lr;
    lr_stream_ = s;
    lr_everywhere_ = false;
  }
  //! Writes lr to device_lr() now, on a stream of its own that it waits for (no other work
  //! is waited for): any stream reads it afterwards. Refused while a capture is open on the
  //! device (CaptureScope, StepGraph): CUDA would end the capture.
  void write_lr_now(double lr) {
    if (!arena_) return;  // moved from
    if (captures_open(device_).load(std::memory_order_acquire) != 0)
      throw config_error(std::string(who_) + ": set_lr(" + std::to_string(lr) +
                         ") inside a CUDA graph capture on device " + std::to_string(device_) +
                         "; call it before the capture (the rate is read on the device, so replays follow it)");
    cudaStream_t own = nullptr;
    LOCKSTEP_TRY_CUDA(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    const cudaError_t c = cudaMemcpyAsync(base() + lr_off_, &lr, sizeof lr, cudaMemcpyHostToDevice, own);
    const cudaError_t w = c == cudaSuccess ? cudaStreamSynchronize(own) : c;
    (void)cudaStreamDestroy(own);
    check_cuda(w, "cudaMemcpyAsync(the learning rate)", __FILE__, __LINE__);
    published_lr_ = lr;
    lr_everywhere_ = true;
  }
  //! Whether a step was queued (then last_stream() is its stream).
  bool stepped() const noexcept { return stepped_; }
  cudaStream_t last_stream() const noexcept { return last_stream_; }
  void* state(std::size_t i, int k, std::size_t offset) const {
    return k < states_ ? base() + meta_[i].state_off[k] + offset * state_size(meta_[i]) : nullptr;
  }
  void* master(std::size_t i, std::size_t offset) const {
    return meta_[i].has_master ? base() + meta_[i].master_off + offset * sizeof(float) : nullptr;
  }

  //! Checks the slices, fills masters not yet filled (from the parameters' values), queues
  //! the counter advance of every parameter whose offset-0 slice is here (unless *skip ≠ 0).
  //! Records s as the stream of the last step.
  void prepare(std::span<const param_slice> slices, cudaStream_t s, const int* skip) {
    std::vector<std::int64_t*> advance;
    for (const auto& sl : slices) {
      check_slice(sl);
      if (sl.count == 0) continue;
      const meta& m = meta_[sl.param];
      if (m.has_master && !master_ready_[sl.param]) {
        if (stream_capturing(s))  // a replay would overwrite the fp32 master with the rounded values
          throw config_error(std::string(who_) + "::step: the fp32 master of parameter " + std::to_string(sl.param) +
                             " is filled from its " + name_of(m.type) +
                             " values by the first step, which is being captured into a CUDA graph; run one step "
                             "eagerly after constructing the optimizer (StepGraphOptions::warmup ≥ 1), or load() a "
                             "checkpoint that holds the masters, before capturing");
        const void* whole = static_cast<const char*>(sl.value) - sl.offset * size_of(m.type);
        void* dst = master(sl.param, 0);
        cuda::kernels::visit_float(m.type, who_, [&]<class Element>(std::type_identity<Element>) {
          cuda::kernels::launch(
              cuda::kernels::widen_op<Element>{}, 1,
              [&](std::size_t) { return cuda::kernels::tensor_ref<2>{{const_cast<void*>(whole), dst}, m.numel}; }, s,
              who_);
        });
        LOCKSTEP_TRY_CUDA(cudaMemsetAsync(base() + ready_off_ + sl.param, 1, 1, s));
        master_ready_[sl.param] = true;
      }
      if (sl.offset == 0) advance.push_back(counters() + sl.param);
    }
    if (!advance.empty()) cuda::kernels::advance_steps(advance, skip, s);
    last_stream_ = s;
    stepped_ = true;
  }

  // ---- checkpoints (synchronous) ----------------------------------------------------------
  template <optimizer_rule Rule>
  void save(byte_writer& w, const typename Rule::options& o) const {
    lockstep::detail::device_guard g(device_);
    wait_idle();
    write<Rule>(w, o, [&](std::size_t offset, std::size_t bytes, void* dst) {
      if (bytes) LOCKSTEP_TRY_CUDA(cudaMemcpy(dst, base() + offset, bytes, cudaMemcpyDeviceToHost));
    });
  }
  //! What save() writes, read from `image` (host bytes: a copy of an arena of this layout)
  //! instead of the device.
  template <optimizer_rule Rule>
  void save_image(byte_writer& w, const typename Rule::options& o, std::span<const std::byte> image) {
    const std::size_t need = lay_out(Rule::states(o));
    if (image.size() != need)
      throw checkpoint_error(std::string(who_) + ": a state image of " + std::to_string(image.size()) +
                             " bytes, but an optimizer over these parameters has " + std::to_string(need) +
                             "; it was taken of another optimizer (other parameters or options)");
    write<Rule>(w, o, [&](std::size_t offset, std::size_t bytes, void* dst) {
      if (bytes) std::memcpy(dst, image.data() + offset, bytes);
    });
  }

  //! Reads what save (or the host optimizer) wrote and returns its options; the state is
  //! replaced only when the whole of it is good. Without steps in the layout, a slot with
  //! state counts as stepped once.
  template <optimizer_rule Rule>
  typename Rule::options load(byte_reader& r) {
    lockstep::detail::device_guard g(device_);
    wait_idle();
    const bool masters_follow = read_magic<Rule>(r);
    const auto o = lockstep::detail::checked_loaded_options<Rule>(r, who_);
    const int states = Rule::states(o);
    const auto n = r.read<std::uint64_t>();
    if (n > size())
      r.fail("has " + std::to_string(n) + " slots, but the optimizer has " + std::to_string(size()) + " parameters");
    std::vector<host_slot> slots;
    for (std::size_t i = 0; i < n; ++i) {
      const auto head = lockstep::detail::get_slot_header(r, i, Rule::saves_step, states > 0);
      if (!head.has) continue;
      check_slot(r, i, head.type, head.count);
      auto& h = slots.emplace_back();
      h.index = i;
      h.step = head.step;
      for (int k = 0; k < states; ++k) {
        if (meta_[i].type == dtype::f64) read_array(r, h.f64[k], meta_[i].numel);
        else read_array(r, h.f32[k], meta_[i].numel);
      }
    }
    host_masters masters;
    if (masters_follow) masters = read_masters(r);
    commit(states, o.lr, slots, masters);  // nothing changed before this point if the state was bad
    return o;
  }

 private:
  void add(std::size_t numel, dtype type, const std::string& name) {
    if (!is_floating(type))
      throw config_error(std::string(who_) + ": parameter '" + name + "' holds " + name_of(type) +
                         " elements; it updates f16, bf16, f32 and f64");
    meta m;
    m.numel = numel;
    m.type = type;
    m.has_master = type == dtype::f16 || type == dtype::bf16;
    meta_.push_back(m);
    master_ready_.push_back(false);
  }

  //! The host optimizers' layout, the arena's bytes read through fetch(offset, bytes, dst).
  template <optimizer_rule Rule, class Fetch>
  void write(byte_writer& w, const typename Rule::options& o, Fetch&& fetch) const {
    std::vector<std::int64_t> steps(meta_.size());
    fetch(0, steps.size() * sizeof(std::int64_t), steps.data());
    const bool masters = any_master();
    const int states = Rule::states(o);
    w.write_bytes(masters ? Rule::magic_with_masters : Rule::magic, 8);
    lockstep::detail::save_options<Rule>(w, o);
    w.write(static_cast<std::uint64_t>(size()));
    for (std::size_t i = 0; i < size(); ++i) {
      const bool has = states > 0 && steps[i] > 0;
      const meta& m = meta_[i];
      const lockstep::detail::slot_header head{has, state_type(m), has ? static_cast<std::uint64_t>(m.numel) : 0,
                                               steps[i]};
      lockstep::detail::put_slot_header(w, head, Rule::saves_step);
      if (!has) continue;
      for (int k = 0; k < states; ++k) {
        if (m.type == dtype::f64)
          w.write_elements(std::span<const double>(fetched<double>(fetch, m.state_off[k], m.numel)));
        else w.write_elements(std::span<const float>(fetched<float>(fetch, m.state_off[k], m.numel)));
      }
    }
    if (!masters) return;
    std::vector<unsigned char> ready(meta_.size());
    fetch(ready_off_, ready.size(), ready.data());
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < meta_.size(); ++i) n += meta_[i].has_master && ready[i];
    w.write(n);
    for (std::size_t i = 0; i < meta_.size(); ++i) {
      if (!meta_[i].has_master || !ready[i]) continue;
      w.write(static_cast<std::uint64_t>(i));
      w.write(static_cast<std::uint64_t>(meta_[i].numel));
      w.write_elements(std::span<const float>(fetched<float>(fetch, meta_[i].master_off, meta_[i].numel)));
    }
  }
  template <class T, class Fetch>
  static std::vector<T> fetched(Fetch& fetch, std::size_t offset, std::size_t n) {
    std::vector<T> v(n);
    fetch(offset, n * sizeof(T), v.data());
    return v;
  }

  //! A parameter's state as read from a checkpoint, before it is uploaded.
  struct host_slot {
    std::size_t index = 0;
    std::int64_t step = 0;
    std::vector<float> f32[2];
    std::vector<double> f64[2];
  };
  using host_masters = std::vector<std::pair<std::size_t, std::vector<float>>>;

  char* base() const { return static_cast<char*>(arena_.get()); }
  bool any_master() const {
    return std::any_of(meta_.begin(), meta_.end(), [](const meta& m) { return m.has_master; });
  }
  void wait_idle() const { LOCKSTEP_TRY_CUDA(cudaStreamSynchronize(last_stream_)); }

  void check_slice(const param_slice& sl) const {
    if (sl.param >= meta_.size())
      throw config_error(std::string(who_) + "::step: a slice names parameter " + std::to_string(sl.param) +
                         ", but the optimizer was built for " + std::to_string(meta_.size()));
    const meta& m = meta_[sl.param];
    if (sl.type != m.type || sl.offset > m.numel || sl.count > m.numel - sl.offset)
      throw config_error(std::string(who_) + "::step: the slice [" + std::to_string(sl.offset) + ", +" +
                         std::to_string(sl.count) + ") " + name_of(sl.type) + " of parameter " +
                         std::to_string(sl.param) + " does not fit it (" + std::to_string(m.numel) + " " +
                         name_of(m.type) + " elements); pass the parameters the optimizer was built for");
    if (sl.count != 0 && (sl.value == nullptr || sl.grad == nullptr))
      throw config_error(std::string(who_) + "::step: parameter " + std::to_string(sl.param) +
                         " has a null value or gradient pointer");
  }

  static void upload(void* dst, const void* src, std::size_t bytes) {
    if (bytes) LOCKSTEP_TRY_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  template <class T>
  static void read_array(byte_reader& r, std::vector<T>& v, std::size_t n) {
    if (n > r.remaining() / sizeof(T)) r.fail("ends inside a state buffer of " + std::to_string(n) + " elements");
    v.resize(n);
    r.read_elements(std::span<T>(v));
  }

  //! The magic: Rule::magic_with_masters (true) or Rule::magic (false); anything else throws.
  template <optimizer_rule Rule>
  bool read_magic(byte_reader& r) const {
    const auto next = r.peek(8);
    const bool m = next.size() == 8 && std::memcmp(next.data(), Rule::magic_with_masters, 8) == 0;
    r.expect_magic(std::string_view(m ? Rule::magic_with_masters : Rule::magic, 8),
                   std::string(Rule::name) + "::save() or " + Rule::fused_name + "::save()");
    return m;
  }
  host_masters read_masters(byte_reader& r) const {
    host_masters out;
    std::vector<bool> seen(meta_.size(), false);
    const auto n = r.read<std::uint64_t>();
    for (std::uint64_t j = 0; j < n; ++j) {
      const auto i = r.read<std::uint64_t>();
      const auto count = r.read<std::uint64_t>();
      if (i >= meta_.size() || !meta_[i].has_master || count != meta_[i].numel || seen[i])
        r.fail("master " + std::to_string(j) + " (slot " + std::to_string(i) + ", " + std::to_string(count) +
               " elements) matches no half-precision parameter of this optimizer");
      seen[i] = true;
      out.emplace_back(static_cast<std::size_t>(i), std::vector<float>{});
      read_array(r, out.back().second, count);
    }
    return out;
  }
  void check_slot(const byte_reader& r, std::size_t i, dtype t, std::uint64_t count) const {
    const meta& m = meta_[i];
    if (t != state_type(m) || count != m.numel)
      r.fail("slot " + std::to_string(i) + " holds " + std::to_string(count) + " " + name_of(t) +
             " elements, but parameter " + std::to_string(i) + " needs " + std::to_string(m.numel) + " " +
             name_of(state_type(m)) + "; load it into an optimizer built for the same parameters");
  }
  //! Replaces the whole state with a parsed checkpoint: a fresh zeroed arena with `states`
  //! buffers per parameter, the slots and masters read, counters from the slots (0 elsewhere).
  //! Masters the checkpoint lacks are refilled from the parameters at their next step.
  void commit(int states, double lr, const std::vector<host_slot>& slots, const host_masters& masters) {
    build(states, lr);
    std::vector<std::int64_t> steps(meta_.size(), 0);
    for (const auto& h : slots) {
      const meta& m = meta_[h.index];
      for (int k = 0; k < states; ++k) {
        if (m.type == dtype::f64) upload(state(h.index, k, 0), h.f64[k].data(), h.f64[k].size() * sizeof(double));
        else upload(state(h.index, k, 0), h.f32[k].data(), h.f32[k].size() * sizeof(float));
      }
      steps[h.index] = h.step;
    }
    for (const auto& [i, v] : masters) {
      upload(master(i, 0), v.data(), v.size() * sizeof(float));
      const unsigned char one = 1;
      upload(base() + ready_off_ + i, &one, 1);
      master_ready_[i] = true;
    }
    upload(counters(), steps.data(), steps.size() * sizeof(std::int64_t));
    // Pageable uploads may return before their DMA lands; later steps run on other streams.
    LOCKSTEP_TRY_CUDA(cudaDeviceSynchronize());
  }

  const char* who_;
  int device_ = 0;
  int states_ = 0;
  std::size_t bytes_ = 0;
  std::size_t ready_off_ = 0;
  std::vector<meta> meta_;
  std::vector<bool> master_ready_;
  std::shared_ptr<void> arena_;
  cudaStream_t last_stream_ = nullptr;
  bool stepped_ = false;
  std::size_t lr_off_ = 0;
  // device_lr() holds published_lr_ for work queued on lr_stream_ from now on, or for every
  // stream when it was written synchronously (lr_everywhere_).
  double published_lr_ = 0;
  cudaStream_t lr_stream_ = nullptr;
  bool lr_everywhere_ = false;
};

}  // namespace lockstep::detail
