// The CUDA backend's ops: shape and dtype checks, scratch buffers from the caching allocator,
// then kernels (kernels.h) and cuBLAS (blas.h) on the current stream. Every op opens an NVTX
// range named after it.
#include "ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string_view>
#include <tuple>

#include <fmt/format.h>

#include "blas.h"
#include "check.h"
#include "common/config.h"
#include "common/fp8.h"
#include "common/ops.h"
#include "common/rope.h"
#include "kernels.h"
#include "nvtx.h"

namespace tpx::cuda {
namespace {

using I = std::int64_t;

/// Checks a kernel launch (configuration errors surface here; faults surface at the next sync).
#define TPX_CUDA_LAUNCH_CHECK() TPX_CUDA_CHECK(cudaGetLastError())

void* stream() {
  return current_stream();
}

void expect(const Tensor& t, DType dtype, const char* what) {
  TPX_CHECK(t.device() == Device::cuda && t.dtype() == dtype, "{} must be {} on cuda, got {}", what,
            to_string(dtype), t.describe());
}
void expect_f32(const Tensor& t, const char* what) {
  expect(t, DType::f32, what);
}

/// An operand the element-wise kernels read or write as it is stored: fp32 or bf16 on cuda.
void expect_f32_or_bf16(const Tensor& t, const char* what) {
  TPX_CHECK(t.device() == Device::cuda && (t.dtype() == DType::f32 || t.dtype() == DType::bf16),
            "{} must be f32 or bf16 on cuda, got {}", what, t.describe());
}
void expect_same_dtype(const Tensor& a, const Tensor& b) {
  TPX_CHECK(a.dtype() == b.dtype(), "dtypes differ: {} vs {}", a.describe(), b.describe());
}

/// A tensor as the element-wise kernels take it (kernels.h): its storage and whether it is bf16.
kernels::Src in(const Tensor& t) {
  return {t.raw(), t.dtype() == DType::bf16};
}
kernels::Dst out(const Tensor& t) {
  return {t.raw(), t.dtype() == DType::bf16};
}

void expect_same_numel(const Tensor& a, const Tensor& b) {
  TPX_CHECK(a.numel() == b.numel(), "element counts differ: {} vs {}", a.describe(), b.describe());
}

const float* cf(const Tensor& t) {
  return t.data<float>();
}
float* f(const Tensor& t) {
  return t.data<float>();
}
std::uint16_t* h16(const Tensor& t) {
  return t.data<std::uint16_t>();
}

Tensor scratch(Tensor::Shape shape, DType dtype) {
  return Tensor::empty(std::move(shape), dtype, Device::cuda);
}

/// `t` as a bf16 tensor: itself if it is one, else a bf16 copy in scratch.
Tensor as_bf16(const Tensor& t) {
  if (t.dtype() == DType::bf16) return t;
  Tensor out = scratch(t.shape(), DType::bf16);
  cast(t, out);
  return out;
}

/// The double at device address p, copied to the host once the current stream has written it.
double fetch_double(const double* p) {
  double result = 0.0;
  TPX_CUDA_CHECK(cudaMemcpyAsync(&result, p, sizeof(double), cudaMemcpyDeviceToHost,
                                 static_cast<cudaStream_t>(stream())));
  synchronize();
  return result;
}

/// A reduction to one double on the host (deterministic, two passes; see elementwise.cu).
double reduce_sum_squares(kernels::Src x, kernels::Src y, I n) {
  // Scratch for the result and one partial per block, as doubles (two f32 slots each).
  const Tensor partials = scratch({2 * (I{kernels::reduction_blocks(n)} + 1)}, DType::f32);
  auto* p = static_cast<double*>(partials.raw());
  kernels::sum_squares(x, y, n, p + 1, p, stream());
  TPX_CUDA_LAUNCH_CHECK();
  return fetch_double(p);
}

using AttnDims = ::tpx::ops::AttentionDims;

/// q [S, B, heads·D] and k, v [S, B, kv_heads·D] (ops::attention_dims) on cuda, of one dtype:
/// f32, or bf16 under bf16 compute.
AttnDims qkv_dims(const Tensor& q, const Tensor& k, const Tensor& v, I heads, DType compute,
                  const char* what) {
  const AttnDims z = ::tpx::ops::attention_dims(q, k, v, heads, what);
  for (const Tensor* t : {&q, &k, &v}) expect_f32_or_bf16(*t, what);
  TPX_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype() &&
                (q.dtype() == DType::f32 || compute == DType::bf16),
            "{}: q, k, v of one dtype, bf16 ones with bf16 compute: {} {} {} ({})", what,
            q.describe(), k.describe(), v.describe(), to_string(compute));
  return z;
}

AttnDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                        const Tensor& probs, DType compute) {
  const AttnDims z = qkv_dims(q, k, v, heads, compute, "attention");
  expect_f32(probs, "attention probs");
  TPX_CHECK(probs.numel() == z.b * heads * z.s * z.s, "probs {} must hold [B, heads, S, S]",
            probs.describe());
  return z;
}

/// `t` (f32 or bf16) from element `elems` on: a GEMM operand that starts inside a tensor.
const void* at(const Tensor& t, I elems) {
  return static_cast<const char*>(t.raw()) + elems * static_cast<I>(dtype_size(t.dtype()));
}
/// The same for a GEMM's output.
void* at_out(const Tensor& t, I elems) {
  return static_cast<char*>(t.raw()) + elems * static_cast<I>(dtype_size(t.dtype()));
}

