// tpx_schedule: a pipeline schedule (09_pipeline_parallel/schedule.h) printed and simulated,
// without a model.
//
//   tpx_schedule --pp P --microbatches M --schedule NAME [--stages-per-rank V]
//                [--simulate [--timeline] [--forward F] [--backward B] [--weight W] [--latency L]]
//
// Prints every rank's actions in order; with --simulate also each rank's busy and idle time,
// idle fraction and peak count of live micro-batch activations, the makespan and the bubble
// next to the schedule's formula; --timeline adds the simulated timeline, one column per unit of
// the smallest cost (every cost and the latency must be whole multiples of it). Bad sizes or names,
// and sizes past the guards (more than pipeline::kMaxScheduleActions actions, a timeline of more
// than 10^8 characters), and costs that are not finite numbers (F, B and W > 0, the latency >= 0)
// or make a step longer than a double holds: one line on stderr and exit 2.
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "09_pipeline_parallel/schedule.h"
#include "common/check.h"

namespace {

constexpr double kMaxTimelineCells = 1e8;

// The timeline's column: the smallest nonzero cost (latency included).
double unit_of(const tpx::pipeline::Costs& c) {
  double unit = 0.0;
  for (double v : {c.forward, c.backward, c.weight, c.latency})
    if (v > 0.0 && (unit == 0.0 || v < unit)) unit = v;
  return unit > 0.0 ? unit : 1.0;
}

// Every cost a finite number: an F, a B and a W take time (> 0), a message 0 or more.
void check_costs(const tpx::pipeline::Costs& c) {
  for (const auto& [flag, value] :
       {std::pair{"--forward", c.forward}, {"--backward", c.backward}, {"--weight", c.weight}})
    if (!(std::isfinite(value) && value > 0.0))
      throw tpx::ConfigError(fmt::format(
          "{} must be a finite number > 0, the time of one action (got {:g})", flag, value));
  if (!(std::isfinite(c.latency) && c.latency >= 0.0))
    throw tpx::ConfigError(fmt::format(
        "--latency must be a finite number >= 0, the time of one message (got {:g})", c.latency));
}

}  // namespace

int main(int argc, char** argv) {
  namespace pl = tpx::pipeline;
  CLI::App app{"tpx_schedule: print and simulate a pipeline-parallel schedule"};
  pl::PipelineShape shape;
  std::string name = "1f1b";
  bool simulate = false, timeline = false;
  pl::Costs costs;
  app.add_option("--pp", shape.ranks, "P, the pipeline ranks")->capture_default_str();
  app.add_option("--microbatches", shape.microbatches, "M, the micro-batches of a step")
      ->capture_default_str();
  app.add_option("--schedule", name, "gpipe, 1f1b, interleaved-1f1b or zb-h1")
      ->capture_default_str();
  app.add_option("--stages-per-rank", shape.stages_per_rank,
                 "V, virtual stages per rank (interleaved-1f1b)")
      ->capture_default_str();
  app.add_flag("--simulate", simulate, "run the lists with the costs below and report the bubble");
  app.add_flag("--timeline", timeline,
               "with --simulate: draw the simulated timeline, one column per unit of time");
  app.add_option("--forward", costs.forward, "cost of one F")->capture_default_str();
  app.add_option("--backward", costs.backward, "cost of one B (the input gradient)")
      ->capture_default_str();
  app.add_option("--weight", costs.weight, "cost of one W (the weight gradients)")
      ->capture_default_str();
  app.add_option("--latency", costs.latency, "time a message takes between ranks")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "tpx_schedule: error: %s (see --help)\n", e.what());
    return 2;
  }
  try {
    check_costs(costs);
    const double unit = unit_of(costs);
    for (double c : {costs.forward, costs.backward, costs.weight, costs.latency}) {
      if (timeline && std::abs(c / unit - std::round(c / unit)) > 1e-9)
        throw tpx::ConfigError(
            fmt::format("--timeline needs every cost and the latency to be a whole multiple of the "
                        "smallest, {:g} (got {:g})",
                        unit, c));
    }
    if (timeline && !simulate) throw tpx::ConfigError("--timeline needs --simulate");
    const auto schedule = pl::make_schedule(name, shape);
    std::string out = pl::format_schedule(*schedule);
    if (simulate) {
      const pl::SimResult result = pl::simulate(*schedule, costs);
      if (!std::isfinite(result.makespan))
        throw tpx::ConfigError(fmt::format(
            "the simulated step is longer than a double holds with --forward {:g} --backward {:g} "
            "--weight {:g} --latency {:g}: smaller costs",
            costs.forward, costs.backward, costs.weight, costs.latency));
      out += pl::format_simulation(*schedule, costs, result);
      if (timeline) {
        // One character per rank and unit of time: a size guard before the text is made.
        const double cells = double(shape.ranks) * (result.makespan / unit);
        if (cells > kMaxTimelineCells)
          throw tpx::ConfigError(fmt::format(
              "--timeline would draw {:.3g} columns for each of {} ranks, more than {:.3g} "
              "cells in all: fewer --microbatches, or costs fewer units of the smallest",
              result.makespan / unit, shape.ranks, kMaxTimelineCells));
        out += pl::format_timeline(*schedule, result, unit);
      }
    }
    std::fputs(out.c_str(), stdout);
  } catch (const tpx::ConfigError& e) {
    std::fprintf(stderr, "tpx_schedule: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tpx_schedule: %s\n", e.what());
    return 1;
  }
  return 0;
}
