#pragma once
//! MpiComm — a lockstep::communicator over MPI: one rank per process, host buffers
//! (memory() is HostMemory). Needs lockstep::mpi (CMake) and an MPI library.
//!
//! Collectives are issued non-blocking (MPI_Iallreduce, MPI_Ibcast, MPI_Iallgather,
//! MPI_Ireduce_scatter_block, MPI_Ibarrier) and return an MpiComm::work; wait() polls
//! MPI_Test until the result is in the receive buffer. Keep the buffers alive and untouched
//! until then (a work that is destroyed unwaited waits in its destructor).
//!
//! No hang: MPI_Wait has no timeout, so wait() polls with a deadline (LOCKSTEP_TIMEOUT
//! seconds, default 60) and throws timeout_error naming the collective. A collective cannot
//! be cancelled in MPI, so after a timeout (or an MPI error) the communicator is *broken*:
//! later calls throw aborted_error, and MPI may still write into the buffers of collectives
//! that were in flight. End the job: lockstep::run(Mpi{}, ...) calls MPI_Abort (mpi/run_mpi.hpp).
//!
//! Order check (comm/order_check.hpp), on by default: every collective is preceded by a small
//! MPI_Iallgather of every rank's description of it (its seal), compared with rank 0's once it
//! has arrived — while later calls are issued and waits poll, never blocking for it — so a
//! rank that skipped a collective or called another one is named with both calls on every
//! rank ("rank 0 called all_reduce #24 … for bucket 3 … but rank 1 called …"); the
//! communicator then refuses every call. LOCKSTEP_DEBUG=1 (or set_check_order(true)) waits
//! for each seal before its collective instead; LOCKSTEP_CHECK_ORDER=off turns it off.
//!
//! Counts above INT_MAX (MPI counts are int) are split into several calls. avg is a sum
//! followed by a division by size() (integers: truncating, as ThreadComm). f16/bf16 have no
//! MPI type: config_error.
//!
//! Construction dups the given MPI communicator (collective over it); the dup is freed when
//! the last MpiComm/work using it goes away. MpiComm::world() initialises MPI if needed.
//!
//! \code
//!   auto comm = lockstep::MpiComm::world();          // MPI_Init_thread if not yet done
//!   std::vector<float> g(n, 1.0f);
//!   comm.all_reduce(g.data(), g.data(), n, lockstep::dtype::f32, lockstep::reduce_op::avg).wait();
//! \endcode

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <deque>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "lockstep/comm/collective.hpp"
#include "lockstep/comm/order_check.hpp"
#include "lockstep/core/concepts.hpp"
#include "lockstep/core/dtype.hpp"
#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/core/host_memory.hpp"
#include "lockstep/core/reduce_op.hpp"
#include "lockstep/mpi/detail/mpi_state.hpp"
#include "lockstep/mpi/detail/mpi_util.hpp"

namespace lockstep {

class MpiComm {
 public:
  //! A collective in flight. wait() returns once the result is in the receive buffer, or
  //! throws timeout_error / mpi_error (the communicator is then broken). Move-only; a work
  //! destroyed before wait() waits in its destructor (and on failure prints to stderr and
  //! abandons the collective instead of throwing).
  class work {
   public:
    work() = default;
    work(work&& o) noexcept
        : state_(std::move(o.state_)), reqs_(std::move(o.reqs_)), staging_(std::move(o.staging_)),
          finish_(std::exchange(o.finish_, nullptr)), what_(std::move(o.what_)) {
      o.reqs_.clear();
    }
    work& operator=(work&& o) noexcept {
      if (this != &o) {
        settle_quietly();
        state_ = std::move(o.state_);
        reqs_ = std::exchange(o.reqs_, {});
        staging_ = std::move(o.staging_);
        finish_ = std::exchange(o.finish_, nullptr);
        what_ = std::move(o.what_);
      }
      return *this;
    }
    work(const work&) = delete;
    work& operator=(const work&) = delete;
    ~work() { settle_quietly(); }

    void wait() {
      if (reqs_.empty() && !finish_) return;
      if (!reqs_.empty()) {
        if (!state_->broken.empty()) {
          abandon();
          state_->live();
        }
        if (!state_->poll(reqs_, what_)) {
          state_->broken = what_ + " timed out";
          std::string msg = state_->timeout_message(what_);
          abandon();
          throw timeout_error(msg);
        }
      }
      if (auto f = std::exchange(finish_, nullptr)) f();
      staging_.clear();
    }

