// How stage 06's FP8 GEMMs are handed to cuBLASLt, as plain data: the transposes, the element
// types of A, B, C and D, the layouts, which of our operands is used in place and which is packed
// (transposed, padded) into scratch, where D lives, and where the two scale factors sit. Host
// code only (no CUDA header): common/cuda/gemm_fp8.cc builds its cuBLASLt descriptors from these
// values, and tests/test_fp8_gemm_plan.cc checks them, on any machine, against what the cuBLAS
// documentation requires of an FP8 call and against a product computed directly.
//
// The requirements (cuBLAS documentation, docs.nvidia.com/cuda/cublas, "cublasLtMatmul()", the
// FP8 paragraph and its type table; "Tensor Core Usage"; "cublasLtMatmulDescAttributes_t"), for
// Ada and Hopper:
//   - A transposed and B not: the "TN" format; compute type CUBLAS_COMPUTE_32F, scale type
//     CUDA_R_32F;
//   - A x B one of E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3 (no E5M2 x E5M2); C and D one of the
//     table's rows for that pair: C and D both CUDA_R_32F is one (bias type bf16, unused here);
//   - "pointers and matrix dimensions must support 16-byte alignment" (Tensor Core Usage):
//     (op_A == N ? m : k)·1, (op_B == N ? k : n)·1, m·sizeof(C), lda·1, ldb·1, ldc·sizeof(C)
//     multiples of 16 bytes, and A, B, C, D 16-byte aligned;
//   - A_SCALE_POINTER and B_SCALE_POINTER: device pointers to one fp32 each (scale mode
//     CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, the default). The documentation states no alignment
//     for a scalar, but its block-scaling modes (cuBLAS 12.8+) require 16-byte aligned scale
//     tensors, and the working Hopper FP8 calls we compared with (the cuBLAS samples'
//     LtFp8Matmul, PyTorch's scaled_gemm) pass each scale in an allocation of its own. So each
//     factor gets a 256-byte slot of its own here (kFactorSlotBytes), as a fresh allocation would.
//
// The row-major problem C [m, n] = op(A)·op(B), op(A) [m, k], op(B) [k, n], in these terms (the
// derivation is in gemm_fp8.cc's header): cuBLASLt's D = Cᵀ, column-major M x N with M = n and
// N = m; its A ("X") is B_k = op(B)ᵀ stored K x M with TRANSA = T, its B ("Y") is A_k = op(A)
// stored K x N with TRANSB = N; both are row-major matrices whose rows run along k ("K-major").
// K is padded to k' = ⌈k/16⌉·16 with zero codes in both operands (the extra terms are 0·0 = +0),
// and when n is not a multiple of 4 (16 bytes of fp32) or C is not 16-byte aligned, D is a scratch
// [m, n'] with n' = ⌈n/4⌉·4 (zero rows appended to B_k), copied in (for beta ≠ 0) and out.
//
// defines: tpx::fp8::lt::Op, Type, Matrix, Call, Pack, GemmPlan, call_for, plan_gemm, bytes,
//          kKAlign, kNAlign, kFactorSlotBytes
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/tensor.h"

