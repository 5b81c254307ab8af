// Stage 08's flags: --cp, the context-parallel degree of the D × C × TP mesh, and --cp-method,
// how attention reaches the other CP ranks' keys. Stage 09, which runs stage 08 inside it, names
// this group too.
//
// defines: tpx::cp::ContextParallelFlags
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "08_context_parallel/traffic.h"
#include "common/cli.h"

namespace tpx::cp {

/// --cp C and --cp-method (the "Mesh" section of --help, after --dp).
class ContextParallelFlags : public FlagGroup {
 public:
  /// The context-parallel degree; 0 = the default, mesh_degree() of the stage's newest
  /// dimension (stage 08: 2 when the job's ranks are even, else 1).
  int cp = 0;
  std::string method_word = "ring";  ///< --cp-method as given (CLI11 checks it is one of three)

  /// --cp-method as the enum.
  CpMethod method() const;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<ContextParallelFlags>(); }
  std::optional<MeshFlag> dimension() const override { return MeshFlag::cp; }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  ConfigFields agreed() const override;
};

}  // namespace tpx::cp
