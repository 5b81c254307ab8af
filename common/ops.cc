// Device dispatch: the only place that routes an op to a backend.
#include "ops.h"

#include <charconv>
#include <chrono>
#include <cstring>
#include <exception>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "check.h"
#include "checked.h"
#include "column_blocks.h"
#include "cpu/ops.h"
#include "lowp.h"
#if TPX_WITH_CUDA
#include "cuda/ops.h"
#endif

namespace tpx::ops {
namespace {

[[noreturn]] void no_cuda() {
  fail("this build has no CUDA backend (configure with a CUDA compiler or -DTPX_CUDA=ON)");
}

}  // namespace

std::string device_problem(Device device) {
  if (device == Device::cpu) return {};
#if TPX_WITH_CUDA
  return cuda::device_problem();
#else
  return "--device cuda: this build has no CUDA backend (configure where nvcc is found)";
#endif
}

std::string fp8_problem(Device device) {
  if (device == Device::cpu) return {};  // bit-exact software casts, GEMMs on dequantized values
  if (std::string p = device_problem(device); !p.empty()) return p;
#if TPX_WITH_CUDA
  const cuda::DeviceInfo& d = cuda::device_info();
  if (d.cc_major * 10 + d.cc_minor < 89)
    return fmt::format(
        "--dtype fp8 multiplies on FP8 tensor cores, which need compute capability 8.9 or newer "
        "(Ada, Hopper, Blackwell); this GPU, {}, is {}.{}",
        d.name, d.cc_major, d.cc_minor);
#endif
  return {};
}

std::string device_name(Device device) {
#if TPX_WITH_CUDA
  if (device == Device::cuda) return cuda::device_name();
#endif
  return device == Device::cpu ? cpu::host_cpu_name() : std::string(to_string(device));
}

namespace {

/// MemAvailable of /proc/meminfo in bytes, or nothing when it cannot be read.
std::optional<std::uint64_t> host_memory_available() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    constexpr std::string_view key = "MemAvailable:";
    if (!line.starts_with(key)) continue;
    std::size_t i = key.size();
    while (i < line.size() && line[i] == ' ') ++i;
    std::uint64_t kib = 0;
    const char* end = line.data() + line.size();
    if (std::from_chars(line.data() + i, end, kib).ec != std::errc{}) return std::nullopt;
    return checked_mul(kib, std::uint64_t{1024});  // the file's "kB" are KiB
  }
  return std::nullopt;
}

}  // namespace

std::uint64_t memory_available(Device device) {
  if (device == Device::cpu)
    return host_memory_available().value_or(std::numeric_limits<std::uint64_t>::max());
#if TPX_WITH_CUDA
  return cuda::memory_free_bytes();
#else
  no_cuda();
#endif
}

int device_ordinal(Device device) {
  if (device == Device::cpu) return 0;
#if TPX_WITH_CUDA
  return cuda::device_info().device;
#else
  no_cuda();
#endif
}

// Routes fn to the backend of `device`. Without CUDA, a cuda tensor fails with a clear message
// (the comma expression keeps the cpu call's return type for the compiler; it never runs).
#if TPX_WITH_CUDA
#define TPX_DISPATCH(device, fn, ...)                                \
  if ((device) == Device::cuda) return ::tpx::cuda::fn(__VA_ARGS__); \
  return ::tpx::cpu::fn(__VA_ARGS__)
#else
#define TPX_DISPATCH(device, fn, ...)                                            \
  if ((device) == Device::cuda) return (no_cuda(), ::tpx::cpu::fn(__VA_ARGS__)); \
  return ::tpx::cpu::fn(__VA_ARGS__)
#endif

namespace {

/// A cast's kernel: dst = src converted between f32 and bf16 (defined below).
void cast_values(const Tensor& src, const Tensor& dst);

bool is_bf16(const Tensor& t) {
  return t.defined() && t.dtype() == DType::bf16;
}
bool any_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (is_bf16(*t)) return true;
  return false;
}

/// The mixed-precision recipe at an op's boundary (DESIGN.md, "Mixed precision"): a tensor
/// stored in bf16 is read as fp32 (exactly: a bf16 value is an fp32 value whose 16 low bits are
/// zero), the op computes in fp32 as it always does, and each bf16 output is rounded once, to
/// nearest even, when the op is done. The rounding points are therefore the ops' outputs and
/// nothing else, identically on both backends (the casts are bit-identical). An op with no bf16
/// tensor never comes here and allocates nothing.
class Fp32Boundary {
 public:
  Fp32Boundary() = default;
  Fp32Boundary(const Fp32Boundary&) = delete;
  Fp32Boundary& operator=(const Fp32Boundary&) = delete;
  ~Fp32Boundary() noexcept(false) { finish(); }

  /// An operand the op reads: an fp32 copy of a bf16 tensor, anything else as it is.
  static Tensor in(const Tensor& t) {
    if (!is_bf16(t)) return t;
    Tensor w = Tensor::empty(t.shape(), DType::f32, t.device());
    cast_values(t, w);
    return w;
  }
  /// An f32 operand a bf16 GEMM reads (`compute` = bf16 on f32 tensors): rounded to bf16 values.
  static Tensor in_rounded(const Tensor& t) {
    if (t.dtype() != DType::f32) return in(t);
    Tensor b = Tensor::empty(t.shape(), DType::bf16, t.device());
    cast_values(t, b);
    return in(b);
  }
  /// An operand the op writes (and reads first when `read`): for a bf16 tensor an fp32 stand-in,
  /// rounded into the tensor by finish().
  Tensor out(const Tensor& t, bool read = false) {
    if (!is_bf16(t)) return t;
    Tensor w = read ? in(t) : Tensor::empty(t.shape(), DType::f32, t.device());
    pending_.emplace_back(w, t);
    return w;
  }
  /// Rounds every output once (also at destruction, unless an exception is in flight).
  void finish() {
    if (std::uncaught_exceptions() > 0) return;
    for (const auto& [wide, stored] : pending_) cast_values(wide, stored);
    pending_.clear();
  }

 private:
  std::vector<std::pair<Tensor, Tensor>> pending_;  // (fp32 stand-in, the bf16 output)
};

/// Whether the op's backend reads and writes the bf16 tensors of `t`'s device as they are stored,
/// with the recipe's rounding points in registers: the cuda kernels widen each bf16 operand as
/// they load it and round each bf16 output once as they store it (cuda/elementwise_ops.h), the
/// same values as Fp32Boundary without its fp32 copies. The cpu always goes through
/// Fp32Boundary (its kernels are fp32 loops); so does cuda with TPX_CUDA_FP32_BOUNDARY=1
/// (cuda/README.md).
bool native_bf16([[maybe_unused]] const Tensor& t) {
#if TPX_WITH_CUDA
  return t.device() == Device::cuda && !cuda::fp32_boundary_forced();
#else
  return false;
#endif
}
bool same_dtype(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->dtype() != (*ts.begin())->dtype()) return false;
  return true;
}

}  // namespace

