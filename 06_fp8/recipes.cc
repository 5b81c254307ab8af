// Stage 06 under --fp8-recipe rowwise, block128, mxfp8 and nvfp4 (06_fp8/layers.h says what each
// GEMM's operands are quantized along, and where the scales come from). Written in tpx::ops, so
// the cpu and cuda backends run the same code: each operand is quantized by the recipe's
// bit-identical casts. Where a GEMM's two operands are both at hand K-major, as codes and scales
// (the column forward, the row dgrad, the weight gradients), ops::gemm_scaled multiplies them:
// on Hopper rowwise and block128 run on the FP8 tensor cores through cuBLASLt's scale modes
// (common/cuda/gemm_scaled.cc); everywhere else, the cpu included, it dequantizes both and the
// fp32 GEMM multiplies them, the very calls this file made before. The ring's GEMM+reduce-scatter
// (the row forward, the column dgrad) multiplies chunk by chunk and keeps dequantized operands.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "06_fp8/layers.h"
#include "common/check.h"
#include "common/config.h"
#include "common/ops.h"

namespace tpx::async_fp8 {
namespace {

/// The layer-0 weights of the dump, by dump name.
const std::map<std::string, Param> kDumpWeights{
    {"wq", Param::wq},         {"wk", Param::wk},     {"wv", Param::wv},        {"wo", Param::wo},
    {"w_gate", Param::w_gate}, {"w_up", Param::w_up}, {"w_down", Param::w_down}};

using I = std::int64_t;

/// x as fp32 on its device: x itself, or its values cast from bf16.
Tensor as_f32(const Tensor& x) {
  if (x.dtype() == DType::f32) return x;
  const Tensor f = Tensor::empty(x.shape(), DType::f32, x.device());
  ops::cast(x, f);
  return f;
}

/// x [..., last] seen as the matrix [numel / last, last], transposed: [last, numel / last].
Tensor transposed(const Tensor& x) {
  const I last = x.dim(x.ndim() - 1);
  const Tensor t = Tensor::empty({last, x.numel() / last}, x.dtype(), x.device());
  ops::transpose(x, t);
  return t;
}

/// The dtype a recipe's element codes are held in: E4M3 or E5M2, or bytes (u8) for nvfp4's E2M1
/// codes (one to a byte, in bits 0..3; they travel packed, two to a byte: ops::pack_e2m1).
DType element_dtype(const fp8::Format& f) {
  if (f.mantissa_bits == lowp::kE2M1.mantissa_bits) return DType::u8;
  return f.mantissa_bits == fp8::kE5M2.mantissa_bits ? DType::e5m2 : DType::e4m3;
}

/// m f32 [rows, cols] (K along cols) quantized as `recipe` quantizes an `operand` on its device
/// (ops::lowp_quantize): codes [rows, cols], scales [scale rows, scale cols] (fp32, or mxfp8's
/// E8M0 and nvfp4's UE4M3 bytes), nvfp4's s_enc [1]; `amax`: nvfp4's agreed tensor amax, or
/// nothing (m's own); `draws`: stochastic rounding (nvfp4's gradients).
ops::ScaledOperand quantize_matrix(const Tensor& m, lowp::Recipe recipe, lowp::Operand operand,
                                   std::optional<float> amax,
                                   const std::optional<lowp::StochasticRounding>& draws) {
  const lowp::Layout l = lowp::layout(recipe, operand);
  const I rows = m.dim(0), cols = m.dim(1);
  const I br = l.block_rows == 0 ? rows : l.block_rows;
  const I bc = l.block_cols == 0 ? cols : l.block_cols;
  ops::ScaledOperand q{.codes = Tensor::empty({rows, cols}, element_dtype(l.element), m.device()),
                       .scales = Tensor::empty(
                           {(rows + br - 1) / br, (cols + bc - 1) / bc},
                           l.scale == lowp::ScaleFormat::fp32 ? DType::f32 : DType::u8, m.device()),
                       .tensor_scale = Tensor::empty({1}, DType::f32, m.device()),
                       .recipe = recipe,
                       .operand = operand,
                       .transposed = false,
                       .values = Tensor()};
  ops::lowp_quantize(m, recipe, operand, amax, q.codes, q.scales, q.tensor_scale,
                     draws ? &*draws : nullptr);
  return q;
}

/// The fp32 values q's codes [rows, cols] stand for, or with `transpose` their transpose
/// [cols, rows] (no copy of the other orientation is made).
Tensor dequantized(const ops::ScaledOperand& q, bool transpose = false) {
  const Tensor& codes = q.codes;
  const Tensor x =
      Tensor::empty(transpose ? Tensor::Shape{codes.dim(1), codes.dim(0)} : codes.shape(),
                    DType::f32, codes.device());
  ops::lowp_dequantize(codes, q.scales, q.tensor_scale, q.recipe, q.operand, x, transpose);
  return x;
}

/// q as a gemm_scaled operand whose fallback dequantizes it as its transpose (`transposed`), or
/// reads `values`, the caller's dequantized copy in that orientation.
ops::ScaledOperand operand_of(ops::ScaledOperand q, bool transposed, Tensor values = Tensor()) {
  q.transposed = transposed;
  q.values = std::move(values);
  return q;
}

/// x quantized under `recipe` with the GEMM's K along its last dimension (k_rows false) or along
/// its rows (k_rows true, x seen as [numel / last, last]), the codes K-major; `codes`/`scales`,
/// when given, receive the codes in x's layout and the scales [1, scale rows, scale cols] (for
/// the dump). Returns then(quantized), called while x's fp32 copy and the codes are alive.
template <class Then>
auto quantize_then(const Tensor& x, bool k_rows, lowp::Recipe recipe, lowp::Operand operand,
                   std::optional<float> amax, Tensor* codes, Tensor* scales,
                   std::optional<lowp::StochasticRounding> draws, const Then& then) {
  const I last = x.dim(x.ndim() - 1), lead = x.numel() / last;
  // The quantizer's matrix has K along its columns.
  const Tensor m = as_f32(x).reshape({lead, last});
  if (draws) draws->k_rows = k_rows;
  ops::ScaledOperand q = quantize_matrix(k_rows ? transposed(m) : m, recipe, operand, amax, draws);
  if (codes) *codes = (k_rows ? transposed(q.codes) : q.codes).reshape(x.shape());
  if (scales) *scales = q.scales.reshape({1, q.scales.dim(0), q.scales.dim(1)});
  return then(std::move(q));
}

/// A cpu f32 tensor of `shape` holding `values`.
Tensor host_f32(const Tensor::Shape& shape, const float* values) {
  const Tensor t = Tensor::empty(shape, DType::f32, Device::cpu);
  std::memcpy(t.raw(), values, t.nbytes());
  return t;
}

}  // namespace

void check_recipe_split(const BlockConfig& c, int world, lowp::Recipe recipe) {
  if (recipe == lowp::Recipe::nvfp4 && c.hidden % 2 != 0)
    throw ConfigError(fmt::format(
        "--fp8-recipe nvfp4: --hidden {} is odd; a gathered row's E2M1 codes travel two to a "
        "byte, so H must be even",
        c.hidden));
  if (world == 1) return;
  // The lengths the group splits and a block runs along (common/lowp.h: 1 × 128 along K and
  // 128 × 128 for weights under block128, 1 × 32 along K under mxfp8): Q's and O's NH·D / N, K's
  // and V's NKV·D / N, F / N.
  const std::int64_t block = recipe == lowp::Recipe::block128 ? 128
                             : recipe == lowp::Recipe::mxfp8  ? 32
                             : recipe == lowp::Recipe::nvfp4  ? 16
                                                              : 0;
  if (block == 0) return;
  std::vector<std::string> cut;
  for (const auto& [what, length] :
       {std::pair{"NH·Dh/N (Wq's columns, Wo's rows)", c.hidden / world},
        std::pair{"NKV·Dh/N (Wk's and Wv's columns)", c.kv_dim() / world},
        std::pair{"F/N (Wg's and Wu's columns, Wd's rows)", c.ffn / world}})
    if (length % block != 0) cut.push_back(fmt::format("{} = {}", what, length));
  if (!cut.empty())
    throw ConfigError(fmt::format(
        "--fp8-recipe {}: over {} ranks a {}-block would straddle two ranks' shards ({}); every "
        "length the group splits must be a multiple of {} per rank",
        lowp::to_string(recipe), world, block, fmt::join(cut, ", "), block));
}

std::vector<std::optional<float>> Fp8AsyncTp::agreed_amax(std::span<const Tensor> x,
                                                          std::string_view what,
                                                          std::span<const Tensor> transformed) {
  std::vector<std::optional<float>> out(x.size() + transformed.size());
  if (recipe_ != lowp::Recipe::nvfp4 || out.empty()) return out;
  const auto k = static_cast<std::int64_t>(out.size());
  const Tensor amax =
      Tensor::empty({k}, DType::f32, x.empty() ? transformed[0].device() : x[0].device());
  for (std::size_t j = 0; j < x.size(); ++j) ops::amax(x[j], amax.slice0(I(j), I(j) + 1));
  // One transformed copy at a time: each is gone before the next is made.
  for (std::size_t j = 0; j < transformed.size(); ++j) {
    const I slot = I(x.size() + j);
    ops::amax(hadamard(transformed[j]), amax.slice0(slot, slot + 1));
  }
  group_.all_reduce_max(amax, fmt::format("{} amax", what));
  const Tensor host = ops::to_device(amax, Device::cpu);
  for (std::int64_t j = 0; j < k; ++j) out[std::size_t(j)] = host.f32()[std::size_t(j)];
  return out;
}

Tensor Fp8AsyncTp::hadamard(const Tensor& x) const {
  if (recipe_ != lowp::Recipe::nvfp4) return x;
  const Tensor y = Tensor::empty(x.shape(), DType::f32, x.device());
  ops::hadamard_rows(as_f32(x), y);
  return y;
}

std::optional<lowp::StochasticRounding> Fp8AsyncTp::gradient_draws(std::int64_t call, int pass,
                                                                   std::size_t j,
                                                                   std::int64_t token0,
                                                                   std::int64_t feature0) const {
  if (recipe_ != lowp::Recipe::nvfp4) return std::nullopt;
  return lowp::StochasticRounding{.stream = lowp::gradient_stream(seed_, call, pass, I(j)),
                                  .token0 = token0,
                                  .feature0 = feature0};
}

Tensor Fp8AsyncTp::emulate(const Tensor& x, bool k_rows, lowp::Operand operand,
                           std::optional<float> amax, Tensor* codes, Tensor* scales,
                           std::optional<lowp::StochasticRounding> draws) const {
  return quantize_then(x, k_rows, recipe_, operand, amax, codes, scales, std::move(draws),
                       [&](const ops::ScaledOperand& q) {
                         return dequantized(q, /*transpose=*/k_rows).reshape(x.shape());
                       });
}

ops::ScaledOperand Fp8AsyncTp::gemm_operand(const Tensor& x, bool k_rows, lowp::Operand operand,
                                            std::optional<float> amax, Tensor* codes,
                                            Tensor* scales,
                                            std::optional<lowp::StochasticRounding> draws) const {
  // Where the GEMM will multiply dequantized operands, dequantized now, at emulate()'s moment
  // (the fp32 copy still alive, the codes freed on return); the codes otherwise.
  return quantize_then(
      x, k_rows, recipe_, operand, amax, codes, scales, std::move(draws),
      [&](ops::ScaledOperand q) { return ops::prepare_scaled(operand_of(std::move(q), k_rows)); });
}

ops::ScaledOperand Fp8AsyncTp::gather_quantized(const Tensor& x, lowp::Operand operand,
                                                std::optional<float> amax, std::string_view what,
                                                Tensor* codes, Tensor* scales,
                                                std::optional<lowp::StochasticRounding> draws) {
  const I k = x.dim(x.ndim() - 1), rows = x.numel() / k;
  const ops::ScaledOperand q =
      quantize_matrix(as_f32(x).reshape({rows, k}), recipe_, operand, amax, draws);
  TPX_CHECK(lowp::layout(recipe_, operand).block_rows == 1,
            "a gathered operand's blocks are one row high");
  const bool e2m1 = recipe_ == lowp::Recipe::nvfp4;
  // The codes [n, B, K] (nvfp4's packed, [n, B, K/2] bytes) and the scales [n, B·K / block]
  // (fp32, or mxfp8's E8M0 and nvfp4's UE4M3 bytes) travel as two gathers of dim-0 chunks.
  // nvfp4's tensor scale needs no gather: every rank made it from the same agreed amax.
  Tensor::Shape code_shape = x.shape();
  if (e2m1) code_shape.back() /= 2;
  Tensor local_codes = q.codes.reshape(x.shape());
  if (e2m1) {
    local_codes = Tensor::empty(code_shape, DType::u8, x.device());
    ops::pack_e2m1(q.codes, local_codes);
  }
  const I n = x.dim(0), scale_rows = q.scales.dim(0), scale_cols = q.scales.dim(1);
  const Tensor local_scales = q.scales.reshape({n, scale_rows * scale_cols / n});
  const auto gc = ring_.transport.gather(ring_, local_codes, fmt::format("{} codes", what));
  const auto gs = ring_.transport.gather(ring_, local_scales, fmt::format("{} scales", what));
  gc->wait_all();
  gs->wait_all();
  const I n_ranks = group_.world();
  Tensor::Shape shape = x.shape();
  shape[0] *= n_ranks;
  Tensor all_codes = gc->full();
  if (e2m1) {
    all_codes = Tensor::empty(shape, DType::u8, x.device());
    ops::unpack_e2m1(gc->full(), all_codes);
  }
  // The dump keeps its own copy: a transport may gather into memory it reuses. The GEMMs read the
  // gathered bytes where they lie, on the compute stream before the next gather is issued, as
  // the dequantization always did.
  if (codes) *codes = ops::to_device(all_codes.reshape(shape), x.device());
  if (scales) *scales = q.scales.reshape({1, scale_rows, scale_cols});
  ops::ScaledOperand all = q;
  all.codes = all_codes.reshape({rows * n_ranks, k});
  all.scales = gs->full().reshape({scale_rows * n_ranks, scale_cols});
  // Where the GEMMs dequantize anyway, dequantized here, while the shard's codes are alive, as
  // this function always did.
  return ops::prepare_scaled(std::move(all));
}

Tensor Fp8AsyncTp::gathered_values(const ops::ScaledOperand& g, const Tensor& shard) const {
  Tensor::Shape shape = shard.shape();
  shape[0] *= group_.world();
  return (g.values.defined() ? g.values : dequantized(g)).reshape(shape);
}

void Fp8AsyncTp::keep_recipe_dump(const std::string& name, const Tensor& codes,
                                  const Tensor& scales, std::optional<float> amax) {
  const std::optional<float> s_enc = recipe_ == lowp::Recipe::nvfp4 && amax
                                         ? std::optional(lowp::nvfp4_tensor_scale(*amax))
                                         : std::nullopt;
  if (keeping_) recipe_layer0_.try_emplace(name, RecipeDump{codes, scales, s_enc});
}

ColumnResult Fp8AsyncTp::recipe_column_forward(const Tensor& h, std::span<const Tensor> w,
                                               std::string_view role) {
  using lowp::Operand;
  // nvfp4: the input's and the weights' amaxes, agreed (one all-reduce; none otherwise).
  std::vector<Tensor> operands{h};
  operands.insert(operands.end(), w.begin(), w.end());
  const std::vector<std::optional<float>> amax = agreed_amax(operands, role);
  Tensor codes, scales;
  // The gathered input [S, B, H] as codes [S·B, H] and scales, K = H along its rows.
  const ops::ScaledOperand x =
      gather_quantized(h, Operand::activation, amax[0], role, &codes, &scales);
  const std::vector<std::string> names = role == "qkv"
                                             ? std::vector<std::string>{"qkv_in", "wq", "wk", "wv"}
                                             : std::vector<std::string>{"mlp_in", "w_gate", "w_up"};
  keep_recipe_dump(names[0], codes, scales, amax[0]);
  ColumnResult r;
  r.saved = h;  // backward quantizes the shard again (the same codes) and re-gathers it
  for (std::size_t j = 0; j < w.size(); ++j) {
    // y = x·W: W's K (its rows) along the blocks, one scale per output column (rowwise); its
    // codes [out, H] are K-major, so y = x·(Wᵀ)ᵀ is gemm_scaled's A·Bᵀ as it stands.
    const ops::ScaledOperand wq =
        gemm_operand(w[j], /*k_rows=*/true, Operand::weight, amax[j + 1], &codes, &scales);
    if (j + 1 < names.size()) keep_recipe_dump(names[j + 1], codes, scales, amax[j + 1]);
    auto shape = h.shape();
    shape[0] *= group_.world();
    shape.back() = w[j].dim(1);
    r.y.push_back(Tensor::empty(shape, ring_.activations, h.device()));
    TraceScope span(ring_.trace, fmt::format("{} GEMM", role));
    ops::gemm_scaled(x, wq, r.y.back());
  }
  return r;
}

Tensor Fp8AsyncTp::recipe_column_backward(const Tensor& saved, std::span<const Tensor> w,
                                          std::span<const Tensor> dy, std::span<const Tensor> dw,
                                          std::string_view role) {
  using lowp::Operand;
  // The wgrad's gradients along the tokens: under nvfp4 after the Hadamard transform.
  // nvfp4: the gradients', the weights', the saved input's and the transformed gradients'
  // amaxes (the wgrad's gradients, after the Hadamard transform), agreed in one all-reduce.
  const bool nvfp4 = recipe_ == lowp::Recipe::nvfp4;
  std::vector<Tensor> operands(dy.begin(), dy.end());
  operands.insert(operands.end(), w.begin(), w.end());
  operands.push_back(saved);
  const std::vector<std::optional<float>> amax =
      agreed_amax(operands, fmt::format("{} bwd", role), nvfp4 ? dy : std::span<const Tensor>{});
  const std::size_t saved_amax = dy.size() + w.size(), transformed = saved_amax + 1;
  // nvfp4's stochastic rounding: this backward's number, and each gradient's first feature (the
  // rank's column shard of the output) over all of the replica's tokens.
  const std::int64_t call = backward_calls_++;
  const I rank = group_.rank();
  // dX = RS(Σ dy·Wᵀ), K = out/N: the gradient and the weight along their columns.
  std::vector<Tensor> dyq, wq;
  for (std::size_t j = 0; j < dy.size(); ++j) {
    const I cols = dy[j].dim(dy[j].ndim() - 1);
    dyq.push_back(emulate(dy[j], /*k_rows=*/false, Operand::gradient, amax[j], nullptr, nullptr,
                          gradient_draws(call, 0, j, 0, rank * cols)));
    wq.push_back(emulate(w[j], /*k_rows=*/false, Operand::weight, amax[dy.size() + j]));
  }
  // The ring multiplies chunk by chunk (common/ring.h): dequantized operands, fp32 GEMMs.
  const Tensor dx =
      gemm_reduce_scatter(ring_, dyq, wq, /*trans_w=*/true, fmt::format("{} dX", role));
  // dW = AG(h)ᵀ·dy, K = the tokens: h re-gathered as FP8, both quantized again along the tokens,
  // nvfp4's after the Hadamard transform (the gathered h is whole on every rank: its own amax is
  // the tensor's).
  const Tensor h = gathered_values(gather_quantized(saved, Operand::activation, amax[saved_amax],
                                                    fmt::format("{} re-gather", role)),
                                   saved);
  weight_grads([this, h, amax, nvfp4, transformed, call, rank,
                dy = std::vector(dy.begin(), dy.end()), dw = std::vector(dw.begin(), dw.end()),
                name = fmt::format("{} dW GEMMs", role)] {
    TraceScope span(ring_.trace, name);
    // Both quantized along the tokens: codes [in, T] and [out, T], K-major, dW = hᵀ·dy = A·Bᵀ.
    const ops::ScaledOperand hq =
        gemm_operand(hadamard(h), /*k_rows=*/true, Operand::activation, std::nullopt);
    for (std::size_t j = 0; j < dy.size(); ++j) {
      const std::optional<float> g_amax = nvfp4 ? amax[transformed + j] : std::nullopt;
      // One statement each, so that the transformed copy is gone before the product.
      const ops::ScaledOperand gq =
          gemm_operand(hadamard(dy[j]), /*k_rows=*/true, Operand::gradient, g_amax, nullptr,
                       nullptr, gradient_draws(call, 1, j, 0, rank * dy[j].dim(dy[j].ndim() - 1)));
      ops::gemm_scaled(hq, gq, dw[j]);
    }
  });
  return dx;
}

Tensor Fp8AsyncTp::recipe_row_forward(const Tensor& a, const Tensor& w, std::string_view role) {
  using lowp::Operand;
  // y = RS(a·W), K = in/N: the activation along its columns, W along its rows.
  const std::vector<std::optional<float>> amax = agreed_amax(std::array{a, w}, role);
  Tensor codes, scales;
  const std::array aq{emulate(a, /*k_rows=*/false, Operand::activation, amax[0])};
  const std::array wq{emulate(w, /*k_rows=*/true, Operand::weight, amax[1], &codes, &scales)};
  keep_recipe_dump(role == "o" ? "wo" : "w_down", codes, scales, amax[1]);
  // The ring multiplies chunk by chunk (common/ring.h): dequantized operands, fp32 GEMMs.
  return gemm_reduce_scatter(ring_, aq, wq, /*trans_w=*/false, role);
}

Tensor Fp8AsyncTp::recipe_row_backward(const Tensor& a, const Tensor& w, const Tensor& dy,
                                       const Tensor& dw, std::string_view role) {
  using lowp::Operand;
  // nvfp4: the gradient's shard's, the weight's and the wgrad input's amaxes (the input after
  // the Hadamard transform along the tokens), agreed in one all-reduce.
  const bool nvfp4 = recipe_ == lowp::Recipe::nvfp4;
  const std::vector<std::optional<float>> amax =
      agreed_amax(std::array{dy, w}, fmt::format("{} bwd", role),
                  nvfp4 ? std::span<const Tensor>(&a, 1) : std::span<const Tensor>{});
  // nvfp4's stochastic rounding: this backward's number; the rank's shard of the tokens.
  const std::int64_t call = backward_calls_++;
  const I shard_tokens = dy.numel() / dy.dim(dy.ndim() - 1);
  // da = AG(dy)·Wᵀ, K = H: the gradient's shard gathered as FP8 codes and scales.
  const ops::ScaledOperand g =
      gather_quantized(dy, Operand::gradient, amax[0], fmt::format("{} bwd", role), nullptr,
                       nullptr, gradient_draws(call, 0, 0, group_.rank() * shard_tokens, 0));
  // The weight gradient needs the gathered values themselves (below); the fallback reads them too.
  const Tensor d = gathered_values(g, dy);
  // W's codes [in/N, H] are K-major as they stand: da = AG(dy)·Wᵀ is gemm_scaled's A·Bᵀ.
  const ops::ScaledOperand wq = gemm_operand(w, /*k_rows=*/false, Operand::weight, amax[1]);
  Tensor da = Tensor::empty(a.shape(), ring_.activations, a.device());
  {
    TraceScope span(ring_.trace, fmt::format("{} bwd GEMM", role));
    ops::gemm_scaled(operand_of(g, false, d.reshape({d.numel() / d.cols(), d.cols()})), wq, da);
  }
  // dW = aᵀ·AG(dy), K = the tokens: both quantized again along the tokens, nvfp4's after the
  // Hadamard transform (the gathered gradient is whole on every rank; a is this rank's K shard of
  // the input, its amax the agreed one).
  weight_grads([this, a, d, dw, call, a_amax = nvfp4 ? amax[2] : std::optional<float>(),
                name = fmt::format("{} dW GEMM", role)] {
    TraceScope span(ring_.trace, name);
    // One statement each, so that each transformed copy is gone before the next is made.
    const ops::ScaledOperand aq =
        gemm_operand(hadamard(a), /*k_rows=*/true, Operand::activation, a_amax);
    const ops::ScaledOperand dq =
        gemm_operand(hadamard(d), /*k_rows=*/true, Operand::gradient, std::nullopt, nullptr,
                     nullptr, gradient_draws(call, 1, 0, 0, 0));
    ops::gemm_scaled(aq, dq, dw);
  });
  return da;
}

std::vector<std::pair<std::string, Tensor>> Fp8AsyncTp::recipe_dump_extra() {
  std::vector<std::pair<std::string, Tensor>> out;
  // The codes full size as under tensorwise (the column inputs were gathered already, the
  // weights are gathered here); the scales as each rank computed them on its shard,
  // [N, scale rows, scale cols] in rank order (a shard's scales are its own: see layers.h);
  // nvfp4's tensor scale s_enc, agreed by the group, as f32 [1].
  for (const auto& [name, dump] : std::exchange(recipe_layer0_, {})) {
    const auto& [codes, scales, tensor_scale] = dump;
    const auto p = kDumpWeights.find(name);
    const Tensor full = p != kDumpWeights.end() ? group_.gather_param(p->second, codes) : codes;
    const std::string base = "fp8/layers.0." + name;
    out.emplace_back(base, ops::to_device(full, Device::cpu));
    out.emplace_back(base + ".scale", ops::to_device(group_.gather_sequence(scales), Device::cpu));
    if (tensor_scale) out.emplace_back(base + ".tensor_scale", host_f32({1}, &*tensor_scale));
  }
  return out;
}

}  // namespace tpx::async_fp8
