// The block's hyper-parameters and the run's settings, with validation.
//
// defines: tpx::Attention, tpx::Recompute, tpx::BlockConfig, tpx::validate(), tpx::dtype_flag(),
//          tpx::attention_flag(), tpx::recompute_flag(), tpx::optimizer_flag(),
//          tpx::high_precision()
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moe.h"
#include "tensor.h"

namespace tpx {

/// RMSNorm epsilon, fixed by the design (DESIGN.md, "The block").
inline constexpr double kNormEps = 1e-5;

/// How the block computes attention (--attention). fused: blockwise with an online softmax
/// (FlashAttention-2), keeping only the per-row log-sum-exp [B, NH, S] for backward; naive:
/// the readable version, materialising and keeping the probabilities [B, NH, S, S].
enum class Attention { fused, naive };

/// What backward keeps from forward (--recompute). none: every activation backward reads is
/// saved; full: only each block's input (its sequence shard under SP) is saved, and the block's
/// forward, collectives included, runs again just before its backward (Megatron-LM's
/// --recompute-granularity full, TorchTitan's full activation checkpointing), on every
/// --recompute-every K-th layer; selective: op-level, the outputs of the GEMMs and of attention
/// are kept and the cheap ops (RMSNorm, SwiGLU's product) run again before the block's backward,
/// with no collective repeated (TorchTitan's selective_ac_option = "op").
enum class Recompute { none, full, selective };

/// The optimizer (--optimizer): plain SGD, or AdamW as torch.optim.AdamW runs it.
enum class Optimizer { sgd, adamw };

/// What a run trains (--task). lm: the language model, token ids → embedding → L blocks → final
/// RMSNorm → output layer → cross-entropy against the next token (DESIGN.md, "The language model
/// around the block"); block: the L blocks alone on a random input against a random target with
/// a mean-squared loss (the chapters' block experiments).
enum class Task { lm, block };

/// --vocab's bounds: a byte-level vocabulary at least, and ids that fit the token file's u16.
inline constexpr std::int64_t kMinVocab = 2;
inline constexpr std::int64_t kMaxVocab = 65536;
/// --lr's default under --task lm (the block's 1 diverges on the cross-entropy in a few steps).
inline constexpr double kLmDefaultLr = 0.1;
/// The vocabulary of --data synthetic when --vocab is not given.
inline constexpr std::int64_t kSyntheticVocab = 512;

/// Llama 3's rotary base θ (--rope-theta's default).
inline constexpr double kLlama3RopeTheta = 500000.0;

/// --generate N after training, and how it draws (common/generate.h).
struct GenerateOptions {
  std::int64_t tokens = 0;  ///< N new ids (0: no generation)
  std::string prompt = "And God said";
  double temperature = 0;  ///< 0: the most likely id; > 0: a draw from softmax(logits / T)
  std::int64_t top_k = 0;  ///< > 0: draw among the K most likely ids only
};

/// --save, --save-every, --resume (common/checkpoint.h).
struct CheckpointOptions {
  std::string save_dir;  ///< --save DIR: checkpoints go to DIR/step-N/ (empty: none)
  int save_every = 0;    ///< --save-every K: after every K-th step too (0: at the end only)
  /// --async-save: a writer thread writes each save's host copy while the steps go on.
  bool async_save = false;
  /// --resume: the checkpoint directory DIR/step-N/ the run starts from, resolved by the
  /// command line (empty: from initialisation), and its step N.
  std::string resume_dir;
  std::int64_t resume_step = 0;
  /// --fault-kill-in-save RANK:N (hidden; the tests' interrupted save): rank RANK kills itself
  /// (SIGKILL) in the save after step N, once its shard file is written and before the index.
  int kill_rank = -1;
  std::int64_t kill_step = 0;
  /// --fault-full-disk-in-save RANK:N (hidden; the tests' full disk): in the save after step N,
  /// rank RANK's file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) drops below its shard file's
  /// size just before it writes it, so its write fails as on a full disk (EFBIG, not ENOSPC).
  int full_rank = -1;
  std::int64_t full_step = 0;
  /// Whether completed step count `done` (1 … steps) ends with a save.
  bool saves_after(std::int64_t done, std::int64_t steps) const {
    return !save_dir.empty() && (done == steps || (save_every > 0 && done % save_every == 0));
  }
};

/// Everything that defines a run of a stage. Defaults are the tutorial's default config.
/// Stage 10's mixture of experts (DESIGN.md, "Experts (stage 10)"; common/moe.h holds the math):
/// which layers' MLP is one, and its shape and rules. experts == 0: every MLP is the dense SwiGLU
/// (every other stage). MoeFlags (common/moe_flags.h) fills it from the command line.
struct MoeConfig {
  std::int64_t experts = 0;     ///< E routed experts per MoE layer; 0: no MoE layer
  std::int64_t topk = 1;        ///< K experts per token
  std::int64_t expert_ffn = 0;  ///< FE, each expert's SwiGLU width
  std::int64_t shared_ffn = 0;  ///< NS·FE, the shared experts side by side; 0: none
  std::int64_t every = 1;       ///< layer l is a MoE layer when l % every == 0
  MoeRouter router = MoeRouter::softmax;
  double capacity_factor = 0.0;  ///< 0: dropless
  double aux_loss_weight = 0.0;  ///< W of the auxiliary balance loss
  double bias_rate = 0.0;  ///< > 0: auxiliary-loss-free balancing's bias step (--balance bias)
  /// Where every MoE layer's balancing bias starts for expert 0 (the others start at 0): the test
  /// hook TPX_MOE_SKEW, which skews the routing towards expert 0 on purpose; 0 without it.
  double skew = 0.0;
  /// The routing groups of a pipeline's micro-batches (stage 10 under --pp): the step's sequences
  /// are routed in `microbatches` groups M, group j holding micro-batch j of each of the
  /// `replicas` data-parallel replicas D (replica d trains sequences [d·B/D, (d+1)·B/D), its
  /// micro-batch j the j-th B/(D·M) of them). The capacity and the auxiliary loss count within a
  /// group, and each group's auxiliary loss is weighted 1/M (the loss stays a mean over the
  /// step). 1 and 1: the step's tokens are one group, whatever the mesh.
  std::int64_t microbatches = 1;
  std::int64_t replicas = 1;
  /// --moe-chunks: the chunks each MoE layer cuts its dispatch, experts and combine into, to run
  /// one chunk's all-to-all beside another's experts (common/moe_ep.h's MoeEpOverlap). The
  /// arithmetic is the same for every cut (the experts' weight gradients to rounding).
  std::int64_t chunks = 1;