GemmDims gemm_dims(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c) {
  const std::int64_t m = trans_a ? a.cols() : a.rows();
  const std::int64_t k = trans_a ? a.rows() : a.cols();
  const std::int64_t kb = trans_b ? b.cols() : b.rows();
  const std::int64_t n = trans_b ? b.rows() : b.cols();
  TPX_CHECK(k == kb && c.rows() == m && c.cols() == n,
            "gemm shapes: op(A) [{}, {}] · op(B) [{}, {}] into C {}", m, k, kb, n, c.describe());
  return {m, n, k};
}

AttentionDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const char* what) {
  TPX_CHECK(q.ndim() == 3 && k.ndim() == 3 && k.shape() == v.shape() && k.dim(0) == q.dim(0) &&
                k.dim(1) == q.dim(1),
            "{}: q [S, B, heads·D] and k, v [S, B, kv_heads·D] must agree: {} {} {}", what,
            q.describe(), k.describe(), v.describe());
  const std::int64_t s = q.dim(0), b = q.dim(1), x = q.dim(2);
  TPX_CHECK(heads > 0 && x > 0 && x % heads == 0, "{}: {} columns do not split into {} heads", what,
            x, heads);
  const std::int64_t d = x / heads;
  TPX_CHECK(k.dim(2) > 0 && k.dim(2) % d == 0 && heads % (k.dim(2) / d) == 0,
            "{}: k, v of {} columns must hold whole KV heads of D = {} whose count divides the {} "
            "query heads (grouped-query attention)",
            what, k.dim(2), d, heads);
  const std::int64_t kv_heads = k.dim(2) / d;
  return {s, b, heads, kv_heads, d, b * x, b * kv_heads * d};
}

AttentionDims attention_merge_dims(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                                   const Tensor& part_lse, std::int64_t heads) {
  TPX_CHECK(out.shape() == part_out.shape() && lse.shape() == part_lse.shape() && out.ndim() == 3 &&
                heads > 0 && out.dim(2) % heads == 0 &&
                lse.numel() == out.dim(0) * out.dim(1) * heads,
            "attention merge: out {} and lse {} must match their parts {} {}", out.describe(),
            lse.describe(), part_out.describe(), part_lse.describe());
  const std::int64_t s = out.dim(0), b = out.dim(1), x = out.dim(2);
  return {s, b, heads, heads, x / heads, b * x, b * x};
}

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta, DType compute) {
  if (is_fp8(a.dtype()) || is_fp8(b.dtype())) {
    // Stage 06's GEMMs.
    for (const auto& [q, which] : {std::pair{&a, "A"}, std::pair{&b, "B"}})
      TPX_CHECK(is_fp8(q->dtype()) && q->scale().defined(),
                "gemm: {} operand {} must be FP8 with its scale when the other one is", which,
                q->describe());
#if TPX_WITH_CUDA
    // On FP8 tensor cores (compute capability 8.9+): the codes are multiplied as they are and
    // alpha / (scale_a · scale_b) is applied to each output, rounding slightly differently from
    // the dequantized product below (cuda/gemm_fp8.cc).
    if (c.device() == Device::cuda && cuda::fp8_gemm_supported()) {
      Fp32Boundary f;  // a bf16 C (an activation under the recipe) is rounded once at the end
      return cuda::gemm_fp8(a, trans_a, b, trans_b, f.out(c, beta != 0.0f), alpha, beta);
    }
#endif
    // Elsewhere, the fp32 product of the dequantized operands, q / scale element by element.
    auto dequantized = [](const Tensor& q) {
      const Tensor x = Tensor::empty(q.shape(), DType::f32, q.device());
      dequantize_fp8(q, q.scale(), x);
      return x;
    };
    return gemm(dequantized(a), trans_a, dequantized(b), trans_b, c, alpha, beta);
  }
  // A bf16 operand makes the GEMM a bf16 one: bf16 operands, fp32 accumulation, the result
  // rounded once if C is bf16 (weight gradients are written to f32 C as they are).
  if (any_bf16({&a, &b})) compute = DType::bf16;
#if TPX_WITH_CUDA
  if (c.device() == Device::cuda)
    return cuda::gemm(a, trans_a, b, trans_b, c, alpha, beta, compute);
#endif
  if (compute == DType::bf16 || is_bf16(c)) {
    // The cpu multiplies the bf16 values in fp32 (OpenBLAS), which is what a tensor core's
    // bf16 products with fp32 accumulation compute, up to the order of the sum.
    Fp32Boundary f;
    const Tensor a32 = compute == DType::bf16 ? f.in_rounded(a) : f.in(a);
    const Tensor b32 = compute == DType::bf16 ? f.in_rounded(b) : f.in(b);
    return cpu::gemm(a32, trans_a, b32, trans_b, f.out(c, beta != 0.0f), alpha, beta);
  }
  TPX_DISPATCH(c.device(), gemm, a, trans_a, b, trans_b, c, alpha, beta);
}
void rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& y, const Tensor& rstd) {
  if (any_bf16({&x, &y}) && !native_bf16(x)) {
    Fp32Boundary f;
    return rmsnorm_forward(f.in(x), g, f.out(y), rstd);
  }
  TPX_DISPATCH(x.device(), rmsnorm_forward, x, g, y, rstd);
}
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dg) {
  if (any_bf16({&dy, &x, &dx}) && !(native_bf16(x) && same_dtype({&dy, &x}))) {
    Fp32Boundary f;
    return rmsnorm_backward(f.in(dy), f.in(x), g, rstd, f.out(dx), dg);
  }
  TPX_DISPATCH(x.device(), rmsnorm_backward, dy, x, g, rstd, dx, dg);
}

