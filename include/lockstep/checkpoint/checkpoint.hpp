#pragma once
//! Checkpoints: everything needed to resume training bit for bit, written atomically and
//! verified on load. Format and guarantees: docs/checkpoint.md.
//! This header: the bundle (Checkpoint). Files: file.hpp; collective save: collective.hpp;
//! restoring a model or a DataParallel: training_state.hpp. Umbrella: lockstep/lockstep.hpp.
//!
//! A Checkpoint is an in-memory bundle: the model's parameters, the meta counters
//! (step, epoch, sample position) and named sections (optimizer, loss scale, RNG, ...).
//! Sections are serialized when added, so a throwing hook fails before any file is touched.
//!
//! \code
//!   // save: only rank 0 builds and writes; every rank returns once the file is in place
//!   lockstep::save_checkpoint_rank0(comm, "run/ckpt.lsck", [&](lockstep::Checkpoint& ck) {
//!     ck.meta = {.step = step, .epoch = epoch, .sample_position = pos};
//!     ck.add_parameters(model.parameters(), comm.memory());
//!     ck.add("optimizer", optimizer);          // lockstep::serializable
//!     ck.add_value("loss_scale", scaler_state); // trivially copyable struct
//!     ck.add_streamed("rng", rng);              // anything with << and >>
//!   });
//!   // resume: every rank reads and verifies the file, then restores
//!   auto ck = lockstep::load_checkpoint("run/ckpt.lsck");
//!   lockstep::restore_parameters(ck, model.parameters(), comm.memory());
//!   ck.restore("optimizer", optimizer);
//!   ck.restore_value("loss_scale", scaler_state);
//!   ck.restore_streamed("rng", rng);
//! \endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>
#include <ios>
#include <locale>
#include <sstream>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/parameter.hpp"
#include "lockstep/core/progress.hpp"
#include "lockstep/detail/checksum.hpp"

namespace lockstep {

//! Counters that say where training stands. Resuming continues with the next sample of
//! `epoch` after `sample_position` at optimizer step `step`.
struct checkpoint_meta {
  std::int64_t step = 0;
  std::int64_t epoch = 0;
  std::int64_t sample_position = 0;
  friend bool operator==(const checkpoint_meta&, const checkpoint_meta&) = default;
};

//! One parameter as stored in a checkpoint: name, shape, element type and its bytes
//! (host order of the host that wrote it; checked on load).
struct checkpoint_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  dtype type = dtype::f32;
  std::span<const std::byte> data;

  std::size_t numel() const {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
  std::string shape_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(shape[i]);
    }
    s += "] ";
    return s + name_of(type);
  }
  //! A copy of the values as T (T must match the stored element type).
  template <element T>
  std::vector<T> values() const {
    if (dtype_of<T> != type)
      throw config_error("checkpoint parameter '" + name + "' holds " + name_of(type) + " elements, but was read as " +
                         name_of(dtype_of<T>));
    std::vector<T> v(numel());
    if (!data.empty()) std::memcpy(v.data(), data.data(), data.size());
    return v;
  }
};

namespace detail {
inline void fingerprint_add(fnv1a64& h, std::string_view name, std::span<const std::int64_t> shape, dtype t) {
  h.update_u64(name.size());
  h.update(name.data(), name.size());
  h.update_u64(static_cast<std::uint64_t>(t));
  h.update_u64(shape.size());
  for (auto d : shape) h.update_u64(static_cast<std::uint64_t>(d));
}
}  // namespace detail

//! FNV-1a 64 over each parameter's name, element type and shape, in order (the exact
//! byte sequence is in docs/checkpoint.md). Equal fingerprints: same model layout.
template <std::ranges::input_range R>
  requires std::convertible_to<std::ranges::range_reference_t<R>, const parameter&>
std::uint64_t parameter_fingerprint(R&& params) {
  detail::fnv1a64 h;
  for (const parameter& p : params) detail::fingerprint_add(h, p.name, p.shape, p.type);
  return h.value();
}

class Checkpoint;
//! progress: lines on a save or load that takes long (docs/observe.md, "Progress on long
//! phases"); every process that loads prints its own: in a job, pass {.enabled = rank == 0}.
inline Checkpoint load_checkpoint(const std::filesystem::path& path, const progress_options& progress = {});
inline void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck,
                            const progress_options& progress = {});

// ---------------------------------------------------------------------------------------
//! Checkpoint — an in-memory bundle of parameters, meta counters and named sections.
//! Every add_* is all-or-nothing: if it throws, the bundle is unchanged. Copies are cheap
//! and share the (immutable) bytes.
class Checkpoint {
 public:
  checkpoint_meta meta;

  // --- building ------------------------------------------------------------------------

