// tpx_project: the projection model (tools/projection.h) from the command line.
//
//   tpx_project --device tools/devices/h100_sxm.json [--markdown FILE] [--json FILE]
//               [--calibrate bench_gemm.json] [--published FILE] [--validate]
//
// Writes, per config (a Llama-3-70B layer and a Llama-7B-sized one), the projected step of every
// stage at N = 2, 4, 8 (stage 01 at N = 1), then the model against published results
// (--published, default published.json next to the device file). --markdown / --json write
// files; with neither, the markdown goes to stdout. --validate prints the validation table alone.
// --calibrate replaces the assumed GEMM efficiency curve with the cuda bf16 GEMM rows of a
// bench_gemm JSON file; a file that is missing or holds no such rows leaves the assumed curve,
// with a note on stderr (the output says which curve it used).
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

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
  std::string device_file, markdown, json_file, calibrate, published;
  bool validate_only = false;
  app.add_option("--device", device_file, "device file (tools/devices/*.json)")->required();
  app.add_option("--markdown", markdown, "write the tables as markdown to FILE");
  app.add_option("--json", json_file, "write the tables as JSON to FILE");
  app.add_option("--calibrate", calibrate,
                 "bench_gemm JSON whose cuda bf16 rows replace the "
                 "assumed GEMM efficiency curve");
  app.add_option("--published", published,
                 "published results (default: published.json next to the device file)");
  app.add_flag("--validate", validate_only, "print the model against published results and exit");
  CLI11_PARSE(app, argc, argv);

  namespace pj = tpx::projection;
  try {
    pj::DeviceSpec device = pj::load_device(device_file);
    if (!calibrate.empty()) {
      if (!std::filesystem::exists(calibrate))
        std::fprintf(stderr, "note: %s not found: the assumed GEMM efficiency curve is used\n",
                     calibrate.c_str());
      else if (!pj::calibrate(device, calibrate))
        std::fprintf(stderr,
                     "note: %s has no cuda bf16 GEMM rows: the assumed GEMM efficiency curve is "
                     "used\n",
                     calibrate.c_str());
    }
    const std::filesystem::path dir = std::filesystem::path(device_file).parent_path();
    const std::filesystem::path pub =
        published.empty() ? dir / "published.json" : std::filesystem::path(published);
    const auto validation = pj::validate(pj::load_published(pub), pub.parent_path(), device);
    if (validate_only) {
      std::fputs(pj::validation_markdown(validation).c_str(), stdout);
      return 0;
    }
    const pj::Report report = pj::make_report(device, validation);
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
