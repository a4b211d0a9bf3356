#pragma once
//! A replacement rank joining an elastic job (docs/elastic.md, "Growing back"): the store's
//! half of it, for any store (run(Processes) uses the job's TcpStore).
//!
//! Protocol, keys under "lockstep.elastic/":
//!  1. The joiner takes a request number n = add("joins", 1) and sets "join/<n>" to its job
//!     rank (request_join).
//!  2. The coordinator of the running job (rank 0) sees the count grow (joins_requested, a
//!     counter read; ElasticGroup::commit asks at most every 100 ms) and, at a step boundary
//!     every member agreed on, admits the requests so far (admit): the new membership — the
//!     members and the joiners, ascending — and the steps completed go under "<s><e>/grow" for
//!     the new epoch e (s: the group's scope, group_scope), and "admit/<n>" tells each joiner
//!     "<s><e>" (or why it was refused: its job rank is a member already, or another request
//!     takes it). It claims a request before it admits it ("claim/<n>", a counter: the first
//!     to count 1 has it), as a joiner that gives up does (step 4).
//!  3. The members read "<e>/grow" (read_growth), the joiner "admit/<n>" and then "<e>/grow"
//!     (await_admission); all make the communicator of epoch e (NcclComm::regroup / join).
//!     The record carries the coordinator's group number (ElasticGroup's generation), which
//!     the joiner takes as its own: its group then reads the keys of the coordinator's.
//!  4. The coordinator's group says in "coordinator" whether it admits (open_joins, when it is
//!     made) and, when it goes (close_joins), answers every request still waiting — refused:
//!     the training loop ended — and writes how many it answered. A joiner that sees the
//!     coordinator's group gone without an answer to its request claims it, withdraws it and is
//!     told so at once, instead of waiting out its timeout; a later group on the store begins
//!     after the answered ones.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lockstep/core/codec.hpp"
#include "lockstep/core/error.hpp"
#include "lockstep/store/store.hpp"

