#include "block.h"

#include <array>

#include "check.h"
#include "ops.h"

namespace tpx {
namespace {

Tensor like(const Tensor& t) {
  return Tensor::empty(t.shape(), t.dtype(), t.device());
}

Tensor rows_of(const Tensor& x) {
  return Tensor::empty({x.rows()}, DType::f32, x.device());
}

/// RoPE (forward or its inverse) on each run of rows at its global positions.
void rope(const BlockConfig& c, const Parallelism& par, const Tensor& x, std::int64_t heads,
          bool inverse) {
  std::int64_t row = 0;
  for (const SequenceRun& run : par.sequence_runs(x.dim(0))) {
    const Tensor part = x.slice0(row, row + run.rows);
    if (inverse)
      ops::rope_backward(part, heads, c.rope_theta, run.first);
    else
      ops::rope_forward(part, heads, c.rope_theta, run.first);
    row += run.rows;
  }
  TPX_CHECK(row == x.dim(0), "the sequence runs cover {} of {} rows", row, x.dim(0));
}

}  // namespace

void Parallelism::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                    std::int64_t heads, const Tensor& out, const Tensor& lse,
                                    DType compute) {
  ops::attention_fused_forward(q, k, v, heads, out, lse, compute);
}

void Parallelism::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                     const Tensor& v, const Tensor& out, const Tensor& lse,
                                     std::int64_t heads, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, DType compute) {
  ops::attention_fused_backward(dout, q, k, v, out, lse, heads, dq, dk, dv, compute);
}

void BlockActivations::keep_only_input() {
  Tensor input = std::move(x);
  *this = BlockActivations{};
  x = std::move(input);
}

std::size_t BlockActivations::bytes() const {
  std::size_t n = 0;
  for (const Tensor* t : {&x, &rstd1, &h_saved, &q, &k, &v, &probs, &lse, &a, &x2, &rstd2,
                          &h2_saved, &gate, &up, &s}) {
    if (t->defined()) n += t->nbytes();
  }
  return n;
}

Tensor block_forward(const BlockConfig& c, const LayerParams& p, const Tensor& x, Parallelism& par,
                     BlockActivations& sv, Trace& trace, MlpBranch* mlp) {
  sv.x = x;

  // Attention sub-block.
  Tensor h = like(x);
  sv.rstd1 = rows_of(x);
  {
    TraceScope op(trace, "rmsnorm 1 fwd");
    ops::rmsnorm_forward(x, p[Param::norm1], h, sv.rstd1);
  }
  const std::array qkv_w{p[Param::wq], p[Param::wk], p[Param::wv]};
  ColumnResult qkv = par.column_forward(h, qkv_w, "qkv");
  sv.h_saved = qkv.saved;
  sv.q = qkv.y[0];
  sv.k = qkv.y[1];
  sv.v = qkv.y[2];
  const std::int64_t heads = sv.q.dim(2) / c.head_dim();     // this rank's query heads
  const std::int64_t kv_heads = sv.k.dim(2) / c.head_dim();  // and KV heads (GQA: fewer)
  if (c.rope()) {
    // q and k hold every position of the rank's part of the sequence here (column_forward
    // gathers the sequence under SP): the whole sequence, or stage 08's chunks (sequence_runs).
    TraceScope op(trace, "rope fwd");
    rope(c, par, sv.q, heads, false);
    rope(c, par, sv.k, kv_heads, false);
  }
  sv.a = like(sv.q);
  const std::int64_t batch = sv.q.dim(1), seq = sv.q.dim(0);
  if (c.attention == Attention::fused) {
    sv.probs = Tensor();
    sv.lse = Tensor::empty({batch, heads, seq}, DType::f32, x.device());
    TraceScope op(trace, "attention fwd");
    par.attention_forward(sv.q, sv.k, sv.v, heads, sv.a, sv.lse, high_precision(c.dtype));
  } else {
    sv.lse = Tensor();
    sv.probs = Tensor::empty({batch, heads, seq, seq}, DType::f32, x.device());
    TraceScope op(trace, "attention fwd");
    ops::attention_forward(sv.q, sv.k, sv.v, heads, sv.a, sv.probs, high_precision(c.dtype));
  }
  Tensor attn_out = par.row_forward(sv.a, p[Param::wo], "o");
  sv.x2 = like(x);
  {
    TraceScope op(trace, "residual add 1 fwd");
    ops::add(x, attn_out, sv.x2);
  }

  // MLP sub-block.
  Tensor h2 = like(x);
  sv.rstd2 = rows_of(x);
  {
    TraceScope op(trace, "rmsnorm 2 fwd");
    ops::rmsnorm_forward(sv.x2, p[Param::norm2], h2, sv.rstd2);
  }
  if (mlp) {  // the stage's branch in place of the SwiGLU (stage 10's experts)
    const Tensor branch = mlp->forward(h2, trace);
    Tensor out = like(x);
    TraceScope op(trace, "residual add 2 fwd");
    ops::add(sv.x2, branch, out);
    return out;
  }
  const std::array gu_w{p[Param::w_gate], p[Param::w_up]};
  ColumnResult gu = par.column_forward(h2, gu_w, "gate/up");
  sv.h2_saved = gu.saved;
  sv.gate = gu.y[0];
  sv.up = gu.y[1];
  sv.s = like(sv.gate);
  {
    TraceScope op(trace, "swiglu fwd");
    ops::swiglu_forward(sv.gate, sv.up, sv.s);
  }
  Tensor mlp_out = par.row_forward(sv.s, p[Param::w_down], "down");
  Tensor out = like(x);
  {
    TraceScope op(trace, "residual add 2 fwd");
    ops::add(sv.x2, mlp_out, out);
  }
  return out;
}

