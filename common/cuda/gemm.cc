// cuBLAS / cuBLASLt calls (see blas.h) and the bf16 GEMM peak measurement.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <map>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "allocator.h"
#include "blas.h"
#include "check.h"
#include "device.h"
#include "lt_plan.h"
#include "nvtx.h"
#include "ops.h"

namespace tpx::cuda {
namespace {

using I = std::int64_t;

constexpr std::size_t kLtWorkspace = std::size_t{32} << 20;

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    default:
      fail(fmt::format("no cuBLAS GEMM for dtype {}", to_string(d)));
  }
}

int to_int(I v, const char* what) {
  TPX_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "{} = {} does not fit cuBLAS's int",
            what, v);
  return static_cast<int>(v);
}

using LtKey =
    std::tuple<bool, bool, I, I, I, I, I, I, int, int, std::uint32_t, std::uint32_t, std::uint32_t>;

/// Per-thread library handles (cuBLAS handles must not be shared by concurrent host threads).
/// GEMMs on different streams may run at the same time, so each stream gets its own workspace:
/// one shared buffer would be written by two GEMMs at once. cuBLASLt takes it per call; cuBLAS
/// is given the same buffer (cublasSetWorkspace) after every cublasSetStream, which resets it.
/// The two never overlap: both run in the order of the one stream. A workspace lives as long as
/// the thread, keyed by the stream's handle (streams are created once and kept).
struct Handles {
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  std::map<void*, void*> workspaces;  // stream (nullptr = legacy default) -> kLtWorkspace bytes
  std::map<LtKey, lt::Plan> plans;

  Handles() {
    ensure_initialized();
    TPX_CUBLAS_CHECK(cublasCreate(&blas));
    TPX_CUBLAS_CHECK(cublasLtCreate(&lt));
  }
  ~Handles() {  // at thread exit; errors are ignored (the runtime may be shutting down)
    for (auto& [key, p] : plans) lt::destroy(p);
    for (auto& [stream, w] : workspaces) cudaFree(w);
    cublasLtDestroy(lt);
    cublasDestroy(blas);
  }
  Handles(const Handles&) = delete;
  Handles& operator=(const Handles&) = delete;

  /// The workspace of `stream`, allocated on its first GEMM.
  void* workspace(void* stream) {
    auto [it, added] = workspaces.try_emplace(stream, nullptr);
    if (added) {
      cudaError_t rc = cudaMalloc(&it->second, kLtWorkspace);
      if (rc == cudaErrorMemoryAllocation) {  // the caching allocator may hold the memory
        (void)cudaGetLastError();
        if (auto* cache = dynamic_cast<CachingAllocator*>(&allocator_for(Device::cuda)))
          cache->release_cached();
        rc = cudaMalloc(&it->second, kLtWorkspace);
      }
      if (rc != cudaSuccess) {
        workspaces.erase(it);
        TPX_CUDA_CHECK(rc);
      }
    }
    return it->second;
  }
};

Handles& handles() {
  thread_local Handles h;
  return h;
}

