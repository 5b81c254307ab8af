// Checkpoints under mpirun (common/checkpoint.h): a run stopped and resumed continues as if it had
// never stopped, on the same mesh bit for bit and on another within --check's tolerance; a
// damaged or foreign checkpoint is refused before it is used, and nothing is overwritten.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/npy.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx::test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

/// A tiny language model (and its blocks): four heads, so T = 1, 2, 4 all cut it.
std::string tiny(int batch = 2, int layers = 2) {
  return fmt::format(
      "--hidden 32 --heads 4 --ffn 64 --seq 8 --batch {} --layers {} --data synthetic --vocab 50",
      batch, layers);
}
const std::string kTiny = tiny();

/// The (step, loss, grad norm) rows of a --json summary.
std::vector<std::array<double, 3>> rows_of(const fs::path& json_path) {
  std::vector<std::array<double, 3>> out;
  const json summary = json::parse(read_file(json_path));
  for (const json& r : summary.at("steps"))
    out.push_back(
        {r.at("step").get<double>(), r.at("loss").get<double>(), r.at("grad_norm").get<double>()});
  return out;
}

/// Runs `mpirun -np n stage args` and expects exit 0.
void run_ok(const std::string& stage, int n, const std::string& args, const TempDir& dir) {
  const CommandResult r = run_stage(stage, n, args, dir);
  ASSERT_EQ(r.exit_code, 0) << stage << " " << args << "\n" << r.out << r.err;
}

/// Every file of `a` (recursively) equal, byte for byte, to the one of that name in `b`, and the
/// same names in both.
void expect_same_files(const fs::path& a, const fs::path& b) {
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(a)) {
    if (!e.is_regular_file()) continue;
    ++files;
    const fs::path rel = fs::relative(e.path(), a);
    ASSERT_TRUE(fs::exists(b / rel)) << rel;
    EXPECT_TRUE(read_file(e.path()) == read_file(b / rel)) << rel << " differs";
  }
  int other = 0;
  for (const auto& e : fs::recursive_directory_iterator(b)) other += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, other);
  EXPECT_GT(files, 0);
}

/// A tensor of a one-rank checkpoint read as the format says (index.json: the shard's file,
/// offset and box; raw little-endian fp32), independently of the program's reader.
std::vector<float> read_whole_tensor(const fs::path& step_dir, const std::string& name) {
  const json index = json::parse(read_file(step_dir / "index.json"));
  for (const json& t : index.at("tensors")) {
    if (t.at("name") != name) continue;
    const json& shards = t.at("shards");
    EXPECT_EQ(shards.size(), 1U) << name;
    std::int64_t n = 1;
    for (const auto& r : shards[0].at("box")) n *= r[1].get<std::int64_t>();
    const std::string bytes = read_file(step_dir / shards[0].at("file").get<std::string>());
    std::vector<float> out(static_cast<std::size_t>(n));
    std::memcpy(out.data(), bytes.data() + shards[0].at("offset").get<std::size_t>(),
                out.size() * 4);
    return out;
  }
  ADD_FAILURE() << "no tensor " << name << " in " << step_dir;
  return {};
}

/// Six steps straight (saving after steps 3 and 6) against three steps' checkpoint resumed for
/// three more on the same mesh: the same losses and gradient norms, bit for bit, and the same
/// checkpoint of step 6 (every weight and moment), byte for byte. The resumed run's --dump holds
/// the checkpoint's weights (its first step starts from them).
void expect_continues_bit_for_bit(const std::string& stage, int n, const std::string& args,
                                  const std::string& sizes = kTiny) {
  TempDir dir;
  const std::string all = sizes + " " + args;
  run_ok(stage, n,
         fmt::format("{} --steps 6 --save {} --save-every 3 --json {}", all,
                     (dir / "straight").string(), (dir / "straight.json").string()),
         dir);
  ASSERT_TRUE(fs::exists(dir / "straight" / "step-3" / "index.json"));
  run_ok(stage, n,
         fmt::format("{} --steps 6 --resume {} --save {} --json {} --dump {}", all,
                     (dir / "straight" / "step-3").string(), (dir / "resumed").string(),
                     (dir / "resumed.json").string(), (dir / "dump").string()),
         dir);
  const auto straight = rows_of(dir / "straight.json");
  const auto resumed = rows_of(dir / "resumed.json");
  ASSERT_EQ(straight.size(), 6U);
  ASSERT_EQ(resumed.size(), 3U);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed[i][0], double(3 + i));
    EXPECT_EQ(resumed[i][1], straight[3 + i][1]) << "loss of step " << 3 + i;
    EXPECT_EQ(resumed[i][2], straight[3 + i][2]) << "grad norm of step " << 3 + i;
  }
  expect_same_files(dir / "straight" / "step-6", dir / "resumed" / "step-6");
  if (n == 1) {
    for (const std::string name : {"layers.0.wq", "layers.1.w_down", "layers.1.norm2"}) {
      const NpyArray dumped = read_npy(dir / "dump" / (name + ".npy"));
      EXPECT_EQ(dumped.data, read_whole_tensor(dir / "straight" / "step-3", name)) << name;
    }
  }
}

