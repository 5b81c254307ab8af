// The stage executable's main(): MPI start-up, the command line, the header, the step table,
// --check, --dump, --json and --trace. A stage's main.cc names itself, says how it splits the
// block (a Parallelism) and what it checks against, and calls run_stage().
//
// defines: tpx::RunContext, tpx::StagePlan, tpx::StageDefinition, tpx::run_stage()
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "check.h"
#include "cli.h"
#include "parallel.h"
#include "reference.h"
#include "trace.h"
#include "traffic.h"
#include "trainer.h"

namespace tpx {

/// What a stage's factory gets to build its Parallelism.
struct RunContext {
  const StageOptions& options;
  int rank = 0;
  int world = 1;
  Trace& trace;
};

/// What one training step holds and moves on this rank, from the config alone (--dry-run):
/// nothing is computed and no tensor allocated.
struct StagePlan {
  Sharding sharding;   ///< the part of the model this rank holds (as the Parallelism's)
  Traffic traffic;     ///< a step's communication, every group together (as the step row's)
  Traffic dp_traffic;  ///< the part over the data-parallel group (stage 07), else zero
  std::string comm;    ///< the header's words for the groups
  /// The part over the context-parallel group (stage 08), else zero; the DP part is then FSDP's
  /// over the merged DP×CP group.
  Traffic cp_traffic = {};
  /// The part over the pipeline-parallel group (stage 09's messages between stages), else zero.
  Traffic pp_traffic = {};
};

struct StageDefinition {
  StageInfo info;
  /// Builds this rank's Parallelism. Throws tpx::ConfigError (same on every rank) for a config
  /// the stage cannot split; that becomes a one-line error and exit code 2.
  std::function<std::unique_ptr<Parallelism>(const RunContext&)> make;
  /// --dry-run's plan of this rank (common/traffic.h's formulas). Throws tpx::ConfigError for a
  /// config the stage cannot split, as `make` does.
  std::function<StagePlan(const RunContext&)> plan;
  /// The reference --check compares against, run in-process on rank 0 for `steps` steps.
  std::function<ReferenceRun(const BlockConfig&, int steps)> reference;
  /// fp32 tolerance of --check (relative to each tensor's largest magnitude).
  double rtol = 1e-5;
  /// The training loop (common/trainer.h's train(), unless the stage runs its own: stage 09's
  /// pipeline over micro-batches).
  std::function<TrainResult(const BlockConfig&, Parallelism&, bool snapshot, Trace&,
                            const std::function<void(const StepRow&)>&)>
      train = tpx::train;
  /// --print-schedule (stage 09): the text printed by rank 0 before the stage exits.
  std::function<std::string(const RunContext&)> print_schedule = {};
};

/// Steps the --check compares losses for: losses after 0..3 SGD updates (fewer if --steps is
/// smaller).
inline constexpr int kCheckSteps = 4;

/// The whole executable. Returns the process exit code.
int run_stage(const StageDefinition& stage, int argc, char** argv);

}  // namespace tpx
