// tpx_report: reads the --json summaries of stage runs and prints one comparison table
// (markdown, bytes in binary units), optionally also as CSV (RFC 4180, raw numbers).
//
//   tpx_report out/01_baseline.json out/02_megatron_tp.np2.json ... [--csv table.csv]
//
// Every row carries its config (H, heads, KV heads, F, S, B, L, dtype), its ranks and mesh, so
// runs of different configs in one table can be told apart; the CSV's device column is the
// summary's device_description, the string the benchmark page names its device by.
#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/cli_hint.h"
#include "common/output.h"
#include "common/units.h"

namespace {

using nlohmann::json;

/// Bad input (a file that cannot be read or is not a summary): one line, exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// One run, as the table shows it.
struct Row {
  std::string stage, comm, device, device_description, dtype, check;
  int ranks = 1, pp = 1, dp = 1, cp = 1, tp = 1;
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, ffn = 0, seq = 0, batch = 0, layers = 0;
  double loss_first = 0, loss_last = 0, step_ms = 0, exposed_ms = 0, payload = 0, bus = 0;
  std::uint64_t peak = 0, saved = 0;

  /// "dp2 × tp2": the mesh's dimensions larger than 1, outermost first ("1" for one rank).
  std::string mesh() const {
    std::vector<std::string> dims;
    for (const auto& [name, size] : {std::pair{"pp", pp}, {"dp", dp}, {"cp", cp}, {"tp", tp}})
      if (size > 1) dims.push_back(fmt::format("{}{}", name, size));
    return dims.empty() ? "1" : fmt::format("{}", fmt::join(dims, " × "));
  }
  std::string config() const {
    return fmt::format("H {} NH {} NKV {} F {} S {} B {} L {}", hidden, heads, kv_heads, ffn, seq,
                       batch, layers);
  }
};

/// Mean over steps after the first (the first step pays for warm-up), or the only step.
double steady_mean(const json& steps, const char* key) {
  double sum = 0;
  int n = 0;
  for (std::size_t i = steps.size() > 1 ? 1 : 0; i < steps.size(); ++i, ++n)
    sum += steps[i].at(key).get<double>();
  return n ? sum / n : 0.0;
}

Row summarise(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError(fmt::format("cannot read '{}'", path));
  const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw InputError(fmt::format("'{}' is not JSON", path));
  try {
    const json& steps = j.at("steps");
    if (steps.empty()) throw InputError(fmt::format("'{}' has no steps", path));
    const json& c = j.at("config");
    Row r;
    r.stage = j.at("stage").get<std::string>();
    r.ranks = j.at("world_size").get<int>();
    r.pp = j.value("pp", 1);
    r.dp = j.value("dp", 1);
    r.cp = j.value("cp", 1);
    r.tp = r.ranks / std::max(1, r.pp * r.dp * r.cp);
    r.comm = j.at("comm").get<std::string>();
    r.device = c.at("device").get<std::string>();
    r.device_description = j.value("device_description", r.device);
    r.dtype = c.at("dtype").get<std::string>();
    for (auto [field, key] : {std::pair{&r.hidden, "hidden"},
                              {&r.heads, "heads"},
                              {&r.ffn, "ffn"},
                              {&r.seq, "seq"},
                              {&r.batch, "batch"},
                              {&r.layers, "layers"}})
      *field = c.at(key).get<std::int64_t>();
    r.kv_heads = c.value("kv_heads", r.heads);
    r.loss_first = steps.front().at("loss").get<double>();
    r.loss_last = steps.back().at("loss").get<double>();
    r.step_ms = steady_mean(steps, "ms");
    r.exposed_ms = steady_mean(steps, "exposed_comm_ms");
    r.payload = steady_mean(steps, "comm_payload_bytes");
    r.bus = steady_mean(steps, "comm_bus_bytes");
    r.peak = steps.back().at("peak_bytes").get<std::uint64_t>();
    r.saved = j.at("saved_activation_bytes").get<std::uint64_t>();
    r.check = j.contains("check") ? (j["check"].at("pass").get<bool>() ? "PASS" : "FAIL") : "-";
    return r;
  } catch (const json::exception& e) {
    throw InputError(fmt::format("'{}' is not a stage's --json summary ({})", path, e.what()));
  }
}

/// A byte mean as the markdown table shows it.
std::string bytes_cell(double bytes) {
  return tpx::bytes_text(static_cast<std::uint64_t>(bytes + 0.5));
}

/// One CSV field (RFC 4180): quoted when it holds a comma, a quote or a line break, with its
/// quotes doubled.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string out = "\"";
  for (const char ch : s) {
    if (ch == '"') out += '"';
    out += ch;
  }
  return out + '"';
}

std::string csv_line(const std::vector<std::string>& fields) {
  std::vector<std::string> quoted;
  for (const auto& f : fields) quoted.push_back(csv_field(f));
  return fmt::format("{}\r\n", fmt::join(quoted, ","));
}

