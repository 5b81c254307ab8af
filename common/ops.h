// The ops every stage is written in. Each dispatches on its tensors' device to the CPU backend
// (common/cpu/) or, when built, the CUDA backend (common/cuda/); stage code never knows which.
//
// Conventions: activations are [S, B, X] and are seen as matrices [S*B, X]; weights are [in, out].
// Output tensors are passed as (const) handles and overwritten unless the name says "accumulate".
//
// Precision (DESIGN.md, "Mixed precision"): an activation may be stored in fp32 or bf16; norm
// gains, statistics (rstd, lse, probs), weight gradients and optimizer state are fp32. Every op
// computes in fp32 inside: it reads bf16 tensors exactly as fp32 and rounds each bf16 output
// once, to nearest even, when it writes it (the same points on both backends). A GEMM with a bf16
// operand has bf16 operands and fp32 accumulation; `compute` = bf16 on gemm and attention rounds
// f32 operands to bf16 too (cuda: tensor cores; cpu: the rounded values multiplied in fp32).
//
// defines: tpx::ops::gemm, attention_dims, attention_merge_dims, rmsnorm_*, attention_*,
//          attention_fused_*, attention_block_*, attention_merge, swiglu_*, add, rope_forward,
//          rope_backward, accumulate, mse_loss_*, embedding_*, cross_entropy_*, sgd_update, AdamWStep, adamw_update, sum_squares,
//          sum_squares_each,
//          fill, cast, copy, to_device, synchronize, bf16_gemm_peak_tflops, time_ms, memory_available,
//          device_ordinal, quantize_fp8, dequantize_fp8, amax, fp8_scale, lowp_quantize,
//          lowp_dequantize, transpose, hadamard_rows, pack_e2m1, unpack_e2m1, ScaledOperand,
//          gemm_scaled, prepare_scaled, scaled_gemm_problem
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tensor.h"

namespace tpx::lowp {
enum class Recipe;          // common/lowp.h
enum class Operand;         // common/lowp.h
struct StochasticRounding;  // common/lowp_block.h
}  // namespace tpx::lowp

namespace tpx::ops {

/// Empty when `device` can run here; otherwise one sentence saying why not (no CUDA backend in
/// this build, no GPU visible, ...).
std::string device_problem(Device device);
/// Empty when `device` can run stage 06's FP8 GEMMs; otherwise one sentence saying why not (the
/// device's own problem, or a GPU older than compute capability 8.9, which has no FP8 tensor
/// cores). The cpu always can: its casts are software and its GEMMs multiply dequantized values.
std::string fp8_problem(Device device);
/// Words for headers and tables: the host CPU's model (with its family, model and stepping, as a
/// virtual machine may name only the vendor) and core count, or the GPU's name, compute
/// capability and SM count.
std::string device_name(Device device);
/// "<backend>: <device_name>", e.g. "cpu: AMD EPYC 7B13 (cpu family 25, model 1, stepping 0),
/// 2 cores": the device string of --json's summary, tpx_report's tables and the benchmark page.
std::string device_description(Device device);
/// Bytes this process could still allocate on `device`, for refusing a run that cannot fit
/// before it allocates. cpu: MemAvailable of /proc/meminfo (the kernel's estimate of what can be
/// allocated without swapping, shared by every process on the host); when /proc/meminfo cannot
/// be read or has no MemAvailable, the maximum of std::uint64_t: unknown, so nothing is refused.
/// cuda: the free bytes of this process's GPU (cudaMemGetInfo), shared with every process using
/// it. Throws tpx::Error for cuda in a build without the CUDA backend or with no usable GPU.
std::uint64_t memory_available(Device device);
/// The ordinal of the device this process uses (which GPU; 0 for the cpu): ranks with equal
/// ordinals on one host share that device's memory. Throws like memory_available for cuda.
int device_ordinal(Device device);

/// The sizes of C = op(A)·op(B): op(A) is [m, k], op(B) [k, n], C [m, n]. Checks that the
/// shapes agree (tpx::Error otherwise); both backends' gemm start from it.
struct GemmDims {
  std::int64_t m, n, k;
};
GemmDims gemm_dims(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c);

/// The sizes of an attention call: q (and out) [S, B, heads·D], k and v [S, B, kv_heads·D] with
/// kv_heads dividing heads (grouped-query attention; kv_heads = heads is multi-head attention).
/// Checks that they agree (tpx::Error naming `what` otherwise); every backend's attention starts
/// from it.
struct AttentionDims {
  std::int64_t s, b, heads, kv_heads, d;
  std::int64_t ldq, ldkv;  ///< row strides of one position: B·heads·D (q, out), B·kv_heads·D (k, v)
  std::int64_t group() const { return heads / kv_heads; }  ///< query heads per KV head
};
AttentionDims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const char* what);
/// The sizes of an attention_merge call (kv_heads = heads): out and part_out [S, B, heads·D],
/// lse and part_lse [B, heads, S]. Checks that they agree (tpx::Error otherwise).
AttentionDims attention_merge_dims(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                                   const Tensor& part_lse, std::int64_t heads);

