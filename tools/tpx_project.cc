// tpx_project: the projection model (tools/projection.h) from the command line.
//
//   tpx_project --device NAME|FILE [--markdown FILE] [--json FILE]
//               [--calibrate FILE …] [--published FILE] [--validate] [--sensitivity]
//               [--attention KERNEL|assumed] [--assumed]
//   tpx_project --device NAME|FILE [--model NAME] [--config FILE] [--hidden H] [--heads NH]
//               [--kv-heads NKV] [--ffn F] [--seq S] [--batch B] [--layers L] [--task lm|block]
//               [--vocab V] [--dtype fp32|bf16]
//               [--recompute none|full|selective] [--tp T] [--dp D] [--ep EP] [--cp C]
//               [--cp-method ring|allgather|ulysses] [--pp P] [--microbatches M]
//               [--schedule gpipe|1f1b|interleaved-1f1b|zb-h1] [--stages-per-rank V]
//               [--markdown FILE] [--json FILE]
//
// --device is a device file, or its name in tools/devices/ (h100_sxm, h200, …; an unknown name
// is refused with the list).
//
// Given a model (--model, --config, or any size flag) or a parallel size (--tp, --dp, --cp,
// --pp, …), it answers "what does each stage's scheme cost per GPU for my model": one row per
// stage (01 on one GPU, 02 … 06 on T GPUs, 07 on T × D, 08 on T × C × D with --cp C, default 2,
// by --cp-method; with --pp P, the 4-D mesh P × D × C × T of stage 09's pipeline, M micro-batches
// (default: one sequence each) by --schedule with V stages per rank) with the projected step, its
// compute and exposed communication, the pipeline's bubble, the FLOPs, the bytes on the TP, CP,
// DP and PP groups as the stages count them (common/traffic.h), the saved activations and the
// peak-memory estimate per GPU (common/memory.h), in KiB/MiB/GiB. The model is the language model
// (--task lm, the default): the blocks, the embedding and the output layer (final norm, the
// output GEMM, the vocab-parallel cross-entropy and its three all-reduces; V padded to a multiple
// of T as the stages pad it), V from --vocab, else the preset's (the tutorial's without
// --model); --task block or --vocab 0 projects the blocks alone. With --pp the embedding is the
// first pipeline rank's and the output layer the last's; the slowest rank sets the pace. A
// mixture-of-experts --model (mixtral-8x7b, deepseek-v3, llama4-maverick) is stage 10's alone,
// on D × T, or D × C × T with --cp C, with --ep EP (default D·C), and with --pp P inside stage
// 09's pipeline: expert_cost() and expert_pipeline_cost() say how it is projected.
//
// Otherwise it writes the report: per config (a Llama-3-70B layer and a Llama-7B-sized one) the
// projected step of every stage at N = 2, 4, 8 (stage 01 at N = 1), stage 07 at TP × DP = 8 × 4
// and 8 × 32, a Llama-3-70B-shaped stack of 80 layers on 4-D meshes P × D × C × T of 64 and 512
// GPUs (the step split into compute, exposed TP, CP and DP communication, PP point-to-point and
// bubble; the shortest marked), then the model against published results (--published, default
// published.json next to the device file): the held-out cases first, then the calibration cases,
// what is left out and why, and the sensitivity of every error to each assumed parameter (±20 %).
// --markdown / --json write files; with neither, the markdown goes to stdout. --validate prints
// the validation tables alone, --sensitivity the sensitivity table alone (both: both).
// --calibrate (repeatable) replaces assumptions of the device with measurements: the GEMM
// efficiency curve from a bench_gemm JSON file's cuda bf16 rows (whole and chunked GEMMs), the
// GEMM's slow-down beside a copy engine and beside an SM copy from bench_copy_overlap's; a file
// that is missing or holds no such rows changes nothing, with a note on stderr (the output says
// what it used).
// A device file's "measured" block (from a GPU run's logs: tools/gpu_logs.py) replaces its
// assumed GEMM curve and attention efficiency; --assumed ignores it (the assumptions alone, as
// before the device was measured). --attention picks which measured attention kernel the model
// uses (h100_sxm: fused, tpx's own; naive; sdpa, PyTorch's FlashAttention-class kernel; the
// file's attention_default when not given), or "assumed" for the assumed constant.
//
// Exit status: 0 done, 2 bad input (a flag, a size, a file), with one line on stderr.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "06_fp8/traffic.h"
#include "07_fsdp_tp/memory.h"
#include "08_context_parallel/memory.h"
#include "09_pipeline_parallel/plan.h"
#include "09_pipeline_parallel/schedule.h"
#include "10_expert_parallel/memory.h"
#include "10_expert_parallel/traffic.h"
#include "common/check.h"
#include "common/checked.h"
#include "common/cli.h"
#include "common/config.h"
#include "common/flops.h"
#include "common/memory.h"
#include "common/moe_flags.h"
#include "common/output.h"
#include "common/presets.h"
#include "common/tp.h"
#include "common/traffic.h"
#include "projection.h"

namespace {

namespace fs = std::filesystem;
namespace pj = tpx::projection;
using nlohmann::json;

/// Empty when `path`, given to `flag`, is a file that can be read; else one sentence naming both.
std::string input_file_problem(std::string_view flag, const fs::path& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) return fmt::format("{} {}: no such file", flag, path.string());
  if (fs::is_directory(st))
    return fmt::format("{} {}: is a directory, not a JSON file", flag, path.string());
  if (!std::ifstream(path)) return fmt::format("{} {}: cannot be read", flag, path.string());
  return {};
}

/// The mesh's GPU count P·D·C·T, and the default micro-batch count B / D, as ints (what the model
/// counts in): otherwise one line naming the flags.
void check_mesh_counts(const pj::Layout& mesh, std::int64_t batch, bool microbatches_given) {
  const auto pd = tpx::checked_mul(mesh.pp, mesh.dp);
  const auto pdc = pd ? tpx::checked_mul(*pd, mesh.cp) : std::nullopt;
  if (!pdc || !tpx::checked_mul(*pdc, mesh.tp))
    throw std::invalid_argument(fmt::format(
        "--pp {} × --dp {} × --cp {} × --tp {} is more GPUs than the model counts ({} at most)",
        mesh.pp, mesh.dp, mesh.cp, mesh.tp, std::numeric_limits<int>::max()));
  if (!microbatches_given && batch / mesh.dp > std::numeric_limits<int>::max())
    throw std::invalid_argument(
        fmt::format("--batch {} / --dp {} is {} micro-batches of one sequence, more than {}: give "
                    "--microbatches",
                    batch, mesh.dp, batch / mesh.dp, std::numeric_limits<int>::max()));
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
  int gpus = 1;
  pj::Projection p;
  double step_ms = 0, exposed_ms = 0, bubble_ms = 0;
  tpx::Traffic tp_bytes, dp_bytes, cp_bytes, ep_bytes;
  std::uint64_t pp_bytes = 0;
  double flops = 0;  // per GPU and step, the model's GEMMs
  std::uint64_t saved = 0, memory = 0;
  std::uint64_t logits = 0;  // the memory estimate's logits term (--task lm; 0 for the blocks)
  std::string left_out;      // why the row has no numbers (stage 08 at a C not asked for)
};

