// 05_copy_engine_async_tp: stage 04's ring-overlapped tensor + sequence parallelism with every
// chunk moved by a copy-engine pull from the peers' symmetric memory, ordered by stream-ordered
// signals with monotonic generations; checked against stage 01 run in-process.
#include "01_baseline/layers.h"
#include "04_overlap_ring/traffic.h"
#include "05_copy_engine_async_tp/flags.h"
#include "05_copy_engine_async_tp/layers.h"
#include "common/stage.h"
#include "common/tp.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "05_copy_engine_async_tp",
               .summary = "tensor + sequence parallelism with all-gather + GEMM and GEMM + "
                          "reduce-scatter overlapped by copy-engine pulls from symmetric memory",
               .flag_groups = {async_tp::AllGatherFlags::make}},
      .make = async_tp::make_copy_engine_async_tp,
      .plan = [](const RunContext& ctx) { return tp_plan(ctx, /*sequence=*/true, ring::traffic); },
      .reference = baseline::run_reference,
  };
  return run_stage(stage, argc, argv);
}
