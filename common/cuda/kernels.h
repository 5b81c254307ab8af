// Launchers of the backend's own CUDA kernels, on raw device pointers. ops.cc checks shapes and
// dtypes, allocates scratch and calls these; the .cu files that define them include nothing but
// CUDA and this header (and fp8.cu the host/device casts of common/fp8_bits.h,
// column_blocks.cu the index map of common/column_blocks.h). Every launcher
// enqueues on `stream` (a cudaStream_t) and returns at once.
//
// bf16 values travel as std::uint16_t bit patterns (the storage of __nv_bfloat16), FP8 values
// as std::uint8_t codes.
//
// defines: tpx::cuda::kernels::* (elementwise.cu, rmsnorm.cu, attention.cu,
//          flash_attention.cu, rope.cu, fp8.cu, lowp.cu, fp8_pack.cu, column_blocks.cu, lm.cu)
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/fp8_bits.h"
#include "common/lowp_block.h"

namespace tpx::cuda::kernels {

using I = std::int64_t;

/// An operand of the element-wise kernels as it is stored: fp32, or bf16 bit patterns. A bf16
/// operand is widened in registers as it is read and a bf16 output rounded once, to nearest even,
/// as it is stored: the recipe's op boundary without copies (elementwise_ops.h).
struct Src {
  const void* p = nullptr;
  bool bf16 = false;
};
struct Dst {
  void* p = nullptr;
  bool bf16 = false;
};
inline Src src(const float* p) {
  return {p, false};
}
inline Dst dst(float* p) {
  return {p, false};
}

// column_blocks.cu -------------------------------------------------------------------------------
/// Ulysses' packing (common/column_blocks.h): split, blocks [n][m, c] ← x [m, n·c]; else join,
/// x ← blocks. Elements of elem_bytes (1, 2 or 4) bytes, moved as they are; src and dst apart.
void column_blocks(const void* src, void* dst, I m, I c, I n, int elem_bytes, bool split,
                   void* stream);

// elementwise.cu ---------------------------------------------------------------------------------
void fill(Dst p, float value, I n, void* stream);
void add(Src a, Src b, Dst out, I n, void* stream);  // out may alias a or b
/// SGD and AdamW (tpx::ops::sgd_update, adamw_update; elementwise_ops.h's Sgd, AdamW): the cpu's
/// fp32 operations in the cpu's order; `copy` (bf16, or null) receives the new w rounded.
void sgd(float* w, const float* grad, float lr, std::uint16_t* copy, I n, void* stream);
void adamw(float* w, const float* grad, float* m, float* v, float beta1, float beta2, float eps,
           float decay, float step_size, float sqrt_bias2, std::uint16_t* copy, I n, void* stream);
/// gate and up of one dtype.
void swiglu_forward(Src gate, Src up, Dst out, I n, void* stream);
/// dout, gate, up of one dtype; dgate, dup of one dtype.
void swiglu_backward(Src dout, Src gate, Src up, Dst dgate, Dst dup, I n, void* stream);
void mse_backward(Src y, Src t, double scale, Dst dy, I n, void* stream);
void f32_to_bf16(const float* in, std::uint16_t* out, I n, void* stream);
void bf16_to_f32(const std::uint16_t* in, float* out, I n, void* stream);

/// Number of double partials sum_squares needs as scratch.
int reduction_blocks(I n);
/// *result (device) = Σ (x − y)² (y.p may be null: Σ x²), accumulated in double. `partials` holds
/// reduction_blocks(n) doubles. The two-pass reduction is deterministic (no atomics).
void sum_squares(Src x, Src y, I n, double* partials, double* result, void* stream);

// rmsnorm.cu -------------------------------------------------------------------------------------
// x, y, dy, dx in their own dtypes (dy and x of one dtype); g, rstd, dg, partial fp32.
void rmsnorm_forward(Src x, const float* g, Dst y, float* rstd, I rows, I h, float eps,
                     void* stream);
void rmsnorm_backward_dx(Src dy, Src x, const float* g, const float* rstd, Dst dx, I rows, I h,
                         void* stream);
/// Row chunks rmsnorm_backward_dg splits the rows into; it needs chunks * h floats of scratch.
int rmsnorm_dg_chunks(I rows, I h);
void rmsnorm_backward_dg(Src dy, Src x, const float* rstd, float* partial, float* dg, I rows, I h,
                         void* stream);

// lm.cu ------------------------------------------------------------------------------------------
// The language model's two ends (tpx::ops::embedding_*, cross_entropy_*): token ids i32, n
// positions; a vocabulary shard of `cols` (or `rows`) ids starting at `begin`, ids >= `vocab` its
// padding. Logits and dlogits of one dtype; fp32 math.
/// out [n, h] (fp32 or bf16, rounded once) = table [rows, h] row ids[t] − begin, or 0 outside.
void embedding_forward(const std::int32_t* ids, const float* table, I rows, I h, I begin, Dst out,
                       I n, void* stream);
/// Bytes of device scratch embedding_backward needs (n < 2^31 positions, rows < 2^32 − 1).
std::size_t embedding_backward_scratch_bytes(I n, I rows);
/// dtable [rows, h] += dout [n, h] (fp32 or bf16) scattered by id, each row's positions summed in
/// position order (a stable sort of the positions by row; no float atomics): deterministic, the
/// cpu's sums. Returns a cudaError_t value (0: success) for a sort that fails to launch.
int embedding_backward(const std::int32_t* ids, Src dout, I n, I rows, I h, I begin, float* dtable,
                       void* scratch, void* stream);
/// Per row of logits [n, cols]: max, Σ exp(z − max) over the real columns in one pass (online
/// softmax), and the target's logit (0 when another shard holds it).
void cross_entropy_partial(Src logits, const std::int32_t* targets, I n, I cols, I begin, I vocab,
                           float* max, float* sumexp, float* target_logit, void* stream);
/// sumexp *= exp(local_max − max); 0 where local_max is −inf.
void cross_entropy_rescale(const float* local_max, const float* max, float* sumexp, I n,
                           void* stream);
/// Number of double partials cross_entropy_loss needs as scratch.
int cross_entropy_loss_blocks(I n);
/// lse = max + log(sumexp); *result (device) = Σ (lse − target_logit) in double, deterministic.
void cross_entropy_loss(const float* max, const float* sumexp, const float* target_logit,
                        float* lse, I n, double* partials, double* result, void* stream);
/// dlogits = scale · exp(z − lse) − scale at the target column, 0 in the padding columns.
void cross_entropy_backward(Src logits, const std::int32_t* targets, const float* lse, I n, I cols,
                            I begin, I vocab, float scale, Dst dlogits, void* stream);

// attention.cu -----------------------------------------------------------------------------------
/// In place on `rows` score rows of length s (rows = batches·s; row r is query position r % s):
/// p = softmax over j <= i, zero for j > i. Also writes a bf16 copy when p_bf16 is not null.
void causal_softmax_forward(float* p, std::uint16_t* p_bf16, I rows, I s, void* stream);
/// In place: dp becomes dS = P ⊙ (dP − Σ_j dP·P) on j <= i and zero above; bf16 copy optional.
void causal_softmax_backward(const float* p, float* dp, std::uint16_t* ds_bf16, I rows, I s,
                             void* stream);

// flash_attention.cu -----------------------------------------------------------------------------
// Fused causal attention on the [S, B, heads·D] layout, with grouped-query attention: query head
// bh (of heads_total = B·heads) of row i starts at i·ldq + bh·d in q, out, dout, dq; it reads KV
// head bh / group (group = heads / kv_heads, which divides heads), whose row i starts at
// i·ldkv + (bh / group)·d in k, v, dk, dv. Two entry points:
//  - fp32 tensors (flash_attention_forward, _backward): CUDA cores, fp32, or with bf16_compute
//    every operand rounded to bf16 as it is loaded;
//  - bf16 tensors (_bf16): q, k, v, dout read as stored; the tensor-core kernels (mma.sync, tiles
//    copied to shared memory by cp.async) where flash_tensor_cores() says they fit and the
//    pointers are 16-byte aligned, else the CUDA-core kernels with bf16 compute. Outputs (Dst)
//    bf16, rounded once as they are stored, or fp32 (the tensor-core kernels only: the fp32
//    tensors under bf16 compute, rounded into bf16 copies first, and chunk pairs); lse and Δ fp32.
// All return a cudaError_t value (0: success) for what fails before a launch
// (cudaErrorInvalidValue for a group that does not divide heads_total, a refused pair, or fp32
// outputs from bf16 inputs where the tensor cores do not run).
/// The largest head dim the fused kernels take.
inline constexpr I kFlashMaxHeadDim = 256;
/// Which keys each query sees, and whether backward overwrites its gradients or adds to them.
/// kCausal: the causal attention, key j visible to query i when j <= i. Context parallelism's
/// pair of sequence chunks: the keys' positions lie `shift` rows before the queries' (key j
/// visible when j <= i + shift; a query that sees no key gets output 0 and lse −inf), and
/// backward adds the pair's share into dq, dk, dv (`accumulate`), which must be fp32 (bf16
/// outputs are rounded once, never summed into: cudaErrorInvalidValue). Every kernel honours the
/// shift; bf16 inputs with fp32 outputs run on the tensor cores only (stage 08's bf16 pairs).
struct FlashPair {
  I shift = 0;
  bool accumulate = false;
};
inline constexpr FlashPair kCausal{};
/// Whether the tensor-core kernels run for head dim d and row strides ldq, ldkv (elements) on
/// the current device: d = 32, 64 or 128, strides multiples of 8, their shared memory allowed.
int flash_tensor_cores(I d, I ldq, I ldkv, bool& use);
/// out, lse [heads_total, S].
int flash_attention_forward(const float* q, const float* k, const float* v, float* out, float* lse,
                            I s, I heads_total, I group, I d, I ldq, I ldkv, bool bf16_compute,
                            FlashPair pair, void* stream);
/// dq, dk, dv (overwritten, or added to with pair.accumulate; dk, dv summed over each KV head's
/// group); delta is scratch of heads_total·S floats.
int flash_attention_backward(const float* dout, const float* q, const float* k, const float* v,
                             const float* out, const float* lse, float* delta, float* dq, float* dk,
                             float* dv, I s, I heads_total, I group, I d, I ldq, I ldkv,
                             bool bf16_compute, FlashPair pair, void* stream);
/// The same on bf16 q, k, v (bit patterns), bf16 compute; out bf16 or fp32.
int flash_attention_forward_bf16(const std::uint16_t* q, const std::uint16_t* k,
                                 const std::uint16_t* v, Dst out, float* lse, I s, I heads_total,
                                 I group, I d, I ldq, I ldkv, FlashPair pair, void* stream);
/// The bf16 backward's scratch: delta, Δ (heads_total·S floats); dq_acc, dQ's fp32 accumulator
/// on the tensor cores when dq is bf16 (S·ldq floats; fp32 dq accumulates in place, and then
/// dq_acc may be null); sync, flash_sync_words() words: the tensor-core backward's block ticket
/// and the counters that fix the order of dQ's adds (flash_tc_math.h, "dQ's turns").
struct FlashScratch {
  float* delta = nullptr;
  float* dq_acc = nullptr;
  unsigned* sync = nullptr;
};
/// The words of FlashScratch::sync for heads_total heads of S rows.
I flash_sync_words(I heads_total, I s);
/// The same on bf16 dout, q, k, v; out (read for Δ) bf16 or fp32; dq, dk, dv of one dtype.
int flash_attention_backward_bf16(const std::uint16_t* dout, const std::uint16_t* q,
                                  const std::uint16_t* k, const std::uint16_t* v, Src out,
                                  const float* lse, FlashScratch scratch, Dst dq, Dst dk, Dst dv,
                                  I s, I heads_total, I group, I d, I ldq, I ldkv, FlashPair pair,
                                  void* stream);
/// (out, lse) ← their log-sum-exp merge with (part_out, part_lse), two attentions of the same
/// queries over disjoint keys, in the layout above (out, part_out row stride ld; lse, part_lse
/// [heads_total, S]); rows with part_lse = −inf are left as they are.
void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, I s,
                     I heads_total, I d, I ld, void* stream);

