#include "projection.h"

#include "02_megatron_tp/traffic.h"
#include "03_sequence_parallel/traffic.h"
#include "04_overlap_ring/traffic.h"
#include "06_fp8/traffic.h"
#include "07_fsdp_tp/memory.h"
#include "08_context_parallel/memory.h"
#include "09_pipeline_parallel/schedule.h"
#include "common/checked.h"
#include "common/memory.h"
#include "common/model.h"
#include "common/presets.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include <stdexcept>

namespace tpx::projection {
namespace {

using I = std::int64_t;

// The model's own errors are std::runtime_error (one line); the schedule library's are
// tpx::ConfigError, a std::runtime_error too.
[[noreturn]] void fail(const std::string& why) {
  throw std::runtime_error(why);
}
void check(bool ok, const char* why) {
  if (!ok) fail(why);
}

/// The --dtype word of the linear GEMMs' type.
std::string dtype_word(DType d) {
  return d == DType::bf16 ? "bf16" : is_fp8(d) ? "fp8" : "fp32";
}
using nlohmann::json;

json read_json(const std::filesystem::path& file) {
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec))
    fail(fmt::format("cannot read {}: it is a directory, not a JSON file", file.string()));
  std::ifstream in(file);
  if (!in) fail(fmt::format("cannot read {}", file.string()));
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(fmt::format("{} is not valid JSON: {}", file.string(), e.what()));
  } catch (const std::ios_base::failure& e) {
    fail(fmt::format("cannot read {}: {}", file.string(), e.what()));
  }
}

/// j[key] as a number, or a one-line error naming the file and the key.
double number(const json& j, const char* key, const std::filesystem::path& file) {
  if (!j.contains(key) || !j.at(key).is_number())
    fail(fmt::format("{}: \"{}\" is missing or not a number", file.string(), key));
  return j.at(key).get<double>();
}

/// j[key] (or `missing` when absent) as a finite number from `lo` to `hi`, `lo` itself excluded
/// unless `lo_ok`: a device's figures (a peak, a rate, an efficiency, a count) checked, so that
/// a negative or absurd one is an error naming the file and the key, not a table of garbage.
double figure(const json& j, const char* key, const std::filesystem::path& file, double lo,
              bool lo_ok, double hi, std::optional<double> missing = std::nullopt) {
  if (missing && !j.contains(key)) return *missing;
  const double v = number(j, key, file);
  if (!(std::isfinite(v) && (v > lo || (lo_ok && v == lo)) && v <= hi))
    fail(fmt::format(
        "{}: \"{}\" is {:g}: it must be a number {} {:g}{}", file.string(), key, v,
        lo_ok ? ">=" : ">", lo,
        hi < std::numeric_limits<double>::max() ? fmt::format(" and <= {:g}", hi) : std::string()));
  return v;
}
constexpr double kNoLimit = std::numeric_limits<double>::max();

/// A count in a device file (SMs, GPUs per node): an integer from `lo` to 10^6.
int count(const json& j, const char* key, const std::filesystem::path& file, int lo,
          std::optional<double> missing = std::nullopt) {
  const double v = figure(j, key, file, lo, true, 1e6, missing);
  if (v != std::floor(v))
    fail(fmt::format("{}: \"{}\" is {:g}: it must be an integer", file.string(), key, v));
  return static_cast<int>(v);
}

std::string text(const json& j, const char* key, const std::filesystem::path& file) {
  if (!j.contains(key) || !j.at(key).is_string())
    fail(fmt::format("{}: \"{}\" is missing or not a string", file.string(), key));
  return j.at(key).get<std::string>();
}

/// j["points"]: [[x, efficiency], …], sorted by x; `what` names the block in the error.
std::vector<std::pair<double, double>> curve_points(const json& j, const std::string& what,
                                                    const std::filesystem::path& file) {
  if (!j.is_object() || !j.contains("points") || !j["points"].is_array() || j["points"].empty())
    fail(fmt::format("{}: {}: \"points\": [[x, efficiency], …] is missing", file.string(), what));
  std::vector<std::pair<double, double>> points;
  for (const json& p : j["points"]) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number() ||
        p[1].get<double>() <= 0)
      fail(fmt::format("{}: {}: a point is not [x, efficiency > 0]", file.string(), what));
    points.emplace_back(p[0].get<double>(), p[1].get<double>());
  }
  std::sort(points.begin(), points.end());
  return points;
}

}  // namespace

std::string stage_name(int stage) {
  static const char* names[] = {"",
                                "01_baseline",
                                "02_megatron_tp",
                                "03_sequence_parallel",
                                "04_overlap_ring",
                                "05_copy_engine_async_tp",
                                "06_fp8"};
  return stage >= 1 && stage <= 6 ? names[stage] : "?";
}

// --- the GEMM efficiency curve -------------------------------------------------------------------

double EfficiencyCurve::at(double flops) const {
  check(!points.empty(), "empty GEMM efficiency curve");
  if (flops <= points.front().first) return points.front().second;
  if (flops >= points.back().first) return points.back().second;
  for (std::size_t i = 1; i < points.size(); ++i)
    if (flops <= points[i].first) {
      const auto [x0, y0] = points[i - 1];
      const auto [x1, y1] = points[i];
      const double t = (std::log(flops) - std::log(x0)) / (std::log(x1) - std::log(x0));
      return y0 + t * (y1 - y0);
    }
  return points.back().second;
}

// --- devices -------------------------------------------------------------------------------------

double DeviceSpec::attention_at(double seq) const {
  if (attention_kernel.empty()) return attention_efficiency;
  return attention_kernels.at(attention_kernel).at(seq);
}

std::string DeviceSpec::attention_origin() const {
  if (attention_kernel.empty())
    return fmt::format(
        "attention efficiency {:g}, {} ({})", attention_efficiency,
        std::find(assumed.begin(), assumed.end(), "attention_efficiency") != assumed.end()
            ? "assumed"
            : "given",
        file);
  return fmt::format("the measured '{}' attention kernel: {}", attention_kernel,
                     attention_kernels.at(attention_kernel).origin);
}

void use_attention(DeviceSpec& d, const std::string& name) {
  if (name == "assumed") {
    d.attention_kernel.clear();
    return;
  }
  if (d.attention_kernels.count(name) == 0) {
    std::vector<std::string> known{"assumed"};
    for (const auto& [k, curve] : d.attention_kernels) known.push_back(k);
    throw std::invalid_argument(fmt::format("--attention {}: {} has no such kernel (known: {})",
                                            name, d.file, fmt::join(known, ", ")));
  }
  d.attention_kernel = name;
}

DeviceSpec load_device(const std::filesystem::path& file, bool measured) {
  const json j = read_json(file);
  DeviceSpec d;
  d.file = file.filename().string();
  d.name = text(j, "name", file);
  // Peaks and rates above 0, efficiencies in (0, 1], slow-downs at least 1 (0: none given).
  d.peak_bf16_flops = figure(j, "peak_bf16_flops", file, 0, false, kNoLimit);
  d.peak_fp8_flops = figure(j, "peak_fp8_flops", file, 0, false, kNoLimit);
  d.hbm_GBps = figure(j, "hbm_GBps", file, 0, false, kNoLimit);
  d.nvlink_GBps_per_direction = figure(j, "nvlink_GBps_per_direction", file, 0, false, kNoLimit);
  d.link_latency_us = figure(j, "link_latency_us", file, 0, true, kNoLimit);
  d.sms = count(j, "sms", file, 1);
  d.collective_sms = count(j, "collective_sms", file, 0);
  d.copy_engine_GBps = figure(j, "copy_engine_GBps", file, 0, false, kNoLimit);
  d.collective_efficiency = figure(j, "collective_efficiency", file, 0, false, 1);
  d.attention_efficiency = figure(j, "attention_efficiency", file, 0, false, 1);
  d.copy_engine_gemm_slowdown =
      figure(j, "copy_engine_gemm_slowdown", file, 1, true, kNoLimit, 1.0);
  d.ring_gemm_slowdown = figure(j, "ring_gemm_slowdown", file, 0, true, kNoLimit, 0.0);
  if (d.ring_gemm_slowdown > 0 && d.ring_gemm_slowdown < 1)
    fail(
        fmt::format("{}: \"ring_gemm_slowdown\" is {:g}: it must be 0 (derived from the SMs) or "
                    ">= 1",
                    file.string(), d.ring_gemm_slowdown));
  d.dp_GBps_per_direction = figure(j, "dp_GBps_per_direction", file, 0, true, kNoLimit, 0.0);
  d.dp_efficiency = figure(j, "dp_efficiency", file, 0, false, 1, 1.0);
  d.elementwise_scale = figure(j, "elementwise_scale", file, 0, false, kNoLimit, 1.0);
  d.gpus_per_node = count(j, "gpus_per_node", file, 1, 8.0);
  if (j.contains("assumptions") && j["assumptions"].is_object())
    for (const auto& [key, why] : j["assumptions"].items()) d.assumed.push_back(key);
  if (d.sms <= d.collective_sms || d.collective_sms < 0)
    fail(fmt::format("{}: collective_sms must be in [0, sms)", file.string()));
  if (!j.contains("gemm_efficiency") || !j["gemm_efficiency"].contains("points"))
    fail(fmt::format("{}: \"gemm_efficiency\": {{\"points\": [[flops, efficiency], …]}} is missing",
                     file.string()));
  for (const json& p : j["gemm_efficiency"]["points"]) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number())
      fail(fmt::format("{}: a gemm_efficiency point is not [flops, efficiency]", file.string()));
    d.gemm.points.emplace_back(p[0].get<double>(), p[1].get<double>());
  }
  if (d.gemm.points.empty()) fail(fmt::format("{}: no gemm_efficiency points", file.string()));
  std::sort(d.gemm.points.begin(), d.gemm.points.end());
  d.gemm.origin = "assumed (" + d.file + ")";
  if (j["gemm_efficiency"].contains("assumption")) d.assumed.push_back("gemm_efficiency");
  if (!j.contains("sources") || !j["sources"].is_array() || j["sources"].empty())
    fail(fmt::format("{}: \"sources\" must list where the figures come from", file.string()));
  if (!measured || !j.contains("measured")) return d;
  // Measurements replace assumptions: the GEMM curve, and attention by the default kernel.
  const json& m = j["measured"];
  const std::string source = text(m, "source", file);
  if (m.contains("gemm_efficiency")) {
    d.gemm.points = curve_points(m["gemm_efficiency"], "measured.gemm_efficiency", file);
    d.gemm.origin =
        fmt::format("measured ({}: {}, {:.2g} … {:.2g} FLOPs, held constant outside)", d.file,
                    source, d.gemm.points.front().first, d.gemm.points.back().first);
    std::erase(d.assumed, "gemm_efficiency");
    d.calibrated = true;
  }
  if (m.contains("attention")) {
    const json& a = m["attention"];
    if (!a.contains("kernels") || !a["kernels"].is_object() || a["kernels"].empty())
      fail(fmt::format("{}: measured.attention: \"kernels\" is missing", file.string()));
    for (const auto& [name, k] : a["kernels"].items()) {
      EfficiencyCurve& c = d.attention_kernels[name];
      c.points = curve_points(k, "measured.attention." + name, file);
      c.origin = fmt::format("{} ({}), S {:g} … {:g}, held constant outside", source, d.file,
                             c.points.front().first, c.points.back().first);
    }
    const std::string chosen = text(m, "attention_default", file);
    if (d.attention_kernels.count(chosen) == 0)
      fail(fmt::format("{}: measured.attention_default '{}' is not one of its kernels",
                       file.string(), chosen));
    d.attention_kernel = chosen;
    std::erase(d.assumed, "attention_efficiency");
  }
  return d;
}

