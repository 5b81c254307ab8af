// The stage executables under faults and bad input, as a user meets them under mpirun:
//   - a diverging run stops on every rank naming the step, --json keeps the steps done, and
//     --check can no longer print PASS over NaN losses;
//   - sizes whose counts overflow, and configs too large for memory, are refused (exit 2) before
//     anything is allocated, quickly;
//   - output paths are checked before the first step, and a write that fails (/dev/full) is a
//     non-zero exit naming the path and the reason; a reused --dump directory loses the stage's
//     stale files and keeps the user's;
//   - ranks started with different flags, or one rank that cannot start, end every rank with one
//     line and exit 2, instead of crashing in MPI or hanging;
//   - --fault-skip-collective cannot name a rank outside the job.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace tpx {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::CommandResult;
using test::TempDir;

constexpr const char* kSmall = "--hidden 32 --heads 4 --ffn 64 --seq 8 --batch 2 --layers 1";

/// `mpirun <spec>` under a wall-clock limit; `spec` is "-np N <stage> <args>" or an MPMD list of
/// such groups joined by " : ".
CommandResult mpirun(const std::string& spec, const TempDir& dir, int timeout_s = 60) {
  return test::run_command(fmt::format("{} timeout {} {} {} {}", test::kRootMpiEnv, timeout_s,
                                       TPX_MPIEXEC, TPX_MPIEXEC_FLAGS, spec),
                           dir);
}

/// "-np N build/bin/<stage> <args>".
std::string group(int ranks, const std::string& stage, const std::string& args) {
  return fmt::format("-np {} {} {}", ranks, test::stage_binary(stage), test::block_task(args));
}

/// The lines a rank printed as errors ("<stage>: error: ..."); mpirun's own banners are not.
std::vector<std::string> error_lines(const CommandResult& r) {
  std::vector<std::string> out;
  for (const auto& line : test::lines_of(r.err))
    if (line.find(": error: ") != std::string::npos) out.push_back(line);
  return out;
}

/// Every one of `ranks` ranks stopped (the job exited with `code`, no step ran) and the error
/// every rank agreed on was printed once, in one line containing every string of `must_name`.
void expect_every_rank_refuses(const CommandResult& r, int ranks, int code,
                               const std::vector<std::string>& must_name) {
  EXPECT_NE(r.exit_code, 124) << "timed out (a rank waited for another forever)\n" << r.err;
  EXPECT_EQ(r.exit_code, code) << r.out << r.err;
  const auto lines = error_lines(r);
  EXPECT_EQ(lines.size(), 1u) << "the " << ranks << " ranks' one error, printed once:\n" << r.err;
  for (const auto& line : lines)
    for (const auto& s : must_name) EXPECT_NE(line.find(s), std::string::npos) << line;
  EXPECT_EQ(r.out.find("grad norm"), std::string::npos) << "it started training:\n" << r.out;
}

// --- 1 and 2: non-finite values ----------------------------------------------------------------

TEST(Divergence, CheckCannotPassOverNanLosses) {
  const TempDir dir;
  const auto r = mpirun(group(1, "01_baseline",
                              "--hidden 64 --heads 4 --ffn 128 --seq 16 --steps 3 --lr 1e15 "
                              "--check"),
                        dir);
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("PASS"), std::string::npos) << r.out;
}

TEST(Divergence, StopsEveryRankNamingTheStepAndKeepsTheStepsDone) {
  for (const auto& [stage, ranks] :
       std::vector<std::pair<std::string, int>>{{"01_baseline", 1}, {"03_sequence_parallel", 2}}) {
    const TempDir dir;
    const auto path = dir / "run.json";
    const auto r = mpirun(
        group(ranks, stage, fmt::format("{} --steps 4 --lr 1e15 --json {}", kSmall, path.string())),
        dir);
    EXPECT_EQ(r.exit_code, 3) << stage << "\n" << r.out << r.err;
    const auto lines = error_lines(r);
    EXPECT_EQ(lines.size(), 1u) << "printed once, not once per rank:\n" << r.err;
    for (const auto& line : lines)
      EXPECT_NE(line.find("loss is not finite at step 1 (lr 1e+15 too large?)"), std::string::npos)
          << line;
    ASSERT_TRUE(fs::exists(path)) << stage;
    const json j = json::parse(test::read_file(path));
    ASSERT_EQ(j.at("steps").size(), 1u) << stage;  // step 0 completed, step 1 diverged
    EXPECT_TRUE(std::isfinite(j["steps"][0]["loss"].get<double>()));
    EXPECT_NE(j.value("diverged", "").find("step 1"), std::string::npos) << j.dump();
  }
}

