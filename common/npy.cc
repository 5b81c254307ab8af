#include "npy.h"

#include <cstring>
#include <fstream>
#include <numeric>
#include <regex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "check.h"
#include "output.h"

namespace tpx {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

std::string shape_tuple(const std::vector<std::int64_t>& shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

std::int64_t count(const std::vector<std::int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

/// Writes `bytes` of `n` elements of NumPy type `descr` in the given shape.
void write_array(const std::filesystem::path& path, std::string_view descr, const void* bytes,
                 std::size_t size, std::size_t n, const std::vector<std::int64_t>& shape) {
  TPX_CHECK(static_cast<std::int64_t>(n) == count(shape), "{} values do not fill shape {}", n,
            shape_tuple(shape));
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
                                   descr, shape_tuple(shape));
  // magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple of 64
  // and ended by '\n'.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  const auto len = static_cast<std::uint16_t>(header.size());
  const char prefix[10] = {kMagic[0],
                           kMagic[1],
                           kMagic[2],
                           kMagic[3],
                           kMagic[4],
                           kMagic[5],
                           1,
                           0,
                           static_cast<char>(len & 0xff),
                           static_cast<char>(len >> 8)};
  write_file_atomically(path, [&](OutputFile& out) {
    out.write(prefix, sizeof prefix);
    out.write(header);
    out.write(bytes, size);
  });
}

/// Reads a C-order array of NumPy type `descr` (elements of `element` bytes) into `data`.
std::vector<std::int64_t> read_array(const std::filesystem::path& path, std::string_view descr,
                                     std::size_t element, auto& data) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(fmt::format("cannot read '{}': {}", path.string(), std::strerror(errno)));
  char prefix[10];
  in.read(prefix, sizeof prefix);
  if (!in || std::memcmp(prefix, kMagic, 6) != 0 || prefix[6] != 1)
    fail(fmt::format("'{}' is not a version 1 .npy file", path.string()));
  const std::size_t len = static_cast<unsigned char>(prefix[8]) |
                          (static_cast<std::size_t>(static_cast<unsigned char>(prefix[9])) << 8);
  std::string header(len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(len));
  if (header.find(fmt::format("'descr': '{}'", descr)) == std::string::npos ||
      header.find("'fortran_order': False") == std::string::npos)
    fail(fmt::format("'{}' is not '{}' in C order: {}", path.string(), descr, header));
  std::smatch m;
  if (!std::regex_search(header, m, std::regex(R"('shape': \(([^)]*)\))")))
    fail(fmt::format("'{}' has no shape in its header", path.string()));
  std::vector<std::int64_t> shape;
  const std::string dims = m[1];
  const std::regex number(R"(\d+)");
  for (std::sregex_iterator it(dims.begin(), dims.end(), number), end; it != end; ++it)
    shape.push_back(std::stoll(it->str()));
  data.resize(static_cast<std::size_t>(count(shape)));
  in.read(reinterpret_cast<char*>(data.data()),
          static_cast<std::streamsize>(data.size() * element));
  if (!in) fail(fmt::format("'{}' is shorter than its shape says", path.string()));
  return shape;
}

}  // namespace

void write_npy(const std::filesystem::path& path, std::span<const float> data,
               const std::vector<std::int64_t>& shape) {
  write_array(path, "<f4", data.data(), data.size_bytes(), data.size(), shape);
}

void write_npy(const std::filesystem::path& path, std::span<const std::uint8_t> data,
               const std::vector<std::int64_t>& shape) {
  write_array(path, "|u1", data.data(), data.size_bytes(), data.size(), shape);
}

void write_npy(const std::filesystem::path& path, std::span<const std::int32_t> data,
               const std::vector<std::int64_t>& shape) {
  write_array(path, "<i4", data.data(), data.size_bytes(), data.size(), shape);
}

NpyArray read_npy(const std::filesystem::path& path) {
  NpyArray a;
  a.shape = read_array(path, "<f4", sizeof(float), a.data);
  return a;
}

NpyBytes read_npy_bytes(const std::filesystem::path& path) {
  NpyBytes a;
  a.shape = read_array(path, "|u1", 1, a.data);
  return a;
}

}  // namespace tpx
