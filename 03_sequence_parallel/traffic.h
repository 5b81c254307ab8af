// Stage 03's bytes per rank and step, chapter 3's formula (common/traffic.h has what the stages'
// formulas share).
//
// defines: tpx::sp::gain_all_reduces(), tpx::sp::traffic()
#pragma once

#include "common/config.h"
#include "common/traffic.h"

namespace tpx::sp {

/// The two fp32 all-reduces of the norm gains' gradients [H] per layer, which sequence
/// parallelism adds (stages 03 to 09): payload 8H, bus 2·⌊4H·2(N−1)/N⌋, calls 2.
Traffic gain_all_reduces(const BlockConfig& c, int n);

/// Per rank and step at N ranks, L layers, P = S·B·H·e (e = `act_bytes`, 0:
/// activation_bytes(c)): ten all-gathers / reduce-scatters of the full P per layer (forward
/// 2 + 2; backward the 2 dY gathers, the 2 re-gathers of the kept inputs and 2 reduce-scatters),
/// bus P·(N−1)/N each, and the gains' all-reduces:
///   payload 10P + 8H, bus 10·P(N−1)/N + 2·⌊4H·2(N−1)/N⌋, calls 12
/// A layer recomputed under --recompute full moves its forward's four once more.
Traffic traffic(const BlockConfig& c, int n, int act_bytes = 0);

}  // namespace tpx::sp
