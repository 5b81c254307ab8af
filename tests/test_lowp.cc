// The low-precision formats (common/lowp_bits.h) and recipes (common/lowp.h) against values
// derived by hand from the specifications: the OCP MX specification v1.0 (E2M1, E8M0, the MX
// conversion), OFP8 (E4M3, E5M2) and NVIDIA's NVFP4 two-level scaling. Every expected code is
// worked out in the comment beside it; tests/lowp_ml_dtypes.py checks the casts exhaustively
// against ml_dtypes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "06_fp8/flags.h"
#include "common/check.h"
#include "common/cli.h"
#include "common/fp8_bits.h"
#include "common/lowp.h"
#include "common/lowp_bits.h"
#include "common/ops.h"
#include "common/tensor.h"

namespace tpx {
namespace {

using lowp::Operand;
using lowp::Recipe;

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// E2M1, E8M0, UE4M3.
// ---------------------------------------------------------------------------------------------

TEST(LowpFormats, E2M1CodesAreTheSpecValues) {
  // S.EE.M, bias 1: E = 0 → M/2 (0, 0.5); E >= 1 → 2^(E−1) · (1 + M/2).
  const float want[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (unsigned c = 0; c < 8; ++c) {
    EXPECT_EQ(lowp::e2m1_decode(static_cast<std::uint8_t>(c)), want[c]) << c;
    EXPECT_EQ(lowp::e2m1_decode(static_cast<std::uint8_t>(c | 8u)), -want[c]) << c;
    EXPECT_EQ(lowp::e2m1_encode(want[c]), c);
  }
  EXPECT_TRUE(std::signbit(lowp::e2m1_decode(8)));
}

TEST(LowpFormats, E2M1RoundsToNearestEvenAndSaturates) {
  // Ties go to the code with mantissa bit 0: 0.25 between 0 (code 0) and 0.5 (code 1) → 0;
  // 0.75 between 0.5 (1) and 1 (2) → 1; 1.25 between 1 (2) and 1.5 (3) → 1; 1.75 → 2 (code 4);
  // 2.5 → 2 (4); 3.5 → 4 (6); 5 between 4 (6) and 6 (7) → 4.
  EXPECT_EQ(lowp::e2m1_encode(0.25f), 0);
  EXPECT_EQ(lowp::e2m1_encode(0.75f), 2);
  EXPECT_EQ(lowp::e2m1_encode(1.25f), 2);
  EXPECT_EQ(lowp::e2m1_encode(1.75f), 4);
  EXPECT_EQ(lowp::e2m1_encode(2.5f), 4);
  EXPECT_EQ(lowp::e2m1_encode(3.5f), 6);
  EXPECT_EQ(lowp::e2m1_encode(5.0f), 6);
  EXPECT_EQ(lowp::e2m1_encode(-5.0f), 14);
  // Just past a tie rounds away from it.
  EXPECT_EQ(lowp::e2m1_encode(std::nextafter(0.25f, 1.0f)), 1);
  EXPECT_EQ(lowp::e2m1_encode(std::nextafter(5.0f, 6.0f)), 7);
  // Saturation (no infinities), NaN to ±6 with its sign, zeros and tiny values.
  EXPECT_EQ(lowp::e2m1_encode(7.0f), 7);
  EXPECT_EQ(lowp::e2m1_encode(kInf), 7);
  EXPECT_EQ(lowp::e2m1_encode(-kInf), 15);
  EXPECT_EQ(lowp::e2m1_encode(kNaN), 7);
  EXPECT_EQ(lowp::e2m1_encode(-kNaN), 15);
  EXPECT_EQ(lowp::e2m1_encode(-0.0f), 8);
  EXPECT_EQ(lowp::e2m1_encode(1e-30f), 0);
  EXPECT_EQ(lowp::e2m1_encode(FLT_TRUE_MIN), 0);
}

TEST(LowpFormats, E8M0IsAPowerOfTwoWithBias127) {
  EXPECT_EQ(lowp::e8m0_decode(127), 1.0f);
  EXPECT_EQ(lowp::e8m0_decode(128), 2.0f);
  EXPECT_EQ(lowp::e8m0_decode(119), 1.0f / 256.0f);
  EXPECT_EQ(lowp::e8m0_decode(254), std::ldexp(1.0f, 127));
  EXPECT_EQ(lowp::e8m0_decode(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(lowp::e8m0_decode(0), std::ldexp(1.0f, -127));  // an fp32 subnormal
  EXPECT_TRUE(std::isnan(lowp::e8m0_decode(0xFF)));
  EXPECT_EQ(lowp::e8m0_from_exponent(0), 127);
  EXPECT_EQ(lowp::e8m0_from_exponent(-127), 0);
  EXPECT_EQ(lowp::e8m0_from_exponent(-200), 0);  // clamps
  EXPECT_EQ(lowp::e8m0_from_exponent(127), 254);
  EXPECT_EQ(lowp::e8m0_from_exponent(128), 0xFF);  // past the format
}

TEST(LowpFormats, E8M0FloorAndFloorLog2) {
  EXPECT_EQ(lowp::floor_log2(1.0f), 0);
  EXPECT_EQ(lowp::floor_log2(1.9999999f), 0);
  EXPECT_EQ(lowp::floor_log2(0.75f), -1);
  EXPECT_EQ(lowp::floor_log2(FLT_MAX), 127);
  EXPECT_EQ(lowp::floor_log2(FLT_MIN), -126);
  EXPECT_EQ(lowp::floor_log2(std::nextafter(FLT_MIN, 0.0f)), -127);  // largest subnormal
  EXPECT_EQ(lowp::floor_log2(std::ldexp(1.0f, -140)), -140);
  EXPECT_EQ(lowp::floor_log2(FLT_TRUE_MIN), -149);
  EXPECT_EQ(lowp::e8m0_floor(1.5f), 127);
  EXPECT_EQ(lowp::e8m0_floor(0.75f), 126);
  EXPECT_EQ(lowp::e8m0_floor(std::ldexp(1.0f, -128)), 0);  // below 2^−127: clamps
  EXPECT_EQ(lowp::e8m0_floor(0.0f), 0);
  EXPECT_EQ(lowp::e8m0_floor(-0.0f), 0);
  EXPECT_EQ(lowp::e8m0_floor(FLT_MAX), 254);
  EXPECT_EQ(lowp::e8m0_floor(kInf), 0xFF);
  EXPECT_EQ(lowp::e8m0_floor(-1.0f), 0xFF);
  EXPECT_EQ(lowp::e8m0_floor(kNaN), 0xFF);
  // emax_elem: the exponent of each element format's largest normal value.
  EXPECT_EQ(lowp::emax(fp8::kE4M3), 8);   // 448 = 1.75 · 2^8
  EXPECT_EQ(lowp::emax(fp8::kE5M2), 15);  // 57344 = 1.75 · 2^15
  EXPECT_EQ(lowp::emax(lowp::kE2M1), 2);  // 6 = 1.5 · 2^2
}

TEST(LowpFormats, UE4M3IsE4M3WithoutTheSign) {
  EXPECT_EQ(lowp::ue4m3_encode(448.0f), 0x7E);   // S.1111.110
  EXPECT_EQ(lowp::ue4m3_encode(1000.0f), 0x7E);  // saturates
  EXPECT_EQ(lowp::ue4m3_encode(kInf), 0x7E);
  EXPECT_EQ(lowp::ue4m3_encode(56.0f), 0x66);  // 1.75 · 2^5: E = 12, M = 6
  EXPECT_EQ(lowp::ue4m3_encode(-0.0f), 0x00);
  EXPECT_EQ(lowp::ue4m3_encode(-1.0f), 0x7F);
  EXPECT_EQ(lowp::ue4m3_encode(kNaN), 0x7F);
  EXPECT_EQ(lowp::ue4m3_decode(0x08), std::ldexp(1.0f, -6));  // min normal
  EXPECT_EQ(lowp::ue4m3_decode(0x01), std::ldexp(1.0f, -9));  // min subnormal
  EXPECT_TRUE(std::isnan(lowp::ue4m3_decode(0x7F)));
  EXPECT_TRUE(std::isnan(lowp::ue4m3_decode(0x80)));  // not a UE4M3 code
  EXPECT_TRUE(std::isnan(lowp::ue4m3_decode(0xB8)));
}

// ---------------------------------------------------------------------------------------------
// Recipes: names, layouts.
// ---------------------------------------------------------------------------------------------

TEST(LowpRecipes, NamesRoundTrip) {
  for (const Recipe r :
       {Recipe::tensorwise, Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4})
    EXPECT_EQ(lowp::parse_recipe(lowp::to_string(r)), r);
  EXPECT_EQ(lowp::parse_recipe("block128"), Recipe::block128);
  EXPECT_FALSE(lowp::parse_recipe("mxfp4").has_value());
  EXPECT_FALSE(lowp::parse_recipe("").has_value());
}

TEST(LowpRecipes, LayoutsAreTheDocumentedBlocks) {
  auto check = [](Recipe r, Operand o, int mantissa, std::int64_t br, std::int64_t bc,
                  lowp::ScaleFormat s) {
    const lowp::Layout l = lowp::layout(r, o);
    EXPECT_EQ(l.element.mantissa_bits, mantissa);
    EXPECT_EQ(l.block_rows, br);
    EXPECT_EQ(l.block_cols, bc);
    EXPECT_EQ(l.scale, s);
  };
  using S = lowp::ScaleFormat;
  check(Recipe::tensorwise, Operand::activation, 3, 0, 0, S::fp32);
  check(Recipe::tensorwise, Operand::gradient, 2, 0, 0, S::fp32);
  check(Recipe::rowwise, Operand::weight, 3, 1, 0, S::fp32);
  check(Recipe::rowwise, Operand::gradient, 2, 1, 0, S::fp32);
  check(Recipe::block128, Operand::activation, 3, 1, 128, S::fp32);
  check(Recipe::block128, Operand::gradient, 3, 1, 128, S::fp32);  // E4M3 in both passes
  check(Recipe::block128, Operand::weight, 3, 128, 128, S::fp32);
  check(Recipe::mxfp8, Operand::activation, 3, 1, 32, S::e8m0);
  check(Recipe::mxfp8, Operand::gradient, 2, 1, 32, S::e8m0);  // MXFP8 E5M2
  check(Recipe::nvfp4, Operand::weight, 1, 1, 16, S::ue4m3);
}

TEST(LowpRecipes, RefusesAnEmptyMatrix) {
  const float x = 1.0f;
  EXPECT_THROW(lowp::quantize(&x, 0, 4, Recipe::rowwise, Operand::activation), Error);
  EXPECT_THROW(lowp::quantize(&x, 1, -1, Recipe::mxfp8, Operand::activation), Error);
}

// ---------------------------------------------------------------------------------------------
// The FP8 recipes with fp32 scales.
// ---------------------------------------------------------------------------------------------

TEST(LowpRecipes, TensorwiseIsStage06sRecipe) {
  // One scale, 448 / amax = 448 / 4 = 112; x · 112 then E4M3: 1 → 112 = 1.75 · 2^6 (E = 13,
  // M = 6: 0x6E); −4 → −448 (0xFE); 0.5 → 56 = 1.75 · 2^5 (0x66).
  const std::vector<float> x{1.0f, -4.0f, 0.5f, 0.0f, 2.0f, -0.0f};
  const lowp::Quantized q = lowp::quantize(x.data(), 2, 3, Recipe::tensorwise, Operand::weight);
  ASSERT_EQ(q.scales.size(), 1u);
  EXPECT_EQ(q.scales[0], 112.0f);
  EXPECT_EQ(q.codes, (std::vector<std::uint8_t>{0x6E, 0xFE, 0x66, 0x00, 0x76, 0x80}));
  // 2 → 224 = 1.75 · 2^7 (E = 14: 0x76). Every value here is exact in E4M3 after scaling.
  EXPECT_EQ(lowp::dequantize(q), x);
}

TEST(LowpRecipes, RowwiseScalesEachRow) {
  // Rows with amax 1, 448 and 0: scales 448, 1 and 1 (amax 0 gives 1).
  const std::vector<float> x{1.0f,   -0.5f, 0.25f, 0.0f,  // ×448: 448, −224, 112, 0
                             448.0f, 1.0f,  2.0f,  3.0f,  // ×1
                             0.0f,   0.0f,  0.0f,  -0.0f};
  const lowp::Quantized q = lowp::quantize(x.data(), 3, 4, Recipe::rowwise, Operand::activation);
  EXPECT_EQ(q.scale_rows, 3);
  EXPECT_EQ(q.scale_cols, 1);
  EXPECT_EQ(q.scales, (std::vector<float>{448.0f, 1.0f, 1.0f}));
  // 448 → 0x7E; −224 = −1.75 · 2^7 → 0xF6; 112 → 0x6E; 1 = 2^0 (E = 7) → 0x38; 2 → 0x40;
  // 3 = 1.5 · 2 (E = 8, M = 4) → 0x44.
  EXPECT_EQ(q.codes, (std::vector<std::uint8_t>{0x7E, 0xF6, 0x6E, 0x00, 0x7E, 0x38, 0x40, 0x44,
                                                0x00, 0x00, 0x00, 0x80}));
  EXPECT_EQ(lowp::dequantize(q), x);
}

TEST(LowpRecipes, RowwiseGradientsUseE5M2) {
  // amax 2: scale 57344 / 2 = 28672; 2 · 28672 = 57344 → E5M2 max 0x7B; 1 → 28672 = 1.75 · 2^14
  // (E = 29, M = 3: 0x77).
  const std::vector<float> x{2.0f, 1.0f};
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 2, Recipe::rowwise, Operand::gradient);
  EXPECT_EQ(q.scales, (std::vector<float>{28672.0f}));
  EXPECT_EQ(q.codes, (std::vector<std::uint8_t>{0x7B, 0x77}));
}

TEST(LowpRecipes, Block128ActivationsHaveOneScalePer128Columns) {
  // 2 × 200: blocks of columns [0, 128) and [128, 200) (a partial block), per row.
  std::vector<float> x(2 * 200, 0.0f);
  x[5] = 3.5f;             // row 0, block 0: scale 448 / 3.5 = 128
  x[150] = 7.0f;           // row 0, block 1: 448 / 7 = 64
  x[200 + 199] = -0.875f;  // row 1, block 1: 448 / 0.875 = 512; row 1, block 0: zero → 1
  const lowp::Quantized q = lowp::quantize(x.data(), 2, 200, Recipe::block128, Operand::activation);
  EXPECT_EQ(q.scale_rows, 2);
  EXPECT_EQ(q.scale_cols, 2);
  EXPECT_EQ(q.scales, (std::vector<float>{128.0f, 64.0f, 1.0f, 512.0f}));
  EXPECT_EQ(q.codes[5], 0x7E);
  EXPECT_EQ(q.codes[150], 0x7E);
  EXPECT_EQ(q.codes[200 + 199], 0xFE);
  EXPECT_EQ(lowp::dequantize(q), x);
}

TEST(LowpRecipes, Block128WeightsHave128By128Blocks) {
  // 130 × 130: four blocks, three of them partial.
  const std::int64_t n = 130;
  std::vector<float> x(static_cast<std::size_t>(n * n), 0.0f);
  auto at = [&](std::int64_t r, std::int64_t c) -> float& {
    return x[static_cast<std::size_t>(r * n + c)];
  };
  at(127, 127) = 2.0f;  // block (0, 0): 448 / 2 = 224
  at(0, 1) = 1.0f;      //               1 · 224 = 224 → 0x76
  at(0, 129) = 448.0f;  // block (0, 1): 1
  at(129, 129) = 0.5f;  // block (1, 1): 896; block (1, 0) is zero: 1
  const lowp::Quantized q = lowp::quantize(x.data(), n, n, Recipe::block128, Operand::weight);
  EXPECT_EQ(q.scale_rows, 2);
  EXPECT_EQ(q.scale_cols, 2);
  EXPECT_EQ(q.scales, (std::vector<float>{224.0f, 1.0f, 1.0f, 896.0f}));
  EXPECT_EQ(q.codes[127 * n + 127], 0x7E);
  EXPECT_EQ(q.codes[1], 0x76);
  EXPECT_EQ(q.codes[129], 0x7E);
  EXPECT_EQ(q.codes[129 * n + 129], 0x7E);
  EXPECT_EQ(lowp::dequantize(q), x);
}

TEST(LowpRecipes, APartialBlockIsTheZeroPaddedBlock) {
  // The rule: a partial last block quantizes as the same block padded with zeros would. A
  // 3 × 40 matrix under every recipe against the 3 × 64 matrix that holds it and zeros.
  std::vector<float> x(3 * 40), padded(3 * 64, 0.0f);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(0.37f * static_cast<float>(i)) * static_cast<float>(1 + i % 7);
    padded[(i / 40) * 64 + i % 40] = x[i];
  }
  for (const Recipe r : {Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4}) {
    SCOPED_TRACE(std::string(lowp::to_string(r)));
    const lowp::Quantized q = lowp::quantize(x.data(), 3, 40, r, Operand::activation);
    const lowp::Quantized p = lowp::quantize(padded.data(), 3, 64, r, Operand::activation);
    const std::int64_t bc = q.layout.block_cols == 0 ? 40 : q.layout.block_cols;
    EXPECT_EQ(q.scale_cols, (40 + bc - 1) / bc);  // ⌈40 / block⌉ scales per row
    for (std::int64_t row = 0; row < 3; ++row) {
      for (std::int64_t sc = 0; sc < q.scale_cols; ++sc) {
        const auto i = static_cast<std::size_t>(row * q.scale_cols + sc);
        const auto j = static_cast<std::size_t>(row * p.scale_cols + sc);
        if (!q.scales.empty()) {
          EXPECT_EQ(q.scales[i], p.scales[j]);
        } else {
          EXPECT_EQ(q.scale_codes[i], p.scale_codes[j]);
        }
      }
      for (std::int64_t c = 0; c < 40; ++c)
        EXPECT_EQ(q.codes[static_cast<std::size_t>(row * 40 + c)],
                  p.codes[static_cast<std::size_t>(row * 64 + c)]);
    }
  }
}

TEST(LowpRecipes, FP8RecipesKeepNaNAndSaturateInfinities) {
  // rowwise: a row holding a NaN has amax NaN → scale 1; the NaN keeps its sign; ±inf → ±448.
  const std::vector<float> x{-kNaN, 2.0f, kInf, -kInf};
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 4, Recipe::rowwise, Operand::activation);
  EXPECT_EQ(q.scales, (std::vector<float>{1.0f}));
  EXPECT_EQ(q.codes, (std::vector<std::uint8_t>{0xFF, 0x40, 0x7E, 0xFE}));
  const std::vector<float> d = lowp::dequantize(q);
  EXPECT_TRUE(std::isnan(d[0]) && std::signbit(d[0]));
  EXPECT_EQ(d[2], 448.0f);
}

// ---------------------------------------------------------------------------------------------
// MXFP8: E8M0 scales by the MX rule.
// ---------------------------------------------------------------------------------------------

TEST(LowpMxfp8, SharedExponentIsFloorLog2AmaxMinusEight) {
  // One block of 32 with amax 1: shared_exp = 0 − 8 → code 119, X = 2^−8; V / X = 256 · V:
  // 1 → 256 = 2^8 (E = 15, M = 0: 0x78), 0.5 → 128 (0x70), −0.25 → −64 (E = 13: 0xE8), 0.001 →
  // 0.256 = 1.024 · 2^−2 (E = 5; mantissa 0.024 · 8 < 0.5: 0x28 = 0.25).
  std::vector<float> x(32, 0.0f);
  x[0] = 1.0f;
  x[1] = 0.5f;
  x[2] = -0.25f;
  x[3] = 0.001f;
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 32, Recipe::mxfp8, Operand::activation);
  EXPECT_EQ(q.scale_codes, (std::vector<std::uint8_t>{119}));
  EXPECT_TRUE(q.scales.empty());
  EXPECT_EQ(q.codes[0], 0x78);
  EXPECT_EQ(q.codes[1], 0x70);
  EXPECT_EQ(q.codes[2], 0xE8);
  EXPECT_EQ(q.codes[3], 0x28);
  const std::vector<float> d = lowp::dequantize(q);
  EXPECT_EQ(d[0], 1.0f);
  EXPECT_EQ(d[2], -0.25f);
  EXPECT_EQ(d[3], 0.25f / 256.0f);
}

TEST(LowpMxfp8, TheBlockMaximumSaturatesBetween448And512) {
  // amax 1.9: ⌊log2 1.9⌋ = 0, X = 2^−8, 1.9 · 256 = 486.4 > 448: saturates to 448 (0x7E),
  // dequantized 448 / 256 = 1.75.
  std::vector<float> x(32, 0.0f);
  x[7] = 1.9f;
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 32, Recipe::mxfp8, Operand::weight);
  EXPECT_EQ(q.scale_codes[0], 119);
  EXPECT_EQ(q.codes[7], 0x7E);
  EXPECT_EQ(lowp::dequantize(q)[7], 1.75f);
}

