#include "projection.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include <stdexcept>

namespace tpx::projection {
namespace {

using I = std::int64_t;

// The library stands alone (no MPI, no device code): its errors are std::runtime_error.
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
  std::ifstream in(file);
  if (!in) fail(fmt::format("cannot read {}", file.string()));
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(fmt::format("{} is not valid JSON: {}", file.string(), e.what()));
  }
}

/// j[key] as a number, or a one-line error naming the file and the key.
double number(const json& j, const char* key, const std::filesystem::path& file) {
  if (!j.contains(key) || !j.at(key).is_number())
    fail(fmt::format("{}: \"{}\" is missing or not a number", file.string(), key));
  return j.at(key).get<double>();
}

std::string text(const json& j, const char* key, const std::filesystem::path& file) {
  if (!j.contains(key) || !j.at(key).is_string())
    fail(fmt::format("{}: \"{}\" is missing or not a string", file.string(), key));
  return j.at(key).get<std::string>();
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

DeviceSpec load_device(const std::filesystem::path& file) {
  const json j = read_json(file);
  DeviceSpec d;
  d.file = file.filename().string();
  d.name = text(j, "name", file);
  d.peak_bf16_flops = number(j, "peak_bf16_flops", file);
  d.peak_fp8_flops = number(j, "peak_fp8_flops", file);
  d.hbm_GBps = number(j, "hbm_GBps", file);
  d.nvlink_GBps_per_direction = number(j, "nvlink_GBps_per_direction", file);
  d.link_latency_us = number(j, "link_latency_us", file);
  d.sms = static_cast<int>(number(j, "sms", file));
  d.collective_sms = static_cast<int>(number(j, "collective_sms", file));
  d.copy_engine_GBps = number(j, "copy_engine_GBps", file);
  d.collective_efficiency = number(j, "collective_efficiency", file);
  d.attention_efficiency = number(j, "attention_efficiency", file);
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
  if (!j.contains("sources") || !j["sources"].is_array() || j["sources"].empty())
    fail(fmt::format("{}: \"sources\" must list where the figures come from", file.string()));
  return d;
}

bool calibrate(DeviceSpec& device, const std::filesystem::path& bench_gemm_json) {
  const json j = read_json(bench_gemm_json);
  if (!j.contains("benchmarks") || !j["benchmarks"].is_array())
    fail(fmt::format("{}: not a Google Benchmark JSON file (no \"benchmarks\")",
                     bench_gemm_json.string()));
  std::vector<std::pair<double, double>> points;
  for (const json& b : j["benchmarks"]) {
    const std::string name = b.value("name", "");
    if (name.rfind("gemm/cuda/bf16/", 0) != 0) continue;  // the bf16 GEMMs of the block
    if (b.value("run_type", "iteration") != "iteration") continue;
    I m = 0, n = 0, k = 0;
    const std::string label = b.value("label", "");
    if (std::sscanf(label.c_str(), "m=%ld n=%ld k=%ld", &m, &n, &k) != 3 || !b.contains("TFLOP/s"))
      continue;
    const double flops = 2.0 * double(m) * double(n) * double(k);
    const double eff = b["TFLOP/s"].get<double>() * 1e12 / device.peak_bf16_flops;
    points.emplace_back(flops, std::clamp(eff, 1e-3, 1.0));
  }
  if (points.empty()) return false;
  std::sort(points.begin(), points.end());
  device.gemm.points = std::move(points);
  device.gemm.origin = "calibrated from " + bench_gemm_json.filename().string();
  device.calibrated = true;
  return true;
}

// --- bytes, as the stages count them -------------------------------------------------------------
//
// Per rank and step, L layers, N ranks, E = act_bytes, P = S·B·H·E (one [S, B, H] activation):
//   01  nothing.
//   02  four all-reduces of P per layer (g after Wo, Wd; f before Wqkv, Wgu in backward):
//       payload 4P, bus 4·⌊P·2(N−1)/N⌋, calls 4.            (02_megatron_tp/README.md)
//   03  ten all-gathers / reduce-scatters of the full P per layer (forward 2 + 2, backward the
//       2 dY gathers, the 2 re-gathers of the kept inputs and 2 reduce-scatters), bus P·(N−1)/N
//       each, and two all-reduces of the norm gains' gradients [H] (fp32):
//       payload 10P + 8H, bus 10·P(N−1)/N + 2·⌊4H·2(N−1)/N⌋, calls 12. (03_sequence_parallel)
//   04  each of the ten primitives is N−1 ring transfers of one P/N chunk (a send counts what it
//       sends): payload = bus = 10(N−1)·P/N, plus the gains as in 03; calls 10(N−1) + 2.
//   05  04's, the transfers being copy-engine pulls (payload = bus = the bytes pulled).
//   06  05's, the six gathers per layer moving 1-byte FP8 codes (the four reduce-scatters stay
//       E), plus eight MAX all-reduces of k fp32 amaxes per layer, k ∈ {4,2,3,2,3,2,2,2}:
//       payload 4k, bus ⌊4k·2(N−1)/N⌋ each.                  (06_fp8/README.md)
// Under --recompute full each layer's forward runs again before its backward, collectives
// included: its share (02: the two g all-reduces; 03: two all-gathers and two reduce-scatters;
// 04, 05: those four as ring transfers; 06: two FP8 gathers, two reduce-scatters and the four
// forward amax all-reduces, k ∈ {4,2,3,2}) is counted twice. GQA changes none of it: the
// collectives move the [S, B, H] stream, whatever the width of k and v.
int activation_bytes(int stage, const BlockConfig& c) {
  return stage == 6 || c.activations() == DType::bf16 ? 2 : 4;
}

Comm comm_bytes(int stage, const BlockConfig& c, int n, int act_bytes) {
  check(n >= 1, "ranks must be >= 1");
  if (act_bytes == 0) act_bytes = activation_bytes(stage, c);
  const auto N = static_cast<std::uint64_t>(n);
  const auto L = static_cast<std::uint64_t>(c.layers);
  const auto elems = static_cast<std::uint64_t>(c.seq * c.batch * c.hidden);
  const auto P = elems * static_cast<std::uint64_t>(act_bytes);
  const auto H = static_cast<std::uint64_t>(c.hidden);
  const std::uint64_t gain_bus = 2 * ((4 * H * 2 * (N - 1)) / N);  // two all-reduces of [H]
  Comm r, fwd;  // per layer: the step's traffic, and the forward's share of it
  switch (stage) {
    case 1:
      return r;
    case 2:
      r = {4 * P, 4 * ((P * 2 * (N - 1)) / N), 4};
      fwd = {2 * P, 2 * ((P * 2 * (N - 1)) / N), 2};
      break;
    case 3:
      r = {10 * P + 8 * H, 10 * (P * (N - 1) / N) + gain_bus, 12};
      fwd = {4 * P, 4 * (P * (N - 1) / N), 4};
      break;
    case 4:
    case 5: {
      const std::uint64_t ring = 10 * (N - 1) * (P / N);
      r = {ring + 8 * H, ring + gain_bus, 10 * (N - 1) + 2};
      fwd = {4 * (N - 1) * (P / N), 4 * (N - 1) * (P / N), 4 * (N - 1)};
      break;
    }
    case 6: {
      const std::uint64_t chunk = elems / N;  // elements of one [S/N, B, H] shard
      const auto E = static_cast<std::uint64_t>(act_bytes);
      const std::uint64_t moved = 6 * (N - 1) * chunk * 1 + 4 * (N - 1) * chunk * E;
      const std::uint64_t moved_fwd = 2 * (N - 1) * chunk * 1 + 2 * (N - 1) * chunk * E;
      std::uint64_t amax_payload = 0, amax_bus = 0, fwd_payload = 0, fwd_bus = 0;
      int i = 0;
      for (const std::uint64_t k : {4, 2, 3, 2, 3, 2, 2, 2}) {
        amax_payload += 4 * k;
        amax_bus += (4 * k * 2 * (N - 1)) / N;
        if (i++ < 4) {  // the forward's four
          fwd_payload += 4 * k;
          fwd_bus += (4 * k * 2 * (N - 1)) / N;
        }
      }
      r = {moved + 8 * H + amax_payload, moved + gain_bus + amax_bus, 10 * (N - 1) + 2 + 8};
      fwd = {moved_fwd + fwd_payload, moved_fwd + fwd_bus, 4 * (N - 1) + 4};
      break;
    }
    default:
      fail(fmt::format("no stage {} (1 … 6)", stage));
  }
  if (c.recompute == Recompute::full)
    r = {r.payload + fwd.payload, r.bus + fwd.bus, r.calls + fwd.calls};
  return {r.payload * L, r.bus * L, r.calls * L};
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
        const double slow =
            o.schedule == Schedule::ring ? double(d.sms) / double(d.sms - d.collective_sms) : 1.0;
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
  const double attn_f = 2 * (2 * B * S * S * H) / N;
  const double attn_ms = attn_f / (d.peak_bf16_flops * d.attention_efficiency) * 1e3;
  // Element-wise work (assumed: 12 passes over the residual stream and 6 over the FFN activations
  // of fp32 per forward, twice that backward; the stream is sharded under sequence parallelism).
  const double stream = sp ? T * H / N : T * H;
  const double ew_f = m.hbm_ms(4 * (12 * stream + 6 * T * F / N));
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
  p.forward = {fwd.step_ms * L, fwd.compute_ms * L};
  p.backward = {bwd.step_ms * L, bwd.compute_ms * L};
  const double forwards = o.recompute || c.recompute == Recompute::full ? 2.0 : 1.0;
  p.step_ms = forwards * p.forward.step_ms + p.backward.step_ms;
  p.compute_ms = forwards * p.forward.compute_ms + p.backward.compute_ms;
  p.exposed_comm_ms = p.step_ms - p.compute_ms;
  return p;
}

Projection project_stage(const DeviceSpec& d, const BlockConfig& c, int n, int stage) {
  ModelOptions o = stage_options(stage);
  o.act_bytes = activation_bytes(stage, c);
  Projection p = project(d, c, n, o);
  p.comm = comm_bytes(stage, c, n);
  return p;
}

double ag_gemm_ms(const DeviceSpec& d, I m, I n_local, I k, int ranks, int bytes, bool overlapped) {
  ModelOptions o;
  o.schedule = overlapped ? Schedule::copy_engine : Schedule::bulk;
  const Model model{d, ranks, o};
  const double flops = 2.0 * double(m) * double(n_local) * double(k);
  return model.primitive(flops, double(m) * double(k) * bytes, false).first;
}

// --- published results ---------------------------------------------------------------------------

std::vector<Published> load_published(const std::filesystem::path& file) {
  const json j = read_json(file);
  if (!j.contains("results") || !j["results"].is_array())
    fail(fmt::format("{}: \"results\" must be a list", file.string()));
  std::vector<Published> out;
  for (const json& r : j["results"]) {
    Published p;
    p.name = text(r, "name", file);
    p.what = text(r, "what", file);
    p.metric = text(r, "metric", file);
    p.unit = text(r, "unit", file);
    p.source = text(r, "source", file);
    p.device_file = text(r, "device", file);
    p.kind = text(r, "kind", file);
    p.notes = r.value("notes", "");
    p.value = number(r, "published", file);
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
    out.push_back(std::move(p));
  }
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
  if (p.kind == "step_speedup" || p.kind == "step_speedup_fp8") {
    // Full activation checkpointing comes with the case's config ("recompute": "full").
    base.fp8 = async.fp8 = p.kind == "step_speedup_fp8";
    return project(d, p.config, p.ranks, base).step_ms /
           project(d, p.config, p.ranks, async).step_ms;
  }
  const I n_local = p.n / p.ranks;
  if (p.kind == "ag_gemm_bulk_ms")
    return ag_gemm_ms(d, p.m, n_local, p.k, p.ranks, p.act_bytes, false);
  if (p.kind == "ag_gemm_overlap_ms")
    return ag_gemm_ms(d, p.m, n_local, p.k, p.ranks, p.act_bytes, true);
  if (p.kind == "ag_gemm_speedup")
    return ag_gemm_ms(d, p.m, n_local, p.k, p.ranks, p.act_bytes, false) /
           ag_gemm_ms(d, p.m, n_local, p.k, p.ranks, p.act_bytes, true);
  fail(fmt::format("published result {}: unknown kind \"{}\"", p.name, p.kind));
}

}  // namespace

