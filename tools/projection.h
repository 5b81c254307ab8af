// The projection model: the step time of each stage (01 … 06) on N GPUs of one node, from the
// block's FLOPs and bytes and a device description (tools/devices/*.json), and its check against
// published results (tools/devices/published.json). Numbers it gives are projections, not
// measurements; every input that is not a datasheet figure is marked as an assumption in the
// device file.
//
// The model, per rank and step (forward + backward of L layers; T = S·B tokens):
//   compute   every GEMM of the block (common/flops.h, split per stage as the stage splits it)
//             at peak · efficiency(GEMM FLOPs): the efficiency curve is the device file's
//             assumed one, or measured cuda bf16 rows of bench_gemm (--calibrate); attention's
//             GEMMs at peak · attention_efficiency; element-wise work as bytes / HBM bandwidth.
//   comm      the bytes the stages count (comm_bytes(): each stage's traffic.h, tested against
//             the stages' --json), at link bandwidth · collective efficiency, plus the latency per
//             message (a ring all-gather or reduce-scatter sends N−1 messages per rank; an
//             all-reduce is charged 2·⌈log₂ N⌉, a tree's latency).
//   overlap   01: none to do. 02, 03: every collective is exposed (bulk, in the critical path).
//             04: each ring primitive runs N steps; in step i the GEMM of chunk i runs beside the
//             transfer of the next chunk: (N−1)·max(GEMM chunk, transfer) + one GEMM chunk, the
//             GEMM slowed by sms / (sms − collective_sms) while a transfer kernel runs beside it.
//             05: the same pipeline with copy-engine pulls (copy_engine_GBps, no SM taken; the
//             GEMM slowed by copy_engine_gemm_slowdown, HBM shared); the loss left is the chunked
//             GEMMs' efficiency. 06: 05 with the linear GEMMs at the FP8 peak, gathers of 1-byte
//             codes, and the amax MAX all-reduces (latency) exposed.
//   fused     (Flux's one kernel, fused_ms()): the whole GEMM at its own efficiency beside the
//             transfers; exposed is the tail: for an all-gather the last chunk's GEMM when the
//             transfers are the slower, for a reduce-scatter the last chunk's transfer.
//   exposed comm = step − compute (the compute of the stage's own, possibly chunked, GEMMs).
//   ends      under --task lm (project_ends()): the embedding and the output layer with the final
//             norm and the vocab-parallel cross-entropy, once per step, V padded to a multiple of
//             N; their bytes are the stages' (common/traffic.h's lm_traffic(), in each stage's
//             formula), their memory common/memory.h's terms.
//
// A training step as published (train_step()): L layers of the block with TP (stage 03's or
// 05's schedule), full or selective activation recompute, GQA; the embedding and the output
// layer (vocab-parallel GEMM and its gathers); FSDP's per-layer all-gathers (bf16) and
// reduce-scatters (fp32) over DP at the inter-node bandwidth, prefetched behind the previous
// layer's compute (exposed: what a layer's DP traffic takes beyond its compute, and the first
// gather); AdamW on the rank's 1/(TP·DP) of the parameters at HBM speed.
//
// The 4-D mesh (project_layout()): P pipeline stages × D data-parallel replicas × C context-
// parallel ranks × T tensor-parallel ranks, rank = ((p·D + d)·C + c)·T + t (TP innermost), a
// node holding gpus_per_node consecutive ranks; a group whose ranks span more than one node runs
// at the inter-node bandwidth (dp_GBps_per_direction × dp_efficiency), else at NVLink's. The
// busiest pipeline rank (⌈L/P⌉ layers, 09_pipeline_parallel/schedule.h's split_layers()) runs M
// micro-batches of B/(D·M) sequences of S/C tokens:
//   compute, TP  stage 05's projection of one micro-batch through its layers (attention of the
//                S/C queries against all S keys), M times;
//   CP           ring: forward C−1 hops of K/V (2·kv·e bytes), each beside one of the C blocks'
//                attention, exposed where the hop outlasts the block; backward the K/V hop and
//                the previous block's dK/dV hop (fp32 partial sums, 2·kv·4 bytes) beside each
//                block, and the last dK/dV hop home exposed. allgather: the gather (forward, again
//                backward) and the dK/dV reduce-scatter, exposed. ulysses: two all-to-alls per
//                attention in each direction (q, k, v there and the output back; q, k, v, out, dO
//                there and dq, dk, dv back), exposed; bytes as 08_context_parallel/traffic.h's cp_traffic();
//   DP           FSDP over the D·C ranks of the DP×CP group, the rank's layers gathered twice
//                and reduce-scattered once a step (kept across micro-batches), prefetched behind
//                the step's compute: exposed what it takes beyond it (project_mesh()'s rule);
//   ends         under --task lm the embedding on the first rank, the output layer and loss on
//                the last (project_ends(), their TP bytes and FSDP gathers and reduce-scatters added
//                there, their memory terms there only); the slowest rank sets the pace;
//   bubble       the schedule's own formula (make_schedule(...)->formula_bubble(...): (P−1)/
//                (M+P−1), ÷V interleaved, ZB-H1's) of the step: busy · β / (1 − β);
//   PP P2P       each boundary sends [S/(C·T), B/(D·M), H] forward and its gradient back; the
//                exposed time is how much longer the schedule's simulated makespan gets when
//                every message between ranks takes latency + bytes / bandwidth.
//
// defines: tpx::projection::stage_name(), EfficiencyCurve, DeviceSpec, load_device(), calibrate(),
//          Comm, Schedule, ModelOptions, Phase, Projection, project(),
//          project_stage(), EndCost, EndsCost, project_ends(), ag_gemm_ms(), gemm_rs_ms(), Workload, train_step(), Published,
//          load_published(), Validation, validate(), error_pct(), perturb(), Sensitivity,
//          sensitivity(), Report, make_report(), report_json(), report_markdown(),
//          validation_markdown(), sensitivity_markdown(), big_config(), small_config(),
//          project_mesh(), Layout, LayoutStep, project_layout(), layout_model(),
//          layout_table() (comm_bytes(), fsdp_bytes(), mesh_traffic(): the stages' traffic.h)
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "07_fsdp_tp/traffic.h"
#include "08_context_parallel/traffic.h"
#include "common/config.h"
#include "common/traffic.h"

