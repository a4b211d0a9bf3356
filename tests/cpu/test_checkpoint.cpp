// Checkpoints: round trip, verification on load (truncation, corruption, version, model
// mismatch), atomic save that leaves the previous file intact, rank-0-only save.
#include <doctest/doctest.h>

#include <lockstep/lockstep.hpp>
#include <lockstep/comm/thread_comm.hpp>
#include <lockstep/core/host_memory.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

namespace fs = std::filesystem;
using lockstep::Checkpoint;
using lockstep::checkpoint_error;

namespace {

// --- independent references --------------------------------------------------------------

// Bit-at-a-time CRC-32 (reflected 0xEDB88320, init and final XOR 0xFFFFFFFF).
std::uint32_t ref_crc32(const unsigned char* p, std::size_t n) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

struct ref_fnv {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  void bytes(const void* d, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(d)[i]) * 0x100000001b3ULL;
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      unsigned char b = static_cast<unsigned char>(v >> (8 * i));
      bytes(&b, 1);
    }
  }
};

std::uint64_t rd_le(const std::vector<unsigned char>& f, std::size_t off, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t{f[off + static_cast<std::size_t>(i)]} << (8 * i);
  return v;
}

// --- files -----------------------------------------------------------------------------------

struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    path =
        fs::temp_directory_path() / ("lockstep-ckpt-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

std::vector<unsigned char> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_file(const fs::path& p, const std::vector<unsigned char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const checkpoint_error& e) {
    return e.what();
  }
  return "<no checkpoint_error>";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// --- a model, an optimizer, a loss-scale struct --------------------------------------------

struct TestModel {
  std::int64_t rows, cols, k;
  std::vector<float> w, gw, b, gb;
  std::vector<double> h, gh;
  std::vector<float> e, ge;  // zero elements: must survive too

  TestModel(std::int64_t r, std::int64_t c, std::int64_t kk, std::mt19937_64& rng) : rows(r), cols(c), k(kk) {
    std::normal_distribution<double> d(0.0, 1.0);
    w.resize(static_cast<std::size_t>(r * c));
    b.resize(static_cast<std::size_t>(c));
    h.resize(static_cast<std::size_t>(kk));
    for (auto& x : w) x = static_cast<float>(d(rng));
    for (auto& x : b) x = static_cast<float>(d(rng));
    for (auto& x : h) x = d(rng);
    gw.resize(w.size());
    gb.resize(b.size());
    gh.resize(h.size());
  }
  std::vector<lockstep::parameter> parameters() {
    return {lockstep::param<float>("fc.weight", std::span(w), std::span(gw), {rows, cols}),
            lockstep::param<float>("fc.bias", std::span(b), std::span(gb), {cols}),
            lockstep::param<double>("head.weight", std::span(h), std::span(gh), {k}),
            lockstep::param<float>("empty", std::span(e), std::span(ge), {0})};
  }
};

bool same_bits(const TestModel& a, const TestModel& b) {
  auto eq = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  return eq(a.w, b.w) && eq(a.b, b.b) && eq(a.h, b.h);
}

struct FakeOptimizer {
  double lr = 0;
  std::int64_t t = 0;
  std::vector<float> m;
  void save(lockstep::byte_writer& w) const {
    w.write(lr);
    w.write(t);
    w.write_array(m);
  }
  void load(lockstep::byte_reader& r) {
    r.read(lr);
    r.read(t);
    m = r.read_array<float>();
  }
};
static_assert(lockstep::serializable<FakeOptimizer>);

// Reads less than FakeOptimizer wrote (a save/load disagreement).
struct ShortReader {
  double lr = 0;
  void save(lockstep::byte_writer& w) const { w.write(lr); }
  void load(lockstep::byte_reader& r) { r.read(lr); }
};
// Reads more than was written.
struct LongReader {
  double lr = 0;
  std::int64_t t = 0;
  std::vector<float> m;
  double extra = 0;
  void save(lockstep::byte_writer&) const {}
  void load(lockstep::byte_reader& r) {
    r.read(lr);
    r.read(t);
    m = r.read_array<float>();
    r.read(extra);
  }
};

// A hook that fails midway through writing its state.
struct ThrowingState {
  void save(lockstep::byte_writer& w) const {
    w.write(std::int64_t{7});
    throw std::runtime_error("hook failed midway");
  }
  void load(lockstep::byte_reader&) {}
};

struct LossScale {
  double scale;
  std::int64_t good_steps;
  double growth;
};

FakeOptimizer random_optimizer(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(1e-4, 1.0);
  FakeOptimizer o;
  o.lr = u(rng);
  o.t = static_cast<std::int64_t>(rng() % 100000) + 1;
  o.m.resize(17 + rng() % 50);
  for (auto& x : o.m) x = static_cast<float>(u(rng));
  return o;
}

Checkpoint full_checkpoint(TestModel& m, const FakeOptimizer& opt, const LossScale& ls, const std::mt19937_64& gen,
                           const lockstep::checkpoint_meta& meta, const std::vector<std::byte>& raw) {
  Checkpoint ck;
  ck.meta = meta;
  ck.add_parameters(m.parameters(), lockstep::HostMemory{});
  ck.add("optimizer", opt);
  ck.add_value("loss_scale", ls);
  ck.add_streamed("rng", gen);
  ck.add_blob("raw", std::span<const std::byte>(raw));
  return ck;
}

struct Fixture {
  std::uint64_t seed = std::random_device{}() ^ (std::uint64_t{std::random_device{}()} << 32);
  std::mt19937_64 rng{seed};
  TempDir dir;
};

//! Saves a checkpoint of model's parameters, with what `extra` adds to it after them, as
//! `name` in fx's directory; returns the file's path.
fs::path save_parameters(Fixture& fx, TestModel& model, const char* name,
                         const std::function<void(Checkpoint&)>& extra = {}) {
  Checkpoint ck;
  ck.add_parameters(model.parameters(), lockstep::HostMemory{});
  if (extra) extra(ck);
  const fs::path path = fx.dir.path / name;
  lockstep::save_checkpoint(path, ck);
  return path;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("checkpoint: CRC-32 and FNV-1a 64 match their references") {
  const char* check = "123456789";
  CHECK(lockstep::detail::crc32_of(check, 9) == 0xCBF43926u);  // the standard check value
  lockstep::detail::fnv1a64 f0;
  CHECK(f0.value() == 0xcbf29ce484222325ULL);
  lockstep::detail::fnv1a64 fa;
  fa.update("a", 1);
  CHECK(fa.value() == 0xaf63dc4c8601ec8cULL);  // published FNV-1a 64 test vector

  Fixture fx;
  CAPTURE(fx.seed);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<unsigned char> d(fx.rng() % 3000 + 1);
    for (auto& x : d) x = static_cast<unsigned char>(fx.rng());
    const auto want = ref_crc32(d.data(), d.size());
    CHECK(lockstep::detail::crc32_of(d.data(), d.size()) == want);
    // Fed in random pieces, the incremental CRC is the same.
    lockstep::detail::crc32 inc;
    std::size_t at = 0;
    while (at < d.size()) {
      const std::size_t n = std::min<std::size_t>(d.size() - at, fx.rng() % 40);
      inc.update(d.data() + at, n);
      at += n;
    }
    CHECK(inc.value() == want);
    ref_fnv rf;
    rf.bytes(d.data(), d.size());
    lockstep::detail::fnv1a64 f;
    f.update(d.data(), d.size());
    CHECK(f.value() == rf.h);
  }
}

TEST_CASE("checkpoint: byte_writer / byte_reader encode little-endian and check bounds") {
  Fixture fx;
  CAPTURE(fx.seed);
  lockstep::byte_writer w;
  const auto u = static_cast<std::uint32_t>(fx.rng());
  w.write(u);
  auto b = w.bytes();
  REQUIRE(b.size() == 4);
  for (int i = 0; i < 4; ++i) CHECK(static_cast<unsigned>(b[static_cast<std::size_t>(i)]) == ((u >> (8 * i)) & 0xFFu));

  const double d = std::uniform_real_distribution<double>(-1e6, 1e6)(fx.rng);
  const auto i64 = static_cast<std::int64_t>(fx.rng());
  std::vector<double> arr(5 + fx.rng() % 10);
  for (auto& x : arr) x = std::uniform_real_distribution<double>(-1, 1)(fx.rng);
  const std::string s = "name-" + std::to_string(fx.rng());
  w.write(d);
  w.write(i64);
  w.write(true);
  w.write_string(s);
  w.write_array(arr);
  const auto bytes = std::move(w).release();

  lockstep::byte_reader r(bytes, "test section");
  CHECK(r.read<std::uint32_t>() == u);
  CHECK(r.read<double>() == d);
  CHECK(r.read<std::int64_t>() == i64);
  CHECK(r.read<bool>() == true);
  CHECK(r.read_string() == s);
  std::vector<double> back(arr.size() + 1);
  CHECK_THROWS_AS(r.read_array(std::span<double>(back)), checkpoint_error);  // wrong length
  lockstep::byte_reader r2(std::span<const std::byte>(bytes).subspan(4 + 8 + 8 + 1 + 8 + s.size()), "test section");
  CHECK(r2.read_array<double>() == arr);
  CHECK(r2.at_end());
  const auto msg = error_of([&] { (void)r2.read<std::int32_t>(); });
  CHECK(contains(msg, "test section"));
  CHECK(contains(msg, "needs 4 more bytes"));

  std::vector<std::byte> bad_bool{std::byte{2}};
  lockstep::byte_reader r3(bad_bool, "flags");
  CHECK_THROWS_AS((void)r3.read<bool>(), checkpoint_error);
}

TEST_CASE("checkpoint: round trip of parameters + sections + meta (header checked independently)") {
  Fixture fx;
  CAPTURE(fx.seed);
  const auto rows = static_cast<std::int64_t>(3 + fx.rng() % 20);
  const auto cols = static_cast<std::int64_t>(2 + fx.rng() % 30);
  const auto k = static_cast<std::int64_t>(1 + fx.rng() % 40);
  TestModel model(rows, cols, k, fx.rng);
  const TestModel original = model;
  const auto opt = random_optimizer(fx.rng);
  const LossScale ls{std::ldexp(1.0, static_cast<int>(fx.rng() % 24)), static_cast<std::int64_t>(fx.rng() % 2000), 2.0};
  std::mt19937_64 gen(fx.rng());
  gen.discard(fx.rng() % 1000);
  const lockstep::checkpoint_meta meta{static_cast<std::int64_t>(fx.rng() % 100000),
                                       static_cast<std::int64_t>(fx.rng() % 100),
                                       static_cast<std::int64_t>(fx.rng() % 60000)};
  std::vector<std::byte> raw(1 + fx.rng() % 100);
  for (auto& x : raw) x = static_cast<std::byte>(fx.rng());

  const fs::path path = fx.dir.path / "model.lsck";
  lockstep::save_checkpoint(path, full_checkpoint(model, opt, ls, gen, meta, raw));
  CHECK(fx.dir.entries() == std::vector<std::string>{"model.lsck"});

  // The header, read independently of the loader.
  const auto file = read_file(path);
  REQUIRE(file.size() > 48);
  const unsigned char magic[8] = {0x89, 'L', 'S', 'C', 'K', 'P', 'T', '\n'};
  CHECK(std::memcmp(file.data(), magic, 8) == 0);
  CHECK(rd_le(file, 8, 4) == 1);
  CHECK(rd_le(file, 12, 2) == lockstep::version_major);
  CHECK(rd_le(file, 14, 2) == lockstep::version_minor);
  CHECK(rd_le(file, 16, 2) == lockstep::version_patch);
  CHECK(rd_le(file, 20, 4) == 48);
  CHECK(rd_le(file, 32, 8) == file.size() - 48);
  CHECK(rd_le(file, 40, 4) == ref_crc32(file.data() + 48, file.size() - 48));
  CHECK(rd_le(file, 44, 4) == ref_crc32(file.data(), 44));
  ref_fnv fp;
  for (const auto& p : model.parameters()) {
    fp.u64(p.name.size());
    fp.bytes(p.name.data(), p.name.size());
    fp.u64(static_cast<std::uint64_t>(p.type));
    fp.u64(p.shape.size());
    for (auto dim : p.shape) fp.u64(static_cast<std::uint64_t>(dim));
  }
  CHECK(rd_le(file, 24, 8) == fp.h);
  CHECK(lockstep::parameter_fingerprint(model.parameters()) == fp.h);

  // Load into a fresh model with different values.
  const auto ck = lockstep::load_checkpoint(path);
  CHECK(ck.source() == path);
  CHECK(ck.meta == meta);
  REQUIRE(ck.parameters().size() == 4);
  CHECK(ck.parameters()[0].name == "fc.weight");
  CHECK(ck.parameters()[0].shape == std::vector<std::int64_t>{rows, cols});
  CHECK(ck.parameters()[2].type == lockstep::dtype::f64);
  CHECK(ck.parameters()[2].values<double>() == original.h);
  CHECK_THROWS_AS((void)ck.parameters()[2].values<float>(), lockstep::config_error);

  TestModel fresh(rows, cols, k, fx.rng);
  REQUIRE_FALSE(same_bits(fresh, original));
  lockstep::restore_parameters(ck, fresh.parameters(), lockstep::HostMemory{});
  CHECK(same_bits(fresh, original));

  FakeOptimizer opt2;
  ck.restore("optimizer", opt2);
  CHECK(opt2.lr == opt.lr);
  CHECK(opt2.t == opt.t);
  CHECK(opt2.m == opt.m);

  LossScale ls2{};
  ck.restore_value("loss_scale", ls2);
  CHECK(ls2.scale == ls.scale);
  CHECK(ls2.good_steps == ls.good_steps);
  CHECK(ls2.growth == ls.growth);

  std::mt19937_64 gen2(12345);
  ck.restore_streamed("rng", gen2);
  std::mt19937_64 gen_copy = gen;
  for (int i = 0; i < 10; ++i) CHECK(gen2() == gen_copy());

  auto rb = ck.blob("raw");
  CHECK(std::vector<std::byte>(rb.begin(), rb.end()) == raw);
  CHECK(ck.section_names() == std::vector<std::string>{"optimizer", "loss_scale", "rng", "raw"});
  const auto missing = error_of([&] { (void)ck.blob("nope"); });
  CHECK(contains(missing, "no section 'nope'"));
  CHECK(contains(missing, path.string()));

  // Saving the loaded bundle again reproduces the file byte for byte.
  const fs::path again = fx.dir.path / "again.lsck";
  lockstep::save_checkpoint(again, ck);
  CHECK(read_file(again) == file);

  // Overwriting an existing checkpoint replaces it.
  TestModel other(rows, cols, k, fx.rng);
  Checkpoint ck2;
  ck2.add_parameters(other.parameters(), lockstep::HostMemory{});
  lockstep::save_checkpoint(path, ck2);
  TestModel fresh2(rows, cols, k, fx.rng);
  lockstep::restore_parameters(lockstep::load_checkpoint(path), fresh2.parameters(), lockstep::HostMemory{});
  CHECK(same_bits(fresh2, other));
  CHECK(fx.dir.entries() == std::vector<std::string>{"again.lsck", "model.lsck"});
}

TEST_CASE("checkpoint: a truncated file is reported as truncated") {
  Fixture fx;
  CAPTURE(fx.seed);
  TestModel model(4 + static_cast<std::int64_t>(fx.rng() % 8), 3, 5, fx.rng);
  const fs::path path = save_parameters(fx, model, "full.lsck", [&](Checkpoint& ck) {
    ck.meta.step = 3;
    ck.add("optimizer", random_optimizer(fx.rng));
  });
  const auto file = read_file(path);

  std::vector<std::size_t> cuts = {0, 1, 7, 8, 20, 47, 48, 49, 48 + (file.size() - 48) / 2, file.size() - 1};
  for (int i = 0; i < 5; ++i) cuts.push_back(fx.rng() % file.size());
  for (std::size_t cut : cuts) {
    CAPTURE(cut);
    const fs::path cut_path = fx.dir.path / "cut.lsck";
    write_file(cut_path, std::vector<unsigned char>(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(cut)));
    const auto msg = error_of([&] { (void)lockstep::load_checkpoint(cut_path); });
    CHECK(contains(msg, "truncated"));
    CHECK(contains(msg, cut_path.string()));
  }

  auto longer = file;
  longer.push_back(static_cast<unsigned char>(fx.rng()));
  write_file(fx.dir.path / "long.lsck", longer);
  CHECK(contains(error_of([&] { (void)lockstep::load_checkpoint(fx.dir.path / "long.lsck"); }),
                 "unexpected bytes after its payload"));

  CHECK(contains(error_of([&] { (void)lockstep::load_checkpoint(fx.dir.path / "absent.lsck"); }), "cannot open"));
}

TEST_CASE("checkpoint: a corrupted byte is caught by the checksums") {
  Fixture fx;
  CAPTURE(fx.seed);
  TestModel model(6, 5, 7, fx.rng);
  const fs::path path =
      save_parameters(fx, model, "c.lsck", [](Checkpoint& ck) { ck.add_blob("note", std::string_view("hello")); });
  const auto file = read_file(path);
  const fs::path bad = fx.dir.path / "bad.lsck";

  for (int trial = 0; trial < 10; ++trial) {
    auto f = file;
    const std::size_t at = 48 + fx.rng() % (file.size() - 48);
    const auto mask = static_cast<unsigned char>(1 + fx.rng() % 255);
    CAPTURE(at);
    CAPTURE(static_cast<int>(mask));
    f[at] ^= mask;
    write_file(bad, f);
    const auto msg = error_of([&] { (void)lockstep::load_checkpoint(bad); });
    CHECK(contains(msg, "checksum mismatch"));
    CHECK(contains(msg, bad.string()));
  }
  // Every header field is covered by the header checksum, the version word too: one flipped
  // bit there is damage, not a file of another format ("load it with a matching lockstep").
  for (std::size_t at : {std::size_t{8}, std::size_t{9}, std::size_t{11}, std::size_t{12}, std::size_t{24},
                         std::size_t{32}, std::size_t{40}, std::size_t{45}}) {
    CAPTURE(at);
    auto f = file;
    f[at] ^= static_cast<unsigned char>(1 + fx.rng() % 255);
    write_file(bad, f);
    const auto msg = error_of([&] { (void)lockstep::load_checkpoint(bad); });
    CHECK(contains(msg, "corrupt header"));
    CHECK_FALSE(contains(msg, "format version"));
  }
  auto f = file;
  f[1] = 'X';
  write_file(bad, f);
  CHECK(contains(error_of([&] { (void)lockstep::load_checkpoint(bad); }), "not a lockstep checkpoint"));
}

TEST_CASE("checkpoint: a different format version is refused") {
  Fixture fx;
  CAPTURE(fx.seed);
  TestModel model(2, 2, 2, fx.rng);
  const fs::path path = save_parameters(fx, model, "v.lsck");
  auto f = read_file(path);
  const std::uint32_t v = 2 + static_cast<std::uint32_t>(fx.rng() % 1000);
  for (int i = 0; i < 4; ++i) f[8 + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
  // Keep the header checksum valid, so only the version is wrong.
  const auto hc = ref_crc32(f.data(), 44);
  for (int i = 0; i < 4; ++i) f[44 + static_cast<std::size_t>(i)] = static_cast<unsigned char>(hc >> (8 * i));
  write_file(path, f);
  const auto msg = error_of([&] { (void)lockstep::load_checkpoint(path); });
  CHECK(contains(msg, "format version " + std::to_string(v)));
  CHECK(contains(msg, "matching lockstep version"));
  CHECK(contains(msg, path.string()));
}

TEST_CASE("checkpoint: restoring into a different model names the parameter and changes nothing") {
  Fixture fx;
  CAPTURE(fx.seed);
  TestModel a(5, 4, 3, fx.rng);
  const fs::path path = save_parameters(fx, a, "a.lsck");
  const auto ck = lockstep::load_checkpoint(path);

  // Each variant matches parameter #0 (so a non-atomic restore would have written it) and
  // differs later.
  struct Variant {
    const char* what;
    std::function<std::vector<lockstep::parameter>(TestModel&)> params;
    std::string names;
  };
  const std::vector<Variant> variants = {
      {"shape",
       [](TestModel& m) {
         auto p = m.parameters();
         p[2].shape = {1, m.k};
         return p;
       },
       "head.weight"},
      {"name",
       [](TestModel& m) {
         auto p = m.parameters();
         p[1].name = "fc.b";
         return p;
       },
       "fc.bias"},
      {"dtype",
       [](TestModel& m) {
         auto p = m.parameters();
         p[2] = lockstep::param<float>("head.weight", m.w.data(), m.gw.data(), {m.k});
         return p;
       },
       "head.weight"},
      {"extra",
       [](TestModel& m) {
         auto p = m.parameters();
         p.push_back(lockstep::param<float>("extra.bias", m.b.data(), m.gb.data(), {m.cols}));
         return p;
       },
       "extra.bias"},
      {"missing",
       [](TestModel& m) {
         auto p = m.parameters();
         p.pop_back();
         return p;
       },
       "empty"},
  };
  for (const auto& v : variants) {
    CAPTURE(v.what);
    TestModel b(5, 4, 3, fx.rng);
    const TestModel before = b;
    const auto msg = error_of([&] { lockstep::restore_parameters(ck, v.params(b), lockstep::HostMemory{}); });
    CHECK(contains(msg, v.names));
    CHECK(contains(msg, path.string()));
    CHECK(contains(msg, "saved from"));
    CHECK(same_bits(b, before));
  }
  // A checkpoint without parameters says so.
  Checkpoint none;
  TestModel c(5, 4, 3, fx.rng);
  CHECK(contains(error_of([&] { lockstep::restore_parameters(none, c.parameters(), lockstep::HostMemory{}); }),
                 "holds no parameters"));
}

TEST_CASE("checkpoint: section restore is all-or-nothing and checks save/load agree") {
  Fixture fx;
  CAPTURE(fx.seed);
  const auto opt = random_optimizer(fx.rng);
  Checkpoint ck;
  ck.add("optimizer", opt);
  ck.add_value("ls", LossScale{1.0, 2, 3.0});

  ShortReader s{0.5};
  CHECK(contains(error_of([&] { ck.restore("optimizer", s); }), "disagree"));
  CHECK(s.lr == 0.5);  // unchanged although load() had assigned lr before the check

  LongReader l{};
  l.lr = 0.25;
  CHECK(contains(error_of([&] { ck.restore("optimizer", l); }), "section 'optimizer'"));
  CHECK(l.lr == 0.25);
  CHECK(l.m.empty());

  double wrong_size = 0;
  CHECK(contains(error_of([&] { ck.restore_value("ls", wrong_size); }), "holds 24 bytes"));

  // A hook that throws leaves the bundle without that section; a duplicate name is refused.
  CHECK_THROWS_WITH_AS(ck.add("broken", ThrowingState{}), "hook failed midway", std::runtime_error);
  CHECK_FALSE(ck.contains("broken"));
  CHECK_THROWS_AS(ck.add("optimizer", opt), lockstep::config_error);
}

TEST_CASE("checkpoint: a failed save leaves the previous checkpoint bit-identical and no temp file") {
  Fixture fx;
  CAPTURE(fx.seed);
  TestModel model(8, 8, 8, fx.rng);
  const TestModel original = model;
  const fs::path path = fx.dir.path / "ck.lsck";
  {
    Checkpoint ck;
    ck.add_parameters(model.parameters(), lockstep::HostMemory{});
    ck.add("optimizer", random_optimizer(fx.rng));
    lockstep::save_checkpoint(path, ck);
  }
  const auto before = read_file(path);
  const std::vector<std::string> only{"ck.lsck"};

  // Train on: the live model now differs from the saved one.
  TestModel later(8, 8, 8, fx.rng);
  auto later_ck = [&] {
    Checkpoint ck;
    ck.add_parameters(later.parameters(), lockstep::HostMemory{});
    return ck;
  };

  SUBCASE("a serialization hook throws midway") {
    CHECK_THROWS_WITH_AS(([&] {
                           auto ck = later_ck();
                           ck.add("optimizer", ThrowingState{});
                           lockstep::save_checkpoint(path, ck);
                         }()),
                         "hook failed midway", std::runtime_error);
  }
  SUBCASE("the directory is missing") {
    const auto target = fx.dir.path / "no-such-dir" / "ck.lsck";
    const auto msg = error_of([&] { lockstep::save_checkpoint(target, later_ck()); });
    CHECK(contains(msg, "does not exist"));
    CHECK(contains(msg, target.string()));
    CHECK_FALSE(fs::exists(fx.dir.path / "no-such-dir"));
  }
  SUBCASE("the rename fails after the temporary file was written") {
    // A non-empty directory in the way: the temp file is fully written, then rename fails.
    const auto blocked = fx.dir.path / "blocked";
    fs::create_directories(blocked / "inside");
    const auto msg = error_of([&] { lockstep::save_checkpoint(blocked, later_ck()); });
    CHECK(contains(msg, "renaming"));
    CHECK(contains(msg, "directory is in the way"));
    fs::remove_all(blocked);
  }
  SUBCASE("a write fails partway (file size limit, standing in for a full disk)") {
    // Make the new checkpoint larger than the limit so the failure is mid-payload.
    std::vector<float> big(1 << 16);
    for (auto& x : big) x = static_cast<float>(fx.rng() % 1000) + 0.5f;
    std::vector<float> gbig(big.size());
    std::vector<lockstep::parameter> ps = later.parameters();
    ps.push_back(lockstep::param<float>("big", std::span(big), std::span(gbig)));
    Checkpoint ck;
    ck.add_parameters(ps, lockstep::HostMemory{});

    rlimit old{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
    auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);  // get EFBIG instead of a signal
    rlimit lim = old;
    lim.rlim_cur = 64 * 1024;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
    const auto msg = error_of([&] { lockstep::save_checkpoint(path, ck); });
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    CHECK(contains(msg, "writing"));
    CHECK(contains(msg, "unchanged"));
  }

  CHECK(read_file(path) == before);
  CHECK(fx.dir.entries() == only);
  TestModel restored(8, 8, 8, fx.rng);
  lockstep::restore_parameters(lockstep::load_checkpoint(path), restored.parameters(), lockstep::HostMemory{});
  CHECK(same_bits(restored, original));
}

TEST_CASE("checkpoint: with ThreadComm only rank 0 writes and every rank can load after it") {
  Fixture fx;
  CAPTURE(fx.seed);
  constexpr int n = 3;
  // Every rank holds the same parameters (as after DataParallel's broadcast).
  const std::uint64_t model_seed = fx.rng();
  std::mt19937_64 ref_rng(model_seed);
  const TestModel reference(6, 3, 4, ref_rng);
  const auto opt = random_optimizer(fx.rng);
  const fs::path path = fx.dir.path / "shared.lsck";

  auto run_ranks = [&](auto body) {
    auto comms = lockstep::ThreadComm::create_group(n);
    std::vector<std::exception_ptr> errs(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          body(comms[static_cast<std::size_t>(r)]);
        } catch (...) {
          errs[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    return errs;
  };

  std::atomic<int> builds{0};
  std::vector<int> restored_ok(n, 0);
  auto errs = run_ranks([&](lockstep::ThreadComm& comm) {
    std::mt19937_64 local(model_seed);
    TestModel mine(6, 3, 4, local);
    lockstep::save_checkpoint_rank0(comm, path, [&](Checkpoint& ck) {
      builds.fetch_add(1);
      ck.meta.step = 42;
      ck.add_parameters(mine.parameters(), comm.memory());
      ck.add("optimizer", opt);
    });
    // Straight after the call, the file is complete on every rank.
    const auto ck = lockstep::load_checkpoint(path);
    std::mt19937_64 other(model_seed + 1);
    TestModel fresh(6, 3, 4, other);
    lockstep::restore_parameters(ck, fresh.parameters(), comm.memory());
    FakeOptimizer o;
    ck.restore("optimizer", o);
    restored_ok[static_cast<std::size_t>(comm.rank())] =
        same_bits(fresh, reference) && o.m == opt.m && ck.meta.step == 42;
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK_FALSE(errs[static_cast<std::size_t>(r)]);
    CHECK(restored_ok[static_cast<std::size_t>(r)] == 1);
  }
  CHECK(builds.load() == 1);
  CHECK(fx.dir.entries() == std::vector<std::string>{"shared.lsck"});

  // If rank 0 fails, every rank throws instead of hanging or loading a missing file.
  const auto bad = fx.dir.path / "missing" / "x.lsck";
  auto errs2 = run_ranks([&](lockstep::ThreadComm& comm) {
    lockstep::save_checkpoint_rank0(comm, bad, [&](Checkpoint& ck) { ck.meta.step = 1; });
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    std::string msg;
    try {
      if (errs2[static_cast<std::size_t>(r)]) std::rethrow_exception(errs2[static_cast<std::size_t>(r)]);
    } catch (const checkpoint_error& e) {
      msg = e.what();
    }
    CHECK(contains(msg, r == 0 ? "does not exist" : "rank 0 failed"));
  }
  CHECK(fx.dir.entries() == std::vector<std::string>{"shared.lsck"});
}

}  // TEST_SUITE
