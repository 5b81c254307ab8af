// Fused (FlashAttention-2) attention against a plain double-precision attention written here,
// forward (out and lse) and backward (dq, dk, dv), and against the naive ops, on sizes that do
// not fall on the kernels' blocks (S = 1, 37, 130, 300; D = 8 … 128; B and heads > 1): on the
// cpu, and on cuda in fp32 and bf16 where a GPU is usable (skipped, with the reason, elsewhere).
// The cpu backward is also checked against central finite differences of a scalar loss.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "common/check.h"
#include "common/ops.h"
#include "common/tensor.h"
#include "test_cuda.h"
#include "test_util.h"

namespace tpx {
namespace {

using I = std::int64_t;
using test::random_tensor;
using test::to_doubles;

struct Sizes {
  I s, b, heads, d;
  Tensor::Shape act() const { return {s, b, heads * d}; }
};

void PrintTo(const Sizes& z, std::ostream* os) {
  *os << "S" << z.s << "_B" << z.b << "_NH" << z.heads << "_D" << z.d;
}

/// Causal attention in double on [S, B, heads·D] values, forward and backward, the way the
/// formulas read (no blocks, no online softmax): P = softmax(q kᵀ / sqrt(D)) over j <= i,
/// O = P V; dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − Σ_j P ∘ dP), dQ = dS K / sqrt(D),
/// dK = dSᵀ Q / sqrt(D).
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

Reference reference(const Sizes& z, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout) {
  const I S = z.s, B = z.b, NH = z.heads, D = z.d;
  const double scale = 1.0 / std::sqrt(double(D));
  auto at = [&](I s, I b, I h, I d) {
    return static_cast<std::size_t>(((s * B + b) * NH + h) * D + d);
  };
  Reference r;
  r.out.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(q.size(), 0.0);
  r.dv.assign(q.size(), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * NH * S), 0.0);
  for (I b = 0; b < B; ++b)
    for (I h = 0; h < NH; ++h)
      for (I i = 0; i < S; ++i) {
        std::vector<double> p(static_cast<std::size_t>(i + 1)), dp(p.size());
        double mx = -INFINITY;
        for (I j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (I d = 0; d < D; ++d) dot += q[at(i, b, h, d)] * k[at(j, b, h, d)];
          p[std::size_t(j)] = dot * scale;
          mx = std::max(mx, p[std::size_t(j)]);
        }
        double sum = 0.0;
        for (double& e : p) sum += (e = std::exp(e - mx));
        for (double& e : p) e /= sum;
        r.lse[std::size_t((b * NH + h) * S + i)] = mx + std::log(sum);
        double rowdot = 0.0;  // Σ_j P·dP
        for (I j = 0; j <= i; ++j) {
          double acc = 0.0;
          for (I d = 0; d < D; ++d) {
            r.out[at(i, b, h, d)] += p[std::size_t(j)] * v[at(j, b, h, d)];
            r.dv[at(j, b, h, d)] += p[std::size_t(j)] * dout[at(i, b, h, d)];
            acc += dout[at(i, b, h, d)] * v[at(j, b, h, d)];
          }
          dp[std::size_t(j)] = acc;
          rowdot += p[std::size_t(j)] * acc;
        }
        for (I j = 0; j <= i; ++j) {
          const double ds = p[std::size_t(j)] * (dp[std::size_t(j)] - rowdot) * scale;
          for (I d = 0; d < D; ++d) {
            r.dq[at(i, b, h, d)] += ds * k[at(j, b, h, d)];
            r.dk[at(j, b, h, d)] += ds * q[at(i, b, h, d)];
          }
        }
      }
  return r;
}

/// max |got − want| / max |want|.
double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0.0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i)
    err = std::max(err, std::abs(got[i] - want[i]));
  // A NaN anywhere must fail (std::max would drop it).
  for (double g : got)
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
  return err / std::max(test::max_abs(want), 1e-30);
}

/// What one backend computed, moved to host doubles.
struct Got {
  std::vector<double> out, lse, dq, dk, dv;
};

struct Inputs {
  Tensor q, k, v, dout;
  Reference want;
};

Inputs inputs(const Sizes& z) {
  Inputs in{random_tensor(z.act(), 21),
            random_tensor(z.act(), 22),
            random_tensor(z.act(), 23),
            random_tensor(z.act(), 24),
            {}};
  in.want = reference(z, to_doubles(in.q), to_doubles(in.k), to_doubles(in.v), to_doubles(in.dout));
  return in;
}

