// The CPU ops (through the tpx::ops dispatch): every forward against a plain double-precision loop
// written here, every backward against central finite differences of J = Σ r_i·y_i (fixed random
// r, accumulated in double); the rotary embedding, linear, against a double rotation, its
// backward as its inverse and its adjoint.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/check.h"
#include "common/ops.h"
#include "common/tensor.h"
#include "test_util.h"

namespace tpx {
namespace {

using I = std::int64_t;
using Shape = Tensor::Shape;
using test::random_tensor;
using test::to_doubles;

// ---------------------------------------------------------------------------------------------
// Forward against double loops.
// ---------------------------------------------------------------------------------------------

class GemmForward : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(GemmForward, MatchesDoubleLoopWithAlphaBeta) {
  const auto [ta, tb] = GetParam();
  const I m = 5, n = 7, k = 33;
  const float alpha = 0.75f, beta = -0.5f;
  const Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, 11);
  const Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, 12);
  const Tensor c = random_tensor({m, n}, 13);
  const auto A = to_doubles(a), B = to_doubles(b), C0 = to_doubles(c);

  ops::gemm(a, ta, b, tb, c, alpha, beta);

  const auto got = to_doubles(c);
  for (I i = 0; i < m; ++i)
    for (I j = 0; j < n; ++j) {
      double acc = 0.0, mag = 0.0;
      for (I p = 0; p < k; ++p) {
        const double av = ta ? A[p * m + i] : A[i * k + p];
        const double bv = tb ? B[j * k + p] : B[p * n + j];
        acc += av * bv;
        mag += std::abs(av * bv);
      }
      const double c0 = C0[i * n + j];
      const double want = alpha * acc + beta * c0;
      // Standard fp32 dot-product error bound: (k + 2) roundings of at most FLT_EPSILON relative
      // each, on the sum of magnitudes. A wrong transpose or a dropped alpha/beta is off by O(1).
      const double bound = (k + 2) * FLT_EPSILON * (std::abs(alpha) * mag + std::abs(beta * c0));
      EXPECT_NEAR(got[i * n + j], want, bound) << "C[" << i << ", " << j << "]";
    }
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, GemmForward,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& p) {
                           return std::string(std::get<0>(p.param) ? "At" : "A") +
                                  (std::get<1>(p.param) ? "Bt" : "B");
                         });

// beta = 0 must overwrite C: the block hands gemm uninitialised outputs.
TEST(Gemm, BetaZeroIgnoresGarbageAndSeesActivationsAsMatrices) {
  const I s = 2, b = 3, k = 4, n = 5;
  const Tensor x = random_tensor({s, b, k}, 21);  // [S, B, in] seen as [S·B, in]
  const Tensor w = random_tensor({k, n}, 22);
  const Tensor y = Tensor::empty({s, b, n});
  ops::fill(y, std::numeric_limits<float>::quiet_NaN());
  ops::gemm(x, false, w, false, y);
  const auto X = to_doubles(x), W = to_doubles(w), Y = to_doubles(y);
  for (I r = 0; r < s * b; ++r)
    for (I j = 0; j < n; ++j) {
      double acc = 0.0;
      for (I p = 0; p < k; ++p) acc += X[r * k + p] * W[p * n + j];
      EXPECT_NEAR(Y[r * n + j], acc, 1e-5) << "row " << r << " col " << j;
    }
}

TEST(Gemm, RejectsMismatchedShapes) {
  const Tensor a = Tensor::zeros({3, 4}), b = Tensor::zeros({5, 6}), c = Tensor::zeros({3, 6});
  EXPECT_THROW(ops::gemm(a, false, b, false, c), Error);
}

