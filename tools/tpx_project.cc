// tpx_project: the projection model (tools/projection.h) from the command line.
//
//   tpx_project --device NAME|FILE [--markdown FILE] [--json FILE]
//               [--calibrate FILE …] [--published FILE] [--validate] [--sensitivity]
//   tpx_project --device NAME|FILE [--model NAME] [--config FILE] [--hidden H] [--heads NH]
//               [--kv-heads NKV] [--ffn F] [--seq S] [--batch B] [--layers L] [--dtype fp32|bf16]
//               [--recompute none|full|selective] [--tp T] [--dp D] [--markdown FILE] [--json FILE]
//
// --device is a device file, or its name in tools/devices/ (h100_sxm, h200, …; an unknown name
// is refused with the list).
//
// Given a model (--model, --config, or any size flag) or a parallel size (--tp, --dp), it answers
// "what does each stage's scheme cost per GPU for my model": one row per stage (01 on one GPU,
// 02 … 06 on T GPUs, 07 on T × D) with the projected step, its compute and exposed communication,
// the FLOPs, the bytes on the TP and DP groups as the stages count them (common/traffic.h), the
// saved activations and the peak-memory estimate per GPU (common/memory.h), in KiB/MiB/GiB.
//
// Otherwise it writes the report: per config (a Llama-3-70B layer and a Llama-7B-sized one) the
// projected step of every stage at N = 2, 4, 8 (stage 01 at N = 1), stage 07 at TP × DP = 8 × 4
// and 8 × 32, then the model against published results (--published, default published.json
// next to the device file): the held-out cases first, then the calibration cases, what is left
// out and why, and the sensitivity of every error to each assumed parameter (±20 %).
// --markdown / --json write files; with neither, the markdown goes to stdout. --validate prints
// the validation tables alone, --sensitivity the sensitivity table alone (both: both).
// --calibrate (repeatable) replaces assumptions of the device with measurements: the GEMM
// efficiency curve from a bench_gemm JSON file's cuda bf16 rows (whole and chunked GEMMs), the
// GEMM's slow-down beside a copy engine and beside an SM copy from bench_copy_overlap's; a file
// that is missing or holds no such rows changes nothing, with a note on stderr (the output says
// what it used).
//
// Exit status: 0 done, 2 bad input (a flag, a size, a file), with one line on stderr.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/config.h"
#include "common/flops.h"
#include "common/memory.h"
#include "common/presets.h"
#include "common/tp.h"
#include "common/traffic.h"
#include "projection.h"

namespace {

namespace fs = std::filesystem;
namespace pj = tpx::projection;
using nlohmann::json;

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path.string());
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

/// A device file: `arg` itself when it is a file, else tools/devices/<arg>.json; an unknown name
/// is an error listing the known ones.
fs::path device_file(const std::string& arg) {
  if (fs::is_regular_file(arg)) return arg;
  const fs::path dir = TPX_DEVICES_DIR;
  const fs::path named = dir / (arg + ".json");
  if (fs::is_regular_file(named)) return named;
  std::vector<std::string> known;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".json" && e.path().stem() != "published")
      known.push_back(e.path().stem().string());
  std::sort(known.begin(), known.end());
  throw std::invalid_argument(
      fmt::format("--device {}: no such file or device; known devices: {} "
                  "(the files in {}), or a path to a device file",
                  arg, fmt::join(known, ", "), dir.string()));
}

/// One stage's row of the by-flags table.
struct StageCost {
  std::string stage;
  int tp = 1, dp = 1;
  pj::Projection p;
  double step_ms = 0, exposed_ms = 0;
  tpx::Traffic tp_bytes, dp_bytes;
  double flops = 0;  // per GPU and step, the model's GEMMs
  std::uint64_t saved = 0, memory = 0;
};

