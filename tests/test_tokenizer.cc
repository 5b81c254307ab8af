// The language model's text as ids: the byte-level BPE tokenizer (common/tokenizer.h) on texts
// whose merges are worked out by hand, round trips of every byte, its bounds and its JSON; the
// token file (common/token_file.h) round trip and every file it refuses, written byte by byte
// here; tools/tpx_tokenize end to end on a small text and on bad input.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/check.h"
#include "common/token_file.h"
#include "common/tokenizer.h"
#include "test_util.h"

namespace tpx {
namespace {

using Merges = std::vector<std::pair<std::int32_t, std::int32_t>>;

// The message of the tpx::ConfigError `f` throws ("" if it throws none).
template <class F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// A text of every byte value and of random bytes (invalid UTF-8 among them).
std::string random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s;
  for (std::size_t i = 0; i < n; ++i) s.push_back(static_cast<char>(byte(gen)));
  return s;
}

std::string all_bytes() {
  std::string s;
  for (int b = 0; b < 256; ++b) s.push_back(static_cast<char>(b));
  return s;
}

TEST(Tokenizer, SplitsWordsWithTheirLeadingSpace) {
  const std::string text = "In the beginning,\n  God 12 (x)\t\xc3\xa9t\xc3\xa9 ";
  const std::vector<std::string_view> want{
      "In", " the", " beginning",        ",", "\n ", " God", " 12", " (", "x",
      ")",  "\t",   "\xc3\xa9t\xc3\xa9", " "};
  EXPECT_EQ(split_words(text), want);
  EXPECT_TRUE(split_words("").empty());
  EXPECT_EQ(split_words("  a"), (std::vector<std::string_view>{" ", " a"}));
}

// "abab ab abc" is the words "abab", " ab", " abc" (a = 97, b = 98, c = 99, space = 32).
//   pairs: (a,b) 2 + 1 + 1 = 4, (32,a) 2, (b,a) 1, (b,c) 1      -> merge 0: (97, 98) = 256
//   words: [256 256], [32 256], [32 256 99]
//   pairs: (32,256) 2, (256,256) 1, (256,99) 1                   -> merge 1: (32, 256) = 257
//   words: [256 256], [257], [257 99]
//   pairs: (256,256) 1, (257,99) 1: a tie, the smaller pair wins -> merge 2: (256, 256) = 258
//   words: [258], [257], [257 99]                                -> merge 3: (257, 99) = 259
// and then every word is one id: no fifth merge.
TEST(Tokenizer, MergesOfAHandWorkedText) {
  const std::string text = "abab ab abc";
  const Tokenizer t = Tokenizer::train(text, 260);
  EXPECT_EQ(t.vocab(), 260);
  EXPECT_EQ(t.merges(), (Merges{{97, 98}, {32, 256}, {256, 256}, {257, 99}}));
  EXPECT_EQ(t.encode(text), (std::vector<std::int32_t>{258, 257, 259}));
  // By rank, not left to right: " abab" is 32 a b a b -> 32 256 256 (merge 0 twice), then merge 1
  // (32, 256) comes before merge 2 (256, 256): 257 256.
  EXPECT_EQ(t.encode(" abab"), (std::vector<std::int32_t>{257, 256}));
  EXPECT_EQ(t.encode("ba"), (std::vector<std::int32_t>{98, 97}));
  // No merge across words: "b" "a" of "ab" + " ab" are not joined.
  EXPECT_EQ(t.encode("c ab"), (std::vector<std::int32_t>{99, 257}));
  const std::string e = config_error([&] { Tokenizer::train(text, 261); });
  EXPECT_NE(e.find("--vocab 261"), std::string::npos) << e;
  EXPECT_NE(e.find("260 ids"), std::string::npos) << e;
}

// "aaaa aaa": the words "aaaa" (pairs (a,a) x3) and " aaa" ((32,a) x1, (a,a) x2).
//   merge 0: (97, 97) = 256, left to right in each word: [256 256], [32 256 97]
//   pairs: (256,256) 1, (32,256) 1, (256,97) 1: the smallest, (32, 256), is merge 1 = 257
//   words: [256 256], [257 97]; pairs (256,256) 1, (257,97) 1 -> merge 2: (256, 256) = 258
TEST(Tokenizer, RepeatedBytesMergeLeftToRight) {
  const Tokenizer t = Tokenizer::train("aaaa aaa", 259);
  EXPECT_EQ(t.merges(), (Merges{{97, 97}, {32, 256}, {256, 256}}));
  EXPECT_EQ(t.encode("aaaaa"), (std::vector<std::int32_t>{258, 97}));
  EXPECT_EQ(t.encode(" aaa"), (std::vector<std::int32_t>{257, 97}));
}

TEST(Tokenizer, EveryByteRoundTrips) {
  const std::string bytes = all_bytes();
  const Tokenizer plain = Tokenizer::train("anything", 256);  // no merges: ids are the bytes
  const std::vector<std::int32_t> ids = plain.encode(bytes);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[std::size_t(b)], b);
  EXPECT_EQ(plain.decode(ids), bytes);

