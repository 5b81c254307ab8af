// The flight recorder's ring, the cross-rank disagreement analysis, shared-GPU detection and the
// communicator's command-line flags, without MPI; and the watchdog end to end: an MPI job with an
// injected fault (one rank skips a collective) must abort quickly with every rank's recent ops
// and one line naming the sequence number at which the ranks disagree.
#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/cli.h"
#include "common/comm/communicator.h"
#include "common/comm/flight_recorder.h"
#include "test_util.h"

namespace tpx {
namespace {

// --- the ring ------------------------------------------------------------------------------------

TEST(FlightRecorder, NumbersOpsAndKeepsTheirFields) {
  FlightRecorder rec;
  const auto a = rec.begin(CommOp::all_reduce, DType::f32, 256, 1024);
  const auto b = rec.begin(CommOp::broadcast, DType::bf16, 8, 16, /*peer=*/3);
  const auto c = rec.begin(CommOp::sendrecv, DType::f32, 4, 16, /*peer=*/1, /*src=*/2);
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 1u);
  EXPECT_EQ(c, 2u);
  rec.started(a);
  rec.finish(a, OpState::done);
  rec.finish(b, OpState::skipped);

  const auto ops = rec.snapshot();
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(rec.next_seq(), 3u);
  EXPECT_EQ(ops[0].op, CommOp::all_reduce);
  EXPECT_EQ(ops[0].count, 256);
  EXPECT_EQ(ops[0].bytes, 1024u);
  EXPECT_EQ(ops[0].state, OpState::done);
  EXPECT_LE(ops[0].enqueue_s, ops[0].start_s);
  EXPECT_LE(ops[0].start_s, ops[0].end_s);
  EXPECT_EQ(ops[1].dtype, DType::bf16);
  EXPECT_EQ(ops[1].peer, 3);
  EXPECT_EQ(ops[1].state, OpState::skipped);
  EXPECT_EQ(ops[2].peer, 1);
  EXPECT_EQ(ops[2].src, 2);
  EXPECT_EQ(ops[2].state, OpState::in_flight);
  EXPECT_LT(ops[2].end_s, 0.0);

