// ScalarLog's files read back by the readers people use: TensorBoard's own EventAccumulator
// (Python, the `tensorboard` package the README's test command installs) for the event file,
// Python's csv and json for the others — every tag, step and value as written (the event
// file stores floats). Only rank 0 writes; lockstep's own training scalars come through.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <lockstep/lockstep.hpp>

#include "mlp.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;

namespace {

using key = std::tuple<std::string, std::string, std::int64_t>;  // source, tag, step

//! What read_scalars.py prints, by (source, tag, step): the value text.
std::map<key, std::string> read_back(const fs::path& dir, const fs::path& csv, const fs::path& jsonl) {
  int rc = 0;
  const std::string text =
      lockstep_test::command_output(std::string(LOCKSTEP_PYTHON) + " " + LOCKSTEP_READ_SCALARS + " '" + dir.string() +
                                        "' '" + csv.string() + "' '" + jsonl.string() + "'",
                                    rc);
  INFO("read_scalars.py printed:\n" << text);
  REQUIRE_MESSAGE(rc == 0, "reading the files back failed (is the Python package tensorboard installed? "
                           "scripts/install_deps.sh installs it)");
  std::map<key, std::string> out;
  for (const auto& row : lockstep_test::tab_fields(text, 4)) out[{row[0], row[1], std::stoll(row[2])}] = row[3];
  return out;
}

struct scratch {
  fs::path dir = fs::temp_directory_path() / ("lockstep_tb_" + std::to_string(lockstep_test::fresh_seed()));
  ~scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("tensorboard: ScalarLog's event file - CSV and JSON lines read back by their readers") {
  LOCKSTEP_SEEDED(std::mt19937_64 rng);
  scratch s;
  const lockstep::ScalarLogOptions o{
      .tensorboard = s.dir / "tb", .csv = s.dir / "log.csv", .jsonl = s.dir / "log.jsonl"};
  const std::vector<std::string> tags{"train/loss", "test/accuracy", "odd, \"quoted\" tag"};
  std::map<std::pair<std::string, std::int64_t>, double> wrote;
  {
    lockstep::ScalarLog log(0, o);
    CHECK(log.active());
    std::uniform_real_distribution<double> u(-1e3, 1e3);
    for (std::int64_t step = 0; step < 40; ++step)
      for (const auto& t : tags) {
        if (rng() % 4 == 0) continue;  // not every tag at every step
        const double v = u(rng) * std::pow(10.0, static_cast<int>(rng() % 7) - 3);
        log.scalar(t, step * 3 + 1, v);
        wrote[{t, step * 3 + 1}] = v;
      }
    log.scalar("special", 5, std::numeric_limits<double>::infinity());
  }
  // One event file, in the directory asked for.
  int files = 0;
  for (const auto& e : fs::directory_iterator(o.tensorboard))
    files += e.path().filename().string().starts_with("events.out.tfevents.") ? 1 : 0;
  CHECK(files == 1);

  const auto got = read_back(o.tensorboard, o.csv, o.jsonl);
  for (const auto& [ts, v] : wrote) {
    const auto& [tag, step] = ts;
    CAPTURE(tag);
    CAPTURE(step);
    REQUIRE(got.count({"tb", tag, step}) == 1);
    CHECK(std::stod(got.at({"tb", tag, step})) == static_cast<double>(static_cast<float>(v)));  // stored as float
    REQUIRE(got.count({"csv", tag, step}) == 1);
    CHECK(std::stod(got.at({"csv", tag, step})) == v);
    REQUIRE(got.count({"json", tag, step}) == 1);
    CHECK(std::stod(got.at({"json", tag, step})) == v);
  }
  CHECK(got.size() == 3 * wrote.size() + 3);  // nothing more, nothing less (+ "special" thrice)
  CHECK(got.at({"tb", "special", 5}) == "inf");
  CHECK(got.at({"csv", "special", 5}) == "inf");
  CHECK(got.at({"json", "special", 5}) == "null");
}

TEST_CASE("tensorboard: only rank 0 writes - lockstep's training scalars come through") {
  const auto seed = lockstep_test::fresh_seed();
  CAPTURE(seed);
  scratch s;
  const lockstep::ScalarLogOptions o{
      .tensorboard = s.dir / "tb", .csv = s.dir / "log.csv", .jsonl = s.dir / "log.jsonl"};
  std::vector<double> scales;
  lockstep::run(lockstep::Threads{3}, [&](auto& ctx) {
    lockstep_test::TestMlp<float> m({6, 8, 3}, seed);
    lockstep::DataParallel dp(ctx, m, {.max_grad_norm = 0.01}, lockstep::DynamicScale({.init_scale = 256}));
    lockstep::ScalarLog log(ctx.rank(), o);
    CHECK(log.active() == (ctx.rank() == 0));
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ctx.rank()));
    const auto x = lockstep_test::random_vector<float>(12 * 6, rng);
    const std::vector<int> y{0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2};
    for (std::int64_t step = 1; step <= 4; ++step) {
      auto st = dp.step();
      const std::vector<std::size_t> rows{0, 1, 2, 3};
      m.forward_backward(x, y, rows, st.on_gradient_ready(), st.loss_scale());
      const auto r = st.finish();
      if (r) m.sgd(0.1);
      log.training(step, dp, r);
      if (ctx.rank() == 0) scales.push_back(dp.scaler().scale());
    }
  });
  int files = 0;
  for (const auto& e : fs::directory_iterator(o.tensorboard)) files += e.is_regular_file() ? 1 : 0;
  CHECK(files == 1);  // rank 0's
  const auto got = read_back(o.tensorboard, o.csv, o.jsonl);
  for (std::int64_t step = 1; step <= 4; ++step) {
    CAPTURE(step);
    CHECK(std::stod(got.at({"tb", "lockstep/loss_scale", step})) == scales[static_cast<std::size_t>(step - 1)]);
    CHECK(std::stod(got.at({"json", "lockstep/skipped_steps", step})) == 0.0);
    CHECK(std::stod(got.at({"csv", "lockstep/grad_norm", step})) > 0.01);  // it clipped
    CHECK(got.count({"tb", "lockstep/comm_seconds", step}) == 1);
  }
}

TEST_CASE("tensorboard: a log directory that cannot be made is named") {
  scratch s;
  fs::create_directories(s.dir);
  {
    std::ofstream(s.dir / "file") << "x";
  }
  CHECK_THROWS_WITH_AS(lockstep::ScalarLog(0, {.tensorboard = s.dir / "file" / "tb"}),
                       doctest::Contains("cannot create"), lockstep::config_error);
}

}  // TEST_SUITE