namespace {

/// An attention whose tensors are all bf16 on cuda (the recipe's activations and their
/// gradients) runs on them as they are stored: the fused kernels read bf16 operands, keep lse and
/// Δ in fp32 and round each output once as they store it, the same values as the boundary below;
/// the naive one's GEMMs read bf16 operands and write bf16 outputs, rounded once by cuBLASLt (dK,
/// dV of a group summed in fp32 first), its probabilities fp32 (cuda/ops.cc).
/// TPX_CUDA_FP32_BOUNDARY=1 goes through the boundary instead (native_bf16), whose fp32 copies
/// cuda/ops.cc rounds into bf16 scratch for the GEMMs and the tensor cores.
bool attention_native(const Tensor& q, DType compute, std::initializer_list<const Tensor*> ts) {
  if (!native_bf16(q) || compute != DType::bf16) return false;
  for (const Tensor* t : ts)
    if (!is_bf16(*t)) return false;
  return true;
}
/// Every other attention with a bf16 tensor, and the cpu's under bf16 compute, goes through
/// Fp32Boundary: bf16 tensors are read as fp32 and the outputs rounded once. The cuda ops then
/// compute in bf16 (`compute` bf16: bf16 GEMMs for the naive attention, bf16 copies of q, k, v,
/// dO for the fused one's tensor cores); the cpu computes everything inside in fp32, and
/// `compute` bf16 on f32 tensors rounds its inputs to bf16 values first.
bool attention_at_boundary(const Tensor& q, DType compute,
                           std::initializer_list<const Tensor*> ts) {
  return (any_bf16(ts) || (q.device() == Device::cpu && compute == DType::bf16)) &&
         !attention_native(q, compute, ts);
}
Tensor attention_input(Fp32Boundary& f, const Tensor& t, DType compute) {
  return t.device() == Device::cpu && compute == DType::bf16 ? f.in_rounded(t) : f.in(t);
}
DType attention_compute(const Tensor& q, DType compute) {
  return q.device() == Device::cpu ? DType::f32 : compute;
}
void expect_f32_compute(DType compute) {
  TPX_CHECK(compute == DType::f32, "the cpu backend computes in fp32 (asked for {})",
            to_string(compute));
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                       const Tensor& out, const Tensor& probs, DType compute) {
  if (attention_at_boundary(q, compute, {&q, &k, &v, &out})) {
    Fp32Boundary f;
    auto in = [&](const Tensor& t) { return attention_input(f, t, compute); };
    return attention_forward(in(q), in(k), in(v), heads, f.out(out), probs,
                             attention_compute(q, compute));
  }
#if TPX_WITH_CUDA
  if (q.device() == Device::cuda)
    return cuda::attention_forward(q, k, v, heads, out, probs, compute);
#endif
  expect_f32_compute(compute);
  TPX_DISPATCH(q.device(), attention_forward, q, k, v, heads, out, probs);
}
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, std::int64_t heads, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, DType compute) {
  if (attention_at_boundary(q, compute, {&dout, &q, &k, &v, &dq, &dk, &dv})) {
    Fp32Boundary f;
    auto in = [&](const Tensor& t) { return attention_input(f, t, compute); };
    return attention_backward(in(dout), in(q), in(k), in(v), probs, heads, f.out(dq), f.out(dk),
                              f.out(dv), attention_compute(q, compute));
  }
#if TPX_WITH_CUDA
  if (q.device() == Device::cuda)
    return cuda::attention_backward(dout, q, k, v, probs, heads, dq, dk, dv, compute);
#endif
  expect_f32_compute(compute);
  TPX_DISPATCH(q.device(), attention_backward, dout, q, k, v, probs, heads, dq, dk, dv);
}
void attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse, DType compute) {
  if (attention_at_boundary(q, compute, {&q, &k, &v, &out})) {
    Fp32Boundary f;
    auto in = [&](const Tensor& t) { return attention_input(f, t, compute); };
    return attention_fused_forward(in(q), in(k), in(v), heads, f.out(out), lse,
                                   attention_compute(q, compute));
  }
#if TPX_WITH_CUDA
  if (q.device() == Device::cuda)
    return cuda::attention_fused_forward(q, k, v, heads, out, lse, compute);
#endif
  expect_f32_compute(compute);
  TPX_DISPATCH(q.device(), attention_fused_forward, q, k, v, heads, out, lse);
}
void attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv, DType compute) {
  if (attention_at_boundary(q, compute, {&dout, &q, &k, &v, &out, &dq, &dk, &dv})) {
    Fp32Boundary f;
    auto in = [&](const Tensor& t) { return attention_input(f, t, compute); };
    return attention_fused_backward(in(dout), in(q), in(k), in(v), f.in(out), lse, heads, f.out(dq),
                                    f.out(dk), f.out(dv), attention_compute(q, compute));
  }
#if TPX_WITH_CUDA
  if (q.device() == Device::cuda)
    return cuda::attention_fused_backward(dout, q, k, v, out, lse, heads, dq, dk, dv, compute);
#endif
  expect_f32_compute(compute);
  TPX_DISPATCH(q.device(), attention_fused_backward, dout, q, k, v, out, lse, heads, dq, dk, dv);
}
void rope_forward(const Tensor& x, std::int64_t heads, double theta, std::int64_t first) {
  if (is_bf16(x) && !native_bf16(x)) {
    Fp32Boundary f;
    return rope_forward(f.out(x, /*read=*/true), heads, theta, first);
  }
  TPX_DISPATCH(x.device(), rope_forward, x, heads, theta, first);
}
void rope_backward(const Tensor& dx, std::int64_t heads, double theta, std::int64_t first) {
  if (is_bf16(dx) && !native_bf16(dx)) {
    Fp32Boundary f;
    return rope_backward(f.out(dx, /*read=*/true), heads, theta, first);
  }
  TPX_DISPATCH(dx.device(), rope_backward, dx, heads, theta, first);
}
Tensor attention_block_operand(const Tensor& t) {
  if (t.device() == Device::cpu) return Fp32Boundary::in(t);
  return t;
}
namespace {
/// The cpu's chunk-pair loops read fp32: a bf16 operand must come widened by the caller
/// (attention_block_operand), once for every pair it takes part in, not once per pair here.
void expect_block_operands(std::initializer_list<const Tensor*> ts) {
  if ((*ts.begin())->device() == Device::cpu && any_bf16(ts))
    fail(
        "attention_block_*: the cpu reads fp32 operands; widen a bf16 one once with "
        "ops::attention_block_operand() before the chunk pairs that read it");
}
}  // namespace
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse, std::int64_t shift) {
  // bf16 inputs: cuda reads them as they are (bf16 compute); the cpu's arrive widened.
  expect_block_operands({&q, &k, &v});
  TPX_DISPATCH(q.device(), attention_block_forward, q, k, v, heads, out, lse, shift);
}
void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              std::int64_t shift) {
  expect_block_operands({&q, &dout, &k, &v, &out});
  TPX_DISPATCH(q.device(), attention_block_backward, dout, q, k, v, out, lse, heads, dq, dk, dv,
               shift);
}
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                     const Tensor& part_lse, std::int64_t heads) {
  TPX_DISPATCH(out.device(), attention_merge, out, lse, part_out, part_lse, heads);
}
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  if (any_bf16({&gate, &up, &out}) && !(native_bf16(gate) && same_dtype({&gate, &up}))) {
    Fp32Boundary f;
    return swiglu_forward(f.in(gate), f.in(up), f.out(out));
  }
  TPX_DISPATCH(gate.device(), swiglu_forward, gate, up, out);
}
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup) {
  if (any_bf16({&dout, &gate, &up, &dgate, &dup}) &&
      !(native_bf16(gate) && same_dtype({&dout, &gate, &up}) && same_dtype({&dgate, &dup}))) {
    Fp32Boundary f;
    return swiglu_backward(f.in(dout), f.in(gate), f.in(up), f.out(dgate), f.out(dup));
  }
  TPX_DISPATCH(gate.device(), swiglu_backward, dout, gate, up, dgate, dup);
}
void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  if (any_bf16({&a, &b, &out}) && !native_bf16(out)) {
    Fp32Boundary f;  // out may alias a or b: they are read into copies before anything is written
    return add(f.in(a), f.in(b), f.out(out));
  }
  TPX_DISPATCH(out.device(), add, a, b, out);
}
void accumulate(const Tensor& x, const Tensor& into) {
  if (any_bf16({&x, &into}) && !native_bf16(into)) {
    Fp32Boundary f;
    return accumulate(f.in(x), f.out(into, /*read=*/true));
  }
  TPX_DISPATCH(into.device(), accumulate, x, into);
}
double mse_loss_sum(const Tensor& y, const Tensor& t) {
  if (any_bf16({&y, &t}) && !native_bf16(y))
    return mse_loss_sum(Fp32Boundary::in(y), Fp32Boundary::in(t));
  TPX_DISPATCH(y.device(), mse_loss_sum, y, t);
}
void mse_loss_backward(const Tensor& y, const Tensor& t, double scale, const Tensor& dy) {
  if (any_bf16({&y, &t, &dy}) && !native_bf16(y)) {
    Fp32Boundary f;
    return mse_loss_backward(f.in(y), f.in(t), scale, f.out(dy));
  }
  TPX_DISPATCH(y.device(), mse_loss_backward, y, t, scale, dy);
}
namespace {

/// The checks every language-model op starts from: i32 ids of one element per position, the
/// other tensors on the ids' device with the sizes `what` needs.
void expect_ids(const Tensor& ids, const Tensor& like, const char* what) {
  TPX_CHECK(ids.dtype() == DType::i32 && ids.device() == like.device(),
            "{}: token ids {} must be i32 on the device of {}", what, ids.describe(),
            like.describe());
}
void expect_rows(const Tensor& t, std::int64_t rows, std::int64_t cols, DType dtype,
                 const char* what) {
  TPX_CHECK(t.dtype() == dtype && t.rows() == rows && t.cols() == cols,
            "{}: {} must be {} [{}, {}]", what, t.describe(), to_string(dtype), rows, cols);
}
void expect_vector(const Tensor& t, std::int64_t n, const Tensor& like, const char* what) {
  TPX_CHECK(t.dtype() == DType::f32 && t.numel() == n && t.device() == like.device(),
            "{}: {} must be f32 with {} elements", what, t.describe(), n);
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, std::int64_t begin,
                       const Tensor& out) {
  expect_ids(ids, table, "embedding_forward");
  TPX_CHECK(table.dtype() == DType::f32 && table.ndim() == 2 && out.device() == table.device(),
            "embedding_forward: table {} must be f32 [rows, H]", table.describe());
  if (is_bf16(out) && !native_bf16(out)) {
    Fp32Boundary f;
    return embedding_forward(ids, table, begin, f.out(out));
  }
  TPX_CHECK(out.rows() == ids.numel() && out.cols() == table.dim(1),
            "embedding_forward: out {} must be [{} positions, {}]", out.describe(), ids.numel(),
            table.dim(1));
  TPX_DISPATCH(out.device(), embedding_forward, ids, table, begin, out);
}
void embedding_backward(const Tensor& ids, const Tensor& dout, std::int64_t begin,
                        const Tensor& dtable) {
  expect_ids(ids, dtable, "embedding_backward");
  if (is_bf16(dout) && !native_bf16(dout))
    return embedding_backward(ids, Fp32Boundary::in(dout), begin, dtable);
  TPX_CHECK(dtable.ndim() == 2 && dout.device() == dtable.device(),
            "embedding_backward: dtable {} must be [rows, H] on the device of dout {}",
            dtable.describe(), dout.describe());
  expect_rows(dtable, dtable.dim(0), dout.cols(), DType::f32, "embedding_backward");
  TPX_CHECK(dout.rows() == ids.numel(), "embedding_backward: dout {} must have {} positions",
            dout.describe(), ids.numel());
  TPX_DISPATCH(dtable.device(), embedding_backward, ids, dout, begin, dtable);
}
void cross_entropy_partial(const Tensor& logits, const Tensor& targets, std::int64_t begin,
                           std::int64_t vocab, const Tensor& max, const Tensor& sumexp,
                           const Tensor& target_logit) {
  expect_ids(targets, logits, "cross_entropy_partial");
  if (is_bf16(logits) && !native_bf16(logits))
    return cross_entropy_partial(Fp32Boundary::in(logits), targets, begin, vocab, max, sumexp,
                                 target_logit);
  const std::int64_t n = targets.numel();
  TPX_CHECK(logits.rows() == n, "cross_entropy_partial: logits {} must have {} positions",
            logits.describe(), n);
  for (const Tensor* t : {&max, &sumexp, &target_logit})
    expect_vector(*t, n, logits, "cross_entropy_partial");
  TPX_DISPATCH(logits.device(), cross_entropy_partial, logits, targets, begin, vocab, max, sumexp,
               target_logit);
}
void cross_entropy_rescale(const Tensor& local_max, const Tensor& max, const Tensor& sumexp) {
  for (const Tensor* t : {&local_max, &max})
    expect_vector(*t, sumexp.numel(), sumexp, "cross_entropy_rescale");
  TPX_DISPATCH(sumexp.device(), cross_entropy_rescale, local_max, max, sumexp);
}
double cross_entropy_loss(const Tensor& max, const Tensor& sumexp, const Tensor& target_logit,
                          const Tensor& lse) {
  for (const Tensor* t : {&max, &sumexp, &target_logit})
    expect_vector(*t, lse.numel(), lse, "cross_entropy_loss");
  TPX_DISPATCH(lse.device(), cross_entropy_loss, max, sumexp, target_logit, lse);
}
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            std::int64_t begin, std::int64_t vocab, double scale,
                            const Tensor& dlogits) {
  expect_ids(targets, logits, "cross_entropy_backward");
  if (any_bf16({&logits, &dlogits}) && !native_bf16(logits)) {
    Fp32Boundary f;
    return cross_entropy_backward(f.in(logits), targets, lse, begin, vocab, scale, f.out(dlogits));
  }
  TPX_CHECK(logits.rows() == targets.numel() && dlogits.device() == logits.device(),
            "cross_entropy_backward: logits {} must have {} positions, dlogits {} their device",
            logits.describe(), targets.numel(), dlogits.describe());
  expect_vector(lse, targets.numel(), logits, "cross_entropy_backward");
  expect_rows(dlogits, logits.rows(), logits.cols(), logits.dtype(), "cross_entropy_backward");
  TPX_DISPATCH(logits.device(), cross_entropy_backward, logits, targets, lse, begin, vocab, scale,
               dlogits);
}
namespace {

/// The optimizer's compute copy, when given: bf16 with w's elements, on w's device.
void expect_copy(const Tensor& copy, const Tensor& w, const char* what) {
  if (copy.defined())
    TPX_CHECK(
        copy.dtype() == DType::bf16 && copy.numel() == w.numel() && copy.device() == w.device(),
        "{}: the compute copy {} must be bf16 like w {}", what, copy.describe(), w.describe());
}

}  // namespace

