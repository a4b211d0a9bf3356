#pragma once
// Real text as tokens: every file of a directory (default: the fortune cookies of Debian's
// `fortunes` package), read as bytes — token = byte value, no tokenizer files needed. Each
// rank draws its own windows: window i of step s on rank r starts at a position drawn from
// (seed, step, rank, i), so the batch of N ranks is N different windows.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace gpt2 {

class TextData {
 public:
  //! All regular files under dir (sorted, symbolic links skipped), concatenated.
  explicit TextData(const std::filesystem::path& dir) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_regular_file(dir)) files.push_back(dir);
    else if (std::filesystem::is_directory(dir))
      for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
        if (e.is_regular_file() && !e.is_symlink() && e.path().extension() != ".dat") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      bytes_.insert(bytes_.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    if (bytes_.size() < 4096)
      throw std::runtime_error("gpt2: " + dir.string() + " holds " + std::to_string(bytes_.size()) +
                               " bytes of text; give a file or directory of text with --data (Debian: "
                               "apt-get install fortunes puts some in /usr/share/games/fortunes)");
  }

  std::size_t size() const noexcept { return bytes_.size(); }

  //! Tokens [rows, T + 1] (int64) for (step, rank): inputs [:, :T], targets [:, 1:].
  torch::Tensor batch(std::int64_t rows, std::int64_t T, std::uint64_t seed, std::int64_t step, int rank) const {
    auto out = torch::empty({rows, T + 1}, torch::kLong);
    auto* p = out.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < rows; ++i) {
      std::seed_seq s{seed, static_cast<std::uint64_t>(step), static_cast<std::uint64_t>(rank),
                      static_cast<std::uint64_t>(i)};
      std::mt19937_64 rng(s);
      const auto start = static_cast<std::size_t>(rng() % (bytes_.size() - static_cast<std::size_t>(T) - 1));
      for (std::int64_t t = 0; t <= T; ++t)
        p[i * (T + 1) + t] = static_cast<unsigned char>(bytes_[start + static_cast<std::size_t>(t)]);
    }
    return out;
  }

 private:
  std::vector<char> bytes_;
};

}  // namespace gpt2
