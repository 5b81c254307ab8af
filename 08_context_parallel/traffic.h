// Stage 08's methods of reaching the other CP ranks' keys, and its bytes per rank and step,
// chapter 8's formulas, with the whole D × C × T mesh's (common/traffic.h has what the stages'
// formulas share).
//
// defines: tpx::cp::CpMethod, tpx::cp::to_string(), tpx::cp::method_of(), tpx::cp::cp_traffic(),
//          tpx::cp::MeshTraffic, tpx::cp::mesh_traffic()
#pragma once

#include <string_view>

#include "common/config.h"
#include "common/traffic.h"

namespace tpx::cp {

/// How attention reaches the keys of the other CP ranks (--cp-method).
enum class CpMethod {
  ring,       ///< K/V blocks passed around the CP ring, merged by log-sum-exp
  allgather,  ///< K and V all-gathered over CP; dK, dV reduce-scattered
  ulysses,    ///< all-to-all to head-sharded full-sequence q, k, v and back (DeepSpeed Ulysses)
};
const char* to_string(CpMethod m);  ///< "ring", "allgather", "ulysses"
/// The method to_string() names ("allgather", "ulysses"; anything else, "ring": the flags check
/// the word first).
CpMethod method_of(std::string_view word);

/// The traffic over the CP group (C ranks) per rank and step, with kv = S/C · B/D · NKV/T · Dh
/// and q = S/C · B/D · NH/T · Dh elements of e activation bytes (K/V at their GQA size, 2 bytes
/// under bf16) and g = 4 bytes of the dK/dV partial sums, which stay fp32 until they are complete
/// (the ring's and the reduce-scatter's; Ulysses moves whole gradients, at e), per layer:
///   ring       forward C−1 hops of K/V (2kv each); backward C−1 hops of K/V and C of dK/dV (one
///              more brings them home): payload = bus = (C−1)·2kv·e + (C−1)·2kv·e + C·2kv·g
///   allgather  forward one all-gather of K/V, bus (C−1)·2kv·e of a C·2kv·e payload; backward the
///              gather again and a reduce-scatter of dK/dV, bus (C−1)·2kv·g
///   ulysses    every all-to-all (C−1 pairwise steps) moves (C−1)/C of its tensor: forward q, k,
///              v there and the output back, (C−1)/C·(2q + 2kv)·e; backward q, k, v, the output
///              and dO there, dq, dk, dv back, (C−1)/C·(4q + 4kv)·e
/// A layer recomputed under --recompute full runs its forward's share again. Zero at C = 1.
Traffic cp_traffic(const BlockConfig& c, int dp, int cp, int tp, CpMethod method);

/// A step's traffic on a D × C × T mesh, per group, as the stage counts it (stage 07 at C = 1):
/// tp, stage 05's on the rank's S/C tokens of B/D sequences; cp, cp_traffic(); dp, FSDP over the
/// D·C ranks of the DP×CP group (fsdp_traffic(c, T, D·C): weights sharded over D·C ranks).
struct MeshTraffic {
  Traffic tp, cp, dp;
  Traffic total() const {
    Traffic t = tp;
    t += cp;
    t += dp;
    return t;
  }
};
MeshTraffic mesh_traffic(const BlockConfig& c, int dp, int cp, int tp,
                         CpMethod method = CpMethod::ring);

}  // namespace tpx::cp
