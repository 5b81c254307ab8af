// Stage 02's bytes per rank and step, chapter 2's formula (common/traffic.h has what the stages'
// formulas share).
//
// defines: tpx::megatron::traffic()
#pragma once

#include "common/config.h"
#include "common/traffic.h"

namespace tpx::megatron {

/// Per rank and step at N ranks, L layers, P = S·B·H·e (one [S, B, H] activation, e =
/// `act_bytes`, 0: activation_bytes(c)): four all-reduces of P per layer (g after Wo and Wd in
/// forward, f before Wqkv and Wgu in backward):
///   payload 4P, bus 4·⌊P·2(N−1)/N⌋, calls 4
/// A layer recomputed under --recompute full moves its forward's two once more.
Traffic traffic(const BlockConfig& c, int n, int act_bytes = 0);

}  // namespace tpx::megatron
