// Row-major GEMMs on raw device pointers through cuBLAS / cuBLASLt, for ops.cc.
//
// cuBLAS is column-major; a row-major matrix read column-major is its transpose, so the row-major
// product C = op(A)·op(B) is issued as the column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the
// operands and the m/n sizes, keep each operand's transpose flag and leading dimension.
//
// Single GEMMs go through cuBLASLt (heuristic algorithm choice, cached per shape, alignment and
// type; 32 MiB workspace per thread) and fall back to cublasGemmEx if cuBLASLt offers nothing;
// batched GEMMs (attention) use cublasGemmStridedBatchedEx. Both accumulate in fp32
// (CUBLAS_COMPUTE_32F): exact fp32 for fp32 operands (no TF32), bf16 products with fp32 sums for
// bf16 operands.
//
// defines: tpx::cuda::blas::Operand, tpx::cuda::blas::gemm
#pragma once

#include <cstdint>

#include "common/tensor.h"

namespace tpx::cuda::blas {

/// A row-major matrix (or a batch of them) in device memory.
struct Operand {
  const void* ptr;
  std::int64_t ld;          ///< elements between consecutive rows
  std::int64_t stride = 0;  ///< elements between consecutive batch entries
};

/// C[b] = alpha·op(A[b])·op(B[b]) + beta·C[b] for b < batch; op(A) is [m, k], op(B) [k, n], C[b]
/// [m, n]. A and B share `ab` (f32 or bf16); C is `c_type` (f32, or bf16 with bf16 operands).
/// Issued on the current stream.
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          Operand a, Operand b, float beta, void* c, std::int64_t ldc, std::int64_t stride_c,
          std::int64_t batch, DType ab, DType c_type);

}  // namespace tpx::cuda::blas
