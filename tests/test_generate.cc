// --generate: how the next token is picked (next_token()), that generate() runs the model it is
// given (a hand-built model whose answer is known), and that every stage hands rank 0 the same
// trained model (01, 02 and 09 continue a prompt with the same sampled text), with the flags'
// refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/generate.h"
#include "common/model.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

TEST(NextToken, GreedyTakesTheLargestLogitAndTheSmallerIdOnATie) {
  const GenerateOptions greedy;
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f};
  for (std::int64_t i = 0; i < 5; ++i) EXPECT_EQ(next_token(logits, greedy, 7, i), 1);
  const std::vector<float> last = {0.5f, 2.0f, -1.0f, 2.5f};
  EXPECT_EQ(next_token(last, greedy, 7, 0), 3);
}

TEST(NextToken, TopKOfOneIsGreedyAtAnyTemperature) {
  GenerateOptions g{.tokens = 1, .prompt = "x", .temperature = 5.0, .top_k = 1};
  const std::vector<float> logits = {0.1f, 0.3f, 0.2f};
  for (std::int64_t i = 0; i < 50; ++i) EXPECT_EQ(next_token(logits, g, 3, i), 1);
}

// Draws follow softmax(logits / T): with logits {0, ln 3} at T = 1, id 1 has p = 3/4; at T = 2,
// p = √3 / (1 + √3). Over 4000 draws the standard error is under 0.007; 0.03 is > 4 of them.
// Top-k 2 of three ids never draws the third.
TEST(NextToken, SamplesFollowTheTemperedSoftmaxAndRepeatFromTheSeed) {
  const std::vector<float> logits = {0.0f, float(std::log(3.0)), -20.0f};
  for (const auto& [temperature, p1] :
       {std::pair{1.0, 0.75}, std::pair{2.0, std::sqrt(3.0) / (1 + std::sqrt(3.0))}}) {
    GenerateOptions g{.tokens = 1, .prompt = "x", .temperature = temperature, .top_k = 2};
    constexpr int kDraws = 4000;
    int ones = 0;
    for (std::int64_t i = 0; i < kDraws; ++i) {
      const std::int32_t id = next_token(logits, g, 11, i);
      ASSERT_TRUE(id == 0 || id == 1) << id;
      ones += id;
      EXPECT_EQ(id, next_token(logits, g, 11, i)) << "the same seed and index, the same draw";
    }
    EXPECT_NEAR(double(ones) / kDraws, p1, 0.03) << "T " << temperature;
  }
  // Another seed, another sequence.
  GenerateOptions g{.tokens = 1, .prompt = "x", .temperature = 1.0, .top_k = 0};
  int same = 0;
  for (std::int64_t i = 0; i < 200; ++i)
    same += next_token(logits, g, 1, i) == next_token(logits, g, 2, i);
  EXPECT_LT(same, 190);
}

// Blocks whose output projections are zero are the identity (x + 0 + 0), so the logits are the
// final norm of the last id's embedding row times W_out. With row i = e_i and W_out[i][(i+1) % V]
// = 1, the model's greedy continuation counts up modulo V. The text outgrows S, so the last
// window of S ids is what runs.
TEST(Generate, RunsTheModelItIsGiven) {
  BlockConfig c;
  c.task = Task::lm;
  c.hidden = 16;
  c.heads = 2;
  c.kv_heads = 2;
  c.ffn = 32;
  c.seq = 4;
  c.layers = 2;
  c.vocab = 12;
  c.generate.tokens = 15;
  Snapshot s;
  s.params.resize(std::size_t(c.layers));
  for (auto& layer : s.params)
    for (Param p : kAllParams) {
      const Tensor::Shape shape = param_shape(p, c);
      std::int64_t n = 1;
      for (std::int64_t d : shape) n *= d;
      const bool gain = p == Param::norm1 || p == Param::norm2;
      const bool output = p == Param::wo || p == Param::w_down;
      // Nonzero q, k, v, gate and up: they run, and their results are multiplied by zero.
      layer[std::size_t(p)].assign(std::size_t(n), gain ? 1.0f : output ? 0.0f : 0.05f);
    }
  const std::size_t H = std::size_t(c.hidden), V = std::size_t(c.vocab);
  s.lm_params[0].assign(V * H, 0.0f);
  s.lm_params[1].assign(H, 1.0f);
  s.lm_params[2].assign(H * V, 0.0f);
  for (std::size_t i = 0; i < V; ++i) {
    s.lm_params[0][i * H + i] = 1.0f;
    s.lm_params[2][i * V + (i + 1) % V] = 1.0f;
  }
  const std::vector<std::int32_t> prompt = {9, 4, 7};
  const std::vector<std::int32_t> out = generate(c, s, prompt);
  ASSERT_EQ(out.size(), 15u);
  for (std::size_t i = 0; i < out.size(); ++i)
    EXPECT_EQ(out[i], std::int32_t((8 + i) % V)) << "token " << i;
}

