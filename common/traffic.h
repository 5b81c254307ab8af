// The bytes a stage moves per rank and training step, from the config alone: what the formulas of
// the chapters (0*/README.md) share. Each stage's own formula is in its folder (traffic.h: 02's
// all-reduces, 03's all-gathers and reduce-scatters, 04's ring (stage 05's pulls move the same),
// 06's FP8 gathers, 07's FSDP, 08's CP methods and the D × C × T mesh), all in the library
// tpx_formulas. The stages count their traffic as it happens (common/parallel.h's CommStats); the
// formulas equal those counts (tests/test_projection.cc, tests/test_dry_run.cc) and are what
// --dry-run and the projection (tools/projection.h, which lists them by stage) report.
// Pure arithmetic: no MPI, no device, nothing allocated; errors are std::runtime_error.
//
// defines: tpx::Traffic, tpx::require_formula(), tpx::per_step(), tpx::activation_bytes(),
//          tpx::stream_bytes(), tpx::TpLayout, tpx::lm_embedding_traffic(),
//          tpx::lm_head_traffic(), tpx::lm_traffic(), tpx::lm_grads_traffic(),
//          tpx::layer_params_per_tp_rank()
#pragma once

#include <cstdint>

#include "config.h"

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
  /// Takes away a part of this traffic (`o` no larger in any field).
  Traffic& operator-=(const Traffic& o) {
    payload -= o.payload;
    bus -= o.bus;
    calls -= o.calls;
    return *this;
  }
  /// The same traffic `k` times over (k micro-batches, k layers).
  friend Traffic operator*(Traffic t, std::uint64_t k) {
    return {t.payload * k, t.bus * k, t.calls * k};
  }
};

/// Throws std::runtime_error(`why`) unless `ok`: a formula's check of its arguments.
void require_formula(bool ok, const char* why);

/// A step of L layers from one layer's traffic `layer` and its forward's share `fwd`, which each
/// layer that --recompute full recomputes (--recompute-every) moves once more.
Traffic per_step(const BlockConfig& c, const Traffic& layer, const Traffic& fwd);

/// Bytes per element of the activations a stage stores and communicates under `c`: 2 under the
/// mixed-precision recipe (--dtype bf16, and stage 06's FP8, which runs inside it), else 4.
int activation_bytes(const BlockConfig& c);

/// P = S·B·H·e, the bytes of one [S, B, H] activation, e = `act_bytes` (0: activation_bytes(c)).
std::uint64_t stream_bytes(const BlockConfig& c, int act_bytes);

/// How a tensor-parallel stage moves activations between the residual stream and its
/// column-parallel regions: stage 02's all-reduces (f backward, g forward), stage 03's
/// all-gathers and reduce-scatters along S, stages 04-06's ring steps (or copy-engine pulls) for
/// the column-parallel gathers and scatters.
enum class TpLayout { all_reduce, sequence, ring };

/// The language model's embedding on a TP rank per step (--task lm; zero for --task block):
/// its g forward, an all-reduce of P = S·B·H·e (stage 02) or a reduce-scatter of P (from stage
/// 03), and, with sequence parallelism, g's backward, an all-gather of P. Plain collectives on
/// every layout (the lookup is no GEMM for a ring to hide).
Traffic lm_embedding_traffic(const BlockConfig& c, int n, int act_bytes, TpLayout layout);
/// The language model's head on a TP rank per step (zero for --task block): the output layer's
/// f (stage 02: backward all-reduce of P; sequence: forward all-gather, backward re-gather and
/// reduce-scatter of P; ring: those three as N − 1 ring steps of P/N each), the cross-entropy's
/// three fp32 all-reduces of S·B floats (MAX, SUM, SUM: 4·S·B bytes each) and, under sequence
/// parallelism, the final gain's gradient all-reduce (4H bytes).
Traffic lm_head_traffic(const BlockConfig& c, int n, int act_bytes, TpLayout layout);
/// Both (a stage that holds both ends).
Traffic lm_traffic(const BlockConfig& c, int n, int act_bytes, TpLayout layout);
/// Over a DP×CP group of G = `group` ranks (stages 07-09): the language model's ends this rank
/// holds, sharded by FSDP like every layer, each end one unit (one flat buffer): the embedding
/// E [V_p, H], and the head, the final gain [H] with W_out [H, V_p], V_p = ⌈V/T⌉ (V padded to a
/// multiple of T, over T). A TP-local tensor of r rows is split on dim 0 into G shards of ⌈r/G⌉
/// rows, so one rank's part of a unit, at the bytes the end computes with, is
///   embedding  a = ⌈V_p/G⌉·H·4                        (the lookup reads fp32 rows)
///   head       a = ⌈H/G⌉·4 + ⌈H/G⌉·V_p·e              (e: W_out's compute copy, 2 under bf16)
/// and its flat fp32 gradient shard n = ⌈V_p/G⌉·H, or ⌈H/G⌉·(1 + V_p), elements. Per step each
/// end is all-gathered before each use, once per micro-batch (M = `microbatches`, stage 09's;
/// the head's forward and backward share one gather), and its gradients reduce-scattered once:
///   payload = M·G·a + G·n·4,  bus = M·(G−1)·a + (G−1)·n·4,  calls = M + 1
/// (nccl-tests' bus bytes: (G−1)/G of the gathered or the reduced buffer). Zero at G = 1.
Traffic lm_grads_traffic(const BlockConfig& c, int tp, int group, bool embedding, bool head,
                         int microbatches = 1);

/// Parameters of one layer on one TP rank: its TP shard of the seven matrices plus the two norm
/// gains (replicated over TP).
double layer_params_per_tp_rank(const BlockConfig& c, int tp);

}  // namespace tpx