  bool layer(std::int64_t l) const { return experts > 0 && l % every == 0; }
  /// The routing group of sequence b of a batch of `batch` sequences.
  std::int64_t group_of(std::int64_t b, std::int64_t batch) const {
    const std::int64_t local = batch / replicas;
    return (b % local) / (local / microbatches);
  }
  /// One MoE layer's shape over `tokens` tokens (one routing group's) of hidden size `hidden`,
  /// the auxiliary loss's weight shared over the M groups.
  MoeShape shape(std::int64_t hidden, std::int64_t tokens) const {
    return {.tokens = tokens,
            .hidden = hidden,
            .experts = experts,
            .topk = topk,
            .expert_ffn = expert_ffn,
            .shared_ffn = shared_ffn,
            .router = router,
            .capacity_factor = capacity_factor,
            .aux_loss_weight = aux_loss_weight / double(microbatches)};
  }
};

struct BlockConfig {
  std::int64_t hidden = 256;  ///< H
  std::int64_t heads = 8;     ///< NH; head dim D = H / NH
  /// NKV, key/value heads (grouped-query attention): Wk, Wv are [H, NKV·D] and query head h
  /// reads KV head h / (NH/NKV). 0 (the default) means NKV = NH, multi-head attention.
  std::int64_t kv_heads = 0;
  std::int64_t ffn = 1024;  ///< F, the SwiGLU inner size
  std::int64_t seq = 128;   ///< S
  std::int64_t batch = 2;   ///< B
  std::int64_t layers = 2;  ///< L stacked blocks
  std::int64_t steps = 5;   ///< training steps (--steps)
  /// --task. The struct's default is the blocks alone (what in-process tests and tools build);
  /// the executables' --task defaults to lm (common/cli.cc).
  Task task = Task::block;
  std::int64_t vocab = 0;  ///< V, the vocabulary (--vocab; the token file's when not given)
  /// --data: a token file made by tpx_tokenize, or "synthetic" for a generated stream.
  std::string data = "synthetic";
  /// --eval-every K: the held-out loss every K steps and at the last (0: never).
  std::int64_t eval_every = 0;
  /// --generate: after the last step rank 0 gathers the trained model and continues the prompt.
  GenerateOptions generate = {};
  /// --save / --resume; empty for a run that neither saves nor resumes (and for --check's
  /// reference run).
  CheckpointOptions checkpoint = {};
  double lr = 1.0;  ///< learning rate (the loss is a mean, so SGD's grads are small)
  Optimizer optimizer = Optimizer::sgd;
  double beta1 = 0.9;         ///< AdamW: first-moment decay
  double beta2 = 0.95;        ///< AdamW: second-moment decay
  double eps = 1e-8;          ///< AdamW: added to the second moment's root
  double weight_decay = 0.1;  ///< AdamW: decoupled decay of the seven weight matrices
  std::uint64_t seed = 1234;
  Device device = Device::cpu;
  /// The precision recipe (--dtype): f32 throughout; bf16, the mixed-precision recipe (bf16
  /// activations and communication, fp32 master weights, gradients and math inside every op;
  /// DESIGN.md, "Mixed precision"); or e4m3 for stage 06's FP8 recipe (--dtype fp8: that recipe
  /// with the seven linear layers' GEMMs in E4M3 forward and E5M2 backward).
  DType dtype = DType::f32;
  Attention attention = Attention::fused;
  /// θ of the rotary embedding on q and k (0: none).
  double rope_theta = kLlama3RopeTheta;
  Recompute recompute = Recompute::none;
  /// Under full recompute, layers l with l % K == 0 are recomputed (1: every layer).
  std::int64_t recompute_every = 1;
  /// Under --dtype fp8, whether the block keeps the FP8 codes its forward made for backward (the
  /// column inputs' shards, every weight: tensorwise) or the high-precision shards, quantized
  /// again in backward (the row and block recipes, 06_fp8/layers.h). No flag sets it: stage 06's
  /// memory dimension does, for the estimate (async_fp8::recipe_memory_dimension()).
  bool fp8_codes_kept = true;
  /// Under --dtype fp8, the last layers that run no recipe (stage 06's --fp8-keep-last): they
  /// keep bf16 shards and no FP8 copy of a weight, for the estimate.
  std::int64_t fp8_keep_last = 0;
  /// Stage 10's experts (none elsewhere).
  MoeConfig moe = {};

