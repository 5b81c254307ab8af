// The expert-parallel MoE MLP on tensors of either device (moe_ep.h): moe_ep_forward's five steps
// and moe_ep_backward's mirror in tpx::ops, with the same exchanges in the same order, so the
// communicator's counts and the bytes formula are the host path's.
//
// What runs where:
//   router      ops::gemm for the logits, ops::moe_route for the choices (moe_token.h);
//   bookkeeping the choices [T_r, k] copied to the host, moe_ep_plan there (the capacity's
//               all_gather, the drops, the order of the dispatched rows), its index lists back;
//   permutation ops::gather_rows: the rows to send in dispatch order (backward: scaled by the
//               gate weight), one kernel;
//   exchanges   Communicator::all_to_all_v of the counts [EP, E/EP] and of the rows;
//   experts     the rows from rank s for local expert e are contiguous in what rank r received
//               (rank 0's first, then expert by expert): EP · E/EP groups a chunk, each
//               multiplied by its expert's matrices, which is ops::gemm_grouped (cuda: one
//               cublasGemmGroupedBatchedEx for all of them; cpu: one GEMM per group), with one
//               ops::swiglu over all the rows between; the weights' gradients one GEMM per group;
//   combine     the outputs back in sent order, then ops::combine_rows: y_t = Σ_j w_j·out_j in
//               j order, a token at a time (the backward: dx_t = Σ_j dx_j, and ops::rows_dot for
//               the gate weights' gradients dy·out_j);
//   router bwd  ops::moe_router_dz, then two GEMMs (dx += dz·W_routerᵀ, dW_router += xᵀ·dz).
// Float only; the host path (moe_ep.cc) stays the double oracle, and on the cpu the two agree to
// the rounding of the GEMMs' summation order (tests/test_moe_ep.cc).
#include <algorithm>
#include <cstring>
#include <limits>
#include <string_view>

#include <fmt/format.h>

#include "check.h"
#include "comm/communicator.h"
#include "moe_chunks.h"
#include "moe_ep.h"
#include "ops.h"
#include "stream.h"
#include "trace.h"

