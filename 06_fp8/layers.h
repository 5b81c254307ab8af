// Stage 06: stage 05's schedule (ring-overlapped tensor + sequence parallelism, chunks moved by
// copy-engine pulls) with every GEMM of the seven linear layers in FP8 (DESIGN.md, "06 — FP8"):
//
//   forward  y  = x · W      E4M3 × E4M3
//   dgrad    dx = dy · Wᵀ    E5M2 × E4M3
//   wgrad    dW = xᵀ · dy    E4M3 × E5M2
//
// Per-tensor current scaling: each operand's amax is taken over the whole logical tensor, so the
// shards of a sharded tensor first agree on it with one MAX all-reduce (one per GEMM group, all of
// the group's operands in one small vector); scale = fmax / amax, q = cast(x · scale). Because
// every shard shares the scale, the column inputs are quantized on their [S/N, B, H] shard and the
// all-gathers move the FP8 bytes: ¼ of stage 05's. The reduce-scatters stay fp32. The FP8 copy of
// a column input is what backward keeps (¼ of the fp32 bytes), and each weight is quantized once
// per step, in forward, and reused by its backward.
//
// --fp8-recipe rowwise | block128 | mxfp8 | nvfp4 (both backends): every operand of the three
// GEMMs is quantized as common/lowp.h's recipe quantizes it, with the GEMM's reduction dimension K
// along the blocks, and the GEMM multiplies the dequantized operands in fp32, except where
// ops::gemm_scaled runs rowwise and block128 natively on Hopper (06_fp8/recipes.cc says which
// GEMMs). Each rank computes its operands' scales on
// its own shard: a scale covers a row (rowwise), a 1 × 128 / 128 × 128 block (block128), a 1 × 32
// block (mxfp8, an E8M0 power of two) or a 1 × 16 block (nvfp4, UE4M3) of the operand of the GEMM
// this rank runs, so no block scale needs an all-reduce. nvfp4's second level, one fp32 scale per
// tensor, does: its amax is the whole tensor's, agreed as tensorwise agrees it, one MAX all-reduce
// per GEMM group (agreed_amax(); its k per layer in 06_fp8/traffic.h). Where K is sharded (the
// row-parallel forward's K = in/N, the column-parallel dgrad's K = out/N) a rowwise "row" is the
// shard's part of the row, and a 128-block (32-, 16-block) fits inside a shard only if the
// shard's length is a multiple of 128 (32, 16): check_recipe_split() refuses the shapes where a
// block would straddle two shards. The column inputs (forward and the dW re-gather) and the
// row-parallel backward's gradient are quantized along K on their [S/N, B, H] shard and gathered
// as codes (FP8 bytes; nvfp4's E2M1 packed two to a byte) plus their scales (fp32; mxfp8's E8M0
// and nvfp4's UE4M3 bytes), which is what the gathers move. The weight-gradient GEMMs reduce over
// the tokens, a dimension the forward's blocks run across: their operands are quantized again
// along the tokens, the gathered ones from the values their gathered codes stand for (every rank
// holds all the tokens then, so no block is cut). Backward keeps the high-precision shard of a
// column input (as stage 05) and quantizes the weights again for dgrad, along the other
// dimension. Under nvfp4 both weight-gradient operands first go through the random Hadamard
// transform along the tokens (common/lowp.h, hadamard_rows), and the transformed gradients of the
// column layers (sharded) agree their own tensor amax.
//
// defines: tpx::async_fp8::Fp8AsyncTp, tpx::async_fp8::make_fp8_async_tp(),
//          tpx::async_fp8::recipe_memory_dimension()
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "05_copy_engine_async_tp/layers.h"
#include "06_fp8/flags.h"
#include "06_fp8/traffic.h"
#include "common/memory_terms.h"
#include "common/ops.h"

namespace tpx::async_fp8 {

class Fp8AsyncTp final : public ring::OverlapRing {
 public:
  explicit Fp8AsyncTp(const RunContext& ctx, Fp8Weights weights = Fp8Weights::kept);

  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override;
  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override;
  /// The FP8 shard of h under the forward's scale (selective recompute): the same codes.
  Tensor column_saved(const Tensor& h, const Tensor& scale) override;
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override;
  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override;
  /// fp8/layers.0.<name>(.scale): the layer-0 FP8 operands of the first forward, full size.
  std::vector<std::pair<std::string, Tensor>> dump_extra() override;
  /// Stage 05's, and under a row or block recipe its memory dimension (recipe_memory_dimension).
  Sharding sharding() const override;
  /// stored[l], and notes that layer l runs next (its forward, its recompute or its backward):
  /// the last --fp8-keep-last layers run stage 05's GEMMs instead of the recipe's. A stage that
  /// runs this one inside it (stage 07) calls it with the parameters it gathered.
  LayerParams layer_params(const std::vector<LayerParams>& stored, std::size_t l,
                           int next) override;

