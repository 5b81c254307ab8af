// tpx_report: reads the --json summaries of stage runs and prints one comparison table
// (markdown, bytes in binary units), optionally also as CSV (RFC 4180, raw numbers).
//
//   tpx_report out/01_baseline.json out/02_megatron_tp.np2.json ... [--csv table.csv]
//
// Every row carries its config (H, heads, KV heads, F, S, B, L, dtype), its ranks and mesh, so
// runs of different configs in one table can be told apart; the CSV's device column is the
// summary's device_description, the string the benchmark page names its device by.
//
// Every field it reads is checked (its type, an integer where a count is meant, its range, and a
// mesh whose pp·dp·cp divides world_size): a bad one is one line naming the file and the field,
// exit 2. The CSV is written whole or not at all (common/output.h): a write that fails part-way
// (a full disk, a file-size limit) leaves an existing file as it was. Exit status: 0, or 1 when a
// run's check failed, 2 for bad input.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/checked.h"
#include "common/cli_hint.h"
#include "common/output.h"
#include "common/units.h"

namespace {

using nlohmann::json;

/// Bad input (a file that cannot be read, is not a summary, or holds a field out of range): one
/// line, exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// One run, as the table shows it.
struct Row {
  std::string stage, comm, device, device_description, dtype, check;
  int ranks = 1, pp = 1, dp = 1, cp = 1, tp = 1;
  int ep = 1;  ///< stage 10's experts: EP ranks borrowed from the data-parallel ones
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, ffn = 0, seq = 0, batch = 0, layers = 0;
  double loss_first = 0, loss_last = 0, step_ms = 0, exposed_ms = 0, payload = 0, bus = 0;
  std::uint64_t peak = 0, saved = 0;

  /// "dp2 × tp2": the mesh's dimensions larger than 1, outermost first ("1" for one rank);
  /// stage 10's EP after them, "dp4 × tp2, ep2", since it is cut out of the data-parallel ranks.
  std::string mesh() const {
    std::vector<std::string> dims;
    for (const auto& [name, size] : {std::pair{"pp", pp}, {"dp", dp}, {"cp", cp}, {"tp", tp}})
      if (size > 1) dims.push_back(fmt::format("{}{}", name, size));
    const std::string mesh = dims.empty() ? "1" : fmt::format("{}", fmt::join(dims, " × "));
    return ep > 1 ? fmt::format("{}, ep{}", mesh, ep) : mesh;
  }
  std::string config() const {
    return fmt::format("H {} NH {} NKV {} F {} S {} B {} L {}", hidden, heads, kv_heads, ffn, seq,
                       batch, layers);
  }
};

/// A summary's fields as tpx_report reads them, each checked: a field that is missing, of the
/// wrong type or out of range is an InputError naming the file and the field ("config.hidden",
/// "steps[1].ms"), never a wrapped or garbage number in the table.
class Fields {
 public:
  explicit Fields(const std::string& path) : path_(path) {}