// --- 3: sizes that overflow ----------------------------------------------------------------------

TEST(Sizes, CountsThatOverflowAreAConfigError) {
  const TempDir dir;
  expect_every_rank_refuses(
      mpirun(group(1, "01_baseline",
                   "--seq 4611686018427387903 --batch 1 --hidden 2 --heads 1 --ffn 1"),
             dir),
      1, 2, {"too large", "64 bits"});
  expect_every_rank_refuses(mpirun(group(1, "01_baseline", "--ffn 99999999999999999999"), dir), 1,
                            2, {"--ffn", "out of range"});
  expect_every_rank_refuses(mpirun(group(1, "01_baseline", "--seed -1"), dir), 1, 2, {"--seed"});
  expect_every_rank_refuses(mpirun(group(2, "02_megatron_tp", "--hidden ''"), dir), 2, 2,
                            {"--hidden", "empty"});
}

// --- 4: memory ---------------------------------------------------------------------------------

TEST(Memory, TooLargeConfigsAreRefusedQuicklyOnEveryRank) {
  for (const auto& [stage, ranks, args] : std::vector<std::tuple<std::string, int, std::string>>{
           {"01_baseline", 1, "--hidden 65536 --heads 64 --ffn 262144 --seq 8192"},
           {"01_baseline", 1, "--layers 100000"},
           {"02_megatron_tp", 2, "--layers 100000"}}) {
    const TempDir dir;
    // One rank runs without mpirun (a singleton MPI job), so the time is the program's own.
    const std::string cmd = ranks == 1
                                ? fmt::format("{} timeout 60 {} {}", test::kRootMpiEnv,
                                              test::stage_binary(stage), test::block_task(args))
                                : "";
    const auto t0 = std::chrono::steady_clock::now();
    const auto r =
        ranks == 1 ? test::run_command(cmd, dir) : mpirun(group(ranks, stage, args), dir);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    expect_every_rank_refuses(r, ranks, 2, {"not enough memory", "biggest term", "available"});
    // MPI start-up included; the refusal itself is arithmetic. mpirun adds its own start-up.
    EXPECT_LT(s, ranks == 1 ? 2.0 : 10.0) << stage << " " << args;
    fmt::print("{} -np {} {}: refused in {:.2f} s\n", stage, ranks, args, s);
  }
}

TEST(Memory, CheckCountsTheWholeModelReferenceOnRankZero) {
  // Each of 2 ranks trains half the model, but --check then runs the whole unsharded model on
  // rank 0: that is rank 0's largest need, and the refusal must say so.
  const TempDir dir;
  const auto r = mpirun(group(2, "02_megatron_tp", "--layers 100000 --check"), dir);
  expect_every_rank_refuses(r, 2, 2, {"not enough memory", "--check reference"});
}

TEST(Memory, TheHeaderPrintsTheEstimate) {
  const TempDir dir;
  const auto path = dir / "run.json";
  const auto r = mpirun(
      group(1, "01_baseline", fmt::format("{} --steps 1 --json {}", kSmall, path.string())), dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("memory estimate per rank:"), std::string::npos) << r.out;
  const json j = json::parse(test::read_file(path));
  EXPECT_GT(j.at("memory_estimate_bytes").get<double>(), 0.0);
}

// --- 5: outputs whole or absent ---------------------------------------------------------------

TEST(Outputs, AnUnwritableJsonPathFailsBeforeTheFirstStepOnEveryRank) {
  const TempDir dir;
  expect_every_rank_refuses(
      mpirun(group(2, "02_megatron_tp", fmt::format("{} --json /nonexistent/x.json", kSmall)), dir),
      2, 2, {"--json", "/nonexistent"});
}

