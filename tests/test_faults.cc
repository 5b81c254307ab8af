// The flight recorder's one verdict, end to end: every multi-rank stage under mpirun with one
// failure on one chosen rank — a collective (or ring step) it skips, a signal it never sends, a
// copy that takes three timeouts, or the whole rank stopped by SIGSTOP — must end on its own, well
// within the comm timeout plus a few seconds, with a non-zero exit and exactly ONE verdict line
// that names that rank and the operation (checked against the rank's own dump of its last ops),
// never a healthy rank, and never the word "fault" (an injected failure reads like a real one);
// the verdict is the first non-empty line on stderr, before the ranks' records and Open MPI's
// lines about the abort. Stage 07 runs on a 2 × 2 mesh and stage 08 on a CP ring of 3, and their
// verdicts also name the group and the rank's number in it; stage 07 is also stopped three times
// as D 2 × T 1, where the peer often waits in the step's loss or norm sum (a watched report
// gather: a bare MPI call there would leave it waiting forever). Stage 09 runs as a pipeline of P 2
// (its stages issue different ops by design: the verdict must compare each send with its receive)
// and of P 2 × C 2 (a CP ring inside each pipeline stage); each of its skips is tried three times.
// A stopped rank is named within the comm timeout plus the ranks' grace to answer (a quarter of
// the timeout, at least 0.5 s), not two timeouts: the op the reporting rank waits in has been in
// flight less than 1.3 × the timeout plus 0.5 s when the verdict is written (its own record
// says), and the verdict is on stderr less than 1.3 × the timeout plus 2.5 s after the SIGSTOP
// (the peers first run on until they need the stopped rank, slowly on a loaded machine).
//
// And a fault that no rank can notice: stage 09's collective that has no peer (an all-gather in a
// TP group of one) still runs, and the run says in one line that the fault did not fire, exits 1
// and writes no --json; so does a fault past the run's last collective.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <ostream>
#include <regex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace tpx {
namespace {

enum class Failure { skip_collective, skip_signal, delay_copy, stop };

const char* name_of(Failure f) {
  switch (f) {
    case Failure::skip_collective:
      return "SkipCollective";
    case Failure::skip_signal:
      return "SkipSignal";
    case Failure::delay_copy:
      return "DelayCopy";
    case Failure::stop:
      return "Stop";
  }
  return "?";
}

struct Case {
  std::string stage;
  Failure failure;
  int cp = 1;             ///< stage 09: --cp (P 2 × C cp)
  bool replicas = false;  ///< stage 07 as D 2 × T 1: two ranks, only the DP group between them
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.stage << " " << name_of(c.failure) << (c.cp > 1 ? " C2" : "")
      << (c.replicas ? " D2" : "");
}

constexpr double kTimeout = 2.0;  // --comm-timeout of every run
constexpr double kGrace = 0.5;    // how long the reporter waits for answers (timeout / 4, >= 0.5)

bool mesh(const Case& c) {
  return c.stage == "07_fsdp_tp";
}
bool context_parallel(const Case& c) {
  return c.stage == "08_context_parallel";
}
bool pipeline(const Case& c) {
  return c.stage == "09_pipeline_parallel";
}
int ranks_of(const Case& c) {
  if (pipeline(c)) return 2 * c.cp;
  if (c.replicas) return 2;
  return mesh(c) ? 4 : 3;
}
/// The rank that fails: not rank 0, which prints the steps; on the mesh, one in the second TP
/// group and the second DP group.
int culprit_of(const Case& c) {
  return mesh(c) && !c.replicas ? 3 : 1;
}

/// The case's sizes and steps.
std::string stage_shape_args(const Case& c, int steps) {
  // Stage 09: messages of 128 KiB ([128, 1, 256] fp32), past MPI's eager limit, so that a
  // send waits for its receive.
  if (pipeline(c))
    return fmt::format(
        "--hidden 256 --heads 2 --ffn 512 --seq 128 --batch 2 --pp 2 --cp {} "
        "--steps {} --comm-timeout {}",
        c.cp, steps, kTimeout);
  const std::string shape = mesh(c) ? "--hidden 96 --heads 2 --ffn 384 --seq 96 --batch 2"
                                    : "--hidden 96 --heads 3 --ffn 384 --seq 96";
  // Stage 08 as C = 3, T = 1: its 30th collective (the skipped one) is a K/V ring hop.
  return fmt::format("{}{} --steps {} --comm-timeout {}", shape,
                     context_parallel(c) ? " --cp 3"
                     : c.replicas        ? " --dp 2"
                                         : "",
                     steps, kTimeout);
}

/// The case's flags: the blocks alone, whose collectives the cases count.
std::string stage_args(const Case& c, int steps) {
  return test::block_task(stage_shape_args(c, steps));
}

std::string fault_flag(const Case& c) {
  const int r = culprit_of(c);
  switch (c.failure) {
    case Failure::skip_collective:
      // Stage 09: P 2, rank 1's op #1 is its receive of micro-batch 1's activation from rank 0;
      // P 2 × C 2, rank 1's op #5 a K/V hop of the CP ring in pipeline stage 0.
      if (pipeline(c)) return fmt::format("--fault-skip-collective {}:{}", r, c.cp > 1 ? 5 : 1);
      return fmt::format("--fault-skip-collective {}:30", r);
    case Failure::skip_signal:
      return fmt::format("--fault-skip-signal {}:10", r);
    case Failure::delay_copy:
      return fmt::format("--fault-delay-copy {}:7", r);
    case Failure::stop:
      return "";
  }
  return "";
}

struct FaultRun {
  test::CommandResult result;
  double seconds = 0;  ///< from the failure (the start; for a stop, the SIGSTOP) to the end
  double named = 0;    ///< for a stop: from the SIGSTOP to the watchdog's first line on stderr
};

/// Runs the case. A stop runs many steps, waits for step 3's row, stops the culprit's process
/// (found through a wrapper that records its pid) and measures from there: until the verdict
/// appears on stderr (polled every 20 ms) and until the job has ended.
FaultRun run_case(const Case& c, const test::TempDir& dir) {
  const std::string mpirun = fmt::format("{} timeout 90 {} --oversubscribe --bind-to none -np {}",
                                         test::kRootMpiEnv, TPX_MPIEXEC, ranks_of(c));
  const std::string stage = test::stage_binary(c.stage);
  FaultRun run;
  const auto t0 = std::chrono::steady_clock::now();
  if (c.failure != Failure::stop) {
    run.result = test::run_command(fmt::format("cd '{}' && {} {} {} {}", dir.path().string(),
                                               mpirun, stage, stage_args(c, 20), fault_flag(c)),
                                   dir);
  } else {
    const std::string wrapped = fmt::format(
        "sh -c 'if [ \"$OMPI_COMM_WORLD_RANK\" = {} ]; then echo $$ > pid; fi; exec {} {}'",
        culprit_of(c), stage, stage_args(c, 100000));
    run.result = test::run_command(
        fmt::format("cd '{}' && {{ {} {} > out.txt 2> err.txt & }}; job=$!; "
                    "i=0; while [ $i -lt 600 ] && ! grep -qE '^ +3 ' out.txt 2>/dev/null; do "
                    "sleep 0.05; i=$((i+1)); done; "
                    "kill -STOP $(cat pid); date +%s.%N > stopped; "
                    "i=0; while [ $i -lt 3000 ] && ! grep -q '^tpx: comm watchdog:' err.txt; do "
                    "sleep 0.02; i=$((i+1)); done; date +%s.%N > named; "
                    "wait $job; rc=$?; date +%s.%N > ended; "
                    "kill -KILL $(cat pid) 2>/dev/null; cat out.txt; cat err.txt >&2; exit $rc",
                    dir.path().string(), mpirun, wrapped),
        dir);
    // The shell's clock, in seconds; a missing file reads as 0 and fails the time check.
    auto seconds_in = [&dir](const char* name) {
      const std::string text = test::read_file(dir / name);
      return text.empty() ? 0.0 : std::strtod(text.c_str(), nullptr);
    };
    run.seconds = seconds_in("ended") - seconds_in("stopped");
    run.named = seconds_in("named") - seconds_in("stopped");
    return run;
  }
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

/// The lines that are the verdict: the watchdog's lines that are not the heading of a rank's
/// dump of its last ops.
std::vector<std::string> verdicts_in(const std::string& err) {
  std::vector<std::string> out;
  for (const auto& line : test::lines_of(err))
    if (line.rfind("tpx: comm watchdog:", 0) == 0 && line.find("last ops") == std::string::npos)
      out.push_back(line);
  return out;
}

/// The first line of `text` that is not empty.
std::string first_line(const std::string& text) {
  for (const auto& line : test::lines_of(text))
    if (line.find_first_not_of(" \t\r") != std::string::npos) return line;
  return {};
}

/// Rank r's dump line of op #seq, if it printed one.
std::string dump_line(const std::string& err, int r, const std::string& seq) {
  for (const auto& line : test::lines_of(err))
    if (line.rfind(fmt::format("[rank {}] ", r), 0) == 0 &&
        line.find(fmt::format(" #{} ", seq)) != std::string::npos)
      return line;
  return {};
}

/// How long the op the reporting rank names as its oldest in flight had been waiting when the
/// verdict was written: its age in the reporter's own dump ("it reports: …; op #k … is the
/// oldest in flight"); -1 when the dump does not show it.
double reported_wait(const std::string& err) {
  std::smatch m;
  if (!std::regex_search(err, m,
                         std::regex(R"(rank (\d+) last ops \(it reports: .*?; op #(\d+) )")))
    return -1;
  const std::string line = dump_line(err, std::stoi(m[1]), m[2]);
  std::smatch age;
  if (!std::regex_search(line, age, std::regex(R"(([\d.]+) +\S+ +\S+  in flight$)"))) return -1;
  return std::stod(age[1]);
}

class Faults : public ::testing::TestWithParam<Case> {};

void expect_one_verdict(const Case& c) {
  const int r = culprit_of(c);
  test::TempDir dir;
  const FaultRun run = run_case(c, dir);
  const std::string& err = run.result.err;
  if (c.failure == Failure::stop) {
    // The stop is made by the shell; the job must end without it, long before `timeout`.
    EXPECT_EQ(run.result.out.find("tpx"), 0u) << "the job did not start\n" << err;
  }
  EXPECT_NE(run.result.exit_code, 0) << err;
  EXPECT_NE(run.result.exit_code, 124) << "the job hung until `timeout` killed it\n" << err;
  if (c.failure == Failure::stop) {
    // The verdict on a stopped rank: the timeout plus the grace, not two timeouts. Then mpirun
    // ends the job, which takes it a second or two for a stopped process.
    const double waited = reported_wait(err);
    EXPECT_GT(waited, kTimeout) << err;
    EXPECT_LT(waited, 1.3 * kTimeout + 0.5) << err;
    EXPECT_LT(run.named, 1.3 * kTimeout + 2.5) << err;
    EXPECT_LT(run.seconds, run.named + 5.0) << err;
  } else {
    // Start-up (about a second on an oversubscribed machine) plus the timeout and the grace.
    EXPECT_LT(run.seconds, kTimeout + kGrace + 10.0) << err;
  }

  const auto verdicts = verdicts_in(err);
  ASSERT_EQ(verdicts.size(), 1u) << err;
  const std::string& v = verdicts[0];
  // The verdict is the first thing a user reads: before the ranks' records and before Open MPI's
  // lines about the abort.
  EXPECT_EQ(first_line(err), v) << err;
  EXPECT_EQ(v.find("fault"), std::string::npos) << v;
  EXPECT_EQ(v.find("has not issued"), std::string::npos) << v;
  EXPECT_EQ(
      v.rfind(fmt::format("tpx: comm watchdog: an op did not complete in {:.1f} s; ", kTimeout), 0),
      0u)
      << v;
  // How the verdict names the rank: on the mesh with its group and its number in it.
  const std::string who =
      pipeline(c)
          ? fmt::format(
                fmt::runtime(c.cp > 1 ? R"(rank {} \(rank \d of cp group [\d.]+ of pp 0\))"
                                      : R"(rank {} \(rank \d of pp group [\d.]+ act even\))"),
                r)
      : mesh(c)             ? fmt::format(R"(rank {} \(rank \d of (tp|dp) group \d\))", r)
      : context_parallel(c) ? fmt::format(R"(rank {} \(rank \d of (cp|dp×cp) group [\d.]+\))", r)
                            : fmt::format("rank {}", r);
  std::smatch m;
  switch (c.failure) {
    case Failure::skip_collective:
    case Failure::skip_signal: {
      ASSERT_TRUE(
          std::regex_search(v, m,
                            std::regex(fmt::format(
                                R"(first difference at op #(\d+) \((.+?)\): {} skipped it)", who))))
          << v;
      const std::string op = m[2];
      const bool signal = op.rfind("signal to ", 0) == 0;
      EXPECT_EQ(signal, c.failure == Failure::skip_signal) << v;
      if (!signal) {
        EXPECT_NE(op.rfind("pull", 0), 0u) << v;
      }
      // The rank's own record has that op, described alike, as skipped.
      const std::string line = dump_line(err, r, m[1]);
      EXPECT_NE(line.find(op), std::string::npos) << v << "\n" << err;
      EXPECT_NE(line.find("skipped"), std::string::npos) << line;
      break;
    }
    case Failure::delay_copy: {
      ASSERT_TRUE(std::regex_search(
          v, m,
          std::regex(fmt::format(R"(op #(\d+) \((pull .+?)\) did not complete on {};)", who))))
          << v;
      const std::string line = dump_line(err, r, m[1]);
      EXPECT_NE(line.find("in flight"), std::string::npos) << line << "\n" << err;
      break;
    }
    case Failure::stop: {
      EXPECT_NE(v.find(fmt::format("; rank {} did not answer", r)), std::string::npos) << v;
      EXPECT_TRUE(std::regex_search(v, std::regex(R"(the others wait in op #\d+ \(.+\))"))) << v;
      break;
    }
  }
}

TEST_P(Faults, OneVerdictNamesTheRankAndTheOperation) {
  const Case c = GetParam();
  // Stage 09's skips three times: which ops are in flight when the watchdog fires varies with
  // the threads' timing, and the verdict must not.
  // Stage 07's replicas three times: where the stop finds the peer (a weight gather, a
  // reduce-scatter, a loss or norm sum) varies from run to run.
  const int tries = (pipeline(c) && c.failure == Failure::skip_collective) || c.replicas ? 3 : 1;
  for (int i = 0; i < tries; ++i) {
    SCOPED_TRACE(fmt::format("try {} of {}", i + 1, tries));
    expect_one_verdict(c);
    if (HasFatalFailure()) return;
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* stage : {"02_megatron_tp", "03_sequence_parallel", "04_overlap_ring"})
    for (Failure f : {Failure::skip_collective, Failure::stop}) cases.push_back({stage, f});
  for (const char* stage : {"05_copy_engine_async_tp", "06_fp8", "07_fsdp_tp"})
    for (Failure f :
         {Failure::skip_collective, Failure::skip_signal, Failure::delay_copy, Failure::stop})
      cases.push_back({stage, f});
  // D 2 × T 1: a stopped replica leaves its peer waiting where only the DP group meets, the
  // step's loss and norm sums among them (report gathers the recorder watches).
  cases.push_back({"07_fsdp_tp", Failure::stop, 1, true});
  for (Failure f : {Failure::skip_collective, Failure::stop})  // T = 1: no copy-engine pulls
    cases.push_back({"08_context_parallel", f});
  for (int cp : {1, 2})
    for (Failure f : {Failure::skip_collective, Failure::stop})
      cases.push_back({"09_pipeline_parallel", f, cp});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stages, Faults, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& p) {
                           return fmt::format("Stage{}{}{}{}", p.param.stage.substr(0, 2),
                                              p.param.cp > 1 ? "C2" : "",
                                              p.param.replicas ? "D2" : "",
                                              name_of(p.param.failure));
                         });

// --- a fault no rank can notice ------------------------------------------------------------------

/// Stage 09 as P 2 for one step with `extra` flags and a --json in `dir`.
test::CommandResult run_pipeline_step(const test::TempDir& dir, const std::string& extra) {
  const Case c{"09_pipeline_parallel", Failure::skip_collective};
  const std::string mpirun = fmt::format("{} timeout 90 {} --oversubscribe --bind-to none -np 2",
                                         test::kRootMpiEnv, TPX_MPIEXEC);
  return test::run_command(
      fmt::format("cd '{}' && {} {} {}", dir.path().string(), mpirun, test::stage_binary(c.stage),
                  fmt::format("{} --json out.json {}", stage_args(c, 1), extra)),
      dir);
}

/// Step 0's row of a stage's output (its loss and gradient norm), or "" when there is none.
std::string step0_row(const std::string& out) {
  const std::regex row(R"(^ +0 +(\S+) +(\S+) )");
  for (const auto& line : test::lines_of(out))
    if (std::smatch m; std::regex_search(line, m, row)) return m[1].str() + " " + m[2].str();
  return {};
}

/// The stage's own error lines on stderr (not Open MPI's).
std::vector<std::string> stage_errors(const std::string& err) {
  std::vector<std::string> lines;
  for (const auto& line : test::lines_of(err))
    if (line.rfind("09_pipeline_parallel: ", 0) == 0) lines.push_back(line);
  return lines;
}

TEST(FaultNoRankCanNotice, AnAllGatherOfAOneRankGroupStillRunsAndTheRunSaysSo) {
  // P 2, T 1: rank 1's collective 8 is step 0's loss gather in its TP group of one rank. Its
  // output is its input; skipped, it held whatever the buffer held (a loss of -1.97e28). It must
  // run, the step's loss must be the healthy run's, and the run must not pass: one line, exit 1,
  // no --json.
  test::TempDir healthy_dir, dir;
  const test::CommandResult healthy = run_pipeline_step(healthy_dir, "");
  ASSERT_EQ(healthy.exit_code, 0) << healthy.err;
  const test::CommandResult r = run_pipeline_step(dir, "--fault-skip-collective 1:8");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_FALSE(step0_row(healthy.out).empty()) << healthy.out;
  EXPECT_EQ(step0_row(r.out), step0_row(healthy.out)) << r.out;
  const auto errors = stage_errors(r.err);
  ASSERT_EQ(errors.size(), 1u) << r.err;
  EXPECT_EQ(errors[0].rfind("09_pipeline_parallel: error: --fault-skip-collective 1:8 did not "
                            "fire: rank 1's collective 8 (op #",
                            0),
            0u)
      << errors[0];
  EXPECT_TRUE(std::regex_search(errors[0], std::regex(R"(: all_gather \S+ \d+ B in tp group )")))
      << errors[0];
  EXPECT_NE(errors[0].find("no other rank taking part"), std::string::npos) << errors[0];
  EXPECT_EQ(r.err.find("comm watchdog"), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::exists(healthy_dir / "out.json"));
  EXPECT_FALSE(std::filesystem::exists(dir / "out.json")) << "a run that failed wrote --json";
}

TEST(FaultNoRankCanNotice, AFaultPastTheLastCollectiveIsReportedAtTheEnd) {
  test::TempDir dir;
  const test::CommandResult r = run_pipeline_step(dir, "--fault-skip-collective 1:1000000");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  const auto errors = stage_errors(r.err);
  ASSERT_EQ(errors.size(), 1u) << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_match(
      errors[0], m,
      std::regex(R"(09_pipeline_parallel: error: --fault-skip-collective 1:1000000 never fired: )"
                 R"(rank 1 issued (\d+) collectives \(0 … (\d+)\))")))
      << errors[0];
  EXPECT_EQ(std::stoi(m[1]), std::stoi(m[2]) + 1) << errors[0];
  EXPECT_GT(std::stoi(m[1]), 1) << errors[0];
  EXPECT_FALSE(std::filesystem::exists(dir / "out.json"));
}

}  // namespace
}  // namespace tpx
