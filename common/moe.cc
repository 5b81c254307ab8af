// Plain loops over tokens and their chosen experts; matrices row-major, token t's row at t·H.
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "check.h"
#include "moe_token.h"

namespace tpx {
namespace {

using I = std::int64_t;

using moe_detail::at;

template <class T>
T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

template <class T>
T silu(T z) {
  return z * sigmoid(z);
}

// d silu(z)/dz = σ(z)·(1 + z·(1 − σ(z)))
template <class T>
T silu_grad(T z) {
  const T s = sigmoid(z);
  return s * (T(1) + z * (T(1) - s));
}

// y[o] += a · Σ_i x[i] W[i, o] for one row x [in] and W [in, out].
template <class T>
void row_matmul_acc(const T* x, const T* w, I in, I out, T a, T* y) {
  for (I i = 0; i < in; ++i) {
    const T xv = a * x[i];
    for (I o = 0; o < out; ++o) y[o] += xv * w[i * out + o];
  }
}

// dx[i] += Σ_o dy[o] W[i, o]
template <class T>
void row_matmul_dx(const T* dy, const T* w, I in, I out, T* dx) {
  for (I i = 0; i < in; ++i) {
    T acc = 0;
    for (I o = 0; o < out; ++o) acc += dy[o] * w[i * out + o];
    dx[i] += acc;
  }
}

// dW[i, o] += x[i] dy[o]
template <class T>
void row_matmul_dw(const T* x, const T* dy, I in, I out, T* dw) {
  for (I i = 0; i < in; ++i)
    for (I o = 0; o < out; ++o) dw[i * out + o] += x[i] * dy[o];
}

}  // namespace

template <class T>
void moe_swiglu_forward(const T* x, const T* wg, const T* wu, const T* wd, I h, I fe, T a, T* gate,
                        T* up, T* y) {
  std::fill(gate, gate + fe, T(0));
  std::fill(up, up + fe, T(0));
  row_matmul_acc(x, wg, h, fe, T(1), gate);
  row_matmul_acc(x, wu, h, fe, T(1), up);
  HostVector<T> s(at(fe));
  for (I f = 0; f < fe; ++f) s[at(f)] = silu(gate[f]) * up[f];
  row_matmul_acc(s.data(), wd, fe, h, a, y);
}

template <class T>
T moe_swiglu_backward(const T* x, const T* wg, const T* wu, const T* wd, I h, I fe, T a,
                      const T* gate, const T* up, const T* dout, T* dwg, T* dwu, T* dwd, T* dx) {
  HostVector<T> s(at(fe)), ds(at(fe), T(0)), dgate(at(fe)), dup(at(fe));
  for (I f = 0; f < fe; ++f) s[at(f)] = silu(gate[f]) * up[f];
  // out = s·Wd: ∂loss/∂a = Σ_o dout[o]·out[o] = Σ_f s[f]·(Wd·dout)[f]
  row_matmul_dx(dout, wd, fe, h, ds.data());  // ds = Wd·dout (before the factor a)
  T da = 0;
  for (I f = 0; f < fe; ++f) da += s[at(f)] * ds[at(f)];
  HostVector<T> adout(dout, dout + h);
  for (T& v : adout) v *= a;
  row_matmul_dw(s.data(), adout.data(), fe, h, dwd);
  for (I f = 0; f < fe; ++f) {
    const T d = a * ds[at(f)];
    dgate[at(f)] = d * up[f] * silu_grad(gate[f]);
    dup[at(f)] = d * silu(gate[f]);
  }
  row_matmul_dw(x, dgate.data(), h, fe, dwg);
  row_matmul_dw(x, dup.data(), h, fe, dwu);
  row_matmul_dx(dgate.data(), wg, h, fe, dx);
  row_matmul_dx(dup.data(), wu, h, fe, dx);
  return da;
}

namespace {

// The normalised probabilities P of the auxiliary loss for one token's scores: p itself
// (softmax) or s / Σ s (sigmoid).
template <class T>
HostVector<T> aux_probs(const MoeShape& m, const T* score) {
  HostVector<T> q(score, score + m.experts);
  if (m.router == MoeRouter::sigmoid) {
    const T sum = std::accumulate(q.begin(), q.end(), T(0));
    for (T& v : q) v /= sum;
  }
  return q;
}

}  // namespace

std::int64_t moe_capacity(const MoeShape& m) {
  if (m.capacity_factor <= 0.0) return m.tokens;
  const double c =
      std::ceil(m.capacity_factor * double(m.tokens) * double(m.topk) / double(m.experts));
  // An expert takes each token at most once: a capacity past T (a huge C) is dropless, and is
  // compared in double before it is cast, so that no value past int64 is converted.
  return c >= double(m.tokens) ? m.tokens : static_cast<I>(c);
}

template <class T>
MoeRouting<T> moe_route(const MoeShape& m, std::span<const T> logits, std::span<const T> bias) {
  const I n = m.tokens, E = m.experts, k = m.topk;
  TPX_CHECK(k >= 1 && k <= E, "top-k {} of {} experts", k, E);
  TPX_CHECK(logits.size() == at(n * E), "{} logits for {} tokens", logits.size(), n);
  TPX_CHECK(bias.empty() || bias.size() == at(E), "a bias of {}", bias.size());
  MoeRouting<T> r;
  r.expert.resize(at(n * k));
  r.weight.resize(at(n * k));
  r.kept.assign(at(n * k), 0);
  r.routed_per_expert.assign(at(E), 0);
  r.tokens_per_expert.assign(at(E), 0);
  r.score.resize(at(n * E));
  const I capacity = moe_capacity(m);
  for (I t = 0; t < n; ++t) {
    moe_token::route(logits.data() + t * E, bias.empty() ? nullptr : bias.data(), E, k,
                     m.router == MoeRouter::sigmoid, r.score.data() + t * E,
                     r.expert.data() + t * k, r.weight.data() + t * k);
    for (I j = 0; j < k; ++j) {
      const std::int32_t e = r.expert[at(t * k + j)];
      // Token order decides who is dropped: the first `capacity` tokens to choose e are served.
      if (r.routed_per_expert[at(e)]++ < capacity) {
        r.kept[at(t * k + j)] = 1;
        ++r.tokens_per_expert[at(e)];
      }
    }
  }
  return r;
}

template <class T>
void moe_update_bias(std::span<T> bias, std::span<const std::int64_t> counts, double rate) {
  TPX_CHECK(bias.size() == counts.size() && !counts.empty(), "{} biases, {} counts", bias.size(),
            counts.size());
  // Compare count·E with Σ counts instead of count with the mean: integers, no rounding.
  const I total = std::accumulate(counts.begin(), counts.end(), I(0));
  const I E = static_cast<I>(counts.size());
  for (std::size_t e = 0; e < counts.size(); ++e) {
    const I scaled = counts[e] * E;
    if (scaled < total) bias[e] += T(rate);
    if (scaled > total) bias[e] -= T(rate);
  }
}

template <class T>
HostVector<T> moe_logits(const MoeShape& m, std::span<const T> router, std::span<const T> x) {
  const I n = m.tokens, H = m.hidden, E = m.experts;
  TPX_CHECK(x.size() == at(n * H) && router.size() == at(H * E), "x of {}, router of {}", x.size(),
            router.size());
  HostVector<T> z(at(n * E), T(0));
  for (I t = 0; t < n; ++t)
    row_matmul_acc(x.data() + t * H, router.data(), H, E, T(1), z.data() + t * E);
  return z;
}

template <class T>
T moe_aux_loss(const MoeShape& m, std::span<const T> score, std::span<const std::int64_t> routed,
               std::int64_t tokens_all) {
  if (m.aux_loss_weight == 0.0) return T(0);
  const I n = m.tokens, E = m.experts, k = m.topk;
  TPX_CHECK(score.size() == at(n * E) && routed.size() == at(E), "{} scores, {} counts",
            score.size(), routed.size());
  HostVector<T> P(at(E), T(0));
  for (I t = 0; t < n; ++t) {
    const HostVector<T> q = aux_probs(m, score.data() + t * E);
    for (I e = 0; e < E; ++e) P[at(e)] += q[at(e)] / T(tokens_all);
  }
  T sum = 0;
  for (I e = 0; e < E; ++e) sum += T(routed[at(e)]) / T(tokens_all * k) * P[at(e)];
  return T(m.aux_loss_weight) * T(E) * sum;
}

template <class T>
HostVector<T> moe_aux_grad(const MoeShape& m, std::span<const std::int64_t> routed,
                           std::int64_t tokens_all) {
  const I E = m.experts, k = m.topk;
  HostVector<T> dP(at(E), T(0));
  if (m.aux_loss_weight != 0.0)
    for (I e = 0; e < E; ++e)
      dP[at(e)] = T(m.aux_loss_weight) * T(E) * T(routed[at(e)]) / T(tokens_all * k);
  return dP;
}

template <class T>
void moe_router_backward(const MoeShape& m, std::span<const T> router, const T* xt, const T* score,
                         const std::int32_t* expert, const T* weight, const T* dweight,
                         std::span<const T> dP, std::int64_t tokens_all, T* dxt, T* drouter) {
  const I H = m.hidden, E = m.experts, k = m.topk, n = tokens_all;
  HostVector<T> dz(at(E));
  moe_token::router_dz(score, expert, weight, dweight,
                       m.aux_loss_weight != 0.0 ? dP.data() : nullptr, E, k,
                       m.router == MoeRouter::sigmoid, n, dz.data());
  row_matmul_dw(xt, dz.data(), H, E, drouter);
  row_matmul_dx(dz.data(), router.data(), H, E, dxt);
}

template <class T>
MoeForward<T> moe_forward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                          std::span<const T> bias) {
  const I n = m.tokens, H = m.hidden, E = m.experts, k = m.topk, FE = m.expert_ffn,
          SF = m.shared_ffn;
  TPX_CHECK(x.size() == at(n * H), "x of {}", x.size());
  TPX_CHECK(w.router.size() == at(H * E), "router of {}", w.router.size());
  TPX_CHECK(w.w_gate.size() == at(E * H * FE) && w.w_up.size() == at(E * H * FE) &&
                w.w_down.size() == at(E * FE * H),
            "expert weights of {}, {}, {}", w.w_gate.size(), w.w_up.size(), w.w_down.size());
  TPX_CHECK(w.shared_gate.size() == at(H * SF) && w.shared_up.size() == at(H * SF) &&
                w.shared_down.size() == at(SF * H),
            "shared expert weights of {}", w.shared_gate.size());
  MoeForward<T> f;
  f.logits = moe_logits<T>(m, w.router, x);
  f.routing = moe_route<T>(m, f.logits, bias);
  const MoeRouting<T>& r = f.routing;

  f.y.assign(at(n * H), T(0));
  f.gate.assign(at(n * k * FE), T(0));
  f.up.assign(at(n * k * FE), T(0));
  for (I t = 0; t < n; ++t)
    for (I j = 0; j < k; ++j) {
      const I a = t * k + j;
      if (!r.kept[at(a)]) continue;
      const I e = r.expert[at(a)];
      moe_swiglu_forward(x.data() + t * H, w.w_gate.data() + e * H * FE, w.w_up.data() + e * H * FE,
                         w.w_down.data() + e * FE * H, H, FE, r.weight[at(a)],
                         f.gate.data() + a * FE, f.up.data() + a * FE, f.y.data() + t * H);
    }
  if (SF > 0) {
    f.shared_gate.assign(at(n * SF), T(0));
    f.shared_up.assign(at(n * SF), T(0));
    for (I t = 0; t < n; ++t)
      moe_swiglu_forward(x.data() + t * H, w.shared_gate.data(), w.shared_up.data(),
                         w.shared_down.data(), H, SF, T(1), f.shared_gate.data() + t * SF,
                         f.shared_up.data() + t * SF, f.y.data() + t * H);
  }
  f.aux_loss = moe_aux_loss<T>(m, r.score, r.routed_per_expert, n);
  return f;
}

