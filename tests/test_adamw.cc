// AdamW (--optimizer adamw), torch.optim.AdamW's update with Megatron-LM's no-decay rule for the
// norm gains:
//   - ops::adamw_update on the cpu against the formula written out in double, over three steps:
//     the moments, the bias corrections (at t = 1 the step is lr·g/(|g| + eps)), the decoupled
//     decay applied to w before the Adam step, and no decay where the caller says none;
//   - every stage passes --check under AdamW at N = 1, 2, 4 (the reference runs AdamW in double),
//     stage 06 in FP8 and in fp32; AdamW's losses are not SGD's;
//   - the memory estimate counts two fp32 moments per parameter, and --json reports them;
//   - AdamW's settings given to an SGD run, or out of range, end every rank with one line, said
//   once.
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/ops.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using nlohmann::json;
using test::run_stage;

/// One AdamW step in double, the formula of DESIGN.md / torch.optim.AdamW, on w, m, v.
void adamw_double(std::vector<double>& w, const std::vector<double>& g, std::vector<double>& m,
                  std::vector<double>& v, double lr, double b1, double b2, double eps, double wd,
                  int t) {
  for (std::size_t i = 0; i < w.size(); ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    w[i] -= lr * wd * w[i];
    const double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
    w[i] -= lr * mhat / (std::sqrt(vhat) + eps);
  }
}

TEST(AdamWOp, ThreeStepsEqualTheFormulaInDouble) {
  const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8;
  for (const double wd : {0.0, 0.1}) {  // a gain (no decay) and a matrix
    const std::int64_t n = 1000;
    const Tensor w = test::random_tensor({n}, 1), m = Tensor::empty({n}), v = Tensor::empty({n});
    ops::fill(m, 0.0f);
    ops::fill(v, 0.0f);
    std::vector<double> wd_ = test::to_doubles(w), md(n, 0.0), vd(n, 0.0);
    for (int t = 1; t <= 3; ++t) {
      const Tensor g = test::random_tensor({n}, std::uint32_t(10 + t), 0.0, 1e-3);
      const auto gd = test::to_doubles(g);
      ops::adamw_update(w, g, m, v, test::adamw_step(lr, b1, b2, eps, wd, t));
      adamw_double(wd_, gd, md, vd, lr, b1, b2, eps, wd, t);
      const auto got = test::to_doubles(w);
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(got[std::size_t(i)], wd_[std::size_t(i)], 1e-6 * (1 + std::abs(wd_[i])))
            << "wd " << wd << " step " << t << " element " << i;
    }
  }
}

TEST(AdamWOp, FirstStepIsLrTimesTheGradientsSignAfterTheDecay) {
  // At t = 1, m̂ = g and v̂ = g²: the step is lr·g/(|g| + eps), about lr·sign(g) — a bias
  // correction left out would make it (1−β1)/sqrt(1−β2) ≈ 0.45 times that. Decay comes first.
  const double lr = 1e-3, wd = 0.1;
  const Tensor w = test::random_tensor({64}, 3), g = test::random_tensor({64}, 4, 0.0, 1e-2);
  const Tensor m = Tensor::empty({64}), v = Tensor::empty({64});
  ops::fill(m, 0.0f);
  ops::fill(v, 0.0f);
  const auto w0 = test::to_doubles(w), gd = test::to_doubles(g);
  ops::adamw_update(w, g, m, v, test::adamw_step(lr, 0.9, 0.95, 1e-8, wd, 1));
  const auto w1 = test::to_doubles(w);
  for (std::size_t i = 0; i < w0.size(); ++i) {
    const double want = w0[i] * (1 - lr * wd) - lr * gd[i] / (std::abs(gd[i]) + 1e-8);
    EXPECT_NEAR(w1[i], want, 1e-6) << i;  // fp32 w of |w| ≲ 3; a missed correction: ~5e-4
  }
}

/// Sizes every N of 1 … 4 divides (those of tests/test_llama_block.cc), two layers.
const std::string kSizes = "--hidden 96 --heads 24 --kv-heads 12 --ffn 48 --seq 24 --layers 2";
const std::string kAdamW = "--optimizer adamw --lr 1e-3";

struct Case {
  std::string stage;
  int ranks;
  std::string extra;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.stage << " -np " << c.ranks << " " << c.extra;
}