// y = x / sqrt(mean(x²) + 1e-5) · g, per row; also a zero row (rstd = 1/sqrt(eps), y = 0).
TEST(RmsNorm, ForwardMatchesDoubleLoop) {
  const I s = 3, b = 2, h = 16, rows = s * b;
  const Tensor x = random_tensor({s, b, h}, 31);
  for (I i = 0; i < h; ++i) x.f32()[static_cast<std::size_t>(2 * h + i)] = 0.0f;     // row 2
  for (I i = 0; i < h; ++i) x.f32()[static_cast<std::size_t>(4 * h + i)] *= 300.0f;  // row 4
  const Tensor g = random_tensor({h}, 32, 1.0, 0.3);
  const Tensor y = Tensor::empty({s, b, h}), rstd = Tensor::empty({rows});
  ops::rmsnorm_forward(x, g, y, rstd);

  const auto X = to_doubles(x), G = to_doubles(g), Y = to_doubles(y), R = to_doubles(rstd);
  for (I r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (I i = 0; i < h; ++i) ss += X[r * h + i] * X[r * h + i];
    const double inv = 1.0 / std::sqrt(ss / double(h) + 1e-5);
    // A few fp32 roundings (2^-24 each) on every value: 1e-6 relative is ~16 ulp of headroom.
    EXPECT_NEAR(R[r], inv, 1e-6 * inv) << "rstd row " << r;
    for (I i = 0; i < h; ++i) {
      const double want = X[r * h + i] * inv * G[i];
      EXPECT_NEAR(Y[r * h + i], want, 1e-6 * std::max(1.0, std::abs(want)))
          << "row " << r << " col " << i;
    }
  }
  EXPECT_NEAR(R[2], 1.0 / std::sqrt(1e-5), 1e-3);
}

// out[i] = Σ_{j ≤ i} softmax_j(q_i·k_j / sqrt(D)) v_j per (batch, head); probs is [B, NH, S, S]
// with exact zeros above the diagonal.
TEST(Attention, ForwardMatchesDoubleLoop) {
  const I S = 6, B = 2, NH = 2, D = 4, X = NH * D;
  const Tensor q = random_tensor({S, B, X}, 41), k = random_tensor({S, B, X}, 42),
               v = random_tensor({S, B, X}, 43);
  const Tensor out = Tensor::empty({S, B, X}), probs = Tensor::empty({B, NH, S, S});
  ops::fill(probs, std::numeric_limits<float>::quiet_NaN());
  ops::attention_forward(q, k, v, NH, out, probs);

  const auto Q = to_doubles(q), K = to_doubles(k), V = to_doubles(v), O = to_doubles(out),
             P = to_doubles(probs);
  auto at = [&](I s, I b, I h, I d) {
    return static_cast<std::size_t>((s * B + b) * X + h * D + d);
  };
  for (I b = 0; b < B; ++b)
    for (I h = 0; h < NH; ++h)
      for (I i = 0; i < S; ++i) {
        std::vector<double> p(static_cast<std::size_t>(i + 1));
        double mx = -INFINITY, sum = 0.0;
        for (I j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (I d = 0; d < D; ++d) dot += Q[at(i, b, h, d)] * K[at(j, b, h, d)];
          p[static_cast<std::size_t>(j)] = dot / std::sqrt(double(D));
          mx = std::max(mx, p[static_cast<std::size_t>(j)]);
        }
        for (auto& e : p) sum += (e = std::exp(e - mx));
        for (auto& e : p) e /= sum;
        const std::size_t prow = static_cast<std::size_t>(((b * NH + h) * S + i) * S);
        // Probabilities are <= 1 and outputs O(1); fp32 exp/sums over <= 6 terms stay well
        // within 1e-6.
        for (I j = 0; j < S; ++j) {
          if (j <= i)
            EXPECT_NEAR(P[prow + static_cast<std::size_t>(j)], p[static_cast<std::size_t>(j)], 1e-6)
                << "b " << b << " h " << h << " i " << i << " j " << j;
          else
            EXPECT_EQ(P[prow + static_cast<std::size_t>(j)], 0.0) << "above the diagonal";
        }
        for (I d = 0; d < D; ++d) {
          double want = 0.0;
          for (I j = 0; j <= i; ++j) want += p[static_cast<std::size_t>(j)] * V[at(j, b, h, d)];
          EXPECT_NEAR(O[at(i, b, h, d)], want, 1e-6)
              << "b " << b << " h " << h << " i " << i << " d " << d;
        }
      }
}