TEST(CheckpointRuns, Stage01_SgdLmContinuesBitForBit) {
  expect_continues_bit_for_bit("01_baseline", 1, "--task lm");
}

TEST(CheckpointRuns, Stage01_AdamwBlockBf16ContinuesBitForBit) {
  expect_continues_bit_for_bit("01_baseline", 1,
                               "--task block --optimizer adamw --lr 1e-3 --dtype bf16");
}

TEST(CheckpointRuns, Stage02_AdamwLmContinuesBitForBit) {
  expect_continues_bit_for_bit("02_megatron_tp", 2, "--task lm --optimizer adamw --lr 1e-3");
}

TEST(CheckpointRuns, Stage02_SgdLmBf16ContinuesBitForBit) {
  expect_continues_bit_for_bit("02_megatron_tp", 2, "--task lm --dtype bf16");
}

TEST(CheckpointRuns, Stage06_Fp8ContinuesBitForBit) {
  expect_continues_bit_for_bit("06_fp8", 2, "--task lm --optimizer adamw --lr 1e-3");
}

// --async-save: a thread writes each save's host copy while the steps go on. The checkpoints are
// the synchronous saves' byte for byte, training is unchanged, and --json says which saves were
// asynchronous and what each cost the step loop.
TEST(CheckpointRuns, Stage02_AsyncSaveWritesTheSameCheckpoints) {
  TempDir dir;
  const std::string args = kTiny + " --task lm --optimizer adamw --lr 1e-3 --steps 3";
  auto path = [&](const std::string& name) { return (dir / name).string(); };
  run_ok(
      "02_megatron_tp", 2,
      fmt::format("{} --save {} --save-every 1 --json {}", args, path("sync"), path("sync.json")),
      dir);
  run_ok("02_megatron_tp", 2,
         fmt::format("{} --save {} --save-every 1 --async-save --json {}", args, path("async"),
                     path("async.json")),
         dir);
  expect_same_files(dir / "sync", dir / "async");
  EXPECT_EQ(rows_of(dir / "sync.json"), rows_of(dir / "async.json"));
  const json sync = json::parse(read_file(dir / "sync.json"));
  const json async = json::parse(read_file(dir / "async.json"));
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(sync.at("steps")[i].at("save_async"), false);
    EXPECT_EQ(async.at("steps")[i].at("save_async"), true);
    EXPECT_EQ(async.at("steps")[i].at("saved"), path(fmt::format("async/step-{}", i + 1)));
    EXPECT_GE(async.at("steps")[i].at("save_ms").get<double>(), 0.0);
  }
  EXPECT_GE(async.at("save_final_wait_ms").get<double>(), 0.0);
}

/// `got`'s rows against `want`'s steps 3..5 within rtol (fp32 --check's 1e-5): another cut
/// sums in another order, so the last bits differ, and nothing more.
void expect_rows_close(const fs::path& got, const fs::path& want, const std::string& what) {
  const auto g = rows_of(got), w = rows_of(want);
  ASSERT_EQ(g.size(), 3U) << what;
  ASSERT_EQ(w.size(), 6U) << what;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(g[i][0], w[3 + i][0]) << what;
    EXPECT_NEAR(g[i][1], w[3 + i][1], 1e-5 * std::abs(w[3 + i][1])) << what << " loss";
    EXPECT_NEAR(g[i][2], w[3 + i][2], 1e-5 * std::abs(w[3 + i][2])) << what << " grad norm";
  }
}

