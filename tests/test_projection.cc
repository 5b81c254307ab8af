// The benchmark's bandwidth convention and the projection model (tools/projection.h):
//   - algbw / busbw (bench/busbw.h) on fixed inputs against nccl-tests' formulas worked by hand;
//   - the model's bytes per rank and step equal what every stage's --json reports on the cpu
//     (stages 01 … 06, N = 1, 2, 4; stage 01 runs on one rank only), and the chapters' worked
//     numbers at the default config;
//   - the efficiency curve, calibration from a bench_gemm file, and one AG+GEMM worked by hand;
//   - tpx_project's output: its validation errors are (projected − published) / published of the
//     numbers it prints, its projections are the library's, and its markdown says it is projected.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "bench/busbw.h"
#include "common/flops.h"
#include "test_util.h"
#include "tools/projection.h"

namespace tpx {
namespace {

using nlohmann::json;
namespace pj = projection;
using bench::Collective;

const std::filesystem::path kDevices = std::filesystem::path(TPX_SOURCE_DIR) / "tools/devices";

// --- busbw.h
// ---------------------------------------------------------------------------------------

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
        "--layers {} --kv-heads {} --recompute {} --steps 1 --json {}",
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
  const pj::DeviceSpec d = pj::load_device(kDevices / "h100_sxm.json");
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
  const auto cases = pj::load_published(kDevices / "published.json");
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
  EXPECT_NE(first.find("not calibrated"), std::string::npos) << first;
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

TEST(TpxProject, MissingDeviceFileFailsWithOneLine) {
  test::TempDir dir;
  const auto r = test::run_command(
      fmt::format("{} --device {}", TPX_PROJECT_BIN, (dir / "nope.json").string()), dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(test::lines_of(r.err).size(), 1u) << r.err;
}

}  // namespace
}  // namespace tpx
