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

constexpr std::array<ModelPreset, 4> kPresets = {{
    {"tutorial",
     "the tutorial's small model, the default (H 256, 8 heads, F 1024, L 2, S 128, B 2, V 4096)",
     256, 8, 8, 1024, 2, 128, 2, kLlama3RopeTheta, 4096},
    {"llama3-8b", "Llama 3 8B (H 4096, 32 heads, 8 KV heads, F 14336, L 32, S 8192, B 2, V 128256)",
     4096, 32, 8, 14336, 32, 8192, 2, kLlama3RopeTheta, kLlama3Vocab},
    {"llama3-70b",
     "Llama 3 70B (H 8192, 64 heads, 8 KV heads, F 28672, L 80, S 8192, B 2, V 128256)", 8192, 64,
     8, 28672, 80, 8192, 2, kLlama3RopeTheta, kLlama3Vocab},
    {"llama3-405b",
     "Llama 3 405B (H 16384, 128 heads, 8 KV heads, F 53248, L 126, S 8192, B 2, V 128256)", 16384,
     128, 8, 53248, 126, 8192, 2, kLlama3RopeTheta, kLlama3Vocab},
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
