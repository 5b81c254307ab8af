// cuBLAS and cuBLASLt, loaded when the first GEMM needs them rather than when a program starts.
//
// libcublasLt is half a gigabyte. Linked the usual way, the dynamic loader maps it and applies its
// relocations before main: about 0.2 s of system time and 210 MiB of resident memory per process,
// paid by every rank of every run of the CUDA build, including the runs on the cpu backend that
// never multiply on a GPU (and `--help`). So the backend does not link cuBLAS: this file defines
// the functions the backend calls, with the signatures of the toolkit's headers, and each forwards
// to the library's own definition, found with dlopen/dlsym on its first call. The callers in
// gemm.cc, gemm_fp8.cc, lt_plan.h and check.cc read as plain cuBLAS.
//
// The libraries are looked up by soname (libcublas.so.<major> of the headers compiled against),
// first where the dynamic loader looks (LD_LIBRARY_PATH, the cache), then in the toolkit's
// library directory found at configure time. A library or function that cannot be found is a
// tpx::Error naming it, on the first GEMM, not a crash.
//
// A function the backend starts to call must be added here (the link fails until it is), with the
// declaration from cublas_api.h or cublasLt.h.
//
// defines: the cuBLAS / cuBLASLt functions the backend calls (cublasCreate_v2, cublasLtMatmul, …),
//          tpx::cuda::blas::loaded
#include <dlfcn.h>

#include <cublasLt.h>
#include <cublas_api.h>

#include <fmt/format.h>

#include "common/check.h"

#ifndef TPX_CUDA_LIB_DIR
#define TPX_CUDA_LIB_DIR ""
#endif

