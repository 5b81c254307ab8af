// Stage 06's flags: --fp8-recipe, the granularity of the low-precision scales (DESIGN.md,
// "Low-precision recipes"). tensorwise is the stage's recipe, one scale per tensor agreed over the
// group, on either device; rowwise, block128, mxfp8 and nvfp4 (their formats, blocks and scales
// are common/lowp.h's) run on the cpu (06_fp8/layers.h) and are refused with one line on cuda.
// And --fp8-keep-last N: the last N blocks' linear layers run no recipe at all (the GEMMs of the
// bf16 recipe the FP8 one runs inside), as NVIDIA's NVFP4 pretraining keeps its last blocks in
// higher precision.
//
// defines: tpx::async_fp8::Fp8RecipeFlags
#pragma once

#include <cstdint>
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
  /// --fp8-keep-last N: blocks L − N … L − 1 run their GEMMs unquantized (0: every block runs
  /// the recipe).
  int keep_last = 0;

  /// --fp8-recipe as the enum.
  lowp::Recipe recipe() const;
  /// Whether block `layer` of `layers` runs the recipe (it is not one of the last keep_last).
  bool quantizes(std::int64_t layer, std::int64_t layers) const {
    return layer < layers - keep_last;
  }

  static std::shared_ptr<FlagGroup> make() { return std::make_shared<Fp8RecipeFlags>(); }
  void add_flags(CLI::App& app, MeshFlag newest) override;
  /// A recipe the stage or its device does not run yet, or --fp8-keep-last outside [0, L] or
  /// without FP8 GEMMs: one line naming the flag (exit 2).
  std::optional<std::string> check(const CLI::App& app, const StageOptions& o) const override;
  ConfigFields agreed() const override;
  /// BlockConfig::fp8_keep_last, for the memory estimate.
  void configure(BlockConfig& c) const override { c.fp8_keep_last = keep_last; }
};

}  // namespace tpx::async_fp8