/// Every stage's cost per GPU for model `c` at TP `tp` (stage 07: T × `dp`).
std::vector<StageCost> stage_costs(const pj::DeviceSpec& d, const tpx::BlockConfig& c, int tp,
                                   int dp) {
  using tpx::Sharding;
  std::vector<StageCost> rows;
  for (int stage = 1; stage <= 7; ++stage) {
    StageCost r;
    r.stage = stage == 7 ? "07_fsdp_tp" : pj::stage_name(stage);
    r.tp = stage == 1 ? 1 : tp;
    r.dp = stage == 7 ? dp : 1;
    tpx::BlockConfig s = c;                      // what the stage runs
    if (stage == 6) s.dtype = tpx::DType::e4m3;  // its default recipe: FP8 GEMMs inside bf16
    Sharding sh{.rank = 0, .world = r.tp, .weights = stage > 1, .sequence = stage > 2, .dp = r.dp};
    if (stage > 1) tpx::check_tp_split(s, r.tp, /*sequence=*/stage > 2);
    if (stage < 7) {
      r.p = pj::project_stage(d, s, r.tp, stage);
      r.step_ms = r.p.step_ms;
      r.exposed_ms = r.p.exposed_comm_ms;
      r.tp_bytes = tpx::comm_bytes(stage, s, r.tp);
    } else {
      tpx::BlockConfig replica = s;
      replica.batch /= dp;
      r.dp_bytes = tpx::fsdp_traffic(s, tp, dp);
      const auto m = pj::project_mesh(d, replica, tp, dp, double(r.dp_bytes.bus));
      r.step_ms = m.step_ms;
      r.exposed_ms = m.step_ms - m.compute_ms;
      r.tp_bytes = tpx::comm_bytes(5, replica, tp);
    }
    r.flops = tpx::step_flops(s).total() / double(r.tp * r.dp);
    const tpx::MemoryEstimate e = tpx::estimate_training_memory(s, sh);
    r.saved = e.term("saved activations").bytes;
    r.memory = e.total();
    rows.push_back(r);
  }
  return rows;
}

std::string describe(const tpx::BlockConfig& c, const std::string& model) {
  return fmt::format("{}H {} NH {} NKV {} F {} S {} B {} L {} | {} | recompute {}",
                     model.empty() ? "" : "model " + model + ": ", c.hidden, c.heads,
                     c.kv_heads_or_heads(), c.ffn, c.seq, c.batch, c.layers,
                     tpx::dtype_flag(c.dtype), tpx::recompute_flag(c.recompute));
}

std::string costs_markdown(const pj::DeviceSpec& d, const tpx::BlockConfig& c,
                           const std::string& model, int tp, int dp,
                           const std::vector<StageCost>& rows) {
  std::ostringstream s;
  s << fmt::format(
      "Projected by the model in tools/projection.cc, not measured: device file tools/devices/{} "
      "({}), GEMM efficiency {}{}.\n\n",
      d.file, d.name, d.calibrated ? "calibrated: " : "not calibrated: ", d.gemm.origin);
  s << fmt::format(
      "{} | TP {}, DP {} (stage 07). Per GPU and training step (forward + backward of all L "
      "layers); bytes as the stages count them (bus bytes, nccl-tests' convention); memory: the "
      "stages' own estimate of a GPU's peak (common/memory.h); stage 06 runs FP8 GEMMs inside "
      "the bf16 recipe.\n\n",
      describe(c, model), tp, dp);
  s << "| stage | GPUs | step ms | exposed comm ms | TFLOP per GPU | TP bus per GPU | DP bus per "
       "GPU | saved activations | peak memory |\n|---|---|---|---|---|---|---|---|---|\n";
  for (const StageCost& r : rows)
    s << fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.1f} | {} | {} | {} | {} |\n", r.stage,
                     r.tp * r.dp, r.step_ms, r.exposed_ms, r.flops / 1e12,
                     tpx::bytes_text(r.tp_bytes.bus), tpx::bytes_text(r.dp_bytes.bus),
                     tpx::bytes_text(r.saved), tpx::bytes_text(r.memory));
  return s.str();
}

