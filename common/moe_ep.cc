// The expert-parallel MoE MLP: routing and capacity, dispatch, the local experts, combine, and the
// mirror of all of it backward (moe_ep.h).
#include "moe_ep.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#include "check.h"
#include "comm/communicator.h"
#include "moe_chunks.h"
#include "moe_flags.h"  // moe_ep_problem()
#include "ops.h"
#include "stream.h"
#include "tensor.h"
#include "trace.h"

namespace tpx {
namespace {

using I = std::int64_t;

using moe_detail::at;
using moe_detail::run_chunks;

/// Rows of `width` T each through Communicator::all_to_all_v: float as f32, double as its bytes.
template <class T>
HostVector<T> exchange(Communicator& ep, const HostVector<T>& send, I width,
                       std::span<const I> send_rows, std::span<const I> recv_rows, const Stream& s,
                       std::string_view what) {
  I n_send = 0, n_recv = 0;
  for (const I r : send_rows) n_send += r;
  for (const I r : recv_rows) n_recv += r;
  TPX_CHECK(send.size() == at(n_send * width), "{} values for {} rows", send.size(), n_send);
  const bool f32 = std::is_same_v<T, float>;
  const DType dtype = f32 ? DType::f32 : DType::u8;
  const I cols = f32 ? width : width * I(sizeof(T));
  const Tensor st = Tensor::empty({n_send, cols}, dtype), rt = Tensor::empty({n_recv, cols}, dtype);
  if (!send.empty()) std::memcpy(st.raw(), send.data(), send.size() * sizeof(T));
  ep.all_to_all_v(st, send_rows, rt, recv_rows, s, what);
  HostVector<T> recv(at(n_recv * width));
  if (!recv.empty()) std::memcpy(recv.data(), rt.raw(), recv.size() * sizeof(T));
  return recv;
}

/// Sums v over `comm`'s ranks in place (f32: the communicator sums no doubles).
void all_reduce_values(Communicator& comm, HostVector<float>& v, const Stream& s) {
  const Tensor t = Tensor::empty({I(v.size())}, DType::f32);
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(float));
  comm.all_reduce(t, s);
  std::memcpy(v.data(), t.raw(), v.size() * sizeof(float));
}

/// The rows of local expert le in the received buffer, in order (rank 0's first): their indices.
std::vector<I> group_rows(std::span<const I> recv_counts, I n_ranks, I local, I le) {
  std::vector<I> rows;
  I base = 0;
  for (I s = 0; s < n_ranks; ++s) {
    for (I l = 0; l < local; ++l) {
      const I c = recv_counts[at(s * local + l)];
      if (l == le)
        for (I i = 0; i < c; ++i) rows.push_back(base + i);
      base += c;
    }
  }
  return rows;
}

/// Appends `part` to `all`, and lets `part` go.
template <class T>
void append(HostVector<T>& all, HostVector<T>& part) {
  all.insert(all.end(), part.begin(), part.end());
  release(part);
}

}  // namespace

