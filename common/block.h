// One transformer block, forward and backward by hand, written once for every stage.
//
//   h   = RMSNorm(x; g1)
//   q,k,v = h·Wq, h·Wk, h·Wv                 (column-parallel group; Wk, Wv: NKV heads, GQA)
//   q,k = RoPE(q), RoPE(k)                   (rotary embedding, unless --rope-theta 0)
//   a   = causal softmax(q kᵀ / sqrt(D)) v     (c.attention: fused or naive, common/ops.h)
//   x2  = x + a·Wo                           (row-parallel)
//   h2  = RMSNorm(x2; g2)
//   out = x2 + (silu(h2·Wg) ⊙ (h2·Wu))·Wd    (column-parallel group, then row-parallel)
//
// The linear layers go through the stage's Parallelism, so the same code is the single-device
// block, the Megatron block and the sequence-parallel block.
//
// defines: tpx::BlockActivations, tpx::block_forward(), tpx::block_refill(),
//          tpx::block_backward()
#pragma once

#include <cstddef>

#include "config.h"
#include "mlp_branch.h"
#include "model.h"
#include "parallel.h"
#include "tensor.h"
#include "trace.h"

namespace tpx {

/// What backward needs from forward, per layer. bytes() is the stage's saved-activation size.
struct BlockActivations {
  Tensor x;         ///< block input (RMSNorm 1 backward)
  Tensor rstd1;     ///< RMSNorm 1 statistics
  Tensor h_saved;   ///< input of the Wq/Wk/Wv group, as the stage keeps it
  Tensor q, k, v;   ///< attention inputs (q and k after the rotary embedding)
  Tensor probs;     ///< softmax probabilities [B, heads, S, S] (naive attention only)
  Tensor lse;       ///< log-sum-exp of each query row's scores [B, heads, S] (fused only)
  Tensor a;         ///< attention output, input of Wo
  Tensor x2;        ///< residual stream after attention (RMSNorm 2 backward)
  Tensor rstd2;     ///< RMSNorm 2 statistics
  Tensor h2_saved;  ///< input of the Wg/Wu group, as the stage keeps it
  Tensor gate, up;  ///< SwiGLU inputs
  Tensor s;         ///< SwiGLU output, input of Wd
  /// Selective recompute: the scales of h_saved and h2_saved when the stage keeps them as FP8
  /// (stage 06), so that they are made again exactly (4 bytes each, not counted in bytes()).
  Tensor h_scale, h2_scale;

  std::size_t bytes() const;  ///< sum of the saved tensors' sizes
  /// Releases everything but the block input x (full recompute keeps only that between the
  /// forward and the block's backward, where block_forward fills the rest again).
  void keep_only_input();
  /// Releases what the cheap ops made (h and h2 as the stage keeps them, the RMSNorm statistics,
  /// SwiGLU's product s) and keeps the outputs of the GEMMs and of attention: selective
  /// recompute, which block_refill() undoes before the block's backward.
  void drop_cheap();
};

/// Runs one block forward on this rank's part of x; fills `saved`, returns the block output.
/// Each op outside the linear layers is a span on `trace`'s compute lane. `mlp`: a branch in place
/// of the SwiGLU (stage 10's experts; mlp_branch.h), which keeps its own state; p's w_gate,
/// w_up and w_down are then not read.
Tensor block_forward(const BlockConfig& c, const LayerParams& p, const Tensor& x, Parallelism& par,
                     BlockActivations& saved, Trace& trace = Trace::off(),
                     MlpBranch* mlp = nullptr);

/// Selective recompute: makes again what drop_cheap() released, from the kept x, x2, gate and
/// up, with no communication (the stage remakes its kept GEMM inputs: Parallelism::column_saved).
void block_refill(const LayerParams& p, Parallelism& par, BlockActivations& saved,
                  Trace& trace = Trace::off());

/// Runs one block backward: writes every parameter gradient into `grads`, returns dL/dx. With
/// the forward's `mlp` branch, the branch's backward in place of the SwiGLU's, and zeros in
/// grads' w_gate, w_up and w_down.
Tensor block_backward(const BlockConfig& c, const LayerParams& p, const BlockActivations& saved,
                      const Tensor& dout, Parallelism& par, LayerParams& grads,
                      Trace& trace = Trace::off(), MlpBranch* mlp = nullptr);

}  // namespace tpx