bool calibrate(DeviceSpec& device, const std::filesystem::path& bench_json) {
  const json j = read_json(bench_json);
  if (!j.contains("benchmarks") || !j["benchmarks"].is_array())
    fail(fmt::format("{}: not a Google Benchmark JSON file (no \"benchmarks\")",
                     bench_json.string()));
  const std::string file = bench_json.filename().string();
  std::vector<std::pair<double, double>> points;
  int whole = 0, chunked = 0;
  // The largest GEMM of each mover in bench_copy_overlap: {n, slowdown}.
  std::pair<I, double> ce{0, 0.0}, sm{0, 0.0};
  for (const json& b : j["benchmarks"]) {
    const std::string name = b.value("name", "");
    if (b.value("run_type", "iteration") != "iteration") continue;
    const std::string label = b.value("label", "");
    I m = 0, n = 0, k = 0, chunks = 0;
    const bool is_whole = name.rfind("gemm/cuda/bf16/", 0) == 0;
    const bool is_chunked = name.rfind("gemm_chunked/cuda/bf16/", 0) == 0;
    if (is_whole || is_chunked) {
      const bool ok = is_whole ? std::sscanf(label.c_str(), "m=%ld n=%ld k=%ld", &m, &n, &k) == 3
                               : std::sscanf(label.c_str(), "m=%ld n=%ld k=%ld chunks=%ld", &m, &n,
                                             &k, &chunks) == 4 &&
                                     chunks > 0;
      if (!ok || !b.contains("TFLOP/s")) continue;
      // A chunked row's TFLOP/s is its n chunks' FLOPs over their summed time: the efficiency of
      // one chunk of m/n rows.
      const double flops = 2.0 * double(m) * double(n) * double(k) / double(is_whole ? 1 : chunks);
      const double eff = b["TFLOP/s"].get<double>() * 1e12 / device.peak_bf16_flops;
      points.emplace_back(flops, std::clamp(eff, 1e-3, 1.0));
      ++(is_whole ? whole : chunked);
      continue;
    }
    for (auto [prefix, slot] : {std::pair{"copy_overlap/cuda/bf16/copy_engine/", &ce},
                                std::pair{"copy_overlap/cuda/bf16/sm_copy/", &sm}}) {
      const std::string pre = prefix;
      if (name.rfind(pre, 0) != 0 || !b.contains("slowdown")) continue;
      const I size = std::atol(name.c_str() + pre.size());
      if (size >= slot->first) *slot = {size, std::max(1.0, b["slowdown"].get<double>())};
    }
  }
  bool any = false;
  if (!points.empty()) {
    std::sort(points.begin(), points.end());
    device.gemm.points = std::move(points);
    device.gemm.origin = fmt::format(
        "calibrated from {} ({} whole and {} chunked cuda bf16 GEMMs, {:.2g} … {:.2g} FLOPs; "
        "held constant outside)",
        file, whole, chunked, device.gemm.points.front().first, device.gemm.points.back().first);
    device.calibration_notes.push_back(device.gemm.origin);
    any = true;
  }
  if (ce.first > 0) {
    device.copy_engine_gemm_slowdown = ce.second;
    device.calibration_notes.push_back(fmt::format(
        "copy_engine_gemm_slowdown {:.3f} from {} (copy_overlap/cuda/bf16/copy_engine/{})",
        ce.second, file, ce.first));
    any = true;
  }
  if (sm.first > 0) {
    device.ring_gemm_slowdown = sm.second;
    device.calibration_notes.push_back(
        fmt::format("ring_gemm_slowdown {:.3f} from {} (copy_overlap/cuda/bf16/sm_copy/{})",
                    sm.second, file, sm.first));
    any = true;
  }
  if (!any) return false;
  device.calibrated = true;
  // What was measured is no longer an assumption.
  std::erase_if(device.assumed, [&](const std::string& key) {
    return (key == "gemm_efficiency" && whole + chunked > 0) ||
           (key == "copy_engine_gemm_slowdown" && ce.first > 0) ||
           ((key == "ring_gemm_slowdown" || key == "collective_sms") && sm.first > 0);
  });
  return true;
}

// --- time ----------------------------------------------------------------------------------------

namespace {

/// The model's arithmetic for one device, milliseconds.
struct Model {
  const DeviceSpec& d;
  int n;
  ModelOptions o;

  double gemm_ms(double flops, bool fp8) const {
    if (flops <= 0) return 0;
    const double peak = fp8 ? d.peak_fp8_flops : d.peak_bf16_flops;
    return flops / (peak * d.gemm.at(flops)) * 1e3;
  }
  double hbm_ms(double bytes) const { return bytes / (d.hbm_GBps * 1e9) * 1e3; }
  /// GEMM time × this while the transfer of a pipeline step runs beside it.
  double overlap_slowdown() const {
    if (o.schedule == Schedule::copy_engine) return d.copy_engine_gemm_slowdown;
    return d.ring_gemm_slowdown > 0 ? d.ring_gemm_slowdown
                                    : double(d.sms) / double(d.sms - d.collective_sms);
  }
  double latency_ms(double messages) const { return messages * d.link_latency_us * 1e-3; }
  /// Messages in the latency term of an all-reduce: 2·⌈log₂ N⌉, a tree or recursive doubling
  /// (what a library picks for the small all-reduces that are latency-bound; for the large ones
  /// the bandwidth term dominates either way).
  double ar_messages() const { return 2.0 * std::ceil(std::log2(double(n))); }
  /// A bulk collective: `bus` bytes per rank over the links in `messages` steps.
  double collective_ms(double bus, double messages) const {
    if (n == 1) return 0;
    return latency_ms(messages) +
           bus / (d.nvlink_GBps_per_direction * 1e9 * d.collective_efficiency) * 1e3;
  }
  /// One transfer of a pipeline step: a ring sendrecv (a kernel on SMs) or a copy-engine pull.
  double transfer_ms(double bytes) const {
    const double bw = o.schedule == Schedule::copy_engine
                          ? d.copy_engine_GBps
                          : d.nvlink_GBps_per_direction * d.collective_efficiency;
    return latency_ms(1) + bytes / (bw * 1e9) * 1e3;
  }
  /// A GEMM of `flops` fused with a gather / scatter of `full_bytes` (the whole [S, B, H]
  /// buffer): returns {time, compute time}.
  std::pair<double, double> primitive(double flops, double full_bytes, bool fp8) const {
    switch (o.schedule) {
      case Schedule::ring:
      case Schedule::copy_engine: {
        if (n == 1) return {gemm_ms(flops, fp8), gemm_ms(flops, fp8)};
        const double g = gemm_ms(flops / n, fp8);
        const double slow = overlap_slowdown();
        const double x = transfer_ms(full_bytes / n);
        return {g + (n - 1) * std::max(g * slow, x), n * g};
      }
      default: {
        const double g = gemm_ms(flops, fp8);
        return {g + collective_ms(full_bytes * (n - 1) / n, n - 1), g};
      }
    }
  }
};

}  // namespace

ModelOptions stage_options(int stage) {
  ModelOptions o;
  switch (stage) {
    case 1:
      o.schedule = Schedule::none;
      break;
    case 2:
      o.schedule = Schedule::all_reduce;
      break;
    case 3:
      o.schedule = Schedule::bulk;
      break;
    case 4:
      o.schedule = Schedule::ring;
      break;
    case 5:
      o.schedule = Schedule::copy_engine;
      break;
    case 6:
      o.schedule = Schedule::copy_engine;
      o.fp8 = true;
      break;
    default:
      fail(fmt::format("no stage {} (1 … 6)", stage));
  }
  return o;
}