 private:
  /// x[i] in format[i], each with its own per-tensor scale, agreed over the group with one MAX
  /// all-reduce of the amaxes ("<what> amax" on the comm lane).
  std::vector<Tensor> quantize(std::span<const Tensor> x, std::span<const DType> format,
                               std::string_view what);
  /// The FP8 weight quantized by this step's forward (reused by its backward).
  const Tensor& fp8_weight(const Tensor& w) const;

  /// Keeps `q` as layer 0's `name` for dump_extra() if it is the first of that name.
  void keep_for_dump(const std::string& name, const Tensor& q);

  // --- rowwise, block128, mxfp8 and nvfp4 (recipe_ != tensorwise) ---
  /// The values `x` stands for under recipe_: quantized with the GEMM's K along its last
  /// dimension (k_rows false) or along its rows (k_rows true, x seen as [numel / last, last]),
  /// then dequantized, fp32 in x's shape (for the ring's GEMMs, which multiply dequantized
  /// operands). `codes`/`scales`, when given, receive the codes in x's layout and the scales
  /// [1, scale rows, scale cols] (for the dump).
  /// `amax`: nvfp4's agreed tensor amax (agreed_amax()), or nothing (x's own, or no tensor
  /// scale).
  /// `draws`: nvfp4's stochastic rounding of a gradient x [tokens, features], its place in the
  /// tensor (gradient_draws()); its k_rows is set here.
  Tensor emulate(const Tensor& x, bool k_rows, lowp::Operand operand, std::optional<float> amax,
                 Tensor* codes = nullptr, Tensor* scales = nullptr,
                 std::optional<lowp::StochasticRounding> draws = std::nullopt) const;
  /// `x` quantized as emulate() quantizes it, as an operand of ops::gemm_scaled: its codes
  /// K-major ([numel / last, last], or [last, numel / last] under k_rows) with their scales, or,
  /// where the GEMM dequantizes anyway (ops::prepare_scaled), already dequantized, as emulate()
  /// would (its values in the orientation emulate() writes them). Arguments as emulate()'s.
  ops::ScaledOperand gemm_operand(
      const Tensor& x, bool k_rows, lowp::Operand operand, std::optional<float> amax,
      Tensor* codes = nullptr, Tensor* scales = nullptr,
      std::optional<lowp::StochasticRounding> draws = std::nullopt) const;
  /// The shard x [n, B, K] quantized along K and gathered over the group as its codes (FP8, or
  /// nvfp4's E2M1 packed two to a byte) and its scales (what the gathers move): the gathered
  /// codes [N·n·B, K] (one to a byte) and scales, K-major, for ops::gemm_scaled (or, where the
  /// GEMMs dequantize anyway, ops::prepare_scaled's values [N·n·B, K]). `amax` as in
  /// emulate; `codes`/`scales` as there (the codes gathered, in x's layout, the scales
  /// this rank's). `draws` as there: the shard's tokens start at token0 (this rank's first).
  ops::ScaledOperand gather_quantized(const Tensor& x, lowp::Operand operand,
                                      std::optional<float> amax, std::string_view what,
                                      Tensor* codes = nullptr, Tensor* scales = nullptr,
                                      std::optional<lowp::StochasticRounding> draws = std::nullopt);
  /// The values gather_quantized's `g` stands for, fp32 [N·n, B, K] (`shard` the gathered x).
  Tensor gathered_values(const ops::ScaledOperand& g, const Tensor& shard) const;
  /// nvfp4's stochastic rounding of a gradient operand (common/lowp.h, gradient_stream): operand
  /// j of pass `pass` (0 input gradient, 1 weight gradient) of linear backward `call`, its
  /// matrix's [0, 0] at (token0, feature0) of the tensor; nothing under the other recipes.
  std::optional<lowp::StochasticRounding> gradient_draws(std::int64_t call, int pass, std::size_t j,
                                                         std::int64_t token0,
                                                         std::int64_t feature0) const;
  /// x along its rows (its leading dimensions, the tokens) under lowp::hadamard_rows, fp32,
  /// under nvfp4 (the weight-gradient GEMMs' operands); x itself under the other recipes.
  Tensor hadamard(const Tensor& x) const;
  /// nvfp4's tensor scales: the amax of each logical tensor x[i] of which the group's ranks
  /// hold parts, then of each hadamard(transformed[j]), agreed with one MAX all-reduce over the
  /// group ("<what> amax"). Under the other recipes no scale spans a shard: nothing for each,
  /// and no communication.
  std::vector<std::optional<float>> agreed_amax(std::span<const Tensor> x, std::string_view what,
                                                std::span<const Tensor> transformed = {});
  ColumnResult recipe_column_forward(const Tensor& h, std::span<const Tensor> w,
                                     std::string_view role);
  Tensor recipe_column_backward(const Tensor& saved, std::span<const Tensor> w,
                                std::span<const Tensor> dy, std::span<const Tensor> dw,
                                std::string_view role);
  Tensor recipe_row_forward(const Tensor& a, const Tensor& w, std::string_view role);
  Tensor recipe_row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                             std::string_view role);
  /// dump_extra() under the row and block recipes: the codes full size (nvfp4's one to a byte), each
  /// rank's scales stacked.
  std::vector<std::pair<std::string, Tensor>> recipe_dump_extra();
  /// Keeps layer 0's `name` (its codes, full or this rank's shard, and this rank's scales).
  /// `amax`: nvfp4's agreed tensor amax, whose s_enc the dump writes as well.
  void keep_recipe_dump(const std::string& name, const Tensor& codes, const Tensor& scales,
                        std::optional<float> amax);

