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
// kernel writes 1/s_a and 1/s_b into device scratch (each in a slot of its own, see "The scale
// factors" below), so no scale visits the host and nothing waits for it.
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
// These choices, and the types and transposes of the call, are made by a host function,
// fp8::lt::plan_gemm (common/fp8_gemm_plan.h), which tests/test_fp8_gemm_plan.cc checks on the
// cpu against the requirements for forward, dgrad and wgrad at stage 06's shapes.
//
// The scale factors. A_SCALE_POINTER and B_SCALE_POINTER each point to one fp32 (scale mode
// CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, set explicitly where cuBLAS has scale modes, 12.8 on).
// Each factor lives in a 256-byte slot of its own in a small scratch, as a separate allocation
// would (the cuBLAS samples' LtFp8Matmul and PyTorch's scaled_gemm pass scales that way). They
// used to share one 8-byte scratch, which put B's factor at byte 4; on an H100 with cuBLAS 13 the
// heuristic then offered an algorithm for every FP8 problem and every cublasLtMatmul returned
// CUBLAS_STATUS_NOT_SUPPORTED. Of all the arguments, only the scale pointers differed from those
// working calls, and accepted by the heuristic but refused by the run is the mark of a check on
// pointers, which the run makes (the heuristic learns the operands' alignment only from the
// preference): hence the slots. Should cuBLASLt still refuse, the fallback below keeps the
// stage running, at the dequantized GEMM's speed.
//
// Fallbacks to the product of the dequantized operands (as ops::gemm computes it elsewhere):
// E5M2 × E5M2, absent from cuBLASLt's FP8 type table (stage 06 never multiplies two gradients);
// k = 0 (C = beta·C); a problem for which cuBLASLt's heuristic offers no algorithm (or none whose
// result state is CUBLAS_STATUS_SUCCESS); and one for which cublasLtMatmul refuses, at run time,
// every algorithm the heuristic offered (up to 8, tried in turn). Each is said once per shape on
// stderr, as gemm.cc does, since it costs speed.
//
// References, the cuBLAS documentation (docs.nvidia.com/cuda/cublas): "cublasLtMatmul()" (the
// FP8 requirements: A transposed and B not, the "TN" format, on Ada and Hopper; compute type
// CUBLAS_COMPUTE_32F; scale type CUDA_R_32F; the table of FP8 type combinations: E4M3 × E4M3,
// E4M3 × E5M2, E5M2 × E4M3, no E5M2 × E5M2, each with C and D both CUDA_R_32F among its rows);
// "Tensor Core Usage" (the alignment above); "cublasLtMatmulDescAttributes_t" (A_SCALE_POINTER,
// B_SCALE_POINTER, A_SCALE_MODE, B_SCALE_MODE, FAST_ACCUM); "cublasLtMatmulHeuristicResult_t"
// (state).
//
// defines: tpx::cuda::gemm_fp8, tpx::cuda::blas::gemm_fp8
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "blas.h"
#include "check.h"
#include "common/fp8_gemm_plan.h"
#include "common/ops.h"
#include "device.h"
#include "kernels.h"
#include "lt_plan.h"
#include "nvtx.h"
#include "ops.h"