// Large logits must not overflow: the softmax subtracts the row maximum.
TEST(Attention, ForwardIsStableForLargeLogits) {
  const I S = 4, B = 1, NH = 1, D = 8;
  const Tensor q = random_tensor({S, B, D}, 44, 0.0, 40.0), k = random_tensor({S, B, D}, 45),
               v = random_tensor({S, B, D}, 46);
  const Tensor out = Tensor::empty({S, B, D}), probs = Tensor::empty({B, NH, S, S});
  ops::attention_forward(q, k, v, NH, out, probs);
  for (float x : out.f32()) EXPECT_TRUE(std::isfinite(x));
  for (I i = 0; i < S; ++i) {
    double sum = 0.0;
    for (I j = 0; j < S; ++j) sum += probs.f32()[static_cast<std::size_t>(i * S + j)];
    EXPECT_NEAR(sum, 1.0, 1e-6) << "row " << i;
  }
}

TEST(SwiGlu, ForwardMatchesDoubleLoop) {
  const Tensor gate = random_tensor({3, 2, 10}, 51, 0.0, 3.0), up = random_tensor({3, 2, 10}, 52);
  const Tensor out = Tensor::empty({3, 2, 10});
  ops::swiglu_forward(gate, up, out);
  const auto Gt = to_doubles(gate), U = to_doubles(up), O = to_doubles(out);
  for (std::size_t i = 0; i < O.size(); ++i) {
    const double want = Gt[i] / (1.0 + std::exp(-Gt[i])) * U[i];
    EXPECT_NEAR(O[i], want, 1e-6 * std::max(1.0, std::abs(want))) << "element " << i;
  }
}

// fp32 addition is correctly rounded, so it equals the double sum rounded to float, exactly.
TEST(AddAccumulate, ExactlyTheRoundedSum) {
  const Tensor a = random_tensor({4, 3, 5}, 61), b = random_tensor({4, 3, 5}, 62);
  const auto A = to_doubles(a), B = to_doubles(b);
  const Tensor out = Tensor::empty({4, 3, 5});
  ops::add(a, b, out);
  for (std::size_t i = 0; i < A.size(); ++i)
    EXPECT_EQ(out.f32()[i], static_cast<float>(A[i] + B[i])) << "add " << i;

  ops::accumulate(b, a);  // a += b
  for (std::size_t i = 0; i < A.size(); ++i)
    EXPECT_EQ(a.f32()[i], static_cast<float>(A[i] + B[i])) << "accumulate " << i;

  const Tensor c = random_tensor({7}, 63), d = random_tensor({7}, 64);
  const auto C = to_doubles(c), Dv = to_doubles(d);
  ops::add(c, d, d);  // out aliasing an input
  for (std::size_t i = 0; i < C.size(); ++i)
    EXPECT_EQ(d.f32()[i], static_cast<float>(C[i] + Dv[i])) << "aliased add " << i;
}

TEST(MseLoss, SumAndBackwardMatchDoubleLoop) {
  const Tensor y = random_tensor({4, 2, 8}, 71), t = random_tensor({4, 2, 8}, 72);
  const auto Y = to_doubles(y), T = to_doubles(t);
  double want = 0.0;
  for (std::size_t i = 0; i < Y.size(); ++i) want += (Y[i] - T[i]) * (Y[i] - T[i]);
  EXPECT_NEAR(ops::mse_loss_sum(y, t), want, 1e-12 * want);  // accumulated in double

  const double scale = 1.0 / double(Y.size());
  const Tensor dy = Tensor::empty({4, 2, 8});
  ops::mse_loss_backward(y, t, scale, dy);
  for (std::size_t i = 0; i < Y.size(); ++i) {
    const double g = scale * (Y[i] - T[i]);
    EXPECT_NEAR(dy.f32()[i], g, 2 * FLT_EPSILON * std::abs(g)) << "element " << i;
  }
}

TEST(Sgd, UpdateMatchesDoubleLoop) {
  const Tensor w = random_tensor({6, 5}, 81), g = random_tensor({6, 5}, 82);
  const auto W = to_doubles(w), G = to_doubles(g);
  const float lr = 0.3f;
  ops::sgd_update(w, g, lr);
  for (std::size_t i = 0; i < W.size(); ++i) {
    const double want = W[i] - double(lr) * G[i];
    // Two fp32 roundings (the product and the difference) on operands of size |W| + |lr·G|.
    EXPECT_NEAR(w.f32()[i], want, 2 * FLT_EPSILON * (std::abs(W[i]) + std::abs(lr * G[i])))
        << "element " << i;
  }
}