void sgd_update(const Tensor& w, const Tensor& grad, float lr, const Tensor& copy) {
  for (const Tensor* t : {&w, &grad})
    TPX_CHECK(t->dtype() == DType::f32, "sgd: {} must be f32 (master weights and gradients)",
              t->describe());
  expect_copy(copy, w, "sgd");
  TPX_DISPATCH(w.device(), sgd_update, w, grad, lr, copy);
}
void adamw_update(const Tensor& w, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWStep& s, const Tensor& copy) {
  for (const Tensor* t : {&grad, &m, &v})
    TPX_CHECK(t->numel() == w.numel() && t->dtype() == DType::f32 && t->device() == w.device(),
              "adamw: {} must be f32 like w {}", t->describe(), w.describe());
  expect_copy(copy, w, "adamw");
  TPX_DISPATCH(w.device(), adamw_update, w, grad, m, v, s, copy);
}
double sum_squares(const Tensor& x) {
  if (is_bf16(x) && !native_bf16(x)) return sum_squares(Fp32Boundary::in(x));
  TPX_DISPATCH(x.device(), sum_squares, x);
}
std::vector<double> sum_squares_each(const std::vector<Tensor>& xs) {
  if (xs.empty()) return {};
  for (const Tensor& x : xs)
    TPX_CHECK(x.device() == xs.front().device() && x.dtype() == DType::f32,
              "sum_squares_each: {} must be f32 on {}'s device", x.describe(),
              xs.front().describe());
  TPX_DISPATCH(xs.front().device(), sum_squares_each, xs);
}
Tensor zeros_like(const Tensor& t) {
  const Tensor z = Tensor::empty(t.shape(), DType::f32, t.device());
  fill(z, 0.0f);
  return z;
}

