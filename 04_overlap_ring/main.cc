// 04_overlap_ring: stage 03's tensor + sequence parallelism with every all-gather + GEMM and
// GEMM + reduce-scatter decomposed into N ring steps of point-to-point transfers, each overlapped
// with the GEMM of a chunk that has already arrived; checked against stage 01 run in-process.
#include "01_baseline/layers.h"
#include "04_overlap_ring/layers.h"
#include "04_overlap_ring/traffic.h"
#include "common/stage.h"
#include "common/tp.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "04_overlap_ring",
               .summary = "tensor + sequence parallelism with ring-decomposed all-gather + GEMM "
                          "and GEMM + reduce-scatter overlapping the transfers"},
      .make = ring::make_overlap_ring,
      .plan = [](const RunContext& ctx) { return tp_plan(ctx, /*sequence=*/true, ring::traffic); },
      .reference = baseline::run_reference,
  };
  return run_stage(stage, argc, argv);
}
