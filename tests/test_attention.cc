// Fused (FlashAttention-2) attention against a plain double-precision attention written here,
// forward (out and lse) and backward (dq, dk, dv), and against the naive ops, on sizes that do
// not fall on the kernels' blocks (S = 1, 37, 130, 300; D = 8 … 128; B and heads > 1), with
// multi-head attention (kv_heads = heads) and grouped-query attention (kv_heads = heads / 2, 1,
// and groups of 2 over 3 KV heads): on the cpu, and on cuda in fp32 and bf16 where a GPU is
// usable (skipped, with the reason, elsewhere). The cpu backward of both implementations is also
// checked against central finite differences of a scalar loss, and grouped-query attention
// against multi-head attention on K and V repeated over each group (dK, dV then the sums over
// the group of the repeated heads' gradients). The rules the cuda kernels read their operands by
// (common/cuda/flash_operands.h) are checked on the host.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/cuda/flash_operands.h"
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
  I kv = 0;  ///< KV heads; 0: as many as query heads
  I kv_heads() const { return kv == 0 ? heads : kv; }
  Tensor::Shape act() const { return {s, b, heads * d}; }          ///< q, out, dq, dout
  Tensor::Shape kv_act() const { return {s, b, kv_heads() * d}; }  ///< k, v, dk, dv
};

void PrintTo(const Sizes& z, std::ostream* os) {
  *os << "S" << z.s << "_B" << z.b << "_NH" << z.heads << "_D" << z.d;
  if (z.kv != 0) *os << "_KV" << z.kv;
}

/// Causal attention in double on q [S, B, heads·D] and k, v [S, B, kv_heads·D], forward and
/// backward, the way the formulas read (no blocks, no online softmax): query head h uses KV head
/// h / (heads / kv_heads); P = softmax(q kᵀ / sqrt(D)) over j <= i, O = P V; dV = Pᵀ dO,
/// dP = dO Vᵀ, dS = P ∘ (dP − Σ_j P ∘ dP), dQ = dS K / sqrt(D), dK = dSᵀ Q / sqrt(D), dK and dV
/// added up over every query head that reads the KV head.
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
  /// The largest |term| sums of dQ and dK: scale·Σ_j P_ij·(|dP_ij| + |Σ_j P·dP|)·|k_j| (and
  /// ·|q_i|), the size of what cancels in dS = P ∘ (dP − Σ_j P ∘ dP), to which every rounding error
  /// in dQ and dK is proportional.
  double dq_terms = 0.0, dk_terms = 0.0;
};

Reference reference(const Sizes& z, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout) {
  const I S = z.s, B = z.b, NH = z.heads, D = z.d, NKV = z.kv_heads();
  const double scale = 1.0 / std::sqrt(double(D));
  auto at = [&](I s, I b, I h, I d) {  // q, out, dout, dq
    return static_cast<std::size_t>(((s * B + b) * NH + h) * D + d);
  };
  auto kat = [&](I s, I b, I h, I d) {  // k, v, dk, dv; h is the query head
    return static_cast<std::size_t>(((s * B + b) * NKV + h / (NH / NKV)) * D + d);
  };
  Reference r;
  r.out.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * NH * S), 0.0);
  std::vector<double> dq_terms(q.size(), 0.0), dk_terms(k.size(), 0.0);
  for (I b = 0; b < B; ++b)
    for (I h = 0; h < NH; ++h)
      for (I i = 0; i < S; ++i) {
        std::vector<double> p(static_cast<std::size_t>(i + 1)), dp(p.size());
        double mx = -INFINITY;
        for (I j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (I d = 0; d < D; ++d) dot += q[at(i, b, h, d)] * k[kat(j, b, h, d)];
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
            r.out[at(i, b, h, d)] += p[std::size_t(j)] * v[kat(j, b, h, d)];
            r.dv[kat(j, b, h, d)] += p[std::size_t(j)] * dout[at(i, b, h, d)];
            acc += dout[at(i, b, h, d)] * v[kat(j, b, h, d)];
          }
          dp[std::size_t(j)] = acc;
          rowdot += p[std::size_t(j)] * acc;
        }
        for (I j = 0; j <= i; ++j) {
          const double ds = p[std::size_t(j)] * (dp[std::size_t(j)] - rowdot) * scale;
          const double ds_terms =
              p[std::size_t(j)] * (std::abs(dp[std::size_t(j)]) + std::abs(rowdot)) * scale;
          for (I d = 0; d < D; ++d) {
            r.dq[at(i, b, h, d)] += ds * k[kat(j, b, h, d)];
            r.dk[kat(j, b, h, d)] += ds * q[at(i, b, h, d)];
            dq_terms[at(i, b, h, d)] += ds_terms * std::abs(k[kat(j, b, h, d)]);
            dk_terms[kat(j, b, h, d)] += ds_terms * std::abs(q[at(i, b, h, d)]);
          }
        }
      }
  r.dq_terms = test::max_abs(dq_terms);
  r.dk_terms = test::max_abs(dk_terms);
  return r;
}

