// The tensor-parallel stage executables from the outside, as a user runs them under mpirun:
//   - the comm bytes per step in --json equal the formulas of the stage chapters
//     (02_megatron_tp/README.md, 03_sequence_parallel/README.md), computed here from the config;
//   - the saved-activation bytes per rank equal the chapters' formula, 1/N of stage 01's under
//     sequence parallelism;
//   - a rank count that divides NH, F and S but is not a power of two (3) passes --check;
//   - a rank count that does not divide them fails fast on every rank with one clear line;
//   - stage 04 moves exactly stage 03's bus bytes at N = 1 … 4 in N − 1 transfers per ring
//     primitive, its --dump equals stage 03's to fp32 summation-order tolerance, and a transfer
//     that never arrives is reported by the watchdog with its ring step named;
//   - stage 05 moves stage 04's bytes in as many pulls as 04 has transfers, its --dump equals
//     stage 04's, it passes --check at N = 3 on the chapter's sizes, 200 steps with random delays
//     on the copy lanes give bitwise the losses of a run without, and a signal that is never sent
//     is reported by the watchdog naming the peer and the generation; its NCCL zero-CTA
//     all-gather option refuses the cpu with one line, printed once, and exit 2 on every rank;
//   - stage 06's all-gathers move ¼ of stage 05's bytes (plus the amax all-reduces), its losses
//     track stage 01's within 2 % over 10 steps, and its dump holds every weight's FP8 codes under
//     the scale of the whole weight.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fp8.h"
#include "common/npy.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using nlohmann::json;

/// Sizes of a run, named as in the chapters.
struct Sizes {
  std::int64_t H = 32, NH = 4, F = 64, S = 16, B = 2, L = 2;
  std::string args() const {
    return fmt::format("--hidden {} --heads {} --ffn {} --seq {} --batch {} --layers {}", H, NH, F,
                       S, B, L);
  }
};

constexpr std::int64_t kFloat = 4;  // bytes per fp32 element

using test::run_stage;