TEST(LowpMxfp8, BlocksAreIndependentAlongARow) {
  // 1 × 70: blocks [0, 32), [32, 64), [64, 70) with amax 4, 0.125 and 1000:
  // codes 2 − 8 + 127 = 121, −3 − 8 + 127 = 116, 9 − 8 + 127 = 128.
  std::vector<float> x(70, 0.0f);
  x[3] = 4.0f;
  x[40] = -0.125f;
  x[69] = 1000.0f;
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 70, Recipe::mxfp8, Operand::activation);
  EXPECT_EQ(q.scale_codes, (std::vector<std::uint8_t>{121, 116, 128}));
  // 1000 / 2 = 500 saturates to 448: 896 back.
  const std::vector<float> d = lowp::dequantize(q);
  EXPECT_EQ(d[3], 4.0f);
  EXPECT_EQ(d[40], -0.125f);
  EXPECT_EQ(d[69], 896.0f);
}

TEST(LowpMxfp8, ZeroTinyHugeNaNAndInfinityBlocks) {
  // Five rows of 32: zeros; all 2^−120; one huge value beside ones; a NaN; an infinity.
  const std::int64_t k = 32;
  std::vector<float> x(static_cast<std::size_t>(5 * k), 0.0f);
  for (std::int64_t c = 0; c < k; ++c) x[static_cast<std::size_t>(k + c)] = 0x1p-120f;
  x[2 * k] = 1e30f;
  for (std::int64_t c = 1; c < k; ++c) x[static_cast<std::size_t>(2 * k + c)] = 1.0f;
  x[3 * k + 4] = kNaN;
  x[3 * k + 5] = -2.0f;
  x[4 * k + 6] = -kInf;
  const lowp::Quantized q = lowp::quantize(x.data(), 5, k, Recipe::mxfp8, Operand::activation);
  // Zero block: ⌊log2 0⌋ = −∞ clamps to −127: code 0, codes 0, values 0.
  // 2^−120: −120 − 8 = −128 clamps to −127 (code 0); V / X = 2^−120 · 2^127 = 128 (0x70).
  // 1e30 (fp32 1.00000002e30): ⌊log2⌋ = 99 (2^99 ≈ 6.34e29), 99 − 8 = 91, code 218; 1e30 / 2^91
  // ≈ 403.9, nearest E4M3 416 = 1.625 · 2^8 (0x7D); the ones, 2^−91, vanish (below 2^−10).
  // NaN and −inf: the NaN scale 0xFF.
  EXPECT_EQ(q.scale_codes, (std::vector<std::uint8_t>{0, 0, 218, 0xFF, 0xFF}));
  EXPECT_EQ(q.codes[0], 0x00);
  EXPECT_EQ(q.codes[k], 0x70);
  EXPECT_EQ(q.codes[2 * k], 0x7D);
  EXPECT_EQ(q.codes[2 * k + 1], 0x00);
  const std::vector<float> d = lowp::dequantize(q);
  EXPECT_EQ(d[0], 0.0f);
  EXPECT_EQ(d[static_cast<std::size_t>(k + 3)], 0x1p-120f);
  EXPECT_EQ(d[static_cast<std::size_t>(2 * k)], 416.0f * 0x1p91f);
  EXPECT_EQ(d[static_cast<std::size_t>(2 * k + 1)], 0.0f);
  for (std::int64_t c = 0; c < k; ++c) {
    EXPECT_TRUE(std::isnan(d[static_cast<std::size_t>(3 * k + c)])) << c;
    EXPECT_TRUE(std::isnan(d[static_cast<std::size_t>(4 * k + c)])) << c;
  }
  EXPECT_TRUE(std::signbit(d[static_cast<std::size_t>(3 * k + 5)]));  // the element's sign
}