  /// obj[key] ("where.key" in messages); missing: not a summary.
  const json& at(const json& obj, const std::string& where, const char* key) const {
    const std::string field = name(where, key);
    if (!obj.is_object() || !obj.contains(key))
      throw InputError(
          fmt::format("'{}' is not a stage's --json summary: it has no {}", path_, field));
    return obj.at(key);
  }
  std::string text(const json& obj, const std::string& where, const char* key) const {
    const json& v = at(obj, where, key);
    if (!v.is_string()) bad(name(where, key), v, "a string");
    return v.get<std::string>();
  }
  /// An integer from `lo` to `hi`: a JSON integer, or a number with no fraction (1e3).
  std::int64_t integer(const json& obj, const std::string& where, const char* key, std::int64_t lo,
                       std::int64_t hi) const {
    const json& v = at(obj, where, key);
    const std::string rule = fmt::format("an integer from {} to {}", lo, hi);
    std::int64_t i = 0;
    if (v.is_number_unsigned()) {  // a JSON integer >= 0, possibly past int64
      const auto u = v.get<std::uint64_t>();
      if (u > std::uint64_t(hi)) bad(name(where, key), v, rule);
      i = std::int64_t(u);
    } else if (v.is_number_integer()) {
      i = v.get<std::int64_t>();
    } else if (v.is_number_float()) {
      // 2^63 is the first double past int64: anything below it that has no fraction converts.
      const double x = v.get<double>();
      if (!(std::isfinite(x) && x == std::floor(x) && std::abs(x) < 0x1p63))
        bad(name(where, key), v, rule);
      i = std::int64_t(x);
    } else {
      bad(name(where, key), v, rule);
    }
    if (i < lo || i > hi) bad(name(where, key), v, rule);
    return i;
  }
  /// A mesh dimension: an int of at least 1, obj[key] or `missing` when absent.
  int count(const json& obj, const std::string& where, const char* key, int missing) const {
    if (!obj.contains(key)) return missing;
    return int(integer(obj, where, key, 1, std::numeric_limits<int>::max()));
  }
  /// A finite number, at least `lo`.
  double real(const json& obj, const std::string& where, const char* key, double lo) const {
    const json& v = at(obj, where, key);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < lo)
      bad(name(where, key), v,
          std::isinf(lo) ? "a finite number" : fmt::format("a finite number >= {}", lo));
    return v.get<double>();
  }
  [[noreturn]] void bad(const std::string& field, const json& value,
                        const std::string& rule) const {
    throw InputError(
        fmt::format("'{}': {} is {}: it must be {}", path_, field, value.dump(), rule));
  }
  [[noreturn]] void inconsistent(const std::string& why) const {
    throw InputError(fmt::format("'{}': {}", path_, why));
  }

 private:
  static std::string name(const std::string& where, const char* key) {
    return where.empty() ? std::string(key) : where + "." + key;
  }
  const std::string& path_;
};

constexpr std::int64_t kMaxCount = std::numeric_limits<std::int64_t>::max();
constexpr double kAnyNumber = -std::numeric_limits<double>::infinity();

/// Mean of steps[i][key] over the steps after the first (the first step pays for warm-up), or
/// the only step; each value a finite number >= 0. A running mean: no sum to overflow.
double steady_mean(const Fields& f, const json& steps, const char* key) {
  double mean = 0;
  int n = 0;
  for (std::size_t i = steps.size() > 1 ? 1 : 0; i < steps.size(); ++i)
    mean += (f.real(steps[i], fmt::format("steps[{}]", i), key, 0.0) - mean) / ++n;
  return mean;
}

