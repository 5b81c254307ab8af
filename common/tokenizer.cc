#include "tokenizer.h"

#include <algorithm>
#include <queue>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "check.h"
#include "output.h"
#include "token_file.h"

namespace tpx {
namespace {

using Pair = std::pair<std::int32_t, std::int32_t>;

constexpr std::string_view kFormat = "tpx-bpe";
constexpr int kVersion = 1;
constexpr std::string_view kWordRule =
    "a run of letters (bytes >= 0x80 count as letters), of digits, or of other printable bytes, "
    "each with the one space before it; or a run of white space less a last space that a word "
    "follows";

std::uint64_t key_of(std::int32_t a, std::int32_t b) {
  return (std::uint64_t(std::uint32_t(a)) << 32) | std::uint32_t(b);
}

enum class ByteClass { space, letter, digit, other };

ByteClass class_of(unsigned char c) {
  if (c == ' ' || (c >= '\t' && c <= '\r')) return ByteClass::space;
  if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c >= 0x80) return ByteClass::letter;
  if (c >= '0' && c <= '9') return ByteClass::digit;
  return ByteClass::other;
}

// How far the run of `cls` bytes starting at `i` reaches.
std::size_t run_end(std::string_view text, std::size_t i, ByteClass cls) {
  while (i < text.size() && class_of(static_cast<unsigned char>(text[i])) == cls) ++i;
  return i;
}

void check_vocab(std::int64_t vocab) {
  if (vocab < kMinTokenizerVocab || vocab > kMaxTokenizerVocab)
    throw ConfigError(fmt::format(
        "--vocab must be {} (the bytes) … {} (got {}): a byte-level tokenizer's vocabulary",
        kMinTokenizerVocab, kMaxTokenizerVocab, vocab));
}

// The most frequent pair first; of equal counts, the smallest pair.
struct Candidate {
  std::int64_t count;
  std::uint64_t key;
  bool operator<(const Candidate& o) const {  // "lower priority than"
    return count != o.count ? count < o.count : key > o.key;
  }
};

}  // namespace

std::vector<std::string_view> split_words(std::string_view text) {
  std::vector<std::string_view> words;
  std::size_t i = 0;
  while (i < text.size()) {
    const ByteClass c = class_of(static_cast<unsigned char>(text[i]));
    std::size_t end;
    if (c != ByteClass::space) {
      end = run_end(text, i, c);
    } else if (text[i] == ' ' && i + 1 < text.size() &&
               class_of(static_cast<unsigned char>(text[i + 1])) != ByteClass::space) {
      // One space and the word after it.
      end = run_end(text, i + 1, class_of(static_cast<unsigned char>(text[i + 1])));
    } else {
      end = run_end(text, i, ByteClass::space);
      // A last space that a word follows goes with that word (unless it is the whole run).
      if (end < text.size() && text[end - 1] == ' ' && end - 1 > i) --end;
    }
    words.push_back(text.substr(i, end - i));
    i = end;
  }
  return words;
}

Tokenizer::Tokenizer(std::vector<Pair> merges) : merges_(std::move(merges)) {
  bytes_.reserve(256 + merges_.size());
  for (int b = 0; b < 256; ++b) bytes_.emplace_back(1, static_cast<char>(b));
  for (std::size_t i = 0; i < merges_.size(); ++i) {
    const auto [a, b] = merges_[i];
    bytes_.push_back(bytes_[std::size_t(a)] + bytes_[std::size_t(b)]);
    rank_.emplace(key_of(a, b), std::int32_t(i));
  }
}