  //! Copies the values of every parameter (read through `ops`, so they may live in
  //! device memory). Call once per checkpoint.
  template <std::ranges::input_range R, class Ops>
    requires std::convertible_to<std::ranges::range_reference_t<R>, const parameter&> &&
             memory_ops<std::remove_cvref_t<Ops>>
  Checkpoint& add_parameters(R&& params, Ops&& ops) {
    if (has_parameters_)
      throw config_error("Checkpoint::add_parameters called twice; a checkpoint holds one "
                         "model's parameters (pass them all in one range)");
    std::vector<parameter> ps;
    for (const parameter& p : params) ps.push_back(p);
    std::size_t total = 0;
    for (const auto& p : ps) {
      if (p.bytes() != 0 && p.value == nullptr)
        throw config_error("Checkpoint::add_parameters: parameter '" + p.name +
                           "' has no value buffer (value is null)");
      total += p.bytes();
    }
    auto buf = std::shared_ptr<std::byte[]>(new std::byte[total == 0 ? 1 : total]);
    std::vector<checkpoint_tensor> ts;
    ts.reserve(ps.size());
    std::size_t off = 0;
    for (const auto& p : ps) {
      if (p.bytes()) ops.download(buf.get() + off, p.value, p.bytes());
      ts.push_back({p.name, p.shape, p.type, std::span<const std::byte>(buf.get() + off, p.bytes())});
      off += p.bytes();
    }
    params_ = std::move(ts);
    owners_.push_back(std::move(buf));
    has_parameters_ = true;
    return *this;
  }

  //! A named section holding these bytes (copied).
  Checkpoint& add_blob(std::string name, std::span<const std::byte> bytes) {
    return add_blob(std::move(name), std::vector<std::byte>(bytes.begin(), bytes.end()));
  }
  //! A named section taking ownership of `bytes`.
  Checkpoint& add_blob(std::string name, std::vector<std::byte> bytes) {
    check_new_name(name);
    auto owned = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
    blobs_.push_back({std::move(name), std::span<const std::byte>(*owned)});
    owners_.push_back(std::move(owned));
    return *this;
  }
  //! A named section holding text.
  Checkpoint& add_blob(std::string name, std::string_view text) {
    const auto* p = reinterpret_cast<const std::byte*>(text.data());
    return add_blob(std::move(name), std::vector<std::byte>(p, p + text.size()));
  }
  //! A named section written by `obj.save(byte_writer&)`.
  template <serializable T>
  Checkpoint& add(std::string name, const T& obj) {
    check_new_name(name);
    byte_writer w;
    obj.save(w);
    return add_blob(std::move(name), std::move(w).release());
  }
  //! A named section holding the object representation of a trivially copyable value
  //! (e.g. a loss scaler's struct of doubles and counters). Host-specific layout; the
  //! size is checked on restore.
  template <class T>
    requires std::is_trivially_copyable_v<T>
  Checkpoint& add_value(std::string name, const T& v) {
    return add_blob(std::move(name), std::span<const std::byte>(reinterpret_cast<const std::byte*>(&v), sizeof(T)));
  }
  //! A named section holding the text `out << v` writes (classic locale), e.g. the state
  //! of a std::mt19937_64. Restored with `in >> v`.
  template <class T>
    requires requires(std::ostream& o, const T& x) { o << x; }
  Checkpoint& add_streamed(std::string name, const T& v) {
    std::ostringstream out;
    out.imbue(std::locale::classic());
    out << v;
    if (!out) throw config_error("Checkpoint::add_streamed: writing section '" + name + "' with operator<< failed");
    return add_blob(std::move(name), std::string_view(out.str()));
  }

  // --- reading -------------------------------------------------------------------------

  bool has_parameters() const noexcept { return has_parameters_; }
  const std::vector<checkpoint_tensor>& parameters() const noexcept { return params_; }
  std::uint64_t fingerprint() const {
    detail::fnv1a64 h;
    for (const auto& t : params_) detail::fingerprint_add(h, t.name, t.shape, t.type);
    return h.value();
  }

