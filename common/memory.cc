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

/// What the run allocates besides parameters, gradients, saved activations and the target, at
/// the moment it is largest. Each line below is one moment of train() / block_backward() /
/// block_forward(), counting the tensors alive then (the stages' layers.cc say what f and g
/// allocate: nothing in stage 01, in-place all-reduces in stage 02, a new tensor for every
/// all-gather and reduce-scatter in stage 03).
I largest_temporaries(const BlockConfig& c, const Sharding& s, const Bytes& b) {
  const bool cuda = c.device == Device::cuda;
  const bool mixed = b.e == kBf16;  // the mixed-precision recipe (--dtype bf16 or fp8)
  const char* what = "the temporaries' bytes";
  // Under the recipe an op reads each bf16 tensor through an fp32 copy and writes each bf16
  // output through an fp32 stand-in, alive while it runs (ops.cc, Fp32Boundary): twice the
  // tensors' bf16 bytes.
  auto widened = [&](std::initializer_list<I> tensors) {
    return mixed ? 2 * sum(tensors, what) : I{0};
  };
  // A GEMM's: on the cpu the same for its activations `acts` and its bf16 output `out`, and the
  // weight's bf16 compute copy, whose fp32 copy has the master weight's bytes `w`; on cuda
  // nothing (bf16 operands go to the tensor cores as they are). Stage 06's FP8 GEMMs on the cpu
  // dequantize both operands into fp32 scratch of the same sizes (FP8 tensor cores need none).
  auto gemm_copies = [&](std::initializer_list<I> acts, I w, I out) {
    if (!mixed || cuda) return I{0};
    return sum({2 * sum(acts, what), w, 2 * out}, what);
  };
  // The CUDA RMSNorm backward's partial sums of dg: at most one [H] row per 16 rows.
  const I rms_partial = cuda ? checked_product({b.rows / kF32 / 16 + 1, c.hidden, kF32}, what) : 0;
  // The CUDA attention backward's scratch. Naive: dP (fp32) and, under the recipe, bf16 copies
  // of dO, q, k, v, P and dS. Fused: Δ = rowsum(dO ∘ O), one float per query row and head (the
  // kernels round their operands to bf16 as they load them; the cpu's block buffers are host
  // memory outside the allocator).
  const bool fused = c.attention == Attention::fused;
  const I attn_scratch = !cuda   ? 0
                         : fused ? b.lse
                                 : sum({b.probs, mixed ? sum({b.cols_h, b.cols_h, b.cols_kv,
                                                              b.cols_kv, b.probs / 2, b.probs / 2},
                                                             what)
                                                       : 0},
                                       what);
  // A reduce-scatter's output (stage 03's f backward and g forward); in place otherwise.
  const I scattered = s.sequence ? b.stream : 0;
  const I R = b.stream, G = b.full;
  const I cols_qkv = sum({b.cols_h, b.cols_kv, b.cols_kv}, what);  // q, k, v (or their grads)

  // Backward of a layer: the last block's output y and the incoming gradient stay alive, and
  // block_backward keeps each of its tensors until it returns.
  const I base = sum({R, R}, what);                                    // y, dout
  const I held_mlp = sum({base, b.cols_f, b.cols_f, b.cols_f}, what);  // + ds, dgate, dup
  const I held_norm2 = sum({held_mlp, R, R}, what);                    // + dh2, dx2
  const I held_attn = sum({held_norm2, b.cols_h, cols_qkv}, what);     // + da, dq, dk, dv
  I peak = largest({
      // row backward of Wd: g's backward gathers dout, allocates ds, runs two GEMMs
      sum({base, b.gather, b.cols_f,
           largest({gemm_copies({b.cols_f, G}, 0, 0), gemm_copies({G}, b.w_f, b.cols_f)})},
          what),
      // SwiGLU backward: dout, gate and up in, dgate and dup out
      sum({held_mlp, widened({b.cols_f, b.cols_f, b.cols_f, b.cols_f, b.cols_f})}, what),
      // column backward of Wg, Wu: f's forward again (gathered h2), the full dh2, then f backward
      sum({held_mlp, b.gather, G,
           largest(
               {gemm_copies({G, b.cols_f}, 0, 0), gemm_copies({b.cols_f}, b.w_f, G), scattered})},
          what),
      sum({held_norm2, rms_partial, widened({R, R, R})}, what),
      // row backward of Wo
      sum({held_norm2, b.gather, b.cols_h,
           largest({gemm_copies({b.cols_h, G}, 0, 0), gemm_copies({G}, b.w_h, b.cols_h)})},
          what),
      // attention backward: dO, q, k, v (and O, fused) in, dq, dk, dv out
      sum({held_attn, attn_scratch,
           widened({b.cols_h, cols_qkv, fused ? b.cols_h : I{0}, cols_qkv})},
          what),
      // column backward of Wq, Wk, Wv
      sum({held_attn, b.gather, G,
           largest(
               {gemm_copies({G, b.cols_h}, 0, 0), gemm_copies({b.cols_h}, b.w_h, G), scattered})},
          what),
      // the end: dh and dx (and the RMSNorm's partial sums on cuda)
      sum({held_attn, R, R, rms_partial, widened({R, R, R})}, what),
  });

  // From the second step on, forward replaces each saved tensor of the previous step: the new
  // one exists before the old one is released. With long sequences the new probabilities
  // alone outweigh everything backward allocates. A layer under full recompute has nothing to
  // replace (its activations are released after its backward); its forward runs again inside
  // backward, beside the last block's output y and the incoming gradient, and what it saves is
  // the saved-activations term's one block: only its transient outputs come on top.
  const I attn_in = widened({cols_qkv, b.cols_h});  // attention forward: q, k, v in, out out
  if (c.recomputed_layers() > 0) {
    const I wo_row = sum({G, largest({gemm_copies({b.cols_h}, b.w_h, G), scattered})}, what);
    const I wd_row = sum({R, G, largest({gemm_copies({b.cols_f}, b.w_f, G), scattered})}, what);
    peak = largest(
        {peak,
         sum({base, largest({wo_row, wd_row, attn_in, sum({R, R, R}, what), widened({R, R, R})})},
             what)});
  }
  if (c.steps >= 2 && c.recomputed_layers() < c.layers) {
    const I qkv_col = sum({R, b.gather, cols_qkv, gemm_copies({G}, b.w_h, b.cols_h)}, what);
    const I attn_fwd =
        sum({b.attn, attn_in, cuda && mixed && !fused ? sum({cols_qkv, b.probs / 2}, what) : I{0}},
            what);
    const I wo_row = sum({G, largest({gemm_copies({b.cols_h}, b.w_h, G), scattered})}, what);
    const I mlp_col = sum({R, R, b.gather, b.cols_f, b.cols_f, gemm_copies({G}, b.w_f, b.cols_f)},
                          what);  // attn out, h2
    const I swiglu = sum({R, b.cols_f, widened({b.cols_f, b.cols_f, b.cols_f})}, what);
    const I wd_row = sum({R, G, largest({gemm_copies({b.cols_f}, b.w_f, G), scattered})}, what);
    peak = largest({peak, qkv_col, attn_fwd, wo_row, sum({R, R, widened({R, R, R})}, what), mlp_col,
                    swiglu, wd_row, sum({R, R, R, widened({R, R, R})}, what)});
  }
  return peak;
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
  // Context parallelism (stage 08): every sequence-long activation is the rank's S / C tokens,
  // and the parameters are sharded over the D·C ranks of the DP×CP group.
  TPX_CHECK(s.cp >= 1 && global.seq % s.cp == 0, "memory estimate: --seq {} over {} CP ranks",
            global.seq, s.cp);
  BlockConfig c = global;
  c.seq = global.seq / s.cp;
  const int shards = s.dp * s.cp;
  // Pipeline parallelism (stage 09): the rank holds pp_layers layers, and its activations are
  // one micro-batch's, B / (D·M) sequences, for each (micro-batch, layer) pair alive at once.
  const bool pipeline = s.pp_layers > 0;
  TPX_CHECK(!pipeline || (s.microbatches >= 1 && c.batch % (s.dp * s.microbatches) == 0 &&
                          c.recompute == Recompute::none),
            "memory estimate: a pipeline of {} micro-batches over --batch {}", s.microbatches,
            c.batch);
  if (pipeline) c.layers = s.pp_layers;
  BlockConfig act = c;  // what the activations are made of: one micro-batch under a pipeline
  if (pipeline) act.batch = c.batch / s.microbatches;
  TPX_CHECK(c.hidden > 0 && c.heads > 0 && c.ffn > 0 && c.seq > 0 && c.batch > 0 && c.layers > 0 &&
                c.hidden % c.heads == 0,
            "memory estimate of an invalid config (validate() it first)");
  TPX_CHECK(s.world >= 1 &&
                (!s.weights || (c.heads % s.world == 0 && c.kv_heads_or_heads() % s.world == 0 &&
                                c.ffn % s.world == 0)) &&
                (!s.sequence || c.seq % s.world == 0),
            "memory estimate for {} ranks that cannot split the block (check_tp_split() first)",
            s.world);
  const Bytes b = local_bytes(c, s), ba = local_bytes(act, s);

  // One layer's parameters: the nine tensors, this rank's shards. Gradients are the same shapes.
  // Under FSDP (s.dp = D > 1) each TP shard [rows, ...] is split on dim 0 into D shards of
  // ⌈rows / D⌉ rows (padded): the rank keeps one, and `tp_layer` counts the unsharded TP shard.
  I layer = 0, tp_layer = 0;
  for (const Param p : kAllParams) {
    const auto shape = param_local_shape(p, c, s);
    const I n = numel(shape, "a parameter's elements");
    tp_layer = sum({tp_layer, n}, "a layer's parameter count");
    const I rows = shape[0], cols = n / rows;
    layer =
        sum({layer, checked_product({(rows + shards - 1) / shards, cols}, "a shard's elements")},
            "a layer's parameter count");
  }
  const I params = checked_product({layer, kF32, c.layers}, "the parameters' bytes");

  // Per layer, as BlockActivations: x, h, x2, h2 (the stream; h and h2 as the stage keeps them:
  // this rank's part of the stream, never the gathered copy), rstd1, rstd2, q, k, v, a, gate, up,
  // s, and probs (naive attention) or lse (fused).
  // Stage 06 (FP8) keeps h and h2 as the FP8 shards it quantized: a byte per element.
  const I kept_h = is_fp8(c.dtype) ? ba.stream / ba.e : ba.stream;
  const I saved_layer =
      sum({ba.stream, kept_h, ba.stream, kept_h, ba.rows, ba.rows, ba.cols_h, ba.cols_kv,
           ba.cols_kv, ba.cols_h, ba.cols_f, ba.cols_f, ba.cols_f, ba.attn},
          "a layer's saved activations");
  // --recompute: what a layer keeps between its forward and its backward, and what its
  // recompute makes again while that block's backward runs (the largest such, once):
  //   none       saved_layer                        —
  //   full       x (R = ceil(L/K) layers; the rest  saved_layer − x
  //              keep saved_layer)
  //   selective  saved_layer − cheap                cheap = h, h2 (as kept), rstd1, rstd2, s
  const char* saved_what = "the saved activations' bytes";
  const I cheap = sum({kept_h, kept_h, ba.rows, ba.rows, ba.cols_f}, saved_what);
  const I recomputed = c.recomputed_layers();
  I saved = 0;
  if (pipeline)
    saved = checked_product({saved_layer, s.pp_live_layers}, saved_what);
  else if (c.recompute == Recompute::selective)
    saved = sum({checked_product({saved_layer - cheap, c.layers}, saved_what), cheap}, saved_what);
  else if (recomputed > 0)
    saved = sum({checked_product({saved_layer, c.layers - recomputed}, saved_what),
                 checked_product({b.stream, recomputed}, saved_what), saved_layer - b.stream},
                saved_what);
  else
    saved = checked_product({saved_layer, c.layers}, saved_what);

  // The target (and, under the recipe, the fp32 input, which the block reads as a bf16 copy:
  // layer 0's saved x) stay fp32: one residual stream's rows at 4 bytes.
  const I stream_f32 = checked_product({b.rows, c.hidden}, "the target's bytes");
  const I temporaries = largest_temporaries(act, s, ba);
  MemoryEstimate e;
  e.terms = {
      {"parameters", std::uint64_t(params)},
      {"gradients", std::uint64_t(params)},
      {"saved activations", std::uint64_t(saved)},
      // The input x is layer 0's saved x (the same tensor), counted there, unless it is a copy.
      // A pipeline's last stage keeps the target's micro-batches; the others none.
      {"target", std::uint64_t(!pipeline || s.pp_holds_target ? stream_f32 : 0)},
      {"largest temporaries", std::uint64_t(temporaries)},
  };
  if (c.activations() != DType::f32 && !pipeline)
    e.terms.push_back({"fp32 input", std::uint64_t(stream_f32)});
  if (pipeline) {
    // The pipeline's own buffers:
    //   input       the first stage's micro-batches of the input, all M (the live ones are also
    //               their first layer's saved x: counted twice, a micro-batch's stream each)
    //   messages    the receives posted for this action and the next: two micro-batch streams
    //   loss grads  the last stage's dL/dy of each micro-batch waiting for its backward
    //   gradients   one micro-batch's gradients of the layer in backward, fp32, before they are
    //               added to the step's (zb-h1: those of every micro-batch between its B and W)
    //   deferred    zb-h1: what a layer's set-aside dW GEMMs read, per (micro-batch, layer)
    //               between B and W, in place of its saved activations: the gathered inputs of
    //               the four GEMMs (h, h2 and the two output gradients of the row layers,
    //               [S, b, H] each) and their other operands (dq, dk, dv, a; dgate, dup, s)
    const char* what = "the pipeline's buffers";
    const I message = ba.stream;
    const I grads_layer = checked_product({tp_layer, kF32}, what);
    const I deferred_layer =
        sum({checked_product({ba.full, 4}, what), ba.cols_h, ba.cols_kv, ba.cols_kv, ba.cols_h,
             ba.cols_f, ba.cols_f, ba.cols_f, grads_layer},
            what);
    const I pending = s.pp_split_backward ? s.pp_live_layers : I{1};
    I buffers = sum(
        {checked_product({message, 2}, what), checked_product({message, s.pp_loss_grads}, what),
         s.pp_split_backward
             ? checked_product(
                   {deferred_layer > saved_layer ? deferred_layer - saved_layer : I{0}, pending},
                   what)
             : grads_layer},
        what);
    if (s.pp_holds_input) buffers = sum({buffers, b.stream}, what);
    e.terms.push_back({"pipeline buffers", std::uint64_t(buffers)});
    if (shards > 1)  // FSDP's unsharded gradients, summed over the micro-batches of a step
      e.terms.push_back({"gradient accumulators (FSDP × PP)",
                         std::uint64_t(checked_product({grads_layer, c.layers}, what))});
    // The host's books of a step, beyond the tensors' bytes (the cpu backend with glibc's
    // malloc, measured with --json's host_peak_bytes − host_baseline_bytes at M up to 16 000):
    //   per (micro-batch, layer held): the schedule's actions and transfers, the per-pass
    //     records, the step's trace spans, each small tensor's handle, storage and shape;
    //     2.5 KiB, and 4.5 KiB on a D·C > 1 slice (its collectives' records and spans)
    //   per live (micro-batch, layer) at the schedule's peak: the handles and malloc chunks of
    //     the fourteen saved tensors and of the pass that holds them, 5 KiB
    // host per micro-batch = M · L_rank · (2.5 or 4.5 KiB) + live · 5 KiB
    const I per_microbatch_layer = shards > 1 ? 4608 : 2560, per_live_layer = 5120;
    e.terms.push_back(
        {"host per micro-batch",
         std::uint64_t(sum({checked_product({s.microbatches, c.layers, per_microbatch_layer}, what),
                            checked_product({s.pp_live_layers, per_live_layer}, what)},
                           what))});
    // The holes the live passes leave in the heap (the cpu backend, glibc's malloc). A layer's
    // forward frees, between the tensors its pass keeps, the outputs of its two row GEMMs before
    // the residual adds (attention's Wo and the MLP's Wd: G each, the full [S, b, H] partial
    // sums), and a pass frees its output once it is sent (a micro-batch's stream R). A block
    // below malloc's mmap threshold (which rises to the largest block freed, at most 32 MiB:
    // the set-up's streams lift it there) comes from the heap, and malloc keeps such holes
    // resident under the live passes' tensors above them until those are freed. With the
    // schedule's peaks of live (micro-batch, layer) pairs and of live passes:
    //   heap holes = live layers · 2·G + live passes · R   (0 on cuda, or if G ≥ 32 MiB)
    constexpr I kMmapThresholdMax = I{32} << 20;
    if (c.device == Device::cpu && ba.full < kMmapThresholdMax)
      e.terms.push_back(
          {"heap holes", std::uint64_t(sum({checked_product({s.pp_live_layers, ba.full, 2}, what),
                                            checked_product({s.pp_live_passes, ba.stream}, what)},
                                           what))});
  }
  if (c.bf16_weight_copies()) {
    // This step's bf16 compute copies of the seven matrices (this rank's shards): half their
    // fp32 bytes.
    const I matrices = checked_product(
        {sum({b.w_h, b.w_kv, b.w_kv, b.w_h, b.w_f, b.w_f, b.w_f}, "a layer's weights' bytes"),
         c.layers},
        "the weights' bytes");
    e.terms.push_back({"bf16 weight copies", std::uint64_t(matrices / (kF32 / kBf16) / shards)});
  }
  if (shards > 1) {
    // FSDP's unsharded layers. While layer l's backward runs: the gathered buffers of l and of
    // l − 1 below it, prefetched (D shards each, at the compute copies' bytes), the unsharded
    // copy of l's weights and its fp32 gradients, and the fp32 buffer of l + 1's gradient
    // reduce-scatter still in flight (D shards); a layer has one below only if l > 0 and one
    // above only if l < L − 1. When l's gradients go out, l's own reduce-scatter buffer joins
    // them, but backward's temporaries are gone: the term is the larger of the two moments,
    // the second less the temporaries the estimate already counts.
    const char* what = "FSDP's unsharded layers";
    const I ew = c.bf16_weight_copies() ? kBf16 : kF32;
    const I g = checked_product({shards, layer, ew}, what);
    const I r = checked_product({shards, layer, kF32}, what);
    const I unsharded = checked_product({tp_layer, sum({ew, kF32}, what)}, what);
    const I during =
        sum({unsharded, c.layers >= 3   ? sum({g, g, r}, what)
                        : c.layers == 2 ? largest({sum({g, g}, what), sum({g, r}, what)})
                                        : g},
            what);
    const I going_out = sum({during, r}, what);
    e.terms.push_back({"unsharded layers (FSDP)",
                       std::uint64_t(largest(
                           {during, going_out > temporaries ? going_out - temporaries : I{0}}))});
  }
  if (s.cp > 1) {
    // Context parallelism's attention buffers at their largest, in backward (kv = this rank's
    // K/V block [S/C, B/D, NKV/T·Dh], fp32; q likewise with NH/T heads):
    //   ring       its own block packed [k | v], the block in flight, two dK/dV partials and
    //              the one arriving: 2·kv each, 6 in all, plus the last hop's arrival
    //   allgather  every rank's block gathered, their dK/dV, this rank's own and its share of
    //              the reduce-scatter: (2C + 2)·2·kv
    //   ulysses    the head-sharded copies of q, k, v, out, dO and of dq, dk, dv (each as big as
    //              the rank's own), plus one all-to-all's host send, receive and reorder buffers
    const char* what = "CP attention buffers";
    const I kv2 = checked_product({ba.cols_kv, 2}, what);
    I cp_bytes = 0;
    switch (s.cp_method) {
      case CpMethod::ring:
        cp_bytes = checked_product({kv2, 7}, what);
        break;
      case CpMethod::allgather:
        cp_bytes = checked_product({kv2, 2 * I(s.cp) + 2}, what);
        break;
      case CpMethod::ulysses:
        cp_bytes = sum(
            {checked_product({ba.cols_h, 7}, what), checked_product({ba.cols_kv, 4}, what)}, what);
        break;
    }
    e.terms.push_back({"CP attention buffers", std::uint64_t(cp_bytes)});
  }
  // AdamW's two fp32 moments per parameter element, this rank's shards.
  if (c.optimizer == Optimizer::adamw)
    e.terms.push_back(
        {"optimizer state", std::uint64_t(checked_product({params, 2}, "AdamW's state bytes"))});
  if (is_fp8(c.dtype)) {
    // The FP8 copies of every weight, made in forward and kept for backward (a byte each).
    const I copies = checked_product(
        {sum({b.w_h, b.w_kv, b.w_kv, b.w_h, b.w_f, b.w_f, b.w_f}, "a layer's weights' bytes") /
             kF32,
         c.layers},
        "the FP8 weights' bytes");
    e.terms.push_back({"FP8 weights", std::uint64_t(copies)});
  }
  if (pipeline) {
    // The set-up's streams: every rank generates the whole input and target, [S, B, H] fp32
    // each (X bytes), before its mesh cuts them; with C > 1 the CP cut copies this rank's S / C
    // rows of one of them twice while both are alive; with C = 1 and D > 1 the FSDP cut copies
    // this replica's B / D columns of the input while both are alive (the target's cut comes
    // after the whole input is gone). The training terms above are not alive yet, so the term
    // is what the set-up needs beyond them (zero when training needs more):
    //   set-up streams = max(0, 2·X + (C > 1 ? 2·X/C : D > 1 ? X/D : 0) − the terms above)
    const char* what = "the set-up's streams";
    const I x = checked_product({global.seq, c.batch, c.hidden, kF32}, what);
    const I cut = s.cp > 1 ? 2 * (x / s.cp) : s.dp > 1 ? x / s.dp : I{0};
    const I setup = sum({checked_product({x, 2}, what), cut}, what);
    const std::uint64_t training = e.total(), need = std::uint64_t(setup);
    e.terms.push_back({"set-up streams", need > training ? need - training : 0});
  }
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
