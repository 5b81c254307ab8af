// FP8 GEMMs on the tensor cores through cuBLASLt (stage 06's seven linear layers; sm_89+).
//
// The idea. An FP8 operand is its codes q and one scale s per tensor, standing for q / s, so
//
//   C = alpha·(Q_a / s_a)·(Q_b / s_b) + beta·C = alpha·(1/s_a)·(1/s_b)·(Q_a·Q_b) + beta·C.
//
// The tensor cores multiply the codes (a product of two FP8 significands, 4 bits at most each, is
// exact), accumulate in fp32 (CUBLAS_COMPUTE_32F) and cuBLASLt applies the two per-tensor factors
// once per output. It takes them as device pointers, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER and
// B_SCALE_POINTER, to a float that multiplies the operand: the inverse of our scale. A one-thread
// kernel writes 1/s_a and 1/s_b into a device scratch of two floats, so no scale visits the host
// and nothing waits for it.
//
// Rounding. The cpu backend (and the fallback below) rounds each dequantized element, q / s, to
// fp32 and multiplies those; here the codes are multiplied exactly and the rounded reciprocals
// enter afterwards. Both are fp32 GEMMs of the same values up to a few roundings of relative
// size 2⁻²⁴ per output, on top of the summation's own (which differs anyway: another order and,
// inside a tensor-core MMA, fewer bits than fp32 on Hopper; CUBLASLT_MATMUL_DESC_FAST_ACCUM stays
// off, its default, so cuBLASLt promotes the partial sums to fp32 registers as it goes). A scale
// above 2¹²⁶ has a subnormal reciprocal with fewer significant bits (21 at FLT_MAX, not 24); only
// a tensor whose amax is below 448·2⁻¹²⁶ ≈ 5e-36 gets such a scale (see ops::fp8_scale).
//
// Layout: the row-major problem as cuBLASLt's "TN". cuBLASLt is column-major, and its FP8
// kernels on compute capability 8.9 and 9.0 take only D = op_X(X)·op_Y(Y) with op_X = T, op_Y = N:
//
//   D (M x N) = Xᵀ·Y,   X stored K x M, Y stored K x N, column-major (ld ≥ K).
//
// A column-major K x M matrix with leading dimension ld holds X(κ, j) at x[j·ld + κ]: read
// row-major, the same bytes are an [M, K] matrix with row stride ld. So both stored operands are
// row-major matrices whose rows run along k ("K-major"). We want row-major C [m, n] = op(A)·op(B)
// with op(A) [m, k] and op(B) [k, n], and choose
//
//   D = Cᵀ: column-major n x m with ld n is exactly row-major C [m, n]; so M = n, N = m, and
//   X = B_k, the row-major [n, k] matrix B_k[j][κ] = op(B)[κ][j], i.e. B_k = op(B)ᵀ,
//   Y = A_k, the row-major [m, k] matrix A_k[i][κ] = op(A)[i][κ], i.e. A_k = op(A).
//
// Check: D(j, i) = Σ_κ X(κ, j)·Y(κ, i) = Σ_κ op(B)[κ][j]·op(A)[i][κ] = C[i][j], stored at
// d[i·n + j], where row-major C keeps C[i][j]. ✓
//
// Which operands are already K-major: A_k = op(A) is A itself when trans_a = false (A is [m, k])
// and Aᵀ when trans_a = true (A is [k, m]); B_k = op(B)ᵀ is B itself when trans_b = true (B is
// [n, k]) and Bᵀ when trans_b = false (B is [k, n]). So C = A·Bᵀ runs as it is, and every other
// combination transposes one or both operands into scratch first (kernels::pack_fp8,
// fp8_pack.cu). Stage 06: forward x·W transposes W, dgrad dy·Wᵀ runs as it is, wgrad xᵀ·dy
// transposes both.
//
// Alignment. cuBLASLt's FP8 kernels need what "Tensor Core Usage" lists: 16-byte aligned pointers,
// K and the leading dimensions of X and Y multiples of 16 bytes (16 codes), and the rows of the
// f32 D and its leading dimension multiples of 16 bytes (4 floats). Rather than refuse other
// shapes, the pack pads: K to k' = ⌈k/16⌉·16 with zero codes in both operands (the extra terms
// are 0·0 = +0, so the sums are unchanged), and, when n is not a multiple of 4 or C is not
// 16-byte aligned, the GEMM writes a scratch D of n' = ⌈n/4⌉·4 columns (zero rows appended to
// B_k), copied in (beta ≠ 0) and out with cudaMemcpy2DAsync. An operand that is K-major, 16-byte
// aligned and fits k' (and n') is used in place. So every shape runs on the FP8 tensor cores.
//
// Fallbacks to the product of the dequantized operands (as ops::gemm computes it elsewhere):
// E5M2 × E5M2, absent from cuBLASLt's FP8 type table (stage 06 never multiplies two gradients);
// k = 0 (C = beta·C); and a problem for which cuBLASLt's heuristic offers no algorithm, said once
// per shape on stderr as gemm.cc does, since it costs speed.
//
// References, the cuBLAS documentation (docs.nvidia.com/cuda/cublas): "cublasLtMatmul()" (the
// FP8 requirements: A transposed and B not, the "TN" format, on Ada and Hopper; compute type
// CUBLAS_COMPUTE_32F; scale type CUDA_R_32F; the table of FP8 type combinations: E4M3 × E4M3,
// E4M3 × E5M2, E5M2 × E4M3, no E5M2 × E5M2); "Tensor Core Usage" (the alignment above);
// "cublasLtMatmulDescAttributes_t" (A_SCALE_POINTER, B_SCALE_POINTER, FAST_ACCUM).
//
// defines: tpx::cuda::gemm_fp8, tpx::cuda::blas::gemm_fp8
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "blas.h"
#include "check.h"
#include "common/ops.h"
#include "device.h"
#include "kernels.h"
#include "lt_plan.h"
#include "nvtx.h"
#include "ops.h"

