// recipe_gemm_error: how far each low-precision recipe's GEMMs land from fp64 on the language
// model's real operands. It trains the language model as stage 01 does (one device, fp32, every
// stage flag), and at the last step takes the operands of each of the seven linear layers' three
// GEMMs as the block hands them over:
//
//   forward  y  = x · W      x [T, in] (activation, K = in),  W [in, out] (weight, K = in)
//   dgrad    dx = dy · Wᵀ    dy [T, out] (gradient, K = out), W (weight, K = out)
//   wgrad    dW = xᵀ · dy    x (activation, K = T),           dy (gradient, K = T)
//
// For each recipe of --recipes, both operands are quantized as stage 06 quantizes them under
// --fp8-recipe (common/lowp.h's quantize with the operand's role and the GEMM's reduction
// dimension K along the blocks; 06_fp8/layers.h), dequantized, and multiplied in double; the
// product of the unquantized fp32 operands, in double, is the truth. As the stage does, the
// weight-gradient GEMM's operands under rowwise, block128, mxfp8 and nvfp4 are quantized along
// the tokens from what the stage holds there: a column layer's input as its forward quantized it
// (along H, gathered as FP8), a row layer's output gradient as its input-gradient GEMM quantized
// it (along H, gathered as FP8), nvfp4's both after the random Hadamard transform along the
// tokens (lowp::hadamard_rows), and nvfp4's gradients rounded stochastically
// (lowp::StochasticRounding, a stream per operand); under tensorwise one scale covers a tensor in
// any orientation.
// --emulate-ranks N cuts a K that a tensor-parallel group of N shards (the row layers' forward,
// the column layers' dgrad) into N parts that rowwise scales apart, as the stage's ranks do (the
// block recipes' blocks never cross a shard: 06_fp8/layers.h's rule; tensorwise agrees one scale).
//
// Each GEMM C against its truth C*: the relative Frobenius error ‖C − C*‖_F / ‖C*‖_F and the
// largest element error relative to the largest element, max |C − C*| / max |C*|; each operand
// A (before any quantization) against what the recipe made of it, A': ‖A' − A‖_F / ‖A‖_F, with
// ‖A‖_F, max |A| and its element count. --gemm-errors FILE receives them as JSON
// (tools/recipe_accuracy.py reads it). --outlier F multiplies the largest-magnitude element of
// every activation operand by F before measuring (a transformer's activation outlier); each
// forward GEMM then also reports the errors of its output's rows other than the outlier's
// ("other_rows").
//
//   recipe_gemm_error --task lm --optimizer adamw --steps 50 [stage flags]
//                     --recipes tensorwise,rowwise --gemm-errors OUT.json
//                     [--emulate-ranks N] [--outlier F]
#include <cblas.h>  // defines: cblas_dgemm

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "01_baseline/layers.h"
#include "common/lowp.h"
#include "common/output.h"
#include "common/stage.h"

namespace tpx::recipe_error {
namespace {

using I = std::int64_t;
using Mat = std::vector<double>;  // row-major
using lowp::Operand;
using lowp::Recipe;

/// The words of --recipes, split at commas.
std::vector<std::string> split_words(const std::string& list) {
  std::vector<std::string> out;
  std::string word;
  for (char ch : list + ",") {
    if (ch == ',') {
      if (!word.empty()) out.push_back(word);
      word.clear();
    } else {
      word += ch;
    }
  }
  return out;
}

/// --gemm-errors, --recipes, --emulate-ranks, --outlier.
class Flags : public FlagGroup {
 public:
  std::string out;
  std::string recipes;
  int ranks = 1;
  double outlier = 1.0;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<Flags>(); }

  std::vector<Recipe> recipe_list() const {
    std::vector<Recipe> r;
    for (const std::string& w : split_words(recipes)) r.push_back(*lowp::parse_recipe(w));
    return r;
  }

