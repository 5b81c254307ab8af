// Stage 06's FP8 GEMMs as they are handed to cuBLASLt (common/fp8_gemm_plan.h, used by
// common/cuda/gemm_fp8.cc), checked without a GPU:
//   - every call is one the cuBLAS documentation supports for FP8 on Ada and Hopper: the
//     requirements are written out below from the documentation ("cublasLtMatmul()": the FP8
//     paragraph and its type table; "Tensor Core Usage"; "cublasLtMatmulDescAttributes_t"), not
//     taken from the code under test;
//   - the call computes the right product: the plan's packs, paddings, layouts and copies are
//     carried out here on small matrices, with cuBLASLt's column-major definition of D, and
//     compared with op(A)·op(B) computed directly;
//   - for the three products of every linear layer at stage 06's shapes (forward x·W, E4M3 x
//     E4M3; dgrad dy·Wᵀ, E5M2 x E4M3; wgrad xᵀ·dy, E4M3 x E5M2) and at odd shapes that need
//     padding, with aligned and misaligned tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/fp8_gemm_plan.h"
#include "common/tensor.h"

namespace tpx {
namespace {

using I = std::int64_t;
using fp8::lt::Call;
using fp8::lt::GemmPlan;
using fp8::lt::Matrix;
using fp8::lt::Op;
using fp8::lt::Pack;
using fp8::lt::Type;

const char* name(Type t) {
  switch (t) {
    case Type::e4m3:
      return "E4M3";
    case Type::e5m2:
      return "E5M2";
    case Type::bf16:
      return "BF16";
    case Type::f16:
      return "F16";
    case Type::f32:
      return "F32";
  }
  return "?";
}

I size_of(Type t) {
  return t == Type::f32 ? 4 : t == Type::bf16 || t == Type::f16 ? 2 : 1;
}

// --- The documented requirements -----------------------------------------------------------------

/// The rows of the FP8 type table of "cublasLtMatmul()" (compute CUBLAS_COMPUTE_32F, scale type
/// CUDA_R_32F): A type, B type, C type, D type. There is no E5M2 x E5M2 row.
struct TypeRow {
  Type a, b, c, d;
};
constexpr Type E4 = Type::e4m3, E5 = Type::e5m2, BF = Type::bf16, H = Type::f16, F = Type::f32;
constexpr TypeRow kFp8Table[] = {
    {E4, E4, BF, BF}, {E4, E4, BF, E4}, {E4, E4, H, E4},  {E4, E4, H, H},   {E4, E4, F, F},
    {E4, E5, BF, BF}, {E4, E5, BF, E4}, {E4, E5, BF, E5}, {E4, E5, H, E4},  {E4, E5, H, E5},
    {E4, E5, H, H},   {E4, E5, F, F},   {E5, E4, BF, BF}, {E5, E4, BF, E4}, {E5, E4, BF, E5},
    {E5, E4, H, E4},  {E5, E4, H, E5},  {E5, E4, H, H},   {E5, E4, F, F}};

/// What is wrong with `c` as an FP8 cublasLtMatmul on Ada or Hopper; empty when nothing.
std::vector<std::string> violations(const Call& c) {
  std::vector<std::string> v;
  if (c.transa != Op::T || c.transb != Op::N)
    v.push_back("not TN: FP8 needs A transposed and B not");
  bool in_table = false;
  for (const TypeRow& r : kFp8Table)
    in_table |= r.a == c.a.type && r.b == c.b.type && r.c == c.c.type && r.d == c.d.type;
  if (!in_table)
    v.push_back(fmt::format("types A {} B {} C {} D {} are not a row of the FP8 table",
                            name(c.a.type), name(c.b.type), name(c.c.type), name(c.d.type)));
  // The stored shapes: A is m x k, or k x m when transposed; B k x n, or n x k; C and D m x n.
  auto shape = [&v](const char* what, const Matrix& x, I rows, I cols) {
    if (x.rows != rows || x.cols != cols)
      v.push_back(fmt::format("{} is {} x {}, the problem needs {} x {}", what, x.rows, x.cols,
                              rows, cols));
    if (x.ld < x.rows) v.push_back(fmt::format("{}'s ld {} < its {} rows", what, x.ld, x.rows));
  };
  shape("A", c.a, c.transa == Op::N ? c.m : c.k, c.transa == Op::N ? c.k : c.m);
  shape("B", c.b, c.transb == Op::N ? c.k : c.n, c.transb == Op::N ? c.n : c.k);
  shape("C", c.c, c.m, c.n);
  shape("D", c.d, c.m, c.n);
  // "Tensor Core Usage", which the FP8 paragraph makes a requirement: 16-byte multiples.
  auto sixteen = [&v](const char* what, I count, Type t) {
    if (count * size_of(t) % 16 != 0)
      v.push_back(fmt::format("{} = {} elements of {} is not a multiple of 16 bytes", what, count,
                              name(t)));
  };
  sixteen("(op_A == N ? m : k)", c.transa == Op::N ? c.m : c.k, c.a.type);
  sixteen("(op_B == N ? k : n)", c.transb == Op::N ? c.k : c.n, c.b.type);
  sixteen("m (C)", c.m, c.c.type);
  sixteen("m (D)", c.m, c.d.type);
  sixteen("lda", c.a.ld, c.a.type);
  sixteen("ldb", c.b.ld, c.b.type);
  sixteen("ldc", c.c.ld, c.c.type);
  sixteen("ldd", c.d.ld, c.d.type);
  if (c.c_is_d &&
      (c.c.type != c.d.type || c.c.rows != c.d.rows || c.c.cols != c.d.cols || c.c.ld != c.d.ld))
    v.push_back("C is D (in place) with another layout");
  return v;
}

/// The plan-level requirements: the call's, pointers 16-byte aligned (an operand used in place
/// must have been so), and each scale factor a 16-byte aligned fp32 of its own.
std::vector<std::string> violations(const GemmPlan& p, bool a16, bool b16, bool c16) {
  std::vector<std::string> v = violations(p.call);
  if (p.a_k.in_place && !a16) v.push_back("A used in place but not 16-byte aligned");
  if (p.b_k.in_place && !b16) v.push_back("B used in place but not 16-byte aligned");
  if (!p.d_scratch && !c16) v.push_back("C written in place but not 16-byte aligned");
  for (const std::size_t off : {p.a_factor_offset, p.b_factor_offset}) {
    if (off % 16 != 0) v.push_back(fmt::format("a scale factor at byte {}, not 16-aligned", off));
    if (off + sizeof(float) > p.factor_bytes) v.push_back("a scale factor outside its scratch");
  }
  const std::size_t lo = std::min(p.a_factor_offset, p.b_factor_offset),
                    hi = std::max(p.a_factor_offset, p.b_factor_offset);
  if (hi - lo < 16) v.push_back("the two scale factors share a 16-byte slot");
  return v;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& e : v) s += "\n  " + e;
  return s;
}

// --- Carrying a plan out -------------------------------------------------------------------------

/// Element (r, c) of a column-major buffer, bounds checked.
double at(const std::vector<double>& buf, I r, I c, I ld) {
  const I i = r + c * ld;
  EXPECT_TRUE(i >= 0 && i < I(buf.size())) << "read outside the buffer at " << r << ", " << c;
  return i >= 0 && i < I(buf.size()) ? buf[std::size_t(i)] : 0.0;
}

/// What kernels::pack_fp8 writes for `pack` from the contiguous row-major source (src_cols
/// columns): out[r][c] = M[r][c] with zeros beyond M, M[r][c] = src[r][c], or src[c][r] when
/// transposed. In place, the source itself.
std::vector<double> pack(const std::vector<double>& src, I src_cols, const Pack& pack) {
  if (pack.in_place) return src;
  std::vector<double> out(std::size_t(pack.out_rows * pack.out_cols), 0.0);
  for (I r = 0; r < pack.rows; ++r)
    for (I c = 0; c < pack.cols; ++c)
      out[std::size_t(r * pack.out_cols + c)] =
          src[std::size_t(pack.transpose ? c * src_cols + r : r * src_cols + c)];
  return out;
}

/// C [m, n] = alpha·op(A)·op(B) + beta·C0 as gemm_fp8.cc runs `p`: pack, copy C into D, the
/// cuBLASLt call by its definition D(i, j) = alpha·Σ op(A)(i, κ)·op(B)(κ, j) + beta·C(i, j) on
/// column-major buffers, copy D out.
std::vector<double> run(const GemmPlan& p, I m, I n, I k, const std::vector<double>& a,
                        bool trans_a, const std::vector<double>& b, bool trans_b,
                        const std::vector<double>& c0, double alpha, double beta) {
  const std::vector<double> a_k = pack(a, trans_a ? m : k, p.a_k);
  const std::vector<double> b_k = pack(b, trans_b ? k : n, p.b_k);
  std::vector<double> d(std::size_t(m * p.np), 1e30);  // a scratch D's padding is never read out
  for (I i = 0; i < m; ++i)
    for (I j = 0; j < n; ++j) d[std::size_t(i * p.np + j)] = c0[std::size_t(i * n + j)];
  const Call& c = p.call;
  // cuBLASLt's A is B_k and its B is A_k (gemm_fp8.cc passes them so); C is D.
  std::vector<double> out = d;
  for (I i = 0; i < c.m; ++i)
    for (I j = 0; j < c.n; ++j) {
      double sum = 0.0;
      for (I kk = 0; kk < c.k; ++kk) {
        const double x = c.transa == Op::T ? at(b_k, kk, i, c.a.ld) : at(b_k, i, kk, c.a.ld);
        const double y = c.transb == Op::T ? at(a_k, j, kk, c.b.ld) : at(a_k, kk, j, c.b.ld);
        sum += x * y;
      }
      const I o = i + j * c.d.ld;
      EXPECT_TRUE(o < I(out.size())) << "D written outside its buffer";
      if (o < I(out.size())) out[std::size_t(o)] = alpha * sum + beta * at(d, i, j, c.c.ld);
    }
  std::vector<double> result(static_cast<std::size_t>(m * n));
  for (I i = 0; i < m; ++i)
    for (I j = 0; j < n; ++j) result[std::size_t(i * n + j)] = out[std::size_t(i * p.np + j)];
  return result;
}

/// Small integers, so that every sum is exact in double.
std::vector<double> integers(I count, int salt) {
  std::vector<double> v(static_cast<std::size_t>(count));
  for (I i = 0; i < count; ++i) v[std::size_t(i)] = double((i * 7 + salt * 13) % 11 - 5);
  return v;
}

void expect_computes_the_product(const GemmPlan& p, I m, I n, I k, bool ta, bool tb) {
  const std::vector<double> a = integers(m * k, 1), b = integers(k * n, 2), c0 = integers(m * n, 3);
  const double alpha = 1.5, beta = 0.5;
  const std::vector<double> got = run(p, m, n, k, a, ta, b, tb, c0, alpha, beta);
  for (I i = 0; i < m; ++i)
    for (I j = 0; j < n; ++j) {
      double sum = 0.0;
      for (I kk = 0; kk < k; ++kk)
        sum += a[std::size_t(ta ? kk * m + i : i * k + kk)] *
               b[std::size_t(tb ? j * k + kk : kk * n + j)];
      const double want = alpha * sum + beta * c0[std::size_t(i * n + j)];
      ASSERT_EQ(got[std::size_t(i * n + j)], want) << "C[" << i << "][" << j << "]";
    }
}

// --- The products of stage 06 --------------------------------------------------------------------

/// One of the three GEMMs of a linear layer with weight W [in, out] and input x [t, in].
struct Product {
  const char* name;
  DType a, b;
  bool ta, tb;
  I m, n, k;
};

std::vector<Product> products_of(I t, I in, I out) {
  return {{"forward x·W (E4M3 x E4M3)", DType::e4m3, DType::e4m3, false, false, t, out, in},
          {"dgrad dy·Wᵀ (E5M2 x E4M3)", DType::e5m2, DType::e4m3, false, true, t, in, out},
          {"wgrad xᵀ·dy (E4M3 x E5M2)", DType::e4m3, DType::e5m2, true, false, in, out, t}};
}

/// Checks every product of a linear [in, out] over t rows with the tensors' alignment as given.
void check_linear(I t, I in, I out, bool a16, bool b16, bool c16, bool simulate) {
  for (const Product& g : products_of(t, in, out)) {
    SCOPED_TRACE(fmt::format("{}: m {} n {} k {}, aligned A {} B {} C {}", g.name, g.m, g.n, g.k,
                             a16, b16, c16));
    const GemmPlan p = fp8::lt::plan_gemm(g.m, g.n, g.k, g.a, g.ta, g.b, g.tb, a16, b16, c16);
    ASSERT_TRUE(p.use_lt) << "the recipe's products all run on the FP8 tensor cores";
    EXPECT_EQ(violations(p, a16, b16, c16), std::vector<std::string>{})
        << joined(violations(p, a16, b16, c16));
    if (simulate) expect_computes_the_product(p, g.m, g.n, g.k, g.ta, g.tb);
  }
}

TEST(Fp8GemmPlan, TheRecipesProductsAreSupportedCallsAtStage06Shapes) {
  // Stage 06's defaults: H 256, NH 8, NKV 8, D 32, F 1024, S 128, B 2 (t = S·B rows), over a TP
  // group of N = 1, 2, 4: the column layers' outputs and the row layers' inputs are split by N.
  const I h = 256, kv = 8 * 32, f = 1024, t = 128 * 2;
  for (const I n : {1, 2, 4}) {
    SCOPED_TRACE(fmt::format("N = {}", n));
    struct Linear {
      const char* name;
      I in, out;
    };
    for (const Linear& l :
         {Linear{"wq", h, h / n}, Linear{"wk", h, kv / n}, Linear{"wv", h, kv / n},
          Linear{"wo", h / n, h}, Linear{"w_gate", h, f / n}, Linear{"w_up", h, f / n},
          Linear{"w_down", f / n, h}}) {
      SCOPED_TRACE(l.name);
      check_linear(t, l.in, l.out, true, true, true, false);
    }
  }
}

TEST(Fp8GemmPlan, OddShapesArePaddedIntoSupportedCallsThatComputeTheProduct) {
  // k not a multiple of 16 (both operands packed, k padded with zero codes), out not a multiple
  // of 4 (a padded scratch D), tiny and ragged shapes, and tensors that are not 16-byte aligned
  // (views at an offset): each must still be a supported call, and the right product.
  struct Shape {
    I t, in, out;
  };
  for (const Shape s : {Shape{37, 40, 24}, Shape{33, 64, 18}, Shape{48, 72, 32}, Shape{1, 1, 1},
                        Shape{5, 17, 3}, Shape{7, 5, 13}, Shape{16, 16, 16}, Shape{20, 48, 36}})
    for (const bool aligned : {true, false}) {
      SCOPED_TRACE(fmt::format("t {} in {} out {}", s.t, s.in, s.out));
      check_linear(s.t, s.in, s.out, aligned, aligned, aligned, true);
      check_linear(s.t, s.in, s.out, aligned, !aligned, aligned, true);
      check_linear(s.t, s.in, s.out, true, true, !aligned, true);
    }
  // A slice of a stage 06 shape, small enough to carry out: every transpose combination.
  for (const bool ta : {false, true})
    for (const bool tb : {false, true}) {
      SCOPED_TRACE(fmt::format("ta {} tb {}", ta, tb));
      const GemmPlan p =
          fp8::lt::plan_gemm(32, 64, 48, DType::e4m3, ta, DType::e4m3, tb, true, true, true);
      EXPECT_EQ(violations(p, true, true, true), std::vector<std::string>{});
      expect_computes_the_product(p, 32, 64, 48, ta, tb);
    }
}

TEST(Fp8GemmPlan, UsesOperandsInPlaceExactlyWhenTheyAreAlreadyKMajorAndAligned) {
  // dgrad, C = A·Bᵀ with k a multiple of 16: no pack at all; forward packs W; wgrad packs both.
  const GemmPlan dgrad =
      fp8::lt::plan_gemm(256, 128, 64, DType::e5m2, false, DType::e4m3, true, true, true, true);
  EXPECT_TRUE(dgrad.a_k.in_place && dgrad.b_k.in_place && !dgrad.d_scratch);
  const GemmPlan forward =
      fp8::lt::plan_gemm(256, 64, 128, DType::e4m3, false, DType::e4m3, false, true, true, true);
  EXPECT_TRUE(forward.a_k.in_place);
  EXPECT_FALSE(forward.b_k.in_place);
  EXPECT_TRUE(forward.b_k.transpose);
  const GemmPlan wgrad =
      fp8::lt::plan_gemm(128, 64, 256, DType::e4m3, true, DType::e5m2, false, true, true, true);
  EXPECT_FALSE(wgrad.a_k.in_place || wgrad.b_k.in_place);
  // A misaligned operand is packed even when its layout would do.
  EXPECT_FALSE(
      fp8::lt::plan_gemm(256, 128, 64, DType::e5m2, false, DType::e4m3, true, false, true, true)
          .a_k.in_place);
}

TEST(Fp8GemmPlan, E5M2TimesE5M2AndEmptySumsTakeTheFallback) {
  EXPECT_FALSE(
      fp8::lt::plan_gemm(16, 16, 16, DType::e5m2, false, DType::e5m2, true, true, true, true)
          .use_lt);
  EXPECT_FALSE(
      fp8::lt::plan_gemm(16, 16, 0, DType::e4m3, false, DType::e4m3, true, true, true, true)
          .use_lt);
}

TEST(Fp8GemmPlan, TheRequirementsCheckRefusesUnsupportedCalls) {
  // The check above is live: it refuses what the documentation does not support.
  const GemmPlan good =
      fp8::lt::plan_gemm(64, 64, 64, DType::e4m3, false, DType::e4m3, true, true, true, true);
  ASSERT_EQ(violations(good, true, true, true), std::vector<std::string>{});
  GemmPlan nn = good;  // "NN", as the row-major problem would be without the transposes
  nn.call.transa = Op::N;
  nn.call.a = {nn.call.a.type, nn.call.m, nn.call.k, nn.call.m};
  EXPECT_NE(violations(nn, true, true, true), std::vector<std::string>{});
  GemmPlan e5m2 = good;  // E5M2 x E5M2 has no row
  e5m2.call.a.type = e5m2.call.b.type = Type::e5m2;
  EXPECT_NE(violations(e5m2, true, true, true), std::vector<std::string>{});
  GemmPlan bf16_c = good;  // an FP32 D takes an FP32 C, not a BF16 one
  bf16_c.call.c.type = Type::bf16;
  bf16_c.call.c_is_d = false;
  EXPECT_NE(violations(bf16_c, true, true, true), std::vector<std::string>{});
  GemmPlan odd_k = good;  // k = 40: not 16 bytes of codes
  odd_k.call.k = 40;
  odd_k.call.a.rows = odd_k.call.b.rows = 40;
  EXPECT_NE(violations(odd_k, true, true, true), std::vector<std::string>{});
  // Both factors in one 8-byte scratch, B's at byte 4.
  GemmPlan shared = good;
  shared.b_factor_offset = sizeof(float);
  shared.factor_bytes = 2 * sizeof(float);
  EXPECT_NE(violations(shared, true, true, true), std::vector<std::string>{});
  // An operand used in place that is not 16-byte aligned.
  EXPECT_NE(violations(good, false, true, true), std::vector<std::string>{});
}

}  // namespace
}  // namespace tpx