/// max |got − want| / max(max |want|, floor). A floor only for dQ and dK: see grad_floor().
double rel_err(const std::vector<double>& got, const std::vector<double>& want,
               double floor = 0.0) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0.0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i)
    err = std::max(err, std::abs(got[i] - want[i]));
  // A NaN anywhere must fail (std::max would drop it).
  for (double g : got)
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
  return err / std::max({test::max_abs(want), floor, 1e-30});
}

/// What dQ and dK errors are measured against where the gradient cancels: at S = 1 the softmax
/// of one score is constant, dS = P·(dP − Δ) = 0, and dQ, dK are exactly zero in double. No
/// floating-point implementation that forms dP and Δ = Σ_j P·dP by different sums (the cuda
/// kernels: a tensor-core product and a warp sum) returns exactly zero, so max |want| cannot be
/// the yardstick there: a gradient below 1/16 of the terms that cancel in it (more than 15/16 of
/// them cancelled) is measured against 1/16 of those terms instead. The sizes here that do not
/// cancel have max |want| at 1/9 to 1/2 of their terms, so their checks are unchanged.
constexpr double kCancelled = 1.0 / 16;

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
            random_tensor(z.kv_act(), 22),
            random_tensor(z.kv_act(), 23),
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
  const Tensor dq = nans(z.act()), dk = nans(z.kv_act()), dv = nans(z.kv_act());
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
  // Pre-filled with NaN: dK, dV accumulate over a group, so they must be overwritten first.
  auto nans = [&](Tensor::Shape shape) {
    const Tensor t = Tensor::empty(std::move(shape), DType::f32, device);
    ops::fill(t, std::numeric_limits<float>::quiet_NaN());
    return t;
  };
  const Tensor dq = nans(z.act()), dk = nans(z.kv_act()), dv = nans(z.kv_act());
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
  EXPECT_LE(rel_err(got.dq, want.dq, kCancelled * want.dq_terms), tol) << "dq";
  EXPECT_LE(rel_err(got.dk, want.dk, kCancelled * want.dk_terms), tol) << "dk";
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
    {1, 1, 1, 32},  // one row: the softmax of a single score is 1
    {1, 1, 2, 64},  // ... on the tensor-core kernels of every head dim, and on CUDA cores
    {1, 2, 4, 128, 2},
    {1, 1, 2, 16},
    {63, 1, 2, 64},  // one row short of a 64-row gpu block, a whole one, one row over
    {64, 2, 2, 32},
    {65, 1, 4, 128, 2},
    {37, 2, 3, 32},   // less than one block
    {130, 1, 2, 64},  // just over one 128-row cpu block (and two 64-row gpu blocks)
    {130, 2, 1, 128},
    {37, 1, 2, 128},
    {300, 1, 2, 16},  // three cpu blocks, a small head
    {65, 1, 1, 8},    // a head dim below a warp
    // Grouped-query attention: kv_heads = heads / 2 and 1, and groups of 2 over 3 KV heads; head
    // dims of both cuda families (32, 64, 128: tensor cores in bf16; 16, 8: CUDA cores).
    {37, 2, 4, 32, 2},
    {37, 2, 4, 32, 1},
    {130, 1, 4, 64, 2},
    {130, 2, 4, 16, 1},
    {300, 1, 4, 16, 2},  // three cpu blocks, every group member crossing them
    {65, 1, 6, 8, 3},
    {70, 1, 4, 128, 1},
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

