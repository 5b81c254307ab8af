#include "06_fp8/flags.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "common/check.h"
#include "common/cli_flags.h"

namespace tpx::async_fp8 {

lowp::Recipe Fp8RecipeFlags::recipe() const {
  const std::optional<lowp::Recipe> r = lowp::parse_recipe(word);
  TPX_CHECK(r.has_value(), "--fp8-recipe {} passed CLI11's check but names no recipe", word);
  return *r;
}

void Fp8RecipeFlags::add_flags(CLI::App& app, MeshFlag /*newest*/) {
  app.add_option("--fp8-recipe", word,
                 "the scales' granularity: tensorwise (one scale per tensor, agreed over the "
                 "group), rowwise (one per row of each GEMM operand), block128 (1x128 and "
                 "128x128 blocks), mxfp8 (1x32 blocks, E8M0 power-of-two scales) or nvfp4 (E2M1 "
                 "elements, 1x16 blocks with UE4M3 scales and one agreed fp32 scale per tensor); "
                 "all but tensorwise multiply their dequantized operands in fp32")
      ->check(CLI::IsMember({"tensorwise", "rowwise", "block128", "mxfp8", "nvfp4"}))
      ->capture_default_str()
      ->group("FP8");
  add_number(app, "--fp8-keep-last", keep_last,
             "the last N transformer blocks keep their linear layers out of the recipe: "
             "their GEMMs and activation gathers run in bf16, as --dtype bf16 runs them, "
             "under any --fp8-recipe (NVIDIA's NVFP4 pretraining keeps about 15 % of the "
             "linear layers in BF16, most of them in the last blocks; 0 = every block runs "
             "the recipe)")
      ->group("FP8");
}

std::optional<std::string> Fp8RecipeFlags::check(const CLI::App& /*app*/,
                                                 const StageOptions& o) const {
  const lowp::Recipe r = recipe();
  if (r != lowp::Recipe::tensorwise && !is_fp8(o.config.dtype))
    return fmt::format(
        "--fp8-recipe {}: the recipe of the FP8 GEMMs, which --dtype {} does not run (it runs "
        "under --dtype fp8)",
        word, to_string(o.config.dtype));
  if (keep_last < 0 || keep_last > o.config.layers)
    return fmt::format(
        "--fp8-keep-last {}: the number of last blocks kept out of the recipe must lie in "
        "[0, --layers {}]",
        keep_last, o.config.layers);
  if (keep_last > 0 && !is_fp8(o.config.dtype))
    return fmt::format(
        "--fp8-keep-last {}: keeps blocks out of the FP8 GEMMs, which --dtype {} does not run (it "
        "runs under --dtype fp8)",
        keep_last, to_string(o.config.dtype));
  return std::nullopt;
}

ConfigFields Fp8RecipeFlags::agreed() const {
  return {{"--fp8-recipe", word}, {"--fp8-keep-last", fmt::format("{}", keep_last)}};
}

}  // namespace tpx::async_fp8
