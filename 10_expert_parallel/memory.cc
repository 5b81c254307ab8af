#include "10_expert_parallel/memory.h"

#include <string>

#include <algorithm>

#include "07_fsdp_tp/memory.h"
#include "10_expert_parallel/traffic.h"
#include "common/moe.h"

namespace tpx::ep {
namespace {

using namespace memory;  // NOLINT: the estimate's vocabulary

class Experts final : public MemoryDimension {
 public:
  Experts(int ep, int dp_index) : ep_(ep), dp_index_(dp_index) {}

  void add_terms(MemoryEstimate& e, const MemoryParts& p) const override {
    const BlockConfig& c = p.rank;
    const MoeConfig& m = c.moe;
    const Count layers = moe_layers(c);
    if (layers == 0) return;
    const char* what = "the experts' bytes";
    const Sharding& s = p.sharding;
    const Count T = s.world, G = Count(s.dp) * Count(s.cp), H = c.hidden, E = m.experts;
    const Count D = s.dp, n = c.seq * p.global.batch / D;  // a replica's tokens, all of S

    // A MoE layer has no dense SwiGLU: its w_gate, w_up [H, F/T] and w_down [F/T, H], each cut
    // on dim 0 over the D·C ranks, leave the shared terms.
    const Count f = c.ffn / T;
    const Count mlp =
        sum({product({2, (H + G - 1) / G, f}, what), product({(f + G - 1) / G, H}, what)}, what);
    const Count dense = product({layers, mlp, kF32}, what);
    for (const char* name : {"parameters", "gradients"}) e.term(name).bytes -= std::uint64_t(dense);
    if (c.optimizer == Optimizer::adamw)
      e.term("optimizer state").bytes -= std::uint64_t(product({dense, 2}, what));
    // Every layer a MoE layer: FSDP's largest unit is a layer without the SwiGLU.
    if (m.every == 1 && G > 1) {
      const Count mlp_tp = product({3, H, f}, what);
      const LayerElements attention{.kept = p.layer.kept - mlp, .tp = p.layer.tp - mlp_tp};
      e.term("unsharded layers (FSDP)").bytes =
          std::uint64_t(fsdp::unsharded_layers(c, s, attention, p.temporaries, false));
    }

    // This rank's experts: the router and the shared ones whole (SF/T of their width), and its
    // E/EP experts at FE/T of theirs, of which each of the D/EP holders keeps 1/(D/EP) (FSDP,
    // padded); gradients and AdamW's moments beside them (the bias too: E floats). Sharded, a
    // MoE layer's backward holds its experts gathered and their whole gradients at once.
    const Count fe = m.expert_ffn / T, sf = m.shared_ffn / T, local = E / ep_;
    const Count holders = Count(s.dp) * Count(s.cp) / ep_;  // EP is cut out of the D·C ranks
    const Count experts = product({3, local, H, fe}, what);
    const Count weights = sum({product({H, E}, what), product({3, H, sf}, what),
                               holders > 1 ? (experts + holders - 1) / holders : experts},
                              what);
    e.terms.push_back({"experts (parameters, gradients, bias)",
                       std::uint64_t(product(
                           {layers, sum({product({2, weights}, what), E}, what), kF32}, what))});
    if (c.optimizer == Optimizer::adamw)
      e.terms.push_back(
          {"experts' optimizer state", std::uint64_t(product({layers, 2, weights, kF32}, what))});
    if (holders > 1)
      e.terms.push_back(
          {"experts gathered (FSDP)", std::uint64_t(product({2, experts, kF32}, what))});
    // Their reduce-scatter stages the whole packed gradients in MPI's memory on the holders'
    // first rank when there are more than two (07_fsdp_tp/memory.cc's reduce_scatter_staging).
    if (holders > 2 && c.device == Device::cpu && dp_index_ / ep_ == 0) {
      const auto staged =
          std::uint64_t(product({(experts + holders - 1) / holders, holders, kF32}, what));
      const std::string name = "MPI reduce-scatter staging";
      if (std::ranges::none_of(e.terms, [&](const MemoryTerm& t) { return t.name == name; }))
        e.terms.push_back({name, 0});
      MemoryTerm& staging = e.term(name);
      staging.bytes = std::max(staging.bytes, staged);
    }

    // Saved activations: a MoE layer keeps no h2, gate, up, s; it keeps its tokens in sequence
    // order [n, H], the logits and scores [n, E], the gate weights [n, K], the rows it received
    // [r, H] with the experts' pre-activations [r, FE/T] twice, the outputs that came back
    // [r', H] and the shared experts' two [n, SF/T], r and r' as balanced routing keeps them.
    const ActivationBytes& b = p.rank_bytes;
    const Count kept_h = (cheap_bytes(c, b) - 2 * b.rows - b.cols_f) / 2;
    const Count swiglu = sum({kept_h, product({3, b.cols_f}, what)}, what);
    // Balanced: each replica assigns ⌈n·K/E⌉ to every expert, which keeps them up to its
    // capacity c in token order (replica q's clamp(c − q·each, 0, each)).
    const Count each = (n * m.topk + E - 1) / E;
    const Count cap = moe_capacity(m.shape(H, p.global.seq * p.global.batch));
    auto kept_of = [&](Count q) { return std::clamp<Count>(cap - q * each, 0, each); };
    const Count group = dp_index_ / ep_ * ep_;  // the EP group's first replica
    Count in = 0;
    for (int q = 0; q < ep_; ++q) in += local * kept_of(group + q);
    const Count out = E * kept_of(dp_index_);
    const Count saved =
        product({sum({product({n, H}, what), product({2, n, E}, what), product({n, m.topk}, what),
                      product({in, H}, what), product({2, in, fe}, what), product({out, H}, what),
                      product({2, n, sf}, what)},
                     what),
                 kF32},
                what);
    // The largest temporaries, where a MoE layer's backward holds more than the block's: while
    // an exchange runs, the rows it sends and receives (S' = out, R = in) twice each (the rows,
    // and the exchange's buffer: the dispatched w·dy rows out and dy rows in, or the dx rows in
    // and out; each is let go once the next step has it), dx and dy of the replica's tokens
    // [n, H], and under TP the gathered dy [n, H] besides.
    const Count moe_temporaries = product(
        {sum({product({2, sum({in, out}, what)}, what), product({T > 1 ? 3 : 2, n}, what)}, what),
         H, kF32},
        what);
    MemoryTerm& temporaries = e.term("largest temporaries");
    temporaries.bytes = std::max<std::uint64_t>(temporaries.bytes, std::uint64_t(moe_temporaries));

    // Under a capacity factor a skewed router can send a rank more rows than balanced routing
    // does, but never more than its E/EP experts' capacity: each keeps at most c of the token
    // group's assignments, nor more than its EP group's tokens can send (each token at most
    // min(K, E/EP) of them). The rows beyond the balanced ones, with the two pre-activations
    // each keeps for its backward, in every MoE layer ("dispatch worst case (capacity)"); the
    // backward's exchange buffers grow with them (twice the rows). Dropless routing has no such
    // bound below every token of the EP group on one rank (the estimate keeps the balanced rows:
    // --json's moe.rows_received_max reports what a run received).
    if (m.capacity_factor > 0) {
      const Count worst =
          std::min(product({local, cap}, what), product({ep_, n, std::min(m.topk, local)}, what));
      if (worst > in)
        e.terms.push_back(
            {"dispatch worst case (capacity)",
             std::uint64_t(
                 product({sum({product({layers, sum({H, product({2, fe}, what)}, what)}, what),
                               product({2, H}, what)},
                              what),
                          worst - in, kF32},
                         what))});
    }

    // (Under a pipeline the base counted one micro-batch's layers, and the pipeline's dimension
    // after this one counts its live layers anew, as dense ones: this term is only a stand-in
    // there, kept from going below zero.)
    MemoryTerm& kept = e.term("saved activations");
    const auto no_swiglu = std::uint64_t(product({layers, swiglu}, what));
    kept.bytes = (kept.bytes > no_swiglu ? kept.bytes - no_swiglu : 0) +
                 std::uint64_t(product({layers, saved}, what));
  }

 private:
  int ep_, dp_index_;
};

}  // namespace

std::shared_ptr<const MemoryDimension> memory_dimension(int ep, int dp_index) {
  return std::make_shared<Experts>(ep, dp_index);
}

}  // namespace tpx::ep
