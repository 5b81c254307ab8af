// 03_sequence_parallel: tensor + sequence parallelism over N ranks (stage 02's linears; norms,
// residuals and loss on S/N tokens per rank; f/g all-gather and reduce-scatter along S), checked
// against stage 01 run in-process.
#include "01_baseline/layers.h"
#include "03_sequence_parallel/layers.h"
#include "03_sequence_parallel/traffic.h"
#include "common/stage.h"
#include "common/tp.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "03_sequence_parallel",
               .summary =
                   "tensor + sequence parallelism: f/g all-gather and reduce-scatter along S"},
      .make = sp::make_sequence_parallel,
      .plan = [](const RunContext& ctx) { return tp_plan(ctx, /*sequence=*/true, sp::traffic); },
      .reference = baseline::run_reference,
  };
  return run_stage(stage, argc, argv);
}