    //! Whether the collective has completed (a completed work's wait() returns at once).
    bool done() const noexcept { return reqs_.empty(); }

   private:
    friend class MpiComm;

    // MPI may still write into the staging buffer: keep it alive for the process' lifetime.
    void abandon() {
      if (!staging_.empty()) new std::vector<unsigned char>(std::move(staging_));  // leaked on purpose
      reqs_.clear();
      finish_ = nullptr;
    }

    void settle_quietly() noexcept {
      if (reqs_.empty() && !finish_) return;
      if (!state_->broken.empty()) {
        abandon();
        return;
      }
      try {
        wait();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "lockstep: an MpiComm work destroyed before wait() failed: %s\n", e.what());
        abandon();
      }
    }

    std::shared_ptr<detail::mpi_state> state_;
    std::vector<MPI_Request> reqs_;
    std::vector<unsigned char> staging_;
    std::function<void()> finish_;
    std::string what_;
  };
  using work_type = work;

  //! A communicator over a dup of `comm` (collective over comm). MPI must be initialised.
  explicit MpiComm(MPI_Comm comm, std::chrono::milliseconds timeout = detail::default_timeout())
      : s_(std::make_shared<detail::mpi_state>()) {
    int ready = 0;
    MPI_Initialized(&ready);
    if (!ready)
      throw config_error("MpiComm: MPI is not initialised; call MPI_Init_thread first or use "
                         "lockstep::MpiComm::world()");
    LOCKSTEP_TRY_MPI(MPI_Comm_dup(comm, &s_->comm));
    LOCKSTEP_TRY_MPI(MPI_Comm_set_errhandler(s_->comm, MPI_ERRORS_RETURN));
    LOCKSTEP_TRY_MPI(MPI_Comm_rank(s_->comm, &s_->rank));
    LOCKSTEP_TRY_MPI(MPI_Comm_size(s_->comm, &s_->size));
    s_->timeout = timeout;
    s_->order = detail::order_check_mode_from_env();
    agree_on_order_check();
  }

  //! All processes of the job (MPI_COMM_WORLD); initialises MPI when nobody did.
  static MpiComm world(std::chrono::milliseconds timeout = detail::default_timeout()) {
    detail::mpi_init();
    return MpiComm(MPI_COMM_WORLD, timeout);
  }

  MpiComm(MpiComm&&) noexcept = default;
  MpiComm& operator=(MpiComm&&) noexcept = default;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  ~MpiComm() = default;

  int rank() const noexcept { return s_->rank; }
  int size() const noexcept { return s_->size; }
  HostMemory memory() const noexcept { return {}; }
  //! The dup'ed MPI communicator (for the application's own MPI calls).
  MPI_Comm native() const noexcept { return s_->comm; }
  //! Number of collectives this rank has issued (the sequence number of the next).
  std::size_t sequence() const noexcept { return s_->seq; }

  //! Names this rank's next collective (e.g. the bucket it reduces): compared across ranks by
  //! the order check and shown in its messages. DataParallel labels its buckets.
  void label_next(std::string label) { next_label_ = std::move(label); }

  //! How the order of collectives is checked across ranks (comm/order_check.hpp; default from
  //! the environment: deferred, the same on every rank, checked at construction). A setter is
  //! collective in effect: call it on every rank alike, between collectives.
  //! set_check_order(true): immediate, as LOCKSTEP_DEBUG=1; false: off.
  void set_order_check(order_check_mode m) noexcept { s_->order = m; }
  void set_check_order(bool on) noexcept { s_->order = on ? order_check_mode::immediate : order_check_mode::off; }
  order_check_mode order_check() const noexcept { return s_->order; }
  //! Waits (up to the timeout) for the order check of every collective issued so far and
  //! throws mismatch_error if any differed across ranks; run(Mpi) calls it after the body.
  void verify_order() {
    s_->live();
    s_->check_seals(true);
  }
  void set_timeout(std::chrono::milliseconds t) noexcept { s_->timeout = t; }
  //! Elements per MPI call (default and maximum INT_MAX, MPI's limit; smaller only to test
  //! the splitting of large collectives).
  void set_max_chunk(std::size_t elements) {
    if (elements < 1 || elements > static_cast<std::size_t>(INT_MAX))
      throw config_error("MpiComm::set_max_chunk: give 1.." + std::to_string(INT_MAX) + " elements");
    s_->max_chunk = elements;
  }

