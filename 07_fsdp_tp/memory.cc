#include "07_fsdp_tp/memory.h"

#include <algorithm>

namespace tpx::fsdp {
namespace {

using namespace memory;  // NOLINT: the estimate's vocabulary

/// The language model's ends as FSDP units on a rank (V_p = its ⌈V/T⌉ vocabulary rows, G = D·C):
/// element counts of their unsharded TP-local tensors and of one rank's flat shard.
struct Ends {
  Count table = 0;        ///< E [V_p, H]
  Count table_shard = 0;  ///< ⌈V_p/G⌉·H
  Count head = 0;         ///< the gain [H] and W_out [H, V_p]: H·(1 + V_p)
  Count head_shard = 0;   ///< ⌈H/G⌉·(1 + V_p)
  Count w_out = 0;        ///< H·V_p
};

Ends ends_of(const BlockConfig& c, const Sharding& s) {
  if (!c.lm()) return {};
  const char* what = "the language model's ends";
  const VocabShard v = vocab_shard(c, s);
  const Count shards = Count(s.dp) * Count(s.cp), h = c.hidden;
  const Count columns = sum({v.local, 1}, what);
  return {.table = product({v.local, h}, what),
          .table_shard = product({(v.local + shards - 1) / shards, h}, what),
          .head = product({h, columns}, what),
          .head_shard = product({(h + shards - 1) / shards, columns}, what),
          .w_out = product({h, v.local}, what)};
}

/// The cpu backend's gradient reduce-scatter is MPI_Reduce_scatter_block, which Open MPI runs
/// over more than two ranks as a reduce to the group's rank 0 and a scatter from it: that rank
/// holds the whole reduced input (r) in MPI's own memory (malloc'd, outside the allocator) while
/// the reduce-scatter runs, and for part of it the reduce's receive buffer as well; measured
/// 0.5 to 2.3 · r above the other ranks' peak (stage 08 at D·C 4, H 256, S 128; the reduce's
/// buffer is there only when it meets the peak). No other rank stages it; with two, none does.
/// The largest unit's counts: a layer's, or under --task lm an end's when it is larger (the
/// output layer's at a large V).
///   MPI reduce-scatter staging = r   (rank 0 of a DP×CP group of D·C > 2, cpu)
Count reduce_scatter_staging(const Sharding& s, const LayerElements& layer, const Ends& ends) {
  const char* what = "the MPI reduce-scatter's staging";
  const Count unit = std::max({layer.kept, ends.table_shard, ends.head_shard});
  return product({s.dp, s.cp, unit, kF32}, what);
}

/// FSDP's unsharded ends (--task lm; V_p = the rank's ⌈V/T⌉ vocabulary rows, G = D·C), added to
/// their own terms (which a pipeline stage without that end drops). Each is a moment of its own,
/// when the blocks' backward temporaries and unsharded layers (`blocks`: their two terms) are
/// not alive, so it adds what it exceeds those by:
///   head       while it runs, beside the logits: the unsharded gain [H] and W_out [H, V_p] at
///              the compute copies' bytes (W_out's 2 under the recipe) and their fp32
///              gradients; then, the logits gone, the same with the reduce-scatter's buffer of G
///              shards of ⌈H/G⌉·(1 + V_p) fp32 elements:
///                head = copies + gradients + max(0, buffer − logits)
///                output layer += max(0, head − blocks)
///   embedding  the lookup's gathered shards, G × [⌈V_p/G⌉, H] fp32, and the unsharded table
///              [V_p, H] copied out of them (its backward holds as much: the unsharded gradient
///              and the reduce-scatter's buffer), before the first block's forward and after the
///              last block's backward, when no activation is saved and the head holds nothing:
///                embedding += max(0, gathered + table − (saved activations + blocks + logits
///                                                        + the head's part above))
///   pipeline   stage 09 (P > 1, or M > 1 micro-batches) sums each end's gradients over the
///              micro-batches in an unsharded fp32 accumulator that lives through the step, and
///              looks up or scores a micro-batch while others' activations are saved: the
///              accumulator counted whole, the end's own moment as far as it exceeds a block's
///              backward (an action of its own: a rank runs one at a time):
///                output layer += gradients + max(0, head − blocks)
///                embedding    += gradient + max(0, gathered + table − blocks)
void add_unsharded_ends(MemoryEstimate& e, const MemoryParts& p, const Ends& ends, Count blocks) {
  if (!p.rank.lm()) return;
  const char* what = "FSDP's unsharded ends";
  const Count shards = Count(p.sharding.dp) * Count(p.sharding.cp);
  const Count w_out = p.rank.activations() == DType::bf16 ? kBf16 : kF32;
  const Count copies =
      sum({product({p.rank.hidden, kF32}, what), product({ends.w_out, w_out}, what)}, what);
  const Count grads = product({ends.head, kF32}, what);
  const Count buffer = product({shards, ends.head_shard, kF32}, what);
  const auto logits = Count(e.term(kLmLogitsTerm).bytes);
  const Count head = sum({copies, grads, buffer > logits ? buffer - logits : 0}, what);
  const Count table = product({ends.table, kF32}, what);
  const Count lookup = sum({product({shards, ends.table_shard, kF32}, what), table}, what);
  if (p.sharding.pp > 1 || p.pass.batch < p.rank.batch) {
    // The accumulators live through the step; a lookup or a scoring is an action of its own,
    // which never runs beside a block's backward on the same rank (one action at a time).
    e.term(kLmOutputTerm).bytes +=
        std::uint64_t(sum({grads, head > blocks ? head - blocks : 0}, what));
    e.term(kLmEmbeddingTerm).bytes +=
        std::uint64_t(sum({table, lookup > blocks ? lookup - blocks : 0}, what));
    return;
  }
  const Count head_above = head > blocks ? head - blocks : 0;
  const Count beside =
      sum({Count(e.term("saved activations").bytes), blocks, logits, head_above}, what);
  e.term(kLmOutputTerm).bytes += std::uint64_t(head_above);
  e.term(kLmEmbeddingTerm).bytes += std::uint64_t(lookup > beside ? lookup - beside : 0);
}

class FsdpMemory final : public MemoryDimension {
 public:
  FsdpMemory(bool first_of_group, bool fp8_gather)
      : first_of_group_(first_of_group), fp8_gather_(fp8_gather) {}
  void add_terms(MemoryEstimate& e, const MemoryParts& p) const override {
    if (p.sharding.dp * p.sharding.cp == 1) return;  // one replica: nothing gathered
    const Count layers = unsharded_layers(p.rank, p.sharding, p.layer, p.temporaries, fp8_gather_);
    e.terms.push_back({"unsharded layers (FSDP)", std::uint64_t(layers)});
    const Ends ends = ends_of(p.rank, p.sharding);
    add_unsharded_ends(e, p, ends, sum({p.temporaries, layers}, "the blocks' moment"));
    if (first_of_group_ && p.rank.device == Device::cpu && p.sharding.dp * p.sharding.cp > 2)
      e.terms.push_back({"MPI reduce-scatter staging",
                         std::uint64_t(reduce_scatter_staging(p.sharding, p.layer, ends))});
  }

