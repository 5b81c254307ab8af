// Stage 06's rowwise and block128 GEMMs on Hopper's FP8 tensor cores through cuBLASLt's scale
// modes (ops::gemm_scaled; the plan, as plain data tested on the cpu, in
// common/scaled_gemm_plan.h).
//
// The idea. gemm_fp8.cc multiplies two FP8 tensors of one scale each and applies 1/s_a·1/s_b once
// per output. The finer recipes give every row (rowwise) or every 128-element block along K
// (block128: 1 × 128 for activations and gradients, 128 × 128 for weights) its own scale, so the
// factor changes inside the reduction. cuBLASLt 12.9 applies such factors itself on compute
// capability 9.0: OUTER_VEC_32F multiplies output (i, j) by a[i]·b[j], VEC128_32F and
// BLK128x128_32F multiply each 128-long partial sum by its blocks' factors before it joins the
// fp32 accumulator. So the operands reach the tensor cores as they are quantized, codes plus
// scales, with no fp32 copy of either, and the factors are the reciprocals of our scales (a code
// q of a block with scale s stands for q / s).
//
// The call is gemm_fp8.cc's "TN" one (its header derives it): D = Cᵀ column-major, cuBLASLt's A
// our B [n, K] and its B our A [m, K], both K-major, which is how 06_fp8/recipes.cc quantizes
// them already; so nothing is transposed here, only padded (K to 16 or 128, m and n to 4: see the
// plan) where the shape needs it, by kernels::pack_fp8. The factors are written by
// kernels::scale_factors (fp8_pack.cu) into the order the plan's arrangement() gives.
//
// The probe. Which index of a VEC128_32F or BLK128x128_32F scale tensor runs fastest, and how its
// leading dimension is padded, is not something the documentation's wording settles, and a wrong
// guess gives plausible numbers, not an error. So the first native GEMM of each pair of scale
// modes in a process first multiplies a probe problem (make_probe: 132 × 260 × 384, every block
// scale a different power of two from its neighbours) with each candidate order in turn, reads
// the product back (one synchronisation, once per pair per process) and keeps the first order
// whose product equals the exact one within the stated tolerance. If none does, or cuBLASLt
// offers no algorithm for the probe, that pair of modes is refused for the rest of the run in one
// line on stderr and its GEMMs run dequantized.
//
// Fallbacks (ops::gemm_scaled then multiplies the dequantized operands in fp32, as on the cpu),
// each said once per recipe and shape on stderr, naming the scale modes and the reason: the
// plan's refusals (mxfp8 and nvfp4, whose block-scaled GEMMs exist only on Blackwell; a GPU other
// than sm_90; a cuBLASLt older than 12.9), a refused probe, a problem for which the heuristic
// offers no algorithm, and one for which cublasLtMatmul refuses every offered algorithm at run
// time. (Where the GPU cannot multiply a recipe natively at all, ops::prepare_scaled has
// dequantized most operands already, and said so once per recipe.)
//
// Not covered: the ring's GEMM+reduce-scatter (common/ring.h, stage 06's row-parallel forward and
// column-parallel dgrad) multiplies chunk by chunk and keeps the dequantized operands.
//
// References, the cuBLAS documentation (docs.nvidia.com/cuda/cublas): "cublasLtMatmulMatrixScale_t"
// (OUTER_VEC_32F, VEC128_32F, BLK128x128_32F), "cublasLtMatmulDescAttributes_t" (A_SCALE_MODE,
// B_SCALE_MODE, A_SCALE_POINTER, B_SCALE_POINTER, FAST_ACCUM), "cublasLtMatmul()" (the FP8
// requirements, as in gemm_fp8.cc).
//
// defines: tpx::cuda::gemm_scaled, tpx::cuda::scaled_gemm_problem
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "blas.h"
#include "check.h"
#include "common/lowp.h"
#include "common/ops.h"
#include "common/scaled_gemm_plan.h"
#include "device.h"
#include "kernels.h"
#include "lt_plan.h"
#include "nvtx.h"
#include "ops.h"

