// The routing rules of the mixture-of-experts MLP (common/moe.h) on small cases worked by hand:
// the choice and its ties, the renormalised gate weights of both router rules, the capacity and
// which assignments it drops, the balancing bias (choice only) and its update, the auxiliary loss.
// The gradients are checked against PyTorch autograd by moe_torch.py. And the flags of the
// experts (common/moe_flags.h): their defaults, the values given, and each refusal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/cli.h"
#include "common/moe.h"
#include "common/moe_flags.h"
#include "common/ops.h"
#include "common/tensor.h"

namespace tpx {
namespace {

MoeShape shape(std::int64_t tokens, std::int64_t experts, std::int64_t topk,
               MoeRouter router = MoeRouter::softmax, double capacity_factor = 0.0) {
  MoeShape m;
  m.tokens = tokens;
  m.hidden = 2;
  m.experts = experts;
  m.topk = topk;
  m.expert_ffn = 2;
  m.router = router;
  m.capacity_factor = capacity_factor;
  return m;
}

MoeRouting<double> route(const MoeShape& m, const std::vector<double>& logits,
                         const std::vector<double>& bias = {}) {
  return moe_route<double>(m, logits, bias);
}

double sigmoid(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}

TEST(MoeRoute, ChoosesTheLargestScoresInDescendingOrder) {
  // z = [0.1, 2, −1, 1.5], k = 3: experts 1 (2), 3 (1.5), 0 (0.1).
  const auto r = route(shape(1, 4, 3), {0.1, 2.0, -1.0, 1.5});
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{1, 3, 0}));
}

TEST(MoeRoute, TiesGoToTheLowerExpertIndex) {
  // Equal logits: softmax gives every expert 1/4; the two lowest indices win, each weight ½.
  const auto r = route(shape(1, 4, 2), {0.5, 0.5, 0.5, 0.5});
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 1}));
  EXPECT_DOUBLE_EQ(r.weight[0], 0.5);
  EXPECT_DOUBLE_EQ(r.weight[1], 0.5);
  // Sigmoid, z = [0, 1, 1, 0], k = 1: experts 1 and 2 tie at σ(1); expert 1 takes the token.
  const auto s = route(shape(1, 4, 1, MoeRouter::sigmoid), {0.0, 1.0, 1.0, 0.0});
  EXPECT_EQ(s.expert, (std::vector<std::int32_t>{1}));
  // A tie at the boundary of the top k: z = [3, 1, 1], k = 2 → experts 0, then 1 (not 2).
  const auto b = route(shape(1, 3, 2), {3.0, 1.0, 1.0});
  EXPECT_EQ(b.expert, (std::vector<std::int32_t>{0, 1}));
}

TEST(MoeRoute, SoftmaxWeightsAreTheTopKProbabilitiesRenormalised) {
  // z = [ln 4, ln 2, 0, ln 2]: p = [4, 2, 1, 2] / 9; k = 2 chooses 0 and 1 (the tie of 1 and 3
  // to the lower index), weights 4/6 and 2/6: the softmax over the chosen logits.
  const auto r = route(shape(1, 4, 2), {std::log(4.0), std::log(2.0), 0.0, std::log(2.0)});
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 1}));
  EXPECT_NEAR(r.weight[0], 4.0 / 6.0, 1e-15);
  EXPECT_NEAR(r.weight[1], 2.0 / 6.0, 1e-15);
  EXPECT_NEAR(r.score[0], 4.0 / 9.0, 1e-15);
  EXPECT_NEAR(r.score[2], 1.0 / 9.0, 1e-15);
}

TEST(MoeRoute, SigmoidWeightsAreTheTopKScoresRenormalised) {
  // z = [2, 0, −1], k = 2: s = [σ(2), ½, σ(−1)]; experts 0, 1 with σ(2)/(σ(2) + ½), ½/(σ(2) + ½).
  const auto r = route(shape(1, 3, 2, MoeRouter::sigmoid), {2.0, 0.0, -1.0});
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 1}));
  const double s0 = sigmoid(2.0);
  EXPECT_NEAR(r.weight[0], s0 / (s0 + 0.5), 1e-15);
  EXPECT_NEAR(r.weight[1], 0.5 / (s0 + 0.5), 1e-15);
}

