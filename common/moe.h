// The mixture-of-experts MLP on the cpu, forward and backward, in plain loops templated on the
// element type: double is the oracle the expert-parallel stage is checked against, float the
// single-process twin. A router (a linear [H, E]) scores every token against E routed experts and
// chooses k of them; each routed expert is a SwiGLU of width FE; the shared experts, if any, see
// every token: NS of width FE are one SwiGLU of width NS·FE (their sum is that SwiGLU with the
// matrices side by side), which is how they are held here.
//
// Routing, for the scores z = x·W_router of one token (z: [E]):
//   softmax (Mixtral):     p = softmax(z); choose the k largest p (+ bias); the gate weights are
//                          the chosen p renormalised to sum 1 (Mixtral's reference code takes a
//                          softmax over the top-k logits, which is the same thing).
//   sigmoid (DeepSeek-V3): s = sigmoid(z); choose the k largest s (+ bias); the gate weights are
//                          the chosen s renormalised to sum 1 (DeepSeek-V3's node-limited group
//                          selection and its routed scaling factor are left out).
// Its float and double buffers are HostVectors (common/host_vector.h): the cpu allocator's bytes.
//
// Ties are broken by the lower expert index, so a routing never depends on the backend. The
// per-expert bias (auxiliary-loss-free balancing) is added to the scores for the choice only; the
// gate weights and the auxiliary loss use the scores without it.
//
// Capacity: with a capacity factor C > 0 each expert takes at most ceil(C·T·k/E) of its
// assignments, in token order (the assignment of token t is kept if fewer than that many tokens
// t' < t chose the same expert); a dropped assignment contributes nothing (the other gate weights
// are not renormalised). C = 0 is dropless.
//
// Auxiliary balance loss (Switch/GShard): L_aux = W·E·Σ_e f_e·P_e, where f_e is the fraction of
// the T·k assignments the router chose for e (before drops; a constant for the gradient) and P_e
// the mean over tokens of e's router probability: p_e for softmax, s_e / Σ_j s_j for sigmoid (the
// normalised affinity of DeepSeek-V3's balance loss). Balanced routing gives L_aux = W.
//
// defines: tpx::moe_detail::at(), tpx::MoeRouter, tpx::MoeShape, tpx::moe_capacity(),
//          tpx::MoeRouting, tpx::moe_route(), tpx::moe_update_bias(), tpx::MoeWeights,
//          tpx::moe_tensors(), tpx::MoeForward, tpx::MoeGrads,
//          tpx::moe_forward(), tpx::moe_backward(), and the pieces they are made of that the
//          expert-parallel layer (moe_ep.h) reuses: tpx::moe_logits(), tpx::moe_swiglu_forward(),
//          tpx::moe_swiglu_backward(), tpx::moe_aux_loss(), tpx::moe_aux_grad(),
//          tpx::moe_router_backward()
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "host_vector.h"

