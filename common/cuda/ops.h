// The CUDA backend of tpx::ops (common/ops.h dispatches here for cuda tensors). Signatures mirror
// tpx::cpu (common/cpu/ops.h); gemm and attention also take the compute dtype.
//
// Precision (see README.md): weights and their gradients are fp32; activations are fp32, or bf16
// under the mixed-precision recipe. With compute = bf16 the GEMMs, attention's included, read
// bf16 operands (bf16 copies of fp32 tensors) and accumulate in fp32; everything else (norms,
// softmax, SwiGLU, loss, SGD) is fp32 arithmetic. The element-wise ops (rmsnorm_*, rope_*,
// swiglu_*, add, accumulate, mse_loss_*, sum_squares, fill, embedding_*, cross_entropy_*) also
// take bf16 tensors as they are stored: a bf16 operand is widened in registers and a bf16 output
// rounded once, to nearest even, as it is stored (elementwise_ops.h), the rounding points of
// tpx::ops' op boundary. Reductions
// that return a scalar to the host (loss, sum of squares) accumulate in double.
//
// All work is issued on cuda::current_stream() (device.h) and is asynchronous unless the op
// returns a host value (mse_loss_sum, cross_entropy_loss, sum_squares, to_host_f32) or copies to
// host memory.
//
// defines: tpx::cuda::gemm, rmsnorm_*, attention_*, attention_fused_*, attention_block_*,
//          attention_merge, rope_*, swiglu_*,
//          add, accumulate, mse_loss_*, sgd_update, embedding_*, cross_entropy_*, sum_squares,
//          fill, cast, copy, to_host_f32,
//          synchronize, device_problem, fp32_boundary_forced, measure_bf16_gemm_peak_tflops,
//          quantize_fp8, dequantize_fp8, amax, fp8_scale, gemm_fp8
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/lowp_block.h"
#include "common/ops.h"
#include "common/tensor.h"
#include "device.h"

namespace tpx::cuda {

void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha, float beta, DType compute = DType::f32);
/// C = alpha·op(A / scale_a)·op(B / scale_b) + beta·C on FP8 tensor cores through cuBLASLt
/// (gemm_fp8.cc), for A and B e4m3 or e5m2 carrying their scales (Tensor::with_scale) and C f32,
/// all on cuda: the codes are multiplied exactly, summed with fp32 accumulation, and scaled once
/// per output by 1/scale_a · 1/scale_b, which rounds slightly differently from dividing each
/// element first. Any shape, transposes and alignment (operands are repacked where cuBLASLt
/// needs it); E5M2 × E5M2, which cuBLASLt lacks, multiplies the dequantized operands in fp32.
/// Throws tpx::Error unless fp8_gemm_supported() (compute capability 8.9 or newer).
void gemm_fp8(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
              float alpha, float beta);
void rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& y, const Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dg);
/// Naive attention by cuBLASLt GEMMs and softmax kernels: q, k, v, out (dout, dq, dk, dv) of
/// one dtype, f32 or bf16 (bf16 compute; outputs rounded once), probs f32.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                       const Tensor& out, const Tensor& probs, DType compute = DType::f32);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, std::int64_t heads, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, DType compute = DType::f32);
/// Fused (FlashAttention-2) attention, kernels in flash_attention.cu, on the tensors in place:
/// fp32, or bf16 (bf16 compute; outputs rounded once as the kernels store them). fp32 tensors
/// under bf16 compute: the tensor cores read bf16 copies of q, k, v, dO (rounded once into
/// scratch), the CUDA-core kernels round them as they load them.
void attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse, DType compute = DType::f32);
void attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              DType compute = DType::f32);
/// Context parallelism's chunk pairs and their log-sum-exp merge (tpx::ops): the fused kernels
/// with the pair's shift, backward adding into dq, dk, dv; fp32.
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse, std::int64_t shift);
void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              std::int64_t shift);
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                     const Tensor& part_lse, std::int64_t heads);
// Rotary embedding, in place (cos/sin tables in double, rounded to fp32).
void rope_forward(const Tensor& x, std::int64_t heads, double theta, std::int64_t first);
void rope_backward(const Tensor& dx, std::int64_t heads, double theta, std::int64_t first);
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out);
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup);
void add(const Tensor& a, const Tensor& b, const Tensor& out);
void accumulate(const Tensor& x, const Tensor& into);
double mse_loss_sum(const Tensor& y, const Tensor& t);
void mse_loss_backward(const Tensor& y, const Tensor& t, double scale, const Tensor& dy);
void sgd_update(const Tensor& w, const Tensor& grad, float lr, const Tensor& copy);
// The language model's ends (kernels in lm.cu): the vocabulary-parallel embedding and
// cross-entropy (tpx::ops checks the shapes). Logits and dlogits (one dtype), the embedding's out
// and dout are f32 or bf16 as stored, widened as read and rounded once as written; the table, its
// gradient and the per-position vectors f32; fp32 math, the loss's sum in double.
// embedding_backward sums each row's positions in position order (a stable sort by row, no float
// atomics): the cpu backend's result, bit for bit.
void embedding_forward(const Tensor& ids, const Tensor& table, std::int64_t begin,
                       const Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, std::int64_t begin,
                        const Tensor& dtable);
void cross_entropy_partial(const Tensor& logits, const Tensor& targets, std::int64_t begin,
                           std::int64_t vocab, const Tensor& max, const Tensor& sumexp,
                           const Tensor& target_logit);
void cross_entropy_rescale(const Tensor& local_max, const Tensor& max, const Tensor& sumexp);
double cross_entropy_loss(const Tensor& max, const Tensor& sumexp, const Tensor& target_logit,
                          const Tensor& lse);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            std::int64_t begin, std::int64_t vocab, double scale,
                            const Tensor& dlogits);
