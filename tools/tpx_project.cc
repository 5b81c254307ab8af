// tpx_project: the projection model (tools/projection.h) from the command line.
//
//   tpx_project --device tools/devices/h100_sxm.json [--markdown FILE] [--json FILE]
//               [--calibrate FILE …] [--published FILE] [--validate] [--sensitivity]
//
// Writes, per config (a Llama-3-70B layer and a Llama-7B-sized one), the projected step of every
// stage at N = 2, 4, 8 (stage 01 at N = 1), stage 07 at TP × DP = 8 × 4 and 8 × 32, then the
// model against published results (--published, default published.json next to the device
// file): the held-out cases first, then the calibration cases, what is left out and why, and the
// sensitivity of every error to each assumed parameter (±20 %). --markdown / --json write files;
// with neither, the markdown goes to stdout. --validate prints the validation tables alone,
// --sensitivity the sensitivity table alone (both: both).
// --calibrate (repeatable) replaces assumptions of the device with measurements: the GEMM
// efficiency curve from a bench_gemm JSON file's cuda bf16 rows (whole and chunked GEMMs), the
// GEMM's slow-down beside a copy engine and beside an SM copy from bench_copy_overlap's; a file
// that is missing or holds no such rows changes nothing, with a note on stderr (the output says
// what it used).
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "projection.h"

namespace {

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path.string());
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tpx_project: projected step time of stages 01-06 on N GPUs of one node"};
  std::string device_file, markdown, json_file, published;
  std::vector<std::string> calibrate;
  bool validate_only = false, sensitivity_only = false;
  app.add_option("--device", device_file, "device file (tools/devices/*.json)")->required();
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
  CLI11_PARSE(app, argc, argv);

  namespace pj = tpx::projection;
  try {
    pj::DeviceSpec device = pj::load_device(device_file);
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
    const std::filesystem::path dir = std::filesystem::path(device_file).parent_path();
    const std::filesystem::path pub =
        published.empty() ? dir / "published.json" : std::filesystem::path(published);
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
