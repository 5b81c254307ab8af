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
//   comm      the bytes the stages count (comm_bytes() below, tested against the stages'
//             --json), at link bandwidth · collective efficiency, plus the link latency per
//             message (a ring all-gather or reduce-scatter sends N−1 messages per rank; an
//             all-reduce is charged 2·⌈log₂ N⌉, a tree's latency).
//   overlap   01: none to do. 02, 03: every collective is exposed (bulk, in the critical path).
//             04: each ring primitive runs N steps; in step i the GEMM of chunk i runs beside the
//             transfer of the next chunk: (N−1)·max(GEMM chunk, transfer) + one GEMM chunk, the
//             GEMM slowed by sms / (sms − collective_sms) while a transfer kernel runs beside it.
//             05: the same pipeline with copy-engine pulls (copy_engine_GBps, no SM taken); the
//             loss left is the chunked GEMMs' efficiency. 06: 05 with the linear GEMMs at the FP8
//             peak, gathers of 1-byte codes, and the amax MAX all-reduces (latency) exposed.
//   exposed comm = step − compute (the compute of the stage's own, possibly chunked, GEMMs).
//
// defines: tpx::projection::stage_name(), EfficiencyCurve, DeviceSpec, load_device(), calibrate(),
// Comm,
//          comm_bytes(), Schedule, ModelOptions, Phase, Projection, project(), project_stage(),
//          ag_gemm_ms(), Published, load_published(), Validation, validate(), error_pct(),
//          Report, make_report(), report_json(), report_markdown(), big_config(), small_config()
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/config.h"

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
  EfficiencyCurve gemm;
  bool calibrated = false;
};

/// Reads a device file; throws std::runtime_error with one line naming the file and the problem.
DeviceSpec load_device(const std::filesystem::path& file);
/// Replaces the device's GEMM curve with the cuda bf16 rows (gemm/cuda/bf16/…) of a
/// bench_gemm JSON file. Returns false, leaving the device as it was, when the file has none.
bool calibrate(DeviceSpec& device, const std::filesystem::path& bench_gemm_json);

/// Communication of one step on one rank, counted as the stages count it (common/stage.h).
struct Comm {
  std::uint64_t payload = 0, bus = 0, calls = 0;
};

/// The stage's directory and executable name, e.g. "03_sequence_parallel" for 3 ("?" outside 1…6).
std::string stage_name(int stage);

/// Bytes per element of the activations `stage` stores and communicates under `c`: 2 under the
/// mixed-precision recipe (--dtype bf16, and stage 06's FP8, which runs inside it), else 4.
int activation_bytes(int stage, const BlockConfig& c);

/// The bytes per rank and step of `stage` (1 … 6) at N ranks. `act_bytes`: bytes per element of
/// the communicated activations (0: activation_bytes(stage, c), what the stage counts). Stage 06
/// gathers 1-byte codes and all-reduces fp32 amaxes; weight-gradient reductions (the norm gains'
/// all-reduce) are fp32 in every recipe. The formulas of the chapters (0*/README.md); see the
/// comments in projection.cc.
Comm comm_bytes(int stage, const BlockConfig& c, int n, int act_bytes = 0);

/// How the communication is scheduled against the GEMMs.
enum class Schedule { none, all_reduce, bulk, ring, copy_engine };

struct ModelOptions {
  Schedule schedule = Schedule::bulk;
  bool fp8 = false;        // linear GEMMs at the FP8 peak, 1-byte gathers, amax all-reduces
  int act_bytes = 4;       // see comm_bytes()
  bool recompute = false;  // activation checkpointing: the forward runs twice per step
};

/// Times of one phase (forward or backward), milliseconds, all layers.
struct Phase {
  double step_ms = 0, compute_ms = 0;
};

struct Projection {
  Phase forward, backward;
  double step_ms = 0, compute_ms = 0, exposed_comm_ms = 0;
  double flops_per_rank = 0;  // the GEMMs the model times, forward + backward once
  Comm comm;
};

/// The model for any schedule (see the top of the file).
Projection project(const DeviceSpec& d, const BlockConfig& c, int n, const ModelOptions& o);
/// Stage `stage`'s schedule (01: none at N = 1; 02: all_reduce; 03: bulk; 04: ring;
/// 05: copy_engine; 06: copy_engine + fp8), bytes as the stages count them.
ModelOptions stage_options(int stage);
Projection project_stage(const DeviceSpec& d, const BlockConfig& c, int n, int stage);

/// One all-gather + GEMM: the gathered x [m, k] (m/N rows per rank, `bytes` per element) times
/// this rank's [k, n_local] weight, bulk (all-gather, then the GEMM) or overlapped (05's
/// pipeline: copy-engine pulls beside chunked GEMMs). Milliseconds.
double ag_gemm_ms(const DeviceSpec& d, std::int64_t m, std::int64_t n_local, std::int64_t k,
                  int ranks, int bytes, bool overlapped);

/// A published result the model is checked against (tools/devices/published.json).
struct Published {
  std::string name, what, metric, unit, source, device_file, kind, notes;
  double value = 0;
  int ranks = 8;
  int act_bytes = 2;
  BlockConfig config;                // for the layer cases
  std::int64_t m = 0, n = 0, k = 0;  // for the AG+GEMM cases (n: the whole N, split by ranks)
};

/// Reads published.json; throws std::runtime_error with one line on a bad file.
std::vector<Published> load_published(const std::filesystem::path& file);

struct Validation {
  Published published;
  double projected = 0, error_pct = 0;
};

/// (projected − published) / published · 100.
double error_pct(double projected, double published);
/// Projects every published case with its device file (resolved next to published.json); a case
/// on `calibrated.file` uses the calibrated curve.
std::vector<Validation> validate(const std::vector<Published>& cases,
                                 const std::filesystem::path& devices_dir,
                                 const DeviceSpec& calibrated);

/// The two configs the tables are made for.
BlockConfig big_config();  ///< H=8192 NH=64 NKV=8 F=28672 S=8192 B=1 L=1, bf16: a Llama-3-70B layer
BlockConfig small_config();  ///< H=4096 NH=32 NKV=32 F=11008 S=2048 B=1 L=1, bf16 (Llama-2-7B)

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
  std::vector<Validation> validation;
};

Report make_report(const DeviceSpec& d, const std::vector<Validation>& validation);
nlohmann::json report_json(const Report& r);
std::string report_markdown(const Report& r);
/// The validation table alone (markdown), as --validate prints it.
std::string validation_markdown(const std::vector<Validation>& v);

}  // namespace tpx::projection
