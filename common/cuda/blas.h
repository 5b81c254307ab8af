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
// FP8 GEMMs (gemm_fp8.cc) take cuBLASLt's FP8 path, which has a layout of its own; they share the
// calling thread's cuBLASLt handle and the per-stream workspaces of gemm.cc (lt_context).
//
// defines: tpx::cuda::blas::Operand, tpx::cuda::blas::gemm, tpx::cuda::blas::LtContext,
//          tpx::cuda::blas::lt_context, tpx::cuda::blas::GroupedProblem,
//          tpx::cuda::blas::gemm_grouped, tpx::cuda::blas::gemm_fp8, tpx::cuda::blas::loaded
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

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

/// One problem of a grouped GEMM: row-major C [m, n] = A [m, k]·op(B) + beta·C (A's rows k
/// apart, C's n; B [k, n], or [n, k] read transposed).
struct GroupedProblem {
  const float* a;
  const float* b;
  float* c;
  std::int64_t m;
};

/// fp32 problems sharing n, k, op(B) and beta but not m, in one cublasGemmGroupedBatchedEx call
/// (each problem a group of one; fp32 accumulation, CUBLAS_COMPUTE_32F, as gemm's), issued on the
/// current stream. Returns false, having issued nothing, where the cuBLAS compiled against has no
/// grouped GEMM (before 12.5).
bool gemm_grouped(bool trans_b, std::int64_t n, std::int64_t k, float beta,
                  const std::vector<GroupedProblem>& problems);

/// What gemm issues a cuBLASLt call with: the calling thread's handle (a cublasLtHandle_t), the
/// current stream (a cudaStream_t) and that stream's workspace of `workspace_bytes`, owned by
/// gemm.cc (allocated on the stream's first GEMM, kept for the thread's lifetime).
struct LtContext {
  void* handle;
  void* stream;
  void* workspace;
  std::size_t workspace_bytes;
};
LtContext lt_context();

/// C = alpha·(a_factor·b_factor)·(A·Bᵀ) + beta·C on FP8 tensor cores (sm_89+): A [m, k] and B
/// [n, k] are row-major FP8 codes (e4m3 or e5m2, not both e5m2), both K-major, which is the only
/// layout cuBLASLt's FP8 kernels take (see gemm_fp8.cc); a_factor and b_factor point to one
/// float each in device memory, multiplying the codes; C [m, n] is f32. The caller guarantees
/// cuBLASLt's FP8 alignment: k, a.ld and b.ld multiples of 16, n and ldc multiples of 4, all
/// pointers 16-byte aligned. Issued on the current stream with fp32 accumulation. Returns false,
/// having issued nothing, when cuBLASLt offers no algorithm for the problem.
bool gemm_fp8(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, Operand a, DType a_type,
              const float* a_factor, Operand b, DType b_type, const float* b_factor, float beta,
              float* c, std::int64_t ldc);

/// Whether cuBLAS or cuBLASLt is loaded in this process. The backend does not link them: they are
/// opened on the first call of any of their functions (blas_loader.cc), so a run that multiplies
/// nothing on a GPU never maps them.
bool loaded();

}  // namespace tpx::cuda::blas
