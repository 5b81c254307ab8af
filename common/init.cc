#include "init.h"

#include <cmath>
#include <numbers>

#include "check.h"

namespace tpx {
namespace {

// SplitMix64's finaliser (Steele, Lea, Flood: "Fast splittable pseudorandom number generators",
// OOPSLA 2014); a good 64-bit mixer for counters.
constexpr std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

}  // namespace

std::uint64_t bits_at(std::uint64_t seed, std::uint64_t id, std::uint64_t index) {
  return mix(mix(mix(seed + kGolden) ^ (id * kGolden)) ^ (index + kGolden));
}

double normal_at(std::uint64_t seed, std::uint64_t id, std::uint64_t index) {
  const std::uint64_t bits = bits_at(seed, id, index);
  // Two 32-bit uniforms; u1 is in (0, 1] so log(u1) is finite.
  const double u1 = (static_cast<double>(bits >> 32) + 1.0) / 4294967296.0;
  const double u2 = static_cast<double>(bits & 0xffffffffULL) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

void fill_normal(Tensor& t, std::uint64_t seed, std::uint64_t id, const Window& w, double mean,
                 double std) {
  auto out = t.f32();
  const std::int64_t rows = t.rows(), cols = t.cols();
  TPX_CHECK(w.col0 + cols <= w.full_cols, "window [{}, {}) past {} columns", w.col0, w.col0 + cols,
            w.full_cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const auto full = static_cast<std::uint64_t>((w.row0 + r) * w.full_cols + w.col0 + c);
      out[static_cast<std::size_t>(r * cols + c)] =
          static_cast<float>(mean + std * normal_at(seed, id, full));
    }
  }
}

}  // namespace tpx