const lt::Plan& lt_plan(Handles& h, const LtKey& key, bool ta, bool tb, I m, I n, I k, I lda, I ldb,
                        I ldc, DType ab, DType ct, const void* a, const void* b, const void* c) {
  if (auto it = h.plans.find(key); it != h.plans.end()) return it->second;
  lt::Plan p;
  const cudaDataType_t abt = cuda_type(ab), cct = cuda_type(ct);
  TPX_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major view: X = B (first operand), Y = A (second), C is n x m.
  const cublasOperation_t opx = tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                          opy = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  TPX_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opx, sizeof opx));
  TPX_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opy, sizeof opy));
  p.x = lt::layout(abt, tb ? k : n, tb ? n : k, ldb);
  p.y = lt::layout(abt, ta ? m : k, ta ? k : m, lda);
  p.out = lt::layout(cct, n, m, ldc);

  const std::uint32_t ax = lt::alignment(b), ay = lt::alignment(a), ac = lt::alignment(c);
  cublasLtMatmulPreference_t pref = lt::preference(kLtWorkspace, ax, ay, ac);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h.lt, p.desc, p.x, p.y, p.out, p.out,
                                                           pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    p.algo = result.algo;
    p.usable = true;
  } else if (st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED) {
    // No cuBLASLt algorithm for this shape and alignment: cuBLAS runs it. Said once per shape
    // (plans are cached), since it may cost speed.
    fmt::print(stderr,
               "tpx: cuBLASLt has no algorithm for a {} GEMM m={} n={} k={} (trans {} {}, "
               "alignment {} {} {} B); using cublasGemmStridedBatchedEx\n",
               to_string(ab), m, n, k, ta, tb, ay, ax, ac);
  } else {
    // Anything else (an invalid value, a bad handle, no memory) is a bug or a broken device, not
    // a shape cuBLASLt lacks: it must not be hidden behind the fallback.
    lt::destroy(p);
    TPX_CUBLAS_CHECK(st);
  }
  return h.plans.emplace(key, p).first->second;
}

}  // namespace

namespace blas {

void gemm(bool ta, bool tb, I m, I n, I k, float alpha, Operand a, Operand b, float beta, void* c,
          I ldc, I stride_c, I batch, DType ab, DType ct) {
  if (m == 0 || n == 0 || batch == 0) return;
  Handles& h = handles();
  auto stream = static_cast<cudaStream_t>(current_stream());
  void* const workspace = h.workspace(stream);
  if (batch == 1) {
    const LtKey key{ta,
                    tb,
                    m,
                    n,
                    k,
                    a.ld,
                    b.ld,
                    ldc,
                    static_cast<int>(ab),
                    static_cast<int>(ct),
                    lt::alignment(a.ptr),
                    lt::alignment(b.ptr),
                    lt::alignment(c)};
    const lt::Plan& p = lt_plan(h, key, ta, tb, m, n, k, a.ld, b.ld, ldc, ab, ct, a.ptr, b.ptr, c);
    if (p.usable) {
      TPX_CUBLAS_CHECK(cublasLtMatmul(h.lt, p.desc, &alpha, b.ptr, p.x, a.ptr, p.y, &beta, c, p.out,
                                      c, p.out, &p.algo, workspace, kLtWorkspace, stream));
      return;
    }
  }
  TPX_CUBLAS_CHECK(cublasSetStream(h.blas, stream));
  TPX_CUBLAS_CHECK(cublasSetWorkspace(h.blas, workspace, kLtWorkspace));
  TPX_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, to_int(n, "n"),
      to_int(m, "m"), to_int(k, "k"), &alpha, b.ptr, cuda_type(ab), to_int(b.ld, "ldb"), b.stride,
      a.ptr, cuda_type(ab), to_int(a.ld, "lda"), a.stride, &beta, c, cuda_type(ct),
      to_int(ldc, "ldc"), stride_c, to_int(batch, "batch"), CUBLAS_COMPUTE_32F,
      CUBLAS_GEMM_DEFAULT));
}