namespace tpx::cuda {
namespace {

using I = std::int64_t;
namespace native = ::tpx::lowp::native;
using native::ScaleMode;
using native::ScaleOrder;

#if CUBLAS_VERSION >= 120900
constexpr bool kScaleModesCompiled = true;
#else
constexpr bool kScaleModesCompiled = false;
#endif

/// Algorithms asked of the heuristic, tried in turn should cuBLASLt refuse one at run time.
constexpr int kAlgorithms = 8;

native::Support support() {
  const DeviceInfo& d = device_info();
  // A build whose headers predate the modes cannot name them, whatever library it finds.
  return {d.cc_major, d.cc_minor, kScaleModesCompiled ? cublasLtGetVersion() : 0};
}

std::int32_t cublas_mode(ScaleMode m) {
#if CUBLAS_VERSION >= 120900
  switch (m) {
    case ScaleMode::outer_vec_32f:
      return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case ScaleMode::vec128_32f:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case ScaleMode::blk128x128_32f:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
#endif
  (void)m;
  fail("cuBLASLt's block scale modes need cuBLAS 12.9 headers");
}

cudaDataType_t code_type(DType t) {
  return t == DType::e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

/// One native problem, everything on the device already laid out: A_k [mp, kp] and B_k [np, kp]
/// K-major codes, their factors in the modes' orders, D [mp, np] f32 row-major.
struct Native {
  I mp, np, kp;
  const void* a;
  DType a_type;
  const float* a_factors;
  ScaleMode a_mode;
  ScaleOrder a_order;
  const void* b;
  DType b_type;
  const float* b_factors;
  ScaleMode b_mode;
  ScaleOrder b_order;
  float* d;
};

enum class Outcome { ran, no_algorithm, refused };

// mp, np, kp, A type, B type, A mode, B mode, A order, B order, alignment of A, B, D.
using Key =
    std::tuple<I, I, I, int, int, int, int, int, int, std::uint32_t, std::uint32_t, std::uint32_t>;

struct Plan {
  lt::Plan lt;
  std::vector<cublasLtMatmulAlgo_t> algos;
  std::size_t current = 0;
};

/// The calling thread's plans (as gemm_fp8.cc's: descriptors are not shared between threads).
struct Plans {
  std::map<Key, Plan> plans;
  Plans() = default;
  ~Plans() {
    for (auto& [key, p] : plans) lt::destroy(p.lt);
  }
  Plans(const Plans&) = delete;
  Plans& operator=(const Plans&) = delete;
};

Plans& plans() {
  thread_local Plans p;
  return p;
}

void set_pointers(cublasLtMatmulDesc_t desc, const Native& x) {
  // cuBLASLt's A is our B, its B our A: each factor tensor follows its operand.
  TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                  &x.b_factors, sizeof x.b_factors));
  TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                  &x.a_factors, sizeof x.a_factors));
}