Projection project(const DeviceSpec& d, const BlockConfig& c, int n, const ModelOptions& o) {
  check(n >= 1, "ranks must be >= 1");
  check(o.schedule != Schedule::none || n == 1, "stage 01 runs on one GPU");
  const Model m{d, n, o};
  const double T = double(c.seq * c.batch), H = double(c.hidden), F = double(c.ffn);
  const double N = n, S = double(c.seq), B = double(c.batch), L = double(c.layers);
  const bool f8 = o.fp8;
  const double E = o.act_bytes;
  const double full = T * H * E;                 // one [S, B, H] activation
  const double gather_full = f8 ? T * H : full;  // what a gather moves (1-byte codes under fp8)
  const bool sp = o.schedule != Schedule::none && o.schedule != Schedule::all_reduce;

  // The linear GEMMs of one layer on one rank (FLOPs; each backward GEMM as its forward).
  const double KV = double(c.kv_dim());  // NKV·D: Wk and Wv are [H, KV] (GQA)
  const double qkv = 2 * T * H * (H + 2 * KV) / N, out = 2 * T * (H / N) * H;
  const double gu = 2 * T * H * 2 * F / N, down = 2 * T * (F / N) * H;
  // Attention (common/flops.h): forward 2·(2·B·S²·H) over the heads, 1/N per rank; backward 2×.
  // Under context parallelism the S queries here attend the keys of all C ranks (C·S).
  const double attn_f = 2 * (2 * B * S * S * H) / N * o.cp;
  const double attn_ms = attn_f / (d.peak_bf16_flops * d.attention_at(S * o.cp)) * 1e3;
  // Element-wise work (assumed: 12 passes over the residual stream and 6 over the FFN activations
  // of fp32 per forward, twice that backward; the stream is sharded under sequence parallelism).
  const double stream = sp ? T * H / N : T * H;
  const double ew_f = d.elementwise_scale * m.hbm_ms(4 * (12 * stream + 6 * T * F / N));
  // FP8 casts (amax, scale, quantize: read 4 + 4, write 1 byte per element) of the operands.
  const double q_f =
      f8 ? m.hbm_ms(9 * (3 * T * H / N + T * F / N + (2 * H * H + 2 * H * KV + 3 * H * F) / N))
         : 0.0;
  const double q_b = f8 ? m.hbm_ms(9 * (5 * T * H / N + 2 * T * F / N)) : 0.0;
  // The N − 1 chunk adds of a pipelined reduce-scatter (read 2, write 1 fp32 chunk each).
  const bool pipelined = o.schedule == Schedule::ring || o.schedule == Schedule::copy_engine;
  const double adds = pipelined ? (N - 1) * m.hbm_ms(3 * 4 * T * H / N) : 0.0;
  // The amax MAX all-reduces (fp8): 4 per phase, latency-bound.
  const double amax = f8 ? 4 * m.collective_ms(4 * 4 * 2 * (N - 1) / N, m.ar_messages()) : 0.0;
  const double gains = 2 * m.collective_ms(4 * H * 2 * (N - 1) / N, m.ar_messages());

  Phase fwd, bwd;
  auto add = [](Phase& ph, std::pair<double, double> t) {
    ph.step_ms += t.first;
    ph.compute_ms += t.second;
  };
  auto plain = [&](double flops) {
    const double t = m.gemm_ms(flops, f8);
    return std::pair{t, t};
  };
  auto all_reduce = [&] {
    return std::pair{m.collective_ms(full * 2 * (N - 1) / N, m.ar_messages()), 0.0};
  };

  if (!sp) {  // 01 and 02: whole GEMMs; 02 all-reduces after Wo, Wd and before the backward f
    for (double g : {qkv, out, gu, down}) add(fwd, plain(g));
    for (double g : {qkv, out, gu, down}) {
      add(bwd, plain(g));
      add(bwd, plain(g));
    }
    if (o.schedule == Schedule::all_reduce)
      for (int i = 0; i < 2; ++i) {
        add(fwd, all_reduce());
        add(bwd, all_reduce());
      }
  } else {  // 03 … 06: every collective paired with the GEMM it feeds or drains
    add(fwd, m.primitive(qkv, gather_full, f8));   // AG h → qkv
    add(fwd, m.primitive(out, full, f8));          // o → RS
    add(fwd, m.primitive(gu, gather_full, f8));    // AG h2 → gate/up
    add(fwd, m.primitive(down, full, f8));         // down → RS
    add(bwd, m.primitive(down, gather_full, f8));  // AG dY → dA of down
    add(bwd, plain(down));                         // dW of down (gathered dY, kept a)
    add(bwd, m.primitive(gu, gather_full, f8));    // re-gather h2 → dW gate/up
    add(bwd, m.primitive(gu, full, f8));           // dX gate/up → RS
    add(bwd, m.primitive(out, gather_full, f8));   // AG dY → dA of o
    add(bwd, plain(out));                          // dW of o
    add(bwd, m.primitive(qkv, gather_full, f8));   // re-gather h → dW qkv
    add(bwd, m.primitive(qkv, full, f8));          // dX qkv → RS
    add(bwd, {gains, 0.0});
  }
  const double rs_adds = pipelined ? 2 * adds : 0.0;  // two reduce-scatters per phase
  add(fwd, {attn_ms + ew_f + q_f + rs_adds, attn_ms + ew_f + q_f + rs_adds});
  add(bwd, {2 * attn_ms + 2 * ew_f + q_b + rs_adds, 2 * attn_ms + 2 * ew_f + q_b + rs_adds});
  add(fwd, {amax, 0.0});
  add(bwd, {amax, 0.0});

  Projection p;
  p.flops_per_rank = L * 3 * (qkv + out + gu + down + attn_f);  // backward = 2 × forward
  p.attention_ms = L * attn_ms;
  p.forward = {fwd.step_ms * L, fwd.compute_ms * L};
  p.backward = {bwd.step_ms * L, bwd.compute_ms * L};
  const double forwards = o.recompute || c.recompute == Recompute::full ? 2.0 : 1.0;
  p.step_ms = forwards * p.forward.step_ms + p.backward.step_ms;
  p.compute_ms = forwards * p.forward.compute_ms + p.backward.compute_ms;
  p.exposed_comm_ms = p.step_ms - p.compute_ms;
  return p;
}

int activation_bytes(int stage, const BlockConfig& c) {
  return stage == 6 ? 2 : tpx::activation_bytes(c);
}

Comm comm_bytes(int stage, const BlockConfig& c, int n, int act_bytes) {
  if (act_bytes == 0) act_bytes = activation_bytes(stage, c);
  switch (stage) {
    case 1:
      return {};
    case 2:
      return megatron::traffic(c, n, act_bytes);
    case 3:
      return sp::traffic(c, n, act_bytes);
    case 4:
    case 5:  // the ring's transfers, pulled by the copy engine
      return ring::traffic(c, n, act_bytes);
    case 6:
      return async_fp8::traffic(c, n, act_bytes);
    default:
      throw std::runtime_error(fmt::format("no stage {} (1 … 6)", stage));
  }
}

EndsCost project_ends(const DeviceSpec& d, const BlockConfig& c, int n, const ModelOptions& o) {
  check(n >= 1, "ranks must be >= 1");
  EndsCost e;
  if (!c.lm()) return e;
  const Model m{d, n, o};
  const double N = n, T = double(c.tokens()), H = double(c.hidden), E = o.act_bytes;
  const double V = double(vocab_shard(c, Sharding{.world = n, .weights = true}).padded);
  const double full = T * H * E;  // one [S, B, H] activation
  const bool sp = o.schedule != Schedule::none && o.schedule != Schedule::all_reduce;
  const TpLayout layout = !sp                            ? TpLayout::all_reduce
                          : o.schedule == Schedule::bulk ? TpLayout::sequence
                                                         : TpLayout::ring;
  const double stream = sp ? T * H / N : T * H;  // the residual stream's rows on this rank
  auto both = [](Phase& ph, double t) {
    ph.step_ms += t;
    ph.compute_ms += t;
  };
  auto add = [](Phase& ph, std::pair<double, double> t) {
    ph.step_ms += t.first;
    ph.compute_ms += t.second;
  };

  // Embedding: read the ids' rows, write the stream (fp32 math, the activations' width out);
  // backward the scatter-add of the stream's gradient into the fp32 rows.
  both(e.embedding.forward, d.elementwise_scale * m.hbm_ms(T * H * (4 + E)));
  both(e.embedding.backward, d.elementwise_scale * m.hbm_ms(T * H * (E + 2 * 4)));
  if (n > 1) {
    const Traffic emb = lm_embedding_traffic(c, n, int(E), layout);
    const double calls = double(emb.calls), per_call = double(emb.bus) / calls;
    const double messages = sp ? N - 1 : m.ar_messages();
    e.embedding.forward.step_ms += m.collective_ms(per_call, messages);
    if (sp) e.embedding.backward.step_ms += m.collective_ms(per_call, messages);
  }

  // Head: the final norm (2 passes forward, 4 backward, fp32), the output layer in bf16, the
  // cross-entropy's passes over the logits (max, sum-exp, softmax − one-hot: 3 fp32 passes).
  both(e.head.forward, d.elementwise_scale * m.hbm_ms(4 * 2 * stream));
  both(e.head.backward, d.elementwise_scale * m.hbm_ms(4 * 4 * stream));
  const double out = 2 * T * H * V / N;
  auto plain = [&] {
    const double t = m.gemm_ms(out, false);
    return std::pair{t, t};
  };
  if (!sp) {
    add(e.head.forward, plain());
    add(e.head.backward, plain());
    add(e.head.backward, plain());
    if (o.schedule == Schedule::all_reduce)
      e.head.backward.step_ms += m.collective_ms(full * 2 * (N - 1) / N, m.ar_messages());
  } else {
    add(e.head.forward, m.primitive(out, full, false));   // AG h → logits
    add(e.head.backward, m.primitive(out, full, false));  // re-gather h → dW_out
    add(e.head.backward, m.primitive(out, full, false));  // dX → RS
  }
  const double logits = d.elementwise_scale * m.hbm_ms(3 * 4 * T * V / N);
  both(e.head.forward, logits / 3);
  both(e.head.backward, 2 * logits / 3);
  if (n > 1) {
    const double ce = m.collective_ms(4 * T * 2 * (N - 1) / N, m.ar_messages());
    e.head.forward.step_ms += 3 * ce;  // MAX, SUM of exponentials, the targets' logits
    if (sp) e.head.backward.step_ms += m.collective_ms(4 * H * 2 * (N - 1) / N, m.ar_messages());
  }
  return e;
}

Projection project_stage(const DeviceSpec& d, const BlockConfig& c, int n, int stage) {
  ModelOptions o = stage_options(stage);
  o.act_bytes = activation_bytes(stage, c);
  Projection p = project(d, c, n, o);
  p.comm = comm_bytes(stage, c, n);
  const EndsCost e = project_ends(d, c, n, o);
  for (const EndCost* end : {&e.embedding, &e.head}) {
    p.forward.step_ms += end->forward.step_ms;
    p.forward.compute_ms += end->forward.compute_ms;
    p.backward.step_ms += end->backward.step_ms;
    p.backward.compute_ms += end->backward.compute_ms;
    p.step_ms += end->step_ms();
    p.compute_ms += end->compute_ms();
  }
  p.exposed_comm_ms = p.step_ms - p.compute_ms;
  if (c.lm())  // the output layer's GEMMs over the rank's V_pad / N columns
    p.flops_per_rank += 3 * 2 * double(c.tokens()) * double(c.hidden) *
                        double(vocab_shard(c, Sharding{.world = n, .weights = true}).padded) / n;
  return p;
}