MoeEpPlan moe_ep_plan(const MoeShape& m, std::span<const std::int32_t> expert, Communicator& tg,
                      int ep_size, std::int64_t chunks, const MoeTokenOrder& order, const Stream& s,
                      Lane lane, Trace& trace) {
  const I n = m.tokens, E = m.experts, k = m.topk, N = ep_size, El = E / N;
  TPX_CHECK(expert.size() == at(n * k), "{} choices for {} tokens", expert.size(), n);
  // The capacity over all tokens in their order: every rank's counts per expert of each of its
  // runs of tokens, and its token count (over the token group, MoeTokenOrder).
  const I NT = tg.size(), rt_rank = tg.rank(), P = order.pieces;
  TPX_CHECK(P >= 1 && n % P == 0, "{} tokens in {} runs", n, P);
  TPX_CHECK(order.keys.empty() || I(order.keys.size()) == NT * P, "{} run places for {} × {}",
            order.keys.size(), NT, P);
  auto place = [&](I q, I p) { return order.keys.empty() ? q * P + p : order.keys[at(q * P + p)]; };
  const I W = P * E + 1, run = n / P;  // a rank's counts: [P, E], then its tokens
  const Tensor mine = Tensor::empty({W}, DType::i32);
  {
    std::vector<I> c(at(P * E), 0);
    for (I a = 0; a < n * k; ++a) ++c[at((a / k) / run * E + expert[at(a)])];
    for (I i = 0; i < W; ++i) {
      const I v = i < P * E ? c[at(i)] : n;
      TPX_CHECK(v <= std::numeric_limits<std::int32_t>::max(), "{} assignments", v);
      mine.data<std::int32_t>()[i] = static_cast<std::int32_t>(v);
    }
  }
  Tensor all;
  {
    TraceScope span(trace, "moe counts all-gather", lane);
    const Tensor there = ops::to_device(mine, s.device());
    const Tensor gathered = Tensor::empty({NT * W}, DType::i32, s.device());
    tg.all_gather(there, gathered, s);
    all = ops::to_device(gathered, Device::cpu);
  }
  MoeEpPlan plan;
  // before[p·E + e]: the assignments to e of the runs placed before this rank's run p.
  std::vector<I> before(at(P * E), 0);
  plan.routed_all.assign(at(E), 0);
  for (I q = 0; q < NT; ++q) {
    const std::int32_t* c = all.data<std::int32_t>() + q * W;
    for (I p = 0; p < P; ++p) {
      for (I e = 0; e < E; ++e) plan.routed_all[at(e)] += c[p * E + e];
      for (I mp = 0; mp < P; ++mp)
        if (place(q, p) < place(rt_rank, mp))
          for (I e = 0; e < E; ++e) before[at(mp * E + e)] += c[p * E + e];
    }
    plan.tokens_all += c[P * E];
  }
  MoeShape global = m;
  global.tokens = plan.tokens_all;
  const I capacity = moe_capacity(global);
  std::vector<std::vector<I>> by_expert(at(E));  // each expert's kept assignments, token order
  plan.kept.assign(at(n * k), 0);
  plan.tokens_per_expert.assign(at(E), 0);
  for (I a = 0; a < n * k; ++a) {
    const I e = expert[at(a)];
    plan.kept[at(a)] = before[at((a / k) / run * E + e)]++ < capacity ? 1 : 0;
    if (plan.kept[at(a)]) {
      ++plan.tokens_per_expert[at(e)];
      by_expert[at(e)].push_back(a);
    }
  }
  // Per chunk of the rank's tokens (one without a cut): the counts per (destination, expert),
  // and the rows, grouped by destination, then expert, then token.
  const I C = chunks;
  TPX_CHECK(C >= 1, "{} chunks", C);
  plan.chunks.assign(at(C), {});
  plan.counts.assign(at(C), std::vector<std::int32_t>(at(E), 0));
  std::vector<std::size_t> next(at(E), 0);  // each expert's first assignment not yet cut
  for (I c = 0; c < C; ++c) {
    MoeEpChunk& ch = plan.chunks[at(c)];
    const I last = (c + 1) * n / C;  // the chunk's tokens end here
    ch.first_sent = I(plan.sent.size());
    ch.send_rows.assign(at(N), 0);
    for (I e = 0; e < E; ++e) {
      const std::vector<I>& kept = by_expert[at(e)];
      I rows = 0;
      for (; next[at(e)] < kept.size() && kept[next[at(e)]] / k < last; ++next[at(e)], ++rows)
        plan.sent.push_back(kept[next[at(e)]]);
      plan.counts[at(c)][at(e)] = static_cast<std::int32_t>(rows);
      ch.send_rows[at(e / El)] += rows;
    }
  }
  return plan;
}

void moe_ep_check(std::int64_t experts, int ep) {
  if (auto problem = moe_ep_problem(experts, ep)) throw ConfigError(*problem);
}

