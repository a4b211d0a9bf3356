// libFuzzer target for TcpStore's wire protocol (lockstep/store/detail/wire.hpp).
//
//   store_protocol_fuzz -max_total_time=30 -timeout=5 -rss_limit_mb=2048 WORK_DIR SEED_DIR
//
// The first input byte picks what is fuzzed:
//  even: the frame parser, both directions, on the rest of the input cut into pieces whose
//        sizes come from the input. Oracle: every frame it delivers re-encodes to exactly
//        the bytes it consumed for it; nothing is consumed after a failure.
//  odd:  the server's state machine (store_engine) with up to 4 connections and a clock,
//        driven by a small program (raw bytes, well-formed frames — random bytes rarely
//        pass the CRC —, clock steps, closes, drains). Oracles: every reply stream parses
//        as replies; the limits on held bytes and connections hold; the engine never
//        throws. The handshake: a connection whose first bytes are a hello of this protocol
//        gets exactly one reply to it — `ok` with the server's instance when the token is the
//        run's and the joined instance is 0 or the server's, else one `err` other_run and
//        nothing after it.
// Built with -DLOCKSTEP_FUZZ_WRITE_SEEDS it is instead a program that writes a seed corpus.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <lockstep/store/detail/store_engine.hpp>
#include <lockstep/store/detail/wire.hpp>

namespace wire = lockstep::detail::wire;

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "store_protocol_fuzz: invariant broken: %s\n", what);
  std::abort();
}

lockstep::store_limits small_limits() {
  lockstep::store_limits lim;
  lim.max_key_bytes = 32;
  lim.max_value_bytes = 512;
  lim.max_total_bytes = 4096;
  lim.max_wait_keys = 8;
  return lim;
}

struct reader {
  std::span<const std::uint8_t> in;
  bool empty() const { return in.empty(); }
  std::uint8_t byte() {
    if (in.empty()) return 0;
    const std::uint8_t b = in[0];
    in = in.subspan(1);
    return b;
  }
  std::span<const std::byte> take(std::size_t n) {
    n = std::min(n, in.size());
    auto out = std::span<const std::byte>(reinterpret_cast<const std::byte*>(in.data()), n);
    in = in.subspan(n);
    return out;
  }
};

void fuzz_parser(reader r) {
  const std::uint8_t mode = r.byte();
  const bool replies = mode & 1;
  lockstep::store_limits lim = small_limits();
  if (mode & 2) lim = lockstep::store_limits{};  // default limits as well
  wire::frame_parser p(replies, lim);
  const std::uint8_t piece_seed = r.byte();
  std::vector<std::byte> pending;  // bytes consumed for the frame in progress
  std::size_t i = 0;
  const auto data = r.take(r.in.size());
  while (i < data.size()) {
    const std::size_t piece = std::min<std::size_t>(data.size() - i, 1 + (piece_seed * (i + 7)) % 97);
    auto in = data.subspan(i, piece);
    i += piece;
    while (!in.empty()) {
      const std::size_t used = p.feed(in);
      if (used > in.size()) broken("consumed more than given");
      pending.insert(pending.end(), in.begin(), in.begin() + static_cast<std::ptrdiff_t>(used));
      in = in.subspan(used);
      if (p.status() == wire::frame_parser::state::failed) {
        if (p.feed(in) != 0) broken("consumed after failing");
        return;
      }
      if (p.status() == wire::frame_parser::state::ready) {
        const wire::frame f = p.take();
        std::vector<std::byte> again;
        wire::encode(again, f.type, f.arg, f.key, f.value);
        if (again != pending) broken("a delivered frame does not re-encode to its bytes");
        if (replies ? !wire::is_reply(f.type) : !wire::is_request(f.type)) broken("wrong direction delivered");
        if (f.key.size() > lim.max_key_bytes) broken("key over the limit delivered");
        pending.clear();
      } else if (used == 0) {
        broken("need_more but consumed nothing");
      }
    }
  }
}

constexpr std::uint64_t engine_instance = 0x0123456789abcdefull;

