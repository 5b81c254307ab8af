// Stage 07's flags: --dp, the data-parallel degree of the D × TP mesh (stages 08 and 09, which run
// stage 07 inside them, name this group too), and --fp8-weight-gather (stage 07's own).
//
// defines: tpx::fsdp::DataParallelFlags, tpx::fsdp::default_dp(), tpx::fsdp::Fp8GatherFlags
#pragma once

#include <memory>
#include <optional>

#include "common/cli.h"

namespace tpx::fsdp {

/// --dp D (the "Mesh" section of --help).
class DataParallelFlags : public FlagGroup {
 public:
  /// The data-parallel degree; 0 = the default, mesh_degree() of the stage's newest dimension
  /// (stage 07: 2 when the job has an even number of ranks, at least 4, else 1).
  int dp = 0;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<DataParallelFlags>(); }
  std::optional<MeshFlag> dimension() const override { return MeshFlag::dp; }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  ConfigFields agreed() const override;
};

/// The data-parallel degree stage 07 runs with on `world` ranks when --dp is `dp` (0: not
/// given).
int default_dp(int dp, int world);

/// --fp8-weight-gather (the "FP8" section of --help): FSDP gathers each layer's weight matrices
/// as E4M3 codes with one scale per matrix, agreed over every rank that holds a part of it
/// (fsdp::FsdpTp), instead of fp32; the GEMMs use the gathered codes as they are. Tensorwise
/// only: the row and block recipes quantize a weight along its input dimension for forward and
/// along its output dimension for the input gradient, which one gathered copy cannot serve.
class Fp8GatherFlags : public FlagGroup {
 public:
  bool fp8_weight_gather = false;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<Fp8GatherFlags>(); }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  /// Without --dtype fp8, or under a recipe other than tensorwise: one line naming the flag.
  std::optional<std::string> check(const CLI::App& app, const StageOptions& o) const override;
  ConfigFields agreed() const override;
};

}  // namespace tpx::fsdp