namespace tpx::projection {

/// GEMM efficiency (achieved / peak FLOP/s) against a GEMM's FLOPs: points (flops, efficiency),
/// interpolated linearly in log(flops), held constant outside the points.
struct EfficiencyCurve {
  std::vector<std::pair<double, double>> points;  // sorted by flops
  std::string origin;                             // "assumed …" or "calibrated from FILE"
  double at(double flops) const;
};

/// A GPU of one node and its links (tools/devices/*.json).
struct DeviceSpec {
  std::string name, file;
  double peak_bf16_flops = 0, peak_fp8_flops = 0;  // dense FLOP/s
  double hbm_GBps = 0;
  double nvlink_GBps_per_direction = 0;
  double link_latency_us = 0;
  int sms = 0;
  int collective_sms = 0;  // SMs a collective (or ring transfer) kernel holds while it runs
  double copy_engine_GBps = 0;
  double collective_efficiency = 1;  // achieved / link bandwidth of a large collective
  double attention_efficiency = 1;   // achieved / bf16 peak of attention's GEMMs
  /// GEMM time × this while a copy-engine pull runs beside it (the two share HBM only).
  double copy_engine_gemm_slowdown = 1;
  /// GEMM time × this while a ring-transfer kernel runs beside it; 0: sms / (sms − collective_sms).
  double ring_gemm_slowdown = 0;
  /// Inter-node bandwidth per GPU and direction (FSDP over DP), and the share a collective reaches.
  double dp_GBps_per_direction = 0, dp_efficiency = 1;
  /// Scales the element-wise HBM traffic the model charges (12 + 6 passes per forward).
  double elementwise_scale = 1;
  /// GPUs per node (NVLink inside, dp_GBps_per_direction between nodes); 8 when not given.
  int gpus_per_node = 8;
  EfficiencyCurve gemm;
  /// Measured attention kernels (the device file's "measured" block): each one's rate as the
  /// model counts attention's FLOPs (common/flops.h, no causal halving), over the bf16 peak,
  /// against S (the keys attended), e.g. "fused" (tpx's kernel) and "sdpa" (PyTorch's).
  std::map<std::string, EfficiencyCurve> attention_kernels;
  /// The kernel the model uses; empty: attention_efficiency, the assumed constant.
  std::string attention_kernel;
  /// attention's efficiency at S keys: the chosen kernel's curve, else attention_efficiency.
  double attention_at(double seq) const;
  /// What attention_at() models, in words: "measured fused (…)" or "assumed 0.5 (…)".
  std::string attention_origin() const;
  bool calibrated = false;
  std::vector<std::string> calibration_notes;  // what --calibrate replaced, from which file
  std::vector<std::string> assumed;            // the keys the device file marks as assumptions
};

/// Reads a device file; throws std::runtime_error with one line naming the file and the problem
/// (a missing key, or a figure out of range: peaks and rates > 0, efficiencies in (0, 1], the
/// latency >= 0, slow-downs >= 1, SM and GPU counts whole numbers). Its optional "measured" block (written from a GPU run's logs by tools/gpu_logs.py, which
/// names the logs) replaces the assumed GEMM curve and attention efficiency with measured ones,
/// unless `measured` is false (the assumptions alone, as before the device was measured).
DeviceSpec load_device(const std::filesystem::path& file, bool measured = true);
/// Makes the model use the measured attention kernel `name`, or "assumed" (attention_efficiency);
/// throws std::invalid_argument naming the kernels the device has for any other name.
void use_attention(DeviceSpec& d, const std::string& name);
/// Replaces assumptions with measurements from a Google Benchmark JSON file: the GEMM curve from
/// bench_gemm's cuda bf16 rows, whole (gemm/cuda/bf16/…, at 2·m·n·k) and chunked
/// (gemm_chunked/cuda/bf16/…, each point at one chunk's FLOPs), so the curve spans what the
/// chunked stages run; the GEMM slow-downs beside a copy-engine copy and beside an SM copy kernel
/// from bench_copy_overlap's bf16 rows (copy_overlap/cuda/bf16/{copy_engine,sm_copy}/n, the
/// largest n). Returns false, leaving the device as it was, when the file has none of them.
bool calibrate(DeviceSpec& device, const std::filesystem::path& bench_json);

/// Communication of one step on one rank, counted as the stages count it (common/traffic.h).
using Comm = tpx::Traffic;
// The bytes formulas live in each stage's traffic.h (common/traffic.h has what they share),
// shared with the stages' --dry-run.
using tpx::layer_params_per_tp_rank;
using tpx::cp::CpMethod;
using tpx::fsdp::fsdp_bytes;

/// Bytes per element of the activations `stage` stores and communicates under `c`: 2 under the
/// mixed-precision recipe (--dtype bf16, and stage 06's FP8, which runs inside it), else 4.
int activation_bytes(int stage, const BlockConfig& c);

/// The bytes per rank and step of `stage` (1 … 6) at N ranks, each stage's own formula (its
/// traffic.h; stage 01 moves nothing, stage 05 moves stage 04's). `act_bytes`: bytes per element
/// of the communicated activations (0: activation_bytes(stage, c), what the stage counts).
/// Throws std::runtime_error for a stage outside 1 … 6.
Comm comm_bytes(int stage, const BlockConfig& c, int n, int act_bytes = 0);

/// The stage's directory and executable name, e.g. "03_sequence_parallel" for 3 ("?" outside 1…6).
std::string stage_name(int stage);

/// How the communication is scheduled against the GEMMs.
enum class Schedule { none, all_reduce, bulk, ring, copy_engine };

struct ModelOptions {
  Schedule schedule = Schedule::bulk;
  bool fp8 = false;        // linear GEMMs at the FP8 peak, 1-byte gathers, amax all-reduces
  int act_bytes = 4;       // see comm_bytes()
  bool recompute = false;  // activation checkpointing: the forward runs twice per step
  int cp = 1;  // context parallelism: the S queries of the config attend C·S keys (of C ranks)
};

/// Times of one phase (forward or backward), milliseconds, all layers.
struct Phase {
  double step_ms = 0, compute_ms = 0;
};

struct Projection {
  Phase forward, backward;
  double step_ms = 0, compute_ms = 0, exposed_comm_ms = 0;
  double flops_per_rank = 0;  // the GEMMs the model times, forward + backward once
  double attention_ms = 0;    // attention's share of forward.compute_ms (backward: twice it)
  Comm comm;
};

/// The model for any schedule (see the top of the file).
Projection project(const DeviceSpec& d, const BlockConfig& c, int n, const ModelOptions& o);
/// Stage `stage`'s schedule (01: none at N = 1; 02: all_reduce; 03: bulk; 04: ring;
/// 05: copy_engine; 06: copy_engine + fp8), bytes as the stages count them.
ModelOptions stage_options(int stage);
/// Stage `stage`'s projection of `c`, the language model's ends (project_ends()) included
/// under --task lm.
Projection project_stage(const DeviceSpec& d, const BlockConfig& c, int n, int stage);

/// The language model's ends on one TP rank of `n` (zero under --task block), one pass of `c`'s
/// S·B tokens under schedule `o`, milliseconds:
///   embedding  the lookup and its backward scatter-add (element-wise, HBM), and its collectives
///              as common/traffic.h's lm_embedding_traffic() counts them (02: the forward
///              all-reduce; from 03: the forward reduce-scatter and the backward all-gather),
///              bulk and exposed (the lookup is no GEMM to hide them behind);
///   head       the final RMSNorm (element-wise), the output layer's GEMM of 2·S·B·H·V/N FLOPs
///              forward and twice that backward, always at the bf16 peak (stage 06 keeps it in
///              bf16), paired with its gathers as the schedule pairs the blocks' column-parallel
///              GEMMs (02: the backward all-reduce; 03: bulk; 04-06: the ring / copy-engine
///              pipeline), the cross-entropy over the [S, B, V/N] logits (three fp32 passes, HBM)
///              and its three all-reduces of S·B floats, and under sequence parallelism the final
///              gain's gradient all-reduce. V is padded to a multiple of N (common/model.h).
struct EndCost {
  Phase forward, backward;
  double step_ms() const { return forward.step_ms + backward.step_ms; }
  double compute_ms() const { return forward.compute_ms + backward.compute_ms; }
};
struct EndsCost {
  EndCost embedding, head;
};
EndsCost project_ends(const DeviceSpec& d, const BlockConfig& c, int n, const ModelOptions& o);

/// One all-gather + GEMM: the gathered x [m, k] (m/N rows per rank, `bytes` per element) times
/// this rank's [k, n_local] weight, bulk (all-gather, then the GEMM) or overlapped (05's
/// pipeline: copy-engine pulls beside chunked GEMMs). Milliseconds.
double ag_gemm_ms(const DeviceSpec& d, std::int64_t m, std::int64_t n_local, std::int64_t k,
                  int ranks, int bytes, bool overlapped);
/// All-gather + GEMM or GEMM + reduce-scatter fused into one kernel (Flux): the whole GEMM
/// (2·m·n·k FLOPs, this rank's share) beside copy-engine-speed transfers of `bytes_moved / ranks`
/// per step; see the top of the file for the exposed tail. Milliseconds.
double fused_ms(const DeviceSpec& d, double gemm_flops, double bytes_moved, int ranks,
                bool reduce_scatter);
/// One GEMM + reduce-scatter: this rank's x [m, k_local] times [k_local, n], partial sums
/// [m, n] reduce-scattered, bulk (the GEMM, then a ring reduce-scatter) or fused. Milliseconds.
double gemm_rs_ms(const DeviceSpec& d, std::int64_t m, std::int64_t n, std::int64_t k_local,
                  int ranks, int bytes, bool fused);

/// A published training run: the whole model, TP inside a node, FSDP over DP across nodes.
struct Workload {
  BlockConfig layer;  // seq, batch = the local batch of one DP replica, the layer's sizes
  int layers = 1, tp = 8, dp = 1;
  std::int64_t vocab = 0;
  double recompute_fraction = 0;  // 1: full activation checkpointing; the forward share rerun
  bool fp8 = false;               // the linear GEMMs at the FP8 peak, 1-byte TP gathers
};
struct TrainStep {
  double step_ms = 0, layers_ms = 0, head_ms = 0, optimizer_ms = 0, fsdp_exposed_ms = 0;
  double tokens_per_gpu_s = 0;
};
/// One training step of `w`, TP by stage 03's schedule (async = false) or stage 05's (true).
TrainStep train_step(const DeviceSpec& d, const Workload& w, bool async);

/// A published result the model is checked against (tools/devices/published.json).
struct Published {
  std::string name, set, what, metric, unit, source, where, quote, measured, device_file, kind,
      notes;
  double value = 0;
  std::vector<std::string> from;  // the numbers of `quote` the value is derived from, as written
  std::string derive;             // "value" (from[0]), "ratio" (from[0] / from[1]) or "sum"
  int ranks = 8;
  int act_bytes = 2;
  BlockConfig config;                // for the layer cases
  std::int64_t m = 0, n = 0, k = 0;  // for the GEMM cases (n and k whole, split by ranks)
  Workload workload;                 // for the training cases
};
/// A published result the table leaves out, and why.
struct LeftOut {
  std::string what, source, reason;
};
struct PublishedSet {
  std::vector<Published> results;
  std::vector<LeftOut> left_out;
};
/// The value `p.from` and `p.derive` give (what `published` must equal).
double derived_value(const Published& p);

/// Reads published.json; throws std::runtime_error with one line on a bad file: a case whose set
/// is not "calibration" or "held_out", whose `from` numbers are not written in its quote, or
/// whose published value is not what they give.
PublishedSet load_published(const std::filesystem::path& file);

struct Validation {
  Published published;
  double projected = 0, error_pct = 0;
};

/// (projected − published) / published · 100.
double error_pct(double projected, double published);
/// Changes every device on the way into the model (the sensitivity's perturbations).
using DeviceTweak = std::function<void(DeviceSpec&)>;
/// Projects every published case with its device file (resolved next to published.json); a case
/// on `calibrated.file` uses the calibrated device.
std::vector<Validation> validate(const std::vector<Published>& cases,
                                 const std::filesystem::path& devices_dir,
                                 const DeviceSpec& calibrated, const DeviceTweak& tweak = {});

/// Multiplies the assumed parameter `key` of `d` by `factor` (gemm_efficiency: every point,
/// capped at 1; copy_engine_gemm_slowdown and ring_gemm_slowdown: their excess over 1). Returns
/// false, leaving `d` as it was, where `d` does not mark `key` as assumed.
bool perturb(DeviceSpec& d, const std::string& key, double factor);
/// How far every validation error moves when one assumed parameter moves by ±`fraction`
/// (in every device file that assumes it), in percentage points.
struct Sensitivity {
  std::string param;
  std::vector<double> minus, plus;  // per case, error(perturbed) − error, in validation order
};
std::vector<Sensitivity> sensitivity(const std::vector<Published>& cases,
                                     const std::filesystem::path& devices_dir,
                                     const DeviceSpec& calibrated, double fraction = 0.2);

/// The two configs the tables are made for.
BlockConfig big_config();  ///< H=8192 NH=64 NKV=8 F=28672 S=8192 B=1 L=1, bf16: a Llama-3-70B layer
BlockConfig small_config();  ///< H=4096 NH=32 NKV=32 F=11008 S=2048 B=1 L=1, bf16 (Llama-2-7B)

/// A 4-D layout (see the top of the file): P × D × C × T GPUs, M micro-batches scheduled by
/// `schedule` (gpipe, 1f1b, interleaved-1f1b, zb-h1) with V virtual stages per rank, CP by
/// `cp_method`.
struct Layout {
  int pp = 1, dp = 1, cp = 1, tp = 8;
  int microbatches = 1, stages_per_rank = 1;
  std::string schedule = "1f1b";
  CpMethod cp_method = CpMethod::ring;
  int gpus() const { return pp * dp * cp * tp; }
};

/// A layout's projected step on its busiest GPU: the parts add up to step_ms.
struct LayoutStep {
  Layout layout;
  int layers = 0;  // the layers of the busiest pipeline rank
  double compute_ms = 0, tp_ms = 0, cp_ms = 0, dp_ms = 0, p2p_ms = 0, bubble_ms = 0, step_ms = 0;
  double bubble = 0;  // the schedule's formula: the idle share of the pipeline
  /// One micro-batch through the rank's layers: forward, and backward (with a recomputed
  /// forward), TP and CP exposure included: the schedule's F and B (and W = B/2 for zb-h1).
  double forward_ms = 0, backward_ms = 0;
  Traffic tp, cp, dp;           // a step's bytes per GPU on each group (common/traffic.h)
  std::uint64_t p2p_bytes = 0;  // sent per GPU and step across pipeline boundaries (2·M·V msgs)
  std::uint64_t message_bytes = 0;  // one boundary's activation [S/(C·T), B/(D·M), H]
  std::uint64_t memory_bytes = 0;   // common/memory.h's estimate: its layers and ends
  std::uint64_t saved_bytes = 0;    // its saved activations
  std::uint64_t logits_bytes = 0;   // its logits term (--task lm, the last pipeline rank's)
};

/// Everything tpx_project writes.
struct Report {
  DeviceSpec device;
  struct Row {
    int stage = 0, n = 0;
    Projection p;
    double speedup_vs_03 = 0;  // 0 where there is no stage 03 at that N (stage 01)
  };
  struct Table {
    std::string name;
    BlockConfig config;
    std::vector<Row> rows;
  };
  std::vector<Table> tables;
  /// Stage 07 (stage 05's TP inside a node, FSDP over DP across nodes) at TP × DP meshes.
  struct MeshRow {
    int tp = 0, dp = 0;
    double tp_step_ms = 0, compute_ms = 0, dp_bus_bytes = 0, dp_ms = 0, step_ms = 0;
  };
  BlockConfig mesh_config;
  std::vector<MeshRow> mesh;
  /// The 4-D meshes: per GPU count, the model and its layouts' projected steps.
  struct LayoutTable {
    int gpus = 0;
    BlockConfig config;
    std::vector<LayoutStep> rows;
    std::size_t best = 0;  // the row with the shortest step
  };
  std::vector<LayoutTable> layouts;
  std::vector<Validation> validation;
  std::vector<LeftOut> left_out;
  std::vector<Sensitivity> sensitivity;
};

/// Stage 07 at a TP × DP mesh: stage `tp_stage`'s TP step (05, or 06 under --dtype fp8) on one
/// DP replica's config `replica` (its B / D), plus `dp_bus_bytes` of FSDP traffic per rank over
/// DP at the inter-node bandwidth (latency: 3·(D−1) messages per layer), prefetched behind the
/// compute (exposed: what it takes beyond it; none without a dp_GBps_per_direction in the device
/// file).
Report::MeshRow project_mesh(const DeviceSpec& d, const BlockConfig& replica, int tp, int dp,
                             double dp_bus_bytes, int tp_stage = 5);

/// The projection of `c` (all its layers, its global batch B) on layout `l`. Throws
/// std::runtime_error (tpx::ConfigError from the schedule library) with one line when the
/// layout does not split the model: D ∤ B, M ∤ B/D, 2C·T ∤ S, T ∤ the heads or F, L < P·V, a
/// schedule's own limits, Ulysses' NKV % (C·T), zb-h1's formula outside M ≥ P and W ≤ F, a mesh
/// of more GPUs than an int counts, more layers than an int.
LayoutStep project_layout(const DeviceSpec& d, const BlockConfig& c, const Layout& l);

/// The model of the 4-D tables: `preset` (common/presets.h, all its layers), bf16, AdamW, and a
/// global batch of `gpus` / 2 sequences (the same tokens per GPU at every size).
BlockConfig layout_model(const std::string& preset, int gpus);
/// The layouts of the 4-D table at `gpus` (64 or 512): a handful of P × D × C × T, each with
/// micro-batches of one sequence under 1F1B.
std::vector<Layout> layout_table(int gpus);

Report make_report(const DeviceSpec& d, const std::vector<Validation>& validation,
                   const std::vector<LeftOut>& left_out = {},
                   const std::vector<Sensitivity>& sensitivity = {});
nlohmann::json report_json(const Report& r);
std::string report_markdown(const Report& r);
/// The validation tables (held-out first, then calibration, then what is left out), as --validate
/// prints them.
std::string validation_markdown(const std::vector<Validation>& v,
                                const std::vector<LeftOut>& left_out = {});
/// The sensitivity table, as --sensitivity prints it.
std::string sensitivity_markdown(const std::vector<Validation>& v,
                                 const std::vector<Sensitivity>& s);

}  // namespace tpx::projection
