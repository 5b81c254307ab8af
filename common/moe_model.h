// The mixture of experts as part of the model (stage 10): its parameters drawn by the counter-based
// initialiser, their names in --dump and --check, and the token order the routing's capacity runs
// in.
//
// Ids: layer l's router and experts take the seven ids that Param leaves free in the layer's
// sixteen (TensorId::layer(l, 9 … 15)); expert e's matrices are rows [e·H, (e+1)·H) of one
// [E·H, FE] tensor (w_down: [E·FE, H]), so a rank draws exactly its experts.
//
// Token order: a step's S·B tokens are routed in sequence order, sequence b's S positions after
// sequence b − 1's (t' = b·S + s), not in the [S, B] layout's t = s·B + b. A data-parallel
// replica holds whole sequences, B/D consecutive ones, so the replicas' tokens in rank order are
// the step's tokens in this order and the capacity over them (moe_ep.h) needs only each rank's
// counts: the same drops on every mesh.
//
// defines: tpx::kMoeRouterId, tpx::moe_init(), tpx::moe_tensor_names(), tpx::moe_named(),
//          tpx::to_sequence_major(), tpx::from_sequence_major()
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.h"
#include "moe.h"
#include "named.h"

namespace tpx {

/// The first of the seven ids of layer l's MoE tensors: Param's nine are 0 … 8.
inline constexpr int kMoeRouterId = 9;

/// Layer l's MoE parameters with `count` routed experts from `first` (all E: first 0, count E),
/// the router whole: weights ~ N(0, 0.02²), rounded to float as make_model's. With the experts'
/// width cut over a TP group of `tp` ranks (moe_ep_backward's `tp`), rank `tp_rank`'s part:
/// columns [r·FE/T, (r+1)·FE/T) of every w_gate and w_up, the same rows of every w_down, and so
/// for the shared experts' SF.
template <class T>
MoeWeights<T> moe_init(const BlockConfig& c, std::int64_t layer, std::int64_t first,
                       std::int64_t count, std::int64_t tp_rank = 0, std::int64_t tp = 1);

/// The names of w's tensors in --dump and --check, in moe_named()'s order: "layers.<l>.router",
/// "layers.<l>.experts.<e>.w_gate" / "w_up" / "w_down" for e = first … first + count − 1,
/// "layers.<l>.shared.w_gate" / "w_up" / "w_down" when there are shared experts.
std::vector<std::string> moe_tensor_names(const MoeConfig& m, std::int64_t layer,
                                          std::int64_t first, std::int64_t count);

/// w's tensors under moe_tensor_names(), each expert's three matrices apart, with their shapes:
/// the router [H, E], an expert's w_gate and w_up [H, FE] and w_down [FE, H], the shared
/// experts' [H, SF] and [SF, H].
template <class T, class V>
std::vector<NamedArray<T>> moe_named(const MoeConfig& m, const MoeWeights<T, V>& w,
                                     std::int64_t layer, std::int64_t first);

/// Rows [S, b, H] (t = s·b + j) as [b, S, H] (t' = j·S + s), and back.
template <class T>
HostVector<T> to_sequence_major(const T* rows, std::int64_t seq, std::int64_t b, std::int64_t h);
template <class T>
HostVector<T> from_sequence_major(const T* rows, std::int64_t seq, std::int64_t b, std::int64_t h);

}  // namespace tpx
