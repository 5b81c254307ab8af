#include "06_fp8/layers.h"

#include <array>
#include <utility>

#include <fmt/format.h>

#include "common/check.h"
#include "common/ops.h"

namespace tpx::async_fp8 {

Fp8AsyncTp::Fp8AsyncTp(const RunContext& ctx, Fp8Weights weights)
    : OverlapRing(ctx, async_tp::copy_engine_transport),
      recipe_(ctx.options.flags<Fp8RecipeFlags>().recipe()),
      keep_(ctx.options.flags<Fp8RecipeFlags>()),
      layers_(ctx.options.config.layers),
      weight_use_(weights),
      seed_(ctx.options.config.seed),
      // A resumed run goes on numbering where the saved one stopped.
      backward_calls_(lowp::gradient_call(ctx.options.config.layers,
                                          ctx.options.config.checkpoint.resume_step,
                                          ctx.options.config.layers - 1)) {}

std::vector<Tensor> Fp8AsyncTp::quantize(std::span<const Tensor> x, std::span<const DType> format,
                                         std::string_view what) {
  const Device dev = x[0].device();
  // An operand that arrives in FP8 with its scale (a weight gathered as FP8: Fp8Weights::gathered)
  // is used as it is; the others are quantized here.
  std::vector<std::size_t> todo;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!is_fp8(x[i].dtype())) {
      todo.push_back(i);
      continue;
    }
    TPX_CHECK(x[i].dtype() == format[i] && x[i].scale().defined(),
              "{} operand {} arrives as {} without its scale or in another format", what, i,
              x[i].describe());
  }
  // Every operand here is sharded over the group (a sequence shard, a column block, a weight
  // shard), so its amax is the maximum of the shards' amaxes: one MAX all-reduce for all of them.
  const auto k = static_cast<std::int64_t>(todo.size());
  const Tensor amax = Tensor::empty({k}, DType::f32, dev);
  for (std::int64_t j = 0; j < k; ++j) ops::amax(x[todo[std::size_t(j)]], amax.slice0(j, j + 1));
  if (k > 0) group_.all_reduce_max(amax, fmt::format("{} amax", what));
  std::vector<Tensor> q(x.begin(), x.end());
  for (std::int64_t j = 0; j < k; ++j) {
    const std::size_t i = todo[std::size_t(j)];
    const Tensor scale = Tensor::empty({1}, DType::f32, dev);
    ops::fp8_scale(amax.slice0(j, j + 1), format[i], scale);
    const Tensor qi = Tensor::empty(x[i].shape(), format[i], dev);
    ops::quantize_fp8(x[i], scale, qi);
    q[i] = qi.with_scale(scale);
  }
  return q;
}

const Tensor& Fp8AsyncTp::fp8_weight(const Tensor& w) const {
  const auto it = weights_.find(w.raw());
  TPX_CHECK(it != weights_.end(), "the FP8 copy of {} is made by its forward, which has not run",
            w.describe());
  return it->second;
}

void Fp8AsyncTp::keep_for_dump(const std::string& name, const Tensor& q) {
  // The block runs layer 0 first, so the first operand of each name is layer 0's.
  if (keeping_) layer0_.try_emplace(name, q);
}

std::vector<std::pair<std::string, Tensor>> Fp8AsyncTp::dump_extra() {
  keeping_ = false;
  if (recipe_ != lowp::Recipe::tensorwise) return recipe_dump_extra();
  const std::map<std::string, Param> weights{
      {"wq", Param::wq},         {"wk", Param::wk},     {"wv", Param::wv},        {"wo", Param::wo},
      {"w_gate", Param::w_gate}, {"w_up", Param::w_up}, {"w_down", Param::w_down}};
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, q] : std::exchange(layer0_, {})) {  // the same order on every rank
    const auto p = weights.find(name);
    const Tensor full = p != weights.end() ? group_.gather_param(p->second, q)
                                           : group_.gather_sequence(q).with_scale(q.scale());
    const std::string base = "fp8/layers.0." + name;
    out.emplace_back(base, ops::to_device(full, Device::cpu));
    out.emplace_back(base + ".scale", ops::to_device(q.scale(), Device::cpu));
  }
  return out;
}

LayerParams Fp8AsyncTp::layer_params(const std::vector<LayerParams>& stored, std::size_t l,
                                     int next) {
  layer_ = std::int64_t(l);
  return OverlapRing::layer_params(stored, l, next);
}