  /// Whether the layer running now is one of the last --fp8-keep-last: its linear layers are
  /// stage 05's (bf16 operands under the recipe, fp32 accumulation), as the output layer's are.
  bool kept() const { return !keep_.quantizes(layer_, layers_); }

  lowp::Recipe recipe_;
  Fp8RecipeFlags keep_;     // --fp8-keep-last, and the rule of which layers it keeps
  std::int64_t layers_;     // L
  std::int64_t layer_ = 0;  // the layer running now (layer_params())
  Fp8Weights weight_use_;
  std::uint64_t seed_;           // the run's, for the gradients' stochastic rounding
  std::int64_t backward_calls_;  // the next linear backward's number (lowp::gradient_call)
  /// Layer 0's operands for the dump, by dump name: codes, scales, and nvfp4's s_enc.
  struct RecipeDump {
    Tensor codes, scales;
    std::optional<float> tensor_scale;
  };
  std::map<std::string, RecipeDump> recipe_layer0_;

  std::map<const void*, Tensor> weights_;  // by the address of the fp32 master weight
  std::map<std::string, Tensor> layer0_;   // the first forward's FP8 operands, by dump name
  bool keeping_ = true;                    // until dump_extra()
};

/// The rule of the block recipes under TP: a block never straddles two ranks' shards. Under
/// block128 (mxfp8) every length a 128-block (32-block) runs along that the group splits (the
/// column layers' output widths NH·Dh/N, NKV·Dh/N and F/N, the row layers' K) must be a
/// multiple of 128 (32) when N > 1, and of 16 under nvfp4; nvfp4 also needs an even H at any N
/// (a gathered row's E2M1 codes travel two to a byte). Otherwise one line naming --fp8-recipe
/// and the rule (a ConfigError, exit 2).
void check_recipe_split(const BlockConfig& c, int world, lowp::Recipe recipe);

/// The memory estimate's view of a recipe (common/memory_terms.h): under the row and block
/// recipes the block keeps the bf16 shards of its column inputs and no FP8 copy of a weight
/// (BlockConfig::fp8_codes_kept false); nothing under tensorwise (a null pointer: no dimension).
std::shared_ptr<const MemoryDimension> recipe_memory_dimension(lowp::Recipe recipe);

/// Stage 06 under --dtype fp8 (its default); stage 05 under fp32 or bf16.
std::unique_ptr<Parallelism> make_fp8_async_tp(const RunContext& ctx,
                                               Fp8Weights weights = Fp8Weights::kept);

}  // namespace tpx::async_fp8