json costs_json(const pj::DeviceSpec& d, const tpx::BlockConfig& c, const std::string& model,
                int tp, int dp, const std::vector<StageCost>& rows) {
  json j = {{"device", d.name},
            {"device_file", d.file},
            {"model", model},
            {"config",
             {{"hidden", c.hidden},
              {"heads", c.heads},
              {"kv_heads", c.kv_heads_or_heads()},
              {"ffn", c.ffn},
              {"seq", c.seq},
              {"batch", c.batch},
              {"layers", c.layers},
              {"dtype", tpx::dtype_flag(c.dtype)},
              {"recompute", tpx::recompute_flag(c.recompute)}}},
            {"tp", tp},
            {"dp", dp},
            {"stages", json::array()}};
  for (const StageCost& r : rows)
    j["stages"].push_back({{"stage", r.stage},
                           {"gpus", r.tp * r.dp},
                           {"step_ms", r.step_ms},
                           {"exposed_comm_ms", r.exposed_ms},
                           {"flops_per_gpu", r.flops},
                           {"tp_bus_bytes", r.tp_bytes.bus},
                           {"tp_payload_bytes", r.tp_bytes.payload},
                           {"dp_bus_bytes", r.dp_bytes.bus},
                           {"saved_activation_bytes", r.saved},
                           {"memory_estimate_bytes", r.memory}});
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tpx_project: projected step time, bytes and memory per GPU of stages 01-07 on GPUs of one "
      "kind, for a model given by name, file or sizes; or the projection report"};
  app.footer("Exit status: 0 done; 2 bad input (a flag, a size the ranks cannot split, a file).");
  std::string device_arg, markdown, json_file, published;
  std::vector<std::string> calibrate;
  bool validate_only = false, sensitivity_only = false;
  app.add_option("--device", device_arg,
                 "a device by name (h100_sxm, h200, …: the files in tools/devices/) or a device "
                 "file")
      ->required();
  app.add_option("--markdown", markdown, "write the tables as markdown to FILE");
  app.add_option("--json", json_file, "write the tables as JSON to FILE");
  app.add_option("--calibrate", calibrate,
                 "bench_gemm / bench_copy_overlap JSON whose cuda bf16 rows replace the assumed "
                 "GEMM efficiency curve and GEMM slow-downs beside a transfer (repeatable)");
  app.add_option("--published", published,
                 "published results (default: published.json next to the device file)");
  app.add_flag("--validate", validate_only, "print the model against published results and exit");
  app.add_flag("--sensitivity", sensitivity_only,
               "print how far each validation error moves with each assumption ±20 % and exit");

  // The model: the stages' presets, config files and size flags (common/presets.h).
  tpx::BlockConfig c;
  c.dtype = tpx::DType::bf16;  // what GPUs train in
  std::string model, dtype = "bf16", recompute = "none";
  int tp = 8, dp = 1;
  const auto m = "Model (any of these: a table per stage for this model)";
  app.add_option("--model", model, "a model by name: " + tpx::preset_names())->group(m);
  app.set_config("--config", "", "read these flags from a TOML/INI file; the command line wins")
      ->group(m);
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.add_option("--hidden", c.hidden, "H")->check(CLI::PositiveNumber)->group(m);
  app.add_option("--heads", c.heads, "NH")->check(CLI::PositiveNumber)->group(m);
  app.add_option("--kv-heads", c.kv_heads, "NKV (GQA); NH when not given")
      ->check(CLI::PositiveNumber)
      ->group(m);
  app.add_option("--ffn", c.ffn, "F")->check(CLI::PositiveNumber)->group(m);
  app.add_option("--seq", c.seq, "S")->check(CLI::PositiveNumber)->group(m);
  app.add_option("--batch", c.batch, "B, the global batch (stage 07: B / D per replica)")
      ->check(CLI::PositiveNumber)
      ->group(m);
  app.add_option("--layers", c.layers, "L")->check(CLI::PositiveNumber)->group(m);
  app.add_option("--dtype", dtype, "fp32 or bf16 (stage 06: FP8 GEMMs inside bf16)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str()
      ->group(m);
  app.add_option("--recompute", recompute, "none, full or selective")
      ->check(CLI::IsMember({"none", "full", "selective"}))
      ->capture_default_str()
      ->group(m);
  app.add_option("--tp", tp, "T, tensor-parallel GPUs (stages 02-07)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->group(m);
  app.add_option("--dp", dp, "D, data-parallel replicas of stage 07 (FSDP over D)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->group(m);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "tpx_project: error: %s (see --help)\n", e.what());
    return 2;
  }
  const bool by_flags = [&] {
    for (const char* flag :
         {"--model", "--config", "--hidden", "--heads", "--kv-heads", "--ffn", "--seq", "--batch",
          "--layers", "--dtype", "--recompute", "--tp", "--dp"})
      if (app.count(flag) > 0) return true;
    return false;
  }();

  try {
    pj::DeviceSpec device = pj::load_device(device_file(device_arg));
    for (const std::string& file : calibrate) {
      if (!std::filesystem::exists(file))
        std::fprintf(stderr, "note: %s not found: the device file's assumptions are used\n",
                     file.c_str());
      else if (!pj::calibrate(device, file))
        std::fprintf(stderr,
                     "note: %s has no cuda bf16 GEMM or copy-overlap rows: the device file's "
                     "assumptions are used\n",
                     file.c_str());
    }
    if (by_flags) {
      if (!model.empty()) {
        const tpx::ModelPreset* preset = tpx::find_preset(model);
        if (preset == nullptr)
          throw std::invalid_argument(
              fmt::format("--model {}: no such model (known: {})", model, tpx::preset_names()));
        auto given = [&](const char* flag) { return app.count(flag) > 0; };
        tpx::apply_preset(*preset,
                          {.hidden = given("--hidden"),
                           .heads = given("--heads"),
                           .kv_heads = given("--kv-heads"),
                           .ffn = given("--ffn"),
                           .layers = given("--layers"),
                           .seq = given("--seq"),
                           .batch = given("--batch"),
                           .rope_theta = false},
                          c);
      } else if (app.count("--kv-heads") == 0) {
        c.kv_heads = c.heads;
      }
      c.dtype = tpx::parse_dtype(dtype);
      c.recompute = recompute == "full"        ? tpx::Recompute::full
                    : recompute == "selective" ? tpx::Recompute::selective
                                               : tpx::Recompute::none;
      if (const auto errors = tpx::validate(c); !errors.empty())
        throw std::invalid_argument(fmt::format("{}", fmt::join(errors, "; ")));
      if (c.batch % dp != 0)
        throw std::invalid_argument(fmt::format(
            "--dp {} must divide --batch {}: each data-parallel replica trains B / D sequences", dp,
            c.batch));
      const auto rows = stage_costs(device, c, tp, dp);
      const std::string md = costs_markdown(device, c, model, tp, dp, rows);
      if (!markdown.empty()) write_file(markdown, md);
      if (!json_file.empty())
        write_file(json_file, costs_json(device, c, model, tp, dp, rows).dump(2) + "\n");
      if (markdown.empty() && json_file.empty()) std::fputs(md.c_str(), stdout);
      return 0;
    }
    const fs::path dir = device_file(device_arg).parent_path();
    const fs::path pub = published.empty() ? dir / "published.json" : fs::path(published);
    const pj::PublishedSet cases = pj::load_published(pub);
    const auto validation = pj::validate(cases.results, pub.parent_path(), device);
    if (validate_only)
      std::fputs(pj::validation_markdown(validation, cases.left_out).c_str(), stdout);
    const auto sens = pj::sensitivity(cases.results, pub.parent_path(), device);
    if (sensitivity_only) std::fputs(pj::sensitivity_markdown(validation, sens).c_str(), stdout);
    if (validate_only || sensitivity_only) return 0;
    const pj::Report report = pj::make_report(device, validation, cases.left_out, sens);
    const std::string md = pj::report_markdown(report);
    if (!markdown.empty()) write_file(markdown, md);
    if (!json_file.empty()) write_file(json_file, pj::report_json(report).dump(2) + "\n");
    if (markdown.empty() && json_file.empty()) std::fputs(md.c_str(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tpx_project: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