double ag_gemm_ms(const DeviceSpec& d, I m, I n_local, I k, int ranks, int bytes, bool overlapped) {
  ModelOptions o;
  o.schedule = overlapped ? Schedule::copy_engine : Schedule::bulk;
  const Model model{d, ranks, o};
  const double flops = 2.0 * double(m) * double(n_local) * double(k);
  return model.primitive(flops, double(m) * double(k) * bytes, false).first;
}

double fused_ms(const DeviceSpec& d, double gemm_flops, double bytes_moved, int ranks,
                bool reduce_scatter) {
  ModelOptions o;
  o.schedule = Schedule::copy_engine;
  const Model model{d, ranks, o};
  const double g = model.gemm_ms(gemm_flops, false) * (ranks > 1 ? d.copy_engine_gemm_slowdown : 1);
  if (ranks == 1) return g;
  const double x = model.transfer_ms(bytes_moved / ranks), N = ranks;
  // All-gather: the local chunk first, chunk i once it has arrived; reduce-scatter: chunk i's
  // partial sums leave once computed, the last one's transfer after the GEMM.
  return reduce_scatter ? std::max(g, g / N + (N - 1) * x) + x : std::max(g, (N - 1) * x + g / N);
}

double gemm_rs_ms(const DeviceSpec& d, I m, I n, I k_local, int ranks, int bytes, bool fused) {
  const double flops = 2.0 * double(m) * double(n) * double(k_local);
  const double full = double(m) * double(n) * bytes;  // the partial sums, [m, n]
  if (fused) return fused_ms(d, flops, full, ranks, true);
  ModelOptions o;
  o.schedule = Schedule::bulk;
  const Model model{d, ranks, o};
  return model.primitive(flops, full, false).first;
}

TrainStep train_step(const DeviceSpec& d, const Workload& w, bool async) {
  check(w.tp >= 1 && w.dp >= 1 && w.layers >= 1, "a workload needs tp, dp, layers >= 1");
  ModelOptions o;
  o.schedule = async ? Schedule::copy_engine : Schedule::bulk;
  o.fp8 = w.fp8;
  o.act_bytes = 2;
  BlockConfig c = w.layer;
  c.layers = 1;
  c.recompute = Recompute::none;
  const Projection layer = project(d, c, w.tp, o);
  TrainStep t;
  const double L = w.layers, rf = w.recompute_fraction;
  const double layer_ms = (1 + rf) * layer.forward.step_ms + layer.backward.step_ms;
  const double layer_compute = (1 + rf) * layer.forward.compute_ms + layer.backward.compute_ms;
  t.layers_ms = L * layer_ms;

  // Embedding (vocab-parallel lookup, its output reduce-scattered in forward and gathered in
  // backward) and the output layer (final norm's output gathered, a vocab-parallel GEMM of
  // 2·T·H·V/TP FLOPs, its backward twice that, the input gradient reduce-scattered), bf16 GEMMs
  // (float8 recipes leave the output layer in bf16), bulk collectives.
  ModelOptions bulk;
  bulk.schedule = Schedule::bulk;
  const Model m{d, w.tp, bulk};
  const double T = double(c.seq * c.batch), H = double(c.hidden), V = double(w.vocab);
  const double stream = T * H * 2;  // one bf16 [S, B, H]
  const double coll = m.collective_ms(stream * (w.tp - 1) / w.tp, w.tp - 1);
  const double out_fwd = 2 * T * H * V / w.tp;
  t.head_ms = 4 * coll + m.gemm_ms(out_fwd, false) * 3 + m.hbm_ms(3 * 4 * T * V / w.tp);

  // AdamW on this rank's parameters: read weight, gradient, m, v (fp32); write weight, m, v.
  const double params_rank = (L * layer_params_per_tp_rank(c, w.tp) + 2 * V * H / w.tp + H) / w.dp;
  t.optimizer_ms = m.hbm_ms(28 * params_rank);

  // FSDP over DP: per layer two bf16 all-gathers and an fp32 reduce-scatter across nodes,
  // prefetched behind the previous layer; the first gather has nothing to hide behind.
  if (w.dp > 1) {
    check(d.dp_GBps_per_direction > 0,
          fmt::format("{}: dp_GBps_per_direction is needed for DP", d.file).c_str());
    const double bw = d.dp_GBps_per_direction * 1e9 * d.dp_efficiency;
    BlockConfig one = c;
    one.layers = 1;
    const double per_layer =
        fsdp_bytes(one, w.tp, w.dp, 2) / bw * 1e3 + 3 * (w.dp - 1) * d.link_latency_us * 1e-3;
    const double first_gather = per_layer * 2.0 / 8.0;  // one bf16 gather of the (2e + 4) = 8
    t.fsdp_exposed_ms = L * std::max(0.0, per_layer - layer_compute) + first_gather;
  }
  t.step_ms = t.layers_ms + t.head_ms + t.optimizer_ms + t.fsdp_exposed_ms;
  t.tokens_per_gpu_s = T / w.tp / (t.step_ms * 1e-3);
  return t;
}

// --- published results ---------------------------------------------------------------------------

double derived_value(const Published& p) {
  std::vector<double> x;
  for (const std::string& f : p.from) {
    try {
      std::size_t used = 0;
      x.push_back(std::stod(f, &used));
      if (used != f.size()) throw std::invalid_argument(f);
    } catch (const std::exception&) {
      fail(fmt::format("published result {}: \"{}\" in \"from\" is not a number", p.name, f));
    }
  }
  if (p.derive == "value" && x.size() == 1) return x[0];
  if (p.derive == "ratio" && x.size() == 2 && x[1] != 0) return x[0] / x[1];
  if (p.derive == "gain_pct" && x.size() == 1) return 1 + x[0] / 100;
  if (p.derive == "sum" && !x.empty()) {
    double sum = 0;
    for (double v : x) sum += v;
    return sum;
  }
  fail(fmt::format(
      "published result {}: \"derive\" must be value or gain_pct (one number), ratio (two) or "
      "sum (any), "
      "not \"{}\" of {}",
      p.name, p.derive, x.size()));
}

PublishedSet load_published(const std::filesystem::path& file) {
  const json j = read_json(file);
  if (!j.contains("results") || !j["results"].is_array())
    fail(fmt::format("{}: \"results\" must be a list", file.string()));
  PublishedSet out;
  for (const json& r : j["results"]) {
    Published p;
    p.name = text(r, "name", file);
    p.set = text(r, "set", file);
    if (p.set != "calibration" && p.set != "held_out")
      fail(fmt::format("{}: {}: \"set\" must be calibration or held_out", file.string(), p.name));
    p.what = text(r, "what", file);
    p.metric = text(r, "metric", file);
    p.unit = text(r, "unit", file);
    const json& src = r.at("source");
    p.source = text(src, "url", file);
    p.where = text(src, "where", file);
    p.quote = text(src, "quote", file);
    p.measured = text(r, "measured", file);
    p.device_file = text(r, "device", file);
    p.kind = text(r, "kind", file);
    p.notes = r.value("notes", "");
    p.value = number(r, "published", file);
    p.derive = text(r, "derive", file);
    if (!r.contains("from") || !r["from"].is_array())
      fail(fmt::format("{}: {}: \"from\" must list the quoted numbers", file.string(), p.name));
    for (const json& f : r["from"]) {
      if (!f.is_string())
        fail(fmt::format("{}: {}: \"from\" holds numbers as written, in strings", file.string(),
                         p.name));
      p.from.push_back(f.get<std::string>());
      if (p.quote.find(p.from.back()) == std::string::npos)
        fail(fmt::format("{}: {}: {} is not in the quoted source line", file.string(), p.name,
                         p.from.back()));
    }
    const double derived = derived_value(p);
    if (std::abs(derived - p.value) > 5e-4 * std::abs(derived))
      fail(fmt::format("{}: {}: published {} is not {} of the quoted {} ({})", file.string(),
                       p.name, p.value, p.derive, fmt::join(p.from, ", "), derived));
    p.ranks = static_cast<int>(number(r, "ranks", file));
    p.act_bytes = static_cast<int>(number(r, "act_bytes", file));
    if (r.contains("config")) {
      const json& c = r["config"];
      p.config.hidden = static_cast<I>(number(c, "hidden", file));
      p.config.heads = static_cast<I>(number(c, "heads", file));
      p.config.kv_heads = static_cast<I>(number(c, "kv_heads", file));
      if (c.value("recompute", "none") == "full") p.config.recompute = Recompute::full;
      p.config.ffn = static_cast<I>(number(c, "ffn", file));
      p.config.seq = static_cast<I>(number(c, "seq", file));
      p.config.batch = static_cast<I>(number(c, "batch", file));
      p.config.layers = 1;
      p.config.dtype = DType::bf16;
    }
    if (r.contains("gemm")) {
      p.m = static_cast<I>(number(r["gemm"], "m", file));
      p.n = static_cast<I>(number(r["gemm"], "n", file));
      p.k = static_cast<I>(number(r["gemm"], "k", file));
    }
    if (r.contains("workload")) {
      const json& w = r["workload"];
      BlockConfig& c = p.workload.layer;
      c.hidden = static_cast<I>(number(w, "hidden", file));
      c.heads = static_cast<I>(number(w, "heads", file));
      c.kv_heads = static_cast<I>(number(w, "kv_heads", file));
      c.ffn = static_cast<I>(number(w, "ffn", file));
      c.seq = static_cast<I>(number(w, "seq", file));
      c.batch = static_cast<I>(number(w, "local_batch", file));
      c.dtype = DType::bf16;
      p.workload.layers = static_cast<int>(number(w, "layers", file));
      p.workload.vocab = static_cast<I>(number(w, "vocab", file));
      p.workload.tp = static_cast<int>(number(w, "tp", file));
      p.workload.dp = static_cast<int>(number(w, "dp", file));
      p.workload.recompute_fraction = number(w, "recompute_fraction", file);
      const std::string prec = text(w, "precision", file);
      if (prec != "bf16" && prec != "fp8")
        fail(fmt::format("{}: {}: precision must be bf16 or fp8", file.string(), p.name));
      p.workload.fp8 = prec == "fp8";
    }
    out.results.push_back(std::move(p));
  }
  if (j.contains("left_out"))
    for (const json& r : j["left_out"])
      out.left_out.push_back(
          {text(r, "what", file), text(r, "source", file), text(r, "reason", file)});
  return out;
}

double error_pct(double projected, double published) {
  check(published != 0, "a published value of 0 has no relative error");
  return (projected - published) / published * 100.0;
}