  const auto oldest = rec.oldest_in_flight();
  ASSERT_TRUE(oldest.has_value());
  EXPECT_EQ(oldest->seq, 2u);
  rec.finish(c, OpState::done);
  EXPECT_FALSE(rec.oldest_in_flight().has_value());
}

TEST(FlightRecorder, KeepsTheLast64Ops) {
  FlightRecorder rec(64);
  ASSERT_EQ(rec.capacity(), 64u);
  for (int i = 0; i < 100; ++i) rec.begin(CommOp::barrier, DType::f32, 0, 0);
  rec.finish(10, OpState::failed);  // long gone from the ring: ignored
  rec.finish(99, OpState::done);
  const auto ops = rec.snapshot();
  ASSERT_EQ(ops.size(), 64u);
  for (std::size_t i = 0; i < ops.size(); ++i) EXPECT_EQ(ops[i].seq, 36 + i);
  EXPECT_EQ(ops.back().state, OpState::done);
  for (std::size_t i = 0; i + 1 < ops.size(); ++i) EXPECT_EQ(ops[i].state, OpState::in_flight);
  EXPECT_EQ(rec.next_seq(), 100u);
  EXPECT_EQ(rec.oldest_in_flight()->seq, 36u);
}

TEST(FlightRecorder, DumpNamesEveryOp) {
  FlightRecorder rec;
  rec.begin(CommOp::all_gather, DType::f32, 64, 256);
  rec.finish(0, OpState::done);
  rec.begin(CommOp::all_reduce, DType::f32, 16, 64);
  const auto ops = rec.snapshot();
  const auto lines = test::lines_of(format_ops(ops, FlightRecorder::now(), "[rank 3] "));
  ASSERT_EQ(lines.size(), 3u);  // header + 2 ops
  for (const auto& l : lines) EXPECT_EQ(l.rfind("[rank 3] ", 0), 0u) << l;
  EXPECT_NE(lines[1].find("#0"), std::string::npos);
  EXPECT_NE(lines[1].find("all_gather fp32[64] 256 B"), std::string::npos);
  EXPECT_NE(lines[1].find("done"), std::string::npos);
  EXPECT_NE(lines[2].find("#1"), std::string::npos);
  EXPECT_NE(lines[2].find("in flight"), std::string::npos);
}

// --- the disagreement analysis -------------------------------------------------------------------

OpRecord op(std::uint64_t seq, CommOp kind = CommOp::all_reduce, std::uint64_t bytes = 1024,
            OpState state = OpState::done, int peer = -1) {
  OpRecord r;
  r.seq = seq;
  r.op = kind;
  r.bytes = bytes;
  r.count = static_cast<std::int64_t>(bytes / 4);
  r.state = state;
  r.peer = peer;
  r.sized = true;  // run, not only booked
  return r;
}

/// A rank that issued ops [first, next) all-reduces of 1024 B, all done.
RankOps ranks_ops(int rank, std::uint64_t first, std::uint64_t next) {
  RankOps r{rank, true, next, {}};
  for (std::uint64_t s = first; s < next; ++s) r.ops.push_back(op(s));
  return r;
}

bool has(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

TEST(Diagnose, NothingToBlameWhenEveryRankRecordedTheSameOps) {
  const std::vector<RankOps> ranks{ranks_ops(0, 0, 8), ranks_ops(1, 0, 8), ranks_ops(2, 0, 8)};
  const Verdict v = diagnose(ranks);
  EXPECT_FALSE(v.seq.has_value()) << v.text;
  EXPECT_TRUE(v.ranks.empty()) << v.text;
  EXPECT_TRUE(has(v.text, "through #7")) << v.text;
}

TEST(Diagnose, NamesTheRankThatSkippedAnOpAndNoOther) {
  // Rank 1 skipped op 5 and went on to op 10; ranks 0 and 2 wait in op 5.
  std::vector<RankOps> ranks{ranks_ops(0, 0, 6), ranks_ops(1, 0, 11), ranks_ops(2, 0, 6)};
  ranks[0].ops[5].state = OpState::in_flight;
  ranks[2].ops[5].state = OpState::in_flight;
  ranks[1].ops[5].state = OpState::skipped;
  ranks[1].ops[10].state = OpState::in_flight;
  const Verdict v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value()) << v.text;
  EXPECT_EQ(*v.seq, 5u);
  EXPECT_EQ(v.ranks, std::vector<int>{1});
  EXPECT_TRUE(has(v.text,
                  "first difference at op #5 (all_reduce fp32[256] 1024 B): rank 1 "
                  "skipped it"))
      << v.text;
  EXPECT_FALSE(has(v.text, "rank 0")) << v.text;
  EXPECT_FALSE(has(v.text, "rank 2")) << v.text;
}

TEST(Diagnose, ARankWaitingInAnOpIsNotBlamedForTheOpsAfterIt) {
  // Ranks 0 and 1 issued 9 ops; rank 2 is still in op 6: it waits, it has not lagged.
  std::vector<RankOps> ranks{ranks_ops(0, 0, 9), ranks_ops(1, 0, 9), ranks_ops(2, 0, 7)};
  ranks[2].ops[6].state = OpState::in_flight;
  const Verdict v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value());
  EXPECT_EQ(*v.seq, 6u);
  EXPECT_EQ(v.ranks, std::vector<int>{2});
  EXPECT_TRUE(has(v.text,
                  "op #6 (all_reduce fp32[256] 1024 B) did not complete on rank 2; "
                  "ranks 0, 1 completed it"))
      << v.text;
  EXPECT_FALSE(has(v.text, "has not issued")) << v.text;
}

TEST(Diagnose, ARankWithNothingInFlightThatHasNotIssuedTheOpIsBlamed) {
  // Ranks 0 and 1 wait in op 7; rank 2 has completed 0..6 and issued nothing since.
  std::vector<RankOps> ranks{ranks_ops(0, 0, 8), ranks_ops(1, 0, 8), ranks_ops(2, 0, 7)};
  ranks[0].ops[7].state = OpState::in_flight;
  ranks[1].ops[7].state = OpState::in_flight;
  const Verdict v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value());
  EXPECT_EQ(*v.seq, 7u);
  EXPECT_EQ(v.ranks, std::vector<int>{2});
  EXPECT_TRUE(has(v.text, "rank 2 has not issued it (its last op is #6, done)")) << v.text;
}

