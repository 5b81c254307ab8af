// Stage 05's flag: --all-gather, what runs the copy-engine transport's all-gathers. Stage 06, which
// runs stage 05's transport, names this group too.
//
// defines: tpx::async_tp::AllGatherPath, tpx::async_tp::to_string(),
//          tpx::async_tp::AllGatherFlags
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "common/cli.h"

namespace tpx::async_tp {

/// What runs a copy-engine stage's all-gathers (--all-gather).
enum class AllGatherPath {
  pulls,          ///< the hand-built pulls from symmetric memory (copy_engine.h)
  nccl_zero_cta,  ///< NCCL's copy-engine all-gather on a registered window (common/comm/zero_cta.h)
};
const char* to_string(AllGatherPath p);

/// --all-gather (the "Copy engine" section of --help).
class AllGatherFlags : public FlagGroup {
 public:
  std::string word = "pulls";  ///< --all-gather as given (CLI11 checks it is one of two)

  /// --all-gather as the enum.
  AllGatherPath path() const;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<AllGatherFlags>(); }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  /// NCCL's all-gather moves GPU memory: refused on the cpu.
  std::optional<std::string> check(const CLI::App& app, const StageOptions& o) const override;
  ConfigFields agreed() const override;
};

}  // namespace tpx::async_tp
