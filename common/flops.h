// Floating-point operations of one training step of the block, counted from its GEMMs: what
// TFLOP/s and MFU are computed from, and what the tutorial's tables cite.
//
// Per layer (multiply-add = 2 FLOPs; S·B tokens; KV = NKV·D, which is H without GQA):
//   linear forward     2·S·B·(2H² + 2H·KV + 3HF)
//                                          Wq, Wo: [H, H]; Wk, Wv: [H, KV]; Wg, Wu: [H, F];
//                                          Wd: [F, H]
//   attention forward  2·(2·B·S²·H)        QKᵀ and PV over all heads, the full S×S square (a
//                                          convention: the causal kernels skip about half of it,
//                                          and fused attention's backward recomputes QKᵀ)
//   backward           2 × forward         each GEMM becomes two (dX and dW; dQ, dK and dV, dP)
//   recompute          R/L × forward       --recompute full runs the forward of R = ceil(L/K)
//                                          blocks again (--recompute-every K); selective only
//                                          element-wise ops, 0 GEMM FLOPs
// A MoE layer (stage 10, c.moe) has in place of 3HF per token its router and the K experts the
// token chose, with the shared experts (SF = NS·FE wide):
//   MoE linear forward 2·S·B·(2H² + 2H·KV + H·E + 3H·(K·FE + SF))
//                                          the K chosen experts, dropped or not (the model's
//                                          FLOPs; a capacity's drops are work not done)
// The language model (--task lm) adds its output layer, once per step (not per layer):
//   output forward     2·S·B·H·V          h · W_out, W_out: [H, V]; backward 2 × forward
// The embedding is a lookup (no FLOPs), the cross-entropy element-wise.
// Element-wise work (norms, RoPE, softmax, SwiGLU, residuals, loss, SGD) is O(S·B·H) and not
// counted. GQA does not change attention's FLOPs: every query head still scores every key.
// A tensor-parallel rank does 1/N of the GEMM work. total() is the model's FLOPs (what MFU
// divides by, recompute excluded, as in the PaLM paper's MFU); executed() adds the recompute.
//
// defines: tpx::StepFlops, tpx::step_flops()
#pragma once

#include "config.h"

namespace tpx {

struct StepFlops {
  double linear_forward = 0;     ///< all layers (and the output layer, under --task lm)
  double attention_forward = 0;  ///< all layers
  double forward() const { return linear_forward + attention_forward; }
  double recompute = 0;  ///< the recomputed layers' forward GEMMs (full), else 0
  double backward() const { return 2.0 * forward(); }
  double total() const { return forward() + backward(); }  ///< forward + backward = 3 × forward
  double executed() const { return total() + recompute; }  ///< what the GPU runs
};

/// FLOPs of one forward + backward of the whole model (all L layers, all ranks together).
inline StepFlops step_flops(const BlockConfig& c) {
  const double h = double(c.hidden), f = double(c.ffn), s = double(c.seq), b = double(c.batch);
  const double t = s * b, layers = double(c.layers);
  StepFlops r;
  const double kv = double(c.kv_dim());
  // Stage 10's MoE layers, l % every == 0 of the L: ⌈L / every⌉.
  const double moe = c.moe.experts > 0 ? double((c.layers + c.moe.every - 1) / c.moe.every) : 0.0;
  const double moe_mlp =
      h * double(c.moe.experts) +
      3.0 * h * (double(c.moe.topk) * double(c.moe.expert_ffn) + double(c.moe.shared_ffn));
  r.linear_forward = layers * 2.0 * t * (2.0 * h * h + 2.0 * h * kv + 3.0 * h * f);
  if (moe > 0)  // the MoE layers' MLP in place of the SwiGLU
    r.linear_forward += moe * 2.0 * t * (moe_mlp - 3.0 * h * f);
  const double recomputed = r.linear_forward + layers * 2.0 * (2.0 * b * s * s * h);
  if (c.lm()) r.linear_forward += 2.0 * t * h * double(c.vocab);  // the output layer
  r.attention_forward = layers * 2.0 * (2.0 * b * s * s * h);
  r.recompute = recomputed * double(c.recomputed_layers()) / layers;  // the blocks' only
  return r;
}

}  // namespace tpx