Tokenizer Tokenizer::train(std::string_view text, std::int64_t vocab) {
  check_vocab(vocab);
  // Each distinct word once, with how often it occurs.
  std::unordered_map<std::string_view, std::int64_t> freq;
  for (const std::string_view w : split_words(text)) ++freq[w];
  std::vector<std::string_view> distinct;
  distinct.reserve(freq.size());
  for (const auto& [w, n] : freq) distinct.push_back(w);
  std::sort(distinct.begin(), distinct.end());  // a fixed order, whatever the hash does

  struct Word {
    std::vector<std::int32_t> ids;
    std::int64_t count;
  };
  std::vector<Word> words;
  words.reserve(distinct.size());
  // counts[pair]: its occurrences in the text; where[pair]: the words that held it when it was
  // counted (some may have lost it since: checked when visited).
  std::unordered_map<std::uint64_t, std::int64_t> counts;
  std::unordered_map<std::uint64_t, std::vector<std::int32_t>> where;
  for (const std::string_view w : distinct) {
    Word word{{}, freq[w]};
    for (const char c : w) word.ids.push_back(static_cast<unsigned char>(c));
    const auto index = std::int32_t(words.size());
    for (std::size_t j = 0; j + 1 < word.ids.size(); ++j) {
      const std::uint64_t k = key_of(word.ids[j], word.ids[j + 1]);
      counts[k] += word.count;
      auto& list = where[k];
      if (list.empty() || list.back() != index) list.push_back(index);
    }
    words.push_back(std::move(word));
  }
  // Every change of a count pushes the pair again; an entry whose count is no longer the pair's
  // is stale and skipped when it surfaces.
  std::priority_queue<Candidate> queue;
  for (const auto& [k, n] : counts) queue.push({n, k});

  std::vector<Pair> merges;
  const auto n_merges = std::size_t(vocab - kMinTokenizerVocab);
  merges.reserve(n_merges);
  std::vector<std::size_t> visited(words.size(), 0);  // the merge that last visited each word
  std::vector<std::uint64_t> touched;
  std::vector<std::int32_t> merged;
  while (merges.size() < n_merges) {
    if (queue.empty())
      throw ConfigError(fmt::format(
          "--vocab {}: the text holds only enough pairs for {} ids (its words are each one token)",
          vocab, kMinTokenizerVocab + std::int64_t(merges.size())));
    const Candidate top = queue.top();
    queue.pop();
    const auto found = counts.find(top.key);
    if (found == counts.end() || found->second != top.count) continue;
    const auto a = std::int32_t(top.key >> 32), b = std::int32_t(top.key & 0xffffffffu);
    const auto made = std::int32_t(kMinTokenizerVocab + std::int64_t(merges.size()));
    merges.emplace_back(a, b);
    touched.clear();
    auto add = [&](std::uint64_t k, std::int64_t n) {
      counts[k] += n;
      touched.push_back(k);
    };
    // The words that held the pair; the list is the pair's no more (it is merged everywhere).
    const std::vector<std::int32_t> holders = std::move(where[top.key]);
    where.erase(top.key);
    for (const std::int32_t index : holders) {
      if (visited[std::size_t(index)] == merges.size()) continue;
      visited[std::size_t(index)] = merges.size();
      Word& w = words[std::size_t(index)];
      merged.clear();
      for (std::size_t j = 0; j < w.ids.size(); ++j) {
        if (j + 1 < w.ids.size() && w.ids[j] == a && w.ids[j + 1] == b) {
          merged.push_back(made);
          ++j;
        } else {
          merged.push_back(w.ids[j]);
        }
      }
      if (merged.size() == w.ids.size()) continue;  // lost the pair to an earlier merge
      for (std::size_t j = 0; j + 1 < w.ids.size(); ++j)
        add(key_of(w.ids[j], w.ids[j + 1]), -w.count);
      for (std::size_t j = 0; j + 1 < merged.size(); ++j) {
        const std::uint64_t k = key_of(merged[j], merged[j + 1]);
        add(k, w.count);
        if (merged[j] == made || merged[j + 1] == made) {
          auto& list = where[k];
          if (list.empty() || list.back() != index) list.push_back(index);
        }
      }
      w.ids.swap(merged);
    }
    counts.erase(top.key);  // every occurrence is merged now
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (const std::uint64_t k : touched) {
      const auto it = counts.find(k);
      if (it == counts.end()) continue;
      if (it->second > 0)
        queue.push({it->second, k});
      else
        counts.erase(it);
    }
  }
  return Tokenizer(std::move(merges));
}

