// How stage 06's rowwise and block128 GEMMs are handed to cuBLASLt's scale modes on Hopper, as
// plain data: which scale mode each operand takes, which problems are refused (and the one
// sentence that says why), how the operands are padded, where each block's factor sits in the
// scale tensor cuBLASLt reads, and the small probe problem that checks that placement on the
// device before the first real use. Host code only (no CUDA header): common/cuda/gemm_scaled.cc
// builds its descriptors and scale tensors from these values, and tests/test_scaled_gemm_plan.cc
// checks them on any machine.
//
// The product. ops::gemm_scaled multiplies two quantized operands given K-major, A's codes
// [m, K] and B's codes [n, K], into C [m, n] = A·Bᵀ. Each code q of a block with scale s stands
// for q / s (common/lowp.h: s = fmax / amax, the quantization multiplier), so
//
//   C[i][j] = Σ_b (1 / s_A(i, b)) · (1 / s_B(j, b)) · Σ_{κ in block b} q_A[i][κ]·q_B[j][κ]
//
// and the factors cuBLASLt multiplies by (its A_SCALE_POINTER / B_SCALE_POINTER tensors) are the
// reciprocals 1 / s, one fp32 division each, as gemm_fp8.cc's per-tensor factor is.
//
// The scale modes (cuBLAS documentation, docs.nvidia.com/cuda/cublas, "cublasLtMatmulMatrixScale_t"
// and the comments of cublasLt.h; VEC128_32F and BLK128x128_32F came with cuBLAS 12.9 and run on
// compute capability 9.0 only):
//   rowwise   OUTER_VEC_32F on both operands: a vector of one fp32 per row ("M and N elements");
//             element (i, j) of the product is multiplied by a[i]·b[j].
//   block128  VEC128_32F for an operand of 1 × 128 blocks (activations, gradients: one fp32 per
//             128 elements along K) and BLK128x128_32F for one of 128 × 128 blocks (weights).
//             Both operands of 128 × 128 blocks is not a combination the documentation lists, and
//             stage 06 never multiplies two weights: refused.
// mxfp8's and nvfp4's own modes (VEC32_UE8M0, VEC16_UE4M3) exist only on Blackwell: refused here,
// as is every GPU other than sm_90 and a cuBLASLt older than 12.9.
//
// Orientation (gemm_fp8.cc's header has the derivation): cuBLASLt is column-major and its FP8
// kernels on Hopper take only "TN", so the row-major C = A·Bᵀ runs as D = Cᵀ with cuBLASLt's A
// ("X") our B [n, K] and its B ("Y") our A [m, K]: cuBLASLt's M is our n and its N our m, and the
// A scale mode and pointer belong to our B, the B ones to our A.
//
// Padding. K is padded with zero codes to a multiple of 16 (rowwise: the FP8 kernels' 16-byte
// rule, as gemm_fp8.cc) or of 128 (block128: every K block whole; the zero codes add +0 and the
// block count ⌈K/128⌉ is unchanged), and both m and n to multiples of 4: D's rows are then 16-byte
// multiples, and every outer dimension a scale tensor runs along is a whole number of 4-float
// groups (the rule the block modes' scale tensors follow below). Padded rows have zero codes and
// zero factors, and only C's first m × n are copied out.
//
// The scale tensors' memory order. The documentation's words ("a dedicated scaling factor for each
// 128-element block in the innermost dimension", "for each 128x128-element block") do not say
// which index runs fastest, and it cannot be tried without a GPU. What working callers do (PyTorch's
// torch._scaled_mm with BlockWise1x128 / BlockWise128x128 scales, the tests around it) is:
//   VEC128_32F      "outer-dimension major": the factors of one K block for all rows are
//                   consecutive, factor (r, b) at b·ld + r, ld = the rows rounded up to 4;
//   BLK128x128_32F  K-block major within a row of blocks: factor (R, b) at R·ld + b, ld = the K
//                   blocks rounded up to 4.
// These are tried first; the other order of each (ScaleOrder) second. The choice is not trusted:
// before the first native GEMM of each pair of scale modes in a process, a probe problem
// (make_probe, m = 132, n = 260, K = 384, all codes positive, the block scales 2^e with e changing
// from block to block) runs on the device with each candidate pair of orders until one matches
// the exact product computed here in double (probe_matches); if none does, the pair of modes is
// refused for the rest of the run, said in one line, and those GEMMs run dequantized.
//
// defines: tpx::lowp::native::ScaleMode, ScaleOrder, ScaleArrangement, Support, Plan, Probe,
//          to_string, scale_mode, arrangement, arrange_factors, orders, plan_scaled_gemm,
//          make_probe, probe_matches, gemm_words, kProbeTolerance, kRowAlign
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/fp8_bits.h"
#include "common/lowp.h"

