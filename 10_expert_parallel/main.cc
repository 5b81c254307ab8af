// 10_expert_parallel: the mixture of experts in place of the SwiGLU of every --moe-every-th layer,
// E routed experts (top K of them per token, softmax or sigmoid routing, an optional shared
// expert) spread over EP ranks borrowed from the data-parallel ones, each token's row moved to its
// experts and back by variable all-to-alls, each expert's width cut over the TP group; the dense
// parts as stage 07 (FSDP × TP), and with --pp stage 09's pipeline around it; checked against the
// double-precision reference with the same experts and routing groups.
#include "05_copy_engine_async_tp/flags.h"
#include "07_fsdp_tp/flags.h"
#include "08_context_parallel/flags.h"
#include "09_pipeline_parallel/flags.h"
#include "10_expert_parallel/layers.h"
#include "common/moe_flags.h"
#include "common/stage.h"

int main(int argc, char** argv) {
  using namespace tpx;
  const StageDefinition stage{
      .info = {.name = "10_expert_parallel",
               .summary =
                   "a mixture of experts: top-K routing, the experts over EP ranks "
                   "borrowed from the data-parallel ones, tokens dispatched to them and "
                   "combined by all-to-alls, their width over TP; the dense layers as stage 07",
               // --pp and --cp before --dp: D is the newest dimension, the one that defaults
               // to 2.
               .flag_groups = {pp::PipelineFlags::make, cp::ContextParallelFlags::make,
                               fsdp::DataParallelFlags::make, MoeFlags::make,
                               async_tp::AllGatherFlags::make}},
      .make = ep::make_expert_parallel,
      .plan = ep::plan_expert_parallel,
      .reference = reference_run,
      .train = ep::train_expert_parallel,
  };
  return run_stage(stage, argc, argv);
}
