// Stage 07's flags: --dp, the data-parallel degree of the D × TP mesh. Stages 08 and 09, which run
// stage 07 inside them, name this group too.
//
// defines: tpx::fsdp::DataParallelFlags, tpx::fsdp::default_dp()
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

}  // namespace tpx::fsdp
