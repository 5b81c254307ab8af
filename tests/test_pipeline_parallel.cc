// Stage 09 (pipeline parallelism) as a user runs it, under mpirun:
//  - --check passes, the dumps equal stage 01's to 1e-5 and the losses of 3 updates to 1e-6,
//    with every schedule at P = 2 alone, P = 2 × T = 2, P = 2 × D = 2, P = 3 over L = 4 layers
//    (uneven) with M = 2 and 3, and interleaved at P = 2 × V = 2, under SGD and AdamW, with GQA,
//    and with --first-stage-layers / --last-stage-layers (P = 2, 3, interleaved, P = 2 × D = 2);
//  - the language model (--task lm) with P = 2 × D = 2, P = 1 × D = 2 and interleaved: --check,
//    dumps and losses as above, its ends sharded over DP like the layers, their bytes on the
//    rank that holds them M gathers (one a micro-batch) and one reduce-scatter of their shards;
//  - the last rank's estimate falls by one block's terms per block --last-stage-layers moves;
//  - zb-h1's gradients equal 1f1b's (the split backward computes the same sums);
//  - --recompute full (every layer, and every second one) and selective give gradients bit for
//    bit those of --recompute none, at P = 2 and 3 with every schedule;
//  - the live counts in --json equal the schedule list's, on every rank;
//  - the PP bytes of a step equal the formula (each message [S/(C·T), B/(D·M), H]), and
//    --dry-run's bytes and memory estimate equal a real run's;
//  - --json's FLOPs per rank equal chapter 9's formula (a pipeline stage's L/P layers, each
//    stage 08's FLOPs), and are the mean over the ranks when P does not divide L;
//  - GPipe's peak memory grows with M at a fixed micro-batch size while 1F1B's does not (the
//    estimate and the measured peak, each within 10 % of the other);
//  - the trace names each F, B and W by micro-batch and carries the messages on a pp-comm lane;
//  - --print-schedule prints the lists and trains nothing;
//  - bad input is one line and exit 2 on every rank.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "09_pipeline_parallel/schedule.h"
#include "common/config.h"
#include "common/traffic.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using json = nlohmann::json;
using test::expect_dumps_close;
using test::run_json;
using test::run_stage;
using test::Sizes;

/// Four layers (so that P = 3 splits them 2, 1, 1 and P·V = 4 one each), B = 4.
Sizes pipeline_sizes() {
  Sizes z;
  z.L = 4;
  z.B = 4;
  return z;
}

struct Case {
  int ranks;
  std::string mesh, schedule, extra;  // mesh: --pp/--dp/--cp/--stages-per-rank/--microbatches
  std::int64_t layers = 0;            // --layers for both stages when not pipeline_sizes()'s
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "np " << c.ranks << " " << c.mesh << " " << c.schedule << " " << c.extra;
}

std::vector<double> losses(const json& j) {
  std::vector<double> v;
  for (const json& row : j.at("steps")) v.push_back(row.at("loss").get<double>());
  return v;
}

class PpMesh : public testing::TestWithParam<Case> {};

TEST_P(PpMesh, ChecksAndDumpsEqualStage01) {
  const Case& c = GetParam();
  Sizes z = pipeline_sizes();
  if (c.mesh.find("--microbatches 3") != std::string::npos) z.B = 6;
  if (c.layers != 0) z.L = c.layers;
  test::TempDir dir;
  const std::string common = fmt::format("{} {} --steps 4", z.args(), c.extra);
  const auto ref = test::stage01_reference(common);
  ASSERT_FALSE(ref.empty());
  const auto r =
      run_stage("09_pipeline_parallel", c.ranks,
                fmt::format("{} {} --schedule {} --check --dump {} --json {}", common, c.mesh,
                            c.schedule, (dir / "09").string(), (dir / "09.json").string()),
                dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  expect_dumps_close(ref / "dump", dir / "09", 1e-5, r.out.substr(0, 600));
  const std::vector<double> want = losses(json::parse(test::read_file(ref / "run.json")));
  const std::vector<double> got = losses(json::parse(test::read_file(dir / "09.json")));
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t s = 0; s < want.size(); ++s)
    EXPECT_LE(std::abs(got[s] - want[s]), 1e-6 * std::abs(want[s])) << "loss of step " << s;
}

const std::string kAdamW = "--optimizer adamw --lr 1e-3";
const std::string kGqaAdamW = "--kv-heads 4 --rope-theta 10000 --optimizer adamw --lr 1e-3";