TEST(Diagnose, FindsADifferentOpSizeOrRoot) {
  std::vector<RankOps> ranks{ranks_ops(0, 0, 6), ranks_ops(1, 0, 6), ranks_ops(2, 0, 6)};
  ranks[1].ops[3] = op(3, CommOp::all_gather, 512);
  Verdict v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value());
  EXPECT_EQ(*v.seq, 3u);
  EXPECT_EQ(v.ranks, std::vector<int>{1});
  EXPECT_TRUE(has(v.text, "rank 1 issued all_gather fp32[128] 512 B instead")) << v.text;
  EXPECT_TRUE(has(v.text, "the others: all_reduce fp32[256] 1024 B")) << v.text;

  ranks[1].ops[3] = op(3);
  ranks[2].ops[4] = op(4, CommOp::all_reduce, 2048);
  v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value());
  EXPECT_EQ(*v.seq, 4u);
  EXPECT_EQ(v.ranks, std::vector<int>{2});

  ranks[2].ops[4] = op(4);
  for (auto& r : ranks) r.ops[2] = op(2, CommOp::broadcast, 64, OpState::done, /*root=*/0);
  ranks[0].ops[2].peer = 1;
  v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value());
  EXPECT_EQ(*v.seq, 2u);
  EXPECT_TRUE(has(v.text, "rank 0 issued broadcast")) << v.text;
}

TEST(Diagnose, ABookedOpItsLaneHasNotRunYetDiffersFromNoOne) {
  // Rank 0's lane has run op 5 (a reduce-scatter, sized); ranks 1 and 2 booked it in program
  // order but their lanes have not reached it: no sizes yet. That is waiting, not a difference.
  std::vector<RankOps> ranks{ranks_ops(0, 0, 6), ranks_ops(1, 0, 6), ranks_ops(2, 0, 6)};
  ranks[0].ops[5] = op(5, CommOp::reduce_scatter, 4096, OpState::in_flight);
  for (int r : {1, 2}) {
    OpRecord booked = op(5, CommOp::reduce_scatter, 0, OpState::in_flight);
    booked.sized = false;
    ranks[static_cast<std::size_t>(r)].ops[5] = booked;
  }
  Verdict v = diagnose(ranks);
  EXPECT_FALSE(has(v.text, "instead")) << v.text;
  EXPECT_FALSE(has(v.text, "first difference")) << v.text;
  // A booked op of another kind is still a difference.
  ranks[2].ops[5].op = CommOp::all_gather;
  v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value()) << v.text;
  EXPECT_EQ(v.ranks, std::vector<int>{2});
  EXPECT_TRUE(has(v.text, "rank 2 issued all_gather")) << v.text;
}

TEST(Diagnose, PointToPointPeersAndSizesMayDiffer) {
  std::vector<RankOps> ranks{ranks_ops(0, 0, 4), ranks_ops(1, 0, 4)};
  ranks[0].ops[1] = op(1, CommOp::sendrecv, 64, OpState::done, /*peer=*/1);
  ranks[1].ops[1] = op(1, CommOp::sendrecv, 128, OpState::done, /*peer=*/0);
  const Verdict v = diagnose(ranks);
  EXPECT_FALSE(v.seq.has_value()) << v.text;
}

TEST(Diagnose, ARankThatDoesNotAnswerIsBlamedNotTheOnesWaitingForIt) {
  // Rank 1 stopped: rank 0 waits in op 4, rank 2 is further on and waits in op 9 (it got there
  // before rank 1 stopped answering its signals). Neither is to blame.
  std::vector<RankOps> ranks{ranks_ops(0, 0, 5), RankOps{1, false, 0, {}}, ranks_ops(2, 0, 10)};
  ranks[0].ops[4].state = OpState::in_flight;
  ranks[2].ops[9].state = OpState::in_flight;
  const Verdict v = diagnose(ranks);
  EXPECT_EQ(v.ranks, std::vector<int>{1});
  ASSERT_TRUE(v.seq.has_value());
  EXPECT_EQ(*v.seq, 4u);
  EXPECT_TRUE(has(v.text, "rank 1 did not answer")) << v.text;
  EXPECT_TRUE(has(v.text, "the others wait in op #4")) << v.text;
  EXPECT_FALSE(has(v.text, "has not issued")) << v.text;
}