namespace {

/// The model's value for one published case.
double projected_value(const Published& p, const DeviceSpec& d) {
  ModelOptions base, async;
  base.act_bytes = async.act_bytes = p.act_bytes;
  base.schedule = Schedule::bulk;          // PyTorch's TP + SP without async TP: stage 03
  async.schedule = Schedule::copy_engine;  // async TP by symmetric-memory pulls: stage 05
  if (p.kind == "forward_speedup")
    return project(d, p.config, p.ranks, base).forward.step_ms /
           project(d, p.config, p.ranks, async).forward.step_ms;
  if (p.kind == "train_speedup")
    return train_step(d, p.workload, false).step_ms / train_step(d, p.workload, true).step_ms;
  if (p.kind == "train_tokens_per_gpu_s") return train_step(d, p.workload, false).tokens_per_gpu_s;
  if (p.kind == "train_async_tokens_per_gpu_s")
    return train_step(d, p.workload, true).tokens_per_gpu_s;
  const I n_local = p.n / p.ranks, k_local = p.k / p.ranks;
  const double bulk_ag = ag_gemm_ms(d, p.m, n_local, p.k, p.ranks, p.act_bytes, false);
  const double fused_ag = fused_ms(d, 2.0 * double(p.m) * double(n_local) * double(p.k),
                                   double(p.m) * double(p.k) * p.act_bytes, p.ranks, false);
  if (p.kind == "ag_gemm_bulk_ms") return bulk_ag;
  if (p.kind == "ag_gemm_fused_ms") return fused_ag;
  if (p.kind == "ag_gemm_fused_speedup") return bulk_ag / fused_ag;
  const double bulk_rs = gemm_rs_ms(d, p.m, p.n, k_local, p.ranks, p.act_bytes, false);
  const double fused_rs = gemm_rs_ms(d, p.m, p.n, k_local, p.ranks, p.act_bytes, true);
  if (p.kind == "gemm_rs_bulk_ms") return bulk_rs;
  if (p.kind == "gemm_rs_fused_ms") return fused_rs;
  fail(fmt::format("published result {}: unknown kind \"{}\"", p.name, p.kind));
}

}  // namespace

std::vector<Validation> validate(const std::vector<Published>& cases,
                                 const std::filesystem::path& devices_dir,
                                 const DeviceSpec& calibrated, const DeviceTweak& tweak) {
  std::vector<Validation> out;
  for (const Published& p : cases) {
    DeviceSpec d =
        p.device_file == calibrated.file ? calibrated : load_device(devices_dir / p.device_file);
    if (tweak) tweak(d);
    Validation v{p, projected_value(p, d), 0.0};
    v.error_pct = error_pct(v.projected, p.value);
    out.push_back(std::move(v));
  }
  return out;
}

bool perturb(DeviceSpec& d, const std::string& key, double f) {
  if (std::find(d.assumed.begin(), d.assumed.end(), key) == d.assumed.end()) return false;
  auto excess = [f](double& slowdown) { slowdown = 1 + (slowdown - 1) * f; };
  if (key == "gemm_efficiency")
    for (auto& pt : d.gemm.points) pt.second = std::min(1.0, pt.second * f);
  else if (key == "peak_bf16_flops")
    d.peak_bf16_flops *= f;
  else if (key == "peak_fp8_flops")
    d.peak_fp8_flops *= f;
  else if (key == "hbm_GBps")
    d.hbm_GBps *= f;
  else if (key == "nvlink_GBps_per_direction")
    d.nvlink_GBps_per_direction *= f;
  else if (key == "link_latency_us")
    d.link_latency_us *= f;
  else if (key == "collective_sms")
    d.collective_sms =
        std::clamp(static_cast<int>(std::lround(d.collective_sms * f)), 0, d.sms - 1);
  else if (key == "copy_engine_GBps")
    d.copy_engine_GBps *= f;
  else if (key == "collective_efficiency")
    d.collective_efficiency = std::min(1.0, d.collective_efficiency * f);
  else if (key == "attention_efficiency")
    d.attention_efficiency = std::min(1.0, d.attention_efficiency * f);
  else if (key == "copy_engine_gemm_slowdown")
    excess(d.copy_engine_gemm_slowdown);
  else if (key == "ring_gemm_slowdown")
    excess(d.ring_gemm_slowdown);
  else if (key == "dp_GBps_per_direction")
    d.dp_GBps_per_direction *= f;
  else if (key == "dp_efficiency")
    d.dp_efficiency = std::min(1.0, d.dp_efficiency * f);
  else if (key == "elementwise_scale")
    d.elementwise_scale *= f;
  else
    fail(fmt::format("{}: the assumption \"{}\" is no parameter of the model", d.file, key));
  return true;
}

std::vector<Sensitivity> sensitivity(const std::vector<Published>& cases,
                                     const std::filesystem::path& devices_dir,
                                     const DeviceSpec& calibrated, double fraction) {
  const std::vector<Validation> base = validate(cases, devices_dir, calibrated);
  // Every key any case's device file marks as assumed, in a fixed order.
  std::vector<std::string> keys;
  for (const Published& p : cases) {
    const DeviceSpec d =
        p.device_file == calibrated.file ? calibrated : load_device(devices_dir / p.device_file);
    for (const std::string& k : d.assumed)
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
  }
  std::sort(keys.begin(), keys.end());
  std::vector<Sensitivity> out;
  for (const std::string& key : keys) {
    Sensitivity s{key, {}, {}};
    for (const double f : {1 - fraction, 1 + fraction}) {
      const auto moved =
          validate(cases, devices_dir, calibrated, [&](DeviceSpec& d) { perturb(d, key, f); });
      auto& into = f < 1 ? s.minus : s.plus;
      for (std::size_t i = 0; i < moved.size(); ++i)
        into.push_back(moved[i].error_pct - base[i].error_pct);
    }
    out.push_back(std::move(s));
  }
  return out;
}

// --- the report ----------------------------------------------------------------------------------

BlockConfig big_config() {
  BlockConfig c;
  c.hidden = 8192;
  c.heads = 64;
  c.kv_heads = 8;  // Llama 3 70B: grouped-query attention, 8 KV heads
  c.ffn = 28672;
  c.seq = 8192;
  c.batch = 1;
  c.layers = 1;
  c.dtype = DType::bf16;
  return c;
}

BlockConfig small_config() {
  BlockConfig c;
  c.hidden = 4096;
  c.heads = 32;
  c.kv_heads = 32;  // Llama 2 7B: multi-head attention
  c.ffn = 11008;
  c.seq = 2048;
  c.batch = 1;
  c.layers = 1;
  c.dtype = DType::bf16;
  return c;
}

Report make_report(const DeviceSpec& d, const std::vector<Validation>& validation,
                   const std::vector<LeftOut>& left_out,
                   const std::vector<Sensitivity>& sensitivity) {
  Report r;
  r.device = d;
  r.validation = validation;
  r.left_out = left_out;
  r.sensitivity = sensitivity;
  for (const auto& [name, c] : {std::pair{std::string("Llama-3-70B layer"), big_config()},
                                std::pair{std::string("Llama-7B-sized layer"), small_config()}}) {
    Report::Table t{name, c, {}};
    t.rows.push_back({1, 1, project_stage(d, c, 1, 1), 0.0});
    for (int n : {2, 4, 8}) {
      const double base = project_stage(d, c, n, 3).step_ms;
      for (int stage = 2; stage <= 6; ++stage) {
        const Projection p = project_stage(d, c, n, stage);
        t.rows.push_back({stage, n, p, base / p.step_ms});
      }
    }
    r.tables.push_back(std::move(t));
  }
  // Stage 07: one DP replica's batch of one sequence per layer; a layer in the middle of the
  // model, its DP traffic prefetched behind the previous layer's compute.
  r.mesh_config = big_config();
  if (d.dp_GBps_per_direction > 0)
    for (const int dp : {4, 32})
      r.mesh.push_back(project_mesh(d, r.mesh_config, 8, dp, fsdp_bytes(r.mesh_config, 8, dp, 2)));
  // The 4-D meshes: a Llama-3-70B-shaped stack of all 80 layers on 64 and 512 GPUs.
  if (d.dp_GBps_per_direction > 0)
    for (const int gpus : {64, 512}) {
      Report::LayoutTable t{gpus, layout_model("llama3-70b", gpus), {}, 0};
      for (const Layout& l : layout_table(gpus)) {
        t.rows.push_back(project_layout(d, t.config, l));
        if (t.rows.back().step_ms < t.rows[t.best].step_ms) t.best = t.rows.size() - 1;
      }
      r.layouts.push_back(std::move(t));
    }
  return r;
}

Report::MeshRow project_mesh(const DeviceSpec& d, const BlockConfig& replica, int tp, int dp,
                             double dp_bus_bytes, int tp_stage) {
  Report::MeshRow row;
  row.tp = tp;
  row.dp = dp;
  const Projection p = project_stage(d, replica, tp, tp_stage);
  row.tp_step_ms = p.step_ms;
  row.compute_ms = p.compute_ms;
  row.dp_bus_bytes = dp_bus_bytes;
  row.dp_ms = d.dp_GBps_per_direction > 0
                  ? dp_bus_bytes / (d.dp_GBps_per_direction * 1e9 * d.dp_efficiency) * 1e3 +
                        3 * (dp - 1) * d.link_latency_us * 1e-3
                  : 0.0;
  row.step_ms = p.step_ms + std::max(0.0, row.dp_ms - p.compute_ms);
  return row;
}

namespace {

/// A group's link: NVLink when its `size` ranks, `stride` apart, sit in one node, else the
/// inter-node network.
struct Link {
  double GBps = 0, efficiency = 1, latency_us = 0;
  /// `bytes` over the link in `messages` messages, milliseconds.
  double ms(double bytes, double messages) const {
    return bytes / (GBps * 1e9 * efficiency) * 1e3 + messages * latency_us * 1e-3;
  }
};

Link link_of(const DeviceSpec& d, int stride, int size, const char* group) {
  if (stride * size <= d.gpus_per_node)
    return {d.nvlink_GBps_per_direction, d.collective_efficiency, d.link_latency_us};
  if (d.dp_GBps_per_direction <= 0)
    fail(fmt::format("{}: the {} group spans nodes and the file has no dp_GBps_per_direction",
                     d.file, group));
  return {d.dp_GBps_per_direction, d.dp_efficiency, d.link_latency_us};
}

}  // namespace