/// Stage 08's row (l.pp = 1) or the 4-D pipeline's (stage 09's scheme), from the layout's
/// projection: exposed = everything but the compute and the bubble.
StageCost layout_cost(const pj::DeviceSpec& d, const tpx::BlockConfig& c, const pj::Layout& l) {
  const pj::LayoutStep x = pj::project_layout(d, c, l);
  StageCost r;
  r.stage = l.pp > 1 ? "09_pipeline_parallel" : "08_context_parallel";
  r.gpus = l.gpus();
  r.step_ms = x.step_ms;
  r.bubble_ms = x.bubble_ms;
  r.exposed_ms = x.step_ms - x.compute_ms - x.bubble_ms;
  r.tp_bytes = x.tp;
  r.cp_bytes = x.cp;
  r.dp_bytes = x.dp;
  r.pp_bytes = x.p2p_bytes;
  r.flops = tpx::step_flops(c).total() / double(r.gpus);
  r.saved = x.saved_bytes;
  r.memory = x.memory_bytes;
  r.logits = x.logits_bytes;
  return r;
}

/// Every stage's cost per GPU for model `c` at TP `tp` (stage 07: T × `dp`), stage 08 at `mesh`
/// without its pipeline, and with mesh.pp > 1 the 4-D pipeline. Stage 08 at a default C that
/// the model does not split into is left out, with the reason (`cp_given`: an error instead).
/// `fp8_gather`: stage 07 runs as under --dtype fp8 --fp8-weight-gather (stage 06's FP8 GEMMs in
/// each TP group, the weights gathered as E4M3 codes).
std::vector<StageCost> stage_costs(const pj::DeviceSpec& d, const tpx::BlockConfig& c, int tp,
                                   int dp, const pj::Layout& mesh, bool cp_given, bool fp8_gather) {
  using tpx::Sharding;
  std::vector<StageCost> rows;
  for (int stage = 1; stage <= 7; ++stage) {
    StageCost r;
    r.stage = stage == 7 ? "07_fsdp_tp" : pj::stage_name(stage);
    const int t = stage == 1 ? 1 : tp, n = stage == 7 ? dp : 1;
    r.gpus = t * n;
    tpx::BlockConfig s = c;                      // what the stage runs
    if (stage == 6) s.dtype = tpx::DType::e4m3;  // its default recipe: FP8 GEMMs inside bf16
    if (stage == 7 && fp8_gather) s.dtype = tpx::DType::e4m3;
    Sharding sh{.rank = 0, .world = t, .weights = stage > 1, .sequence = stage > 2, .dp = n};
    if (stage == 7) sh.dimensions = {tpx::fsdp::memory_dimension(false, fp8_gather)};
    if (stage > 1) tpx::check_tp_split(s, t, /*sequence=*/stage > 2);
    if (stage < 7) {
      r.p = pj::project_stage(d, s, t, stage);
      r.step_ms = r.p.step_ms;
      r.exposed_ms = r.p.exposed_comm_ms;
      r.tp_bytes = pj::comm_bytes(stage, s, t);
    } else {
      tpx::BlockConfig replica = s;
      replica.batch /= dp;
      const int tp_stage = fp8_gather ? 6 : 5;  // what runs in each TP group
      r.dp_bytes = tpx::fsdp::fsdp_traffic(s, tp, dp, 1, fp8_gather);
      r.dp_bytes += tpx::lm_grads_traffic(s, tp, dp, true, true);  // the replicated ends
      const auto m = pj::project_mesh(d, replica, tp, dp, double(r.dp_bytes.bus), tp_stage);
      r.step_ms = m.step_ms;
      r.exposed_ms = m.step_ms - m.compute_ms;
      // Under FP8 gathers the TP group's GEMMs take the gathered E4M3 weights as they are: no
      // weight amax in any all-reduce (06_fp8/traffic.h, Fp8Weights::gathered).
      r.tp_bytes =
          fp8_gather ? tpx::async_fp8::recipe_traffic(replica, tp, pj::activation_bytes(6, replica),
                                                      tpx::lowp::Recipe::tensorwise,
                                                      tpx::async_fp8::Fp8Weights::gathered)
                     : pj::comm_bytes(tp_stage, replica, tp);
    }
    r.flops = tpx::step_flops(s).total() / double(r.gpus);
    const tpx::MemoryEstimate e = tpx::estimate_training_memory(s, sh);
    r.saved = e.term("saved activations").bytes;
    r.memory = e.total();
    if (s.lm()) r.logits = e.term(tpx::kLmLogitsTerm).bytes;
    rows.push_back(r);
  }
  pj::Layout cp = mesh;
  cp.pp = cp.microbatches = cp.stages_per_rank = 1;
  cp.schedule = "1f1b";
  try {
    rows.push_back(layout_cost(d, c, cp));
  } catch (const std::runtime_error& e) {
    if (cp_given) throw;
    StageCost left;
    left.stage = "08_context_parallel";
    left.left_out = e.what();
    rows.push_back(left);
  }
  if (mesh.pp > 1) rows.push_back(layout_cost(d, c, mesh));
  return rows;
}

/// A mixture of experts as stage 05 and chapter 9 time it: each MoE layer's MLP a dense SwiGLU of
/// the chosen experts' width K·FE + SF (the same GEMM FLOPs per token), averaged over the layers
/// with the dense ones' F, rounded down to a multiple of T.
tpx::BlockConfig dense_equivalent(const tpx::BlockConfig& c, int tp) {
  const tpx::MoeConfig& m = c.moe;
  tpx::BlockConfig dense = c;
  dense.moe = {};
  const std::int64_t moe_layers = tpx::ep::moe_layers(c),
                     width = m.topk * m.expert_ffn + m.shared_ffn;
  const std::int64_t ffn = (moe_layers * width + (c.layers - moe_layers) * c.ffn) / c.layers;
  dense.ffn = std::max<std::int64_t>(tp, ffn / tp * tp);
  return dense;
}

/// Refuses an EP that does not divide the D·C ranks (the experts borrow theirs) or the experts, and
/// a T that does not divide FE; `name_cp`: the message names the D·C ranks, not D alone.
void check_experts_fit(const tpx::MoeConfig& m, int tp, int dp, int cp, int ep, bool name_cp) {
  if ((dp * cp) % ep != 0 || m.experts % ep != 0)
    throw std::invalid_argument(
        name_cp ? fmt::format("--ep {} must divide the D·C ranks (--dp {} × --cp {}) and the "
                              "experts ({}): the experts borrow their ranks from the data- and "
                              "context-parallel ones, E/EP whole experts each",
                              ep, dp, cp, m.experts)
                : fmt::format("--ep {} must divide --dp ({}) and the experts ({}): the experts "
                              "borrow their ranks from the data-parallel ones, E/EP whole experts "
                              "each",
                              ep, dp, m.experts));
  if (m.expert_ffn % tp != 0)
    throw std::invalid_argument(fmt::format(
        "--tp {} must divide the experts' width FE ({}): each TP rank holds FE/T of every expert",
        tp, m.expert_ffn));
}