  const std::string train = random_bytes(20000, 1) + "the quick brown fox, the lazy dog\n";
  const Tokenizer t = Tokenizer::train(train, 700);
  ASSERT_EQ(t.vocab(), 700);
  for (const std::string& s :
       {bytes, random_bytes(5000, 2), std::string("\xff\xfe\xc3(\x80 \xe2\x82 bad utf-8"),
        std::string(3000, ' '), std::string(1000, '\0'), std::string("the quick brown fox"),
        std::string()}) {
    const std::vector<std::int32_t> enc = t.encode(s);
    for (const std::int32_t id : enc) ASSERT_TRUE(id >= 0 && id < 700) << id;
    EXPECT_EQ(t.decode(enc), s);
  }
  EXPECT_LT(t.encode("the quick brown fox").size(), std::string("the quick brown fox").size());
}

TEST(Tokenizer, RefusesVocabOutsideItsRange) {
  for (const std::int64_t v : {-1L, 0L, 255L, 32769L, 65536L}) {
    const std::string e = config_error([&] { Tokenizer::train("some text", v); });
    EXPECT_NE(e.find("--vocab must be 256"), std::string::npos) << v << ": " << e;
    EXPECT_NE(e.find(fmt::format("got {}", v)), std::string::npos) << e;
  }
  EXPECT_EQ(Tokenizer::train("ab", 256).vocab(), 256);
  EXPECT_EQ(Tokenizer::train("ab", 257).vocab(), 257);
}

TEST(Tokenizer, DecodeRefusesAnIdOutsideTheVocab) {
  const Tokenizer t = Tokenizer::train("abab ab abc", 258);
  const std::vector<std::int32_t> ids{97, 257, 258};
  const std::string e = config_error([&] { t.decode(ids); });
  EXPECT_NE(e.find("token 258 at index 2"), std::string::npos) << e;
  const std::vector<std::int32_t> negative{-1};
  EXPECT_NE(config_error([&] { t.decode(negative); }), "");
}

TEST(Tokenizer, SaveLoadKeepsEveryEncoding) {
  test::TempDir dir;
  const std::string train =
      "In the beginning God created the heaven and the earth.\n"
      "And the earth was without form, and void.\n" +
      random_bytes(2000, 3);
  const Tokenizer t = Tokenizer::train(train, 400);
  const std::string path = (dir / "t.json").string();
  t.save(path);
  const Tokenizer back = Tokenizer::load(path);
  EXPECT_EQ(back.vocab(), 400);
  EXPECT_EQ(back.merges(), t.merges());
  for (const std::string& s :
       {train, std::string("And God said, Let there be light"), random_bytes(3000, 4), all_bytes()})
    EXPECT_EQ(back.encode(s), t.encode(s));
}