template <class T>
MoeGrads<T> moe_backward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                         const MoeForward<T>& f, std::span<const T> dy) {
  const I n = m.tokens, H = m.hidden, E = m.experts, k = m.topk, FE = m.expert_ffn,
          SF = m.shared_ffn;
  TPX_CHECK(dy.size() == at(n * H) && x.size() == at(n * H), "dy of {}", dy.size());
  const MoeRouting<T>& r = f.routing;
  MoeGrads<T> g;
  g.x.assign(at(n * H), T(0));
  g.w.router.assign(w.router.size(), T(0));
  g.w.w_gate.assign(w.w_gate.size(), T(0));
  g.w.w_up.assign(w.w_up.size(), T(0));
  g.w.w_down.assign(w.w_down.size(), T(0));
  g.w.shared_gate.assign(w.shared_gate.size(), T(0));
  g.w.shared_up.assign(w.shared_up.size(), T(0));
  g.w.shared_down.assign(w.shared_down.size(), T(0));

  // ∂L_aux/∂P_e = W·E·f_e (f_e held constant), and P_e = mean_t q_{t,e}.
  const HostVector<T> dP = moe_aux_grad<T>(m, r.routed_per_expert, n);

  HostVector<T> dweight(at(k));
  for (I t = 0; t < n; ++t) {
    const T* xt = x.data() + t * H;
    const T* dyt = dy.data() + t * H;
    T* dxt = g.x.data() + t * H;
    // The experts: each chosen, served expert's weights and the gradient of its gate weight.
    for (I j = 0; j < k; ++j) {
      const I a = t * k + j;
      dweight[at(j)] = 0;
      if (!r.kept[at(a)]) continue;
      const I e = r.expert[at(a)];
      dweight[at(j)] = moe_swiglu_backward(
          xt, w.w_gate.data() + e * H * FE, w.w_up.data() + e * H * FE,
          w.w_down.data() + e * FE * H, H, FE, r.weight[at(a)], f.gate.data() + a * FE,
          f.up.data() + a * FE, dyt, g.w.w_gate.data() + e * H * FE, g.w.w_up.data() + e * H * FE,
          g.w.w_down.data() + e * FE * H, dxt);
    }
    if (SF > 0)
      moe_swiglu_backward(xt, w.shared_gate.data(), w.shared_up.data(), w.shared_down.data(), H, SF,
                          T(1), f.shared_gate.data() + t * SF, f.shared_up.data() + t * SF, dyt,
                          g.w.shared_gate.data(), g.w.shared_up.data(), g.w.shared_down.data(),
                          dxt);

    moe_router_backward<T>(m, w.router, xt, r.score.data() + t * E, r.expert.data() + t * k,
                           r.weight.data() + t * k, dweight.data(), dP, n, dxt, g.w.router.data());
  }
  return g;
}