namespace {

/// The checks of project_layout(): the mesh's counts fit an int, and the layout splits the model
/// (D | B, M | B/D, 2C·T | S, T | the heads, KV heads and F, Ulysses' C·T | NKV). `mesh` names
/// the layout in the errors.
void check_layout(const BlockConfig& c, const Layout& l, const std::string& mesh) {
  check(l.pp >= 1 && l.dp >= 1 && l.cp >= 1 && l.tp >= 1 && l.microbatches >= 1 &&
            l.stages_per_rank >= 1,
        "P, D, C, T, M and V must be >= 1");
  // Every product of the mesh's sizes below is at most P·D·C·T, an int (Layout::gpus()).
  const auto pd = checked_mul(l.pp, l.dp);
  const auto pdc = pd ? checked_mul(*pd, l.cp) : std::nullopt;
  if (!pdc || !checked_mul(*pdc, l.tp))
    fail(fmt::format("{}: more GPUs than an int counts ({} at most)", mesh,
                     std::numeric_limits<int>::max()));
  if (c.layers > std::numeric_limits<int>::max())
    fail(fmt::format("{}: L = {} layers, more than an int counts", mesh, c.layers));
  const I nkv = c.kv_heads_or_heads();
  if (c.batch % l.dp != 0)
    fail(fmt::format("{}: D = {} does not divide the batch of {} sequences", mesh, l.dp, c.batch));
  if (c.batch / l.dp % l.microbatches != 0)
    fail(fmt::format("{}: M = {} does not divide a replica's {} sequences", mesh, l.microbatches,
                     c.batch / l.dp));
  const I chunks = l.cp > 1 ? 2 * I(l.cp) * l.tp : l.tp;
  if (c.seq % chunks != 0)
    fail(fmt::format("{}: S = {} does not split into {} chunks", mesh, c.seq, chunks));
  if (nkv % l.tp != 0 || c.heads % l.tp != 0 || c.ffn % l.tp != 0)
    fail(fmt::format("{}: T = {} does not divide the heads ({}), KV heads ({}) and F ({})", mesh,
                     l.tp, c.heads, nkv, c.ffn));
  if (l.cp > 1 && l.cp_method == CpMethod::ulysses && nkv % (l.cp * l.tp) != 0)
    fail(fmt::format("{}: ulysses needs the {} KV heads to split over C·T = {}", mesh, nkv,
                     l.cp * l.tp));
}

/// The layers of each pipeline rank: its V stages' share of L.
std::vector<int> rank_layers(const BlockConfig& c, const pipeline::PipelineShape& shape) {
  const auto split = pipeline::split_layers(int(c.layers), shape.stages(),
                                            fmt::format("P·V = {}", shape.stages()));
  std::vector<int> layers(std::size_t(shape.ranks), 0);
  for (int p = 0; p < shape.ranks; ++p)
    for (const int s : shape.stages_of(p)) layers[std::size_t(p)] += split[std::size_t(s)].count;
  return layers;
}

/// Which of the language model's ends a pipeline rank holds: the embedding on the first, the
/// final norm, output layer and loss on the last (both at P = 1; none under --task block).
struct RankEnds {
  bool embedding = false, head = false;
};
RankEnds rank_ends(const BlockConfig& c, int rank, int ranks) {
  return {c.lm() && rank == 0, c.lm() && rank == ranks - 1};
}

/// CP's exposed time per layer of one micro-batch `mb`, forward and backward.
struct CpExposure {
  double forward = 0, backward = 0;
};

/// CP per layer, forward and backward (common/traffic.h's bytes; chapter 8's schedules): K/V,
/// q and the outputs at `e` bytes, the dK/dV partial sums (ring, reduce-scatter) at 4; the ring
/// hides each hop behind one of the C blocks' attention (`attention_ms` is the rank's layers').
CpExposure cp_exposure(const DeviceSpec& d, const BlockConfig& c, const Layout& l,
                       const BlockConfig& mb, double e, double attention_ms) {
  CpExposure x;
  if (l.cp == 1) return x;
  const double C = l.cp, g = 4, Dh = double(c.head_dim());
  const double rows = double(mb.seq) * double(mb.batch);
  const double kv = rows * double(c.kv_heads_or_heads() / l.tp) * Dh,
               q = rows * double(c.heads / l.tp) * Dh;
  const Link link = link_of(d, l.tp, l.cp, "cp");
  const double block_f = attention_ms / double(mb.layers) / C;  // one of the C blocks' attention
  switch (l.cp_method) {
    case CpMethod::ring: {
      const double hop = link.ms(2 * kv * e, 1), dhop = link.ms(2 * kv * g, 1);
      x.forward = (C - 1) * std::max(0.0, hop - block_f);
      x.backward = (C - 1) * std::max(0.0, hop + dhop - 2 * block_f) + dhop;
      break;
    }
    case CpMethod::allgather: {
      const double gather = link.ms((C - 1) * 2 * kv * e, C - 1);
      x.forward = gather;
      x.backward = gather + link.ms((C - 1) * 2 * kv * g, C - 1);  // again, and dK/dV's RS
      break;
    }
    case CpMethod::ulysses: {
      auto a2a = [&](double n) { return link.ms((C - 1) / C * n * e, C - 1); };
      x.forward = a2a(q + 2 * kv) + a2a(q);
      x.backward = a2a(3 * q + 2 * kv) + a2a(q + 2 * kv);
      break;
    }
  }
  return x;
}

/// The schedule's bubble at r's F and B, with a split backward's W as half of B (the weight
/// gradients' GEMMs are as many FLOPs as the input gradients'), and its time beside `busy`;
/// returns the costs the schedule ran with.
pipeline::Costs add_bubble(const pipeline::Schedule& sched, const Layout& l,
                           const std::string& mesh, double busy, LayoutStep& r) {
  const double V = l.stages_per_rank;
  pipeline::Costs costs{r.forward_ms / V, r.backward_ms / V, 0.0, 0.0};
  if (sched.split_backward()) costs = {r.forward_ms, r.backward_ms / 2, r.backward_ms / 2, 0.0};
  r.bubble = sched.formula_bubble(costs);
  if (!std::isfinite(r.bubble))
    fail(fmt::format(
        "{}: schedule {} has no bubble formula here: zb-h1's needs M >= P (M = {}) and W no "
        "larger than F and B (F {:.3g} ms, B {:.3g} ms, W {:.3g} ms)",
        mesh, l.schedule, l.microbatches, costs.forward, costs.backward, costs.weight));
  r.bubble_ms = busy * r.bubble / (1 - r.bubble);
  return costs;
}

/// PP: each boundary's [S/(C·T), B/(D·M), H] activation, and its gradient back; the time the
/// messages add to the schedule's simulated makespan at `costs`.
void add_p2p(const DeviceSpec& d, const BlockConfig& c, const Layout& l,
             const pipeline::Schedule& sched, const pipeline::Costs& costs, I mb_batch,
             int act_bytes, LayoutStep& r) {
  r.message_bytes = std::uint64_t(c.seq / (l.cp * l.tp)) * std::uint64_t(mb_batch) *
                    std::uint64_t(c.hidden) * std::uint64_t(act_bytes);
  if (l.pp == 1) return;
  r.p2p_bytes =
      2 * std::uint64_t(l.microbatches) * std::uint64_t(l.stages_per_rank) * r.message_bytes;
  pipeline::Costs with = costs;
  with.latency = link_of(d, l.dp * l.cp * l.tp, l.pp, "pp").ms(double(r.message_bytes), 1);
  r.p2p_ms = pipeline::simulate(sched, with).makespan - pipeline::simulate(sched, costs).makespan;
}

/// The step's bytes per group as the stages count them (common/traffic.h) for the rank's layers
/// `rank` (the whole batch), and the DP×CP group's time beyond the compute.
/// Under --task lm, the ends the rank holds (`ends`) add their TP collectives per micro-batch
/// (common/traffic.h's lm_embedding_traffic(), lm_head_traffic(), on the ring's layout) and, as
/// FSDP units of the DP×CP group, their gathers and gradients' reduce-scatter (lm_grads_traffic(),
/// gathered once a step like the layers).
void add_group_traffic(const DeviceSpec& d, const BlockConfig& rank, const Layout& l,
                       const RankEnds& ends, LayoutStep& r) {
  BlockConfig micro = rank;  // one micro-batch of every replica, the blocks alone
  micro.batch = rank.batch / l.microbatches;
  micro.task = Task::block;
  const cp::MeshTraffic t = cp::mesh_traffic(micro, l.dp, l.cp, l.tp, l.cp_method);
  BlockConfig local = rank;  // what one rank's ends see: S / C tokens of a micro-batch's B / D
  local.seq = rank.seq / l.cp;
  local.batch = micro.batch / l.dp;
  Traffic tp = t.tp;
  if (ends.embedding) tp += lm_embedding_traffic(local, l.tp, 0, TpLayout::ring);
  if (ends.head) tp += lm_head_traffic(local, l.tp, 0, TpLayout::ring);
  r.tp = tp * std::uint64_t(l.microbatches);
  r.cp = t.cp * std::uint64_t(l.microbatches);
  r.dp = fsdp::fsdp_traffic(micro, l.tp,
                            l.dp * l.cp);  // gathered once a step, kept across micro-batches
  r.dp += lm_grads_traffic(rank, l.tp, l.dp * l.cp, ends.embedding, ends.head);
  if (l.dp * l.cp > 1) {
    const double dp_ms =
        link_of(d, l.tp, l.dp * l.cp, "dp×cp").ms(double(r.dp.bus), 3.0 * (l.dp * l.cp - 1));
    r.dp_ms = std::max(0.0, dp_ms - r.compute_ms);
  }
}

/// Memory: common/memory.h's estimate of the rank's layers `rank` with as many micro-batches'
/// saved activations as the schedule keeps alive (per virtual stage: 1/V of the layers each).
void add_memory(const pipeline::Schedule& sched, const BlockConfig& rank, const Layout& l,
                const RankEnds& ends, LayoutStep& r) {
  const std::vector<int> live = pipeline::peak_live(sched);
  const int alive =
      (*std::max_element(live.begin(), live.end()) + l.stages_per_rank - 1) / l.stages_per_rank;
  BlockConfig mem = rank;
  mem.batch = rank.batch / l.microbatches * std::min(alive, l.microbatches);
  const Sharding sh{.rank = 0,
                    .world = l.tp,
                    .weights = true,
                    .sequence = true,
                    .dp = l.dp,
                    .cp = l.cp,
                    .dimensions = {fsdp::memory_dimension(), cp::memory_dimension(l.cp_method)}};
  if (!ends.embedding && !ends.head) mem.task = Task::block;
  MemoryEstimate estimate = estimate_training_memory(mem, sh);
  if (!ends.embedding) estimate.remove(kLmEmbeddingTerm);  // the first rank's
  if (!ends.head) {                                        // the last rank's
    estimate.remove(kLmOutputTerm);
    estimate.remove(kLmLogitsTerm);
  }
  r.memory_bytes = estimate.total();
  r.saved_bytes = estimate.term("saved activations").bytes;
  if (ends.head) r.logits_bytes = estimate.term(kLmLogitsTerm).bytes;
}

}  // namespace