TEST(SumSquares, MatchesDoubleLoop) {
  const Tensor x = random_tensor({3, 4, 5}, 91);
  double want = 0.0;
  for (double v : to_doubles(x)) want += v * v;
  EXPECT_NEAR(ops::sum_squares(x), want, 1e-12 * want);
  EXPECT_GT(want, 0.0);
}

TEST(Fill, SetsEveryElement) {
  const Tensor t = random_tensor({3, 7}, 92);
  ops::fill(t, 2.5f);
  for (float v : t.f32()) EXPECT_EQ(v, 2.5f);
}

// ---------------------------------------------------------------------------------------------
// Backward against central finite differences.
//
// J(θ) = Σ r_i·y_i(θ) with a fixed random r, accumulated in double, so ∂J/∂θ is what backward
// returns when fed dy = r. Each element θ_k is moved by ±eps (eps = 1e-2 on O(1) inputs) and the
// difference is divided by the actually stored fp32 step. Error budget:
//  - truncation: eps²/6·|∂³J| ≈ 2e-5·O(1);
//  - rounding: only the outputs that depend on θ_k change between the two evaluations; each
//    carries a few fp32 ulps (~1e-7 relative), so J moves by ≲ sqrt(16)·1e-7 and the quotient by
//    ≲ 4e-7 / 2e-2 = 2e-5.
// The tolerance |fd − analytic| <= 1e-3·(max |fd| over the tensor) + 1e-3·|fd| is ~50x that
// budget (and every check here still passes at a tenth of it), while a wrong term in a backward
// formula is off by O(10%) or more of the gradient's scale.
// ---------------------------------------------------------------------------------------------

constexpr double kEps = 1e-2;

double dot(const Tensor& r, const Tensor& y) {
  double s = 0.0;
  auto pr = r.f32(), py = y.f32();
  for (std::size_t i = 0; i < pr.size(); ++i) s += double(pr[i]) * double(py[i]);
  return s;
}

/// Central differences of `objective` w.r.t. every element of `x` (restored afterwards).
std::vector<double> numeric_grad(const Tensor& x, const std::function<double()>& objective,
                                 double eps = kEps) {
  auto v = x.f32();
  std::vector<double> g(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float orig = v[i];
    v[i] = static_cast<float>(orig + eps);
    const double xp = v[i], jp = objective();
    v[i] = static_cast<float>(orig - eps);
    const double xm = v[i], jm = objective();
    v[i] = orig;
    g[i] = (jp - jm) / (xp - xm);
  }
  return g;
}

void expect_grad_close(const std::vector<double>& analytic, const std::vector<double>& numeric,
                       const std::string& name) {
  ASSERT_EQ(analytic.size(), numeric.size()) << name;
  const double scale = test::max_abs(numeric);
  ASSERT_GT(scale, 1e-3) << name << ": the gradient is too small for the check to mean anything";
  for (std::size_t i = 0; i < analytic.size(); ++i)
    EXPECT_NEAR(analytic[i], numeric[i], 1e-3 * scale + 1e-3 * std::abs(numeric[i]))
        << name << "[" << i << "]";
}

TEST(GemmBackward, TransposedGemmsAreTheLinearMapsGradient) {
  // y = A·B; dA = dy·Bᵀ and dB = Aᵀ·dy, both computed with ops::gemm's transposes.
  const I m = 4, k = 6, n = 5;
  const Tensor a = random_tensor({m, k}, 101), b = random_tensor({k, n}, 102),
               r = random_tensor({m, n}, 103);
  const Tensor y = Tensor::empty({m, n});
  auto objective = [&] {
    ops::gemm(a, false, b, false, y);
    return dot(r, y);
  };
  const Tensor da = Tensor::empty({m, k}), db = Tensor::empty({k, n});
  ops::gemm(r, false, b, true, da);
  ops::gemm(a, true, r, false, db);
  expect_grad_close(to_doubles(da), numeric_grad(a, objective), "dA");
  expect_grad_close(to_doubles(db), numeric_grad(b, objective), "dB");
}

