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
#include "memory_terms.h"

namespace tpx {
namespace memory {

namespace {

[[noreturn]] void overflow(std::string_view what) {
  throw SizeOverflow(
      fmt::format("{} does not fit in a 64-bit count (the sizes are too large)", what));
}

/// Stage 06 (FP8) keeps h and h2 as the FP8 shards it quantized: a byte per element (its row
/// and block recipes keep the bf16 shards: BlockConfig::fp8_codes_kept).
Count kept_h_bytes(const BlockConfig& c, const ActivationBytes& b) {
  return is_fp8(c.dtype) && c.fp8_codes_kept ? b.stream / b.e : b.stream;
}

}  // namespace

Count sum(std::initializer_list<Count> parts, std::string_view what) {
  Count r = 0;
  for (const Count p : parts) {
    const auto next = checked_add(r, p);
    if (!next) overflow(what);
    r = *next;
  }
  return r;
}

Count product(std::initializer_list<Count> factors, std::string_view what) {
  return checked_product(factors, what);
}

Count largest(std::initializer_list<Count> moments) {
  return std::max(moments);
}

Count saved_layer_bytes(const BlockConfig& c, const ActivationBytes& b) {
  const Count kept_h = kept_h_bytes(c, b);
  return sum({b.stream, kept_h, b.stream, kept_h, b.rows, b.rows, b.cols_h, b.cols_kv, b.cols_kv,
              b.cols_h, b.cols_f, b.cols_f, b.cols_f, b.attn},
             "a layer's saved activations");
}

Count cheap_bytes(const BlockConfig& c, const ActivationBytes& b) {
  const Count kept_h = kept_h_bytes(c, b);
  return sum({kept_h, kept_h, b.rows, b.rows, b.cols_f}, "the saved activations' bytes");
}

}  // namespace memory

namespace {

using namespace memory;  // NOLINT: the estimate is written in its own vocabulary
using I = Count;
using Bytes = ActivationBytes;

I numel(const std::vector<I>& shape, std::string_view what) {
  I r = 1;
  for (const I d : shape) r = checked_product({r, d}, what);
  return r;
}

/// The bytes of the rank's tensors for block `c` (its tokens and batch part).
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
  b.dq_turns = checked_product({1 + batch * heads * ((c.seq + 31) / 32), 4},
                               "the fused attention backward's turn counters");
  b.w_h = checked_product({c.hidden, cols_h, kF32}, "a local attention weight's bytes");
  b.w_kv = checked_product({c.hidden, cols_kv, kF32}, "a local Wk's bytes");
  b.w_f = checked_product({c.hidden, cols_f, kF32}, "a local MLP weight's bytes");
  return b;
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
/// per query row and head, and under the recipe (bf16 dq) dQ's fp32 accumulator, 2·q's bytes,
/// and the words that order its adds, 1 + B·NH/N·ceil(S/32) (kernels::flash_sync_words). Naive: dP (fp32) and, under the recipe, which it reads as bf16 as
/// they are stored, a bf16 copy of the fp32 P and dS in bf16, and, when a KV head serves a group
/// of g > 1 query heads, the group's dK and dV summed in fp32 before they are rounded once:
///   naive = P·4 + (mixed ? P·2 + P·2 + (g > 1 ? 2·(2·kv) : 0) : 0)
/// (P the probabilities' elements, kv the bf16 bytes of k). The cpu's block buffers are host
/// memory outside the allocator.
I attention_scratch(const BlockConfig& c, bool cuda, bool mixed, bool fused, const Bytes& b) {
  const char* what = Moments::what;
  if (!cuda) return 0;
  if (fused) return mixed ? sum({b.lse, 2 * b.cols_h, b.dq_turns}, what) : b.lse;
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

// ---- The shared terms, one function each ----

/// The rank's block: its S / C tokens under context parallelism (stages 08, 09), cut further by
/// the sharding's dimensions (a pipeline: its layers; one pass, a micro-batch); refused unless
/// the estimate can be made.
struct Blocks {
  BlockConfig rank, pass;
};
Blocks rank_blocks(const BlockConfig& global, const Sharding& s) {
  TPX_CHECK(s.cp >= 1 && global.seq % s.cp == 0, "memory estimate: --seq {} over {} CP ranks",
            global.seq, s.cp);
  Blocks b{global, global};
  b.rank.seq = global.seq / s.cp;
  b.pass = b.rank;
  for (const auto& dimension : s.dimensions) dimension->cut(b.rank, b.pass, s);
  const BlockConfig& c = b.rank;
  TPX_CHECK(c.hidden > 0 && c.heads > 0 && c.ffn > 0 && c.seq > 0 && c.batch > 0 && c.layers > 0 &&
                c.hidden % c.heads == 0,
            "memory estimate of an invalid config (validate() it first)");
  TPX_CHECK(s.world >= 1 &&
                (!s.weights || (c.heads % s.world == 0 && c.kv_heads_or_heads() % s.world == 0 &&
                                c.ffn % s.world == 0)) &&
                (!s.sequence || c.seq % s.world == 0),
            "memory estimate for {} ranks that cannot split the block (check_tp_split() first)",
            s.world);
  return b;
}

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

/// --recompute: what a layer keeps between its forward and its backward, and what its
/// recompute makes again while that block's backward runs (the largest such, once):
///   none       saved_layer                        —
///   full       x (R = ceil(L/K) layers; the rest  saved_layer − x
///              keep saved_layer)
///   selective  saved_layer − cheap                cheap = h, h2 (as kept), rstd1, rstd2, s
/// (A pipeline counts its live micro-batches instead: 09_pipeline_parallel/memory.cc.)
I saved_activations(const BlockConfig& c, const Bytes& b) {
  const char* what = "the saved activations' bytes";
  const I saved_layer = saved_layer_bytes(c, b);
  const I cheap = cheap_bytes(c, b);
  const I recomputed = c.recomputed_layers();
  if (c.fp8_keep_last > 0 && is_fp8(c.dtype) && c.fp8_codes_kept) {
    // Stage 06's --fp8-keep-last: the last layers keep bf16 shards of h and h2, the others FP8
    // codes. Layer by layer, with the largest re-made part (the rule below) counted once.
    BlockConfig kept = c;
    kept.fp8_codes_kept = false;
    I all = 0, again = 0;
    for (I l = 0; l < c.layers; ++l) {
      const BlockConfig& lc = l < c.layers - c.fp8_keep_last ? c : kept;
      const I layer = saved_layer_bytes(lc, b), layer_cheap = cheap_bytes(lc, b);
      if (c.recompute == Recompute::selective) {
        all = sum({all, layer - layer_cheap}, what);
        again = std::max(again, layer_cheap);
      } else if (c.recomputes_layer(l)) {
        all = sum({all, b.stream}, what);
        again = std::max(again, layer - b.stream);
      } else {
        all = sum({all, layer}, what);
      }
    }
    return sum({all, again}, what);
  }
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

/// AdamW's two fp32 moments per parameter element, this rank's shards.
I optimizer_state(I params) {
  return checked_product({params, 2}, "AdamW's state bytes");
}

/// The FP8 copies of every weight, made in forward and kept for backward (a byte each; stage 06),
/// but for the layers --fp8-keep-last keeps out of the recipe.
I fp8_weights(const BlockConfig& c, const Bytes& b) {
  return checked_product(
      {layer_matrix_bytes(b) / kF32, c.layers - std::min(c.layers, c.fp8_keep_last)},
      "the FP8 weights' bytes");
}

/// --task lm: the language model's ends on this rank (DESIGN.md, "The language model around the
/// block"), V padded to a multiple of T and cut over it, the tokens of the rank's S / C region
/// rows (the whole S under SP: the output layer's input is gathered) and B / D sequences:
///   embedding      its rows E [V/T, H] and their gradient, fp32 (+ AdamW's two moments)
///   output layer   W_out [H, V/T] and the final gain [H], their gradients (+ moments; + W_out's
///                  bf16 compute copy under the recipe)
///   logits         z and dz [S, B, V/T] at the activations' width, the cross-entropy's five fp32
///                  vectors of S·B, the output layer's gathered input and its gradient
///                  [S, B, H]: the head's moment, never S·B·V (it falls as 1/T)
///   tokens         the ids and targets, int32 [S, B]
/// Under FSDP (stages 07-09) the ends are sharded as every layer: the D·C ranks of the DP×CP
/// group each keep ⌈rows / (D·C)⌉ of a tensor's dim-0 rows (E's V/T, the gain's and W_out's H),
/// so the first two terms hold 1/(T·D·C) of the model's ends; what FSDP gathers for them is its
/// dimension's (07_fsdp_tp/memory.cc).
/// (`c` is one pass's block: its S / C rows; a pipeline's micro-batch of the batch.)
void add_lm_terms(const BlockConfig& c, const Sharding& s, MemoryEstimate& e) {
  if (!c.lm()) return;
  const char* what = "the language model's bytes";
  const VocabShard v = vocab_shard(c, s);
  const I rows = c.seq, batch = c.batch / s.dp, h = c.hidden;
  const I shards = I(s.dp) * I(s.cp);
  const I table = checked_product({(v.local + shards - 1) / shards, h}, what);
  const I head_rows = (h + shards - 1) / shards;
  const I w_out = checked_product({head_rows, v.local}, what);
  const I copies = c.optimizer == Optimizer::adamw ? 4 : 2;  // value, gradient (, m, v)
  const I e_act = c.activations() == DType::bf16 ? kBf16 : kF32;
  const I positions = checked_product({rows, batch}, what);
  e.terms.push_back(
      {kLmEmbeddingTerm, std::uint64_t(checked_product({table, kF32, copies}, what))});
  e.terms.push_back(
      {kLmOutputTerm,
       std::uint64_t(
           sum({checked_product({sum({w_out, head_rows}, what), kF32, copies}, what),
                c.activations() == DType::bf16 ? checked_product({w_out, kBf16}, what) : 0},
               what))});
  e.terms.push_back(
      {kLmLogitsTerm, std::uint64_t(sum({checked_product({positions, v.local, e_act, 2}, what),
                                         checked_product({positions, kF32, 5}, what),
                                         checked_product({positions, h, e_act, 2}, what)},
                                        what))});
  e.terms.push_back({kLmTokensTerm, std::uint64_t(checked_product({positions, 4, 2}, what))});
  e.remove("target");
  e.remove("fp32 input");
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

MemoryTerm& MemoryEstimate::term(const std::string& name) {
  const auto& self = *this;
  return const_cast<MemoryTerm&>(self.term(name));
}

void MemoryEstimate::remove(const std::string& name) {
  std::erase_if(terms, [&](const MemoryTerm& m) { return m.name == name; });
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
  const auto [c, pass] = rank_blocks(global, s);
  const Bytes pass_bytes = local_bytes(pass, s);
  const MemoryParts p{.global = global,
                      .rank = c,
                      .pass = pass,
                      .rank_bytes = local_bytes(c, s),
                      .pass_bytes = pass_bytes,
                      .layer = layer_elements(c, s),
                      .temporaries = largest_temporaries(pass, s, pass_bytes),
                      .sharding = s};
  const I params = parameter_bytes(c, p.layer);
  const I stream_f32 = fp32_stream_bytes(c, p.rank_bytes);
  MemoryEstimate e;
  e.terms = {
      {"parameters", std::uint64_t(params)},
      {"gradients", std::uint64_t(params)},
      {"saved activations", std::uint64_t(saved_activations(c, p.rank_bytes))},
      // The input x is layer 0's saved x (the same tensor), counted there, unless it is a copy.
      {"target", std::uint64_t(stream_f32)},
      {"largest temporaries", std::uint64_t(p.temporaries)},
  };
  if (c.activations() != DType::f32) e.terms.push_back({"fp32 input", std::uint64_t(stream_f32)});
  if (c.bf16_weight_copies())
    e.terms.push_back(
        {"bf16 weight copies", std::uint64_t(bf16_weight_copies(c, s, p.rank_bytes))});
  if (c.optimizer == Optimizer::adamw)
    e.terms.push_back({"optimizer state", std::uint64_t(optimizer_state(params))});
  if (is_fp8(c.dtype) && c.fp8_codes_kept)
    e.terms.push_back({"FP8 weights", std::uint64_t(fp8_weights(c, p.rank_bytes))});
  add_lm_terms(pass, s, e);
  for (const auto& dimension : s.dimensions) dimension->add_terms(e, p);
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