namespace tpx::lowp::native {

using I = std::int64_t;

/// cuBLASLt's scale modes used here (cublasLtMatmulMatrixScale_t).
enum class ScaleMode : std::uint8_t { outer_vec_32f, vec128_32f, blk128x128_32f };

/// The candidate memory orders of a scale tensor of [scale_rows, scale_cols] factors (rows of
/// blocks along the operand's rows, columns along K): outer_major, a K block's factors for all
/// rows consecutive; k_major, a row's factors for all K blocks consecutive (our own order).
enum class ScaleOrder : std::uint8_t { outer_major, k_major };

/// Rows (m, n) are padded to multiples of this, and so is a scale tensor's leading dimension.
inline constexpr I kRowAlign = 4;

inline I round_up(I v, I to) {
  return (v + to - 1) / to * to;
}

inline std::string_view to_string(ScaleMode m) {
  switch (m) {
    case ScaleMode::outer_vec_32f:
      return "OUTER_VEC_32F";
    case ScaleMode::vec128_32f:
      return "VEC128_32F";
    case ScaleMode::blk128x128_32f:
      return "BLK128x128_32F";
  }
  return "?";
}

inline std::string_view to_string(ScaleOrder o) {
  return o == ScaleOrder::outer_major ? "outer-major" : "K-major";
}

/// The scale mode of an operand under recipe (rowwise or block128; others have none here).
inline ScaleMode scale_mode(Recipe recipe, Operand operand) {
  if (recipe == Recipe::rowwise) return ScaleMode::outer_vec_32f;
  return layout(recipe, operand).block_rows == 128 ? ScaleMode::blk128x128_32f
                                                   : ScaleMode::vec128_32f;
}

/// Where each factor of an operand goes in the tensor cuBLASLt reads: factor (r, b) of the
/// [scale_rows, scale_cols] blocks at r·row_stride + b·col_stride; `size` floats in all, the
/// padding included.
struct ScaleArrangement {
  I scale_rows, scale_cols;
  I row_stride, col_stride;
  I size;
};

/// The arrangement of `mode` in `order` for an operand of `rows` rows (padded, a multiple of
/// kRowAlign) and `k_blocks` blocks along K. OUTER_VEC_32F: one factor per row, a plain vector
/// (the order does not apply). VEC128_32F: [rows, k_blocks]; BLK128x128_32F: [⌈rows/128⌉,
/// k_blocks]; in either order the contiguous dimension is padded to a multiple of kRowAlign.
inline ScaleArrangement arrangement(ScaleMode mode, ScaleOrder order, I rows, I k_blocks) {
  if (mode == ScaleMode::outer_vec_32f) return {rows, 1, 1, 0, rows};
  const I sr = mode == ScaleMode::blk128x128_32f ? (rows + 127) / 128 : rows;
  if (order == ScaleOrder::outer_major) {
    const I ld = round_up(sr, kRowAlign);
    return {sr, k_blocks, 1, ld, ld * k_blocks};
  }
  const I ld = round_up(k_blocks, kRowAlign);
  return {sr, k_blocks, ld, 1, sr * ld};
}

/// The candidate orders of a mode, the documented (PyTorch's) one first.
inline std::vector<ScaleOrder> orders(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::outer_vec_32f:
      return {ScaleOrder::outer_major};
    case ScaleMode::vec128_32f:
      return {ScaleOrder::outer_major, ScaleOrder::k_major};
    case ScaleMode::blk128x128_32f:
      return {ScaleOrder::k_major, ScaleOrder::outer_major};
  }
  return {};
}

/// The host's version of the device's arrangement: `scales` row-major [sr, sc] (ops::lowp_quantize's
/// fp32 scales s; sr, sc at most the arrangement's, the rest of its rows being padding) written as
/// factors 1 / s (fp32 division) where `a` places them, zeros in the padding.
inline std::vector<float> arrange_factors(const ScaleArrangement& a, const float* scales, I sr,
                                          I sc) {
  std::vector<float> out(static_cast<std::size_t>(a.size), 0.0f);
  for (I r = 0; r < sr; ++r)
    for (I b = 0; b < sc; ++b)
      out[static_cast<std::size_t>(r * a.row_stride + b * a.col_stride)] =
          hd::div_rn(1.0f, scales[r * sc + b]);
  return out;
}

/// What the machine offers: the GPU's compute capability and cuBLASLt's version
/// (cublasLtGetVersion(), e.g. 130100 for 13.1.0); zeros where there is no GPU.
struct Support {
  int cc_major = 0, cc_minor = 0;
  std::size_t cublaslt_version = 0;
};