namespace tpx::cuda {
namespace {

using I = std::int64_t;
namespace plan = ::tpx::fp8::lt;

/// Algorithms asked of the heuristic: the best first, the others tried in turn should cuBLASLt
/// refuse one at run time (the heuristic does not see the pointers).
constexpr int kAlgorithms = 8;

bool aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

cudaDataType_t cuda_type(plan::Type t) {
  switch (t) {
    case plan::Type::e4m3:
      return CUDA_R_8F_E4M3;
    case plan::Type::e5m2:
      return CUDA_R_8F_E5M2;
    case plan::Type::bf16:
      return CUDA_R_16BF;
    case plan::Type::f16:
      return CUDA_R_16F;
    case plan::Type::f32:
      return CUDA_R_32F;
  }
  fail("no CUDA data type for this FP8 GEMM element type");
}

cublasOperation_t cuda_op(plan::Op op) {
  return op == plan::Op::T ? CUBLAS_OP_T : CUBLAS_OP_N;
}

cublasLtMatrixLayout_t layout(const plan::Matrix& m) {
  return lt::layout(cuda_type(m.type), m.rows, m.cols, m.ld);
}

// m, n, k, lda, ldb, ldc, A type, B type, alignment of A, B, C.
using Fp8Key = std::tuple<I, I, I, I, I, I, int, int, std::uint32_t, std::uint32_t, std::uint32_t>;

/// One FP8 problem's descriptors and the algorithms the heuristic offered, best first; `current`
/// is the one in use. Once cuBLASLt has refused them all at run time, current == algos.size()
/// and the problem takes the fallback.
struct Fp8Plan {
  lt::Plan lt;
  std::vector<cublasLtMatmulAlgo_t> algos;
  std::size_t current = 0;
  bool usable() const { return current < algos.size(); }
};

/// The calling thread's FP8 plans (lt_plan.h), next to gemm.cc's per-thread handles and plans.
/// The scale pointers change with every call and are set on a plan's descriptor just before each
/// cublasLtMatmul (set_factors).
struct Fp8Plans {
  std::map<Fp8Key, Fp8Plan> plans;
  Fp8Plans() = default;
  ~Fp8Plans() {
    for (auto& [key, p] : plans) lt::destroy(p.lt);
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

void say_fallback(const char* why, DType at, DType bt, I m, I n, I k, std::uint32_t ay,
                  std::uint32_t ax, std::uint32_t ad) {
  fmt::print(stderr,
             "tpx: cuBLASLt {} for a {} x {} GEMM m={} n={} k={} (alignment {} {} {} B); "
             "multiplying the dequantized operands in fp32 instead\n",
             why, to_string(at), to_string(bt), m, n, k, ay, ax, ad);
}

Fp8Plan& fp8_plan(cublasLtHandle_t handle, std::size_t workspace_bytes, const Fp8Key& key,
                  const plan::Call& call, DType at, DType bt, const float* a_factor,
                  const float* b_factor, const void* a, const void* b, const void* c) {
  auto& plans = fp8_plans().plans;
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  Fp8Plan p;
  TPX_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.lt.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opx = cuda_op(call.transa), opy = cuda_op(call.transb);
  const std::int8_t fast_accum = 0;
  TPX_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opx, sizeof opx));
  TPX_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.lt.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opy, sizeof opy));
  TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.lt.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                  &fast_accum, sizeof fast_accum));
#if CUBLAS_VERSION >= 120800
  // One fp32 per tensor: the default scale mode, said explicitly since cuBLAS 12.8 has others.
  const std::int32_t scalar = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  for (const auto attr : {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE})
    TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.lt.desc, attr, &scalar, sizeof scalar));
#endif
  set_factors(p.lt.desc, a_factor, b_factor);  // the heuristic sees the problem as it will run
  p.lt.x = layout(call.a);
  p.lt.y = layout(call.b);
  p.lt.out = layout(call.d);  // C is D (call.c_is_d): one layout for both

  const std::uint32_t ax = lt::alignment(b), ay = lt::alignment(a), ad = lt::alignment(c);
  cublasLtMatmulPreference_t pref = lt::preference(workspace_bytes, ax, ay, ad);
  cublasLtMatmulHeuristicResult_t results[kAlgorithms] = {};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
      handle, p.lt.desc, p.lt.x, p.lt.y, p.lt.out, p.lt.out, pref, kAlgorithms, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS) {
    // A result's other fields hold only if its state is CUBLAS_STATUS_SUCCESS
    // (cublasLtMatmulHeuristicResult_t).
    for (int i = 0; i < found; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace_bytes)
        p.algos.push_back(results[i].algo);
  } else if (st != CUBLAS_STATUS_NOT_SUPPORTED) {
    // An invalid value, a bad handle, no memory: a bug or a broken device, not a missing kernel.
    lt::destroy(p.lt);
    TPX_CUBLAS_CHECK(st);
  }
  if (p.algos.empty())  // said once per shape (plans are cached): correct but slower
    say_fallback("has no FP8 algorithm", at, bt, call.n, call.m, call.k, ay, ax, ad);
  p.lt.usable = !p.algos.empty();
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

/// Copies an operand into its K-major scratch as the plan says (or returns it as it is).
Tensor packed(const Tensor& t, const plan::Pack& pack, void* stream) {
  if (pack.in_place) return t;
  Tensor out = scratch({pack.out_rows, pack.out_cols}, t.dtype());
  kernels::pack_fp8(codes(t), t.cols(), pack.transpose, pack.rows, pack.cols,
                    out.data<std::uint8_t>(), pack.out_rows, pack.out_cols, stream);
  TPX_CUDA_CHECK(cudaGetLastError());
  return out;
}

}  // namespace