void print_markdown(const std::vector<Row>& rows) {
  std::vector<std::string> devices;
  for (const Row& r : rows)
    if (std::find(devices.begin(), devices.end(), r.device_description) == devices.end())
      devices.push_back(r.device_description);
  fmt::print("Device: {}.\n\n", fmt::join(devices, "; "));
  const std::vector<std::string> head = {
      "stage",        "ranks",       "mesh",      "config",         "dtype",
      "comm",         "loss step 0", "loss last", "step ms",        "exposed comm ms",
      "payload/rank", "bus/rank",    "peak",      "saved act/rank", "check"};
  fmt::print("| {} |\n|", fmt::join(head, " | "));
  for (std::size_t i = 0; i < head.size(); ++i) fmt::print("---|");
  fmt::print("\n");
  for (const Row& r : rows)
    fmt::print(
        "| {} | {} | {} | {} | {} | {} | {:.6f} | {:.6f} | {:.2f} | {:.2f} | {} | {} | {} | "
        "{} | {} |\n",
        r.stage, r.ranks, r.mesh(), r.config(), r.dtype, r.comm, r.loss_first, r.loss_last,
        r.step_ms, r.exposed_ms, bytes_cell(r.payload), bytes_cell(r.bus), tpx::bytes_text(r.peak),
        tpx::bytes_text(r.saved), r.check);
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.device == "cpu"; }))
    fmt::print(
        "\nstep ms are CPU-backend timings: they show the mechanics, not GPU speed; "
        "step ms, exposed comm ms (communication no compute ran beside) and bytes are means over "
        "steps after the first.\n");
}

std::string csv_text(const std::vector<Row>& rows) {
  std::string text = csv_line({"stage",
                               "ranks",
                               "pp",
                               "dp",
                               "cp",
                               "tp",
                               "mesh",
                               "device",
                               "dtype",
                               "hidden",
                               "heads",
                               "kv_heads",
                               "ffn",
                               "seq",
                               "batch",
                               "layers",
                               "comm",
                               "loss_step0",
                               "loss_last",
                               "step_ms",
                               "exposed_comm_ms",
                               "payload_bytes_per_rank",
                               "bus_bytes_per_rank",
                               "peak_bytes",
                               "saved_activation_bytes_per_rank",
                               "check"});
  for (const Row& r : rows)
    text += csv_line({r.stage,
                      fmt::format("{}", r.ranks),
                      fmt::format("{}", r.pp),
                      fmt::format("{}", r.dp),
                      fmt::format("{}", r.cp),
                      fmt::format("{}", r.tp),
                      r.mesh(),
                      r.device_description,
                      r.dtype,
                      fmt::format("{}", r.hidden),
                      fmt::format("{}", r.heads),
                      fmt::format("{}", r.kv_heads),
                      fmt::format("{}", r.ffn),
                      fmt::format("{}", r.seq),
                      fmt::format("{}", r.batch),
                      fmt::format("{}", r.layers),
                      r.comm,
                      fmt::format("{:.9g}", r.loss_first),
                      fmt::format("{:.9g}", r.loss_last),
                      fmt::format("{:.4f}", r.step_ms),
                      fmt::format("{:.4f}", r.exposed_ms),
                      fmt::format("{:.0f}", r.payload),
                      fmt::format("{:.0f}", r.bus),
                      fmt::format("{}", r.peak),
                      fmt::format("{}", r.saved),
                      r.check});
  return text;
}

int fail(const std::string& message) {
  fmt::print(stderr, "tpx_report: error: {}\n", message);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> files;
  std::string csv;
  CLI::App app("tpx_report: one comparison table from stage --json summaries", "tpx_report");
  app.add_option("files", files, "--json files written by the stages")->required();
  app.add_option("--csv", csv, "also write the table as CSV (RFC 4180, raw numbers)")
      ->type_name("FILE")
      ->group("Output");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    fmt::print("{}", app.help());
    return 0;
  } catch (const CLI::ParseError& e) {
    return fail(tpx::parse_error_text(app, e));
  }

  if (!csv.empty()) {
    std::vector<tpx::NamedPath> inputs;
    for (const auto& f : files) inputs.push_back({"", f});
    if (std::string p = tpx::output_collision({{"--csv", csv}}, inputs); !p.empty()) return fail(p);
  }
  std::vector<Row> rows;
  try {
    for (const auto& f : files) rows.push_back(summarise(f));
  } catch (const InputError& e) {
    return fail(e.what());
  }
  print_markdown(rows);
  if (!csv.empty()) {
    std::ofstream out(csv, std::ios::binary);
    out << csv_text(rows);
    out.flush();
    if (!out) return fail(fmt::format("cannot write '{}'", csv));
  }
  const bool all_pass =
      std::none_of(rows.begin(), rows.end(), [](const Row& r) { return r.check == "FAIL"; });
  return all_pass ? 0 : 1;
}
