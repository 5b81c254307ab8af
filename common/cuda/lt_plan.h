// What gemm.cc and gemm_fp8.cc share about cuBLASLt problems: a matrix layout, the alignment its
// heuristic may assume for a pointer, and a cached plan (descriptors and the chosen algorithm).
//
// defines: tpx::cuda::lt::layout(), tpx::cuda::lt::alignment(), tpx::cuda::lt::Plan,
//          tpx::cuda::lt::destroy()
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