ColumnResult Fp8AsyncTp::column_forward(const Tensor& h, std::span<const Tensor> w,
                                        std::string_view role) {
  // The language model's output layer stays in bf16, as TorchTitan's and Transformer Engine's
  // recipes keep it: its logits feed a softmax over the whole vocabulary, where FP8's 3-bit
  // mantissa would move every probability, and it is one GEMM of L·7. So do the layers of the
  // last --fp8-keep-last blocks: stage 05's ring on the bf16 shard, the fp32 master weights
  // rounded to bf16 by the GEMM (ops::gemm), no amax, no scale, no dump (the dump is layer 0's,
  // which runs the recipe unless every block is kept).
  if (role == kOutputLayerRole || kept()) return OverlapRing::column_forward(h, w, role);
  if (recipe_ != lowp::Recipe::tensorwise) return recipe_column_forward(h, w, role);
  // The input's shard and the weights (E4M3 all): the shard is what the all-gather moves.
  std::vector<Tensor> x{h};
  x.insert(x.end(), w.begin(), w.end());
  const std::vector<DType> format(x.size(), DType::e4m3);
  std::vector<Tensor> q = quantize(x, format, role);
  if (weight_use_ == Fp8Weights::kept)
    for (std::size_t j = 0; j < w.size(); ++j) weights_[w[j].raw()] = q[j + 1];
  // The dump's names of these operands: the gathered input, then the weights.
  const std::vector<std::string> names = role == "qkv"
                                             ? std::vector<std::string>{"qkv_in", "wq", "wk", "wv"}
                                             : std::vector<std::string>{"mlp_in", "w_gate", "w_up"};
  for (std::size_t i = 0; i < q.size() && i < names.size(); ++i) keep_for_dump(names[i], q[i]);
  return OverlapRing::column_forward(q[0], std::span(q).subspan(1), role);  // saves the FP8 shard
}

Tensor Fp8AsyncTp::column_backward(const Tensor& saved, std::span<const Tensor> w,
                                   std::span<const Tensor> dy, std::span<const Tensor> dw,
                                   std::string_view role) {
  if (role == kOutputLayerRole) return OverlapRing::column_backward(saved, w, dy, dw, role);
  if (kept()) {
    // nvfp4's stochastic rounding numbers every linear backward of every layer
    // (lowp::gradient_call): a kept one still takes its number.
    ++backward_calls_;
    return OverlapRing::column_backward(saved, w, dy, dw, role);
  }
  if (recipe_ != lowp::Recipe::tensorwise) return recipe_column_backward(saved, w, dy, dw, role);
  // dX = RS(Σ dy·Wᵀ): E5M2 × E4M3; dW = AG(h)ᵀ·dy: E4M3 (the saved shard) × E5M2. The weights
  // requantized (Fp8Weights) join the gradients' all-reduce.
  const bool requantize = weight_use_ != Fp8Weights::kept;
  std::vector<Tensor> x(dy.begin(), dy.end());
  std::vector<DType> format(dy.size(), DType::e5m2);
  if (requantize) {
    x.insert(x.end(), w.begin(), w.end());
    format.resize(x.size(), DType::e4m3);
  }
  const std::vector<Tensor> q = quantize(x, format, fmt::format("{} bwd", role));
  const std::span<const Tensor> dyq = std::span(q).first(dy.size());
  std::vector<Tensor> wq;
  for (std::size_t j = 0; j < w.size(); ++j)
    wq.push_back(requantize ? q[dy.size() + j] : fp8_weight(w[j]));
  return OverlapRing::column_backward(saved, wq, dyq, dw, role);
}

Tensor Fp8AsyncTp::row_forward(const Tensor& a, const Tensor& w, std::string_view role) {
  if (kept()) return OverlapRing::row_forward(a, w, role);
  if (recipe_ != lowp::Recipe::tensorwise) return recipe_row_forward(a, w, role);
  const std::array x{a, w};
  const std::array format{DType::e4m3, DType::e4m3};
  const std::vector<Tensor> q = quantize(x, format, role);
  if (weight_use_ == Fp8Weights::kept) weights_[w.raw()] = q[1];
  keep_for_dump(role == "o" ? "wo" : "w_down", q[1]);
  return OverlapRing::row_forward(q[0], q[1], role);
}