Plan& plan_for(cublasLtHandle_t handle, std::size_t workspace_bytes, const Key& key,
               const Native& x) {
  auto& all = plans().plans;
  if (auto it = all.find(key); it != all.end()) return it->second;
  Plan p;
  TPX_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.lt.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opx = CUBLAS_OP_T, opy = CUBLAS_OP_N;
  const std::int8_t fast_accum = 0;  // the block modes refuse it; the partial sums promoted to fp32
  const std::int32_t x_mode = cublas_mode(x.b_mode), y_mode = cublas_mode(x.a_mode);
  auto set = [&p](cublasLtMatmulDescAttributes_t attr, const auto& v) {
    TPX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.lt.desc, attr, &v, sizeof v));
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, opx);
  set(CUBLASLT_MATMUL_DESC_TRANSB, opy);
  set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum);
  // A library that does not know a mode refuses the attribute (CUBLAS_STATUS_INVALID_VALUE):
  // that is a refusal of the problem, not an error of the run.
  bool modes_taken = true;
  for (const auto& [attr, mode] : {std::pair{CUBLASLT_MATMUL_DESC_A_SCALE_MODE, x_mode},
                                   std::pair{CUBLASLT_MATMUL_DESC_B_SCALE_MODE, y_mode}})
    modes_taken = modes_taken && cublasLtMatmulDescSetAttribute(
                                     p.lt.desc, attr, &mode, sizeof mode) == CUBLAS_STATUS_SUCCESS;
  set_pointers(p.lt.desc, x);
  p.lt.x = lt::layout(code_type(x.b_type), x.kp, x.np, x.kp);
  p.lt.y = lt::layout(code_type(x.a_type), x.kp, x.mp, x.kp);
  p.lt.out = lt::layout(CUDA_R_32F, x.np, x.mp, x.np);
  cublasLtMatmulPreference_t pref =
      lt::preference(workspace_bytes, lt::alignment(x.b), lt::alignment(x.a), lt::alignment(x.d));
  cublasLtMatmulHeuristicResult_t results[kAlgorithms] = {};
  int found = 0;
  const cublasStatus_t st =
      modes_taken ? cublasLtMatmulAlgoGetHeuristic(handle, p.lt.desc, p.lt.x, p.lt.y, p.lt.out,
                                                   p.lt.out, pref, kAlgorithms, results, &found)
                  : CUBLAS_STATUS_NOT_SUPPORTED;
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < found; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace_bytes)
        p.algos.push_back(results[i].algo);
  } else if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE) {
    // INVALID_VALUE too is how cuBLASLt answers a scale mode it does not take for these types.
    lt::destroy(p.lt);
    TPX_CUBLAS_CHECK(st);
  }
  p.lt.usable = !p.algos.empty();
  return all.emplace(key, p).first->second;
}

/// Issues D = A_k·B_kᵀ with the factors on the current stream, or says why not.
Outcome run(const Native& x) {
  const blas::LtContext ctx = blas::lt_context();
  auto* const handle = static_cast<cublasLtHandle_t>(ctx.handle);
  const Key key{x.mp,
                x.np,
                x.kp,
                int(x.a_type),
                int(x.b_type),
                int(x.a_mode),
                int(x.b_mode),
                int(x.a_order),
                int(x.b_order),
                lt::alignment(x.a),
                lt::alignment(x.b),
                lt::alignment(x.d)};
  Plan& p = plan_for(handle, ctx.workspace_bytes, key, x);
  if (p.algos.empty()) return Outcome::no_algorithm;
  if (p.current >= p.algos.size()) return Outcome::refused;
  set_pointers(p.lt.desc, x);
  const float alpha = 1.0f, beta = 0.0f;
  while (p.current < p.algos.size()) {
    const cublasStatus_t st =
        cublasLtMatmul(handle, p.lt.desc, &alpha, x.b, p.lt.x, x.a, p.lt.y, &beta, x.d, p.lt.out,
                       x.d, p.lt.out, &p.algos[p.current], ctx.workspace, ctx.workspace_bytes,
                       static_cast<cudaStream_t>(ctx.stream));
    if (st == CUBLAS_STATUS_SUCCESS) return Outcome::ran;
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) TPX_CUBLAS_CHECK(st);
    ++p.current;  // refused, nothing issued: the next algorithm, or the fallback for good
  }
  return Outcome::refused;
}

const char* why(Outcome o) {
  return o == Outcome::no_algorithm ? "cuBLASLt's heuristic offers no algorithm"
                                    : "cuBLASLt refused every offered algorithm at run time";
}

/// Says `line` on stderr once per process (the set of said lines is shared by the threads).
void say_once(const std::string& line) {
  static std::mutex mutex;
  static std::set<std::string> said;
  const std::lock_guard lock(mutex);
  if (said.insert(line).second) fmt::print(stderr, "tpx: {}\n", line);
}

void say_fallback(lowp::Recipe recipe, I m, I n, I k, const std::string& reason) {
  say_once(fmt::format(
      "--fp8-recipe {} GEMM m={} n={} k={}: {}; multiplying the dequantized operands in fp32",
      lowp::to_string(recipe), m, n, k, reason));
}

Tensor scratch(Tensor::Shape shape, DType dtype) {
  return Tensor::empty(std::move(shape), dtype, Device::cuda);
}

