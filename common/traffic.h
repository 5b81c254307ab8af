// The bytes each stage moves per rank and training step, from the config alone: the formulas of
// the chapters (0*/README.md), written once. The stages count their traffic as it happens
// (common/parallel.h's CommStats); these formulas equal those counts (tests/test_projection.cc,
// tests/test_dry_run.cc) and are what --dry-run and the projection (tools/projection.h) report.
// Pure arithmetic: no MPI, no device, nothing allocated.
//
// defines: tpx::Traffic, tpx::activation_bytes(), tpx::comm_bytes(),
//          tpx::layer_params_per_tp_rank(), tpx::fsdp_bytes(), tpx::fsdp_traffic(),
//          tpx::cp_traffic(), tpx::MeshTraffic, tpx::mesh_traffic()
#pragma once

#include <cstdint>

#include "config.h"
#include "model.h"

namespace tpx {

/// Communication of one step on one rank, counted as the stages count it (nccl-tests' bus bytes).
struct Traffic {
  std::uint64_t payload = 0, bus = 0, calls = 0;
  Traffic& operator+=(const Traffic& o) {
    payload += o.payload;
    bus += o.bus;
    calls += o.calls;
    return *this;
  }
};

/// Bytes per element of the activations `stage` stores and communicates under `c`: 2 under the
/// mixed-precision recipe (--dtype bf16, and stage 06's FP8, which runs inside it), else 4.
int activation_bytes(int stage, const BlockConfig& c);

/// The bytes per rank and step of `stage` (1 … 6) at N ranks. `act_bytes`: bytes per element of
/// the communicated activations (0: activation_bytes(stage, c), what the stage counts). Stage 06
/// gathers 1-byte codes and all-reduces fp32 amaxes; weight-gradient reductions (the norm gains'
/// all-reduce) are fp32 in every recipe. Throws std::runtime_error for a stage outside 1 … 6.
Traffic comm_bytes(int stage, const BlockConfig& c, int n, int act_bytes = 0);

/// Parameters of one layer on one TP rank: its TP shard of the seven matrices plus the two norm
/// gains (replicated over TP).
double layer_params_per_tp_rank(const BlockConfig& c, int tp);

/// FSDP's bus bytes per rank and step over DP (stage 07), the chapter's approximation: per layer
/// two all-gathers of the layer's `gather_bytes`-per-element copy and one fp32 reduce-scatter of
/// its gradients, `L · (2·e + 4) · P_l · (D−1)/D` (padding to a multiple of D left out).
double fsdp_bytes(const BlockConfig& c, int tp, int dp, int gather_bytes);

/// Stage 07's DP traffic per rank and step exactly as it counts it: per layer two all-gathers of
/// one rank's packed part (each TP-local parameter's dim-0 shard of ⌈rows/D⌉ rows, the matrices
/// as bf16 compute copies under --dtype bf16, the norm gains fp32, each at a multiple of its
/// element size) and one fp32 reduce-scatter of the layer's padded flat gradient [D · numel].
/// With `microbatches` M (stage 09's pipeline) each layer is gathered for every micro-batch's
/// forward and backward, 2M times, and its gradients reduce-scattered once.
Traffic fsdp_traffic(const BlockConfig& c, int tp, int dp, int microbatches = 1);

/// Stage 08's traffic over the CP group (C ranks) per rank and step, chapter 8's formulas, with
/// kv = S/C · B/D · NKV/T · Dh and q = S/C · B/D · NH/T · Dh elements of e activation bytes
/// (K/V at their GQA size, 2 bytes under bf16) and g = 4 bytes of the dK/dV partial sums, which
/// stay fp32 until they are complete (the ring's and the reduce-scatter's; Ulysses moves whole
/// gradients, at e), per layer:
///   ring       forward C−1 hops of K/V (2kv each); backward C−1 hops of K/V and C of dK/dV (one
///              more brings them home): payload = bus = (C−1)·2kv·e + (C−1)·2kv·e + C·2kv·g
///   allgather  forward one all-gather of K/V, bus (C−1)·2kv·e of a C·2kv·e payload; backward the
///              gather again and a reduce-scatter of dK/dV, bus (C−1)·2kv·g
///   ulysses    every all-to-all (C−1 pairwise steps) moves (C−1)/C of its tensor: forward q, k,
///              v there and the output back, (C−1)/C·(2q + 2kv)·e; backward q, k, v, the output
///              and dO there, dq, dk, dv back, (C−1)/C·(4q + 4kv)·e
/// A layer recomputed under --recompute full runs its forward's share again. Zero at C = 1.
Traffic cp_traffic(const BlockConfig& c, int dp, int cp, int tp, CpMethod method);

/// A step's traffic on a D × C × T mesh, per group, as stage 08 counts it (stage 07 at C = 1):
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

}  // namespace tpx
