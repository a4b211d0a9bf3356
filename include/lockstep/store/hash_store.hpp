#pragma once
//! lockstep::HashStore — the in-process store: the reference the other stores are checked
//! against, and the store of ranks that are threads of one process.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "lockstep/core/detail/env.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep {

//! An in-process store (mutex + condition variable): for tests, for ranks that are
//! threads of one process, and as the reference the other stores are checked against.
class HashStore {
 public:
  explicit HashStore(int world, std::chrono::milliseconds timeout = detail::default_timeout(), store_limits limits = {})
      : world_(world), timeout_(timeout), limits_(limits) {
    if (world < 1) throw config_error("HashStore: world is " + std::to_string(world) + "; give at least 1");
    if (timeout.count() <= 0) throw config_error("HashStore: the timeout must be positive");
  }

  void set(std::string_view key, std::span<const std::byte> value) {
    detail::check_store_key(key, limits_, "HashStore");
    detail::check_store_value(key, value.size(), limits_.max_value_bytes, "HashStore");
    std::lock_guard lk(m_);
    auto it = values_.find(key);
    const std::size_t old = it == values_.end() ? 0 : it->second.size() + it->first.size();
    if (total_ - old + value.size() + key.size() > limits_.max_total_bytes)
      throw config_error("HashStore: set " + detail::printable_key(key) + " would hold more than " +
                         std::to_string(limits_.max_total_bytes) + " bytes (store_limits::max_total_bytes)");
    total_ = total_ - old + value.size() + key.size();
    if (it == values_.end()) values_.emplace(std::string(key), std::vector<std::byte>(value.begin(), value.end()));
    else it->second.assign(value.begin(), value.end());
    cv_.notify_all();
  }

  std::vector<std::byte> get(std::string_view key) {
    detail::check_store_key(key, limits_, "HashStore");
    std::unique_lock lk(m_);
    if (!cv_.wait_for(lk, timeout_, [&] { return values_.find(key) != values_.end(); }))
      throw timeout_error(detail::store_timeout_message("HashStore", "get", {std::string(key)}, 1, timeout_, world_));
    return values_.find(key)->second;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    detail::check_store_keys(keys, limits_, "HashStore");
    std::unique_lock lk(m_);
    if (cv_.wait_for(lk, timeout, [&] { return all_set(keys); })) return;
    std::vector<std::string> missing;
    for (const auto& k : keys)
      if (values_.find(k) == values_.end()) missing.push_back(k);
    throw timeout_error(detail::store_timeout_message("HashStore", "wait", missing, keys.size(), timeout, world_));
  }
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

  bool check(const std::vector<std::string>& keys) {
    detail::check_store_keys(keys, limits_, "HashStore");
    std::lock_guard lk(m_);
    return all_set(keys);
  }

  std::int64_t add(std::string_view key, std::int64_t delta) {
    detail::check_store_key(key, limits_, "HashStore");
    std::lock_guard lk(m_);
    auto it = counters_.find(key);
    if (it == counters_.end()) it = counters_.emplace(std::string(key), 0).first;
    it->second = detail::checked_add(it->second, delta, key, "HashStore");
    return it->second;
  }

  int world() const noexcept { return world_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  const store_limits& limits() const noexcept { return limits_; }

 private:
  bool all_set(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (values_.find(k) == values_.end()) return false;
    return true;
  }

  int world_;
  std::chrono::milliseconds timeout_;
  store_limits limits_;
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<std::byte>, std::less<>> values_;
  std::map<std::string, std::int64_t, std::less<>> counters_;
  std::size_t total_ = 0;
};

static_assert(store<HashStore>);

}  // namespace lockstep
