// Stage 10's bytes per rank and step, chapter 10's formulas: the experts' all-to-alls over the EP
// group, their counts and gradients over the data-parallel ranks, their tokens gathered and their
// outputs summed over the TP group; and the dense layers' (stage 07's, less the SwiGLU a MoE layer
// does not have). Pure arithmetic (common/traffic.h).
//
// defines: tpx::ep::moe_layers(), tpx::ep::cp_token_order(), tpx::ep::balanced_kept_rows(),
//          tpx::ep::ExpertLayerTraffic, tpx::ep::expert_layer_traffic(), tpx::ep::ExpertTraffic,
//          tpx::ep::expert_traffic(), tpx::ep::pipeline_plan_with_experts()
#pragma once

#include <cstdint>
#include <vector>

#include "08_context_parallel/traffic.h"
#include "common/config.h"
#include "common/mesh.h"
#include "common/moe_ep.h"
#include "common/stage.h"
#include "common/traffic.h"

namespace tpx::ep {

/// How many of the L layers are MoE layers: ⌈L / N⌉ for --moe-every N.
std::int64_t moe_layers(const BlockConfig& c);

/// Where the tokens of the D·C ranks of a token group (rank q = d·C + c, b sequences each) lie in
/// the capacity's order (common/moe_ep.h): whole sequences in rank order at C = 1 (the default
/// order); under context parallelism 2b runs a rank, sequence j's chunk c then its chunk
/// 2C − 1 − c (stage 08's cut), run p of rank q at place (d·b + p/2)·2C + its chunk's index.
MoeTokenOrder cp_token_order(int dp, int cp, std::int64_t b);

/// n_{s→d} of the EP group `group` (token-group ranks group·EP … group·EP + EP − 1 of the D·C)
/// when the routing is perfectly balanced (what --dry-run assumes): each of a rank's
/// n = S·B/(D·C) tokens chooses K experts, m = n·K/E assignments to every expert (which must
/// divide), and an expert keeps at most c = ⌈C_f·S·B·K/E⌉ of the step's in token order (all
/// dropless), so a run of L tokens placed after o others keeps clamp(c − o·K/E, 0, L·K/E)
/// (replica q at C = 1: clamp(c − q·m, 0, m)).
std::vector<std::vector<std::uint64_t>> balanced_kept_rows(const BlockConfig& c, int dp, int ep,
                                                           int group, int cp = 1);

/// One MoE layer on one rank (dp_cp_index, any TP index) under balanced routing, for one routing
/// group: `group` is the config with the group's sequences as its batch (all B, or a pipeline's
/// micro-batch of B/M over the D replicas), the token group the D·C ranks.
struct ExpertLayerTraffic {
  Traffic tp;       ///< per group: the TP gathers and sums of the tokens, and the gate weights'
  Traffic swiglu;   ///< per group: stage 05's five SwiGLU primitives the layer does not run
  Traffic ep;       ///< per group: dispatch and combine, forward and backward
  Traffic counts;   ///< per group: the counts' all_gather over the D replicas
  Traffic gathers;  ///< per group: FSDP's two all_gathers of the experts over their D/EP holders
  Traffic grads;    ///< per step: the router's and shared experts' all_reduce (over D), the
                    ///< experts' reduce_scatter (over their D/EP holders)
};
ExpertLayerTraffic expert_layer_traffic(const BlockConfig& group, int dp, int tp, int ep,
                                        int dp_cp_index, int cp = 1);

/// One rank's step, by the communicator's groups.
struct ExpertTraffic {
  Traffic tp;  ///< the TP group's: stage 05's for the dense parts, the experts' gathers and sums
  Traffic dp;  ///< the D·C ranks': FSDP's, the counts, the experts' gradients
  Traffic ep;  ///< the EP group's: dispatch and combine, forward and backward
  Traffic cp;  ///< the CP group's: stage 08's ring, all-gather or all-to-all
};

/// Rank (dp_cp_index, any TP index) of a D × C × T mesh with EP, per step, under balanced
/// routing. Per MoE layer, with n = S·B/(D·C), P = n·H·4 and G = D·C/EP (D for C at C = 1):
///   TP  forward: all_gather of the replica's tokens (P) and reduce_scatter of the output (P);
///       backward: the same two for dy and dx, and the all_reduce of the n·K gate-weight
///       gradients; in place of the SwiGLU's five ring primitives (stage 05's formula)
///   EP  moe_ep_traffic() of balanced_kept_rows() without its counts' all_gather
///   DP  that all_gather (over D), the router's [H, E] and the shared experts' three [H, SF/T]
///       gradient all_reduces (over D); the experts' FSDP over their G holders (none at G = 1):
///       their three [E/EP, H, FE/T] packed and padded to a multiple of G, all_gathered twice
///       and reduce_scattered once; FSDP's bytes of the dense parameters, a MoE layer's without
///       its SwiGLU.
///   CP  stage 08's (cp_traffic), which the experts do not change.
ExpertTraffic expert_traffic(const BlockConfig& c, int dp, int tp, int ep, int dp_cp_index,
                             int cp = 1, cp::CpMethod method = cp::CpMethod::ring);

/// Stage 09's plan of a pipeline rank (`p`: pp::pipeline_rank_plan(), its sharding's layers the
/// rank's) with each of its MoE layers' SwiGLU replaced by the experts once per micro-batch (a
/// routing group of B/M sequences over the D replicas: expert_layer_traffic()), their gradients
/// reduced once per step, and an "ep" group; rank (mesh.dp_index, mesh.cp_index) of the D·C.
StagePlan pipeline_plan_with_experts(StagePlan p, const BlockConfig& c, const Mesh& mesh, int ep,
                                     int microbatches);

}  // namespace tpx::ep
