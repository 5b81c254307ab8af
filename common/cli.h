// The command line of every stage executable (DESIGN.md, "Contract of every stage executable"),
// on CLI11.
//
// defines: tpx::StageInfo, tpx::AllGatherPath, tpx::StageOptions, tpx::CliOutcome,
//          tpx::parse_stage_cli(), tpx::config_fields()
#pragma once

#include <optional>
#include <string>

#include "agree.h"
#include "comm/communicator.h"
#include "config.h"
#include "model.h"

namespace tpx {

/// What a stage says about itself in --help and in its header.
struct StageInfo {
  std::string name;     ///< executable name, e.g. "01_baseline"
  std::string summary;  ///< one line: the stage's idea
  bool single_device = false;
  /// Moves chunks with the copy engine (stages 05, 06): offers --all-gather.
  bool copy_engine = false;
  /// Runs the linear layers in FP8 (stage 06): offers --dtype fp8, its default.
  bool fp8 = false;
  /// Lays the ranks out as a DP × TP mesh (stage 07): offers --dp.
  bool mesh = false;
  /// Splits the sequence over a CP dimension of the mesh (stage 08): offers --cp, --cp-method.
  bool context_parallel = false;
  /// Splits the layers over a PP dimension of the mesh (stage 09): offers --pp, --microbatches,
  /// --schedule, --stages-per-rank and --print-schedule.
  bool pipeline = false;
};

const char* to_string(CpMethod m);

/// What runs a copy-engine stage's all-gathers (--all-gather).
enum class AllGatherPath {
  pulls,  ///< the hand-built pulls from symmetric memory (05_copy_engine_async_tp/copy_engine.h)
  nccl_zero_cta,  ///< NCCL's copy-engine all-gather on a registered window (common/comm/zero_cta.h)
};
const char* to_string(AllGatherPath p);

/// A parsed command line.
struct StageOptions {
  BlockConfig config;
  bool check = false;
  std::string dump_dir;    ///< empty: no dump
  std::string json_path;   ///< empty: no summary file
  std::string trace_path;  ///< empty: no trace
  CommOptions comm;        ///< --comm, --comm-timeout, --fault-skip-collective
  AllGatherPath all_gather = AllGatherPath::pulls;  ///< --all-gather (copy-engine stages)
  /// --dp D (mesh stages): the data-parallel degree; 0 = the default, 2 when the job has an even
  /// number of ranks, at least 4, else 1 (default_dp()).
  int dp = 0;
  std::string model;        ///< --model NAME (common/presets.h); empty: none
  std::string config_file;  ///< --config FILE; empty: none
  /// --dry-run: report a step's FLOPs, bytes and memory from the formulas, compute nothing.
  bool dry_run = false;
  /// --cp C (stage 08): the context-parallel degree; 0 = the default, 2 when the job's ranks
  /// are even, else 1.
  int cp = 0;
  CpMethod cp_method = CpMethod::ring;  ///< --cp-method
  /// --pp P (stage 09): the pipeline-parallel degree; 0 = the default, 2 when the job's ranks
  /// are even, else 1.
  int pp = 0;
  /// --microbatches M (stage 09): the parts of the local batch B / D; 0 = the default, the
  /// largest of P·V, P, 1 that divides B / D.
  int microbatches = 0;
  std::string schedule = "1f1b";  ///< --schedule (09_pipeline_parallel/schedule.h's names)
  int stages_per_rank = 1;        ///< --stages-per-rank V (interleaved-1f1b)
  bool print_schedule = false;    ///< --print-schedule: print the schedule and exit
};

/// The data-parallel degree stage 07 runs with on `world` ranks when --dp is `dp` (0: not
/// given).
int default_dp(int dp, int world);

/// A mesh dimension's flag: --dp, --cp, --pp.
enum class MeshFlag { dp, cp, pp };
/// The dimension a stage adds (07 dp, 08 cp, 09 pp): its flag's default is 2 where the ranks
/// allow, every other dimension's 1 (DESIGN.md's rule).
MeshFlag newest_dimension(const StageInfo& info);
/// The value a stage whose newest dimension is `newest` gives `flag` on `world` ranks when the
/// flag is not given; what stages 07-09 run with and what --help prints (mesh_default_words).
int mesh_default(MeshFlag newest, MeshFlag flag, int world);
/// mesh_default()'s rule in words, for --help: "1", "2 if the ranks are even, else 1", ...
std::string mesh_default_words(MeshFlag newest, MeshFlag flag);

/// Either options to run with, or a message to print and an exit code (help: 0, error: 2).
struct CliOutcome {
  std::optional<StageOptions> options;
  std::string message;
  int exit_code = 0;
};

/// Parses and validates argv. Never throws and never exits: the caller prints and returns.
CliOutcome parse_stage_cli(const StageInfo& info, int argc, char** argv);

/// The flags every rank must agree on: those that shape the computation or decide which
/// collectives run (sizes, steps, lr, seed, device, dtype, communicator, --check, whether
/// --dump / --trace are given), plus the stage's name. Not --json's path (only rank 0 writes it).
ConfigFields config_fields(const StageInfo& info, const StageOptions& o);

}  // namespace tpx
