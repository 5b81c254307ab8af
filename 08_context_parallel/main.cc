// 08_context_parallel: the ranks as a D × C × TP mesh; stage 07's FSDP × TP on each rank's part
// of the sequence, the sequence cut into 2C load-balanced chunks over the CP dimension, and
// attention reaching the other CP ranks' keys by a ring of K/V blocks merged by log-sum-exp (or an
// all-gather of K and V); checked against stage 01 run in-process on the whole model, the whole
// batch and the whole sequence.
#include "01_baseline/layers.h"
#include "05_copy_engine_async_tp/flags.h"
#include "07_fsdp_tp/flags.h"
#include "08_context_parallel/flags.h"
#include "08_context_parallel/layers.h"
#include "common/stage.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "08_context_parallel",
               .summary = "a D × C × TP mesh: the sequence in 2C load-balanced chunks over CP, "
                          "attention by a ring of K/V blocks merged by log-sum-exp (or an "
                          "all-gather of K/V, or Ulysses' all-to-all), stage 07's FSDP × TP on "
                          "each rank's tokens",
               .flag_groups = {fsdp::DataParallelFlags::make, cp::ContextParallelFlags::make,
                               async_tp::AllGatherFlags::make}},
      .make = cp::make_context_parallel,
      .plan = cp::plan_context_parallel,
      .reference = baseline::run_reference,
  };
  return run_stage(stage, argc, argv);
}