TEST(RmsNormBackward, MatchesFiniteDifferences) {
  const I s = 3, b = 2, h = 16;
  const Tensor x = random_tensor({s, b, h}, 111), g = random_tensor({h}, 112, 1.0, 0.3),
               r = random_tensor({s, b, h}, 113);
  const Tensor y = Tensor::empty({s, b, h}), rstd = Tensor::empty({s * b});
  auto objective = [&] {
    ops::rmsnorm_forward(x, g, y, rstd);
    return dot(r, y);
  };
  objective();  // rstd of the unperturbed x for backward
  const Tensor dx = Tensor::empty({s, b, h}), dg = Tensor::empty({h});
  ops::rmsnorm_backward(r, x, g, rstd, dx, dg);
  expect_grad_close(to_doubles(dx), numeric_grad(x, objective), "dx");
  expect_grad_close(to_doubles(dg), numeric_grad(g, objective), "dg");
}

TEST(AttentionBackward, MatchesFiniteDifferences) {
  const I S = 6, B = 2, NH = 2, D = 4, X = NH * D;
  const Tensor q = random_tensor({S, B, X}, 121), k = random_tensor({S, B, X}, 122),
               v = random_tensor({S, B, X}, 123), r = random_tensor({S, B, X}, 124);
  const Tensor out = Tensor::empty({S, B, X}), probs = Tensor::empty({B, NH, S, S});
  auto objective = [&] {
    ops::attention_forward(q, k, v, NH, out, probs);
    return dot(r, out);
  };
  objective();  // probs of the unperturbed inputs for backward
  const Tensor dq = Tensor::empty({S, B, X}), dk = Tensor::empty({S, B, X}),
               dv = Tensor::empty({S, B, X});
  ops::attention_backward(r, q, k, v, probs, NH, dq, dk, dv);
  expect_grad_close(to_doubles(dq), numeric_grad(q, objective), "dq");
  expect_grad_close(to_doubles(dk), numeric_grad(k, objective), "dk");
  expect_grad_close(to_doubles(dv), numeric_grad(v, objective), "dv");
}

// Rotary embedding in double, written from the definition: in every head of x [S, B, NH·D], the
// pair (i, i + D/2) at position p turns by the angle p·θ^(−2i/D) (times `sign`: −1 for the
// inverse).
std::vector<double> rope_reference(const std::vector<double>& x, I S, I B, I NH, I D, double theta,
                                   double sign) {
  std::vector<double> y(x.size());
  const I half = D / 2;
  for (I p = 0; p < S; ++p)
    for (I h = 0; h < B * NH; ++h)
      for (I i = 0; i < half; ++i) {
        const double angle =
            sign * double(p) * std::exp(-(2.0 * double(i) / double(D)) * std::log(theta));
        const auto a = static_cast<std::size_t>((p * B * NH + h) * D + i),
                   b = a + std::size_t(half);
        y[a] = x[a] * std::cos(angle) - x[b] * std::sin(angle);
        y[b] = x[b] * std::cos(angle) + x[a] * std::sin(angle);
      }
  return y;
}

struct RopeCase {
  I s, b, heads, d;
  double theta;
};

const RopeCase kRopeCases[] = {{77, 2, 3, 8, 10000.0},
                               {77, 2, 2, 64, 500000.0},
                               {9, 1, 4, 64, 10000.0},
                               {5, 3, 1, 2, 500000.0}};

// Each output is two fp32 products and a sum, with cos and sin rounded to fp32 once: at most a
// few roundings of |x1| + |x2| (2^-24 ≈ 6e-8 each), well inside 1e-6·(|x1| + |x2|). A wrong
// angle, pairing or sign is off by O(1) on most pairs.
TEST(Rope, ForwardMatchesDoubleRotation) {
  for (const RopeCase& c : kRopeCases) {
    SCOPED_TRACE(testing::Message() << "S " << c.s << " B " << c.b << " heads " << c.heads << " D "
                                    << c.d << " theta " << c.theta);
    const Tensor x = random_tensor({c.s, c.b, c.heads * c.d}, 61);
    const auto X = to_doubles(x);
    ops::rope_forward(x, c.heads, c.theta);
    const auto Y = to_doubles(x);
    const auto want = rope_reference(X, c.s, c.b, c.heads, c.d, c.theta, 1.0);
    const I half = c.d / 2;
    for (std::size_t e = 0; e < X.size(); ++e) {
      const std::size_t in_head = e % std::size_t(c.d);
      const std::size_t a = in_head < std::size_t(half) ? e : e - std::size_t(half);
      const double mag = std::abs(X[a]) + std::abs(X[a + std::size_t(half)]);
      ASSERT_NEAR(Y[e], want[e], 1e-6 * mag + 1e-30) << "element " << e;
    }
    // Position 0 turns by angle 0: cos 1, sin 0 exactly, so the first row is unchanged.
    for (std::size_t e = 0; e < std::size_t(c.b * c.heads * c.d); ++e) EXPECT_EQ(Y[e], X[e]) << e;
  }
}