void adamw_update(const Tensor& w, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const ops::AdamWStep& s, const Tensor& copy);
double sum_squares(const Tensor& x);
std::vector<double> sum_squares_each(const std::vector<Tensor>& xs);
void fill(const Tensor& t, float value);

/// True when the environment sets TPX_CUDA_FP32_BOUNDARY=1 (read once): tpx::ops then gives the
/// cuda ops fp32 copies of bf16 tensors and rounds their outputs in a separate pass, as the cpu
/// backend does, instead of letting the kernels read and write bf16 (README.md, "The op
/// boundary"). The values are the same either way; the switch is there to compare and time them.
bool fp32_boundary_forced();

/// dst = src converted between f32 and bf16 (round to nearest even); equal dtypes copy.
void cast(const Tensor& src, const Tensor& dst);
/// Copies bytes between host and device or device and device (same dtype, same element count).
void copy(const Tensor& src, const Tensor& dst);
/// Ulysses' packing on the device (common/column_blocks.h): split, blocks [n][m, c] ← x
/// [m, n·c]; else join, x ← blocks. Arguments checked by tpx::ops.
void column_blocks(const Tensor& x, const Tensor& blocks, std::int64_t m, std::int64_t c,
                   std::int64_t n, bool split);
/// A host f32 tensor with the values of t (any dtype, any device).
Tensor to_host_f32(const Tensor& t);

/// FP8 casts (kernels in fp8.cu), bit-identical to the cpu backend's; arguments checked by
/// tpx::ops. The scale and amax stay on the device.
void quantize_fp8(const Tensor& x, const Tensor& scale, const Tensor& q);
void dequantize_fp8(const Tensor& q, const Tensor& scale, const Tensor& x);
void amax(const Tensor& x, const Tensor& out);
void fp8_scale(const Tensor& amax, DType fmt, const Tensor& scale);

/// A low-precision recipe's quantizer on the device (kernels in lowp.cu), bit-identical to the
/// cpu's lowp::quantize: x f32 [rows, cols] on cuda (K along cols) as layout `l` quantizes it;
/// codes u8 [rows, cols]; scales f32 (fp32 layouts) or u8 (E8M0, UE4M3) [scale rows, scale
/// cols]; under UE4M3 tensor_scale f32 [1] receives s_enc, made from tensor_amax f32 [1] when it
/// is defined (an amax the shards agreed) and from x's own amax otherwise. Everything stays on
/// the device. `stochastic` (UE4M3 only): the E2M1 casts round stochastically (lowp::sr_bits).
void lowp_quantize(const Tensor& x, const lowp::Layout& l, const Tensor& tensor_amax,
                   const Tensor& codes, const Tensor& scales, const Tensor& tensor_scale,
                   const lowp::StochasticRounding* stochastic = nullptr);
/// Its inverse, lowp::dequantize's bytes: x f32 [rows, cols] from codes, scales and (UE4M3)
/// tensor_scale as lowp_quantize wrote them.
void lowp_dequantize(const Tensor& codes, const lowp::Layout& l, const Tensor& scales,
                     const Tensor& tensor_scale, const Tensor& x, bool transpose = false);

/// lowp::hadamard_rows of x [rows, cols] into y, the cpu's bits (kernel in lowp.cu).
void hadamard_rows(const Tensor& x, std::int64_t rows, std::int64_t cols, const Tensor& y);
/// E2M1 codes packed two to a byte and back (kernel in lowp.cu); arguments checked by tpx::ops.
void pack_e2m1(const Tensor& codes, const Tensor& packed);
void unpack_e2m1(const Tensor& packed, const Tensor& codes);

// Mixture of experts (kernels in moe.cu); arguments checked by tpx::ops.
void moe_route(const Tensor& logits, const Tensor& bias, bool sigmoid, const Tensor& score,
               const Tensor& expert, const Tensor& weight);
void gather_rows(const Tensor& x, const Tensor& index, const Tensor& scale, const Tensor& out);
void combine_rows(const Tensor& rows, const Tensor& slot, const Tensor& weight, const Tensor& out,
                  bool accumulate);
void rows_dot(const Tensor& a, const Tensor& rows, const Tensor& slot, const Tensor& out);
void moe_router_dz(const Tensor& score, const Tensor& expert, const Tensor& weight,
                   const Tensor& dweight, const Tensor& dP, bool sigmoid, std::int64_t tokens_all,
                   const Tensor& dz);
/// ops::gemm_grouped in one cublasGemmGroupedBatchedEx (gemm.cc); false where this cuBLAS has none.
bool gemm_grouped(const Tensor& a, std::span<const std::int64_t> rows, const Tensor& b,
                  std::span<const std::int64_t> which, bool trans_b, const Tensor& c, float beta);

/// Times a large cuBLASLt bf16 GEMM (8192³, fp32 accumulation, bf16 result) and returns its
/// throughput in TFLOP/s:
/// the device's practical dense bf16 peak, the denominator of MFU.
double measure_bf16_gemm_peak_tflops();

// --- Native block-scaled FP8 GEMMs (gemm_scaled.cc) ---------------------------------------------

/// ops::gemm_scaled on the FP8 tensor cores through cuBLASLt's scale modes, when the plan
/// (common/scaled_gemm_plan.h), the probe of the modes' scale layout and cuBLASLt accept the
/// problem; returns false, having issued nothing, otherwise (said once per recipe and shape on
/// stderr), and the caller multiplies the dequantized operands.
bool gemm_scaled(const ops::ScaledOperand& a, const ops::ScaledOperand& b, const Tensor& c);
/// ops::scaled_gemm_problem for this process's GPU.
std::string scaled_gemm_problem(lowp::Recipe recipe);

}  // namespace tpx::cuda
