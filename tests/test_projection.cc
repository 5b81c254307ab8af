// The benchmark's bandwidth convention and the projection model (tools/projection.h):
//   - algbw / busbw (bench/busbw.h) on fixed inputs against nccl-tests' formulas worked by hand;
//   - the model's bytes per rank and step equal what every stage's --json reports on the cpu
//     (stages 01 … 06, N = 1, 2, 4; stage 01 runs on one rank only), and the chapters' worked
//     numbers at the default config;
//   - the efficiency curve, calibration from a bench_gemm file, and one AG+GEMM worked by hand;
//   - the fused (Flux) and GEMM + reduce-scatter times, FSDP's bytes and a training step by hand;
//   - tpx_project's output: its validation errors are (projected − published) / published of the
//     numbers it prints, its projections are the library's, and its markdown says it is projected;
//   - the 4-D mesh (project_layout()): at P = C = 1 it is stage 07's projection, its bubble is the
//     schedule's formula, its CP bytes 08_context_parallel/traffic.h's (and chapter 8's measured
//     numbers), its P2P bytes the boundary activations, and the report's tables hold only whole
//     layouts;
//   - the published cases: the held-out set keeps every case and each value is the one its quoted
//     source line gives; the validation and sensitivity tables in docs/benchmarks.md are what a
//     fresh run of tpx_project prints (a constant changed without regenerating them fails here).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "06_fp8/traffic.h"
#include "07_fsdp_tp/memory.h"
#include "07_fsdp_tp/traffic.h"
#include "08_context_parallel/memory.h"
#include "09_pipeline_parallel/schedule.h"
#include "10_expert_parallel/memory.h"
#include "10_expert_parallel/traffic.h"
#include "bench/busbw.h"
#include "common/flops.h"
#include "common/memory.h"
#include "common/model.h"
#include "common/presets.h"
#include "common/traffic.h"
#include "test_stage_runs.h"
#include "test_util.h"
#include "tools/projection.h"

namespace tpx {
namespace {

using nlohmann::json;
namespace pj = projection;
using bench::Collective;
using cp::cp_traffic;
using cp::CpMethod;
using cp::mesh_traffic;
using cp::MeshTraffic;
using fsdp::fsdp_traffic;
using pj::comm_bytes;

const std::filesystem::path kDevices = std::filesystem::path(TPX_SOURCE_DIR) / "tools/devices";

// --- busbw.h -------------------------------------------------------------------------------------

TEST(BusBandwidth, NcclTestsFormulasByHand) {
  // 1 GB in 1 s: algbw 1 GB/s for every op; at n = 8 an all-reduce's bus carries 2·7/8 of it.
  EXPECT_DOUBLE_EQ(bench::algbw_GBps(1e9, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(bench::busbw_GBps(Collective::all_reduce, 8, 1e9, 1.0), 1.75);
  EXPECT_DOUBLE_EQ(bench::busbw_GBps(Collective::all_gather, 8, 1e9, 1.0), 0.875);
  EXPECT_DOUBLE_EQ(bench::busbw_GBps(Collective::reduce_scatter, 4, 1e9, 1.0), 0.75);
  EXPECT_DOUBLE_EQ(bench::busbw_GBps(Collective::symm_pull, 2, 1e9, 1.0), 0.5);
  EXPECT_DOUBLE_EQ(bench::busbw_GBps(Collective::broadcast, 8, 1e9, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(bench::busbw_GBps(Collective::sendrecv, 8, 1e9, 1.0), 1.0);
  // 256 MiB in 10 ms at n = 2: algbw 26.8435456 GB/s; an all-reduce's busbw equals it (2·1/2).
  EXPECT_NEAR(bench::algbw_GBps(268435456.0, 0.01), 26.8435456, 1e-9);
  EXPECT_NEAR(bench::busbw_GBps(Collective::all_reduce, 2, 268435456.0, 0.01), 26.8435456, 1e-9);
  // One rank moves nothing over links; no time gives no bandwidth.
  EXPECT_DOUBLE_EQ(bench::bus_factor(Collective::all_reduce, 1), 0.0);
  EXPECT_DOUBLE_EQ(bench::algbw_GBps(1e9, 0.0), 0.0);
}

// --- bytes: the model against the stages -------------------------------------------------------

struct Case {
  int stage, ranks;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "stage " << c.stage << " -np " << c.ranks;
}

class ModelBytes : public testing::TestWithParam<Case> {};

TEST_P(ModelBytes, EqualTheStagesJson) {
  const auto [stage, n] = GetParam();
  BlockConfig c;  // small, so a run takes a second: the sizes of tests/test_stages.cc
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  c.seq = 16;
  c.batch = 2;
  c.layers = 2;
  // Multi-head attention without recompute, and GQA under full recompute (the forward's
  // collectives twice; GQA moves nothing more).
  for (const bool llama : {false, true}) {
    c.kv_heads = llama ? std::max(2, n) : c.heads;
    c.recompute = llama ? Recompute::full : Recompute::none;
    test::TempDir dir;
    const auto path = dir / "summary.json";
    const std::string cmd = fmt::format(
        "{} timeout 120 {} {} -np {} {} --hidden {} --heads {} --ffn {} --seq {} --batch {} "
        "--layers {} --kv-heads {} --recompute {} --task block --steps 1 --json {}",
        test::kRootMpiEnv, TPX_MPIEXEC, TPX_MPIEXEC_FLAGS, n,
        test::stage_binary(projection::stage_name(stage)), c.hidden, c.heads, c.ffn, c.seq, c.batch,
        c.layers, c.kv_heads, recompute_flag(c.recompute), path.string());
    const auto r = test::run_command(cmd, dir);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const json j = json::parse(test::read_file(path));
    ASSERT_EQ(j.at("steps").size(), 1u);
    const json& row = j["steps"][0];
    const pj::Comm want = pj::comm_bytes(stage, c, n);
    EXPECT_EQ(row.at("comm_bus_bytes").get<std::uint64_t>(), want.bus) << cmd;
    EXPECT_EQ(row.at("comm_payload_bytes").get<std::uint64_t>(), want.payload) << cmd;
    EXPECT_EQ(row.at("comm_calls").get<std::uint64_t>(), want.calls) << cmd;
  }
}

INSTANTIATE_TEST_SUITE_P(stages, ModelBytes,
                         testing::Values(Case{1, 1}, Case{2, 1}, Case{2, 2}, Case{2, 4}, Case{3, 1},
                                         Case{3, 2}, Case{3, 4}, Case{4, 1}, Case{4, 2}, Case{4, 4},
                                         Case{5, 1}, Case{5, 2}, Case{5, 4}, Case{6, 1}, Case{6, 2},
                                         Case{6, 4}));

TEST(ModelBytesChapters, DefaultConfigNumbers) {
  // The worked numbers the chapters state for the default config (S=128 B=2 H=256 L=2).
  const BlockConfig c;
  EXPECT_EQ(pj::comm_bytes(2, c, 2).payload, 2097152u);  // 02_megatron_tp/README.md
  EXPECT_EQ(pj::comm_bytes(2, c, 2).bus, 2097152u);
  EXPECT_EQ(pj::comm_bytes(2, c, 4).bus, 3145728u);
  EXPECT_EQ(pj::comm_bytes(3, c, 2).payload, 5246976u);  // 03_sequence_parallel/README.md
  EXPECT_EQ(pj::comm_bytes(3, c, 2).bus, 2625536u);
  EXPECT_EQ(pj::comm_bytes(3, c, 4).bus, 3938304u);
  EXPECT_EQ(pj::comm_bytes(4, c, 1).payload, 4096u);  // 04_overlap_ring/README.md
  EXPECT_EQ(pj::comm_bytes(4, c, 2).bus, 2625536u);
  EXPECT_EQ(pj::comm_bytes(6, c, 2).bus, 921760u);  // 06_fp8/README.md (bf16 reduce-scatters)
  // The mixed-precision recipe: activations move 2 bytes an element, the norm gains' gradient
  // all-reduce (2·H·4·2(N−1)/N per layer and gain under sequence parallelism) stays fp32.
  BlockConfig b = c;
  b.dtype = DType::bf16;
  EXPECT_EQ(pj::comm_bytes(2, b, 2).bus, 2097152u / 2);
  EXPECT_EQ(pj::comm_bytes(3, b, 2).bus, (2625536u - 4096u) / 2 + 4096u);
  EXPECT_EQ(pj::comm_bytes(5, b, 2).bus, 1314816u);  // what stage 05 --dtype bf16 -np 2 counts
  EXPECT_EQ(pj::comm_bytes(1, c, 1).bus, 0u);
}

// --- the model's arithmetic ----------------------------------------------------------------------

TEST(Projection, EfficiencyCurveInterpolatesInLogFlops) {
  pj::EfficiencyCurve e{{{1e9, 0.2}, {1e11, 0.6}}, "test"};
  EXPECT_DOUBLE_EQ(e.at(1e8), 0.2);     // held below the first point
  EXPECT_DOUBLE_EQ(e.at(1e12), 0.6);    // and above the last
  EXPECT_NEAR(e.at(1e10), 0.4, 1e-12);  // halfway in log(flops)
}

/// A device with round numbers, so that times can be worked by hand.
pj::DeviceSpec round_device() {
  pj::DeviceSpec d;
  d.name = "round";
  d.file = "round.json";
  d.peak_bf16_flops = 1e15;  // 1 PFLOP/s
  d.peak_fp8_flops = 2e15;
  d.hbm_GBps = 1000;
  d.nvlink_GBps_per_direction = 100;
  d.link_latency_us = 10;
  d.sms = 100;
  d.collective_sms = 20;
  d.copy_engine_GBps = 50;
  d.collective_efficiency = 1.0;
  d.attention_efficiency = 1.0;
  d.gemm = {{{1.0, 0.5}}, "flat 0.5"};
  return d;
}

TEST(Projection, AllGatherGemmByHand) {
  pj::DeviceSpec d = round_device();
  // m=1000, k=1000, n_local=500, 4 ranks, 2-byte elements:
  // GEMM 2·1000·500·1000 = 1e9 FLOPs at 0.5 PFLOP/s = 0.002 ms.
  // Bulk all-gather: bus 2e6·3/4 = 1.5e6 bytes at 100 GB/s = 0.015 ms, + 3 messages · 10 µs.
  EXPECT_NEAR(pj::ag_gemm_ms(d, 1000, 500, 1000, 4, 2, false), 0.002 + 0.015 + 0.03, 1e-12);
  // Overlapped: chunk GEMM 0.0005 ms; one pull: 5e5 bytes at 50 GB/s = 0.01 ms + 10 µs; the
  // pulls dominate: 0.0005 + 3·0.02.
  EXPECT_NEAR(pj::ag_gemm_ms(d, 1000, 500, 1000, 4, 2, true), 0.0005 + 3 * 0.02, 1e-12);
  // Ten times each side: GEMM 1e12 FLOPs = 2 ms, chunk 0.5 ms; bulk bus 1.5e8 bytes = 1.5 ms.
  // With pulls at 500 GB/s (5e7 bytes: 0.1 ms + 10 µs) the transfers hide behind the chunks.
  d.copy_engine_GBps = 500;
  EXPECT_NEAR(pj::ag_gemm_ms(d, 10000, 5000, 10000, 4, 2, false), 2.0 + 1.5 + 0.03, 1e-9);
  EXPECT_NEAR(pj::ag_gemm_ms(d, 10000, 5000, 10000, 4, 2, true), 0.5 + 3 * 0.5, 1e-9);
}

TEST(Projection, CopyEngineOverlapNeverLosesToBulk) {
  // The mechanics, on the assumed curve: the measured one (three points, 0.50 at 1.8e11 FLOPs
  // and 0.82 at 1.1e12) makes the chunks of 05 so much slower than whole GEMMs that 03 can win.
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json", /*measured=*/false);
  for (const BlockConfig& c : {pj::big_config(), pj::small_config()})
    for (int n : {2, 4, 8}) {
      const double s3 = pj::project_stage(d, c, n, 3).step_ms;
      const double s5 = pj::project_stage(d, c, n, 5).step_ms;
      const auto p2 = pj::project_stage(d, c, n, 2);
      EXPECT_LE(s5, s3) << n;  // the same bytes, hidden behind (chunked) GEMMs
      // On the big layer, where GEMMs dominate, FP8 GEMMs and 1-byte gathers win.
      if (c.hidden == pj::big_config().hidden) {
        EXPECT_LT(pj::project_stage(d, c, n, 6).step_ms, s5) << n;
      }
      EXPECT_GT(p2.exposed_comm_ms, 0.0);
      EXPECT_NEAR(p2.step_ms, p2.compute_ms + p2.exposed_comm_ms, 1e-9);
      // The GEMMs the model times are the block's FLOPs (common/flops.h), 1/N per rank.
      EXPECT_NEAR(p2.flops_per_rank, step_flops(c).total() / n, 1e-9 * p2.flops_per_rank);
    }
}

TEST(Projection, CalibrationTakesTheCudaBf16Rows) {
  pj::DeviceSpec d = round_device();
  test::TempDir dir;
  const auto path = dir / "bench_gemm.json";
  // 2·1000·1000·1000 = 2e9 FLOPs at 250 TFLOP/s: 0.25 of the 1 PFLOP/s peak. The cpu row and the
  // fp32 row are not bf16 GPU GEMMs and must be ignored.
  std::ofstream(path) << R"({"benchmarks": [
    {"name": "gemm/cpu/fp32/wq/fwd", "run_type": "iteration", "label": "m=10 n=10 k=10",
     "TFLOP/s": 0.1},
    {"name": "gemm/cuda/fp32/wq/fwd", "run_type": "iteration", "label": "m=10 n=10 k=10",
     "TFLOP/s": 50},
    {"name": "gemm/cuda/bf16/wq/fwd", "run_type": "iteration", "label": "m=1000 n=1000 k=1000",
     "TFLOP/s": 250}]})";
  ASSERT_TRUE(pj::calibrate(d, path));
  EXPECT_TRUE(d.calibrated);
  ASSERT_EQ(d.gemm.points.size(), 1u);
  EXPECT_DOUBLE_EQ(d.gemm.points[0].first, 2e9);
  EXPECT_DOUBLE_EQ(d.gemm.at(1e12), 0.25);
  std::ofstream(path, std::ios::trunc) << R"({"benchmarks": []})";
  pj::DeviceSpec e = round_device();
  EXPECT_FALSE(pj::calibrate(e, path));
  EXPECT_FALSE(e.calibrated);
}

TEST(Projection, CalibrationTakesChunkedRowsAndContention) {
  pj::DeviceSpec d = round_device();
  d.assumed = {"gemm_efficiency", "copy_engine_gemm_slowdown", "collective_sms", "link_latency_us"};
  test::TempDir dir;
  const auto path = dir / "bench.json";
  // A chunked row of 4 chunks: each chunk is 2·250·1000·1000 = 5e8 FLOPs, at 100 TFLOP/s = 0.1
  // of the peak. bench_copy_overlap: the largest n of each mover counts (8192, not 4096).
  std::ofstream(path) << R"({"benchmarks": [
    {"name": "gemm/cuda/bf16/wq/fwd", "run_type": "iteration", "label": "m=1000 n=1000 k=1000",
     "TFLOP/s": 250},
    {"name": "gemm_chunked/cuda/bf16/wq/N:4", "run_type": "iteration",
     "label": "m=1000 n=1000 k=1000 chunks=4", "TFLOP/s": 100, "efficiency": 0.4},
    {"name": "copy_overlap/cuda/bf16/copy_engine/4096", "run_type": "iteration", "slowdown": 1.5},
    {"name": "copy_overlap/cuda/bf16/copy_engine/8192", "run_type": "iteration", "slowdown": 1.04},
    {"name": "copy_overlap/cuda/bf16/sm_copy/8192", "run_type": "iteration", "slowdown": 1.3}]})";
  ASSERT_TRUE(pj::calibrate(d, path));
  ASSERT_EQ(d.gemm.points.size(), 2u);
  EXPECT_DOUBLE_EQ(d.gemm.points[0].first, 5e8);
  EXPECT_DOUBLE_EQ(d.gemm.at(5e8), 0.1);
  EXPECT_DOUBLE_EQ(d.gemm.at(2e9), 0.25);
  EXPECT_DOUBLE_EQ(d.copy_engine_gemm_slowdown, 1.04);
  EXPECT_DOUBLE_EQ(d.ring_gemm_slowdown, 1.3);
  // Measured now: no longer assumptions; the latency still is.
  EXPECT_EQ(d.assumed, std::vector<std::string>{"link_latency_us"});
}

