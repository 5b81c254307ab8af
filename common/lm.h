// The language model's two ends around the blocks, written once for every stage (DESIGN.md, "The
// language model around the block"):
//
//   x      = E[tokens]                         vocab-parallel: each rank looks up its own rows,
//                                              zeros for other ids, then g (Parallelism::
//                                              vocab_reduce: all-reduce, or reduce-scatter under SP)
//   ... L blocks ...
//   h      = RMSNorm(y; norm_f)
//   z      = h · W_out                         column-parallel over V (role "output"): [S, B, V/T]
//   loss   = mean over positions of (logsumexp(z) − z[target])
//            from one pass over the local logits (max, Σexp, target logit) and three
//            all-reduces of one float per position (MAX, SUM, SUM): the logits are never gathered
//   dz     = (softmax(z) − onehot(target)) / (S·B) on the local shard
//
// defines: tpx::lm::RankTokens, tpx::lm::cut_tokens(), tpx::lm::HeadActivations,
//          tpx::lm::embedding_end(), tpx::lm::head_end(), tpx::lm::embed(),
//          tpx::lm::embed_backward(), tpx::lm::head_forward(), tpx::lm::head_backward()
#pragma once

#include "config.h"
#include "data.h"
#include "model.h"
#include "parallel.h"
#include "tensor.h"
#include "trace.h"

namespace tpx::lm {

/// A rank's token ids and next-token targets, i32 [rows, batch] in its region's row order.
struct RankTokens {
  Tensor tokens, targets;
};

/// The positions of `cut` out of the step's whole batch, on `device`.
RankTokens cut_tokens(const TokenBatch& all, const TokenCut& cut, Device device);

/// What the head's backward needs from its forward.
struct HeadActivations {
  Tensor y;        ///< the last block's output (the final norm's input)
  Tensor rstd;     ///< the final norm's statistics
  Tensor h_saved;  ///< the output layer's input, as the stage keeps it
  Tensor logits;   ///< this rank's [rows, B, V/T] (padded columns included)
  Tensor lse;      ///< log Σ exp of every position's whole row of logits [rows·B], f32
};

/// The tensors of one end of `p` (the others undefined): the embedding; the head's final gain
/// and output layer. What Parallelism::lm_params() gathers (or lm_grads() makes) for that end.
inline LmParams embedding_end(const LmParams& p) {
  return {.embedding = p.embedding, .norm_f = {}, .w_out = {}};
}
inline LmParams head_end(const LmParams& p) {
  return {.embedding = {}, .norm_f = p.norm_f, .w_out = p.w_out};
}

/// The residual stream's first activation from the token ids: this rank's part of x, in the
/// activations' dtype.
Tensor embed(const BlockConfig& c, Parallelism& par, const Tensor& table, const Tensor& tokens,
             Trace& trace);
/// The embedding's gradient (overwritten; this rank's rows) from the residual stream's gradient.
void embed_backward(const BlockConfig& c, Parallelism& par, const Tensor& tokens, const Tensor& dx,
                    const Tensor& dtable, Trace& trace);

/// The final norm, the output layer and the cross-entropy on the last block's output y. Returns
/// Σ over this rank's positions of (lse − z[target]), on TP rank 0 only (every TP rank holds the
/// same sums after the all-reduces), so that Parallelism::sum_over_ranks counts each position once.
double head_forward(const BlockConfig& c, Parallelism& par, const LmParams& p, const Tensor& y,
                    const Tensor& targets, HeadActivations& acts, Trace& trace);
/// The gradient of the last block's output; writes the final gain's and the output layer's
/// gradients into `grads` (the gain's already reduced over the TP group where SP splits it).
/// `scale` is 1 / (the global number of positions).
Tensor head_backward(const BlockConfig& c, Parallelism& par, const LmParams& p,
                     const HeadActivations& acts, const Tensor& targets, double scale,
                     const LmParams& grads, Trace& trace);

}  // namespace tpx::lm