  void add_flags(CLI::App& app, MeshFlag /*newest*/) override {
    app.add_option("--gemm-errors", out, "the JSON file the errors are written to")
        ->required()
        ->group("GEMM error");
    app.add_option("--recipes", recipes, "the recipes measured, comma-separated (common/lowp.h)")
        ->required()
        ->group("GEMM error");
    app.add_option("--emulate-ranks", ranks,
                   "the tensor-parallel ranks whose shards of K rowwise scales apart")
        ->capture_default_str()
        ->group("GEMM error");
    app.add_option("--outlier", outlier,
                   "multiplies the largest-magnitude element of each activation operand")
        ->capture_default_str()
        ->group("GEMM error");
  }

  std::optional<std::string> check(const CLI::App& /*app*/, const StageOptions& o) const override {
    const std::vector<std::string> words = split_words(recipes);
    if (words.empty()) return "--recipes: name at least one recipe";
    for (const std::string& w : words)
      if (!lowp::parse_recipe(w))
        return fmt::format(
            "--recipes: '{}' is not a recipe (tensorwise, rowwise, block128, mxfp8, nvfp4)", w);
    if (ranks < 1) return fmt::format("--emulate-ranks must be >= 1 (got {})", ranks);
    if (!(std::isfinite(outlier) && outlier > 0))
      return fmt::format("--outlier must be a positive number (got {})", outlier);
    // The element times F is rounded to fp32: F up to 2^64 keeps any activation below 2^64
    // finite (fp32 reaches 3.4e38); beyond it the measurement would be of an infinity.
    if (outlier > 0x1p64)
      return fmt::format(
          "--outlier must be at most 2^64 (got {:g}): the activation times it must stay an fp32 "
          "number",
          outlier);
    const BlockConfig& c = o.config;
    for (const auto& [what, k] : {std::pair{"--hidden", c.hidden}, std::pair{"--ffn", c.ffn}})
      if (k % ranks != 0)
        return fmt::format("--emulate-ranks {}: {} {} does not split into {} equal parts", ranks,
                           what, k, ranks);
    if (!c.lm()) return "--task block: the operands measured are the language model's (--task lm)";
    if (c.dtype != DType::f32)
      return "--dtype: the operands measured are the fp32 model's (--dtype fp32)";
    if (c.eval_every != 0 || c.recompute != Recompute::none)
      return "--eval-every and --recompute run forwards that are not the measured step's: leave "
             "them out";
    if (const std::string p = output_file_problem("--gemm-errors", out); !p.empty()) return p;
    return std::nullopt;
  }

  ConfigFields agreed() const override {
    return {{"--gemm-errors", out},
            {"--recipes", recipes},
            {"--emulate-ranks", std::to_string(ranks)},
            {"--outlier", fmt::format("{}", outlier)}};
  }
};

/// The fp32 values of a cpu tensor seen as [numel / last dim, last dim], widened to double.
Mat values(const Tensor& t) {
  const std::span<const float> v = t.f32();
  return {v.begin(), v.end()};
}

/// C [m, n] = op(A) · op(B) in double, op a transpose where asked; A is [m, k] or [k, m], B
/// [k, n] or [n, k].
Mat product(const Mat& a, bool trans_a, const Mat& b, bool trans_b, I m, I k, I n) {
  Mat c(static_cast<std::size_t>(m * n), 0.0);
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0, a.data(), static_cast<int>(trans_a ? m : k), b.data(),
              static_cast<int>(trans_b ? k : n), 0.0, c.data(), static_cast<int>(n));
  return c;
}