namespace blas {

bool gemm_fp8(I m, I n, I k, float alpha, Operand a, DType a_type, const float* a_factor, Operand b,
              DType b_type, const float* b_factor, float beta, float* c, I ldc) {
  if (m == 0 || n == 0) return true;
  const LtContext ctx = lt_context();
  auto* const handle = static_cast<cublasLtHandle_t>(ctx.handle);
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
  const plan::Call call = plan::call_for(m, n, k, a.ld, b.ld, ldc, a_type, b_type);
  Fp8Plan& p = fp8_plan(handle, ctx.workspace_bytes, key, call, a_type, b_type, a_factor, b_factor,
                        a.ptr, b.ptr, c);
  if (!p.usable()) return false;
  set_factors(p.lt.desc, a_factor, b_factor);
  while (p.usable()) {
    const cublasStatus_t st =
        cublasLtMatmul(handle, p.lt.desc, &alpha, b.ptr, p.lt.x, a.ptr, p.lt.y, &beta, c, p.lt.out,
                       c, p.lt.out, &p.algos[p.current], ctx.workspace, ctx.workspace_bytes,
                       static_cast<cudaStream_t>(ctx.stream));
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    // Refused, nothing issued: the next algorithm, or (all refused) the fallback for good.
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) TPX_CUBLAS_CHECK(st);
    ++p.current;
  }
  say_fallback("refused every FP8 algorithm at run time (CUBLAS_STATUS_NOT_SUPPORTED)", a_type,
               b_type, m, n, k, std::get<8>(key), std::get<9>(key), std::get<10>(key));
  p.lt.usable = false;
  return false;
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
  // Everything below follows the plan (common/fp8_gemm_plan.h, tested on the cpu).
  const plan::GemmPlan p =
      plan::plan_gemm(m, n, k, a.dtype(), trans_a, b.dtype(), trans_b, aligned16(a.raw()),
                      aligned16(b.raw()), aligned16(c.raw()));
  if (!p.use_lt) return dequantized_gemm(a, trans_a, b, trans_b, c, alpha, beta);
  auto* const stream = current_stream();

  // A_k = op(A) [m, k'] and B_k = op(B)ᵀ [n', k'], K-major: in place, or packed into scratch.
  const Tensor a_k = packed(a, p.a_k, stream), b_k = packed(b, p.b_k, stream);

  // The factors cuBLASLt multiplies by, 1/scale_a and 1/scale_b, computed on the device, each in
  // a slot of its own.
  const Tensor factors = scratch({I(p.factor_bytes / sizeof(float))}, DType::f32);
  float* const fa = factors.data<float>() + p.a_factor_offset / sizeof(float);
  float* const fb = factors.data<float>() + p.b_factor_offset / sizeof(float);
  kernels::fp8_scale_inverses(a.scale().data<float>(), b.scale().data<float>(), fa, fb, stream);
  TPX_CUDA_CHECK(cudaGetLastError());

  // D: C itself, or a scratch [m, n'] holding C (for beta ≠ 0) in its first n columns.
  const Tensor d = p.d_scratch ? scratch({m, p.np}, DType::f32) : c;
  const auto row = static_cast<std::size_t>(n) * sizeof(float);
  const auto d_row = static_cast<std::size_t>(p.np) * sizeof(float);
  auto* const cuda_stream = static_cast<cudaStream_t>(stream);
  if (p.d_scratch && beta != 0.0f)
    TPX_CUDA_CHECK(cudaMemcpy2DAsync(d.raw(), d_row, c.raw(), row, row, static_cast<std::size_t>(m),
                                     cudaMemcpyDeviceToDevice, cuda_stream));

  if (!blas::gemm_fp8(m, p.np, p.kp, alpha, {codes(a_k), p.kp}, a.dtype(), fa, {codes(b_k), p.kp},
                      b.dtype(), fb, beta, d.data<float>(), p.np))
    return dequantized_gemm(a, trans_a, b, trans_b, c, alpha, beta);
  if (p.d_scratch)
    TPX_CUDA_CHECK(cudaMemcpy2DAsync(c.raw(), row, d.raw(), d_row, row, static_cast<std::size_t>(m),
                                     cudaMemcpyDeviceToDevice, cuda_stream));
}

}  // namespace tpx::cuda