TEST(Projection, FusedAndGemmReduceScatterByHand) {
  pj::DeviceSpec d = round_device();  // flat 0.5 efficiency: 1e12 FLOPs = 2 ms
  // Transfers: 4e7 bytes / 4 ranks = 1e7 per step at 50 GB/s = 0.2 ms + 10 µs latency.
  // All-gather fused: the GEMM (2 ms) outlasts 3 transfers + one chunk (0.63 + 0.5 ms).
  EXPECT_NEAR(pj::fused_ms(d, 1e12, 4e7, 4, false), 2.0, 1e-12);
  // Reduce-scatter fused: the last transfer stays exposed after the GEMM.
  EXPECT_NEAR(pj::fused_ms(d, 1e12, 4e7, 4, true), 2.0 + 0.21, 1e-12);
  // Transfer-bound (4e8 bytes: 2.01 ms a step): an all-gather waits for 3 steps, then computes
  // the last chunk; a reduce-scatter computes one chunk, then 3 transfers and the last one.
  EXPECT_NEAR(pj::fused_ms(d, 1e12, 4e8, 4, false), 3 * 2.01 + 0.5, 1e-9);
  EXPECT_NEAR(pj::fused_ms(d, 1e12, 4e8, 4, true), 0.5 + 3 * 2.01 + 2.01, 1e-9);
  // Beside a copy engine that slows the GEMM by 10 %, the compute-bound case takes 10 % longer.
  d.copy_engine_gemm_slowdown = 1.1;
  EXPECT_NEAR(pj::fused_ms(d, 1e12, 4e7, 4, false), 2.2, 1e-12);
  d.copy_engine_gemm_slowdown = 1.0;
  // Bulk GEMM + reduce-scatter: x [1000, 250] times [250, 2000] = 1e9 FLOPs, 0.002 ms; the
  // [1000, 2000] partial sums in 2 bytes (4e6) reduce-scattered: bus 3e6 at 100 GB/s = 0.03 ms,
  // + 3 messages · 10 µs.
  EXPECT_NEAR(pj::gemm_rs_ms(d, 1000, 2000, 250, 4, 2, false), 0.002 + 0.03 + 0.03, 1e-12);
}

