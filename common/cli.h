// The command line of every stage executable (DESIGN.md, "Contract of every stage executable"),
// on CLI11.
//
// defines: tpx::MeshFlag, tpx::FlagGroup, tpx::StagePrecision, tpx::StageInfo, tpx::StageOptions,
//          tpx::CliOutcome, tpx::parse_stage_cli(), tpx::config_fields(), tpx::mesh_degree(),
//          tpx::mesh_default_words()
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agree.h"
#include "comm/communicator.h"
#include "config.h"
#include "model.h"
#include "presets.h"

namespace CLI {
class App;
}

namespace tpx {

struct StageOptions;

/// A mesh dimension's flag, --dp, --cp, --pp: the dimensions stages 07 (dp), 08 (cp) and 09 (pp)
/// add, whose defaults follow one rule (mesh_degree()).
enum class MeshFlag { dp, cp, pp };

/// Flags a stage adds to its executable's command line, and where their values live: the group
/// adds its own --help section, checks how its flags combine, and lists the values every rank
/// must agree on. A stage names its groups (and those of the stages it runs inside it) in
/// StageInfo::flag_groups and reads the parsed values with StageOptions::flags<G>().
class FlagGroup {
 public:
  virtual ~FlagGroup() = default;
  /// The mesh dimension the group's flags choose, if any: the last such group of a stage names
  /// its newest dimension, whose flag defaults to 2 where the ranks allow (mesh_degree()).
  virtual std::optional<MeshFlag> dimension() const { return std::nullopt; }
  /// Adds the group's flags to `app`, bound to this object; `newest` is the stage's newest mesh
  /// dimension (for mesh_default_words()).
  virtual void add_flags(CLI::App& app, MeshFlag newest) = 0;
  /// After parsing: one sentence for the first of the group's flags that parse on their own but
  /// not together (or not with the common flags, `o`); nothing when they fit.
  virtual std::optional<std::string> check(const CLI::App& /*app*/,
                                           const StageOptions& /*o*/) const {
    return std::nullopt;
  }
  /// --model names a mixture of experts (ModelPreset::moe): the group that trains experts takes
  /// the preset's for its flags the command line did not give, and says so (true); the others
  /// leave it (false), and a stage none of whose groups takes it refuses the model.
  virtual bool take_experts(const PresetExperts& /*moe*/, const CLI::App& /*app*/) { return false; }
  /// After check(): writes what the group's flags say of the model into the config (stage 10's
  /// experts); nothing for a group whose flags only choose how the model is split.
  virtual void configure(BlockConfig& /*c*/) const {}
  /// The group's flags as config_fields() lists them: every rank must give the same.
  virtual ConfigFields agreed() const = 0;
};

/// A --dtype word a stage adds (stage 06's fp8), and what it means, for --help.
struct StagePrecision {
  std::string word;  ///< e.g. "fp8"
  std::string help;  ///< e.g. "the bf16 recipe with the linear layers' GEMMs in ..."
  /// Whether it is the stage's default --dtype (stage 06); else fp32 stays the default (stage 07).
  bool is_default = true;
};

/// What a stage says about itself in --help and in its header.
struct StageInfo {
  std::string name;     ///< executable name, e.g. "01_baseline"
  std::string summary;  ///< one line: the stage's idea
  bool single_device = false;
  /// A precision the stage adds to --dtype (stage 06: fp8, its default); none: fp32 and bf16.
  std::optional<StagePrecision> own_dtype = std::nullopt;
  /// The stage's own flag groups, in the order --help lists them: each call makes one.
  std::vector<std::function<std::shared_ptr<FlagGroup>()>> flag_groups = {};
};

/// A parsed command line.
struct StageOptions {
  BlockConfig config;
  bool check = false;
  std::string dump_dir;     ///< empty: no dump
  std::string json_path;    ///< empty: no summary file
  std::string trace_path;   ///< empty: no trace
  CommOptions comm;         ///< --comm, --comm-timeout, --fault-skip-collective
  std::string model;        ///< --model NAME (common/presets.h); empty: none
  std::string config_file;  ///< --config FILE; empty: none
  /// --dry-run: report a step's FLOPs, bytes and memory from the formulas, compute nothing.
  bool dry_run = false;
  /// The stage's flag groups (StageInfo::flag_groups), as parsed.
  std::vector<std::shared_ptr<const FlagGroup>> flag_groups = {};

  /// The stage's flag group of type G; a new G (its flags' defaults) when the stage has none
  /// (a test's StageOptions).
  /// The newest mesh dimension of the stage: the last flag group's that has one (dp if none).
  MeshFlag newest_mesh_flag() const {
    MeshFlag newest = MeshFlag::dp;
    for (const auto& group : flag_groups)
      if (const auto d = group->dimension()) newest = *d;
    return newest;
  }
  template <class G>
  const G& flags() const {
    for (const auto& group : flag_groups)
      if (const auto* g = dynamic_cast<const G*>(group.get())) return *g;
    static const G defaults;
    return defaults;
  }
};

/// A mesh degree: `given` (the flag's value) unless it is 0, the flag not given; then the value
/// a stage whose newest dimension is `newest` gives `flag` on `world` ranks, what stages 07-09
/// run with and what --help prints (mesh_default_words).
int mesh_degree(int given, MeshFlag newest, MeshFlag flag, int world);
/// mesh_degree()'s default in words, for --help: "1", "2 if the ranks are even, else 1", ...
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