double frobenius(const Mat& x) {
  double s = 0.0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

double amax(const Mat& x) {
  double m = 0.0;
  for (double v : x) m = std::max(m, std::fabs(v));
  return m;
}

/// ‖a − b‖_F.
double distance(const Mat& a, const Mat& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

/// The element format's name as ml_dtypes spells it.
std::string element_name(Recipe recipe, Operand operand) {
  const lowp::Layout l = lowp::layout(recipe, operand);
  if (recipe == Recipe::nvfp4) return "e2m1";
  return l.element.mantissa_bits == fp8::kE4M3.mantissa_bits ? "e4m3" : "e5m2";
}

/// An operand before and after the recipe: its size and the error the recipe made.
nlohmann::json operand_json(const Mat& exact, const Mat& approx, Recipe recipe, Operand operand,
                            int passes) {
  static const std::map<Operand, std::string> kRole{{Operand::activation, "activation"},
                                                    {Operand::weight, "weight"},
                                                    {Operand::gradient, "gradient"}};
  const double f = frobenius(exact);
  return {{"role", kRole.at(operand)},
          {"element", element_name(recipe, operand)},
          {"passes", passes},
          {"n", exact.size()},
          {"frobenius", f},
          {"amax", amax(exact)},
          {"rel_error", f > 0 ? distance(approx, exact) / f : 0.0}};
}

/// The errors of one GEMM: C = op(A')·op(B') against C* = op(A)·op(B).
nlohmann::json gemm_json(const Mat& c, const Mat& exact) {
  const double f = frobenius(exact), m = amax(exact);
  double worst = 0.0;
  for (std::size_t i = 0; i < c.size(); ++i) worst = std::max(worst, std::fabs(c[i] - exact[i]));
  return {{"rel_frobenius", f > 0 ? distance(c, exact) / f : 0.0},
          {"max_rel", m > 0 ? worst / m : 0.0},
          {"frobenius", f}};
}

/// Stage 01's layers, with the last step's operands measured on their way through.
class Measured final : public Parallelism {
 public:
  explicit Measured(const RunContext& ctx)
      : c_(ctx.options.config), flags_(ctx.options.flags<Flags>()) {}

  Sharding sharding() const override { return inner_.sharding(); }

  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view role) override {
    if (role == kOutputLayerRole) {
      forward_layer_ = 0;
    } else if (last_step()) {
      const std::vector<std::string>& names = column_names(role);
      for (std::size_t j = 0; j < w.size(); ++j) forward(names[j], h, w[j], /*row=*/false);
    }
    return inner_.column_forward(h, w, role);
  }

  Tensor column_backward(const Tensor& saved, std::span<const Tensor> w, std::span<const Tensor> dy,
                         std::span<const Tensor> dw, std::string_view role) override {
    if (role == kOutputLayerRole) {
      backward_layer_ = c_.layers;
    } else if (last_step()) {
      const std::vector<std::string>& names = column_names(role);
      for (std::size_t j = 0; j < w.size(); ++j)
        backward(names[j], saved, w[j], dy[j], /*row=*/false);
    }
    Tensor dx = inner_.column_backward(saved, w, dy, dw, role);
    if (role == "qkv" && backward_layer_ == 0) {  // the step's last GEMMs
      if (last_step()) write();
      ++steps_done_;
    }
    return dx;
  }

  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view role) override {
    if (last_step()) forward(role == "o" ? "wo" : "w_down", a, w, /*row=*/true);
    if (role == "down") ++forward_layer_;
    return inner_.row_forward(a, w, role);
  }

  Tensor row_backward(const Tensor& a, const Tensor& w, const Tensor& dy, const Tensor& dw,
                      std::string_view role) override {
    if (role == "down") --backward_layer_;
    if (last_step()) backward(role == "o" ? "wo" : "w_down", a, w, dy, /*row=*/true);
    return inner_.row_backward(a, w, dy, dw, role);
  }

 private:
  /// Layer 0's Q/K/V backward ends a step: steps_done_ counts them.
  bool last_step() const { return steps_done_ == c_.steps - 1; }

  static const std::vector<std::string>& column_names(std::string_view role) {
    static const std::vector<std::string> qkv{"wq", "wk", "wv"}, mlp{"w_gate", "w_up"};
    return role == "qkv" ? qkv : mlp;
  }

  /// rowwise's parts of a K the group shards.
  I parts(Recipe r, bool k_sharded) const {
    return k_sharded && r == Recipe::rowwise ? I(flags_.ranks) : 1;
  }

  /// x with its largest-magnitude element times --outlier (in fp32); `at`, when given, receives
  /// that element's index.
  Mat with_outlier(Mat x, std::size_t* at = nullptr) const {
    if (flags_.outlier != 1.0 && !x.empty()) {
      auto big = std::max_element(x.begin(), x.end(),
                                  [](double p, double q) { return std::fabs(p) < std::fabs(q); });
      *big = static_cast<double>(static_cast<float>(*big * flags_.outlier));
      if (at) *at = static_cast<std::size_t>(big - x.begin());
    }
    return x;
  }

  void record(const std::string& weight, std::string_view kind, Recipe r, nlohmann::json gemm,
              nlohmann::json a, nlohmann::json b) {
    gemm["recipe"] = lowp::to_string(r);
    gemm["layer"] = forward_or_backward_layer(kind);
    gemm["weight"] = weight;
    gemm["kind"] = kind;
    gemm["a"] = std::move(a);
    gemm["b"] = std::move(b);
    gemms_.push_back(std::move(gemm));
  }

  /// A gradient operand's stochastic rounding under nvfp4, each from a stream of its own; nothing
  /// under the other recipes.
  std::optional<lowp::StochasticRounding> gradient_draws(Recipe r) {
    if (r != Recipe::nvfp4) return std::nullopt;
    return lowp::StochasticRounding{.stream = lowp::sr_stream(1, draws_++)};
  }

  I forward_or_backward_layer(std::string_view kind) const {
    return kind == "forward" ? forward_layer_ : backward_layer_;
  }

  /// y = x·W: K = in, sharded in a row layer.
  void forward(const std::string& name, const Tensor& x_t, const Tensor& w_t, bool row) {
    const I in = w_t.dim(0), out = w_t.dim(1), t = x_t.numel() / in;
    std::size_t at = 0;
    const Mat x = with_outlier(values(x_t), &at), w = values(w_t);
    const Mat exact = product(x, false, w, false, t, in, out);
    // Under --outlier: the rows of y other than the outlier's token, whose error its own
    // quantization would otherwise hide.
    const auto skip = static_cast<std::ptrdiff_t>(at / static_cast<std::size_t>(in));
    auto others = [&](const Mat& y) {
      Mat o(y.begin(), y.begin() + skip * out);
      o.insert(o.end(), y.begin() + (skip + 1) * out, y.end());
      return o;
    };
    for (Recipe r : flags_.recipe_list()) {
      const Mat xq = lowp::emulate(x, t, in, false, r, Operand::activation, parts(r, row));
      const Mat wq = lowp::emulate(w, in, out, true, r, Operand::weight, parts(r, row));
      const Mat y = product(xq, false, wq, false, t, in, out);
      nlohmann::json g = gemm_json(y, exact);
      if (flags_.outlier != 1.0) g["other_rows"] = gemm_json(others(y), others(exact));
      record(name, "forward", r, std::move(g), operand_json(x, xq, r, Operand::activation, 1),
             operand_json(w, wq, r, Operand::weight, 1));
    }
  }

  /// dx = dy·Wᵀ (K = out, sharded in a column layer) and dW = xᵀ·dy (K = the tokens).
  void backward(const std::string& name, const Tensor& x_t, const Tensor& w_t, const Tensor& dy_t,
                bool row) {
    const I in = w_t.dim(0), out = w_t.dim(1), t = dy_t.numel() / out;
    const Mat x = with_outlier(values(x_t)), w = values(w_t), dy = values(dy_t);
    const Mat exact_dx = product(dy, false, w, true, t, out, in);
    const Mat exact_dw = product(x, true, dy, false, in, t, out);
    for (Recipe r : flags_.recipe_list()) {
      // nvfp4 rounds its gradients stochastically, as stage 06 does: the input gradient's GEMM
      // (and a row layer's re-gathered gradient, the same codes) and the weight gradient's
      // each draw from a stream of their own.
      const auto draw0 = gradient_draws(r), draw1 = gradient_draws(r);
      const lowp::StochasticRounding* sr0 = draw0 ? &*draw0 : nullptr;
      const lowp::StochasticRounding* sr1 = draw1 ? &*draw1 : nullptr;
      const Mat dyq = lowp::emulate(dy, t, out, false, r, Operand::gradient, parts(r, !row), sr0);
      const Mat wq = lowp::emulate(w, in, out, false, r, Operand::weight, parts(r, !row));
      record(name, "dgrad", r, gemm_json(product(dyq, false, wq, true, t, out, in), exact_dx),
             operand_json(dy, dyq, r, Operand::gradient, 1),
             operand_json(w, wq, r, Operand::weight, 1));
      // wgrad: tensorwise reuses one scale per tensor; the others quantize again along the
      // tokens from what the stage holds (a column layer's FP8 input, a row layer's FP8
      // gradient, each as quantized along H).
      // nvfp4 multiplies both along the tokens by the orthogonal Hadamard transform R first
      // (lowp::hadamard_rows): (R·x)ᵀ·(R·dy) = xᵀ·dy, and each operand's error is measured
      // against R times it.
      Mat xw, dyw, x_want = x, dy_want = dy;
      int x_passes = 1, dy_passes = 1;
      if (r == Recipe::tensorwise) {
        xw = lowp::emulate(x, t, in, false, r, Operand::activation);
        dyw = lowp::emulate(dy, t, out, false, r, Operand::gradient);
      } else {
        Mat xs = row ? x : lowp::emulate(x, t, in, false, r, Operand::activation);
        Mat dys = row ? lowp::emulate(dy, t, out, false, r, Operand::gradient, 1, sr0) : dy;
        if (r == Recipe::nvfp4) {
          for (Mat* m : {&xs, &x_want}) lowp::hadamard_rows(*m, t, in);
          for (Mat* m : {&dys, &dy_want}) lowp::hadamard_rows(*m, t, out);
        }
        x_passes = row ? 1 : 2;
        dy_passes = row ? 2 : 1;
        xw = lowp::emulate(xs, t, in, true, r, Operand::activation);
        dyw = lowp::emulate(dys, t, out, true, r, Operand::gradient, 1, sr1);
      }
      record(name, "wgrad", r, gemm_json(product(xw, true, dyw, false, in, t, out), exact_dw),
             operand_json(x_want, xw, r, Operand::activation, x_passes),
             operand_json(dy_want, dyw, r, Operand::gradient, dy_passes));
    }
  }

  void write() {
    nlohmann::json j;
    j["step"] = c_.steps - 1;
    j["emulate_ranks"] = flags_.ranks;
    j["outlier"] = flags_.outlier;
    j["recipes"] = split_words(flags_.recipes);
    j["config"] = {{"hidden", c_.hidden}, {"heads", c_.heads},   {"kv_heads", c_.kv_heads},
                   {"ffn", c_.ffn},       {"layers", c_.layers}, {"seq", c_.seq},
                   {"batch", c_.batch},   {"vocab", c_.vocab},   {"steps", c_.steps},
                   {"seed", c_.seed},     {"lr", c_.lr}};
    j["gemms"] = std::move(gemms_);
    write_text_file(flags_.out, j.dump(1) + "\n");
  }

  baseline::SerialLinears inner_{DType::f32};
  BlockConfig c_;
  Flags flags_;
  I steps_done_ = 0;
  I forward_layer_ = 0, backward_layer_ = 0;
  std::uint64_t draws_ = 0;  // gradient operands drawn so far (gradient_draws)
  nlohmann::json gemms_ = nlohmann::json::array();
};

}  // namespace
}  // namespace tpx::recipe_error

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "recipe_gemm_error",
               .summary = "stage 01's language model, every low-precision recipe's GEMM error "
                          "against fp64 measured on the last step's operands",
               .single_device = true,
               .flag_groups = {recipe_error::Flags::make}},
      .make = [](const RunContext& ctx) -> std::unique_ptr<Parallelism> {
        return std::make_unique<recipe_error::Measured>(ctx);
      },
      .plan =
          [](const RunContext&) {
            return StagePlan{.sharding = {}, .traffic = {}, .comm = "none (one device)"};
          },
      .reference = baseline::run_reference,
  };
  return run_stage(stage, argc, argv);
}