// The two cpu implementations agree more closely than either with double: the same fp32
// products, summed in a different order.
TEST_P(FusedAttention, CpuFusedMatchesCpuNaive) {
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  const Got fused = run_fused(z, in, Device::cpu, DType::f32);
  const Got naive = run_naive(z, in, Device::cpu, DType::f32);
  EXPECT_LE(rel_err(fused.out, naive.out), 1e-5) << "out";
  EXPECT_LE(rel_err(fused.dq, naive.dq, kCancelled * in.want.dq_terms), 1e-5) << "dq";
  EXPECT_LE(rel_err(fused.dk, naive.dk, kCancelled * in.want.dk_terms), 1e-5) << "dk";
  EXPECT_LE(rel_err(fused.dv, naive.dv), 1e-5) << "dv";
}

// The fused ops are deterministic: a second run gives the same bits.
TEST_P(FusedAttention, CpuFusedIsReproducible) {
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  const Got a = run_fused(z, in, Device::cpu, DType::f32);
  const Got b = run_fused(z, in, Device::cpu, DType::f32);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
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
  EXPECT_LE(rel_err(fused.dq, naive.dq, kCancelled * in.want.dq_terms), 2 * kBf16Tol)
      << "dq, fused vs naive";
  EXPECT_LE(rel_err(fused.dk, naive.dk, kCancelled * in.want.dk_terms), 2 * kBf16Tol)
      << "dk, fused vs naive";
  EXPECT_LE(rel_err(fused.dv, naive.dv), 2 * kBf16Tol) << "dv, fused vs naive";
  expect_close(naive, in.want, kBf16Tol, /*with_lse=*/false);
  if (z.s == 1) {
    // One key: dS = P·(dP − Δ) is zero up to fp32 roundoff when Δ reads dO rounded as dP does
    // (flash_operands.h). With dO unrounded in Δ it was bf16 roundoff, 1e-3 of the terms.
    EXPECT_LE(rel_err(fused.dq, in.want.dq, kCancelled * in.want.dq_terms), kFp32Tol) << "dq, S 1";
    EXPECT_LE(rel_err(fused.dk, in.want.dk, kCancelled * in.want.dk_terms), kFp32Tol) << "dk, S 1";
  }
}

TEST_P(FusedAttention, CudaNaiveFp32MatchesDoubleReference) {
  TPX_REQUIRE_GPU();
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  expect_close(run_naive(z, in, Device::cuda, DType::f32), in.want, kFp32Tol, /*with_lse=*/false);
}

// The cuda fused ops are deterministic too (no atomics): a second run gives the same bits.
TEST_P(FusedAttention, CudaFusedIsReproducible) {
  TPX_REQUIRE_GPU();
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  for (DType compute : {DType::f32, DType::bf16}) {
    const Got a = run_fused(z, in, Device::cuda, compute);
    const Got b = run_fused(z, in, Device::cuda, compute);
    EXPECT_EQ(a.out, b.out) << to_string(compute);
    EXPECT_EQ(a.lse, b.lse) << to_string(compute);
    EXPECT_EQ(a.dq, b.dq) << to_string(compute);
    EXPECT_EQ(a.dk, b.dk) << to_string(compute);
    EXPECT_EQ(a.dv, b.dv) << to_string(compute);
  }
}

