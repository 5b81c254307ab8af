// The whole stacked block (two layers, stage 01's linear layers): input and weight gradients from
// block_backward against central finite differences of the loss 0.5·mean((y − y*)²).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "01_baseline/layers.h"
#include "common/block.h"
#include "common/model.h"
#include "common/ops.h"
#include "test_util.h"

namespace tpx {
namespace {

BlockConfig tiny_config() {
  BlockConfig c;
  c.hidden = 16;
  c.heads = 2;
  c.ffn = 32;
  c.seq = 8;
  c.batch = 2;
  c.layers = 2;
  c.seed = 99;
  return c;
}

class StackedBlock : public ::testing::Test {
 protected:
  void SetUp() override {
    c_ = tiny_config();
    m_ = make_model(c_, Sharding{});
    // At the initial scale (weights N(0, 0.02²)) attention is nearly uniform and the attention
    // weights' gradients almost vanish, so a wrong dWq/dWk would hide under any tolerance. Scale
    // the weights to std ~0.3 and jitter the gains so every path carries an O(1) share.
    std::mt19937 gen(5);
    std::uniform_real_distribution<float> jitter(0.5f, 1.5f);
    for (auto& layer : m_.params)
      for (Param p : kAllParams) {
        for (float& v : layer[p].f32())
          v = param_split(p) == Split::replicated ? jitter(gen) : 15.0f * v;
      }
    acts_.resize(static_cast<std::size_t>(c_.layers));
  }

  /// Forward through every layer; the loss in double from the fp32 output.
  double loss() {
    Tensor y = m_.input;
    for (std::size_t l = 0; l < acts_.size(); ++l)
      y = block_forward(c_, m_.params[l], y, par_, acts_[l]);
    last_output_ = y;
    double sum = 0.0;
    auto py = y.f32(), pt = m_.target.f32();
    for (std::size_t i = 0; i < py.size(); ++i)
      sum += (double(py[i]) - pt[i]) * (double(py[i]) - pt[i]);
    return 0.5 * sum / double(py.size());
  }

  /// Forward + backward: fills m_.grads and returns dL/dx.
  Tensor backward() {
    loss();
    Tensor dy = Tensor::empty(last_output_.shape());
    ops::mse_loss_backward(last_output_, m_.target, 1.0 / double(last_output_.numel()), dy);
    for (std::size_t l = acts_.size(); l-- > 0;)
      dy = block_backward(c_, m_.params[l], acts_[l], dy, par_, m_.grads[l]);
    return dy;
  }

  /// Fourth-order central difference of the loss w.r.t. element i of t (restored afterwards):
  /// (8·(L(+h) − L(−h)) − (L(+2h) − L(−2h))) / 12h, divided by the actually stored fp32 steps.
  double numeric(const Tensor& t, std::size_t i, double eps) {
    auto v = t.f32();
    const float orig = v[i];
    auto diff = [&](double k) {  // (L(x + k·eps) − L(x − k·eps)) / (stored step)
      v[i] = static_cast<float>(orig + k * eps);
      const double xp = v[i], lp = loss();
      v[i] = static_cast<float>(orig - k * eps);
      const double xm = v[i], lm = loss();
      return (lp - lm) / (xp - xm);
    };
    const double g = (4 * diff(1) - diff(2)) / 3;
    v[i] = orig;
    return g;
  }

  /// Compares `analytic` with finite differences of the loss at `samples` random elements of
  /// `t`. The loss is computed in double from the fp32 block output, so each evaluation carries
  /// fp32 rounding noise of a few ulps of the outputs; a plain central difference trades that
  /// noise (∝ 1/eps) against truncation (∝ eps²) and never gets below ~3e-4 of the gradient's
  /// scale here. The fourth-order stencil's truncation is ∝ eps⁴, so eps = 3e-2 (3-10% of the
  /// perturbed values) keeps both small: observed worst error ≈ 4e-5 × (the tensor's largest
  /// gradient). The tolerance 1e-3 × scale + 1e-3·|fd| leaves ~25x headroom, while a wrong term in
  /// backward is off by a sizeable fraction of the scale.
  void check(const std::string& name, const Tensor& t, const std::vector<double>& analytic,
             int samples, std::mt19937& gen) {
    const double scale = test::max_abs(analytic);
    ASSERT_GT(scale, 1e-3) << name << ": gradient too small for the check to mean anything";
    std::uniform_int_distribution<std::size_t> pick(0, analytic.size() - 1);
    for (int s = 0; s < samples; ++s) {
      const std::size_t i = pick(gen);
      const double fd = numeric(t, i, 3e-2);
      EXPECT_NEAR(analytic[i], fd, 1e-3 * scale + 1e-3 * std::abs(fd)) << name << "[" << i << "]";
    }
  }

  BlockConfig c_;
  Model m_;
  baseline::SerialLinears par_;
  std::vector<BlockActivations> acts_;
  Tensor last_output_;
};

TEST_F(StackedBlock, GradientsMatchFiniteDifferencesOfTheLoss) {
  const Tensor dx = backward();
  // Copies: the finite differences re-run forward, which must not touch the analytic results.
  const auto input_grad = test::to_doubles(dx);
  std::vector<std::vector<std::vector<double>>> grads;
  for (const auto& layer : m_.grads) {
    auto& g = grads.emplace_back();
    for (Param p : kAllParams) g.push_back(test::to_doubles(layer[p]));
  }

  std::mt19937 gen(2024);
  check("input.grad", m_.input, input_grad, 24, gen);
  for (std::size_t l = 0; l < m_.params.size(); ++l)
    for (Param p : kAllParams)
      check("layers." + std::to_string(l) + "." + std::string(param_name(p)) + ".grad",
            m_.params[l][p], grads[l][static_cast<std::size_t>(p)], 12, gen);
}

// The block output itself: the residual structure out = x2 + MLP(x2) means a zero Wd and Wo make
// the stacked block the identity, an exact property independent of every other weight.
TEST_F(StackedBlock, ZeroOutputProjectionsMakeTheIdentity) {
  for (auto& layer : m_.params) {
    ops::fill(layer[Param::wo], 0.0f);
    ops::fill(layer[Param::w_down], 0.0f);
  }
  loss();
  const auto x = m_.input.f32(), y = last_output_.f32();
  ASSERT_EQ(x.size(), y.size());
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(x[i], y[i]) << i;
}

}  // namespace
}  // namespace tpx
