#include "common/checkpoint.h"

#include <algorithm>
#include <array>

namespace tpx {

namespace {

// The table of the byte-at-a-time CRC: entry b is the remainder of b shifted through 8 steps.
constexpr std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t r = b;
    for (int k = 0; k < 8; ++k) r = (r & 1U) ? (r >> 1) ^ 0xEDB88320U : r >> 1;
    table[b] = r;
  }
  return table;
}

constexpr std::array<std::uint32_t, 256> kCrcTable = make_crc_table();

}  // namespace

std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t r = ~crc;
  for (std::size_t i = 0; i < n; ++i) r = kCrcTable[(r ^ p[i]) & 0xFFU] ^ (r >> 8);
  return ~r;
}

std::optional<std::vector<IndexRange>> overlap(const std::vector<IndexRange>& a,
                                               const std::vector<IndexRange>& b) {
  if (a.size() != b.size()) return std::nullopt;
  std::vector<IndexRange> box(a.size());
  for (std::size_t d = 0; d < a.size(); ++d) {
    const std::int64_t lo = std::max(a[d].start, b[d].start);
    const std::int64_t hi = std::min(a[d].start + a[d].length, b[d].start + b[d].length);
    if (hi <= lo) return std::nullopt;
    box[d] = {lo, hi - lo};
  }
  return box;
}

}  // namespace tpx
