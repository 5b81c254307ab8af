// 01_baseline: the block on one device, forward and backward by hand, checked against the plain
// double-precision reference in common/reference.cc.
#include "01_baseline/layers.h"
#include "common/stage.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "01_baseline",
               .summary = "single device, the reference block",
               .single_device = true},
      .make =
          [](const RunContext& ctx) {
            return std::make_unique<baseline::SerialLinears>(ctx.options.config.dtype);
          },
      // One device: the whole model, nothing moved.
      .plan =
          [](const RunContext&) {
            return StagePlan{.sharding = {}, .traffic = {}, .comm = "none (one device)"};
          },
      .reference = reference_run,
  };
  return run_stage(stage, argc, argv);
}