namespace tpx::cuda {
namespace {

using I = std::int64_t;

constexpr I kKAlign = 16;  // codes: K and the operands' leading dimensions, 16 bytes
constexpr I kNAlign = 4;   // floats: D's rows and leading dimension, 16 bytes

I round_up(I v, I to) {
  return (v + to - 1) / to * to;
}

bool aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

cudaDataType_t fp8_type(DType d) {
  switch (d) {
    case DType::e4m3:
      return CUDA_R_8F_E4M3;
    case DType::e5m2:
      return CUDA_R_8F_E5M2;
    default:
      fail(fmt::format("no cuBLASLt FP8 type for dtype {}", to_string(d)));
  }
}

// m, n, k, lda, ldb, ldc, A type, B type, alignment of A, B, C.
using Fp8Key = std::tuple<I, I, I, I, I, I, int, int, std::uint32_t, std::uint32_t, std::uint32_t>;

/// The calling thread's FP8 plans (lt_plan.h), next to gemm.cc's per-thread handles and plans.
/// The scale pointers change with every call and are set on a plan's descriptor just before each
/// cublasLtMatmul (set_factors).
struct Fp8Plans {
  std::map<Fp8Key, lt::Plan> plans;
  Fp8Plans() = default;
  ~Fp8Plans() {
    for (auto& [key, p] : plans) lt::destroy(p);
  }
  Fp8Plans(const Fp8Plans&) = delete;
  Fp8Plans& operator=(const Fp8Plans&) = delete;
};

Fp8Plans& fp8_plans() {
  thread_local Fp8Plans p;
  return p;
}

void set_factors(cublasLtMatmulDesc_t desc, const float* a_factor, const float* b_factor) {
  // Column-major view: cuBLASLt's A is our B_k, its B our A_k; each factor follows its operand.
  TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                  &b_factor, sizeof b_factor));
  TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                  &a_factor, sizeof a_factor));
}