TEST(Rope, BackwardUndoesForward) {
  for (const RopeCase& c : kRopeCases) {
    SCOPED_TRACE(testing::Message() << "S " << c.s << " D " << c.d << " theta " << c.theta);
    const Tensor x = random_tensor({c.s, c.b, c.heads * c.d}, 62);
    const auto X = to_doubles(x);
    ops::rope_forward(x, c.heads, c.theta);
    const auto Y = to_doubles(x);
    ops::rope_backward(x, c.heads, c.theta);
    const auto Z = to_doubles(x);
    // The backward alone is the rotation by −angle.
    const auto back = rope_reference(Y, c.s, c.b, c.heads, c.d, c.theta, -1.0);
    double moved = 0.0;  // forward must not be the identity for the round trip to mean anything
    for (std::size_t e = 0; e < X.size(); ++e) {
      moved = std::max(moved, std::abs(Y[e] - X[e]));
      EXPECT_NEAR(Z[e], X[e], 2e-6 * (1.0 + std::abs(X[e]))) << "element " << e;
      EXPECT_NEAR(Z[e], back[e], 2e-6 * (1.0 + std::abs(X[e]))) << "element " << e;
    }
    EXPECT_GT(moved, 0.1);
  }
}

// rope_backward is the adjoint of rope_forward: <R x, y> = <x, Rᵀ y> (sums in double).
TEST(Rope, BackwardIsTheAdjoint) {
  for (const RopeCase& c : kRopeCases) {
    SCOPED_TRACE(testing::Message() << "S " << c.s << " D " << c.d << " theta " << c.theta);
    const Tensor::Shape shape{c.s, c.b, c.heads * c.d};
    const Tensor x = random_tensor(shape, 63), y = random_tensor(shape, 64);
    const Tensor rx = Tensor::empty(shape), rty = Tensor::empty(shape);
    ops::copy(x, rx);
    ops::copy(y, rty);
    ops::rope_forward(rx, c.heads, c.theta);
    ops::rope_backward(rty, c.heads, c.theta);
    const double lhs = dot(rx, y), rhs = dot(x, rty);
    double mag = 0.0;  // Σ |x|·|y| bounds what roundings of a few 2^-24 can move either side
    for (std::size_t e = 0; e < x.f32().size(); ++e)
      mag += std::abs(double(x.f32()[e])) * std::abs(double(y.f32()[e]));
    EXPECT_NEAR(lhs, rhs, 2e-6 * mag);
    // And it is not the forward rotation again (which would not be the adjoint).
    const Tensor ry = Tensor::empty(shape);
    ops::copy(y, ry);
    ops::rope_forward(ry, c.heads, c.theta);
    if (c.s > 1) {
      EXPECT_GT(std::abs(dot(x, ry) - lhs), 1e-3 * mag);
    }
  }
}

TEST(Rope, RefusesOddHeadDimsAndBadArguments) {
  const Tensor x = random_tensor({4, 1, 6}, 65);
  EXPECT_THROW(ops::rope_forward(x, 2, 10000.0), Error);   // D = 3
  EXPECT_THROW(ops::rope_backward(x, 2, 10000.0), Error);  // D = 3
  EXPECT_THROW(ops::rope_forward(x, 4, 10000.0), Error);   // 6 columns, 4 heads
  EXPECT_THROW(ops::rope_forward(x, 0, 10000.0), Error);
  EXPECT_THROW(ops::rope_forward(x, 3, 0.0), Error);  // theta 0 is "no rotation": not a call
  EXPECT_THROW(ops::rope_forward(random_tensor({4, 6}, 66), 3, 10000.0), Error);  // not [S, B, X]
}