std::vector<Validation> validate(const std::vector<Published>& cases,
                                 const std::filesystem::path& devices_dir,
                                 const DeviceSpec& calibrated) {
  std::vector<Validation> out;
  for (const Published& p : cases) {
    const DeviceSpec d =
        p.device_file == calibrated.file ? calibrated : load_device(devices_dir / p.device_file);
    Validation v{p, projected_value(p, d), 0.0};
    v.error_pct = error_pct(v.projected, p.value);
    out.push_back(std::move(v));
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

Report make_report(const DeviceSpec& d, const std::vector<Validation>& validation) {
  Report r;
  r.device = d;
  r.validation = validation;
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
  return r;
}

json report_json(const Report& r) {
  json j;
  j["projected"] = true;
  j["device"] = {{"name", r.device.name},
                 {"file", r.device.file},
                 {"calibrated", r.device.calibrated},
                 {"gemm_efficiency", r.device.gemm.origin}};
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
  j["validation"] = json::array();
  for (const auto& v : r.validation)
    j["validation"].push_back({{"name", v.published.name},
                               {"what", v.published.what},
                               {"metric", v.published.metric},
                               {"unit", v.published.unit},
                               {"published", v.published.value},
                               {"projected", v.projected},
                               {"error_pct", v.error_pct},
                               {"device", v.published.device_file},
                               {"source", v.published.source},
                               {"notes", v.published.notes}});
  return j;
}

std::string validation_markdown(const std::vector<Validation>& v) {
  std::ostringstream s;
  s << "| published result | metric | published | projected | error % | device file | source |\n"
    << "|---|---|---|---|---|---|---|\n";
  for (const auto& x : v)
    s << fmt::format("| {} | {} | {:.3f} {} | {:.3f} {} | {:+.1f} | {} | {} |\n", x.published.what,
                     x.published.metric, x.published.value, x.published.unit, x.projected,
                     x.published.unit, x.error_pct, x.published.device_file, x.published.source);
  return s.str();
}

std::string report_markdown(const Report& r) {
  std::ostringstream s;
  s << fmt::format(
      "Projected by the model in tools/projection.cc, not measured: device file "
      "tools/devices/{} ({}), GEMM efficiency {}{}.\n\n",
      r.device.file, r.device.name,
      r.device.calibrated ? "calibrated: " : "not calibrated: ", r.device.gemm.origin);
  for (const auto& t : r.tables) {
    const BlockConfig& c = t.config;
    s << fmt::format(
        "**{}**: H={} NH={} NKV={} F={} S={} B={} L={} {}, recompute {}, per rank and training "
        "step (forward + backward); bus bytes as the stages count them (fp32 activations, "
        "1-byte gathers in 06).\n\n",
        t.name, c.hidden, c.heads, c.kv_heads_or_heads(), c.ffn, c.seq, c.batch, c.layers,
        dtype_word(c.dtype), recompute_flag(c.recompute));
    s << "| stage | N | projected step ms | compute ms | exposed comm ms | bus bytes/rank | "
         "speed-up vs 03 |\n|---|---|---|---|---|---|---|\n";
    for (const auto& row : t.rows)
      s << fmt::format("| {} | {} | {:.2f} | {:.2f} | {:.2f} | {} | {} |\n", stage_name(row.stage),
                       row.n, row.p.step_ms, row.p.compute_ms, row.p.exposed_comm_ms,
                       row.p.comm.bus,
                       row.speedup_vs_03 > 0 ? fmt::format("{:.3f}", row.speedup_vs_03) : "—");
    s << "\n";
  }
  s << "**The model against published results** (error = (projected − published) / published; "
       "each device file says which of its figures are assumptions):\n\n";
  s << validation_markdown(r.validation);
  return s.str();
}

}  // namespace tpx::projection