/// The experts' exposed EP time and their DP time (behind the compute): the all-to-alls over
/// NVLink when an EP group's `ep_gpus` share a node, else the network; the DP bytes over the
/// network, 3·(G − 1) latencies for G = `dp_ranks`.
struct ExpertTimes {
  double ep_ms = 0, dp_ms = 0;
};
ExpertTimes expert_times(const pj::DeviceSpec& d, const tpx::Traffic& ep, const tpx::Traffic& dp,
                         int ep_gpus, int dp_ranks) {
  const bool one_node = ep_gpus <= d.gpus_per_node;
  if (!one_node && d.dp_GBps_per_direction <= 0)
    throw std::invalid_argument(fmt::format(
        "{}: an EP group of {} GPUs spans nodes and the file has no dp_GBps_per_direction", d.file,
        ep_gpus));
  const double ep_GBps = one_node ? d.nvlink_GBps_per_direction * d.collective_efficiency
                                  : d.dp_GBps_per_direction * d.dp_efficiency;
  ExpertTimes t;
  t.ep_ms = double(ep.bus) / (ep_GBps * 1e9) * 1e3 + double(ep.calls) * d.link_latency_us * 1e-3;
  if (d.dp_GBps_per_direction > 0)
    t.dp_ms = double(dp.bus) / (d.dp_GBps_per_direction * 1e9 * d.dp_efficiency) * 1e3 +
              3 * (dp_ranks - 1) * d.link_latency_us * 1e-3;
  return t;
}

/// Stage 10 on a D × T mesh with EP (a mixture-of-experts model), from its own formulas: bytes
/// (10_expert_parallel/traffic.h), memory (its estimate, the experts sharded over their D/EP
/// holders) and FLOPs (common/flops.h, the K chosen experts). Time: stage 05's projection of
/// one replica with each MoE layer's MLP as a dense SwiGLU of the chosen experts' width K·FE +
/// SF (the same GEMM FLOPs per token; the experts' smaller GEMMs run at its efficiency),
/// averaged over the layers; the DP bytes behind the compute as project_mesh() puts them; the
/// EP all-to-alls exposed, over NVLink when an EP group's T·EP ranks share a node, else the
/// network.
/// With --cp C (D × C × T, stage 08's context parallelism inside): the bytes are the stage's
/// formulas on that mesh (the token group and FSDP over D·C, chapter 8's CP bytes), the time
/// project_layout()'s for the same dense equivalent, its DP part replaced by the experts' DP
/// bytes behind the compute, plus the EP all-to-alls exposed.
StageCost expert_cost(const pj::DeviceSpec& d, const tpx::BlockConfig& c, int tp, int dp, int ep,
                      int cp = 1, tpx::cp::CpMethod method = tpx::cp::CpMethod::ring) {
  const tpx::MoeConfig& m = c.moe;
  const auto gpus = tpx::checked_mul(tp, dp);
  if (!gpus || !tpx::checked_mul(*gpus, cp))
    throw std::invalid_argument(
        fmt::format("--dp {} × --tp {}{} is more GPUs than the model counts ({} at most)", dp, tp,
                    cp > 1 ? fmt::format(" × --cp {}", cp) : "", std::numeric_limits<int>::max()));
  check_experts_fit(m, tp, dp, cp, ep, /*name_cp=*/cp > 1);
  StageCost r;
  r.stage = "10_expert_parallel";
  r.gpus = tp * dp * cp;
  tpx::BlockConfig dense = dense_equivalent(c, tp);  // the experts as a SwiGLU of their FLOPs
  // The time's compute and exposed TP (and CP) parts: stage 05's projection of one replica, or
  // with --cp stage 08's of the whole mesh, which refuses a sequence C does not cut as the
  // stage does, before any bytes are counted.
  double compute_ms = 0, busy_ms = 0;
  if (cp == 1) {
    dense.batch /= dp;
    tpx::check_tp_split(dense, tp, /*sequence=*/true);
    const pj::Projection p = pj::project_stage(d, dense, tp, 5);
    compute_ms = p.compute_ms;
    busy_ms = p.step_ms;
  } else {
    pj::Layout l;
    l.dp = dp, l.cp = cp, l.tp = tp, l.cp_method = method;
    const pj::LayoutStep x = pj::project_layout(d, dense, l);
    compute_ms = x.compute_ms;
    busy_ms = x.compute_ms + x.tp_ms + x.cp_ms;
  }
  // The bytes assume balanced routing: every expert gets as many of a rank's assignments (and,
  // under --cp with a capacity, of each sequence chunk's: balanced_kept_rows).
  const auto tokens = tpx::checked_mul<std::int64_t>(c.seq / cp, c.batch / dp);
  const bool chunks = cp > 1 && m.capacity_factor > 0;
  if (const auto assignments = tokens ? tpx::checked_mul(*tokens, m.topk) : std::nullopt;
      !assignments || *assignments % m.experts != 0 ||
      (chunks && c.seq / (2 * cp) * m.topk % m.experts != 0))
    throw std::invalid_argument(fmt::format(
        "stage 10's bytes assume balanced routing: a rank's S/C·B/D·K assignments ({} / {} · {} / "
        "{} · {}){} must be divisible by the experts E ({}): give another --seq or --batch",
        c.seq, cp, c.batch, dp, m.topk, chunks ? ", and each sequence chunk's S/(2C)·K," : "",
        m.experts));
  const tpx::ep::ExpertTraffic t = tpx::ep::expert_traffic(c, dp, tp, ep, 0, cp, method);
  r.tp_bytes = t.tp;
  r.dp_bytes = t.dp;
  r.ep_bytes = t.ep;
  r.cp_bytes = t.cp;
  const ExpertTimes times = expert_times(d, t.ep, t.dp, tp * ep, dp * cp);
  r.step_ms = busy_ms + std::max(0.0, times.dp_ms - compute_ms) + times.ep_ms;
  r.exposed_ms = r.step_ms - compute_ms;
  r.flops = tpx::step_flops(c).total() / double(r.gpus);
  tpx::Sharding sh{
      .rank = 0,
      .world = tp,
      .weights = true,
      .sequence = true,
      .dp = dp,
      .dimensions = {tpx::fsdp::memory_dimension(false), tpx::ep::memory_dimension(ep, 0)}};
  if (cp > 1) {  // as stage 08's plan: FSDP over D·C, the CP attention's buffers, the experts
    sh.cp = cp;
    sh.dimensions = {tpx::fsdp::memory_dimension(false), tpx::cp::memory_dimension(method),
                     tpx::ep::memory_dimension(ep, 0)};
  }
  const tpx::MemoryEstimate e = tpx::estimate_training_memory(c, sh);
  r.saved = e.term("saved activations").bytes;
  r.memory = e.total();
  return r;
}

