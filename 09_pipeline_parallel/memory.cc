#include "09_pipeline_parallel/memory.h"

#include <algorithm>

#include "common/check.h"

namespace tpx::pp {
namespace {

using namespace memory;  // NOLINT: the estimate's vocabulary

/// A pipeline rank keeps, for each (micro-batch, layer) alive at once (the schedule's peak, live),
/// what its layer keeps, plus the one block its recompute makes again (common/memory.cc's table
/// of --recompute):
///   none       saved_layer · live
///   full       x · live + (saved_layer − x) · (live − recomputed pairs) + (saved_layer − x)
///   selective  (saved_layer − cheap) · live + cheap
Count saved_activations(const BlockConfig& c, const PipelineMemory& pp, const ActivationBytes& b) {
  const char* what = "the saved activations' bytes";
  const Count saved_layer = saved_layer_bytes(c, b);
  const Count input = b.stream;
  if (c.recompute == Recompute::selective) {
    const Count cheap = cheap_bytes(c, b);
    return sum({product({saved_layer - cheap, pp.live_layers}, what), cheap}, what);
  }
  if (c.recompute == Recompute::full)
    return sum({product({input, pp.live_layers}, what),
                product({saved_layer - input, pp.live_kept_layers}, what), saved_layer - input},
               what);
  return product({saved_layer, pp.live_layers}, what);
}

/// The pipeline's own buffers:
///   input       the first stage's micro-batches of the input, all M (the live ones are also
///               their first layer's saved x: counted twice, a micro-batch's stream each)
///   messages    the receives posted for this action and the next: two micro-batch streams
///   loss grads  the last stage's dL/dy of each micro-batch waiting for its backward
///   gradients   one micro-batch's gradients of the layer in backward, fp32, before they are
///               added to the step's (zb-h1: those of every micro-batch between its B and W)
///   deferred    zb-h1: what a layer's set-aside dW GEMMs read, per (micro-batch, layer)
///               between B and W, in place of its saved activations: the gathered inputs of
///               the four GEMMs (h, h2 and the two output gradients of the row layers,
///               [S, b, H] each) and their other operands (dq, dk, dv, a; dgate, dup, s)
Count buffers(const PipelineMemory& pp, const MemoryParts& p) {
  const char* what = "the pipeline's buffers";
  const ActivationBytes& b = p.pass_bytes;
  const Count message = b.stream;
  const Count grads_layer = product({p.layer.tp, kF32}, what);
  const Count deferred_layer = sum({product({b.full, 4}, what), b.cols_h, b.cols_kv, b.cols_kv,
                                    b.cols_h, b.cols_f, b.cols_f, b.cols_f, grads_layer},
                                   what);
  const Count saved_layer = saved_layer_bytes(p.rank, b);
  const Count deferred_beyond_saved =
      deferred_layer > saved_layer ? deferred_layer - saved_layer : 0;
  const Count gradients =
      pp.split_backward ? product({deferred_beyond_saved, pp.live_layers}, what) : grads_layer;
  const Count all =
      sum({product({message, 2}, what), product({message, pp.loss_grads}, what), gradients}, what);
  return pp.holds_input ? sum({all, p.rank_bytes.stream}, what) : all;
}

/// FSDP × PP: the unsharded fp32 gradients of the rank's layers, summed over a step's
/// micro-batches before they are reduce-scattered.
Count gradient_accumulators(const BlockConfig& c, const LayerElements& layer) {
  const char* what = "the pipeline's buffers";
  return product({product({layer.tp, kF32}, what), c.layers}, what);
}

/// The host's books of a step, beyond the tensors' bytes (the cpu backend with glibc's malloc,
/// measured with --json's host_peak_bytes − host_baseline_bytes at M up to 16 000):
///   per (micro-batch, layer held): the schedule's actions and transfers, the per-pass records,
///     the step's trace spans, each small tensor's handle, storage and shape; 2.5 KiB, and
///     4.5 KiB on a D·C > 1 slice (its collectives' records and spans)
///   per live (micro-batch, layer) at the schedule's peak: the handles and malloc chunks of the
///     fourteen saved tensors and of the pass that holds them, 5 KiB
/// host per micro-batch = M · L_rank · (2.5 or 4.5 KiB) + live · 5 KiB
Count host_per_microbatch(const BlockConfig& c, const Sharding& s, const PipelineMemory& pp) {
  const char* what = "the pipeline's buffers";
  const Count per_microbatch_layer = s.dp * s.cp > 1 ? 4608 : 2560, per_live_layer = 5120;
  return sum({product({pp.microbatches, c.layers, per_microbatch_layer}, what),
              product({pp.live_layers, per_live_layer}, what)},
             what);
}

/// The set-up streams: every rank generates the whole input and target, [S, B, H] fp32 each (X
/// bytes), before its mesh cuts them; with C > 1 the CP cut copies this rank's S / C rows of one
/// of them twice while both are alive; with C = 1 and D > 1 the FSDP cut copies this replica's
/// B / D columns of the input while both are alive (the target's cut comes after the whole input
/// is gone). The training terms are not alive yet, so the term is what the set-up needs beyond
/// them (zero when training needs more):
///   set-up streams = max(0, 2·X + (C > 1 ? 2·X/C : D > 1 ? X/D : 0) − the training terms)
std::uint64_t setup_streams(const MemoryParts& p, std::uint64_t training) {
  const char* what = "the set-up's streams";
  const Sharding& s = p.sharding;
  const Count x = product({p.global.seq, p.rank.batch, p.rank.hidden, kF32}, what);
  const Count cut = s.cp > 1 ? 2 * (x / s.cp) : s.dp > 1 ? x / s.dp : Count{0};
  const auto need = std::uint64_t(sum({product({x, 2}, what), cut}, what));
  return need > training ? need - training : 0;
}

class PipelineDimension final : public MemoryDimension {
 public:
  explicit PipelineDimension(const PipelineMemory& pp) : pp_(pp) {}