template <class T>
MoeEpForward<T> moe_ep_forward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                               std::span<const T> bias, Communicator& ep, const Stream& s,
                               Communicator* token_group, const MoeEpOverlap& overlap,
                               const MoeTokenOrder& order) {
  moe_ep_check(m.experts, ep.size());
  Trace& trace = overlap.trace ? *overlap.trace : Trace::off();
  const I n = m.tokens, H = m.hidden, E = m.experts, k = m.topk, FE = m.expert_ffn,
          SF = m.shared_ffn, N = ep.size(), El = E / N;
  TPX_CHECK(x.size() == at(n * H), "x of {}", x.size());
  TPX_CHECK(w.w_gate.size() == at(El * H * FE) && w.w_up.size() == at(El * H * FE) &&
                w.w_down.size() == at(El * FE * H),
            "expert weights of {}, {}, {} for {} local experts", w.w_gate.size(), w.w_up.size(),
            w.w_down.size(), El);
  TPX_CHECK(w.shared_gate.size() == at(H * SF) && w.shared_up.size() == at(H * SF) &&
                w.shared_down.size() == at(SF * H),
            "shared expert weights of {}", w.shared_gate.size());
  MoeEpForward<T> f;

  // 1. Route this rank's tokens without a capacity: every assignment kept for now.
  MoeShape local = m;
  local.capacity_factor = 0.0;
  {
    TraceScope span(trace, "router");
    f.logits = moe_logits<T>(m, w.router, x);
    f.routing = moe_route<T>(local, f.logits, bias);
  }
  MoeRouting<T>& rt = f.routing;

  // 2, 3. The capacity over all tokens in their order and the chunks' rows (moe_ep_plan).
  Communicator& tg = token_group ? *token_group : ep;
  MoeEpPlan plan = moe_ep_plan(m, rt.expert, tg, int(N), overlap.chunks, order, s,
                               token_group ? Lane::dp_comm : Lane::ep_comm, trace);
  rt.kept = std::move(plan.kept);
  rt.tokens_per_expert = std::move(plan.tokens_per_expert);
  f.routed_all = std::move(plan.routed_all);
  f.tokens_all = plan.tokens_all;
  f.sent = std::move(plan.sent);
  f.chunks = std::move(plan.chunks);
  f.aux_loss = moe_aux_loss<T>(m, rt.score, f.routed_all, f.tokens_all);
  const I C = overlap.chunks;
  std::vector<HostVector<T>> send(at(C)), recv(at(C)), out(at(C)), back(at(C));
  std::vector<Tensor> counts(at(C));
  for (I c = 0; c < C; ++c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    counts[at(c)] = Tensor::empty({E}, DType::i32);
    std::copy(plan.counts[at(c)].begin(), plan.counts[at(c)].end(),
              counts[at(c)].data<std::int32_t>());
    I rows = 0;
    for (const I r : ch.send_rows) rows += r;
    send[at(c)].reserve(at(rows * H));
    for (I i = 0; i < rows; ++i) {
      const T* xt = x.data() + (f.sent[at(ch.first_sent + i)] / k) * H;
      send[at(c)].insert(send[at(c)].end(), xt, xt + H);
    }
  }
  const Stream here(Device::cpu);  // a task's exchanges run inline on its own thread
  const std::vector<I> ones(at(N), 1);
  auto dispatch = [&](I c) {
    MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe dispatch {}/{}", c + 1, C), Lane::ep_comm);
    const Tensor got = Tensor::empty({E}, DType::i32);
    ep.all_to_all_v(counts[at(c)].reshape({N, El}), ones, got.reshape({N, El}), ones, here,
                    "moe dispatch counts");
    ch.recv_counts.assign(at(E), 0);
    ch.recv_rows.assign(at(N), 0);
    for (I i = 0; i < E; ++i) {
      ch.recv_counts[at(i)] = got.data<std::int32_t>()[i];
      ch.recv_rows[at(i / El)] += ch.recv_counts[at(i)];
    }
    recv[at(c)] = exchange<T>(ep, send[at(c)], H, ch.send_rows, ch.recv_rows, here, "moe dispatch");
    release(send[at(c)]);
  };
  // 4. The local experts on the chunk's received rows, one call per expert over its group.
  std::vector<HostVector<T>> gate(at(C)), up(at(C));
  auto experts = [&](I c) {
    TraceScope span(trace, fmt::format("experts {}/{}", c + 1, C));
    const I rows = I(recv[at(c)].size()) / std::max<I>(H, 1);
    gate[at(c)].assign(at(rows * FE), T(0));
    up[at(c)].assign(at(rows * FE), T(0));
    out[at(c)].assign(at(rows * H), T(0));
    for (I le = 0; le < El; ++le)
      for (const I i : group_rows(f.chunks[at(c)].recv_counts, N, El, le))
        moe_swiglu_forward(recv[at(c)].data() + i * H, w.w_gate.data() + le * H * FE,
                           w.w_up.data() + le * H * FE, w.w_down.data() + le * FE * H, H, FE, T(1),
                           gate[at(c)].data() + i * FE, up[at(c)].data() + i * FE,
                           out[at(c)].data() + i * H);
  };
  // 5. Combine: the outputs back to their tokens' ranks.
  auto combine = [&](I c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe combine {}/{}", c + 1, C), Lane::ep_comm);
    back[at(c)] = exchange<T>(ep, out[at(c)], H, ch.recv_rows, ch.send_rows, here, "moe combine");
    release(out[at(c)]);
  };
  run_chunks(C, overlap.lane, dispatch, experts, combine);
  // The chunks' rows side by side, in sent order (chunk by chunk), and the totals. (Each
  // buffer is made its whole size first: growing it would hold two copies at once, and keep
  // more than it needs in what the backward keeps.)
  f.send_rows.assign(at(N), 0);
  f.recv_rows.assign(at(N), 0);
  auto reserve = [&](HostVector<T>& into, const std::vector<HostVector<T>>& parts) {
    std::size_t total = 0;
    for (const HostVector<T>& part : parts) total += part.size();
    into.reserve(total);
  };
  reserve(f.recv, recv);
  reserve(f.gate, gate);
  reserve(f.up, up);
  reserve(f.out, back);
  for (I c = 0; c < C; ++c) {
    MoeEpChunk& ch = f.chunks[at(c)];
    ch.first_recv = I(f.recv.size()) / std::max<I>(H, 1);
    for (I d = 0; d < N; ++d) {
      f.send_rows[at(d)] += ch.send_rows[at(d)];
      f.recv_rows[at(d)] += ch.recv_rows[at(d)];
    }
    append(f.recv, recv[at(c)]);
    append(f.gate, gate[at(c)]);
    append(f.up, up[at(c)]);
    append(f.out, back[at(c)]);
  }

  // The weighted sum on the tokens' rank, and the shared experts.
  TraceScope span(trace, "experts: weighted sum, shared");
  std::vector<I> row_of(at(n * k), -1);
  for (std::size_t i = 0; i < f.sent.size(); ++i) row_of[at(f.sent[i])] = I(i);
  f.y.assign(at(n * H), T(0));
  for (I t = 0; t < n; ++t)
    for (I j = 0; j < k; ++j) {
      const I a = t * k + j;
      if (!rt.kept[at(a)]) continue;
      const T* o = f.out.data() + row_of[at(a)] * H;
      for (I h = 0; h < H; ++h) f.y[at(t * H + h)] += rt.weight[at(a)] * o[h];
    }
  if (SF > 0) {
    f.shared_gate.assign(at(n * SF), T(0));
    f.shared_up.assign(at(n * SF), T(0));
    for (I t = 0; t < n; ++t)
      moe_swiglu_forward(x.data() + t * H, w.shared_gate.data(), w.shared_up.data(),
                         w.shared_down.data(), H, SF, T(1), f.shared_gate.data() + t * SF,
                         f.shared_up.data() + t * SF, f.y.data() + t * H);
  }
  return f;
}

