#include "generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "block.h"
#include "check.h"
#include "data.h"
#include "init.h"
#include "lm.h"
#include "model.h"
#include "ops.h"
#include "token_file.h"
#include "tokenizer.h"

namespace tpx {
namespace {

/// The whole model on one device, forward only: y = x·W, nothing to communicate. (Training's
/// backward never runs here.)
class ForwardOnly final : public Parallelism {
 public:
  Sharding sharding() const override { return {}; }
  ColumnResult column_forward(const Tensor& h, std::span<const Tensor> w,
                              std::string_view /*role*/) override {
    ColumnResult r{.y = {}, .saved = h};
    for (const Tensor& wi : w) r.y.push_back(row_forward(h, wi, {}));
    return r;
  }
  Tensor column_backward(const Tensor&, std::span<const Tensor>, std::span<const Tensor>,
                         std::span<const Tensor>, std::string_view) override {
    TPX_CHECK(false, "generation runs no backward");
    return {};
  }
  Tensor row_forward(const Tensor& a, const Tensor& w, std::string_view /*role*/) override {
    Tensor y = linear_output(a, w);
    ops::gemm(a, false, w, false, y, 1.0f, 0.0f, DType::f32);
    return y;
  }
  Tensor row_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      std::string_view) override {
    TPX_CHECK(false, "generation runs no backward");
    return {};
  }
};

Tensor host_tensor(std::vector<std::int64_t> shape, const std::vector<float>& values) {
  Tensor t = Tensor::empty(std::move(shape));
  TPX_CHECK(std::size_t(t.numel()) == values.size(), "{} values for {}", values.size(),
            t.describe());
  std::copy(values.begin(), values.end(), t.f32().begin());
  return t;
}

}  // namespace

std::string tokenizer_path_for(const std::string& token_file) {
  constexpr std::string_view ext = ".tokens";
  std::string stem = token_file;
  if (stem.ends_with(ext)) stem.resize(stem.size() - ext.size());
  return stem + ".tokenizer.json";
}

std::optional<std::string> check_generation(const BlockConfig& c) {
  const GenerateOptions& g = c.generate;
  if (g.tokens < 0) return fmt::format("--generate must be >= 0 (got {}; 0: none)", g.tokens);
  if (g.temperature < 0 || !std::isfinite(g.temperature))
    return fmt::format(
        "--temperature must be a finite number >= 0 (got {}; 0: the most likely "
        "token)",
        g.temperature);
  if (g.top_k < 0) return fmt::format("--top-k must be >= 0 (got {}; 0: every token)", g.top_k);
  if (g.tokens == 0) return std::nullopt;
  if (!c.lm()) return "--generate needs --task lm (the blocks alone make no text)";
  if (c.data == kSyntheticData)
    return "--generate needs a token file's --data (--data synthetic has no tokenizer to decode "
           "with)";
  const std::string path = tokenizer_path_for(c.data);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    return fmt::format(
        "--generate: no tokenizer '{}' beside token file '{}' (<name>.tokens is "
        "decoded with <name>.tokenizer.json)",
        path, c.data);
  try {
    const Tokenizer tok = Tokenizer::load(path);
    const std::int64_t file_vocab = token_file_vocab(c.data);
    if (tok.vocab() != file_vocab)
      return fmt::format("--generate: tokenizer '{}' has vocab {} but token file '{}' has {}", path,
                         tok.vocab(), c.data, file_vocab);
    if (tok.encode(g.prompt).empty()) return "--prompt: empty (generation continues a text)";
  } catch (const ConfigError& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

std::int32_t next_token(std::span<const float> logits, const GenerateOptions& g, std::uint64_t seed,
                        std::int64_t index) {
  TPX_CHECK(!logits.empty(), "no logits");
  std::vector<std::int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  // Most likely first, the smaller id first on a tie: greedy takes the front.
  auto likelier = [&](std::int32_t a, std::int32_t b) {
    return logits[std::size_t(a)] > logits[std::size_t(b)] ||
           (logits[std::size_t(a)] == logits[std::size_t(b)] && a < b);
  };
  if (g.temperature == 0) return *std::min_element(ids.begin(), ids.end(), likelier);
  std::size_t keep = ids.size();
  if (g.top_k > 0) keep = std::min(keep, std::size_t(g.top_k));
  std::partial_sort(ids.begin(), ids.begin() + std::ptrdiff_t(keep), ids.end(), likelier);
  ids.resize(keep);
  // softmax(logits / T) over the kept ids, in double, then the draw's place in its cumulative sum.
  const double top = logits[std::size_t(ids.front())];
  std::vector<double> p(keep);
  double sum = 0;
  for (std::size_t i = 0; i < keep; ++i)
    sum += p[i] = std::exp((double(logits[std::size_t(ids[i])]) - top) / g.temperature);
  const double u =
      double(bits_at(seed, TensorId::sample, std::uint64_t(index)) >> 11) * 0x1.0p-53 * sum;
  double acc = 0;
  for (std::size_t i = 0; i < keep; ++i)
    if ((acc += p[i]) > u) return ids[i];
  return ids[keep - 1];
}

std::vector<std::int32_t> generate(const BlockConfig& c, const Snapshot& trained,
                                   std::span<const std::int32_t> prompt) {
  TPX_CHECK(!prompt.empty(), "an empty prompt");
  TPX_CHECK(trained.params.size() == std::size_t(c.layers), "{} layers trained, {} configured",
            trained.params.size(), c.layers);
  BlockConfig one = c;  // one device, fp32, one sequence
  one.batch = 1;
  one.dtype = DType::f32;
  one.device = Device::cpu;
  one.recompute = Recompute::none;
  std::vector<LayerParams> layers(std::size_t(c.layers));
  for (std::size_t l = 0; l < layers.size(); ++l)
    for (Param p : kAllParams)
      layers[l][p] = host_tensor(param_shape(p, c), trained.params[l][std::size_t(p)]);
  const LmParams lm{.embedding = host_tensor({c.vocab, c.hidden}, trained.lm_params[0]),
                    .norm_f = host_tensor({c.hidden}, trained.lm_params[1]),
                    .w_out = host_tensor({c.hidden, c.vocab}, trained.lm_params[2])};
  ForwardOnly par;
  std::vector<std::int32_t> text(prompt.begin(), prompt.end()), out;
  for (std::int64_t i = 0; i < c.generate.tokens; ++i) {
    // The last ≤ S ids, as one sequence of batch 1.
    const std::int64_t n = std::min<std::int64_t>(std::int64_t(text.size()), c.seq);
    one.seq = n;
    Tensor tokens = Tensor::empty({n, 1}, DType::i32);
    std::copy(text.end() - n, text.end(), tokens.data<std::int32_t>());
    Tensor targets = Tensor::empty({n, 1}, DType::i32);  // unused: the loss is not wanted
    std::fill_n(targets.data<std::int32_t>(), n, 0);
    Tensor y = lm::embed(one, par, lm.embedding, tokens, Trace::off());
    BlockActivations acts;
    for (const LayerParams& w : layers) y = block_forward(one, w, y, par, acts, Trace::off());
    lm::HeadActivations head;
    lm::head_forward(one, par, lm, y, targets, head, Trace::off());
    const std::span<const float> last =
        head.logits.f32().subspan(std::size_t((n - 1) * c.vocab), std::size_t(c.vocab));
    const std::int32_t next = next_token(last, c.generate, c.seed, i);
    text.push_back(next);
    out.push_back(next);
  }
  return out;
}

}  // namespace tpx