  work all_reduce(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    const MPI_Datatype mt = detail::mpi_type_of(t);
    work w = begin(collective::all_reduce(count, t, op));
    const std::size_t es = size_of(t);
    auto* out = static_cast<unsigned char*>(recv);
    if (send != recv && detail::overlaps(send, count * es, recv, count * es)) {
      std::memmove(recv, send, count * es);  // partial overlap: reduce in place instead
      send = recv;
    }
    for_chunks(count, [&](std::size_t off, int len) {
      const void* s = send == recv ? MPI_IN_PLACE : static_cast<const unsigned char*>(send) + off * es;
      issue(w, MPI_Iallreduce(s, out + off * es, len, mt, detail::mpi_op_of(op, t), s_->comm, &next(w)));
    });
    if (op == reduce_op::avg && count > 0) w.finish_ = [=, n = size()] { divide(out, count, t, n); };
    return w;
  }

  work broadcast(void* buf, std::size_t count, dtype t, int root) {
    if (root < 0 || root >= size())
      throw config_error("MpiComm::broadcast: root " + std::to_string(root) +
                         " is not a rank of this communicator of " + std::to_string(size()));
    const MPI_Datatype mt = detail::mpi_type_of(t);
    work w = begin(collective::broadcast(count, t, root));
    auto* b = static_cast<unsigned char*>(buf);
    for_chunks(count, [&](std::size_t off, int len) {
      issue(w, MPI_Ibcast(b + off * size_of(t), len, mt, root, s_->comm, &next(w)));
    });
    return w;
  }