/// The file's text; a directory or an unreadable file is an InputError.
std::string read_text(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(fmt::format("cannot read '{}': it is a directory, not a --json file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("cannot read '{}'", path));
  try {
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::exception& e) {
    throw InputError(fmt::format("cannot read '{}': {}", path, e.what()));
  }
}

Row summarise(const std::string& path) {
  const json j = json::parse(read_text(path), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw InputError(fmt::format("'{}' is not JSON", path));
  const Fields f(path);
  const json& steps = f.at(j, "", "steps");
  if (!steps.is_array() || steps.empty()) throw InputError(fmt::format("'{}' has no steps", path));
  const json& c = f.at(j, "", "config");
  Row r;
  r.stage = f.text(j, "", "stage");
  r.ranks = int(f.integer(j, "", "world_size", 1, std::numeric_limits<int>::max()));
  // The mesh: pp·dp·cp must divide the ranks, the rest is TP.
  r.pp = f.count(j, "", "pp", 1);
  r.dp = f.count(j, "", "dp", 1);
  r.cp = f.count(j, "", "cp", 1);
  const auto pp_dp = tpx::checked_mul<std::int64_t>(r.pp, r.dp);
  const auto outer = pp_dp ? tpx::checked_mul<std::int64_t>(*pp_dp, r.cp) : std::nullopt;
  if (!outer || r.ranks % *outer != 0)
    f.inconsistent(fmt::format(
        "world_size {} is not a multiple of pp·dp·cp (pp {}, dp {}, cp {}): the mesh does not "
        "cover the ranks",
        r.ranks, r.pp, r.dp, r.cp));
  r.tp = int(r.ranks / *outer);
  if (j.contains("moe")) {  // stage 10: EP divides D
    const json& moe = f.at(j, "", "moe");
    if (!moe.is_object()) f.bad("moe", moe, "an object");
    r.ep = f.count(moe, "moe", "ep", 1);
    if (r.dp % r.ep != 0)
      f.inconsistent(
          fmt::format("moe.ep {} does not divide dp {}: EP is cut out of the "
                      "data-parallel ranks",
                      r.ep, r.dp));
  }
  r.comm = f.text(j, "", "comm");
  r.device = f.text(c, "config", "device");
  r.device_description =
      j.contains("device_description") ? f.text(j, "", "device_description") : r.device;
  r.dtype = f.text(c, "config", "dtype");
  for (auto [field, key] : {std::pair{&r.hidden, "hidden"},
                            {&r.heads, "heads"},
                            {&r.ffn, "ffn"},
                            {&r.seq, "seq"},
                            {&r.batch, "batch"},
                            {&r.layers, "layers"}})
    *field = f.integer(c, "config", key, 1, kMaxCount);
  r.kv_heads = c.contains("kv_heads") ? f.integer(c, "config", "kv_heads", 1, kMaxCount) : r.heads;
  if (r.heads % r.kv_heads != 0)
    f.inconsistent(
        fmt::format("config.kv_heads {} does not divide config.heads {}", r.kv_heads, r.heads));
  const std::string last = fmt::format("steps[{}]", steps.size() - 1);
  r.loss_first = f.real(steps.front(), "steps[0]", "loss", kAnyNumber);
  r.loss_last = f.real(steps.back(), last, "loss", kAnyNumber);
  r.step_ms = steady_mean(f, steps, "ms");
  r.exposed_ms = steady_mean(f, steps, "exposed_comm_ms");
  r.payload = steady_mean(f, steps, "comm_payload_bytes");
  r.bus = steady_mean(f, steps, "comm_bus_bytes");
  r.peak = std::uint64_t(f.integer(steps.back(), last, "peak_bytes", 0, kMaxCount));
  r.saved = std::uint64_t(f.integer(j, "", "saved_activation_bytes", 0, kMaxCount));
  if (j.contains("check")) {
    const json& pass = f.at(j.at("check"), "check", "pass");
    if (!pass.is_boolean()) f.bad("check.pass", pass, "true or false");
    r.check = pass.get<bool>() ? "PASS" : "FAIL";
  } else {
    r.check = "-";
  }
  return r;
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
  // A write past a file-size limit (ulimit -f) then fails with EFBIG, which the CSV's writer
  // reports and cleans up after, instead of killing the process half-way through the file.
  std::signal(SIGXFSZ, SIG_IGN);
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
    if (std::string p = tpx::output_file_problem("--csv", csv); !p.empty()) return fail(p);
  }
  std::vector<Row> rows;
  try {
    for (const auto& f : files) rows.push_back(summarise(f));
  } catch (const InputError& e) {
    return fail(e.what());
  }
  if (!csv.empty()) {
    // Whole or absent, like the stages' outputs: a failed write leaves an existing file as it was.
    try {
      tpx::write_text_file(csv, csv_text(rows));
    } catch (const tpx::Error& e) {
      return fail(e.what());
    }
  }
  print_markdown(rows);
  const bool all_pass =
      std::none_of(rows.begin(), rows.end(), [](const Row& r) { return r.check == "FAIL"; });
  return all_pass ? 0 : 1;
}
