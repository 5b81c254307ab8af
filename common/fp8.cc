// The DType face of the FP8 casts (common/fp8.h); the bit manipulation is in common/fp8_bits.h.
#include "fp8.h"

#include <fmt/format.h>

#include "check.h"

namespace tpx::fp8 {

Format format(DType dtype) {
  if (dtype == DType::e4m3) return kE4M3;
  if (dtype == DType::e5m2) return kE5M2;
  fail(fmt::format("{} is not an FP8 dtype (expected e4m3 or e5m2)", to_string(dtype)));
}

std::uint8_t encode(float v, DType dtype) {
  return encode(v, format(dtype));
}

float decode(std::uint8_t q, DType dtype) {
  return decode(q, format(dtype));
}

float max_normal(DType dtype) {
  return max_normal(format(dtype));
}

}  // namespace tpx::fp8