TEST(MoeRoute, TheBiasChangesTheChoiceButNotTheWeights) {
  // Sigmoid, z = [2, 0, 0], bias [0, −0.1, 0.3]: selection scores σ(2) ≈ 0.881, 0.4, 0.8 → experts
  // 0 and 2; their weights from the scores without the bias: σ(2)/(σ(2) + ½), ½/(σ(2) + ½).
  const auto r = route(shape(1, 3, 2, MoeRouter::sigmoid), {2.0, 0.0, 0.0}, {0.0, -0.1, 0.3});
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 2}));
  const double s0 = sigmoid(2.0);
  EXPECT_NEAR(r.weight[0], s0 / (s0 + 0.5), 1e-15);
  EXPECT_NEAR(r.weight[1], 0.5 / (s0 + 0.5), 1e-15);
  // Without the bias experts 1 and 2 tie and 1 is chosen.
  EXPECT_EQ(route(shape(1, 3, 2, MoeRouter::sigmoid), {2.0, 0.0, 0.0}).expert,
            (std::vector<std::int32_t>{0, 1}));
}

TEST(MoeCapacity, IsTheCeilingOfCTkOverE) {
  EXPECT_EQ(moe_capacity(shape(4, 2, 1, MoeRouter::softmax, 1.0)), 2);  // ⌈4·1/2⌉
  EXPECT_EQ(moe_capacity(shape(5, 2, 1, MoeRouter::softmax, 0.5)), 2);  // ⌈0.5·5/2⌉ = ⌈1.25⌉
  EXPECT_EQ(moe_capacity(shape(4, 4, 2, MoeRouter::softmax, 1.5)), 3);  // ⌈1.5·8/4⌉
  EXPECT_EQ(moe_capacity(shape(6, 4, 2, MoeRouter::softmax, 1.25)), 4);  // ⌈1.25·12/4⌉ = ⌈3.75⌉
  EXPECT_EQ(moe_capacity(shape(4, 2, 1, MoeRouter::softmax, 8.0)), 4);  // at most every token
  EXPECT_EQ(moe_capacity(shape(7, 4, 2)), 7);                           // dropless
}

TEST(MoeCapacity, DropsTheLateTokensOfAFullExpert) {
  // Four tokens, E = 2, k = 1, C = 1: capacity 2. Tokens 0, 1, 3 prefer expert 0, token 2 expert
  // 1: expert 0 serves tokens 0 and 1 and drops token 3; expert 1 serves token 2.
  const auto r =
      route(shape(4, 2, 1, MoeRouter::softmax, 1.0), {1.0, 0.0, 2.0, 0.0, 0.0, 1.0, 3.0, 0.0});
  EXPECT_EQ(r.expert, (std::vector<std::int32_t>{0, 0, 1, 0}));
  EXPECT_EQ(r.kept, (std::vector<std::uint8_t>{1, 1, 1, 0}));
  EXPECT_EQ(r.routed_per_expert, (std::vector<std::int64_t>{3, 1}));
  EXPECT_EQ(r.tokens_per_expert, (std::vector<std::int64_t>{2, 1}));
  // Dropless (C = 0): every assignment served.
  const auto d = route(shape(4, 2, 1), {1.0, 0.0, 2.0, 0.0, 0.0, 1.0, 3.0, 0.0});
  EXPECT_EQ(d.kept, (std::vector<std::uint8_t>{1, 1, 1, 1}));
  EXPECT_EQ(d.tokens_per_expert, (std::vector<std::int64_t>{3, 1}));
}