void expect_compute(DType compute) {
  TPX_CHECK(compute == DType::f32 || compute == DType::bf16,
            "GEMM compute dtype must be fp32 or bf16, got {}", to_string(compute));
}

}  // namespace

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta, DType compute) {
  NvtxRange range("gemm");
  expect_compute(compute);
  const auto [m, n, k] = ::tpx::ops::gemm_dims(a, trans_a, b, trans_b, c);
  TPX_CHECK(a.device() == Device::cuda && b.device() == Device::cuda && c.device() == Device::cuda,
            "gemm operands must be on cuda: {} {} {}", a.describe(), b.describe(), c.describe());
  TPX_CHECK(c.dtype() == DType::f32 || (c.dtype() == DType::bf16 && compute == DType::bf16),
            "gemm C must be f32 (or bf16 with bf16 compute), got {}", c.describe());
  if (compute == DType::f32) {
    expect_f32(a, "gemm A (fp32 compute)");
    expect_f32(b, "gemm B (fp32 compute)");
  }
  const Tensor a_op = compute == DType::bf16 ? as_bf16(a) : a;
  const Tensor b_op = compute == DType::bf16 ? as_bf16(b) : b;
  blas::gemm(trans_a, trans_b, m, n, k, alpha, {a_op.raw(), a.cols()}, {b_op.raw(), b.cols()}, beta,
             c.raw(), n, 0, 1, compute, c.dtype());
}

void rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& y, const Tensor& rstd) {
  NvtxRange range("rmsnorm_forward");
  const I rows = x.rows(), h = x.cols();
  expect_f32_or_bf16(x, "rmsnorm x");
  expect_f32(g, "rmsnorm g");
  expect_f32_or_bf16(y, "rmsnorm y");
  expect_f32(rstd, "rmsnorm rstd");
  TPX_CHECK(g.numel() == h && y.numel() == x.numel() && rstd.numel() == rows,
            "rmsnorm shapes: x {}, g {}, y {}, rstd {}", x.describe(), g.describe(), y.describe(),
            rstd.describe());
  kernels::rmsnorm_forward(in(x), cf(g), out(y), f(rstd), rows, h, static_cast<float>(kNormEps),
                           stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dg) {
  NvtxRange range("rmsnorm_backward");
  const I rows = x.rows(), h = x.cols();
  for (const Tensor* t : {&dy, &x, &dx}) expect_f32_or_bf16(*t, "rmsnorm_backward tensor");
  for (const Tensor* t : {&g, &rstd, &dg}) expect_f32(*t, "rmsnorm_backward tensor");
  expect_same_dtype(dy, x);
  TPX_CHECK(dy.numel() == x.numel() && dx.numel() == x.numel() && g.numel() == h &&
                dg.numel() == h && rstd.numel() == rows,
            "rmsnorm_backward shapes");
  kernels::rmsnorm_backward_dx(in(dy), in(x), cf(g), cf(rstd), out(dx), rows, h, stream());
  TPX_CUDA_LAUNCH_CHECK();
  Tensor partial = scratch({I{kernels::rmsnorm_dg_chunks(rows, h)}, h}, DType::f32);
  kernels::rmsnorm_backward_dg(in(dy), in(x), cf(rstd), f(partial), f(dg), rows, h, stream());
  TPX_CUDA_LAUNCH_CHECK();
}

// Per (batch, query head): P = causal_softmax(Q Kᵀ · scale),  O = P V, as strided-batched GEMMs.
// Q, O of batch b, query head h are the [S, D] matrices at column offset (b·heads + h)·D of the
// [S, B, heads·D] tensors (row stride ldq), and K, V those of KV head h / g (g = heads / kv_heads)
// at column offset (b·kv_heads + h / g)·D of [S, B, kv_heads·D] (row stride ldkv): cuBLAS reads
// (and writes O) in place, no transposes or copies.
// Grouped-query attention: with n = b·kv_heads + kv, query head h = kv·g + r is the (n·g + r)-th
// (b, h) pair, so for each member r < g of the groups one GEMM batched over the B·kv_heads
// values of n takes Q, O at offset r·D with batch stride g·D, P at offset r·S² with batch stride
// g·S², and K, V with batch stride D. g = 1 (kv_heads = heads) is one GEMM over all B·heads.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                       const Tensor& out, const Tensor& probs, DType compute) {
  NvtxRange range("attention_forward");
  expect_compute(compute);
  const AttnDims z = attention_dims(q, k, v, heads, probs, compute);
  expect(out, q.dtype(), "attention out");  // bf16: cuBLASLt rounds each output once
  expect_same_numel(q, out);
  const I s = z.s, d = z.d, g = z.group(), n = z.b * z.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const bool low = compute == DType::bf16;
  const Tensor qo = low ? as_bf16(q) : q, ko = low ? as_bf16(k) : k, vo = low ? as_bf16(v) : v;
  const Tensor p16 = low ? scratch(probs.shape(), DType::bf16) : Tensor();
  for (I r = 0; r < g; ++r)
    blas::gemm(false, true, s, s, d, scale, {at(qo, r * d), z.ldq, g * d}, {ko.raw(), z.ldkv, d},
               0.0f, f(probs) + r * s * s, s, g * s * s, n, compute, DType::f32);
  kernels::causal_softmax_forward(f(probs), low ? h16(p16) : nullptr, z.b * heads * s, s, stream());
  TPX_CUDA_LAUNCH_CHECK();
  const Tensor& p_op = low ? p16 : probs;
  for (I r = 0; r < g; ++r)
    blas::gemm(false, false, s, d, s, 1.0f, {at(p_op, r * s * s), s, g * s * s},
               {vo.raw(), z.ldkv, d}, 0.0f, at_out(out, r * d), z.ldq, g * d, n, compute,
               out.dtype());
}

// dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ⊙ (dP − rowsum(dP ⊙ P));  dQ = scale·dS K;  dK = scale·dSᵀ Q.
// dP and dS share one [B·heads, S, S] scratch (the softmax backward runs in place). Batched as
// in forward, one GEMM per group member r; a KV head's dK and dV sum its group's query heads:
// member 0 writes them (beta 0), members 1 .. g − 1 add to them (beta 1), in that order.
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, I heads, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, DType compute) {
  NvtxRange range("attention_backward");
  expect_compute(compute);
  const AttnDims z = attention_dims(q, k, v, heads, probs, compute);
  for (const Tensor* t : {&dout, &dq, &dk, &dv}) {
    expect(*t, q.dtype(), "attention_backward tensor");
    expect_same_numel(t == &dk || t == &dv ? k : q, *t);
  }
  const I s = z.s, d = z.d, g = z.group(), n = z.b * z.kv_heads;
  const I ldq = z.ldq, ldkv = z.ldkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const bool low = compute == DType::bf16;
  const Tensor doo = low ? as_bf16(dout) : dout, qo = low ? as_bf16(q) : q;
  const Tensor ko = low ? as_bf16(k) : k, vo = low ? as_bf16(v) : v;
  const Tensor p_op = low ? as_bf16(probs) : probs;
  const Tensor dp = scratch(probs.shape(), DType::f32);
  const Tensor ds16 = low ? scratch(probs.shape(), DType::bf16) : Tensor();
  // dK and dV sum the group's members: bf16 ones are summed in fp32 scratch and rounded once
  // (a group of one writes them directly, rounded by cuBLASLt).
  const bool summed16 = dk.dtype() == DType::bf16 && g > 1;
  const Tensor dk_acc = summed16 ? scratch(dk.shape(), DType::f32) : dk;
  const Tensor dv_acc = summed16 ? scratch(dv.shape(), DType::f32) : dv;

  for (I r = 0; r < g; ++r)
    blas::gemm(true, false, s, d, s, 1.0f, {at(p_op, r * s * s), s, g * s * s},
               {at(doo, r * d), ldq, g * d}, r == 0 ? 0.0f : 1.0f, dv_acc.raw(), ldkv, d, n,
               compute, dv_acc.dtype());
  for (I r = 0; r < g; ++r)
    blas::gemm(false, true, s, s, d, 1.0f, {at(doo, r * d), ldq, g * d}, {vo.raw(), ldkv, d}, 0.0f,
               f(dp) + r * s * s, s, g * s * s, n, compute, DType::f32);
  kernels::causal_softmax_backward(cf(probs), f(dp), low ? h16(ds16) : nullptr, z.b * heads * s, s,
                                   stream());
  TPX_CUDA_LAUNCH_CHECK();
  const Tensor& ds_op = low ? ds16 : dp;
  for (I r = 0; r < g; ++r)
    blas::gemm(false, false, s, d, s, scale, {at(ds_op, r * s * s), s, g * s * s},
               {ko.raw(), ldkv, d}, 0.0f, at_out(dq, r * d), ldq, g * d, n, compute, dq.dtype());
  for (I r = 0; r < g; ++r)
    blas::gemm(true, false, s, d, s, scale, {at(ds_op, r * s * s), s, g * s * s},
               {at(qo, r * d), ldq, g * d}, r == 0 ? 0.0f : 1.0f, dk_acc.raw(), ldkv, d, n, compute,
               dk_acc.dtype());
  if (summed16) {
    cast(dk_acc, dk);
    cast(dv_acc, dv);
  }
}

namespace {

/// The fused ops' checks: q, out [S, B, heads·D] and k, v [S, B, kv_heads·D] on cuda, f32 or
/// bf16 (q, k, v of one dtype; bf16 takes bf16 compute), lse [B, heads, S] f32, a head dim the
/// kernels take and a head count a grid dimension can hold.
AttnDims fused_dims(const Tensor& q, const Tensor& k, const Tensor& v, I heads, const Tensor& out,
                    const Tensor& lse, DType compute) {
  const AttnDims z = ::tpx::ops::attention_dims(q, k, v, heads, "fused attention");
  for (const Tensor* t : {&q, &k, &v, &out}) expect_f32_or_bf16(*t, "fused attention tensor");
  TPX_CHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype() &&
                (q.dtype() == DType::f32 || compute == DType::bf16),
            "fused attention: q, k, v of one dtype, bf16 ones with bf16 compute: {} {} {} ({})",
            q.describe(), k.describe(), v.describe(), to_string(compute));
  TPX_CHECK(out.shape() == q.shape(), "fused attention: out {} must be shaped like q {}",
            out.describe(), q.describe());
  expect_f32(lse, "fused attention lse");
  TPX_CHECK(z.d <= kernels::kFlashMaxHeadDim,
            "fused attention on cuda takes head dims up to {} (got {}); use --attention naive",
            kernels::kFlashMaxHeadDim, z.d);
  TPX_CHECK(z.b * heads <= 65535, "fused attention: B·heads = {} exceeds a grid's 65535",
            z.b * heads);
  TPX_CHECK(lse.numel() == z.b * heads * z.s, "lse {} must hold [B, heads, S] = [{}, {}, {}]",
            lse.describe(), z.b, heads, z.s);
  return z;
}

/// Whether the fused kernels run on bf16 operands: bf16 tensors and fp32 ones under bf16
/// compute (read as bf16 copies in scratch, the same values the CUDA-core kernels round as they
/// load), except where fp32 outputs are asked for and the tensor cores cannot write them (only
/// they store fp32 from bf16 operands): a head dim or row stride they do not take, an fp32
/// output or a bf16 input not 16-byte aligned. Then the CUDA-core kernels run on fp32 tensors.
bool fused_bf16_operands(const Tensor& q, DType compute, const AttnDims& z,
                         std::initializer_list<const Tensor*> inputs,
                         std::initializer_list<const Tensor*> outputs) {
  if (q.dtype() == DType::f32 && compute != DType::bf16) return false;
  auto aligned = [](const Tensor* t) {
    return reinterpret_cast<std::uintptr_t>(t->raw()) % 16 == 0;
  };
  bool fp32_outputs = false;
  for (const Tensor* t : outputs) {
    if (t->dtype() != DType::f32) continue;
    fp32_outputs = true;
    if (!aligned(t)) return false;
  }
  if (!fp32_outputs) return true;  // bf16 outputs: the launcher picks tensor or CUDA cores
  for (const Tensor* t : inputs)
    if (t->dtype() == DType::bf16 && !aligned(t)) return false;
  bool tc = false;
  TPX_CUDA_CHECK(static_cast<cudaError_t>(kernels::flash_tensor_cores(z.d, z.ldq, z.ldkv, tc)));
  return tc;
}

/// `t` as an fp32 tensor: itself if it is one, else an fp32 copy in scratch (exact).
Tensor as_f32(const Tensor& t) {
  if (t.dtype() == DType::f32) return t;
  Tensor out = scratch(t.shape(), DType::f32);
  cast(t, out);
  return out;
}

}  // namespace