TEST(LowpMxfp8, SubnormalBlocksFlushToZero) {
  // amax 2^−140 (an fp32 subnormal): −148 clamps to −127, V / X = 2^−13, below half of E4M3's
  // smallest subnormal 2^−9: code 0.
  std::vector<float> x(32, 0x1p-140f);
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 32, Recipe::mxfp8, Operand::activation);
  EXPECT_EQ(q.scale_codes[0], 0);
  EXPECT_EQ(q.codes[0], 0);
  EXPECT_EQ(lowp::dequantize(q)[0], 0.0f);
}

// ---------------------------------------------------------------------------------------------
// NVFP4: E2M1 elements, UE4M3 block scales, one fp32 tensor scale.
// ---------------------------------------------------------------------------------------------

TEST(LowpNvfp4, TwoLevelScales) {
  // Tensor amax 6: s_enc = 2688 / 6 = 448.
  // Block 0 (amax 6): d = 6 / 6 · 448 = 448 → UE4M3 0x7E; s_enc / d = 1: 6 → code 7, −3 →
  //   code 13 (8 | 5), 0.25 → 0 (a tie, to even).
  // Block 1 (amax 0.75): d = 0.125 · 448 = 56 → 0x66; s_enc / d = 8: 0.75 → 6 (code 7),
  //   0.1 → 0.8 → 1 (code 2), dequantized 1 · 56 / 448 = 0.125.
  std::vector<float> x(32, 0.0f);
  x[0] = 6.0f;
  x[1] = -3.0f;
  x[2] = 0.25f;
  x[16] = 0.75f;
  x[17] = 0.1f;
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 32, Recipe::nvfp4, Operand::activation);
  EXPECT_EQ(q.tensor_scale, 448.0f);
  EXPECT_EQ(q.scale_codes, (std::vector<std::uint8_t>{0x7E, 0x66}));
  EXPECT_EQ(q.codes[0], 7);
  EXPECT_EQ(q.codes[1], 13);
  EXPECT_EQ(q.codes[2], 0);
  EXPECT_EQ(q.codes[16], 7);
  EXPECT_EQ(q.codes[17], 2);
  const std::vector<float> d = lowp::dequantize(q);
  EXPECT_EQ(d[0], 6.0f);
  EXPECT_EQ(d[1], -3.0f);
  EXPECT_EQ(d[2], 0.0f);
  EXPECT_EQ(d[16], 0.75f);
  EXPECT_EQ(d[17], 0.125f);
}