namespace tpx {
namespace {

using I = std::int64_t;
using moe_detail::at;
using moe_detail::run_chunks;

/// A host vector of i32 as a [n] tensor on `device`.
Tensor i32_on(const std::vector<std::int32_t>& v, Device device) {
  const Tensor h = Tensor::empty({I(v.size())}, DType::i32);
  if (!v.empty()) std::memcpy(h.raw(), v.data(), v.size() * sizeof(std::int32_t));
  return ops::to_device(h, device);
}

std::int32_t narrow(I v) {
  TPX_CHECK(v >= 0 && v <= std::numeric_limits<std::int32_t>::max(), "index {} past i32", v);
  return static_cast<std::int32_t>(v);
}

/// Matrix e of a stack [count, rows, cols]: [rows, cols].
Tensor matrix(const Tensor& stack, I e) {
  return stack.slice0(e, e + 1).reshape({stack.dim(1), stack.dim(2)});
}

/// Rows [begin, begin + n) of a [R, c] tensor.
Tensor rows_of(const Tensor& t, I begin, I n) {
  return t.slice0(begin, begin + n);
}

/// The groups of a chunk's received buffer, in buffer order: the rows from rank src for local
/// expert e are one group (rank 0's first, then expert by expert), multiplied by expert e.
struct Groups {
  std::vector<I> rows, which, first;
};
Groups groups_of(const MoeEpChunk& ch, I ranks, I local) {
  Groups g;
  I base = 0;
  for (I src = 0; src < ranks; ++src)
    for (I le = 0; le < local; ++le) {
      const I c = ch.recv_counts[at(src * local + le)];
      g.rows.push_back(c);
      g.which.push_back(le);
      g.first.push_back(base);
      base += c;
    }
  return g;
}

/// The SwiGLU's product silu(gate)·up of [rows, f] pre-activations.
Tensor swiglu(const Tensor& gate, const Tensor& up) {
  const Tensor h = Tensor::empty(gate.shape(), DType::f32, gate.device());
  ops::swiglu_forward(gate, up, h);
  return h;
}

/// One SwiGLU's backward on rows x [r, H] with pre-activations gate, up [r, f] for dout [r, H]
/// (the shared experts'): adds to dwg, dwu [H, f] and dwd [f, H] and to dx [r, H].
void swiglu_backward(const Tensor& x, const Tensor& wg, const Tensor& wu, const Tensor& wd,
                     const Tensor& gate, const Tensor& up, const Tensor& dout, const Tensor& dwg,
                     const Tensor& dwu, const Tensor& dwd, const Tensor& dx) {
  const Device d = x.device();
  const I r = x.dim(0), f = gate.dim(1);
  ops::gemm(swiglu(gate, up), true, dout, false, dwd, 1.0f, 1.0f);  // dWd += hᵀ·dout
  const Tensor dh = Tensor::empty({r, f}, DType::f32, d);
  ops::gemm(dout, false, wd, true, dh, 1.0f, 0.0f);  // dh = dout·Wdᵀ
  const Tensor dgate = Tensor::empty({r, f}, DType::f32, d);
  const Tensor dup = Tensor::empty({r, f}, DType::f32, d);
  ops::swiglu_backward(dh, gate, up, dgate, dup);
  ops::gemm(x, true, dgate, false, dwg, 1.0f, 1.0f);
  ops::gemm(x, true, dup, false, dwu, 1.0f, 1.0f);
  ops::gemm(dgate, false, wg, true, dx, 1.0f, 1.0f);
  ops::gemm(dup, false, wu, true, dx, 1.0f, 1.0f);
}

}  // namespace

std::size_t MoeEpOpsForward::bytes() const {
  std::size_t b = 0;
  for (const Tensor* t : {&logits, &score, &weight, &out, &shared_gate, &shared_up})
    if (t->defined()) b += t->nbytes();
  for (const auto* v : {&recv, &gate, &up})
    for (const Tensor& t : *v) b += t.nbytes();
  return b;
}

MoeEpOpsForward moe_ep_ops_forward(const MoeShape& m, const MoeTensors& w, const Tensor& x,
                                   const Tensor& bias, Communicator& ep, const Stream& s,
                                   Communicator* token_group, const MoeEpOverlap& overlap,
                                   const MoeTokenOrder& order) {
  moe_ep_check(m.experts, ep.size());
  Trace& trace = overlap.trace ? *overlap.trace : Trace::off();
  const I n = m.tokens, H = m.hidden, E = m.experts, k = m.topk, FE = m.expert_ffn,
          SF = m.shared_ffn, N = ep.size(), El = E / N;
  const Device d = x.device();
  TPX_CHECK(x.shape() == Tensor::Shape({n, H}) && x.dtype() == DType::f32, "x {}", x.describe());
  TPX_CHECK(w.w_gate.shape() == Tensor::Shape({El, H, FE}) &&
                w.w_down.shape() == Tensor::Shape({El, FE, H}),
            "expert weights {} and {} for {} local experts", w.w_gate.describe(),
            w.w_down.describe(), El);
  TPX_CHECK(!overlap.lane || overlap.chunks == 1 || d == Device::cpu,
            "the experts' chunked overlap runs on the cpu only (--moe-chunks 1 on {})",
            to_string(d));
  const bool sigmoid = m.router == MoeRouter::sigmoid;
  MoeEpOpsForward f;

  // 1. Route this rank's tokens: the logits, the scores and the choices, on the device.
  {
    TraceScope span(trace, "router");
    f.logits = Tensor::empty({n, E}, DType::f32, d);
    ops::gemm(x, false, w.router, false, f.logits, 1.0f, 0.0f);
    f.score = Tensor::empty({n, E}, DType::f32, d);
    f.expert = Tensor::empty({n, k}, DType::i32, d);
    f.weight = Tensor::empty({n, k}, DType::f32, d);
    ops::moe_route(f.logits, bias, sigmoid, f.score, f.expert, f.weight);
  }
  // 2, 3. The choices to the host, and the plan there (moe_ep_plan, the host path's).
  const Tensor choices = ops::to_device(f.expert, Device::cpu);
  const std::span<const std::int32_t> expert(choices.data<std::int32_t>(), at(n * k));
  Communicator& tg = token_group ? *token_group : ep;
  MoeEpPlan plan = moe_ep_plan(m, expert, tg, int(N), overlap.chunks, order, s,
                               token_group ? Lane::dp_comm : Lane::ep_comm, trace);
  f.kept = std::move(plan.kept);
  f.routed_all = std::move(plan.routed_all);
  f.tokens_all = plan.tokens_all;
  f.chunks = std::move(plan.chunks);
  {
    // The auxiliary loss from the scores over this rank's tokens (moe_aux_loss's sums).
    const Tensor score = ops::to_device(f.score, Device::cpu);
    f.aux_loss = double(moe_aux_loss<float>(m, score.f32(), f.routed_all, f.tokens_all));
  }
  // The index lists: each dispatched row's token and gate weight, each assignment's row.
  const I S = I(plan.sent.size());
  std::vector<std::int32_t> sent_token(at(S)), slot(at(n * k), -1);
  for (I i = 0; i < S; ++i) {
    sent_token[at(i)] = narrow(plan.sent[at(i)] / k);
    slot[at(plan.sent[at(i)])] = narrow(i);
  }
  f.sent_token = i32_on(sent_token, d);
  f.slot = i32_on(slot, d).reshape({n, k});
  {
    // The gate weight of each dispatched row: the weights gathered as [n·k, 1] rows.
    std::vector<std::int32_t> assignment(at(S));
    for (I i = 0; i < S; ++i) assignment[at(i)] = narrow(plan.sent[at(i)]);
    f.sent_weight = Tensor::empty({S, 1}, DType::f32, d);
    ops::gather_rows(f.weight.reshape({n * k, 1}), i32_on(assignment, d), Tensor(), f.sent_weight);
    f.sent_weight = f.sent_weight.reshape({S});
  }

  const I C = overlap.chunks;
  const Stream here(d);  // the exchanges: inline on the cpu, the compute stream on cuda
  const std::vector<I> ones(at(N), 1);
  f.recv.assign(at(C), {});
  f.gate.assign(at(C), {});
  f.up.assign(at(C), {});
  f.out = Tensor::empty({S, H}, DType::f32, d);
  std::vector<Tensor> out(at(C));
  auto dispatch = [&](I c) {
    MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe dispatch {}/{}", c + 1, C), Lane::ep_comm);
    const Tensor counts = i32_on(plan.counts[at(c)], d).reshape({N, El});
    const Tensor got = Tensor::empty({N, El}, DType::i32, d);
    ep.all_to_all_v(counts, ones, got, ones, here, "moe dispatch counts");
    const Tensor host = ops::to_device(got, Device::cpu);
    ch.recv_counts.assign(at(E), 0);
    ch.recv_rows.assign(at(N), 0);
    for (I i = 0; i < E; ++i) {
      ch.recv_counts[at(i)] = host.data<std::int32_t>()[i];
      ch.recv_rows[at(i / El)] += ch.recv_counts[at(i)];
    }
    I rows = 0, sent_rows = 0;
    for (const I r : ch.recv_rows) rows += r;
    for (const I r : ch.send_rows) sent_rows += r;
    const Tensor send = Tensor::empty({sent_rows, H}, DType::f32, d);
    ops::gather_rows(x, f.sent_token.slice0(ch.first_sent, ch.first_sent + sent_rows), Tensor(),
                     send);
    f.recv[at(c)] = Tensor::empty({rows, H}, DType::f32, d);
    ep.all_to_all_v(send, ch.send_rows, f.recv[at(c)], ch.recv_rows, here, "moe dispatch");
  };
  // 4. The local experts on the chunk's received rows: each matrix one grouped GEMM over the
  // chunk's groups, the SwiGLU between them one op over all its rows.
  auto experts = [&](I c) {
    TraceScope span(trace, fmt::format("experts {}/{}", c + 1, C));
    const Tensor& recv = f.recv[at(c)];
    const I rows = recv.dim(0);
    const Groups gr = groups_of(f.chunks[at(c)], N, El);
    f.gate[at(c)] = Tensor::empty({rows, FE}, DType::f32, d);
    f.up[at(c)] = Tensor::empty({rows, FE}, DType::f32, d);
    out[at(c)] = Tensor::empty({rows, H}, DType::f32, d);
    ops::gemm_grouped(recv, gr.rows, w.w_gate, gr.which, false, f.gate[at(c)], 0.0f);
    ops::gemm_grouped(recv, gr.rows, w.w_up, gr.which, false, f.up[at(c)], 0.0f);
    ops::gemm_grouped(swiglu(f.gate[at(c)], f.up[at(c)]), gr.rows, w.w_down, gr.which, false,
                      out[at(c)], 0.0f);
  };
  // 5. Combine: the outputs back to their tokens' ranks, into their rows of f.out.
  auto combine = [&](I c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe combine {}/{}", c + 1, C), Lane::ep_comm);
    I sent_rows = 0;
    for (const I r : ch.send_rows) sent_rows += r;
    ep.all_to_all_v(out[at(c)], ch.recv_rows, rows_of(f.out, ch.first_sent, sent_rows),
                    ch.send_rows, here, "moe combine");
    out[at(c)] = {};
  };
  run_chunks(C, overlap.lane, dispatch, experts, combine);

  // The weighted sum on the tokens' rank, and the shared experts.
  TraceScope span(trace, "experts: weighted sum, shared");
  f.y = Tensor::empty({n, H}, DType::f32, d);
  ops::combine_rows(f.out, f.slot, f.weight, f.y, /*accumulate=*/false);
  if (SF > 0) {
    f.shared_gate = Tensor::empty({n, SF}, DType::f32, d);
    f.shared_up = Tensor::empty({n, SF}, DType::f32, d);
    ops::gemm(x, false, w.shared_gate, false, f.shared_gate, 1.0f, 0.0f);
    ops::gemm(x, false, w.shared_up, false, f.shared_up, 1.0f, 0.0f);
    ops::gemm(swiglu(f.shared_gate, f.shared_up), false, w.shared_down, false, f.y, 1.0f, 1.0f);
  }
  return f;
}

MoeTensorGrads moe_ep_ops_backward(const MoeShape& m, const MoeTensors& w, const Tensor& x,
                                   const MoeEpOpsForward& f, const Tensor& dy, Communicator& ep,
                                   const Stream& s, Communicator* tp, const MoeEpOverlap& overlap) {
  moe_ep_check(m.experts, ep.size());
  Trace& trace = overlap.trace ? *overlap.trace : Trace::off();
  const I n = m.tokens, H = m.hidden, E = m.experts, k = m.topk, SF = m.shared_ffn, N = ep.size(),
          El = E / N;
  const Device d = x.device();
  TPX_CHECK(dy.shape() == Tensor::Shape({n, H}) && x.shape() == dy.shape(), "dy {}, x {}",
            dy.describe(), x.describe());
  MoeTensorGrads g;
  g.x = Tensor::empty({n, H}, DType::f32, d);
  for (auto [from, to] : {std::pair{&w.router, &g.w.router},
                          {&w.w_gate, &g.w.w_gate},
                          {&w.w_up, &g.w.w_up},
                          {&w.w_down, &g.w.w_down},
                          {&w.shared_gate, &g.w.shared_gate},
                          {&w.shared_up, &g.w.shared_up},
                          {&w.shared_down, &g.w.shared_down}})
    *to = from->defined() ? ops::zeros_like(*from) : Tensor();

  // Chunk by chunk, as the forward cut them: dispatch w_j·dy_t in the forward's order, the local
  // experts' backward group by group, the dx rows back into their rows of dx_back.
  const I C = I(f.chunks.size()), S = f.out.dim(0);
  const Stream here(d);
  std::vector<Tensor> rdy(at(C)), dx_rows(at(C));
  const Tensor dx_back = Tensor::empty({S, H}, DType::f32, d);
  auto sent_rows = [&](I c) {
    I rows = 0;
    for (const I r : f.chunks[at(c)].send_rows) rows += r;
    return rows;
  };
  auto dispatch = [&](I c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe dispatch {}/{}", c + 1, C), Lane::ep_comm);
    const I rows = sent_rows(c);
    const Tensor send = Tensor::empty({rows, H}, DType::f32, d);
    ops::gather_rows(dy, f.sent_token.slice0(ch.first_sent, ch.first_sent + rows),
                     f.sent_weight.slice0(ch.first_sent, ch.first_sent + rows), send);
    rdy[at(c)] = Tensor::empty({f.recv[at(c)].dim(0), H}, DType::f32, d);
    ep.all_to_all_v(send, ch.send_rows, rdy[at(c)], ch.recv_rows, here, "moe dispatch");
  };
  // The local experts' backward: dh, dx by grouped GEMMs over the chunk's groups, the SwiGLU's
  // backward one op, the weights' gradients one GEMM per group (groups of one expert add to one
  // matrix: in buffer order, rank 0's rows first).
  auto experts = [&](I c) {
    TraceScope span(trace, fmt::format("experts bwd {}/{}", c + 1, C));
    const Tensor& recv = f.recv[at(c)];
    const I rows = recv.dim(0), FE = f.gate[at(c)].dim(1);
    const Groups gr = groups_of(f.chunks[at(c)], N, El);
    const Tensor& gate = f.gate[at(c)];
    const Tensor& up = f.up[at(c)];
    const Tensor h = swiglu(gate, up);
    const Tensor dh = Tensor::empty({rows, FE}, DType::f32, d);
    ops::gemm_grouped(rdy[at(c)], gr.rows, w.w_down, gr.which, /*trans_b=*/true, dh, 0.0f);
    const Tensor dgate = Tensor::empty({rows, FE}, DType::f32, d);
    const Tensor dup = Tensor::empty({rows, FE}, DType::f32, d);
    ops::swiglu_backward(dh, gate, up, dgate, dup);
    dx_rows[at(c)] = Tensor::empty({rows, H}, DType::f32, d);
    ops::gemm_grouped(dgate, gr.rows, w.w_gate, gr.which, true, dx_rows[at(c)], 0.0f);
    ops::gemm_grouped(dup, gr.rows, w.w_up, gr.which, true, dx_rows[at(c)], 1.0f);
    for (std::size_t i = 0; i < gr.rows.size(); ++i) {
      const I first = gr.first[i], count = gr.rows[i], le = gr.which[i];
      if (count == 0) continue;
      const Tensor x_g = rows_of(recv, first, count);
      ops::gemm(rows_of(h, first, count), true, rows_of(rdy[at(c)], first, count), false,
                matrix(g.w.w_down, le), 1.0f, 1.0f);
      ops::gemm(x_g, true, rows_of(dgate, first, count), false, matrix(g.w.w_gate, le), 1.0f, 1.0f);
      ops::gemm(x_g, true, rows_of(dup, first, count), false, matrix(g.w.w_up, le), 1.0f, 1.0f);
    }
    rdy[at(c)] = {};
  };
  auto combine = [&](I c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe combine {}/{}", c + 1, C), Lane::ep_comm);
    ep.all_to_all_v(dx_rows[at(c)], ch.recv_rows, rows_of(dx_back, ch.first_sent, sent_rows(c)),
                    ch.send_rows, here, "moe combine");
    dx_rows[at(c)] = {};
  };
  run_chunks(C, overlap.lane, dispatch, experts, combine);

  TraceScope span(trace, "experts bwd: gate weights, shared, router");
  // On the tokens' rank: dx from the experts, the gate weights' gradients dy·out_j, the shared
  // experts, and the router (with the auxiliary loss over all tokens).
  ops::combine_rows(dx_back, f.slot, Tensor(), g.x, /*accumulate=*/false);
  const Tensor dweight = Tensor::empty({n, k}, DType::f32, d);
  ops::rows_dot(dy, f.out, f.slot, dweight);
  if (SF > 0)
    swiglu_backward(x, w.shared_gate, w.shared_up, w.shared_down, f.shared_gate, f.shared_up, dy,
                    g.w.shared_gate, g.w.shared_up, g.w.shared_down, g.x);
  // Experts cut over a TP group: a gate weight's gradient is the sum of the ranks' parts; the
  // router's part of dx then goes to the group's rank 0 alone (moe_ep_backward's rule).
  if (tp && tp->size() > 1) tp->all_reduce(dweight, s);
  Tensor dP;
  if (m.aux_loss_weight != 0.0) {
    const HostVector<float> p = moe_aux_grad<float>(m, f.routed_all, f.tokens_all);
    const Tensor h = Tensor::empty({E}, DType::f32);
    std::copy(p.begin(), p.end(), h.data<float>());
    dP = ops::to_device(h, d);
  }
  const Tensor dz = Tensor::empty({n, E}, DType::f32, d);
  ops::moe_router_dz(f.score, f.expert, f.weight, dweight, dP, m.router == MoeRouter::sigmoid,
                     f.tokens_all, dz);
  if (!tp || tp->rank() == 0) ops::gemm(dz, false, w.router, true, g.x, 1.0f, 1.0f);
  ops::gemm(x, true, dz, false, g.w.router, 1.0f, 1.0f);
  return g;
}

}  // namespace tpx
