// The native block-scaled GEMMs' plan (common/scaled_gemm_plan.h), on any machine: which of
// cuBLASLt's scale modes each recipe's operand takes, which problems are refused and with what
// words, how the operands are padded, where each block's factor lands in a scale tensor of each
// candidate order (from the definition, index by index), that the layout probe tells the orders
// apart, the header's words, and ops::gemm_scaled's dequantized product on the cpu, bit for bit
// the fp32 GEMM stage 06 ran before it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/check.h"
#include "common/fp8_bits.h"
#include "common/lowp.h"
#include "common/ops.h"
#include "common/scaled_gemm_plan.h"
#include "common/tensor.h"

namespace tpx::lowp::native {
namespace {

using lowp::Operand;
using lowp::Recipe;

const Support kHopper{9, 0, 130100};

TEST(ScaledGemmPlan, EachRecipeAndOperandTakesItsScaleMode) {
  struct Case {
    Recipe recipe;
    Operand a, b;
    ScaleMode a_mode, b_mode;
  };
  // Stage 06's native GEMMs: the column forward x·W and the row dgrad dy·Wᵀ (a weight as B), the
  // weight gradients xᵀ·dy (two operands quantized along the tokens).
  const Case cases[] = {
      {Recipe::rowwise, Operand::activation, Operand::weight, ScaleMode::outer_vec_32f,
       ScaleMode::outer_vec_32f},
      {Recipe::rowwise, Operand::gradient, Operand::weight, ScaleMode::outer_vec_32f,
       ScaleMode::outer_vec_32f},
      {Recipe::rowwise, Operand::activation, Operand::gradient, ScaleMode::outer_vec_32f,
       ScaleMode::outer_vec_32f},
      {Recipe::block128, Operand::activation, Operand::weight, ScaleMode::vec128_32f,
       ScaleMode::blk128x128_32f},
      {Recipe::block128, Operand::gradient, Operand::weight, ScaleMode::vec128_32f,
       ScaleMode::blk128x128_32f},
      {Recipe::block128, Operand::activation, Operand::gradient, ScaleMode::vec128_32f,
       ScaleMode::vec128_32f},
  };
  for (const Case& c : cases) {
    const Plan p = plan_scaled_gemm(c.recipe, c.a, c.b, 256, 512, 1024, kHopper);
    SCOPED_TRACE(std::string(lowp::to_string(c.recipe)));
    ASSERT_TRUE(p.native) << p.refusal;
    EXPECT_EQ(p.a_mode, c.a_mode);
    EXPECT_EQ(p.b_mode, c.b_mode);
    EXPECT_TRUE(p.refusal.empty());
  }
  EXPECT_EQ(to_string(ScaleMode::outer_vec_32f), "OUTER_VEC_32F");
  EXPECT_EQ(to_string(ScaleMode::vec128_32f), "VEC128_32F");
  EXPECT_EQ(to_string(ScaleMode::blk128x128_32f), "BLK128x128_32F");
}

TEST(ScaledGemmPlan, RefusesWhatHopperAndCublasLtCannotMultiplyAndSaysWhy) {
  auto refusal = [](Recipe r, Operand a, Operand b, std::int64_t k, const Support& s) {
    const Plan p = plan_scaled_gemm(r, a, b, 64, 64, k, s);
    EXPECT_FALSE(p.native);
    EXPECT_EQ(p.refusal.find('\n'), std::string::npos) << "one line";
    return p.refusal;
  };
  const auto A = Operand::activation, W = Operand::weight, G = Operand::gradient;
  EXPECT_NE(refusal(Recipe::mxfp8, A, W, 128, kHopper).find("VEC32_UE8M0"), std::string::npos);
  EXPECT_NE(refusal(Recipe::mxfp8, A, W, 128, kHopper).find("Blackwell"), std::string::npos);
  EXPECT_NE(refusal(Recipe::nvfp4, A, W, 128, kHopper).find("VEC16_UE4M3"), std::string::npos);
  EXPECT_NE(refusal(Recipe::tensorwise, A, W, 128, kHopper).find("tensorwise"), std::string::npos);
  // Another GPU: Ada (8.9), Blackwell (10.0, 12.0).
  for (const Support s : {Support{8, 9, 130100}, Support{10, 0, 130100}, Support{12, 0, 130100}}) {
    const std::string why = refusal(Recipe::block128, A, W, 128, s);
    EXPECT_NE(why.find("9.0"), std::string::npos) << why;
    EXPECT_NE(why.find(std::to_string(s.cc_major) + "." + std::to_string(s.cc_minor)),
              std::string::npos)
        << why;
    EXPECT_NE(why.find("VEC128_32F x BLK128x128_32F"), std::string::npos) << why;
  }
  // cuBLASLt 12.8 has the modes' enum (MXFP8 / NVFP4 on Blackwell) but not these.
  const std::string old = refusal(Recipe::rowwise, A, W, 128, Support{9, 0, 120800});
  EXPECT_NE(old.find("120800"), std::string::npos) << old;
  EXPECT_NE(old.find("12.9"), std::string::npos) << old;
  EXPECT_TRUE(plan_scaled_gemm(Recipe::rowwise, A, W, 64, 64, 64, Support{9, 0, 120900}).native);
  EXPECT_NE(refusal(Recipe::rowwise, A, W, 0, kHopper).find("empty"), std::string::npos);
  EXPECT_NE(refusal(Recipe::block128, W, W, 128, kHopper).find("BLK128x128_32F x BLK128x128_32F"),
            std::string::npos);
  // rowwise keeps E5M2 for gradients: two gradients would be E5M2 x E5M2, which FP8 GEMMs lack;
  // block128 casts every operand to E4M3, so the same pair runs.
  EXPECT_NE(refusal(Recipe::rowwise, G, G, 128, kHopper).find("E5M2 x E5M2"), std::string::npos);
  EXPECT_TRUE(plan_scaled_gemm(Recipe::block128, G, G, 64, 64, 128, kHopper).native);
}

TEST(ScaledGemmPlan, PadsKToWholeBlocksAndTheRowsToFour) {
  const Plan r =
      plan_scaled_gemm(Recipe::rowwise, Operand::activation, Operand::weight, 37, 50, 200, kHopper);
  ASSERT_TRUE(r.native);
  EXPECT_EQ(r.mp, 40);
  EXPECT_EQ(r.np, 52);
  EXPECT_EQ(r.kp, 208);  // 16-byte rows of codes
  EXPECT_EQ(r.k_blocks, 1);
  const Plan b = plan_scaled_gemm(Recipe::block128, Operand::activation, Operand::weight, 37, 50,
                                  200, kHopper);
  ASSERT_TRUE(b.native);
  EXPECT_EQ(b.mp, 40);
  EXPECT_EQ(b.np, 52);
  EXPECT_EQ(b.kp, 256);  // whole 128-blocks: the block count stays ⌈200/128⌉ = 2
  EXPECT_EQ(b.k_blocks, 2);
  const Plan same = plan_scaled_gemm(Recipe::block128, Operand::activation, Operand::weight, 256,
                                     384, 512, kHopper);
  EXPECT_EQ(same.mp, 256);
  EXPECT_EQ(same.np, 384);
  EXPECT_EQ(same.kp, 512);
  EXPECT_EQ(same.k_blocks, 4);
}

/// Every factor where the definition of each order puts it, the padding zero, nothing written
/// twice: scales s [sr, kb] row-major, factors 1 / s.
TEST(ScaledGemmPlan, ArrangementPlacesEachFactorWhereItsOrderSays) {
  struct Case {
    ScaleMode mode;
    ScaleOrder order;
    std::int64_t rows, k_blocks;
  };
  const Case cases[] = {
      {ScaleMode::outer_vec_32f, ScaleOrder::outer_major, 12, 1},
      {ScaleMode::vec128_32f, ScaleOrder::outer_major, 12, 3},
      {ScaleMode::vec128_32f, ScaleOrder::k_major, 12, 3},
      {ScaleMode::vec128_32f, ScaleOrder::outer_major, 6, 5},    // 6 rows: ld 8
      {ScaleMode::blk128x128_32f, ScaleOrder::k_major, 260, 3},  // 3 row blocks, ld 4
      {ScaleMode::blk128x128_32f, ScaleOrder::outer_major, 260, 3},
      {ScaleMode::blk128x128_32f, ScaleOrder::k_major, 1024, 8},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} {} rows {} k blocks {}", to_string(c.mode), to_string(c.order),
                             c.rows, c.k_blocks));
    const std::int64_t sr = c.mode == ScaleMode::blk128x128_32f ? (c.rows + 127) / 128 : c.rows;
    const ScaleArrangement a = arrangement(c.mode, c.order, c.rows, c.k_blocks);
    ASSERT_EQ(a.scale_rows, sr);
    ASSERT_EQ(a.scale_cols, c.k_blocks);
    // The definitions: outer-major, factor (r, b) at b·⌈sr⌉₄ + r; K-major at r·⌈kb⌉₄ + b; a
    // vector of one factor per row for OUTER_VEC_32F.
    auto up4 = [](std::int64_t v) { return (v + 3) / 4 * 4; };
    auto index = [&](std::int64_t r, std::int64_t b) {
      if (c.mode == ScaleMode::outer_vec_32f) return r;
      return c.order == ScaleOrder::outer_major ? b * up4(sr) + r : r * up4(c.k_blocks) + b;
    };
    const std::int64_t size = c.mode == ScaleMode::outer_vec_32f   ? sr
                              : c.order == ScaleOrder::outer_major ? up4(sr) * c.k_blocks
                                                                   : sr * up4(c.k_blocks);
    ASSERT_EQ(a.size, size);
    std::vector<float> s(static_cast<std::size_t>(sr * c.k_blocks));
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = std::ldexp(1.0f, int(i % 29) - 14) * 1.5f;
    const std::vector<float> f = arrange_factors(a, s.data(), sr, c.k_blocks);
    ASSERT_EQ(static_cast<std::int64_t>(f.size()), size);
    std::vector<int> hits(f.size(), 0);
    for (std::int64_t r = 0; r < sr; ++r)
      for (std::int64_t b = 0; b < c.k_blocks; ++b) {
        const auto at = static_cast<std::size_t>(index(r, b));
        ASSERT_LT(at, f.size());
        ++hits[at];
        EXPECT_EQ(f[at], 1.0f / s[std::size_t(r * c.k_blocks + b)]) << r << ", " << b;
      }
    for (std::size_t i = 0; i < f.size(); ++i) {
      EXPECT_LE(hits[i], 1) << "two factors at " << i;
      if (hits[i] == 0) {
        EXPECT_EQ(f[i], 0.0f) << "padding at " << i;
      }
    }
  }
  // The documented order first, the other one second.
  EXPECT_EQ(orders(ScaleMode::vec128_32f).front(), ScaleOrder::outer_major);
  EXPECT_EQ(orders(ScaleMode::blk128x128_32f).front(), ScaleOrder::k_major);
  EXPECT_EQ(orders(ScaleMode::vec128_32f).size(), 2u);
  EXPECT_EQ(orders(ScaleMode::outer_vec_32f).size(), 1u);
}