/// C = alpha * op(A) · op(B) + beta * C, with op(X) = X or Xᵀ and A, B, C seen as matrices.
/// compute = bf16, or a bf16 A or B, multiplies bf16 operands with fp32 accumulation; C may be
/// bf16 (the result rounded once, beta applied in fp32 first) or f32 (weight gradients).
/// FP8: A and B may both be E4M3/E5M2 tensors carrying their scales (Tensor::with_scale); the
/// product is then that of the dequantized operands, q / scale, in fp32 (C is f32, or bf16
/// rounded once; `compute` is not used). On a GPU with FP8 tensor cores (compute capability 8.9+)
/// it runs there through cuBLASLt (cuda::gemm_fp8): codes multiplied exactly, fp32 accumulation,
/// 1/scale_a · 1/scale_b applied to each output, which rounds slightly differently from dividing
/// each element first. Elsewhere (cpu, older GPUs) each operand is dequantized into an fp32 scratch
/// tensor and multiplied by the fp32 GEMM.
void gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c,
          float alpha = 1.0f, float beta = 0.0f, DType compute = DType::f32);

/// y = x / sqrt(mean(x², over the last dim) + eps) * g; rstd [rows] keeps 1/sqrt(...) for backward.
void rmsnorm_forward(const Tensor& x, const Tensor& g, const Tensor& y, const Tensor& rstd);
/// dx and dg (overwritten) from dy, the saved input x and rstd.
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& g, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dg);

/// Causal multi-head attention on q [S, B, heads*D] and k, v [S, B, kv_heads*D]: out =
/// softmax(q kᵀ / sqrt(D)) v per (batch, query head), position i attending j <= i. Grouped-query
/// attention: kv_heads = k.dim(2) / D divides `heads`, and query head h reads KV head
/// h / (heads / kv_heads) (kv_heads = heads is multi-head attention). out is q's shape; dk, dv
/// are k's shape, each KV head's gradient summed over its group of query heads. probs
/// [B, heads, S, S] keeps the softmax (zeros above the diagonal) for backward. `compute` is the
/// operand type of its GEMMs (see gemm).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                       const Tensor& out, const Tensor& probs, DType compute = DType::f32);
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, std::int64_t heads, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, DType compute = DType::f32);

/// The same causal attention computed blockwise with an online softmax (FlashAttention-2: Dao
/// 2023, arXiv:2307.08691): the [S, S] scores never exist in memory. Forward writes out and
/// lse [B, heads, S] (fp32), the log-sum-exp of each query row's scaled scores, which is all
/// backward keeps: it recomputes each block's probabilities as exp(q kᵀ/sqrt(D) − lse).
/// `compute` as for attention_forward (bf16: tensor-core products with fp32 accumulation, cuda
/// only). Any head dim on the cpu; on cuda D <= 256 (tensor cores for D = 32, 64, 128).
void attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse, DType compute = DType::f32);
/// dq, dk, dv (overwritten) from dout, the forward's inputs, its output `out` and lse.
void attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              DType compute = DType::f32);