/// The native plan of C [m, n] = A·Bᵀ, A [m, K] and B [n, K] K-major codes of `recipe`'s operands
/// a and b; refusal is one sentence (no trailing period) when native is false.
struct Plan {
  bool native = false;
  std::string refusal;
  ScaleMode a_mode{}, b_mode{};
  I mp = 0, np = 0, kp = 0;  ///< m, n, K padded (see the header)
  I k_blocks = 0;            ///< A's and B's scale columns: 1 (rowwise) or ⌈K/128⌉
};

/// cuBLAS 12.9: the first with VEC128_32F and BLK128x128_32F (and OUTER_VEC_32F on Hopper).
inline constexpr std::size_t kFirstCublasLt = 120900;

inline Plan plan_scaled_gemm(Recipe recipe, Operand a, Operand b, I m, I n, I k, const Support& s) {
  Plan p;
  auto refuse = [&p](std::string why) {
    p.native = false;
    p.refusal = std::move(why);
    return p;
  };
  if (recipe == Recipe::tensorwise)
    return refuse("--fp8-recipe tensorwise has one scale per tensor: ops::gemm's FP8 GEMM");
  if (recipe != Recipe::rowwise && recipe != Recipe::block128)
    return refuse(fmt::format(
        "--fp8-recipe {}: cuBLASLt multiplies its block scales ({}) only on Blackwell; on this "
        "GPU the operands are dequantized",
        to_string(recipe), recipe == Recipe::mxfp8 ? "VEC32_UE8M0" : "VEC16_UE4M3"));
  p.a_mode = scale_mode(recipe, a);
  p.b_mode = scale_mode(recipe, b);
  if (s.cc_major != 9 || s.cc_minor != 0)
    return refuse(fmt::format(
        "cuBLASLt's {} x {} scale modes run on compute capability 9.0 (Hopper) only; this GPU is "
        "{}.{}",
        to_string(p.a_mode), to_string(p.b_mode), s.cc_major, s.cc_minor));
  if (s.cublaslt_version < kFirstCublasLt)
    return refuse(fmt::format("cuBLASLt {} has no {} x {} scale modes (cuBLAS 12.9 added them)",
                              s.cublaslt_version, to_string(p.a_mode), to_string(p.b_mode)));
  if (m <= 0 || n <= 0 || k <= 0)
    return refuse(fmt::format("an empty GEMM m={} n={} k={}", m, n, k));
  if (p.a_mode == ScaleMode::blk128x128_32f && p.b_mode == ScaleMode::blk128x128_32f)
    return refuse("cuBLASLt lists no BLK128x128_32F x BLK128x128_32F combination");
  const Layout la = layout(recipe, a), lb = layout(recipe, b);
  if (la.element.mantissa_bits == fp8::kE5M2.mantissa_bits &&
      lb.element.mantissa_bits == fp8::kE5M2.mantissa_bits)
    return refuse("cuBLASLt has no E5M2 x E5M2 FP8 GEMM");
  p.native = true;
  p.kp = round_up(k, recipe == Recipe::block128 ? 128 : 16);
  p.mp = round_up(m, kRowAlign);
  p.np = round_up(n, kRowAlign);
  p.k_blocks = recipe == Recipe::block128 ? (k + 127) / 128 : 1;
  return p;
}

/// How a run's header says its recipe multiplies (common/stage.cc, after the dtype): with
/// `native` (ops::scaled_gemm_problem found nothing against it) the scale modes the GEMMs go to,
/// the ones cuBLASLt refuses and the ring's still dequantized; else the dequantized operands.
inline std::string gemm_words(Recipe recipe, bool native) {
  if (!native || (recipe != Recipe::rowwise && recipe != Recipe::block128))
    return "operands dequantized, GEMMs in fp32";
  return fmt::format("GEMMs on FP8 tensor cores, cuBLASLt {}, else dequantized",
                     recipe == Recipe::rowwise ? "OUTER_VEC_32F" : "VEC128_32F/BLK128x128_32F");
}

/// The probe problem of a pair of scale modes: A [m, K] and B [n, K] positive E4M3 codes, their
/// scales s (row-major [scale rows, k_blocks], as ops::lowp_quantize writes them), and the exact
/// product in double with, per element, the sum of its terms' magnitudes.
struct Probe {
  ScaleMode a_mode, b_mode;
  I m, n, k, k_blocks;
  I a_scale_rows, b_scale_rows;
  std::vector<std::uint8_t> a_codes, b_codes;
  std::vector<float> a_scales, b_scales;
  std::vector<double> expected, magnitude;  ///< [m, n]
};