namespace {

// FlashAttention-2 kernels (flash_attention.cu) on the tensors in place. bf16 tensors are read
// and written as they are stored (outputs rounded once by the kernels); fp32 ones too, except
// that under bf16 compute the tensor-core kernels read bf16 copies of the inputs (above).
// Backward's scratch is Δ = rowsum(dO ∘ O), one float per query row and head, and for bf16
// operands dQ's fp32 accumulator (bf16 dq) and the counters that fix its adds' order. `pair`: the
// causal attention, or one of context parallelism's chunk pairs, whose outputs are fp32 (its
// inputs fp32, or bf16 under bf16 compute: stage 08's --dtype bf16).
void fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads, const Tensor& out,
                   const Tensor& lse, DType compute, kernels::FlashPair pair) {
  expect_compute(compute);
  const AttnDims z = fused_dims(q, k, v, heads, out, lse, compute);
  if (fused_bf16_operands(q, compute, z, {&q, &k, &v}, {&out})) {
    TPX_CHECK(out.dtype() == q.dtype() || out.dtype() == DType::f32,
              "fused attention: bf16 q, k, v write a bf16 or f32 out, not {}", out.describe());
    const Tensor qb = as_bf16(q), kb = as_bf16(k), vb = as_bf16(v);
    TPX_CUDA_CHECK(static_cast<cudaError_t>(kernels::flash_attention_forward_bf16(
        h16(qb), h16(kb), h16(vb), {out.raw(), out.dtype() == DType::bf16}, f(lse), z.s,
        z.b * heads, z.group(), z.d, z.ldq, z.ldkv, pair, stream())));
  } else {
    // fp32 tensors, or bf16 ones whose fp32 outputs the tensor cores cannot write: fp32 copies
    // (exact) under bf16 compute.
    expect_f32(out, "fused attention out");
    const Tensor qf = as_f32(q), kf = as_f32(k), vf = as_f32(v);
    TPX_CUDA_CHECK(static_cast<cudaError_t>(kernels::flash_attention_forward(
        cf(qf), cf(kf), cf(vf), f(out), f(lse), z.s, z.b * heads, z.group(), z.d, z.ldq, z.ldkv,
        compute == DType::bf16, pair, stream())));
  }
  TPX_CUDA_LAUNCH_CHECK();
}

void fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& out, const Tensor& lse, I heads, const Tensor& dq,
                    const Tensor& dk, const Tensor& dv, DType compute, kernels::FlashPair pair) {
  expect_compute(compute);
  const AttnDims z = fused_dims(q, k, v, heads, out, lse, compute);
  for (const Tensor* t : {&dout, &dq, &dk, &dv}) {
    TPX_CHECK(t->dtype() == (t == &dout ? q.dtype() : dq.dtype()),
              "fused attention backward: {} must be of {}'s dtype", t->describe(),
              t == &dout ? "q" : "dq");
    const Tensor& like = t == &dk || t == &dv ? k : q;
    TPX_CHECK(t->shape() == like.shape(), "fused attention backward: {} must be shaped like {}",
              t->describe(), like.describe());
  }
  const Tensor delta = scratch({z.b * heads * z.s}, DType::f32);
  if (fused_bf16_operands(q, compute, z, {&dout, &q, &k, &v}, {&dq, &dk, &dv})) {
    TPX_CHECK(dq.dtype() == q.dtype() || dq.dtype() == DType::f32,
              "fused attention backward: bf16 q, k, v write bf16 or f32 dq, dk, dv, not {}",
              dq.describe());
    const Tensor dob = as_bf16(dout), qb = as_bf16(q), kb = as_bf16(k), vb = as_bf16(v);
    auto dst = [](const Tensor& t) -> kernels::Dst { return {t.raw(), t.dtype() == DType::bf16}; };
    // dQ's fp32 accumulator (a bf16 dq; an fp32 one accumulates in place) and the words that fix
    // the order of its adds (kernels::FlashScratch).
    const Tensor dq_acc = dq.dtype() == DType::bf16 ? scratch({z.s * z.ldq}, DType::f32) : Tensor{};
    const Tensor sync = scratch({kernels::flash_sync_words(z.b * heads, z.s)}, DType::i32);
    const kernels::FlashScratch work{f(delta), dq_acc.defined() ? f(dq_acc) : nullptr,
                                     static_cast<unsigned*>(sync.raw())};
    TPX_CUDA_CHECK(static_cast<cudaError_t>(kernels::flash_attention_backward_bf16(
        h16(dob), h16(qb), h16(kb), h16(vb), {out.raw(), out.dtype() == DType::bf16}, cf(lse), work,
        dst(dq), dst(dk), dst(dv), z.s, z.b * heads, z.group(), z.d, z.ldq, z.ldkv, pair,
        stream())));
  } else {
    expect_f32(dq, "fused attention backward dq");
    const Tensor dof = as_f32(dout), qf = as_f32(q), kf = as_f32(k), vf = as_f32(v);
    const Tensor of = as_f32(out);
    TPX_CUDA_CHECK(static_cast<cudaError_t>(kernels::flash_attention_backward(
        cf(dof), cf(qf), cf(kf), cf(vf), cf(of), cf(lse), f(delta), f(dq), f(dk), f(dv), z.s,
        z.b * heads, z.group(), z.d, z.ldq, z.ldkv, compute == DType::bf16, pair, stream())));
  }
  TPX_CUDA_LAUNCH_CHECK();
}

}  // namespace

void attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                             const Tensor& out, const Tensor& lse, DType compute) {
  NvtxRange range("attention_fused_forward");
  fused_forward(q, k, v, heads, out, lse, compute, kernels::kCausal);
}

void attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, I heads, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv, DType compute) {
  NvtxRange range("attention_fused_backward");
  fused_backward(dout, q, k, v, out, lse, heads, dq, dk, dv, compute, kernels::kCausal);
}

// Context parallelism's chunk pairs: the same kernels with the pair's shift, fp32 outputs. fp32
// inputs compute in fp32 (CUDA cores); bf16 ones under bf16 compute, on the tensor cores where
// they take the shapes (else CUDA cores on exact fp32 copies).
namespace {
DType pair_compute(const Tensor& q) {
  return q.dtype() == DType::bf16 ? DType::bf16 : DType::f32;
}
}  // namespace