// The recipe on cuda's bf16 tensors: the fused ops read and write them as they are stored (no
// fp32 copies), with the op boundary's rounding points. The boundary spelled out by hand on fp32
// tensors holding the same bf16 values: forward under bf16 compute into fp32 out and lse, out
// rounded to bf16; backward on that rounded out, dq, dk, dv rounded. Bit for bit the same: both
// compute each output in fp32 from the same bf16 operands and round it once. A store rounded
// twice, an input read unrounded or Δ read from the unrounded out would differ in some bits.
TEST_P(FusedAttention, CudaBf16TensorsAreTheBoundarysValues) {
  TPX_REQUIRE_GPU();
  const Sizes z = GetParam();
  const Inputs in = inputs(z);
  auto as = [](const Tensor& t, DType dtype) {
    const Tensor c = Tensor::empty(t.shape(), dtype, Device::cuda);
    ops::cast(t, c);
    return c;
  };
  auto bf16 = [&](const Tensor& host) {
    return as(ops::to_device(host, Device::cuda), DType::bf16);
  };
  auto host = [&](const Tensor& t) {
    return to_doubles(ops::to_device(t.dtype() == DType::f32 ? t : as(t, DType::f32), Device::cpu));
  };
  auto empty = [](Tensor::Shape shape, DType dtype) {
    return Tensor::empty(std::move(shape), dtype, Device::cuda);
  };
  const Tensor q = bf16(in.q), k = bf16(in.k), v = bf16(in.v), dout = bf16(in.dout);
  // As stored.
  const Tensor out = empty(z.act(), DType::bf16), lse = empty({z.b, z.heads, z.s}, DType::f32);
  const Tensor dq = empty(z.act(), DType::bf16), dk = empty(z.kv_act(), DType::bf16),
               dv = empty(z.kv_act(), DType::bf16);
  ops::attention_fused_forward(q, k, v, z.heads, out, lse, DType::bf16);
  ops::attention_fused_backward(dout, q, k, v, out, lse, z.heads, dq, dk, dv, DType::bf16);
  // Through fp32 tensors, rounded by hand.
  const Tensor q32 = as(q, DType::f32), k32 = as(k, DType::f32), v32 = as(v, DType::f32),
               dout32 = as(dout, DType::f32);
  const Tensor out32 = empty(z.act(), DType::f32), lse32 = empty({z.b, z.heads, z.s}, DType::f32);
  ops::attention_fused_forward(q32, k32, v32, z.heads, out32, lse32, DType::bf16);
  const Tensor out_rounded = as(out32, DType::bf16);
  const Tensor dq32 = empty(z.act(), DType::f32), dk32 = empty(z.kv_act(), DType::f32),
               dv32 = empty(z.kv_act(), DType::f32);
  ops::attention_fused_backward(dout32, q32, k32, v32, as(out_rounded, DType::f32), lse32, z.heads,
                                dq32, dk32, dv32, DType::bf16);
  EXPECT_EQ(host(out), host(out_rounded)) << "out";
  EXPECT_EQ(host(lse), host(lse32)) << "lse";
  EXPECT_EQ(host(dq), host(as(dq32, DType::bf16))) << "dq";
  EXPECT_EQ(host(dk), host(as(dk32, DType::bf16))) << "dk";
  EXPECT_EQ(host(dv), host(as(dv32, DType::bf16))) << "dv";
  // And the values are attention's.
  const Got got{host(out), host(lse), host(dq), host(dk), host(dv)};
  expect_close(got, in.want, kBf16Tol);
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

// The same with Llama's grouping (4 query heads per KV head), several 64-row blocks per head.
TEST(FusedAttentionCuda, Bf16TensorCoresGroupedQueryAtHeadDim128) {
  TPX_REQUIRE_GPU();
  const Sizes z{256, 2, 8, 128, 2};
  const Inputs in = inputs(z);
  expect_close(run_fused(z, in, Device::cuda, DType::bf16), in.want, kBf16Tol);
  expect_close(run_fused(z, in, Device::cuda, DType::f32), in.want, kFp32Tol);
}

// dQ on the tensor cores sums the shares of every key block in an fp32 accumulator, in the order
// of the blocks' turns (flash_tc_math.h, "dQ's turns"), not as they happen to arrive: at a size
// where 16 key blocks of each of 8 heads add to the same query tiles, run after run gives the
// same bits (an atomic add in arrival order would not).
TEST(FusedAttentionCuda, Bf16BackwardIsTheSameBitsRunAfterRun) {
  TPX_REQUIRE_GPU();
  const Sizes z{1024, 2, 8, 128, 4};
  const Inputs in = inputs(z);
  const Got first = run_fused(z, in, Device::cuda, DType::bf16);
  expect_close(first, in.want, kBf16Tol);
  for (int run = 1; run < 4; ++run) {
    const Got again = run_fused(z, in, Device::cuda, DType::bf16);
    EXPECT_EQ(again.dq, first.dq) << "run " << run;
    EXPECT_EQ(again.dk, first.dk) << "run " << run;
    EXPECT_EQ(again.dv, first.dv) << "run " << run;
  }
}

// Central differences of J = Σ r ∘ O(q, k, v), O the fp32 forward (fused or naive), accumulated
// in double, against the backward with dO = r. Tiny cases: every element of q, k and v is moved;
// with grouped-query attention a KV element moves every query head of its group, so dK and dV
// pass only if they sum over the group.
void check_finite_differences(const Sizes& z, bool fused) {
  SCOPED_TRACE(testing::PrintToString(z) + (fused ? " fused" : " naive"));
  const Tensor q = random_tensor(z.act(), 31), k = random_tensor(z.kv_act(), 32),
               v = random_tensor(z.kv_act(), 33), r = random_tensor(z.act(), 34);
  const Tensor out = Tensor::empty(z.act()), lse = Tensor::empty({z.b, z.heads, z.s}),
               probs = Tensor::empty({z.b, z.heads, z.s, z.s});
  auto loss = [&] {
    if (fused)
      ops::attention_fused_forward(q, k, v, z.heads, out, lse);
    else
      ops::attention_forward(q, k, v, z.heads, out, probs);
    double j = 0.0;
    auto po = out.f32(), pr = r.f32();
    for (std::size_t i = 0; i < po.size(); ++i) j += double(pr[i]) * double(po[i]);
    return j;
  };
  loss();  // out, lse, probs of the unperturbed inputs
  const Tensor dq = Tensor::empty(z.act()), dk = Tensor::empty(z.kv_act()),
               dv = Tensor::empty(z.kv_act());
  if (fused)
    ops::attention_fused_backward(r, q, k, v, out, lse, z.heads, dq, dk, dv);
  else
    ops::attention_backward(r, q, k, v, probs, z.heads, dq, dk, dv);
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

TEST(FusedAttentionGrad, CpuBackwardMatchesFiniteDifferences) {
  check_finite_differences({7, 2, 2, 4}, /*fused=*/true);
}

TEST(GroupedQueryAttentionGrad, CpuBackwardMatchesFiniteDifferences) {
  for (const Sizes& z : {Sizes{7, 2, 4, 4, 2}, Sizes{6, 1, 3, 4, 1}})
    for (bool fused : {true, false}) check_finite_differences(z, fused);
}

// Grouped-query attention is multi-head attention on K and V with each KV head repeated for the
// query heads of its group: out (and lse) and dQ are those of the repeated problem, and dK, dV of
// a KV head are the sums over its group of the repeated heads' dK, dV (added here in double).
void check_against_repeated_heads(const Sizes& z, bool fused) {
  SCOPED_TRACE(testing::PrintToString(z) + (fused ? " fused" : " naive"));
  const I g = z.heads / z.kv_heads();
  const Sizes mha{z.s, z.b, z.heads, z.d};
  Inputs gqa{random_tensor(z.act(), 41),
             random_tensor(z.kv_act(), 42),
             random_tensor(z.kv_act(), 43),
             random_tensor(z.act(), 44),
             {}};
  Inputs rep{gqa.q, Tensor::empty(z.act()), Tensor::empty(z.act()), gqa.dout, {}};
  for (const auto& [from, to] : {std::pair{&gqa.k, &rep.k}, std::pair{&gqa.v, &rep.v}}) {
    auto src = from->f32(), dst = to->f32();
    for (I row = 0; row < z.s * z.b; ++row)
      for (I h = 0; h < z.heads; ++h)
        for (I d = 0; d < z.d; ++d)
          dst[std::size_t((row * z.heads + h) * z.d + d)] =
              src[std::size_t((row * z.kv_heads() + h / g) * z.d + d)];
  }
  const Got got = fused ? run_fused(z, gqa, Device::cpu, DType::f32)
                        : run_naive(z, gqa, Device::cpu, DType::f32);
  const Got want = fused ? run_fused(mha, rep, Device::cpu, DType::f32)
                         : run_naive(mha, rep, Device::cpu, DType::f32);
  std::vector<double> dk(got.dk.size(), 0.0), dv(got.dv.size(), 0.0);
  for (I row = 0; row < z.s * z.b; ++row)
    for (I h = 0; h < z.heads; ++h)
      for (I d = 0; d < z.d; ++d) {
        const auto to = std::size_t((row * z.kv_heads() + h / g) * z.d + d);
        const auto from = std::size_t((row * z.heads + h) * z.d + d);
        dk[to] += want.dk[from];
        dv[to] += want.dv[from];
      }
  // The same fp32 operations on the same values, but for dK, dV summed in fp32 in a different
  // order than the double sum here: a few roundings of the largest value.
  EXPECT_LE(rel_err(got.out, want.out), 1e-6) << "out";
  EXPECT_LE(rel_err(got.lse, want.lse), 1e-6) << "lse";
  EXPECT_LE(rel_err(got.dq, want.dq), 1e-6) << "dq";
  EXPECT_LE(rel_err(got.dk, dk), 1e-6) << "dk";
  EXPECT_LE(rel_err(got.dv, dv), 1e-6) << "dv";
}

TEST(GroupedQueryAttention, CpuEqualsMultiHeadOnRepeatedKvHeads) {
  for (const Sizes& z : {Sizes{37, 2, 6, 16, 2}, Sizes{140, 1, 4, 8, 1}, Sizes{20, 2, 4, 8, 4}})
    for (bool fused : {true, false}) check_against_repeated_heads(z, fused);
}

TEST(GroupedQueryAttention, KvHeadsMustDivideQueryHeads) {
  const Sizes z{8, 1, 4, 4};  // q: 16 columns, 4 heads of 4
  const Tensor q = random_tensor(z.act(), 1), out = Tensor::empty(z.act());
  const Tensor lse = Tensor::empty({z.b, z.heads, z.s}),
               probs = Tensor::empty({z.b, z.heads, z.s, z.s});
  const Tensor kv3 = random_tensor({z.s, z.b, 12}, 2);          // 3 KV heads: not a divisor of 4
  const Tensor kv_odd = random_tensor({z.s, z.b, 6}, 3);        // 1.5 KV heads
  const Tensor kv_short = random_tensor({z.s - 1, z.b, 8}, 4);  // 2 KV heads, one position short
  for (const Tensor* kv : {&kv3, &kv_odd, &kv_short}) {
    EXPECT_THROW(ops::attention_fused_forward(q, *kv, *kv, z.heads, out, lse), Error);
    EXPECT_THROW(ops::attention_forward(q, *kv, *kv, z.heads, out, probs), Error);
  }
  try {
    ops::attention_forward(q, kv3, kv3, z.heads, out, probs);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("divides"), std::string::npos) << e.what();
  }
  // k and v of different widths.
  const Tensor kv2 = random_tensor({z.s, z.b, 8}, 5);
  EXPECT_THROW(ops::attention_fused_forward(q, kv2, q, z.heads, out, lse), Error);
  EXPECT_THROW(ops::attention_forward(q, kv2, q, z.heads, out, probs), Error);
  // Backward: dK, dV shaped like k (2 KV heads), not like q.
  ops::attention_fused_forward(q, kv2, kv2, z.heads, out, lse);
  const Tensor dq = Tensor::empty(z.act()), wrong = Tensor::empty(z.act());
  EXPECT_THROW(ops::attention_fused_backward(q, q, kv2, kv2, out, lse, z.heads, dq, wrong, wrong),
               Error);
  EXPECT_THROW(ops::attention_backward(q, q, kv2, kv2, probs, z.heads, dq, wrong, wrong), Error);
}

TEST(FusedAttentionInput, WrongLseShapeIsAnError) {
  const Sizes z{8, 1, 2, 4};
  const Tensor q = random_tensor(z.act(), 1), out = Tensor::empty(z.act());
  const Tensor lse = Tensor::empty({z.b, z.heads, z.s + 1});
  EXPECT_THROW(ops::attention_fused_forward(q, q, q, z.heads, out, lse), Error);
  EXPECT_THROW(ops::attention_fused_forward(q, q, q, 3, out, lse), Error);  // 8 columns, 3 heads
}

// The rules by which the cuda kernels read their operands (common/cuda/flash_operands.h), run on
// the host. Their bf16 rounding is the library's, which is CUDA's __float2bfloat16_rn.
TEST(FlashOperands, RoundBf16IsTheLibrarysBf16Rounding) {
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           -1.0f,
                           1.0f + 0x1p-8f,      // a tie: to the even neighbour, 1
                           1.0f + 3 * 0x1p-8f,  // a tie: to the even neighbour, 1 + 2⁻⁶
                           -(1.0f + 0x1p-9f),
                           std::numeric_limits<float>::max(),  // rounds up to inf
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::min(),
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::signaling_NaN()};
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  for (int n = 0; n < 100000; ++n) xs.push_back(dist(gen));
  for (const float x : xs) {
    const float got = cuda::flash::round_bf16(x), want = bf16_value(bf16_bits(x));
    EXPECT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(want)) << x;
  }
  EXPECT_EQ(cuda::flash::operand<false>(1.0f + 0x1p-12f), 1.0f + 0x1p-12f);
  EXPECT_EQ(cuda::flash::operand<true>(1.0f + 0x1p-12f), 1.0f);
}