/// Stage 10 under --pp: stage 09's pipeline around it on the P × D × C × T mesh `l`. Time:
/// project_layout()'s for the dense equivalent of expert_cost() (the slowest rank's compute, its
/// exposed TP and CP, the bubble and the point-to-point), its DP part replaced by the experts' DP
/// bytes behind the compute, plus the EP all-to-alls exposed. Bytes and memory: pipeline rank
/// 0's, the stage's own --dry-run arithmetic (pp::pipeline_rank_plan with the experts:
/// ep::pipeline_plan_with_experts) and memory estimate under balanced routing, M routing groups
/// of B/M sequences a step.
StageCost expert_pipeline_cost(const pj::DeviceSpec& d, const tpx::BlockConfig& c,
                               const pj::Layout& l, int ep) {
  const tpx::MoeConfig& m = c.moe;
  check_experts_fit(m, l.tp, l.dp, l.cp, ep, /*name_cp=*/true);
  // The experts as a SwiGLU of their FLOPs; the projection checks the mesh and M.
  const pj::LayoutStep x = pj::project_layout(d, dense_equivalent(c, l.tp), l);
  // Balanced routing must divide, per micro-batch: S/C·B/(D·M)·K assignments over E, and under
  // --cp with a capacity each sequence chunk's S/(2C)·K (the stage's --dry-run's rule).
  const std::int64_t n = c.seq / l.cp * (c.batch / l.dp / l.microbatches);
  const bool chunks = l.cp > 1 && m.capacity_factor > 0;
  if ((n * m.topk) % m.experts != 0 || (chunks && c.seq / (2 * l.cp) * m.topk % m.experts != 0))
    throw std::invalid_argument(fmt::format(
        "stage 10's bytes assume balanced routing: a micro-batch's S/C·B/(D·M)·K assignments per "
        "rank ({}){} must be divisible by the experts E ({}): give another --seq, --batch or "
        "--microbatches",
        n * m.topk, chunks ? ", and each sequence chunk's S/(2C)·K," : "", m.experts));
  const tpx::pipeline::PipelineShape shape{l.pp, l.microbatches, l.stages_per_rank};
  const auto schedule = tpx::pipeline::make_schedule(l.schedule, shape);
  const auto layers = tpx::pipeline::split_layers(
      int(c.layers), shape.stages(),
      fmt::format("--pp {} × --stages-per-rank {}", l.pp, l.stages_per_rank));
  tpx::Mesh mesh;  // pipeline rank 0, the first of its D·C and TP groups
  mesh.pp = l.pp, mesh.dp = l.dp, mesh.cp = l.cp, mesh.tp = l.tp;
  const tpx::StagePlan plan = tpx::ep::pipeline_plan_with_experts(
      tpx::pp::pipeline_rank_plan(c, *schedule, layers, mesh, l.cp_method,
                                  {tpx::ep::memory_dimension(ep, 0)}),
      c, mesh, ep, l.microbatches);
  StageCost r;
  r.stage = "10_expert_parallel";
  r.gpus = l.gpus();
  r.ep_bytes = plan.group("ep");
  r.dp_bytes = plan.group("dp");
  r.cp_bytes = plan.group("cp");
  r.pp_bytes = plan.group("pp").bus;
  r.tp_bytes = plan.traffic;
  for (const tpx::PlanGroup& g : plan.groups) r.tp_bytes -= g.traffic;
  const ExpertTimes times = expert_times(d, r.ep_bytes, r.dp_bytes, l.tp * ep, l.dp * l.cp);
  const double busy = x.compute_ms + x.tp_ms + x.cp_ms + x.p2p_ms;
  r.bubble_ms = x.bubble_ms;
  r.step_ms = busy + x.bubble_ms + std::max(0.0, times.dp_ms - x.compute_ms) + times.ep_ms;
  r.exposed_ms = r.step_ms - x.compute_ms - x.bubble_ms;
  r.flops = tpx::step_flops(c).total() / double(r.gpus);
  const tpx::MemoryEstimate e = tpx::estimate_training_memory(c, plan.sharding);
  r.saved = e.term("saved activations").bytes;
  r.memory = e.total();
  return r;
}

std::string expert_words(const tpx::BlockConfig& c, int tp, int dp, int ep, int cp,
                         tpx::cp::CpMethod method) {
  const tpx::MoeConfig& m = c.moe;
  return fmt::format(
      "experts E {} of FE {}, top {} by {}{}, {} | D {}{} × T {}, EP {}", m.experts, m.expert_ffn,
      m.topk, m.router == tpx::MoeRouter::sigmoid ? "sigmoid" : "softmax",
      m.shared_ffn > 0 ? fmt::format(", shared width {}", m.shared_ffn) : "",
      m.every == 1 ? std::string("in every layer") : fmt::format("in one layer of {}", m.every), dp,
      cp > 1 ? fmt::format(" × C {} (cp-method {})", cp, tpx::cp::to_string(method)) : "", tp, ep);
}

/// The by-flags tables' first line: what projected them, on which device, with what.
std::string projected_by(const pj::DeviceSpec& d) {
  return fmt::format(
      "Projected by the model in tools/projection.cc, not measured: device file tools/devices/{} "
      "({}), GEMM efficiency {}{}; attention: {}.\n\n",
      d.file, d.name, d.calibrated ? "calibrated: " : "not calibrated: ", d.gemm.origin,
      d.attention_origin());
}

/// The model's sizes and recipe in the by-flags JSON.
json config_json(const tpx::BlockConfig& c) {
  return {{"hidden", c.hidden},
          {"heads", c.heads},
          {"kv_heads", c.kv_heads_or_heads()},
          {"ffn", c.ffn},
          {"seq", c.seq},
          {"batch", c.batch},
          {"layers", c.layers},
          {"task", c.lm() ? "lm" : "block"},
          {"vocab", c.vocab},
          {"dtype", tpx::dtype_flag(c.dtype)},
          {"recompute", tpx::recompute_flag(c.recompute)}};
}

std::string describe(const tpx::BlockConfig& c, const std::string& model) {
  return fmt::format("{}H {} NH {} NKV {} F {} S {} B {} L {} {} | {} | recompute {}",
                     model.empty() ? "" : "model " + model + ": ", c.hidden, c.heads,
                     c.kv_heads_or_heads(), c.ffn, c.seq, c.batch, c.layers,
                     c.lm() ? fmt::format("V {}", c.vocab) : std::string("(blocks only)"),
                     tpx::dtype_flag(c.dtype), tpx::recompute_flag(c.recompute));
}