void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, I heads,
                             const Tensor& out, const Tensor& lse, I shift) {
  NvtxRange range("attention_block_forward");
  expect_f32(out, "attention block out");
  fused_forward(q, k, v, heads, out, lse, pair_compute(q), {shift, false});
}

void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, I heads, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv, I shift) {
  NvtxRange range("attention_block_backward");
  for (const Tensor* t : {&dq, &dk, &dv}) expect_f32(*t, "attention block gradient");
  fused_backward(dout, q, k, v, out, lse, heads, dq, dk, dv, pair_compute(q), {shift, true});
}

void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                     const Tensor& part_lse, I heads) {
  NvtxRange range("attention_merge");
  for (const Tensor* t : {&out, &lse, &part_out, &part_lse})
    expect_f32(*t, "attention merge tensor");
  const AttnDims z = ::tpx::ops::attention_merge_dims(out, lse, part_out, part_lse, heads);
  kernels::attention_merge(f(out), f(lse), cf(part_out), cf(part_lse), z.s, z.b * heads, z.d, z.ldq,
                           stream());
  TPX_CUDA_LAUNCH_CHECK();
}

namespace {

/// The rotary tables of rope_table() on the device: cos [seq, D/2] then sin [seq, D/2], one
/// cudaMalloc per (device, seq, head dim, theta), uploaded on the first call that needs it and
/// kept for the life of the process (a run uses one or two), so a step never uploads them again.
/// Stages issue ops from several host threads, hence the mutex; the upload runs on the calling
/// thread's current stream and is waited for before the table is published, so a kernel on any
/// stream, issued by any thread afterwards, reads complete values.
const float* rope_device_table(I seq, I head_dim, double theta) {
  using Key = std::tuple<int, I, I, double>;
  static std::mutex mutex;
  static auto* tables = new std::map<Key, float*>();  // never freed: lives until exit
  ensure_initialized();
  int device = 0;
  TPX_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard lock(mutex);
  const Key key{device, seq, head_dim, theta};
  if (const auto it = tables->find(key); it != tables->end()) return it->second;
  const RopeTable t = rope_table(seq, head_dim, theta);
  const std::size_t n = t.cos.size(), bytes = n * sizeof(float);
  void* raw = nullptr;
  TPX_CUDA_CHECK(cudaMalloc(&raw, 2 * bytes));
  auto* p = static_cast<float*>(raw);
  auto st = static_cast<cudaStream_t>(stream());
  cudaError_t rc = cudaMemcpyAsync(p, t.cos.data(), bytes, cudaMemcpyHostToDevice, st);
  if (rc == cudaSuccess)
    rc = cudaMemcpyAsync(p + n, t.sin.data(), bytes, cudaMemcpyHostToDevice, st);
  if (rc == cudaSuccess) rc = cudaStreamSynchronize(st);  // `t` is pageable and about to go
  if (rc != cudaSuccess) {
    cudaFree(p);
    TPX_CUDA_CHECK(rc);
  }
  tables->emplace(key, p);
  return p;
}

/// x [S, B, heads·D] rotated in place by the angles of rope_table(), or by their opposites; row
/// p of x is at position first + p.
void rope_rotate(const Tensor& x, I heads, double theta, I first, bool inverse) {
  expect_f32_or_bf16(x, "rope x");
  TPX_CHECK(x.ndim() == 3 && heads > 0 && x.dim(2) % heads == 0 && (x.dim(2) / heads) % 2 == 0,
            "rope: {} must be [S, B, heads*D] with {} heads of even D", x.describe(), heads);
  TPX_CHECK(first >= 0, "rope: first position {} must not be negative", first);
  const I s = x.dim(0), d = x.dim(2) / heads, n = first + s;
  const float* table = rope_device_table(n, d, theta);  // checks theta, and S > 0 like the cpu
  const I half = d / 2;
  kernels::rope(out(x), table + first * half, table + (n + first) * half, s, x.dim(1) * heads, half,
                inverse, stream());
  TPX_CUDA_LAUNCH_CHECK();
}

}  // namespace

void rope_forward(const Tensor& x, I heads, double theta, I first) {
  NvtxRange range("rope_forward");
  rope_rotate(x, heads, theta, first, false);
}

// y = R x with R orthogonal, so dx = Rᵀ dy: the same rotation by the opposite angle.
void rope_backward(const Tensor& dx, I heads, double theta, I first) {
  NvtxRange range("rope_backward");
  rope_rotate(dx, heads, theta, first, true);
}

