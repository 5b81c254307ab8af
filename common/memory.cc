#include "memory.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string_view>

#include <fmt/format.h>

#include "check.h"
#include "checked.h"

namespace tpx {
namespace {

using I = std::int64_t;

constexpr I kF32 = 4;   // master weights, gradients, optimizer state, statistics; fp32 activations
constexpr I kBf16 = 2;  // activations under the mixed-precision recipe, and weights' compute copies

[[noreturn]] void overflow(std::string_view what) {
  throw SizeOverflow(
      fmt::format("{} does not fit in a 64-bit count (the sizes are too large)", what));
}

/// The sum of non-negative counts; SizeOverflow naming `what` if it does not fit in int64.
I sum(std::initializer_list<I> parts, std::string_view what) {
  I r = 0;
  for (const I p : parts) {
    const auto next = checked_add(r, p);
    if (!next) overflow(what);
    r = *next;
  }
  return r;
}

I numel(const std::vector<I>& shape, std::string_view what) {
  I r = 1;
  for (const I d : shape) r = checked_product({r, d}, what);
  return r;
}

/// Bytes of this rank's tensors, named as in the chapters (N ranks; /N only where `s` splits).
/// Activations take e = c.activations()'s bytes per element (4, or 2 under --dtype bf16 / fp8);
/// statistics and weights are fp32.
struct Bytes {
  I e;        ///< an activation element's bytes
  I stream;   ///< R: the residual stream [S, B, H], or [S/N, B, H] with sequence parallelism
  I rows;     ///< an RMSNorm's rstd, one float per row of the stream
  I full;     ///< G: [S, B, H], every token: a region's gathered input or partial output
  I gather;   ///< G with sequence parallelism (f and g all-gather into a new tensor), else 0
  I cols_h;   ///< [S, B, H/N]: q, a and their gradients
  I cols_kv;  ///< [S, B, NKV·D/N]: k, v and their gradients (cols_h without GQA)
  I cols_f;   ///< [S, B, F/N]: gate, up, s and their gradients
  I probs;    ///< [B, NH/N, S, S]: naive attention's probabilities
  I lse;      ///< [B, NH/N, S]: fused attention's log-sum-exp per query row
  I attn;     ///< what attention keeps for backward: lse (fused) or probs (naive)
  I w_h;      ///< a local Wq / Wo: H·H/N elements (bytes at fp32)
  I w_kv;     ///< a local Wk / Wv: H·NKV·D/N elements
  I w_f;      ///< a local Wg / Wu / Wd: H·F/N elements (bytes at fp32)
};

Bytes local_bytes(const BlockConfig& c, const Sharding& s) {
  const I seq_local = s.sequence ? c.seq / s.world : c.seq;
  const I cols_h = param_local_shape(Param::wq, c, s)[1];      // H/N: whole heads
  const I cols_kv = param_local_shape(Param::wk, c, s)[1];     // NKV·D/N: whole KV heads
  const I cols_f = param_local_shape(Param::w_gate, c, s)[1];  // F/N
  const I heads = cols_h / c.head_dim();                       // as block_forward counts them
  Bytes b{};
  b.e = c.activations() == DType::bf16 ? kBf16 : kF32;
  const I e = b.e;
  const I batch = c.batch / s.dp;  // a data-parallel replica's part of the batch
  b.stream = checked_product({seq_local, batch, c.hidden, e}, "the residual stream's bytes");
  b.rows = checked_product({seq_local, batch, kF32}, "an RMSNorm statistic's bytes");
  b.full = checked_product({c.seq, batch, c.hidden, e}, "an activation's bytes (S·B·H·e)");
  b.gather = s.sequence ? b.full : 0;
  b.cols_h = checked_product({c.seq, batch, cols_h, e}, "q's bytes (S·B·H/N·e)");
  b.cols_kv = checked_product({c.seq, batch, cols_kv, e}, "k's bytes (S·B·NKV·D/N·e)");
  b.cols_f = checked_product({c.seq, batch, cols_f, e}, "gate's bytes (S·B·F/N·e)");
  b.probs = checked_product({batch, heads, c.seq, c.seq, kF32},
                            "the attention probabilities' bytes (B·NH/N·S·S·4)");
  b.lse = checked_product({batch, heads, c.seq, kF32}, "the attention lse's bytes (B·NH/N·S·4)");
  b.attn = c.attention == Attention::fused ? b.lse : b.probs;
  b.w_h = checked_product({c.hidden, cols_h, kF32}, "a local attention weight's bytes");
  b.w_kv = checked_product({c.hidden, cols_kv, kF32}, "a local Wk's bytes");
  b.w_f = checked_product({c.hidden, cols_f, kF32}, "a local MLP weight's bytes");
  return b;
}

/// The largest of the moments' live bytes.
I largest(std::initializer_list<I> moments) {
  return std::max(moments);
}

/// The sizes every moment of a layer's passes is counted in (`b` the activations' bytes, as
/// local_bytes() names them), and the copies the ops make around their tensors.
struct Moments {
  bool cuda;   ///< the CUDA backend
  bool mixed;  ///< the mixed-precision recipe (--dtype bf16 or fp8)
  bool fused;  ///< --attention fused
  const Bytes& b;
  I R;             ///< the residual stream, b.stream
  I G;             ///< a region's gathered input or partial output, b.full
  I cols_qkv;      ///< q, k, v (or their gradients)
  I scattered;     ///< a reduce-scatter's output (stage 03's f backward and g forward), else 0
  I rms_partial;   ///< the CUDA RMSNorm backward's partial sums of dg, else 0
  I attn_scratch;  ///< the CUDA attention backward's scratch, else 0