/// What a GEMM computes on the probe when it reads each operand's factors where `ra` and `rb` place
/// them although they were written in `written` order: fp32 sums of the exact code products per
/// 128-block, each block's sum times its two factors, as the block modes apply them.
std::vector<float> device_like(const Probe& p, ScaleOrder a_written, const ScaleArrangement& ra,
                               ScaleOrder b_written, const ScaleArrangement& rb) {
  const bool outer = p.a_mode == ScaleMode::outer_vec_32f;
  auto factors = [&p](ScaleMode mode, ScaleOrder written, std::int64_t rows,
                      const std::vector<float>& s, std::int64_t sr) {
    return arrange_factors(arrangement(mode, written, rows, p.k_blocks), s.data(), sr, p.k_blocks);
  };
  const std::vector<float> fa = factors(p.a_mode, a_written, p.m, p.a_scales, p.a_scale_rows);
  const std::vector<float> fb = factors(p.b_mode, b_written, p.n, p.b_scales, p.b_scale_rows);
  const std::int64_t a_br = p.a_mode == ScaleMode::blk128x128_32f ? 128 : 1;
  const std::int64_t b_br = p.b_mode == ScaleMode::blk128x128_32f ? 128 : 1;
  const std::int64_t bc = outer ? p.k : 128;
  std::vector<float> c(static_cast<std::size_t>(p.m * p.n));
  for (std::int64_t i = 0; i < p.m; ++i)
    for (std::int64_t j = 0; j < p.n; ++j) {
      float acc = 0.0f;
      for (std::int64_t b = 0; b < p.k_blocks; ++b) {
        float part = 0.0f;
        for (std::int64_t x = b * bc; x < (b + 1) * bc && x < p.k; ++x)
          part += fp8::decode(p.a_codes[std::size_t(i * p.k + x)], fp8::kE4M3) *
                  fp8::decode(p.b_codes[std::size_t(j * p.k + x)], fp8::kE4M3);
        // A read past the written tensor finds whatever lies there: here, zero.
        auto at = [](const std::vector<float>& f, std::int64_t where) {
          return where < static_cast<std::int64_t>(f.size()) ? f[std::size_t(where)] : 0.0f;
        };
        const float xa = at(fa, i / a_br * ra.row_stride + b * ra.col_stride);
        const float xb = at(fb, j / b_br * rb.row_stride + b * rb.col_stride);
        acc += part * xa * xb;
      }
      c[std::size_t(i * p.n + j)] = acc;
    }
  return c;
}