/// codes [rows, k] as a K-major [rows_p, kp] operand: itself where it fits, else a padded copy.
Tensor padded_codes(const Tensor& codes, I rows_p, I kp) {
  const I rows = codes.dim(0), k = codes.dim(1);
  if (rows == rows_p && k == kp && reinterpret_cast<std::uintptr_t>(codes.raw()) % 16 == 0)
    return codes;
  Tensor out = scratch({rows_p, kp}, codes.dtype());
  kernels::pack_fp8(codes.data<std::uint8_t>(), k, false, rows, k, out.data<std::uint8_t>(), rows_p,
                    kp, current_stream());
  TPX_CUDA_CHECK(cudaGetLastError());
  return out;
}

/// The factors 1/s of scales [sr, sc] where `mode` in `order` keeps them for rows_p rows.
Tensor factors(const Tensor& scales, ScaleMode mode, ScaleOrder order, I rows_p, I k_blocks) {
  const native::ScaleArrangement a = native::arrangement(mode, order, rows_p, k_blocks);
  Tensor out = scratch({a.size}, DType::f32);
  auto* const stream = current_stream();
  TPX_CUDA_CHECK(cudaMemsetAsync(out.raw(), 0, out.nbytes(), static_cast<cudaStream_t>(stream)));
  kernels::scale_factors(scales.data<float>(), scales.dim(0), scales.dim(1), a.row_stride,
                         a.col_stride, out.data<float>(), stream);
  TPX_CUDA_CHECK(cudaGetLastError());
  return out;
}

/// What the probe decided for a pair of modes: the orders, or the refusal.
struct Decision {
  bool native = false;
  ScaleOrder a_order{}, b_order{};
  std::string refusal;
};

Tensor host_tensor(Tensor::Shape shape, DType dtype, const void* bytes) {
  Tensor t = Tensor::empty(std::move(shape), dtype, Device::cpu);
  std::memcpy(t.raw(), bytes, t.nbytes());
  return ops::to_device(t, Device::cuda);
}

Decision run_probe(ScaleMode a_mode, ScaleMode b_mode) {
  const native::Probe p = native::make_probe(a_mode, b_mode);
  const Tensor a = host_tensor({p.m, p.k}, DType::e4m3, p.a_codes.data());
  const Tensor b = host_tensor({p.n, p.k}, DType::e4m3, p.b_codes.data());
  const Tensor sa = host_tensor({p.a_scale_rows, p.k_blocks}, DType::f32, p.a_scales.data());
  const Tensor sb = host_tensor({p.b_scale_rows, p.k_blocks}, DType::f32, p.b_scales.data());
  const Tensor d = scratch({p.m, p.n}, DType::f32);
  std::vector<std::string> tried;
  std::optional<Outcome> refused;
  for (const ScaleOrder ao : native::orders(a_mode))
    for (const ScaleOrder bo : native::orders(b_mode)) {
      const Tensor fa = factors(sa, a_mode, ao, p.m, p.k_blocks);
      const Tensor fb = factors(sb, b_mode, bo, p.n, p.k_blocks);
      const Outcome o = run({p.m, p.n, p.k, a.raw(), DType::e4m3, fa.data<float>(), a_mode, ao,
                             b.raw(), DType::e4m3, fb.data<float>(), b_mode, bo, d.data<float>()});
      if (o != Outcome::ran) {
        refused = o;
        continue;
      }
      const Tensor back = ops::to_device(d, Device::cpu);  // waits for the product
      if (native::probe_matches(p, back.data<float>())) return {true, ao, bo, {}};
      tried.push_back(fmt::format("{} / {}", native::to_string(ao), native::to_string(bo)));
    }
  if (tried.empty()) return {false, {}, {}, fmt::format("{} for the layout probe", why(*refused))};
  return {false,
          {},
          {},
          fmt::format("the layout probe's product matched the exact one under no candidate order "
                      "of the scale tensors (tried {})",
                      fmt::join(tried, ", "))};
}

