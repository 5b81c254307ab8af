// What gemm.cc and gemm_fp8.cc share about cuBLASLt problems: a matrix layout, the alignment its
// heuristic may assume for a pointer, the heuristic's preference, and a cached plan (descriptors
// and the chosen algorithm).
//
// defines: tpx::cuda::lt::layout(), tpx::cuda::lt::alignment(), tpx::cuda::lt::preference(),
//          tpx::cuda::lt::Plan, tpx::cuda::lt::destroy()
#pragma once

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>

#include "check.h"

namespace tpx::cuda::lt {

/// A column-major rows x cols layout of `type` with leading dimension ld (elements).
inline cublasLtMatrixLayout_t layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols,
                                     std::int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  TPX_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<std::uint64_t>(rows),
                                              static_cast<std::uint64_t>(cols), ld));
  return l;
}

/// Largest power of two (up to 256) dividing the address: what cuBLASLt's heuristic may assume.
inline std::uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return a == 0 ? 256u : static_cast<std::uint32_t>(std::min<std::uintptr_t>(256, a & (~a + 1)));
}

/// What the heuristic may assume of a problem: at most `workspace` bytes of workspace, and the
/// alignment (alignment()) of the operands x and y (cuBLASLt's A and B) and of the output (its C
/// and D: one tensor). The caller destroys it (cublasLtMatmulPreferenceDestroy).
inline cublasLtMatmulPreference_t preference(std::uint64_t workspace, std::uint32_t x,
                                             std::uint32_t y, std::uint32_t out) {
  cublasLtMatmulPreference_t pref = nullptr;
  TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    TPX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value));
  };
  set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, x);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, y);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, out);
  set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, out);
  return pref;
}

/// One cuBLASLt problem: the descriptor, the layouts of the two operands x, y (cuBLASLt's A and
/// B, after the row-major swap) and of the output, and the chosen algorithm; reused for every
/// call of the same shape, types and alignment. usable is false when no algorithm was found.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t x = nullptr, y = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;
};

/// Frees a plan's descriptors; errors are ignored (at thread exit the runtime may be going away).
inline void destroy(Plan& p) {
  cublasLtMatrixLayoutDestroy(p.x);
  cublasLtMatrixLayoutDestroy(p.y);
  cublasLtMatrixLayoutDestroy(p.out);
  cublasLtMatmulDescDestroy(p.desc);
}

}  // namespace tpx::cuda::lt