TEST(LowpNvfp4, ZeroAndUnderflowingBlocks) {
  // Tensor amax 2688: s_enc = 1. Block 1 (amax 2^−12): d = 2^−12 / 6 ≈ 4.07e−5, below half of
  // E4M3's smallest subnormal (2^−10 ≈ 9.8e−4): UE4M3 0, the block's codes 0. Block 2: zeros.
  std::vector<float> x(48, 0.0f);
  x[0] = 2688.0f;
  x[16] = 0x1p-12f;
  x[17] = -0x1p-12f;
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 48, Recipe::nvfp4, Operand::weight);
  EXPECT_EQ(q.tensor_scale, 1.0f);
  // Block 0: d = 2688 / 6 = 448 (0x7E), s_enc / d = 1/448, 2688 / 448 = 6 → code 7.
  EXPECT_EQ(q.scale_codes, (std::vector<std::uint8_t>{0x7E, 0x00, 0x00}));
  EXPECT_EQ(q.codes[0], 7);
  EXPECT_EQ(q.codes[16], 0);
  EXPECT_EQ(q.codes[17], 8);  // −0
  const std::vector<float> d = lowp::dequantize(q);
  EXPECT_EQ(d[0], 2688.0f);
  EXPECT_EQ(d[16], 0.0f);
  EXPECT_EQ(d[40], 0.0f);
}

TEST(LowpNvfp4, NaNPoisonsItsBlockAndInfinitySaturates) {
  // Block 0 holds a NaN: its scale is UE4M3's NaN and all 16 values dequantize to NaN; the
  // tensor amax is NaN, so s_enc = 1, and block 1 (amax 3) gets d = 0.5 (0x30 = 2^−1), s_enc / d
  // = 2: 3 → 6 (code 7), 1 → 2 (code 4).
  std::vector<float> x(32, 0.0f);
  x[3] = kNaN;
  x[16] = 3.0f;
  x[17] = 1.0f;
  const lowp::Quantized q = lowp::quantize(x.data(), 1, 32, Recipe::nvfp4, Operand::activation);
  EXPECT_EQ(q.tensor_scale, 1.0f);
  EXPECT_EQ(q.scale_codes, (std::vector<std::uint8_t>{0x7F, 0x30}));
  const std::vector<float> d = lowp::dequantize(q);
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isnan(d[static_cast<std::size_t>(i)])) << i;
  EXPECT_EQ(q.codes[16], 7);
  EXPECT_EQ(q.codes[17], 4);
  EXPECT_EQ(d[16], 3.0f);
  EXPECT_EQ(d[17], 1.0f);

  // An infinity: tensor amax +inf → s_enc = 1; d = inf / 6 saturates to 448; −inf / 448 = −inf
  // saturates to −6 (code 15); dequantized −6 · 448 = −2688. 1 · (1 / 448) → 0.
  std::vector<float> y(16, 0.0f);
  y[0] = -kInf;
  y[1] = 1.0f;
  const lowp::Quantized r = lowp::quantize(y.data(), 1, 16, Recipe::nvfp4, Operand::gradient);
  EXPECT_EQ(r.tensor_scale, 1.0f);
  EXPECT_EQ(r.scale_codes, (std::vector<std::uint8_t>{0x7E}));
  EXPECT_EQ(r.codes[0], 15);
  EXPECT_EQ(r.codes[1], 0);
  EXPECT_EQ(lowp::dequantize(r)[0], -2688.0f);
}

// A given tensor amax sets nvfp4's tensor scale (a shard quantized under the amax its group
// agreed): the codes of the shard are then those of the whole tensor, and without it the shard's
// own amax gives another scale.
TEST(LowpNvfp4, AnAgreedTensorAmaxGivesTheWholeTensorsCodes) {
  std::vector<float> whole(2 * 32);
  for (std::size_t i = 0; i < whole.size(); ++i) whole[i] = std::sin(float(i)) * float(1 + i % 7);
  whole[40] = 50.0f;  // the tensor's amax lies in the second row
  const lowp::Quantized all =
      lowp::quantize(whole.data(), 2, 32, lowp::Recipe::nvfp4, lowp::Operand::activation);
  // Row 0 as a shard of its own, under the agreed amax and under its own.
  const lowp::Quantized agreed =
      lowp::quantize(whole.data(), 1, 32, lowp::Recipe::nvfp4, lowp::Operand::activation, 50.0f);
  const lowp::Quantized own =
      lowp::quantize(whole.data(), 1, 32, lowp::Recipe::nvfp4, lowp::Operand::activation);
  EXPECT_EQ(agreed.tensor_scale, all.tensor_scale);
  EXPECT_EQ(agreed.codes, std::vector<std::uint8_t>(all.codes.begin(), all.codes.begin() + 32));
  EXPECT_EQ(agreed.scale_codes,
            std::vector<std::uint8_t>(all.scale_codes.begin(), all.scale_codes.begin() + 2));
  EXPECT_NE(own.tensor_scale, all.tensor_scale);
}