TEST(Diagnose, FollowsASignalWaitToThePeerThatHoldsTheJobUp) {
  // Rank 0 waits (op 3) for rank 2's signal; rank 2's pull (op 5) is stuck; rank 1 is done with
  // both and waits for rank 2 in op 7.
  std::vector<RankOps> ranks{ranks_ops(0, 0, 4), ranks_ops(1, 0, 8), ranks_ops(2, 0, 6)};
  for (auto& r : ranks)
    for (auto& o : r.ops) o.op = CommOp::pull, o.bytes = 64;
  ranks[0].ops[3].op = CommOp::signal_wait;
  ranks[1].ops[3].op = CommOp::signal_wait;
  ranks[2].ops[3].op = CommOp::signal_wait;
  ranks[0].ops[3].state = OpState::in_flight;
  ranks[0].ops[3].src = ranks[0].ops[3].src_job = 2;
  ranks[2].ops[5].state = OpState::in_flight;
  ranks[2].ops[5].src = 0;
  ranks[1].ops[7] = op(7, CommOp::signal_wait, 0, OpState::in_flight);
  ranks[1].ops[7].src_job = 2;
  const Verdict v = diagnose(ranks);
  ASSERT_TRUE(v.seq.has_value());
  EXPECT_EQ(*v.seq, 5u);
  EXPECT_EQ(v.ranks, std::vector<int>{2});
  EXPECT_TRUE(has(v.text, "op #5 (pull 64 B from 0) did not complete on rank 2")) << v.text;
}

TEST(Diagnose, NamesTheGroupAndTheRanksNumberInIt) {
  std::vector<RankOps> ranks{ranks_ops(0, 0, 4), ranks_ops(1, 0, 4), ranks_ops(2, 0, 4),
                             ranks_ops(3, 0, 4)};
  for (int r = 0; r < 4; ++r) {
    OpRecord& o = ranks[static_cast<std::size_t>(r)].ops[2];
    const std::string group = fmt::format("dp group {}", r % 2);
    group.copy(o.group, group.size());
    o.group_rank = r / 2;
    o.state = OpState::in_flight;
  }
  ranks[3].ops[2].state = OpState::skipped;
  const Verdict v = diagnose(ranks);
  EXPECT_EQ(v.ranks, std::vector<int>{3});
  EXPECT_TRUE(has(v.text, "rank 3 (rank 1 of dp group 1) skipped it")) << v.text;
}

TEST(Diagnose, AReportLanesMembersAreItsGroupsEvenBeforeTheirFirstReport) {
  // Rank 1 waits in its first report of dp group 1 (ranks 1 and 3); rank 3 has run the group's
  // weight gather but not reached the report: its pull in tp group 1 (ranks 2 and 3) is stuck,
  // and rank 2 completed it. Rank 3 holds the job up, though it has no record of the report lane.
  auto in = [](OpRecord o, const std::string& group, int group_rank, std::uint64_t lane_seq) {
    group.copy(o.group, group.size());
    o.group_rank = group_rank;
    o.lane_seq = lane_seq;
    return o;
  };
  std::vector<RankOps> ranks{{1, true, 2, {}}, {2, true, 1, {}}, {3, true, 2, {}}};
  ranks[0].ops = {in(op(0, CommOp::all_gather), "dp group 1", 0, 0),
                  in(op(1, CommOp::all_gather, 16, OpState::in_flight), "dp group 1 report", 0, 0)};
  ranks[1].ops = {in(op(0, CommOp::pull, 64), "tp group 1", 0, 0)};
  ranks[2].ops = {in(op(0, CommOp::all_gather), "dp group 1", 1, 0),
                  in(op(1, CommOp::pull, 64, OpState::in_flight), "tp group 1", 1, 0)};
  const Verdict v = diagnose(ranks);
  EXPECT_EQ(v.ranks, std::vector<int>{3}) << v.text;
  EXPECT_TRUE(has(v.text, "did not complete on rank 3")) << v.text;
}

TEST(Diagnose, OpsEvictedFromARingCountAsIssued) {
  // Rank 0 has issued 100 ops and keeps 36..99; rank 1 has issued 50, keeps 0..49, and is idle.
  std::vector<RankOps> ranks{ranks_ops(0, 36, 100), ranks_ops(1, 0, 50)};
  ranks[0].ops.back().state = OpState::in_flight;
  const Verdict v = diagnose(ranks);
  EXPECT_EQ(v.ranks, std::vector<int>{1});
  EXPECT_TRUE(has(v.text, "rank 1 has not issued it (its last op is #49, done)")) << v.text;
}