Tensor block_backward(const BlockConfig& c, const LayerParams& p, const BlockActivations& sv,
                      const Tensor& dout, Parallelism& par, LayerParams& grads, Trace& trace,
                      MlpBranch* mlp) {
  // out = x2 + s·Wd: dout flows to x2 unchanged and through the MLP branch (the SwiGLU, or a
  // stage's branch in its place: stage 10's experts). The SwiGLU's gradients live to the end of
  // the block's backward (what the memory estimate's largest temporaries count).
  Tensor dh2, ds, dgate, dup;
  if (mlp) {
    dh2 = mlp->backward(dout, trace);
    for (Param q : {Param::w_gate, Param::w_up, Param::w_down}) ops::fill(grads[q], 0.0f);
  } else {
    ds = par.row_backward(sv.s, p[Param::w_down], dout, grads[Param::w_down], "down");
    dgate = like(sv.gate);
    dup = like(sv.up);
    {
      TraceScope op(trace, "swiglu bwd");
      ops::swiglu_backward(ds, sv.gate, sv.up, dgate, dup);
    }
    const std::array gu_w{p[Param::w_gate], p[Param::w_up]};
    const std::array gu_dy{dgate, dup};
    const std::array gu_dw{grads[Param::w_gate], grads[Param::w_up]};
    dh2 = par.column_backward(sv.h2_saved, gu_w, gu_dy, gu_dw, "gate/up");
  }
  Tensor dx2 = like(dout);
  {
    TraceScope op(trace, "rmsnorm 2 bwd");
    ops::rmsnorm_backward(dh2, sv.x2, p[Param::norm2], sv.rstd2, dx2, grads[Param::norm2]);
    ops::accumulate(dout, dx2);
  }

  // x2 = x + a·Wo: dx2 flows to x unchanged and through the attention branch.
  Tensor da = par.row_backward(sv.a, p[Param::wo], dx2, grads[Param::wo], "o");
  Tensor dq = like(sv.q), dk = like(sv.k), dv = like(sv.v);
  const std::int64_t heads = sv.q.dim(2) / c.head_dim();
  const std::int64_t kv_heads = sv.k.dim(2) / c.head_dim();
  {
    TraceScope op(trace, "attention bwd");
    if (c.attention == Attention::fused)
      par.attention_backward(da, sv.q, sv.k, sv.v, sv.a, sv.lse, heads, dq, dk, dv,
                             high_precision(c.dtype));
    else
      ops::attention_backward(da, sv.q, sv.k, sv.v, sv.probs, heads, dq, dk, dv,
                              high_precision(c.dtype));
  }
  if (c.rope()) {
    // q = R·(h·Wq) with R a rotation per position and pair: the gradient rotates back by Rᵀ.
    TraceScope op(trace, "rope bwd");
    rope(c, par, dq, heads, true);
    rope(c, par, dk, kv_heads, true);
  }
  const std::array qkv_w{p[Param::wq], p[Param::wk], p[Param::wv]};
  const std::array qkv_dy{dq, dk, dv};
  const std::array qkv_dw{grads[Param::wq], grads[Param::wk], grads[Param::wv]};
  Tensor dh = par.column_backward(sv.h_saved, qkv_w, qkv_dy, qkv_dw, "qkv");
  Tensor dx = like(dout);
  {
    TraceScope op(trace, "rmsnorm 1 bwd");
    ops::rmsnorm_backward(dh, sv.x, p[Param::norm1], sv.rstd1, dx, grads[Param::norm1]);
    ops::accumulate(dx2, dx);
  }

  par.reduce_replicated_grad(grads[Param::norm1]);
  par.reduce_replicated_grad(grads[Param::norm2]);
  return dx;
}

void BlockActivations::drop_cheap() {
  h_scale = h_saved.scale();  // undefined unless the stage keeps h as FP8
  h2_scale = h2_saved.scale();
  for (Tensor* t : {&h_saved, &h2_saved, &rstd1, &rstd2, &s}) *t = Tensor();
}

void block_refill(const LayerParams& p, Parallelism& par, BlockActivations& sv, Trace& trace) {
  // The same calls on the same inputs as block_forward: the same bits.
  TraceScope op(trace, "refill (selective recompute)");
  Tensor h = like(sv.x), h2 = like(sv.x2);
  sv.rstd1 = rows_of(sv.x);
  sv.rstd2 = rows_of(sv.x2);
  ops::rmsnorm_forward(sv.x, p[Param::norm1], h, sv.rstd1);
  ops::rmsnorm_forward(sv.x2, p[Param::norm2], h2, sv.rstd2);
  sv.h_saved = par.column_saved(h, sv.h_scale);
  sv.h2_saved = par.column_saved(h2, sv.h2_scale);
  sv.s = like(sv.gate);
  ops::swiglu_forward(sv.gate, sv.up, sv.s);
}

}  // namespace tpx