TEST(Outputs, AFullDiskIsAnErrorNamingThePathOnEveryRank) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "this system has no /dev/full";
  const TempDir dir;
  for (const char* flag : {"--json", "--trace"}) {
    const auto r = mpirun(
        group(2, "03_sequence_parallel", fmt::format("{} --steps 1 {} /dev/full", kSmall, flag)),
        dir);
    EXPECT_EQ(r.exit_code, 1) << flag << "\n" << r.err;
    const auto lines = error_lines(r);
    EXPECT_EQ(lines.size(), 1u) << "printed once, not once per rank:\n" << r.err;
    // The same one-line form as every other error: no source location in it.
    for (const auto& line : lines)
      EXPECT_EQ(line,
                "03_sequence_parallel: error: cannot write '/dev/full': No space left on "
                "device")
          << line;
  }
}

TEST(Outputs, AReusedDumpDirectoryLosesOnlyTheStagesStaleFiles) {
  const TempDir dir;
  const fs::path dump = dir / "dump";
  fs::create_directories(dump);
  for (const char* name : {"layers.1.wq.npy", "layers.3.w_down.grad.npy", "notes.txt"})
    std::ofstream(dump / name) << "from an earlier run";
  const auto r = mpirun(
      group(1, "01_baseline", fmt::format("{} --steps 1 --dump {}", kSmall, dump.string())), dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(dump / "layers.1.wq.npy")) << "a stale file of a larger run stayed";
  EXPECT_FALSE(fs::exists(dump / "layers.3.w_down.grad.npy"));
  EXPECT_TRUE(fs::exists(dump / "notes.txt")) << "a file that is not the stage's was removed";
  EXPECT_TRUE(fs::exists(dump / "layers.0.wq.npy"));
  for (const auto& e : fs::directory_iterator(dump))
    EXPECT_EQ(e.path().filename().string().find("tmp"), std::string::npos)
        << "a temporary was left: " << e.path();
}

TEST(Outputs, TwoJobsWritingOneDumpLeaveOneRunsWholeDump) {
  const TempDir dir;
  auto job = [&](int seed, const fs::path& dump) {
    return fmt::format(
        "{} timeout 60 {} {} {}", test::kRootMpiEnv, TPX_MPIEXEC, TPX_MPIEXEC_FLAGS,
        group(1, "06_fp8",
              fmt::format("{} --steps 1 --seed {} --dump {}", kSmall, seed, dump.string())));
  };
  // Each seed's dump on its own, then both at once into one directory.
  for (int seed : {1, 2})
    ASSERT_EQ(test::run_command(job(seed, dir / fmt::format("alone{}", seed)), dir).exit_code, 0);
  const fs::path shared = dir / "shared";
  const auto r = test::run_command(
      fmt::format("{} > /dev/null & a=$!; {} > /dev/null; b=$?; wait $a; echo $? $b",
                  job(1, shared), job(2, shared)),
      dir);
  EXPECT_EQ(r.out, "0 0\n") << r.err;
  // Every file comes from one run, the same run for all, and the set is that run's whole set.
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(shared))
    if (e.is_regular_file()) names.push_back(fs::relative(e.path(), shared).string());
  std::sort(names.begin(), names.end());
  int from = 0;
  for (int seed : {1, 2}) {
    const fs::path alone = dir / fmt::format("alone{}", seed);
    std::vector<std::string> want;
    for (const auto& e : fs::recursive_directory_iterator(alone))
      if (e.is_regular_file()) want.push_back(fs::relative(e.path(), alone).string());
    std::sort(want.begin(), want.end());
    bool all = names == want;
    for (const auto& name : names)
      all = all && test::read_file(shared / name) == test::read_file(alone / name);
    if (all) from = seed;
  }
  EXPECT_NE(from, 0) << "the dump is neither run's whole dump (" << names.size() << " files)";
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".shared."), std::string::npos)
        << "a temporary was left beside the dump: " << e.path();
}

// --- 6 and 7: ranks agree before they start ----------------------------------------------------