/// Backward's Δ_i = Σ_d dO_id·O_id (flash_delta_kernel) must be Σ_j P_ij·dP_ij of the dP the
/// kernels form, dP_ij = Σ_d operand(dO_id)·operand(v_jd). With O_i = Σ_j P_ij·operand(v_j), the
/// forward's output, the two are one sum in two orders only when Δ reads dO through operand()
/// too; otherwise every dS = P·(dP − Δ) carries Σ_d (dO − bf16(dO))·O, and at S = 1 (P = 1),
/// where dQ and dK are exactly zero, that residue is all they are. Row i = S − 1 (it sees every
/// key) of random scores, V and dO, in double but for the kernels' fp32 products and O.
template <bool kBf16>
void check_delta(I s, I d) {
  SCOPED_TRACE(testing::Message() << "S " << s << ", D " << d << (kBf16 ? ", bf16" : ", fp32"));
  using cuda::flash::delta_term;
  using cuda::flash::operand;
  std::mt19937 gen(static_cast<std::uint32_t>(1000 * s + d));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<double> p(static_cast<std::size_t>(s));
  double sum = 0.0;
  for (double& e : p) sum += (e = std::exp(2.0 * dist(gen)));
  for (double& e : p) e /= sum;
  std::vector<float> v(static_cast<std::size_t>(s * d)), dout(static_cast<std::size_t>(d));
  for (float& e : v) e = dist(gen);
  for (float& e : dout) e = dist(gen);
  auto vat = [&](I j, I c) { return v[static_cast<std::size_t>(j * d + c)]; };
  double delta = 0.0, weighted_dp = 0.0, size = 0.0;
  for (I c = 0; c < d; ++c) {
    double o = 0.0;
    for (I j = 0; j < s; ++j) o += p[std::size_t(j)] * operand<kBf16>(vat(j, c));
    const auto out = static_cast<float>(o);
    delta += delta_term<kBf16>(dout[std::size_t(c)], out);
    size += std::abs(double(dout[std::size_t(c)]) * out);
  }
  for (I j = 0; j < s; ++j) {
    double dp = 0.0;
    for (I c = 0; c < d; ++c)
      dp += double(operand<kBf16>(dout[std::size_t(c)])) * operand<kBf16>(vat(j, c));
    weighted_dp += p[std::size_t(j)] * dp;
  }
  // fp32 roundings of O and of each product: a few 1e-8 of Σ |dO·O|. A dO read unrounded in Δ
  // leaves about 2⁻⁹/sqrt(3·D) of it: 1e-4 at D = 128.
  EXPECT_LE(std::abs(delta - weighted_dp), 1e-6 * size)
      << "delta " << delta << ", sum of P·dP " << weighted_dp;
}