std::vector<float> device_like(const Probe& p, ScaleOrder a_written, ScaleOrder a_read,
                               ScaleOrder b_written, ScaleOrder b_read) {
  return device_like(p, a_written, arrangement(p.a_mode, a_read, p.m, p.k_blocks), b_written,
                     arrangement(p.b_mode, b_read, p.n, p.k_blocks));
}

TEST(ScaledGemmPlan, ProbeAcceptsTheRightOrderAndRejectsEveryOther) {
  const auto O = ScaleOrder::outer_major, K = ScaleOrder::k_major;
  {
    const Probe p = make_probe(ScaleMode::outer_vec_32f, ScaleMode::outer_vec_32f);
    EXPECT_EQ(p.k_blocks, 1);
    EXPECT_TRUE(probe_matches(p, device_like(p, O, O, O, O).data()));
    // Factors swapped between the operands: rows of A scaled by B's.
    Probe swapped = p;
    std::swap(swapped.a_scales, swapped.b_scales);
    EXPECT_FALSE(probe_matches(p, device_like(swapped, O, O, O, O).data()));
  }
  for (const ScaleMode b_mode : {ScaleMode::vec128_32f, ScaleMode::blk128x128_32f}) {
    SCOPED_TRACE(std::string(to_string(b_mode)));
    const Probe p = make_probe(ScaleMode::vec128_32f, b_mode);
    EXPECT_EQ(p.k_blocks, 3);  // K = 384: a leading dimension of 3 K blocks is padded to 4
    for (const ScaleOrder aw : {O, K})
      for (const ScaleOrder bw : {O, K})
        for (const ScaleOrder ar : {O, K})
          for (const ScaleOrder br : {O, K}) {
            const bool right = aw == ar && bw == br;
            EXPECT_EQ(probe_matches(p, device_like(p, aw, ar, bw, br).data()), right)
                << to_string(aw) << " read as " << to_string(ar) << ", " << to_string(bw)
                << " read as " << to_string(br);
          }
  }
  // A NaN never matches.
  const Probe p = make_probe(ScaleMode::outer_vec_32f, ScaleMode::outer_vec_32f);
  std::vector<float> c = device_like(p, O, O, O, O);
  c[7] = std::nanf("");
  EXPECT_FALSE(probe_matches(p, c.data()));
}

