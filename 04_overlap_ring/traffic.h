// Stage 04's bytes per rank and step, chapter 4's formula, which stage 05's copy-engine pulls
// move too (common/traffic.h has what the stages' formulas share).
//
// defines: tpx::ring::traffic()
#pragma once

#include "common/config.h"
#include "common/traffic.h"

namespace tpx::ring {

/// Per rank and step at N ranks, L layers, P = S·B·H·e (e = `act_bytes`, 0:
/// activation_bytes(c)): each of stage 03's ten primitives per layer is N−1 ring transfers of
/// one P/N chunk (a send counts what it sends; stage 05 counts the bytes pulled), plus stage
/// 03's all-reduces of the norm gains:
///   payload = bus = 10(N−1)·P/N (+ the gains'), calls 10(N−1) + 2
/// A layer recomputed under --recompute full moves its forward's four primitives once more.
Traffic traffic(const BlockConfig& c, int n, int act_bytes = 0);

}  // namespace tpx::ring
