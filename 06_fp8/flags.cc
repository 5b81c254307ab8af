#include "06_fp8/flags.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "common/check.h"

namespace tpx::async_fp8 {

lowp::Recipe Fp8RecipeFlags::recipe() const {
  const std::optional<lowp::Recipe> r = lowp::parse_recipe(word);
  TPX_CHECK(r.has_value(), "--fp8-recipe {} passed CLI11's check but names no recipe", word);
  return *r;
}

void Fp8RecipeFlags::add_flags(CLI::App& app, MeshFlag /*newest*/) {
  app.add_option("--fp8-recipe", word,
                 "the FP8 scales' granularity: tensorwise (one scale per tensor, agreed over the "
                 "group), rowwise, block128, mxfp8 or nvfp4 (common/lowp.h; not run by this "
                 "stage yet)")
      ->check(CLI::IsMember({"tensorwise", "rowwise", "block128", "mxfp8", "nvfp4"}))
      ->capture_default_str()
      ->group("FP8");
}

std::optional<std::string> Fp8RecipeFlags::check(const CLI::App& /*app*/,
                                                 const StageOptions& /*o*/) const {
  if (recipe() != lowp::Recipe::tensorwise)
    return fmt::format(
        "--fp8-recipe {}: this stage multiplies only the tensorwise recipe so far, on either "
        "device (one scale per tensor: --fp8-recipe tensorwise)",
        word);
  return std::nullopt;
}

ConfigFields Fp8RecipeFlags::agreed() const {
  return {{"--fp8-recipe", word}};
}

}  // namespace tpx::async_fp8