  //! recv holds size()·count elements, rank r's block at r·count. In place: send may be
  //! recv + rank()·count (elements); any other overlap is staged through a copy.
  work all_gather(const void* send, void* recv, std::size_t count, dtype t) {
    const MPI_Datatype mt = detail::mpi_type_of(t);
    work w = begin(collective::all_gather(count, t));
    const std::size_t es = size_of(t), bytes = count * es;
    auto* out = static_cast<unsigned char*>(recv);
    unsigned char* mine = out + static_cast<std::size_t>(rank()) * bytes;
    const bool in_place = send == mine;
    if (!in_place && detail::overlaps(send, bytes, recv, bytes * static_cast<std::size_t>(size()))) {
      w.staging_.assign(static_cast<const unsigned char*>(send), static_cast<const unsigned char*>(send) + bytes);
      send = w.staging_.data();
    }
    if (count == 0) return w;
    if (count <= s_->max_chunk) {
      const int n = static_cast<int>(count);
      issue(w, MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, mt, recv, n, mt, s_->comm, &next(w)));
      return w;
    }
    // Too large for one int count: every rank broadcasts its block, in chunks.
    if (!in_place) std::memcpy(mine, send, bytes);
    for (int r = 0; r < size(); ++r)
      for_chunks(count, [&](std::size_t off, int len) {
        issue(w, MPI_Ibcast(out + static_cast<std::size_t>(r) * bytes + off * es, len, mt, r, s_->comm, &next(w)));
      });
    return w;
  }

  //! send holds size()·count elements; rank r receives the reduction of every rank's block r.
  //! recv may equal send, be send + rank()·count (in place) or overlap it anywhere: staged
  //! through a copy (never MPI_IN_PLACE, which all ranks must use or none — and in the in-place
  //! form only rank 0 would pass recv == send).
  work reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, reduce_op op) {
    const MPI_Datatype mt = detail::mpi_type_of(t);
    work w = begin(collective::reduce_scatter(count, t, op));
    const std::size_t es = size_of(t), bytes = count * es;
    const std::size_t total = bytes * static_cast<std::size_t>(size());
    if (count == 0) return w;
    const bool big = count > s_->max_chunk;
    unsigned char* out = static_cast<unsigned char*>(recv);
    if (detail::overlaps(send, total, recv, bytes)) {
      w.staging_.resize(bytes);
      out = w.staging_.data();
    }
    const auto* in = static_cast<const unsigned char*>(send);
    if (!big) {
      issue(w, MPI_Ireduce_scatter_block(send, out, static_cast<int>(count), mt, detail::mpi_op_of(op, t), s_->comm,
                                         &next(w)));
    } else {
      // Too large for one int count: one reduction to each rank, in chunks.
      for (int r = 0; r < size(); ++r)
        for_chunks(count, [&](std::size_t off, int len) {
          issue(w,
                MPI_Ireduce(in + static_cast<std::size_t>(r) * bytes + off * es, r == rank() ? out + off * es : nullptr,
                            len, mt, detail::mpi_op_of(op, t), r, s_->comm, &next(w)));
        });
    }
    const bool staged = out != recv;
    if (staged || op == reduce_op::avg)
      w.finish_ = [=, n = size(), avg = op == reduce_op::avg] {
        if (staged) std::memcpy(recv, out, bytes);
        if (avg) divide(recv, count, t, n);
      };
    return w;
  }

  void barrier() {
    work w = begin(collective::barrier());
    issue(w, MPI_Ibarrier(s_->comm, &next(w)));
    w.wait();
  }

  //! A communicator over the ranks that pass the same colour (>= 0), ordered by key (ties: by
  //! rank here): MPI_Comm_split. Collective over this communicator. MPI_Comm_split has no
  //! timeout, so a barrier with one (LOCKSTEP_TIMEOUT) goes first: every rank is known to
  //! have arrived before any blocks in it. The new communicator keeps this one's timeout and
  //! order checking, numbers its collectives on its own, and ends with the job like every
  //! MpiComm (run(Mpi) calls MPI_Abort on any failure).
  MpiComm split(int color, int key) {
    if (color < 0)
      throw config_error("MpiComm::split: colour " + std::to_string(color) +
                         " is negative; give every rank a colour >= 0 (ranks of one colour form a group)");
    barrier();
    MPI_Comm sub = MPI_COMM_NULL;
    LOCKSTEP_TRY_MPI(MPI_Comm_split(s_->comm, color, key, &sub));
    struct freer {
      MPI_Comm* c;
      ~freer() { MPI_Comm_free(c); }
    } free_sub{&sub};
    MpiComm out(sub, s_->timeout);
    out.s_->order = s_->order;
    out.s_->max_chunk = s_->max_chunk;
    return out;
  }

 private:
  // Checks the communicator is healthy and the order check's arrived seals, issues this
  // call's seal, and starts a work for it.
  work begin(collective call) {
    s_->live();
    s_->check_seals(false);
    call.seq = s_->seq++;
    call.label = std::exchange(next_label_, {});
    s_->issue_seal(call);
    work w;
    w.state_ = s_;
    w.what_ = call.describe();
    return w;
  }

  // Every rank sends seals or none (comm/order_check.hpp): one blocking all-reduce of the
  // flag, its min and max, at construction — a rank whose environment lacks the variable (mpirun
  // over several hosts without -x) is named here instead of desynchronising the job later.
  void agree_on_order_check() {
    if (size() == 1) return;
    const int on = s_->order != order_check_mode::off ? 1 : 0;
    int minmax[2] = {on, -on};
    LOCKSTEP_TRY_MPI(MPI_Allreduce(MPI_IN_PLACE, minmax, 2, MPI_INT, MPI_MIN, s_->comm));
    detail::check_same_order_mode(-minmax[1] == 1, minmax[0] == 1);
  }

  template <class F>
  void for_chunks(std::size_t count, F&& f) {
    for (std::size_t off = 0; off < count; off += s_->max_chunk)
      f(off, static_cast<int>(std::min(s_->max_chunk, count - off)));
  }

  static MPI_Request& next(work& w) { return w.reqs_.emplace_back(MPI_REQUEST_NULL); }

  // A failed start breaks the communicator: earlier chunks may be in flight, and the other
  // ranks cannot know this one stopped.
  void issue(work& w, int rc) {
    if (rc == MPI_SUCCESS) return;
    w.reqs_.pop_back();
    s_->broken = w.what_ + " failed to start: " + detail::mpi_error_string(rc);
    std::string msg =
        detail::call_failure(("MPI call for " + w.what_).c_str(), __FILE__, __LINE__, detail::mpi_error_string(rc));
    w.abandon();
    throw mpi_error(msg);
  }

  static void divide(void* p, std::size_t count, dtype t, int n) {
    visit_host_dtype(t, [&]<class T>(T) {
      T* x = static_cast<T*>(p);
      // Integers: the wrapped sum divided by n, truncating (as ThreadComm).
      using D = std::conditional_t<std::is_floating_point_v<T>, T, std::int64_t>;
      const auto d = static_cast<D>(n);
      for (std::size_t i = 0; i < count; ++i) x[i] = static_cast<T>(static_cast<D>(x[i]) / d);
    });
  }

  std::shared_ptr<detail::mpi_state> s_;
  std::string next_label_;
};

static_assert(communicator<MpiComm>);
static_assert(splittable_communicator<MpiComm>);

}  // namespace lockstep
