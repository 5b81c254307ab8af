#include "lm.h"

#include <array>

#include "check.h"
#include "ops.h"

namespace tpx::lm {

RankTokens cut_tokens(const TokenBatch& all, const TokenCut& cut, Device device) {
  std::int64_t rows = 0;
  for (const SequenceRun& r : cut.runs) rows += r.rows;
  const std::int64_t cols = cut.batch_end - cut.batch_begin;
  TPX_CHECK(cut.batch_begin >= 0 && cut.batch_end <= all.batch && cols > 0,
            "batch columns [{}, {}) of {}", cut.batch_begin, cut.batch_end, all.batch);
  RankTokens out{Tensor::empty({rows, cols}, DType::i32), Tensor::empty({rows, cols}, DType::i32)};
  std::int32_t *tokens = out.tokens.data<std::int32_t>(),
               *targets = out.targets.data<std::int32_t>();
  std::int64_t row = 0;
  for (const SequenceRun& r : cut.runs)
    for (std::int64_t s = r.first; s < r.first + r.rows; ++s, ++row) {
      TPX_CHECK(s >= 0 && s < all.seq, "sequence row {} of {}", s, all.seq);
      for (std::int64_t b = 0; b < cols; ++b) {
        const auto from = static_cast<std::size_t>(s * all.batch + cut.batch_begin + b);
        tokens[row * cols + b] = all.tokens[from];
        targets[row * cols + b] = all.targets[from];
      }
    }
  if (device == Device::cpu) return out;
  return {ops::to_device(out.tokens, device), ops::to_device(out.targets, device)};
}

Tensor embed(const BlockConfig& c, Parallelism& par, const Tensor& table, const Tensor& tokens,
             Trace& trace) {
  const VocabShard v = vocab_shard(c, par.sharding());
  const Tensor partial =
      Tensor::empty({tokens.dim(0), tokens.dim(1), c.hidden}, c.activations(), table.device());
  {
    TraceScope op(trace, "embedding lookup");
    ops::embedding_forward(tokens, table, v.begin, partial);
  }
  return par.vocab_reduce(partial);
}

void embed_backward(const BlockConfig& c, Parallelism& par, const Tensor& tokens, const Tensor& dx,
                    const Tensor& dtable, Trace& trace) {
  const VocabShard v = vocab_shard(c, par.sharding());
  const Tensor d = par.vocab_reduce_backward(dx);
  TraceScope op(trace, "embedding scatter-add");
  ops::fill(dtable, 0.0f);
  ops::embedding_backward(tokens, d, v.begin, dtable);
}

double head_forward(const BlockConfig& c, Parallelism& par, const LmParams& p, const Tensor& y,
                    const Tensor& targets, HeadActivations& acts, Trace& trace) {
  const Sharding sh = par.sharding();
  const VocabShard v = vocab_shard(c, sh);
  const Device device = y.device();
  acts.y = y;
  const Tensor h = Tensor::empty(y.shape(), y.dtype(), device);
  acts.rstd = Tensor::empty({y.rows()}, DType::f32, device);
  {
    TraceScope op(trace, "final rmsnorm");
    ops::rmsnorm_forward(y, p.norm_f, h, acts.rstd);
  }
  const std::array<Tensor, 1> w = {p.w_out};
  ColumnResult r = par.column_forward(h, w, kOutputLayerRole);
  acts.h_saved = r.saved;
  acts.logits = r.y[0];
  const std::int64_t n = targets.numel();
  auto vec = [&] { return Tensor::empty({n}, DType::f32, device); };
  const Tensor local_max = vec(), max = vec(), sumexp = vec(), target = vec();
  acts.lse = vec();
  {
    TraceScope op(trace, "cross-entropy: local max, Σexp, target");
    ops::cross_entropy_partial(acts.logits, targets, v.begin, c.vocab, local_max, sumexp, target);
    ops::copy(local_max, max);
  }
  // Megatron's vocabulary-parallel cross-entropy: three all-reduces of one float per position.
  par.vocab_all_reduce(max, VocabReduce::max);
  {
    TraceScope op(trace, "cross-entropy: rescale");
    ops::cross_entropy_rescale(local_max, max, sumexp);
  }
  par.vocab_all_reduce(sumexp, VocabReduce::sum);
  par.vocab_all_reduce(target, VocabReduce::sum);
  TraceScope op(trace, "cross-entropy: loss");
  const double sum = ops::cross_entropy_loss(max, sumexp, target, acts.lse);
  return sh.rank == 0 ? sum : 0.0;
}

Tensor head_backward(const BlockConfig& c, Parallelism& par, const LmParams& p,
                     const HeadActivations& acts, const Tensor& targets, double scale,
                     const LmParams& grads, Trace& trace) {
  const VocabShard v = vocab_shard(c, par.sharding());
  const Tensor dlogits =
      Tensor::empty(acts.logits.shape(), acts.logits.dtype(), acts.logits.device());
  {
    TraceScope op(trace, "cross-entropy backward");
    ops::cross_entropy_backward(acts.logits, targets, acts.lse, v.begin, c.vocab, scale, dlogits);
  }
  const std::array<Tensor, 1> w = {p.w_out}, dy = {dlogits}, dw = {grads.w_out};
  const Tensor dh = par.column_backward(acts.h_saved, w, dy, dw, kOutputLayerRole);
  const Tensor dx = Tensor::empty(acts.y.shape(), acts.y.dtype(), acts.y.device());
  {
    TraceScope op(trace, "final rmsnorm backward");
    ops::rmsnorm_backward(dh, acts.y, p.norm_f, acts.rstd, dx, grads.norm_f);
  }
  par.reduce_replicated_grad(grads.norm_f);
  return dx;
}

}  // namespace tpx::lm