/// The fused ops on `device` (every output pre-filled with NaN: all must be written).
Got run_fused(const Sizes& z, const Inputs& in, Device device, DType compute) {
  auto put = [&](const Tensor& t) { return ops::to_device(t, device); };
  auto nans = [&](Tensor::Shape shape) {
    const Tensor t = Tensor::empty(std::move(shape), DType::f32, device);
    ops::fill(t, std::numeric_limits<float>::quiet_NaN());
    return t;
  };
  const Tensor q = put(in.q), k = put(in.k), v = put(in.v), dout = put(in.dout);
  const Tensor out = nans(z.act()), lse = nans({z.b, z.heads, z.s});
  const Tensor dq = nans(z.act()), dk = nans(z.act()), dv = nans(z.act());
  ops::attention_fused_forward(q, k, v, z.heads, out, lse, compute);
  ops::attention_fused_backward(dout, q, k, v, out, lse, z.heads, dq, dk, dv, compute);
  auto host = [](const Tensor& t) { return to_doubles(ops::to_device(t, Device::cpu)); };
  return {host(out), host(lse), host(dq), host(dk), host(dv)};
}

/// The naive ops on `device`.
Got run_naive(const Sizes& z, const Inputs& in, Device device, DType compute) {
  auto put = [&](const Tensor& t) { return ops::to_device(t, device); };
  const Tensor q = put(in.q), k = put(in.k), v = put(in.v), dout = put(in.dout);
  const Tensor out = Tensor::empty(z.act(), DType::f32, device);
  const Tensor probs = Tensor::empty({z.b, z.heads, z.s, z.s}, DType::f32, device);
  const Tensor dq = Tensor::empty(z.act(), DType::f32, device),
               dk = Tensor::empty(z.act(), DType::f32, device),
               dv = Tensor::empty(z.act(), DType::f32, device);
  ops::attention_forward(q, k, v, z.heads, out, probs, compute);
  ops::attention_backward(dout, q, k, v, probs, z.heads, dq, dk, dv, compute);
  auto host = [](const Tensor& t) { return to_doubles(ops::to_device(t, Device::cpu)); };
  return {host(out), {}, host(dq), host(dk), host(dv)};
}

void expect_close(const Got& got, const Reference& want, double tol, bool with_lse = true) {
  EXPECT_LE(rel_err(got.out, want.out), tol) << "out";
  if (with_lse) {
    EXPECT_LE(rel_err(got.lse, want.lse), tol) << "lse";
  }
  EXPECT_LE(rel_err(got.dq, want.dq), tol) << "dq";
  EXPECT_LE(rel_err(got.dk, want.dk), tol) << "dk";
  EXPECT_LE(rel_err(got.dv, want.dv), tol) << "dv";
}

/// fp32 against double: sums of at most a few hundred O(1) terms, each rounded to ~6e-8
/// relative, stay below 1e-5 of the largest value; 1e-4 leaves room. A dropped mask, scale or
/// rescale is off by O(1).
constexpr double kFp32Tol = 1e-4;
/// bf16 operands (8 significant bits, unit roundoff 2^-8 ≈ 3.9e-3) and, on tensor cores, bf16
/// probabilities and dS: errors of a few units of roundoff relative to the largest value.
constexpr double kBf16Tol = 3e-2;

const std::vector<Sizes> kSizes = {
    {1, 1, 1, 32},    // one row: the softmax of a single score is 1
    {37, 2, 3, 32},   // less than one block
    {130, 1, 2, 64},  // just over one 128-row cpu block (and two 64-row gpu blocks)
    {130, 2, 1, 128}, {37, 1, 2, 128}, {300, 1, 2, 16},  // three cpu blocks, a small head
    {65, 1, 1, 8},                                       // a head dim below a warp
};

class FusedAttention : public testing::TestWithParam<Sizes> {};

TEST_P(FusedAttention, CpuMatchesDoubleReference) {
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  expect_close(run_fused(z, in, Device::cpu, DType::f32), in.want, kFp32Tol);
}

TEST_P(FusedAttention, CpuNaiveMatchesTheSameReference) {
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  expect_close(run_naive(z, in, Device::cpu, DType::f32), in.want, kFp32Tol, /*with_lse=*/false);
}