//! The client's side of one connection: everything the server sent must parse as replies.
//! `expect`: what the first reply must be (the connection began with a hello of this
//! protocol): -1 nothing known, 0 admitted, 1 refused as of another run.
struct client_view {
  wire::frame_parser parser{true, lockstep::store_limits{}};
  bool fresh = true;  // nothing was fed to this connection yet
  int expect = -1;
  int frames = 0;
  void receive(std::span<const std::byte> in) {
    while (!in.empty()) {
      in = in.subspan(parser.feed(in));
      if (parser.status() == wire::frame_parser::state::failed) broken("the server wrote a malformed reply");
      if (parser.status() == wire::frame_parser::state::ready) check(parser.take());
    }
  }
  void check(const wire::frame& f) {
    ++frames;
    if (expect == 1 && frames > 1) broken("a refused hello's connection got a second reply");
    if (expect == -1 || frames != 1) return;
    if (expect == 0) {
      const auto w = wire::decode_welcome(f.value);
      if (f.type != wire::op::ok || !w || w->instance != engine_instance)
        broken("a hello of this run was not admitted with the server's instance");
    } else if (f.type != wire::op::err || f.arg != static_cast<std::int64_t>(wire::err_code::other_run)) {
      broken("a hello of another run, or for a store that is gone, was not refused as such");
    }
  }
};

void fuzz_engine(reader r) {
  using eng = wire::store_engine;
  const auto lim = small_limits();
  const std::string token = "tok";
  eng e(token, lim, 3, std::chrono::milliseconds(100), engine_instance);
  auto now = eng::clock::time_point{} + std::chrono::hours(1);
  std::optional<eng::conn_id> conns[4];
  client_view views[4];
  auto conn = [&](std::uint8_t c) -> std::optional<eng::conn_id> {
    auto& slot = conns[c % 4];
    if (slot && !e.exists(*slot)) slot.reset();
    if (!slot) {
      slot = e.open("fuzz", now);
      views[c % 4] = client_view{};
    }
    return slot;
  };
  auto feed = [&](eng::conn_id id, std::span<const std::byte> bytes) {
    if (!e.wants_read(id)) return;  // the socket loop reads only then
    for (int i = 0; i < 4; ++i)
      if (conns[i] == id && !bytes.empty()) views[i].fresh = false;
    e.receive(id, bytes, now);
  };
  int steps = 0;
  while (!r.empty() && ++steps < 4096) {
    const std::uint8_t opc = r.byte();
    const std::uint8_t who = opc >> 4;
    switch (opc % 8) {
      case 0:
      case 1: {  // raw bytes
        auto id = conn(who);
        const auto bytes = r.take(r.byte());
        if (id) feed(*id, bytes);
        break;
      }
      case 2:
      case 3: {  // a well-formed request
        auto id = conn(who);
        const std::uint8_t kind = r.byte();
        const std::uint8_t a = r.byte();
        std::string key = "k" + std::to_string(a % 5);
        if (kind & 0x80) {
          key.clear();
          for (auto b : r.take(a % 40)) key += static_cast<char>(b);
        }
        std::vector<std::byte> frame;
        const std::int64_t arg = static_cast<std::int64_t>(r.byte()) * 7 - (kind & 0x40 ? 300 : 0);
        switch (kind % 10) {
          case 0:
            wire::encode(frame, wire::op::hello, wire::protocol_version, {}, wire::encode_hello(0, token));
            if (id && views[who % 4].fresh) views[who % 4].expect = 0;
            break;
          case 1:
            wire::encode(frame, wire::op::hello, arg, {}, r.take(r.byte() % 16));
            break;   // any version, any value
          case 9: {  // the handshake of this protocol: which run, which store it joined
            const std::uint8_t pick = r.byte();
            std::uint64_t joined = 0;
            if (pick & 1) joined = engine_instance;
            if (pick & 2) {
              const auto b = r.take(8);
              for (std::size_t i = 0; i < b.size(); ++i) joined |= static_cast<std::uint64_t>(b[i]) << (8 * i);
            }
            std::string tok = token;
            if (pick & 4) tok = lockstep::string_of(r.take(r.byte() % 12));  // maybe empty, maybe "tok"
            wire::encode(frame, wire::op::hello, wire::protocol_version, {}, wire::encode_hello(joined, tok));
            const bool admitted = tok == token && (joined == 0 || joined == engine_instance);
            if (id && views[who % 4].fresh) views[who % 4].expect = admitted ? 0 : 1;
            break;
          }
          case 2: {
            const auto v = r.take(r.byte() * 3);
            wire::encode(frame, wire::op::set, (kind >> 3) & 1, key, v);  // flag 1: only if absent
            break;
          }
          case 3: wire::encode(frame, wire::op::get, arg, key, {}); break;
          case 4: {  // deltas up to 2^63 in size, so that counters can overflow
            const auto delta = static_cast<std::int64_t>(static_cast<std::uint64_t>(arg) << (r.byte() % 64));
            wire::encode(frame, wire::op::add, delta, key, {});
            break;
          }
          case 5:
          case 6: {
            std::vector<std::string> keys;
            const int n = 1 + r.byte() % 10;
            for (int i = 0; i < n; ++i) keys.push_back("k" + std::to_string(r.byte() % 6));
            wire::encode(frame, kind % 10 == 5 ? wire::op::wait : wire::op::check, arg, {},
                         wire::encode_key_list(keys));
            break;
          }
          case 7:
            wire::encode(frame, wire::op::watch, arg, key, r.take(1 + r.byte() % 12));
            break;  // may be empty: malformed
          case 8: wire::encode(frame, wire::op::unwatch, 0, {}, {}); break;
        }
        if (!id) break;
        // Deliver in two pieces, split where the input says.
        const std::size_t cut = frame.empty() ? 0 : r.byte() % (frame.size() + 1);
        feed(*id, std::span<const std::byte>(frame).first(cut));
        if (e.exists(*id)) feed(*id, std::span<const std::byte>(frame).subspan(cut));
        break;
      }
      case 4:  // time passes
        now += std::chrono::milliseconds(r.byte() * 5);
        e.tick(now);
        break;
      case 5: {  // the client reads some replies (the socket loop's send)
        auto& slot = conns[who % 4];
        if (slot && e.exists(*slot)) {
          const auto& out = e.out(*slot);
          const std::size_t n = std::min<std::size_t>(out.size(), r.byte() * 16u);
          views[who % 4].receive(std::span<const std::byte>(out).first(n));
          e.sent(*slot, n, now);
        }
        break;
      }
      case 6: {  // the peer goes away, or the loop closes a misbehaving one
        auto& slot = conns[who % 4];
        if (slot && (who & 1 || e.should_close(*slot))) {
          e.close(*slot);
          slot.reset();
        }
        break;
      }
      default:
        if (auto d = e.next_deadline()) {
          if (*d < now) broken("a deadline in the past survived tick()");
          now = *d;
          e.tick(now);
        }
        break;
    }
    if (e.connections() > 3) broken("more connections than the cap");
    if (e.value_bytes() > lim.max_total_bytes) broken("the store holds more than max_total_bytes");
    (void)e.take_log();
  }
  for (int i = 0; i < 4; ++i)
    if (conns[i] && e.exists(*conns[i])) views[i].receive(e.out(*conns[i]));
}

}  // namespace

