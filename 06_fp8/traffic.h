// Stage 06's bytes per rank and step, chapter 6's formula (common/traffic.h has what the stages'
// formulas share).
//
// defines: tpx::async_fp8::Fp8Weights, tpx::async_fp8::traffic(), tpx::async_fp8::recipe_traffic()
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/lowp.h"
#include "common/traffic.h"

namespace tpx::async_fp8 {

/// Where a weight's FP8 copy comes from in backward (tensorwise; the other recipes quantize
/// the weights again for dgrad along the other dimension anyway). `kept`: the forward's, found
/// by the weight's address, for a stage whose weights stay in one place through the step (stage
/// 06). `requantized`: quantized again from the weight backward is given, its amax agreed in the
/// same MAX all-reduce as the gradient's, for a stage that gathers each layer again for its
/// backward into another buffer (stage 07's FSDP; an address may then be another layer's): the
/// same values under the same agreed scale give the forward's codes again. `gathered`: the
/// weights arrive as FP8 codes with their scale, agreed over every rank that holds a part of the
/// weight (stage 07's --fp8-weight-gather), in forward and in backward: used as they are, no amax
/// of theirs in any all-reduce here.
enum class Fp8Weights { kept, requantized, gathered };

/// Per rank and step at N ranks, L layers, a shard of S·B·H / N elements: stage 05's ring, the
/// six gathers per layer moving 1-byte FP8 codes and the four reduce-scatters e bytes (e =
/// `act_bytes`, 0: 2, the recipe's bf16), stage 03's all-reduces of the norm gains, and eight
/// MAX all-reduces of k fp32 amaxes per layer, k ∈ {4,2,3,2,3,2,2,2}: payload 4k, bus
/// ⌊4k·2(N−1)/N⌋ each. A layer recomputed under --recompute full moves its forward's two FP8
/// gathers, two reduce-scatters and four amax all-reduces (k ∈ {4,2,3,2}) once more.
Traffic traffic(const BlockConfig& c, int n, int act_bytes = 0);
/// The same under --fp8-recipe `recipe`: tensorwise is traffic(); under rowwise, block128 or
/// mxfp8 (06_fp8/layers.h) there is no amax all-reduce, and each of the six gathers moves, beside
/// its codes, its chunk's scales in a ring of its own: S·B/N rows of 1 (rowwise) or ⌈H/128⌉
/// (block128) fp32 scales, 4 bytes each, or ⌈H/32⌉ (mxfp8) E8M0 scales, 1 byte each. Under
/// tensorwise with the weights requantized for backward (Fp8Weights, stage 07) each backward
/// all-reduce carries its group's weights' amaxes too: k ∈ {4,2,3,2,6,3,4,3}; with the weights
/// gathered as FP8 none does: k ∈ {1,1,1,1,3,2,2,2}. Under nvfp4 the eight all-reduces agree the
/// tensor scales, k ∈ {4,2,3,2,10,3,7,3}, and each gather moves its codes packed (S·B·H / 2N
/// bytes) and ⌈H/16⌉ UE4M3 scale bytes per row.
/// With `keep_last` K (--fp8-keep-last) the last K layers run no recipe: each moves stage 05's
/// bytes at e (04_overlap_ring/traffic.h: ten primitives of N − 1 transfers of S·B·H·e / N, the
/// gains' all-reduces, no amax), and a recomputed one its four forward primitives once more; the
/// other L − K layers move the recipe's.
Traffic recipe_traffic(const BlockConfig& c, int n, int act_bytes, lowp::Recipe recipe,
                       Fp8Weights weights = Fp8Weights::kept, std::int64_t keep_last = 0);

}  // namespace tpx::async_fp8
