#pragma once
// Reader for the gzipped IDX files of (Fashion-)MNIST. IDX: a big-endian u32 magic
// (0x00000803: unsigned bytes, 3 dimensions — images; 0x00000801: 1 dimension — labels),
// one big-endian u32 per dimension, then the bytes. Every problem is a data_error that
// names the file and says what is wrong with it.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <zlib.h>

namespace fmnist {

struct data_error : std::runtime_error {
  data_error(const std::string& what, bool missing_file) : std::runtime_error(what), missing(missing_file) {}
  bool missing;  // the file is not there at all (vs. present but unreadable or corrupt)
};

inline constexpr int image_side = 28;
inline constexpr int image_pixels = image_side * image_side;
inline constexpr int classes = 10;

struct split {
  std::size_t size = 0;
  std::vector<std::uint8_t> pixels;  // size × 784, row-major, 0 = background
  std::vector<std::uint8_t> labels;  // size, each < 10
};

namespace detail {

class gz_file {
 public:
  explicit gz_file(const std::filesystem::path& path) : path_(path.string()) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec))
      throw data_error("cannot find '" + path_ +
                           "': the Fashion-MNIST data is not installed there. Install it with "
                           "`sudo apt-get install dataset-fashion-mnist`, or pass --data DIR "
                           "with the directory that holds {train,t10k}-{images-idx3,labels-idx1}"
                           "-ubyte.gz",
                       true);
    errno = 0;
    f_ = gzopen(path_.c_str(), "rb");
    if (f_ == nullptr)
      throw data_error(
          "cannot open '" + path_ + "': " + (errno ? std::strerror(errno) : "zlib could not allocate its state"),
          false);
    gzbuffer(f_, 1u << 18);  // fewer, larger reads: decompression dominates the load time
  }
  gz_file(const gz_file&) = delete;
  gz_file& operator=(const gz_file&) = delete;
  ~gz_file() {
    if (f_) gzclose(f_);
  }

  // Reads up to n bytes; returns how many arrived (fewer only at the end of the data).
  // A decompression error (corrupt or cut-off gzip stream) throws.
  std::size_t read(void* dst, std::size_t n) {
    auto* p = static_cast<unsigned char*>(dst);
    std::size_t got = 0;
    while (got < n) {
      const auto want = static_cast<unsigned>(std::min<std::size_t>(n - got, 1u << 30));
      const int k = gzread(f_, p + got, want);
      if (k < 0) fail_stream();
      if (k == 0) break;
      got += static_cast<std::size_t>(k);
      total_ += static_cast<std::size_t>(k);
    }
    if (got < n) {
      int code = Z_OK;
      gzerror(f_, &code);
      if (code != Z_OK) fail_stream();
    }
    return got;
  }

  std::uint32_t read_u32_be(const char* what) {
    unsigned char b[4];
    if (read(b, 4) != 4)
      throw data_error("'" + path_ + "' is truncated: it ends inside its IDX header (reading " + what +
                           "); the download or copy was cut short — reinstall "
                           "dataset-fashion-mnist",
                       false);
    return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | std::uint32_t{b[3]};
  }

  [[noreturn]] void fail(const std::string& problem) const { throw data_error("'" + path_ + "' " + problem, false); }
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail_stream() {
    int code = Z_OK;
    std::string msg = gzerror(f_, &code);
    if (msg.starts_with(path_ + ": ")) msg.erase(0, path_.size() + 2);  // zlib prefixes the path
    fail("is corrupt: zlib reports \"" + msg + "\" after " + std::to_string(total_) +
         " decompressed bytes (a truncated or damaged gzip file); "
         "reinstall dataset-fashion-mnist");
  }

  std::string path_;
  gzFile f_ = nullptr;
  std::size_t total_ = 0;  // bytes decompressed so far
};

inline std::string hex32(std::uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", static_cast<unsigned>(v));
  return b;
}