TEST(Projection, FsdpBytesByHand) {
  BlockConfig c;  // H=256 NH=8 F=1024 L=2, multi-head: Wq Wk Wv Wo 4·H², FFN 3·H·F
  const double per_tp_rank = (4.0 * 256 * 256 + 3.0 * 256 * 1024) / 2 + 2 * 256;
  EXPECT_DOUBLE_EQ(pj::layer_params_per_tp_rank(c, 2), per_tp_rank);
  // D = 4, bf16 gathers: per layer (2·2 + 4)·P·3/4, two layers.
  EXPECT_DOUBLE_EQ(pj::fsdp_bytes(c, 2, 4, 2), 2 * 8 * per_tp_rank * 3 / 4);
  EXPECT_DOUBLE_EQ(pj::fsdp_bytes(c, 2, 1, 2), 0.0);
}

TEST(Projection, TrainingStepHasEveryPart) {
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_hbm2e_500w.json");
  pj::Workload w;
  w.layer = pj::big_config();
  w.layer.batch = 2;
  w.layers = 4;
  w.vocab = 128256;
  w.tp = 8;
  w.dp = 4;
  const pj::TrainStep plain = pj::train_step(d, w, false);
  EXPECT_NEAR(plain.step_ms,
              plain.layers_ms + plain.head_ms + plain.optimizer_ms + plain.fsdp_exposed_ms, 1e-9);
  EXPECT_GT(plain.head_ms, 0.0);
  EXPECT_GT(plain.optimizer_ms, 0.0);
  EXPECT_GT(plain.fsdp_exposed_ms, 0.0);  // at least the first gather
  // The layers are the block's projection, L times.
  pj::ModelOptions o;
  o.schedule = pj::Schedule::bulk;
  o.act_bytes = 2;  // bf16 activations
  BlockConfig one = w.layer;
  one.layers = 1;
  EXPECT_NEAR(plain.layers_ms, 4 * pj::project(d, one, 8, o).step_ms, 1e-9 * plain.layers_ms);
  // Full recompute runs each layer's forward again.
  w.recompute_fraction = 1;
  EXPECT_NEAR(pj::train_step(d, w, false).layers_ms - plain.layers_ms,
              4 * pj::project(d, one, 8, o).forward.step_ms, 1e-9 * plain.layers_ms);
  // Tokens per GPU: S·B tokens per TP group of 8 per step.
  EXPECT_NEAR(plain.tokens_per_gpu_s, 8192.0 * 2 / 8 / (plain.step_ms * 1e-3), 1e-9);
}

TEST(Projection, BadDeviceFileIsOneClearError) {
  test::TempDir dir;
  const auto path = dir / "bad.json";
  std::ofstream(path) << R"({"name": "x", "peak_bf16_flops": "fast"})";
  try {
    pj::load_device(path);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("peak_bf16_flops"), std::string::npos) << e.what();
  }
}

// A device figure out of range (a negative peak, an efficiency above 1, a fractional or absurd
// count, an optional figure of the wrong type) is an error naming the file and the key, not a
// table of negative milliseconds.
TEST(Projection, DeviceFiguresOutOfRangeAreOneErrorNamingTheKey) {
  test::TempDir dir;
  const json good = json::parse(test::read_file(kDevices / "h100_sxm.json"));
  for (const auto& [key, value, says] : std::vector<std::tuple<std::string, json, std::string>>{
           {"peak_bf16_flops", -5, "\"peak_bf16_flops\" is -5: it must be a number > 0"},
           {"hbm_GBps", 0, "\"hbm_GBps\" is 0: it must be a number > 0"},
           {"link_latency_us", -1, "\"link_latency_us\" is -1: it must be a number >= 0"},
           {"collective_efficiency", 1.5, "\"collective_efficiency\" is 1.5"},
           {"sms", 1e300, "\"sms\" is 1e+300"},
           {"sms", 131.5, "\"sms\" is 131.5: it must be an integer"},
           {"gpus_per_node", 0, "\"gpus_per_node\" is 0"},
           {"dp_efficiency", "high", "\"dp_efficiency\" is missing or not a number"},
           {"copy_engine_gemm_slowdown", 0.5, "\"copy_engine_gemm_slowdown\" is 0.5"}}) {
    SCOPED_TRACE(key);
    json j = good;
    j[key] = value;
    const auto path = dir / "bad.json";
    std::ofstream(path) << j.dump();
    try {
      pj::load_device(path);
      ADD_FAILURE() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(path.string() + ": " + says), std::string::npos)
          << e.what();
    }
  }
}

// --- the 4-D mesh --------------------------------------------------------------------------------

/// The Llama-3-70B layer, `layers` of them, a global batch of `batch` sequences.
BlockConfig stack(int layers, int batch) {
  BlockConfig c = pj::big_config();
  c.layers = layers;
  c.batch = batch;
  return c;
}

TEST(Layout, OneStageNoCpIsStage07) {
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  const BlockConfig c = stack(4, 8);
  pj::Layout l;
  l.tp = 8;
  l.dp = 4;
  const pj::LayoutStep x = pj::project_layout(d, c, l);
  BlockConfig replica = c;
  replica.batch /= 4;
  const Traffic dp = fsdp_traffic(c, 8, 4);
  const auto stage07 = pj::project_mesh(d, replica, 8, 4, double(dp.bus));
  EXPECT_DOUBLE_EQ(x.step_ms, stage07.step_ms);
  EXPECT_DOUBLE_EQ(x.compute_ms, stage07.compute_ms);
  EXPECT_DOUBLE_EQ(x.compute_ms + x.tp_ms, stage07.tp_step_ms);
  EXPECT_EQ(x.bubble, 0.0);
  EXPECT_EQ(x.bubble_ms, 0.0);
  EXPECT_EQ(x.p2p_ms, 0.0);
  EXPECT_EQ(x.cp_ms, 0.0);
  EXPECT_EQ(x.p2p_bytes, 0u);
  // The bytes: stage 07's, as its dry run counts them.
  const MeshTraffic t = mesh_traffic(c, 4, 1, 8);
  EXPECT_EQ(x.tp.bus, t.tp.bus);
  EXPECT_EQ(x.tp.bus, comm_bytes(5, replica, 8).bus);
  EXPECT_EQ(x.dp.bus, dp.bus);
  EXPECT_EQ(x.cp.bus, 0u);
}

TEST(Layout, TheStepIsTheSumOfItsParts) {
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  for (const pj::Layout& l : pj::layout_table(512)) {
    const pj::LayoutStep x = pj::project_layout(d, pj::layout_model("llama3-70b", 512), l);
    EXPECT_NEAR(x.step_ms, x.compute_ms + x.tp_ms + x.cp_ms + x.dp_ms + x.p2p_ms + x.bubble_ms,
                1e-9 * x.step_ms);
    EXPECT_GT(x.compute_ms, 0.0);
    EXPECT_EQ(x.cp_ms > 0.0 || l.cp == 1, true);  // the ring's last dK/dV hop is never hidden
    EXPECT_EQ(x.p2p_ms > 0.0, l.pp > 1);
    EXPECT_EQ(x.bubble_ms > 0.0, l.pp > 1);
  }
}

TEST(Layout, TheBubbleIsTheSchedulesFormula) {
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  const BlockConfig c = stack(16, 16);
  for (const std::string& name : pipeline::schedule_names()) {
    pj::Layout l;
    l.pp = 4;
    l.dp = 2;
    l.microbatches = 8;
    l.schedule = name;
    l.stages_per_rank = name == "interleaved-1f1b" ? 2 : 1;
    const pj::LayoutStep x = pj::project_layout(d, c, l);
    const auto sched = pipeline::make_schedule(name, {4, 8, l.stages_per_rank});
    const double V = l.stages_per_rank;
    const pipeline::Costs costs =
        sched->split_backward()
            ? pipeline::Costs{x.forward_ms, x.backward_ms / 2, x.backward_ms / 2, 0.0}
            : pipeline::Costs{x.forward_ms / V, x.backward_ms / V, 0.0, 0.0};
    EXPECT_DOUBLE_EQ(x.bubble, sched->formula_bubble(costs)) << name;
    // The pipeline's busy time (its micro-batches' work) over 1 − bubble is the makespan.
    const double busy = x.compute_ms + x.tp_ms + x.cp_ms;
    EXPECT_NEAR(x.bubble_ms, busy * x.bubble / (1 - x.bubble), 1e-9 * x.step_ms) << name;
  }
  // By hand: 1F1B and GPipe (P−1)/(M+P−1) = 3/11; interleaved with V = 2: 3/19.
  pj::Layout l;
  l.pp = 4;
  l.dp = 2;
  l.microbatches = 8;
  EXPECT_DOUBLE_EQ(pj::project_layout(d, c, l).bubble, 3.0 / 11.0);
  l.schedule = "interleaved-1f1b";
  l.stages_per_rank = 2;
  EXPECT_DOUBLE_EQ(pj::project_layout(d, c, l).bubble, 3.0 / 19.0);
}

TEST(Layout, MoreMicrobatchesShrinkTheBubble) {
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  const BlockConfig c = stack(16, 32);
  double prev = 1.0, prev_share = 1.0;
  for (const int m : {4, 8, 16, 32}) {
    pj::Layout l;
    l.pp = 4;
    l.microbatches = m;
    const pj::LayoutStep x = pj::project_layout(d, c, l);
    EXPECT_LT(x.bubble, prev) << m;
    EXPECT_LT(x.bubble_ms / x.step_ms, prev_share) << m;
    prev = x.bubble;
    prev_share = x.bubble_ms / x.step_ms;
  }
}