INSTANTIATE_TEST_SUITE_P(
    Meshes, PpMesh,
    testing::Values(
        // P = 2 alone, M = 4
        Case{2, "--pp 2 --microbatches 4", "gpipe", ""},
        Case{2, "--pp 2 --microbatches 4", "1f1b", ""},
        Case{2, "--pp 2 --microbatches 4", "zb-h1", kAdamW},
        // P = 2 × V = 2: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
        Case{2, "--pp 2 --stages-per-rank 2 --microbatches 2", "interleaved-1f1b", ""},
        Case{2, "--pp 2 --stages-per-rank 2 --microbatches 4", "interleaved-1f1b", kAdamW},
        // P = 2 × T = 2
        Case{4, "--pp 2 --microbatches 2", "gpipe", kGqaAdamW},
        Case{4, "--pp 2 --microbatches 2", "1f1b", kGqaAdamW},
        Case{4, "--pp 2 --microbatches 4", "zb-h1", ""},
        // P = 2 × D = 2: each replica's B/D = 2 sequences in M = 2 micro-batches
        Case{4, "--pp 2 --dp 2 --microbatches 2", "gpipe", ""},
        Case{4, "--pp 2 --dp 2 --microbatches 2", "1f1b", kAdamW},
        Case{4, "--pp 2 --dp 2 --microbatches 2", "zb-h1", kAdamW},
        // P = 3 over L = 4 (layers 2, 1, 1), M = 2 and M = 3 (B = 6)
        Case{3, "--pp 3 --microbatches 2", "gpipe", ""},
        Case{3, "--pp 3 --microbatches 2", "1f1b", kAdamW},
        Case{3, "--pp 3 --microbatches 2", "zb-h1", ""},
        Case{3, "--pp 3 --microbatches 3", "1f1b", ""},
        Case{3, "--pp 3 --microbatches 3", "zb-h1", kAdamW},
        // Uneven ends: P = 2 over L = 4 as 1, 3; P = 3 over L = 5 as 1, 3, 1; interleaved
        // P = 2 × V = 2 over L = 5 as 2, 1, 1, 1; P = 2 × D = 2 over L = 4 as 3, 1
        Case{2, "--pp 2 --microbatches 2 --first-stage-layers 1", "1f1b", ""},
        Case{3, "--pp 3 --microbatches 2 --first-stage-layers 1 --last-stage-layers 1", "gpipe", "",
             5},
        Case{3, "--pp 3 --microbatches 2 --first-stage-layers 1 --last-stage-layers 1", "1f1b",
             kAdamW, 5},
        Case{3, "--pp 3 --microbatches 2 --first-stage-layers 1 --last-stage-layers 1", "zb-h1", "",
             5},
        Case{2, "--pp 2 --stages-per-rank 2 --microbatches 2 --first-stage-layers 2",
             "interleaved-1f1b", "", 5},
        Case{4, "--pp 2 --dp 2 --microbatches 2 --last-stage-layers 1", "1f1b", ""}),
    [](const auto& p) {
      std::string name = fmt::format("np{}_{}_{}", p.param.ranks, p.param.schedule, p.index);
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

TEST(PipelineParallel, ZeroBubbleGivesOneFOneBsGradients) {
  const Sizes z = pipeline_sizes();
  test::TempDir dir;
  for (const char* schedule : {"1f1b", "zb-h1"}) {
    const auto r =
        run_stage("09_pipeline_parallel", 2,
                  fmt::format("{} --pp 2 --microbatches 4 --steps 1 --schedule {} --dump {}",
                              z.args(), schedule, (dir / schedule).string()),
                  dir);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  expect_dumps_close(dir / "1f1b", dir / "zb-h1", 1e-6, "zb-h1 against 1f1b");
}

TEST(PipelineParallel, RecomputeGivesGradientsBitIdenticalToNone) {
  // A recomputed block's forward is the same arithmetic again, and a selective refill remakes
  // the cheap ops' outputs exactly: every dumped tensor (the weights' and the input's gradients,
  // the output, the loss) equal bit for bit, whichever schedule orders the passes. Every schedule
  // at P 2; at P 3, where a middle stage holds neither end, one plain and one interleaved.
  struct Pipe {
    int pp;
    std::string args;
  };
  test::TempDir dir;
  for (const Pipe& p :
       {Pipe{2, "--layers 4 --schedule gpipe"}, Pipe{2, "--layers 4 --schedule 1f1b"},
        Pipe{2, "--layers 4 --schedule zb-h1"},
        Pipe{2, "--layers 4 --schedule interleaved-1f1b --stages-per-rank 2"},
        Pipe{3, "--layers 4 --schedule 1f1b"},
        Pipe{3, "--layers 6 --schedule interleaved-1f1b --stages-per-rank 2"}}) {
    const std::string base = fmt::format(
        "--hidden 32 --heads 4 --kv-heads 2 --seq 8 --ffn 64 --batch {} --steps 1 "
        "--pp {} --microbatches {} {}",
        2 * p.pp, p.pp, p.pp, p.args);
    std::string mode_names[] = {"none", "full", "every2", "selective"};
    std::string modes[] = {"--recompute none", "--recompute full",
                           "--recompute full --recompute-every 2", "--recompute selective"};
    for (int i = 0; i < 4; ++i) {
      const auto r = run_stage(
          "09_pipeline_parallel", p.pp,
          fmt::format("{} {} --dump {}", base, modes[i], (dir / mode_names[i]).string()), dir);
      ASSERT_EQ(r.exit_code, 0) << base << " " << modes[i] << "\n" << r.out << r.err;
    }
    for (int i = 1; i < 4; ++i)
      expect_dumps_close(dir / "none", dir / mode_names[i], 0.0, base + " " + modes[i]);
    for (const std::string& name : mode_names) std::filesystem::remove_all(dir / name);
  }
}

/// The schedule the stage runs, rebuilt from the library for the test's expectations.
std::unique_ptr<pipeline::Schedule> schedule_of(const json& j) {
  const json& p = j.at("pipeline");
  return pipeline::make_schedule(p.at("schedule").get<std::string>(),
                                 {.ranks = p.at("pp").get<int>(),
                                  .microbatches = p.at("microbatches").get<int>(),
                                  .stages_per_rank = p.at("stages_per_rank").get<int>()});
}

TEST(PipelineParallel, LiveCountsEqualTheSchedulesLists) {
  const Sizes z = pipeline_sizes();
  struct Run {
    int n;
    std::string args;
  };
  for (const Run& run : {Run{2, "--pp 2 --microbatches 4 --schedule gpipe"},
                         Run{2, "--pp 2 --microbatches 4 --schedule 1f1b"},
                         Run{2, "--pp 2 --microbatches 4 --schedule zb-h1"},
                         Run{2,
                             "--pp 2 --stages-per-rank 2 --microbatches 4 --schedule "
                             "interleaved-1f1b"},
                         Run{3, "--pp 3 --microbatches 4 --schedule 1f1b"}}) {
    const json j = run_json("09_pipeline_parallel", run.n, z.args() + " --steps 2 " + run.args);
    ASSERT_TRUE(j.contains("pipeline")) << run.args;
    const auto schedule = schedule_of(j);
    // Counted per virtual stage, as the list counts them: each action covers 1/V of the layers.
    const std::vector<int> want = pipeline::peak_live(*schedule);
    const auto got = j.at("pipeline").at("live_peak").get<std::vector<int>>();
    EXPECT_EQ(got, want) << run.args;
    if (schedule->name() == "1f1b") {
      for (int p = 0; p < schedule->shape().ranks; ++p) {
        EXPECT_LE(got[std::size_t(p)], schedule->shape().ranks - p) << "1F1B above P − p";
      }
    }
    if (schedule->name() == "gpipe") {
      for (const int live : got) {
        EXPECT_EQ(live, schedule->shape().microbatches);
      }
    }
  }
}

// The language model with data parallelism: its ends, on the pipeline's first and last stages,
// sharded over DP as the layers are (V = 101: 51 + 50 embedding rows at D = 2).
const std::string kLm = "--task lm --data synthetic --vocab 101";

INSTANTIATE_TEST_SUITE_P(
    LmEnds, PpMesh,
    testing::Values(Case{4, "--pp 2 --dp 2 --microbatches 2", "1f1b", kLm + " " + kAdamW},
                    Case{4, "--pp 2 --dp 2 --microbatches 2", "zb-h1", kLm},
                    Case{4, "--pp 2 --dp 2 --stages-per-rank 2 --microbatches 2",
                         "interleaved-1f1b", kLm},
                    Case{2, "--pp 1 --dp 2 --microbatches 2", "gpipe", kLm + " " + kAdamW}),
    [](const auto& p) {
      std::string name = fmt::format("np{}_{}_{}", p.param.ranks, p.param.schedule, p.index);
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

TEST(PipelineParallel, LmEndsAreShardedOverDpLikeTheLayers) {
  // --task lm minus --task block on rank 0 (the first stage's: the embedding; at P = 1 the head
  // too): each end it holds gathered once a micro-batch and reduce-scattered once a step, by
  // hand and by lm_grads_traffic() (what --dry-run reports).
  const Sizes z = pipeline_sizes();
  struct Run {
    int n, p, m;
    bool bf16;
  };
  for (const Run& run :
       {Run{4, 2, 1, false}, Run{4, 2, 2, false}, Run{2, 1, 2, false}, Run{2, 1, 2, true}}) {
    const std::string args =
        fmt::format("{} --steps 1 --pp {} --dp 2 --microbatches {} --schedule 1f1b{}", z.args(),
                    run.p, run.m, run.bf16 ? " --dtype bf16" : "");
    const json lm = run_json("09_pipeline_parallel", run.n, args + " " + kLm);
    const json block = run_json("09_pipeline_parallel", run.n, args + " --task block");
    ASSERT_TRUE(lm.contains("steps") && block.contains("steps"));
    const json &a = lm["steps"][0], &b = block["steps"][0];
    auto diff = [&](const char* key) {
      return a.at(key).get<std::uint64_t>() - b.at(key).get<std::uint64_t>();
    };
    const int t = run.n / (run.p * 2);
    const bool head = run.p == 1;
    const std::string where = fmt::format("P {} D 2 M {}{}", run.p, run.m, run.bf16 ? " bf16" : "");
    const auto [payload, bus] = test::lm_ends_dp_bytes(z.H, 101, t, 2, run.m, run.bf16, true, head);
    EXPECT_EQ(diff("dp_payload_bytes"), payload) << where;
    EXPECT_EQ(diff("dp_bus_bytes"), bus) << where;
    BlockConfig c;
    c.hidden = z.H, c.heads = z.NH, c.ffn = z.F, c.seq = z.S, c.batch = z.B, c.layers = z.L;
    c.task = Task::lm;
    c.vocab = 101;
    c.dtype = run.bf16 ? DType::bf16 : DType::f32;
    const Traffic ends = lm_grads_traffic(c, t, 2, true, head, run.m);
    EXPECT_EQ(ends.payload, payload) << where;
    EXPECT_EQ(ends.bus, bus) << where;
  }
}

TEST(PipelineParallel, PpBytesEqualTheFormula) {
  // Rank 0 sends one message per micro-batch for each boundary it crosses: its virtual stages'
  // activations forward to another rank, and their gradients back. A message is the
  // SP-sharded activation [S/(C·T), B/(D·M), H] in fp32.
  Sizes z = pipeline_sizes();
  z.B = 8;
  struct Run {
    int n, p, d, c, v, m;
  };
  for (const Run& run : {Run{2, 2, 1, 1, 1, 4}, Run{4, 2, 1, 1, 1, 2}, Run{4, 2, 2, 1, 1, 4},
                         Run{4, 2, 1, 2, 1, 2}, Run{2, 2, 1, 1, 2, 4}, Run{3, 3, 1, 1, 1, 4}}) {
    const int t = run.n / (run.p * run.d * run.c);
    const std::string schedule = run.v > 1 ? "interleaved-1f1b" : "1f1b";
    const json j = run_json(
        "09_pipeline_parallel", run.n,
        fmt::format("{} --steps 2 --pp {} --dp {} --cp {} --stages-per-rank {} --microbatches {} "
                    "--schedule {}",
                    z.args(), run.p, run.d, run.c, run.v, run.m, schedule));
    ASSERT_TRUE(j.contains("steps")) << schedule;
    const std::int64_t message = z.S / (run.c * t) * (z.B / (run.d * run.m)) * z.H * 4;
    // Rank 0 holds virtual stages 0, P, 2P, …: each but the last sends forward, each but stage
    // 0 sends back, and every neighbour is on another rank when P > 1.
    const int stages = run.p * run.v;
    std::int64_t boundaries = 0;
    for (int s = 0; s < stages; s += run.p) boundaries += (s + 1 < stages) + (s > 0);
    for (const json& row : j.at("steps"))
      EXPECT_EQ(row.at("pp_bus_bytes").get<std::int64_t>(), boundaries * run.m * message)
          << fmt::format("P {} D {} C {} T {} V {} M {}", run.p, run.d, run.c, t, run.v, run.m);
  }
}

/// Chapter 9's FLOPs of rank p and step: its layers L_p, each with stage 08's FLOPs per layer
///   3 · L_p · (2 · (S/C)·(B/D) · (2H² + 2H·NKV·Dh + 3HF) / T  +  2 · 2 · (B/D) · S² · H / (C·T))
/// M cancels (M micro-batches of B/(D·M) sequences each). --json reports the mean over the ranks,
/// the model's FLOPs / N: L_p = L/P when P divides L.
double pp_flops(const Sizes& z, double layers, int d, int c, int t) {
  const double dh = double(z.H / z.NH), h = double(z.H), f = double(z.F), nkv = double(z.NH);
  const double tokens = double(z.S) / c * double(z.B) / d, s = double(z.S);
  const double linear = 2 * tokens * (2 * h * h + 2 * h * nkv * dh + 3 * h * f) / t;
  const double attention = 2 * 2 * (double(z.B) / d) * s * s * h / (double(c) * t);
  return 3 * layers * (linear + attention);
}

TEST(PipelineParallel, FlopsPerRankEqualTheChaptersFormula) {
  const Sizes z = pipeline_sizes();
  struct Run {
    int n, p, d, c, m;
    std::string schedule;
  };
  for (const Run& run :
       {Run{2, 2, 1, 1, 2, "1f1b"}, Run{4, 2, 2, 1, 2, "gpipe"}, Run{4, 2, 1, 2, 2, "zb-h1"},
        Run{4, 2, 1, 1, 4, "1f1b"}, Run{3, 3, 1, 1, 2, "1f1b"}}) {
    const int t = run.n / (run.p * run.d * run.c);
    const json j = run_json("09_pipeline_parallel", run.n,
                            fmt::format("{} --steps 1 --pp {} --dp {} --cp {} --microbatches {} "
                                        "--schedule {}",
                                        z.args(), run.p, run.d, run.c, run.m, run.schedule));
    ASSERT_TRUE(j.contains("flops_per_step_per_rank")) << run.schedule;
    // L/P layers per pipeline stage when P divides L; else the mean over the P stages.
    const double want = pp_flops(z, double(z.L) / run.p, run.d, run.c, t);
    EXPECT_NEAR(j.at("flops_per_step_per_rank").get<double>(), want, 1e-9 * want)
        << fmt::format("np {} P {} D {} C {} T {} M {}", run.n, run.p, run.d, run.c, t, run.m);
  }
}

// The language model's ends under a pipeline with FSDP (07_fsdp_tp/memory.cc, the ends'
// moments): the first rank's estimate within 10 % of its allocator's peak at P 2 × D 2, with one
// micro-batch of each replica's two sequences and with four of eight. Counting the embedding's
// gathered table and its copy beside a block's backward, as if the two ran at once, put the
// estimate at 1.29 of the peak here.
TEST(PipelineParallel, TheEndsEstimateHoldsThePeakUnderFsdp) {
  for (const char* args : {"--pp 2 --dp 2", "--pp 2 --dp 2 --batch 8 --microbatches 4"}) {
    const json j = run_json("09_pipeline_parallel", 4, fmt::format("--task lm --steps 2 {}", args));
    ASSERT_TRUE(j.contains("steps")) << args;
    double peak = 0;
    for (const json& step : j.at("steps"))
      peak = std::max(peak, step.at("peak_bytes").get<double>());
    const double ratio = j.at("memory_estimate_bytes").get<double>() / peak;
    EXPECT_GE(ratio, 0.9) << args << " " << j.at("memory_terms").dump();
    EXPECT_LE(ratio, 1.1) << args << " " << j.at("memory_terms").dump();
  }
}

TEST(PipelineParallel, GpipeMemoryGrowsWithMicrobatchesOneFOneBsDoesNot) {
  // One sequence per micro-batch (B = M): GPipe keeps all M micro-batches' activations, 1F1B at
  // most P − p of them. The estimate and the measured peak agree to 10 % everywhere.
  Sizes z = pipeline_sizes();
  z.S = 96;  // activations well above the weights
  std::map<std::string, std::vector<double>> saved, peak;
  for (const char* schedule : {"gpipe", "1f1b"})
    for (const int m : {2, 4, 8}) {
      z.B = m;
      const json j = run_json("09_pipeline_parallel", 2,
                              fmt::format("{} --steps 2 --pp 2 --microbatches {} --schedule {}",
                                          z.args(), m, schedule));
      ASSERT_TRUE(j.contains("steps")) << schedule << " M " << m;
      const double est = j.at("memory_estimate_bytes").get<double>();
      const double measured = j.at("steps")[1].at("peak_bytes").get<double>();
      EXPECT_GE(est / measured, 0.9) << schedule << " M " << m << ": " << j.at("memory_terms");
      EXPECT_LE(est / measured, 1.1) << schedule << " M " << m << ": " << j.at("memory_terms");
      saved[schedule].push_back(j.at("memory_terms").at("saved activations").get<double>());
      EXPECT_EQ(j.at("saved_activation_bytes").get<double>(), saved[schedule].back())
          << "the estimate's saved activations are what the run kept at its peak";
      peak[schedule].push_back(measured);
    }
  for (std::size_t i = 1; i < 3; ++i) {
    EXPECT_GT(saved["gpipe"][i], 1.9 * saved["gpipe"][i - 1]) << "GPipe keeps every micro-batch";
    EXPECT_GT(peak["gpipe"][i], peak["gpipe"][i - 1]);
    EXPECT_EQ(saved["1f1b"][i], saved["1f1b"][i - 1]) << "1F1B keeps at most P micro-batches";
    EXPECT_LT(peak["1f1b"][i], 1.1 * peak["1f1b"][0]);
  }
}

// The estimate against the process's own high-water mark over training (VmHWM from the step's
// start less the VmRSS before the model is made), every rank, within the 15 % chapters 8 and 9
// state: at points where the pipeline's own memory (the set-up's streams, M micro-batches' books,
// a pass's activations) is tens of MiB, well above the noise of MPI's and malloc's own pages; and
// at H 256, S 128, L 4, B 4 for stage 08 (each CP method, fp32 and bf16, FSDP over the DP×CP
// group: the MPI reduce-scatter's staging on its first rank at D·C 4) and stage 09.
struct PeakPoint {
  int n;
  std::string args;
  std::string stage = "09_pipeline_parallel";
};

void PrintTo(const PeakPoint& p, std::ostream* os) {
  *os << p.stage << " -np " << p.n << " " << p.args;
}

class HostPeak : public testing::TestWithParam<PeakPoint> {};

TEST_P(HostPeak, EstimateHoldsTheHostsOwnPeakOnEveryRank) {
  const PeakPoint& p = GetParam();
  // The ratio of every rank's estimate to its measured peak. A host's peak also holds pages that
  // other processes' load makes malloc and MPI keep: a point outside the tolerance is measured
  // once more, and fails only when both runs are (a wrong term is off every time).
  auto ratios = [&] {
    const json j = run_json(p.stage, p.n, "--steps 2 " + p.args);
    std::vector<std::string> off;
    if (!j.contains("host_peak_bytes_per_rank")) return std::vector<std::string>{"no run"};
    EXPECT_TRUE(j.at("host_peak_since_baseline").get<bool>()) << "VmHWM could not be reset";
    const auto peak = j.at("host_peak_bytes_per_rank").get<std::vector<double>>();
    const auto base = j.at("host_baseline_bytes_per_rank").get<std::vector<double>>();
    const auto est = j.at("memory_estimate_bytes_per_rank").get<std::vector<double>>();
    EXPECT_EQ(peak.size(), std::size_t(p.n));
    std::vector<std::string> each;
    for (std::size_t r = 0; r < peak.size(); ++r) {
      const double measured = peak[r] - base[r];
      each.push_back(fmt::format("{:.3f}", est[r] / measured));
      if (std::abs(est[r] / measured - 1.0) > 0.15)
        off.push_back(fmt::format("rank {}: estimate {} / measured {} = {:.3f}; {}", r, est[r],
                                  measured, est[r] / measured, j.at("memory_terms").dump()));
    }
    std::cout << "[ memory   ] " << p.stage << " " << p.args << ": estimate / measured "
              << fmt::format("{}", fmt::join(each, ", ")) << std::endl;
    return off;
  };
  if (const auto first = ratios(); !first.empty()) {
    std::cout << p.stage << " " << p.args << ": outside the tolerance once, measured again:\n"
              << fmt::format("{}", fmt::join(first, "\n")) << std::endl;
    const auto again = ratios();
    EXPECT_TRUE(again.empty()) << p.stage << " " << p.args << ", outside 1 ± 0.15 in two runs:\n"
                               << fmt::format("{}\n", fmt::join(first, "\n"))
                               << fmt::format("{}", fmt::join(again, "\n"));
  }
}

// GPipe at 20 sequences per micro-batch keeps all 200 passes alive; P 2 × D 2 needs the set-up's
// FSDP cut on top of the two whole streams. Each schedule, each mesh dimension beside P, each
// recompute policy and each CP method once (ring and Ulysses in both dtypes); interleaving and
// P 2 × C 2 at H 256, where their weights and ring buffers weigh most.
const std::string kBig = "--hidden 64 --heads 2 --seq 16 --ffn 64 --batch 4000 --microbatches 200";
const std::string kMid = "--hidden 256 --heads 8 --ffn 1024 --seq 128 --layers 4 --batch 4";
const std::string kCp = "08_context_parallel";
INSTANTIATE_TEST_SUITE_P(
    PipelineParallel, HostPeak,
    testing::Values(
        PeakPoint{2, kBig + " --layers 2 --schedule 1f1b"},
        PeakPoint{2, kBig + " --layers 2 --schedule gpipe"},
        PeakPoint{4, kBig + " --layers 2 --pp 2 --dp 2 --schedule zb-h1"},
        PeakPoint{2,
                  "--hidden 32 --heads 2 --seq 8 --ffn 64 --layers 2 --schedule gpipe "
                  "--batch 2000 --microbatches 2000"},
        // Recompute: every live micro-batch keeps a recomputed layer's input only (rank 0's
        // layer 0 at every 2; rank 1's layer 1 keeps all); selective drops the cheap outputs.
        PeakPoint{2, kBig + " --layers 2 --schedule gpipe --recompute full --recompute-every 2"},
        PeakPoint{2, kBig + " --layers 2 --schedule gpipe --recompute selective"},
        PeakPoint{4, kMid + " --pp 2 --cp 2"},
        PeakPoint{2, kMid + " --pp 2 --stages-per-rank 2 --schedule interleaved-1f1b "
                            "--recompute full"},
        PeakPoint{2, kMid + " --cp 2", kCp},
        PeakPoint{2, kMid + " --cp 2 --cp-method ulysses", kCp},
        PeakPoint{4, kMid + " --cp 2 --dp 2 --dtype bf16", kCp},
        PeakPoint{2, kMid + " --cp 2 --cp-method allgather --dtype bf16", kCp},
        PeakPoint{4, kMid + " --cp 2 --dp 2 --cp-method ulysses --dtype bf16", kCp}),
    [](const auto& p) { return fmt::format("point{}", p.index); });

/// The stage's error lines in a run's stderr (one per rank that reports).
std::vector<std::string> error_lines(const std::string& err) {
  std::vector<std::string> errors;
  std::istringstream in(err);
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("09_pipeline_parallel: error:")) errors.push_back(line);
  return errors;
}

// --last-stage-layers: the last rank's estimate falls by one block's bytes for each block it
// gives up, and rank 0's rises by as many of its own. A block's bytes on a rank, from chapter 9's
// terms: its parameters and gradients (SGD: no optimizer state), its saved activations once per
// live micro-batch (1F1B at P = 2, M = 2: 2 on rank 0, 1 on the last rank) and the host's books
// (M · 2.5 KiB, and 5 KiB per live micro-batch). Rank 0's terms between two runs give the
// per-block parameters, gradients and saved activations that both ranks' blocks share.
TEST(PipelineParallel, TheLastStagesEstimateFallsByTheBlocksItGivesUp) {
  const std::string sizes =
      "--hidden 96 --heads 12 --ffn 192 --seq 24 --batch 4 --layers 5 --steps 1 --pp 2 "
      "--microbatches 2 --schedule 1f1b";
  const json even = run_json("09_pipeline_parallel", 2, sizes);                              // 3, 2
  const json one = run_json("09_pipeline_parallel", 2, sizes + " --last-stage-layers 1");    // 4, 1
  const json three = run_json("09_pipeline_parallel", 2, sizes + " --last-stage-layers 3");  // 2, 3
  ASSERT_TRUE(even.contains("pipeline") && one.contains("pipeline") && three.contains("pipeline"));
  EXPECT_EQ(even.at("pipeline").at("stage_layers"), json({3, 2}));
  EXPECT_EQ(one.at("pipeline").at("stage_layers"), json({4, 1}));
  EXPECT_EQ(three.at("pipeline").at("stage_layers"), json({2, 3}));
  auto rank = [](const json& j, int r) {
    return j.at("memory_estimate_bytes_per_rank").at(std::size_t(r)).get<double>();
  };
  auto term = [](const json& j, const char* name) {
    return j.at("memory_terms").at(name).get<double>();
  };
  const double microbatches = 2, live0 = 2, live_last = 1;
  // One block more on rank 0 (from the even run to `one`, and from `three` to the even run).
  for (const auto& [more, fewer] : {std::pair{&one, &even}, std::pair{&even, &three}}) {
    const double params = term(*more, "parameters") - term(*fewer, "parameters");
    const double grads = term(*more, "gradients") - term(*fewer, "gradients");
    const double saved_pair =
        (term(*more, "saved activations") - term(*fewer, "saved activations")) / live0;
    EXPECT_GT(params, 0);
    EXPECT_EQ(grads, params);
    EXPECT_GT(saved_pair, 0);
    auto block = [&](double live) {
      return params + grads + saved_pair * live + microbatches * 2560 + live * 5120;
    };
    EXPECT_EQ(rank(*more, 0) - rank(*fewer, 0), block(live0));
    EXPECT_EQ(rank(*fewer, 1) - rank(*more, 1), block(live_last));
  }
}

TEST(PipelineParallel, APipelineThatCannotFitIsRefusedUpFront) {
  // 50 000 micro-batches of 40 sequences: the set-up's streams (2 · 16 GB per rank) are far
  // beyond any host of this suite; refused from the estimate, in one line on every rank, before
  // the model is made.
  test::TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_stage("09_pipeline_parallel", 2,
                           "--hidden 128 --heads 2 --seq 16 --ffn 64 --batch 2000000 "
                           "--microbatches 50000",
                           dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  const std::vector<std::string> errors = error_lines(r.err);
  ASSERT_EQ(errors.size(), 1u) << r.err;
  EXPECT_NE(errors[0].find("not enough memory"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("biggest term"), std::string::npos) << errors[0];
  EXPECT_EQ(r.out.find("grad norm"), std::string::npos) << "it started training:\n" << r.out;
  EXPECT_LT(s, 20.0) << "the refusal is arithmetic";
}

TEST(PipelineParallel, AMillionMicrobatchesAreRefusedUpFront) {
  // Small sizes, a million micro-batches of one sequence: its memory would fit (its estimate is
  // about 3.3 GiB a rank, the host's books of the micro-batches), but a step of them would take
  // minutes of books and messages for a bubble no smaller than at 65 536; refused by the stage's
  // limit on M in one line, exit 2, before anything is allocated.
  test::TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_stage("09_pipeline_parallel", 2,
                           "--hidden 32 --heads 2 --seq 8 --ffn 64 --layers 2 --batch 1000000 "
                           "--microbatches 1000000",
                           dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  const std::vector<std::string> errors = error_lines(r.err);
  ASSERT_EQ(errors.size(), 1u) << r.err;
  EXPECT_NE(
      errors[0].find("--microbatches 1000000 is more than 09_pipeline_parallel takes (65536)"),
      std::string::npos)
      << errors[0];
  EXPECT_EQ(r.out.find("grad norm"), std::string::npos) << "it started training:\n" << r.out;
  EXPECT_LT(s, 20.0) << "the refusal is arithmetic";
  // The largest M the stage takes is a run like any other: its dry run plans it.
  const json dry = run_json("09_pipeline_parallel", 2,
                            "--hidden 32 --heads 2 --seq 8 --ffn 64 --layers 2 --batch 65536 "
                            "--microbatches 65536 --dry-run");
  EXPECT_TRUE(dry.contains("memory_estimate_bytes")) << dry.dump();
}

TEST(PipelineParallel, DryRunGivesTheRealRunsBytesAndMemoryEstimate) {
  // --dry-run's plan of rank 0 (the stages' traffic.h formulas on its layers, once per micro-batch,
  // and the schedule's messages) against what a real step of rank 0 counted.
  const Sizes z = pipeline_sizes();
  struct Run {
    int n;
    std::string args;
  };
  for (const Run& run :
       {Run{2, "--pp 2 --microbatches 4"}, Run{4, "--pp 2 --dp 2 --microbatches 2"},
        Run{4, "--pp 2 --cp 2 --microbatches 2 --schedule zb-h1"},
        Run{2, "--pp 2 --stages-per-rank 2 --microbatches 2 --schedule interleaved-1f1b"},
        Run{3, "--pp 3 --microbatches 4 --schedule gpipe"},
        Run{3, "--pp 3 --microbatches 2 --first-stage-layers 2 --last-stage-layers 1"},
        // --recompute full's second forwards: TP's share on the layers this rank recomputes
        // (layer 0 of 0, 1 at every 2: rank 0 one, rank 1 none), and CP's ring again.
        Run{4, "--pp 2 --microbatches 2 --recompute full --recompute-every 2"},
        Run{4, "--pp 2 --cp 2 --microbatches 2 --recompute full"}}) {
    const std::string args = z.args() + " --steps 2 " + run.args;
    const json real = run_json("09_pipeline_parallel", run.n, args);
    const json dry = run_json("09_pipeline_parallel", run.n, args + " --dry-run");
    ASSERT_TRUE(real.contains("steps") && dry.contains("step")) << run.args;
    for (const char* key : {"comm_payload_bytes", "comm_bus_bytes", "comm_calls", "dp_bus_bytes",
                            "cp_bus_bytes", "pp_bus_bytes", "pp_payload_bytes"})
      EXPECT_EQ(dry.at("step").at(key), real.at("steps")[1].at(key)) << key << ": " << run.args;
    EXPECT_EQ(dry.at("memory_estimate_bytes"), real.at("memory_estimate_bytes")) << run.args;
  }
}

TEST(PipelineParallel, TheTraceNamesEveryActionByMicrobatch) {
  const Sizes z = pipeline_sizes();
  test::TempDir dir;
  const auto path = dir / "t.json";
  const auto r = run_stage("09_pipeline_parallel", 2,
                           fmt::format("{} --steps 1 --pp 2 --microbatches 4 --schedule zb-h1 "
                                       "--trace {}",
                                       z.args(), path.string()),
                           dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json t = json::parse(test::read_file(path));
  std::map<int, std::vector<std::string>> phases, pp;  // by rank
  std::string lane;
  for (const json& e : t.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name" && e.at("tid").get<int>() == 6)
      lane = e.at("args").at("name").get<std::string>();
    if (e.at("ph") != "X") continue;
    const int rank = e.at("pid").get<int>(), tid = e.at("tid").get<int>();
    if (tid == 3) phases[rank].push_back(e.at("name").get<std::string>());
    if (tid == 6) pp[rank].push_back(e.at("name").get<std::string>());
  }
  EXPECT_EQ(lane, "pp comm");
  const auto schedule = pipeline::make_schedule("zb-h1", {.ranks = 2, .microbatches = 4});
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<std::string> want;
    for (const pipeline::Action& a : schedule->actions(rank))
      want.push_back(pipeline::to_string(a, false));
    std::vector<std::string> got;
    for (const std::string& name : phases[rank])
      if (name.size() >= 2 && std::string("FBW").find(name[0]) != std::string::npos)
        got.push_back(name);
    EXPECT_EQ(got, want) << "rank " << rank;
    // Four activations forward (rank 0 sends them, rank 1 receives) and four gradients back.
    const auto count = [&](const char* prefix) {
      return std::count_if(pp[rank].begin(), pp[rank].end(),
                           [&](const std::string& n) { return n.starts_with(prefix); });
    };
    EXPECT_EQ(count("act "), 4) << "rank " << rank;
    EXPECT_EQ(count("grad "), 4) << "rank " << rank;
  }
}

TEST(PipelineParallel, PrintScheduleListsTheActionsAndTrainsNothing) {
  test::TempDir dir;
  const auto r = run_stage("09_pipeline_parallel", 2,
                           "--layers 4 --batch 4 --pp 2 --microbatches 4 --schedule 1f1b "
                           "--print-schedule",
                           dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto schedule = pipeline::make_schedule("1f1b", {.ranks = 2, .microbatches = 4});
  EXPECT_NE(r.out.find(pipeline::format_schedule(*schedule)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("stage 0 0-1, stage 1 2-3"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("grad norm"), std::string::npos) << "no step ran:\n" << r.out;
}

TEST(PipelineParallel, BadInputIsOneLineOnEveryRank) {
  const Sizes z = pipeline_sizes();
  struct Bad {
    int n;
    std::string args, words;
  };
  for (const Bad& b :
       {Bad{3, "--pp 2", "--pp 2 must divide the 3 ranks"}, Bad{4, "--pp 4 --layers 3", "--pp 4"},
        Bad{2, "--pp 2 --stages-per-rank 3 --schedule interleaved-1f1b", "--stages-per-rank 3"},
        Bad{2, "--pp 2 --microbatches 3", "3"}, Bad{2, "--pp 2 --schedule zigzag", "--schedule"},
        Bad{2,
            "--pp 2 --stages-per-rank 2 --microbatches 3 --batch 3 --schedule "
            "interleaved-1f1b",
            "multiple of"},
        Bad{1, "--pp 1 --first-stage-layers 1", "--first-stage-layers 1 needs at least two"},
        Bad{2, "--pp 2 --last-stage-layers 5", "--last-stage-layers 5 must be between 1 and"},
        Bad{2, "--pp 2 --first-stage-layers 4",
            "leaves 0 of --layers 4 for the 1 other pipeline stage "},
        Bad{2, "--pp 2 --first-stage-layers 1 --last-stage-layers 2", "must add up to --layers 4"},
        Bad{3, "--pp 3 --first-stage-layers 2 --last-stage-layers 2", "leaves 0 of --layers 4"}}) {
    const std::string layers = b.args.find("--layers") == std::string::npos ? "--layers 4" : "";
    const std::string batch = b.args.find("--batch") == std::string::npos ? "--batch 4" : "";
    test::expect_refused_once(
        "09_pipeline_parallel", b.n,
        fmt::format("--hidden {} --heads {} --ffn {} --seq {} {} {} --steps 1 {}", z.H, z.NH, z.F,
                    z.S, layers, batch, b.args),
        b.words);
  }
  // --pp exists on stage 09 only.
  test::expect_refused_once("08_context_parallel", 2, z.args() + " --steps 1 --pp 2", "--pp");
}

// --help's defaults are the ones the runs take (mesh_default_words beside mesh_default): stage
// 08's --dp and stage 09's --dp and --cp are 1, whatever the ranks.
TEST(PipelineParallel, HelpSaysTheMeshDefaultsTheRunsUse) {
  test::TempDir dir;
  for (const char* stage : {"08_context_parallel", "09_pipeline_parallel"}) {
    SCOPED_TRACE(stage);
    const auto r = test::run_command(test::stage_binary(stage) + " --help", dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto dp = r.out.find("--dp D");
    ASSERT_NE(dp, std::string::npos) << r.out;
    const std::string dp_text = r.out.substr(dp, r.out.find("\n  --", dp + 1) - dp);
    EXPECT_NE(dp_text.find("when not given, 1"), std::string::npos) << dp_text;
    const auto cp = r.out.find("--cp C");
    const std::string cp_text = r.out.substr(cp, r.out.find("\n  --", cp + 1) - cp);
    EXPECT_NE(cp_text.find(std::string_view(stage) == "09_pipeline_parallel"
                               ? "when not given, 1"
                               : "when not given, 2 if the ranks are even, else 1"),
              std::string::npos)
        << cp_text;
  }
  // And the runs: 4 ranks of stage 09 default to P 2 × D 1 × C 1 × T 2.
  const Sizes z = pipeline_sizes();
  const auto run = test::run_stage("09_pipeline_parallel", 4, z.args() + " --steps 1", dir);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("mesh P 2 × D 1 × CP 1 × TP 2"), std::string::npos) << run.out;
}

TEST(PipelineParallel, TheInterleavedDefaultNamesNoFlagTheUserDidNotGive) {
  const Sizes z = pipeline_sizes();
  const auto r = test::expect_refused_once(
      "09_pipeline_parallel", 2,
      fmt::format("--hidden {} --heads {} --ffn {} --seq {} --layers 4 --batch 1 --steps 1 "
                  "--schedule interleaved-1f1b --stages-per-rank 2",
                  z.H, z.NH, z.F, z.S),
      "the default --microbatches");
  EXPECT_EQ(r.err.find("--microbatches 1 "), std::string::npos) << r.err;
}

/// The model sizes of pipeline_sizes() with `args`, whose own --layers and --batch win.
std::string sized(const std::string& args) {
  const Sizes z = pipeline_sizes();
  return fmt::format(
      "--hidden {} --heads {} --ffn {} --seq {} {} {} --steps 1 {}", z.H, z.NH, z.F, z.S,
      args.find("--layers") == std::string::npos ? fmt::format("--layers {}", z.L) : "",
      args.find("--batch") == std::string::npos ? fmt::format("--batch {}", z.B) : "", args);
}

/// A refusal that is the stage's own line, not a signal, an internal check or MPI_ABORT.
void expect_no_crash(const test::CommandResult& r) {
  for (const char* crash : {"Signal", "check '", "MPI_ABORT", "core dumped"})
    EXPECT_EQ(r.err.find(crash), std::string::npos) << r.err;
}

// P·D·C (and D·C) of sizes near the int range: before, 65536 · 65536 wrapped to 0 (an integer
// division by zero on every rank) and 2147483647 · 2 to −2, which "divides" 2 ranks (a rank
// group's negative colour, an internal check and MPI_ABORT). Now one line, exit 2, everywhere.
TEST(PipelineParallel, MeshSizesBeyondTheIntRangeAreOneLineOnEveryRank) {
  test::TempDir dir;
  { std::ofstream(dir / "mesh.toml") << "pp = 65536\ndp = 65536\n"; }
  struct Bad {
    std::string stage;
    int n;
    std::string args, words;
  };
  for (const Bad& b :
       {Bad{"09_pipeline_parallel", 1, "--pp 65536 --dp 65536", "--pp 65536 must divide the 1"},
        Bad{"09_pipeline_parallel", 1, "--pp 65536 --dp 65536 --dry-run", "--pp 65536 must"},
        Bad{"09_pipeline_parallel", 1, "--pp 65536 --dp 65536 --print-schedule", "--pp 65536"},
        Bad{"09_pipeline_parallel", 1, "--config " + (dir / "mesh.toml").string(),
            "--pp 65536 must divide the 1 ranks"},
        Bad{"08_context_parallel", 2, "--dp 2147483647 --cp 2",
            "--dp 2147483647 × --cp 2 must divide the 2 ranks"},
        Bad{"09_pipeline_parallel", 2, "--dp 2147483647 --cp 2 --batch 4294967294",
            "P 2 (--pp's default) × --cp 2 must divide the 2 ranks"},
        Bad{"09_pipeline_parallel", 2, "--pp 1 --dp 2147483647 --cp 2 --batch 4294967294 --dry-run",
            "--dp 2147483647 × --cp 2 must divide the 2 ranks"}}) {
    SCOPED_TRACE(b.stage + " " + b.args);
    expect_no_crash(test::expect_refused_once(b.stage, b.n, sized(b.args), b.words));
  }
}

// A refusal about the pipeline's stages or micro-batches names the flags the user gave, and the
// remedy it advises runs.
TEST(PipelineParallel, StageAndMicrobatchRefusalsNameTheGivenFlagsAndARemedyThatRuns) {
  test::TempDir dir;
  // --stages-per-rank on a schedule of one stage per rank: that, not --microbatches (before:
  // "--microbatches must be at least 1 (got -2)", P·V wrapped).
  auto r =
      test::expect_refused_once("09_pipeline_parallel", 2, sized("--stages-per-rank 2147483647"),
                                "--stages-per-rank 2147483647 needs --schedule interleaved-1f1b");
  EXPECT_EQ(r.err.find("--microbatches"), std::string::npos) << r.err;
  // On interleaved-1f1b: P·V stages for L = 4 layers; at most L / P = 2 per rank fit.
  r = test::expect_refused_once(
      "09_pipeline_parallel", 2, sized("--schedule interleaved-1f1b --stages-per-rank 2147483647"),
      "P 2 (--pp's default) × --stages-per-rank 2147483647 makes 4294967294 pipeline stages");
  EXPECT_EQ(r.err.find("--microbatches"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("give --stages-per-rank at most 2"), std::string::npos) << r.err;
  EXPECT_EQ(run_stage("09_pipeline_parallel", 2,
                      sized("--schedule interleaved-1f1b --stages-per-rank 2"), dir)
                .exit_code,
            0);
  // B / D = 3 rows that no multiple of P = 2 divides: no --microbatches can work (before, the
  // message offered one), a --batch that is a multiple of P·D = 2 does.
  for (const std::string microbatches : {"", "--microbatches 2"}) {
    SCOPED_TRACE(microbatches);
    r = test::expect_refused_once(
        "09_pipeline_parallel", 2,
        sized("--pp 2 --schedule interleaved-1f1b --stages-per-rank 2 --batch 3 " + microbatches),
        "give --batch a multiple of 2 (P·D)");
    EXPECT_EQ(r.err.find("or --microbatches"), std::string::npos) << r.err;
  }
  EXPECT_EQ(
      run_stage("09_pipeline_parallel", 2,
                sized("--pp 2 --schedule interleaved-1f1b --stages-per-rank 2 --batch 4"), dir)
          .exit_code,
      0);
}

// A 0 the user typed is refused like any value out of range (before: taken as "not given", the
// default run); an empty output path reaches the outputs' own check (before: no output, exit 0).
TEST(PipelineParallel, ZeroAndEmptyValuesAreRefusedOnEveryRank) {
  for (const char* flag :
       {"--pp", "--dp", "--cp", "--microbatches", "--first-stage-layers", "--last-stage-layers"})
    test::expect_refused_once("09_pipeline_parallel", 2, sized(fmt::format("{} 0", flag)),
                              fmt::format("{} '0': must be a positive number", flag));
  for (const char* flag : {"--json", "--trace", "--dump"})
    test::expect_refused_once("09_pipeline_parallel", 2, sized(fmt::format("{} ''", flag)),
                              fmt::format("{}: the path is empty", flag));
}

// Outputs of one run that would land in one file, or inside the dump, or over the --config it
// reads: refused in one line before any work, nothing written; a refused run leaves no --dump.
TEST(PipelineParallel, OutputsThatCollideAreRefusedAndARefusedRunLeavesNoDump) {
  const Sizes z = pipeline_sizes();
  const std::string base = z.args() + " --steps 1";
  struct Bad {
    std::string args, words;
  };
  for (const Bad& b :
       {Bad{"--json X --trace X", "--trace 'X' is the same file as --json 'X'"},
        Bad{"--json X --trace ./sub/../X", "is the same file as --json 'X'"},
        Bad{"--dump D --json D/config.json", "--json 'D/config.json' lies inside --dump 'D'"},
        // A file the dump does not write may share its directory, which must exist first.
        Bad{"--dump D --trace D/t.json", "--trace 'D/t.json': directory 'D' does not exist"}}) {
    SCOPED_TRACE(b.args);
    test::TempDir dir;
    std::filesystem::create_directory(dir / "sub");
    const auto r = test::run_stage("09_pipeline_parallel", 2, base + " " + b.args, dir);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    int lines = 0;
    for (const auto& line : test::lines_of(r.err))
      if (line.starts_with("09_pipeline_parallel: error:")) {
        ++lines;
        EXPECT_NE(line.find(b.words), std::string::npos) << line;
      }
    EXPECT_EQ(lines, 1) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir / "X"));
    EXPECT_FALSE(std::filesystem::exists(dir / "D")) << "a refused run made its --dump";
  }
  // A run refused after the outputs were checked (here: by a bad mesh) leaves no directory.
  test::TempDir dir;
  const auto r = test::run_stage("09_pipeline_parallel", 2,
                                 base + " --pp 2 --microbatches 3 --dump a/b/D", dir);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "a")) << "a refused run left its --dump behind";
}

}  // namespace
}  // namespace tpx