namespace tpx::fp8::lt {

using I = std::int64_t;

/// cuBLASLt's operations on an operand (cublasOperation_t).
enum class Op : std::uint8_t { N, T };
/// The element types involved (cudaDataType_t's CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_16BF,
/// CUDA_R_16F, CUDA_R_32F).
enum class Type : std::uint8_t { e4m3, e5m2, bf16, f16, f32 };

inline constexpr I bytes(Type t) {
  return t == Type::f32 ? 4 : t == Type::bf16 || t == Type::f16 ? 2 : 1;
}

inline constexpr I kKAlign = 16;  ///< codes: k' and the operands' leading dimensions, 16 bytes
inline constexpr I kNAlign = 4;   ///< floats: D's rows (cuBLASLt's m) and leading dimension
/// Bytes between the two factors in their scratch: each sits where a fresh allocation would.
inline constexpr std::size_t kFactorSlotBytes = 256;

/// A column-major rows x cols matrix with leading dimension ld, as cublasLtMatrixLayoutCreate
/// takes it.
struct Matrix {
  Type type;
  I rows, cols, ld;
};

/// One cublasLtMatmul: D = alpha·op(A)·op(B) + beta·C in cuBLASLt's column-major terms.
struct Call {
  Op transa, transb;
  I m, n, k;
  Matrix a, b, c, d;
  bool c_is_d;  ///< C and D are the same buffer (in place), with the same layout
};

/// The cuBLASLt call for row-major C [m, n] (row stride ldc) = A_k·B_kᵀ with A_k [m, k] and B_k
/// [n, k] K-major FP8 codes (row strides lda, ldb): TN, X = B_k, Y = A_k, D = Cᵀ in place.
inline Call call_for(I m, I n, I k, I lda, I ldb, I ldc, DType a, DType b) {
  auto fp8 = [](DType t) { return t == DType::e5m2 ? Type::e5m2 : Type::e4m3; };
  const Matrix d{Type::f32, n, m, ldc};
  return {Op::T, Op::N, n, m, k, {fp8(b), k, n, ldb}, {fp8(a), k, m, lda}, d, d, true};
}

/// How one of our operands reaches cuBLASLt: used as it is, or copied by kernels::pack_fp8 into a
/// K-major scratch of out_rows x out_cols codes (the logical rows x cols matrix, read transposed
/// from the source when `transpose`, zero padded).
struct Pack {
  bool in_place;
  bool transpose;
  I rows, cols;          ///< the logical matrix: op(A) [m, k], or op(B)ᵀ [n, k]
  I out_rows, out_cols;  ///< the scratch: [m, k'] or [n', k']
};

/// Everything gemm_fp8.cc does for C [m, n] = alpha·op(A)·op(B) + beta·C with FP8 A and B.
struct GemmPlan {
  bool use_lt;  ///< false: multiply the dequantized operands instead (E5M2 x E5M2, k = 0)
  I kp, np;     ///< k' and the columns of D (n, or n' for a scratch D)
  Pack a_k;     ///< our A -> A_k = op(A), cuBLASLt's B
  Pack b_k;     ///< our B -> B_k = op(B)ᵀ, cuBLASLt's A
  bool d_scratch;
  Call call;
  /// Byte offsets, into one scratch of factor_bytes, of 1/scale of our A (cuBLASLt's
  /// B_SCALE_POINTER) and of our B (its A_SCALE_POINTER).
  std::size_t a_factor_offset, b_factor_offset, factor_bytes;
};

inline I round_up(I v, I to) {
  return (v + to - 1) / to * to;
}

/// The plan for contiguous row-major A (op(A) [m, k]: A is [m, k], or [k, m] when trans_a), B
/// (op(B) [k, n]: [k, n], or [n, k] when trans_b) and C [m, n]; the flags say whether each
/// tensor's first byte is 16-byte aligned.
inline GemmPlan plan_gemm(I m, I n, I k, DType a, bool trans_a, DType b, bool trans_b,
                          bool a_aligned16, bool b_aligned16, bool c_aligned16) {
  GemmPlan p{};
  p.use_lt = m > 0 && n > 0 && k > 0 && !(a == DType::e5m2 && b == DType::e5m2);
  p.kp = round_up(k, kKAlign);
  p.d_scratch = n % kNAlign != 0 || !c_aligned16;
  p.np = p.d_scratch ? round_up(n, kNAlign) : n;
  // A_k = op(A) is A itself when not transposed; B_k = op(B)ᵀ is B itself when transposed.
  p.a_k = {!trans_a && k == p.kp && a_aligned16, trans_a, m, k, m, p.kp};
  p.b_k = {trans_b && k == p.kp && n == p.np && b_aligned16, !trans_b, n, k, p.np, p.kp};
  p.call = call_for(m, p.np, p.kp, p.kp, p.kp, p.np, a, b);
  p.a_factor_offset = 0;
  p.b_factor_offset = kFactorSlotBytes;
  p.factor_bytes = 2 * kFactorSlotBytes;
  return p;
}

}  // namespace tpx::fp8::lt