template <class T>
MoeGrads<T> moe_ep_backward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                            const MoeEpForward<T>& f, std::span<const T> dy, Communicator& ep,
                            const Stream& s, Communicator* tp, const MoeEpOverlap& overlap) {
  moe_ep_check(m.experts, ep.size());
  Trace& trace = overlap.trace ? *overlap.trace : Trace::off();
  const I n = m.tokens, H = m.hidden, E = m.experts, k = m.topk, FE = m.expert_ffn,
          SF = m.shared_ffn, N = ep.size(), El = E / N;
  TPX_CHECK(dy.size() == at(n * H) && x.size() == at(n * H), "dy of {}", dy.size());
  const MoeRouting<T>& rt = f.routing;
  MoeGrads<T> g;
  g.x.assign(at(n * H), T(0));
  g.w.router.assign(w.router.size(), T(0));
  g.w.w_gate.assign(w.w_gate.size(), T(0));
  g.w.w_up.assign(w.w_up.size(), T(0));
  g.w.w_down.assign(w.w_down.size(), T(0));
  g.w.shared_gate.assign(w.shared_gate.size(), T(0));
  g.w.shared_up.assign(w.shared_up.size(), T(0));
  g.w.shared_down.assign(w.shared_down.size(), T(0));

  // Chunk by chunk, as the forward cut them: dispatch w_j·dy_t, the gradient of expert j's
  // unscaled output, in the forward's order; the local experts' backward, one call per expert
  // over its group; the dx rows back.
  const I C = I(f.chunks.size());
  const Stream here(Device::cpu);  // a task's exchanges run inline on its own thread
  std::vector<HostVector<T>> rdy(at(C)), dx_rows(at(C)), dx_chunks(at(C));
  auto dispatch = [&](I c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe dispatch {}/{}", c + 1, C), Lane::ep_comm);
    I rows = 0;
    for (const I r : ch.send_rows) rows += r;
    HostVector<T> send(at(rows * H));
    for (I i = 0; i < rows; ++i) {
      const I a = f.sent[at(ch.first_sent + i)];
      for (I h = 0; h < H; ++h) send[at(i * H + h)] = rt.weight[at(a)] * dy[at((a / k) * H + h)];
    }
    rdy[at(c)] = exchange<T>(ep, send, H, ch.send_rows, ch.recv_rows, here, "moe dispatch");
  };
  auto experts = [&](I c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("experts bwd {}/{}", c + 1, C));
    const I rows = I(rdy[at(c)].size()) / std::max<I>(H, 1);
    dx_rows[at(c)].assign(at(rows * H), T(0));
    const T* xr = f.recv.data() + ch.first_recv * H;
    const T* gate = f.gate.data() + ch.first_recv * FE;
    const T* up = f.up.data() + ch.first_recv * FE;
    for (I le = 0; le < El; ++le)
      for (const I i : group_rows(ch.recv_counts, N, El, le))
        moe_swiglu_backward(xr + i * H, w.w_gate.data() + le * H * FE, w.w_up.data() + le * H * FE,
                            w.w_down.data() + le * FE * H, H, FE, T(1), gate + i * FE, up + i * FE,
                            rdy[at(c)].data() + i * H, g.w.w_gate.data() + le * H * FE,
                            g.w.w_up.data() + le * H * FE, g.w.w_down.data() + le * FE * H,
                            dx_rows[at(c)].data() + i * H);
    release(rdy[at(c)]);
  };
  auto combine = [&](I c) {
    const MoeEpChunk& ch = f.chunks[at(c)];
    TraceScope span(trace, fmt::format("moe combine {}/{}", c + 1, C), Lane::ep_comm);
    dx_chunks[at(c)] =
        exchange<T>(ep, dx_rows[at(c)], H, ch.recv_rows, ch.send_rows, here, "moe combine");
    release(dx_rows[at(c)]);
  };
  run_chunks(C, overlap.lane, dispatch, experts, combine);
  HostVector<T> dx_back;  // in sent order
  dx_back.reserve(f.sent.size() * at(H));
  for (HostVector<T>& part : dx_chunks) append(dx_back, part);

  TraceScope span(trace, "experts bwd: gate weights, shared, router");
  // On the tokens' rank: dx from the experts, the gate weights' gradients dy·out_j, the shared
  // experts, and the router (with the auxiliary loss over all tokens).
  std::vector<I> row_of(at(n * k), -1);
  for (std::size_t i = 0; i < f.sent.size(); ++i) row_of[at(f.sent[i])] = I(i);
  const HostVector<T> dP = moe_aux_grad<T>(m, f.routed_all, f.tokens_all);
  HostVector<T> dweight(at(n * k), T(0));
  for (I t = 0; t < n; ++t) {
    const T* dyt = dy.data() + t * H;
    T* dxt = g.x.data() + t * H;
    for (I j = 0; j < k; ++j) {
      const I a = t * k + j;
      if (!rt.kept[at(a)]) continue;
      const I row = row_of[at(a)];
      const T* o = f.out.data() + row * H;
      const T* d = dx_back.data() + row * H;
      T da = 0;
      for (I h = 0; h < H; ++h) {
        da += dyt[h] * o[h];
        dxt[h] += d[h];
      }
      dweight[at(a)] = da;
    }
    if (SF > 0)
      moe_swiglu_backward(x.data() + t * H, w.shared_gate.data(), w.shared_up.data(),
                          w.shared_down.data(), H, SF, T(1), f.shared_gate.data() + t * SF,
                          f.shared_up.data() + t * SF, dyt, g.w.shared_gate.data(),
                          g.w.shared_up.data(), g.w.shared_down.data(), dxt);
  }
  // Experts cut over a TP group: each rank's outputs are its part of the width, so a gate
  // weight's gradient dy·out_j is the sum of the ranks' parts. The router's gradient is then the
  // same on every rank; its part of dx is added on the group's rank 0 alone (the caller sums
  // dx over the group).
  if (tp && tp->size() > 1) {
    if constexpr (std::is_same_v<T, float>)
      all_reduce_values(*tp, dweight, s);
    else
      TPX_CHECK(false, "experts cut over a TP group run in float");
  }
  HostVector<T> scratch(at(H));
  const bool router_dx = !tp || tp->rank() == 0;
  for (I t = 0; t < n; ++t) {
    T* dxt = router_dx ? g.x.data() + t * H : scratch.data();
    moe_router_backward<T>(m, w.router, x.data() + t * H, rt.score.data() + t * E,
                           rt.expert.data() + t * k, rt.weight.data() + t * k,
                           dweight.data() + t * k, dP, f.tokens_all, dxt, g.w.router.data());
  }
  return g;
}