TEST(TokenizerPath, SitsBesideTheTokenFile) {
  EXPECT_EQ(tokenizer_path_for("d/kjv-4096.tokens"), "d/kjv-4096.tokenizer.json");
  EXPECT_EQ(tokenizer_path_for("d/ids"), "d/ids.tokenizer.json");
}

/// A token file and its tokenizer, trained by tpx_tokenize on a few hundred lines of text.
struct Corpus {
  test::TempDir dir;
  fs::path tokens = dir / "text.tokens", tokenizer = dir / "text.tokenizer.json";
  Corpus() {
    {
      std::ofstream text(dir / "text.txt");
      for (int i = 0; i < 400; ++i)
        text << fmt::format(
            "line {} of the text: the cat sat on the mat and the dog ran {} times\n", i,
            i * 7 % 13);
    }
    const auto r = test::run_command(
        fmt::format("{} --text {} --vocab 300 --tokenizer {} --output {}", TPX_TOKENIZE_BIN,
                    (dir / "text.txt").string(), tokenizer.string(), tokens.string()),
        dir);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  }
};

constexpr const char* kShape =
    "--hidden 32 --heads 4 --ffn 64 --seq 16 --batch 2 --layers 2 --dtype fp32";

// Three steps, then 16 tokens drawn at temperature 1: the draws fall where the trained model's
// probabilities put them, so 02 (the vocabulary and weights cut over T = 2) and 09 (layers on two
// pipeline stages, embedding on the first, output layer on the last) print 01's text only if
// rank 0 gathered the very model each trained.
TEST(GenerateStages, EveryStageContinuesThePromptAlike) {
  const Corpus corpus;
  const std::string base = fmt::format(
      "{} --task lm --data {} --steps 3 --generate 16 --prompt "
      "'the cat'",
      kShape, corpus.tokens.string());
  const std::string args = base + " --temperature 1";
  const json one = test::run_json("01_baseline", 1, args);
  ASSERT_TRUE(one.contains("generated")) << one.dump();
  const std::string text = one["generated"].at("text");
  EXPECT_EQ(one["generated"].at("prompt"), "the cat");
  EXPECT_GE(text.size(), 16u) << "16 tokens of at least a byte each";
  EXPECT_EQ(test::run_json("02_megatron_tp", 2, args)["generated"].at("text"), text);
  EXPECT_EQ(test::run_json("09_pipeline_parallel", 2, args + " --pp 2")["generated"].at("text"),
            text);
  // Greedy is another text, the same on every run.
  const json greedy = test::run_json("01_baseline", 1, base);
  const json again = test::run_json("01_baseline", 1, base);
  EXPECT_EQ(greedy["generated"].at("text"), again["generated"].at("text"));
}

TEST(GenerateStages, BadFlagsAreRefusedInOneLine) {
  const Corpus corpus;
  const std::string data = "--task lm --data " + corpus.tokens.string();
  // A token file without its tokenizer beside it.
  fs::copy_file(corpus.tokens, corpus.dir / "alone.tokens");
  // A tokenizer of another vocabulary beside a copy of the token file.
  fs::copy_file(corpus.tokens, corpus.dir / "other.tokens");
  {
    const auto r =
        test::run_command(fmt::format("{} --text {} --vocab 280 --tokenizer {} --output {}",
                                      TPX_TOKENIZE_BIN, (corpus.dir / "text.txt").string(),
                                      (corpus.dir / "other.tokenizer.json").string(),
                                      (corpus.dir / "unused.tokens").string()),
                          corpus.dir);
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  struct Case {
    std::string args, words;
  };
  for (const Case& c : {
           Case{data + " --generate -1", "--generate must be >= 0"},
           Case{data + " --generate 4 --temperature -0.5", "--temperature must be"},
           Case{data + " --generate 4 --temperature 1 --top-k -2", "--top-k must be >= 0"},
           Case{data + " --generate 4 --prompt ''", "--prompt: empty"},
           Case{"--task block --generate 4", "--generate needs --task lm"},
           Case{"--task lm --data synthetic --generate 4", "--data synthetic has no tokenizer"},
           Case{"--task lm --data " + (corpus.dir / "alone.tokens").string() + " --generate 4",
                "alone.tokenizer.json"},
           Case{"--task lm --data " + (corpus.dir / "other.tokens").string() + " --generate 4",
                "has vocab 280"},
       })
    test::expect_refused_once("02_megatron_tp", 2, fmt::format("{} {}", kShape, c.args), c.words);
}

}  // namespace
}  // namespace tpx