// nvfp4's random Hadamard transform along the rows (common/lowp.h): orthogonal, so xᵀ·y is kept
// (to double's rounding); an outlier in one row is spread evenly over its 16-row group (every
// entry of R has magnitude 1/4); a last partial group is left as it is; float and double agree.
TEST(LowpNvfp4, HadamardRowsIsOrthogonalAndSpreadsAnOutlier) {
  const std::int64_t rows = 40, xc = 3, yc = 5;  // two groups of 16, then 8 rows untouched
  std::vector<double> x(std::size_t(rows * xc)), y(std::size_t(rows * yc));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.7 * double(i)) + 0.1 * double(i % 5);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = std::sin(1.3 * double(i)) - 0.2;
  auto xty = [&](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> p(std::size_t(xc * yc), 0.0);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < xc; ++i)
        for (std::int64_t j = 0; j < yc; ++j)
          p[std::size_t(i * yc + j)] += a[std::size_t(r * xc + i)] * b[std::size_t(r * yc + j)];
    return p;
  };
  const std::vector<double> before = xty(x, y);
  std::vector<double> xt = x, yt = y;
  lowp::hadamard_rows(xt, rows, xc);
  lowp::hadamard_rows(yt, rows, yc);
  const std::vector<double> after = xty(xt, yt);
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_NEAR(after[i], before[i], 1e-12) << i;
  EXPECT_NE(xt, x);
  for (std::int64_t r = 32; r < rows; ++r)
    for (std::int64_t c = 0; c < xc; ++c)
      EXPECT_EQ(xt[std::size_t(r * xc + c)], x[std::size_t(r * xc + c)]) << r;
  // One outlier of 100 in row 5 of an otherwise zero column: 16 entries of magnitude 25, of
  // both signs, in rows 0..15 of that column.
  std::vector<float> spike(std::size_t(16 * 2), 0.0f);
  spike[5 * 2 + 1] = 100.0f;
  lowp::hadamard_rows(spike, 16, 2);
  int positive = 0;
  for (int r = 0; r < 16; ++r) {
    EXPECT_EQ(spike[std::size_t(r * 2)], 0.0f);
    EXPECT_EQ(std::fabs(spike[std::size_t(r * 2 + 1)]), 25.0f) << r;
    positive += spike[std::size_t(r * 2 + 1)] > 0;
  }
  EXPECT_GT(positive, 0);
  EXPECT_LT(positive, 16);
  // float against double: the same matrix, to fp32's rounding of a 16-term sum.
  std::vector<float> xf(x.begin(), x.end());
  lowp::hadamard_rows(xf, rows, xc);
  for (std::size_t i = 0; i < xf.size(); ++i) EXPECT_NEAR(double(xf[i]), xt[i], 1e-5) << i;
}

TEST(LowpRecipes, StorageBytesAreCodesPlusScales) {
  // A 4096 × 4096 weight: 2^24 codes.
  const std::int64_t n = 4096, codes = n * n;
  EXPECT_EQ(lowp::storage_bytes(n, n, Recipe::tensorwise, Operand::weight), codes + 4);
  EXPECT_EQ(lowp::storage_bytes(n, n, Recipe::rowwise, Operand::weight), codes + 4096 * 4);
  EXPECT_EQ(lowp::storage_bytes(n, n, Recipe::block128, Operand::weight), codes + 32 * 32 * 4);
  EXPECT_EQ(lowp::storage_bytes(n, n, Recipe::block128, Operand::activation),
            codes + 4096 * 32 * 4);
  EXPECT_EQ(lowp::storage_bytes(n, n, Recipe::mxfp8, Operand::weight), codes + 4096 * 128);
  EXPECT_EQ(lowp::storage_bytes(n, n, Recipe::nvfp4, Operand::weight), codes / 2 + 4096 * 256 + 4);
  // Partial blocks count whole, an odd count of E2M1 codes rounds up: 3 × 17 has 51 codes,
  // 26 bytes packed, and 3 · 2 block scales.
  EXPECT_EQ(lowp::storage_bytes(3, 17, Recipe::nvfp4, Operand::activation), 26 + 6 + 4);
  EXPECT_EQ(lowp::storage_bytes(3, 17, Recipe::mxfp8, Operand::activation), 51 + 3);
  EXPECT_EQ(lowp::storage_bytes(130, 130, Recipe::block128, Operand::weight), 16900 + 4 * 4);
  EXPECT_THROW(lowp::storage_bytes(0, 5, Recipe::rowwise, Operand::weight), Error);
}

// ---------------------------------------------------------------------------------------------
// Chapter 6's worked example and figure (06_fp8/README.md, "The scale arithmetic, worked").
// ---------------------------------------------------------------------------------------------

// One block x, row 0 of a 2 × 8 activation whose row 1 is [10, 0, …, 0]; the values below are
// the ones the chapter prints, worked out independently (ml_dtypes' float8_e4m3fn and
// float4_e2m1fn casts of the fp32 products, and by hand: see each comment).
TEST(LowpWorkedExample, OneBlockUnderEachRecipe) {
  const std::vector<float> x{0.3f,  -1.7f, 2.9f, 0.05f, -0.62f, 1.1f, 3.3f, -0.0071f,
                             10.0f, 0.0f,  0.0f, 0.0f,  0.0f,   0.0f, 0.0f, 0.0f};
  // The chapter prints dequantized values to 4 significant digits: within 5e-4 relative.
  auto near = [](const std::vector<float>& got, const std::vector<double>& want) {
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 5e-4 * std::fabs(want[i]) + 1e-12) << "element " << i;
  };
  const std::vector<std::uint8_t> row0_codes_rowwise{0x62, 0xF6, 0x7C, 0x4E,
                                                     0xEB, 0x71, 0x7E, 0xB7};
  const std::vector<double> row0_rowwise{0.2946,  -1.650, 2.829, 0.05156,
                                         -0.6482, 1.061,  3.300, -0.006906};

  // tensorwise: amax 10 (row 1), scale 448 / 10 = 44.8; 0.3 · 44.8 = 13.44 → 13 (0x55).
  const lowp::Quantized t = lowp::quantize(x.data(), 2, 8, Recipe::tensorwise, Operand::activation);
  EXPECT_EQ(t.scales, (std::vector<float>{44.8f}));
  EXPECT_EQ(std::vector<std::uint8_t>(t.codes.begin(), t.codes.begin() + 8),
            (std::vector<std::uint8_t>{0x55, 0xEA, 0x70, 0x41, 0xDE, 0x64, 0x71, 0xAA}));
  near(lowp::dequantize(t), {0.2902, -1.786, 2.857, 0.05022, -0.6250, 1.071, 3.214, -0.006975});

  // rowwise and block128 (one partial 1 × 128 block per row here): amax 3.3, scale
  // 448 / 3.3 = 135.7576; 3.3 · scale = 448 (0x7E); 0.05 · scale = 6.79 → 6.75 (0x4E).
  for (const Recipe r : {Recipe::rowwise, Recipe::block128}) {
    const lowp::Quantized q = lowp::quantize(x.data(), 2, 8, r, Operand::activation);
    EXPECT_EQ(q.scales[0], 448.0f / 3.3f) << lowp::to_string(r);
    EXPECT_NEAR(q.scales[0], 135.7576, 1e-4);
    EXPECT_EQ(std::vector<std::uint8_t>(q.codes.begin(), q.codes.begin() + 8), row0_codes_rowwise)
        << lowp::to_string(r);
    near(lowp::dequantize(q), row0_rowwise);
  }

  // mxfp8: ⌊log2 3.3⌋ − 8 = −7, E8M0 code 127 − 7 = 120, X = 2^−7; 3.3 · 128 = 422.4 → 416
  // (0x7D: E4M3 steps by 32 in [256, 512)), dequantized 416 / 128 = 3.25; 0.05 · 128 = 6.4 →
  // 6.5 (0x4D). Every dequantized value is exact.
  const lowp::Quantized m = lowp::quantize(x.data(), 2, 8, Recipe::mxfp8, Operand::activation);
  EXPECT_EQ(m.scale_codes[0], 120);
  EXPECT_EQ(std::vector<std::uint8_t>(m.codes.begin(), m.codes.begin() + 8),
            (std::vector<std::uint8_t>{0x62, 0xF6, 0x7C, 0x4D, 0xEA, 0x71, 0x7D, 0xB7}));
  const std::vector<float> md = lowp::dequantize(m);
  EXPECT_EQ(std::vector<float>(md.begin(), md.begin() + 8),
            (std::vector<float>{0.3125f, -1.75f, 3.0f, 0.05078125f, -0.625f, 1.125f, 3.25f,
                                -0.00732421875f}));

  // nvfp4: s_enc = 2688 / 10 = 268.8; d_b = 3.3 / 6 · 268.8 = 147.84 → UE4M3 144 (0x71, steps
  // of 16 in [128, 256)); s_enc / d_b = 1.8667; 2.9 · 1.8667 = 5.41 → 6 (code 7), −1.7 →
  // −3.17 → −3 (code 13), 0.05 → 0.093 → 0; dequantized e2m1 · 144 / 268.8. Row 1: d_b =
  // 10 / 6 · 268.8 = 448 (0x7E).
  const lowp::Quantized f = lowp::quantize(x.data(), 2, 8, Recipe::nvfp4, Operand::activation);
  EXPECT_EQ(f.tensor_scale, 268.8f);
  EXPECT_EQ(f.scale_codes, (std::vector<std::uint8_t>{0x71, 0x7E}));
  EXPECT_EQ(std::vector<std::uint8_t>(f.codes.begin(), f.codes.begin() + 8),
            (std::vector<std::uint8_t>{0x1, 0xD, 0x7, 0x0, 0xA, 0x4, 0x7, 0x8}));
  near(lowp::dequantize(f), {0.2679, -1.607, 3.214, 0.0, -0.5357, 1.071, 3.214, 0.0});
}