namespace tpx::cuda::blas {
namespace {

#define TPX_STR2(x) #x
#define TPX_STR(x) TPX_STR2(x)

/// The sonames of the libraries the headers belong to.
constexpr const char* kCublas = "libcublas.so." TPX_STR(CUBLAS_VER_MAJOR);
constexpr const char* kCublasLt = "libcublasLt.so." TPX_STR(CUBLAS_VER_MAJOR);

/// dlopen's handle of `soname`, opened on the first call (thread-safe: each caller holds a static).
void* open_library(const char* soname) {
  if (void* h = dlopen(soname, RTLD_NOW | RTLD_LOCAL)) return h;
  const std::string first = dlerror();
  const std::string dir = TPX_CUDA_LIB_DIR;
  if (!dir.empty())
    if (void* h = dlopen((dir + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
  fail(
      fmt::format("cannot load {} ({}), which the cuda backend's GEMMs need: put the CUDA "
                  "toolkit's lib directory on LD_LIBRARY_PATH",
                  soname, first));
}

void* cublas() {
  static void* const h = open_library(kCublas);
  return h;
}

void* cublas_lt() {
  static void* const h = open_library(kCublasLt);
  return h;
}

/// The library's own definition of `name`, as a pointer of type F.
template <class F>
F symbol(void* library, const char* soname, const char* name) {
  void* p = dlsym(library, name);
  if (p == nullptr) fail(fmt::format("{} has no function {}", soname, name));
  return reinterpret_cast<F>(p);
}

}  // namespace

bool loaded() {
  const auto open = [](const char* soname) {
    void* h = dlopen(soname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (h != nullptr) dlclose(h);  // RTLD_NOLOAD took a reference
    return h != nullptr;
  };
  return open(kCublasLt) || open(kCublas);  // by soname, however the library was opened
}

}  // namespace tpx::cuda::blas

// One forwarder: `ret name params` calls the library's `name` with `args`, through a pointer of
// type `ret (*) params` looked up once (a function-local static). A C function cannot be
// overloaded, so a signature that differs from the header's declaration is a compile error, not
// a wrong call (the header's C++ overloads, such as cublasGemmStridedBatchedEx's with 64-bit
// sizes, are inline functions of their own).
#define TPX_FORWARD(library, soname, ret, name, params, args)                               \
  ret CUBLASWINAPI name params {                                                            \
    using Fn = ret(CUBLASWINAPI*) params;                                                   \
    static const auto fn = ::tpx::cuda::blas::symbol<Fn>(::tpx::cuda::blas::library(),      \
                                                         ::tpx::cuda::blas::soname, #name); \
    return fn args;                                                                         \
  }
#define TPX_CUBLAS(ret, name, params, args) TPX_FORWARD(cublas, kCublas, ret, name, params, args)
#define TPX_CUBLAS_LT(ret, name, params, args) \
  TPX_FORWARD(cublas_lt, kCublasLt, ret, name, params, args)

extern "C" {

// cuBLAS (cublas_api.h; cublas_v2.h maps cublasCreate to cublasCreate_v2 and so on).
TPX_CUBLAS(cublasStatus_t, cublasCreate_v2, (cublasHandle_t * handle), (handle))
TPX_CUBLAS(cublasStatus_t, cublasDestroy_v2, (cublasHandle_t handle), (handle))
TPX_CUBLAS(cublasStatus_t, cublasSetStream_v2, (cublasHandle_t handle, cudaStream_t stream),
           (handle, stream))
TPX_CUBLAS(cublasStatus_t, cublasSetWorkspace_v2,
           (cublasHandle_t handle, void* workspace, size_t bytes), (handle, workspace, bytes))
TPX_CUBLAS(const char*, cublasGetStatusName, (cublasStatus_t status), (status))
TPX_CUBLAS(const char*, cublasGetStatusString, (cublasStatus_t status), (status))
TPX_CUBLAS(cublasStatus_t, cublasGemmStridedBatchedEx,
           (cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
            int k, const void* alpha, const void* A, cudaDataType Atype, int lda,
            long long int strideA, const void* B, cudaDataType Btype, int ldb,
            long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
            long long int strideC, int batchCount, cublasComputeType_t computeType,
            cublasGemmAlgo_t algo),
           (handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
            beta, C, Ctype, ldc, strideC, batchCount, computeType, algo))
#if CUBLAS_VERSION >= 120500
TPX_CUBLAS(cublasStatus_t, cublasGemmGroupedBatchedEx,
           (cublasHandle_t handle, const cublasOperation_t transa_array[],
            const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
            const int k_array[], const void* alpha_array, const void* const Aarray[],
            cudaDataType_t Atype, const int lda_array[], const void* const Barray[],
            cudaDataType_t Btype, const int ldb_array[], const void* beta_array,
            void* const Carray[], cudaDataType_t Ctype, const int ldc_array[], int group_count,
            const int group_size[], cublasComputeType_t computeType),
           (handle, transa_array, transb_array, m_array, n_array, k_array, alpha_array, Aarray,
            Atype, lda_array, Barray, Btype, ldb_array, beta_array, Carray, Ctype, ldc_array,
            group_count, group_size, computeType))
#endif

// cuBLASLt (cublasLt.h).
TPX_CUBLAS_LT(cublasStatus_t, cublasLtCreate, (cublasLtHandle_t * handle), (handle))
TPX_CUBLAS_LT(size_t, cublasLtGetVersion, (void), ())
TPX_CUBLAS_LT(cublasStatus_t, cublasLtDestroy, (cublasLtHandle_t handle), (handle))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmul,
              (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
               cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
               const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
               cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
               size_t workspaceBytes, cudaStream_t stream),
              (handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
               workspaceBytes, stream))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmulAlgoGetHeuristic,
              (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc,
               cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc,
               cublasLtMatrixLayout_t Ddesc, cublasLtMatmulPreference_t preference,
               int requestedAlgoCount, cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
               int* returnAlgoCount),
              (handle, desc, Adesc, Bdesc, Cdesc, Ddesc, preference, requestedAlgoCount,
               heuristicResultsArray, returnAlgoCount))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmulDescCreate,
              (cublasLtMatmulDesc_t * desc, cublasComputeType_t computeType,
               cudaDataType_t scaleType),
              (desc, computeType, scaleType))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmulDescSetAttribute,
              (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf,
               size_t bytes),
              (desc, attr, buf, bytes))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref),
              (pref))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref),
              (pref))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatmulPreferenceSetAttribute,
              (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
               const void* buf, size_t bytes),
              (pref, attr, buf, bytes))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatrixLayoutCreate,
              (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols,
               int64_t ld),
              (layout, type, rows, cols, ld))
TPX_CUBLAS_LT(cublasStatus_t, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout),
              (layout))

}  // extern "C"
