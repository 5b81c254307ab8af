#include "07_fsdp_tp/memory.h"

namespace tpx::fsdp {
namespace {

using namespace memory;  // NOLINT: the estimate's vocabulary

/// FSDP's unsharded layers. While layer l's backward runs: the gathered buffers of l and of
/// l − 1 below it, prefetched (D shards each, at the compute copies' bytes: g), the unsharded
/// copy of l's weights and its fp32 gradients, and the fp32 buffer of l + 1's gradient
/// reduce-scatter still in flight (D shards: r); a layer has one below only if l > 0 and one
/// above only if l < L − 1. When l's gradients go out, l's own reduce-scatter buffer joins
/// them, but backward's temporaries are gone: the term is the larger of the two moments, the
/// second less the temporaries the estimate already counts.
Count unsharded_layers(const BlockConfig& c, const Sharding& s, const LayerElements& layer,
                       Count temporaries) {
  const char* what = "FSDP's unsharded layers";
  const Count shards = s.dp * s.cp;
  const Count weight_bytes = c.bf16_weight_copies() ? kBf16 : kF32;
  const Count gathered = product({shards, layer.kept, weight_bytes}, what);
  const Count reduce_scatter = product({shards, layer.kept, kF32}, what);
  const Count unsharded = product({layer.tp, sum({weight_bytes, kF32}, what)}, what);
  const Count in_flight =
      c.layers >= 3 ? sum({gathered, gathered, reduce_scatter}, what)
      : c.layers == 2
          ? largest({sum({gathered, gathered}, what), sum({gathered, reduce_scatter}, what)})
          : gathered;
  const Count during = sum({unsharded, in_flight}, what);
  const Count going_out = sum({during, reduce_scatter}, what);
  return largest({during, going_out > temporaries ? going_out - temporaries : Count{0}});
}

class FsdpMemory final : public MemoryDimension {
 public:
  void add_terms(MemoryEstimate& e, const MemoryParts& p) const override {
    if (p.sharding.dp * p.sharding.cp == 1) return;  // one replica: nothing gathered
    e.terms.push_back(
        {"unsharded layers (FSDP)",
         std::uint64_t(unsharded_layers(p.rank, p.sharding, p.layer, p.temporaries))});
  }
};

}  // namespace

std::shared_ptr<const MemoryDimension> memory_dimension() {
  return std::make_shared<FsdpMemory>();
}

}  // namespace tpx::fsdp
