// Text from the trained language model (--generate N): the prompt's ids, then N more, each drawn
// from the model's next-token distribution at the last position.
//
// Rank 0 holds the whole trained model (gathered after the last step: TrainResult::trained) and
// runs it as one device would: the embedding, the L blocks and the head of common/lm.h and
// common/block.h over a Parallelism with no communication, in fp32, batch 1. Each new token costs
// a full forward over the last ≤ S ids of the text so far (no KV cache: a few hundred tokens of a
// small model take seconds on the cpu, and the block stays the one every stage trains). Position 0
// is the window's first id, as in training.
//
// The token file's tokenizer: `<name>.tokenizer.json` beside the token file `<name>.tokens` (the
// build writes both: tools/CMakeLists.txt), so `--data DIR/kjv-4096.tokens` decodes with
// `DIR/kjv-4096.tokenizer.json`.
//
// Sampling: --temperature 0 (the default) takes the most likely id (the smallest id on a tie);
// T > 0 draws from softmax(logits / T), over the --top-k most likely ids when K > 0. The draw of
// new token i is bits_at(seed, TensorId::sample, i) (common/init.h), so a run repeats.
//
// defines: tpx::tokenizer_path_for(), tpx::check_generation(), tpx::TrainedModel,
//          tpx::next_token(), tpx::generate()
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "config.h"
#include "trainer.h"

namespace tpx {

/// The tokenizer of the token file `token_file`: its name with the extension ".tokens" (or, for
/// a name without it, the whole name) followed by ".tokenizer.json".
std::string tokenizer_path_for(const std::string& token_file);

/// --generate, --prompt, --temperature and --top-k checked against the run: one sentence naming
/// the flag or file and the rule (--generate under --task block or --data synthetic, a missing or
/// broken tokenizer, a tokenizer whose vocabulary is not the run's, a prompt of no tokens, a
/// negative temperature or top-k); nothing when they fit or --generate is not given.
std::optional<std::string> check_generation(const BlockConfig& c);

/// The id that follows `logits` (one position's V values) for generated token `index`: the
/// largest logit under temperature 0, else a draw from the seed as above.
std::int32_t next_token(std::span<const float> logits, const GenerateOptions& g, std::uint64_t seed,
                        std::int64_t index);

/// `prompt` continued by c.generate.tokens ids, with the model of `trained` (full tensors, the
/// vocabulary unpadded, as Snapshot holds them). Returns the new ids only.
std::vector<std::int32_t> generate(const BlockConfig& c, const Snapshot& trained,
                                   std::span<const std::int32_t> prompt);

}  // namespace tpx