LayoutStep project_layout(const DeviceSpec& d, const BlockConfig& c, const Layout& l) {
  const std::string mesh = fmt::format("P {} × D {} × C {} × T {}", l.pp, l.dp, l.cp, l.tp);
  check_layout(c, l, mesh);
  const pipeline::PipelineShape shape{l.pp, l.microbatches, l.stages_per_rank};
  const auto sched = pipeline::make_schedule(l.schedule, shape);
  LayoutStep r;
  r.layout = l;

  // One micro-batch through a rank's layers: stage 05 on S/C tokens of B/(D·M) sequences, and
  // under --task lm the ends it holds. The slowest rank sets the pace: its numbers are the row's.
  BlockConfig mb = c;
  mb.seq = c.seq / l.cp;
  mb.batch = c.batch / (I(l.dp) * l.microbatches);  // D·M divides B: no overflow
  ModelOptions o = stage_options(5);
  o.act_bytes = activation_bytes(5, c);
  o.cp = l.cp;
  const double again = c.recompute == Recompute::full ? 1.0 : 0.0;  // project()'s rule
  const EndsCost end_cost = project_ends(d, mb, l.tp, o);
  const std::vector<int> layers = rank_layers(c, shape);
  Projection p;
  CpExposure cp_layer;
  RankEnds ends;
  double slowest = -1;
  for (int q = 0; q < l.pp; ++q) {
    BlockConfig rank_mb = mb;
    rank_mb.layers = layers[std::size_t(q)];
    Projection pq = project(d, rank_mb, l.tp, o);
    const CpExposure cq = cp_exposure(d, c, l, rank_mb, o.act_bytes, pq.attention_ms);
    const RankEnds eq = rank_ends(c, q, l.pp);
    for (const auto& [held, end] :
         {std::pair{eq.embedding, &end_cost.embedding}, std::pair{eq.head, &end_cost.head}}) {
      if (!held) continue;
      pq.forward.step_ms += end->forward.step_ms;
      pq.forward.compute_ms += end->forward.compute_ms;
      pq.step_ms += end->step_ms();
      pq.compute_ms += end->compute_ms();
    }
    pq.exposed_comm_ms = pq.step_ms - pq.compute_ms;
    const double t = pq.step_ms + double(rank_mb.layers) * (cq.forward * (1 + again) + cq.backward);
    if (t > slowest) {
      slowest = t;
      p = pq;
      cp_layer = cq;
      ends = eq;
      r.layers = layers[std::size_t(q)];
    }
  }

  const double L = r.layers, M = l.microbatches;
  const double cp_mb = L * (cp_layer.forward * (1 + again) + cp_layer.backward);
  r.compute_ms = M * p.compute_ms;
  r.tp_ms = M * p.exposed_comm_ms;
  r.cp_ms = M * cp_mb;
  r.forward_ms = p.forward.step_ms + L * cp_layer.forward;
  r.backward_ms =
      p.step_ms - p.forward.step_ms + L * (cp_layer.forward * again + cp_layer.backward);
  const double busy = M * (p.step_ms + cp_mb);

  const pipeline::Costs costs = add_bubble(*sched, l, mesh, busy, r);
  add_p2p(d, c, l, *sched, costs, mb.batch, o.act_bytes, r);
  BlockConfig rank = c;  // the rank's layers, the whole batch
  rank.layers = r.layers;
  add_group_traffic(d, rank, l, ends, r);
  r.step_ms = busy + r.bubble_ms + r.p2p_ms + r.dp_ms;
  add_memory(*sched, rank, l, ends, r);
  return r;
}

BlockConfig layout_model(const std::string& preset, int gpus) {
  const ModelPreset* m = find_preset(preset);
  if (m == nullptr) fail(fmt::format("no model {} (known: {})", preset, preset_names()));
  BlockConfig c;
  apply_preset(*m, {}, c);
  c.dtype = DType::bf16;
  c.optimizer = Optimizer::adamw;
  c.batch = gpus / 2;
  return c;
}

std::vector<Layout> layout_table(int gpus) {
  struct Dims {
    int pp, dp, cp;
  };
  std::vector<Dims> dims;
  if (gpus == 64)
    dims = {{1, 8, 1}, {1, 4, 2}, {2, 4, 1}, {2, 2, 2}, {4, 2, 1}, {4, 1, 2}, {8, 1, 1}};
  else if (gpus == 512)
    dims = {{1, 64, 1}, {1, 32, 2}, {2, 32, 1}, {2, 16, 2}, {4, 16, 1},
            {4, 8, 2},  {4, 4, 4},  {8, 8, 1},  {8, 4, 2}};
  else
    fail(fmt::format("no 4-D table for {} GPUs (64 or 512)", gpus));
  const int batch = gpus / 2;  // layout_model()'s
  std::vector<Layout> out;
  for (const Dims& x : dims) {
    Layout l;
    l.pp = x.pp;
    l.dp = x.dp;
    l.cp = x.cp;
    l.tp = gpus / (x.pp * x.dp * x.cp);
    l.microbatches = batch / x.dp;  // micro-batches of one sequence
    out.push_back(l);
  }
  return out;
}

namespace {

json validation_json(const Validation& v) {
  const Published& p = v.published;
  return {{"name", p.name},           {"set", p.set},
          {"what", p.what},           {"measured", p.measured},
          {"metric", p.metric},       {"unit", p.unit},
          {"published", p.value},     {"projected", v.projected},
          {"error_pct", v.error_pct}, {"device", p.device_file},
          {"source", p.source},       {"where", p.where},
          {"quote", p.quote},         {"notes", p.notes}};
}

/// Mean and largest |error| of one set.
std::pair<double, double> abs_errors(const std::vector<const Validation*>& v) {
  double sum = 0, worst = 0;
  for (const Validation* x : v) {
    sum += std::abs(x->error_pct);
    worst = std::max(worst, std::abs(x->error_pct));
  }
  return {v.empty() ? 0.0 : sum / double(v.size()), worst};
}

std::vector<const Validation*> of_set(const std::vector<Validation>& v, const std::string& set) {
  std::vector<const Validation*> out;
  for (const Validation& x : v)
    if (x.published.set == set) out.push_back(&x);
  return out;
}

}  // namespace

json report_json(const Report& r) {
  json j;
  j["projected"] = true;
  j["device"] = {{"name", r.device.name},
                 {"file", r.device.file},
                 {"calibrated", r.device.calibrated},
                 {"calibration", r.device.calibration_notes},
                 {"gemm_efficiency", r.device.gemm.origin},
                 {"attention", r.device.attention_origin()}};
  j["configs"] = json::array();
  for (const auto& t : r.tables) {
    json rows = json::array();
    for (const auto& row : t.rows)
      rows.push_back({{"stage", stage_name(row.stage)},
                      {"n", row.n},
                      {"step_ms", row.p.step_ms},
                      {"compute_ms", row.p.compute_ms},
                      {"exposed_comm_ms", row.p.exposed_comm_ms},
                      {"bus_bytes_per_rank", row.p.comm.bus},
                      {"payload_bytes_per_rank", row.p.comm.payload},
                      {"comm_calls", row.p.comm.calls},
                      {"speedup_vs_03", row.speedup_vs_03 > 0 ? json(row.speedup_vs_03) : json()}});
    const BlockConfig& c = t.config;
    j["configs"].push_back({{"name", t.name},
                            {"config",
                             {{"hidden", c.hidden},
                              {"heads", c.heads},
                              {"kv_heads", c.kv_heads_or_heads()},
                              {"recompute", recompute_flag(c.recompute)},
                              {"ffn", c.ffn},
                              {"seq", c.seq},
                              {"batch", c.batch},
                              {"layers", c.layers},
                              {"dtype", dtype_word(c.dtype)}}},
                            {"rows", rows}});
  }
  j["mesh"] = json::array();
  for (const auto& m : r.mesh)
    j["mesh"].push_back({{"stage", "07"},
                         {"tp", m.tp},
                         {"dp", m.dp},
                         {"tp_step_ms", m.tp_step_ms},
                         {"compute_ms", m.compute_ms},
                         {"dp_bus_bytes_per_rank", m.dp_bus_bytes},
                         {"dp_comm_ms", m.dp_ms},
                         {"step_ms", m.step_ms}});
  j["layouts"] = json::array();
  for (const auto& t : r.layouts) {
    json rows = json::array();
    for (std::size_t i = 0; i < t.rows.size(); ++i) {
      const LayoutStep& x = t.rows[i];
      const Layout& l = x.layout;
      rows.push_back({{"pp", l.pp},
                      {"dp", l.dp},
                      {"cp", l.cp},
                      {"tp", l.tp},
                      {"microbatches", l.microbatches},
                      {"schedule", l.schedule},
                      {"stages_per_rank", l.stages_per_rank},
                      {"layers_per_rank", x.layers},
                      {"step_ms", x.step_ms},
                      {"compute_ms", x.compute_ms},
                      {"tp_exposed_ms", x.tp_ms},
                      {"cp_exposed_ms", x.cp_ms},
                      {"dp_exposed_ms", x.dp_ms},
                      {"pp_p2p_ms", x.p2p_ms},
                      {"bubble_ms", x.bubble_ms},
                      {"bubble", x.bubble},
                      {"tp_bus_bytes", x.tp.bus},
                      {"cp_bus_bytes", x.cp.bus},
                      {"dp_bus_bytes", x.dp.bus},
                      {"pp_p2p_bytes", x.p2p_bytes},
                      {"memory_estimate_bytes", x.memory_bytes},
                      {"best", i == t.best}});
    }
    j["layouts"].push_back({{"gpus", t.gpus},
                            {"model", "llama3-70b"},
                            {"layers", t.config.layers},
                            {"seq", t.config.seq},
                            {"batch", t.config.batch},
                            {"rows", rows}});
  }
  j["validation"] = json::array();
  for (const auto& v : r.validation) j["validation"].push_back(validation_json(v));
  j["left_out"] = json::array();
  for (const auto& l : r.left_out)
    j["left_out"].push_back({{"what", l.what}, {"source", l.source}, {"reason", l.reason}});
  j["sensitivity"] = json::array();
  for (const auto& s : r.sensitivity)
    j["sensitivity"].push_back({{"param", s.param}, {"minus_20", s.minus}, {"plus_20", s.plus}});
  return j;
}