namespace lockstep {

//! A membership that grew: its epoch, its job ranks (ascending), the steps the job had
//! completed, the job ranks that joined, and the number of the coordinator's group among the
//! groups it made on the store (0: not given).
struct growth {
  std::uint64_t epoch = 0;
  std::vector<int> ranks;
  std::int64_t steps = 0;
  std::vector<int> joined;
  std::int64_t generation = 0;
};

namespace detail {

inline std::string join_key(const std::string& what) { return "lockstep.elastic/" + what; }

//! The keys' scope of a group's changes, by its number among the groups made on the store (0:
//! none, a lone call): "g<n>/" (their epochs start again with each group).
inline std::string group_scope(std::int64_t generation) {
  return generation > 0 ? "g" + std::to_string(generation) + "/" : std::string();
}

//! Where a grown membership of epoch `epoch` is recorded, "<scope><epoch>" (what admit/<n>
//! tells the joiner), and the record's key.
inline std::string growth_place(std::uint64_t epoch, std::int64_t generation) {
  return group_scope(generation) + std::to_string(epoch);
}
inline std::string growth_key(const std::string& place) { return join_key(place + "/grow"); }

//! Takes request n for the caller — the coordinator admitting it, or its joiner withdrawing
//! it — unless the other took it first (a counter: the first to count 1 has it).
template <store S>
bool claim_request(S& st, std::int64_t n) {
  return st.add(join_key("claim/" + std::to_string(n)), 1) == 1;
}

inline std::vector<std::byte> encode_growth(const growth& g) {
  byte_writer w;
  w.write(g.epoch);
  w.write(g.steps);
  w.write(g.generation);
  for (const auto* list : {&g.ranks, &g.joined}) {
    w.write(static_cast<std::uint64_t>(list->size()));
    for (int r : *list) w.write(static_cast<std::int64_t>(r));
  }
  return std::move(w).release();
}

inline growth decode_growth(std::span<const std::byte> bytes, const std::string& key) {
  byte_reader r(bytes, "membership record '" + key + "'");
  growth g;
  g.epoch = r.read<std::uint64_t>();
  g.steps = r.read<std::int64_t>();
  g.generation = r.read<std::int64_t>();
  for (auto* list : {&g.ranks, &g.joined}) {
    const auto n = r.read<std::uint64_t>();
    if (n > bytes.size()) r.fail("names " + std::to_string(n) + " ranks; the record is damaged");
    for (std::uint64_t i = 0; i < n; ++i) list->push_back(static_cast<int>(r.read<std::int64_t>()));
  }
  return g;
}

//! The coordinator's word on joining ("coordinator"): whether its group admits (open) or went
//! away (its loop ended cleanly or not, after `steps`), its group number, and the last request
//! answered (from those on a later group admits).
struct joins_state {
  bool open = true;
  bool clean = true;
  std::int64_t generation = 0;
  std::int64_t steps = 0;
  std::int64_t answered = 0;
};

inline std::vector<std::byte> encode_joins(const joins_state& j) {
  byte_writer w;
  w.write(static_cast<std::uint8_t>((j.open ? 1 : 0) | (j.clean ? 2 : 0)));
  for (const auto v : {j.generation, j.steps, j.answered}) w.write(v);
  return std::move(w).release();
}

//! The coordinator's word, if its group said one.
template <store S>
std::optional<joins_state> read_joins(S& st) {
  const std::string key = join_key("coordinator");
  if (!st.check({key})) return std::nullopt;
  const auto bytes = st.get(key);
  byte_reader r(bytes, "membership record '" + key + "'");
  joins_state j;
  const auto flags = r.read<std::uint8_t>();
  j.open = (flags & 1) != 0;
  j.clean = (flags & 2) != 0;
  for (auto* v : {&j.generation, &j.steps, &j.answered}) *v = r.read<std::int64_t>();
  return j;
}

//! What a refusal by a coordinator's group that went away says.
inline std::string ended_text(const joins_state& j) {
  return "job rank 0's ElasticGroup, which admits replacements, went away after step " + std::to_string(j.steps) +
         (j.clean ? " (the job's training loop ended)" : " (its loop did not end cleanly)") +
         " without admitting it: no group of the job admits replacements now";
}

//! The job rank a join request names: a whole number from 0, else nothing.
inline std::optional<int> job_rank_of(const std::string& text) {
  if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoi(text);
}

}  // namespace detail

//! The joiner's step 1: asks to join as job rank `job_rank`; returns the request number.
template <store S>
std::int64_t request_join(S& st, int job_rank) {
  const std::int64_t n = st.add(detail::join_key("joins"), 1);
  st.set(detail::join_key("join/" + std::to_string(n)), bytes_of(std::to_string(job_rank)));
  return n;
}

//! The joiner's step 3: waits (at most `timeout`) until request `n` is answered; the
//! membership it joins. aborted_error naming why when it was refused; timeout_error when the
//! job did not admit it in time (no step boundary came: the job is stuck or has ended).
template <store S>
growth await_admission(S& st, std::int64_t n, int job_rank, std::chrono::milliseconds timeout) {
  const std::string key = detail::join_key("admit/" + std::to_string(n));
  const std::string who = "rank " + std::to_string(job_rank);
  try {
    // The coordinator's group answers every request it saw before it goes (step 4); one it
    // did not see gets no answer: withdrawn and told at once — unless a later group's
    // coordinator claimed it first to admit it (the claim: whoever counts 1 first).
    detail::wait_unless(st, {key}, timeout, [&] {
      const auto j = detail::read_joins(st);
      if (!j || j->open || j->answered >= n) return;
      if (!detail::claim_request(st, n)) return;  // being admitted
      st.set(detail::join_key("join/" + std::to_string(n)), bytes_of("withdrawn"));
      throw aborted_error(who + " asked to join the job, but " + detail::ended_text(*j));
    });
  } catch (const timeout_error& e) {
    throw timeout_error(who + " asked to join the job, but it was not admitted within " +
                        detail::seconds_text(timeout) +
                        " (its members admit joiners at a step boundary, from ElasticGroup::commit(); is the job "
                        "stuck, or does its loop not call commit()?): " +
                        e.what());
  }
  const std::string answer = string_of(st.get(key));
  if (answer.rfind("refused: ", 0) == 0) throw aborted_error(who + " may not join the job: " + answer.substr(9));
  const std::string grow_key = detail::growth_key(answer);
  return detail::decode_growth(st.get(grow_key), grow_key);
}

//! The coordinator's poll: how many join requests were made so far (a counter read).
template <store S>
std::int64_t joins_requested(S& st) {
  return st.add(detail::join_key("joins"), 0);
}

//! The coordinator's step 2: admits requests `first` … joins_requested() into the membership
//! after `ranks` (epoch `epoch` - 1 → `epoch`), the job having completed `steps`. Requests for
//! a job rank that is a member or asked for twice are refused. Returns the new membership
//! (joined empty when every request was refused: then nothing changes). Writes the record
//! the members read (read_growth) whether or not anyone joined. `generation`: the coordinator's
//! group number, which the joiners take.
template <store S>
growth admit(S& st, std::uint64_t epoch, std::span<const int> ranks, std::int64_t first, std::int64_t steps,
             std::int64_t& next_request, std::int64_t generation = 0) {
  growth g{epoch, std::vector<int>(ranks.begin(), ranks.end()), steps, {}, generation};
  const std::int64_t last = joins_requested(st);
  std::vector<std::pair<std::int64_t, std::string>> answers;
  for (std::int64_t n = first; n <= last; ++n) {
    // The joiner sets its rank right after taking the number; one that died in between, or
    // wrote something else, is refused (it is not there to read it) instead of stopping here.
    const std::string key = detail::join_key("join/" + std::to_string(n));
    std::optional<int> asked;
    try {
      st.wait({key}, std::chrono::seconds(2));
      asked = detail::job_rank_of(string_of(st.get(key)));
    } catch (const timeout_error&) {
    }
    if (!asked) {
      answers.emplace_back(n, "refused: request " + std::to_string(n) + " named no job rank within 2 s");
      continue;
    }
    const int r = *asked;
    // A joiner that gave up on an earlier group withdraws its request by claiming it first.
    if (!detail::claim_request(st, n)) continue;
    const bool member = std::find(g.ranks.begin(), g.ranks.end(), r) != g.ranks.end();
    if (member)
      answers.emplace_back(
          n, "refused: job rank " + std::to_string(r) + " is " +
                 (std::find(g.joined.begin(), g.joined.end(), r) != g.joined.end() ? "joining by an earlier request"
                                                                                   : "a member of the running job") +
                 "; a replacement takes the job rank of a rank that left");
    else {
      g.ranks.push_back(r);
      g.joined.push_back(r);
      answers.emplace_back(n, detail::growth_place(epoch, generation));
    }
  }
  std::sort(g.ranks.begin(), g.ranks.end());
  std::sort(g.joined.begin(), g.joined.end());
  st.set(detail::growth_key(detail::growth_place(epoch, generation)), detail::encode_growth(g));
  for (const auto& [n, a] : answers) st.set(detail::join_key("admit/" + std::to_string(n)), bytes_of(a));
  next_request = last + 1;
  return g;
}

//! A member's step 3: the membership of epoch `epoch` as the coordinator admitted it (waits
//! for the record: the store's timeout).
template <store S>
growth read_growth(S& st, std::uint64_t epoch, std::int64_t generation = 0) {
  const std::string key = detail::growth_key(detail::growth_place(epoch, generation));
  return detail::decode_growth(st.get(key), key);
}

//! Step 4, the coordinator's group when it is made (group number `generation`): joins are
//! open. Returns the first request it answers — after those a group before it on the store
//! answered (1 on a fresh store).
template <store S>
std::int64_t open_joins(S& st, std::int64_t generation) {
  const auto before = detail::read_joins(st);
  const std::int64_t first = before ? before->answered + 1 : 1;
  st.set(detail::join_key("coordinator"), detail::encode_joins({true, true, generation, 0, first - 1}));
  return first;
}

//! Step 4, the coordinator's group as it goes, after `steps` (`clean`: its loop ended, rather
//! than failed): every request from `next_request` on is refused, then the word says how many
//! were answered.
template <store S>
void close_joins(S& st, std::int64_t generation, std::int64_t steps, bool clean, std::int64_t next_request) {
  const detail::joins_state j{false, clean, generation, steps, std::max(joins_requested(st), next_request - 1)};
  const std::string why = "refused: " + detail::ended_text(j);
  for (std::int64_t n = next_request; n <= j.answered; ++n)
    st.set(detail::join_key("admit/" + std::to_string(n)), bytes_of(why));
  st.set(detail::join_key("coordinator"), detail::encode_joins(j));
}

}  // namespace lockstep
