// Placement on nodes (common/comm/nodes.h, common/placement.h):
//   - the node map's words and arithmetic on maps written by hand: the layout, where each node's
//     ranks are, the ring links between nodes;
//   - the stage executables on one machine playing two nodes of two ranks (TPX_NODE_ID, set per
//     rank by mpirun's -x in an MPMD launch): stage 05 refuses in under 2 s with one line naming
//     the nodes on every rank; stage 04 warns once with the TP bytes that cross the network and
//     passes --check; stage 07 at D 2 × TP 2 passes --check with no warning (each TP group inside
//     a node), and refuses a layout that splits a TP group; a bad TPX_NODE_ID is one line and
//     exit 2; without it the header says one node.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/comm/nodes.h"
#include "common/memory.h"
#include "common/placement.h"
#include "test_util.h"

namespace tpx {
namespace {

using nlohmann::json;
using test::CommandResult;
using test::TempDir;

constexpr const char* kSmall =
    "--hidden 32 --heads 4 --ffn 64 --seq 8 --batch 2 --layers 1 --steps 2";

/// A map of job ranks 0 … n−1 whose nodes are `ids` (named "node <id>", as TPX_NODE_ID names them).
NodeMap fake(const std::vector<int>& ids) {
  std::vector<NodeMap::Rank> ranks;
  for (std::size_t r = 0; r < ids.size(); ++r)
    ranks.push_back({static_cast<int>(r), ids[r], fmt::format("node {}", ids[r])});
  return NodeMap(std::move(ranks), true);
}

TEST(NodeMap, LayoutCountsNodesAndTheirRanks) {
  EXPECT_EQ(fake({0, 0, 1, 1}).layout(), "2 nodes × 2 ranks per node");
  EXPECT_EQ(fake({7, 7, 7, 3}).layout(), "2 nodes × 1–3 ranks per node");
  EXPECT_EQ(fake({4}).layout(), "1 node × 1 rank per node");
  EXPECT_EQ(fake({0, 0, 0, 0, 0, 0}).layout(), "1 node × 6 ranks per node");
}

TEST(NodeMap, NodesAreNumberedInRankOrderAndNamedByTheirRanks) {
  const NodeMap m = fake({9, 9, 2, 2});
  EXPECT_EQ(m.nodes(), 2);
  EXPECT_EQ(m.node_of(0), 0);
  EXPECT_EQ(m.node_of(3), 1);
  EXPECT_EQ(m.where(), "node 9: job ranks 0-1; node 2: job ranks 2-3");
  EXPECT_EQ(fake({0, 1, 0, 1}).where(), "node 0: job ranks 0,2; node 1: job ranks 1,3");
  EXPECT_EQ(fake({0, 0, 0, 1, 0}).where(), "node 0: job ranks 0-2,4; node 1: job rank 3");
}

TEST(NodeMap, RingLinksAcrossNodes) {
  EXPECT_EQ(fake({0, 0, 1, 1}).ring_links_across(), 2);  // 1→2 and 3→0
  EXPECT_EQ(fake({0, 1, 0, 1}).ring_links_across(), 4);  // every link
  EXPECT_EQ(fake({0, 0, 0, 0}).ring_links_across(), 0);
  EXPECT_EQ(fake({0, 0, 1, 1, 2, 2}).ring_links_across(), 3);
  EXPECT_EQ(fake({5}).ring_links_across(), 0);
}

TEST(Placement, WarnsOnlyForATpGroupAcrossNodesWithTheBytesOnTheNetwork) {
  Placement p;
  EXPECT_EQ(p.tp_warning(1 << 20), "");
  p.tp_nodes = fake({0, 0, 1, 1});
  p.tp_name = "the tp group (the whole job)";
  p.job_nodes = 2;
  const std::string w = p.tp_warning(3 << 20);  // 3 MiB per rank, 2 links across: 6 MiB
  for (const char* s : {"the tp group (the whole job) spans 2 nodes",
                        "node 0: job ranks 0-1; node 1: job ranks 2-3", "3.0 MiB per rank",
                        "2 of the 4 links", "about 6.0 MiB per step", "--dp 2"})
    EXPECT_NE(w.find(s), std::string::npos) << s << "\n" << w;
}

// --- the executables, two nodes of two ranks on one machine -----------------------------------

/// mpirun of an MPMD list of groups "-np N [-x VAR=…] <stage> <args>" joined by " : ".
CommandResult mpirun(const std::string& spec, const TempDir& dir) {
  return test::run_command(fmt::format("{} timeout 120 {} {} {}", test::kRootMpiEnv, TPX_MPIEXEC,
                                       TPX_MPIEXEC_FLAGS, spec),
                           dir);
}

/// Ranks on the nodes `ids` (one group of ranks per entry: {ranks, node id}), each running
/// `stage args`.
std::string on_nodes(const std::vector<std::pair<int, int>>& ids, const std::string& stage,
                     const std::string& args) {
  std::string spec;
  for (const auto& [ranks, id] : ids)
    spec += fmt::format("{}-np {} -x {}={} {} {}", spec.empty() ? "" : " : ", ranks,
                        kNodeIdVariable, id, test::stage_binary(stage), args);
  return spec;
}

std::vector<std::string> lines_with(const std::string& text, const std::string& what) {
  std::vector<std::string> out;
  for (const auto& line : test::lines_of(text))
    if (line.find(what) != std::string::npos) out.push_back(line);
  return out;
}

const std::vector<std::pair<int, int>> kTwoNodes{{2, 0}, {2, 1}};  // ranks 0-1, 2-3

TEST(OnTwoNodes, SymmetricMemoryRefusesInUnderTwoSecondsNamingTheNodes) {
  const TempDir dir;
  // mpirun's own start-up, on this machine now: the same launch that stops after parsing.
  auto t0 = std::chrono::steady_clock::now();
  const CommandResult help = mpirun(on_nodes(kTwoNodes, "05_copy_engine_async_tp", "--help"), dir);
  const double startup =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(help.exit_code, 0) << help.err;
  t0 = std::chrono::steady_clock::now();
  const CommandResult r = mpirun(on_nodes(kTwoNodes, "05_copy_engine_async_tp", kSmall), dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  const auto errors = lines_with(r.err, ": error: ");
  EXPECT_EQ(errors.size(), 1u) << r.err;  // every rank refuses alike: said once
  for (const auto& line : errors)
    for (const char* want : {"symmetric memory needs every rank on one node", "span 2 nodes",
                             "node 0: job ranks 0-1; node 1: job ranks 2-3"})
      EXPECT_NE(line.find(want), std::string::npos) << line;
  EXPECT_EQ(r.out.find("grad norm"), std::string::npos) << "it started training:\n" << r.out;
  EXPECT_LT(s - startup, 2.0) << "refused in " << s << " s, mpirun's start-up " << startup << " s";
  fmt::print("refused in {:.2f} s (mpirun's start-up and --help: {:.2f} s)\n", s, startup);
}

TEST(OnTwoNodes, TensorParallelismAcrossNodesWarnsOnceWithItsBytesAndPasses) {
  const TempDir dir;
  const auto json_path = dir / "run.json";
  const CommandResult r =
      mpirun(on_nodes(kTwoNodes, "04_overlap_ring",
                      fmt::format("{} --check --json {}", kSmall, json_path.string())),
             dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 nodes × 2 ranks per node (node ids from TPX_NODE_ID) | the tp group "
                       "spans 2 nodes\n"),
            std::string::npos)
      << r.out;
  const auto warnings = lines_with(r.err, "warning:");
  ASSERT_EQ(warnings.size(), 1u) << r.err;
  // Step 0's TP bytes (stage 04 has no DP group), and the 2 of 4 ring links that cross: 1→2, 3→0.
  const json j = json::parse(test::read_file(json_path));
  const auto tp = j.at("steps").at(0).at("comm_bus_bytes").get<std::uint64_t>();
  ASSERT_GT(tp, 0u);
  for (const std::string& want :
       {std::string("04_overlap_ring: warning: the tp group (the whole job) spans 2 nodes"),
        std::string("(node 0: job ranks 0-1; node 1: job ranks 2-3)"),
        fmt::format("TP moves {} per rank every step", bytes_text(tp)),
        std::string("2 of the 4 links"), fmt::format("about {} per step", bytes_text(2 * tp))})
    EXPECT_NE(warnings[0].find(want), std::string::npos) << want << "\n" << warnings[0];
}

// Stage 10's EP group is EP consecutive replicas of one TP index: with TP inside a node it lands
// on one node when EP·T ranks fit there, and the header says where it landed either way.
TEST(OnTwoNodes, TheEpGroupIsPlacedAndNamed) {
  const TempDir dir;
  const std::string moe =
      "--hidden 32 --heads 4 --ffn 64 --seq 8 --batch 4 --layers 2 --steps 2 --experts 4 --topk 2 "
      "--check";
  for (const auto& [flags, words] :
       {std::pair{"--dp 4 --ep 2", "dp groups span 2 nodes | ep groups each on one node\n"},
        std::pair{"--dp 2 --ep 2",
                  "tp groups each on one node | dp groups span 2 nodes | ep groups "
                  "span 2 nodes\n"},
        // Under a pipeline (PP outermost) each stage's slice is one node: its all-to-alls stay
        // inside it, and only the pipeline's messages cross.
        std::pair{"--pp 2 --dp 2",
                  "dp groups each on one node | pp groups span 2 nodes | ep groups each on one "
                  "node\n"}}) {
    const CommandResult r =
        mpirun(on_nodes(kTwoNodes, "10_expert_parallel", fmt::format("{} {}", moe, flags)), dir);
    ASSERT_EQ(r.exit_code, 0) << flags << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(std::string("2 nodes × 2 ranks per node (node ids from TPX_NODE_ID) | ") +
                         words),
              std::string::npos)
        << flags << "\n"
        << r.out;
  }
}

TEST(OnTwoNodes, MeshWithEachTpGroupInsideANodePassesWithoutWarning) {
  const TempDir dir;
  const CommandResult r =
      mpirun(on_nodes(kTwoNodes, "07_fsdp_tp", fmt::format("{} --dp 2 --check", kSmall)), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 nodes × 2 ranks per node (node ids from TPX_NODE_ID) | tp groups each on "
                       "one node | dp groups span 2 nodes\n"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

TEST(OnTwoNodes, MeshWhoseTpGroupsSpanNodesIsRefused) {
  // Ranks 0, 2 on node 0 and 1, 3 on node 1: every TP group {0, 1}, {2, 3} spans both.
  const TempDir dir;
  std::string spec;
  for (int r = 0; r < 4; ++r)
    spec += fmt::format("{}-np 1 -x {}={} {} {} --dp 2", r == 0 ? "" : " : ", kNodeIdVariable,
                        r % 2, test::stage_binary("07_fsdp_tp"), kSmall);
  const CommandResult r = mpirun(spec, dir);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  const auto errors = lines_with(r.err, ": error: ");
  EXPECT_EQ(errors.size(), 1u) << r.err;  // said once
  for (const auto& line : errors) {
    EXPECT_NE(line.find("every rank of tp group"), std::string::npos) << line;
    EXPECT_NE(line.find("span 2 nodes"), std::string::npos) << line;
  }
  // The line is rank 0's: its TP group {0, 1}, split over the two nodes.
  EXPECT_NE(r.err.find("node 0: job rank 0; node 1: job rank 1"), std::string::npos) << r.err;
}

TEST(OnTwoNodes, ABadNodeIdIsOneLineOnEveryRank) {
  const TempDir dir;
  const CommandResult r = mpirun(
      fmt::format("-np 1 {} : -np 1 -x {}=two {}",
                  (test::stage_binary("03_sequence_parallel") + " " + kSmall), kNodeIdVariable,
                  test::stage_binary("03_sequence_parallel") + " " + kSmall),
      dir);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  const auto errors = lines_with(r.err, ": error: ");
  EXPECT_EQ(errors.size(), 1u) << r.err;  // said once
  for (const auto& line : errors)
    EXPECT_NE(line.find("TPX_NODE_ID must be an integer >= 0 naming the rank's node (a test hook; "
                        "leave it unset on a real cluster), but rank 1 has 'two'"),
              std::string::npos)
        << line;
}

TEST(OneMachine, TheHeaderSaysOneNodeAndNothingWarns) {
  const TempDir dir;
  const CommandResult r = test::run_stage("03_sequence_parallel", 2, kSmall, dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\n1 node × 2 ranks per node\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace tpx