// The bytes chapter 6's figure of the recipes shows for its 8 × 256 operand: 2048 one-byte codes
// (1024 bytes of packed E2M1) plus the scales, counted by hand from the blocks.
TEST(LowpWorkedExample, TheFiguresBytes) {
  EXPECT_EQ(lowp::storage_bytes(8, 256, Recipe::tensorwise, Operand::activation), 2048 + 4);
  EXPECT_EQ(lowp::storage_bytes(8, 256, Recipe::rowwise, Operand::activation), 2048 + 8 * 4);
  EXPECT_EQ(lowp::storage_bytes(8, 256, Recipe::block128, Operand::activation), 2048 + 16 * 4);
  EXPECT_EQ(lowp::storage_bytes(8, 256, Recipe::block128, Operand::weight), 2048 + 2 * 4);
  EXPECT_EQ(lowp::storage_bytes(128, 256, Recipe::block128, Operand::weight), 32768 + 2 * 4);
  EXPECT_EQ(lowp::storage_bytes(8, 256, Recipe::mxfp8, Operand::activation), 2048 + 64);
  EXPECT_EQ(lowp::storage_bytes(8, 256, Recipe::nvfp4, Operand::activation), 1024 + 128 + 4);
}

// ---------------------------------------------------------------------------------------------
// Stage 06's --fp8-recipe.
// ---------------------------------------------------------------------------------------------

/// parse_stage_cli of a stage with stage 06's --fp8-recipe.
CliOutcome parse_fp8_stage(std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  const StageInfo info{.name = "prog",
                       .summary = "test",
                       .own_dtype = StagePrecision{.word = "fp8", .help = "test"},
                       .flag_groups = {async_fp8::Fp8RecipeFlags::make}};
  return parse_stage_cli(info, static_cast<int>(argv.size()), argv.data());
}

// nvfp4's stochastic rounding of one E2M1 element (lowp::e2m1_encode_stochastic), worked by hand:
// u = (bits >> 8) · 2^−24, and |v| goes up from lo to hi where |v| − lo > u · (hi − lo). 0.25 lies
// halfway between 0 and 0.5: up for u < 0.5, down from u = 0.5 on; 2.5 between 2 (code 4) and 3
// (code 5); 5 between 4 (code 6) and 6 (code 7), up even for u = 0. Over all 2^24 values of u the
// share that rounds up is the fraction itself, to 2^−24, so the mean of the decoded values is v.
TEST(LowpStochastic, E2m1RoundsUpWithTheFractionsProbability) {
  using lowp::e2m1_encode_stochastic;
  EXPECT_EQ(e2m1_encode_stochastic(0.25f, 0x7FFFFF00u), 0x1u);   // u = 0.5 − 2^−24: up to 0.5
  EXPECT_EQ(e2m1_encode_stochastic(0.25f, 0x80000000u), 0x0u);   // u = 0.5: down to 0
  EXPECT_EQ(e2m1_encode_stochastic(-0.25f, 0x00000000u), 0x9u);  // −0.5
  EXPECT_EQ(e2m1_encode_stochastic(2.5f, 0x7FFFFFFFu), 0x5u);
  EXPECT_EQ(e2m1_encode_stochastic(2.5f, 0xFFFFFFFFu), 0x4u);
  EXPECT_EQ(e2m1_encode_stochastic(5.0f, 0x00000000u), 0x7u);
  EXPECT_EQ(e2m1_encode_stochastic(5.0f, 0xFFFFFF00u), 0x6u);
  for (const std::uint32_t bits : {0u, 0x12345678u, 0xFFFFFFFFu}) {
    EXPECT_EQ(e2m1_encode_stochastic(1.5f, bits), 0x3u);  // on the grid: stays
    EXPECT_EQ(e2m1_encode_stochastic(-6.0f, bits), 0xFu);
    EXPECT_EQ(e2m1_encode_stochastic(7.0f, bits), 0x7u);  // saturates
    EXPECT_EQ(e2m1_encode_stochastic(-std::numeric_limits<float>::infinity(), bits), 0xFu);
    EXPECT_EQ(e2m1_encode_stochastic(std::numeric_limits<float>::quiet_NaN(), bits), 0x7u);
    EXPECT_EQ(e2m1_encode_stochastic(-0.0f, bits), 0x8u);
  }
  for (const float v : {0.1f, 0.3f, 1.2f, 1.75f, 2.9f, 4.5f, 5.999f, 1.0e-30f}) {
    std::int64_t up = 0;
    double sum = 0.0;
    const std::uint8_t lo = lowp::e2m1_encode(v) > 0 && lowp::e2m1_decode(lowp::e2m1_encode(v)) > v
                                ? std::uint8_t(lowp::e2m1_encode(v) - 1)
                                : lowp::e2m1_encode(v);
    for (std::uint32_t k = 0; k < (1u << 24); ++k) {
      const std::uint8_t q = e2m1_encode_stochastic(v, k << 8);
      ASSERT_TRUE(q == lo || q == lo + 1) << v << " " << int(q);
      up += q != lo;
      sum += double(lowp::e2m1_decode(q));
    }
    const double a = lowp::e2m1_decode(lo), b = lowp::e2m1_decode(std::uint8_t(lo + 1));
    EXPECT_NEAR(double(up) / double(1 << 24), (double(v) - a) / (b - a), 1.0 / double(1 << 24))
        << v;
    EXPECT_NEAR(sum / double(1 << 24), double(v), (b - a) / double(1 << 24)) << v;
  }
}

