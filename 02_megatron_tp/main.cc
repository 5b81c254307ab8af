// 02_megatron_tp: Megatron tensor parallelism over N ranks (column-parallel QKV / gate / up,
// row-parallel O / down, all-reduces in f and g), checked against stage 01 run in-process.
#include "01_baseline/layers.h"
#include "02_megatron_tp/layers.h"
#include "02_megatron_tp/traffic.h"
#include "common/stage.h"
#include "common/tp.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "02_megatron_tp",
               .summary =
                   "Megatron tensor parallelism: column/row-parallel linears, f/g all-reduce"},
      .make = megatron::make_megatron,
      .plan =
          [](const RunContext& ctx) { return tp_plan(ctx, /*sequence=*/false, megatron::traffic); },
      .reference = baseline::run_reference,
  };
  return run_stage(stage, argc, argv);
}