// rope.cu ----------------------------------------------------------------------------------------
/// Rotary embedding in place on x, rows of 2·half floats, `rows_per_pos` rows (B·heads) per
/// sequence position, s positions: the pair (i, i + half) of a row at position p is rotated by
/// the angle whose cos and sin are cos[p·half + i], sin[p·half + i] (device arrays), or by its
/// opposite when `inverse`; the same fp32 products and sums as the cpu, without FMA contraction.
/// x fp32 or bf16 (read, rotated in fp32, rounded once when stored).
void rope(Dst x, const float* cos, const float* sin, I s, I rows_per_pos, I half, bool inverse,
          void* stream);

// fp8.cu -----------------------------------------------------------------------------------------
// Scales and amax are one float in device memory: nothing crosses to the host.
/// q[i] = fp8::quantize(x[i], *scale, format).
void quantize_fp8(const float* x, const float* scale, std::uint8_t* q, I n, fp8::Format format,
                  void* stream);
/// x[i] = fp8::dequantize(q[i], *scale, format).
void dequantize_fp8(const std::uint8_t* q, const float* scale, float* x, I n, fp8::Format format,
                    void* stream);
/// *out = max |x[i]| (0 for n = 0; fp32's canonical NaN if any x[i] is NaN).
void amax(const float* x, I n, float* out, void* stream);
/// *scale = fp8::scale_from_amax(*amax, fmax).
void fp8_scale(const float* amax, float fmax, float* scale, void* stream);