/// Rotary position embedding (Su et al. 2021, arXiv:2104.09864), the rotate-half form, in
/// place on x [S, B, heads*D] (D even): in each head, the pair (x_i, x_{i+D/2}), i < D/2, of the
/// row at sequence position p (x's dim-0 index) is rotated by the angle p·θ^(−2i/D):
///   x_i ← x_i·cos − x_{i+D/2}·sin,   x_{i+D/2} ← x_{i+D/2}·cos + x_i·sin.
/// cos and sin are computed in double and rounded to fp32 once, identically on both backends.
/// theta must be > 0 (the block skips the call for --rope-theta 0).
/// `first` is the global position of x's row 0 (context parallelism hands each rank chunks from
/// the middle of the sequence): row p is rotated for position first + p.
void rope_forward(const Tensor& x, std::int64_t heads, double theta, std::int64_t first = 0);
/// The backward of rope_forward, in place on the gradient dx: the transposed (inverse) rotation,
/// angle −p·θ^(−2i/D). A rotation is orthogonal, so this is also rope_forward's inverse.
void rope_backward(const Tensor& dx, std::int64_t heads, double theta, std::int64_t first = 0);

/// A q, k, v, dO or O operand of attention_block_* as the op reads it on t's device: on the cpu
/// a bf16 tensor's fp32 copy (exact: every bf16 value is an fp32 value), on cuda t itself (the
/// kernels read bf16 as stored). A caller makes it once for all the chunk pairs that read the
/// tensor (stage 08: q, dO and O once per attention, each K/V block once), not once per pair.
Tensor attention_block_operand(const Tensor& t);
/// Context parallelism (stage 08): one pair of sequence chunks of a causal attention. q [Sc, B,
/// heads·D] against k, v [Sc, B, kv_heads·D] whose positions lie `shift` rows before q's: key j
/// is visible to query i when j <= i + shift (0: the diagonal pair, masked as
/// attention_fused_forward; >= Sc: a K/V chunk wholly in the past, unmasked). Writes the pair's
/// own softmax-normalised out and its lse [B, heads, Sc]; a query that sees no key gets out 0
/// and lse −inf. The fused kernel's own loops with its online softmax, on both backends (the
/// fused causal attention is their shift-0 case). out, lse f32; q, k, v f32, or bf16 (stage 08's
/// --dtype bf16: cuda reads them as stored, under bf16 compute, on the tensor cores where they
/// take the shapes); on the cpu bf16 operands are refused: pass attention_block_operand()'s.
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t heads,
                             const Tensor& out, const Tensor& lse, std::int64_t shift);
/// The pair's backward from the merged forward's out and lse (the full softmax over every key
/// chunk): *adds* this pair's terms into dq, dk, dv (f32; dout, q, k, v, out as the forward's).
void attention_block_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, std::int64_t heads,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              std::int64_t shift);
/// (out, lse) ← the log-sum-exp merge of (out, lse) with (part_out, part_lse), two attentions
/// of the same queries over disjoint keys: m = max(lse, lse'), w = e^(lse−m), w' = e^(lse'−m),
/// out = (w·out + w'·part_out) / (w + w'), lse = m + log(w + w'). Rows with part_lse = −inf are
/// left as they are. f32 only; an element-wise kernel on cuda.
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out,
                     const Tensor& part_lse, std::int64_t heads);

/// out = silu(gate) ⊙ up, silu(z) = z·σ(z).
void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& out);
void swiglu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, const Tensor& dgate,
                     const Tensor& dup);

/// out = a + b (out may alias a or b).
void add(const Tensor& a, const Tensor& b, const Tensor& out);
/// into += x.
void accumulate(const Tensor& x, const Tensor& into);

/// Σ (y − t)² in double, t the target (y* in the chapters); the loss 0.5·mean((y − y*)²) is built
/// from it by the caller, which knows the global element count.
double mse_loss_sum(const Tensor& y, const Tensor& t);
/// dy = scale · (y − t); with scale = 1 / (S·B·H) this is the gradient of 0.5·mean((y − y*)²).
void mse_loss_backward(const Tensor& y, const Tensor& t, double scale, const Tensor& dy);

// The language model's two ends (DESIGN.md, "The language model around the block"). Token ids
// are i32 [S, B]; a vocabulary-parallel rank holds the rows [begin, begin + Vl) of the embedding
// and the same columns of the output layer, and its logits are [S, B, Vl].

