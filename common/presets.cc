#include "presets.h"

#include <array>

namespace tpx {
namespace {

// The Llama 3 models' shapes as Meta published them: "The Llama 3 Herd of Models" (Llama Team,
// AI @ Meta, 2024, arXiv:2407.21783), Table 3 (layers, model dimension, FFN dimension, attention
// heads, key/value heads, RoPE θ = 500,000), and the models' config.json files on the Hugging Face
// Hub (meta-llama/Llama-3.1-8B, -70B, -405B: hidden_size, intermediate_size, num_attention_heads,
// num_key_value_heads, num_hidden_layers, rope_theta, vocab_size = 128256). S = 8192 is Llama 3's pre-training
// context length (the same paper, section 3.4.1); B = 2 sequences per step, so that stage 07's
// default mesh (D = 2 on 4 or more ranks) splits it. The tutorial's V is the vocabulary of the
// build's default token file, data/kjv-4096.tokens (common/token_file.h).
constexpr std::int64_t kLlama3Vocab = 128256;  // Llama 3's tokenizer (the paper, section 3.1.1)

// The mixtures of experts, from the models' config.json files on the Hugging Face Hub and their
// papers: Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1: hidden_size 4096, intermediate_size 14336,
// 32 layers, 32 heads, 8 KV heads, num_local_experts 8, num_experts_per_tok 2, rope_theta 1e6,
// vocab_size 32000; Jiang et al. 2024, softmax over the top 2); DeepSeek-V3 (deepseek-ai/
// DeepSeek-V3: hidden_size 7168, 61 layers, 128 heads, moe_intermediate_size 2048,
// n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, scoring_func sigmoid,
// auxiliary-loss-free balancing, rope_theta 10000, vocab_size 129280; intermediate_size 18432
// is its first three dense layers'); Llama 4 Maverick (meta-llama/Llama-4-Maverick-17B-128E:
// hidden_size 5120, 48 layers, 40 heads, 8 KV heads, intermediate_size 8192 per expert,
// intermediate_size_mlp 16384 for the dense layers, num_local_experts 128, num_experts_per_tok 1,
// a shared expert, interleave_moe_layer_step 2, rope_theta 500000, vocab_size 202048). What tpx
// leaves out: DeepSeek-V3's multi-head latent attention (here multi-head attention of the same
// heads), its first three dense layers (here every layer has experts) and its node-limited
// routing; Llama 4's sigmoid gate on its one expert (here the chosen weights renormalised: 1
// under K = 1), its chunked attention, its layers without RoPE, and which layers have the
// experts (here 0, 2, 4, …: --moe-every's l % 2 == 0; Llama 4's are 1, 3, 5, …). S = 4096, B 2: a training shape.
constexpr std::array<ModelPreset, 7> kPresets = {{
    {"tutorial",
     "the tutorial's small model, the default (H 256, 8 heads, F 1024, L 2, S 128, B 2, V 4096)",
     256,
     8,
     8,
     1024,
     2,
     128,
     2,
     kLlama3RopeTheta,
     4096,
     {}},
    {"llama3-8b",
     "Llama 3 8B (H 4096, 32 heads, 8 KV heads, F 14336, L 32, S 8192, B 2, V 128256)",
     4096,
     32,
     8,
     14336,
     32,
     8192,
     2,
     kLlama3RopeTheta,
     kLlama3Vocab,
     {}},
    {"llama3-70b",
     "Llama 3 70B (H 8192, 64 heads, 8 KV heads, F 28672, L 80, S 8192, B 2, V 128256)",
     8192,
     64,
     8,
     28672,
     80,
     8192,
     2,
     kLlama3RopeTheta,
     kLlama3Vocab,
     {}},
    {"llama3-405b",
     "Llama 3 405B (H 16384, 128 heads, 8 KV heads, F 53248, L 126, S 8192, B 2, V 128256)",
     16384,
     128,
     8,
     53248,
     126,
     8192,
     2,
     kLlama3RopeTheta,
     kLlama3Vocab,
     {}},
    {"mixtral-8x7b",
     "Mixtral 8x7B (H 4096, 32 heads, 8 KV heads, L 32, E 8 of FE 14336, top 2 by softmax, S 4096, "
     "B 2, V 32000; stage 10)",
     4096,
     32,
     8,
     14336,
     32,
     4096,
     2,
     1.0e6,
     32000,
     {.experts = 8, .topk = 2, .expert_ffn = 14336}},
    {"deepseek-v3",
     "DeepSeek-V3-like (H 7168, 128 heads, L 61, E 256 of FE 2048 and 1 shared, top 8 by sigmoid, "
     "the bias balance, S 4096, B 2, V 129280; stage 10)",
     7168,
     128,
     128,
     18432,
     61,
     4096,
     2,
     1.0e4,
     129280,
     {.experts = 256, .topk = 8, .expert_ffn = 2048, .shared = 1, .sigmoid = true, .bias = true}},
    {"llama4-maverick",
     "Llama 4 Maverick-like (H 5120, 40 heads, 8 KV heads, L 48, every other layer E 128 of FE "
     "8192 and 1 shared, top 1, F 16384 between, S 4096, B 2, V 202048; stage 10)",
     5120,
     40,
     8,
     16384,
     48,
     4096,
     2,
     kLlama3RopeTheta,
     202048,
     {.experts = 128, .topk = 1, .expert_ffn = 8192, .shared = 1, .every = 2, .sigmoid = true}},
}};

}  // namespace

std::span<const ModelPreset> model_presets() {
  return kPresets;
}

const ModelPreset* find_preset(std::string_view name) {
  for (const ModelPreset& p : kPresets)
    if (p.name == name) return &p;
  return nullptr;
}

std::string preset_names() {
  std::string names;
  for (const ModelPreset& p : kPresets) names += (names.empty() ? "" : ", ") + std::string(p.name);
  return names;
}

void apply_preset(const ModelPreset& p, const GivenSizes& given, BlockConfig& c) {
  if (!given.hidden) c.hidden = p.hidden;
  if (!given.heads) c.heads = p.heads;
  // A multi-head preset keeps NKV = NH when only --heads is given.
  if (!given.kv_heads) c.kv_heads = p.kv_heads == p.heads ? c.heads : p.kv_heads;
  if (!given.ffn) c.ffn = p.ffn;
  if (!given.layers) c.layers = p.layers;
  if (!given.seq) c.seq = p.seq;
  if (!given.batch) c.batch = p.batch;
  if (!given.rope_theta) c.rope_theta = p.rope_theta;
}

}  // namespace tpx
