// Error checks for CUDA runtime and cuBLAS calls: a failure throws tpx::Error naming the call, the
// library's error string, file, line, host and rank (through tpx::fail in common/check.h).
//
// This header needs no CUDA header itself (status codes travel as int; 0 is success in every
// CUDA library), so plain .cc files can include it. NCCL has its own header, nccl_check.h.
//
// defines: tpx::cuda::fail_cuda, tpx::cuda::fail_cublas, TPX_CUDA_CHECK, TPX_CUBLAS_CHECK
#pragma once

#include <source_location>
#include <string_view>

#include "common/check.h"

namespace tpx::cuda {

/// Throws tpx::Error for a cudaError_t `code` returned by `call`.
[[noreturn]] void fail_cuda(int code, std::string_view call,
                            std::source_location loc = std::source_location::current());
/// Throws tpx::Error for a cublasStatus_t `code` returned by `call`.
[[noreturn]] void fail_cublas(int code, std::string_view call,
                              std::source_location loc = std::source_location::current());

}  // namespace tpx::cuda

/// Wraps a CUDA runtime call (anything returning cudaError_t).
#define TPX_CUDA_CHECK(call)                                            \
  do {                                                                  \
    const int tpx_cuda_rc_ = static_cast<int>(call);                    \
    if (tpx_cuda_rc_ != 0) ::tpx::cuda::fail_cuda(tpx_cuda_rc_, #call); \
  } while (0)

/// Wraps a cuBLAS or cuBLASLt call (anything returning cublasStatus_t).
#define TPX_CUBLAS_CHECK(call)                                                \
  do {                                                                        \
    const int tpx_cublas_rc_ = static_cast<int>(call);                        \
    if (tpx_cublas_rc_ != 0) ::tpx::cuda::fail_cublas(tpx_cublas_rc_, #call); \
  } while (0)
