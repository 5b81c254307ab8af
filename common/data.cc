#include "data.h"

#include <fmt/format.h>

#include <filesystem>

#include "check.h"
#include "init.h"
#include "token_file.h"

namespace tpx {
namespace {

/// Where the held-out split's draws start, far from the train split's.
constexpr std::uint64_t kValidDraws = std::uint64_t{1} << 62;

}  // namespace

TokenStream::TokenStream(const BlockConfig& c)
    : seq_(c.seq), batch_(c.batch), vocab_(c.vocab), seed_(c.seed) {
  if (c.data == kSyntheticData) return;
  TokenFile file = read_token_file(c.data);
  path_ = c.data;
  train_ = std::move(file.train);
  valid_ = std::move(file.valid);
  // resolve_token_source() has refused the rest; a caller that skipped it still gets a sentence.
  for (const auto* split : {&train_, &valid_})
    if (split->size() < std::size_t(seq_) + 1)
      throw ConfigError(
          fmt::format("token file '{}': a split of {} tokens is shorter than one "
                      "sequence + 1 (--seq {})",
                      path_, split->size(), seq_));
}

const std::vector<std::uint16_t>& TokenStream::ids(DataSplit split) const {
  return split == DataSplit::train ? train_ : valid_;
}

TokenBatch TokenStream::batch(std::int64_t step, DataSplit split) const {
  TokenBatch out;
  out.seq = seq_;
  out.batch = batch_;
  const auto n = static_cast<std::size_t>(seq_ * batch_);
  out.tokens.resize(n);
  out.targets.resize(n);
  const std::uint64_t draws = split == DataSplit::valid ? kValidDraws : 0;
  TPX_CHECK(path_.empty() || ids(split).size() > std::size_t(seq_), "a split shorter than S + 1");
  for (std::int64_t b = 0; b < batch_; ++b) {
    const std::uint64_t window = draws + std::uint64_t(step * batch_ + b);
    // The window's S + 1 tokens: from the file at a drawn start, or drawn one by one.
    auto token = [&](std::int64_t p) -> std::int32_t {
      if (path_.empty()) {
        const std::uint64_t index = window * std::uint64_t(seq_ + 1) + std::uint64_t(p);
        return std::int32_t(bits_at(seed_, TensorId::tokens, index) % std::uint64_t(vocab_));
      }
      const auto& stream = ids(split);
      const std::uint64_t starts = stream.size() - std::uint64_t(seq_);  // ≥ 1: checked
      const std::uint64_t start = bits_at(seed_, TensorId::windows, window) % starts;
      return std::int32_t(stream[start + std::uint64_t(p)]);
    };
    for (std::int64_t s = 0; s < seq_; ++s) {
      const auto i = static_cast<std::size_t>(s * batch_ + b);
      out.tokens[i] = token(s);
      out.targets[i] = token(s + 1);
    }
  }
  return out;
}

std::string TokenStream::describe() const {
  if (path_.empty()) return fmt::format("synthetic ({} ids drawn from the seed)", vocab_);
  return fmt::format("{} ({} train, {} held-out tokens)", path_, train_.size(), valid_.size());
}

std::string default_data() {
  const std::string corpus = default_token_file();
  std::error_code ec;
  return std::filesystem::is_regular_file(corpus, ec) ? corpus : std::string(kSyntheticData);
}

std::optional<std::string> resolve_token_source(BlockConfig& c, bool vocab_given) {
  if (c.data.empty()) return "--data: the path is empty (a token file, or synthetic)";
  if (c.data == kSyntheticData) {
    if (!vocab_given) c.vocab = kSyntheticVocab;
    return std::nullopt;
  }
  try {
    const TokenFile file = read_token_file(c.data);  // every rule of the format, every id
    if (!vocab_given) c.vocab = file.vocab;
    if (c.vocab < file.vocab)
      return fmt::format(
          "--vocab {} is smaller than the vocabulary {} of token file '{}' (its "
          "ids reach {}); leave --vocab out to use the file's",
          c.vocab, file.vocab, c.data, file.vocab - 1);
    auto short_split = [&](const std::vector<std::uint16_t>& ids, const char* name) {
      return fmt::format(
          "token file '{}': its {} split of {} tokens is shorter than one "
          "sequence + 1 (--seq {} needs {})",
          c.data, name, ids.size(), c.seq, c.seq + 1);
    };
    if (file.train.size() < std::size_t(c.seq) + 1) return short_split(file.train, "train");
    if (c.eval_every > 0 && file.valid.size() < std::size_t(c.seq) + 1)
      return short_split(file.valid, "held-out");
  } catch (const ConfigError& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

}  // namespace tpx