Tensor Fp8AsyncTp::row_backward(const Tensor& a, const Tensor& w, const Tensor& dy,
                                const Tensor& dw, std::string_view role) {
  if (kept()) {
    ++backward_calls_;  // as column_backward's
    return OverlapRing::row_backward(a, w, dy, dw, role);
  }
  if (recipe_ != lowp::Recipe::tensorwise) return recipe_row_backward(a, w, dy, dw, role);
  // da = AG(dy)·Wᵀ: E5M2 × E4M3, the gradient's shard gathered as FP8; dW = aᵀ·AG(dy): E4M3 ×
  // E5M2. `a` is quantized again with the gradient in one all-reduce: its bits are forward's
  // (the same tensor, the same agreed amax); so is the weight, where it is requantized.
  if (weight_use_ != Fp8Weights::kept) {
    const std::array x{a, dy, w};
    const std::array format{DType::e4m3, DType::e5m2, DType::e4m3};
    const std::vector<Tensor> q = quantize(x, format, fmt::format("{} bwd", role));
    return OverlapRing::row_backward(q[0], q[2], q[1], dw, role);
  }
  const std::array x{a, dy};
  const std::array format{DType::e4m3, DType::e5m2};
  const std::vector<Tensor> q = quantize(x, format, fmt::format("{} bwd", role));
  return OverlapRing::row_backward(q[0], fp8_weight(w), q[1], dw, role);
}

namespace {

/// The row and block recipes' cut of the estimate: the rank's block keeps no FP8 codes. And the
/// moment of a column layer's weight-gradient GEMMs (recipes.cc), with G = [S, B, H] and
/// F' = [S, B, F/N] in elements: the gathered input's values (fp32, G) and their quantized copy
/// along the tokens (G), beside one output gradient's emulation: its fp32 copy when it is stored
/// in bf16 (F'), its codes (F', one byte) and its dequantized copy (F'); nvfp4's Hadamard
/// transforms add a copy of each operand (G and F'):
///   recipe emulation = 4·(2G + F'·[bf16] + F') + F' (+ 4·(G + F') under nvfp4)
class RecipeMemory final : public MemoryDimension {
 public:
  explicit RecipeMemory(lowp::Recipe recipe) : recipe_(recipe) {}
  void cut(BlockConfig& rank, BlockConfig& pass, const Sharding& /*s*/) const override {
    rank.fp8_codes_kept = pass.fp8_codes_kept = false;
  }
  void add_terms(MemoryEstimate& e, const MemoryParts& p) const override {
    using memory::Count;
    // Every layer kept out of the recipe (--fp8-keep-last L): no operand is emulated.
    if (p.rank.fp8_keep_last >= p.rank.layers) return;
    const char* what = "the recipe's emulation";
    const memory::ActivationBytes& b = p.pass_bytes;
    const Count g = b.full / b.e, f = b.cols_f / b.e;
    Count bytes = memory::sum(
        {memory::product({4, memory::sum({2 * g, b.e == 2 ? f : 0, f}, what)}, what), f}, what);
    if (recipe_ == lowp::Recipe::nvfp4)
      bytes = memory::sum({bytes, memory::product({4, memory::sum({g, f}, what)}, what)}, what);
    e.terms.push_back({"recipe emulation", std::uint64_t(bytes)});
  }

 private:
  lowp::Recipe recipe_;
};

}  // namespace

std::shared_ptr<const MemoryDimension> recipe_memory_dimension(lowp::Recipe recipe) {
  if (recipe == lowp::Recipe::tensorwise) return nullptr;
  return std::make_shared<RecipeMemory>(recipe);
}

Sharding Fp8AsyncTp::sharding() const {
  Sharding s = OverlapRing::sharding();
  if (auto d = recipe_memory_dimension(recipe_)) s.dimensions.push_back(std::move(d));
  return s;
}

std::unique_ptr<Parallelism> make_fp8_async_tp(const RunContext& ctx, Fp8Weights weights) {
  check_tp_split(ctx.options.config, ctx.world, /*sequence=*/true);
  check_recipe_split(ctx.options.config, ctx.world, ctx.options.flags<Fp8RecipeFlags>().recipe());
  // Under --dtype fp32 or bf16 this is stage 05 itself: the baseline FP8 is compared with.
  if (!is_fp8(ctx.options.config.dtype)) return std::make_unique<async_tp::CopyEngineAsyncTp>(ctx);
  return std::make_unique<Fp8AsyncTp>(ctx, weights);
}

Tensor Fp8AsyncTp::column_saved(const Tensor& h, const Tensor& scale) {
  if (!scale.defined()) return h;
  const Tensor q = Tensor::empty(h.shape(), DType::e4m3, h.device());
  ops::quantize_fp8(h, scale, q);
  return q.with_scale(scale);
}

}  // namespace tpx::async_fp8