void fill(const Tensor& t, float value) {
  if (is_bf16(t) && !native_bf16(t)) {
    Fp32Boundary f;
    return fill(f.out(t), value);
  }
  TPX_DISPATCH(t.device(), fill, t, value);
}

void copy(const Tensor& src, const Tensor& dst) {
  TPX_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype(), "copy {} -> {}",
            src.describe(), dst.describe());
  if (src.device() == Device::cpu && dst.device() == Device::cpu) {
    std::memcpy(dst.raw(), src.raw(), src.nbytes());
    return;
  }
#if TPX_WITH_CUDA
  cuda::copy(src, dst);
#else
  no_cuda();
#endif
}

namespace {

/// split_columns (split) or join_columns: x [m, n·c] ↔ blocks [n][m, c].
void column_blocks(const Tensor& x, std::int64_t n, const Tensor& blocks, bool split) {
  TPX_CHECK(x.ndim() >= 1 && n >= 1 && x.dim(x.ndim() - 1) % n == 0,
            "{} columns: {} must have a last dimension that {} blocks divide",
            split ? "split" : "join", x.describe(), n);
  TPX_CHECK(
      blocks.numel() == x.numel() && blocks.dtype() == x.dtype() && blocks.device() == x.device(),
      "{} columns: {} and {} must match in element count, dtype and device",
      split ? "split" : "join", x.describe(), blocks.describe());
  TPX_CHECK(x.raw() != blocks.raw() || x.numel() == 0, "{} columns: {} in place",
            split ? "split" : "join", x.describe());
  const std::int64_t c = x.dim(x.ndim() - 1) / n, m = c == 0 ? 0 : x.numel() / (n * c);
  if (x.device() == Device::cuda) {
#if TPX_WITH_CUDA
    return cuda::column_blocks(x, blocks, m, c, n, split);
#else
    no_cuda();
#endif
  }
  // A run of c elements of the blocks (one row of one block) is a run of c elements of x.
  const std::size_t esize = dtype_size(x.dtype()), run = static_cast<std::size_t>(c) * esize;
  auto* xb = static_cast<char*>(x.raw());
  auto* bb = static_cast<char*>(blocks.raw());
  for (std::int64_t e = 0; e < m * n * c; e += c) {
    const auto from = static_cast<std::size_t>(hd::column_block_source(e, m, c, n)) * esize;
    const auto to = static_cast<std::size_t>(e) * esize;
    if (split)
      std::memcpy(bb + to, xb + from, run);
    else
      std::memcpy(xb + from, bb + to, run);
  }
}

}  // namespace

void split_columns(const Tensor& x, std::int64_t n, const Tensor& blocks) {
  column_blocks(x, n, blocks, true);
}

void join_columns(const Tensor& blocks, std::int64_t n, const Tensor& x) {
  column_blocks(x, n, blocks, false);
}

void cast(const Tensor& src, const Tensor& dst) {
  cast_values(src, dst);
}

namespace {

void cast_values(const Tensor& src, const Tensor& dst) {
  TPX_CHECK(src.numel() == dst.numel() && src.device() == dst.device(), "cast {} -> {}",
            src.describe(), dst.describe());
#if TPX_WITH_CUDA
  if (src.device() == Device::cuda) return cuda::cast(src, dst);
#endif
  if (src.device() == Device::cuda) no_cuda();
  const auto n = static_cast<std::size_t>(src.numel());
  if (src.dtype() == dst.dtype()) {
    std::memcpy(dst.raw(), src.raw(), src.nbytes());
  } else if (src.dtype() == DType::f32 && dst.dtype() == DType::bf16) {
    const float* in = src.data<float>();
    auto* out = dst.data<std::uint16_t>();
    for (std::size_t i = 0; i < n; ++i) out[i] = bf16_bits(in[i]);
  } else if (src.dtype() == DType::bf16 && dst.dtype() == DType::f32) {
    const auto* in = src.data<std::uint16_t>();
    float* out = dst.data<float>();
    for (std::size_t i = 0; i < n; ++i) out[i] = bf16_value(in[i]);
  } else {
    fail(fmt::format("no cast from {} to {}", src.describe(), dst.describe()));
  }
}

}  // namespace

namespace {

/// The FP8 ops' argument checks, made here once for both backends.
void expect_scalar_f32(const Tensor& t, Device device, const char* what) {
  TPX_CHECK(t.dtype() == DType::f32 && t.numel() == 1 && t.device() == device,
            "{} must be f32 [1] on {}, got {}", what, to_string(device), t.describe());
}
void expect_fp8_cast(const Tensor& x, const Tensor& scale, const Tensor& q) {
  TPX_CHECK((x.dtype() == DType::f32 || x.dtype() == DType::bf16) &&
                (q.dtype() == DType::e4m3 || q.dtype() == DType::e5m2) && x.numel() == q.numel() &&
                x.device() == q.device(),
            "fp8 cast between {} and {}: f32 or bf16 and e4m3/e5m2 with equal element counts, "
            "one device",
            x.describe(), q.describe());
  expect_scalar_f32(scale, x.device(), "the fp8 scale");
}

}  // namespace

