#include "07_fsdp_tp/flags.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include "06_fp8/flags.h"
#include "common/cli_flags.h"

namespace tpx::fsdp {

void DataParallelFlags::add_flags(CLI::App& app, MeshFlag newest) {
  add_mesh_degree(app, "--dp", dp, "D",
                  "data-parallel degree D: the ranks form a D × TP mesh (TP = ranks / D, TP "
                  "innermost); weights, gradients and optimizer state are sharded over D",
                  MeshFlag::dp, newest, "Mesh");
}

ConfigFields DataParallelFlags::agreed() const {
  return {{"--dp", fmt::format("{}", dp)}};
}

int default_dp(int dp, int world) {
  return mesh_degree(dp, MeshFlag::dp, MeshFlag::dp, world);
}

void Fp8GatherFlags::add_flags(CLI::App& app, MeshFlag /*newest*/) {
  app.add_flag("--fp8-weight-gather", fp8_weight_gather,
               "FSDP gathers each layer's weight matrices as E4M3 codes (a quarter of the fp32 "
               "bytes) with one scale per matrix agreed over the mesh, and the GEMMs use them as "
               "gathered (--dtype fp8, --fp8-recipe tensorwise)")
      ->group("FP8");
}

std::optional<std::string> Fp8GatherFlags::check(const CLI::App& /*app*/,
                                                 const StageOptions& o) const {
  if (!fp8_weight_gather) return std::nullopt;
  if (!is_fp8(o.config.dtype))
    return fmt::format(
        "--fp8-weight-gather: the weights are gathered as the FP8 GEMMs use them, which --dtype "
        "{} does not run (give --dtype fp8)",
        to_string(o.config.dtype));
  if (const auto& recipe = o.flags<async_fp8::Fp8RecipeFlags>();
      recipe.recipe() != lowp::Recipe::tensorwise)
    return fmt::format(
        "--fp8-weight-gather: --fp8-recipe {} quantizes a weight along its input dimension for "
        "forward and along its output dimension for the input gradient, which one gathered copy "
        "cannot serve; it takes --fp8-recipe tensorwise",
        recipe.word);
  return std::nullopt;
}

ConfigFields Fp8GatherFlags::agreed() const {
  return {{"--fp8-weight-gather", fp8_weight_gather ? "given" : "not given"}};
}

}  // namespace tpx::fsdp
