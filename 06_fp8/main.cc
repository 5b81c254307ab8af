// 06_fp8: stage 05 with every GEMM of the seven linear layers in FP8 (E4M3 forward, E5M2
// gradients, per-tensor current scaling agreed over the group) and the all-gathers moving FP8
// bytes; checked against stage 01 (fp32) run in-process.
#include "01_baseline/layers.h"
#include "04_overlap_ring/traffic.h"
#include "05_copy_engine_async_tp/flags.h"
#include "06_fp8/flags.h"
#include "06_fp8/layers.h"
#include "06_fp8/traffic.h"
#include "common/stage.h"
#include "common/tp.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "06_fp8",
               .summary = "stage 05 with FP8 GEMMs (E4M3 forward, E5M2 gradients; one scale "
                          "per tensor agreed over the group, or per row or block: --fp8-recipe) "
                          "and all-gathers of FP8 bytes",
               .own_dtype = StagePrecision{.word = "fp8",
                                           .help = "the bf16 recipe with the linear layers' "
                                                   "GEMMs in E4M3 forward, E5M2 gradients"},
               .flag_groups = {async_tp::AllGatherFlags::make, async_fp8::Fp8RecipeFlags::make}},
      .make = [](const RunContext& ctx) { return async_fp8::make_fp8_async_tp(ctx); },
      // Under --dtype fp32 or bf16 the stage runs as stage 05, and moves stage 05's bytes.
      .plan =
          [](const RunContext& ctx) {
            StagePlan p =
                tp_plan(ctx, /*sequence=*/true,
                        is_fp8(ctx.options.config.dtype) ? async_fp8::traffic : ring::traffic);
            // The recipe's scales: the amax all-reduces, or the scales the gathers carry.
            const auto& flags = ctx.options.flags<async_fp8::Fp8RecipeFlags>();
            const lowp::Recipe r = flags.recipe();
            async_fp8::check_recipe_split(ctx.options.config, ctx.world, r);
            if (is_fp8(ctx.options.config.dtype)) {
              p.traffic = async_fp8::recipe_traffic(ctx.options.config, ctx.world, 0, r,
                                                    async_fp8::Fp8Weights::kept, flags.keep_last);
              if (auto d = async_fp8::recipe_memory_dimension(r))
                p.sharding.dimensions.push_back(std::move(d));  // as the stage's sharding()
            }
            return p;
          },
      // The reference is stage 01 in fp32: what FP8 is measured against.
      .reference =
          [](BlockConfig c, int steps) {
            c.dtype = DType::f32;
            return baseline::run_reference(c, steps);
          },
  };
  return run_stage(stage, argc, argv);
}