json run_json(const std::string& stage, int ranks, const Sizes& z, int steps,
              const std::string& extra = "") {
  test::TempDir dir;
  const auto path = dir / "summary.json";
  const auto r = run_stage(
      stage, ranks,
      fmt::format("{} --steps {} --json {} {}", z.args(), steps, path.string(), extra), dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  return json::parse(test::read_file(path));
}

// --- the chapters' formulas, per rank and step (fp32; nccl-tests bus convention) ----------------

struct Comm {
  std::uint64_t payload, bus, calls;
};

/// Stage 02, per block: forward g after Wo and Wd, backward f before Wq/Wk/Wv and Wg/Wu: four
/// all-reduces of the [S, B, H] stream. Bus bytes of an all-reduce: 2(N−1)/N of its payload.
Comm megatron_comm(const Sizes& z, std::int64_t n) {
  const std::int64_t stream = z.S * z.B * z.H * kFloat;
  const std::int64_t payload = z.L * 4 * stream;
  return {std::uint64_t(payload), std::uint64_t(payload * 2 * (n - 1) / n), std::uint64_t(4 * z.L)};
}

/// Stage 03, per block: forward 2 all-gathers (f) + 2 reduce-scatters (g); backward 2
/// all-gathers (g) + 2 re-gathers of the kept [S/N, B, H] inputs (f, for dW) + 2
/// reduce-scatters (f); all of the full [S, B, H] (bus = (N−1)/N of that). Plus the all-reduce
/// of the two norm-gain gradients [H].
Comm sequence_parallel_comm(const Sizes& z, std::int64_t n) {
  const std::int64_t stream = z.S * z.B * z.H * kFloat;
  const std::int64_t gains = 2 * z.H * kFloat;
  const std::int64_t payload = z.L * (10 * stream + gains);
  const std::int64_t bus = z.L * (10 * stream * (n - 1) / n + gains * 2 * (n - 1) / n);
  return {std::uint64_t(payload), std::uint64_t(bus), std::uint64_t(12 * z.L)};
}

/// Stage 04: stage 03's bytes, each bulk all-gather / reduce-scatter of the [S, B, H] stream now
/// N − 1 ring transfers of one [S/N, B, H] chunk (a sendrecv's payload is what it sends, so
/// payload = bus for them); the norm-gain all-reduces are unchanged.
Comm overlap_ring_comm(const Sizes& z, std::int64_t n) {
  const std::int64_t stream = z.S * z.B * z.H * kFloat;
  const std::int64_t gains = 2 * z.H * kFloat;
  const std::int64_t ring = 10 * (n - 1) * (stream / n);  // 10 primitives per layer
  return {std::uint64_t(z.L * (ring + gains)),
          std::uint64_t(z.L * (ring + gains * 2 * (n - 1) / n)),
          std::uint64_t(z.L * (10 * (n - 1) + 2))};
}

/// Saved-activation elements per layer on one device: x, h, x2, h2 [S,B,H]; q, k, v, a
/// [S,B,H]; rstd1, rstd2 [S·B]; gate, up, s [S,B,F]; and attention's: the fused default's
/// lse [B,NH,S] (--attention naive: probs [B,NH,S,S]).
std::int64_t baseline_saved(const Sizes& z) {
  return 8 * z.S * z.B * z.H + 2 * z.S * z.B + 3 * z.S * z.B * z.F + z.B * z.NH * z.S;
}

/// Stage 02: the tensor-parallel part (q, k, v, a, gate, up, s, lse) is 1/N, the norm /
/// residual part (x, h, x2, h2, rstd1, rstd2) is replicated.
std::int64_t megatron_saved_bytes(const Sizes& z, std::int64_t n) {
  const std::int64_t replicated = 4 * z.S * z.B * z.H + 2 * z.S * z.B;
  return z.L * kFloat * (replicated + (baseline_saved(z) - replicated) / n);
}

/// Stage 03: everything is 1/N (h and h2 are kept as their [S/N, B, H] shards).
std::int64_t sequence_parallel_saved_bytes(const Sizes& z, std::int64_t n) {
  return z.L * kFloat * baseline_saved(z) / n;
}

struct Case {
  std::string stage;
  int ranks;
};

/// How gtest names a Case in its output (and ctest in the discovered test names).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.stage << " -np " << c.ranks;
}

class StageFormulas : public testing::TestWithParam<Case> {};

TEST_P(StageFormulas, CommAndSavedBytesMatchTheChapter) {
  const auto [stage, n] = GetParam();
  const Sizes z;
  const json j = run_json(stage, n, z, /*steps=*/2);
  const bool sp = stage != "02_megatron_tp";  // 03 and 04 keep 03's sharding
  const Comm want = stage == "04_overlap_ring" ? overlap_ring_comm(z, n)
                    : sp                       ? sequence_parallel_comm(z, n)
                                               : megatron_comm(z, n);
  ASSERT_EQ(j.at("steps").size(), 2u);
  for (const json& row : j.at("steps")) {
    EXPECT_EQ(row.at("comm_payload_bytes").get<std::uint64_t>(), want.payload);
    EXPECT_EQ(row.at("comm_bus_bytes").get<std::uint64_t>(), want.bus);
    EXPECT_EQ(row.at("comm_calls").get<std::uint64_t>(), want.calls);
  }
  const std::int64_t saved = sp ? sequence_parallel_saved_bytes(z, n) : megatron_saved_bytes(z, n);
  EXPECT_EQ(j.at("saved_activation_bytes").get<std::int64_t>(), saved);
}

