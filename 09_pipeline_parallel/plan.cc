#include "09_pipeline_parallel/plan.h"

#include <fmt/format.h>

#include "07_fsdp_tp/memory.h"
#include "07_fsdp_tp/traffic.h"
#include "08_context_parallel/memory.h"
#include "common/traffic.h"

namespace tpx::pp {

using cp::CpMethod;
using cp::MeshTraffic;
using pipeline::LayerRange;
using pipeline::PipelineShape;
using pipeline::Transfer;

namespace {

Traffic per_layer_share(Traffic all, const Traffic& none, std::int64_t layers,
                        std::int64_t recomputed) {
  const auto L = std::uint64_t(layers), R = std::uint64_t(recomputed);
  return {(all.payload - none.payload) / L * R, (all.bus - none.bus) / L * R,
          (all.calls - none.calls) / L * R};
}

/// The slice's traffic for one micro-batch on this rank's layers (`micro`: its L_rank layers),
/// with --recompute full's second forwards on the layers of this rank that it recomputes (their
/// global index a multiple of --recompute-every, which mesh_traffic cannot see): the forward's
/// share of a layer, from the traffic with every layer recomputed minus none, times their number.
MeshTraffic recomputed_traffic(const BlockConfig& micro, const Mesh& mesh, CpMethod method,
                               const std::vector<LayerRange>& layers,
                               const std::vector<int>& stages) {
  BlockConfig none = micro, all = micro;
  none.recompute = Recompute::none;
  MeshTraffic t = cp::mesh_traffic(none, mesh.dp, mesh.cp, mesh.tp, method);
  if (micro.recompute != Recompute::full) return t;
  all.recompute_every = 1;
  const MeshTraffic every = cp::mesh_traffic(all, mesh.dp, mesh.cp, mesh.tp, method);
  std::int64_t recomputed = 0;
  for (const int stage : stages) {
    const LayerRange& range = layers[std::size_t(stage)];
    for (int k = 0; k < range.count; ++k) recomputed += micro.recomputes_layer(range.first + k);
  }
  t.tp += per_layer_share(every.tp, t.tp, micro.layers, recomputed);
  t.cp += per_layer_share(every.cp, t.cp, micro.layers, recomputed);
  return t;
}

}  // namespace

std::vector<std::int64_t> layers_of(const PipelineShape& shape,
                                    const std::vector<LayerRange>& layers, int pp_index) {
  std::vector<std::int64_t> held;
  for (const int s : shape.stages_of(pp_index)) {
    const LayerRange& r = layers[std::size_t(s)];
    for (int l = r.first; l < r.first + r.count; ++l) held.push_back(l);
  }
  return held;
}

Sharding pipeline_sharding(Sharding slice, const PipelineMemory& held, int pp) {
  slice.pp = pp;
  slice.dimensions.push_back(memory_dimension(held));
  return slice;
}

Sharding planned_sharding(const Mesh& mesh, CpMethod method, int tp_index, bool dp_cp_first,
                          const PipelineMemory& held, const SliceDimensions& extra) {
  Sharding slice{.rank = tp_index,
                 .world = mesh.tp,
                 .weights = true,
                 .sequence = true,
                 .dp = mesh.dp,
                 .cp = mesh.cp,
                 .dimensions = {fsdp::memory_dimension(dp_cp_first), cp::memory_dimension(method)}};
  slice.dimensions.insert(slice.dimensions.end(), extra.begin(), extra.end());
  return pipeline_sharding(slice, held, mesh.pp);
}

StagePlan pipeline_rank_plan(const BlockConfig& c, const pipeline::Schedule& schedule,
                             const std::vector<LayerRange>& layers, const Mesh& mesh,
                             CpMethod method, const SliceDimensions& slice) {
  const PipelineShape& shape = schedule.shape();
  const PipelineMemory held = pipeline_memory(c, schedule, layers, mesh.pp_index);
  StagePlan p;
  p.sharding = planned_sharding(mesh, method, mesh.tp_index, mesh.dp_cp_index() == 0, held, slice);
  // The checkpoint's cut, as train_pipeline's: the FSDP shard, the layers and the ends it holds.
  p.sharding.dp_cp_index = mesh.dp_cp_index();
  p.sharding.layers = layers_of(shape, layers, mesh.pp_index);
  p.sharding.embedding = mesh.pp_index == 0;
  p.sharding.head = mesh.pp_index == shape.rank_of(shape.stages() - 1);
  // The slice's traffic on this rank's layers, once per micro-batch (the TP and CP bytes of a
  // micro-batch, M times; FSDP's gathers for every micro-batch, its reduce-scatter once).
  BlockConfig mine = c;
  mine.layers = held.layers;
  BlockConfig micro = mine;
  micro.batch = c.batch / shape.microbatches;
  BlockConfig blocks = micro;  // the slice's blocks; the language model's ends come below
  blocks.task = Task::block;
  MeshTraffic t = recomputed_traffic(blocks, mesh, method, layers, shape.stages_of(mesh.pp_index));
  // --task lm: the embedding on the rank of the first stage, the head on the last's, once per
  // micro-batch on its S / C tokens of B / (D·M) sequences.
  const bool first = mesh.pp_index == shape.rank_of(0);
  const bool last = mesh.pp_index == shape.rank_of(shape.stages() - 1);
  BlockConfig ends = micro;
  ends.seq = c.seq / mesh.cp;
  ends.batch = micro.batch / mesh.dp;
  if (first) t.tp += lm_embedding_traffic(ends, mesh.tp, 0, TpLayout::ring);
  if (last) t.tp += lm_head_traffic(ends, mesh.tp, 0, TpLayout::ring);
  const auto m = std::uint64_t(shape.microbatches);
  const Traffic tp{t.tp.payload * m, t.tp.bus * m, t.tp.calls * m};
  const Traffic cp{t.cp.payload * m, t.cp.bus * m, t.cp.calls * m};
  Traffic dp = mesh.dp * mesh.cp > 1
                   ? fsdp::fsdp_traffic(mine, mesh.tp, mesh.dp * mesh.cp, shape.microbatches)
                   : Traffic{};
  dp += lm_grads_traffic(c, mesh.tp, mesh.dp * mesh.cp, first, last, shape.microbatches);
  Traffic pp;
  // The pipeline's messages: every send of the schedule on this rank carries one micro-batch's
  // [S/(C·T), B/(D·M), H] activation (or its gradient); a receive is a call that sends nothing.
  const std::uint64_t message = std::uint64_t(c.seq / (mesh.cp * mesh.tp)) *
                                std::uint64_t(micro.batch / mesh.dp) * std::uint64_t(c.hidden) *
                                std::uint64_t(dtype_size(c.activations()));
  for (const Transfer& x : pipeline::transfers(schedule, mesh.pp_index)) {
    pp.calls += 1;
    if (x.send) {
      pp.payload += message;
      pp.bus += message;
    }
  }
  p.groups = {{.name = "cp", .label = "cp group", .traffic = cp},
              {.name = "pp", .label = "pp group (rank 0)", .traffic = pp},
              {.name = "dp", .label = cp.calls > 0 ? "dp×cp group" : "dp group", .traffic = dp}};
  p.traffic = tp;
  for (const PlanGroup& g : p.groups) p.traffic += g.traffic;
  p.comm = fmt::format("mesh P {} × D {} × CP {} × TP {}, {} with M {} (dry run)", mesh.pp, mesh.dp,
                       mesh.cp, mesh.tp, schedule.name(), shape.microbatches);
  return p;
}

}  // namespace tpx::pp
