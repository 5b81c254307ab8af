// One block of a low-precision recipe (common/lowp.h), host and device: how a block's scale is
// computed from its amax and stored, and how each element is cast under it and read back. The
// cpu quantizer (common/lowp.cc) and the CUDA one (common/cuda/lowp.cu) both call these, so the
// two write the same bytes. Like fp8_bits.h it includes nothing a .cu file cannot.
//
// Per block, given its amax (block_amax's value: NaN if it holds a NaN, +inf if an infinity):
//   fp32 scale (tensorwise, rowwise, block128)  s = fmax / amax (fp8::scale_from_amax);
//                                                q = cast(x · s)
//   E8M0 (mxfp8)     NaN or ±inf in the block: the NaN scale 0xFF, every element its format's
//                    NaN with its sign; else X = 2^(⌊log2 amax⌋ − emax), clamped at 2^−127
//                    (amax 0 → 2^−127), q = cast(x · (1/X))
//   UE4M3 (nvfp4)    d = ue4m3(amax / 6 · s_enc); NaN d: every element E2M1's stand-in ±6;
//                    d = 0: every element ±0; else q = e2m1(x · (s_enc / d)), to nearest or,
//                    given the element's random bits, stochastically (StochasticRounding)
// each step one fp32 operation rounded to nearest (hd::), in the order written.
//
// defines: tpx::lowp::ScaleFormat, tpx::lowp::Layout, tpx::lowp::BlockScale, tpx::lowp::kE2M1Max,
//          tpx::lowp::nvfp4_tensor_scale(), tpx::lowp::kRhtSize, tpx::lowp::kRhtNegative,
//          tpx::lowp::rht_entry(), tpx::lowp::StochasticRounding, tpx::lowp::mix64(),
//          tpx::lowp::sr_bits(), tpx::lowp::sr_stream(), tpx::lowp::block_scale(),
//          tpx::lowp::cast_element(), tpx::lowp::decode_element()
#pragma once

#include <cstdint>

#include "common/fp8_bits.h"
#include "common/host_device.h"
#include "common/lowp_bits.h"