Tokenizer Tokenizer::load(const std::string& path) {
  const std::string text = read_input_file(path, "tokenizer");
  auto bad = [&](std::string_view rule) {
    return ConfigError(fmt::format("tokenizer '{}': {}", path, rule));
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    throw bad("not JSON (a tokenizer is the JSON file tpx_tokenize --tokenizer writes)");
  }
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormat)
    throw bad(fmt::format("not a tokenizer (no \"format\": \"{}\")", kFormat));
  if (!j.contains("version") || j["version"] != kVersion)
    throw bad(fmt::format("unsupported version (this build reads version {})", kVersion));
  if (!j.contains("vocab") || !j["vocab"].is_number_integer())
    throw bad("\"vocab\" must be an integer");
  const auto vocab = j["vocab"].get<std::int64_t>();
  if (vocab < kMinTokenizerVocab || vocab > kMaxTokenizerVocab)
    throw bad(fmt::format("\"vocab\" must be {} … {} (got {})", kMinTokenizerVocab,
                          kMaxTokenizerVocab, vocab));
  if (!j.contains("merges") || !j["merges"].is_array() ||
      std::int64_t(j["merges"].size()) != vocab - kMinTokenizerVocab)
    throw bad(fmt::format("\"merges\" must be a list of vocab − 256 = {} pairs",
                          vocab - kMinTokenizerVocab));
  std::vector<Pair> merges;
  merges.reserve(std::size_t(vocab - kMinTokenizerVocab));
  std::unordered_map<std::uint64_t, std::size_t> seen;
  for (const auto& m : j["merges"]) {
    const std::size_t i = merges.size();
    const std::int64_t made = kMinTokenizerVocab + std::int64_t(i);
    if (!m.is_array() || m.size() != 2 || !m[0].is_number_integer() || !m[1].is_number_integer())
      throw bad(fmt::format("merge {} must be a pair of ids [a, b]", i));
    const auto a = m[0].get<std::int64_t>(), b = m[1].get<std::int64_t>();
    if (a < 0 || b < 0 || a >= made || b >= made)
      throw bad(fmt::format("merge {} makes id {} from [{}, {}]: each id must be 0 … {}", i, made,
                            a, b, made - 1));
    const auto [it, fresh] = seen.emplace(key_of(std::int32_t(a), std::int32_t(b)), i);
    if (!fresh) throw bad(fmt::format("merge {} repeats merge {} [{}, {}]", i, it->second, a, b));
    merges.emplace_back(std::int32_t(a), std::int32_t(b));
  }
  return Tokenizer(std::move(merges));
}

