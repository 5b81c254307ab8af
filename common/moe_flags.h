// The mixture-of-experts flags (DESIGN.md, "Experts (stage 10)") as a FlagGroup (cli.h) a stage
// names in StageInfo::flag_groups: --experts, --topk, --expert-ffn, --shared-experts,
// --moe-every, --router, --capacity-factor, --aux-loss-weight, --balance, --ep. Each value is
// checked on its own while parsing (a count is positive, a factor a positive number) and the
// combinations after it (k ≤ E, E divisible by EP): one line naming the flag and the rule, exit 2,
// before any rank allocates.
//
// defines: tpx::MoeBalance, tpx::kMoeAuxLossWeight, tpx::kMoeBiasRate, tpx::moe_ep_problem(),
//          tpx::kMoeSkewVariable, tpx::MoeSkew, tpx::moe_skew_from_env(), tpx::MoeFlags
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cli.h"
#include "config.h"
#include "moe.h"

namespace tpx {

/// --balance: the auxiliary loss (Switch/GShard) or the auxiliary-loss-free bias (DeepSeek-V3).
enum class MoeBalance { aux, bias };

/// The auxiliary loss weight W under --balance aux when --aux-loss-weight is not given (the
/// Switch Transformer's α).
inline constexpr double kMoeAuxLossWeight = 0.01;
/// The bias update rate u of --balance bias (DeepSeek-V3's γ for most of its training).
inline constexpr double kMoeBiasRate = 0.001;

/// The test hook TPX_MOE_SKEW (an environment variable, like TPX_NODE_ID for placement): where
/// expert 0's balancing bias starts in every MoE layer, so that tests route a skewed load on
/// purpose. Not set: 0. Set: a finite number, or the one-line refusal.
inline constexpr const char* kMoeSkewVariable = "TPX_MOE_SKEW";
struct MoeSkew {
  double value = 0.0;
  std::optional<std::string> problem;
};
MoeSkew moe_skew_from_env();

/// The "Experts" section of --help.
/// The rule --experts and --ep must meet (each EP rank holds E/EP whole experts): the refusal's
/// line, or nothing when E is a multiple of EP (EP ≥ 1).
std::optional<std::string> moe_ep_problem(std::int64_t experts, std::int64_t ep);

class MoeFlags : public FlagGroup {
 public:
  int experts = 8;         ///< --experts E, routed experts per MoE layer
  int topk = 2;            ///< --topk K, experts per token (1 … E)
  int expert_ffn = 0;      ///< --expert-ffn FE; 0: not given, --ffn
  int shared_experts = 0;  ///< --shared-experts NS, each of width FE, applied to every token
  int moe_every = 1;       ///< --moe-every N: layer l has experts when l % N == 0
  std::string router_word = "softmax";    ///< --router as given (CLI11 checks it is one of two)
  double capacity_factor = 0.0;           ///< --capacity-factor C; 0 (the default): dropless
  std::optional<double> aux_loss_weight;  ///< --aux-loss-weight W as given
  std::string balance_word = "aux";       ///< --balance as given
  /// --ep EP, the expert-parallel degree; 0 (not given): stage 10 spreads the experts over all
  /// of its data-parallel ranks
  int ep = 0;
  /// --moe-chunks C: each MoE layer's dispatch, experts and combine in C chunks of the tokens,
  /// chunk c + 1's all-to-all on the EP lane while the experts run on chunk c (MoeEpOverlap)
  int chunks = 1;

  MoeRouter router() const;
  MoeBalance balance() const;
  /// W: as given, else kMoeAuxLossWeight under --balance aux and 0 under --balance bias.
  double aux_weight() const;
  /// FE: --expert-ffn, or the dense MLP's --ffn when it is not given.
  std::int64_t expert_width(const BlockConfig& c) const;
  /// Whether layer l's MLP is the mixture of experts (Megatron-LM's moe_layer_freq: l % N == 0).
  bool moe_layer(std::int64_t layer) const;
  /// One MoE layer's shape over `tokens` tokens.
  MoeShape shape(const BlockConfig& c, std::int64_t tokens) const;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<MoeFlags>(); }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  /// A preset's experts for every flag of the group the command line did not give.
  bool take_experts(const PresetExperts& moe, const CLI::App& app) override;
  /// The flags as a preset's experts set them, none given (tpx_project's model).
  static MoeFlags of(const PresetExperts& moe);
  std::optional<std::string> check(const CLI::App& app, const StageOptions& o) const override;
  /// c.moe: every layer's MoE (as moe_layer() says) of shape(), and --balance bias's rate.
  void configure(BlockConfig& c) const override;
  ConfigFields agreed() const override;
};

}  // namespace tpx
