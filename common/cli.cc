#include "cli.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "check.h"

namespace tpx {

CliOutcome parse_stage_cli(const StageInfo& info, int argc, char** argv) {
  StageOptions o;
  BlockConfig& c = o.config;
  std::string device = "cpu", dtype = "fp32";

  CLI::App app(fmt::format("{}: {}", info.name, info.summary), info.name);
  app.footer(info.single_device
                 ? "Single-device stage: run it directly or under `mpirun -np 1`; with more ranks "
                   "it exits with an error."
                 : "Run under `mpirun -np N`; N must divide the sizes the stage splits.");
  app.get_formatter()->column_width(26);
  auto sizes = "Model sizes";
  app.add_option("--hidden", c.hidden, "H, the model width")->capture_default_str()->group(sizes);
  app.add_option("--heads", c.heads, "NH, attention heads (H % NH == 0)")
      ->capture_default_str()
      ->group(sizes);
  app.add_option("--ffn", c.ffn, "F, the SwiGLU inner size")->capture_default_str()->group(sizes);
  app.add_option("--seq", c.seq, "S, sequence length")->capture_default_str()->group(sizes);
  app.add_option("--batch", c.batch, "B, batch size")->capture_default_str()->group(sizes);
  app.add_option("--layers", c.layers, "L, stacked blocks")->capture_default_str()->group(sizes);
  auto run = "Run";
  app.add_option("--steps", c.steps, "T, SGD steps")->capture_default_str()->group(run);
  app.add_option("--lr", c.lr, "SGD learning rate")->capture_default_str()->group(run);
  app.add_option("--seed", c.seed, "initialisation seed")->capture_default_str()->group(run);
  app.add_option("--device", device, "backend: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str()
      ->group(run);
  app.add_option("--dtype", dtype, "compute type: fp32 or bf16 (bf16 needs cuda)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str()
      ->group(run);
  auto out = "Output";
  app.add_flag("--check", o.check,
               "compare output, input grad, every weight grad and the loss after 3 SGD steps "
               "with the reference; exit non-zero on FAIL")
      ->group(out);
  app.add_option("--dump", o.dump_dir,
                 "write full float32 .npy tensors after the first "
                 "forward+backward into DIR")
      ->type_name("DIR")
      ->group(out);
  app.add_option("--json", o.json_path, "write a machine-readable run summary")
      ->type_name("FILE")
      ->group(out);
  app.add_option("--trace", o.trace_path,
                 "write a Chrome/Perfetto trace, one lane per rank and "
                 "stream")
      ->type_name("FILE")
      ->group(out);

  auto comm = "Communication";
  std::string comm_kind = "auto";
  app.add_option("--comm", comm_kind,
                 "collectives: nccl (cuda, one GPU per rank), mpi (host memory; cuda tensors are "
                 "staged through the host) or auto (nccl when every rank has its own GPU)")
      ->check(CLI::IsMember({"auto", "mpi", "nccl"}))
      ->capture_default_str()
      ->group(comm);
  app.add_option("--comm-timeout", o.comm.timeout_s,
                 "seconds a collective may take before every rank prints its last ops and the "
                 "job aborts naming the first op the ranks disagree on")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->group(comm);
  // Fault injection for the watchdog's tests; hidden from --help (empty group).
  std::pair<int, std::int64_t> fault{-1, -1};
  app.add_option("--fault-skip-collective", fault, "RANK:SEQ: that rank silently skips its op SEQ")
      ->delimiter(':')
      ->type_name("RANK:SEQ")
      ->group("");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    return {std::nullopt, app.help(), 0};
  } catch (const CLI::ParseError& e) {
    return {std::nullopt, fmt::format("{} (see --help)", e.what()), 2};
  }
  if (!(o.comm.timeout_s > 0))
    return {std::nullopt,
            fmt::format("--comm-timeout must be a positive number of seconds (got {})",
                        o.comm.timeout_s),
            2};
  if (app.count("--fault-skip-collective") > 0) {
    if (fault.first < 0 || fault.second < 0)
      return {std::nullopt, "--fault-skip-collective needs RANK:SEQ with RANK, SEQ >= 0", 2};
    o.comm.fault_rank = fault.first;
    o.comm.fault_seq = fault.second;
  }
  o.comm.kind = parse_comm_kind(comm_kind);
  c.device = parse_device(device);
  c.dtype = parse_dtype(dtype);
  if (const auto errors = validate(c); !errors.empty())
    return {std::nullopt, fmt::format("{}", fmt::join(errors, "; ")), 2};
  return {std::move(o), "", 0};
}

}  // namespace tpx