 private:
  bool first_of_group_, fp8_gather_;
};

}  // namespace

// FSDP's unsharded layers (memory.h). While layer l's backward runs: the unsharded copy of l's
// weights and its fp32 gradients, the gathered buffers of l and of l − 1 below it, prefetched (D·C
// shards each, at the compute copies' bytes: g), and the fp32 buffers of the gradient
// reduce-scatters still in flight (D·C shards each: r), those of l + 1 and l + 2: the layers
// keep at most two in flight, but a layer allocates its own before it waits for the older
// ones. A layer has one below only if l > 0, and as many above as there are:
//   in flight(l) = g · (1 + [l > 0]) + r · min(2, L − 1 − l)
// at its largest at l = 0 or l = 1 (g at one byte an element when the weights travel as E4M3
// codes: --fp8-weight-gather). When l's gradients go out, l's own reduce-scatter buffer
// joins them, but backward's temporaries are gone: the term is the larger of the two moments,
// the second less the temporaries the estimate already counts.
memory::Count unsharded_layers(const BlockConfig& c, const Sharding& s,
                               const memory::LayerElements& layer, memory::Count temporaries,
                               bool fp8_gather) {
  using namespace memory;  // NOLINT: the estimate's vocabulary
  const char* what = "FSDP's unsharded layers";
  const Count shards = s.dp * s.cp;
  const Count weight_bytes = fp8_gather ? 1 : c.bf16_weight_copies() ? kBf16 : kF32;
  const Count gathered = product({shards, layer.kept, weight_bytes}, what);
  const Count reduce_scatter = product({shards, layer.kept, kF32}, what);
  const Count unsharded = product({layer.tp, sum({weight_bytes, kF32}, what)}, what);
  const Count above_0 = std::min<Count>(2, c.layers - 1),
              above_1 = std::min<Count>(2, c.layers - 2);
  const Count in_flight = largest(
      {sum({gathered, product({reduce_scatter, above_0}, what)}, what),
       c.layers >= 2 ? sum({gathered, gathered, product({reduce_scatter, above_1}, what)}, what)
                     : Count{0}});
  const Count during = sum({unsharded, in_flight}, what);
  const Count going_out = sum({during, reduce_scatter}, what);
  return largest({during, going_out > temporaries ? going_out - temporaries : Count{0}});
}

std::shared_ptr<const MemoryDimension> memory_dimension(bool first_of_group, bool fp8_gather) {
  return std::make_shared<FsdpMemory>(first_of_group, fp8_gather);
}

}  // namespace tpx::fsdp