// Saved on one rank, resumed on T = 2 (stage 02) and T = 4 (stage 03, sequence parallel too);
// saved on T = 2, resumed on one rank: each continues the straight run of its own stage within
// fp32's --check tolerance. AdamW: the moments reshard too.
TEST(CheckpointRuns, Stage01_02_03_ReshardAcrossMeshes) {
  TempDir dir;
  const std::string args = kTiny + " --task lm --optimizer adamw --lr 1e-3";
  auto path = [&](const std::string& name) { return (dir / name).string(); };
  run_ok("01_baseline", 1,
         fmt::format("{} --steps 6 --save {} --save-every 3 --json {}", args, path("one"),
                     path("one.json")),
         dir);
  run_ok("02_megatron_tp", 2,
         fmt::format("{} --steps 6 --save {} --save-every 3 --json {}", args, path("two"),
                     path("two.json")),
         dir);
  run_ok("01_baseline", 1,
         fmt::format("{} --steps 6 --resume {} --json {}", args, path("two/step-3"),
                     path("two_to_one.json")),
         dir);
  expect_rows_close(dir / "two_to_one.json", dir / "one.json", "T 2 -> 1");
  run_ok("02_megatron_tp", 2,
         fmt::format("{} --steps 6 --resume {} --json {}", args, path("one/step-3"),
                     path("one_to_two.json")),
         dir);
  expect_rows_close(dir / "one_to_two.json", dir / "two.json", "T 1 -> 2");
  run_ok("03_sequence_parallel", 4,
         fmt::format("{} --steps 6 --resume {} --json {}", args, path("two/step-3"),
                     path("two_to_four.json")),
         dir);
  expect_rows_close(dir / "two_to_four.json", dir / "two.json", "T 2 -> 4");
}

// The mesh's other cuts. Stage 07: FSDP holds ⌈rows / D⌉ of each TP-local tensor's dim 0
// (padded: at D 3 the 50-row vocabulary's last shard holds 16 real rows of 17); stage 08: the
// DP×CP group's D·C ranks; stage 09: a pipeline stage's layers and the end it holds.
TEST(CheckpointRuns, Stage07_FsdpContinuesBitForBit) {
  expect_continues_bit_for_bit("07_fsdp_tp", 2, "--task lm --dp 2 --optimizer adamw --lr 1e-3");
}

TEST(CheckpointRuns, Stage07_PaddedFsdpContinuesBitForBit) {
  expect_continues_bit_for_bit("07_fsdp_tp", 3, "--task lm --dp 3 --dtype bf16", tiny(3));
}

TEST(CheckpointRuns, Stage08_ContextParallelContinuesBitForBit) {
  expect_continues_bit_for_bit("08_context_parallel", 2,
                               "--task lm --cp 2 --optimizer adamw --lr 1e-3");
}

TEST(CheckpointRuns, Stage09_PipelineContinuesBitForBit) {
  expect_continues_bit_for_bit("09_pipeline_parallel", 2,
                               "--task lm --pp 2 --optimizer adamw --lr 1e-3");
}

TEST(CheckpointRuns, Stage09_InterleavedPipelineWithFsdpContinuesBitForBit) {
  expect_continues_bit_for_bit(
      "09_pipeline_parallel", 4,
      "--task lm --pp 2 --dp 2 --schedule interleaved-1f1b --stages-per-rank 2", tiny(4, 4));
}