// An element's random bits depend on its place in the tensor, not on the matrix it was quantized
// in: the transposed matrix (k_rows) draws the same bits at the same (token, feature), and two
// column shards quantized apart (each with its first feature, the tensor's amax agreed) write
// the whole tensor's codes. Nearest rounding writes other codes, and the shards with their
// features numbered from 0 do too (the check can fail).
TEST(LowpStochastic, AnElementsBitsFollowItsPlaceNotItsShard) {
  const lowp::StochasticRounding s{.stream = 99, .token0 = 5, .feature0 = 7};
  lowp::StochasticRounding t = s;
  t.k_rows = true;
  for (std::int64_t r = 0; r < 9; ++r)
    for (std::int64_t c = 0; c < 11; ++c) EXPECT_EQ(lowp::sr_bits(s, r, c), lowp::sr_bits(t, c, r));
  EXPECT_NE(lowp::sr_bits(s, 0, 1), lowp::sr_bits(s, 1, 0));
  const std::int64_t tokens = 24, features = 64, half = features / 2;
  std::vector<float> x(std::size_t(tokens * features));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.91f * float(i)) * 3.0f;
  const float amax = lowp::block_amax(x.data(), 1, 0, std::int64_t(x.size()), 0, 1);
  const lowp::StochasticRounding whole{.stream = 1234};
  const lowp::Quantized all =
      lowp::quantize(x.data(), tokens, features, Recipe::nvfp4, Operand::gradient, amax, &whole);
  auto shard_codes = [&](bool numbered) {
    std::vector<std::uint8_t> codes(all.codes.size());
    for (std::int64_t p = 0; p < 2; ++p) {
      std::vector<float> part(std::size_t(tokens * half));
      for (std::int64_t r = 0; r < tokens; ++r)
        for (std::int64_t c = 0; c < half; ++c)
          part[std::size_t(r * half + c)] = x[std::size_t(r * features + p * half + c)];
      const lowp::StochasticRounding sr{.stream = 1234, .feature0 = numbered ? p * half : 0};
      const lowp::Quantized q =
          lowp::quantize(part.data(), tokens, half, Recipe::nvfp4, Operand::gradient, amax, &sr);
      for (std::int64_t r = 0; r < tokens; ++r)
        for (std::int64_t c = 0; c < half; ++c)
          codes[std::size_t(r * features + p * half + c)] = q.codes[std::size_t(r * half + c)];
    }
    return codes;
  };
  EXPECT_EQ(shard_codes(true), all.codes);
  EXPECT_NE(shard_codes(false), all.codes);
  EXPECT_NE(
      lowp::quantize(x.data(), tokens, features, Recipe::nvfp4, Operand::gradient, amax).codes,
      all.codes);
  EXPECT_THROW(lowp::quantize(x.data(), tokens, features, Recipe::mxfp8, Operand::gradient,
                              std::nullopt, &whole),
               Error);
}

// Where nearest rounding is biased, stochastic rounding is not: a block whose values scale to
// 1.25 (halfway between E2M1's 1 and 1.5; the tie goes to the even 1) dequantizes to 1 every time
// to nearest, and to 1.25 on average over 400 streams (the mean of 15·400 draws of ±0.25, its
// standard deviation 0.25 / √6000 ≈ 0.003); the block's 6 (its amax) is exact either way.
TEST(LowpStochastic, RoundingIsUnbiasedWhereNearestIsNot) {
  std::vector<float> x(16, 1.25f);
  x[0] = 6.0f;  // s_enc = 6·448 / 6 = 448 and d = ue4m3(6 / 6 · 448) = 448: x scales to itself
  const std::vector<float> nearest =
      lowp::dequantize(lowp::quantize(x.data(), 1, 16, Recipe::nvfp4, Operand::gradient));
  EXPECT_EQ(nearest[1], 1.0f);
  double sum = 0.0;
  const int streams = 400;
  for (int k = 0; k < streams; ++k) {
    const lowp::StochasticRounding sr{.stream = lowp::sr_stream(7, std::uint64_t(k))};
    const std::vector<float> d = lowp::dequantize(
        lowp::quantize(x.data(), 1, 16, Recipe::nvfp4, Operand::gradient, std::nullopt, &sr));
    EXPECT_EQ(d[0], 6.0f);
    for (std::size_t i = 1; i < 16; ++i) {
      ASSERT_TRUE(d[i] == 1.0f || d[i] == 1.5f) << d[i];
      sum += d[i];
    }
  }
  EXPECT_NEAR(sum / (15.0 * streams), 1.25, 0.015);
}

// The recipes' ops on tensors (common/ops.h, which stage 06's recipes are written in): the cpu
// backend's quantize and dequantize write lowp::quantize's and lowp::dequantize's bytes into
// tensors of a [.., K] shape, with nvfp4's agreed amax; shapes that do not fit are refused.
TEST(LowpOps, QuantizeAndDequantizeAreTheQuantizersOnTensors) {
  const std::int64_t rows = 15, cols = 48;
  const Tensor x = Tensor::empty({3, 5, cols});
  for (std::int64_t i = 0; i < x.numel(); ++i)
    x.f32()[std::size_t(i)] = std::sin(0.7f * float(i)) * std::exp2(float(i % 13) - 6.0f);
  x.f32()[7] = 900.0f;  // an outlier in row 0
  for (const Recipe r :
       {Recipe::tensorwise, Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4})
    for (const Operand op : {Operand::activation, Operand::weight, Operand::gradient})
      for (const std::optional<float> agreed : {std::optional<float>(), std::optional(2048.0f)}) {
        SCOPED_TRACE(
            fmt::format("{} operand {}{}", lowp::to_string(r), int(op), agreed ? " agreed" : ""));
        const lowp::Quantized want = lowp::quantize(x.f32().data(), rows, cols, r, op, agreed);
        const bool fp32 = want.layout.scale == lowp::ScaleFormat::fp32;
        const Tensor codes = Tensor::empty({3, 5, cols}, DType::u8);
        const Tensor scales =
            Tensor::empty({want.scale_rows, want.scale_cols}, fp32 ? DType::f32 : DType::u8);
        const Tensor tensor_scale = Tensor::empty({1});
        tensor_scale.f32()[0] = -1.0f;
        ops::lowp_quantize(x, r, op, agreed, codes, scales, tensor_scale);
        const auto* c = codes.data<std::uint8_t>();
        EXPECT_EQ(std::vector<std::uint8_t>(c, c + codes.numel()), want.codes);
        if (fp32) {
          EXPECT_EQ(std::vector<float>(scales.f32().begin(), scales.f32().end()), want.scales);
        } else {
          const auto* sc = scales.data<std::uint8_t>();
          EXPECT_EQ(std::vector<std::uint8_t>(sc, sc + scales.numel()), want.scale_codes);
        }
        if (r == Recipe::nvfp4) {
          EXPECT_EQ(tensor_scale.f32()[0], want.tensor_scale);
        } else {
          EXPECT_EQ(tensor_scale.f32()[0], -1.0f);  // not written
        }
        const Tensor back = Tensor::empty({rows, cols});
        ops::lowp_dequantize(codes, scales, tensor_scale, r, op, back);
        const std::vector<float> want_back = lowp::dequantize(want);
        for (std::size_t i = 0; i < want_back.size(); ++i)
          ASSERT_EQ(std::bit_cast<std::uint32_t>(back.f32()[i]),
                    std::bit_cast<std::uint32_t>(want_back[i]))
              << "element " << i;
        // Written transposed: [cols, rows], the same values.
        const Tensor back_t = Tensor::empty({cols, rows});
        ops::lowp_dequantize(codes, scales, tensor_scale, r, op, back_t, /*transpose=*/true);
        for (std::int64_t i = 0; i < rows; ++i)
          for (std::int64_t j = 0; j < cols; ++j)
            ASSERT_EQ(std::bit_cast<std::uint32_t>(back_t.f32()[std::size_t(j * rows + i)]),
                      std::bit_cast<std::uint32_t>(want_back[std::size_t(i * cols + j)]))
                << i << ", " << j;
        EXPECT_THROW(ops::lowp_dequantize(codes, scales, tensor_scale, r, op,
                                          Tensor::empty({rows, cols}), /*transpose=*/true),
                     Error);
      }
  // Codes of the wrong count, scales of the wrong dtype or count: refused.
  const Tensor scales = Tensor::empty({15, 2}, DType::u8);  // mxfp8's 32-blocks: [15, 2]
  const Tensor ts = Tensor::empty({1});
  EXPECT_NO_THROW(ops::lowp_quantize(x, Recipe::mxfp8, Operand::activation, std::nullopt,
                                     Tensor::empty({15, 48}, DType::e4m3), scales, ts));
  EXPECT_THROW(ops::lowp_quantize(x, Recipe::mxfp8, Operand::activation, std::nullopt,
                                  Tensor::empty({15, 47}, DType::u8), scales, ts),
               Error);
  EXPECT_THROW(ops::lowp_quantize(x, Recipe::mxfp8, Operand::activation, std::nullopt,
                                  Tensor::empty({15, 48}, DType::u8), Tensor::empty({15, 2}), ts),
               Error);
  EXPECT_THROW(
      ops::lowp_quantize(x, Recipe::mxfp8, Operand::activation, std::nullopt,
                         Tensor::empty({15, 48}, DType::u8), Tensor::empty({15, 3}, DType::u8), ts),
      Error);
  EXPECT_THROW(ops::lowp_quantize(x, Recipe::nvfp4, Operand::activation, std::nullopt,
                                  Tensor::empty({15, 48}, DType::u8),
                                  Tensor::empty({15, 3}, DType::u8), Tensor()),
               Error);
}