INSTANTIATE_TEST_SUITE_P(stages, StageFormulas,
                         testing::Values(Case{"02_megatron_tp", 1}, Case{"02_megatron_tp", 2},
                                         Case{"02_megatron_tp", 4}, Case{"03_sequence_parallel", 1},
                                         Case{"03_sequence_parallel", 2},
                                         Case{"03_sequence_parallel", 4},
                                         Case{"04_overlap_ring", 1}, Case{"04_overlap_ring", 2},
                                         Case{"04_overlap_ring", 4}),
                         [](const auto& p) {
                           return fmt::format("{}_np{}", p.param.stage.substr(0, 2), p.param.ranks);
                         });

class SavedBytes : public testing::TestWithParam<int> {};

TEST_P(SavedBytes, SequenceParallelKeepsOneNthOfTheBaseline) {
  const int n = GetParam();
  const Sizes z;
  const json base = run_json("01_baseline", 1, z, 1);
  const json sp = run_json("03_sequence_parallel", n, z, 1);
  const auto base_bytes = base.at("saved_activation_bytes").get<std::int64_t>();
  EXPECT_EQ(base_bytes, z.L * kFloat * baseline_saved(z));
  EXPECT_EQ(n * sp.at("saved_activation_bytes").get<std::int64_t>(), base_bytes);
}

INSTANTIATE_TEST_SUITE_P(stages, SavedBytes, testing::Values(4));

// --attention naive keeps the probabilities [B, NH/N, S, S] where fused keeps the log-sum-exp
// [B, NH/N, S]: per rank, the saved bytes differ by exactly L·4·B·NH/N·(S² − S).
TEST(AttentionSavedBytes, NaiveKeepsTheProbabilitiesFusedOnlyTheLse) {
  const Sizes z;
  for (const auto& [stage, n] : {std::pair{"01_baseline", 1}, std::pair{"02_megatron_tp", 2}}) {
    test::TempDir dir;
    std::int64_t bytes[2] = {0, 0};
    for (int naive = 0; naive < 2; ++naive) {
      const auto path = dir / fmt::format("{}.json", naive);
      const auto r = run_stage(stage, n,
                               fmt::format("{} --steps 1 --attention {} --json {}", z.args(),
                                           naive ? "naive" : "fused", path.string()),
                               dir);
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      const json j = json::parse(test::read_file(path));
      EXPECT_EQ(j.at("config").at("attention"), naive ? "naive" : "fused");
      bytes[naive] = j.at("saved_activation_bytes").get<std::int64_t>();
    }
    const std::int64_t heads = z.NH / n;
    EXPECT_EQ(bytes[1] - bytes[0],
              z.L * (z.B * heads * z.S * z.S * kFloat - z.B * heads * z.S * kFloat))
        << stage << " -np " << n;
  }
}

class ThreeRanks : public testing::TestWithParam<std::string> {};

