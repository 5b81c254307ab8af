// The language model's tokenizer: byte-level byte-pair encoding (BPE), trained by the project.
//
// Ids 0 … 255 are the 256 byte values, so every byte string has an encoding (invalid UTF-8 too)
// and decode(encode(x)) == x. Training adds ids 256 … V − 1, one per merge: it counts how often
// each pair of adjacent ids occurs in the text, makes the most frequent pair a new id, replaces it
// everywhere, and repeats until the vocabulary holds V ids. Ties go to the smallest pair (first
// id, then second), so the same text and V always give the same merges.
//
// Merges never cross a word boundary. The text is first cut into words (split_words()), and
// training counts each distinct word once with its frequency: a 4.4 MB text has ~30 000 distinct
// words, and a merge only revisits the words that hold its pair. Encoding cuts the same way and
// applies, within each word, the merge of lowest rank among the word's adjacent pairs until none
// applies (as GPT-2 does).
//
// The tokenizer is saved as JSON: {"format": "tpx-bpe", "version": 1, "vocab": V, "words":
// "<the split rule>", "merges": [[a, b], …]}, merge i making id 256 + i from ids a and b.
//
// defines: tpx::Tokenizer, tpx::split_words(), tpx::valid_utf8(), tpx::kMinTokenizerVocab,
//          tpx::kMaxTokenizerVocab
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tpx {

/// The vocabulary sizes train() accepts: the 256 bytes at least; at most what a u16 token file
/// holds with room to spare.
inline constexpr std::int64_t kMinTokenizerVocab = 256;
inline constexpr std::int64_t kMaxTokenizerVocab = 32768;

/// `text` cut into words, in order, with nothing lost (their concatenation is `text`). A word is
/// one of:
///   - a run of letters (A–Z, a–z, and every byte ≥ 0x80, so UTF-8 letters stay in their word),
///     a run of digits, or a run of other printable bytes (punctuation), each with the one space
///     before it if there is one (" beginning", " 12", " (");
///   - a run of white space (space, tab, newline, CR, VT, FF), less a last space that a word
///     follows (that space belongs to the word).
/// So "In the beginning,\n" is "In", " the", " beginning", ",", "\n".
std::vector<std::string_view> split_words(std::string_view text);

class Tokenizer {
 public:
  /// Trains on `text` up to `vocab` ids. Throws tpx::ConfigError for a vocab outside kMinTokenizerVocab …
  /// kMaxTokenizerVocab ("--vocab ...") or one the text cannot fill (its words run out of pairs first).
  static Tokenizer train(std::string_view text, std::int64_t vocab);

  /// Reads a tokenizer save() wrote. Throws tpx::ConfigError naming the file and the rule for a
  /// file that cannot be read, is not such JSON, or whose merges do not make a vocabulary (a
  /// merge naming an id not yet made, a repeated pair, a count that is not vocab − 256).
  static Tokenizer load(const std::string& path);

  /// Writes the JSON whole or not at all (common/output.h).
  void save(const std::string& path) const;

  /// The ids of `text`, each word's merges applied by rank.
  std::vector<std::int32_t> encode(std::string_view text) const;

  /// The bytes of `ids` concatenated. Throws tpx::ConfigError naming the first id outside
  /// 0 … vocab − 1 and its index.
  std::string decode(std::span<const std::int32_t> ids) const;

  /// V: 256 + the number of merges.
  std::int64_t vocab() const { return std::int64_t(bytes_.size()); }

  /// Merge i made id 256 + i from this pair.
  const std::vector<std::pair<std::int32_t, std::int32_t>>& merges() const { return merges_; }

 private:
  explicit Tokenizer(std::vector<std::pair<std::int32_t, std::int32_t>> merges);

  std::vector<std::pair<std::int32_t, std::int32_t>> merges_;
  std::vector<std::string> bytes_;                        // bytes_[id]: what id decodes to
  std::unordered_map<std::uint64_t, std::int32_t> rank_;  // pair (a << 32 | b) -> its merge
};

/// `bytes` with each byte that does not belong to a well-formed UTF-8 sequence (RFC 3629: no
/// overlong forms, no surrogates, nothing above U+10FFFF) replaced by U+FFFD, so that text decoded
/// from sampled ids can be printed and written to JSON.
std::string valid_utf8(std::string_view bytes);

}  // namespace tpx
