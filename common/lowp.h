// Low-precision recipes: how one GEMM operand is cut into blocks, how each block's scale is
// computed and encoded, and how its elements are cast. Five recipes, from one scale per tensor to
// one per 16 elements; the formats' bits are in common/fp8_bits.h and common/lowp_bits.h, one
// block's scale and casts (host and device) in common/lowp_block.h.
//
// The operand is a row-major matrix [rows, cols] whose cols run along the GEMM's reduction
// dimension K and whose rows are its outer dimension (M for the left operand of C = A·B, N for
// the right one, which the caller therefore passes as Bᵀ: the TN layout cuBLASLt's scaled GEMMs
// take). Every block lies inside one row band of block_rows rows and one column band of
// block_cols columns:
//
//   recipe      element                       block (rows × cols)          scale
//   tensorwise  E4M3 (E5M2 for gradients)     the whole matrix             fp32  fmax / amax
//   rowwise     E4M3 (E5M2 for gradients)     1 × cols (one per row)       fp32  fmax / amax
//   block128    E4M3                          1 × 128; weights 128 × 128   fp32  fmax / amax
//   mxfp8       E4M3 (E5M2 for gradients)     1 × 32                       E8M0  2^(⌊log2 amax⌋ − emax)
//   nvfp4       E2M1                          1 × 16                       UE4M3, and one fp32 per
//                                                                          tensor (two levels)
//
// - tensorwise is stage 06's recipe (common/fp8.h). rowwise gives every row of the operand its
//   own scale (cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F; TorchAO's rowwise float8
//   training). block128 is DeepSeek-V3's (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024,
//   its section on FP8 training: 1 × 128 tiles of activations, 128 × 128 blocks of weights, E4M3
//   in every pass; cuBLASLt's VEC128_32F and BLK128x128_32F). Their scales follow stage 06's
//   rule per block: scale = fmax / amax in fp32 (fp8::scale_from_amax: amax 0, NaN or +inf give
//   1), q = cast(x · scale), x' = decode(q) / scale.
// - mxfp8 is the OCP Microscaling Formats (MX) Specification v1.0 (2023), its MXFP8 E4M3 format
//   (MXFP8 E5M2 for gradients, as the other FP8 recipes split the passes) and its conversion of a
//   vector of scalars to an MX block: shared_exp = ⌊log2 amax⌋ − emax_elem (emax_elem = 8 for
//   E4M3, 15 for E5M2), X = 2^shared_exp stored as E8M0, P_i = cast(V_i / X) saturating to ±448
//   (E4M3; ±57344 E5M2). Dequantized value P_i · X. Where the specification leaves the choice open this code
//   takes the MX paper's reference implementation's: a shared exponent below −127 clamps to
//   −127 (a zero block gets 2^−127 and all-zero codes); a block holding a NaN or an infinity gets
//   the NaN scale 0xFF, and every element of a block whose scale is NaN dequantizes to NaN (the
//   specification's rule for a NaN scale). Note that under E4M3 amax / X lies in [256, 512): a block's
//   largest values between 448 and 512 saturate to 448. (Transformer Engine rounds the scale up
//   instead, 2^⌈log2(amax / 448)⌉, which never saturates; the flag names the OCP rule.)
// - nvfp4 is NVIDIA's NVFP4 (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025; the
//   format as its section on NVFP4 and its appendix on the quantization define it), two-level:
//     s_enc   = (6 · 448) / amax_tensor, fp32, by fp8::scale_from_amax (amax 0 → 1)
//     d_b     = ue4m3(amax_b / 6 · s_enc)      the block's decode scale, stored as UE4M3
//     q_i     = e2m1(x_i · (s_enc / decode(d_b)))
//     x'_i    = e2m1_value(q_i) · decode(d_b) / s_enc
//   each step one fp32 operation rounded to nearest, in the order written. A block whose d_b
//   decodes to 0 (all zero, or so small next to the tensor's amax that amax_b / 6 · s_enc is
//   below half of E4M3's smallest subnormal) gets all-zero codes; a NaN anywhere in a block makes
//   d_b NaN (0x7F) and the whole block dequantizes to NaN; an infinite element saturates (the
//   tensor's amax is then +inf, so s_enc = 1, and d_b saturates to 448). Stages round nvfp4's
//   gradients stochastically (the paper's choice; weights and activations to nearest): q_i's E2M1
//   cast goes up or down with the probability of its place between the two neighbours, the
//   random bits a hash of the element's place in its tensor (StochasticRounding, lowp_block.h;
//   the run's numbering of the gradients: gradient_stream below).
//
// A partial last block (rows or cols not a multiple of the block) is a block of the elements
// that exist: its amax is that of those elements, as if the matrix were padded with zeros to a
// whole number of blocks, and there are ⌈rows / block_rows⌉ × ⌈cols / block_cols⌉ scales. No
// shape is refused here; whether a shard's edge may cut a block is the caller's rule.
//
// NaN keeps its sign through the FP8 recipes as stage 06's casts do; E2M1 has no NaN (its code
// of a NaN is ±6, see lowp_bits.h): under nvfp4 the block scale carries it.
//
// defines: tpx::lowp::Recipe, Operand, ScaleFormat, Layout, Quantized, to_string,
//          parse_recipe, layout, quantize, dequantize, emulate, block_amax, storage_bytes,
//          kRhtSigns, hadamard_rows, kLinearBackwards, gradient_call, gradient_stream
//          (nvfp4_tensor_scale, kRhtSize, rht_entry, StochasticRounding: common/lowp_block.h)
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "common/fp8_bits.h"
#include "common/lowp_bits.h"
#include "common/lowp_block.h"