// lowp.cu ----------------------------------------------------------------------------------------
/// The row-major x [rows, cols] (K along cols; rows, cols > 0) quantized as layout `l` quantizes
/// it (common/lowp.h, the cpu's lowp::quantize bit for bit): codes [rows, cols] one a byte, the
/// scales [⌈rows/br⌉, ⌈cols/bc⌉] into `scales` (fp32 layouts) or `scale_codes` (E8M0, UE4M3),
/// and under UE4M3 s_enc from *tensor_amax (device) into *tensor_scale (either may be null
/// otherwise); `stochastic` (host, UE4M3 only, or null): the E2M1 casts round stochastically.
void lowp_quantize(const float* x, I rows, I cols, const lowp::Layout& l, const float* tensor_amax,
                   const lowp::StochasticRounding* stochastic, std::uint8_t* codes, float* scales,
                   std::uint8_t* scale_codes, float* tensor_scale, void* stream);
/// x [rows, cols] = the values lowp_quantize's codes and scales stand for (the cpu's
/// lowp::dequantize bit for bit); tensor_scale (device, UE4M3 only) is s_enc.
/// `transpose`: x is written as [cols, rows] instead.
void lowp_dequantize(const std::uint8_t* codes, I rows, I cols, const lowp::Layout& l,
                     const float* scales, const std::uint8_t* scale_codes,
                     const float* tensor_scale, float* x, bool transpose, void* stream);

