// tpx_report: reads the --json summaries of stage runs and prints one comparison table
// (markdown), optionally also as CSV.
//
//   tpx_report out/01_baseline.json out/02_megatron_tp.np2.json ... [--csv table.csv]
#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace {

struct Row {
  std::string stage, ranks, comm, device, dtype, loss_first, loss_last, step_ms, exposed_ms,
      payload, bus, peak_mib, saved_mib, check;
};

// Mean over steps after the first (the first step pays for warm-up), or the only step.
double steady_mean(const nlohmann::json& steps, const char* key) {
  double sum = 0;
  int n = 0;
  for (std::size_t i = steps.size() > 1 ? 1 : 0; i < steps.size(); ++i, ++n)
    sum += steps[i][key].get<double>();
  return n ? sum / n : 0.0;
}

Row summarise(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("cannot read '{}'", path));
  const auto j = nlohmann::json::parse(in);
  const auto& steps = j.at("steps");
  if (steps.empty()) throw std::runtime_error(fmt::format("'{}' has no steps", path));
  const double mib = 1024.0 * 1024.0;
  Row r;
  r.stage = j.at("stage").get<std::string>();
  r.ranks = std::to_string(j.at("world_size").get<int>());
  r.comm = j.at("comm").get<std::string>();
  r.device = j.at("config").at("device").get<std::string>();
  r.dtype = j.at("config").at("dtype").get<std::string>();
  r.loss_first = fmt::format("{:.6f}", steps.front().at("loss").get<double>());
  r.loss_last = fmt::format("{:.6f}", steps.back().at("loss").get<double>());
  r.step_ms = fmt::format("{:.2f}", steady_mean(steps, "ms"));
  r.exposed_ms = fmt::format("{:.2f}", steady_mean(steps, "exposed_comm_ms"));
  r.payload = fmt::format("{:.0f}", steady_mean(steps, "comm_payload_bytes"));
  r.bus = fmt::format("{:.0f}", steady_mean(steps, "comm_bus_bytes"));
  r.peak_mib = fmt::format("{:.1f}", steps.back().at("peak_bytes").get<double>() / mib);
  r.saved_mib = fmt::format("{:.2f}", j.at("saved_activation_bytes").get<double>() / mib);
  r.check = j.contains("check") ? (j["check"].at("pass").get<bool>() ? "PASS" : "FAIL") : "-";
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  std::string csv;
  CLI::App app("tpx_report: one comparison table from stage --json summaries");
  app.add_option("files", files, "--json files written by the stages")->required();
  app.add_option("--csv", csv, "also write the table as CSV")->type_name("FILE");
  CLI11_PARSE(app, argc, argv);

  const std::vector<std::string> head = {"stage",
                                         "ranks",
                                         "comm",
                                         "device",
                                         "dtype",
                                         "loss step 0",
                                         "loss last",
                                         "step ms",
                                         "exposed comm ms",
                                         "payload B/rank",
                                         "bus B/rank",
                                         "peak MiB",
                                         "saved act MiB/rank",
                                         "check"};
  std::vector<Row> rows;
  try {
    for (const auto& f : files) rows.push_back(summarise(f));
  } catch (const std::exception& e) {
    fmt::print(stderr, "tpx_report: error: {}\n", e.what());
    return 1;
  }
  auto cells = [](const Row& r) {
    return std::vector<std::string>{r.stage,      r.ranks,     r.comm,      r.device,     r.dtype,
                                    r.loss_first, r.loss_last, r.step_ms,   r.exposed_ms, r.payload,
                                    r.bus,        r.peak_mib,  r.saved_mib, r.check};
  };
  fmt::print("| {} |\n|{}\n", fmt::join(head, " | "), [&] {
    std::string s;
    for (std::size_t i = 0; i < head.size(); ++i) s += "---|";
    return s;
  }());
  for (const auto& r : rows) fmt::print("| {} |\n", fmt::join(cells(r), " | "));
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.device == "cpu"; }))
    fmt::print(
        "\nstep ms are CPU-backend timings: they show the mechanics, not GPU speed; "
        "step ms, exposed comm ms (communication no compute ran beside) and bytes are means over "
        "steps after the first.\n");
  if (!csv.empty()) {
    std::ofstream out(csv);
    out << fmt::format("{}\n", fmt::join(head, ","));
    for (const auto& r : rows) out << fmt::format("{}\n", fmt::join(cells(r), ","));
    if (!out) {
      fmt::print(stderr, "tpx_report: error: cannot write '{}'\n", csv);
      return 1;
    }
  }
  bool all_pass = true;
  for (const auto& r : rows) all_pass = all_pass && r.check != "FAIL";
  return all_pass ? 0 : 1;
}
