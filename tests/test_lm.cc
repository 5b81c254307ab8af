// The language model's ends as the stage executables run them (--task lm): what the embedding
// and the cross-entropy move equals its formula (common/traffic.h), the logits' memory per rank
// falls as 1/T, and bad token files or flags are refused in one line before any rank allocates.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/config.h"
#include "common/token_file.h"
#include "common/traffic.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr const char* kShape = "--hidden 32 --heads 4 --ffn 64 --seq 16 --batch 2 --layers 2";

struct EndsCase {
  std::string stage;
  TpLayout layout;
  std::string args;
};

// A step of --task lm minus the same step of --task block is the language model's ends: the
// embedding's g (and its backward), the output layer's f, the cross-entropy's MAX, SUM, SUM of
// S·B floats and the final gain's all-reduce, counted by the communicators as they ran.
TEST(LmTraffic, TheEndsMoveWhatTheirFormulaSays) {
  for (const EndsCase& e :
       {EndsCase{"02_megatron_tp", TpLayout::all_reduce, ""},
        EndsCase{"03_sequence_parallel", TpLayout::sequence, ""},
        EndsCase{"04_overlap_ring", TpLayout::ring, ""}, EndsCase{"06_fp8", TpLayout::ring, ""},
        EndsCase{"03_sequence_parallel", TpLayout::sequence, "--dtype bf16"}})
    for (int n : {2, 4}) {
      const std::string args = fmt::format("{} {} --steps 1 --vocab 101", kShape, e.args);
      const json lm = test::run_json(e.stage, n, args + " --task lm --data synthetic");
      const json block = test::run_json(e.stage, n, args + " --task block");
      ASSERT_FALSE(lm.empty() || block.empty());
      BlockConfig c;
      c.hidden = 32, c.heads = 4, c.ffn = 64, c.seq = 16, c.batch = 2, c.layers = 2;
      c.task = Task::lm;
      c.vocab = 101;
      c.dtype = e.stage == "06_fp8" ? DType::e4m3
                                    : parse_dtype(lm["config"].at("dtype").get<std::string>());
      const Traffic want = lm_traffic(c, n, 0, e.layout);
      const json &a = lm["steps"][0], &b = block["steps"][0];
      auto diff = [&](const char* key) {
        return a.at(key).get<std::uint64_t>() - b.at(key).get<std::uint64_t>();
      };
      const std::string where = fmt::format("{} -np {} {}", e.stage, n, e.args);
      EXPECT_EQ(diff("comm_payload_bytes"), want.payload) << where;
      EXPECT_EQ(diff("comm_bus_bytes"), want.bus) << where;
      EXPECT_EQ(diff("comm_calls"), want.calls) << where;
      // The cross-entropy's part by hand: three all-reduces of S·B fp32 values.
      const std::uint64_t vector = 4 * 16 * 2;
      EXPECT_GE(want.bus, 3 * (vector * 2 * (n - 1) / n)) << where;
    }
}

// At a vocabulary large enough to dominate, the logits, their gradient and the vocabulary's
// shards all fall as 1/T: the measured peak drops by half of the T = 1 → 2 drop again from
// T = 2 → 4 (peak(T) ≈ rest + V-part/T), and the estimate's logits term is S·B·V/T·e·2 plus the
// cross-entropy's vectors and the gathered [S, B, H] input with its gradient, never S·B·V.
TEST(LmMemory, TheLogitsPeakPerRankFallsAsOneOverT) {
  constexpr std::int64_t V = 16384, S = 32, B = 2, H = 32;
  std::vector<double> peak, logits;
  for (int n : {1, 2, 4}) {
    const json j = test::run_json(
        "02_megatron_tp", n,
        fmt::format("--hidden {} --heads 4 --ffn 64 --seq {} --batch {} --layers 1 --steps 2 "
                    "--task lm --data synthetic --vocab {}",
                    H, S, B, V));
    ASSERT_FALSE(j.empty());
    peak.push_back(j["steps"][1].at("peak_bytes").get<double>());
    const double term = j.at("memory_terms").value("logits", -1.0);
    logits.push_back(term);
    const double want = double(S * B * (V / n) * 4 * 2 + S * B * 4 * 5 + S * B * H * 4 * 2);
    EXPECT_EQ(term, want) << "T = " << n;
  }
  const double drop12 = peak[0] - peak[1], drop24 = peak[1] - peak[2];
  EXPECT_GT(drop12, 0.3 * peak[0]) << "the vocabulary's part dominates at T = 1";
  EXPECT_NEAR(drop24 / drop12, 0.5, 0.1) << peak[0] << " " << peak[1] << " " << peak[2];
}