// Across the mesh: saved by stage 02 (T 2), resumed by 07 (D 2); saved by 07 (D 2 × T 2),
// resumed by 09 (P 2); saved by 09 (P 2, layers and ends on different ranks), resumed by 01 on
// one rank and by 09 at P 4. Each continues stage 01's straight run within fp32's tolerance.
TEST(CheckpointRuns, Stage02_07_09_ReshardAcrossTheMesh) {
  TempDir dir;
  const std::string args = tiny(2, 4) + " --task lm --optimizer adamw --lr 1e-3";
  auto path = [&](const std::string& name) { return (dir / name).string(); };
  auto save = [&](const std::string& stage, int n, const std::string& mesh,
                  const std::string& name) {
    run_ok(stage, n, fmt::format("{} {} --steps 3 --save {}", args, mesh, path(name)), dir);
    ASSERT_TRUE(fs::exists(dir / name / "step-3" / "index.json")) << name;
  };
  int resumed = 0;
  auto resume = [&](const std::string& stage, int n, const std::string& mesh,
                    const std::string& from, const std::string& what) {
    const std::string out = fmt::format("resumed{}.json", ++resumed);
    run_ok(stage, n,
           fmt::format("{} {} --steps 6 --resume {} --json {}", args, mesh, path(from), path(out)),
           dir);
    expect_rows_close(dir / out, dir / "straight.json", what);
  };
  run_ok("01_baseline", 1, fmt::format("{} --steps 6 --json {}", args, path("straight.json")), dir);
  save("02_megatron_tp", 2, "", "tp2");
  resume("07_fsdp_tp", 2, "--dp 2", "tp2", "02 T 2 -> 07 D 2");
  save("07_fsdp_tp", 4, "--dp 2", "dp2tp2");
  resume("09_pipeline_parallel", 2, "--pp 2", "dp2tp2", "07 D 2 x T 2 -> 09 P 2");
  save("09_pipeline_parallel", 2, "--pp 2", "pp2");
  resume("01_baseline", 1, "", "pp2", "09 P 2 -> 01");
  resume("09_pipeline_parallel", 4, "--pp 4", "pp2", "09 P 2 -> 09 P 4");
}

// Tensors larger than a checksummed chunk (1 MiB): W_gate [512, 1024] and W_down [1024, 512] are
// 2 MiB each on one rank, two chunks. Resumed at T = 2, a rank reads W_down's half of the rows,
// one chunk of the two, and W_gate's half of the columns, which spans both.
TEST(CheckpointRuns, Stage01_02_ReshardReadsPartsOfLargeShards) {
  TempDir dir;
  const std::string args =
      "--hidden 512 --heads 4 --ffn 1024 --seq 4 --batch 1 --layers 1 --data synthetic --vocab 50 "
      "--task lm";
  auto path = [&](const std::string& name) { return (dir / name).string(); };
  run_ok("01_baseline", 1,
         fmt::format("{} --steps 2 --save {} --save-every 1 --json {}", args, path("one"),
                     path("one.json")),
         dir);
  run_ok(
      "02_megatron_tp", 2,
      fmt::format("{} --steps 2 --resume {} --json {}", args, path("one/step-1"), path("two.json")),
      dir);
  const auto want = rows_of(dir / "one.json"), got = rows_of(dir / "two.json");
  ASSERT_EQ(want.size(), 2U);
  ASSERT_EQ(got.size(), 1U);
  EXPECT_EQ(got[0][0], 1.0);
  EXPECT_NEAR(got[0][1], want[1][1], 1e-5 * std::abs(want[1][1]));
  EXPECT_NEAR(got[0][2], want[1][2], 1e-5 * std::abs(want[1][2]));
}

/// --dry-run's checkpoint size (--json: each rank's shard file, and all of them) against the
/// rank-R.bin files a real --save of the same run wrote; and the line the dry run prints.
void expect_dry_run_size_is_what_a_save_writes(const std::string& stage, int n,
                                               const std::string& args) {
  TempDir dir;
  const fs::path ckpt = dir / "ckpt";
  const std::string cmd = fmt::format("{} --steps 1 --save {}", args, ckpt.string());
  run_ok(stage, n, cmd, dir);
  const fs::path path = dir / "dry.json";
  const CommandResult dry = run_stage(stage, n, cmd + " --dry-run --json " + path.string(), dir);
  ASSERT_EQ(dry.exit_code, 0) << stage << " " << args << "\n" << dry.out << dry.err;
  EXPECT_NE(dry.out.find("checkpoint (--save)"), std::string::npos) << dry.out;
  const json j = json::parse(read_file(path));
  ASSERT_TRUE(j.contains("checkpoint_bytes_per_rank")) << stage << " " << args;
  const json& per_rank = j.at("checkpoint_bytes_per_rank");
  ASSERT_EQ(per_rank.size(), std::size_t(n)) << stage << " " << args;
  std::uintmax_t total = 0;
  for (int r = 0; r < n; ++r) {
    const fs::path file = ckpt / "step-1" / fmt::format("rank-{}.bin", r);
    ASSERT_TRUE(fs::exists(file)) << file;
    const std::uintmax_t size = fs::file_size(file);
    EXPECT_EQ(per_rank.at(r).get<std::uintmax_t>(), size) << stage << " " << args << ": rank " << r;
    total += size;
  }
  EXPECT_EQ(j.at("checkpoint_bytes").get<std::uintmax_t>(), total) << stage << " " << args;
}