// --- shared GPUs and the command line ------------------------------------------------------------

TEST(SharedDevice, FindsTheFirstPairOfRanksOnOneGpu) {
  EXPECT_FALSE(find_shared_device({}).has_value());
  EXPECT_FALSE(find_shared_device({"a 0000:01:00.0", "a 0000:02:00.0", "b 0000:01:00.0"}));
  const auto p = find_shared_device({"a 0000:01:00.0", "a 0000:02:00.0", "a 0000:02:00.0"});
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->first, 1);
  EXPECT_EQ(p->second, 2);
}

TEST(CommKind, ParsesTheThreeNames) {
  EXPECT_EQ(parse_comm_kind("auto"), CommKind::automatic);
  EXPECT_EQ(parse_comm_kind("mpi"), CommKind::mpi);
  EXPECT_EQ(parse_comm_kind("nccl"), CommKind::nccl);
  EXPECT_THROW(parse_comm_kind("gloo"), Error);
}

CliOutcome parse(std::vector<std::string> args) {
  args.insert(args.begin(), "stage");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  const StageInfo info{"stage", "test", false};
  return parse_stage_cli(info, static_cast<int>(argv.size()), argv.data());
}

TEST(CommCli, DefaultsAndFlags) {
  const CliOutcome d = parse({});
  ASSERT_TRUE(d.options) << d.message;
  EXPECT_EQ(d.options->comm.kind, CommKind::automatic);
  EXPECT_EQ(d.options->comm.timeout_s, 60.0);
  EXPECT_EQ(d.options->comm.fault_rank, -1);
  EXPECT_EQ(d.options->comm.fault_seq, -1);

  const CliOutcome o =
      parse({"--comm", "mpi", "--comm-timeout", "2.5", "--fault-skip-collective", "1:5"});
  ASSERT_TRUE(o.options) << o.message;
  EXPECT_EQ(o.options->comm.kind, CommKind::mpi);
  EXPECT_EQ(o.options->comm.timeout_s, 2.5);
  EXPECT_EQ(o.options->comm.fault_rank, 1);
  EXPECT_EQ(o.options->comm.fault_seq, 5);
  EXPECT_EQ(parse({"--comm", "nccl"}).options->comm.kind, CommKind::nccl);
}

TEST(CommCli, RejectsBadValues) {
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"--comm", "gloo"},
                                             {"--comm-timeout", "0"},
                                             {"--comm-timeout", "-1"},
                                             {"--fault-skip-collective", "1"},
                                             {"--fault-skip-collective", "x:3"},
                                             {"--fault-skip-collective", "-1:3"}}) {
    const CliOutcome o = parse(args);
    EXPECT_FALSE(o.options) << fmt::format("{}", fmt::join(args, " "));
    EXPECT_EQ(o.exit_code, 2);
    EXPECT_FALSE(o.message.empty());
  }
}

TEST(CommCli, HelpShowsCommFlagsButHidesFaultInjection) {
  const CliOutcome h = parse({"--help"});
  EXPECT_EQ(h.exit_code, 0);
  EXPECT_NE(h.message.find("--comm "), std::string::npos) << h.message;
  EXPECT_NE(h.message.find("--comm-timeout"), std::string::npos) << h.message;
  EXPECT_EQ(h.message.find("fault"), std::string::npos) << h.message;
}

// --- the watchdog, end to end --------------------------------------------------------------------

struct ProbeRun {
  test::CommandResult result;
  double seconds = 0;
};