void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out) {
  NvtxRange range("swiglu_forward");
  for (const Tensor* t : {&gate, &up, &out}) expect_f32_or_bf16(*t, "swiglu tensor");
  expect_same_dtype(gate, up);
  expect_same_numel(gate, up);
  expect_same_numel(gate, out);
  kernels::swiglu_forward(in(gate), in(up), cuda::out(out), gate.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup) {
  NvtxRange range("swiglu_backward");
  for (const Tensor* t : {&dout, &gate, &up, &dgate, &dup}) {
    expect_f32_or_bf16(*t, "swiglu_backward tensor");
    expect_same_numel(gate, *t);
  }
  expect_same_dtype(gate, dout);
  expect_same_dtype(gate, up);
  expect_same_dtype(dgate, dup);
  kernels::swiglu_backward(in(dout), in(gate), in(up), out(dgate), out(dup), gate.numel(),
                           stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  NvtxRange range("add");
  for (const Tensor* t : {&a, &b, &out}) expect_f32_or_bf16(*t, "add tensor");
  expect_same_numel(a, b);
  expect_same_numel(a, out);
  kernels::add(in(a), in(b), cuda::out(out), a.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void accumulate(const Tensor& x, const Tensor& into) {
  NvtxRange range("accumulate");
  expect_f32_or_bf16(x, "accumulate x");
  expect_f32_or_bf16(into, "accumulate into");
  expect_same_numel(x, into);
  kernels::add(in(into), in(x), out(into), x.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

double mse_loss_sum(const Tensor& y, const Tensor& t) {
  NvtxRange range("mse_loss_sum");
  expect_f32_or_bf16(y, "mse y");
  expect_f32_or_bf16(t, "mse target");
  expect_same_numel(y, t);
  return reduce_sum_squares(in(y), in(t), y.numel());
}

void mse_loss_backward(const Tensor& y, const Tensor& t, double scale, const Tensor& dy) {
  NvtxRange range("mse_loss_backward");
  for (const Tensor* p : {&y, &t, &dy}) expect_f32_or_bf16(*p, "mse_loss_backward tensor");
  expect_same_numel(y, t);
  expect_same_numel(y, dy);
  kernels::mse_backward(in(y), in(t), scale, out(dy), y.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

namespace {

/// The optimizer's bf16 compute copy (tpx::ops checked it), or null.
std::uint16_t* copy_bits(const Tensor& copy) {
  return copy.defined() ? static_cast<std::uint16_t*>(copy.raw()) : nullptr;
}

}  // namespace

void sgd_update(const Tensor& w, const Tensor& grad, float lr, const Tensor& copy) {
  NvtxRange range("sgd_update");
  expect_f32(w, "sgd w");
  expect_f32(grad, "sgd grad");
  expect_same_numel(w, grad);
  kernels::sgd(f(w), cf(grad), lr, copy_bits(copy), w.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

// The language model's ends (kernels in lm.cu; tpx::ops checked the shapes). Logits, dlogits,
// the embedding's output and dout are f32 or bf16 as stored; the rest f32, ids i32.
namespace {

/// Token ids on cuda, at most 2^31 − 1 of them (one thread block per position).
const std::int32_t* ids_of(const Tensor& ids, const char* what) {
  expect(ids, DType::i32, what);
  TPX_CHECK(ids.numel() <= I{0x7fffffff}, "{}: {} positions, more than 2^31 − 1", what,
            ids.numel());
  return ids.data<std::int32_t>();
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, std::int64_t begin,
                       const Tensor& out) {
  NvtxRange range("embedding_forward");
  const std::int32_t* id = ids_of(ids, "embedding_forward ids");
  expect_f32(table, "embedding_forward table");
  expect_f32_or_bf16(out, "embedding_forward out");
  kernels::embedding_forward(id, cf(table), table.dim(0), table.dim(1), begin, cuda::out(out),
                             ids.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void embedding_backward(const Tensor& ids, const Tensor& dout, std::int64_t begin,
                        const Tensor& dtable) {
  NvtxRange range("embedding_backward");
  const std::int32_t* id = ids_of(ids, "embedding_backward ids");
  expect_f32_or_bf16(dout, "embedding_backward dout");
  expect_f32(dtable, "embedding_backward dtable");
  const I n = ids.numel(), rows = dtable.dim(0);
  TPX_CHECK(rows < I{0xffffffff}, "embedding_backward: {} rows, more than 2^32 − 2",
            dtable.describe());
  const Tensor work = scratch({static_cast<I>(std::max<std::size_t>(
                                  1, kernels::embedding_backward_scratch_bytes(n, rows)))},
                              DType::u8);
  TPX_CUDA_CHECK(static_cast<cudaError_t>(kernels::embedding_backward(
      id, in(dout), n, rows, dtable.dim(1), begin, f(dtable), work.raw(), stream())));
  TPX_CUDA_LAUNCH_CHECK();
}

void cross_entropy_partial(const Tensor& logits, const Tensor& targets, std::int64_t begin,
                           std::int64_t vocab, const Tensor& max, const Tensor& sumexp,
                           const Tensor& target_logit) {
  NvtxRange range("cross_entropy_partial");
  const std::int32_t* t = ids_of(targets, "cross_entropy_partial targets");
  expect_f32_or_bf16(logits, "cross_entropy_partial logits");
  for (const Tensor* p : {&max, &sumexp, &target_logit}) expect_f32(*p, "cross_entropy_partial");
  kernels::cross_entropy_partial(in(logits), t, targets.numel(), logits.cols(), begin, vocab,
                                 f(max), f(sumexp), f(target_logit), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void cross_entropy_rescale(const Tensor& local_max, const Tensor& max, const Tensor& sumexp) {
  NvtxRange range("cross_entropy_rescale");
  for (const Tensor* p : {&local_max, &max, &sumexp}) expect_f32(*p, "cross_entropy_rescale");
  kernels::cross_entropy_rescale(cf(local_max), cf(max), f(sumexp), sumexp.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

double cross_entropy_loss(const Tensor& max, const Tensor& sumexp, const Tensor& target_logit,
                          const Tensor& lse) {
  NvtxRange range("cross_entropy_loss");
  for (const Tensor* p : {&max, &sumexp, &target_logit, &lse}) expect_f32(*p, "cross_entropy_loss");
  const I n = lse.numel();
  // The result and one partial per block, as doubles (two f32 slots each).
  const Tensor partials = scratch({2 * (I{kernels::cross_entropy_loss_blocks(n)} + 1)}, DType::f32);
  auto* p = static_cast<double*>(partials.raw());
  kernels::cross_entropy_loss(cf(max), cf(sumexp), cf(target_logit), f(lse), n, p + 1, p, stream());
  TPX_CUDA_LAUNCH_CHECK();
  return fetch_double(p);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            std::int64_t begin, std::int64_t vocab, double scale,
                            const Tensor& dlogits) {
  NvtxRange range("cross_entropy_backward");
  const std::int32_t* t = ids_of(targets, "cross_entropy_backward targets");
  expect_f32_or_bf16(logits, "cross_entropy_backward logits");
  expect_same_dtype(logits, dlogits);
  expect_same_numel(logits, dlogits);
  expect_f32(lse, "cross_entropy_backward lse");
  kernels::cross_entropy_backward(in(logits), t, cf(lse), targets.numel(), logits.cols(), begin,
                                  vocab, static_cast<float>(scale), out(dlogits), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void adamw_update(const Tensor& w, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const ops::AdamWStep& s, const Tensor& copy) {
  NvtxRange range("adamw_update");
  kernels::adamw(f(w), cf(grad), f(m), f(v), s.beta1, s.beta2, s.eps, s.decay, s.step_size,
                 s.sqrt_bias2, copy_bits(copy), w.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

double sum_squares(const Tensor& x) {
  NvtxRange range("sum_squares");
  expect_f32_or_bf16(x, "sum_squares x");
  return reduce_sum_squares(in(x), kernels::Src{}, x.numel());
}

std::vector<double> sum_squares_each(const std::vector<Tensor>& xs) {
  NvtxRange range("sum_squares_each");
  // Each tensor's two-pass reduction into its slot of one array of doubles (two f32 slots
  // each), then one copy of the array to the host: one wait for all of them.
  const auto k = static_cast<I>(xs.size());
  const Tensor results = scratch({2 * std::max<I>(k, 1)}, DType::f32);
  auto* r = static_cast<double*>(results.raw());
  std::vector<Tensor> partials;  // alive until the copy below has waited for the kernels
  for (I i = 0; i < k; ++i) {
    const Tensor& x = xs[std::size_t(i)];
    expect_f32(x, "sum_squares_each x");
    partials.push_back(
        scratch({2 * std::max<I>(1, kernels::reduction_blocks(x.numel()))}, DType::f32));
    kernels::sum_squares(in(x), kernels::Src{}, x.numel(),
                         static_cast<double*>(partials.back().raw()), r + i, stream());
    TPX_CUDA_LAUNCH_CHECK();
  }
  std::vector<double> out(std::size_t(k), 0.0);
  if (k > 0) {
    TPX_CUDA_CHECK(cudaMemcpyAsync(out.data(), r, std::size_t(k) * sizeof(double),
                                   cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream())));
    synchronize();
  }
  return out;
}

void fill(const Tensor& t, float value) {
  NvtxRange range("fill");
  expect_f32_or_bf16(t, "fill");
  kernels::fill(out(t), value, t.numel(), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

bool fp32_boundary_forced() {
  static const bool forced = [] {
    const char* v = std::getenv("TPX_CUDA_FP32_BOUNDARY");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return forced;
}

void cast(const Tensor& src, const Tensor& dst) {
  NvtxRange range("cast");
  TPX_CHECK(src.device() == Device::cuda && dst.device() == Device::cuda,
            "cast between cuda tensors: {} -> {}", src.describe(), dst.describe());
  expect_same_numel(src, dst);
  if (src.dtype() == dst.dtype()) {
    copy(src, dst);
  } else if (src.dtype() == DType::f32 && dst.dtype() == DType::bf16) {
    kernels::f32_to_bf16(cf(src), h16(dst), src.numel(), stream());
  } else if (src.dtype() == DType::bf16 && dst.dtype() == DType::f32) {
    kernels::bf16_to_f32(src.data<std::uint16_t>(), f(dst), src.numel(), stream());
  } else {
    fail(fmt::format("no cast from {} to {}", src.describe(), dst.describe()));
  }
  TPX_CUDA_LAUNCH_CHECK();
}

void copy(const Tensor& src, const Tensor& dst) {
  NvtxRange range("copy");
  TPX_CHECK(src.numel() == dst.numel() && src.dtype() == dst.dtype(), "copy {} -> {}",
            src.describe(), dst.describe());
  if (src.device() == Device::cuda || dst.device() == Device::cuda) ensure_initialized();
  auto s = static_cast<cudaStream_t>(stream());
  TPX_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDefault, s));
  // Host memory is pageable: make the copy complete before the caller touches (or frees) it.
  if (src.device() == Device::cpu || dst.device() == Device::cpu) synchronize();
}

void column_blocks(const Tensor& x, const Tensor& blocks, I m, I c, I n, bool split) {
  NvtxRange range(split ? "split_columns" : "join_columns");
  const int bytes = static_cast<int>(dtype_size(x.dtype()));
  if (split)
    kernels::column_blocks(x.raw(), blocks.raw(), m, c, n, bytes, true, stream());
  else
    kernels::column_blocks(blocks.raw(), x.raw(), m, c, n, bytes, false, stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void quantize_fp8(const Tensor& x, const Tensor& scale, const Tensor& q) {
  NvtxRange range("quantize_fp8");
  kernels::quantize_fp8(cf(x), cf(scale), q.data<std::uint8_t>(), x.numel(), fp8::format(q.dtype()),
                        stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void dequantize_fp8(const Tensor& q, const Tensor& scale, const Tensor& x) {
  NvtxRange range("dequantize_fp8");
  kernels::dequantize_fp8(q.data<std::uint8_t>(), cf(scale), f(x), q.numel(),
                          fp8::format(q.dtype()), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void amax(const Tensor& x, const Tensor& out) {
  NvtxRange range("amax");
  kernels::amax(cf(x), x.numel(), f(out), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void fp8_scale(const Tensor& amax, DType fmt, const Tensor& scale) {
  NvtxRange range("fp8_scale");
  kernels::fp8_scale(cf(amax), fp8::max_normal(fmt), f(scale), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void lowp_quantize(const Tensor& x, const lowp::Layout& l, const Tensor& tensor_amax,
                   const Tensor& codes, const Tensor& scales, const Tensor& tensor_scale,
                   const lowp::StochasticRounding* stochastic) {
  NvtxRange range("lowp_quantize");
  TPX_CHECK(x.dtype() == DType::f32 && x.ndim() == 2 && x.numel() > 0,
            "lowp_quantize of {}: a non-empty f32 matrix", x.describe());
  TPX_CHECK(dtype_size(codes.dtype()) == 1 && codes.numel() == x.numel(),
            "lowp_quantize: codes {} for {}", codes.describe(), x.describe());
  const I rows = x.dim(0), cols = x.dim(1);
  const I br = l.block_rows == 0 ? rows : l.block_rows,
          bc = l.block_cols == 0 ? cols : l.block_cols;
  const bool fp32 = l.scale == lowp::ScaleFormat::fp32;
  TPX_CHECK(scales.numel() == ((rows + br - 1) / br) * ((cols + bc - 1) / bc) &&
                scales.dtype() == (fp32 ? DType::f32 : DType::u8),
            "lowp_quantize: scales {} for {}", scales.describe(), x.describe());
  const bool two_level = l.scale == lowp::ScaleFormat::ue4m3;
  Tensor amax = tensor_amax;
  if (two_level && !amax.defined()) {  // the whole tensor's own amax
    amax = scratch({1}, DType::f32);
    kernels::amax(cf(x), x.numel(), f(amax), stream());
  }
  TPX_CHECK(stochastic == nullptr || two_level,
            "lowp_quantize: stochastic rounding needs nvfp4's E2M1 elements");
  kernels::lowp_quantize(cf(x), rows, cols, l, two_level ? cf(amax) : nullptr, stochastic,
                         codes.data<std::uint8_t>(), fp32 ? f(scales) : nullptr,
                         fp32 ? nullptr : scales.data<std::uint8_t>(),
                         two_level ? f(tensor_scale) : nullptr, stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void lowp_dequantize(const Tensor& codes, const lowp::Layout& l, const Tensor& scales,
                     const Tensor& tensor_scale, const Tensor& x, bool transpose) {
  NvtxRange range("lowp_dequantize");
  TPX_CHECK(x.dtype() == DType::f32 && x.ndim() == 2 && x.numel() > 0 &&
                dtype_size(codes.dtype()) == 1 && codes.numel() == x.numel(),
            "lowp_dequantize: codes {} into {}", codes.describe(), x.describe());
  const bool fp32 = l.scale == lowp::ScaleFormat::fp32;
  TPX_CHECK(scales.dtype() == (fp32 ? DType::f32 : DType::u8),
            "lowp_dequantize: scales {} for this layout", scales.describe());
  const bool two_level = l.scale == lowp::ScaleFormat::ue4m3;
  const I rows = transpose ? x.dim(1) : x.dim(0), cols = transpose ? x.dim(0) : x.dim(1);
  kernels::lowp_dequantize(codes.data<std::uint8_t>(), rows, cols, l, fp32 ? cf(scales) : nullptr,
                           fp32 ? nullptr : scales.data<std::uint8_t>(),
                           two_level ? cf(tensor_scale) : nullptr, f(x), transpose, stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void hadamard_rows(const Tensor& x, I rows, I cols, const Tensor& y) {
  NvtxRange range("hadamard_rows");
  kernels::hadamard_rows(cf(x), rows, cols, f(y), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void moe_route(const Tensor& logits, const Tensor& bias, bool sigmoid, const Tensor& score,
               const Tensor& expert, const Tensor& weight) {
  NvtxRange range("moe_route");
  kernels::moe_route(cf(logits), bias.defined() ? cf(bias) : nullptr, logits.dim(0), logits.dim(1),
                     expert.dim(1), sigmoid, f(score), expert.data<std::int32_t>(), f(weight),
                     stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void gather_rows(const Tensor& x, const Tensor& index, const Tensor& scale, const Tensor& out) {
  NvtxRange range("gather_rows");
  kernels::gather_rows(cf(x), index.data<std::int32_t>(), scale.defined() ? cf(scale) : nullptr,
                       index.dim(0), x.dim(1), f(out), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void combine_rows(const Tensor& rows, const Tensor& slot, const Tensor& weight, const Tensor& out,
                  bool accumulate) {
  NvtxRange range("combine_rows");
  kernels::combine_rows(cf(rows), slot.data<std::int32_t>(),
                        weight.defined() ? cf(weight) : nullptr, slot.dim(0), slot.dim(1),
                        out.dim(1), f(out), accumulate, stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void rows_dot(const Tensor& a, const Tensor& rows, const Tensor& slot, const Tensor& out) {
  NvtxRange range("rows_dot");
  kernels::rows_dot(cf(a), cf(rows), slot.data<std::int32_t>(), slot.dim(0), slot.dim(1), a.dim(1),
                    f(out), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

bool gemm_grouped(const Tensor& a, std::span<const std::int64_t> rows, const Tensor& b,
                  std::span<const std::int64_t> which, bool trans_b, const Tensor& c, float beta) {
  NvtxRange range("gemm_grouped");
  std::vector<blas::GroupedProblem> problems;
  const I K = a.dim(1), N = c.dim(1), matrix = b.dim(1) * b.dim(2);
  I first = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] > 0)  // cuBLAS takes no empty problem
      problems.push_back({cf(a) + first * K, cf(b) + which[i] * matrix, f(c) + first * N, rows[i]});
    first += rows[i];
  }
  return blas::gemm_grouped(trans_b, N, K, beta, problems);
}

void moe_router_dz(const Tensor& score, const Tensor& expert, const Tensor& weight,
                   const Tensor& dweight, const Tensor& dP, bool sigmoid, std::int64_t tokens_all,
                   const Tensor& dz) {
  NvtxRange range("moe_router_dz");
  kernels::moe_router_dz(cf(score), expert.data<std::int32_t>(), cf(weight), cf(dweight),
                         dP.defined() ? cf(dP) : nullptr, score.dim(0), score.dim(1), expert.dim(1),
                         sigmoid, tokens_all, f(dz), stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void pack_e2m1(const Tensor& codes, const Tensor& packed) {
  NvtxRange range("pack_e2m1");
  kernels::e2m1_pack(codes.data<std::uint8_t>(), packed.numel(), packed.data<std::uint8_t>(), true,
                     stream());
  TPX_CUDA_LAUNCH_CHECK();
}

void unpack_e2m1(const Tensor& packed, const Tensor& codes) {
  NvtxRange range("unpack_e2m1");
  kernels::e2m1_pack(codes.data<std::uint8_t>(), packed.numel(), packed.data<std::uint8_t>(), false,
                     stream());
  TPX_CUDA_LAUNCH_CHECK();
}

Tensor to_host_f32(const Tensor& t) {
  Tensor f32 = t;
  if (t.dtype() != DType::f32) {
    TPX_CHECK(t.device() == Device::cuda, "to_host_f32 of {}: only cuda tensors are converted",
              t.describe());
    f32 = scratch(t.shape(), DType::f32);
    cast(t, f32);
  }
  Tensor host = Tensor::empty(t.shape(), DType::f32, Device::cpu);
  copy(f32, host);
  return host;
}

}  // namespace tpx::cuda