/// "P 2 × D 1 × C 2 × T 8, 1f1b, M 4, V 1, cp-method ring" (P only when > 1).
std::string describe(const pj::Layout& l) {
  return fmt::format("{}D {} × C {} × T {}{}, cp-method {}",
                     l.pp > 1 ? fmt::format("P {} × ", l.pp) : "", l.dp, l.cp, l.tp,
                     l.pp > 1 ? fmt::format(", {} with M {} and V {}", l.schedule, l.microbatches,
                                            l.stages_per_rank)
                              : "",
                     tpx::cp::to_string(l.cp_method));
}

std::string costs_markdown(const pj::DeviceSpec& d, const tpx::BlockConfig& c,
                           const std::string& model, int tp, int dp, const pj::Layout& mesh,
                           bool fp8_gather, const std::vector<StageCost>& rows) {
  std::ostringstream s;
  s << projected_by(d);
  s << fmt::format(
      "{} | TP {}, DP {} (stages 07, 08); {} (stage 08{}). Per GPU and training step (forward + "
      "backward of all L layers{}; the pipeline's slowest rank); bytes as the stages count them "
      "(bus bytes, nccl-tests' convention; 08's DP bytes over DP×CP; PP: what a rank sends); "
      "memory: the stages' own estimate of a GPU's peak (common/memory.h); stage 06 runs FP8 "
      "GEMMs inside the bf16 recipe{}{}.\n\n",
      describe(c, model), tp, dp, describe(mesh), mesh.pp > 1 ? ", 09 with the pipeline" : "",
      c.lm() ? ", the embedding and the output layer with its cross-entropy (with the pipeline: "
               "the embedding on the first rank, the output layer on the last)"
             : "",
      c.lm() ? ", its output layer in bf16" : "",
      fp8_gather ? "; stage 07 runs --dtype fp8 --fp8-weight-gather: stage 06 in each TP group, "
                   "the weights gathered as E4M3 codes"
                 : "");
  s << "| stage | GPUs | step ms | exposed comm ms | bubble ms | TFLOP per GPU | TP bus per GPU | "
       "CP bus per GPU | DP bus per GPU | PP P2P per GPU | saved activations | peak memory "
       "|\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const StageCost& r : rows) {
    if (!r.left_out.empty()) continue;
    s << fmt::format(
        "| {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.1f} | {} | {} | {} | {} | {} | {} "
        "|\n",
        r.stage, r.gpus, r.step_ms, r.exposed_ms, r.bubble_ms, r.flops / 1e12,
        tpx::bytes_text(r.tp_bytes.bus), tpx::bytes_text(r.cp_bytes.bus),
        tpx::bytes_text(r.dp_bytes.bus), tpx::bytes_text(r.pp_bytes), tpx::bytes_text(r.saved),
        tpx::bytes_text(r.memory));
  }
  for (const StageCost& r : rows)
    if (!r.left_out.empty())
      s << fmt::format("\n{} is left out at its default --cp {}: {}.\n", r.stage, mesh.cp,
                       r.left_out);
  return s.str();
}

json costs_json(const pj::DeviceSpec& d, const tpx::BlockConfig& c, const std::string& model,
                int tp, int dp, const pj::Layout& mesh, bool fp8_gather,
                const std::vector<StageCost>& rows) {
  json j = {{"device", d.name},
            {"device_file", d.file},
            {"model", model},
            {"config", config_json(c)},
            {"tp", tp},
            {"dp", dp},
            {"cp", mesh.cp},
            {"cp_method", tpx::cp::to_string(mesh.cp_method)},
            {"pp", mesh.pp},
            {"microbatches", mesh.microbatches},
            {"schedule", mesh.schedule},
            {"stages_per_rank", mesh.stages_per_rank},
            {"fp8_weight_gather", fp8_gather},
            {"stages", json::array()}};
  for (const StageCost& r : rows) {
    if (!r.left_out.empty()) {
      j["stages"].push_back({{"stage", r.stage}, {"left_out", r.left_out}});
      continue;
    }
    j["stages"].push_back({{"stage", r.stage},
                           {"gpus", r.gpus},
                           {"step_ms", r.step_ms},
                           {"exposed_comm_ms", r.exposed_ms},
                           {"bubble_ms", r.bubble_ms},
                           {"flops_per_gpu", r.flops},
                           {"tp_bus_bytes", r.tp_bytes.bus},
                           {"tp_payload_bytes", r.tp_bytes.payload},
                           {"cp_bus_bytes", r.cp_bytes.bus},
                           {"cp_payload_bytes", r.cp_bytes.payload},
                           {"pp_p2p_bytes", r.pp_bytes},
                           {"dp_bus_bytes", r.dp_bytes.bus},
                           {"saved_activation_bytes", r.saved},
                           {"memory_estimate_bytes", r.memory},
                           {"logits_bytes", r.logits}});
  }
  return j;
}

/// Stage 10's table for a mixture-of-experts model.
/// `pipe`: the pipeline's layout under --pp (expert_pipeline_cost()), or null.
std::string expert_markdown(const pj::DeviceSpec& d, const tpx::BlockConfig& c,
                            const std::string& model, int tp, int dp, int ep, int cp,
                            tpx::cp::CpMethod method, const StageCost& r,
                            const pj::Layout* pipe = nullptr) {
  std::string s = projected_by(d);
  s += fmt::format(
      "{} | {}. A mixture of experts runs as stage 10 alone. Per GPU and training step; bytes as "
      "the stage counts them (bus bytes, balanced routing, the experts' rows in fp32 as the "
      "stage moves them); time: stage {}'s projection of {} with each MoE layer's MLP as a SwiGLU "
      "of the chosen experts' width (K·FE + SF: the same FLOPs; the experts' smaller GEMMs at its "
      "efficiency), the experts' DP bytes behind the compute, the EP all-to-alls exposed; memory: "
      "the stage's estimate (the experts sharded over their {} holders).\n\n",
      describe(c, model), expert_words(c, tp, dp, ep, cp, method), cp > 1 ? "08" : "05",
      cp > 1 ? "the D × C × T mesh" : "a replica", cp > 1 ? "D·C/EP" : "D/EP");
  if (pipe != nullptr)
    s += fmt::format(
        "With --pp: stage 09's pipeline around it, P {} by {} with M {} and V {}; the time is "
        "project_layout()'s of that dense equivalent on the whole mesh (the slowest pipeline rank, "
        "its bubble and point-to-point) with the experts' DP and EP parts as above; bytes and "
        "memory are pipeline rank 0's (the stage's --dry-run arithmetic, M routing groups of B/M "
        "sequences a step).\n\n",
        pipe->pp, pipe->schedule, pipe->microbatches, pipe->stages_per_rank);
  const bool cps = cp > 1;
  std::string head = "| stage | GPUs | step ms | exposed comm ms |", rule = "|---|---|---|---|";
  std::string cells =
      fmt::format("| {} | {} | {:.2f} | {:.2f} |", r.stage, r.gpus, r.step_ms, r.exposed_ms);
  auto column = [&](const std::string& name, const std::string& cell) {
    head += " " + name + " |";
    rule += "---|";
    cells += " " + cell + " |";
  };
  if (pipe != nullptr) column("bubble ms", fmt::format("{:.2f}", r.bubble_ms));
  column("TFLOP per GPU", fmt::format("{:.1f}", r.flops / 1e12));
  column("TP bus per GPU", tpx::bytes_text(r.tp_bytes.bus));
  if (cps) column("CP bus per GPU", tpx::bytes_text(r.cp_bytes.bus));
  column("EP bus per GPU", tpx::bytes_text(r.ep_bytes.bus));
  column("DP bus per GPU", tpx::bytes_text(r.dp_bytes.bus));
  if (pipe != nullptr) column("PP bytes sent per GPU", tpx::bytes_text(r.pp_bytes));
  column("saved activations", tpx::bytes_text(r.saved));
  column("peak memory", tpx::bytes_text(r.memory));
  s += head + "\n" + rule + "\n" + cells + "\n";
  return s;
}

