// Stage 10, expert parallelism: the mixture of experts (common/moe.h) in place of the SwiGLU of
// every --moe-every-th layer, its E routed experts spread over EP ranks, the tokens moved to
// their experts and back by all-to-alls (common/moe_ep.h). The rest of the block runs as stage 07
// does, on its D × T mesh (FSDP over D, TP with sequence parallelism inside each replica). EP
// borrows its ranks from the data-parallel ones, as TorchTitan's expert parallelism does, and TP
// cuts every expert's width, as Megatron-LM's expert tensor parallelism does:
//
//   EP groups    D / EP groups of EP consecutive replicas, one per TP index t: rank i of a group
//                holds experts [i·E/EP, (i+1)·E/EP), whole along H, columns [t·FE/T, (t+1)·FE/T)
//                of their width
//   FSDP         the G = D / EP holders of the same experts (and TP index) each keep 1/G of
//                them, packed and padded; all-gathered for a forward and for a backward, let go
//                after each
//   routing      the replica's S·B/D tokens gathered over TP (its ranks hold S/T positions each)
//                and routed alike on every TP rank, in sequence order (common/moe_model.h); the
//                capacity and the auxiliary loss count over all D replicas, so that the routing
//                and the drops are the same on every mesh
//   dispatch     the counts per (rank, expert), then every kept assignment's row to its expert's
//                rank (all_to_all_v over the EP group); combine the reverse; each TP rank's output
//                is its part of the width, summed and cut back to S/T positions by a
//                reduce-scatter over TP
//   gradients    the gate weights' summed over TP (moe_ep_backward); the router's and the shared
//                experts' summed over the D replicas; the experts' reduce-scattered over their
//                G holders
//   balance      the auxiliary loss, or the per-expert bias moved from the step's counts over
//                all D replicas (identical everywhere)
//   pipeline     --pp P: stage 09's pipeline with this on each pipeline stage's D × T ranks and
//                layers; each micro-batch of the D replicas is a routing group (its capacity and
//                auxiliary loss), each layer keeps a state per micro-batch, and the gradients are
//                reduced once, after the step's last
//   CP           --cp C: stage 08's context parallelism in stage 07's place, EP borrowed from the
//                D·C ranks (the token group is its DP×CP group), dropless only
//
// defines: tpx::ep::WithExperts, tpx::ep::ExpertParallel, tpx::ep::ExpertContextParallel,
//          tpx::ep::make_expert_parallel(),
//          tpx::ep::plan_expert_parallel()
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "07_fsdp_tp/layers.h"
#include "08_context_parallel/layers.h"
#include "common/mlp_branch.h"
#include "common/stage.h"
#include "common/trainer.h"

namespace tpx::ep {

class MoeLayers;  // layers.cc: every MoE layer's experts and the EP communicators

/// A stage's Parallelism (`Base`: stage 07's FSDP × TP, or stage 08's context parallelism
/// around it) with the MoE layers' experts beside it.
template <class Base>
class WithExperts final : public Base {
 public:
  /// `held`: the layers of the model this rank trains (all of them; a pipeline stage's).
  WithExperts(const RunContext& ctx, const Mesh& mesh, int ep, std::vector<std::int64_t> held);
  ~WithExperts() override;

  std::string comm_name() const override;
  /// The base's groups and the EP group (the placement's header says where each lands).
  std::vector<MeshGroup> mesh_groups() const override;
  /// The base's sharding, with the experts' dimension of the estimate (memory.h) after its own.
  Sharding sharding() const override;
  ExtraParameters* extra_parameters() override;
  CommStats take_comm_stats() override;
  /// The base's, and tokens_per_expert [MoE layers, E]: the first step's assignments chosen per
  /// expert (before drops), over all tokens.
  std::vector<std::pair<std::string, Tensor>> dump_extra() override;

 private:
  std::unique_ptr<MoeLayers> moe_;
  int dp_cp_index_;  // this rank's place among the D·C ranks, in token order
};

/// Stage 10 on D × T: stage 07 with the experts.
using ExpertParallel = WithExperts<fsdp::FsdpTp>;
/// Stage 10 on D × C × T (--cp C > 1): stage 08 with the experts, EP borrowed from the D·C ranks.
using ExpertContextParallel = WithExperts<cp::ContextParallel>;

/// Refuses what the stage cannot run (one line naming the flag, exit 2, before any rank
/// allocates), then builds it: ExpertParallel on a D × T mesh, or under --pp P > 1 stage 09's
/// pipeline of them. Collective.
std::unique_ptr<Parallelism> make_expert_parallel(const RunContext& ctx);
/// The training loop: train(), or stage 09's train_pipeline() when make_expert_parallel() made a
/// pipeline (--pp P > 1).
TrainResult train_expert_parallel(const BlockConfig& c, Parallelism& par, bool snapshot,
                                  Trace& trace, const std::function<void(const StepRow&)>& on_row);
/// --dry-run: the same refusals, stage 07's sharding of the dense parameters and the step's bytes
/// by chapter 10's formulas (traffic.h) under perfectly balanced routing.
StagePlan plan_expert_parallel(const RunContext& ctx);

}  // namespace tpx::ep