TEST(FlashOperands, DeltaIsTheProbabilityWeightedSumOfDp) {
  for (const I s : {1, 2, 63, 64, 65})
    for (const I d : {8, 16, 32, 64, 128}) {
      check_delta<true>(s, d);
      check_delta<false>(s, d);
    }
}

// Stage 08's chunk pairs under --dtype bf16 on the cpu: the op reads fp32 operands that its
// caller widened once (attention_block_operand) for all the pairs reading them. The op itself
// refuses bf16 on the cpu, so a caller cannot fall back to one widening of q, K/V, dO and O per
// pair (C times the copying on the cpu's hot path). The widened copy holds the same values, so
// the pair's results equal the op run on fp32 tensors of those values, bit for bit.
TEST(BlockAttention, CpuTakesOperandsWidenedOnceByTheCaller) {
  const Sizes z{8, 2, 4, 16, 2};
  auto bf16 = [](const Tensor& t) {
    const Tensor b = Tensor::empty(t.shape(), DType::bf16);
    ops::cast(t, b);
    return b;
  };
  auto f32 = [](const Tensor& b) {
    const Tensor f = Tensor::empty(b.shape());
    ops::cast(b, f);
    return f;
  };
  const Tensor q = bf16(random_tensor(z.act(), 51)), k = bf16(random_tensor(z.kv_act(), 52)),
               v = bf16(random_tensor(z.kv_act(), 53));
  const Tensor out = Tensor::empty(z.act()), lse = Tensor::empty({z.b, z.heads, z.s});
  EXPECT_THROW(ops::attention_block_forward(q, k, v, z.heads, out, lse, 0), Error);
  const Tensor dout = bf16(random_tensor(z.act(), 54)), dq = Tensor::empty(z.act()),
               dk = Tensor::empty(z.kv_act()), dv = Tensor::empty(z.kv_act());
  EXPECT_THROW(ops::attention_block_backward(dout, q, k, v, out, lse, z.heads, dq, dk, dv, 0),
               Error);

  const Tensor qw = ops::attention_block_operand(q), kw = ops::attention_block_operand(k),
               vw = ops::attention_block_operand(v);
  ASSERT_EQ(qw.dtype(), DType::f32);
  EXPECT_EQ(to_doubles(qw), to_doubles(f32(q))) << "the widening is exact";
  // An fp32 operand is read as it is: no copy.
  EXPECT_EQ(ops::attention_block_operand(qw).raw(), qw.raw());

  // The widened operands give what fp32 tensors holding the bf16 values give (shift 3: a pair
  // partly masked).
  const Tensor out2 = Tensor::empty(z.act()), lse2 = Tensor::empty({z.b, z.heads, z.s});
  ops::attention_block_forward(qw, kw, vw, z.heads, out, lse, 3);
  ops::attention_block_forward(f32(q), f32(k), f32(v), z.heads, out2, lse2, 3);
  EXPECT_EQ(to_doubles(out), to_doubles(out2));
  EXPECT_EQ(to_doubles(lse), to_doubles(lse2));
}

}  // namespace
}  // namespace tpx