json expert_json(const pj::DeviceSpec& d, const tpx::BlockConfig& c, const std::string& model,
                 int tp, int dp, int ep, int cp, tpx::cp::CpMethod method, const StageCost& r,
                 const pj::Layout* pipe = nullptr) {
  const tpx::MoeConfig& m = c.moe;
  json config = config_json(c);
  config.update({{"experts", m.experts},
                 {"topk", m.topk},
                 {"expert_ffn", m.expert_ffn},
                 {"shared_ffn", m.shared_ffn},
                 {"moe_every", m.every}});
  json row = {{"stage", r.stage},
              {"gpus", r.gpus},
              {"step_ms", r.step_ms},
              {"exposed_comm_ms", r.exposed_ms},
              {"flops_per_gpu", r.flops},
              {"tp_bus_bytes", r.tp_bytes.bus},
              {"tp_payload_bytes", r.tp_bytes.payload},
              {"ep_bus_bytes", r.ep_bytes.bus},
              {"ep_payload_bytes", r.ep_bytes.payload},
              {"dp_bus_bytes", r.dp_bytes.bus},
              {"saved_activation_bytes", r.saved},
              {"memory_estimate_bytes", r.memory}};
  json j = {{"device", d.name}, {"device_file", d.file},
            {"model", model},   {"config", config},
            {"tp", tp},         {"dp", dp},
            {"ep", ep}};
  if (cp > 1) {
    j["cp"] = cp;
    j["cp_method"] = tpx::cp::to_string(method);
    row["cp_bus_bytes"] = r.cp_bytes.bus;
    row["cp_payload_bytes"] = r.cp_bytes.payload;
  }
  if (pipe != nullptr) {
    j["pp"] = pipe->pp;
    j["microbatches"] = pipe->microbatches;
    j["schedule"] = pipe->schedule;
    j["stages_per_rank"] = pipe->stages_per_rank;
    row["bubble_ms"] = r.bubble_ms;
    row["pp_p2p_bytes"] = r.pp_bytes;
    row["dp_payload_bytes"] = r.dp_bytes.payload;
    row["ep_calls"] = r.ep_bytes.calls;
    row["dp_calls"] = r.dp_bytes.calls;
  }
  j["stages"] = json::array({row});
  return j;
}

}  // namespace

namespace {

/// An integer flag's check: all of the value an integer of T (no sign, fraction or exponent) and
/// at least `least` (1 for a size, 0 for a count that may be none, e.g. --vocab); CLI11's
/// PositiveNumber would say "not in range 0 to 1.797…e308" for both.
template <class T>
CLI::Validator integer_at_least(T least) {
  return CLI::Validator(
      [least](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (ec == std::errc::result_out_of_range)
          return fmt::format("'{}' is out of range (at most {})", text,
                             std::numeric_limits<T>::max());
        if (text.empty() || ec != std::errc() || ptr != end)
          return fmt::format("'{}' is not an integer", text);
        if (value < least)
          return least == 1 ? fmt::format("must be a positive integer (got {})", text)
                            : fmt::format("must be {} or more (got {})", least, text);
        return {};
      },
      least == 1 ? "POSITIVE" : "NON-NEGATIVE",
      least == 1 ? "positive integer" : "non-negative integer");
}
template <class T>
CLI::Validator positive_integer() {
  return integer_at_least<T>(1);
}
template <class T>
CLI::Validator non_negative_integer() {
  return integer_at_least<T>(0);
}

/// Everything the command line sets.
struct Options {
  // The device, the report's inputs and the outputs.
  std::string device_arg, markdown, json_file, published, attention;
  std::vector<std::string> calibrate;
  bool validate_only = false, sensitivity_only = false, assumed_only = false;
  // The model (common/presets.h's presets, config files and size flags) and its mesh.
  tpx::BlockConfig c;
  std::string model, dtype = "bf16", recompute = "none", cp_method = "ring", task = "lm";
  std::int64_t vocab = 0;  // --vocab; the preset's when not given
  int tp = 8, dp = 1;
  int ep = 0;                      // stage 10's EP (a mixture-of-experts model); 0: D
  bool fp8_weight_gather = false;  // stage 07 under --dtype fp8 --fp8-weight-gather
  pj::Layout mesh;  // stage 08's C and method, and the pipeline's P, M, schedule and V