TEST(MoeCapacity, CountsEveryChoiceOfAToken) {
  // Three tokens, E = 3, k = 2, C = 1: capacity ⌈3·2/3⌉ = 2. Every token ranks 0 > 1 > 2, so
  // expert 0 and 1 each get all three and drop token 2's assignment; expert 2 gets none. The
  // kept gate weights are not renormalised after the drop.
  const auto r =
      route(shape(3, 3, 2, MoeRouter::softmax, 1.0), {2.0, 1.0, 0.0, 2.0, 1.0, 0.0, 2.0, 1.0, 0.0});
  EXPECT_EQ(r.kept, (std::vector<std::uint8_t>{1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(r.tokens_per_expert, (std::vector<std::int64_t>{2, 2, 0}));
  EXPECT_NEAR(r.weight[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-15);
}

TEST(MoeForward, ADroppedTokenGetsOnlyTheSharedExpert) {
  // Two tokens, E = 1, k = 1, C = 0.5: capacity 1, token 1 dropped. Without a shared expert its
  // output row is zero; with one, it is the shared expert's output alone.
  MoeShape m = shape(2, 1, 1, MoeRouter::softmax, 0.5);
  MoeWeights<double> w;
  w.router = {0.3, -0.2};
  w.w_gate = {1.0, 0.5, 0.5, 1.0};
  w.w_up = {0.5, 1.0, 1.0, -1.0};
  w.w_down = {1.0, 0.0, 0.0, 1.0};
  const std::vector<double> x = {1.0, 2.0, 1.0, 2.0};
  const auto f = moe_forward<double>(m, w, x, {});
  EXPECT_EQ(f.routing.kept, (std::vector<std::uint8_t>{1, 0}));
  // Token 0 (weight 1): gate = x·Wg = [2, 2.5], up = x·Wu = [2.5, −1]; y = silu(gate)·up.
  auto silu = [](double z) { return z * sigmoid(z); };
  EXPECT_NEAR(f.y[0], silu(2.0) * 2.5, 1e-15);
  EXPECT_NEAR(f.y[1], silu(2.5) * -1.0, 1e-15);
  EXPECT_EQ(f.y[2], 0.0);
  EXPECT_EQ(f.y[3], 0.0);
  m.shared_ffn = 2;
  w.shared_gate = w.w_gate;
  w.shared_up = w.w_up;
  w.shared_down = w.w_down;
  const auto s = moe_forward<double>(m, w, x, {});
  EXPECT_NEAR(s.y[2], silu(2.0) * 2.5, 1e-15);
  EXPECT_NEAR(s.y[0], 2.0 * silu(2.0) * 2.5, 1e-15);
}

TEST(MoeAuxLoss, IsWETimesSumOfFractionTimesMeanProbability) {
  // Two tokens, E = 2, k = 1, softmax, logits [ln 3, 0] on both: p = [¾, ¼], both choose expert 0:
  // f = [1, 0], P = [¾, ¼], L_aux = W·2·(1·¾) = 1.5·W.
  MoeShape m = shape(2, 2, 1);
  m.aux_loss_weight = 0.1;
  MoeWeights<double> w;
  w.router = {std::log(3.0), 0.0, 0.0, 0.0};  // x = [1, 0] → z = [ln 3, 0]
  w.w_gate.assign(8, 0.0);
  w.w_up.assign(8, 0.0);
  w.w_down.assign(8, 0.0);
  const std::vector<double> x = {1.0, 0.0, 1.0, 0.0};
  EXPECT_NEAR(moe_forward<double>(m, w, x, {}).aux_loss, 0.15, 1e-15);
  // Sigmoid, P from s / Σ s: z = [ln 3, 0] → s = [¾, ½], q = [0.6, 0.4]; L_aux = 0.1·2·0.6.
  m.router = MoeRouter::sigmoid;
  EXPECT_NEAR(moe_forward<double>(m, w, x, {}).aux_loss, 0.12, 1e-15);
}

TEST(MoeBias, MovesTowardTheMeanCountBySignOnly) {
  // Counts [6, 2, 4, 4], mean 4: the overloaded expert 0 goes down by u, the underloaded expert 1
  // up by u, the two at the mean stay.
  std::vector<double> bias = {0.0, 0.5, -0.25, 1.0};
  const std::vector<std::int64_t> counts = {6, 2, 4, 4};
  moe_update_bias<double>(bias, counts, 0.001);
  EXPECT_DOUBLE_EQ(bias[0], -0.001);
  EXPECT_DOUBLE_EQ(bias[1], 0.501);
  EXPECT_DOUBLE_EQ(bias[2], -0.25);
  EXPECT_DOUBLE_EQ(bias[3], 1.0);
  // In float, counts [2, 1, 0], mean 1: 2 > 1 down, 1 = 1 stays, 0 up.
  std::vector<float> b3 = {0.0f, 0.0f, 0.0f};
  moe_update_bias<float>(b3, std::vector<std::int64_t>{2, 1, 0}, 0.5);
  EXPECT_EQ(b3, (std::vector<float>{-0.5f, 0.0f, 0.5f}));
  // A non-integer mean: counts [3, 2, 2], mean 7/3: 3 down, both 2s up.
  std::vector<double> b = {0.0, 0.0, 0.0};
  moe_update_bias<double>(b, std::vector<std::int64_t>{3, 2, 2}, 0.25);
  EXPECT_EQ(b, (std::vector<double>{-0.25, 0.25, 0.25}));
}

TEST(MoeBias, BalancesASkewedRouterOverSteps) {
  // One token type that always prefers expert 0 (sigmoid, z = [1, 0, 0, 0], k = 1, 8 tokens): the
  // bias update moves tokens off it once the gap between the biases passes σ(1) − ½ ≈ 0.231.
  const MoeShape m = shape(8, 4, 1, MoeRouter::sigmoid);
  std::vector<double> logits;
  for (int t = 0; t < 8; ++t) logits.insert(logits.end(), {1.0, 0.0, 0.0, 0.0});
  std::vector<double> bias(4, 0.0);
  auto r = moe_route<double>(m, logits, bias);
  EXPECT_EQ(r.routed_per_expert, (std::vector<std::int64_t>{8, 0, 0, 0}));
  for (int step = 0; step < 3; ++step) {
    moe_update_bias<double>(bias, r.routed_per_expert, 0.05);
    r = moe_route<double>(m, logits, bias);
  }
  // After 3 steps: b = [−0.15, 0.15, 0.15, 0.15]: σ(1) − 0.15 ≈ 0.581 < ½ + 0.15: expert 1 (the
  // lowest of the tied three) takes every token.
  EXPECT_EQ(r.routed_per_expert, (std::vector<std::int64_t>{0, 8, 0, 0}));
}

TEST(MoeForward, FloatAgreesWithDouble) {
  // The float instantiation (the stage's cpu path) against the double one on a dropping case.
  MoeShape m = shape(6, 3, 2, MoeRouter::sigmoid, 1.0);
  m.hidden = 3;
  m.expert_ffn = 2;
  m.shared_ffn = 2;
  m.aux_loss_weight = 0.01;
  MoeWeights<double> wd;
  auto fill = [](auto& v, std::size_t n, double seed) {
    v.resize(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = std::sin(seed + 1.7 * double(i));
  };
  fill(wd.router, 9, 0.1);
  fill(wd.w_gate, 18, 0.2);
  fill(wd.w_up, 18, 0.3);
  fill(wd.w_down, 18, 0.4);
  fill(wd.shared_gate, 6, 0.5);
  fill(wd.shared_up, 6, 0.6);
  fill(wd.shared_down, 6, 0.7);
  std::vector<double> x, dy;
  fill(x, 18, 0.8);
  fill(dy, 18, 0.9);
  auto to_float = [](const auto& v) { return HostVector<float>(v.begin(), v.end()); };
  MoeWeights<float> wf{to_float(wd.router),     to_float(wd.w_gate),      to_float(wd.w_up),
                       to_float(wd.w_down),     to_float(wd.shared_gate), to_float(wd.shared_up),
                       to_float(wd.shared_down)};
  const auto fd = moe_forward<double>(m, wd, x, {});
  const auto ff = moe_forward<float>(m, wf, to_float(x), {});
  EXPECT_EQ(ff.routing.expert, fd.routing.expert);
  EXPECT_EQ(ff.routing.kept, fd.routing.kept);
  for (std::size_t i = 0; i < fd.y.size(); ++i) EXPECT_NEAR(ff.y[i], fd.y[i], 1e-5);
  const auto gd = moe_backward<double>(m, wd, x, fd, dy);
  const auto gf = moe_backward<float>(m, wf, to_float(x), ff, to_float(dy));
  for (std::size_t i = 0; i < gd.w.router.size(); ++i)
    EXPECT_NEAR(gf.w.router[i], gd.w.router[i], 1e-5);
  for (std::size_t i = 0; i < gd.x.size(); ++i) EXPECT_NEAR(gf.x[i], gd.x[i], 1e-5);
}

// The double version's gradients are the derivatives of its own loss: central differences of
// Σ y·r + L_aux (r fixed) for every parameter and input element, on a case that drops tokens,
// with shared experts, the sigmoid rule, the bias and the auxiliary loss; a step of 1e-6 moves
// no score across another, so the routing stays put. (moe_torch checks them against autograd
// too; this one runs where torch is missing.)
TEST(MoeBackward, MatchesFiniteDifferencesOfItsOwnLoss) {
  for (const MoeRouter router : {MoeRouter::sigmoid, MoeRouter::softmax}) {
    SCOPED_TRACE(router == MoeRouter::sigmoid ? "sigmoid" : "softmax");
    MoeShape m = shape(6, 3, 2, router, 1.0);
    m.hidden = 3;
    m.expert_ffn = 2;
    m.shared_ffn = 4;
    m.aux_loss_weight = 0.3;
    auto fill = [](std::size_t n, double seed) {
      HostVector<double> v(n);
      for (std::size_t i = 0; i < n; ++i) v[i] = std::sin(seed + 2.3 * double(i));
      return v;
    };
    MoeWeights<double> w{fill(9, 0.1),  fill(18, 0.2), fill(18, 0.3), fill(18, 0.4),
                         fill(12, 0.5), fill(12, 0.6), fill(12, 0.7)};
    HostVector<double> x = fill(18, 0.8);
    const HostVector<double> r = fill(18, 0.9);
    const std::vector<double> bias = {0.05, -0.02, 0.0};
    auto loss = [&] {
      const auto f = moe_forward<double>(m, w, x, bias);
      double l = f.aux_loss;
      for (std::size_t i = 0; i < r.size(); ++i) l += f.y[i] * r[i];
      return l;
    };
    const auto f = moe_forward<double>(m, w, x, bias);
    ASSERT_GT(std::count(f.routing.kept.begin(), f.routing.kept.end(), 0), 0) << "drops nothing";
    const MoeGrads<double> g = moe_backward<double>(m, w, x, f, r);
    const std::vector<std::pair<HostVector<double>*, const HostVector<double>*>> tensors = {
        {&x, &g.x},
        {&w.router, &g.w.router},
        {&w.w_gate, &g.w.w_gate},
        {&w.w_up, &g.w.w_up},
        {&w.w_down, &g.w.w_down},
        {&w.shared_gate, &g.w.shared_gate},
        {&w.shared_up, &g.w.shared_up},
        {&w.shared_down, &g.w.shared_down}};
    for (const auto& [value, grad] : tensors) {
      ASSERT_EQ(value->size(), grad->size());
      for (std::size_t i = 0; i < value->size(); ++i) {
        const double keep = (*value)[i], h = 1e-6;
        (*value)[i] = keep + h;
        const double up = loss();
        (*value)[i] = keep - h;
        const double down = loss();
        (*value)[i] = keep;
        EXPECT_NEAR((*grad)[i], (up - down) / (2 * h), 1e-8) << "element " << i;
      }
    }
  }
}

/// parse_stage_cli of a stage whose only group is the experts' flags.
CliOutcome parse_moe(std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  const StageInfo info{.name = "prog", .summary = "test", .flag_groups = {MoeFlags::make}};
  return parse_stage_cli(info, static_cast<int>(args.size()), argv.data());
}

void expect_refused(const std::vector<std::string>& args, const std::string& line) {
  SCOPED_TRACE(fmt::format("{}", fmt::join(args, " ")));
  const CliOutcome r = parse_moe(args);
  EXPECT_FALSE(r.options.has_value());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.message.find(line), std::string::npos) << r.message;
  EXPECT_EQ(std::count(r.message.begin(), r.message.end(), '\n'), 0) << r.message;
}

TEST(MoeCapacity, AFactorPastTheTokensIsDropless) {
  // ⌈C·T·K/E⌉ past T (every token once) is T; 1e300 is compared before any cast to int64.
  MoeShape m;
  m.tokens = 10;
  m.experts = 4;
  m.topk = 2;
  m.capacity_factor = 1e300;
  EXPECT_EQ(moe_capacity(m), 10);
  m.capacity_factor = 2.0;  // ⌈2·10·2/4⌉ = 10: exactly T
  EXPECT_EQ(moe_capacity(m), 10);
  m.capacity_factor = 0.5;  // ⌈0.5·10·2/4⌉ = 3
  EXPECT_EQ(moe_capacity(m), 3);
}

TEST(MoeFlags, DefaultsAndGivenValues) {
  const CliOutcome none = parse_moe({"--ffn", "96", "--hidden", "32", "--heads", "4"});
  ASSERT_TRUE(none.options.has_value()) << none.message;
  const MoeFlags& d = none.options->flags<MoeFlags>();
  const MoeShape m = d.shape(none.options->config, 10);
  EXPECT_EQ(m.experts, 8);
  EXPECT_EQ(m.topk, 2);
  EXPECT_EQ(m.expert_ffn, 96);  // --ffn
  EXPECT_EQ(m.shared_ffn, 0);
  EXPECT_EQ(m.router, MoeRouter::softmax);
  EXPECT_EQ(m.capacity_factor, 0.0);  // dropless
  EXPECT_EQ(moe_capacity(m), 10);
  // DESIGN.md: --capacity-factor 0 is dropless, the default said out loud.
  const CliOutcome dropless =
      parse_moe({"--ffn", "96", "--hidden", "32", "--heads", "4", "--capacity-factor", "0"});
  ASSERT_TRUE(dropless.options.has_value()) << dropless.message;
  EXPECT_EQ(moe_capacity(dropless.options->flags<MoeFlags>().shape(dropless.options->config, 10)),
            10);
  EXPECT_EQ(m.aux_loss_weight, kMoeAuxLossWeight);
  EXPECT_EQ(d.balance(), MoeBalance::aux);
  EXPECT_EQ(d.ep, 0);  // not given: the stage's data-parallel ranks
  // The model's config carries the experts (what --check's reference builds).
  EXPECT_EQ(none.options->config.moe.experts, 8);
  EXPECT_EQ(none.options->config.moe.expert_ffn, 96);
  EXPECT_EQ(none.options->config.moe.bias_rate, 0.0);
  EXPECT_TRUE(none.options->config.moe.layer(2));
  EXPECT_TRUE(d.moe_layer(0));
  EXPECT_TRUE(d.moe_layer(1));

  const CliOutcome given =
      parse_moe({"--experts", "16", "--topk", "4", "--expert-ffn", "24", "--shared-experts", "2",
                 "--moe-every", "2", "--router", "sigmoid", "--capacity-factor", "1.25",
                 "--balance", "bias", "--ep", "4"});
  ASSERT_TRUE(given.options.has_value()) << given.message;
  const MoeFlags& g = given.options->flags<MoeFlags>();
  const MoeShape s = g.shape(given.options->config, 32);
  EXPECT_EQ(s.experts, 16);
  EXPECT_EQ(s.topk, 4);
  EXPECT_EQ(s.expert_ffn, 24);
  EXPECT_EQ(s.shared_ffn, 48);  // two shared experts of width 24
  EXPECT_EQ(s.router, MoeRouter::sigmoid);
  EXPECT_EQ(moe_capacity(s), 10);     // ⌈1.25·32·4/16⌉
  EXPECT_EQ(s.aux_loss_weight, 0.0);  // --balance bias without --aux-loss-weight
  EXPECT_EQ(g.balance(), MoeBalance::bias);
  EXPECT_EQ(g.ep, 4);
  EXPECT_TRUE(g.moe_layer(0));
  EXPECT_FALSE(g.moe_layer(1));
  EXPECT_TRUE(g.moe_layer(2));
  EXPECT_FALSE(given.options->config.moe.layer(1));
  EXPECT_EQ(given.options->config.moe.shared_ffn, 48);
  EXPECT_EQ(given.options->config.moe.bias_rate, kMoeBiasRate);
  // A weight given is used under either balance rule, 0 included.
  const CliOutcome w = parse_moe({"--balance", "bias", "--aux-loss-weight", "0.001"});
  ASSERT_TRUE(w.options.has_value()) << w.message;
  EXPECT_EQ(w.options->flags<MoeFlags>().aux_weight(), 0.001);
  const CliOutcome zero = parse_moe({"--aux-loss-weight", "0"});
  ASSERT_TRUE(zero.options.has_value()) << zero.message;
  EXPECT_EQ(zero.options->flags<MoeFlags>().aux_weight(), 0.0);
  // Every rank must give the same: all ten are in the agreed fields.
  const ConfigFields fields =
      config_fields(StageInfo{.name = "prog", .summary = "test", .flag_groups = {MoeFlags::make}},
                    *given.options);
  for (const char* flag :
       {"--experts", "--topk", "--expert-ffn", "--shared-experts", "--moe-every", "--router",
        "--capacity-factor", "--aux-loss-weight", "--balance", "--ep"})
    EXPECT_TRUE(std::ranges::any_of(fields, [&](const auto& f) { return f.first == flag; }))
        << flag;
}

TEST(MoeFlags, BadInputIsOneLineNamingTheFlagAndTheRule) {
  expect_refused({"--topk", "0"}, "--topk '0': must be a positive number");
  expect_refused({"--topk", "-1"}, "--topk '-1': must be a positive number");
  expect_refused({"--topk", "9"},
                 "--topk (9) must be at most --experts (8): each token is routed to K different "
                 "experts");
  expect_refused({"--experts", "4", "--topk", "5"}, "--topk (5) must be at most --experts (4)");
  expect_refused({"--capacity-factor", "-0.5"},
                 "--capacity-factor '-0.5': must be 0 (dropless) or a positive number");
  expect_refused({"--capacity-factor", "nan"}, "--capacity-factor 'nan'");
  expect_refused({"--capacity-factor", "inf"}, "--capacity-factor 'inf'");
  expect_refused({"--experts", "6", "--ep", "4"},
                 "--experts (6) must be divisible by --ep (4): each EP rank holds E/EP whole "
                 "experts");
  expect_refused({"--ep", "0"}, "--ep '0': must be a positive number");
  expect_refused({"--experts", "0"}, "--experts '0': must be a positive number");
  expect_refused({"--expert-ffn", "0"}, "--expert-ffn '0': must be a positive number");
  expect_refused({"--moe-every", "0"}, "--moe-every '0': must be a positive number");
  expect_refused({"--shared-experts", "-1"}, "--shared-experts '-1': must be 0 (none)");
  expect_refused({"--aux-loss-weight", "-0.01"}, "--aux-loss-weight '-0.01': must be 0");
  expect_refused({"--aux-loss-weight", "nan"}, "--aux-loss-weight 'nan'");
  expect_refused({"--aux-loss-weight", "1e400"}, "--aux-loss-weight");
  expect_refused({"--router", "topk"}, "--router");
  expect_refused({"--balance", "none"}, "--balance");
}

// Stage 10's tensor ops on the cpu (common/ops.h's MoE ops), each against its definition.

Tensor f32_tensor(Tensor::Shape shape, const std::vector<float>& v) {
  const Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

Tensor i32_tensor(Tensor::Shape shape, const std::vector<std::int32_t>& v) {
  const Tensor t = Tensor::empty(std::move(shape), DType::i32);
  std::copy(v.begin(), v.end(), t.data<std::int32_t>());
  return t;
}

TEST(MoeOps, RouteGivesTheReferencesChoicesWithTiesToTheLowerIndex) {
  // Two tokens, E = 5, k = 3: token 0 ties experts 1, 2 and 4 at the top (→ 1, 2, 4), token 1's
  // bias lifts expert 3 above the others (→ 3 first; then 0 and 1 tie below it → 0, 1).
  const std::vector<float> z{0.0f, 2.0f, 2.0f, -1.0f, 2.0f, 1.0f, 1.0f, 0.5f, 0.5f, 0.5f};
  const std::vector<float> b{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (const bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid" : "softmax");
    const Tensor score = Tensor::empty({2, 5}), weight = Tensor::empty({2, 3});
    const Tensor expert = Tensor::empty({2, 3}, DType::i32);
    std::vector<float> bias = b;
    ops::moe_route(f32_tensor({2, 5}, z), Tensor(), sigmoid, score, expert, weight);
    EXPECT_EQ(
        std::vector<std::int32_t>(expert.data<std::int32_t>(), expert.data<std::int32_t>() + 3),
        (std::vector<std::int32_t>{1, 2, 4}));
    bias[3] = 1.0f;
    ops::moe_route(f32_tensor({2, 5}, z), f32_tensor({5}, bias), sigmoid, score, expert, weight);
    EXPECT_EQ(
        std::vector<std::int32_t>(expert.data<std::int32_t>() + 3, expert.data<std::int32_t>() + 6),
        (std::vector<std::int32_t>{3, 0, 1}));
    // The scores and weights are the double reference's, rounded (the bias left out of both).
    const auto ref = moe_route<double>(
        shape(2, 5, 3, sigmoid ? MoeRouter::sigmoid : MoeRouter::softmax),
        std::vector<double>(z.begin(), z.end()), std::vector<double>(bias.begin(), bias.end()));
    for (std::size_t i = 0; i < 10; ++i) EXPECT_NEAR(score.f32()[i], ref.score[i], 1e-7) << i;
    for (std::size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(expert.data<std::int32_t>()[i], ref.expert[i]) << i;
      EXPECT_NEAR(weight.f32()[i], ref.weight[i], 1e-7) << i;
    }
  }
}

TEST(MoeOps, RowMovesAreTheirDefinitions) {
  // x [4, 3]; gather rows 2, 0, 2 scaled by 1, −2, 0.5.
  std::vector<float> xv(12);
  for (std::size_t i = 0; i < xv.size(); ++i) xv[i] = float(i) - 4.0f;
  const Tensor x = f32_tensor({4, 3}, xv), out = Tensor::empty({3, 3});
  ops::gather_rows(x, i32_tensor({3}, {2, 0, 2}), f32_tensor({3}, {1.0f, -2.0f, 0.5f}), out);
  EXPECT_EQ(std::vector<float>(out.f32().begin(), out.f32().end()),
            (std::vector<float>{2, 3, 4, 8, 6, 4, 1, 1.5f, 2}));
  // combine: token 0 = 0.5·row 1 + 2·row 0, token 1 = row 2 only (its second slot dropped), added
  // to what was there.
  const Tensor rows = f32_tensor({3, 2}, {1, 2, 3, 4, 5, 6});
  const Tensor slot = i32_tensor({2, 2}, {1, 0, 2, -1});
  const Tensor weight = f32_tensor({2, 2}, {0.5f, 2.0f, 1.0f, 9.0f});
  const Tensor y = f32_tensor({2, 2}, {10, 10, 20, 20});
  ops::combine_rows(rows, slot, weight, y, /*accumulate=*/true);
  EXPECT_EQ(std::vector<float>(y.f32().begin(), y.f32().end()),
            (std::vector<float>{10 + 1.5f + 2, 10 + 2 + 4, 25, 26}));
  ops::combine_rows(rows, slot, Tensor(), y, /*accumulate=*/false);
  EXPECT_EQ(std::vector<float>(y.f32().begin(), y.f32().end()), (std::vector<float>{4, 6, 5, 6}));
  // rows_dot: a[t]·rows[slot], 0 where dropped.
  const Tensor a = f32_tensor({2, 2}, {1, -1, 2, 0.5f}), d = Tensor::empty({2, 2});
  ops::rows_dot(a, rows, slot, d);
  EXPECT_EQ(std::vector<float>(d.f32().begin(), d.f32().end()),
            (std::vector<float>{3 - 4, 1 - 2, 10 + 3, 0}));
}

TEST(MoeOps, RouterGradientIsTheDoubleReferences) {
  // moe_router_backward with H = 1 and x = 1 adds dz itself to dW_router: the op's dz against it.
  for (const bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid" : "softmax");
    MoeShape m = shape(3, 4, 2, sigmoid ? MoeRouter::sigmoid : MoeRouter::softmax);
    m.hidden = 1;
    m.aux_loss_weight = 0.01;
    const std::vector<double> z{0.3, -1.0, 2.0, 0.5, 1.0, 1.5, -0.5, 0.0, 0.2, 0.1, 0.4, -2.0};
    const auto r = moe_route<double>(m, z, {});
    const std::vector<double> dweight{0.7, -0.2, 0.0, 1.1, -0.4, 0.25};
    const std::vector<std::int64_t> routed{2, 1, 2, 1};
    const HostVector<double> dP = moe_aux_grad<double>(m, routed, 12);
    const std::vector<double> router{0.0, 0.0, 0.0, 0.0};
    const Tensor score = Tensor::empty({3, 4}), dz = Tensor::empty({3, 4});
    std::copy(r.score.begin(), r.score.end(), score.f32().begin());
    std::vector<float> weight(r.weight.begin(), r.weight.end()), dw(dweight.begin(), dweight.end()),
        dp(dP.begin(), dP.end());
    ops::moe_router_dz(score, i32_tensor({3, 2}, r.expert), f32_tensor({3, 2}, weight),
                       f32_tensor({3, 2}, dw), f32_tensor({4}, dp), sigmoid, 12, dz);
    for (std::int64_t t = 0; t < 3; ++t) {
      std::vector<double> want(4, 0.0);
      double dx = 0.0;
      const double one = 1.0;
      moe_router_backward<double>(m, router, &one, r.score.data() + t * 4, r.expert.data() + t * 2,
                                  r.weight.data() + t * 2, dweight.data() + t * 2, dP, 12, &dx,
                                  want.data());
      for (std::size_t e = 0; e < 4; ++e)
        EXPECT_NEAR(dz.f32()[std::size_t(t) * 4 + e], want[e], 1e-6) << t << " " << e;
    }
  }
}

TEST(MoeOps, RefuseTensorsOfTheWrongDtypeOrShape) {
  const Tensor logits = Tensor::empty({2, 4}), score = Tensor::empty({2, 4});
  const Tensor weight = Tensor::empty({2, 2}), expert_f32 = Tensor::empty({2, 2});
  try {
    ops::moe_route(logits, Tensor(), false, score, expert_f32, weight);
    ADD_FAILURE() << "an f32 expert tensor accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("moe_route: expert must be i32[2, 2] on cpu"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(
      ops::gather_rows(logits, i32_tensor({3}, {0, 1, 2}), Tensor(), Tensor::empty({2, 4})),
      std::exception);
  EXPECT_THROW(ops::gather_rows(logits, i32_tensor({1}, {5}), Tensor(), Tensor::empty({1, 4})),
               std::exception);  // row 5 of 2
}

}  // namespace
}  // namespace tpx