/// The probe's tolerance, relative to Σ|terms| of each element. fp32 accumulation over K = 384
/// terms bounds the rounding error by about K·2⁻²⁴ ≈ 2.3e-5 of Σ|terms|; Hopper's FP8 tensor
/// cores keep fewer bits in a partial sum between the promotions to fp32 (DeepSeek-AI,
/// "DeepSeek-V3 Technical Report", 2024, its section on FP8 training: about 14 bits, 2⁻¹⁴ ≈
/// 6e-5 per term), so 1e-3 leaves an order of magnitude over both. A factor read from the wrong
/// place is off by a factor of 2 or more (the scales are powers of two whose exponent changes
/// from block to block, all terms positive so nothing cancels): an error of at least a sixth of
/// the element (one of K = 384's three blocks off by half), far above 1e-3.
inline constexpr double kProbeTolerance = 1e-3;

inline Probe make_probe(ScaleMode a_mode, ScaleMode b_mode) {
  // m and n multiples of 4 but not of 128 (a leading dimension that is not a whole tile, a
  // partial 128 × 128 block), K three blocks (a leading dimension of K blocks padded to 4): a
  // padding rule other than the plan's shows as a wrong product, not only a wrong order.
  Probe p{a_mode, b_mode, 132, 260, 384, 0, 0, 0, {}, {}, {}, {}, {}, {}};
  const bool outer = a_mode == ScaleMode::outer_vec_32f;
  p.k_blocks = outer ? 1 : (p.k + 127) / 128;
  auto scale_rows = [](ScaleMode mode, I rows) {
    return mode == ScaleMode::blk128x128_32f ? (rows + 127) / 128 : rows;
  };
  p.a_scale_rows = scale_rows(a_mode, p.m);
  p.b_scale_rows = scale_rows(b_mode, p.n);
  // Positive E4M3 codes 0x30..0x3F (0.5 to 0.9375 and 1 to 1.875): exact products, no cancel.
  auto codes = [&p](I rows, int salt) {
    std::vector<std::uint8_t> c(static_cast<std::size_t>(rows * p.k));
    for (I r = 0; r < rows; ++r)
      for (I j = 0; j < p.k; ++j)
        c[std::size_t(r * p.k + j)] = std::uint8_t(0x30 + (r * 7 + j * 3 + salt) % 16);
    return c;
  };
  // s = 2^(e − 3), e = (5r + 3b + salt) mod 7: neighbouring blocks (either way) differ.
  auto scales = [&p](I rows, int salt) {
    std::vector<float> s(static_cast<std::size_t>(rows * p.k_blocks));
    for (I r = 0; r < rows; ++r)
      for (I b = 0; b < p.k_blocks; ++b)
        s[std::size_t(r * p.k_blocks + b)] = std::ldexp(1.0f, int((5 * r + 3 * b + salt) % 7) - 3);
    return s;
  };
  p.a_codes = codes(p.m, 0);
  p.b_codes = codes(p.n, 5);
  p.a_scales = scales(p.a_scale_rows, 0);
  p.b_scales = scales(p.b_scale_rows, 2);
  const I a_br = a_mode == ScaleMode::blk128x128_32f ? 128 : 1;
  const I b_br = b_mode == ScaleMode::blk128x128_32f ? 128 : 1;
  const I bc = outer ? p.k : 128;
  p.expected.assign(static_cast<std::size_t>(p.m * p.n), 0.0);
  p.magnitude.assign(p.expected.size(), 0.0);
  for (I i = 0; i < p.m; ++i)
    for (I j = 0; j < p.n; ++j) {
      double sum = 0.0, mag = 0.0;
      for (I x = 0; x < p.k; ++x) {
        const double va = double(fp8::decode(p.a_codes[std::size_t(i * p.k + x)], fp8::kE4M3)) /
                          p.a_scales[std::size_t(i / a_br * p.k_blocks + x / bc)];
        const double vb = double(fp8::decode(p.b_codes[std::size_t(j * p.k + x)], fp8::kE4M3)) /
                          p.b_scales[std::size_t(j / b_br * p.k_blocks + x / bc)];
        sum += va * vb;
        mag += std::fabs(va * vb);
      }
      p.expected[std::size_t(i * p.n + j)] = sum;
      p.magnitude[std::size_t(i * p.n + j)] = mag;
    }
  return p;
}

/// Whether c (row-major [m, n] floats, the device's product) is the probe's product within
/// kProbeTolerance of each element's Σ|terms|; NaN never is.
inline bool probe_matches(const Probe& p, const float* c) {
  for (std::size_t i = 0; i < p.expected.size(); ++i) {
    const double err = std::fabs(double(c[i]) - p.expected[i]);
    if (!(err <= kProbeTolerance * p.magnitude[i])) return false;
  }
  return true;
}

}  // namespace tpx::lowp::native
