// 07_fsdp_tp: the ranks as a D × TP mesh; stage 05's copy-engine async TP inside each TP group,
// and across the DP groups the batch split, the parameters, gradients and optimizer state sharded
// (FSDP2 / ZeRO-3), each layer's weights all-gathered just in time with a prefetch and its
// gradients reduce-scattered while backward goes on; checked against stage 01 run in-process
// on the whole model and the whole batch.
#include "01_baseline/layers.h"
#include "05_copy_engine_async_tp/flags.h"
#include "07_fsdp_tp/flags.h"
#include "07_fsdp_tp/layers.h"
#include "common/stage.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "07_fsdp_tp",
               .summary = "a D × TP mesh: stage 05's async TP in each TP group, the batch split "
                          "and the parameters, gradients and optimizer state sharded over DP "
                          "(FSDP), weights gathered just in time, gradients reduce-scattered",
               .flag_groups = {fsdp::DataParallelFlags::make, async_tp::AllGatherFlags::make}},
      .make = fsdp::make_fsdp_tp,
      .plan = fsdp::plan_fsdp_tp,
      .reference = baseline::run_reference,
  };
  return run_stage(stage, argc, argv);
}