#define TPX_MOE_INSTANTIATE(T)                                                                     \
  template void moe_swiglu_forward<T>(const T*, const T*, const T*, const T*, I, I, T, T*, T*,     \
                                      T*);                                                         \
  template T moe_swiglu_backward<T>(const T*, const T*, const T*, const T*, I, I, T, const T*,     \
                                    const T*, const T*, T*, T*, T*, T*);                           \
  template HostVector<T> moe_logits<T>(const MoeShape&, std::span<const T>, std::span<const T>);   \
  template T moe_aux_loss<T>(const MoeShape&, std::span<const T>, std::span<const std::int64_t>,   \
                             std::int64_t);                                                        \
  template HostVector<T> moe_aux_grad<T>(const MoeShape&, std::span<const std::int64_t>,           \
                                         std::int64_t);                                            \
  template void moe_router_backward<T>(const MoeShape&, std::span<const T>, const T*, const T*,    \
                                       const std::int32_t*, const T*, const T*,                    \
                                       std::span<const T>, std::int64_t, T*, T*);                  \
  template MoeRouting<T> moe_route<T>(const MoeShape&, std::span<const T>, std::span<const T>);    \
  template void moe_update_bias<T>(std::span<T>, std::span<const std::int64_t>, double);           \
  template MoeForward<T> moe_forward<T>(const MoeShape&, const MoeWeights<T>&, std::span<const T>, \
                                        std::span<const T>);                                       \
  template MoeGrads<T> moe_backward<T>(const MoeShape&, const MoeWeights<T>&, std::span<const T>,  \
                                       const MoeForward<T>&, std::span<const T>);
TPX_MOE_INSTANTIATE(float)
TPX_MOE_INSTANTIATE(double)
#undef TPX_MOE_INSTANTIATE

}  // namespace tpx