bool gemm_grouped(bool trans_b, I n, I k, float beta, const std::vector<GroupedProblem>& problems) {
#if CUBLAS_VERSION >= 120500
  // Column-major view, as gemm's: each problem's Cᵀ = op(B)ᵀ·Aᵀ, so cuBLAS's first operand is B
  // (its m our n), the second A (its n our m). The sizes, operations and scalars are host arrays
  // of one entry per group; the three pointer arrays live on the device (cuBLAS reads them there).
  const int G = to_int(I(problems.size()), "groups");
  if (G == 0) return true;
  Handles& h = handles();
  auto stream = static_cast<cudaStream_t>(current_stream());
  const std::vector<cublasOperation_t> op_b(std::size_t(G), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N),
      op_a(std::size_t(G), CUBLAS_OP_N);
  const std::vector<int> ms(std::size_t(G), to_int(n, "n")), ks(std::size_t(G), to_int(k, "k")),
      ldb(std::size_t(G), to_int(trans_b ? k : n, "ldb")), lda(std::size_t(G), to_int(k, "lda")),
      ldc(std::size_t(G), to_int(n, "ldc")), ones(std::size_t(G), 1);
  std::vector<int> ns(problems.size());
  const std::vector<float> alphas(std::size_t(G), 1.0f), betas(std::size_t(G), beta);
  std::vector<const void*> pointers(3 * std::size_t(G));
  for (std::size_t i = 0; i < problems.size(); ++i) {
    ns[i] = to_int(problems[i].m, "m");
    pointers[i] = problems[i].b;
    pointers[std::size_t(G) + i] = problems[i].a;
    pointers[2 * std::size_t(G) + i] = problems[i].c;
  }
  const Tensor device_pointers =
      Tensor::empty({I(pointers.size() * sizeof(void*))}, DType::u8, Device::cuda);
  // A pageable source: the copy has read it when cudaMemcpyAsync returns.
  TPX_CUDA_CHECK(cudaMemcpyAsync(device_pointers.raw(), pointers.data(),
                                 pointers.size() * sizeof(void*), cudaMemcpyHostToDevice, stream));
  const auto* table = static_cast<const void* const*>(device_pointers.raw());
  TPX_CUBLAS_CHECK(cublasSetStream(h.blas, stream));
  TPX_CUBLAS_CHECK(cublasSetWorkspace(h.blas, h.workspace(stream), kLtWorkspace));
  TPX_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      h.blas, op_b.data(), op_a.data(), ms.data(), ns.data(), ks.data(), alphas.data(), table,
      CUDA_R_32F, ldb.data(), table + G, CUDA_R_32F, lda.data(), betas.data(),
      const_cast<void* const*>(table + 2 * G), CUDA_R_32F, ldc.data(), G, ones.data(),
      CUBLAS_COMPUTE_32F));
  return true;
#else
  (void)trans_b, (void)n, (void)k, (void)beta, (void)problems;
  return false;
#endif
}

LtContext lt_context() {
  Handles& h = handles();
  void* const stream = current_stream();
  return {h.lt, stream, h.workspace(stream), kLtWorkspace};
}

}  // namespace blas

double measure_bf16_gemm_peak_tflops() {
  NvtxRange range("measure_bf16_gemm_peak");
  ensure_initialized();
  constexpr I n = 8192;  // large enough for cuBLAS to reach its steady-state throughput
  constexpr int warmup = 3, iters = 10;
  // Operands hold varied values (an all-zero GEMM draws less power and runs unrealistically fast).
  std::vector<std::uint16_t> host(static_cast<std::size_t>(n * n));
  std::uint32_t state = 12345;
  for (auto& v : host) {
    state = state * 1664525u + 1013904223u;
    const float f = static_cast<float>(state >> 8) / float(1 << 24) - 0.5f;
    v = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16);
  }
  void *a = nullptr, *b = nullptr, *c = nullptr;
  const std::size_t bytes = host.size() * sizeof(std::uint16_t);
  TPX_CUDA_CHECK(cudaMalloc(&a, bytes));
  TPX_CUDA_CHECK(cudaMalloc(&b, bytes));
  TPX_CUDA_CHECK(cudaMalloc(&c, bytes));  // a bf16 result, as a bf16 peak is usually quoted
  TPX_CUDA_CHECK(cudaMemcpy(a, host.data(), bytes, cudaMemcpyHostToDevice));
  TPX_CUDA_CHECK(cudaMemcpy(b, host.data(), bytes, cudaMemcpyHostToDevice));
  auto run = [&] {
    blas::gemm(false, false, n, n, n, 1.0f, {a, n}, {b, n}, 0.0f, c, n, 0, 1, DType::bf16,
               DType::bf16);
  };
  for (int i = 0; i < warmup; ++i) run();
  const double ms = time_ms(iters, run);  // per GEMM
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * double(n) * double(n) * double(n) / (ms * 1e-3) / 1e12;
}

}  // namespace tpx::cuda