TEST_P(ThreeRanks, SplitsSizesDivisibleByThree) {
  test::TempDir dir;
  const Sizes z{.H = 48, .NH = 6, .F = 96, .S = 12, .B = 2, .L = 2};
  const auto r = run_stage(GetParam(), 3, z.args() + " --steps 4 --check", dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("ranks 3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
}

TEST_P(ThreeRanks, RejectsSizesNotDivisibleByThreeOnEveryRank) {
  test::TempDir dir;
  const Sizes z{.H = 64, .NH = 4, .F = 128, .S = 16, .B = 2, .L = 1};
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_stage(GetParam(), 3, z.args(), dir);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.exit_code, 124) << "timed out instead of failing";
  EXPECT_LT(seconds, 30.0);
  int lines = 0;
  const std::string want = GetParam() + ": error: cannot split the block over 3 ranks:";
  for (const auto& line : test::lines_of(r.err))
    if (line.starts_with(want)) {
      ++lines;
      EXPECT_NE(line.find("--heads (4)"), std::string::npos) << line;
    }
  EXPECT_EQ(lines, 1) << "the ranks' agreed error, printed once:\n" << r.err;
  EXPECT_EQ(r.out.find("step"), std::string::npos) << "no step may run:\n" << r.out;
}

INSTANTIATE_TEST_SUITE_P(stages, ThreeRanks,
                         testing::Values("02_megatron_tp", "03_sequence_parallel",
                                         "04_overlap_ring", "05_copy_engine_async_tp"),
                         [](const auto& p) { return p.param.substr(3); });

// --- stage 04 against stage 03 -------------------------------------------------------------------

/// Sizes every N in 1 … 4 divides (NH, F, S multiples of 12).
constexpr Sizes kRingSizes{.H = 48, .NH = 12, .F = 96, .S = 24, .B = 2, .L = 2};

class OverlapRingVsSequenceParallel : public testing::TestWithParam<int> {};

TEST_P(OverlapRingVsSequenceParallel, SameBusBytesEveryStep) {
  const int n = GetParam();
  const json sp = run_json("03_sequence_parallel", n, kRingSizes, 2);
  const json ring = run_json("04_overlap_ring", n, kRingSizes, 2);
  ASSERT_EQ(sp.at("steps").size(), ring.at("steps").size());
  for (std::size_t i = 0; i < sp.at("steps").size(); ++i) {
    const json &a = sp["steps"][i], &b = ring["steps"][i];
    EXPECT_EQ(b.at("comm_bus_bytes").get<std::uint64_t>(),
              a.at("comm_bus_bytes").get<std::uint64_t>())
        << "step " << i;
    // 10 primitives per layer, N − 1 transfers each, plus the two norm-gain all-reduces.
    EXPECT_EQ(b.at("comm_calls").get<std::uint64_t>(),
              std::uint64_t(kRingSizes.L * (10 * (n - 1) + 2)));
    EXPECT_GE(b.at("exposed_comm_ms").get<double>(), 0.0);
  }
}

/// Runs `a` and `b` at N ranks with --dump and expects every dumped tensor of b within
/// `rtol` · max|a| of a's.
void expect_dumps_close(const std::string& a, const std::string& b, int n, double rtol) {
  test::TempDir dir;
  for (const std::string& stage : {a, b}) {
    const auto r = run_stage(
        stage, n, fmt::format("{} --steps 1 --dump {}", kRingSizes.args(), (dir / stage).string()),
        dir);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  std::vector<std::string> names = {"output", "input.grad", "loss"};
  for (int l = 0; l < kRingSizes.L; ++l)
    for (const char* p : {"norm1", "wq", "wk", "wv", "wo", "norm2", "w_gate", "w_up", "w_down"})
      names.push_back(fmt::format("layers.{}.{}.grad", l, p));
  for (const auto& name : names) {
    const NpyArray want = read_npy(dir / a / (name + ".npy"));
    const NpyArray got = read_npy(dir / b / (name + ".npy"));
    ASSERT_EQ(got.shape, want.shape) << name;
    double scale = 0.0, err = 0.0;
    for (std::size_t i = 0; i < want.data.size(); ++i) {
      scale = std::max(scale, std::abs(double(want.data[i])));
      err = std::max(err, std::abs(double(got.data[i]) - double(want.data[i])));
    }
    EXPECT_LE(err, rtol * scale) << name << " at N = " << n;
  }
}

TEST_P(OverlapRingVsSequenceParallel, DumpEqualsStage03) {
  // The ring sums a row-parallel output's partials in ring order, the bulk reduce-scatter in its
  // own: fp32 summation order, nothing more.
  expect_dumps_close("03_sequence_parallel", "04_overlap_ring", GetParam(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(stages, OverlapRingVsSequenceParallel, testing::Values(1, 2, 3, 4));

TEST(OverlapRing, WatchdogNamesTheRingStepThatNeverArrived) {
  // Rank 1 silently skips its first comm op, the first ring transfer of layer 0's Q/K/V
  // all-gather; rank 0 then waits on a transfer that never comes.
  test::TempDir dir;
  const Sizes z{.H = 48, .NH = 12, .F = 96, .S = 12, .B = 2, .L = 1};
  const auto r =
      run_stage("04_overlap_ring", 2,
                z.args() + " --comm mpi --comm-timeout 3 --fault-skip-collective 1:0", dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.exit_code, 124) << "timed out instead of being caught by the watchdog";
  EXPECT_NE(r.err.find("comm watchdog"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1 skipped it"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(qkv AG step 1/2)"), std::string::npos) << r.err;
}

// --- stage 05 against stage 04 -------------------------------------------------------------------

class CopyEngineVsOverlapRing : public testing::TestWithParam<int> {};

TEST_P(CopyEngineVsOverlapRing, SameBytesInAsManyTransfers) {
  // Each of the 10 primitives per layer pulls N − 1 chunks where stage 04 sent N − 1: payload,
  // bus bytes and calls are stage 04's, step by step.
  const int n = GetParam();
  const json ring = run_json("04_overlap_ring", n, kRingSizes, 2);
  const json ce = run_json("05_copy_engine_async_tp", n, kRingSizes, 2);
  ASSERT_EQ(ring.at("steps").size(), ce.at("steps").size());
  for (std::size_t i = 0; i < ring.at("steps").size(); ++i) {
    const json &a = ring["steps"][i], &b = ce["steps"][i];
    for (const char* key : {"comm_payload_bytes", "comm_bus_bytes", "comm_calls"})
      EXPECT_EQ(b.at(key).get<std::uint64_t>(), a.at(key).get<std::uint64_t>())
          << key << " at step " << i;
  }
}

TEST_P(CopyEngineVsOverlapRing, DumpEqualsStage04) {
  // The one-shot reduce-scatter adds the peers' partial sums in another order than the ring.
  expect_dumps_close("04_overlap_ring", "05_copy_engine_async_tp", GetParam(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(stages, CopyEngineVsOverlapRing, testing::Values(1, 2, 3, 4));

TEST(CopyEngine, ChecksAtThreeRanksOnTheChaptersSizes) {
  test::TempDir dir;
  const Sizes z{.H = 384, .NH = 6, .F = 768, .S = 96, .B = 2, .L = 2};
  const auto r = run_stage("05_copy_engine_async_tp", 3, z.args() + " --steps 4 --check", dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
}

TEST(CopyEngine, RandomDelaysOnTheCopyLanesChangeNoBit) {
  // 200 steps with every pull and signal delayed by a random 0 … 300 µs: the schedule of the
  // transfers changes, the arithmetic must not. A torn read (a pull before its chunk was
  // published) or a stale signal (a wait satisfied by an earlier step's) would change some loss.
  const Sizes z{.H = 16, .NH = 4, .F = 32, .S = 8, .B = 1, .L = 1};
  auto losses = [&](const std::string& extra) {
    test::TempDir dir;
    const auto path = dir / "summary.json";
    const auto r = run_stage(
        "05_copy_engine_async_tp", 4,
        fmt::format("{} --steps 200 --check --json {} {}", z.args(), path.string(), extra), dir);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
    std::vector<double> out;
    const json summary = json::parse(test::read_file(path));
    for (const json& step : summary.at("steps")) {
      out.push_back(step.at("loss").get<double>());
      out.push_back(step.at("grad_norm").get<double>());
    }
    return out;
  };
  const std::vector<double> quiet = losses("");
  const std::vector<double> jittered = losses("--fault-copy-delay-us 300");
  ASSERT_EQ(quiet.size(), 400u);
  EXPECT_EQ(jittered, quiet);
}

TEST(CopyEngine, WatchdogNamesThePeerAndGenerationOfAMissingSignal) {
  // Rank 1 never sends its first signal: "ready" for generation 1 of layer 0's Q/K/V gather.
  // Rank 0's pull waits on it until the symmetric memory's watchdog reports it.
  test::TempDir dir;
  const Sizes z{.H = 48, .NH = 12, .F = 96, .S = 12, .B = 2, .L = 1};
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_stage("05_copy_engine_async_tp", 2,
                           z.args() + " --comm-timeout 3 --fault-skip-signal 1:0", dir);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.exit_code, 124) << "timed out instead of being caught by the watchdog";
  EXPECT_LT(seconds, 60.0);
  EXPECT_NE(r.err.find("comm watchdog"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("signal_wait from 1 gen 1 (qkv pull 1/1 ready)"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("rank 1 skipped it"), std::string::npos) << r.err;
}

TEST(CopyEngine, NcclZeroCtaAllGatherOnTheCpuIsOneLineOnEveryRank) {
  // The library comparison needs GPUs; on the cpu the option says so and nothing runs.
  const auto r = test::expect_refused_once("05_copy_engine_async_tp", 2,
                                           Sizes{}.args() + " --all-gather nccl-zero-cta",
                                           "--all-gather nccl-zero-cta cannot run on the cpu");
  EXPECT_EQ(r.out.find("step"), std::string::npos) << "no step may run:\n" << r.out;
}

// --- stage 06 against stages 05 and 01 ----------------------------------------------------------

class Fp8VsCopyEngine : public testing::TestWithParam<int> {};

TEST_P(Fp8VsCopyEngine, AllGathersMoveHalfOfStage05sBf16Bytes) {
  // Stage 06 runs its FP8 GEMMs inside the bf16 recipe, so it is measured against stage 05 in
  // bf16. Per layer and step, stage 05 gathers 6 [S/N, B, H] bf16 shards (qkv and gate/up inputs
  // in forward, their re-gathers and the two dY gathers in backward), pulling N − 1 of them each;
  // stage 06 pulls the same shards as 1-byte FP8 codes. Its bf16 reduce-scatters and fp32 norm
  // all-reduces are stage 05's; on top come 8 MAX all-reduces of the amaxes per layer, one per
  // GEMM group, of k fp32 values: forward qkv 4 (h, Wq, Wk, Wv), o 2, gate/up 3, down 2;
  // backward qkv 3 (dQ, dK, dV), o 2 (a, dY), gate/up 2, down 2. (Against stage 05 in fp32 the
  // gathers move a quarter of the bytes and the reduce-scatters half.)
  const int n = GetParam();
  const Sizes z = kRingSizes;
  const json bf16 = run_json("05_copy_engine_async_tp", n, z, 2, "--dtype bf16");
  const json f8 = run_json("06_fp8", n, z, 2);
  const std::int64_t pulled = 6 * z.L * (n - 1) * (z.S / n) * z.B * z.H;  // elements per step
  std::uint64_t amax_payload = 0, amax_bus = 0;
  for (const std::int64_t k : {4, 2, 3, 2, 3, 2, 2, 2}) {
    amax_payload += std::uint64_t(z.L * k * kFloat);
    amax_bus += std::uint64_t(z.L * ((k * kFloat * 2 * (n - 1)) / n));
  }
  ASSERT_EQ(bf16.at("steps").size(), f8.at("steps").size());
  for (std::size_t i = 0; i < bf16.at("steps").size(); ++i) {
    const json &a = bf16["steps"][i], &b = f8["steps"][i];
    const auto saved = std::uint64_t(pulled * (2 - 1));  // 2 bytes become 1
    EXPECT_EQ(b.at("comm_bus_bytes").get<std::uint64_t>(),
              a.at("comm_bus_bytes").get<std::uint64_t>() - saved + amax_bus)
        << "step " << i;
    EXPECT_EQ(b.at("comm_payload_bytes").get<std::uint64_t>(),
              a.at("comm_payload_bytes").get<std::uint64_t>() - saved + amax_payload)
        << "step " << i;
  }
}

TEST(Fp8, UnderFp32ItIsStage05) {
  // --dtype fp32 runs stage 05 itself, the baseline FP8 is measured against: the same losses,
  // gradient norms and bytes, bit for bit.
  auto summary = [](const std::string& stage, const std::string& extra) {
    test::TempDir dir;
    const auto path = dir / "summary.json";
    const auto r = run_stage(
        stage, 2, fmt::format("{} --steps 3 --json {} {}", kRingSizes.args(), path.string(), extra),
        dir);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return json::parse(test::read_file(path));
  };
  const json f32 = summary("05_copy_engine_async_tp", "");
  const json f8 = summary("06_fp8", "--dtype fp32");
  EXPECT_EQ(f8.at("config").at("dtype"), "fp32");
  ASSERT_EQ(f32.at("steps").size(), f8.at("steps").size());
  for (std::size_t i = 0; i < f32.at("steps").size(); ++i)
    for (const char* key : {"loss", "grad_norm", "comm_bus_bytes", "comm_calls"})
      EXPECT_EQ(f8["steps"][i].at(key), f32["steps"][i].at(key)) << key << " at step " << i;
}

INSTANTIATE_TEST_SUITE_P(ranks, Fp8VsCopyEngine, testing::Values(2, 4),
                         [](const auto& p) { return fmt::format("np{}", p.param); });

class Fp8Loss : public testing::TestWithParam<int> {};

TEST_P(Fp8Loss, TracksStage01OverTenSteps) {
  // FP8 rounding must not change how training goes: every loss of 10 SGD steps within 2 % of
  // stage 01's (fp32, one device).
  const json ref = run_json("01_baseline", 1, kRingSizes, 10);
  const json f8 = run_json("06_fp8", GetParam(), kRingSizes, 10);
  ASSERT_EQ(ref.at("steps").size(), 10u);
  ASSERT_EQ(f8.at("steps").size(), 10u);
  for (std::size_t i = 0; i < 10; ++i) {
    const double want = ref["steps"][i].at("loss").get<double>();
    const double got = f8["steps"][i].at("loss").get<double>();
    EXPECT_LE(std::abs(got - want), 0.02 * std::abs(want)) << "step " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(ranks, Fp8Loss, testing::Values(1, 2, 4),
                         [](const auto& p) { return fmt::format("np{}", p.param); });

TEST(Fp8, DumpHoldsEachWeightsCodesUnderOneAgreedScale) {
  // At N = 2 every weight is split between two ranks. The dump's scale must be the full weight's
  // (448 / max |W| in fp32, so the shards agreed on the amax), and every code, from either rank's
  // shard, must be that scale's encoding of the weight.
  test::TempDir dir;
  const Sizes z = kRingSizes;
  const auto r =
      run_stage("06_fp8", 2, z.args() + " --steps 1 --dump " + (dir / "dump").string(), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* name : {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}) {
    SCOPED_TRACE(name);
    const NpyArray w = read_npy(dir / "dump" / fmt::format("layers.0.{}.npy", name));
    const NpyBytes q = read_npy_bytes(dir / "dump" / "fp8" / fmt::format("layers.0.{}.npy", name));
    const NpyArray scale =
        read_npy(dir / "dump" / "fp8" / fmt::format("layers.0.{}.scale.npy", name));
    ASSERT_EQ(q.shape, w.shape);
    ASSERT_EQ(scale.data.size(), 1u);
    float amax = 0;
    for (const float v : w.data) amax = std::max(amax, std::abs(v));
    EXPECT_EQ(scale.data[0], 448.0f / amax);
    int wrong = 0;
    for (std::size_t i = 0; i < w.data.size(); ++i)
      wrong += q.data[i] != fp8::encode(w.data[i] * scale.data[0], DType::e4m3) ? 1 : 0;
    EXPECT_EQ(wrong, 0) << "of " << w.data.size() << " codes";
  }
  for (const char* name : {"qkv_in", "mlp_in"}) {
    const NpyBytes q = read_npy_bytes(dir / "dump" / "fp8" / fmt::format("layers.0.{}.npy", name));
    EXPECT_EQ(q.shape, (std::vector<std::int64_t>{z.S, z.B, z.H})) << name;
  }
}

}  // namespace
}  // namespace tpx