/// out[s, b, :] = table[ids[s, b] − begin, :] for an id in [begin, begin + table.dim(0)), and 0
/// for every other id: the lookup of this rank's rows of the embedding (the whole table, begin 0,
/// is the plain lookup). table f32 [Vl, H]; out [S, B, H] f32 or bf16 (rounded once).
void embedding_forward(const Tensor& ids, const Tensor& table, std::int64_t begin,
                       const Tensor& out);
/// dtable[id − begin, :] += dout[s, b, :] for every position whose id is in this rank's range
/// (dtable f32 [Vl, H], *accumulated*: zero it first; dout f32 or bf16). Each row's sum runs in
/// position order (s, then b) on both backends, so the result is deterministic.
void embedding_backward(const Tensor& ids, const Tensor& dout, std::int64_t begin,
                        const Tensor& dtable);
/// One pass over this rank's logits z [S, B, Vl] (f32 or bf16, math in fp32), column j standing
/// for the vocabulary id begin + j; ids ≥ `vocab` are the padding of a vocabulary cut into equal
/// parts and are skipped. For each of the N = S·B positions n with target t = targets[n]:
///   max[n] = max_j z[n, j],  sumexp[n] = Σ_j exp(z[n, j] − max[n]),
///   target_logit[n] = z[n, t − begin] when begin ≤ t < begin + Vl, else 0.
/// max, sumexp, target_logit f32 [N] (overwritten). A rank with no real column writes max = −inf,
/// sumexp = 0.
void cross_entropy_partial(const Tensor& logits, const Tensor& targets, std::int64_t begin,
                           std::int64_t vocab, const Tensor& max, const Tensor& sumexp,
                           const Tensor& target_logit);
/// sumexp[n] *= exp(local_max[n] − max[n]): a rank's partial sum of exponentials moved from its
/// own maximum onto the global one (after the MAX all-reduce), ready for the SUM all-reduce.
/// A row with local_max = −inf (no real column) gets 0.
void cross_entropy_rescale(const Tensor& local_max, const Tensor& max, const Tensor& sumexp);
/// lse[n] = max[n] + log(sumexp[n]) (f32 [N], overwritten); returns Σ_n (lse[n] − target[n])
/// in double: the sum of the positions' losses.
double cross_entropy_loss(const Tensor& max, const Tensor& sumexp, const Tensor& target_logit,
                          const Tensor& lse);
/// dz[n, j] = scale · (exp(z[n, j] − lse[n]) − [begin + j == t_n]), and 0 in the padding columns
/// (ids ≥ vocab): softmax minus one-hot on the local shard, never the whole row. dlogits has the
/// logits' shape and dtype (rounded once).
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            std::int64_t begin, std::int64_t vocab, double scale,
                            const Tensor& dlogits);

/// w −= lr · grad. With `copy` (bf16, w's numel, w's device) the same pass also writes the
/// updated w rounded to bf16 into it: the compute copy the next step reads, without a pass of
/// its own over the fp32 masters (the trainer's --dtype bf16 recipe).
void sgd_update(const Tensor& w, const Tensor& grad, float lr, const Tensor& copy = Tensor());

/// One AdamW step's scalars, computed by the caller in double and rounded to fp32 once, so that
/// both backends run the same fp32 arithmetic per element.
struct AdamWStep {
  float beta1, beta2, eps;
  float decay;       ///< 1 − lr·weight_decay (1 for the norm gains: no decay)
  float step_size;   ///< lr / (1 − β1ᵗ)
  float sqrt_bias2;  ///< sqrt(1 − β2ᵗ)
};
/// torch.optim.AdamW's step t on w with gradient g and moments m, v (updated in place):
///   m = β1·m + (1−β1)·g,  v = β2·v + (1−β2)·g²,  w = w·decay,
///   w −= step_size · m / (sqrt(v) / sqrt_bias2 + eps)
/// i.e. w −= lr·wd·w, then w −= lr · m̂ / (sqrt(v̂) + eps) with m̂ = m/(1−β1ᵗ), v̂ = v/(1−β2ᵗ).
/// `copy` as sgd_update's.
void adamw_update(const Tensor& w, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWStep& s, const Tensor& copy = Tensor());
/// Σ x², in double.
double sum_squares(const Tensor& x);
/// Σ x² of each f32 tensor (of one device), in double, in their order: the same values as
/// sum_squares() one by one, read back from the device together, after one wait instead of one
/// per tensor (the gradient norm's).
std::vector<double> sum_squares_each(const std::vector<Tensor>& xs);