// A device whose scale tensors are padded otherwise than the plan pads them (the rows to a whole
// 128-row tile, or the K blocks not at all) reads the right order at the wrong places: the probe's
// shape (132 and 260 rows, 3 K blocks) makes that a wrong product too.
TEST(ScaledGemmPlan, ProbeRejectsAnotherPaddingOfTheRightOrder) {
  const auto O = ScaleOrder::outer_major, K = ScaleOrder::k_major;
  const Probe p = make_probe(ScaleMode::vec128_32f, ScaleMode::blk128x128_32f);
  const ScaleArrangement ra = arrangement(p.a_mode, O, p.m, p.k_blocks);
  const ScaleArrangement rb = arrangement(p.b_mode, K, p.n, p.k_blocks);
  ASSERT_TRUE(probe_matches(p, device_like(p, O, ra, K, rb).data()));
  ScaleArrangement tile = ra;  // VEC128_32F's rows padded to 256, not 132
  tile.col_stride = 256;
  EXPECT_FALSE(probe_matches(p, device_like(p, O, tile, K, rb).data()));
  ScaleArrangement tight = rb;  // BLK128x128_32F's 3 K blocks not padded to 4
  tight.row_stride = 3;
  EXPECT_FALSE(probe_matches(p, device_like(p, O, ra, K, tight).data()));
}