// Reads the payload bytes of `count` items of `item_bytes` each; a short read names both.
inline void read_items(gz_file& f, std::vector<std::uint8_t>& out, std::size_t count, std::size_t item_bytes,
                       std::size_t header_count, const char* items) {
  out.resize(count * item_bytes);
  const std::size_t got = f.read(out.data(), out.size());
  if (got != out.size())
    f.fail("is truncated: its header announces " + std::to_string(header_count) + " " + items +
           " but the data ends after " + std::to_string(got / item_bytes) + " of them (" + std::to_string(got) +
           " of " + std::to_string(out.size()) + " bytes read); reinstall dataset-fashion-mnist");
}

inline void expect_end(gz_file& f, const char* items) {
  unsigned char extra;
  if (f.read(&extra, 1) != 0)
    f.fail(std::string("has bytes after the last of the ") + items +
           " its header announces: the file is corrupt or not an IDX file");
}

}  // namespace detail

// Images: returns the header's count (≤ limit of them are read into out.pixels).
inline std::size_t read_images(const std::filesystem::path& path, std::size_t limit, split& out) {
  detail::gz_file f(path);
  const std::uint32_t magic = f.read_u32_be("the magic number");
  if (magic != 0x00000803u)
    f.fail("has bad magic " + detail::hex32(magic) +
           ": expected 0x00000803 (IDX, unsigned bytes, 3 dimensions — an image file); "
           "is it the right file?");
  const std::uint32_t n = f.read_u32_be("the image count");
  const std::uint32_t rows = f.read_u32_be("the row count");
  const std::uint32_t cols = f.read_u32_be("the column count");
  if (rows != image_side || cols != image_side)
    f.fail("holds " + std::to_string(rows) + "x" + std::to_string(cols) +
           " images; Fashion-MNIST images are 28x28 — is it the right file?");
  if (n == 0 || n > 10'000'000u)
    f.fail("announces " + std::to_string(n) +
           " images; expected between 1 and 10,000,000 "
           "(the header is corrupt)");
  const std::size_t count = std::min<std::size_t>(n, limit);
  detail::read_items(f, out.pixels, count, image_pixels, n, "images");
  if (count == n) detail::expect_end(f, "images");
  out.size = count;
  return n;
}

// Labels: returns the header's count; every label read must be < 10.
inline std::size_t read_labels(const std::filesystem::path& path, std::size_t limit, split& out) {
  detail::gz_file f(path);
  const std::uint32_t magic = f.read_u32_be("the magic number");
  if (magic != 0x00000801u)
    f.fail("has bad magic " + detail::hex32(magic) +
           ": expected 0x00000801 (IDX, unsigned bytes, 1 dimension — a label file); "
           "is it the right file?");
  const std::uint32_t n = f.read_u32_be("the label count");
  if (n == 0 || n > 10'000'000u)
    f.fail("announces " + std::to_string(n) +
           " labels; expected between 1 and 10,000,000 "
           "(the header is corrupt)");
  const std::size_t count = std::min<std::size_t>(n, limit);
  detail::read_items(f, out.labels, count, 1, n, "labels");
  if (count == n) detail::expect_end(f, "labels");
  for (std::size_t i = 0; i < count; ++i)
    if (out.labels[i] >= classes)
      f.fail("is corrupt: label " + std::to_string(out.labels[i]) + " at index " + std::to_string(i) +
             " is out of range (Fashion-MNIST has 10 classes, 0-9)");
  return n;
}

// "<dir>/<prefix>-images-idx3-ubyte.gz" and its labels; at most `limit` samples.
inline split load_split(const std::filesystem::path& dir, const std::string& prefix, std::size_t limit) {
  const auto images = dir / (prefix + "-images-idx3-ubyte.gz");
  const auto labels = dir / (prefix + "-labels-idx1-ubyte.gz");
  split s;
  const std::size_t ni = read_images(images, limit, s);
  const std::size_t nl = read_labels(labels, limit, s);
  if (ni != nl)
    throw data_error("'" + images.string() + "' holds " + std::to_string(ni) + " images but '" + labels.string() +
                         "' holds " + std::to_string(nl) +
                         " labels; the two files must come from the same split "
                         "(reinstall dataset-fashion-mnist)",
                     false);
  return s;
}

}  // namespace fmnist
