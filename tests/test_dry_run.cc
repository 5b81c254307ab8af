// --dry-run against real runs: at a small shape, every stage's dry run (nothing computed, only the
// formulas of common/flops.h, the stages' traffic.h and common/memory.h) reports exactly what the
// real run's --json measured and counted; and models by name (--model) and by file (--config).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace tpx {
namespace {

using nlohmann::json;

struct Case {
  std::string stage;
  int ranks;
  std::string args;  ///< besides the small shape
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.stage << " -np " << c.ranks << " " << c.args;
}

constexpr const char* kShape = "--hidden 32 --heads 4 --ffn 64 --seq 16 --layers 2";

json run_json(const Case& c, const std::string& extra) {
  test::TempDir dir;
  const auto path = dir / "s.json";
  const auto r =
      test::run_stage(c.stage, c.ranks,
                      fmt::format("{} {} {} --json {}", kShape, c.args, extra, path.string()), dir);
  EXPECT_EQ(r.exit_code, 0) << c.stage << " " << c.args << " " << extra << "\n" << r.out << r.err;
  if (r.exit_code != 0) return json::object();
  return json::parse(test::read_file(path));
}

class DryRun : public testing::TestWithParam<Case> {};

TEST_P(DryRun, EqualsTheRealRunsJson) {
  const Case& c = GetParam();
  const json real = run_json(c, "--steps 2");
  const json dry = run_json(c, "--dry-run");
  ASSERT_TRUE(real.contains("steps") && dry.contains("step"));
  ASSERT_EQ(real["steps"].size(), 2u);
  EXPECT_TRUE(dry.at("dry_run").get<bool>());
  EXPECT_FALSE(real.contains("dry_run"));
  for (const char* key :
       {"flops_per_step_per_rank", "executed_flops_per_step_per_rank", "saved_activation_bytes",
        "memory_estimate_bytes", "memory_terms", "optimizer_state_bytes", "dp", "cp", "world_size"})
    EXPECT_EQ(dry.at(key), real.at(key)) << key;
  // The config, but for what only a real run has (the step count is the same here: 5 default).
  json want = real.at("config"), got = dry.at("config");
  want.erase("steps");
  got.erase("steps");
  EXPECT_EQ(got, want);
  // Every step of the real run moves what the dry run says a step moves.
  for (const json& row : real["steps"])
    for (const char* key : {"comm_payload_bytes", "comm_bus_bytes", "comm_calls",
                            "dp_payload_bytes", "dp_bus_bytes", "cp_payload_bytes", "cp_bus_bytes"})
      EXPECT_EQ(dry["step"].at(key), row.at(key)) << key << " at step " << row.at("step");
  // And it is not all zeros where the stage communicates.
  if (c.ranks > 1) {
    EXPECT_GT(dry["step"].at("comm_bus_bytes").get<std::uint64_t>(), 0u);
  }
  if (real.at("cp").get<int>() > 1) {
    EXPECT_GT(dry["step"].at("cp_bus_bytes").get<std::uint64_t>(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    stages, DryRun,
    testing::Values(
        Case{"01_baseline", 1, "--recompute full"}, Case{"02_megatron_tp", 2, "--kv-heads 2"},
        Case{"03_sequence_parallel", 2, "--dtype bf16 --optimizer adamw --lr 1e-3"},
        Case{"04_overlap_ring", 2, "--kv-heads 2 --recompute full"},
        Case{"05_copy_engine_async_tp", 2, "--recompute selective"},
        Case{"05_copy_engine_async_tp", 2, "--recompute full --recompute-every 2"},
        Case{"06_fp8", 2, ""}, Case{"06_fp8", 2, "--dtype bf16"},
        Case{"07_fsdp_tp", 4, "--dp 2 --dtype bf16"}, Case{"07_fsdp_tp", 3, "--dp 3 --batch 3"},
        // Stage 06's FP8 inside each TP group: tensorwise's amax all-reduces with the weights'
        // amaxes in backward (requantized), and the forward's once more under recompute.
        // (The row and block recipes' bytes: test_fp8_recipes.)
        Case{"07_fsdp_tp", 4, "--dp 2 --dtype fp8"},
        Case{"07_fsdp_tp", 4, "--dp 2 --dtype fp8 --recompute full"},
        Case{"07_fsdp_tp", 4, "--dp 2 --dtype fp8 --fp8-weight-gather"},
        // Stage 08, each method at C = 2 and at C = 2 × T = 2; Ulysses needs NKV
        // to split over C·T (4 KV heads here); the recompute repeats the forward's
        // K/V traffic on every second layer; D = 2 × C = 2 shards over DP×CP.
        Case{"08_context_parallel", 2, "--cp 2 --cp-method ring"},
        Case{"08_context_parallel", 2, "--cp 2 --cp-method allgather --kv-heads 2"},
        Case{"08_context_parallel", 2, "--cp 2 --cp-method ulysses --kv-heads 2"},
        Case{"08_context_parallel", 4,
             "--cp 2 --cp-method ring --kv-heads 2 --recompute full "
             "--recompute-every 2"},
        Case{"08_context_parallel", 4, "--cp 2 --cp-method allgather"},
        Case{"08_context_parallel", 4, "--cp 2 --cp-method ulysses --recompute full"},
        Case{"08_context_parallel", 4, "--dp 2 --cp 2 --optimizer adamw --lr 1e-3"},
        // And in bf16: K/V, q and the outputs at 2 bytes, the dK/dV partial sums at 4.
        Case{"08_context_parallel", 2, "--cp 2 --cp-method ring --dtype bf16 --recompute full"},
        Case{"08_context_parallel", 4, "--cp 2 --cp-method allgather --dtype bf16"},
        Case{"08_context_parallel", 2, "--cp 2 --cp-method ulysses --kv-heads 2 --dtype bf16"}),
    [](const auto& p) {
      std::string name =
          fmt::format("{}_np{}_{}", p.param.stage.substr(0, 2), p.param.ranks, p.index);
      return name;
    });

// The language model's ends (--task lm): the embedding's g, the output layer's f, the
// cross-entropy's three all-reduces of one float per position, the final gain's, and over DP×CP
// FSDP's gathers of the ends' shards (the output layer's in bf16 under the recipe; stage 09's
// once a micro-batch) and the reduce-scatters of their gradients (common/traffic.h), at a
// vocabulary that T does not divide (V = 101: padded to 102 at T = 2).
INSTANTIATE_TEST_SUITE_P(
    lm, DryRun,
    testing::Values(
        Case{"01_baseline", 1, "--task lm --data synthetic --vocab 101"},
        Case{"02_megatron_tp", 2, "--task lm --data synthetic --vocab 101"},
        Case{"03_sequence_parallel", 2, "--task lm --data synthetic --vocab 101"},
        Case{"04_overlap_ring", 2, "--task lm --data synthetic --vocab 101"},
        Case{"05_copy_engine_async_tp", 2, "--task lm --data synthetic --vocab 101 --dtype bf16"},
        Case{"06_fp8", 2, "--task lm --data synthetic --vocab 101"},
        Case{"07_fsdp_tp", 4, "--task lm --data synthetic --vocab 101 --dp 2"},
        Case{"07_fsdp_tp", 4, "--task lm --data synthetic --vocab 101 --dp 2 --dtype bf16"},
        Case{"08_context_parallel", 4, "--task lm --data synthetic --vocab 101 --dp 2 --cp 2"},
        Case{"09_pipeline_parallel", 2,
             "--task lm --data synthetic --vocab 101 --pp 2 --microbatches 2"},
        Case{"09_pipeline_parallel", 4,
             "--task lm --data synthetic --vocab 101 --pp 2 --dp 2 --batch 4"},
        Case{"09_pipeline_parallel", 2,
             "--task lm --data synthetic --vocab 101 --pp 1 --dp 2 --batch 4 --microbatches 2 "
             "--dtype bf16"}),
    [](const auto& p) {
      return fmt::format("{}_np{}_{}", p.param.stage.substr(0, 2), p.param.ranks, p.index);
    });

TEST(DryRun, Stage08RefusesWhatTheRealRunRefuses) {
  // The plan checks the mesh with the real run's own checks: the same line, exit 2, for a
  // sequence that does not split into 2C·T chunks, KV heads Ulysses cannot split, a C·D that
  // does not divide the ranks, the naive attention (no lse to merge by).
  test::TempDir dir;
  auto first_line = [](const std::string& err) { return err.substr(0, err.find('\n')); };
  for (const std::string& args :
       {std::string("--seq 12 --cp 2"),
        std::string("--seq 16 --cp 2 --cp-method ulysses "
                    "--kv-heads 2"),
        std::string("--seq 16 --cp 3"), std::string("--seq 16 --cp 2 --attention naive")}) {
    const std::string cmd = "--hidden 32 --heads 4 --ffn 64 --layers 2 " + args;
    const auto real = test::run_stage("08_context_parallel", 4, cmd, dir);
    const auto dry = test::run_stage("08_context_parallel", 4, cmd + " --dry-run", dir);
    EXPECT_EQ(real.exit_code, 2) << args << "\n" << real.err;
    EXPECT_EQ(dry.exit_code, 2) << args << "\n" << dry.err;
    EXPECT_NE(first_line(dry.err).find("08_context_parallel: error: "), std::string::npos)
        << args << "\n"
        << dry.err;
    EXPECT_EQ(first_line(dry.err), first_line(real.err)) << args;  // printed once, by rank 0
    EXPECT_EQ(dry.err.find("error: ", dry.err.find('\n')), std::string::npos) << dry.err;
  }
}

TEST(DryRun, CheckpointSizeIsWhatASaveWrites) {
  // The dry run's size of each rank's shard file against the files a real --save wrote: the
  // language model at a vocabulary T does not divide (V = 101, padded to 102: the padding is not
  // saved), AdamW's moments (three copies of the state), the norm gains replicated (rank 0 alone
  // writes them); and the blocks alone under SGD.
  for (const std::string& args :
       {std::string("--task lm --data synthetic --vocab 101 --optimizer adamw --lr 1e-3"),
        std::string("--task block")}) {
    test::TempDir dir;
    const auto ckpt = dir / "ckpt";
    const std::string cmd = fmt::format("{} {} --steps 1 --save {}", kShape, args, ckpt.string());
    const auto real = test::run_stage("02_megatron_tp", 2, cmd, dir);
    ASSERT_EQ(real.exit_code, 0) << args << "\n" << real.out << real.err;
    const auto path = dir / "d.json";
    const auto dry =
        test::run_stage("02_megatron_tp", 2, cmd + " --dry-run --json " + path.string(), dir);
    ASSERT_EQ(dry.exit_code, 0) << args << "\n" << dry.out << dry.err;
    const json j = json::parse(test::read_file(path));
    ASSERT_TRUE(j.contains("checkpoint_bytes_per_rank")) << args;
    const json& per_rank = j.at("checkpoint_bytes_per_rank");
    ASSERT_EQ(per_rank.size(), 2u) << args;
    std::uintmax_t total = 0;
    for (int r = 0; r < 2; ++r) {
      const auto file = ckpt / "step-1" / fmt::format("rank-{}.bin", r);
      ASSERT_TRUE(std::filesystem::exists(file)) << file;
      const std::uintmax_t size = std::filesystem::file_size(file);
      EXPECT_EQ(per_rank.at(r).get<std::uintmax_t>(), size) << args << ": rank " << r;
      total += size;
    }
    EXPECT_EQ(j.at("checkpoint_bytes").get<std::uintmax_t>(), total) << args;
    EXPECT_NE(dry.out.find("checkpoint (--save)"), std::string::npos) << dry.out;
  }
}

// --- models by name and by file ------------------------------------------------------------------

json dry_json(const std::string& stage, int ranks, const std::string& args, test::TempDir& dir,
              int want_exit = 0) {
  const auto path = dir / "d.json";
  const auto r = test::run_stage(stage, ranks, args + " --dry-run --json " + path.string(), dir);
  EXPECT_EQ(r.exit_code, want_exit) << args << "\n" << r.out << r.err;
  if (r.exit_code != 0) return json::object();
  return json::parse(test::read_file(path));
}

TEST(Model, PresetsSetTheLlama3ShapesAndFlagsWin) {
  test::TempDir dir;
  const json j = dry_json("02_megatron_tp", 2, "--model llama3-70b --layers 2 --seq 512", dir);
  ASSERT_TRUE(j.contains("config"));
  const json& c = j["config"];
  EXPECT_EQ(c.at("model"), "llama3-70b");
  EXPECT_EQ(c.at("hidden"), 8192);
  EXPECT_EQ(c.at("heads"), 64);
  EXPECT_EQ(c.at("kv_heads"), 8);
  EXPECT_EQ(c.at("ffn"), 28672);
  EXPECT_EQ(c.at("rope_theta"), 500000.0);
  EXPECT_EQ(c.at("layers"), 2);  // the flags win
  EXPECT_EQ(c.at("seq"), 512);
  EXPECT_EQ(c.at("batch"), 2);
}

TEST(Model, TutorialPresetIsTheDefault) {
  test::TempDir dir;
  json a = dry_json("01_baseline", 1, "", dir);
  json b = dry_json("01_baseline", 1, "--model tutorial", dir);
  ASSERT_TRUE(a.contains("config") && b.contains("config"));
  EXPECT_EQ(b["config"].at("model"), "tutorial");
  a["config"].erase("model");
  b["config"].erase("model");
  EXPECT_EQ(a["config"], b["config"]);
}

TEST(Model, ConfigFileUnderTheCommandLine) {
  test::TempDir dir;
  const auto file = dir / "model.toml";
  std::ofstream(file) << "# a Llama-3-8B-like model, smaller\nmodel = \"llama3-8b\"\n"
                         "layers = 3\nseq = 1024\nkv-heads = 4\ndtype = \"bf16\"\n";
  const json j = dry_json("03_sequence_parallel", 2,
                          fmt::format("--config {} --seq 2048", file.string()), dir);
  ASSERT_TRUE(j.contains("config"));
  const json& c = j["config"];
  EXPECT_EQ(c.at("config_file"), file.string());
  EXPECT_EQ(c.at("model"), "llama3-8b");
  EXPECT_EQ(c.at("hidden"), 4096);  // the preset
  EXPECT_EQ(c.at("layers"), 3);     // the file over the preset
  EXPECT_EQ(c.at("kv_heads"), 4);
  EXPECT_EQ(c.at("dtype"), "bf16");
  EXPECT_EQ(c.at("seq"), 2048);  // the command line over the file
}

TEST(Model, BadModelsAndFilesAreOneLineAndExit2) {
  test::TempDir dir;
  const auto typo = dir / "typo.toml";
  std::ofstream(typo) << "hiden = 64\n";
  for (const std::string& args :
       {std::string("--model llama3-9b"), fmt::format("--config {}", (dir / "none.toml").string()),
        fmt::format("--config {}", typo.string()), std::string("--check"),
        std::string("--dump ") + (dir / "d").string()}) {
    const auto r = test::run_stage("02_megatron_tp", 2, args + " --dry-run", dir);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("error: "), std::string::npos) << args << "\n" << r.err;
    EXPECT_NE(r.err.find('\n'), std::string::npos);
  }
  const auto r = test::run_stage("01_baseline", 1, "--model llama3-9b", dir);
  EXPECT_NE(r.err.find("llama3-405b"), std::string::npos) << r.err;  // the known models listed
}

TEST(Model, The405bDryRunReportsWithoutRefusing) {
  // Terabytes on one rank: the real run is refused at start-up (exit 2); the dry run answers at
  // once, the memory check's verdict reported.
  test::TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  const json j = dry_json("07_fsdp_tp", 4, "--model llama3-405b", dir);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(j.contains("memory_problem")) << j.dump(1);
  EXPECT_NE(j["memory_problem"].get<std::string>().find("not enough memory"), std::string::npos);
  EXPECT_GT(j.at("memory_estimate_bytes").get<double>(), 1e12);
  EXPECT_GT(j["step"].at("dp_bus_bytes").get<std::uint64_t>(), 0u);
  EXPECT_LT(s, 60.0);  // mpirun's start-up on a shared 2-core machine included
  const auto r = test::run_stage("07_fsdp_tp", 4, "--model llama3-405b", dir);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
}

}  // namespace
}  // namespace tpx