ProbeRun run_probe(int ranks, const std::string& args) {
  const std::string probe = (std::filesystem::path(TPX_BIN_DIR) / "comm_fault_probe").string();
  const std::string command =
      fmt::format("timeout 120 env {} {} --oversubscribe --bind-to none -np {} {} {}",
                  test::kRootMpiEnv, TPX_MPIEXEC, ranks, probe, args);
  test::TempDir scratch;
  const auto t0 = std::chrono::steady_clock::now();
  ProbeRun run{test::run_command(command, scratch), 0};
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

TEST(Watchdog, HealthyJobFinishes) {
  const ProbeRun run = run_probe(2, "--comm-timeout 10");
  EXPECT_EQ(run.result.exit_code, 0) << run.result.out << run.result.err;
  for (int r : {0, 1})
    EXPECT_NE(run.result.out.find(
                  fmt::format("rank {}: 10 all-reduces and an all-gather, 0 wrong values", r)),
              std::string::npos)
        << run.result.out;
  EXPECT_EQ(run.result.err.find("comm watchdog"), std::string::npos) << run.result.err;
}

// The probe's lines on stderr that are its own (not Open MPI's).
std::vector<std::string> probe_errors(const std::string& err) {
  std::vector<std::string> lines;
  for (const auto& line : test::lines_of(err))
    if (line.rfind("comm_fault_probe:", 0) == 0) lines.push_back(line);
  return lines;
}

TEST(Watchdog, AFaultOnAnOpNoOtherRankTakesPartInIsNotInjectedAndIsReported) {
  // One rank: its collective 10, the all-gather, has no peer that could miss it. It must still
  // run (a one-rank all-gather's output is its input: 1, not the −1 the buffer held), and the
  // end of the run says the fault did not fire, with a non-zero exit.
  const ProbeRun run = run_probe(1, "--comm-timeout 10 --fault-skip-collective 0:10");
  EXPECT_EQ(run.result.exit_code, 1) << run.result.out << run.result.err;
  EXPECT_NE(run.result.out.find("rank 0: 10 all-reduces and an all-gather, 0 wrong values"),
            std::string::npos)
      << run.result.out;
  const auto lines = probe_errors(run.result.err);
  ASSERT_EQ(lines.size(), 1u) << run.result.err;
  EXPECT_EQ(lines[0].rfind("comm_fault_probe: rank 0: --fault-skip-collective 0:10 did not fire: "
                           "rank 0's collective 10 (op #10: all_gather ",
                           0),
            0u)
      << lines[0];
  EXPECT_NE(lines[0].find("no other rank taking part"), std::string::npos) << lines[0];
  EXPECT_EQ(run.result.err.find("comm watchdog"), std::string::npos) << run.result.err;
}

TEST(Watchdog, AFaultPastTheLastOpIsReportedAtTheEnd) {
  // The probe issues 11 collectives (0 … 10): number 11 never comes.
  const ProbeRun run = run_probe(2, "--comm-timeout 10 --fault-skip-collective 1:11");
  EXPECT_EQ(run.result.exit_code, 1) << run.result.out << run.result.err;
  const auto lines = probe_errors(run.result.err);
  ASSERT_EQ(lines.size(), 1u) << run.result.err;
  EXPECT_EQ(lines[0],
            "comm_fault_probe: rank 1: --fault-skip-collective 1:11 never fired: rank 1 issued 11 "
            "collectives (0 … 10)");
  EXPECT_EQ(run.result.err.find("comm watchdog"), std::string::npos) << run.result.err;
}

TEST(Watchdog, SkippedCollectiveAbortsWithTheFirstDisagreement) {
  const ProbeRun run = run_probe(2, "--comm-timeout 2 --fault-skip-collective 1:5");
  const std::string& err = run.result.err;
  EXPECT_NE(run.result.exit_code, 0) << err;
  EXPECT_NE(run.result.exit_code, 124) << "the job hung until `timeout` killed it\n" << err;
  EXPECT_LT(run.seconds, 20.0) << err;

  // Every rank dumped its recent ops; rank 1's dump shows op #5 skipped.
  bool rank0_dump = false, rank1_skip = false;
  int verdicts = 0;
  std::string verdict;
  for (const auto& line : test::lines_of(err)) {
    if (line.rfind("[rank 0] ", 0) == 0 && line.find("#4 ") != std::string::npos) rank0_dump = true;
    if (line.rfind("[rank 1] ", 0) == 0 && line.find("#5 ") != std::string::npos &&
        line.find("skipped") != std::string::npos)
      rank1_skip = true;
    if (line.find("first difference") != std::string::npos) {
      ++verdicts;
      verdict = line;
    }
  }
  EXPECT_TRUE(rank0_dump) << err;
  EXPECT_TRUE(rank1_skip) << err;
  // Exactly one verdict line, naming op 5 and the rank that skipped it, and no other rank.
  EXPECT_EQ(verdicts, 1) << err;
  EXPECT_EQ(verdict,
            "tpx: comm watchdog: an op did not complete in 2.0 s; first difference at op #5 "
            "(all_reduce fp32[256] 1024 B): rank 1 skipped it (the others: all_reduce fp32[256] "
            "1024 B)")
      << err;
}

}  // namespace
}  // namespace tpx
