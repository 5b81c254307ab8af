// Stage 09's --dry-run arithmetic for one rank of a P × D × C × T mesh, without a job: the part
// of the model it holds (its layers, the schedule's peak of live activations, the slice's and the
// pipeline's dimensions of the memory estimate) and a step's bytes on each of its groups. Pure
// formulas: the stage's plan (pipeline.cc) and tools/tpx_project call the same function.
//
// defines: tpx::pp::SliceDimensions, tpx::pp::layers_of(), tpx::pp::pipeline_sharding(),
//          tpx::pp::planned_sharding(), tpx::pp::pipeline_rank_plan()
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "08_context_parallel/traffic.h"
#include "09_pipeline_parallel/memory.h"
#include "09_pipeline_parallel/schedule.h"
#include "common/mesh.h"
#include "common/stage.h"

namespace tpx::pp {

/// The slice's own dimensions of the memory estimate beyond FSDP's and CP's (stage 10's experts),
/// before the pipeline's.
using SliceDimensions = std::vector<std::shared_ptr<const MemoryDimension>>;

/// The layers pipeline rank `pp_index` holds, in the order it holds them: those of each of its
/// virtual stages (`layers`: every virtual stage's), as indices into the whole model.
std::vector<std::int64_t> layers_of(const pipeline::PipelineShape& shape,
                                    const std::vector<pipeline::LayerRange>& layers, int pp_index);

/// `slice` (a pipeline stage's ranks' sharding) with the pipeline's dimension, last.
Sharding pipeline_sharding(Sharding slice, const PipelineMemory& held, int pp);

/// The estimate's sharding of a rank (TP index `tp_index`, the first of its D·C group or not)
/// that holds `held` of the pipeline: as the slice's sharding() (stage 07's FSDP, then 08's CP,
/// then `extra`), the pipeline's dimension last.
Sharding planned_sharding(const Mesh& mesh, cp::CpMethod method, int tp_index, bool dp_cp_first,
                          const PipelineMemory& held, const SliceDimensions& extra = {});

/// The plan of the rank at `mesh`'s coordinates (its pp_index, dp_index, cp_index, tp_index; the
/// groups themselves are not used) under `schedule`, whose virtual stages hold `layers`: its
/// sharding (the slice's dimensions `slice`, the checkpoint's cut) and a step's bytes: the TP and
/// CP bytes of the rank's layers once per micro-batch (08_context_parallel/traffic.h, the
/// language model's ends on the first and last stage's rank), FSDP's gathers for every
/// micro-batch and its reduce-scatter once (over D·C), and the pipeline's messages. Its groups:
/// "cp", "pp", "dp"; what they leave is the TP group's.
StagePlan pipeline_rank_plan(const BlockConfig& c, const pipeline::Schedule& schedule,
                             const std::vector<pipeline::LayerRange>& layers, const Mesh& mesh,
                             cp::CpMethod method, const SliceDimensions& slice = {});

}  // namespace tpx::pp