  static constexpr const char* what = "the temporaries' bytes";

  /// Under the recipe an op reads each bf16 tensor through an fp32 copy and writes each bf16
  /// output through an fp32 stand-in, alive while it runs (ops.cc, Fp32Boundary): twice the
  /// tensors' bf16 bytes.
  I widened(std::initializer_list<I> tensors) const {
    return mixed ? 2 * sum(tensors, what) : I{0};
  }
  /// Attention's: the same on the cpu; on cuda nothing, its kernels and GEMMs read the bf16
  /// tensors as they are stored and round each output once (ops.cc, attention_native).
  I attention_copies(std::initializer_list<I> tensors) const {
    return cuda ? I{0} : widened(tensors);
  }
  /// A GEMM's: on the cpu the same for its activations `acts` and its bf16 output `out`, and the
  /// weight's bf16 compute copy, whose fp32 copy has the master weight's bytes `w`; on cuda
  /// nothing (bf16 operands go to the tensor cores as they are). Stage 06's FP8 GEMMs on the cpu
  /// dequantize both operands into fp32 scratch of the same sizes (FP8 tensor cores need none).
  I gemm_copies(std::initializer_list<I> acts, I w, I out) const {
    if (!mixed || cuda) return I{0};
    return sum({2 * sum(acts, what), w, 2 * out}, what);
  }
};

/// The CUDA attention backward's scratch (cuda/ops.cc). Fused: Δ = rowsum(dO ∘ O), one float
/// per query row and head. Naive: dP (fp32) and, under the recipe, which it reads as bf16 as
/// they are stored, a bf16 copy of the fp32 P and dS in bf16, and, when a KV head serves a group
/// of g > 1 query heads, the group's dK and dV summed in fp32 before they are rounded once:
///   naive = P·4 + (mixed ? P·2 + P·2 + (g > 1 ? 2·(2·kv) : 0) : 0)
/// (P the probabilities' elements, kv the bf16 bytes of k). The cpu's block buffers are host
/// memory outside the allocator.
I attention_scratch(const BlockConfig& c, bool cuda, bool mixed, bool fused, const Bytes& b) {
  const char* what = Moments::what;
  if (!cuda) return 0;
  if (fused) return b.lse;
  const bool grouped = c.kv_heads_or_heads() < c.heads;
  const I dkv_f32 = grouped ? checked_product({b.cols_kv, 2, 2}, what) : I{0};  // dK, dV at fp32
  return sum({b.probs, mixed ? sum({b.probs / 2, b.probs / 2, dkv_f32}, what) : 0}, what);
}

Moments moments_of(const BlockConfig& c, const Sharding& s, const Bytes& b) {
  const bool cuda = c.device == Device::cuda;
  const bool mixed = b.e == kBf16;
  const bool fused = c.attention == Attention::fused;
  const char* what = Moments::what;
  return {.cuda = cuda,
          .mixed = mixed,
          .fused = fused,
          .b = b,
          .R = b.stream,
          .G = b.full,
          .cols_qkv = sum({b.cols_h, b.cols_kv, b.cols_kv}, what),
          .scattered = s.sequence ? b.stream : 0,
          // At most one [H] row per 16 rows.
          .rms_partial = cuda ? checked_product({b.rows / kF32 / 16 + 1, c.hidden, kF32}, what) : 0,
          .attn_scratch = attention_scratch(c, cuda, mixed, fused, b)};
}

/// Backward of a layer: the last block's output y and the incoming gradient stay alive, and
/// block_backward keeps each of its tensors until it returns; each line is one moment.
I backward_peak(const Moments& m) {
  const char* what = Moments::what;
  const Bytes& b = m.b;
  const I R = m.R, G = m.G;
  const I base = sum({R, R}, what);                                    // y, dout
  const I held_mlp = sum({base, b.cols_f, b.cols_f, b.cols_f}, what);  // + ds, dgate, dup
  const I held_norm2 = sum({held_mlp, R, R}, what);                    // + dh2, dx2
  const I held_attn = sum({held_norm2, b.cols_h, m.cols_qkv}, what);   // + da, dq, dk, dv
  return largest({
      // row backward of Wd: g's backward gathers dout, allocates ds, runs two GEMMs
      sum({base, b.gather, b.cols_f,
           largest({m.gemm_copies({b.cols_f, G}, 0, 0), m.gemm_copies({G}, b.w_f, b.cols_f)})},
          what),
      // SwiGLU backward: dout, gate and up in, dgate and dup out
      sum({held_mlp, m.widened({b.cols_f, b.cols_f, b.cols_f, b.cols_f, b.cols_f})}, what),
      // column backward of Wg, Wu: f's forward again (gathered h2), the full dh2, then f backward
      sum({held_mlp, b.gather, G,
           largest({m.gemm_copies({G, b.cols_f}, 0, 0), m.gemm_copies({b.cols_f}, b.w_f, G),
                    m.scattered})},
          what),
      sum({held_norm2, m.rms_partial, m.widened({R, R, R})}, what),
      // row backward of Wo
      sum({held_norm2, b.gather, b.cols_h,
           largest({m.gemm_copies({b.cols_h, G}, 0, 0), m.gemm_copies({G}, b.w_h, b.cols_h)})},
          what),
      // attention backward: dO, q, k, v (and O, fused) in, dq, dk, dv out
      sum({held_attn, m.attn_scratch,
           m.attention_copies({b.cols_h, m.cols_qkv, m.fused ? b.cols_h : I{0}, m.cols_qkv})},
          what),
      // column backward of Wq, Wk, Wv
      sum({held_attn, b.gather, G,
           largest({m.gemm_copies({G, b.cols_h}, 0, 0), m.gemm_copies({b.cols_h}, b.w_h, G),
                    m.scattered})},
          what),
      // the end: dh and dx (and the RMSNorm's partial sums on cuda)
      sum({held_attn, R, R, m.rms_partial, m.widened({R, R, R})}, what),
  });
}

/// Attention forward's copies: q, k, v in, out out (none on cuda).
I attention_forward_copies(const Moments& m) {
  return m.attention_copies({m.cols_qkv, m.b.cols_h});
}

/// A layer under full recompute has nothing to replace (its activations are released after its
/// backward); its forward runs again inside backward, beside the last block's output y and the
/// incoming gradient, and what it saves is the saved-activations term's one block: only its
/// transient outputs come on top.
I recompute_peak(const Moments& m) {
  const char* what = Moments::what;
  const Bytes& b = m.b;
  const I R = m.R, G = m.G;
  const I wo_row = sum({G, largest({m.gemm_copies({b.cols_h}, b.w_h, G), m.scattered})}, what);
  const I wd_row = sum({R, G, largest({m.gemm_copies({b.cols_f}, b.w_f, G), m.scattered})}, what);
  return sum({R, R,
              largest({wo_row, wd_row, attention_forward_copies(m), sum({R, R, R}, what),
                       m.widened({R, R, R})})},
             what);
}

/// From the second step on, forward replaces each saved tensor of the previous step: the new one
/// exists before the old one is released. With long sequences the new probabilities alone
/// outweigh everything backward allocates. Each line is one moment of block_forward().
I forward_replacement_peak(const Moments& m) {
  const char* what = Moments::what;
  const Bytes& b = m.b;
  const I R = m.R, G = m.G;
  const I qkv_col = sum({R, b.gather, m.cols_qkv, m.gemm_copies({G}, b.w_h, b.cols_h)}, what);
  const I attn_fwd =
      sum({b.attn, attention_forward_copies(m),
           m.cuda && m.mixed && !m.fused ? b.probs / 2 : I{0}},  // naive on cuda: P in bf16
          what);
  const I wo_row = sum({G, largest({m.gemm_copies({b.cols_h}, b.w_h, G), m.scattered})}, what);
  const I mlp_col = sum({R, R, b.gather, b.cols_f, b.cols_f, m.gemm_copies({G}, b.w_f, b.cols_f)},
                        what);  // attn out, h2
  const I swiglu = sum({R, b.cols_f, m.widened({b.cols_f, b.cols_f, b.cols_f})}, what);
  const I wd_row = sum({R, G, largest({m.gemm_copies({b.cols_f}, b.w_f, G), m.scattered})}, what);
  return largest({qkv_col, attn_fwd, wo_row, sum({R, R, m.widened({R, R, R})}, what), mlp_col,
                  swiglu, wd_row, sum({R, R, R, m.widened({R, R, R})}, what)});
}

/// What the run allocates besides parameters, gradients, saved activations and the target, at
/// the moment it is largest: one of train() / block_backward() / block_forward()'s moments,
/// counting the tensors alive then (the stages' layers.cc say what f and g allocate: nothing in
/// stage 01, in-place all-reduces in stage 02, a new tensor for every all-gather and
/// reduce-scatter in stage 03).
I largest_temporaries(const BlockConfig& c, const Sharding& s, const Bytes& b) {
  const Moments m = moments_of(c, s, b);
  I peak = backward_peak(m);
  if (c.recomputed_layers() > 0) peak = largest({peak, recompute_peak(m)});
  if (c.steps >= 2 && c.recomputed_layers() < c.layers)
    peak = largest({peak, forward_replacement_peak(m)});
  return peak;
}

// ---- The estimate's terms, one function per dimension of the mesh and per method ----

/// The rank's block: its S / C tokens under context parallelism (stage 08), its layers of a
/// pipeline (stage 09); refused unless the estimate can be made.
BlockConfig rank_block(const BlockConfig& global, const Sharding& s) {
  TPX_CHECK(s.cp >= 1 && global.seq % s.cp == 0, "memory estimate: --seq {} over {} CP ranks",
            global.seq, s.cp);
  BlockConfig c = global;
  c.seq = global.seq / s.cp;
  const bool pipeline = s.pp_layers > 0;
  TPX_CHECK(!pipeline || (s.microbatches >= 1 && c.batch % (s.dp * s.microbatches) == 0),
            "memory estimate: a pipeline of {} micro-batches over --batch {}", s.microbatches,
            c.batch);
  if (pipeline) c.layers = s.pp_layers;
  TPX_CHECK(c.hidden > 0 && c.heads > 0 && c.ffn > 0 && c.seq > 0 && c.batch > 0 && c.layers > 0 &&
                c.hidden % c.heads == 0,
            "memory estimate of an invalid config (validate() it first)");
  TPX_CHECK(s.world >= 1 &&
                (!s.weights || (c.heads % s.world == 0 && c.kv_heads_or_heads() % s.world == 0 &&
                                c.ffn % s.world == 0)) &&
                (!s.sequence || c.seq % s.world == 0),
            "memory estimate for {} ranks that cannot split the block (check_tp_split() first)",
            s.world);
  return c;
}

/// What the activations are made of: the rank's block, or one micro-batch of it in a pipeline,
/// B / (D·M) sequences.
BlockConfig activation_block(const BlockConfig& c, const Sharding& s) {
  BlockConfig act = c;
  if (s.pp_layers > 0) act.batch = c.batch / s.microbatches;
  return act;
}

/// One layer's parameter elements: the nine tensors, this rank's shards. Under FSDP (D·C shards
/// of the DP×CP group) each TP shard [rows, ...] is split on dim 0 into D·C shards of
/// ⌈rows / (D·C)⌉ rows (padded): the rank keeps one (`kept`); `tp` counts the unsharded TP shard.
struct LayerElements {
  I kept = 0;
  I tp = 0;
};
LayerElements layer_elements(const BlockConfig& c, const Sharding& s) {
  const I shards = s.dp * s.cp;
  LayerElements layer;
  for (const Param p : kAllParams) {
    const auto shape = param_local_shape(p, c, s);
    const I elements = numel(shape, "a parameter's elements");
    layer.tp = sum({layer.tp, elements}, "a layer's parameter count");
    const I rows = shape[0], cols = elements / rows;
    layer.kept = sum(
        {layer.kept, checked_product({(rows + shards - 1) / shards, cols}, "a shard's elements")},
        "a layer's parameter count");
  }
  return layer;
}

/// parameters = gradients = L · (a layer's kept elements) · 4 bytes.
I parameter_bytes(const BlockConfig& c, const LayerElements& layer) {
  return checked_product({layer.kept, kF32, c.layers}, "the parameters' bytes");
}

/// Stage 06 (FP8) keeps h and h2 as the FP8 shards it quantized: a byte per element.
I kept_h_bytes(const BlockConfig& c, const Bytes& b) {
  return is_fp8(c.dtype) ? b.stream / b.e : b.stream;
}

/// Per layer, as BlockActivations: x, h, x2, h2 (the stream; h and h2 as the stage keeps them:
/// this rank's part of the stream, never the gathered copy), rstd1, rstd2, q, k, v, a, gate, up,
/// s, and probs (naive attention) or lse (fused).
I saved_layer_bytes(const BlockConfig& c, const Bytes& b) {
  const I kept_h = kept_h_bytes(c, b);
  return sum({b.stream, kept_h, b.stream, kept_h, b.rows, b.rows, b.cols_h, b.cols_kv, b.cols_kv,
              b.cols_h, b.cols_f, b.cols_f, b.cols_f, b.attn},
             "a layer's saved activations");
}

/// --recompute: what a layer keeps between its forward and its backward, and what its
/// recompute makes again while that block's backward runs (the largest such, once):
///   none       saved_layer                        —
///   full       x (R = ceil(L/K) layers; the rest  saved_layer − x
///              keep saved_layer)
///   selective  saved_layer − cheap                cheap = h, h2 (as kept), rstd1, rstd2, s
/// A pipeline rank keeps, for each (micro-batch, layer) alive at once (the schedule's peak, live),
/// what its layer keeps, plus the one block its recompute makes again:
///   none       saved_layer · live
///   full       x · live + (saved_layer − x) · (live − recomputed pairs) + (saved_layer − x)
///   selective  (saved_layer − cheap) · live + cheap
I pipeline_saved_activations(const BlockConfig& c, const Sharding& s, I saved_layer, I cheap,
                             I input) {
  const char* what = "the saved activations' bytes";
  if (c.recompute == Recompute::selective)
    return sum({checked_product({saved_layer - cheap, s.pp_live_layers}, what), cheap}, what);
  if (c.recompute == Recompute::full)
    return sum(
        {checked_product({input, s.pp_live_layers}, what),
         checked_product({saved_layer - input, s.pp_live_kept_layers}, what), saved_layer - input},
        what);
  return checked_product({saved_layer, s.pp_live_layers}, what);
}

I saved_activations(const BlockConfig& c, const Sharding& s, const Bytes& b, const Bytes& ba) {
  const char* what = "the saved activations' bytes";
  const I saved_layer = saved_layer_bytes(c, ba);
  const I kept_h = kept_h_bytes(c, ba);
  const I cheap = sum({kept_h, kept_h, ba.rows, ba.rows, ba.cols_f}, what);
  const I recomputed = c.recomputed_layers();
  if (s.pp_layers > 0) return pipeline_saved_activations(c, s, saved_layer, cheap, ba.stream);
  if (c.recompute == Recompute::selective)
    return sum({checked_product({saved_layer - cheap, c.layers}, what), cheap}, what);
  if (recomputed > 0)
    return sum({checked_product({saved_layer, c.layers - recomputed}, what),
                checked_product({b.stream, recomputed}, what), saved_layer - b.stream},
               what);
  return checked_product({saved_layer, c.layers}, what);
}

/// The target (and, under the recipe, the fp32 input, which the block reads as a bf16 copy:
/// layer 0's saved x) stay fp32: one residual stream's rows at 4 bytes.
I fp32_stream_bytes(const BlockConfig& c, const Bytes& b) {
  return checked_product({b.rows, c.hidden}, "the target's bytes");
}

/// The pipeline's own buffers (stage 09):
///   input       the first stage's micro-batches of the input, all M (the live ones are also
///               their first layer's saved x: counted twice, a micro-batch's stream each)
///   messages    the receives posted for this action and the next: two micro-batch streams
///   loss grads  the last stage's dL/dy of each micro-batch waiting for its backward
///   gradients   one micro-batch's gradients of the layer in backward, fp32, before they are
///               added to the step's (zb-h1: those of every micro-batch between its B and W)
///   deferred    zb-h1: what a layer's set-aside dW GEMMs read, per (micro-batch, layer)
///               between B and W, in place of its saved activations: the gathered inputs of
///               the four GEMMs (h, h2 and the two output gradients of the row layers,
///               [S, b, H] each) and their other operands (dq, dk, dv, a; dgate, dup, s)
I pipeline_buffers(const BlockConfig& c, const Sharding& s, const Bytes& b, const Bytes& ba,
                   const LayerElements& layer) {
  const char* what = "the pipeline's buffers";
  const I message = ba.stream;
  const I grads_layer = checked_product({layer.tp, kF32}, what);
  const I deferred_layer =
      sum({checked_product({ba.full, 4}, what), ba.cols_h, ba.cols_kv, ba.cols_kv, ba.cols_h,
           ba.cols_f, ba.cols_f, ba.cols_f, grads_layer},
          what);
  const I saved_layer = saved_layer_bytes(c, ba);
  const I deferred_beyond_saved = deferred_layer > saved_layer ? deferred_layer - saved_layer : 0;
  const I gradients = s.pp_split_backward
                          ? checked_product({deferred_beyond_saved, s.pp_live_layers}, what)
                          : grads_layer;
  const I buffers = sum({checked_product({message, 2}, what),
                         checked_product({message, s.pp_loss_grads}, what), gradients},
                        what);
  return s.pp_holds_input ? sum({buffers, b.stream}, what) : buffers;
}

/// FSDP × PP: the unsharded fp32 gradients of the rank's layers, summed over a step's
/// micro-batches before they are reduce-scattered.
I gradient_accumulators(const BlockConfig& c, const LayerElements& layer) {
  const char* what = "the pipeline's buffers";
  return checked_product({checked_product({layer.tp, kF32}, what), c.layers}, what);
}

/// The host's books of a step, beyond the tensors' bytes (the cpu backend with glibc's malloc,
/// measured with --json's host_peak_bytes − host_baseline_bytes at M up to 16 000):
///   per (micro-batch, layer held): the schedule's actions and transfers, the per-pass records,
///     the step's trace spans, each small tensor's handle, storage and shape; 2.5 KiB, and
///     4.5 KiB on a D·C > 1 slice (its collectives' records and spans)
///   per live (micro-batch, layer) at the schedule's peak: the handles and malloc chunks of the
///     fourteen saved tensors and of the pass that holds them, 5 KiB
/// host per micro-batch = M · L_rank · (2.5 or 4.5 KiB) + live · 5 KiB
I host_per_microbatch(const BlockConfig& c, const Sharding& s) {
  const char* what = "the pipeline's buffers";
  const I per_microbatch_layer = s.dp * s.cp > 1 ? 4608 : 2560, per_live_layer = 5120;
  return sum({checked_product({s.microbatches, c.layers, per_microbatch_layer}, what),
              checked_product({s.pp_live_layers, per_live_layer}, what)},
             what);
}

/// The holes the live passes leave in the heap (the cpu backend, glibc's malloc). A layer's
/// forward frees, between the tensors its pass keeps, the outputs of its two row GEMMs before
/// the residual adds (attention's Wo and the MLP's Wd: G each, the full [S, b, H] partial sums),
/// and a pass frees its output once it is sent (a micro-batch's stream R). A block below
/// malloc's mmap threshold (which rises to the largest block freed, at most 32 MiB: the
/// set-up's streams lift it there) comes from the heap, and malloc keeps such holes resident
/// under the live passes' tensors above them until those are freed. With the schedule's peaks
/// of live (micro-batch, layer) pairs and of live passes:
///   heap holes = live kept layers · 2·G + live passes · R   (no term on cuda, or if G ≥ 32 MiB)
/// where a layer that --recompute full makes again leaves none: it frees its saved tensors with
/// the GEMMs' outputs right after its forward, so the next forward reuses the space.
constexpr I kMmapThresholdMax = I{32} << 20;
bool has_heap_holes(const BlockConfig& c, const Bytes& ba) {
  return c.device == Device::cpu && ba.full < kMmapThresholdMax;
}
I heap_holes(const Sharding& s, const Bytes& ba) {
  const char* what = "the pipeline's buffers";
  return sum({checked_product({s.pp_live_kept_layers, ba.full, 2}, what),
              checked_product({s.pp_live_passes, ba.stream}, what)},
             what);
}

/// The pipeline's terms, after the training terms.
void add_pipeline_terms(MemoryEstimate& e, const BlockConfig& c, const Sharding& s, const Bytes& b,
                        const Bytes& ba, const LayerElements& layer) {
  e.terms.push_back({"pipeline buffers", std::uint64_t(pipeline_buffers(c, s, b, ba, layer))});
  if (s.dp * s.cp > 1)
    e.terms.push_back(
        {"gradient accumulators (FSDP × PP)", std::uint64_t(gradient_accumulators(c, layer))});
  e.terms.push_back({"host per micro-batch", std::uint64_t(host_per_microbatch(c, s))});
  if (has_heap_holes(c, ba)) e.terms.push_back({"heap holes", std::uint64_t(heap_holes(s, ba))});
}

/// The seven matrices' bytes of one layer at fp32, this rank's TP shards.
I layer_matrix_bytes(const Bytes& b) {
  return sum({b.w_h, b.w_kv, b.w_kv, b.w_h, b.w_f, b.w_f, b.w_f}, "a layer's weights' bytes");
}

/// This step's bf16 compute copies of the seven matrices (this rank's shards): half their fp32
/// bytes, over the D·C FSDP shards.
I bf16_weight_copies(const BlockConfig& c, const Sharding& s, const Bytes& b) {
  const I matrices = checked_product({layer_matrix_bytes(b), c.layers}, "the weights' bytes");
  return matrices / (kF32 / kBf16) / (s.dp * s.cp);
}

/// FSDP's unsharded layers (stage 07). While layer l's backward runs: the gathered buffers of l
/// and of l − 1 below it, prefetched (D shards each, at the compute copies' bytes: g), the
/// unsharded copy of l's weights and its fp32 gradients, and the fp32 buffer of l + 1's gradient
/// reduce-scatter still in flight (D shards: r); a layer has one below only if l > 0 and one
/// above only if l < L − 1. When l's gradients go out, l's own reduce-scatter buffer joins
/// them, but backward's temporaries are gone: the term is the larger of the two moments, the
/// second less the temporaries the estimate already counts.
I unsharded_layers(const BlockConfig& c, const Sharding& s, const LayerElements& layer,
                   I temporaries) {
  const char* what = "FSDP's unsharded layers";
  const I shards = s.dp * s.cp;
  const I weight_bytes = c.bf16_weight_copies() ? kBf16 : kF32;
  const I gathered = checked_product({shards, layer.kept, weight_bytes}, what);
  const I reduce_scatter = checked_product({shards, layer.kept, kF32}, what);
  const I unsharded = checked_product({layer.tp, sum({weight_bytes, kF32}, what)}, what);
  const I in_flight =
      c.layers >= 3 ? sum({gathered, gathered, reduce_scatter}, what)
      : c.layers == 2
          ? largest({sum({gathered, gathered}, what), sum({gathered, reduce_scatter}, what)})
          : gathered;
  const I during = sum({unsharded, in_flight}, what);
  const I going_out = sum({during, reduce_scatter}, what);
  return largest({during, going_out > temporaries ? going_out - temporaries : I{0}});
}

/// Context parallelism's attention buffers at their largest, in backward (stage 08; kv = this
/// rank's K/V block [S/C, B/D, NKV/T·Dh], fp32; q likewise with NH/T heads):
///   ring       its own block packed [k | v], the block in flight, two dK/dV partials and
///              the one arriving: 2·kv each, 6 in all, plus the last hop's arrival
///   allgather  every rank's block gathered, their dK/dV, this rank's own and its share of
///              the reduce-scatter: (2C + 2)·2·kv
///   ulysses    the head-sharded copies of q, k, v, out, dO and of dq, dk, dv (each as big as
///              the rank's own), plus one all-to-all's host send, receive and reorder buffers
I cp_attention_buffers(const Sharding& s, const Bytes& ba) {
  const char* what = "CP attention buffers";
  const I kv2 = checked_product({ba.cols_kv, 2}, what);
  switch (s.cp_method) {
    case CpMethod::ring:
      return checked_product({kv2, 7}, what);
    case CpMethod::allgather:
      return checked_product({kv2, 2 * I(s.cp) + 2}, what);
    case CpMethod::ulysses:
      return sum({checked_product({ba.cols_h, 7}, what), checked_product({ba.cols_kv, 4}, what)},
                 what);
  }
  return 0;
}

/// AdamW's two fp32 moments per parameter element, this rank's shards.
I optimizer_state(I params) {
  return checked_product({params, 2}, "AdamW's state bytes");
}

/// The FP8 copies of every weight, made in forward and kept for backward (a byte each; stage 06).
I fp8_weights(const BlockConfig& c, const Bytes& b) {
  return checked_product({layer_matrix_bytes(b) / kF32, c.layers}, "the FP8 weights' bytes");
}

/// The pipeline's set-up streams: every rank generates the whole input and target, [S, B, H]
/// fp32 each (X bytes), before its mesh cuts them; with C > 1 the CP cut copies this rank's
/// S / C rows of one of them twice while both are alive; with C = 1 and D > 1 the FSDP cut
/// copies this replica's B / D columns of the input while both are alive (the target's cut
/// comes after the whole input is gone). The training terms are not alive yet, so the term is
/// what the set-up needs beyond them (zero when training needs more):
///   set-up streams = max(0, 2·X + (C > 1 ? 2·X/C : D > 1 ? X/D : 0) − the training terms)
std::uint64_t setup_streams(const BlockConfig& global, const BlockConfig& c, const Sharding& s,
                            std::uint64_t training) {
  const char* what = "the set-up's streams";
  const I x = checked_product({global.seq, c.batch, c.hidden, kF32}, what);
  const I cut = s.cp > 1 ? 2 * (x / s.cp) : s.dp > 1 ? x / s.dp : I{0};
  const auto need = std::uint64_t(sum({checked_product({x, 2}, what), cut}, what));
  return need > training ? need - training : 0;
}

}  // namespace

std::uint64_t MemoryEstimate::total() const {
  std::uint64_t t = 0;
  for (const MemoryTerm& m : terms) {
    const auto next = checked_add(t, m.bytes);
    if (!next) overflow("the memory estimate's total");
    t = *next;
  }
  return t;
}

const MemoryTerm& MemoryEstimate::biggest() const {
  TPX_CHECK(!terms.empty(), "a memory estimate without terms");
  return *std::max_element(
      terms.begin(), terms.end(),
      [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes < b.bytes; });
}

const MemoryTerm& MemoryEstimate::term(const std::string& name) const {
  for (const MemoryTerm& m : terms)
    if (m.name == name) return m;
  fail(fmt::format("the memory estimate has no term '{}'", name));
}

std::string MemoryEstimate::describe() const {
  const std::uint64_t all = total();
  const ByteUnit u = byte_unit(all);
  std::string line = fmt::format("{} =", bytes_text(all));
  for (std::size_t i = 0; i < terms.size(); ++i)
    line += fmt::format("{} {} {:.{}f}", i == 0 ? "" : " +", terms[i].name,
                        double(terms[i].bytes) / u.scale, u.digits);
  return line;
}

MemoryEstimate estimate_training_memory(const BlockConfig& global, const Sharding& s) {
  const BlockConfig c = rank_block(global, s);
  const BlockConfig act = activation_block(c, s);
  const bool pipeline = s.pp_layers > 0, fsdp = s.dp * s.cp > 1;
  const Bytes rank = local_bytes(c, s), micro = local_bytes(act, s);
  const LayerElements layer = layer_elements(c, s);
  const I params = parameter_bytes(c, layer);
  const I stream_f32 = fp32_stream_bytes(c, rank);
  const I temporaries = largest_temporaries(act, s, micro);
  MemoryEstimate e;
  e.terms = {
      {"parameters", std::uint64_t(params)},
      {"gradients", std::uint64_t(params)},
      {"saved activations", std::uint64_t(saved_activations(c, s, rank, micro))},
      // The input x is layer 0's saved x (the same tensor), counted there, unless it is a copy.
      // A pipeline's last stage keeps the target's micro-batches; the others none.
      {"target", std::uint64_t(!pipeline || s.pp_holds_target ? stream_f32 : 0)},
      {"largest temporaries", std::uint64_t(temporaries)},
  };
  if (c.activations() != DType::f32 && !pipeline)
    e.terms.push_back({"fp32 input", std::uint64_t(stream_f32)});
  if (pipeline) add_pipeline_terms(e, c, s, rank, micro, layer);
  if (c.bf16_weight_copies())
    e.terms.push_back({"bf16 weight copies", std::uint64_t(bf16_weight_copies(c, s, rank))});
  if (fsdp)
    e.terms.push_back(
        {"unsharded layers (FSDP)", std::uint64_t(unsharded_layers(c, s, layer, temporaries))});
  if (s.cp > 1)
    e.terms.push_back({"CP attention buffers", std::uint64_t(cp_attention_buffers(s, micro))});
  if (c.optimizer == Optimizer::adamw)
    e.terms.push_back({"optimizer state", std::uint64_t(optimizer_state(params))});
  if (is_fp8(c.dtype)) e.terms.push_back({"FP8 weights", std::uint64_t(fp8_weights(c, rank))});
  if (pipeline) e.terms.push_back({"set-up streams", setup_streams(global, c, s, e.total())});
  (void)e.total();  // throws SizeOverflow now rather than when it is printed
  return e;
}

std::uint64_t snapshot_bytes(const BlockConfig& c) {
  const I activation = checked_product({c.seq, c.batch, c.hidden}, "an activation's elements");
  I layer = 0;
  for (const Param p : kAllParams)
    layer = sum({layer, numel(param_shape(p, c), "a parameter's elements")},
                "a layer's parameter count");
  const I params = checked_product({layer, c.layers}, "the model's parameter count");
  // input, target, output, input gradient; every parameter and its gradient
  const I elements = sum({checked_product({activation, 4}, "the snapshot's activations"),
                          checked_product({params, 2}, "the snapshot's parameters")},
                         "the snapshot's elements");
  return std::uint64_t(checked_product({elements, kF32}, "the snapshot's bytes"));
}

HostMemory host_memory() {
  HostMemory m;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    std::istringstream in(line);
    std::string key;
    std::uint64_t kib = 0;
    in >> key >> kib;  // "VmRSS:   123456 kB"
    if (key == "VmRSS:") m.rss = kib * 1024;
    if (key == "VmHWM:") m.peak = kib * 1024;
  }
  return m;
}

bool reset_host_peak() {
  std::ofstream refs("/proc/self/clear_refs");
  refs << "5\n";  // 5: reset the peak resident set size
  refs.flush();
  return bool(refs);
}

}  // namespace tpx