const lt::Plan& fp8_plan(cublasLtHandle_t lt, std::size_t workspace_bytes, const Fp8Key& key, I m,
                         I n, I k, blas::Operand a, DType at, const float* a_factor,
                         blas::Operand b, DType bt, const float* b_factor, const void* c, I ldc) {
  auto& plans = fp8_plans().plans;
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  lt::Plan p;
  TPX_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opx = CUBLAS_OP_T, opy = CUBLAS_OP_N;  // "TN"
  const std::int8_t fast_accum = 0;
  TPX_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opx, sizeof opx));
  TPX_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opy, sizeof opy));
  TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                  &fast_accum, sizeof fast_accum));
  set_factors(p.desc, a_factor, b_factor);     // the heuristic sees the problem as it will run
  p.x = lt::layout(fp8_type(bt), k, n, b.ld);  // B_k: K x M column-major, M = n
  p.y = lt::layout(fp8_type(at), k, m, a.ld);  // A_k: K x N column-major, N = m
  p.out = lt::layout(CUDA_R_32F, n, m, ldc);   // Cᵀ: M x N column-major = C [m, n] row-major

  cublasLtMatmulPreference_t pref = nullptr;
  TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const std::uint64_t ws = workspace_bytes;
  const std::uint32_t ax = lt::alignment(b.ptr), ay = lt::alignment(a.ptr), ad = lt::alignment(c);
  TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &ax, sizeof ax));
  TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ay, sizeof ay));
  TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ad, sizeof ad));
  TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof ad));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.x, p.y, p.out, p.out, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    p.algo = result.algo;
    p.usable = true;
  } else if (st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED) {
    // Said once per shape (plans are cached): the fallback is correct but slower.
    fmt::print(stderr,
               "tpx: cuBLASLt has no FP8 algorithm for a {} x {} GEMM m={} n={} k={} (alignment "
               "{} {} {} B); multiplying the dequantized operands in fp32 instead\n",
               to_string(at), to_string(bt), m, n, k, ay, ax, ad);
  } else {
    // An invalid value, a bad handle, no memory: a bug or a broken device, not a missing kernel.
    lt::destroy(p);
    TPX_CUBLAS_CHECK(st);
  }
  return plans.emplace(key, p).first->second;
}

Tensor scratch(Tensor::Shape shape, DType dtype) {
  return Tensor::empty(std::move(shape), dtype, Device::cuda);
}

const std::uint8_t* codes(const Tensor& t) {
  return t.data<std::uint8_t>();
}

/// The product of the dequantized operands in fp32: what ops::gemm computes where there are no
/// FP8 tensor cores.
void dequantized_gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
                      float alpha, float beta) {
  auto dequantized = [](const Tensor& q) {
    const Tensor x = scratch(q.shape(), DType::f32);
    dequantize_fp8(q, q.scale(), x);
    return x;
  };
  gemm(dequantized(a), trans_a, dequantized(b), trans_b, c, alpha, beta);
}

}  // namespace

namespace blas {

bool gemm_fp8(I m, I n, I k, float alpha, Operand a, DType a_type, const float* a_factor, Operand b,
              DType b_type, const float* b_factor, float beta, float* c, I ldc) {
  if (m == 0 || n == 0) return true;
  const LtContext ctx = lt_context();
  auto* const lt = static_cast<cublasLtHandle_t>(ctx.handle);
  const Fp8Key key{m,
                   n,
                   k,
                   a.ld,
                   b.ld,
                   ldc,
                   static_cast<int>(a_type),
                   static_cast<int>(b_type),
                   lt::alignment(a.ptr),
                   lt::alignment(b.ptr),
                   lt::alignment(c)};
  const lt::Plan& p = fp8_plan(lt, ctx.workspace_bytes, key, m, n, k, a, a_type, a_factor, b,
                               b_type, b_factor, c, ldc);
  if (!p.usable) return false;
  set_factors(p.desc, a_factor, b_factor);
  TPX_CUBLAS_CHECK(cublasLtMatmul(lt, p.desc, &alpha, b.ptr, p.x, a.ptr, p.y, &beta, c, p.out, c,
                                  p.out, &p.algo, ctx.workspace, ctx.workspace_bytes,
                                  static_cast<cudaStream_t>(ctx.stream)));
  return true;
}

}  // namespace blas

