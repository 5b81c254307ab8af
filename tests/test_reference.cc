// The double-precision oracle (common/reference.cc): it agrees with stage 01's fp32 code run
// in-process, and its own gradients are the derivatives of its own loss (finite differences in
// double), so a bug in the oracle cannot hide behind the agreement.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "01_baseline/layers.h"
#include "common/model.h"
#include "common/reference.h"
#include "test_util.h"

namespace tpx {
namespace {

BlockConfig small_config() {
  BlockConfig c;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  c.seq = 16;
  c.batch = 2;
  c.layers = 2;
  c.seed = 4321;
  return c;
}

/// max |got − want| / max |want|: the error relative to the tensor's scale, as --check reports.
double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0.0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i)
    err = std::max(err, std::abs(got[i] - want[i]));
  return err / test::max_abs(want);
}

// fp32 (stage 01, BLAS) against double (loops): every value of the first forward + backward and
// the loss after 0..3 SGD steps to 1e-5 relative. fp32 carries ~6e-8 relative per rounding; the
// longest chains here (two layers of 32..64-term dot products, a softmax) accumulate ~1e-6.
TEST(Reference, AgreesWithStage01) {
  const BlockConfig c = small_config();
  constexpr int kSteps = 4;
  const ReferenceRun want = reference_run(c, kSteps);
  const ReferenceRun got = baseline::run_reference(c, kSteps);

  const auto n = static_cast<std::size_t>(c.seq * c.batch * c.hidden);
  ASSERT_EQ(want.output.size(), n);
  ASSERT_EQ(want.input_grad.size(), n);
  ASSERT_EQ(want.grads.size(), static_cast<std::size_t>(c.layers));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  ASSERT_EQ(want.losses.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(got.losses.size(), want.losses.size());

  EXPECT_LT(rel_error(got.output, want.output), 1e-5) << "output";
  EXPECT_LT(rel_error(got.input_grad, want.input_grad), 1e-5) << "input.grad";
  for (std::size_t l = 0; l < want.grads.size(); ++l)
    for (Param p : kAllParams) {
      const auto i = static_cast<std::size_t>(p);
      const auto shape = param_shape(p, c);
      const auto count =
          static_cast<std::size_t>(shape.size() == 1 ? shape[0] : shape[0] * shape[1]);
      const std::string name = "layers." + std::to_string(l) + "." + std::string(param_name(p));
      ASSERT_EQ(want.grads[l][i].size(), count) << name;
      EXPECT_GT(test::max_abs(want.grads[l][i]), 0.0) << name;
      EXPECT_LT(rel_error(got.grads[l][i], want.grads[l][i]), 1e-5) << name << ".grad";
    }
  for (std::size_t s = 0; s < want.losses.size(); ++s)
    EXPECT_NEAR(got.losses[s], want.losses[s], 1e-5 * want.losses[s]) << "loss after " << s;
  // Training moved the weights: the losses are not all the same number.
  EXPECT_NE(want.losses.front(), want.losses.back());
}

// The reference starts from exactly the fp32 values make_model() generates.
TEST(Reference, StartsFromMakeModel) {
  BlockConfig c = small_config();
  c.layers = 1;
  const ReferenceState s = reference_init(c);
  const Model m = make_model(c, Sharding{});
  EXPECT_EQ(s.input, test::to_doubles(m.input));
  EXPECT_EQ(s.target, test::to_doubles(m.target));
  for (Param p : kAllParams)
    EXPECT_EQ(s.params[0][static_cast<std::size_t>(p)], test::to_doubles(m.params[0][p]))
        << param_name(p);
}

BlockConfig tiny_config() {
  BlockConfig c;
  c.hidden = 8;
  c.heads = 2;
  c.ffn = 16;
  c.seq = 4;
  c.batch = 2;
  c.layers = 2;
  c.seed = 77;
  return c;
}

/// A starting point where every path of the block matters: at the initial scale attention is
/// nearly uniform and its weights' gradients nearly vanish, so the weights are scaled to std ~0.3
/// and the gains jittered.
ReferenceState lively_state(const BlockConfig& c) {
  ReferenceState s = reference_init(c);
  std::mt19937 gen(3);
  std::uniform_real_distribution<double> jitter(0.5, 1.5);
  for (auto& layer : s.params)
    for (Param p : kAllParams)
      for (double& v : layer[static_cast<std::size_t>(p)])
        v = param_split(p) == Split::replicated ? jitter(gen) : 15.0 * v;
  return s;
}

// Every gradient element of the oracle against central differences of its own loss, in double.
// With eps = 1e-5 the truncation error is eps²/6·|∂³L| ~ 1e-11 and rounding 1e-16·L/eps ~ 1e-11,
// so 1e-6 of the tensor's gradient scale is a tight bound that still leaves ample headroom.
TEST(Reference, GradientsMatchFiniteDifferencesOfItsLoss) {
  const BlockConfig c = tiny_config();
  const ReferenceState base = lively_state(c);
  const ReferenceRun run = reference_run_from(c, base, 1);
  constexpr double eps = 1e-5;

  auto loss_at = [&](ReferenceState s) { return reference_run_from(c, std::move(s), 1).losses[0]; };
  auto check = [&](const std::string& name, const std::vector<double>& analytic,
                   auto&& element) {  // element(state&) -> double&
    const double scale = test::max_abs(analytic);
    ASSERT_GT(scale, 1e-6) << name << ": gradient too small for the check to mean anything";
    for (std::size_t i = 0; i < analytic.size(); ++i) {
      ReferenceState plus = base, minus = base;
      element(plus)[i] += eps;
      element(minus)[i] -= eps;
      const double fd = (loss_at(std::move(plus)) - loss_at(std::move(minus))) / (2 * eps);
      EXPECT_NEAR(analytic[i], fd, 1e-6 * scale) << name << "[" << i << "]";
    }
  };

  check("input.grad", run.input_grad,
        [](ReferenceState& s) -> std::vector<double>& { return s.input; });
  for (std::size_t l = 0; l < base.params.size(); ++l)
    for (Param p : kAllParams) {
      const auto i = static_cast<std::size_t>(p);
      check("layers." + std::to_string(l) + "." + std::string(param_name(p)) + ".grad",
            run.grads[l][i],
            [l, i](ReferenceState& s) -> std::vector<double>& { return s.params[l][i]; });
    }
}

// The oracle's SGD step: for a small lr, L(w − lr·g) = L(w) − lr·|g|² + O(lr²).
TEST(Reference, SgdStepDecreasesTheLossByLrTimesGradNormSquared) {
  BlockConfig c = tiny_config();
  c.lr = 1e-3;
  const ReferenceState s = lively_state(c);
  const ReferenceRun run = reference_run_from(c, s, 2);
  double g2 = 0.0;
  for (const auto& layer : run.grads)
    for (const auto& g : layer)
      for (double v : g) g2 += v * v;
  ASSERT_GT(g2, 0.0);
  const double decrease = run.losses[0] - run.losses[1];
  EXPECT_NEAR(decrease / (c.lr * g2), 1.0, 1e-2);

  c.lr = 0.0;  // no update: the loss stays put
  const ReferenceRun still = reference_run_from(c, s, 2);
  EXPECT_EQ(still.losses[0], still.losses[1]);
}

}  // namespace
}  // namespace tpx