TEST(Layout, CpBytesAreTrafficsAndTheChaptersMeasuredOnes) {
  // Chapter 8's table, measured by stage 08 at the default sizes with --kv-heads 2, C = 2
  // (08_context_parallel/README.md): ring 524,288, allgather 393,216, ulysses 983,040 bytes.
  BlockConfig c;
  c.kv_heads = 2;
  EXPECT_EQ(cp_traffic(c, 1, 2, 1, CpMethod::ring).bus, 524288u);
  EXPECT_EQ(cp_traffic(c, 1, 2, 1, CpMethod::allgather).bus, 393216u);
  EXPECT_EQ(cp_traffic(c, 1, 2, 1, CpMethod::ulysses).bus, 983040u);
  // Its exercise: C = 4, 4 KV heads, H 96 NH 12 S 48 B 2 L 2: 122,880 bytes (ring).
  BlockConfig e;
  e.hidden = 96, e.heads = 12, e.kv_heads = 4, e.ffn = 192, e.seq = 48, e.batch = 2, e.layers = 2;
  EXPECT_EQ(cp_traffic(e, 1, 4, 1, CpMethod::ring).bus, 122880u);
  EXPECT_EQ(cp_traffic(e, 1, 1, 1, CpMethod::ring).bus, 0u);
  // The projection's CP bytes are traffic.h's, a micro-batch at a time.
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  const BlockConfig s = stack(8, 8);
  for (const CpMethod m : {CpMethod::ring, CpMethod::allgather, CpMethod::ulysses}) {
    pj::Layout l;
    l.dp = 2;
    l.cp = 2;
    l.tp = 4;
    l.cp_method = m;
    EXPECT_EQ(pj::project_layout(d, s, l).cp.bus, mesh_traffic(s, 2, 2, 4, m).cp.bus);
    l.pp = 2;
    l.microbatches = 4;
    BlockConfig half = s;  // each rank holds 4 layers; a micro-batch is 2 of the 8 sequences
    half.layers = 4;
    half.batch = 2;
    const pj::LayoutStep x = pj::project_layout(d, s, l);
    EXPECT_EQ(x.cp.bus, 4 * cp_traffic(half, 2, 2, 4, m).bus);
    EXPECT_EQ(x.dp.bus, fsdp_traffic(half, 4, 4).bus);  // over D·C = 4 ranks
    // PP: 2·M messages of [S/(C·T), B/(D·M), H] bf16, forward and back.
    EXPECT_EQ(x.message_bytes, std::uint64_t(8192 / 8) * 1 * 8192 * 2);
    EXPECT_EQ(x.p2p_bytes, 2 * 4 * x.message_bytes);
  }
}

TEST(Layout, TheReportsTablesHoldWholeLayoutsAndMarkTheBest) {
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  const pj::Report r = pj::make_report(d, {});
  ASSERT_EQ(r.layouts.size(), 2u);
  for (const auto& t : r.layouts) {
    EXPECT_TRUE(t.gpus == 64 || t.gpus == 512) << t.gpus;
    EXPECT_EQ(t.config.layers, 80);
    EXPECT_EQ(t.config.hidden, 8192);
    ASSERT_GE(t.rows.size(), 5u);
    for (const pj::LayoutStep& x : t.rows) {
      EXPECT_EQ(x.layout.gpus(), t.gpus);
      EXPECT_GE(x.step_ms, t.rows[t.best].step_ms);
    }
  }
  const std::string md = pj::report_markdown(r);
  EXPECT_NE(md.find("on 64 GPUs, 4-D meshes (projected, not measured)"), std::string::npos);
  EXPECT_NE(md.find("on 512 GPUs, 4-D meshes (projected, not measured)"), std::string::npos);
  EXPECT_NE(md.find("| **best** |"), std::string::npos);
  EXPECT_THROW(pj::layout_table(100), std::runtime_error);
}

// --- tpx_project's output ------------------------------------------------------------------------