void fill(const Tensor& t, float value);
/// A new f32 tensor of t's shape on t's device, every value 0 (a gradient's or a moment's start).
Tensor zeros_like(const Tensor& t);
/// dst = src converted between f32 and bf16 (round to nearest even, NaN stays NaN; bf16 to f32 is
/// exact); same device, same numel.
void cast(const Tensor& src, const Tensor& dst);
/// Copies between any devices; shapes must have the same element count and dtypes must match.
void copy(const Tensor& src, const Tensor& dst);
/// Ulysses' packing (stage 08; the layout in common/column_blocks.h): x seen as [m, n·c] (its
/// last dimension n·c) and `blocks` as n blocks [m, c], block r holding columns r·c … (r + 1)·c − 1
/// of every row. split_columns: blocks ← x; join_columns: x ← blocks. Same dtype (any), same
/// element count, same device, not overlapping; on cuda a kernel, on the cpu row copies.
void split_columns(const Tensor& x, std::int64_t n, const Tensor& blocks);
void join_columns(const Tensor& blocks, std::int64_t n, const Tensor& x);
/// A new tensor on `device` holding the same values: a bf16 cuda tensor arrives on the host as
/// f32 (the cpu computes in f32); every other dtype, FP8 codes included, is copied as it is.
Tensor to_device(const Tensor& t, Device device);

// FP8 (stage 06; formats and recipe in common/fp8.h). The scale is an f32 tensor of one element
// on the device of the data, so a cuda cast never waits for the host. The casts are bit-identical
// on both backends.

/// q = encode(x · scale): x f32 of any shape, q e4m3 or e5m2 with as many elements, scale f32 [1];
/// the product in fp32, then round to nearest even, saturating to ±fmax (±inf too), NaN stays NaN
/// (0x7F/0xFF in e4m3, 0x7E/0xFE in e5m2, with x's sign), −0 stays −0.
void quantize_fp8(const Tensor& x, const Tensor& scale, const Tensor& q);
/// x = decode(q) / scale: one fp32 division per element (decode is exact; a multiplication by
/// 1 / scale would round twice). NaN codes give NaN, e5m2's inf codes ±inf.
void dequantize_fp8(const Tensor& q, const Tensor& scale, const Tensor& x);
/// out (f32 [1]) = max |x| over all elements of x (f32); 0 for an empty x. A NaN anywhere makes
/// it NaN (fp32's canonical quiet NaN, 0x7FC00000).
void amax(const Tensor& x, const Tensor& out);
/// scale (f32 [1]) = fmax / amax in fp32, fmax = 448 (e4m3) or 57344 (e5m2), from amax (f32 [1]).
/// amax = 0, +inf or NaN gives 1 (the NaN or inf elements then quantize to NaN or ±fmax); an
/// amax so small that the quotient overflows gives FLT_MAX rather than inf.
void fp8_scale(const Tensor& amax, DType fmt, const Tensor& scale);

// Low-precision recipes (common/lowp.h): one GEMM operand quantized block by block and read back,
// and the tensor moves the recipes need around it (stage 06 under --fp8-recipe). Bit-identical on
// both backends: the cpu calls common/lowp.cc, cuda common/cuda/lowp.cu, and both call the same
// host-device block functions (common/lowp_block.h).

/// x f32 [rows, cols] (cols its last dimension, rows the product of the others; K along cols)
/// quantized as `recipe` quantizes an `operand`: codes [rows, cols] one a byte (u8, or e4m3 /
/// e5m2 to name the format; E2M1 in bits 0..3), scales [⌈rows/br⌉, ⌈cols/bc⌉] f32 (tensorwise,
/// rowwise, block128) or u8 (mxfp8's E8M0, nvfp4's UE4M3 codes), and under nvfp4 its s_enc into
/// tensor_scale (f32 [1]), from `tensor_amax` when given (the amax its shards agreed) and from x's
/// own amax otherwise (tensor_scale is ignored by the other recipes and may be undefined).
/// `stochastic` (nvfp4 only): the E2M1 casts round stochastically, each element with the random
/// bits of its place in the logical tensor (lowp::StochasticRounding).
void lowp_quantize(const Tensor& x, lowp::Recipe recipe, lowp::Operand operand,
                   std::optional<float> tensor_amax, const Tensor& codes, const Tensor& scales,
                   const Tensor& tensor_scale,
                   const lowp::StochasticRounding* stochastic = nullptr);