// The dry run's sizes where the cut is more than the TP group's: FSDP's padded shards (D 3: the
// last of the 50-row vocabulary's holds 16 real rows of 17), a DP×CP group, a pipeline's stages
// (interleaved, uneven: one rank holds the embedding, the other the head) under FSDP, and a
// pipeline of blocks alone.
TEST(CheckpointRuns, Stage07_08_09_DryRunSizeIsWhatASaveWrites) {
  const std::string adamw = " --task lm --optimizer adamw --lr 1e-3";
  expect_dry_run_size_is_what_a_save_writes("07_fsdp_tp", 3, tiny(3) + adamw + " --dp 3");
  expect_dry_run_size_is_what_a_save_writes("08_context_parallel", 4,
                                            kTiny + adamw + " --dp 1 --cp 2");
  expect_dry_run_size_is_what_a_save_writes(
      "09_pipeline_parallel", 4,
      tiny(4, 5) + adamw +
          " --pp 2 --dp 2 --schedule interleaved-1f1b --stages-per-rank 2 --first-stage-layers 2");
  expect_dry_run_size_is_what_a_save_writes("09_pipeline_parallel", 2,
                                            kTiny + " --task block --pp 2");
}

/// A checkpoint of two steps (step-1 and step-2) of the tiny model on one rank, to damage.
struct Saved {
  TempDir dir;
  fs::path ckpt = dir / "ckpt";
  std::string args = kTiny + " --task lm";
  Saved() {
    run_ok("01_baseline", 1,
           fmt::format("{} --steps 2 --save {} --save-every 1", args, ckpt.string()), dir);
  }
  fs::path step2() const { return ckpt / "step-2"; }
  /// Every file under the checkpoint, path → bytes.
  std::map<std::string, std::string> contents() const {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::recursive_directory_iterator(ckpt))
      if (e.is_regular_file()) out[fs::relative(e.path(), ckpt).string()] = read_file(e.path());
    return out;
  }
};

/// Resuming the damaged checkpoint (saving into the same directory) on stage 02 at T = 2 is
/// refused on every rank with one line containing each of `words`, exit 2, and the checkpoint
/// stays as it was.
void expect_refused(const Saved& s, const std::vector<std::string>& words,
                    const std::string& more = "") {
  const auto before = s.contents();
  const CommandResult r =
      expect_refused_once("02_megatron_tp", 2,
                          fmt::format("{} {} --steps 4 --resume {} --save {}", s.args, more,
                                      s.ckpt.string(), s.ckpt.string()),
                          words[0]);
  for (const std::string& w : words) EXPECT_NE(r.err.find(w), std::string::npos) << w << r.err;
  EXPECT_TRUE(before == s.contents()) << "the refused run changed the checkpoint";
}

TEST(CheckpointRuns, Stage02_RefusesATruncatedShard) {
  Saved s;
  fs::resize_file(s.step2() / "rank-0.bin", fs::file_size(s.step2() / "rank-0.bin") / 2);
  expect_refused(s, {"rank-0.bin", "truncated", "tensor '"});
}

TEST(CheckpointRuns, Stage02_RefusesAFlippedByte) {
  Saved s;
  const fs::path file = s.step2() / "rank-0.bin";
  std::string bytes = read_file(file);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x01);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  expect_refused(s, {"rank-0.bin", "CRC-32", "tensor '"});
}

TEST(CheckpointRuns, Stage02_RefusesAMissingShard) {
  Saved s;
  fs::remove(s.step2() / "rank-0.bin");
  expect_refused(s, {"rank-0.bin", "missing", "tensor 'layers.0.norm1'"});
}

TEST(CheckpointRuns, Stage02_RefusesAnotherModelShape) {
  Saved s;
  expect_refused(s, {"index.json", "tensor 'layers.0.wk'", "dim 1: 32 vs 16"}, "--kv-heads 2");
}

TEST(CheckpointRuns, Stage02_RefusesANewerFormat) {
  Saved s;
  json index = json::parse(read_file(s.step2() / "index.json"));
  index["version"] = index["version"].get<int>() + 1;
  std::ofstream(s.step2() / "index.json", std::ios::trunc) << index.dump();
  expect_refused(s, {"index.json", "format version 2 is newer"});
}

