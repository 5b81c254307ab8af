#include "moe_flags.h"

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "cli_flags.h"

namespace tpx {
namespace {

constexpr const char* kGroup = "Experts";

}  // namespace

MoeRouter MoeFlags::router() const {
  return router_word == "sigmoid" ? MoeRouter::sigmoid : MoeRouter::softmax;
}

MoeBalance MoeFlags::balance() const {
  return balance_word == "bias" ? MoeBalance::bias : MoeBalance::aux;
}

double MoeFlags::aux_weight() const {
  if (aux_loss_weight) return *aux_loss_weight;
  return balance() == MoeBalance::aux ? kMoeAuxLossWeight : 0.0;
}

std::int64_t MoeFlags::expert_width(const BlockConfig& c) const {
  return expert_ffn > 0 ? expert_ffn : c.ffn;
}

bool MoeFlags::moe_layer(std::int64_t layer) const {
  return layer % moe_every == 0;
}

MoeShape MoeFlags::shape(const BlockConfig& c, std::int64_t tokens) const {
  MoeShape m;
  m.tokens = tokens;
  m.hidden = c.hidden;
  m.experts = experts;
  m.topk = topk;
  m.expert_ffn = expert_width(c);
  m.shared_ffn = shared_experts * m.expert_ffn;
  m.router = router();
  m.capacity_factor = capacity_factor;
  m.aux_loss_weight = aux_weight();
  return m;
}

void MoeFlags::add_flags(CLI::App& app, MeshFlag /*newest*/) {
  add_count(app, "--experts", experts, "E, routed experts in each MoE layer", "8")
      ->type_name("E")
      ->group(kGroup);
  add_count(app, "--topk", topk, "K, experts each token is routed to (1 … E)", "2")
      ->type_name("K")
      ->group(kGroup);
  add_count(app, "--expert-ffn", expert_ffn,
            "FE, the SwiGLU inner size of every routed and shared expert; when not given, --ffn",
            "--ffn")
      ->type_name("FE")
      ->group(kGroup);
  app.add_option_function<std::string>(
         "--shared-experts",
         [this](const std::string& s) {
           const int value = parse_number<int>("--shared-experts", s);
           if (value < 0)
             throw CLI::ValidationError(
                 fmt::format("--shared-experts '{}': must be 0 (none) or a positive number", s));
           shared_experts = value;
         },
         "NS, shared experts of width FE that every token passes through besides its K")
      ->default_str("0")
      ->type_name("NS")
      ->group(kGroup);
  add_count(app, "--moe-every", moe_every,
            "N: layer l's MLP is the mixture of experts when l % N == 0, the others stay dense",
            "1, every layer")
      ->type_name("N")
      ->group(kGroup);
  app.add_option("--router", router_word,
                 "softmax (Mixtral: softmax over E, top K, the K probabilities renormalised) or "
                 "sigmoid (DeepSeek-V3: sigmoid scores, top K, renormalised); ties go to the "
                 "lower expert index")
      ->check(CLI::IsMember({"softmax", "sigmoid"}))
      ->capture_default_str()
      ->group(kGroup);
  app.add_option_function<std::string>(
         "--capacity-factor",
         [this](const std::string& s) {
           const double value = parse_number<double>("--capacity-factor", s);
           if (!(value >= 0.0) || !std::isfinite(value))  // NaN and inf too
             throw CLI::ValidationError(fmt::format(
                 "--capacity-factor '{}': must be 0 (dropless) or a positive number", s));
           capacity_factor = value;
         },
         "C: each expert serves at most ceil(C·T·K/E) of a step's T tokens, in token order, and "
         "drops the rest; 0, dropless (every token served)")
      ->default_str("0")
      ->type_name("C")
      ->group(kGroup);
  app.add_option_function<std::string>(
         "--aux-loss-weight",
         [this](const std::string& s) {
           const double value = parse_number<double>("--aux-loss-weight", s);
           if (!(value >= 0.0) || !std::isfinite(value))
             throw CLI::ValidationError(fmt::format(
                 "--aux-loss-weight '{}': must be 0 (no auxiliary loss) or positive", s));
           aux_loss_weight = value;
         },
         fmt::format("W of the auxiliary balance loss W·E·Σ f_e·P_e; when not given, {} under "
                     "--balance aux and 0 under --balance bias",
                     kMoeAuxLossWeight))
      ->type_name("W")
      ->group(kGroup);
  app.add_option("--balance", balance_word,
                 fmt::format("aux (the auxiliary loss) or bias (DeepSeek-V3's per-expert bias on "
                             "the routing scores, moved by {} toward the mean count after each "
                             "step; not a gradient)",
                             kMoeBiasRate))
      ->check(CLI::IsMember({"aux", "bias"}))
      ->capture_default_str()
      ->group(kGroup);
  add_count(app, "--moe-chunks", chunks,
            "C: each MoE layer cuts its tokens into C chunks, and dispatches chunk c+1 and "
            "combines chunk c-1 on the EP lane while the experts run on chunk c (the overlap "
            "of the all-to-alls with the experts; the same results, C times the calls)",
            "1, no overlap")
      ->type_name("C")
      ->group(kGroup);
  add_count(app, "--ep", ep,
            "EP, the expert-parallel degree: each EP rank holds E/EP whole experts",
            "every data-parallel rank")
      ->type_name("EP")
      ->group("Mesh");
}

std::optional<std::string> moe_ep_problem(std::int64_t experts, std::int64_t ep) {
  if (ep >= 1 && experts % ep == 0) return std::nullopt;
  return fmt::format(
      "--experts ({}) must be divisible by --ep ({}): each EP rank holds E/EP whole experts",
      experts, ep);
}

MoeSkew moe_skew_from_env() {
  const char* text = std::getenv(kMoeSkewVariable);
  if (text == nullptr) return {};
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  // Finite as the stage's float bias holds it, not only as a double.
  if (*text == '\0' || *end != '\0' || !std::isfinite(float(value)))
    return {.value = 0.0,
            .problem = fmt::format("{}='{}': must be a finite number (expert 0's starting bias)",
                                   kMoeSkewVariable, text)};
  return {.value = value, .problem = std::nullopt};
}

std::optional<std::string> MoeFlags::check(const CLI::App& /*app*/,
                                           const StageOptions& /*o*/) const {
  if (auto skew = moe_skew_from_env(); skew.problem) return skew.problem;
  if (topk > experts)
    return fmt::format(
        "--topk ({}) must be at most --experts ({}): each token is routed to K "
        "different experts",
        topk, experts);
  if (ep == 0) return std::nullopt;  // not given: the stage's data-parallel ranks (checked there)
  return moe_ep_problem(experts, ep);
}

bool MoeFlags::take_experts(const PresetExperts& moe, const CLI::App& app) {
  auto unless_given = [&](const char* flag, auto& target, auto value) {
    if (app.count(flag) == 0) target = value;
  };
  unless_given("--experts", experts, int(moe.experts));
  unless_given("--topk", topk, int(moe.topk));
  unless_given("--expert-ffn", expert_ffn, int(moe.expert_ffn));
  unless_given("--shared-experts", shared_experts, int(moe.shared));
  unless_given("--moe-every", moe_every, int(moe.every));
  unless_given("--router", router_word, std::string(moe.sigmoid ? "sigmoid" : "softmax"));
  unless_given("--balance", balance_word, std::string(moe.bias ? "bias" : "aux"));
  return true;
}

MoeFlags MoeFlags::of(const PresetExperts& moe) {
  MoeFlags f;
  f.experts = int(moe.experts);
  f.topk = int(moe.topk);
  f.expert_ffn = int(moe.expert_ffn);
  f.shared_experts = int(moe.shared);
  f.moe_every = int(moe.every);
  f.router_word = moe.sigmoid ? "sigmoid" : "softmax";
  f.balance_word = moe.bias ? "bias" : "aux";
  return f;
}

void MoeFlags::configure(BlockConfig& c) const {
  const MoeShape m = shape(c, 0);
  c.moe = {.experts = m.experts,
           .topk = m.topk,
           .expert_ffn = m.expert_ffn,
           .shared_ffn = m.shared_ffn,
           .every = moe_every,
           .router = m.router,
           .capacity_factor = m.capacity_factor,
           .aux_loss_weight = m.aux_loss_weight,
           .bias_rate = balance() == MoeBalance::bias ? kMoeBiasRate : 0.0,
           .skew = moe_skew_from_env().value,
           .chunks = chunks};
}

ConfigFields MoeFlags::agreed() const {
  return {{"--experts", fmt::format("{}", experts)},
          {"--topk", fmt::format("{}", topk)},
          {"--expert-ffn", fmt::format("{}", expert_ffn)},
          {"--shared-experts", fmt::format("{}", shared_experts)},
          {"--moe-every", fmt::format("{}", moe_every)},
          {"--router", router_word},
          {"--capacity-factor", fmt::format("{}", capacity_factor)},
          {"--aux-loss-weight", fmt::format("{}", aux_weight())},
          {"--balance", balance_word},
          {"--ep", fmt::format("{}", ep)},
          {"--moe-chunks", fmt::format("{}", chunks)},
          {kMoeSkewVariable, fmt::format("{}", moe_skew_from_env().value)}};
}

}  // namespace tpx
