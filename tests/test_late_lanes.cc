// The order of every comm lane's hand-offs, checked on the cpu with the lanes running late.
//
// A stage issues its transfers on comm lanes (a ring's steps, FSDP's gathers and reduce-scatters,
// CP's K/V blocks, a pipeline's activations and gradients) and its compute waits for a lane's
// event before it reads what the lane received, or writes over what the lane sends. On a GPU the
// lanes really run behind the host that issues them, so a missing wait reads stale bytes there;
// on the cpu a transfer between processes on one machine is usually done before the compute gets
// to it, so the same mistake can pass every other test. The hidden --fault-comm-delay-us US makes
// every communicator op wait a random 0 … US µs on its lane first (common/comm/communicator.cc):
// each run below trains with and without it, and both must pass --check with the same losses and
// gradient norms, bit for bit (the transfers' timing changes, the arithmetic must not).
//
// The other direction, a lane reading what the compute stream has not written yet, is what the
// cpu cannot show at all (its compute runs inline, before the lane is handed anything): every
// stage's hand-off goes through run_after_compute (common/stream.h), whose cuda test is
// Streams.RunAfterComputeWaitsForTheComputeStreamsWrites.
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using json = nlohmann::json;
using test::run_stage;
using test::Sizes;

struct Case {
  std::string stage;
  int ranks = 2;
  std::string args;  // the mesh, the method or schedule, the precision
  std::string name;  // the test's name after the stage's
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "np " << c.ranks << " " << c.stage << " " << c.args;
}

/// Each op waits 0 … 400 µs: longer than a transfer of these sizes between processes takes, so a
/// compute that does not wait for the lane gets to the buffer first.
constexpr int kDelayUs = 400;

/// The loss and gradient norm of every step of a run (empty, and a failure, when it fails).
std::vector<double> train(const Case& c, const std::string& extra) {
  Sizes z;
  z.L = 4;  // the interleaved schedule's two stages a rank at P = 2
  z.B = 4;  // a pipeline's four micro-batches of one sequence
  test::TempDir dir;
  const auto path = dir / "summary.json";
  const auto r = run_stage(
      c.stage, c.ranks,
      fmt::format("{} --steps 3 {} --check --json {} {}", z.args(), c.args, path.string(), extra),
      dir);
  std::vector<double> losses;
  EXPECT_EQ(r.exit_code, 0) << extra << "\n" << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << extra << "\n" << r.out;
  if (r.exit_code != 0) return losses;
  const json summary = json::parse(test::read_file(path));
  for (const json& step : summary.at("steps")) {
    losses.push_back(step.at("loss").get<double>());
    losses.push_back(step.at("grad_norm").get<double>());
  }
  return losses;
}

class LateLanes : public testing::TestWithParam<Case> {};

TEST_P(LateLanes, ChangeNoBit) {
  const Case& c = GetParam();
  const std::vector<double> quiet = train(c, "");
  const std::vector<double> late = train(c, fmt::format("--fault-comm-delay-us {}", kDelayUs));
  ASSERT_EQ(quiet.size(), 6u);
  EXPECT_EQ(late, quiet);
}

INSTANTIATE_TEST_SUITE_P(
    stages, LateLanes,
    testing::Values(
        // the ring's steps on their P2P lane
        Case{"04_overlap_ring", 3, "", "ring"},
        // FSDP's gather lane and reduce-scatter lane, alone and beside TP
        Case{"07_fsdp_tp", 2, "--dp 2", "D2"}, Case{"07_fsdp_tp", 4, "--dp 2", "D2_T2"},
        // each CP method's K/V (or head) exchange, fp32 and bf16
        Case{"08_context_parallel", 2, "--cp 2 --cp-method ring", "ring"},
        Case{"08_context_parallel", 2, "--cp 2 --cp-method allgather", "allgather"},
        Case{"08_context_parallel", 2, "--cp 2 --cp-method ulysses", "ulysses"},
        Case{"08_context_parallel", 2, "--cp 2 --cp-method ring --dtype bf16", "ring_bf16"},
        Case{"08_context_parallel", 2, "--cp 2 --cp-method allgather --dtype bf16",
             "allgather_bf16"},
        // a pipeline's send and receive lanes with each schedule, recompute, CP and FSDP inside it
        Case{"09_pipeline_parallel", 2, "--pp 2 --microbatches 4 --schedule gpipe", "gpipe"},
        Case{"09_pipeline_parallel", 2, "--pp 2 --microbatches 4 --schedule 1f1b", "1f1b"},
        Case{"09_pipeline_parallel", 2,
             "--pp 2 --stages-per-rank 2 --microbatches 4 --schedule interleaved-1f1b",
             "interleaved"},
        Case{"09_pipeline_parallel", 2, "--pp 2 --microbatches 4 --schedule zb-h1", "zb_h1"},
        Case{"09_pipeline_parallel", 2, "--pp 2 --microbatches 4 --schedule 1f1b --recompute full",
             "1f1b_recompute"},
        Case{"09_pipeline_parallel", 4, "--pp 2 --cp 2 --microbatches 2 --schedule 1f1b", "P2_C2"},
        Case{"09_pipeline_parallel", 4, "--pp 2 --dp 2 --microbatches 2 --schedule zb-h1",
             "P2_D2_zb_h1"}),
    [](const auto& p) { return p.param.stage + "_" + p.param.name; });

TEST(LateLanesFlag, AnOutOfRangeDelayIsRefusedInOneLine) {
  for (const char* us : {"-1", "1000001"})
    test::expect_refused_once("04_overlap_ring", 2,
                              fmt::format("--steps 1 --fault-comm-delay-us {}", us),
                              "--fault-comm-delay-us must be 0 … 1000000");
}

}  // namespace
}  // namespace tpx