TEST(TpxProject, ValidationErrorsAreWhatItPrints) {
  test::TempDir dir;
  const auto md = dir / "p.md", js = dir / "p.json";
  const auto r = test::run_command(
      fmt::format("{} --device {} --markdown {} --json {}", TPX_PROJECT_BIN,
                  (kDevices / "h100_sxm.json").string(), md.string(), js.string()),
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json j = json::parse(test::read_file(js));
  const json published = json::parse(test::read_file(kDevices / "published.json"))["results"];
  const auto cases = pj::load_published(kDevices / "published.json").results;
  const auto mine = pj::validate(cases, kDevices, pj::load_device(kDevices / "h100_sxm.json"));
  ASSERT_EQ(j.at("validation").size(), published.size());
  ASSERT_EQ(mine.size(), published.size());
  for (std::size_t i = 0; i < published.size(); ++i) {
    const json& v = j["validation"][i];
    const double pub = v.at("published").get<double>(), proj = v.at("projected").get<double>();
    EXPECT_EQ(v.at("name"), published[i].at("name"));
    EXPECT_DOUBLE_EQ(pub, published[i].at("published").get<double>());  // the source's number
    EXPECT_TRUE(std::isfinite(proj) && proj > 0) << v.at("name");
    EXPECT_NEAR(v.at("error_pct").get<double>(), (proj - pub) / pub * 100.0, 1e-9);
    EXPECT_NEAR(proj, mine[i].projected, 1e-9 * proj);  // the program prints the library's model
  }
  // The markdown says, first, that its numbers are projected, which device file, which curve.
  const std::string text = test::read_file(md);
  const std::string first = text.substr(0, text.find('\n'));
  EXPECT_NE(first.find("Projected by the model"), std::string::npos) << first;
  EXPECT_NE(first.find("h100_sxm.json"), std::string::npos) << first;
  EXPECT_NE(first.find("calibrated: measured (h100_sxm.json"), std::string::npos) << first;
  EXPECT_NE(first.find("attention: the measured 'sdpa' attention kernel"), std::string::npos)
      << first;
  // One row per stage 02 … 06 at N = 2, 4, 8, plus stage 01, per config; the bytes are the
  // stages' formula.
  ASSERT_EQ(j.at("configs").size(), 2u);
  for (const json& t : j["configs"]) {
    ASSERT_EQ(t.at("rows").size(), 16u);
    BlockConfig c;
    c.hidden = t["config"]["hidden"];
    c.heads = t["config"]["heads"];
    c.ffn = t["config"]["ffn"];
    c.seq = t["config"]["seq"];
    c.batch = t["config"]["batch"];
    c.layers = t["config"]["layers"];
    c.dtype = parse_dtype(t["config"]["dtype"].get<std::string>());  // bf16: 2-byte activations
    for (const json& row : t["rows"]) {
      const int stage = std::stoi(row.at("stage").get<std::string>().substr(0, 2));
      EXPECT_EQ(row.at("bus_bytes_per_rank").get<std::uint64_t>(),
                pj::comm_bytes(stage, c, row.at("n").get<int>()).bus);
    }
  }
}

// The held-out set, by name: removing a case from it (or moving it to calibration) fails here.
const std::vector<std::string> kHeldOut = {
    "flux_ag_gemm_torch_a800",         "flux_ag_gemm_fused_a800",
    "flux_gemm_rs_torch_a800",         "flux_gemm_rs_fused_a800",
    "flux_gemm_rs_torch_h800",         "flux_gemm_rs_fused_h800",
    "torchtitan_async_tp_fp8_rowwise", "torchtitan_8b_async_tp_bf16",
    "torchtitan_8b_async_tp_fp8",      "torchtitan_8b_async_tp_fp8_rowwise",
    "torchtitan_perf_2d_async_tp_fp8", "torchtitan_70b_bf16_tokens",
    "torchtitan_8b_bf16_tokens",       "pytorch_async_tp_e2e_70b"};

TEST(Published, HeldOutSetKeepsEveryCase) {
  const auto set = pj::load_published(kDevices / "published.json");
  std::size_t held = 0, cal = 0;
  for (const auto& p : set.results) ++(p.set == "held_out" ? held : cal);
  EXPECT_GE(held, cal) << "the held-out set must have at least as many cases as calibration";
  for (const std::string& name : kHeldOut) {
    const auto it = std::find_if(set.results.begin(), set.results.end(),
                                 [&](const pj::Published& p) { return p.name == name; });
    ASSERT_NE(it, set.results.end()) << name << " was removed from the held-out set";
    EXPECT_EQ(it->set, "held_out") << name;
  }
  for (const auto& p : set.results) {
    // The value is what the quoted source line gives (load_published checks it too).
    EXPECT_NEAR(p.value, pj::derived_value(p), 5e-4 * p.value) << p.name;
    for (const std::string& f : p.from) EXPECT_NE(p.quote.find(f), std::string::npos) << p.name;
    EXPECT_FALSE(p.source.empty() || p.where.empty() || p.measured.empty()) << p.name;
    EXPECT_EQ(p.source.rfind("https://", 0), 0u) << p.name;
  }
}

TEST(Published, ValueChangedWithoutItsSourceLineIsRefused) {
  json j = json::parse(test::read_file(kDevices / "published.json"));
  test::TempDir dir;
  const auto path = dir / "published.json";
  json changed = j;
  changed["results"][0]["published"] = changed["results"][0]["published"].get<double>() * 1.05;
  std::ofstream(path) << changed.dump();
  EXPECT_THROW(pj::load_published(path), std::runtime_error);
  // A number that is not in the quoted line is refused too.
  changed = j;
  changed["results"][0]["from"][0] = "123456.7";
  std::ofstream(path, std::ios::trunc) << changed.dump();
  EXPECT_THROW(pj::load_published(path), std::runtime_error);
  changed = j;
  changed["results"][0]["set"] = "tuned";
  std::ofstream(path, std::ios::trunc) << changed.dump();
  EXPECT_THROW(pj::load_published(path), std::runtime_error);
  std::ofstream(path, std::ios::trunc) << j.dump();
  EXPECT_NO_THROW(pj::load_published(path));
}

TEST(Published, SensitivityIsTheErrorOfAPerturbedModel) {
  const auto cases = pj::load_published(kDevices / "published.json").results;
  const pj::DeviceSpec h100 = pj::load_device(kDevices / "h100_sxm.json");
  const auto base = pj::validate(cases, kDevices, h100);
  const auto sens = pj::sensitivity(cases, kDevices, h100);
  ASSERT_FALSE(sens.empty());
  bool gemm = false;
  for (const auto& s : sens) {
    ASSERT_EQ(s.minus.size(), cases.size());
    if (s.param != "gemm_efficiency") continue;
    gemm = true;
    const auto up = pj::validate(cases, kDevices, h100,
                                 [](pj::DeviceSpec& d) { pj::perturb(d, "gemm_efficiency", 1.2); });
    for (std::size_t i = 0; i < cases.size(); ++i)
      EXPECT_NEAR(s.plus[i], up[i].error_pct - base[i].error_pct, 1e-9) << cases[i].name;
  }
  EXPECT_TRUE(gemm) << "the GEMM efficiency curve is an assumption of every device file";
  // A figure no device file marks as assumed is not perturbed (nor a measured one); efficiencies
  // stay at most 1.
  pj::DeviceSpec measured = h100;
  EXPECT_FALSE(pj::perturb(measured, "gemm_efficiency", 1.2));
  EXPECT_FALSE(pj::perturb(measured, "attention_efficiency", 1.2));
  pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json", /*measured=*/false);
  EXPECT_FALSE(pj::perturb(d, "sms", 1.2));
  EXPECT_TRUE(pj::perturb(d, "gemm_efficiency", 10.0));
  for (const auto& pt : d.gemm.points) EXPECT_LE(pt.second, 1.0);
}

TEST(Devices, TheMeasuredBlockReplacesTheAssumptions) {
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  const pj::DeviceSpec a = pj::load_device(kDevices / "h100_sxm.json", /*measured=*/false);
  // Measured: the GEMM curve and the attention kernels of the 2026-11-27 run, SDPA by default.
  EXPECT_TRUE(d.calibrated);
  EXPECT_NE(d.gemm.origin.find("commit ca299f2"), std::string::npos) << d.gemm.origin;
  EXPECT_EQ(d.attention_kernel, "sdpa");
  for (const char* k : {"fused", "naive", "sdpa"}) EXPECT_EQ(d.attention_kernels.count(k), 1u);
  for (const char* key : {"gemm_efficiency", "attention_efficiency"}) {
    EXPECT_EQ(std::count(d.assumed.begin(), d.assumed.end(), key), 0) << key;
    EXPECT_EQ(std::count(a.assumed.begin(), a.assumed.end(), key), 1) << key;
  }
  // Assumed: the file's constant and curve, as before the run.
  EXPECT_FALSE(a.calibrated);
  EXPECT_TRUE(a.attention_kernel.empty());
  EXPECT_DOUBLE_EQ(a.attention_at(2048), 0.5);
  EXPECT_NE(d.gemm.at(2e11), a.gemm.at(2e11));
  // An unknown kernel is refused with the known ones.
  pj::DeviceSpec e = d;
  try {
    pj::use_attention(e, "flash3");
    ADD_FAILURE() << "use_attention accepted flash3";
  } catch (const std::invalid_argument& x) {
    EXPECT_NE(std::string(x.what()).find("known: assumed, fused, naive, sdpa"), std::string::npos)
        << x.what();
  }
  pj::use_attention(e, "assumed");
  EXPECT_DOUBLE_EQ(e.attention_at(2048), d.attention_efficiency);
}

TEST(Devices, TheFusedKernelProjectsItsMeasuredTime) {
  // bench_attention measured tpx's fused forward + backward at S 2048 (B 1, NH 32, D 128) in
  // 15.2 ms; the model, told to use that kernel, gives stage 01's attention (forward + twice it
  // backward) the same time, within the 4 digits the device file keeps.
  pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
  pj::use_attention(d, "fused");
  const pj::Projection p = pj::project_stage(d, pj::small_config(), 1, 1);
  EXPECT_NEAR(3 * p.attention_ms, 15.2, 0.05);
  // The SDPA kernel: 0.356 ms.
  pj::use_attention(d, "sdpa");
  EXPECT_NEAR(3 * pj::project_stage(d, pj::small_config(), 1, 1).attention_ms, 0.356, 0.002);
  // The step with tpx's kernel is within 15 % of the measured 22.74 ms; the assumptions alone
  // were 4.7 times too fast (4.83 ms).
  pj::use_attention(d, "fused");
  EXPECT_NEAR(pj::project_stage(d, pj::small_config(), 1, 1).step_ms, 22.74, 0.15 * 22.74);
  const pj::DeviceSpec a = pj::load_device(kDevices / "h100_sxm.json", /*measured=*/false);
  EXPECT_NEAR(pj::project_stage(a, pj::small_config(), 1, 1).step_ms, 4.83, 0.01);
}

TEST(Published, CommittedTablesAreAFreshRun) {
  // docs/benchmarks.md carries tpx_project's markdown verbatim: its validation and sensitivity
  // tables must be what the model and the device files give now.
  test::TempDir dir;
  const auto r =
      test::run_command(fmt::format("{} --device {} --validate --sensitivity", TPX_PROJECT_BIN,
                                    (kDevices / "h100_sxm.json").string()),
                        dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_GT(r.out.size(), 1000u);
  const std::string doc =
      test::read_file(std::filesystem::path(TPX_SOURCE_DIR) / "docs/benchmarks.md");
  std::string want = r.out;
  while (!want.empty() && want.back() == '\n') want.pop_back();
  EXPECT_NE(doc.find(want), std::string::npos)
      << "docs/benchmarks.md's validation tables are not what tpx_project prints now: "
         "regenerate them (tools/bench.py --only projection --build DIR)";
}

TEST(TpxProject, MissingDeviceFileFailsWithOneLine) {
  test::TempDir dir;
  const auto r = test::run_command(
      fmt::format("{} --device {}", TPX_PROJECT_BIN, (dir / "nope.json").string()), dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(test::lines_of(r.err).size(), 1u) << r.err;
}

TEST(TpxProject, BadSizesAndInputsAreOneLineNamingTheFlagAndExit2) {
  test::TempDir dir;
  // A Google Benchmark file whose GEMM row has a TFLOP/s of another type.
  std::ofstream(dir / "rows.json") << R"({"benchmarks": [{"name": "gemm/cuda/bf16/x", )"
                                      R"("label": "m=1 n=1 k=1", "TFLOP/s": "fast"}]})";
  const std::string device = (kDevices / "h100_sxm.json").string();
  const std::string tmp = dir.path().string(), rows = (dir / "rows.json").string(),
                    nodir = (dir / "nodir").string();
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--tp 0", "--tp: must be a positive integer (got 0)"},
           {"--hidden abc", "--hidden: 'abc' is not an integer"},
           {"--hidden -3", "--hidden: must be a positive integer (got -3)"},
           {"--dp 1.5", "--dp: '1.5' is not an integer"},
           {"--calibrate /nonexistent.json", "--calibrate /nonexistent.json: no such file"},
           {"--markdown t.md --json t.md", "--json 't.md' is the same file as --markdown 't.md'"},
           // An input that is a directory, or holds a field of another type, names its flag.
           {"--calibrate " + tmp, "--calibrate " + tmp + ": is a directory, not a JSON file"},
           {"--published " + tmp, "--published " + tmp + ": is a directory, not a JSON file"},
           {"--calibrate " + rows,
            "--calibrate " + rows + ": not a bench_gemm or bench_copy_overlap JSON file"},
           {"--json " + nodir + "/p.json", "directory '" + nodir + "' does not exist"},
           // Products of the mesh's sizes are checked, not wrapped into "must be >= 1".
           {"--dp 2147483647 --cp 2 --batch 4294967294",
            "--pp 1 × --dp 2147483647 × --cp 2 × --tp 8 is more GPUs than the model counts"},
           {"--pp 65536 --dp 65536 --batch 4294967296",
            "--pp 65536 × --dp 65536 × --cp 2 × --tp 8 is more GPUs"},
           {"--batch 4294967296", "--batch 4294967296 / --dp 1 is 4294967296 micro-batches"},
           {"--layers 4294967296 --pp 2", "L = 4294967296 layers, more than an int counts"},
           // zb-h1's formula needs W <= F too: the line says so when M >= P holds.
           {"--model llama3-70b --tp 4 --batch 8 --pp 4 --schedule zb-h1 --recompute full",
            "needs M >= P (M = 8) and W no larger than F and B"}}) {
    SCOPED_TRACE(args);
    const auto r =
        test::run_command(fmt::format("{} --device {} {}", TPX_PROJECT_BIN, device, args), dir);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    const auto lines = test::lines_of(r.err);
    ASSERT_EQ(lines.size(), 1u) << r.err;
    EXPECT_NE(lines[0].find(says), std::string::npos) << lines[0];
    EXPECT_LT(lines[0].size(), 200u) << lines[0];
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

// --- tpx_project by flags: a model by name, file or sizes ----------------------------------------

json project_json(const std::string& args, test::TempDir& dir) {
  const auto path = dir / "p.json";
  const auto r =
      test::run_command(fmt::format("{} {} --json {}", TPX_PROJECT_BIN, args, path.string()), dir);
  EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.err;
  if (r.exit_code != 0) return json::object();
  return json::parse(test::read_file(path));
}

TEST(TpxProject, Llama3At8GpusGivesEveryStage) {
  test::TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  const auto r = test::run_command(
      fmt::format("{} --model llama3-8b --tp 8 --device h100_sxm", TPX_PROJECT_BIN), dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(s, 5.0);  // well under a second when the machine is not shared
  for (const char* stage : {"01_baseline", "02_megatron_tp", "03_sequence_parallel",
                            "04_overlap_ring", "05_copy_engine_async_tp", "06_fp8", "07_fsdp_tp"})
    EXPECT_NE(r.out.find("| " + std::string(stage) + " |"), std::string::npos) << stage;
  EXPECT_NE(r.out.find("H 4096 NH 32 NKV 8 F 14336 S 8192 B 2 L 32"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" GiB |"), std::string::npos) << r.out;                        // human units
  EXPECT_NE(r.out.find("| 08_context_parallel | 16 |"), std::string::npos) << r.out;  // C = 2
  const json j = project_json("--model llama3-8b --tp 8 --device h100_sxm", dir);
  ASSERT_EQ(j.at("stages").size(), 8u);
  // Each row's bytes are the stages' own formulas (those are checked against the stages' --json).
  BlockConfig c;
  c.hidden = 4096, c.heads = 32, c.kv_heads = 8, c.ffn = 14336, c.seq = 8192, c.batch = 2;
  c.layers = 32, c.dtype = DType::bf16, c.task = Task::lm, c.vocab = 128256;
  EXPECT_EQ(j["stages"][2].at("tp_bus_bytes").get<std::uint64_t>(), pj::comm_bytes(3, c, 8).bus);
  EXPECT_EQ(j["stages"][0].at("tp_bus_bytes").get<std::uint64_t>(), 0u);
}

// A mixture-of-experts model is stage 10's row alone, its bytes and memory the stage's own
// formulas (10_expert_parallel/traffic.h and memory.h, which the stage's tests check against its
// communicator and allocator), its refusals one line.
TEST(TpxProject, AMixtureOfExpertsIsStage10sRow) {
  test::TempDir dir;
  const json j =
      project_json("--model mixtral-8x7b --tp 8 --dp 4 --ep 2 --batch 8 --device h200", dir);
  ASSERT_EQ(j.at("stages").size(), 1u) << j.dump();
  const json& row = j["stages"][0];
  EXPECT_EQ(row.at("stage"), "10_expert_parallel");
  EXPECT_EQ(row.at("gpus"), 32);
  EXPECT_EQ(j.at("ep"), 2);
  BlockConfig c;
  c.hidden = 4096, c.heads = 32, c.kv_heads = 8, c.ffn = 14336, c.seq = 4096, c.batch = 8;
  c.layers = 32, c.dtype = DType::bf16, c.task = Task::lm, c.vocab = 32000;
  c.moe = {.experts = 8, .topk = 2, .expert_ffn = 14336, .aux_loss_weight = 0.01};
  const ep::ExpertTraffic t = ep::expert_traffic(c, 4, 8, 2, 0);
  EXPECT_EQ(row.at("ep_bus_bytes").get<std::uint64_t>(), t.ep.bus);
  EXPECT_EQ(row.at("tp_bus_bytes").get<std::uint64_t>(), t.tp.bus);
  EXPECT_EQ(row.at("dp_bus_bytes").get<std::uint64_t>(), t.dp.bus);
  EXPECT_GT(row.at("step_ms").get<double>(), row.at("exposed_comm_ms").get<double>());
  EXPECT_GT(row.at("exposed_comm_ms").get<double>(), 0.0);
  // The memory: the stage's estimate with the experts sharded over their D/EP = 2 holders.
  const Sharding sh{.rank = 0,
                    .world = 8,
                    .weights = true,
                    .sequence = true,
                    .dp = 4,
                    .dimensions = {fsdp::memory_dimension(false), ep::memory_dimension(2, 0)}};
  EXPECT_EQ(row.at("memory_estimate_bytes").get<std::uint64_t>(),
            estimate_training_memory(c, sh).total());
  // With --cp: the D × C × T mesh, EP borrowed from the D·C ranks, the stage's formulas there
  // (its --dry-run's, which its tests hold equal to a step's), chapter 8's CP bytes beside them.
  const json jc =
      project_json("--model mixtral-8x7b --tp 8 --dp 2 --cp 2 --ep 2 --batch 8 --device h200", dir);
  ASSERT_EQ(jc.at("stages").size(), 1u) << jc.dump();
  const json& rc = jc["stages"][0];
  EXPECT_EQ(rc.at("gpus"), 32);
  EXPECT_EQ(jc.at("cp"), 2);
  EXPECT_EQ(jc.at("cp_method"), "ring");
  const ep::ExpertTraffic tc = ep::expert_traffic(c, 2, 8, 2, 0, 2, cp::CpMethod::ring);
  EXPECT_EQ(rc.at("ep_bus_bytes").get<std::uint64_t>(), tc.ep.bus);
  EXPECT_EQ(rc.at("tp_bus_bytes").get<std::uint64_t>(), tc.tp.bus);
  EXPECT_EQ(rc.at("dp_bus_bytes").get<std::uint64_t>(), tc.dp.bus);
  EXPECT_EQ(rc.at("cp_bus_bytes").get<std::uint64_t>(), tc.cp.bus);
  EXPECT_GT(tc.cp.bus, 0u);
  EXPECT_NE(tc.dp.bus, t.dp.bus);  // FSDP and the token group over D·C = 4 ranks, not D = 4
  const Sharding shc{
      .rank = 0,
      .world = 8,
      .weights = true,
      .sequence = true,
      .dp = 2,
      .cp = 2,
      .dimensions = {fsdp::memory_dimension(false), cp::memory_dimension(cp::CpMethod::ring),
                     ep::memory_dimension(2, 0)}};
  EXPECT_EQ(rc.at("memory_estimate_bytes").get<std::uint64_t>(),
            estimate_training_memory(c, shc).total());
  EXPECT_GT(rc.at("step_ms").get<double>(), rc.at("exposed_comm_ms").get<double>());
  for (const auto& [args, says] :
       {std::pair{"--model mixtral-8x7b --dp 4 --ep 3 --batch 8", "--ep 3 must divide --dp (4)"},
        std::pair{"--model mixtral-8x7b --dp 2 --cp 2 --ep 3 --batch 8",
                  "--ep 3 must divide the D·C ranks (--dp 2 × --cp 2)"},
        std::pair{"--model mixtral-8x7b --dp 2 --cp 3 --ep 2 --batch 8",
                  "S = 4096 does not split into 48 chunks"},
        std::pair{"--model mixtral-8x7b --tp 1 --dp 1073741824 --cp 4 --ep 8 --batch 1073741824",
                  "--dp 1073741824 × --tp 1 × --cp 4 is more GPUs than the model counts"},
        std::pair{"--model llama3-8b --ep 2", "--ep is stage 10's"},
        std::pair{"--model deepseek-v3 --fp8-weight-gather", "it takes no --fp8-weight-gather"},
        std::pair{"--model deepseek-v3 --tp 128 --dp 33554432 --ep 256 --batch 33554432",
                  "is more GPUs than the model counts"},
        std::pair{"--model deepseek-v3 --tp 1 --dp 8 --batch 8 --seq 8",
                  "must be divisible by the experts E (256)"}}) {
    const auto r =
        test::run_command(fmt::format("{} {} --device h200", TPX_PROJECT_BIN, args), dir);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << "\n" << r.err;
  }
}

// A mixture of experts under --pp: stage 09's pipeline around stage 10. Pipeline rank 0's bytes
// on each group and its memory estimate are the stage's own --dry-run (whose tests hold it equal
// to a step's counts), at P 2 × D 2 × T 1 with M 2: the blocks alone under 1f1b, and the language
// model (rank 0 holds the embedding) under gpipe. The time is the dense equivalent's pipeline with
// its bubble.
TEST(TpxProject, AMixtureOfExpertsUnderAPipelineIsTheStagesDryRun) {
  test::TempDir dir;
  for (const std::string args :
       {"--model mixtral-8x7b --task block --layers 4 --batch 8 --dp 2 --pp 2 --microbatches 2",
        "--model mixtral-8x7b --task lm --layers 4 --batch 8 --dp 2 --pp 2 --microbatches 2 "
        "--vocab 4096 "
        "--schedule gpipe"}) {
    SCOPED_TRACE(args);
    const json j = project_json(args + " --tp 1 --ep 2 --dtype fp32 --device h200", dir);
    ASSERT_EQ(j.at("stages").size(), 1u) << j.dump();
    const json& row = j["stages"][0];
    EXPECT_EQ(j.at("pp"), 2);
    EXPECT_EQ(row.at("gpus"), 4);
    const json stage = test::run_json("10_expert_parallel", 4, args + " --dry-run");
    ASSERT_TRUE(stage.contains("step")) << stage.dump();
    const json& step = stage["step"];
    auto at = [](const json& x, const char* key) { return x.at(key).get<std::uint64_t>(); };
    EXPECT_EQ(at(row, "ep_bus_bytes"), at(step, "ep_bus_bytes"));
    EXPECT_EQ(at(row, "ep_payload_bytes"), at(step, "ep_payload_bytes"));
    EXPECT_EQ(at(row, "dp_bus_bytes"), at(step, "dp_bus_bytes"));
    EXPECT_EQ(at(row, "dp_payload_bytes"), at(step, "dp_payload_bytes"));
    EXPECT_EQ(at(row, "pp_p2p_bytes"), at(step, "pp_bus_bytes"));
    EXPECT_EQ(at(row, "tp_payload_bytes"),
              at(step, "comm_payload_bytes") - at(step, "dp_payload_bytes") -
                  at(step, "ep_payload_bytes") - at(step, "pp_payload_bytes") -
                  at(step, "cp_payload_bytes"));
    EXPECT_GT(at(row, "ep_bus_bytes"), 0u);
    EXPECT_EQ(at(row, "memory_estimate_bytes"), at(stage, "memory_estimate_bytes"));
    EXPECT_EQ(at(row, "saved_activation_bytes"), at(stage, "saved_activation_bytes"));
    EXPECT_GT(row.at("bubble_ms").get<double>(), 0.0);
    EXPECT_GT(row.at("step_ms").get<double>(),
              row.at("exposed_comm_ms").get<double>() + row.at("bubble_ms").get<double>());
  }
  // What the pipeline cannot cut is refused in one line, before any bytes are counted.
  for (const auto& [args, says] :
       {std::pair{"--model mixtral-8x7b --dp 2 --pp 2 --ep 3 --batch 8",
                  "--ep 3 must divide the D·C ranks"},
        std::pair{"--model mixtral-8x7b --dp 2 --pp 3 --layers 2 --batch 8 --ep 2",
                  "pipeline stages"},
        std::pair{"--model deepseek-v3 --tp 1 --dp 8 --pp 2 --batch 8 --seq 8 --ep 8",
                  "must be divisible by the experts E (256)"}}) {
    const auto r =
        test::run_command(fmt::format("{} {} --device h200", TPX_PROJECT_BIN, args), dir);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << "\n" << r.err;
  }
}

TEST(TpxProject, Bf16HalvesTheActivationBytes) {
  test::TempDir dir;
  const std::string base = "--model llama3-8b --task block --tp 8 --device h100_sxm --dtype ";
  const json f = project_json(base + "fp32", dir), b = project_json(base + "bf16", dir);
  ASSERT_TRUE(f.contains("stages") && b.contains("stages"));
  // Stage 02 moves only activations: exactly half. The saved activations: half but for
  // attention's fp32 log-sum-exp ([B, NH, S] per layer, a sliver).
  EXPECT_EQ(2 * b["stages"][1].at("tp_bus_bytes").get<std::uint64_t>(),
            f["stages"][1].at("tp_bus_bytes").get<std::uint64_t>());
  for (std::size_t i : {0u, 1u, 2u, 4u}) {
    const double ratio = b["stages"][i].at("saved_activation_bytes").get<double>() /
                         f["stages"][i].at("saved_activation_bytes").get<double>();
    EXPECT_GT(ratio, 0.5) << i;
    EXPECT_LT(ratio, 0.51) << i;
  }
}

TEST(TpxProject, FlagsOverTheModelAndBadInputExits2) {
  test::TempDir dir;
  const json j = project_json(
      "--model llama3-70b --layers 1 --tp 4 --dp 2 --batch 2 --device "
      "h100_sxm",
      dir);
  ASSERT_TRUE(j.contains("config"));
  EXPECT_EQ(j["config"].at("hidden"), 8192);
  EXPECT_EQ(j["config"].at("layers"), 1);
  EXPECT_EQ(j["stages"][6].at("gpus"), 8);
  EXPECT_GT(j["stages"][6].at("dp_bus_bytes").get<std::uint64_t>(), 0u);
  for (const std::string& args :
       {std::string("--device h100"), std::string("--device h100_sxm --model llama3-9b"),
        std::string("--device h100_sxm --hidden 4096 --tp 3"),
        std::string("--device h100_sxm --hidden x"), std::string("--device h100_sxm --layer 3")}) {
    const auto r = test::run_command(fmt::format("{} {}", TPX_PROJECT_BIN, args), dir);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_EQ(test::lines_of(r.err).size(), 1u) << args << "\n" << r.err;
  }
  const auto r = test::run_command(fmt::format("{} --device h100", TPX_PROJECT_BIN), dir);
  EXPECT_NE(r.err.find("h100_sxm"), std::string::npos) << r.err;  // the known devices listed
}

TEST(TpxProject, PipelineAndCpFlags) {
  test::TempDir dir;
  const std::string base = "--device h100_sxm --model llama3-70b --tp 8 --dp 2 --batch 16 ";
  const json j = project_json(base + "--cp 2 --cp-method allgather --pp 4", dir);
  ASSERT_EQ(j.at("stages").size(), 9u);
  const json& cp = j["stages"][7];
  const json& pp = j["stages"][8];
  EXPECT_EQ(cp.at("stage"), "08_context_parallel");
  EXPECT_EQ(cp.at("gpus"), 32);
  EXPECT_EQ(pp.at("stage"), "09_pipeline_parallel");
  EXPECT_EQ(pp.at("gpus"), 128);
  EXPECT_EQ(j.at("microbatches"), 8);  // B / D: one sequence each
  BlockConfig c = pj::layout_model("llama3-70b", 32);
  c.batch = 16;
  c.optimizer = Optimizer::sgd;  // tpx_project's default
  EXPECT_EQ(cp.at("cp_bus_bytes").get<std::uint64_t>(),
            cp_traffic(c, 2, 2, 8, CpMethod::allgather).bus);
  EXPECT_EQ(cp.at("bubble_ms").get<double>(), 0.0);
  EXPECT_GT(pp.at("bubble_ms").get<double>(), 0.0);
  EXPECT_GT(pp.at("pp_p2p_bytes").get<std::uint64_t>(), 0u);
  // More micro-batches: a smaller bubble.
  const json k = project_json(base + "--pp 4 --microbatches 4", dir);
  ASSERT_EQ(k.at("stages").size(), 9u);
  EXPECT_LT(
      pp.at("bubble_ms").get<double>() / pp.at("step_ms").get<double>(),
      k["stages"][8].at("bubble_ms").get<double>() / k["stages"][8].at("step_ms").get<double>());
  // A sequence stage 08's default C = 2 cannot split (2·C·T = 16 ∤ 40): the other stages'
  // rows, stage 08 left out with the reason; asked for with --cp, it is an error.
  const std::string odd = "--device h100_sxm --hidden 512 --heads 4 --ffn 1024 --seq 40 --tp 4";
  const auto left = test::run_command(fmt::format("{} {}", TPX_PROJECT_BIN, odd), dir);
  ASSERT_EQ(left.exit_code, 0) << left.err;
  EXPECT_NE(left.out.find("| 07_fsdp_tp |"), std::string::npos) << left.out;
  EXPECT_EQ(left.out.find("| 08_context_parallel |"), std::string::npos) << left.out;
  EXPECT_NE(left.out.find("08_context_parallel is left out at its default --cp 2: "),
            std::string::npos)
      << left.out;
  EXPECT_EQ(test::run_command(fmt::format("{} {} --cp 2", TPX_PROJECT_BIN, odd), dir).exit_code, 2);
  for (const std::string& args :
       {std::string("--schedule zigzag"), std::string("--cp 3"), std::string("--pp 0"),
        std::string("--cp-method ring2"), std::string("--pp 4 --microbatches 3"),
        std::string("--pp 8 --microbatches 2 --schedule zb-h1"),
        std::string("--pp 4 --microbatches 2 --schedule interleaved-1f1b --stages-per-rank 2"),
        std::string("--pp 100")}) {
    const auto r = test::run_command(fmt::format("{} {} {}", TPX_PROJECT_BIN, base, args), dir);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_EQ(test::lines_of(r.err).size(), 1u) << args << "\n" << r.err;
  }
}

// --- the language model's ends: embedding, output layer, cross-entropy ---------------------------

/// The preset's config as tpx_project runs it (bf16, SGD), the language model at V.
BlockConfig lm_config(const std::string& preset, std::int64_t vocab) {
  BlockConfig c;
  apply_preset(*find_preset(preset), {}, c);
  c.dtype = DType::bf16;
  c.task = vocab > 0 ? Task::lm : Task::block;
  c.vocab = vocab;
  return c;
}

std::uint64_t u64(const json& row, const char* key) {
  return row.at(key).get<std::uint64_t>();
}

TEST(TpxProject, PresetsCarryTheirVocabulary) {
  test::TempDir dir;
  EXPECT_EQ(find_preset("llama3-8b")->vocab, 128256);
  EXPECT_EQ(find_preset("llama3-405b")->vocab, 128256);
  // The tutorial's V is the build's default token file's (kjv-4096).
  EXPECT_EQ(find_preset("tutorial")->vocab, 4096);
  const json j = project_json("--model llama3-70b --layers 1 --device h100_sxm", dir);
  EXPECT_EQ(j["config"].at("vocab"), 128256);
  EXPECT_EQ(j["config"].at("task"), "lm");
  const json t = project_json("--tp 2 --device h100_sxm", dir);  // the tutorial's sizes
  EXPECT_EQ(t["config"].at("vocab"), 4096);
  const json b = project_json("--tp 2 --task block --device h100_sxm", dir);
  EXPECT_EQ(b["config"].at("task"), "block");
  EXPECT_EQ(b["config"].at("vocab"), 0);
  // From a --config file too; the command line wins over it.
  std::ofstream(dir / "m.toml") << "model = \"llama3-8b\"\nvocab = 32000\n";
  const std::string cfg = "--config " + (dir / "m.toml").string() + " --device h100_sxm";
  EXPECT_EQ(project_json(cfg, dir)["config"].at("vocab"), 32000);
  EXPECT_EQ(project_json(cfg + " --vocab 0", dir)["config"].at("task"), "block");
}

// --fp8-weight-gather: stage 07's row runs as under --dtype fp8 --fp8-weight-gather, stage 06 in
// each TP group with the gathered E4M3 weights taken as they are, FSDP's gathers of E4M3 codes;
// its bytes are the stages' formulas (tested against the stages' counts in test_fp8_recipes), its
// memory the estimate with the weights gathered at a byte an element (test_memory), and every
// other row is unchanged.
TEST(TpxProject, Fp8WeightGatherRunsStage07InFp8) {
  test::TempDir dir;
  const std::string base = "--model llama3-8b --layers 4 --tp 8 --dp 2 --cp 1 --device h100_sxm ";
  const json plain = project_json(base, dir), g = project_json(base + "--fp8-weight-gather", dir);
  ASSERT_EQ(g.at("stages").size(), plain.at("stages").size());
  EXPECT_EQ(plain.at("fp8_weight_gather"), false);
  EXPECT_EQ(g.at("fp8_weight_gather"), true);
  for (std::size_t i = 0; i < g.at("stages").size(); ++i) {
    if (i == 6) continue;
    for (const char* key : {"tp_bus_bytes", "dp_bus_bytes", "memory_estimate_bytes"})
      EXPECT_EQ(u64(g["stages"][i], key), u64(plain["stages"][i], key)) << i << " " << key;
  }
  BlockConfig c = lm_config("llama3-8b", 128256);
  c.layers = 4;
  c.dtype = DType::e4m3;
  BlockConfig replica = c;
  replica.batch /= 2;
  const json& s07 = g["stages"][6];
  EXPECT_EQ(u64(s07, "dp_bus_bytes"),
            fsdp::fsdp_traffic(c, 8, 2, 1, true).bus + lm_grads_traffic(c, 8, 2, true, true).bus);
  EXPECT_EQ(u64(s07, "tp_bus_bytes"),
            async_fp8::recipe_traffic(replica, 8, 2, lowp::Recipe::tensorwise,
                                      async_fp8::Fp8Weights::gathered)
                .bus);
  // E4M3 codes against bf16 compute copies: FSDP's gathers move half the bytes.
  EXPECT_LT(u64(s07, "dp_bus_bytes"), u64(plain["stages"][6], "dp_bus_bytes"));
  EXPECT_LT(u64(s07, "memory_estimate_bytes"), u64(plain["stages"][6], "memory_estimate_bytes"));
}

TEST(TpxProject, TheEndsAddExactlyTheirFormulas) {
  test::TempDir dir;
  const std::int64_t V = 128256;
  const std::string base = "--model llama3-8b --layers 4 --tp 8 --dp 2 --cp 1 --device h100_sxm ";
  const json lm = project_json(base, dir), block = project_json(base + "--vocab 0", dir);
  ASSERT_EQ(lm.at("stages").size(), 8u);
  ASSERT_EQ(block.at("stages").size(), 8u);
  BlockConfig c = lm_config("llama3-8b", V), b = lm_config("llama3-8b", 0);
  c.layers = b.layers = 4;
  // The output layer: 2·S·B·H·V forward, twice that backward, over the row's GPUs.
  const double head_flops = 3 * 2.0 * double(c.tokens()) * double(c.hidden) * double(V);
  const TpLayout layouts[] = {TpLayout::all_reduce, TpLayout::all_reduce, TpLayout::sequence,
                              TpLayout::ring,       TpLayout::ring,       TpLayout::ring};
  for (std::size_t i = 0; i < 8; ++i) {
    SCOPED_TRACE(i);
    const json &x = lm["stages"][i], &y = block["stages"][i];
    const int gpus = x.at("gpus").get<int>();
    EXPECT_NEAR(x.at("flops_per_gpu").get<double>() - y.at("flops_per_gpu").get<double>(),
                head_flops / gpus, 1e-9 * head_flops);
    EXPECT_GT(x.at("step_ms").get<double>(), y.at("step_ms").get<double>());
    EXPECT_GT(u64(x, "memory_estimate_bytes"), u64(y, "memory_estimate_bytes"));
    EXPECT_EQ(u64(y, "logits_bytes"), 0u);
    if (i >= 1 && i <= 5) {  // 02 … 06 on T = 8: the embedding's and the head's collectives
      EXPECT_EQ(u64(x, "tp_bus_bytes") - u64(y, "tp_bus_bytes"),
                lm_traffic(c, 8, 2, layouts[i]).bus);
      EXPECT_EQ(u64(x, "dp_bus_bytes"), u64(y, "dp_bus_bytes"));
    }
  }
  // Stage 07 (T 8 × D 2): a replica's ends on the ring, gathered and reduce-scattered over D.
  BlockConfig replica = c;
  replica.batch /= 2;
  EXPECT_EQ(u64(lm["stages"][6], "tp_bus_bytes") - u64(block["stages"][6], "tp_bus_bytes"),
            lm_traffic(replica, 8, 2, TpLayout::ring).bus);
  EXPECT_EQ(u64(lm["stages"][6], "dp_bus_bytes") - u64(block["stages"][6], "dp_bus_bytes"),
            lm_grads_traffic(c, 8, 2, true, true).bus);
  // Stage 02's memory: the estimate's language-model terms in place of the target's.
  const Sharding sh{.rank = 0, .world = 8, .weights = true};
  const MemoryEstimate el = estimate_training_memory(c, sh), eb = estimate_training_memory(b, sh);
  std::uint64_t ends = 0;
  for (const char* t : {kLmEmbeddingTerm, kLmOutputTerm, kLmLogitsTerm, kLmTokensTerm})
    ends += el.term(t).bytes;
  EXPECT_EQ(u64(lm["stages"][1], "memory_estimate_bytes") + eb.term("target").bytes +
                eb.term("fp32 input").bytes,
            u64(block["stages"][1], "memory_estimate_bytes") + ends);
}

TEST(TpxProject, ThePipelinesEndsLandOnItsFirstAndLastRanks) {
  test::TempDir dir;
  const std::string base =
      "--model llama3-8b --layers 4 --tp 8 --dp 1 --cp 1 --pp 2 --batch 4 --device h100_sxm ";
  const json lm = project_json(base, dir), block = project_json(base + "--task block", dir);
  ASSERT_EQ(lm.at("stages").size(), 9u);
  const json &x = lm["stages"][8], &y = block["stages"][8];
  // Two layers a rank: the last, with the output layer, is the slowest and sets the pace; its
  // TP bytes gain the head's per micro-batch (M = 4 of one sequence), its DP none (D = 1).
  BlockConfig local = lm_config("llama3-8b", 128256);
  local.batch = 1;
  EXPECT_EQ(u64(x, "tp_bus_bytes") - u64(y, "tp_bus_bytes"),
            4 * lm_head_traffic(local, 8, 2, TpLayout::ring).bus);
  EXPECT_GT(x.at("step_ms").get<double>(), y.at("step_ms").get<double>());
  EXPECT_GT(u64(x, "logits_bytes"), 0u);
  // The whole model's FLOPs per GPU, the output layer's included.
  EXPECT_NEAR(x.at("flops_per_gpu").get<double>() - y.at("flops_per_gpu").get<double>(),
              3 * 2.0 * 8192 * 4 * 4096 * 128256 / 16, 1e-9 * x.at("flops_per_gpu").get<double>());
}

TEST(TpxProject, TheLogitsPerRankFallAsOneOverT) {
  test::TempDir dir;
  const std::int64_t V = 131072;  // divides by every T here: no padding
  std::uint64_t logits[4] = {};
  const int tps[4] = {1, 2, 4, 8};
  for (int k = 0; k < 4; ++k) {
    const json j = project_json(
        fmt::format("--model llama3-8b --layers 1 --vocab {} --tp {} --device h100_sxm", V, tps[k]),
        dir);
    logits[k] = u64(j["stages"][tps[k] == 1 ? 0 : 1], "logits_bytes");  // 01 at T 1, else 02
  }
  // z and dz [S, B, V/T] in bf16: the part that scales; the rest (the loss's vectors, the head's
  // [S, B, H] input) does not depend on T.
  const std::uint64_t positions = 8192 * 2;
  for (int k = 1; k < 4; ++k)
    EXPECT_EQ(logits[k - 1] - logits[k],
              positions * 2 * 2 * (std::uint64_t(V) / tps[k - 1] - std::uint64_t(V) / tps[k]))
        << tps[k];
  // A V the mesh does not divide is padded to a multiple of T, as the stages pad it.
  const std::string at8 = "--model llama3-8b --layers 1 --tp 8 --device h100_sxm --vocab ";
  EXPECT_EQ(u64(project_json(at8 + "128250", dir)["stages"][1], "logits_bytes"),
            u64(project_json(at8 + "128256", dir)["stages"][1], "logits_bytes"));
}

TEST(TpxProject, BadVocabIsOneLineAndExit2) {
  test::TempDir dir;
  for (const auto& [args, says] : std::vector<std::pair<std::string, std::string>>{
           {"--vocab -1", "--vocab: must be 0 or more (got -1)"},
           {"--vocab 12x", "--vocab: '12x' is not an integer"},
           {"--task words", "--task: words not in {lm,block}"}}) {
    SCOPED_TRACE(args);
    const auto r = test::run_command(
        fmt::format("{} --device h100_sxm --model llama3-8b {}", TPX_PROJECT_BIN, args), dir);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    const auto lines = test::lines_of(r.err);
    ASSERT_EQ(lines.size(), 1u) << r.err;
    EXPECT_NE(lines[0].find(says), std::string::npos) << lines[0];
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

}  // namespace
}  // namespace tpx