std::string validation_markdown(const std::vector<Validation>& v,
                                const std::vector<LeftOut>& left_out) {
  std::ostringstream s;
  const auto held = of_set(v, "held_out"), cal = of_set(v, "calibration");
  const auto [held_mean, held_max] = abs_errors(held);
  const auto [cal_mean, cal_max] = abs_errors(cal);
  s << fmt::format(
      "**Held-out error: mean |error| {:.1f} %, largest {:.1f} % over {} cases** that no "
      "constant of the model or the device files was chosen against; calibration cases (the "
      "ones they were written against): mean |error| {:.1f} %, largest {:.1f} % over {}. "
      "Error = (projected − published) / published.\n\n",
      held_mean, held_max, held.size(), cal_mean, cal_max, cal.size());
  for (const auto& [title, rows] : {std::pair{std::string("Held-out cases"), held},
                                    std::pair{std::string("Calibration cases"), cal}}) {
    s << "*" << title << "*:\n\n"
      << "| # | published result | what was measured | metric | published | projected | error % "
         "| device file | source |\n|---|---|---|---|---|---|---|---|---|\n";
    const char tag = title[0] == 'H' ? 'H' : 'C';
    int i = 0;
    for (const Validation* x : rows)
      s << fmt::format("| {}{} | {} | {} | {} | {:.3f} {} | {:.3f} {} | {:+.1f} | {} | {} ({}) |\n",
                       tag, ++i, x->published.what, x->published.measured, x->published.metric,
                       x->published.value, x->published.unit, x->projected, x->published.unit,
                       x->error_pct, x->published.device_file, x->published.source,
                       x->published.where);
    s << "\n";
  }
  if (!left_out.empty()) {
    s << "*Left out of the tables*, and why:\n\n";
    for (const LeftOut& l : left_out)
      s << fmt::format("- {} ({}): {}\n", l.what, l.source, l.reason);
    s << "\n";
  }
  return s.str();
}

std::string sensitivity_markdown(const std::vector<Validation>& v,
                                 const std::vector<Sensitivity>& sens) {
  std::ostringstream s;
  s << "**Sensitivity**: how many percentage points each validation error moves when one assumed "
       "parameter (each device file lists its assumptions) is scaled by 0.8 / 1.2 in every device "
       "file that assumes it (gemm_efficiency: every point of the curve, capped at 1; the "
       "slow-downs: their excess over 1). Columns follow the validation tables (H = held-out, "
       "C = calibration).\n\n";
  std::vector<std::size_t> order;
  for (const std::string set : {"held_out", "calibration"})
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i].published.set == set) order.push_back(i);
  s << "| parameter |";
  int h = 0, c = 0;
  for (std::size_t i : order)
    s << (v[i].published.set == "held_out" ? fmt::format(" H{} |", ++h)
                                           : fmt::format(" C{} |", ++c));
  s << " largest |\n|---|";
  for (std::size_t k = 0; k <= order.size(); ++k) s << "---|";
  s << "\n";
  for (const Sensitivity& x : sens) {
    s << "| " << x.param << " |";
    double worst = 0;
    for (std::size_t i : order) {
      const double lo = x.minus.at(i), hi = x.plus.at(i);
      worst = std::max({worst, std::abs(lo), std::abs(hi)});
      if (std::abs(lo) < 0.05 && std::abs(hi) < 0.05)
        s << " 0 |";
      else
        s << fmt::format(" {:+.1f} / {:+.1f} |", lo, hi);
    }
    s << fmt::format(" {:.1f} |\n", worst);
  }
  s << "\n";
  return s.str();
}

std::string report_markdown(const Report& r) {
  std::ostringstream s;
  s << fmt::format(
      "Projected by the model in tools/projection.cc, not measured: device file "
      "tools/devices/{} ({}), GEMM efficiency {}{}; attention: {}.\n\n",
      r.device.file, r.device.name,
      r.device.calibrated ? "calibrated: " : "not calibrated: ", r.device.gemm.origin,
      r.device.attention_origin());
  for (const std::string& note : r.device.calibration_notes)
    if (note != r.device.gemm.origin) s << "Calibrated: " << note << ".\n\n";
  for (const auto& t : r.tables) {
    const BlockConfig& c = t.config;
    const int e = activation_bytes(2, c);
    s << fmt::format(
        "**{}**: H={} NH={} NKV={} F={} S={} B={} L={} {}, recompute {}, per rank and training "
        "step (forward + backward); bus bytes as the stages count them: {}-byte activations "
        "({}), 1-byte FP8 gathers in 06, fp32 norm-gain gradients.\n\n",
        t.name, c.hidden, c.heads, c.kv_heads_or_heads(), c.ffn, c.seq, c.batch, c.layers,
        dtype_word(c.dtype), recompute_flag(c.recompute), e, e == 2 ? "bf16" : "fp32");
    s << "| stage | N | projected step ms | compute ms | exposed comm ms | bus bytes/rank | "
         "speed-up vs 03 |\n|---|---|---|---|---|---|---|\n";
    for (const auto& row : t.rows)
      s << fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {} | {} |\n", stage_name(row.stage),
                       row.n, row.p.step_ms, row.p.compute_ms, row.p.exposed_comm_ms,
                       row.p.comm.bus,
                       row.speedup_vs_03 > 0 ? fmt::format("{:.3f}", row.speedup_vs_03) : "—");
    s << "\n";
  }
  if (!r.mesh.empty()) {
    const BlockConfig& c = r.mesh_config;
    s << fmt::format(
        "**Stage 07 at TP × DP meshes** ({}, H={} NKV={} F={} S={}, one sequence per DP "
        "replica, bf16): stage 05's TP inside a node; FSDP over DP across nodes at {:g} GB/s "
        "per GPU and direction × {:g}: per layer two bf16 all-gathers and one fp32 "
        "reduce-scatter of the layer's {:.0f} parameters per TP rank, (2·2 + 4)·P·(D−1)/D bus "
        "bytes; a layer in the middle of the model, whose DP traffic is prefetched behind the "
        "previous layer's compute (exposed: what it takes beyond that compute).\n\n",
        r.tables.empty() ? std::string("Llama-3-70B") : r.tables[0].name, c.hidden,
        c.kv_heads_or_heads(), c.ffn, c.seq, r.device.dp_GBps_per_direction, r.device.dp_efficiency,
        layer_params_per_tp_rank(c, 8));
    s << "| stage | TP × DP | GPUs | TP step ms | compute ms | DP bus bytes/rank | DP comm ms | "
         "projected step ms |\n|---|---|---|---|---|---|---|---|\n";
    for (const auto& m : r.mesh)
      s << fmt::format("| 07 | {} × {} | {} | {:.2f} | {:.2f} | {:.0f} | {:.2f} | {:.2f} |\n", m.tp,
                       m.dp, m.tp * m.dp, m.tp_step_ms, m.compute_ms, m.dp_bus_bytes, m.dp_ms,
                       m.step_ms);
    s << "\n";
  }
  for (const auto& t : r.layouts) {
    const BlockConfig& c = t.config;
    s << fmt::format(
        "**A Llama-3-70B-shaped layer stack on {} GPUs, 4-D meshes (projected, not measured)**: "
        "all {} layers (H={} NH={} NKV={} F={}), S={}, a global batch of {} sequences, bf16, "
        "AdamW; P × D × C × T with TP inside a node of {} GPUs, a group that spans nodes at the "
        "inter-node {:g} GB/s × {:g}; micro-batches of one sequence, 1F1B; CP by the K/V ring; "
        "FSDP over DP×CP; each layout named by the stage whose scheme it is (07: D × T, 08: "
        "+ C, 09: + P). Per GPU (the busiest pipeline rank) and training step, the step split "
        "into compute, exposed TP, CP and DP communication, PP point-to-point, and the bubble "
        "(the schedule's formula); memory: the stages' estimate for the rank's layers and the "
        "micro-batches 1F1B keeps alive, not checked against the GPU. As above, the stack of "
        "blocks only: no embedding, output layer or optimizer step.\n\n",
        t.gpus, c.layers, c.hidden, c.heads, c.kv_heads_or_heads(), c.ffn, c.seq, c.batch,
        r.device.gpus_per_node, r.device.dp_GBps_per_direction, r.device.dp_efficiency);
    s << "| scheme | P × D × C × T | M | layers/rank | projected step ms | compute ms | TP exposed "
         "ms | CP exposed ms | DP exposed ms | PP P2P ms | bubble ms | bubble % | memory estimate "
         "| |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (std::size_t i = 0; i < t.rows.size(); ++i) {
      const LayoutStep& x = t.rows[i];
      const Layout& l = x.layout;
      s << fmt::format(
          "| {} | {} × {} × {} × {} | {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | "
          "{:.1f} | "
          "{:.1f} | {:.1f} | {} | {} |\n",
          l.pp > 1   ? "09_pipeline_parallel"
          : l.cp > 1 ? "08_context_parallel"
                     : "07_fsdp_tp",
          l.pp, l.dp, l.cp, l.tp, l.microbatches, x.layers, x.step_ms, x.compute_ms, x.tp_ms,
          x.cp_ms, x.dp_ms, x.p2p_ms, x.bubble_ms, 100 * x.bubble, bytes_text(x.memory_bytes),
          i == t.best ? "**best**" : "");
    }
    s << "\n";
  }
  s << "**The model against published results**, each case quoted with its source and what it "
       "measured; each device file says which of its figures are assumptions.\n\n";
  s << validation_markdown(r.validation, r.left_out);
  if (!r.sensitivity.empty()) s << sensitivity_markdown(r.validation, r.sensitivity);
  return s.str();
}

}  // namespace tpx::projection
