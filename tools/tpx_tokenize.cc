// tpx_tokenize: trains the project's byte-level BPE tokenizer (common/tokenizer.h) on a text and
// writes the text as a token file (common/token_file.h); decodes a token file or encodes a string.
//
//   tpx_tokenize --text FILE --vocab V [--valid-fraction F] --tokenizer OUT.json --output OUT.tokens
//   tpx_tokenize --tokenizer T.json --decode FILE.tokens [--split train|valid] [--count N]
//   tpx_tokenize --tokenizer T.json --encode "text"
//
// Training holds out the last fraction F of the text's lines (rounded, at least one line, and at
// least one left to train on): the tokenizer learns from the rest alone, and both parts are
// encoded with it, the held-out part after the training part in the token file. Bad flags or
// files: one line on stderr and exit 2, before anything is written.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "common/check.h"
#include "common/cli_hint.h"
#include "common/output.h"
#include "common/token_file.h"
#include "common/tokenizer.h"

namespace {

struct Options {
  std::string text, tokenizer, output, decode, encode, split = "train";
  std::int64_t vocab = 4096, count = -1;
  double valid_fraction = 0.1;
};

std::vector<std::uint16_t> as_u16(const std::vector<std::int32_t>& ids) {
  return {ids.begin(), ids.end()};  // every id < kMaxTokenizerVocab ≤ 65536
}

// Trains on all but the last fraction of the lines, then writes the tokenizer and token file.
void train(const Options& o) {
  using tpx::ConfigError;
  if (o.tokenizer.empty() || o.output.empty())
    throw ConfigError("--text needs --tokenizer (the JSON to write) and --output (the token file)");
  if (!(o.valid_fraction > 0.0 && o.valid_fraction < 1.0))
    throw ConfigError(fmt::format(
        "--valid-fraction must be above 0 and below 1, the share of lines held out (got {:g})",
        o.valid_fraction));
  if (o.vocab < tpx::kMinTokenizerVocab || o.vocab > tpx::kMaxTokenizerVocab)
    throw ConfigError(fmt::format("--vocab must be {} (the bytes) … {} (got {})",
                                  tpx::kMinTokenizerVocab, tpx::kMaxTokenizerVocab, o.vocab));
  const std::vector<tpx::NamedPath> outputs{{"--tokenizer", o.tokenizer}, {"--output", o.output}};
  if (const std::string p = tpx::output_collision(outputs, {{"--text", o.text}}); !p.empty())
    throw ConfigError(p);
  for (const auto& out : outputs)
    if (const std::string p = tpx::output_file_problem(out.flag, out.path); !p.empty())
      throw ConfigError(p);
  const std::string text = tpx::read_input_file(o.text, "--text");
  // Line starts; a last line without its newline counts as a line.
  std::vector<std::size_t> starts;
  for (std::size_t i = 0; i < text.size(); i = text.find('\n', i) + 1) {
    starts.push_back(i);
    if (text.find('\n', i) == std::string::npos) break;
  }
  const auto lines = std::int64_t(starts.size());
  if (lines < 2)
    throw ConfigError(
        fmt::format("--text '{}': {} line(s); a held-out split needs a text of at least 2 lines",
                    o.text, lines));
  const auto held =
      std::clamp<std::int64_t>(std::llround(o.valid_fraction * double(lines)), 1, lines - 1);
  const std::string_view all(text);
  const std::string_view train_text = all.substr(0, starts[std::size_t(lines - held)]);
  const std::string_view valid_text = all.substr(starts[std::size_t(lines - held)]);

  const auto t0 = std::chrono::steady_clock::now();
  const tpx::Tokenizer tok = tpx::Tokenizer::train(train_text, o.vocab);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  tpx::TokenFile f;
  f.vocab = tok.vocab();
  f.train = as_u16(tok.encode(train_text));
  f.valid = as_u16(tok.encode(valid_text));
  tok.save(o.tokenizer);
  tpx::write_token_file(o.output, f);
  std::printf(
      "tpx_tokenize: %s: %lld lines, the last %lld held out; vocab %lld trained in %.2f s\n"
      "  train: %zu bytes -> %zu tokens (%.2f bytes/token)\n"
      "  held-out: %zu bytes -> %zu tokens (%.2f bytes/token)\n"
      "  wrote %s and %s\n",
      o.text.c_str(), static_cast<long long>(lines), static_cast<long long>(held),
      static_cast<long long>(o.vocab), seconds, train_text.size(), f.train.size(),
      double(train_text.size()) / double(f.train.size()), valid_text.size(), f.valid.size(),
      double(valid_text.size()) / double(f.valid.size()), o.tokenizer.c_str(), o.output.c_str());
}

void decode(const Options& o) {
  const tpx::Tokenizer tok = tpx::Tokenizer::load(o.tokenizer);
  const tpx::TokenFile f = tpx::read_token_file(o.decode);
  if (f.vocab != tok.vocab())
    throw tpx::ConfigError(fmt::format(
        "--decode '{}' has vocab {} but --tokenizer '{}' has {}: decode with the tokenizer that "
        "made it",
        o.decode, f.vocab, o.tokenizer, tok.vocab()));
  const auto& split = o.split == "train" ? f.train : f.valid;
  const std::size_t n = o.count < 0 ? split.size() : std::min(split.size(), std::size_t(o.count));
  const std::vector<std::int32_t> ids(split.begin(), split.begin() + std::ptrdiff_t(n));
  const std::string text = tok.decode(ids);
  std::fwrite(text.data(), 1, text.size(), stdout);
}

void encode(const Options& o) {
  const tpx::Tokenizer tok = tpx::Tokenizer::load(o.tokenizer);
  std::string line;
  for (const std::int32_t id : tok.encode(o.encode))
    line += fmt::format("{}{}", line.empty() ? "" : " ", id);
  std::puts(line.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "tpx_tokenize: train the byte-level BPE tokenizer on a text and write its token file (the "
      "stages' --data); or decode a token file, or encode a string"};
  app.footer(
      "Train:  tpx_tokenize --text FILE --vocab V [--valid-fraction F] --tokenizer OUT.json "
      "--output OUT.tokens\n"
      "Decode: tpx_tokenize --tokenizer T.json --decode FILE.tokens [--split valid] [--count N]\n"
      "Encode: tpx_tokenize --tokenizer T.json --encode \"text\"\n"
      "Exit status: 0 done; 1 a failed write; 2 bad input (a flag, a file).");
  Options o;
  auto* text = app.add_option("--text", o.text, "the text to train on and tokenize (bytes)");
  auto* vocab = app.add_option("--vocab", o.vocab,
                               fmt::format("with --text: V, the vocabulary size ({} … {})",
                                           tpx::kMinTokenizerVocab, tpx::kMaxTokenizerVocab))
                    ->capture_default_str();
  auto* valid = app.add_option("--valid-fraction", o.valid_fraction,
                               "with --text: the share of the text's lines held out, from its end")
                    ->capture_default_str();
  app.add_option("--tokenizer", o.tokenizer,
                 "the tokenizer's JSON: written with --text, read with --decode or --encode");
  auto* output = app.add_option("--output", o.output, "with --text: the token file to write");
  auto* dec = app.add_option("--decode", o.decode, "a token file to print as text");
  auto* split = app.add_option("--split", o.split, "with --decode: train, or valid (held out)")
                    ->check(CLI::IsMember({"train", "valid"}))
                    ->capture_default_str();
  auto* count = app.add_option("--count", o.count, "with --decode: print the first N tokens only");
  auto* enc = app.add_option("--encode", o.encode, "a string to print as token ids");
  text->excludes(dec)->excludes(enc);
  dec->excludes(enc);
  for (auto* opt : {vocab, valid, output}) opt->needs(text);
  for (auto* opt : {split, count}) opt->needs(dec);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "tpx_tokenize: error: %s\n", tpx::parse_error_text(app, e).c_str());
    return 2;
  }
  try {
    if (app.count("--count") && o.count < 0)
      throw tpx::ConfigError(fmt::format("--count must be 0 or more tokens (got {})", o.count));
    if (app.count("--text"))
      train(o);
    else if (app.count("--decode") || app.count("--encode")) {
      if (o.tokenizer.empty())
        throw tpx::ConfigError(fmt::format("{} needs --tokenizer (the JSON that --text wrote)",
                                           app.count("--decode") ? "--decode" : "--encode"));
      if (app.count("--decode"))
        decode(o);
      else
        encode(o);
    } else {
      throw tpx::ConfigError("give --text (train), --decode or --encode (see --help)");
    }
  } catch (const tpx::ConfigError& e) {
    std::fprintf(stderr, "tpx_tokenize: error: %s\n", tpx::printable(e.what()).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tpx_tokenize: %s\n", tpx::printable(e.what()).c_str());
    return 1;
  }
  return 0;
}