TEST_P(FusedAttention, CudaFp32MatchesDoubleReference) {
  TPX_REQUIRE_GPU();
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  expect_close(run_fused(z, in, Device::cuda, DType::f32), in.want, kFp32Tol);
}

TEST_P(FusedAttention, CudaBf16MatchesDoubleReference) {
  TPX_REQUIRE_GPU();
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  const Got fused = run_fused(z, in, Device::cuda, DType::bf16);
  expect_close(fused, in.want, kBf16Tol);
  // And the naive bf16 path, which rounds the same operands, agrees with it as well as each
  // agrees with double.
  const Got naive = run_naive(z, in, Device::cuda, DType::bf16);
  EXPECT_LE(rel_err(fused.out, naive.out), 2 * kBf16Tol) << "out, fused vs naive";
  EXPECT_LE(rel_err(fused.dq, naive.dq), 2 * kBf16Tol) << "dq, fused vs naive";
}

INSTANTIATE_TEST_SUITE_P(Sizes, FusedAttention, testing::ValuesIn(kSizes),
                         [](const auto& p) { return testing::PrintToString(p.param); });

// The model sizes of the GPU runs (D = 128, bf16, a few 64-row blocks) on the tensor cores.
TEST(FusedAttentionCuda, Bf16TensorCoresAtHeadDim128) {
  TPX_REQUIRE_GPU();
  const Sizes z{512, 1, 4, 128};
  const Inputs in = inputs(z);
  expect_close(run_fused(z, in, Device::cuda, DType::bf16), in.want, kBf16Tol);
}

// Central differences of J = Σ r ∘ O(q, k, v), O the fused fp32 forward, accumulated in double,
// against the fused backward with dO = r. A tiny case: every element of q, k and v is moved.
TEST(FusedAttentionGrad, CpuBackwardMatchesFiniteDifferences) {
  const Sizes z{7, 2, 2, 4};
  const Tensor q = random_tensor(z.act(), 31), k = random_tensor(z.act(), 32),
               v = random_tensor(z.act(), 33), r = random_tensor(z.act(), 34);
  const Tensor out = Tensor::empty(z.act()), lse = Tensor::empty({z.b, z.heads, z.s});
  auto loss = [&] {
    ops::attention_fused_forward(q, k, v, z.heads, out, lse);
    double j = 0.0;
    auto po = out.f32(), pr = r.f32();
    for (std::size_t i = 0; i < po.size(); ++i) j += double(pr[i]) * double(po[i]);
    return j;
  };
  loss();  // out and lse of the unperturbed inputs
  const Tensor dq = Tensor::empty(z.act()), dk = Tensor::empty(z.act()),
               dv = Tensor::empty(z.act());
  ops::attention_fused_backward(r, q, k, v, out, lse, z.heads, dq, dk, dv);
  constexpr float kStep = 1e-2f;
  for (const auto& [x, dx, name] :
       {std::tuple{&q, &dq, "dq"}, std::tuple{&k, &dk, "dk"}, std::tuple{&v, &dv, "dv"}}) {
    auto px = x->f32();
    const auto analytic = to_doubles(*dx);
    std::vector<double> numeric(px.size());
    for (std::size_t i = 0; i < px.size(); ++i) {
      const float orig = px[i];
      px[i] = orig + kStep;
      const double xp = px[i], jp = loss();
      px[i] = orig - kStep;
      const double xm = px[i], jm = loss();
      px[i] = orig;
      numeric[i] = (jp - jm) / (xp - xm);
    }
    const double big = test::max_abs(numeric);
    ASSERT_GT(big, 1e-2) << name << ": too small a gradient to check";
    for (std::size_t i = 0; i < numeric.size(); ++i)
      EXPECT_NEAR(analytic[i], numeric[i], 1e-3 * big + 1e-3 * std::abs(numeric[i]))
          << name << "[" << i << "]";
  }
}

TEST(FusedAttentionInput, WrongLseShapeIsAnError) {
  const Sizes z{8, 1, 2, 4};
  const Tensor q = random_tensor(z.act(), 1), out = Tensor::empty(z.act());
  const Tensor lse = Tensor::empty({z.b, z.heads, z.s + 1});
  EXPECT_THROW(ops::attention_fused_forward(q, q, q, z.heads, out, lse), Error);
  EXPECT_THROW(ops::attention_fused_forward(q, q, q, 3, out, lse), Error);  // 8 columns, 3 heads
}

}  // namespace
}  // namespace tpx
