// The cpu backend's FP8 ops: loops over common/fp8_bits.h's casts, the very functions the CUDA
// kernels run, so both backends write the same bytes.
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../fp8.h"
#include "ops.h"

namespace tpx::cpu {

void quantize_fp8(const Tensor& x, const Tensor& scale, const Tensor& q) {
  const fp8::Format format = fp8::format(q.dtype());
  const float s = scale.data<float>()[0];
  const float* in = x.data<float>();
  auto* out = q.data<std::uint8_t>();
  const auto n = static_cast<std::size_t>(x.numel());
  for (std::size_t i = 0; i < n; ++i) out[i] = fp8::quantize(in[i], s, format);
}

void dequantize_fp8(const Tensor& q, const Tensor& scale, const Tensor& x) {
  const fp8::Format format = fp8::format(q.dtype());
  const float s = scale.data<float>()[0];
  const auto* in = q.data<std::uint8_t>();
  float* out = x.data<float>();
  const auto n = static_cast<std::size_t>(q.numel());
  // 256 codes: each one's value computed once, by the same function, then looked up.
  std::array<float, 256> value{};
  for (std::size_t c = 0; c < value.size(); ++c)
    value[c] = fp8::dequantize(static_cast<std::uint8_t>(c), s, format);
  for (std::size_t i = 0; i < n; ++i) out[i] = value[in[i]];
}

void amax(const Tensor& x, const Tensor& out) {
  const float* in = x.data<float>();
  const auto n = static_cast<std::size_t>(x.numel());
  float m = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::isnan(in[i])) {
      m = fp8::bits_float(fp8::kNaNBits);
      break;
    }
    m = std::fmax(m, std::fabs(in[i]));
  }
  out.data<float>()[0] = m;
}

void fp8_scale(const Tensor& amax, DType fmt, const Tensor& scale) {
  scale.data<float>()[0] = fp8::scale_from_amax(amax.data<float>()[0], fp8::max_normal(fmt));
}

}  // namespace tpx::cpu