  Options() {
    c.dtype = tpx::DType::bf16;  // what GPUs train in
    mesh.cp = 2;
    mesh.microbatches = 0;  // 0: one sequence each, B / D
  }
};

/// The model's flags: given any of them, tpx_project prints a table per stage for that model.
constexpr const char* kModelFlags[] = {"--model",
                                       "--config",
                                       "--hidden",
                                       "--heads",
                                       "--kv-heads",
                                       "--ffn",
                                       "--seq",
                                       "--batch",
                                       "--layers",
                                       "--task",
                                       "--vocab",
                                       "--dtype",
                                       "--recompute",
                                       "--tp",
                                       "--dp",
                                       "--ep",
                                       "--cp",
                                       "--cp-method",
                                       "--pp",
                                       "--microbatches",
                                       "--schedule",
                                       "--stages-per-rank",
                                       "--fp8-weight-gather"};

/// --device, the outputs, and the report's inputs and switches.
void add_report_options(CLI::App& app, Options& o) {
  app.add_option("--device", o.device_arg,
                 "a device by name (h100_sxm, h200, …: the files in tools/devices/) or a device "
                 "file")
      ->required();
  app.add_option("--markdown", o.markdown, "write the tables as markdown to FILE");
  app.add_option("--json", o.json_file, "write the tables as JSON to FILE");
  app.add_option("--calibrate", o.calibrate,
                 "bench_gemm / bench_copy_overlap JSON whose cuda bf16 rows replace the assumed "
                 "GEMM efficiency curve and GEMM slow-downs beside a transfer (repeatable)");
  app.add_option("--attention", o.attention,
                 "the measured attention kernel the model uses (the device file's "
                 "measured.attention kernels, e.g. fused, sdpa), or assumed");
  app.add_flag("--assumed", o.assumed_only,
               "ignore the device file's measured block: its assumptions alone");
  app.add_option("--published", o.published,
                 "published results (default: published.json next to the device file)");
  app.add_flag("--validate", o.validate_only, "print the model against published results and exit");
  app.add_flag("--sensitivity", o.sensitivity_only,
               "print how far each validation error moves with each assumption ±20 % and exit");
}

/// The model's sizes, recipe and mesh (kModelFlags).
void add_model_options(CLI::App& app, Options& o) {
  const auto m = "Model (any of these: a table per stage for this model)";
  tpx::BlockConfig& c = o.c;
  app.add_option("--model", o.model, "a model by name: " + tpx::preset_names())->group(m);
  app.set_config("--config", "", "read these flags from a TOML/INI file; the command line wins")
      ->group(m);
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.add_option("--hidden", c.hidden, "H")->check(positive_integer<std::int64_t>())->group(m);
  app.add_option("--heads", c.heads, "NH")->check(positive_integer<std::int64_t>())->group(m);
  app.add_option("--kv-heads", c.kv_heads, "NKV (GQA); NH when not given")
      ->check(positive_integer<std::int64_t>())
      ->group(m);
  app.add_option("--ffn", c.ffn, "F")->check(positive_integer<std::int64_t>())->group(m);
  app.add_option("--seq", c.seq, "S")->check(positive_integer<std::int64_t>())->group(m);
  app.add_option("--batch", c.batch, "B, the global batch (stage 07: B / D per replica)")
      ->check(positive_integer<std::int64_t>())
      ->group(m);
  app.add_option("--layers", c.layers, "L")->check(positive_integer<std::int64_t>())->group(m);
  app.add_option(
         "--task", o.task,
         "lm: the language model (blocks, embedding, output layer); block: the blocks alone")
      ->check(CLI::IsMember({"lm", "block"}))
      ->capture_default_str()
      ->group(m);
  app.add_option("--vocab", o.vocab,
                 "V, the vocabulary (padded to a multiple of T); 0: the blocks alone; default: "
                 "the preset's")
      ->check(non_negative_integer<std::int64_t>())
      ->group(m);
  app.add_option("--dtype", o.dtype, "fp32 or bf16 (stage 06: FP8 GEMMs inside bf16)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str()
      ->group(m);
  app.add_option("--recompute", o.recompute, "none, full or selective")
      ->check(CLI::IsMember({"none", "full", "selective"}))
      ->capture_default_str()
      ->group(m);
  app.add_option("--tp", o.tp, "T, tensor-parallel GPUs (stages 02-07)")
      ->check(positive_integer<int>())
      ->capture_default_str()
      ->group(m);
  app.add_option("--dp", o.dp, "D, data-parallel replicas of stages 07 and 08 (FSDP over D)")
      ->check(positive_integer<int>())
      ->capture_default_str()
      ->group(m);
  app.add_option("--ep", o.ep,
                 "EP, expert-parallel ranks of stage 10 for a mixture-of-experts --model, borrowed "
                 "from the D replicas (the D·C ranks with --cp); when not given, D (D·C)")
      ->check(positive_integer<int>())
      ->group(m);
  app.add_flag("--fp8-weight-gather", o.fp8_weight_gather,
               "stage 07 as under --dtype fp8 --fp8-weight-gather: stage 06's FP8 GEMMs in each TP "
               "group, FSDP gathering the weights as E4M3 codes")
      ->group(m);
  pj::Layout& mesh = o.mesh;
  app.add_option("--cp", mesh.cp,
                 "C, context-parallel ranks of stage 08 (and the pipeline); for a "
                 "mixture-of-experts --model, of stage 10, which is D × T when not given")
      ->check(positive_integer<int>())
      ->capture_default_str()
      ->group(m);
  app.add_option("--cp-method", o.cp_method, "ring, allgather or ulysses (stage 08)")
      ->check(CLI::IsMember({"ring", "allgather", "ulysses"}))
      ->capture_default_str()
      ->group(m);
  app.add_option("--pp", mesh.pp,
                 "P, pipeline stages: adds the 4-D mesh P × D × C × T's row (for a "
                 "mixture-of-experts --model, stage 10 inside stage 09's pipeline)")
      ->check(positive_integer<int>())
      ->capture_default_str()
      ->group(m);
  app.add_option("--microbatches", mesh.microbatches,
                 "M, micro-batches per step of each replica (default: B / D, one sequence each)")
      ->check(positive_integer<int>())
      ->group(m);
  app.add_option("--schedule", mesh.schedule, "the pipeline's schedule")
      ->check(CLI::IsMember(tpx::pipeline::schedule_names()))
      ->capture_default_str()
      ->group(m);
  app.add_option("--stages-per-rank", mesh.stages_per_rank,
                 "V, virtual pipeline stages per rank (interleaved-1f1b)")
      ->check(positive_integer<int>())
      ->capture_default_str()
      ->group(m);
}

/// The outputs apart from each other and from every file read, each writable, each input
/// readable: one line naming the flag otherwise, before any work.
void check_paths(const Options& o) {
  std::vector<tpx::NamedPath> outputs, inputs;
  if (!o.markdown.empty()) outputs.push_back({"--markdown", o.markdown});
  if (!o.json_file.empty()) outputs.push_back({"--json", o.json_file});
  for (const std::string& f : o.calibrate) inputs.push_back({"--calibrate", f});
  if (!o.published.empty()) inputs.push_back({"--published", o.published});
  if (const std::string p = tpx::output_collision(outputs, inputs); !p.empty())
    throw std::invalid_argument(p);
  for (const tpx::NamedPath& out : outputs)
    if (const std::string p = tpx::output_file_problem(out.flag, out.path); !p.empty())
      throw std::invalid_argument(p);
  for (const tpx::NamedPath& in : inputs)
    if (const std::string p = input_file_problem(in.flag, in.path); !p.empty())
      throw std::invalid_argument(p);
}

/// The device file, its measured block unless --assumed, the --attention kernel, and the
/// --calibrate files' measurements (a note on stderr for a file with none).
pj::DeviceSpec device_of(const Options& o) {
  pj::DeviceSpec device = pj::load_device(device_file(o.device_arg), !o.assumed_only);
  if (!o.attention.empty()) pj::use_attention(device, o.attention);
  for (const std::string& file : o.calibrate) {
    bool used = false;
    try {
      used = pj::calibrate(device, file);
    } catch (const json::exception& e) {  // a row's field of another type
      throw std::invalid_argument(fmt::format(
          "--calibrate {}: not a bench_gemm or bench_copy_overlap JSON file ({})", file, e.what()));
    }
    if (!used)
      std::fprintf(stderr,
                   "note: %s has no cuda bf16 GEMM or copy-overlap rows: the device file's "
                   "assumptions are used\n",
                   file.c_str());
  }
  return device;
}

/// The model of the flags: a preset under the size flags given, the dtype and recompute, checked
/// like the stages check it, and D dividing the batch.
void resolve_model(const CLI::App& app, Options& o) {
  tpx::BlockConfig& c = o.c;
  // V: --vocab, else the preset's (the tutorial's, whose sizes are the defaults, without --model).
  const tpx::ModelPreset* preset = tpx::find_preset(o.model.empty() ? "tutorial" : o.model);
  if (preset == nullptr)
    throw std::invalid_argument(
        fmt::format("--model {}: no such model (known: {})", o.model, tpx::preset_names()));
  if (preset->moe.experts > 0) {  // stage 10's row alone: the dense stages cannot run it
    tpx::MoeFlags::of(preset->moe).configure(c);
    if (app.count("--fp8-weight-gather") > 0)
      throw std::invalid_argument(
          fmt::format("--model {} is a mixture of experts, which tpx_project projects as stage "
                      "10 (no FP8): it takes no --fp8-weight-gather",
                      o.model));
  } else if (app.count("--ep") > 0) {
    throw std::invalid_argument("--ep is stage 10's: give a mixture-of-experts --model");
  }
  c.vocab = app.count("--vocab") > 0 ? o.vocab : preset->vocab;
  c.task = o.task == "block" || c.vocab == 0 ? tpx::Task::block : tpx::Task::lm;
  if (!c.lm()) c.vocab = 0;
  if (!o.model.empty()) {
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
  c.dtype = tpx::parse_dtype(o.dtype);
  c.recompute = o.recompute == "full"        ? tpx::Recompute::full
                : o.recompute == "selective" ? tpx::Recompute::selective
                                             : tpx::Recompute::none;
  // The blocks as the stages check them; V has no upper bound here (no token file to fit: a
  // projection of Llama 3's 128 256 ids), only what the byte counts hold (tpx::SizeOverflow).
  tpx::BlockConfig blocks = c;
  blocks.task = tpx::Task::block;
  if (const auto errors = tpx::validate(blocks); !errors.empty())
    throw std::invalid_argument(fmt::format("{}", fmt::join(errors, "; ")));
  if (c.batch % o.dp != 0)
    throw std::invalid_argument(fmt::format(
        "--dp {} must divide --batch {}: each data-parallel replica trains B / D sequences", o.dp,
        c.batch));
}

/// The mesh of the flags: D, T and the CP method; M = B / D unless given; its counts checked.
void resolve_mesh(const CLI::App& app, Options& o) {
  pj::Layout& mesh = o.mesh;
  mesh.dp = o.dp;
  mesh.tp = o.tp;
  check_mesh_counts(mesh, o.c.batch, app.count("--microbatches") > 0);
  mesh.cp_method = tpx::cp::method_of(o.cp_method);
  if (mesh.microbatches == 0) mesh.microbatches = int(o.c.batch / o.dp);
}

/// The markdown to --markdown and the JSON (made only when asked for) to --json; with neither,
/// the markdown to stdout.
void write_outputs(const Options& o, const std::string& md, const std::function<json()>& j) {
  if (!o.markdown.empty()) tpx::write_text_file(o.markdown, md);
  if (!o.json_file.empty()) tpx::write_text_file(o.json_file, j().dump(2) + "\n");
  if (o.markdown.empty() && o.json_file.empty()) std::fputs(md.c_str(), stdout);
}

/// A table per stage for the model of the flags (stage 10's alone for a mixture of experts).
void project_model(const CLI::App& app, Options& o, const pj::DeviceSpec& device) {
  resolve_model(app, o);
  if (o.c.moe.experts > 0) {  // on D × T, or with --cp on D × C × T (EP of the D·C ranks)
    const int cp = app.count("--cp") > 0 ? o.mesh.cp : 1;
    const tpx::cp::CpMethod method = tpx::cp::method_of(o.cp_method);
    const int ep = o.ep == 0 ? o.dp * cp : o.ep;
    if (o.mesh.pp > 1) {  // P × D × C × T: stage 09's pipeline around stage 10
      resolve_mesh(app, o);
      o.mesh.cp = cp;
      const pj::Layout& l = o.mesh;
      const StageCost r = expert_pipeline_cost(device, o.c, l, ep);
      write_outputs(
          o, expert_markdown(device, o.c, o.model, o.tp, o.dp, ep, cp, method, r, &l),
          [&] { return expert_json(device, o.c, o.model, o.tp, o.dp, ep, cp, method, r, &l); });
      return;
    }
    const StageCost r = expert_cost(device, o.c, o.tp, o.dp, ep, cp, method);
    write_outputs(o, expert_markdown(device, o.c, o.model, o.tp, o.dp, ep, cp, method, r),
                  [&] { return expert_json(device, o.c, o.model, o.tp, o.dp, ep, cp, method, r); });
    return;
  }
  resolve_mesh(app, o);
  const bool g = o.fp8_weight_gather;
  const auto rows = stage_costs(device, o.c, o.tp, o.dp, o.mesh, app.count("--cp") > 0, g);
  write_outputs(o, costs_markdown(device, o.c, o.model, o.tp, o.dp, o.mesh, g, rows),
                [&] { return costs_json(device, o.c, o.model, o.tp, o.dp, o.mesh, g, rows); });
}

/// The report, or with --validate / --sensitivity those tables alone on stdout.
void project_report(const Options& o, const pj::DeviceSpec& device) {
  const fs::path dir = device_file(o.device_arg).parent_path();
  const fs::path pub = o.published.empty() ? dir / "published.json" : fs::path(o.published);
  const pj::PublishedSet cases = pj::load_published(pub);
  const auto validation = pj::validate(cases.results, pub.parent_path(), device);
  if (o.validate_only)
    std::fputs(pj::validation_markdown(validation, cases.left_out).c_str(), stdout);
  const auto sens = pj::sensitivity(cases.results, pub.parent_path(), device);
  if (o.sensitivity_only) std::fputs(pj::sensitivity_markdown(validation, sens).c_str(), stdout);
  if (o.validate_only || o.sensitivity_only) return;
  const pj::Report report = pj::make_report(device, validation, cases.left_out, sens);
  write_outputs(o, pj::report_markdown(report), [&] { return pj::report_json(report); });
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tpx_project: projected step time, bytes and memory per GPU of stages 01-08 (and, with --pp, "
      "a 4-D mesh's pipeline) on GPUs of one kind, for a model given by name, file or sizes; or "
      "the projection report"};
  app.footer("Exit status: 0 done; 2 bad input (a flag, a size the ranks cannot split, a file).");
  Options o;
  add_report_options(app, o);
  add_model_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "tpx_project: error: %s (see --help)\n", e.what());
    return 2;
  }
  const bool by_flags = std::any_of(std::begin(kModelFlags), std::end(kModelFlags),
                                    [&](const char* flag) { return app.count(flag) > 0; });
  try {
    check_paths(o);
    const pj::DeviceSpec device = device_of(o);
    if (by_flags)
      project_model(app, o, device);
    else
      project_report(o, device);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tpx_project: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