class AdamWCheck : public testing::TestWithParam<Case> {};

TEST_P(AdamWCheck, PassesAgainstTheDoubleReference) {
  const auto& [stage, n, extra] = GetParam();
  test::TempDir dir;
  const auto path = dir / "s.json";
  const auto r = run_stage(
      stage, n,
      fmt::format("{} {} {} --steps 3 --check --json {}", kSizes, kAdamW, extra, path.string()),
      dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("optimizer adamw (beta1 0.9, beta2 0.95"), std::string::npos) << r.out;
  const json j = json::parse(test::read_file(path));
  EXPECT_EQ(j.at("config").at("optimizer"), "adamw");
  // Two fp32 moments per parameter element this rank holds: twice the "parameters" term.
  EXPECT_GT(j.at("optimizer_state_bytes").get<std::uint64_t>(), 0u);
}

std::vector<Case> check_cases() {
  std::vector<Case> cases = {{"01_baseline", 1, ""}};
  for (const char* stage : {"02_megatron_tp", "03_sequence_parallel", "04_overlap_ring",
                            "05_copy_engine_async_tp", "06_fp8"})
    for (int n : {1, 2, 4}) cases.push_back({stage, n, ""});
  for (int n : {1, 2, 4}) cases.push_back({"06_fp8", n, "--dtype fp32"});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(stages, AdamWCheck, testing::ValuesIn(check_cases()), [](const auto& p) {
  return fmt::format("{}_np{}{}", p.param.stage.substr(0, 2), p.param.ranks,
                     p.param.extra.empty() ? "" : "_fp32");
});

TEST(AdamW, ChangesTheLossesAndAddsItsStateToTheEstimate) {
  test::TempDir dir;
  auto run = [&](const std::string& flags, const char* name) {
    const auto path = dir / name;
    const auto r =
        run_stage("02_megatron_tp", 2,
                  fmt::format("{} {} --steps 3 --json {}", kSizes, flags, path.string()), dir);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return json::parse(test::read_file(path));
  };
  const json sgd = run("--lr 1e-3", "sgd.json"), adamw = run(kAdamW, "adamw.json");
  EXPECT_EQ(sgd["steps"][0].at("loss"), adamw["steps"][0].at("loss"));  // before any update
  EXPECT_NE(sgd["steps"][2].at("loss"), adamw["steps"][2].at("loss"));
  EXPECT_EQ(sgd.at("optimizer_state_bytes").get<std::uint64_t>(), 0u);
  // Per rank at N = 2: each layer's parameters are H·(2H + 2·NKV·D + 3F)/2 + 2H floats (the gains
  // replicated), and AdamW keeps two fp32 moments of each.
  const std::int64_t h = 96, kv = 12 * 4, f = 48;
  const std::int64_t per_layer = h * (2 * h + 2 * kv + 3 * f) / 2 + 2 * h;
  EXPECT_EQ(adamw.at("optimizer_state_bytes").get<std::int64_t>(), 2 * 4 * 2 * per_layer);
  EXPECT_EQ(adamw.at("memory_estimate_bytes").get<std::int64_t>() -
                sgd.at("memory_estimate_bytes").get<std::int64_t>(),
            2 * 4 * 2 * per_layer);
}

struct Bad {
  std::string args, says;
};

void PrintTo(const Bad& b, std::ostream* os) {
  *os << b.args;
}

class AdamWBadFlags : public testing::TestWithParam<Bad> {};

TEST_P(AdamWBadFlags, OneLineOnEveryRankAndExit2) {
  const auto r = test::expect_refused_once("02_megatron_tp", 2, kSizes + " " + GetParam().args,
                                           GetParam().says);
  EXPECT_EQ(r.out.find("grad norm"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    flags, AdamWBadFlags,
    testing::Values(Bad{"--optimizer adamw --beta1 1.5", "--beta1 must be in [0, 1)"},
                    Bad{"--optimizer adamw --eps 0", "--eps must be positive"},
                    Bad{"--optimizer adamw --weight-decay -1", "--weight-decay must be"},
                    Bad{"--beta2 0.99", "--beta2 is a setting of --optimizer adamw"},
                    Bad{"--optimizer adam", "--optimizer"}),
    [](const auto& p) { return fmt::format("case{}", p.index); });

}  // namespace
}  // namespace tpx