void quantize_fp8(const Tensor& x, const Tensor& scale, const Tensor& q) {
  expect_fp8_cast(x, scale, q);
  if (is_bf16(x)) return quantize_fp8(Fp32Boundary::in(x), scale, q);  // x·scale in fp32
  TPX_DISPATCH(q.device(), quantize_fp8, x, scale, q);
}
void dequantize_fp8(const Tensor& q, const Tensor& scale, const Tensor& x) {
  expect_fp8_cast(x, scale, q);
  if (is_bf16(x)) {
    Fp32Boundary f;
    return dequantize_fp8(q, scale, f.out(x));
  }
  TPX_DISPATCH(q.device(), dequantize_fp8, q, scale, x);
}
void amax(const Tensor& x, const Tensor& out) {
  TPX_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, "amax of {}: f32 or bf16 only",
            x.describe());
  expect_scalar_f32(out, x.device(), "amax out");
  if (is_bf16(x)) return amax(Fp32Boundary::in(x), out);
  TPX_DISPATCH(x.device(), amax, x, out);
}
void fp8_scale(const Tensor& amax, DType fmt, const Tensor& scale) {
  TPX_CHECK(fmt == DType::e4m3 || fmt == DType::e5m2, "fp8_scale for {}: e4m3 or e5m2 only",
            to_string(fmt));
  expect_scalar_f32(amax, scale.device(), "fp8_scale amax");
  expect_scalar_f32(scale, scale.device(), "fp8_scale scale");
  TPX_DISPATCH(scale.device(), fp8_scale, amax, fmt, scale);
}

namespace {

/// x as the matrix [rows, cols] its last dimension makes (cols: the last dimension).
std::pair<std::int64_t, std::int64_t> matrix_of(const Tensor& x) {
  const std::int64_t cols = x.ndim() == 0 ? 1 : x.dim(x.ndim() - 1);
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}

bool one_byte_codes(const Tensor& t) {
  return t.dtype() == DType::u8 || t.dtype() == DType::e4m3 || t.dtype() == DType::e5m2;
}

/// Checks a recipe's codes and scales for the matrix [rows, cols] on `device` (lowp_quantize's
/// shapes).
void expect_lowp_parts(std::int64_t rows, std::int64_t cols, Device device, const Tensor& codes,
                       const Tensor& scales, const Tensor& tensor_scale, const lowp::Layout& l,
                       const char* what) {
  TPX_CHECK(rows > 0 && cols > 0, "{}: a {} x {} matrix (both sizes positive)", what, rows, cols);
  TPX_CHECK(one_byte_codes(codes) && codes.numel() == rows * cols && codes.device() == device &&
                codes.dim(codes.ndim() - 1) == cols,
            "{}: codes {} for a {} x {} matrix (one byte an element, its last dimension the "
            "columns, on its device)",
            what, codes.describe(), rows, cols);
  const std::int64_t br = l.block_rows == 0 ? rows : l.block_rows;
  const std::int64_t bc = l.block_cols == 0 ? cols : l.block_cols;
  const DType scale_dtype = l.scale == lowp::ScaleFormat::fp32 ? DType::f32 : DType::u8;
  TPX_CHECK(scales.dtype() == scale_dtype && scales.device() == device &&
                scales.numel() == ((rows + br - 1) / br) * ((cols + bc - 1) / bc),
            "{}: scales {} for a {} x {} matrix", what, scales.describe(), rows, cols);
  if (l.scale == lowp::ScaleFormat::ue4m3)
    expect_scalar_f32(tensor_scale, device, "nvfp4's tensor scale");
}

}  // namespace

void lowp_quantize(const Tensor& x, lowp::Recipe recipe, lowp::Operand operand,
                   std::optional<float> tensor_amax, const Tensor& codes, const Tensor& scales,
                   const Tensor& tensor_scale, const lowp::StochasticRounding* stochastic) {
  const lowp::Layout l = lowp::layout(recipe, operand);
  const auto [rows, cols] = matrix_of(x);
  TPX_CHECK(x.dtype() == DType::f32, "lowp_quantize of {}: f32 only", x.describe());
  expect_lowp_parts(rows, cols, x.device(), codes, scales, tensor_scale, l, "lowp_quantize");
  if (x.device() == Device::cuda) {
#if TPX_WITH_CUDA
    Tensor amax;
    if (tensor_amax && l.scale == lowp::ScaleFormat::ue4m3) {
      amax = Tensor::empty({1}, DType::f32, Device::cuda);
      fill(amax, *tensor_amax);
    }
    return cuda::lowp_quantize(x.reshape({rows, cols}), l, amax, codes, scales, tensor_scale,
                               stochastic);
#else
    no_cuda();
#endif
  }
  cpu::lowp_quantize(x, recipe, operand, tensor_amax, codes, scales, tensor_scale, stochastic);
}

void lowp_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& tensor_scale,
                     lowp::Recipe recipe, lowp::Operand operand, const Tensor& x, bool transpose) {
  const lowp::Layout l = lowp::layout(recipe, operand);
  // The codes' matrix: x's, or under `transpose` the transpose of x's [cols, rows].
  const auto [x_rows, x_cols] = matrix_of(x);
  const std::int64_t rows = transpose ? x_cols : x_rows, cols = transpose ? x_rows : x_cols;
  TPX_CHECK(x.dtype() == DType::f32, "lowp_dequantize into {}: f32 only", x.describe());
  expect_lowp_parts(rows, cols, x.device(), codes, scales, tensor_scale, l, "lowp_dequantize");
  TPX_DISPATCH(x.device(), lowp_dequantize, codes.reshape({rows, cols}), l, scales, tensor_scale,
               x.reshape(transpose ? Tensor::Shape{cols, rows} : Tensor::Shape{rows, cols}),
               transpose);
}

void transpose(const Tensor& x, const Tensor& out) {
  TPX_CHECK(out.numel() == x.numel() && out.dtype() == x.dtype() && out.device() == x.device() &&
                (x.raw() != out.raw() || x.numel() == 0),
            "transpose {} -> {}: same element count, dtype and device, not in place", x.describe(),
            out.describe());
  const auto [rows, cols] = matrix_of(x);
  if (x.numel() == 0) return;
  // Column r of x is block r of split_columns with blocks one column wide: row r of xᵀ.
  if (x.device() == Device::cuda) {
#if TPX_WITH_CUDA
    return cuda::column_blocks(x, out, rows, 1, cols, true);
#else
    no_cuda();
#endif
  }
  cpu::transpose(x, rows, cols, out);
}

void hadamard_rows(const Tensor& x, const Tensor& y) {
  TPX_CHECK(x.dtype() == DType::f32 && y.dtype() == DType::f32 && x.shape() == y.shape() &&
                x.device() == y.device() && x.raw() != y.raw(),
            "hadamard_rows {} -> {}: f32 of one shape and device, not in place", x.describe(),
            y.describe());
  const auto [rows, cols] = matrix_of(x);
  if (x.numel() == 0) return;
  TPX_DISPATCH(x.device(), hadamard_rows, x, rows, cols, y);
}