#if !defined(LOCKSTEP_FUZZ_WRITE_SEEDS)

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  reader r{std::span<const std::uint8_t>(data, size)};
  if (r.byte() % 2 == 0) fuzz_parser(r);
  else fuzz_engine(r);
  return 0;
}

#else  // a small program that writes seeds: store_protocol_fuzz_seeds SEED_DIR [EMPTY_DIR]

#include <filesystem>
#include <fstream>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s SEED_DIR [WORK_DIR]\n", argv[0]);
    return 2;
  }
  namespace fs = std::filesystem;
  std::vector<std::vector<std::byte>> seeds;
  auto bytes = [](std::initializer_list<int> v) {
    std::vector<std::byte> b;
    for (int x : v) b.push_back(static_cast<std::byte>(x));
    return b;
  };
  {  // parser seeds: request streams and reply streams
    std::vector<std::byte> s = bytes({0, 0, 13});
    wire::encode(s, wire::op::hello, wire::protocol_version, {}, wire::encode_hello(0x1234, "tok"));
    wire::encode(s, wire::op::set, 0, "key", lockstep::bytes_of("value"));
    wire::encode(s, wire::op::get, 1000, "key", {});
    wire::encode(s, wire::op::add, -5, "ctr", {});
    wire::encode(s, wire::op::wait, 50, {}, wire::encode_key_list({"a", "bb"}));
    wire::encode(s, wire::op::check, 0, {}, wire::encode_key_list({"a"}));
    wire::encode(s, wire::op::watch, 500, "failed", lockstep::bytes_of("rank 1"));
    wire::encode(s, wire::op::set, 1, "failed", lockstep::bytes_of("first"));
    wire::encode(s, wire::op::unwatch, 0, {}, {});
    seeds.push_back(s);
    std::vector<std::byte> r = bytes({0, 1, 5});
    wire::encode(r, wire::op::ok, wire::protocol_version, {}, wire::encode_welcome(small_limits(), engine_instance));
    wire::encode(r, wire::op::err, 8, {}, lockstep::bytes_of("the store at this address belongs to run 1a2b3c4d"));
    wire::encode(r, wire::op::ok, 0, {}, lockstep::bytes_of("payload"));
    wire::encode(r, wire::op::err, 4, {}, lockstep::bytes_of("1 of 1 key(s) never set: 'x'"));
    seeds.push_back(r);
  }
  // engine seeds: hello on two connections, a parked wait, a set that wakes it, a get that
  // times out, a raw frame, a close.
  seeds.push_back(bytes({1, 0x02, 0, 0, 0, 0x12, 0, 0, 0, 0x02, 5, 0, 9, 3, 0, 0x12, 2, 1, 4, 0x05, 255, 0x15, 255}));
  seeds.push_back(bytes({1, 0x02, 0, 0, 0, 0x02, 3, 2, 100, 0, 0x04, 40, 0x07, 0x05, 255, 0x16}));
  {
    std::vector<std::byte> raw = bytes({1, 0x02, 0, 0, 0, 0x00, 0});
    std::vector<std::byte> f;
    wire::encode(f, wire::op::set, 0, "k1", lockstep::bytes_of("raw"));
    raw.back() = static_cast<std::byte>(f.size());
    raw.insert(raw.end(), f.begin(), f.end());
    raw.push_back(std::byte{0x05});
    raw.push_back(std::byte{255});
    seeds.push_back(raw);
  }
  seeds.push_back(bytes({1, 0x12, 1, 0, 0, 3, 0x02, 4, 1, 200, 0, 0x02, 2, 1, 80, 1, 2, 3}));
  // watches: one goes silent past its limit, one closes, one leaves cleanly
  seeds.push_back(bytes({1,   0x02, 0, 0, 0,    0, 0x02, 7, 1, 50,  3, 'r',  'a', 'n', 'k', 0,    0x04,
                         100, 0x12, 0, 0, 0,    0, 0x12, 7, 1, 0,   2, 'r',  '2', 'x', 0,   0x16, 0x22,
                         0,   0,    0, 0, 0x22, 7, 1,    9, 0, 'q', 0, 0x22, 8,   0,   0,   0,    0x26}));
  // the handshake: this run's hello, a reconnection to this store, another run's token, a
  // reconnection to a store that is gone (the fourth connection is over the cap of 3)
  seeds.push_back(bytes({1,    0x02, 0,    0,    0, 0, 0x12, 9, 0, 0, 1, 0, 0x22, 9, 0, 0,    4,   3,    't', 'o',  'x',
                         5,    0x32, 9,    0,    0, 2, 1,    2, 3, 4, 5, 6, 7,    8, 0, 0x05, 255, 0x15, 255, 0x25, 255,
                         0x35, 255,  0x26, 0x42, 9, 0, 0,    3, 9, 9, 9, 9, 9,    9, 9, 9,    7,   0x45, 255}));
  fs::create_directories(argv[1]);
  for (std::size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream f(fs::path(argv[1]) / ("seed" + std::to_string(i)), std::ios::binary);
    f.write(reinterpret_cast<const char*>(seeds[i].data()), static_cast<std::streamsize>(seeds[i].size()));
    if (!f) return 1;
  }
  if (argc > 2) {  // a fresh, empty directory for what the fuzzer finds
    fs::remove_all(argv[2]);
    fs::create_directories(argv[2]);
  }
  std::printf("wrote %zu seeds to %s\n", seeds.size(), argv[1]);
  return 0;
}

#endif
