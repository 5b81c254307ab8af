// Stage 09's part of the memory estimate: what a pipeline rank holds besides one pass of its
// layers (chapter 9, "Memory"). Its layers and one micro-batch cut the rank's block; the saved
// activations are those of the schedule's live (micro-batch, layer) pairs; the first stage keeps
// the input's micro-batches, the last the target's; and the pipeline's own buffers and host terms
// follow the training terms.
//
// defines: tpx::pp::PipelineMemory, tpx::pp::pipeline_memory(), tpx::pp::memory_dimension()
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "09_pipeline_parallel/schedule.h"
#include "common/memory_terms.h"

namespace tpx::pp {

/// What the estimate needs of a pipeline rank: its layers and its schedule's peaks.
struct PipelineMemory {
  /// The rank's layers of the L (all of its virtual stages), its batch part trained in
  /// `microbatches` parts.
  std::int64_t layers = 0;
  int microbatches = 1;
  /// The most (micro-batch, layer) activations alive at once: the schedule's peak.
  std::int64_t live_layers = 0;
  /// The most (micro-batch, virtual stage) passes alive at once (each of them layers /
  /// stages-per-rank layers of live_layers).
  std::int64_t live_passes = 0;
  /// The most of the live (micro-batch, layer) pairs whose layer keeps its activations whole
  /// between its forward and its backward (all but the layers that --recompute full makes
  /// again, which keep only their input).
  std::int64_t live_kept_layers = 0;
  /// The schedule splits the backward (zb-h1), so the dW GEMMs' inputs of the micro-batches
  /// between their B and W are kept too.
  bool split_backward = false;
  /// The most micro-batches whose loss gradient waits for their backward (the last stage's live
  /// count; 0 elsewhere).
  std::int64_t loss_grads = 0;
  /// The first stage keeps the input's micro-batches, the last the target's.
  bool holds_input = false, holds_target = false;
};

/// What rank `pp_index` of the pipeline holds under `schedule`, whose virtual stages hold
/// `layers`: its layers, and the peaks of the schedule's live activations and waiting loss
/// gradients (a layer that --recompute full makes again keeps only its input).
PipelineMemory pipeline_memory(const BlockConfig& c, const pipeline::Schedule& schedule,
                               const std::vector<pipeline::LayerRange>& layers, int pp_index);

/// The pipeline dimension of the estimate, for Sharding::dimensions (after those of the slice's
/// stages: its set-up term compares with everything before it).
std::shared_ptr<const MemoryDimension> memory_dimension(const PipelineMemory& pipeline);

}  // namespace tpx::pp
