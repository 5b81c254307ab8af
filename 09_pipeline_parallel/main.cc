// 09_pipeline_parallel: the ranks as a P × D × C × TP mesh; the layers split over P pipeline
// stages, each stage's ranks running stage 08 (and so 07, 05) on their layers, micro-batches
// flowing from stage to stage by point-to-point messages in the order a schedule (GPipe, 1F1B,
// interleaved 1F1B, ZB-H1) lists; checked against stage 01 run in-process on the whole model,
// the whole batch and the whole sequence.
#include "01_baseline/layers.h"
#include "05_copy_engine_async_tp/flags.h"
#include "07_fsdp_tp/flags.h"
#include "08_context_parallel/flags.h"
#include "09_pipeline_parallel/flags.h"
#include "09_pipeline_parallel/pipeline.h"
#include "common/stage.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "09_pipeline_parallel",
               .summary = "a P × D × C × TP mesh: the layers over P pipeline stages, micro-batches "
                          "through them by point-to-point messages in a schedule's order (gpipe, "
                          "1f1b, interleaved-1f1b, zb-h1), stage 08 on each stage's ranks",
               .flag_groups = {fsdp::DataParallelFlags::make, cp::ContextParallelFlags::make,
                               pp::PipelineFlags::make, async_tp::AllGatherFlags::make}},
      .make = pp::make_pipeline,
      .plan = pp::plan_pipeline,
      .reference = baseline::run_reference,
      .train = pp::train_pipeline,
      .answer_instead = pp::describe_pipeline,
  };
  return run_stage(stage, argc, argv);
}
