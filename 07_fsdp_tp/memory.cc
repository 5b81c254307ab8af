#include "07_fsdp_tp/memory.h"

#include <algorithm>

namespace tpx::fsdp {
namespace {

using namespace memory;  // NOLINT: the estimate's vocabulary

/// FSDP's unsharded layers. While layer l's backward runs: the unsharded copy of l's weights
/// and its fp32 gradients, the gathered buffers of l and of l − 1 below it, prefetched (D·C
/// shards each, at the compute copies' bytes: g), and the fp32 buffers of the gradient
/// reduce-scatters still in flight (D·C shards each: r), those of l + 1 and l + 2: the layers
/// keep at most two in flight, but a layer allocates its own before it waits for the older
/// ones. A layer has one below only if l > 0, and as many above as there are:
///   in flight(l) = g · (1 + [l > 0]) + r · min(2, L − 1 − l)
/// at its largest at l = 0 or l = 1. When l's gradients go out, l's own reduce-scatter buffer
/// joins them, but backward's temporaries are gone: the term is the larger of the two moments,
/// the second less the temporaries the estimate already counts.
Count unsharded_layers(const BlockConfig& c, const Sharding& s, const LayerElements& layer,
                       Count temporaries) {
  const char* what = "FSDP's unsharded layers";
  const Count shards = s.dp * s.cp;
  const Count weight_bytes = c.bf16_weight_copies() ? kBf16 : kF32;
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

/// The cpu backend's gradient reduce-scatter is MPI_Reduce_scatter_block, which Open MPI runs
/// over more than two ranks as a reduce to the group's rank 0 and a scatter from it: that rank
/// holds the whole reduced input (r) in MPI's own memory (malloc'd, outside the allocator) while
/// the reduce-scatter runs, and for part of it the reduce's receive buffer as well; measured
/// 0.5 to 2.3 · r above the other ranks' peak (stage 08 at D·C 4, H 256, S 128; the reduce's
/// buffer is there only when it meets the peak). No other rank stages it; with two, none does.
///   MPI reduce-scatter staging = r   (rank 0 of a DP×CP group of D·C > 2, cpu)
Count reduce_scatter_staging(const Sharding& s, const LayerElements& layer) {
  const char* what = "the MPI reduce-scatter's staging";
  return product({s.dp, s.cp, layer.kept, kF32}, what);
}

class FsdpMemory final : public MemoryDimension {
 public:
  explicit FsdpMemory(bool first_of_group) : first_of_group_(first_of_group) {}
  void add_terms(MemoryEstimate& e, const MemoryParts& p) const override {
    if (p.sharding.dp * p.sharding.cp == 1) return;  // one replica: nothing gathered
    e.terms.push_back(
        {"unsharded layers (FSDP)",
         std::uint64_t(unsharded_layers(p.rank, p.sharding, p.layer, p.temporaries))});
    if (first_of_group_ && p.rank.device == Device::cpu && p.sharding.dp * p.sharding.cp > 2)
      e.terms.push_back({"MPI reduce-scatter staging",
                         std::uint64_t(reduce_scatter_staging(p.sharding, p.layer))});
  }

 private:
  bool first_of_group_;
};

}  // namespace

std::shared_ptr<const MemoryDimension> memory_dimension(bool first_of_group) {
  return std::make_shared<FsdpMemory>(first_of_group);
}

}  // namespace tpx::fsdp