/// The values lowp_quantize's codes, scales and tensor_scale stand for: x f32 [rows, cols], or
/// with `transpose` their transpose [cols, rows] (written in place of a copy).
void lowp_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& tensor_scale,
                     lowp::Recipe recipe, lowp::Operand operand, const Tensor& x,
                     bool transpose = false);
/// out [cols, rows] = xᵀ, x seen as [rows, cols] (cols its last dimension): any dtype, same
/// device, not overlapping.
void transpose(const Tensor& x, const Tensor& out);
/// y = x with every group of 16 consecutive rows replaced by R times it (lowp::hadamard_rows, fp32,
/// the same sums in the same order): x and y f32 of one shape, seen as [rows, cols].
void hadamard_rows(const Tensor& x, const Tensor& y);
/// E2M1 codes [..., K] one to a byte packed two to a byte along K, [..., K / 2] (element 2i in
/// bits 0..3, 2i + 1 in bits 4..7, as the FP4 GEMMs read them), and back. u8, K even.
void pack_e2m1(const Tensor& codes, const Tensor& packed);
void unpack_e2m1(const Tensor& packed, const Tensor& codes);

// Mixture of experts (stage 10): the routing and the moves of token rows between a token's
// place and its experts' (common/moe_ep.h). Index tensors are i32; a slot < 0 names no row.

/// Routes n tokens from their router logits [n, E] (moe_token::route, the same bits on every
/// backend): score [n, E], expert [n, k] i32, weight [n, k]; bias [E] added for the choice only,
/// or undefined. f32 on one device.
void moe_route(const Tensor& logits, const Tensor& bias, bool sigmoid, const Tensor& score,
               const Tensor& expert, const Tensor& weight);
/// out [R, H] row i = scale[i] · x[index[i]] (scale [R], or undefined: 1): the permutation of
/// token rows into the order they are sent in. x [T, H] f32, index [R] i32 in 0 … T − 1.
void gather_rows(const Tensor& x, const Tensor& index, const Tensor& scale, const Tensor& out);
/// out [n, H] row t (=, or += with `accumulate`) Σ_j weight[t, j] · rows[slot[t, j]] over the j
/// with slot[t, j] ≥ 0, in j order (weight undefined: 1): the combine's weighted sum, one token
/// at a time, so the sum's order never depends on the backend. rows [R, H], slot [n, k] i32.
void combine_rows(const Tensor& rows, const Tensor& slot, const Tensor& weight, const Tensor& out,
                  bool accumulate);
/// out [n, k] = a[t] · rows[slot[t, j]] (0 where slot < 0): the gate weights' gradients dy·out_j.
void rows_dot(const Tensor& a, const Tensor& rows, const Tensor& slot, const Tensor& out);
/// Grouped GEMM over consecutive groups of rows (the experts' GEMMs): for group i, rows
/// [r_i, r_i + rows[i]) of c = those rows of a · op(b[which[i]]) + beta · c's. a [R, K] and c
/// [R, N] f32, b a stack [G, K, N] (or [G, N, K] read transposed with trans_b) of f32 matrices,
/// Σ rows = R. cpu: one gemm per group; cuda: one cublasGemmGroupedBatchedEx (cuBLAS 12.5 on; one
/// gemm per group before).
void gemm_grouped(const Tensor& a, std::span<const std::int64_t> rows, const Tensor& b,
                  std::span<const std::int64_t> which, bool trans_b, const Tensor& c, float beta);
/// dz [n, E] = ∂loss/∂logits of n tokens (moe_token::router_dz): score [n, E], expert, weight and
/// dweight [n, k], dP [E] the auxiliary loss's ∂/∂P (moe_aux_grad) or undefined, tokens_all the
/// tokens it averages over.
void moe_router_dz(const Tensor& score, const Tensor& expert, const Tensor& weight,
                   const Tensor& dweight, const Tensor& dP, bool sigmoid, std::int64_t tokens_all,
                   const Tensor& dz);