// A save that died before its index (a step-<N>.tmp with shards, or a step-<N> without an
// index) is not a checkpoint: --resume DIR loads the last whole one, step 2, and continues.
TEST(CheckpointRuns, Stage01_IgnoresAnInterruptedSave) {
  Saved s;
  fs::create_directories(s.ckpt / "step-3.tmp");
  fs::copy_file(s.step2() / "rank-0.bin", s.ckpt / "step-3.tmp" / "rank-0.bin");
  fs::create_directories(s.ckpt / "step-4");
  fs::copy_file(s.step2() / "rank-0.bin", s.ckpt / "step-4" / "rank-0.bin");
  const CommandResult r = run_stage("01_baseline", 1,
                                    fmt::format("{} --steps 3 --resume {} --json {}", s.args,
                                                s.ckpt.string(), (s.dir / "r.json").string()),
                                    s.dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("resumed from " + s.step2().string() + " (step 2)"), std::string::npos)
      << r.out;
  const auto rows = rows_of(s.dir / "r.json");
  ASSERT_EQ(rows.size(), 1U);
  EXPECT_EQ(rows[0][0], 2.0);
}

// A rank killed (SIGKILL) in the save after step 3, its shard written and the index not: the job
// dies, step 3 is no checkpoint, and --resume DIR continues from step 2 as the run that never
// stopped, bit for bit.
TEST(CheckpointRuns, Stage02_AKillDuringASaveLeavesThePreviousCheckpoint) {
  TempDir dir;
  const std::string args = kTiny + " --task lm --optimizer adamw --lr 1e-3";
  const fs::path ckpt = dir / "ckpt";
  const CommandResult killed =
      run_stage("02_megatron_tp", 2,
                fmt::format("{} --steps 4 --save {} --save-every 1 --fault-kill-in-save 1:3", args,
                            ckpt.string()),
                dir);
  EXPECT_NE(killed.exit_code, 0) << killed.out << killed.err;
  EXPECT_TRUE(fs::exists(ckpt / "step-2" / "index.json"));
  EXPECT_TRUE(fs::exists(ckpt / "step-3.tmp" / "rank-1.bin")) << "the save had begun";
  EXPECT_FALSE(fs::exists(ckpt / "step-3")) << "a checkpoint without its index";
  run_ok("02_megatron_tp", 2,
         fmt::format("{} --steps 4 --json {}", args, (dir / "straight.json").string()), dir);
  const CommandResult resumed =
      run_stage("02_megatron_tp", 2,
                fmt::format("{} --steps 4 --resume {} --json {}", args, ckpt.string(),
                            (dir / "resumed.json").string()),
                dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err;
  EXPECT_NE(resumed.out.find("(step 2)"), std::string::npos) << resumed.out;
  const auto straight = rows_of(dir / "straight.json"), rows = rows_of(dir / "resumed.json");
  ASSERT_EQ(rows.size(), 2U);
  ASSERT_EQ(straight.size(), 4U);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(rows[i][1], straight[2 + i][1]) << "loss of step " << 2 + i;
    EXPECT_EQ(rows[i][2], straight[2 + i][2]) << "grad norm of step " << 2 + i;
  }
}

