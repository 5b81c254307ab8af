// One token's routing and one token's router gradient, written once for every backend: the
// double reference (moe.cc), the cpu ops (cpu/moe_ops.cc) and the CUDA kernels (cuda/moe.cu) call
// these functions, so a routing never depends on where it ran.
//
// Routing (moe.h has the rules): the scores of z [E], softmax or sigmoid; the k largest
// selection scores score + bias, ties to the lower expert index; the gate weights the chosen
// scores over their sum. The choice needs no buffer: the j-th choice is the largest expert, in the
// order (selection score descending, index ascending), that comes after the (j−1)-th; a k·E scan
// that a GPU thread runs in registers, giving std::partial_sort's order with that comparator.
//
// The exponentials are taken in double and rounded once, for float too: CUDA's expf and glibc's
// differ in the last bit, a double exp rounded to float agrees unless the two doubles straddle a
// float's rounding boundary (about once in 2²⁹ values). Everything else is one rounding per
// operation in a fixed order with no product beside a sum (nothing a compiler may fuse into an
// FMA), and fp32 division is IEEE's on both sides (nvcc's default -prec-div=true).
//
// The router's gradient for one token (what moe_router_backward adds to dx and dW_router is this
// dz times x and W_router): with s the scores, w_j the gate weights and dw_j their gradients,
//   ∂/∂s_{e_j} = (dw_j − Σ_i w_i·dw_i) / Σ_K s     (w_j = s_{e_j} / Σ_K s)
//   + the auxiliary loss's dP_e / n (softmax), or (dP_e − Σ_f q_f·dP_f) / (n·Σ s) (sigmoid, q = s / Σ s)
//   dz = softmax's Jacobian s ⊙ (ds − s·ds), or the sigmoid's ds ⊙ s ⊙ (1 − s).
//
// defines: tpx::moe_token::route(), tpx::moe_token::router_dz()
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace tpx::moe_token {

/// e^x in double, rounded once to T.
template <class T>
TPX_HD inline T exp_once(T x) {
  return static_cast<T>(::exp(static_cast<double>(x)));
}

/// Token t's routing: z [E] → score [E] (softmax p or sigmoid s, without the bias), expert [k]
/// and weight [k]. bias: [E] added to the scores for the choice only, or null.
template <class T>
TPX_HD void route(const T* z, const T* bias, std::int64_t E, std::int64_t k, bool sigmoid, T* score,
                  std::int32_t* expert, T* weight) {
  if (!sigmoid) {
    T zmax = z[0];
    for (std::int64_t e = 1; e < E; ++e) zmax = z[e] > zmax ? z[e] : zmax;
    T sum = T(0);
    for (std::int64_t e = 0; e < E; ++e) {
      score[e] = exp_once(T(z[e] - zmax));
      sum = sum + score[e];
    }
    for (std::int64_t e = 0; e < E; ++e) score[e] = score[e] / sum;
  } else {
    for (std::int64_t e = 0; e < E; ++e) score[e] = T(1) / (T(1) + exp_once(T(-z[e])));
  }
  T chosen = T(0);
  std::int64_t prev = -1;
  T prev_sel = T(0);
  for (std::int64_t j = 0; j < k; ++j) {
    std::int64_t best = -1;
    T best_sel = T(0);
    for (std::int64_t e = 0; e < E; ++e) {
      const T sel = bias ? T(score[e] + bias[e]) : score[e];
      // After the previous choice in the order (descending, then ascending index)...
      const bool after = prev < 0 || sel < prev_sel || (sel == prev_sel && e > prev);
      // ... and before every other candidate (a strict > keeps the lower index of a tie).
      if (after && (best < 0 || sel > best_sel)) {
        best = e;
        best_sel = sel;
      }
    }
    expert[j] = static_cast<std::int32_t>(best);
    chosen = chosen + score[best];
    prev = best;
    prev_sel = best_sel;
  }
  for (std::int64_t j = 0; j < k; ++j) weight[j] = score[expert[j]] / chosen;
}

/// ∂loss/∂s_e for one token (the header's first two lines): the gate weights' part, and the
/// auxiliary loss's when dP is not null. `sum`: Σ_e s_e (sigmoid's), `qdq`: Σ_f q_f·dP_f.
template <class T>
TPX_HD inline T dscore(std::int64_t e, const std::int32_t* expert, const T* dweight, std::int64_t k,
                       T chosen, T wdw, const T* dP, bool sigmoid, T n, T sum, T qdq) {
  T d = T(0);
  for (std::int64_t j = 0; j < k; ++j)
    if (expert[j] == e) d = d + (dweight[j] - wdw) / chosen;
  if (dP) d = d + (sigmoid ? (dP[e] - qdq) / (n * sum) : dP[e] / n);
  return d;
}

/// dz [E] = ∂loss/∂z for one token: score [E], expert [k], weight [k], dweight [k] (0 for a
/// dropped choice), dP [E] the auxiliary loss's ∂/∂P (moe_aux_grad) or null, n the tokens the
/// auxiliary loss averages over.
template <class T>
TPX_HD void router_dz(const T* score, const std::int32_t* expert, const T* weight, const T* dweight,
                      const T* dP, std::int64_t E, std::int64_t k, bool sigmoid, std::int64_t n,
                      T* dz) {
  T chosen = T(0), wdw = T(0);
  for (std::int64_t j = 0; j < k; ++j) {
    chosen = chosen + score[expert[j]];
    wdw = wdw + weight[j] * dweight[j];
  }
  T sum = T(0), qdq = T(0);
  if (dP && sigmoid) {
    for (std::int64_t e = 0; e < E; ++e) sum = sum + score[e];
    for (std::int64_t e = 0; e < E; ++e) qdq = qdq + score[e] / sum * dP[e];
  }
  const T tn = T(n);
  auto ds = [&](std::int64_t e) {
    return dscore(e, expert, dweight, k, chosen, wdw, dP, sigmoid, tn, sum, qdq);
  };
  if (!sigmoid) {
    T pdp = T(0);
    for (std::int64_t e = 0; e < E; ++e) pdp = pdp + score[e] * ds(e);
    for (std::int64_t e = 0; e < E; ++e) dz[e] = score[e] * (ds(e) - pdp);
  } else {
    for (std::int64_t e = 0; e < E; ++e) dz[e] = ds(e) * score[e] * (T(1) - score[e]);
  }
}

}  // namespace tpx::moe_token