/// y = lowp::hadamard_rows(x), x and y [rows, cols] (not overlapping), the cpu's bits.
void hadamard_rows(const float* x, I rows, I cols, float* y, void* stream);
/// pack: packed[i] = codes[2i] | codes[2i + 1] << 4 for i < bytes; else codes from packed.
void e2m1_pack(std::uint8_t* codes, I bytes, std::uint8_t* packed, bool pack, void* stream);

// moe.cu -----------------------------------------------------------------------------------------
// Stage 10's routing and row moves; shapes as tpx::ops's MoE ops (common/ops.h) say.
void moe_route(const float* logits, const float* bias, I n, I E, I k, bool sigmoid, float* score,
               std::int32_t* expert, float* weight, void* stream);
void gather_rows(const float* x, const std::int32_t* index, const float* scale, I R, I H,
                 float* out, void* stream);
void combine_rows(const float* rows, const std::int32_t* slot, const float* weight, I n, I k, I H,
                  float* out, bool accumulate, void* stream);
void rows_dot(const float* a, const float* rows, const std::int32_t* slot, I n, I k, I H,
              float* out, void* stream);
void moe_router_dz(const float* score, const std::int32_t* expert, const float* weight,
                   const float* dweight, const float* dP, I n, I E, I k, bool sigmoid, I tokens_all,
                   float* dz, void* stream);

// fp8_pack.cu ------------------------------------------------------------------------------------
// The operands of the FP8 GEMM (gemm_fp8.cc) in the layout cuBLASLt's FP8 kernels read.
/// out (row-major [out_rows, out_cols], row stride out_cols) = the rows x cols matrix M padded
/// with zero codes (+0 in both formats) to out_rows >= rows, out_cols >= cols, where
/// M[r][c] = src[r·ld + c], or src[c·ld + r] when `transposed` (src then holds Mᵀ, cols x rows).
void pack_fp8(const std::uint8_t* src, I ld, bool transposed, I rows, I cols, std::uint8_t* out,
              I out_rows, I out_cols, void* stream);
/// *inv_a = 1 / *scale_a, *inv_b = 1 / *scale_b (fp32 division, correctly rounded).
void fp8_scale_inverses(const float* scale_a, const float* scale_b, float* inv_a, float* inv_b,
                        void* stream);
/// The block-scaled GEMMs' factors (gemm_scaled.cc): out[r·row_stride + c·col_stride] =
/// 1 / scales[r·cols + c] (fp32 division, correctly rounded) for r < rows, c < cols: row-major
/// scales placed where cuBLASLt's scale tensor keeps them. The rest of out is not written (the
/// caller zeroes the padding first).
void scale_factors(const float* scales, I rows, I cols, I row_stride, I col_stride, float* out,
                   void* stream);

}  // namespace tpx::cuda::kernels