TEST(Agreement, RanksWithDifferentSizesStopNamingTheFlag) {
  const TempDir dir;
  const std::string base = "--heads 4 --ffn 64 --seq 8 --steps 1";
  expect_every_rank_refuses(mpirun(group(1, "02_megatron_tp", base + " --hidden 64") + " : " +
                                       group(1, "02_megatron_tp", base + " --hidden 128"),
                                   dir),
                            2, 2, {"--hidden", "64 on rank 0", "128 on rank 1"});
}

TEST(Agreement, RanksWithDifferentSeedsOrStagesStop) {
  const TempDir dir;
  expect_every_rank_refuses(
      mpirun(group(1, "03_sequence_parallel", std::string(kSmall)) + " : " +
                 group(1, "03_sequence_parallel", fmt::format("{} --seed 7", kSmall)),
             dir),
      2, 2, {"--seed", "rank 1"});
  expect_every_rank_refuses(
      mpirun(group(1, "02_megatron_tp", kSmall) + " : " + group(1, "03_sequence_parallel", kSmall),
             dir),
      2, 2, {"stage", "02_megatron_tp", "03_sequence_parallel"});
}

TEST(Agreement, ABadFlagOnOneRankEndsEveryRank) {
  const TempDir dir;
  expect_every_rank_refuses(mpirun(group(1, "02_megatron_tp", kSmall) + " : " +
                                       group(1, "02_megatron_tp", std::string(kSmall) + " --bogus"),
                                   dir, /*timeout_s=*/30),
                            2, 2, {"rank 1", "--bogus"});
}

TEST(Agreement, AnUnknownFlagIsSaidOnceWithTheClosestFlag) {
  // Every rank has the same typo: one line, naming no rank, with the flag it meant.
  const TempDir dir;
  const auto r = mpirun(group(2, "02_megatron_tp", std::string(kSmall) + " --layer 3"), dir);
  expect_every_rank_refuses(r, 2, 2, {"--layer: did you mean --layers?"});
  for (const auto& line : error_lines(r))
    EXPECT_EQ(line.find("rank "), std::string::npos) << "all ranks agree: no rank named\n" << line;
}

TEST(Agreement, AnOutputFlagGivenToOneRankStopsEveryRank) {
  const TempDir dir;
  const std::string base = std::string(kSmall) + " --steps 1";
  const std::string out = (dir / "out.json").string();
  expect_every_rank_refuses(mpirun(group(1, "05_copy_engine_async_tp", base) + " : " +
                                       group(1, "05_copy_engine_async_tp", base + " --json " + out),
                                   dir),
                            2, 2, {"--json", "not given on rank 0", "out.json' on rank 1"});
  EXPECT_FALSE(fs::exists(out));
}

TEST(Agreement, ACommTimeoutBelowTheFloorIsRefused) {
  const TempDir dir;
  expect_every_rank_refuses(
      mpirun(group(2, "02_megatron_tp", fmt::format("{} --comm-timeout 0.05", kSmall)), dir), 2, 2,
      {"--comm-timeout", "at least 0.1 s", "0.05"});
}

// --- 8: fault injection ------------------------------------------------------------------------

TEST(FaultFlag, ARankOutsideTheJobIsRejected) {
  const TempDir dir;
  expect_every_rank_refuses(
      mpirun(group(2, "02_megatron_tp", fmt::format("{} --fault-skip-collective 5:3", kSmall)),
             dir),
      2, 2, {"--fault-skip-collective", "rank 5", "0..1"});
}

TEST(FaultFlag, ParseErrorsNameTheFlag) {
  const TempDir dir;
  expect_every_rank_refuses(
      mpirun(group(2, "02_megatron_tp", fmt::format("{} --fault-skip-collective 1-3", kSmall)),
             dir),
      2, 2, {"--fault-skip-collective", "RANK:SEQ"});
}

TEST(FaultFlag, TheSingleDeviceStageRejectsComm) {
  const TempDir dir;
  expect_every_rank_refuses(mpirun(group(1, "01_baseline", "--comm nccl"), dir), 1, 2,
                            {"--comm", "01_baseline", "one device"});
}

}  // namespace
}  // namespace tpx
