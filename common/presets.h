// Models by name (--model NAME): the Llama 3 family as Meta published it, the tutorial's own
// small model, and three mixtures of experts for stage 10 (Mixtral 8x7B, DeepSeek-V3, Llama 4
// Maverick). A preset sets the model's shape, its vocabulary V and a training shape (S, B); every
// flag given on the command line or in a --config file wins over it.
//
// defines: tpx::PresetExperts, tpx::ModelPreset, tpx::model_presets(), tpx::find_preset(), tpx::preset_names(),
//          tpx::apply_preset()
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "config.h"

namespace tpx {

/// A mixture-of-experts model's experts (stage 10's flags, common/moe_flags.h); experts == 0: a
/// dense model.
struct PresetExperts {
  std::int64_t experts = 0, topk = 0, expert_ffn = 0;
  std::int64_t shared = 0;  ///< NS shared experts of width FE
  std::int64_t every = 1;   ///< --moe-every
  bool sigmoid = false;     ///< --router sigmoid (else softmax)
  bool bias = false;        ///< --balance bias (else aux)
};

struct ModelPreset {
  std::string_view name;     ///< the --model word, e.g. "llama3-8b"
  std::string_view summary;  ///< one line for --help and the listings
  std::int64_t hidden, heads, kv_heads, ffn, layers, seq, batch;
  double rope_theta;
  std::int64_t vocab;  ///< V of the language model (the tokenizer's vocabulary)
  PresetExperts moe;   ///< its experts (only stage 10 trains a preset that has them)
};

/// Every preset, the tutorial's first (the default config: choosing it changes nothing).
std::span<const ModelPreset> model_presets();
/// The preset called `name`, or nullptr.
const ModelPreset* find_preset(std::string_view name);
/// "tutorial, llama3-8b, llama3-70b, llama3-405b".
std::string preset_names();

/// Which of the preset's fields a caller has set itself (and keeps).
struct GivenSizes {
  bool hidden = false, heads = false, kv_heads = false, ffn = false, layers = false, seq = false,
       batch = false, rope_theta = false;
};
/// Sets the fields of `c` that `given` does not mark to the preset's values; not V (the stages
/// take theirs from the token file; tpx_project reads ModelPreset::vocab itself).
void apply_preset(const ModelPreset& p, const GivenSizes& given, BlockConfig& c);

}  // namespace tpx