namespace {
void expect_e2m1_pair(const Tensor& codes, const Tensor& packed, const char* what) {
  const std::int64_t cols = matrix_of(codes).second;
  TPX_CHECK(codes.dtype() == DType::u8 && packed.dtype() == DType::u8 && cols % 2 == 0 &&
                packed.numel() * 2 == codes.numel() && packed.device() == codes.device(),
            "{}: {} codes and {} bytes (u8, an even last dimension, half as many bytes)", what,
            codes.describe(), packed.describe());
}
}  // namespace

void pack_e2m1(const Tensor& codes, const Tensor& packed) {
  expect_e2m1_pair(codes, packed, "pack_e2m1");
  if (codes.numel() == 0) return;
  TPX_DISPATCH(codes.device(), pack_e2m1, codes, packed);
}

void unpack_e2m1(const Tensor& packed, const Tensor& codes) {
  expect_e2m1_pair(codes, packed, "unpack_e2m1");
  if (codes.numel() == 0) return;
  TPX_DISPATCH(codes.device(), unpack_e2m1, packed, codes);
}

namespace {
/// Checks a MoE op's tensor: its dtype, device and shape.
void expect_moe(const Tensor& t, DType dtype, Device device, const Tensor::Shape& shape,
                std::string_view what, std::string_view name) {
  if (t.defined() && t.dtype() == dtype && t.device() == device && t.shape() == shape) return;
  std::string dims;
  for (const std::int64_t n : shape) dims += fmt::format("{}{}", dims.empty() ? "" : ", ", n);
  fail(fmt::format("{}: {} must be {}[{}] on {}, got {}", what, name, to_string(dtype), dims,
                   to_string(device), t.defined() ? t.describe() : std::string("nothing")));
}
}  // namespace

void moe_route(const Tensor& logits, const Tensor& bias, bool sigmoid, const Tensor& score,
               const Tensor& expert, const Tensor& weight) {
  TPX_CHECK(logits.ndim() == 2 && expert.ndim() == 2, "moe_route: logits {} and expert {}",
            logits.describe(), expert.describe());
  const std::int64_t n = logits.dim(0), E = logits.dim(1), k = expert.dim(1);
  const Device d = logits.device();
  TPX_CHECK(k >= 1 && k <= E, "moe_route: top-{} of {} experts", k, E);
  expect_moe(logits, DType::f32, d, {n, E}, "moe_route", "logits");
  if (bias.defined()) expect_moe(bias, DType::f32, d, {E}, "moe_route", "bias");
  expect_moe(score, DType::f32, d, {n, E}, "moe_route", "score");
  expect_moe(expert, DType::i32, d, {n, k}, "moe_route", "expert");
  expect_moe(weight, DType::f32, d, {n, k}, "moe_route", "weight");
  if (n == 0) return;
  TPX_DISPATCH(d, moe_route, logits, bias, sigmoid, score, expert, weight);
}

void gather_rows(const Tensor& x, const Tensor& index, const Tensor& scale, const Tensor& out) {
  TPX_CHECK(x.ndim() == 2 && out.ndim() == 2 && index.ndim() == 1,
            "gather_rows: x {}, index {}, out {}", x.describe(), index.describe(), out.describe());
  const std::int64_t R = index.dim(0), H = x.dim(1);
  const Device d = x.device();
  expect_moe(x, DType::f32, d, {x.dim(0), H}, "gather_rows", "x");
  expect_moe(index, DType::i32, d, {R}, "gather_rows", "index");
  if (scale.defined()) expect_moe(scale, DType::f32, d, {R}, "gather_rows", "scale");
  expect_moe(out, DType::f32, d, {R, H}, "gather_rows", "out");
  if (R == 0 || H == 0) return;
  TPX_DISPATCH(d, gather_rows, x, index, scale, out);
}

void combine_rows(const Tensor& rows, const Tensor& slot, const Tensor& weight, const Tensor& out,
                  bool accumulate) {
  TPX_CHECK(rows.ndim() == 2 && slot.ndim() == 2 && out.ndim() == 2,
            "combine_rows: rows {}, slot {}, out {}", rows.describe(), slot.describe(),
            out.describe());
  const std::int64_t n = slot.dim(0), k = slot.dim(1), H = out.dim(1);
  const Device d = out.device();
  expect_moe(rows, DType::f32, d, {rows.dim(0), H}, "combine_rows", "rows");
  expect_moe(slot, DType::i32, d, {n, k}, "combine_rows", "slot");
  if (weight.defined()) expect_moe(weight, DType::f32, d, {n, k}, "combine_rows", "weight");
  expect_moe(out, DType::f32, d, {n, H}, "combine_rows", "out");
  if (n == 0 || H == 0) return;
  TPX_DISPATCH(d, combine_rows, rows, slot, weight, out, accumulate);
}

void rows_dot(const Tensor& a, const Tensor& rows, const Tensor& slot, const Tensor& out) {
  TPX_CHECK(a.ndim() == 2 && rows.ndim() == 2 && slot.ndim() == 2,
            "rows_dot: a {}, rows {}, slot {}", a.describe(), rows.describe(), slot.describe());
  const std::int64_t n = slot.dim(0), k = slot.dim(1), H = a.dim(1);
  const Device d = a.device();
  expect_moe(a, DType::f32, d, {n, H}, "rows_dot", "a");
  expect_moe(rows, DType::f32, d, {rows.dim(0), H}, "rows_dot", "rows");
  expect_moe(slot, DType::i32, d, {n, k}, "rows_dot", "slot");
  expect_moe(out, DType::f32, d, {n, k}, "rows_dot", "out");
  if (n == 0) return;
  TPX_DISPATCH(d, rows_dot, a, rows, slot, out);
}

void gemm_grouped(const Tensor& a, std::span<const std::int64_t> rows, const Tensor& b,
                  std::span<const std::int64_t> which, bool trans_b, const Tensor& c, float beta) {
  TPX_CHECK(a.ndim() == 2 && b.ndim() == 3 && c.ndim() == 2 && rows.size() == which.size(),
            "gemm_grouped: a {}, b {}, c {}, {} groups and {} matrices", a.describe(), b.describe(),
            c.describe(), rows.size(), which.size());
  const std::int64_t R = a.dim(0), K = a.dim(1), N = c.dim(1), G = b.dim(0);
  const Device d = c.device();
  expect_moe(a, DType::f32, d, {R, K}, "gemm_grouped", "a");
  expect_moe(b, DType::f32, d, trans_b ? Tensor::Shape{G, N, K} : Tensor::Shape{G, K, N},
             "gemm_grouped", "b");
  expect_moe(c, DType::f32, d, {R, N}, "gemm_grouped", "c");
  std::int64_t total = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    TPX_CHECK(rows[i] >= 0 && which[i] >= 0 && which[i] < G,
              "gemm_grouped: group {} of {} rows on matrix {} of {}", i, rows[i], which[i], G);
    total += rows[i];
  }
  TPX_CHECK(total == R, "gemm_grouped: the groups hold {} rows of {}", total, R);
#if TPX_WITH_CUDA
  if (d == Device::cuda && cuda::gemm_grouped(a, rows, b, which, trans_b, c, beta)) return;