void gemm_fp8(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
              float alpha, float beta) {
  NvtxRange range("gemm_fp8");
  const auto [m, n, k] = ::tpx::ops::gemm_dims(a, trans_a, b, trans_b, c);
  for (const Tensor* q : {&a, &b})
    TPX_CHECK(is_fp8(q->dtype()) && q->scale().defined() && q->device() == Device::cuda,
              "gemm_fp8 operands must be FP8 on cuda with their scales, got {}", q->describe());
  TPX_CHECK(c.dtype() == DType::f32 && c.device() == Device::cuda,
            "gemm_fp8 C must be f32 on cuda, got {}", c.describe());
  TPX_CHECK(fp8_gemm_supported(),
            "gemm_fp8 needs FP8 tensor cores (compute capability 8.9 or newer); this GPU is {}",
            device_name());
  if (m == 0 || n == 0) return;
  if (k == 0 || (a.dtype() == DType::e5m2 && b.dtype() == DType::e5m2))
    return dequantized_gemm(a, trans_a, b, trans_b, c, alpha, beta);
  auto* const stream = current_stream();

  // The shapes cuBLASLt is given (header, "Alignment"): k' and, unless C can be written in place,
  // n' columns of a scratch D.
  const bool c_in_place = n % kNAlign == 0 && aligned16(c.raw());
  const I kp = round_up(k, kKAlign), np = c_in_place ? n : round_up(n, kNAlign);

  // A_k = op(A) [m, k'] and B_k = op(B)ᵀ [n', k'], K-major: in place, or packed into scratch.
  const bool a_in_place = !trans_a && k == kp && aligned16(a.raw());
  const bool b_in_place = trans_b && k == kp && n == np && aligned16(b.raw());
  Tensor a_k = a, b_k = b;
  if (!a_in_place) {
    a_k = scratch({m, kp}, a.dtype());
    kernels::pack_fp8(codes(a), a.cols(), trans_a, m, k, a_k.data<std::uint8_t>(), m, kp, stream);
    TPX_CUDA_CHECK(cudaGetLastError());
  }
  if (!b_in_place) {
    b_k = scratch({np, kp}, b.dtype());
    kernels::pack_fp8(codes(b), b.cols(), !trans_b, n, k, b_k.data<std::uint8_t>(), np, kp, stream);
    TPX_CUDA_CHECK(cudaGetLastError());
  }

  // The factors cuBLASLt multiplies by: 1/scale_a, 1/scale_b, computed on the device.
  const Tensor factors = scratch({2}, DType::f32);
  float* const f = factors.data<float>();
  kernels::fp8_scale_inverses(a.scale().data<float>(), b.scale().data<float>(), f, stream);
  TPX_CUDA_CHECK(cudaGetLastError());

  // D: C itself, or a scratch [m, n'] holding C (for beta ≠ 0) in its first n columns.
  const Tensor d = c_in_place ? c : scratch({m, np}, DType::f32);
  const auto row = static_cast<std::size_t>(n) * sizeof(float);
  const auto d_row = static_cast<std::size_t>(np) * sizeof(float);
  auto* const cuda_stream = static_cast<cudaStream_t>(stream);
  if (!c_in_place && beta != 0.0f)
    TPX_CUDA_CHECK(cudaMemcpy2DAsync(d.raw(), d_row, c.raw(), row, row, static_cast<std::size_t>(m),
                                     cudaMemcpyDeviceToDevice, cuda_stream));

  if (!blas::gemm_fp8(m, np, kp, alpha, {codes(a_k), kp}, a.dtype(), f, {codes(b_k), kp}, b.dtype(),
                      f + 1, beta, d.data<float>(), np))
    return dequantized_gemm(a, trans_a, b, trans_b, c, alpha, beta);
  if (!c_in_place)
    TPX_CUDA_CHECK(cudaMemcpy2DAsync(c.raw(), row, d.raw(), d_row, row, static_cast<std::size_t>(m),
                                     cudaMemcpyDeviceToDevice, cuda_stream));
}

}  // namespace tpx::cuda
