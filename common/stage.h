// The stage executable's main(): MPI start-up, the command line, the header, the step table,
// --check, --dump, --json and --trace. A stage's main.cc names itself, says how it splits the
// block (a Parallelism) and what it checks against, and calls run_stage().
//
// defines: tpx::RunContext, tpx::PlanGroup, tpx::StagePlan, tpx::StageDefinition, tpx::run_stage()
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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

/// A step's traffic over one named mesh group of a stage (--dry-run), under the name of the step
/// row's counter (CommStats::add_group: "dp", "cp", "pp").
struct PlanGroup {
  std::string name;
  std::string label;  ///< --dry-run's words, e.g. "dp×cp group"
  Traffic traffic;
};

/// What one training step holds and moves on this rank, from the config alone (--dry-run):
/// nothing is computed and no tensor allocated.
struct StagePlan {
  Sharding sharding;  ///< the part of the model this rank holds (as the Parallelism's)
  Traffic traffic;    ///< a step's communication, every group together (as the step row's)
  std::string comm;   ///< the header's words for the groups
  /// The parts of `traffic` over the stage's named mesh groups, in the order --dry-run prints
  /// them; what they leave is the TP group's.
  std::vector<PlanGroup> groups = {};

  /// The part over the group named `name`; zeros when the plan has none.
  Traffic group(std::string_view name) const {
    for (const PlanGroup& g : groups)
      if (g.name == name) return g.traffic;
    return {};
  }
};

struct StageDefinition {
  StageInfo info;
  /// Builds this rank's Parallelism. Throws tpx::ConfigError (same on every rank) for a config
  /// the stage cannot split; that becomes a one-line error and exit code 2.
  std::function<std::unique_ptr<Parallelism>(const RunContext&)> make;
  /// --dry-run's plan of this rank (the stage's traffic.h formulas). Throws tpx::ConfigError for a
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
  /// A flag of the stage's own that asks for a text instead of a run (stage 09's
  /// --print-schedule): the text rank 0 prints before the stage exits; nothing when the flag is
  /// not given and the stage runs.
  std::function<std::optional<std::string>(const RunContext&)> answer_instead = {};
};

/// Steps the --check compares losses for: losses after 0..3 SGD updates (fewer if --steps is
/// smaller).
inline constexpr int kCheckSteps = 4;

/// The whole executable. Returns the process exit code.
int run_stage(const StageDefinition& stage, int argc, char** argv);

}  // namespace tpx
