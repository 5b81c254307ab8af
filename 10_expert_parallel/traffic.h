// Stage 10's bytes per rank and step, chapter 10's formulas: the experts' all-to-alls over the EP
// group, their counts and gradients over the data-parallel ranks, their tokens gathered and their
// outputs summed over the TP group; and the dense layers' (stage 07's, less the SwiGLU a MoE layer
// does not have). Pure arithmetic (common/traffic.h).
//
// defines: tpx::ep::moe_layers(), tpx::ep::balanced_kept_rows(), tpx::ep::ExpertLayerTraffic,
//          tpx::ep::expert_layer_traffic(), tpx::ep::ExpertTraffic, tpx::ep::expert_traffic()
#pragma once

#include <cstdint>
#include <vector>

#include "common/config.h"
#include "common/traffic.h"

namespace tpx::ep {

/// How many of the L layers are MoE layers: ⌈L / N⌉ for --moe-every N.
std::int64_t moe_layers(const BlockConfig& c);

/// n_{s→d} of the EP group `group` (replicas group·EP … group·EP + EP − 1) when the routing is
/// perfectly balanced (what --dry-run assumes): each of a replica's n = S·B/D tokens chooses K
/// experts, m = n·K/E assignments to every expert (which must divide), and an expert keeps at
/// most c = ⌈C·S·B·K/E⌉ of the step's in sequence order (c = S·B dropless), so replica q keeps
/// clamp(c − q·m, 0, m) of its m.
std::vector<std::vector<std::uint64_t>> balanced_kept_rows(const BlockConfig& c, int dp, int ep,
                                                           int group);

/// One MoE layer on one rank (dp_index, any TP index) under balanced routing, for one routing
/// group: `group` is the config with the group's sequences as its batch (all B, or a pipeline's
/// micro-batch of B/M over the D replicas).
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
                                        int dp_index);

/// One rank's step, by the communicator's groups.
struct ExpertTraffic {
  Traffic tp;  ///< the TP group's: stage 05's for the dense parts, the experts' gathers and sums
  Traffic dp;  ///< the data-parallel ranks': FSDP's, the counts, the experts' gradients
  Traffic ep;  ///< the EP group's: dispatch and combine, forward and backward
};

/// Rank (dp_index, any TP index) of a D × T mesh with EP, per step, under balanced routing. Per
/// MoE layer, with n = S·B/D, P = n·H·4 and G = D/EP:
///   TP  forward: all_gather of the replica's tokens (P) and reduce_scatter of the output (P);
///       backward: the same two for dy and dx, and the all_reduce of the n·K gate-weight
///       gradients; in place of the SwiGLU's five ring primitives (stage 05's formula)
///   EP  moe_ep_traffic() of balanced_kept_rows() without its counts' all_gather
///   DP  that all_gather (over D), the router's [H, E] and the shared experts' three [H, SF/T]
///       gradient all_reduces (over D); the experts' FSDP over their G holders (none at G = 1):
///       their three [E/EP, H, FE/T] packed and padded to a multiple of G, all_gathered twice
///       and reduce_scattered once; FSDP's bytes of the dense parameters, a MoE layer's without
///       its SwiGLU.
ExpertTraffic expert_traffic(const BlockConfig& c, int dp, int tp, int ep, int dp_index);

}  // namespace tpx::ep