/// The decision for a pair of modes: probed on first use (under a lock, once per process).
const Decision& decision(ScaleMode a_mode, ScaleMode b_mode) {
  static std::mutex mutex;
  static std::map<std::pair<ScaleMode, ScaleMode>, Decision> decided;
  const std::lock_guard lock(mutex);
  const auto key = std::pair{a_mode, b_mode};
  if (auto it = decided.find(key); it != decided.end()) return it->second;
  Decision d = run_probe(a_mode, b_mode);
  if (d.native)
    fmt::print(stderr, "tpx: cuBLASLt {} x {}: scale tensors {} / {} (checked by the probe)\n",
               native::to_string(a_mode), native::to_string(b_mode), native::to_string(d.a_order),
               native::to_string(d.b_order));
  else
    fmt::print(stderr, "tpx: cuBLASLt {} x {} refused for this run: {}\n",
               native::to_string(a_mode), native::to_string(b_mode), d.refusal);
  return decided.emplace(key, std::move(d)).first->second;
}

/// D [mp, np] (f32, row-major) into C [m, n] (f32 or bf16, contiguous).
void copy_out(const Tensor& d, I np, const Tensor& c, I m, I n) {
  auto* const stream = static_cast<cudaStream_t>(current_stream());
  Tensor f = c.dtype() == DType::f32 ? c : scratch({m, n}, DType::f32);
  const auto row = static_cast<std::size_t>(n) * sizeof(float);
  TPX_CUDA_CHECK(cudaMemcpy2DAsync(f.raw(), row, d.raw(),
                                   static_cast<std::size_t>(np) * sizeof(float), row,
                                   static_cast<std::size_t>(m), cudaMemcpyDeviceToDevice, stream));
  if (c.dtype() != DType::f32) ops::cast(f, c.reshape({m, n}));
}

}  // namespace

std::string scaled_gemm_problem(lowp::Recipe recipe) {
  const native::Plan p = native::plan_scaled_gemm(recipe, lowp::Operand::activation,
                                                  lowp::Operand::weight, 128, 128, 128, support());
  return p.native ? std::string() : p.refusal;
}

bool gemm_scaled(const ops::ScaledOperand& a, const ops::ScaledOperand& b, const Tensor& c) {
  NvtxRange range("gemm_scaled");
  const I m = a.codes.dim(0), n = b.codes.dim(0), k = a.codes.dim(1);
  const native::Plan p =
      native::plan_scaled_gemm(a.recipe, a.operand, b.operand, m, n, k, support());
  if (!p.native) {
    say_fallback(a.recipe, m, n, k, p.refusal);
    return false;
  }
  const Decision& d = decision(p.a_mode, p.b_mode);
  const std::string modes =
      fmt::format("cuBLASLt {} x {}", native::to_string(p.a_mode), native::to_string(p.b_mode));
  if (!d.native) {
    say_fallback(a.recipe, m, n, k, fmt::format("{} refused (see above)", modes));
    return false;
  }
  const Tensor ak = padded_codes(a.codes, p.mp, p.kp), bk = padded_codes(b.codes, p.np, p.kp);
  const Tensor fa = factors(a.scales, p.a_mode, d.a_order, p.mp, p.k_blocks);
  const Tensor fb = factors(b.scales, p.b_mode, d.b_order, p.np, p.k_blocks);
  // D: C itself when it is f32 and exactly [m, n] with 16-byte rows, else a scratch [mp, np].
  const bool in_place = c.dtype() == DType::f32 && m == p.mp && n == p.np &&
                        reinterpret_cast<std::uintptr_t>(c.raw()) % 16 == 0;
  const Tensor dst = in_place ? c : scratch({p.mp, p.np}, DType::f32);
  const Outcome o =
      run({p.mp, p.np, p.kp, ak.raw(), a.codes.dtype(), fa.data<float>(), p.a_mode, d.a_order,
           bk.raw(), b.codes.dtype(), fb.data<float>(), p.b_mode, d.b_order, dst.data<float>()});
  if (o != Outcome::ran) {
    say_fallback(a.recipe, m, n, k, fmt::format("{}: {}", modes, why(o)));
    return false;
  }
  if (!in_place) copy_out(dst, p.np, c, m, n);
  return true;
}

}  // namespace tpx::cuda