  std::int64_t head_dim() const { return hidden / heads; }
  std::int64_t kv_heads_or_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  std::int64_t kv_dim() const { return kv_heads_or_heads() * head_dim(); }  ///< NKV·D
  bool rope() const { return rope_theta > 0; }
  /// Whether layer l runs its forward again before its backward (full recompute).
  bool recomputes_layer(std::int64_t l) const {
    return recompute == Recompute::full && l % recompute_every == 0;
  }
  /// How many layers do: ceil(L / K) under full recompute, else 0.
  std::int64_t recomputed_layers() const {
    return recompute == Recompute::full ? (layers + recompute_every - 1) / recompute_every : 0;
  }
  std::int64_t tokens() const { return seq * batch; }
  bool lm() const { return task == Task::lm; }
  /// Whether step `step` also measures the held-out loss (--eval-every).
  bool evaluates(std::int64_t step) const {
    return lm() && eval_every > 0 && (step % eval_every == 0 || step == steps - 1);
  }
  /// The dtype activations, their gradients and the saved tensors are stored and communicated
  /// in: bf16 under --dtype bf16 and fp8, f32 otherwise.
  DType activations() const { return dtype == DType::f32 ? DType::f32 : DType::bf16; }
  /// Whether each step makes a bf16 compute copy of the seven weight matrices from the fp32
  /// master weights (--dtype bf16; the FP8 stage quantizes the master weights itself).
  bool bf16_weight_copies() const { return dtype == DType::bf16; }
};

/// The --dtype word for a config's dtype: "fp32", "bf16" or "fp8".
std::string_view dtype_flag(DType d);
/// The --task word: "lm" or "block".
constexpr std::string_view task_flag(Task t) {
  return t == Task::lm ? "lm" : "block";
}
/// The --attention word: "fused" or "naive".
constexpr std::string_view attention_flag(Attention a) {
  return a == Attention::fused ? "fused" : "naive";
}
/// The --optimizer word: "sgd" or "adamw".
constexpr std::string_view optimizer_flag(Optimizer o) {
  return o == Optimizer::adamw ? "adamw" : "sgd";
}
/// The --recompute word: "none", "full" or "selective".
constexpr std::string_view recompute_flag(Recompute r) {
  return r == Recompute::full ? "full" : r == Recompute::selective ? "selective" : "none";
}
/// The operand type of the GEMMs that never run in FP8 (attention's): d, or bf16 under fp8 (the
/// FP8 recipe runs inside the bf16 one).
constexpr DType high_precision(DType d) {
  return is_fp8(d) ? DType::bf16 : d;
}

/// Every problem with the config, one clear sentence each; empty when it is valid.
std::vector<std::string> validate(const BlockConfig& c);

}  // namespace tpx