TEST(ScaledGemmPlan, HeaderWordsNameTheScaleModesOnlyWhereNative) {
  EXPECT_EQ(gemm_words(Recipe::rowwise, true),
            "GEMMs on FP8 tensor cores, cuBLASLt OUTER_VEC_32F, else dequantized");
  EXPECT_EQ(gemm_words(Recipe::block128, true),
            "GEMMs on FP8 tensor cores, cuBLASLt VEC128_32F/BLK128x128_32F, else dequantized");
  for (const Recipe r : {Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4})
    EXPECT_EQ(gemm_words(r, false), "operands dequantized, GEMMs in fp32");
  EXPECT_EQ(gemm_words(Recipe::mxfp8, true), "operands dequantized, GEMMs in fp32");
  EXPECT_EQ(gemm_words(Recipe::nvfp4, true), "operands dequantized, GEMMs in fp32");
  EXPECT_FALSE(ops::scaled_gemm_problem(Device::cpu, Recipe::rowwise).empty());
}

Tensor filled(std::int64_t rows, std::int64_t cols, float phase) {
  Tensor t = Tensor::empty({rows, cols}, DType::f32, Device::cpu);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    t.data<float>()[i] = std::sin(0.37f * float(i) + phase) * (1.0f + float(i % 11));
  return t;
}

ops::ScaledOperand quantized(const Tensor& x, Recipe r, Operand o) {
  const lowp::Layout l = lowp::layout(r, o);
  const std::int64_t rows = x.dim(0), cols = x.dim(1);
  const std::int64_t br = l.block_rows == 0 ? rows : l.block_rows;
  const std::int64_t bc = l.block_cols == 0 ? cols : l.block_cols;
  ops::ScaledOperand q{
      .codes = Tensor::empty({rows, cols}, DType::u8, Device::cpu),
      .scales =
          Tensor::empty({(rows + br - 1) / br, (cols + bc - 1) / bc},
                        l.scale == lowp::ScaleFormat::fp32 ? DType::f32 : DType::u8, Device::cpu),
      .tensor_scale = Tensor::empty({1}, DType::f32, Device::cpu),
      .recipe = r,
      .operand = o,
      .transposed = false,
      .values = Tensor()};
  ops::lowp_quantize(x, r, o, std::nullopt, q.codes, q.scales, q.tensor_scale);
  return q;
}

Tensor dequantized(const ops::ScaledOperand& q, bool transpose) {
  const std::int64_t rows = q.codes.dim(0), cols = q.codes.dim(1);
  Tensor x = Tensor::empty(transpose ? Tensor::Shape{cols, rows} : Tensor::Shape{rows, cols},
                           DType::f32, Device::cpu);
  ops::lowp_dequantize(q.codes, q.scales, q.tensor_scale, q.recipe, q.operand, x, transpose);
  return x;
}

/// On the cpu gemm_scaled is the fp32 GEMM of the dequantized operands in the orientation each
/// operand names: the same call, so the same bits, as stage 06's layers made before it.
TEST(ScaledGemmPlan, CpuProductIsTheDequantizedFp32GemmBitForBit) {
  const std::int64_t m = 40, n = 36, k = 256;
  for (const Recipe r : {Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4})
    for (const bool at : {false, true})
      for (const bool bt : {false, true}) {
        SCOPED_TRACE(fmt::format("{} a transposed {} b transposed {}", lowp::to_string(r), at, bt));
        ops::ScaledOperand a = quantized(filled(m, k, 0.1f), r, Operand::activation);
        ops::ScaledOperand b = quantized(filled(n, k, 0.7f), r, Operand::weight);
        a.transposed = at;
        b.transposed = bt;
        const Tensor c = Tensor::empty({m, n}, DType::f32, Device::cpu);
        ops::gemm_scaled(a, b, c);
        const Tensor want = Tensor::empty({m, n}, DType::f32, Device::cpu);
        ops::gemm(dequantized(a, at), at, dequantized(b, bt), !bt, want);
        EXPECT_EQ(std::memcmp(c.raw(), want.raw(), c.nbytes()), 0);
        // The caller's own dequantized copy is read instead, to the same bits.
        a.values = dequantized(a, at);
        const Tensor c2 = Tensor::empty({m, n}, DType::f32, Device::cpu);
        ops::gemm_scaled(a, b, c2);
        EXPECT_EQ(std::memcmp(c2.raw(), want.raw(), c.nbytes()), 0);
      }
  // A C of another element count is refused.
  const ops::ScaledOperand a = quantized(filled(m, k, 0.1f), Recipe::rowwise, Operand::activation);
  const ops::ScaledOperand b = quantized(filled(n, k, 0.2f), Recipe::rowwise, Operand::weight);
  EXPECT_THROW(ops::gemm_scaled(a, b, Tensor::empty({m, n + 1}, DType::f32, Device::cpu)),
               tpx::Error);
}

}  // namespace
}  // namespace tpx::lowp::native