#endif
  std::int64_t first = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] > 0) {
      const Tensor bi = b.slice0(which[i], which[i] + 1).reshape({b.dim(1), b.dim(2)});
      gemm(a.slice0(first, first + rows[i]), false, bi, trans_b, c.slice0(first, first + rows[i]),
           1.0f, beta);
    }
    first += rows[i];
  }
}

void moe_router_dz(const Tensor& score, const Tensor& expert, const Tensor& weight,
                   const Tensor& dweight, const Tensor& dP, bool sigmoid, std::int64_t tokens_all,
                   const Tensor& dz) {
  TPX_CHECK(score.ndim() == 2 && expert.ndim() == 2, "moe_router_dz: score {}, expert {}",
            score.describe(), expert.describe());
  const std::int64_t n = score.dim(0), E = score.dim(1), k = expert.dim(1);
  const Device d = score.device();
  TPX_CHECK(tokens_all >= 1 || n == 0, "moe_router_dz: {} tokens", tokens_all);
  expect_moe(score, DType::f32, d, {n, E}, "moe_router_dz", "score");
  expect_moe(expert, DType::i32, d, {n, k}, "moe_router_dz", "expert");
  expect_moe(weight, DType::f32, d, {n, k}, "moe_router_dz", "weight");
  expect_moe(dweight, DType::f32, d, {n, k}, "moe_router_dz", "dweight");
  if (dP.defined()) expect_moe(dP, DType::f32, d, {E}, "moe_router_dz", "dP");
  expect_moe(dz, DType::f32, d, {n, E}, "moe_router_dz", "dz");
  if (n == 0) return;
  TPX_DISPATCH(d, moe_router_dz, score, expert, weight, dweight, dP, sigmoid, tokens_all, dz);
}

void synchronize([[maybe_unused]] Device device) {
#if TPX_WITH_CUDA
  if (device == Device::cuda) cuda::synchronize();
#endif
}

double bf16_gemm_peak_tflops([[maybe_unused]] Device device) {
#if TPX_WITH_CUDA
  if (device == Device::cuda) {
    static std::once_flag once;
    static double peak = 0.0;
    std::call_once(once, [] { peak = cuda::measure_bf16_gemm_peak_tflops(); });
    return peak;
  }
#endif
  return 0.0;
}

double time_ms(Device device, int reps, const std::function<void()>& work) {
  TPX_CHECK(reps > 0, "time_ms: {} repetitions", reps);
  work();  // untimed: first-call costs (plans, workspaces, lazy loading) stay out
#if TPX_WITH_CUDA
  if (device == Device::cuda) return cuda::time_ms(reps, work);
#endif
  synchronize(device);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) work();
  synchronize(device);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         reps;
}

Tensor to_device(const Tensor& t, Device device) {
#if TPX_WITH_CUDA
  if (device == Device::cpu && t.device() == Device::cuda && t.dtype() == DType::bf16)
    return cuda::to_host_f32(t);
#endif
  Tensor out = Tensor::empty(t.shape(), t.dtype(), device);
  copy(t, out);
  return out;
}

#undef TPX_DISPATCH

// --- Native block-scaled FP8 GEMMs (stage 06's --fp8-recipe rowwise and block128) ---------------

namespace {

/// An operand's rows and K: from its codes [rows, K], or from its values alone ([rows, K], or
/// [K, rows] when transposed).
std::pair<std::int64_t, std::int64_t> rows_k(const ScaledOperand& o) {
  if (o.codes.defined()) return {o.codes.dim(0), o.codes.dim(1)};
  TPX_CHECK(o.values.defined(), "gemm_scaled: an operand with neither codes nor values");
  const std::int64_t r = o.values.rows(), c = o.values.cols();
  return o.transposed ? std::pair{c, r} : std::pair{r, c};
}

/// The values an operand stands for, in its orientation: the caller's, or dequantized now.
Tensor scaled_values(const ScaledOperand& o) {
  if (o.values.defined()) return o.values;
  const std::int64_t rows = o.codes.dim(0), k = o.codes.dim(1);
  const Tensor x = Tensor::empty(o.transposed ? Tensor::Shape{k, rows} : Tensor::Shape{rows, k},
                                 DType::f32, o.codes.device());
  lowp_dequantize(o.codes, o.scales, o.tensor_scale, o.recipe, o.operand, x, o.transposed);
  return x;
}

}  // namespace

void gemm_scaled(const ScaledOperand& a, const ScaledOperand& b, const Tensor& c) {
  const auto [m, k] = rows_k(a);
  const auto [n, kb] = rows_k(b);
  TPX_CHECK(k == kb && c.numel() == m * n && a.recipe == b.recipe,
            "gemm_scaled: A [{}, {}] and B [{}, {}] (K-major, of one recipe) into C {}", m, k, n,
            kb, c.describe());
  TPX_CHECK((c.dtype() == DType::f32 || c.dtype() == DType::bf16) &&
                (a.codes.defined() ? a.codes : a.values).device() == c.device() &&
                (b.codes.defined() ? b.codes : b.values).device() == c.device(),
            "gemm_scaled: operands on C's device, C f32 or bf16: {}", c.describe());
#if TPX_WITH_CUDA
  if (c.device() == Device::cuda && a.codes.defined() && b.codes.defined() &&
      cuda::gemm_scaled(a, b, c))
    return;
#endif
  // The product of the dequantized operands in fp32, as stage 06 multiplies them on the cpu:
  // A·Bᵀ with A as [m, K] (or its transpose) and B as [n, K] (or its transpose, [K, n]).
  gemm(scaled_values(a), a.transposed, scaled_values(b), !b.transposed, c, 1.0f, 0.0f, DType::f32);
}

ScaledOperand prepare_scaled(ScaledOperand q) {
  if (q.values.defined() || !q.codes.defined()) return q;
  const std::string problem = scaled_gemm_problem(q.codes.device(), q.recipe);
  if (problem.empty()) return q;
  if (q.codes.device() == Device::cuda) {
    // Said once per process and recipe: the header's dtype says it on every run too.
    static std::mutex mutex;
    static std::set<lowp::Recipe> said;
    const std::lock_guard lock(mutex);
    if (said.insert(q.recipe).second)
      fmt::print(stderr, "tpx: --fp8-recipe {}: {}; multiplying the dequantized operands in fp32\n",
                 lowp::to_string(q.recipe), problem);
  }
  q.values = scaled_values(q);
  q.codes = q.scales = q.tensor_scale = Tensor();
  return q;
}

std::string scaled_gemm_problem(Device device, lowp::Recipe recipe) {
  if (device == Device::cpu)
    return "the cpu multiplies the dequantized operands in fp32 (no FP8 tensor cores)";
  if (std::string p = device_problem(device); !p.empty()) return p;
#if TPX_WITH_CUDA
  return cuda::scaled_gemm_problem(recipe);
#else
  (void)recipe;
  no_cuda();
#endif
}

std::string device_description(Device device) {
  return fmt::format("{}: {}", to_string(device), device_name(device));
}

}  // namespace tpx::ops