  bool contains(std::string_view name) const noexcept { return find(name) != nullptr; }
  std::vector<std::string> section_names() const {
    std::vector<std::string> out;
    for (const auto& b : blobs_) out.push_back(b.name);
    return out;
  }
  //! The bytes of a section; throws checkpoint_error if there is none by that name.
  std::span<const std::byte> blob(std::string_view name) const { return get(name).bytes; }
  std::string blob_text(std::string_view name) const {
    auto b = blob(name);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  //! Loads `obj` from a section written by add(). All-or-nothing when T is copyable.
  template <serializable T>
  void restore(std::string_view name, T& obj) const {
    const auto& s = get(name);
    byte_reader r(s.bytes, describe() + " section '" + s.name + "'");
    auto run = [&](T& target) {
      target.load(r);
      if (!r.at_end())
        throw checkpoint_error(r.what() + ": load() read " + std::to_string(r.position()) + " of its " +
                               std::to_string(s.bytes.size()) + " bytes; save() and load() of this type disagree");
    };
    if constexpr (std::copy_constructible<T> && std::is_move_assignable_v<T>) {
      T tmp(obj);
      run(tmp);
      obj = std::move(tmp);
    } else {
      run(obj);
    }
  }
  template <class T>
    requires std::is_trivially_copyable_v<T>
  void restore_value(std::string_view name, T& v) const {
    const auto& s = get(name);
    if (s.bytes.size() != sizeof(T))
      throw checkpoint_error(describe() + " section '" + s.name + "' holds " + std::to_string(s.bytes.size()) +
                             " bytes, but the value to restore has " + std::to_string(sizeof(T)) +
                             " (a different type, or one whose layout changed since the save)");
    std::memcpy(static_cast<void*>(&v), s.bytes.data(), sizeof(T));
  }
  template <class T>
    requires requires(std::istream& i, T& x) { i >> x; } && std::copy_constructible<T> && std::is_move_assignable_v<T>
  void restore_streamed(std::string_view name, T& v) const {
    const auto& s = get(name);
    std::istringstream in(std::string(reinterpret_cast<const char*>(s.bytes.data()), s.bytes.size()));
    in.imbue(std::locale::classic());
    T tmp(v);
    in >> tmp;
    if (in.fail())
      throw checkpoint_error(describe() + " section '" + s.name +
                             "' could not be read back with operator>> (was it written by "
                             "add_streamed for this type?)");
    v = std::move(tmp);
  }

  //! The file this bundle was loaded from (empty if it was built in memory).
  const std::filesystem::path& source() const noexcept { return source_; }
  //! "checkpoint '<path>'" or "checkpoint" — the subject of error messages.
  std::string describe() const {
    return source_.empty() ? std::string("checkpoint") : "checkpoint '" + source_.string() + "'";
  }

 private:
  struct section {
    std::string name;
    std::span<const std::byte> bytes;
  };

  const section* find(std::string_view name) const noexcept {
    for (const auto& b : blobs_)
      if (b.name == name) return &b;
    return nullptr;
  }
  const section& get(std::string_view name) const {
    if (const auto* s = find(name)) return *s;
    std::string have;
    for (const auto& b : blobs_) have += (have.empty() ? "'" : ", '") + b.name + "'";
    throw checkpoint_error(describe() + " has no section '" + std::string(name) + "' (it has " +
                           (have.empty() ? std::string("none") : have) + "); was it saved with this name?");
  }
  void check_new_name(const std::string& name) const {
    if (name.empty()) throw config_error("Checkpoint: a section needs a non-empty name");
    if (find(name)) throw config_error("Checkpoint: section '" + name + "' was added twice; names must be unique");
  }

  friend Checkpoint load_checkpoint(const std::filesystem::path& path, const progress_options& progress);
  friend void save_checkpoint(const std::filesystem::path& path, const Checkpoint& ck,
                              const progress_options& progress);

  //! Calls sink(ptr, bytes) for each piece of the payload, in order (see docs/checkpoint.md).
  template <class Sink>
  void emit_payload(Sink& sink) const {
    byte_writer w;  // small structural pieces; tensor and section bytes go to the sink directly
    auto flush = [&] {
      sink(w.bytes().data(), w.size());
      w = byte_writer{};
    };
    w.write(meta.step);
    w.write(meta.epoch);
    w.write(meta.sample_position);
    w.write(has_parameters_);
    w.write(static_cast<std::uint64_t>(params_.size()));
    for (const auto& t : params_) {
      w.write_string(t.name);
      w.write(static_cast<std::uint8_t>(t.type));
      w.write_array(std::span<const std::int64_t>(t.shape));
      w.write(static_cast<std::uint64_t>(t.data.size()));
      flush();
      sink(t.data.data(), t.data.size());
    }
    w.write(static_cast<std::uint64_t>(blobs_.size()));
    for (const auto& b : blobs_) {
      w.write_string(b.name);
      w.write(static_cast<std::uint64_t>(b.bytes.size()));
      flush();
      sink(b.bytes.data(), b.bytes.size());
    }
    flush();
  }

  std::vector<checkpoint_tensor> params_;
  bool has_parameters_ = false;
  std::vector<section> blobs_;
  std::vector<std::shared_ptr<const void>> owners_;  // keep the spans' bytes alive
  std::filesystem::path source_;
};

}  // namespace lockstep