// R's entries as the CUDA kernel computes them (common/lowp_block.h's rht_entry, a parity and a
// sign mask) are H₁₆·diag(s)/4 written out from the definition; the transform op on a tensor is
// lowp::hadamard_rows bit for bit, a last partial group of rows included.
TEST(LowpOps, HadamardOpIsTheTransformAndItsEntriesAreTheMatrix) {
  for (int i = 0; i < lowp::kRhtSize; ++i)
    for (int j = 0; j < lowp::kRhtSize; ++j) {
      int h = 1;  // H₁₆[i][j] by Sylvester's doubling: a minus sign per shared bit
      for (int bit = 1; bit < lowp::kRhtSize; bit <<= 1)
        if ((i & bit) != 0 && (j & bit) != 0) h = -h;
      EXPECT_EQ(lowp::rht_entry(i, j), float(h * lowp::kRhtSigns[std::size_t(j)]) / 4.0f)
          << i << ", " << j;
    }
  const std::int64_t rows = 37, cols = 19;
  const Tensor x = Tensor::empty({rows, cols}), y = Tensor::empty({rows, cols});
  std::vector<float> want(std::size_t(rows * cols));
  for (std::size_t i = 0; i < want.size(); ++i)
    want[i] = x.f32()[i] = std::cos(1.3f * float(i)) * (i % 17 == 0 ? 1.0e-39f : 3.0f);
  ops::hadamard_rows(x, y);
  lowp::hadamard_rows(want, rows, cols);
  for (std::size_t i = 0; i < want.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(y.f32()[i]), std::bit_cast<std::uint32_t>(want[i])) << i;
  EXPECT_EQ(y.f32()[std::size_t(36 * cols + 3)], x.f32()[std::size_t(36 * cols + 3)]);  // partial
  EXPECT_THROW(ops::hadamard_rows(x, x), Error);
  EXPECT_THROW(ops::hadamard_rows(x, Tensor::empty({rows, cols}, DType::bf16)), Error);
}

// transpose sees x as [numel / last, last] and moves elements of any size; pack_e2m1 puts element
// 2i in the low nibble of byte i and 2i + 1 in the high one, and unpack_e2m1 undoes it.
TEST(LowpOps, TransposeAndE2m1PackingMoveTheBytesWhereTheySay) {
  const Tensor x = Tensor::empty({2, 3, 5}), t = Tensor::empty({5, 6});
  for (std::int64_t i = 0; i < 30; ++i) x.f32()[std::size_t(i)] = float(i);
  ops::transpose(x, t);
  for (std::int64_t r = 0; r < 6; ++r)
    for (std::int64_t c = 0; c < 5; ++c)
      EXPECT_EQ(t.f32()[std::size_t(c * 6 + r)], float(r * 5 + c)) << r << ", " << c;
  const Tensor b = Tensor::empty({4, 3}, DType::e4m3), bt = Tensor::empty({3, 4}, DType::e4m3);
  for (std::uint8_t i = 0; i < 12; ++i) b.data<std::uint8_t>()[i] = std::uint8_t(7 * i + 1);
  ops::transpose(b, bt);
  EXPECT_EQ(bt.data<std::uint8_t>()[1 * 4 + 2], std::uint8_t(7 * (2 * 3 + 1) + 1));
  EXPECT_THROW(ops::transpose(x, Tensor::empty({5, 6}, DType::u8)), Error);

  const Tensor codes = Tensor::empty({2, 4}, DType::u8), packed = Tensor::empty({2, 2}, DType::u8);
  const std::vector<std::uint8_t> in{0x1, 0x2, 0x3, 0x4, 0xF, 0x8, 0x0, 0x9};
  std::copy(in.begin(), in.end(), codes.data<std::uint8_t>());
  ops::pack_e2m1(codes, packed);
  const auto* p = packed.data<std::uint8_t>();
  EXPECT_EQ(std::vector<std::uint8_t>(p, p + 4),
            (std::vector<std::uint8_t>{0x21, 0x43, 0x8F, 0x90}));
  const Tensor back = Tensor::empty({2, 4}, DType::u8);
  ops::unpack_e2m1(packed, back);
  const auto* u = back.data<std::uint8_t>();
  EXPECT_EQ(std::vector<std::uint8_t>(u, u + 8), in);
  EXPECT_THROW(ops::pack_e2m1(Tensor::empty({2, 3}, DType::u8), Tensor::empty({3}, DType::u8)),
               Error);
}

TEST(Fp8RecipeFlag, TensorwiseIsTheDefaultAndRanksAgreeOnIt) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{}, std::vector<std::string>{"--fp8-recipe", "tensorwise"}}) {
    const CliOutcome ok = parse_fp8_stage(args);
    ASSERT_TRUE(ok.options.has_value()) << ok.message;
    EXPECT_EQ(ok.options->flags<async_fp8::Fp8RecipeFlags>().recipe(), Recipe::tensorwise);
    const StageInfo info{
        .name = "prog", .summary = "test", .flag_groups = {async_fp8::Fp8RecipeFlags::make}};
    const ConfigFields fields = config_fields(info, *ok.options);
    EXPECT_TRUE(std::ranges::any_of(fields, [](const auto& f) {
      return f.first == "--fp8-recipe" && f.second == "tensorwise";
    }));
  }
}

TEST(Fp8RecipeFlag, EveryRecipeParsesOnBothDevicesAndOnlyUnderFp8) {
  // Every recipe runs on both backends: the same ops (quantize, dequantize, an fp32 GEMM).
  for (const Recipe r : {Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4}) {
    const std::string name(lowp::to_string(r));
    for (const char* device : {"cpu", "cuda"}) {
      const CliOutcome out = parse_fp8_stage({"--fp8-recipe", name, "--device", device});
      ASSERT_TRUE(out.options.has_value()) << name << " on " << device << ": " << out.message;
      EXPECT_EQ(out.options->flags<async_fp8::Fp8RecipeFlags>().recipe(), r);
    }
  }
  // A recipe other than tensorwise names the FP8 GEMMs' scales: without FP8 GEMMs it is refused.
  for (const char* dtype : {"fp32", "bf16"}) {
    const CliOutcome out = parse_fp8_stage({"--fp8-recipe", "rowwise", "--dtype", dtype});
    EXPECT_FALSE(out.options.has_value()) << dtype;
    EXPECT_EQ(out.exit_code, 2) << dtype;
    EXPECT_NE(out.message.find("--fp8-recipe rowwise"), std::string::npos) << out.message;
    EXPECT_NE(out.message.find(std::string("--dtype ") + dtype), std::string::npos) << out.message;
  }
  const CliOutcome bad = parse_fp8_stage({"--fp8-recipe", "fp4"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.message.find("--fp8-recipe"), std::string::npos) << bad.message;
}

}  // namespace
}  // namespace tpx
