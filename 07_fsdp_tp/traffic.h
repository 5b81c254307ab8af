// Stage 07's bytes per rank and step over the DP group, chapter 7's formulas (common/traffic.h has
// what the stages' formulas share; the TP group's are stage 05's, 04_overlap_ring/traffic.h).
//
// defines: tpx::fsdp::fsdp_bytes(), tpx::fsdp::fsdp_traffic()
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/traffic.h"

namespace tpx::fsdp {

/// FSDP's bus bytes per rank and step over DP, the chapter's approximation: per layer two
/// all-gathers of the layer's `gather_bytes`-per-element copy and one fp32 reduce-scatter of its
/// gradients, `L · (2·e + 4) · P_l · (D−1)/D` (padding to a multiple of D left out).
double fsdp_bytes(const BlockConfig& c, int tp, int dp, int gather_bytes);

/// The DP traffic per rank and step exactly as the stage counts it: per layer two all-gathers of
/// one rank's packed part (each TP-local parameter's dim-0 shard of ⌈rows/D⌉ rows, the matrices
/// as bf16 compute copies under --dtype bf16, the norm gains fp32, each at a multiple of its
/// element size) and one fp32 reduce-scatter of the layer's padded flat gradient [D · numel].
/// With `microbatches` M (stage 09's pipeline) each layer is gathered for every micro-batch's
/// forward and backward, 2M times, and its gradients reduce-scattered once. With `fp8_gather`
/// (--fp8-weight-gather) the seven weight matrices travel as 1-byte E4M3 codes, and each gather
/// is preceded by one MAX all-reduce of their seven fp32 amaxes over the T·D ranks of the mesh
/// (payload 28, bus ⌊28·2(TD−1)/TD⌋); the last `keep_last` layers (--fp8-keep-last), which run
/// no recipe, are gathered as stored (fp32) with no amax. At D = 1 nothing is sharded and
/// nothing moves.
Traffic fsdp_traffic(const BlockConfig& c, int tp, int dp, int microbatches = 1,
                     bool fp8_gather = false, std::int64_t keep_last = 0);

}  // namespace tpx::fsdp
