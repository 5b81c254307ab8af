#include "09_pipeline_parallel/flags.h"

#include <fmt/format.h>

#include "common/cli_flags.h"

namespace tpx::pp {

void PipelineFlags::add_flags(CLI::App& app, MeshFlag newest) {
  add_mesh_degree(app, "--pp", pp, "P",
                  "pipeline-parallel degree P: the layers split contiguously over P stages (mesh "
                  "P × D × C × TP, PP outermost)",
                  MeshFlag::pp, newest, "Pipeline");
  add_count(app, "--microbatches", microbatches,
            "M micro-batches of the local batch B/D, each sent through the pipeline; when not "
            "given, the largest of P·V, P and 1 that divides B/D; stage 09 takes at most 65536",
            "its default: the largest of P·V, P and 1 that divides B/D")
      ->type_name("M")
      ->group("Pipeline");
  app.add_option("--schedule", schedule,
                 "gpipe (all forwards, then all backwards), 1f1b (one forward, one backward), "
                 "interleaved-1f1b (V virtual stages per rank) or zb-h1 (zero bubble: the "
                 "backward split into B, the input gradient, and W, the weight gradients)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}))
      ->capture_default_str()
      ->group("Pipeline");
  add_count(app, "--stages-per-rank", stages_per_rank,
            "V virtual stages per rank (interleaved-1f1b: rank p holds stages p, p+P, ...)",
            "its default: 1")
      ->type_name("V")
      ->group("Pipeline");
  add_count(app, "--first-stage-layers", first_stage_layers,
            "N blocks on the first pipeline stage (it also holds the embedding), the other "
            "stages' layers split evenly; with --stages-per-rank V the first virtual stage, rank "
            "0's first",
            "its default: the even split's share")
      ->type_name("N")
      ->group("Pipeline");
  add_count(app, "--last-stage-layers", last_stage_layers,
            "N blocks on the last pipeline stage (it also holds the final norm, the output layer "
            "and the loss), the other stages' layers split evenly; with --stages-per-rank V the "
            "last virtual stage, the last rank's last",
            "its default: the even split's share")
      ->type_name("N")
      ->group("Pipeline");
  app.add_flag("--print-schedule", print_schedule,
               "print every rank's list of F, B (and W) actions and the simulated bubble, "
               "then exit without training")
      ->group("Pipeline");
}

ConfigFields PipelineFlags::agreed() const {
  return {{"--pp", fmt::format("{}", pp)},
          {"--microbatches", fmt::format("{}", microbatches)},
          {"--schedule", schedule},
          {"--stages-per-rank", fmt::format("{}", stages_per_rank)},
          {"--first-stage-layers", fmt::format("{}", first_stage_layers)},
          {"--last-stage-layers", fmt::format("{}", last_stage_layers)},
          {"--print-schedule", print_schedule ? "given" : "not given"}};
}

}  // namespace tpx::pp