// --- Native block-scaled FP8 GEMMs (stage 06's --fp8-recipe rowwise and block128) ---------------

/// One operand of gemm_scaled: a recipe's codes K-major, [rows, K] (e4m3 / e5m2, or u8: E2M1
/// codes one a byte), with the scales ops::lowp_quantize wrote for them as it quantizes `operand`
/// ([⌈rows/br⌉, ⌈K/bc⌉]) and nvfp4's s_enc (undefined for the other recipes).
struct ScaledOperand {
  Tensor codes, scales, tensor_scale;
  lowp::Recipe recipe;
  lowp::Operand operand;
  /// Where the product is not native, the operand is dequantized (lowp_dequantize) and the fp32
  /// GEMM multiplies it: as [rows, K], or with `transposed` as its transpose [K, rows] (written
  /// in place of a copy). The product is the same either way; the choice fixes which fp32 GEMM
  /// runs, and so its bits (stage 06 keeps the ones it always had).
  bool transposed = false;
  /// The dequantized values in that orientation when the caller holds them already (the fallback
  /// then reads them instead of dequantizing again); undefined otherwise.
  Tensor values;
};
/// C [m, n] = A·Bᵀ, A's codes [m, K] and B's [n, K], both of one recipe (or, for an operand
/// prepare_scaled has dequantized, its values alone); C f32 or bf16 (rounded once), of m·n
/// elements in any shape. On a Hopper GPU (sm_90) with cuBLASLt 12.9 or newer,
/// rowwise and block128 multiply on the FP8 tensor cores through cuBLASLt's scale modes
/// (OUTER_VEC_32F; VEC128_32F and BLK128x128_32F: common/cuda/gemm_scaled.cc, the plan in
/// common/scaled_gemm_plan.h): the codes multiplied exactly, fp32 accumulation, each block's
/// partial sums multiplied by 1/s_A·1/s_B. Everywhere else (the cpu, mxfp8 and nvfp4, another
/// GPU, an older cuBLASLt, a problem cuBLASLt refuses) both operands are dequantized and the fp32
/// GEMM multiplies them; on cuda that is said on stderr with the reason, once per recipe where
/// the GPU cannot multiply it natively at all (prepare_scaled), once per recipe and shape where
/// cuBLASLt refuses a problem.
void gemm_scaled(const ScaledOperand& a, const ScaledOperand& b, const Tensor& c);
/// q as gemm_scaled will read it: where gemm_scaled dequantizes anyway (scaled_gemm_problem is
/// not empty for q's device and recipe), q's values in its orientation, dequantized now, with
/// its codes and scales released (an operand of several GEMMs is dequantized once, and its codes
/// are gone as soon as its values exist, as stage 06's layers always had it); q itself
/// otherwise, or when it holds its values already.
ScaledOperand prepare_scaled(ScaledOperand q);
/// Empty when gemm_scaled may multiply `recipe`'s operands natively on `device` (cuda: an sm_90
/// GPU, cuBLASLt 12.9+, rowwise or block128; a problem cuBLASLt refuses still falls back);
/// otherwise one sentence saying why they are dequantized. Never starts a GPU for the cpu.
std::string scaled_gemm_problem(Device device, lowp::Recipe recipe);

/// Blocks the host until all work issued on `device` by this thread is done (no-op on cpu).
void synchronize(Device device);

/// The device's dense bf16 GEMM throughput in TFLOP/s, measured once per process by timing a
/// large cuBLAS GEMM: the denominator of MFU. 0 for the cpu.
double bf16_gemm_peak_tflops(Device device);

/// Milliseconds per call of `work`, issued `reps` times back to back after one untimed call: on
/// cuda by two events on the calling thread's stream around the calls (the host queues them
/// ahead of the GPU, so the time is the kernels' unless each call's launches take longer than
/// its kernels), on the cpu by the host's steady clock. What `work` issues on other streams is
/// not waited for. For benchmarks: what is outside `work` (casts, allocations) is not timed.
double time_ms(Device device, int reps, const std::function<void()>& work);

}  // namespace tpx::ops