namespace tpx::lowp {

enum class Recipe { tensorwise, rowwise, block128, mxfp8, nvfp4 };

/// The role of the operand in the layer's GEMMs: decides block128's block shape and the element
/// format of tensorwise and rowwise (E5M2 for gradients).
enum class Operand { activation, weight, gradient };

/// The recipe's name as the flag spells it: "tensorwise", "rowwise", …
std::string_view to_string(Recipe recipe);
/// The recipe a flag value names, or nothing.
std::optional<Recipe> parse_recipe(std::string_view name);

/// What a recipe does to one operand (Layout and ScaleFormat: common/lowp_block.h).
Layout layout(Recipe recipe, Operand operand);

/// An operand quantized by a recipe.
struct Quantized {
  Recipe recipe;
  Layout layout;
  std::int64_t rows, cols;
  std::int64_t scale_rows, scale_cols;  ///< ⌈rows / block rows⌉, ⌈cols / block cols⌉
  /// One code per element, row-major [rows, cols]; E2M1 codes in bits 0..3 of their byte.
  std::vector<std::uint8_t> codes;
  /// fp32 scales (tensorwise, rowwise, block128), [scale_rows, scale_cols]; empty otherwise.
  std::vector<float> scales;
  /// E8M0 (mxfp8) or UE4M3 (nvfp4) scale codes, [scale_rows, scale_cols]; empty otherwise.
  std::vector<std::uint8_t> scale_codes;
  /// nvfp4's per-tensor encode scale s_enc; 1 for the other recipes.
  float tensor_scale = 1.0f;
};

/// max |x| over the block [r0, r1) × [c0, c1) of a row-major matrix with `cols` columns: fp32's
/// quiet NaN when the block holds a NaN, +inf when it holds an infinity (and no NaN).
float block_amax(const float* x, std::int64_t cols, std::int64_t r0, std::int64_t r1,
                 std::int64_t c0, std::int64_t c1);

/// Quantizes the row-major matrix x [rows, cols] (K along cols) as `recipe` quantizes an
/// `operand`. rows and cols must be positive (else tpx::Error). `tensor_amax`: nvfp4's s_enc
/// comes from it instead of x's own amax, when x is one shard of a tensor whose amax the
/// shards agreed (a stage's MAX all-reduce); the other recipes ignore it.
/// `stochastic` (nvfp4 only; tpx::Error otherwise): the E2M1 casts round stochastically, each
/// element with its sr_bits under it (StochasticRounding, common/lowp_block.h), instead of to
/// nearest even. The block scales are the same either way.
Quantized quantize(const float* x, std::int64_t rows, std::int64_t cols, Recipe recipe,
                   Operand operand, std::optional<float> tensor_amax = std::nullopt,
                   const StochasticRounding* stochastic = nullptr);

/// The fp32 values the codes and scales stand for, row-major [rows, cols].
std::vector<float> dequantize(const Quantized& q);

/// The values a row-major operand m [rows, cols] stands for once `recipe` has quantized it as a
/// GEMM's `operand`, with the reduction dimension K along m's columns (k_rows false) or along
/// its rows (k_rows true), K cut into `parts` equal parts quantized apart (a rank's shard of K;
/// nvfp4's tensor scale is still the whole m's, as the shards agree it): quantize() of m's
/// values rounded to fp32, dequantized, widened to double. The double
/// reference's emulation of a recipe (common/reference.h) and tools/recipe_gemm_error use it.
/// `stochastic`: nvfp4's stochastic rounding, with m's rows the tensor's tokens and its columns
/// its features, m[0][0] at (token0, feature0) (its k_rows is set here from `k_rows`).
std::vector<double> emulate(const std::vector<double>& m, std::int64_t rows, std::int64_t cols,
                            bool k_rows, Recipe recipe, Operand operand, std::int64_t parts = 1,
                            const StochasticRounding* stochastic = nullptr);

/// nvfp4's random Hadamard transform (NVIDIA, "Pretraining Large Language Models with NVFP4",
/// 2025, its section on random Hadamard transforms): before the weight-gradient GEMM
/// dW = xᵀ·dy quantizes its two operands along the tokens, each is multiplied along the tokens
/// by the same orthogonal 16 × 16 matrix R = H₁₆·diag(s) / 4, H₁₆ the Sylvester-Hadamard matrix
/// (H₁[0][0] = 1, H₂ₙ = [[Hₙ, Hₙ], [Hₙ, −Hₙ]]) and s kRhtSigns. Rᵀ·R = I, so (R·x)ᵀ·(R·dy) = xᵀ·dy
/// in exact arithmetic, while each transformed element mixes 16 tokens: an outlier token is
/// spread over its group before the 16-element blocks take their scales. Tokens run along the
/// rows of m [rows, cols] (row-major): every group of 16 consecutive rows is replaced by R times
/// it; a last group of fewer than 16 rows stays as it is (identity, still orthogonal). Computed
/// in T's arithmetic, each output element one sum of 16 products in row order.
/// The fixed random signs s of the transform, drawn once (the paper fixes one sign vector for
/// the whole run); every stage and the reference use these.
inline constexpr std::array<int, kRhtSize> kRhtSigns = {1,  -1, 1, 1,  -1, 1, -1, -1,
                                                        -1, 1,  1, -1, 1,  1, -1, 1};
template <class T>
void hadamard_rows(std::vector<T>& m, std::int64_t rows, std::int64_t cols);

/// nvfp4's stochastic rounding of the gradients (NVIDIA, "Pretraining Large Language Models with
/// NVFP4", 2025: gradients rounded stochastically, weights and activations to nearest), numbered
/// so that a stage and the double reference draw the same random bits. A run's linear backwards
/// are counted in the order the block runs them, down, gate/up, o, qkv (kLinearBackwards a
/// layer), the last layer first: call = (step·L + L − 1 − layer)·4 + k. Each gradient operand a
/// backward quantizes draws from the stream of (call, pass, j): pass 0 the input gradient's GEMM,
/// 1 the weight gradient's, j its index among the call's weights (q, k, v; gate, up); its
/// elements' bits are then sr_bits of their (token, feature) in the tensor (common/lowp_block.h).
inline constexpr std::int64_t kLinearBackwards = 4;
inline std::int64_t gradient_call(std::int64_t layers, std::int64_t step, std::int64_t layer) {
  return (step * layers + layers - 1 - layer) * kLinearBackwards;
}
inline std::uint64_t gradient_stream(std::uint64_t seed, std::int64_t call, int pass,
                                     std::int64_t j) {
  return sr_stream(seed, static_cast<std::uint64_t>((call * 2 + pass) * 4 + j));
}

/// The bytes an operand [rows, cols] occupies (and a gather of it moves) under a recipe: its
/// codes, one byte each (E2M1: two to a byte, as the GEMMs read them, ⌈rows · cols / 2⌉), and its
/// scales, ⌈rows / block rows⌉ · ⌈cols / block cols⌉ of them at 4 bytes (fp32) or 1 (E8M0,
/// UE4M3), and nvfp4's fp32 tensor scale. Quantized keeps E2M1 codes one to a byte; this counts
/// them packed.
std::int64_t storage_bytes(std::int64_t rows, std::int64_t cols, Recipe recipe, Operand operand);

}  // namespace tpx::lowp
