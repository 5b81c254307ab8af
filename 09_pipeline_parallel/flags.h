// Stage 09's flags: --pp, the pipeline-parallel degree of the P × D × C × TP mesh, the
// micro-batches, the schedule, its virtual stages per rank, the layers of the first and last
// stage, and --print-schedule.
//
// defines: tpx::pp::PipelineFlags
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "common/cli.h"

namespace tpx::pp {

/// The "Pipeline" section of --help.
class PipelineFlags : public FlagGroup {
 public:
  /// --pp P: the pipeline-parallel degree; 0 = the default, 2 when the job's ranks are even,
  /// else 1.
  int pp = 0;
  /// --microbatches M: the parts of the local batch B / D; 0 = the default, the largest of P·V,
  /// P, 1 that divides B / D.
  int microbatches = 0;
  std::string schedule = "1f1b";  ///< --schedule (schedule.h's names)
  int stages_per_rank = 1;        ///< --stages-per-rank V (interleaved-1f1b)
  bool print_schedule = false;    ///< --print-schedule: print the schedule and exit
  /// --first-stage-layers / --last-stage-layers: the blocks of the first virtual stage (rank 0's
  /// first) and of the last (the last rank's last); 0 = not given, the even split's share.
  int first_stage_layers = 0;
  int last_stage_layers = 0;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<PipelineFlags>(); }
  std::optional<MeshFlag> dimension() const override { return MeshFlag::pp; }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  ConfigFields agreed() const override;
};

}  // namespace tpx::pp