#define TPX_MOE_EP_INSTANTIATE(T)                                                              \
  template MoeEpForward<T> moe_ep_forward<T>(                                                  \
      const MoeShape&, const MoeWeights<T>&, std::span<const T>, std::span<const T>,           \
      Communicator&, const Stream&, Communicator*, const MoeEpOverlap&, const MoeTokenOrder&); \
  template MoeGrads<T> moe_ep_backward<T>(                                                     \
      const MoeShape&, const MoeWeights<T>&, std::span<const T>, const MoeEpForward<T>&,       \
      std::span<const T>, Communicator&, const Stream&, Communicator*, const MoeEpOverlap&);
TPX_MOE_EP_INSTANTIATE(float)
TPX_MOE_EP_INSTANTIATE(double)
#undef TPX_MOE_EP_INSTANTIATE

MoeEpTraffic moe_ep_traffic(const std::vector<std::vector<std::uint64_t>>& rows, int r,
                            std::int64_t experts, std::uint64_t row_bytes, int token_ranks,
                            int chunks, std::int64_t pieces) {
  using U = std::uint64_t;
  const U N = rows.size(), E = U(experts), C = U(chunks);
  require_formula(N >= 1 && r >= 0 && U(r) < N && E % N == 0 && chunks >= 1 && pieces >= 1,
                  "an EP group of N >= 1 ranks, rank r in it, E a multiple of N, C >= 1 chunks, "
                  "runs >= 1");
  U out_all = 0, out_away = 0, in_all = 0, in_away = 0;
  for (U q = 0; q < N; ++q) {
    require_formula(rows[q].size() == N, "rows is EP × EP");
    out_all += rows[U(r)][q];
    in_all += rows[q][U(r)];
    if (q != U(r)) {
      out_away += rows[U(r)][q];
      in_away += rows[q][U(r)];
    }
  }
  // Every rank of the token group's counts per run and expert, and its token count.
  const U G = token_ranks > 0 ? U(token_ranks) : N, gather = G * (U(pieces) * E + 1) * 4;
  const U exchange = (out_all + in_all) * row_bytes, away = (out_away + in_away) * row_bytes;
  MoeEpTraffic t;
  t.counts = {gather, gather * (G - 1) / G, 1};
  t.forward = {gather + 4 * E * C + exchange, t.counts.bus + 4 * (E - E / N) * C + away, 1 + 3 * C};
  t.backward = {exchange, away, 2 * C};
  return t;
}

std::vector<std::vector<std::uint64_t>> moe_balanced_rows(int ep, std::int64_t tokens_per_rank,
                                                          std::int64_t topk) {
  require_formula(
      ep >= 1 && tokens_per_rank >= 0 && topk >= 1 && (tokens_per_rank * topk) % ep == 0,
      "T_r · k a multiple of EP");
  const auto each = std::uint64_t(tokens_per_rank * topk / ep);
  return std::vector<std::vector<std::uint64_t>>(std::size_t(ep),
                                                 std::vector<std::uint64_t>(std::size_t(ep), each));
}

}  // namespace tpx
