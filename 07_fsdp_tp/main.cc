// 07_fsdp_tp: the ranks as a D × TP mesh; stage 05's copy-engine async TP inside each TP group,
// and across the DP groups the batch split, the parameters, gradients and optimizer state sharded
// (FSDP2 / ZeRO-3), each layer's weights all-gathered just in time with a prefetch and its
// gradients reduce-scattered while backward goes on; under --dtype fp8 stage 06's FP8 GEMMs
// (every --fp8-recipe) inside each TP group; checked against stage 01 run in-process on the
// whole model and the whole batch (fp32 under fp8; a recipe's emulation in double under the
// row and block recipes).
#include "01_baseline/layers.h"
#include "05_copy_engine_async_tp/flags.h"
#include "06_fp8/flags.h"
#include "07_fsdp_tp/flags.h"
#include "07_fsdp_tp/layers.h"
#include "common/stage.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "07_fsdp_tp",
               .summary =
                   "a D × TP mesh: stage 05's async TP (stage 06's FP8 GEMMs under --dtype fp8) "
                   "in each TP group, the batch split "
                   "and the parameters, gradients and optimizer state sharded over DP "
                   "(FSDP), weights gathered just in time, gradients reduce-scattered",
               .own_dtype = StagePrecision{.word = "fp8",
                                           .help = "stage 06's FP8 GEMMs in each TP group "
                                                   "(--fp8-recipe), the weights gathered fp32",
                                           .is_default = false},
               .flag_groups = {fsdp::DataParallelFlags::make, async_tp::AllGatherFlags::make,
                               async_fp8::Fp8RecipeFlags::make, fsdp::Fp8GatherFlags::make}},
      .make = fsdp::make_fsdp_tp,
      .plan = fsdp::plan_fsdp_tp,
      // FP8 is measured against the fp32 reference, as stage 06's is.
      .reference =
          [](BlockConfig c, int steps) {
            if (is_fp8(c.dtype)) c.dtype = DType::f32;
            return baseline::run_reference(c, steps);
          },
  };
  return run_stage(stage, argc, argv);
}
