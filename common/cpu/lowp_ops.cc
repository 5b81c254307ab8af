// The cpu backend's low-precision recipe ops (tpx::ops::lowp_quantize and its neighbours, which
// check the arguments): common/lowp.cc's quantizer and Hadamard transform over tensors, and the
// moves around them as plain loops.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../lowp.h"
#include "ops.h"

namespace tpx::cpu {

void lowp_quantize(const Tensor& x, lowp::Recipe recipe, lowp::Operand operand,
                   std::optional<float> tensor_amax, const Tensor& codes, const Tensor& scales,
                   const Tensor& tensor_scale, const lowp::StochasticRounding* stochastic) {
  const std::int64_t cols = x.dim(x.ndim() - 1), rows = x.numel() / cols;
  const lowp::Quantized q =
      lowp::quantize(x.data<float>(), rows, cols, recipe, operand, tensor_amax, stochastic);
  std::memcpy(codes.raw(), q.codes.data(), q.codes.size());
  if (q.layout.scale == lowp::ScaleFormat::fp32)
    std::copy(q.scales.begin(), q.scales.end(), scales.data<float>());
  else
    std::memcpy(scales.raw(), q.scale_codes.data(), q.scale_codes.size());
  if (q.layout.scale == lowp::ScaleFormat::ue4m3) tensor_scale.data<float>()[0] = q.tensor_scale;
}

void lowp_dequantize(const Tensor& codes, const lowp::Layout& l, const Tensor& scales,
                     const Tensor& tensor_scale, const Tensor& x, bool transpose) {
  const std::int64_t rows = codes.dim(0), cols = codes.dim(1);
  const std::int64_t br = l.block_rows == 0 ? rows : l.block_rows;
  const std::int64_t bc = l.block_cols == 0 ? cols : l.block_cols;
  const std::int64_t scale_cols = (cols + bc - 1) / bc;
  const bool fp32 = l.scale == lowp::ScaleFormat::fp32;
  const float s_enc = l.scale == lowp::ScaleFormat::ue4m3 ? tensor_scale.data<float>()[0] : 1.0f;
  const auto* c = static_cast<const std::uint8_t*>(codes.raw());
  float* out = x.data<float>();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::int64_t blk = (r / br) * scale_cols + j / bc;
      const lowp::BlockScale b =
          fp32 ? lowp::BlockScale{scales.data<float>()[blk], 0}
               : lowp::BlockScale{1.0f, static_cast<const std::uint8_t*>(scales.raw())[blk]};
      out[transpose ? j * rows + r : r * cols + j] =
          lowp::decode_element(c[r * cols + j], l, b, s_enc);
    }
}

void transpose(const Tensor& x, std::int64_t rows, std::int64_t cols, const Tensor& out) {
  const std::size_t esize = dtype_size(x.dtype());
  const auto* in = static_cast<const char*>(x.raw());
  auto* o = static_cast<char*>(out.raw());
  auto move = [&]<class T>(T) {
    const auto* a = reinterpret_cast<const T*>(in);
    auto* b = reinterpret_cast<T*>(o);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) b[c * rows + r] = a[r * cols + c];
  };
  if (esize == 4) return move(std::uint32_t{});
  if (esize == 2) return move(std::uint16_t{});
  if (esize == 1) return move(std::uint8_t{});
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      std::memcpy(o + std::size_t(c * rows + r) * esize, in + std::size_t(r * cols + c) * esize,
                  esize);
}

void hadamard_rows(const Tensor& x, std::int64_t rows, std::int64_t cols, const Tensor& y) {
  std::vector<float> m(x.data<float>(), x.data<float>() + x.numel());
  lowp::hadamard_rows(m, rows, cols);
  std::copy(m.begin(), m.end(), y.data<float>());
}

void pack_e2m1(const Tensor& codes, const Tensor& packed) {
  const auto* c = static_cast<const std::uint8_t*>(codes.raw());
  auto* p = static_cast<std::uint8_t*>(packed.raw());
  for (std::int64_t i = 0; i < packed.numel(); ++i)
    p[i] = static_cast<std::uint8_t>((c[2 * i] & 0x0Fu) | ((c[2 * i + 1] & 0x0Fu) << 4));
}

void unpack_e2m1(const Tensor& packed, const Tensor& codes) {
  const auto* p = static_cast<const std::uint8_t*>(packed.raw());
  auto* c = static_cast<std::uint8_t*>(codes.raw());
  for (std::int64_t i = 0; i < packed.numel(); ++i) {
    c[2 * i] = p[i] & 0x0Fu;
    c[2 * i + 1] = static_cast<std::uint8_t>(p[i] >> 4);
  }
}

}  // namespace tpx::cpu
