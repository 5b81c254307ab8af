// Stage 09's held-out loss (--eval-every), under mpirun:
//  - every evaluated row's eval_loss equals stage 01's for the same flags (the held-out windows
//    come from the seed, so both see the same batch) under gpipe, 1f1b, interleaved-1f1b and
//    zb-h1 at P = 2, and with the batch cut over a data-parallel pair (P 2 × D 2, FSDP) and
//    a context-parallel pair (P 2 × C 2);
//  - the step itself is bit for bit as without --eval-every: the same losses and gradient norms,
//    and the evaluation's messages and collectives are not in the step's traffic columns.
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "test_stage_runs.h"

namespace tpx {
namespace {

using json = nlohmann::json;
using test::run_json;

/// Four layers (P·V = 4 virtual stages hold one each), B = 4 (two micro-batches of two at P = 2),
/// S = 16 (a C = 2 pair's four load-balanced chunks), a small vocabulary of synthetic ids.
constexpr const char* kShape =
    "--hidden 32 --heads 4 --ffn 64 --seq 16 --batch 4 --layers 4 --vocab 101 --task lm "
    "--data synthetic --dtype fp32 --steps 3";

struct EvalRun {
  int ranks;
  std::string args;
};

/// The step's traffic columns of a row: every count of bytes or calls.
bool is_traffic(const std::string& key) {
  return key.find("payload") != std::string::npos || key.find("bus") != std::string::npos ||
         key.find("calls") != std::string::npos;
}

TEST(PipelineEval, HeldOutLossEqualsStage01AndLeavesTheStepAlone) {
  const json ref = run_json("01_baseline", 1, fmt::format("{} --eval-every 1", kShape));
  ASSERT_TRUE(ref.contains("steps"));
  const json& want = ref.at("steps");
  ASSERT_EQ(want.size(), 3u);
  for (const json& row : want) ASSERT_TRUE(row.contains("eval_loss")) << "stage 01 evaluates";

  for (const EvalRun& run :
       {EvalRun{2, "--pp 2 --schedule gpipe"}, EvalRun{2, "--pp 2 --schedule 1f1b"},
        EvalRun{2, "--pp 2 --schedule interleaved-1f1b --stages-per-rank 2"},
        EvalRun{2, "--pp 2 --schedule zb-h1"}, EvalRun{4, "--pp 2 --dp 2"},
        EvalRun{4, "--pp 2 --cp 2"}}) {
    const std::string args = fmt::format("{} {}", kShape, run.args);
    const json with = run_json("09_pipeline_parallel", run.ranks, args + " --eval-every 1");
    const json without = run_json("09_pipeline_parallel", run.ranks, args);
    ASSERT_TRUE(with.contains("steps") && without.contains("steps")) << run.args;
    const json& got = with.at("steps");
    const json& plain = without.at("steps");
    ASSERT_EQ(got.size(), want.size()) << run.args;
    ASSERT_EQ(plain.size(), want.size()) << run.args;
    for (std::size_t s = 0; s < want.size(); ++s) {
      const std::string where = fmt::format("{}, step {}", run.args, s);
      ASSERT_TRUE(got[s].contains("eval_loss")) << where;
      const double e = got[s].at("eval_loss").get<double>(),
                   w = want[s].at("eval_loss").get<double>();
      EXPECT_NEAR(e, w, 1e-5 * std::abs(w)) << where;
      EXPECT_FALSE(plain[s].contains("eval_loss")) << where;
      // The evaluation reads the parameters and changes nothing: the step's numbers are the
      // same doubles, and its traffic is the step's alone.
      EXPECT_EQ(got[s].at("loss").get<double>(), plain[s].at("loss").get<double>()) << where;
      EXPECT_EQ(got[s].at("grad_norm").get<double>(), plain[s].at("grad_norm").get<double>())
          << where;
      int traffic = 0;
      for (const auto& [key, value] : plain[s].items())
        if (is_traffic(key)) {
          ++traffic;
          EXPECT_EQ(got[s].value(key, json()), value) << key << ": " << where;
        }
      EXPECT_GT(traffic, 0) << "no traffic column in the row: " << where;
    }
  }
}

}  // namespace
}  // namespace tpx