namespace tpx {

namespace moe_detail {
/// An index of the MoE code's buffers (counted in int64, as the shapes are) as a vector's.
inline std::size_t at(std::int64_t i) {
  return static_cast<std::size_t>(i);
}
}  // namespace moe_detail

enum class MoeRouter { softmax, sigmoid };

/// The sizes and rules of one MoE MLP over T tokens.
struct MoeShape {
  std::int64_t tokens = 0;      ///< T
  std::int64_t hidden = 0;      ///< H
  std::int64_t experts = 0;     ///< E, routed experts
  std::int64_t topk = 1;        ///< k, experts chosen per token (1 … E)
  std::int64_t expert_ffn = 0;  ///< FE, the width of every expert's SwiGLU
  std::int64_t shared_ffn = 0;  ///< SF = NS·FE, the shared experts' width; 0: none
  MoeRouter router = MoeRouter::softmax;
  double capacity_factor = 0.0;  ///< C; 0: dropless
  double aux_loss_weight = 0.0;  ///< W of L_aux; 0: no auxiliary loss
};

/// The assignments one expert takes at most: ceil(C·T·k/E), or T (every token) when dropless.
std::int64_t moe_capacity(const MoeShape& m);

/// One routing of T tokens: token t's j-th choice (j = 0 … k−1, by descending selection score).
template <class T>
struct MoeRouting {
  std::vector<std::int32_t> expert;             ///< [T, k] the chosen experts
  HostVector<T> weight;                         ///< [T, k] their gate weights (each row sums 1)
  std::vector<std::uint8_t> kept;               ///< [T, k] 1: served, 0: dropped for capacity
  std::vector<std::int64_t> routed_per_expert;  ///< [E] assignments chosen, before drops
  std::vector<std::int64_t> tokens_per_expert;  ///< [E] assignments served, after drops
  HostVector<T> score;  ///< [T, E] p (softmax) or s (sigmoid), without the bias
};

/// Routes T tokens from their router logits z [T, E]; bias: [E] added to the scores for the
/// choice only, or empty (no bias).
template <class T>
MoeRouting<T> moe_route(const MoeShape& m, std::span<const T> logits, std::span<const T> bias);

/// Auxiliary-loss-free balancing after a step: b_e += rate · sign(mean − count_e), with mean =
/// T·k/E the count of a perfect balance and counts the assignments chosen (routed_per_expert).
template <class T>
void moe_update_bias(std::span<T> bias, std::span<const std::int64_t> counts, double rate);

/// The parameters, all row-major: expert e's matrices at offset e·H·FE. V: a vector of T (a
/// report's copy may hold them outside the allocator: std::vector<T>).
template <class T, class V = HostVector<T>>
struct MoeWeights {
  V router;                  ///< [H, E]
  V w_gate, w_up;            ///< [E, H, FE]
  V w_down;                  ///< [E, FE, H]
  V shared_gate, shared_up;  ///< [H, SF] (empty without shared experts)
  V shared_down;             ///< [SF, H]
};

/// w's seven tensors in MoeWeights' order, as pointers (to const when w is).
template <class W>
auto moe_tensors(W& w) {
  return std::array{&w.router,      &w.w_gate,    &w.w_up,       &w.w_down,
                    &w.shared_gate, &w.shared_up, &w.shared_down};
}

/// The output and what the backward needs.
template <class T>
struct MoeForward {
  HostVector<T> y;  ///< [T, H]
  T aux_loss{};     ///< L_aux (0 when W = 0)
  MoeRouting<T> routing;
  HostVector<T> logits;                  ///< [T, E]
  HostVector<T> gate, up;                ///< [T, k, FE] the routed experts' pre-activations
  HostVector<T> shared_gate, shared_up;  ///< [T, SF]
};

/// The gradients of (the caller's loss + L_aux), the shapes of MoeWeights.
template <class T>
struct MoeGrads {
  HostVector<T> x;  ///< [T, H]
  MoeWeights<T> w;
};

/// y = Σ_j kept·weight_j · expert_{e_j}(x) + shared(x), token by token; x: [T, H].
template <class T>
MoeForward<T> moe_forward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                          std::span<const T> bias);

/// The backward of moe_forward for dy = ∂loss/∂y, with L_aux's own gradient added.
template <class T>
MoeGrads<T> moe_backward(const MoeShape& m, const MoeWeights<T>& w, std::span<const T> x,
                         const MoeForward<T>& f, std::span<const T> dy);

// The pieces of moe_forward/moe_backward, for a layer that runs the experts apart from the router
// (moe_ep.h) with the same arithmetic.

/// The router logits z = x·W_router [T, E] of x [T, H] (T = m.tokens).
template <class T>
HostVector<T> moe_logits(const MoeShape& m, std::span<const T> router, std::span<const T> x);

/// One SwiGLU on one row x [h]: gate = x·Wg, up = x·Wu (both [fe], written), y [h] += a · (silu(gate)
/// ·up)·Wd.
template <class T>
void moe_swiglu_forward(const T* x, const T* wg, const T* wu, const T* wd, std::int64_t h,
                        std::int64_t fe, T a, T* gate, T* up, T* y);

/// Its backward for dout = ∂loss/∂(its output, before the factor a): accumulates the weights'
/// gradients and dx; returns ∂loss/∂a = dout·(its output).
template <class T>
T moe_swiglu_backward(const T* x, const T* wg, const T* wu, const T* wd, std::int64_t h,
                      std::int64_t fe, T a, const T* gate, const T* up, const T* dout, T* dwg,
                      T* dwu, T* dwd, T* dx);

/// The part of L_aux that the m.tokens tokens of `score` [m.tokens, E] carry when all tokens_all
/// tokens chose `routed` [E] assignments: W·E·Σ_e f_e·(Σ_t q_{t,e}) / tokens_all. With
/// m.tokens = tokens_all it is L_aux; over the parts of a split of the tokens it sums to L_aux.
template <class T>
T moe_aux_loss(const MoeShape& m, std::span<const T> score, std::span<const std::int64_t> routed,
               std::int64_t tokens_all);

/// ∂L_aux/∂P_e = W·E·f_e for `routed` [E] assignments of tokens_all tokens (f_e held constant).
template <class T>
HostVector<T> moe_aux_grad(const MoeShape& m, std::span<const std::int64_t> routed,
                           std::int64_t tokens_all);

/// The router's backward for one token x_t [H] with scores `score` [E], choices `expert` [k],
/// gate weights `weight` [k] and dweight [k] = ∂loss/∂(each gate weight) (0 for a dropped one):
/// adds to dx_t [H] and dW_router [H, E], the auxiliary loss through dP (moe_aux_grad) included.
template <class T>
void moe_router_backward(const MoeShape& m, std::span<const T> router, const T* xt, const T* score,
                         const std::int32_t* expert, const T* weight, const T* dweight,
                         std::span<const T> dP, std::int64_t tokens_all, T* dxt, T* drouter);

}  // namespace tpx