namespace tpx::lowp {

/// How a block's scale is stored.
enum class ScaleFormat { fp32, e8m0, ue4m3 };

/// What a recipe does to one operand.
struct Layout {
  fp8::Format element;      ///< fp8::kE4M3, fp8::kE5M2 or lowp::kE2M1
  std::int64_t block_rows;  ///< rows per block; 0: all rows (tensorwise)
  std::int64_t block_cols;  ///< columns per block; 0: all columns (tensorwise, rowwise)
  ScaleFormat scale;
};

/// The largest E2M1 value, NVFP4's element fmax.
inline constexpr float kE2M1Max = 6.0f;

/// nvfp4's per-tensor encode scale s_enc = (6 · 448) / amax_tensor, fp32 (fp8::scale_from_amax:
/// amax 0, NaN or +inf give 1).
TPX_HD inline float nvfp4_tensor_scale(float amax) {
  return fp8::scale_from_amax(amax, kE2M1Max * fp8::max_normal(fp8::kE4M3));
}

/// nvfp4's random Hadamard transform's size and its matrix R = H₁₆·diag(s) / 4 (common/lowp.h,
/// hadamard_rows; the signs s are lowp::kRhtSigns): bit j of kRhtNegative is set where s_j = −1.
inline constexpr int kRhtSize = 16;
inline constexpr std::uint32_t kRhtNegative = 0x49D2u;
/// R[i][j] = (−1)^(popcount(i & j) + [s_j = −1]) / 4, exactly ±0.25.
TPX_HD constexpr float rht_entry(int i, int j) {
  const unsigned v = unsigned(i & j);
  const unsigned odd = ((v ^ (v >> 1) ^ (v >> 2) ^ (v >> 3)) & 1u) ^ ((kRhtNegative >> j) & 1u);
  return odd != 0 ? -0.25f : 0.25f;
}

/// Stochastic rounding of nvfp4's gradients (common/lowp.h): where the quantized matrix's
/// elements lie in the logical tensor [tokens, features] they came from, and the stream of random
/// numbers the tensor draws from. An element's random bits are a hash of (stream, token, feature)
/// alone, so a rank quantizing its shard, in either orientation, and the reference quantizing the
/// whole tensor draw the same bits for the same element.
struct StochasticRounding {
  std::uint64_t stream = 0;
  std::int64_t token0 = 0;    ///< the tensor's token of the matrix's row 0 (column 0 if k_rows)
  std::int64_t feature0 = 0;  ///< the tensor's feature of the matrix's column 0 (row 0 if k_rows)
  bool k_rows = false;        ///< the matrix is the tensor transposed: its rows run along features
};

/// SplitMix64's output function (G. L. Steele, D. Lea and C. H. Flood, "Fast Splittable
/// Pseudorandom Number Generators", OOPSLA 2014): a bijection of 64-bit words that scatters
/// neighbouring inputs over the whole range.
TPX_HD constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The random bits of the matrix element (r, c) under s: the high 32 bits of two rounds of mix64
/// over the stream, the element's token and its feature.
TPX_HD constexpr std::uint32_t sr_bits(const StochasticRounding& s, std::int64_t r,
                                       std::int64_t c) {
  const auto token = static_cast<std::uint64_t>(s.token0 + (s.k_rows ? c : r));
  const auto feature = static_cast<std::uint64_t>(s.feature0 + (s.k_rows ? r : c));
  return static_cast<std::uint32_t>(
      mix64(mix64(s.stream + token * 0x9E3779B97F4A7C15ull) ^ feature) >> 32);
}

/// The stream of one quantized gradient of a training run: its seed, and a count of the GEMM
/// operands that draw (the stage's and the reference's numbering, 06_fp8/layers.h).
TPX_HD constexpr std::uint64_t sr_stream(std::uint64_t seed, std::uint64_t operand) {
  return mix64(seed ^ mix64(operand + 1));
}

/// One block's scale: the fp32 scale (fp32 recipes) or the scale's code (E8M0, UE4M3).
struct BlockScale {
  float scale = 1.0f;
  std::uint8_t code = 0;
};

/// The scale of a block whose amax is `amax`, stored as `l` stores it; `tensor_scale` is nvfp4's
/// s_enc (ignored by the other formats).
TPX_HD inline BlockScale block_scale(float amax, const Layout& l, float tensor_scale) {
  BlockScale b;
  switch (l.scale) {
    case ScaleFormat::fp32:
      b.scale = fp8::scale_from_amax(amax, fp8::max_normal(l.element));
      break;
    case ScaleFormat::e8m0: {
      const std::uint32_t a = fp8::float_bits(amax) & 0x7FFFFFFFu;
      const bool special = a >= 0x7F800000u;  // NaN or ±inf in the block
      b.code = special ? kE8M0NaN
                       : (amax == 0.0f ? e8m0_from_exponent(-128)
                                       : e8m0_from_exponent(floor_log2(amax) - emax(l.element)));
      break;
    }
    case ScaleFormat::ue4m3:
      b.code = ue4m3_encode(hd::mul_rn(hd::div_rn(amax, kE2M1Max), tensor_scale));
      break;
  }
  return b;
}

/// The code of element v of a block with scale `b` (nvfp4: `tensor_scale` its s_enc). With
/// `stochastic`, under UE4M3 (nvfp4) the element is rounded stochastically with its random bits
/// `random` (sr_bits; e2m1_encode_stochastic); the other formats ignore both and round to nearest
/// even. (The bits travel by value: a pointer would put them in a kernel's local memory.)
TPX_HD inline std::uint8_t cast_element(float v, const Layout& l, const BlockScale& b,
                                        float tensor_scale, bool stochastic = false,
                                        std::uint32_t random = 0) {
  const bool negative = (fp8::float_bits(v) & 0x80000000u) != 0;
  switch (l.scale) {
    case ScaleFormat::fp32:
      return fp8::quantize(v, b.scale, l.element);
    case ScaleFormat::e8m0: {
      if (b.code == kE8M0NaN)  // the format's NaN, with v's sign
        return static_cast<std::uint8_t>((negative ? 0x80u : 0u) | l.element.nan_code);
      const float inverse = pow2(127 - int(b.code));  // 1 / X, exact: 2^−127 <= X <= 2^127
      return fp8::encode(hd::mul_rn(v, inverse), l.element);
    }
    case ScaleFormat::ue4m3: {
      const float d = ue4m3_decode(b.code);
      if (fp8::is_nan(d))  // E2M1 has no NaN: its stand-in ±6, with v's sign
        return static_cast<std::uint8_t>((negative ? 0x08u : 0u) | kE2M1.nan_code);
      if (d == 0.0f) return negative ? 0x08u : 0x00u;  // ±0
      const float scaled = hd::mul_rn(v, hd::div_rn(tensor_scale, d));
      return stochastic ? e2m1_encode_stochastic(scaled, random) : e2m1_encode(scaled);
    }
  }
  return 0;
}

/// The fp32 value element code q stands for in a block with scale `b`.
TPX_HD inline float decode_element(std::uint8_t q, const Layout& l, const BlockScale& b,
                                   float tensor_scale) {
  switch (l.scale) {
    case ScaleFormat::fp32:
      return fp8::dequantize(q, b.scale, l.element);
    case ScaleFormat::e8m0:
      if (b.code == kE8M0NaN)  // fp32's quiet NaN with the code's sign
        return fp8::bits_float(((q & 0x80u) != 0 ? 0x80000000u : 0u) | fp8::kNaNBits);
      return hd::mul_rn(fp8::decode(q, l.element), e8m0_decode(b.code));
    case ScaleFormat::ue4m3: {
      const float d = ue4m3_decode(b.code);
      if (fp8::is_nan(d))
        return fp8::bits_float(((q & 0x08u) != 0 ? 0x80000000u : 0u) | fp8::kNaNBits);
      return hd::div_rn(hd::mul_rn(e2m1_decode(q), d), tensor_scale);
    }
  }
  return 0.0f;
}

}  // namespace tpx::lowp
