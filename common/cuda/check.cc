// Error strings for the CUDA runtime and cuBLAS (see check.h).
#include "check.h"

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <fmt/format.h>

namespace tpx::cuda {

void fail_cuda(int code, std::string_view call, std::source_location loc) {
  const auto err = static_cast<cudaError_t>(code);
  (void)cudaGetLastError();  // clear a non-sticky error so the process can report and go on
  ::tpx::fail(fmt::format("{} failed: {} ({}: {})", call, cudaGetErrorString(err),
                          cudaGetErrorName(err), code),
              loc);
}

void fail_cublas(int code, std::string_view call, std::source_location loc) {
  const auto status = static_cast<cublasStatus_t>(code);
  ::tpx::fail(fmt::format("{} failed: {} ({}: {})", call, cublasGetStatusString(status),
                          cublasGetStatusName(status), code),
              loc);
}

}  // namespace tpx::cuda