void Tokenizer::save(const std::string& path) const {
  std::string out = fmt::format(
      "{{\n  \"format\": \"{}\",\n  \"version\": {},\n  \"vocab\": {},\n  \"words\": {},\n"
      "  \"merges\": [",
      kFormat, kVersion, vocab(), nlohmann::json(kWordRule).dump());
  for (std::size_t i = 0; i < merges_.size(); ++i)
    out += fmt::format("{}\n    [{}, {}]", i ? "," : "", merges_[i].first, merges_[i].second);
  out += merges_.empty() ? "]\n}\n" : "\n  ]\n}\n";
  write_text_file(path, out);
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<std::int32_t> out;
  std::unordered_map<std::string_view, std::pair<std::size_t, std::size_t>> done;  // word -> ids
  // One word's symbols as a linked list; candidate merges ordered by rank, then by position (so
  // the occurrences of one pair merge left to right, as training merged them).
  std::vector<std::int32_t> id;
  std::vector<std::int64_t> next, prev;
  using Entry = std::tuple<std::int32_t, std::int64_t>;  // rank, left position
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> queue;
  auto rank_at = [&](std::int64_t left) -> std::int32_t {
    if (left < 0 || next[std::size_t(left)] < 0) return -1;
    const auto it =
        rank_.find(key_of(id[std::size_t(left)], id[std::size_t(next[std::size_t(left)])]));
    return it == rank_.end() ? -1 : it->second;
  };
  auto offer = [&](std::int64_t left) {
    if (const std::int32_t r = rank_at(left); r >= 0) queue.emplace(r, left);
  };
  for (const std::string_view word : split_words(text)) {
    if (const auto it = done.find(word); it != done.end()) {
      const auto [from, n] = it->second;
      for (std::size_t i = 0; i < n; ++i) out.push_back(out[from + i]);
      continue;
    }
    const auto n = std::int64_t(word.size());
    id.resize(std::size_t(n));
    next.resize(std::size_t(n));
    prev.resize(std::size_t(n));
    for (std::int64_t i = 0; i < n; ++i) {
      id[std::size_t(i)] = static_cast<unsigned char>(word[std::size_t(i)]);
      next[std::size_t(i)] = i + 1 < n ? i + 1 : -1;
      prev[std::size_t(i)] = i - 1;
    }
    for (std::int64_t i = 0; i + 1 < n; ++i) offer(i);
    while (!queue.empty()) {
      const auto [r, left] = queue.top();
      queue.pop();
      if (id[std::size_t(left)] < 0 || rank_at(left) != r) continue;  // gone, or changed
      const std::int64_t right = next[std::size_t(left)];
      id[std::size_t(left)] = std::int32_t(kMinTokenizerVocab + r);
      id[std::size_t(right)] = -1;
      next[std::size_t(left)] = next[std::size_t(right)];
      if (next[std::size_t(right)] >= 0) prev[std::size_t(next[std::size_t(right)])] = left;
      offer(prev[std::size_t(left)]);
      offer(left);
    }
    const std::size_t from = out.size();
    for (std::int64_t i = 0; i >= 0; i = next[std::size_t(i)]) out.push_back(id[std::size_t(i)]);
    done.emplace(word, std::pair{from, out.size() - from});
  }
  return out;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab())
      throw ConfigError(fmt::format("token {} at index {} is outside the vocabulary 0 … {}", ids[i],
                                    i, vocab() - 1));
    out += bytes_[std::size_t(ids[i])];
  }
  return out;
}

namespace {

/// A UTF-8 sequence that starts with byte `b`: its length (0: no sequence starts so) and the range
/// of its second byte (RFC 3629, section 4: no overlong forms, surrogates or code points above
/// U+10FFFF); the later bytes are 0x80 … 0xBF.
struct Utf8Lead {
  std::size_t length = 0;
  unsigned char lo = 0x80, hi = 0xBF;
};

Utf8Lead utf8_lead(unsigned char b) {
  if (b < 0x80) return {1};
  if (b >= 0xC2 && b <= 0xDF) return {2};
  if (b == 0xE0) return {3, 0xA0};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3};
  if (b == 0xF0) return {4, 0x90};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  if (b >= 0xF1 && b <= 0xF3) return {4};
  return {};
}

}  // namespace

std::string valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const auto at = [&](std::size_t i) { return static_cast<unsigned char>(bytes[i]); };
  for (std::size_t i = 0; i < bytes.size();) {
    const Utf8Lead lead = utf8_lead(at(i));
    const std::size_t n = lead.length;
    bool ok = n > 0 && i + n <= bytes.size();
    if (ok && n > 1) ok = at(i + 1) >= lead.lo && at(i + 1) <= lead.hi;
    for (std::size_t k = 2; ok && k < n; ++k) ok = at(i + k) >= 0x80 && at(i + k) <= 0xBF;
    if (ok) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
    }
  }
  return out;
}

}  // namespace tpx