  /// The rank's layers; a pass is one micro-batch of B / (D·M) sequences.
  void cut(BlockConfig& rank, BlockConfig& pass, const Sharding& s) const override {
    TPX_CHECK(pp_.microbatches >= 1 && rank.batch % (s.dp * pp_.microbatches) == 0,
              "memory estimate: a pipeline of {} micro-batches over --batch {}", pp_.microbatches,
              rank.batch);
    rank.layers = pass.layers = pp_.layers;
    pass.batch = rank.batch / pp_.microbatches;
  }

  void add_terms(MemoryEstimate& e, const MemoryParts& p) const override {
    // The live micro-batches' activations; the target's micro-batches on the last stage only;
    // the input's are the pipeline's own buffer (the first stage's), never a bf16 copy's source.
    e.term("saved activations").bytes = std::uint64_t(saved_activations(p.rank, pp_, p.pass_bytes));
    if (!pp_.holds_target && !p.global.lm()) e.term("target").bytes = 0;
    e.remove("fp32 input");
    // --task lm: the embedding on the first stage's rank, the head on the last's.
    if (!pp_.holds_input) e.remove(kLmEmbeddingTerm);
    if (!pp_.holds_target) {
      e.remove(kLmOutputTerm);
      e.remove(kLmLogitsTerm);
    }
    e.terms.push_back({"pipeline buffers", std::uint64_t(buffers(pp_, p))});
    if (p.sharding.dp * p.sharding.cp > 1) {
      // The unsharded gradients of the layer in backward are its accumulator (or the one
      // micro-batch's buffer the pipeline buffers count), not a buffer of their own.
      // (At most the whole term: a slice's dimension before this one may have cut it below a
      // dense layer's, stage 10's for layers without the SwiGLU.)
      MemoryTerm& unsharded = e.term("unsharded layers (FSDP)");
      unsharded.bytes -= std::min(
          unsharded.bytes, std::uint64_t(product({p.layer.tp, kF32}, "FSDP's unsharded layers")));
      e.terms.push_back({"gradient accumulators (FSDP × PP)",
                         std::uint64_t(gradient_accumulators(p.rank, p.layer))});
    }
    e.terms.push_back(
        {"host per micro-batch", std::uint64_t(host_per_microbatch(p.rank, p.sharding, pp_))});
    e.terms.push_back({"set-up streams", setup_streams(p, e.total())});
  }

 private:
  PipelineMemory pp_;
};

}  // namespace

PipelineMemory pipeline_memory(const BlockConfig& c, const pipeline::Schedule& schedule,
                               const std::vector<pipeline::LayerRange>& layers, int pp_index) {
  const pipeline::PipelineShape& shape = schedule.shape();
  PipelineMemory m;
  m.microbatches = shape.microbatches;
  for (const int stage : shape.stages_of(pp_index)) m.layers += layers[std::size_t(stage)].count;
  // The schedule's peaks on this rank: live (micro-batch, layer) activations, and loss
  // gradients waiting for the last stage's backward.
  const int last = shape.stages() - 1;
  std::int64_t live = 0, passes = 0, losses = 0;
  std::int64_t kept = 0;  // the live pairs of layers not fully recomputed
  auto kept_layers = [&](const pipeline::LayerRange& range) {
    std::int64_t n = 0;
    for (int k = 0; k < range.count; ++k) n += c.recomputes_layer(range.first + k) ? 0 : 1;
    return n;
  };
  for (const pipeline::Action& a : schedule.actions(pp_index)) {
    const std::int64_t n = layers[std::size_t(a.stage)].count;
    const std::int64_t n_kept = kept_layers(layers[std::size_t(a.stage)]);
    if (a.phase == pipeline::Phase::forward) {
      live += n;
      kept += n_kept;
      ++passes;
      if (a.stage == last) ++losses;
    } else if (a.phase == pipeline::Phase::weight || !schedule.split_backward()) {
      live -= n;
      kept -= n_kept;
      --passes;
    }
    if (a.phase == pipeline::Phase::backward && a.stage == last) --losses;
    m.live_layers = std::max(m.live_layers, live);
    m.live_kept_layers = std::max(m.live_kept_layers, kept);
    m.live_passes = std::max(m.live_passes, passes);
    m.loss_grads = std::max(m.loss_grads, losses);
  }
  m.split_backward = schedule.split_backward();
  m.holds_input = pp_index == shape.rank_of(0);
  m.holds_target = pp_index == shape.rank_of(last);
  return m;
}

std::shared_ptr<const MemoryDimension> memory_dimension(const PipelineMemory& pipeline) {
  return std::make_shared<PipelineDimension>(pipeline);
}

}  // namespace tpx::pp