TEST(SwiGluBackward, MatchesFiniteDifferences) {
  const Tensor gate = random_tensor({4, 2, 6}, 131, 0.0, 2.0), up = random_tensor({4, 2, 6}, 132),
               r = random_tensor({4, 2, 6}, 133);
  const Tensor out = Tensor::empty({4, 2, 6});
  auto objective = [&] {
    ops::swiglu_forward(gate, up, out);
    return dot(r, out);
  };
  const Tensor dgate = Tensor::empty({4, 2, 6}), dup = Tensor::empty({4, 2, 6});
  ops::swiglu_backward(r, gate, up, dgate, dup);
  expect_grad_close(to_doubles(dgate), numeric_grad(gate, objective), "dgate");
  expect_grad_close(to_doubles(dup), numeric_grad(up, objective), "dup");
}

TEST(MseLossBackward, IsTheGradientOfHalfTheMeanSquaredError) {
  const Tensor y = random_tensor({4, 2, 8}, 141), t = random_tensor({4, 2, 8}, 142);
  const double scale = 1.0 / double(y.numel());
  auto loss = [&] { return 0.5 * scale * ops::mse_loss_sum(y, t); };
  const Tensor dy = Tensor::empty({4, 2, 8});
  ops::mse_loss_backward(y, t, scale, dy);
  // The loss is quadratic, so the central difference is exact up to rounding; the gradient's
  // scale is 1/N, hence the explicit comparison relative to it.
  const auto fd = numeric_grad(y, loss);
  const auto an = to_doubles(dy);
  const double big = test::max_abs(fd);
  ASSERT_GT(big, 0.1 * scale);
  for (std::size_t i = 0; i < fd.size(); ++i) EXPECT_NEAR(an[i], fd[i], 1e-4 * big) << i;
}

// The cross-entropy's backward refuses targets that do not match the logits' rows (the cpu loop
// runs over the targets and would read past the logits).
TEST(CrossEntropyBackward, RefusesTargetsThatAreNotOnePerRow) {
  const Tensor logits = random_tensor({4, 10}, 91), dlogits = Tensor::empty({4, 10});
  Tensor targets = Tensor::empty({6}, DType::i32), lse = Tensor::zeros({6});
  for (std::int64_t r = 0; r < 6; ++r) targets.data<std::int32_t>()[r] = 1;
  EXPECT_THROW(ops::cross_entropy_backward(logits, targets, lse, 0, 10, 1.0, dlogits), Error);
  EXPECT_NO_THROW(ops::cross_entropy_backward(logits, targets.slice0(0, 4), lse.slice0(0, 4), 0, 10,
                                              1.0, dlogits));
}

// A long row's sum of exponentials (a vocabulary shard of 64k columns) stays within fp32's
// rounding of the sum computed in double: the one pass sums in double, not in an fp32 running
// sum that drifts with the row's length.
TEST(CrossEntropyPartial, LongRowSumIsAccurate) {
  const std::int64_t n = 3, cols = 65536;
  const Tensor z = random_tensor({n, cols}, 92, 0.0, 3.0);
  Tensor targets = Tensor::empty({n}, DType::i32);
  for (std::int64_t r = 0; r < n; ++r) targets.data<std::int32_t>()[r] = static_cast<int>(7 * r);
  Tensor m = Tensor::empty({n}), s = Tensor::empty({n}), t = Tensor::empty({n});
  ops::cross_entropy_partial(z, targets, 0, cols, m, s, t);
  for (std::int64_t r = 0; r < n; ++r) {
    double mx = -INFINITY, sum = 0.0;
    for (std::int64_t j = 0; j < cols; ++j) mx = std::max(mx, double(z.f32()[r * cols + j]));
    for (std::int64_t j = 0; j < cols; ++j) sum += std::exp(double(z.f32()[r * cols + j]) - mx);
    EXPECT_EQ(m.f32()[r], float(mx)) << r;
    EXPECT_NEAR(s.f32()[r], sum, 1e-6 * sum) << r;
    EXPECT_EQ(t.f32()[r], z.f32()[r * cols + 7 * r]) << r;
  }
}

}  // namespace
}  // namespace tpx
