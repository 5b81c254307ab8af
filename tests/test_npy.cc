// .npy files: write/read round trips, and the header checked byte by byte against the format
// (https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/npy.h"
#include "test_util.h"

namespace tpx {
namespace {

namespace fs = std::filesystem;
using Shape = std::vector<std::int64_t>;

std::vector<float> ramp(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 0.25f * float(i) - 3.0f + 1e-3f * float(i * i);
  return v;
}

std::size_t count(const Shape& s) {
  std::size_t n = 1;
  for (auto d : s) n *= static_cast<std::size_t>(d);
  return n;
}

class NpyRoundTrip : public ::testing::TestWithParam<Shape> {};

TEST_P(NpyRoundTrip, ReadsBackWhatWasWritten) {
  const test::TempDir dir;
  const Shape shape = GetParam();
  const auto data = ramp(count(shape));
  const fs::path path = dir / "t.npy";
  write_npy(path, data, shape);
  const NpyArray a = read_npy(path);
  EXPECT_EQ(a.shape, shape);
  EXPECT_EQ(a.data, data);  // bit-exact
}

INSTANTIATE_TEST_SUITE_P(Shapes, NpyRoundTrip,
                         ::testing::Values(Shape{1}, Shape{7}, Shape{3, 5}, Shape{2, 3, 4},
                                           Shape{4, 1, 2, 3}));

/// The version 1.0 header: magic, version, little-endian u16 length, a Python dict literal
/// padded with spaces and ended by '\n' so that the data starts at a multiple of 64.
struct Header {
  std::string magic;
  int major = -1, minor = -1;
  std::size_t data_offset = 0;
  std::string dict;
};

Header parse_header(const std::string& bytes) {
  Header h;
  if (bytes.size() < 10) return h;
  h.magic = bytes.substr(0, 6);
  h.major = static_cast<unsigned char>(bytes[6]);
  h.minor = static_cast<unsigned char>(bytes[7]);
  const std::size_t len = static_cast<unsigned char>(bytes[8]) |
                          static_cast<std::size_t>(static_cast<unsigned char>(bytes[9])) << 8;
  h.data_offset = 10 + len;
  h.dict = bytes.substr(10, len);
  return h;
}

TEST(NpyHeader, IsVersion1AlignedAndDescribesTheArray) {
  const test::TempDir dir;
  for (const Shape& shape : {Shape{5}, Shape{2, 3, 4}, Shape{128, 2, 256}}) {
    const fs::path path = dir / "h.npy";
    const auto data = ramp(count(shape));
    write_npy(path, data, shape);
    const std::string bytes = test::read_file(path);
    const Header h = parse_header(bytes);
    EXPECT_EQ(h.magic, std::string("\x93NUMPY"));
    EXPECT_EQ(h.major, 1);
    EXPECT_EQ(h.minor, 0);
    EXPECT_EQ(h.data_offset % 64, 0u);
    ASSERT_FALSE(h.dict.empty());
    EXPECT_EQ(h.dict.back(), '\n');
    EXPECT_EQ(h.dict.front(), '{');
    EXPECT_NE(h.dict.find("'descr': '<f4'"), std::string::npos) << h.dict;
    EXPECT_NE(h.dict.find("'fortran_order': False"), std::string::npos) << h.dict;
    std::string tuple = "(";
    for (std::size_t i = 0; i < shape.size(); ++i)
      tuple += (i ? ", " : "") + std::to_string(shape[i]);
    tuple += shape.size() == 1 ? ",)" : ")";  // Python's one-element tuple
    EXPECT_NE(h.dict.find("'shape': " + tuple), std::string::npos) << h.dict;
    // The data follows the header directly, little-endian float32 in C order.
    ASSERT_EQ(bytes.size(), h.data_offset + 4 * data.size());
    std::vector<float> back(data.size());
    std::memcpy(back.data(), bytes.data() + h.data_offset, 4 * data.size());
    EXPECT_EQ(back, data);
  }
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(NpyRead, RejectsFilesThatAreNotFloat32Npy) {
  const test::TempDir dir;
  write_bytes(dir / "text.npy", "hello, this is not a numpy file\n");
  EXPECT_THROW(read_npy(dir / "text.npy"), Error);
  write_bytes(dir / "empty.npy", "");
  EXPECT_THROW(read_npy(dir / "empty.npy"), Error);
  EXPECT_THROW(read_npy(dir / "missing.npy"), Error);

  // A valid header for float64 data: not what the reader supports.
  std::string dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }";
  dict.append(64 - (10 + dict.size() + 1) % 64, ' ');
  dict.push_back('\n');
  std::string f8 = std::string("\x93NUMPY\x01\x00", 8);
  f8.push_back(static_cast<char>(dict.size() & 0xff));
  f8.push_back(static_cast<char>(dict.size() >> 8));
  f8 += dict + std::string(16, '\0');
  write_bytes(dir / "f8.npy", f8);
  EXPECT_THROW(read_npy(dir / "f8.npy"), Error);

  // A float32 file cut short of its shape.
  write_npy(dir / "full.npy", ramp(24), {2, 3, 4});
  const std::string bytes = test::read_file(dir / "full.npy");
  write_bytes(dir / "short.npy", bytes.substr(0, bytes.size() - 4));
  EXPECT_THROW(read_npy(dir / "short.npy"), Error);
}

TEST(NpyWrite, RejectsAShapeThatDoesNotMatchAndAnUnwritablePath) {
  const test::TempDir dir;
  EXPECT_THROW(write_npy(dir / "bad.npy", ramp(5), {2, 3}), Error);
  write_bytes(dir / "file", "x");
  EXPECT_THROW(write_npy(dir / "file" / "sub.npy", ramp(2), {2}), Error);
}

}  // namespace
}  // namespace tpx
