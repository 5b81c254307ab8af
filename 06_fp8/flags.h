// Stage 06's flag: --fp8-recipe, the granularity of the low-precision scales (DESIGN.md,
// "Low-precision recipes"). tensorwise is the stage's recipe, one scale per tensor agreed over the
// group, on either device; rowwise, block128, mxfp8 and nvfp4 (their formats, blocks and scales
// are common/lowp.h's) run on the cpu (06_fp8/layers.h) and are refused with one line on cuda.
//
// defines: tpx::async_fp8::Fp8RecipeFlags
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "common/cli.h"
#include "common/lowp.h"

namespace tpx::async_fp8 {

/// --fp8-recipe (the "FP8" section of --help).
class Fp8RecipeFlags : public FlagGroup {
 public:
  std::string word = "tensorwise";  ///< --fp8-recipe as given (CLI11 checks it names a recipe)

  /// --fp8-recipe as the enum.
  lowp::Recipe recipe() const;

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<Fp8RecipeFlags>(); }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  /// A recipe the stage or its device does not run yet: one line naming the flag (exit 2).
  std::optional<std::string> check(const CLI::App& app, const StageOptions& o) const override;
  ConfigFields agreed() const override;
};

}  // namespace tpx::async_fp8