// A disk that fills during the save after step 3 (rank 1's shard file cannot grow past half its
// size, so its write() fails), with the saves written in the step loop and on the writer thread:
// every rank exits non-zero, the one error line names the shard file, step 3 is no checkpoint,
// and --resume DIR continues from step 2 as the run that never stopped, bit for bit.
TEST(CheckpointRuns, Stage02_AFullDiskDuringASaveLeavesThePreviousCheckpoint) {
  TempDir dir;
  const std::string args = kTiny + " --task lm --optimizer adamw --lr 1e-3";
  run_ok("02_megatron_tp", 2,
         fmt::format("{} --steps 4 --json {}", args, (dir / "straight.json").string()), dir);
  const auto straight = rows_of(dir / "straight.json");
  ASSERT_EQ(straight.size(), 4U);
  for (const std::string mode : {"", "--async-save"}) {
    const fs::path ckpt = dir / (mode.empty() ? "sync" : "async");
    // Each rank's own exit status, written by a shell around it (mpirun reports one).
    const std::string cmd = fmt::format(
        "{} timeout 120 {} {} -np 2 sh -c '\"$0\" \"$@\"; echo $? > {}/exit-$OMPI_COMM_WORLD_RANK' "
        "{} {} --steps 4 --save {} --save-every 1 {} --fault-full-disk-in-save 1:3",
        kRootMpiEnv, TPX_MPIEXEC, TPX_MPIEXEC_FLAGS, dir.path().string(),
        stage_binary("02_megatron_tp"), args, ckpt.string(), mode);
    const CommandResult full = run_command(cmd, dir);
    for (int rank = 0; rank < 2; ++rank) {
      const fs::path status = dir / fmt::format("exit-{}", rank);
      ASSERT_TRUE(fs::exists(status)) << mode << " rank " << rank << "\n" << full.out << full.err;
      EXPECT_EQ(read_file(status), "1\n") << mode << " rank " << rank << "'s exit status";
      fs::remove(status);
    }
    std::vector<std::string> errors;
    for (const std::string& line : lines_of(full.err))
      if (line.starts_with("02_megatron_tp: error: ")) errors.push_back(line);
    ASSERT_EQ(errors.size(), 1U) << "the ranks' agreed error, printed once:\n" << full.err;
    EXPECT_NE(errors[0].find((ckpt / "step-3.tmp" / "rank-1.bin").string()), std::string::npos)
        << errors[0];
    EXPECT_NE(errors[0].find("File too large"), std::string::npos) << errors[0];
    EXPECT_TRUE(fs::exists(ckpt / "step-2" / "index.json")) << mode;
    EXPECT_FALSE(fs::exists(ckpt / "step-3")) << mode << ": a checkpoint of the failed save";
    EXPECT_FALSE(fs::exists(ckpt / "step-4")) << mode << ": the run went on after the failure";
    const fs::path out = dir / (ckpt.filename().string() + ".json");
    const CommandResult resumed = run_stage(
        "02_megatron_tp", 2,
        fmt::format("{} --steps 4 --resume {} --json {}", args, ckpt.string(), out.string()), dir);
    ASSERT_EQ(resumed.exit_code, 0) << mode << "\n" << resumed.out << resumed.err;
    EXPECT_NE(resumed.out.find("(step 2)"), std::string::npos) << resumed.out;
    const auto rows = rows_of(out);
    ASSERT_EQ(rows.size(), 2U) << mode;
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(rows[i][1], straight[2 + i][1]) << mode << " loss of step " << 2 + i;
      EXPECT_EQ(rows[i][2], straight[2 + i][2]) << mode << " grad norm of step " << 2 + i;
    }
  }
}

// The flags' own rules, before anything runs.
TEST(CheckpointRuns, Stage01_RefusesBadCheckpointFlags) {
  TempDir dir;
  const std::string args = kTiny + " --task lm";
  expect_refused_once("01_baseline", 1, args + " --save-every 2", "--save-every needs --save");
  expect_refused_once("01_baseline", 1,
                      args + " --save " + (dir / "x").string() + " --save-every 0",
                      "--save-every '0': must be a positive number");
  fs::create_directories(dir / "empty");
  expect_refused_once("01_baseline", 1, args + " --resume " + (dir / "empty").string(),
                      "no checkpoint in it");
  expect_refused_once("01_baseline", 1, args + " --resume " + (dir / "none").string(),
                      "no such directory");
  expect_refused_once("01_baseline", 1, args + " --check --resume " + (dir / "empty").string(),
                      "--check compares a run from initialisation");
  std::ofstream(dir / "file") << "x";
  expect_refused_once("01_baseline", 1, args + " --save " + (dir / "file").string(),
                      "not a directory");
}

// The checkpoint's step against --steps (counted from the start of training), and its seed.
TEST(CheckpointRuns, Stage01_RefusesAStepOrSeedThatDoesNotContinue) {
  Saved s;
  expect_refused_once("01_baseline", 1,
                      fmt::format("{} --steps 2 --resume {}", s.args, s.ckpt.string()),
                      "--steps 2: the checkpoint");
  expect_refused_once("01_baseline", 1,
                      fmt::format("{} --steps 4 --seed 7 --resume {}", s.args, s.ckpt.string()),
                      "--seed 7: the checkpoint");
}

}  // namespace
}  // namespace tpx::test
