// The language model's token stream: which token ids each training step reads, the same on every
// rank and in the reference, from the seed alone.
//
// A stream is a token file's train (or held-out) split, made by tpx_tokenize from real text, or
// `--data synthetic`, ids drawn from the seed (for tests: no file needed). Step t's batch is B
// windows of S + 1 consecutive tokens; window b starts at a position drawn from (seed, t, b).
// Position s of a window is the input of position s and the target of position s − 1: the next
// token comes from the stream itself, before any rank cuts the sequence.
//
// defines: tpx::DataSplit, tpx::kSyntheticData, tpx::TokenBatch, tpx::TokenStream,
//          tpx::default_data(), tpx::resolve_token_source()
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config.h"

namespace tpx {

enum class DataSplit { train, valid };

/// --data's word for the generated stream.
inline constexpr std::string_view kSyntheticData = "synthetic";

/// One step's whole batch, sequence first: tokens[s·B + b] is window b's token s and
/// targets[s·B + b] its token s + 1.
struct TokenBatch {
  std::int64_t seq = 0, batch = 0;
  std::vector<std::int32_t> tokens, targets;
};

class TokenStream {
 public:
  /// The stream c.data names (a token file is read and checked whole: ConfigError naming the
  /// file and the rule it breaks), for c.seq, c.batch, c.vocab and c.seed.
  explicit TokenStream(const BlockConfig& c);

  /// Step `step`'s batch from `split`.
  TokenBatch batch(std::int64_t step, DataSplit split = DataSplit::train) const;
  /// Words for the header: "synthetic (V ids from the seed)" or the file with its split sizes.
  std::string describe() const;

 private:
  const std::vector<std::uint16_t>& ids(DataSplit split) const;

  std::int64_t seq_, batch_, vocab_;
  std::uint64_t seed_;
  std::string path_;  // empty: synthetic
  std::vector<std::uint16_t> train_, valid_;
};

/// --data's default: the token file the build made from real text (token_file.h's
/// default_token_file()) where it exists, else the generated stream.
std::string default_data();

/// --data and --vocab checked and resolved (c.vocab: the token file's vocabulary when --vocab is
/// not given, kSyntheticVocab for the generated stream): one sentence naming the flag or file
/// and the rule for a file that is missing or broken, a --vocab smaller than the file's, or a
/// split shorter than one sequence + 1; nothing when they fit.
std::optional<std::string> resolve_token_source(BlockConfig& c, bool vocab_given);

}  // namespace tpx