/// A token file written byte by byte: `vocab`, the train and held-out ids.
void write_tokens(const fs::path& path, std::uint32_t vocab,
                  const std::vector<std::uint16_t>& train, const std::vector<std::uint16_t>& valid,
                  std::size_t cut = 0) {
  std::string bytes(64, '\0');
  std::memcpy(bytes.data(), "TPXTOKN1", 8);
  const std::uint32_t version = 1;
  const std::uint64_t nt = train.size(), nv = valid.size();
  std::memcpy(bytes.data() + 8, &version, 4);
  std::memcpy(bytes.data() + 12, &vocab, 4);
  std::memcpy(bytes.data() + 16, &nt, 8);
  std::memcpy(bytes.data() + 24, &nv, 8);
  for (const auto* ids : {&train, &valid})
    bytes.append(reinterpret_cast<const char*>(ids->data()), ids->size() * 2);
  bytes.resize(bytes.size() - cut);
  std::ofstream(path, std::ios::binary) << bytes;
}

// Every refusal: exit 2, one line naming the file or flag and the rule, on every rank, and the
// --dump directory never made (nothing allocated, nothing left behind).
TEST(LmInput, BadTokenFilesAndFlagsAreRefusedInOneLine) {
  test::TempDir dir;
  const std::vector<std::uint16_t> ids(100, 7), held(40, 3);
  std::vector<std::uint16_t> bad = ids;
  bad[42] = 300;
  write_tokens(dir / "ok.tokens", 256, ids, held);
  write_tokens(dir / "id.tokens", 256, bad, held);
  write_tokens(dir / "cut.tokens", 256, ids, held, 3);
  write_tokens(dir / "short.tokens", 256, std::vector<std::uint16_t>(16, 1), held);
  std::ofstream(dir / "foreign.tokens") << "not tokens at all, just some text of a fair length.\n";
  struct Case {
    std::string args, words;
  };
  const std::string f = (dir / "").string();
  for (const Case& c : {
           Case{"--data " + f + "id.tokens", "id 300 at token 42"},
           Case{"--data " + f + "cut.tokens", "truncated"},
           Case{"--data " + f + "foreign.tokens", "not a token file"},
           Case{"--data " + f + "short.tokens", "shorter than one sequence + 1"},
           Case{"--data " + f + "ok.tokens --vocab 200", "--vocab 200 is smaller than"},
           Case{"--data " + f + "missing.tokens", "missing.tokens"},
           Case{"--data synthetic --vocab 1", "--vocab must be between"},
           Case{"--data synthetic --vocab 70000", "--vocab must be between"},
       }) {
    const fs::path dump = dir / "dump";
    const std::string args =
        fmt::format("{} --task lm {} --dump {}", kShape, c.args, dump.string());
    const auto r = test::expect_refused_once("02_megatron_tp", 2, args, c.words);
    EXPECT_NE(r.err.find("error: "), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(dump)) << args;
  }
  // And the good file trains.
  const json j = test::run_json(
      "02_megatron_tp", 2, fmt::format("{} --task lm --data {}ok.tokens --steps 1", kShape, f));
  ASSERT_FALSE(j.empty());
  EXPECT_EQ(j["config"].at("vocab"), 256);
}

}  // namespace
}  // namespace tpx