TEST(Tokenizer, LoadRefusesWhatIsNotATokenizer) {
  test::TempDir dir;
  const std::string path = (dir / "t.json").string();
  auto load_error = [&](const std::string& content) {
    std::ofstream(path, std::ios::binary) << content;
    return config_error([&] { Tokenizer::load(path); });
  };
  const std::string head = R"({"format": "tpx-bpe", "version": 1, )";
  const std::vector<std::pair<std::string, std::string>> cases{
      {"not json at all", "not JSON"},
      {R"({"format": "other", "version": 1, "vocab": 256, "merges": []})", "not a tokenizer"},
      {R"({"format": "tpx-bpe", "version": 2, "vocab": 256, "merges": []})", "unsupported version"},
      {head + R"("vocab": 32769, "merges": []})", "\"vocab\" must be 256"},
      {head + R"("vocab": "256", "merges": []})", "\"vocab\" must be an integer"},
      {head + R"("vocab": 258, "merges": [[97, 98]]})", "vocab − 256 = 2 pairs"},
      {head + R"("vocab": 258, "merges": [[97, 98], [97, 258]]})",
       "merge 1 makes id 257 from [97, 258]"},
      {head + R"("vocab": 257, "merges": [[-1, 98]]})", "merge 0 makes id 256"},
      {head + R"("vocab": 258, "merges": [[97, 98], [97, 98]]})", "merge 1 repeats merge 0"},
      {head + R"("vocab": 257, "merges": [[97]]})", "merge 0 must be a pair"},
  };
  for (const auto& [content, rule] : cases) {
    const std::string e = load_error(content);
    EXPECT_NE(e.find("tokenizer '" + path + "'"), std::string::npos) << content << ": " << e;
    EXPECT_NE(e.find(rule), std::string::npos) << content << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  const std::string missing = (dir / "missing.json").string();
  EXPECT_NE(config_error([&] { Tokenizer::load(missing); }).find("cannot read"), std::string::npos);
  EXPECT_NE(config_error([&] { Tokenizer::load(dir.path().string()); }).find("directory"),
            std::string::npos);
}

// ---- The token file -----------------------------------------------------------------------------

void put(std::string& s, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A token file's bytes as the layout in token_file.h spells them, written here by hand.
std::string token_bytes(std::string_view magic, std::uint32_t version, std::uint32_t vocab,
                        std::uint64_t n_train, std::uint64_t n_valid,
                        const std::vector<std::uint16_t>& ids) {
  std::string s(magic);
  put(s, version, 4);
  put(s, vocab, 4);
  put(s, n_train, 8);
  put(s, n_valid, 8);
  s.resize(64, '\0');
  for (const std::uint16_t id : ids) put(s, id, 2);
  return s;
}

class TokenFileTest : public ::testing::Test {
 protected:
  std::string write(const std::string& bytes) {
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << bytes;
    return path_;
  }
  // The ConfigError read_token_file() throws for `bytes`, checked to name the file and be one
  // line.
  std::string refusal(const std::string& bytes) {
    write(bytes);
    const std::string e = config_error([&] { read_token_file(path_); });
    EXPECT_NE(e.find("token file '" + path_ + "'"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    return e;
  }
  test::TempDir dir_;
  std::string path_ = (dir_ / "x.tokens").string();
};

TEST_F(TokenFileTest, RoundTripsAndMatchesTheLayout) {
  TokenFile f;
  f.vocab = 65536;
  f.train = {0, 1, 65535, 258, 7};
  f.valid = {4096, 3};
  write_token_file(path_, f);
  const std::string bytes = test::read_file(path_);
  EXPECT_EQ(bytes, token_bytes("TPXTOKN1", 1, 65536, 5, 2, {0, 1, 65535, 258, 7, 4096, 3}));
  const TokenFile back = read_token_file(path_);
  EXPECT_EQ(back.vocab, 65536);
  EXPECT_EQ(back.train, f.train);
  EXPECT_EQ(back.valid, f.valid);
  EXPECT_EQ(token_file_vocab(path_), 65536);
}

TEST_F(TokenFileTest, RefusesAForeignFile) {
  const std::string npy = std::string("\x93NUMPY\x01\x00", 8) + std::string(100, ' ');
  EXPECT_NE(refusal(npy).find("not a token file"), std::string::npos);
  EXPECT_NE(refusal("").find("not a token file"), std::string::npos);
  EXPECT_NE(refusal("hello").find("not a token file"), std::string::npos);
  EXPECT_NE(refusal(token_bytes("TPXTOKN2", 1, 300, 1, 1, {1, 2})).find("not a token file"),
            std::string::npos);
}

TEST_F(TokenFileTest, RefusesAnotherVersion) {
  const std::string e = refusal(token_bytes("TPXTOKN1", 2, 300, 1, 1, {1, 2}));
  EXPECT_NE(e.find("unsupported version 2"), std::string::npos) << e;
}

TEST_F(TokenFileTest, RefusesATruncatedFile) {
  const std::string good = token_bytes("TPXTOKN1", 1, 300, 2, 1, {1, 2, 3});
  EXPECT_NE(refusal(good.substr(0, 30)).find("truncated: 30 bytes, shorter than the 64-byte"),
            std::string::npos);
  EXPECT_NE(refusal("TPX").find("truncated"), std::string::npos);
  const std::string e = refusal(good.substr(0, good.size() - 1));
  EXPECT_NE(e.find("truncated: 69 bytes"), std::string::npos) << e;
  // Counts whose byte total overflows are a truncated file too, not a wrapped size.
  const std::string huge = token_bytes("TPXTOKN1", 1, 300, ~std::uint64_t{0} / 2, 2, {1, 2});
  EXPECT_NE(refusal(huge).find("truncated"), std::string::npos);
}

TEST_F(TokenFileTest, RefusesTrailingBytes) {
  const std::string e = refusal(token_bytes("TPXTOKN1", 1, 300, 2, 1, {1, 2, 3, 4}));
  EXPECT_NE(e.find("2 trailing bytes"), std::string::npos) << e;
}

TEST_F(TokenFileTest, RefusesAVocabOutsideTwoTo65536) {
  for (const std::uint32_t v : {0u, 1u, 65537u, 0xffffffffu}) {
    const std::string e = refusal(token_bytes("TPXTOKN1", 1, v, 1, 1, {0, 0}));
    EXPECT_NE(e.find(fmt::format("vocab {} is outside 2 … 65536", v)), std::string::npos) << e;
  }
  TokenFile f{1, {0}, {0}};
  EXPECT_NE(config_error([&] { write_token_file(path_, f); }).find("vocab 1"), std::string::npos);
}

TEST_F(TokenFileTest, RefusesAnIdNotBelowTheVocab) {
  std::string e = refusal(token_bytes("TPXTOKN1", 1, 300, 4, 2, {1, 299, 2, 300, 301, 5}));
  EXPECT_NE(e.find("id 300 at token 3 (training split, index 3) is not below the vocab 300"),
            std::string::npos)
      << e;
  e = refusal(token_bytes("TPXTOKN1", 1, 300, 2, 3, {1, 2, 5, 65535, 0}));
  EXPECT_NE(e.find("id 65535 at token 3 (held-out split, index 1)"), std::string::npos) << e;
  // The header alone is fine: token_file_vocab() does not read the ids.
  EXPECT_EQ(token_file_vocab(path_), 300);
  TokenFile f{300, {1, 300}, {1}};
  EXPECT_NE(config_error([&] { write_token_file(path_, f); }).find("id 300 at token 1"),
            std::string::npos);
}

TEST_F(TokenFileTest, RefusesAnEmptySplit) {
  EXPECT_NE(refusal(token_bytes("TPXTOKN1", 1, 300, 0, 2, {1, 2})).find("training split is empty"),
            std::string::npos);
  EXPECT_NE(refusal(token_bytes("TPXTOKN1", 1, 300, 2, 0, {1, 2})).find("held-out split is empty"),
            std::string::npos);
  TokenFile f{300, {1}, {}};
  EXPECT_NE(config_error([&] { write_token_file(path_, f); }).find("held-out split is empty"),
            std::string::npos);
}

TEST_F(TokenFileTest, VocabFromTheHeaderIsCheckedLikeTheFile) {
  write(token_bytes("TPXTOKN1", 1, 4096, 2, 1, {1, 2}));  // one id short
  EXPECT_NE(config_error([&] { token_file_vocab(path_); }).find("truncated"), std::string::npos);
  write("plain text, not tokens, long enough to fill a header of sixty-four bytes and more");
  EXPECT_NE(config_error([&] { token_file_vocab(path_); }).find("not a token file"),
            std::string::npos);
  const std::string missing = (dir_ / "missing.tokens").string();
  EXPECT_NE(config_error([&] { token_file_vocab(missing); }).find("cannot read"),
            std::string::npos);
  EXPECT_NE(config_error([&] { read_token_file(missing); }).find("cannot read"), std::string::npos);
  EXPECT_NE(config_error([&] { read_token_file(dir_.path().string()); }).find("directory"),
            std::string::npos);
}

TEST(TokenFile, DefaultIsTheBuildsCorpus) {
  EXPECT_TRUE(default_token_file().ends_with("/data/kjv-4096.tokens")) << default_token_file();
}

// ---- tools/tpx_tokenize -------------------------------------------------------------------------

// tools/tpx_tokenize run with `args` in `dir`.
test::CommandResult tokenize(const std::string& args, const test::TempDir& dir) {
  return test::run_command(
      fmt::format("cd '{}' && '{}' {}", dir.path().string(), TPX_TOKENIZE_BIN, args), dir);
}

TEST(TpxTokenize, TrainsWritesAndDecodesTheText) {
  test::TempDir dir;
  std::string text;
  for (int i = 0; i < 40; ++i)
    text += fmt::format("{} And the earth was without form, and void; verse {}.\n",
                        i % 2 ? "In the beginning" : "And God said", i);
  std::ofstream(dir / "t.txt", std::ios::binary) << text;
  auto r = tokenize(
      "--text t.txt --vocab 300 --valid-fraction 0.1 --tokenizer t.json --output t.tokens", dir);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const TokenFile f = read_token_file((dir / "t.tokens").string());
  EXPECT_EQ(f.vocab, 300);
  const Tokenizer t = Tokenizer::load((dir / "t.json").string());
  // The last 4 of 40 lines are held out, and the tokenizer learnt from the other 36 alone.
  const std::size_t cut = [&] {
    std::size_t at = 0;
    for (int i = 0; i < 36; ++i) at = text.find('\n', at) + 1;
    return at;
  }();
  EXPECT_EQ(t.merges(), Tokenizer::train(std::string_view(text).substr(0, cut), 300).merges());
  const std::vector<std::int32_t> train(f.train.begin(), f.train.end()),
      valid(f.valid.begin(), f.valid.end());
  EXPECT_EQ(t.decode(train), text.substr(0, cut));
  EXPECT_EQ(t.decode(valid), text.substr(cut));

  r = tokenize("--tokenizer t.json --decode t.tokens --split valid", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, text.substr(cut));
  r = tokenize("--tokenizer t.json --decode t.tokens --count 5", dir);
  EXPECT_EQ(r.out, t.decode(std::span(train).first(5)));
  r = tokenize("--tokenizer t.json --encode 'In the beginning'", dir);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  std::string want;
  for (const std::int32_t id : t.encode("In the beginning"))
    want += fmt::format("{}{}", want.empty() ? "" : " ", id);
  EXPECT_EQ(r.out, want + "\n");
}

TEST(TpxTokenize, BadInputIsOneLineAndExitTwo) {
  test::TempDir dir;
  std::ofstream(dir / "t.txt") << "one line\ntwo lines\nthree lines\n";
  std::ofstream(dir / "one.txt") << "a single line\n";
  std::ofstream(dir / "foreign.tokens") << "not a token file, just text";
  const std::string train = " --tokenizer o.json --output o.tokens";
  const std::vector<std::pair<std::string, std::string>> cases{
      {"--text t.txt --vocab 100" + train, "--vocab must be 256"},
      {"--text t.txt --vocab 40000" + train, "--vocab must be 256"},
      {"--text t.txt --vocab 300 --valid-fraction 1" + train, "--valid-fraction"},
      {"--text t.txt --vocab 300 --valid-fraction 0" + train, "--valid-fraction"},
      {"--text missing.txt --vocab 300" + train, "--text 'missing.txt': cannot read"},
      {"--text one.txt --vocab 300" + train, "at least 2 lines"},
      {"--text t.txt --vocab 300 --tokenizer o.json", "--output"},
      {"--text t.txt --vocab 300 --tokenizer t.txt --output o.tokens", "--text"},
      {"--text t.txt --vocab 300 --tokenizer o.json --output /nonexistent/o.tokens",
       "/nonexistent"},
      {"--text t.txt --vocab 2000" + train, "--vocab 2000: the text holds only"},
      {"--tokenizer missing.json --encode hi", "tokenizer 'missing.json': cannot read"},
      {"--tokenizer t.txt --encode hi", "not JSON"},
      {"--encode hi", "--encode needs --tokenizer"},
      {"--tokenizer o.json", "give --text"},
      {"--vocab 300", "--vocab requires --text"},
      {"--tokenizer t.json --encode hi --count 3", "--count requires --decode"},
      {"--tokenizer t.json --decode x.tokens --count -1", "--count must be 0 or more"},
      {"--text t.txt --decode x.tokens", "excludes"},
      {"--vocabs 300", "did you mean --vocab"},
  };
  for (const auto& [args, rule] : cases) {
    const auto r = tokenize(args, dir);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_EQ(test::lines_of(r.err).size(), 1u) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(rule), std::string::npos) << args << "\n" << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir / "o.json")) << args;
    EXPECT_FALSE(std::filesystem::exists(dir / "o.tokens")) << args;
  }
  // A good tokenizer, then token files it cannot decode.
  ASSERT_EQ(tokenize("--text t.txt --vocab 260" + train, dir).exit_code, 0);
  ASSERT_EQ(tokenize("--text t.txt --vocab 256 --tokenizer p.json --output "
                     "p.tokens",
                     dir)
                .exit_code,
            0);
  for (const auto& [args, rule] : std::vector<std::pair<std::string, std::string>>{
           {"--tokenizer o.json --decode foreign.tokens", "not a token file"},
           {"--tokenizer o.json --decode p.tokens", "vocab 256 but --tokenizer 'o.json' has 260"},
           {"--tokenizer o.json --decode o.tokens --split test", "--split"}}) {
    const auto r = tokenize(args, dir);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_EQ(test::lines_of(r.err).size(), 1u) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(rule), std::string::npos) << args << "\n" << r.err;
  }
}

// Sampled ids can end inside a character or join bytes no encoder would: valid_utf8() keeps
// every well-formed sequence and replaces each byte of a broken one by U+FFFD.
TEST(ValidUtf8, KeepsWellFormedTextAndReplacesEachBadByte) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(valid_utf8("plain ascii"), "plain ascii");
  const std::string good = "caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80";  // é, €, an emoji
  EXPECT_EQ(valid_utf8(good), good);
  EXPECT_EQ(valid_utf8("a\xC3"), "a" + fffd) << "cut after the lead byte";
  EXPECT_EQ(valid_utf8("\xE2\x82"), fffd + fffd) << "cut inside a three-byte sequence";
  EXPECT_EQ(valid_utf8("\x80x"), fffd + "x") << "a continuation byte alone";
  EXPECT_EQ(valid_utf8("\xC0\xAF"), fffd + fffd) << "overlong '/'";
  EXPECT_EQ(valid_utf8("\xED\xA0\x80"), fffd + fffd + fffd) << "a surrogate";
  EXPECT_EQ(valid_utf8("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd) << "above U+10FFFF";
  EXPECT_EQ(valid_utf8("\xFF"), fffd);
}

}  // namespace
}  // namespace tpx
