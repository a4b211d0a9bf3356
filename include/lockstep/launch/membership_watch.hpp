#pragma once
//! lockstep::membership_watch — run(Processes)'s watchdog, one per membership of the job: the
//! lockstep::elastic_link that an ElasticGroup built on the body's context uses
//! (launch/elastic_link.hpp). A job that never changes membership has exactly the watchdog it
//! always had (on "lockstep/failed", aborting the context's communicator on a failure).
//!
//! Between a failure and the survivors' new communicator the communicator in the context is
//! replaced; the watchdog reaches it only while it is in place (adopt() to the next leave()),
//! under a lock, so that its thread never aborts or polls a communicator being moved.

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/error.hpp"
#include "lockstep/launch/elastic_link.hpp"
#include "lockstep/launch/watchdog.hpp"
#include "lockstep/store/tcp_store.hpp"

namespace lockstep {

template <class Comm>
class membership_watch final : public elastic_link {
 public:
  //! The watchdog's poll of the communicator in place (this membership's watchdog passed too).
  using poll_fn = std::function<std::optional<std::string>(Comm&, const Watchdog&)>;

  //! Watches the membership `first` (the whole job; a replacement's: the one it joined):
  //! `store` is the job's, reached by the watchdogs at host:port; `comm` the context's
  //! communicator, aborted on a failure. Throws like Watchdog.
  membership_watch(TcpStore& store, std::string host, int port, int rank, int world, std::string token, Comm& comm,
                   poll_fn poll, watchdog_options o, growth first)
      : store_(store), host_(std::move(host)), port_(port), rank_(rank), world_(world), token_(std::move(token)),
        comm_(comm), poll_(std::move(poll)), opt_(std::move(o)), first_(std::move(first)), epoch_(first_.epoch),
        members_(first_.ranks) {
    begin();
    std::lock_guard lk(m_);
    ready_ = true;
  }
  membership_watch(const membership_watch&) = delete;
  membership_watch& operator=(const membership_watch&) = delete;
  ~membership_watch() override { stop(); }

  //! The current membership's job ranks and number of changes so far.
  const std::vector<int>& members() const noexcept { return members_; }
  std::uint64_t epoch() const noexcept { return epoch_; }
  std::string failure_key() const { return membership_failure_key(epoch_); }

  //! The failure that ended the current membership (or the last one, after leave()).
  std::optional<std::string> failure() const override {
    if (dog_) return dog_->failure();
    return last_;
  }
  //! This rank failed: tell the current membership (Watchdog::report).
  void report(const std::string& what) noexcept {
    if (dog_) dog_->report(what);
  }
  //! Stops the current watchdog (Watchdog::stop: a clean leave unless it saw a failure).
  void stop() noexcept {
    if (dog_) dog_->stop();
  }

  // elastic_link -------------------------------------------------------------------------------
  TcpStore& store() override { return store_; }

  void leave() override {
    if (!dog_) return;
    {
      std::lock_guard lk(m_);
      ready_ = false;
    }
    last_ = dog_->failure();
    dog_->retire();
    dog_.reset();
  }

  std::vector<int> gone(std::uint64_t epoch, std::span<const int> ranks) override {
    std::vector<int> out;
    try {
      for (int r : ranks)
        if (store_.check({membership_failure_key(epoch) + "/rank " + std::to_string(r)})) out.push_back(r);
    } catch (const std::exception&) {  // the store is gone, and with it its host, job rank 0
      out.push_back(0);
    }
    return out;
  }

  void watch(std::uint64_t epoch, std::span<const int> ranks) override {
    leave();
    epoch_ = epoch;
    members_.assign(ranks.begin(), ranks.end());
    begin();
  }

  growth start() override {
    if (std::exchange(started_, true))
      throw config_error("ElasticGroup: run(Processes) lends its store and watchdogs to one ElasticGroup; build "
                         "one for the run and keep it for the whole loop");
    return first_;
  }

  std::optional<std::string> adopt() override {
    std::lock_guard lk(m_);
    ready_ = true;
    auto why = dog_ ? dog_->failure() : std::nullopt;
    if (why) comm_.abort(*why);  // a member was lost while the communicator was made
    return why;
  }

 private:
  void begin() {
    watchdog_options o = opt_;
    o.key = membership_failure_key(epoch_);
    // Until adopt(), the members are making the membership's communicator, which waits for
    // every one of them (ncclCommInitRank cannot be interrupted). A member that died before it
    // watched this membership is named by no key: past the timeout this rank reports the
    // communicator not made, and every member's watchdog then ends its process after the grace
    // instead of leaving it waiting for ever.
    const auto made_by = std::chrono::steady_clock::now() + opt_.timeout;
    dog_.emplace(
        host_, port_, rank_, world_, token_,
        [this](const std::string& why) {
          std::lock_guard lk(m_);
          if (ready_) comm_.abort(why);
        },
        [this, made_by]() -> std::optional<std::string> {
          std::lock_guard lk(m_);
          if (!ready_) {
            if (std::chrono::steady_clock::now() < made_by) return std::nullopt;
            return "rank " + std::to_string(rank_) + ": the communicator of membership " + std::to_string(epoch_) +
                   " (job ranks " + list(members_) + ") was not made within " + detail::seconds_text(opt_.timeout) +
                   ": a member never joined it (lost while the group changed?)";
          }
          if (!poll_) return std::nullopt;
          return poll_(comm_, *dog_);
        },
        o);
  }

  static std::string list(const std::vector<int>& ranks) {
    std::string s;
    for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  }

  TcpStore& store_;
  std::string host_;
  int port_;
  int rank_;
  int world_;
  std::string token_;
  Comm& comm_;
  poll_fn poll_;
  watchdog_options opt_;
  std::mutex m_;
  bool ready_ = false;  // comm_ is the membership's communicator: the watchdog may use it
  std::optional<Watchdog> dog_;
  std::optional<std::string> last_;
  growth first_;
  bool started_ = false;  // start() was called: an ElasticGroup took the link
  std::uint64_t epoch_ = 0;
  std::vector<int> members_;
};

}  // namespace lockstep
