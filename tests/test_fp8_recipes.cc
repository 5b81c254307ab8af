// Stage 06 under --fp8-recipe rowwise, block128, mxfp8 and nvfp4 (06_fp8/layers.h): --check against
// the double reference that emulates the recipe at N = 1, 2, 4, and the stage nearer to that
// emulation than to the plain reference or another recipe's; the meshes whose shards would cut a
// 128-block refused, and the cuda device refused; a step's bytes against the formula; the dumped
// layer-0 weight codes and scales against common/lowp.h's quantizer applied to the dumped fp32
// weights; the recipe in config.json; stage 07 under each recipe (its replicas' tokens, its bytes
// against its dry run, its weights gathered as FP8); nvfp4's Hadamard transform.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "06_fp8/traffic.h"
#include "07_fsdp_tp/traffic.h"
#include "common/lowp.h"
#include "common/npy.h"
#include "common/reference.h"
#include "common/scaled_gemm_plan.h"
#include "test_cuda.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using lowp::Recipe;
using nlohmann::json;
using test::run_stage;

/// A block whose every split length is a multiple of 128 on 1, 2 and 4 ranks (H/4 = NKV·D/4 =
/// F/4 = 128), so block128 and mxfp8 run at every N; H = 512 is four 128-blocks (sixteen
/// 32-blocks) along each row of the column inputs.
constexpr const char* kSizes =
    "--hidden 512 --heads 4 --ffn 512 --seq 8 --batch 2 --layers 2 --steps 2";

/// The recipes with finer blocks check on a narrower block, a quarter of the work: every split
/// length a multiple of 32 on 1, 2 and 4 ranks (H/4 = NKV·Dh/4 = F/4 = 32), mxfp8's block.
constexpr const char* kNarrowSizes =
    "--hidden 128 --heads 4 --ffn 128 --seq 8 --batch 2 --layers 2 --steps 2";

/// The sizes a recipe's --check runs at: block128 needs 128 along every split.
const char* check_sizes(std::string_view recipe) {
  return recipe == "block128" ? kSizes : kNarrowSizes;
}

struct Case {
  const char* recipe;
  int ranks;
  const char* stage = "06_fp8";
  const char* mesh = "";  ///< stage 07's --dp, when not its default
  int keep = 0;           ///< --fp8-keep-last: the last blocks kept out of the recipe
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.stage << " " << c.recipe << " at N = " << c.ranks << " " << c.mesh << " keep " << c.keep;
}

class RecipeCheck : public ::testing::TestWithParam<Case> {};

// --check compares with the double reference emulating the recipe (common/reference.h) under the
// stage's FP8 tolerance (relative error 0.1 of the largest value, gradient cosine 0.98, losses
// 2e-2; common/stage.cc's kFp8Check), the one tensorwise is held to against stage 01 in fp32. It
// holds against the plain reference too, for the same reason: every operand element
// is an E4M3 (3 mantissa bits, relative rounding error ≤ 2^-4) or E5M2 (≤ 2^-3) value times its
// scale, and a finer scale only shrinks the share of values pushed into the subnormals, so each
// element's error stays within E4M3's/E5M2's, and a K-long dot product of such errors sums to a
// relative error of the same order as tensorwise's. block128 uses E4M3 for the gradients too:
// one bit more of mantissa than E5M2. mxfp8's power-of-two scales leave each block's largest
// element between 256 and 448 (or saturated at 448) instead of at 448: the same 3-bit mantissa.
// Each recipe runs on the language model (the default task), mxfp8 on the block too.
TEST_P(RecipeCheck, PassesCheck) {
  const Case c = GetParam();
  test::TempDir dir;
  for (const char* task : {"lm", "block"}) {
    if (std::string_view(task) == "block" &&
        (std::string_view(c.recipe) != "mxfp8" || std::string_view(c.stage) != "06_fp8"))
      continue;
    const auto r = run_stage(c.stage, c.ranks,
                             fmt::format("{} --task {} --dtype fp8 --fp8-recipe {} --check {} "
                                         "--fp8-keep-last {}",
                                         check_sizes(c.recipe), task, c.recipe, c.mesh, c.keep),
                             dir);
    EXPECT_EQ(r.exit_code, 0) << task << r.out << r.err;
    if (std::string_view(c.recipe) != "tensorwise") {
      EXPECT_NE(r.out.find("emulating --fp8-recipe"), std::string::npos) << r.out;
    }
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << task << r.out;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fp8Recipes, RecipeCheck,
    ::testing::Values(Case{"rowwise", 1}, Case{"rowwise", 2}, Case{"rowwise", 4},
                      Case{"block128", 1}, Case{"block128", 2}, Case{"block128", 4},
                      Case{"mxfp8", 1}, Case{"mxfp8", 2}, Case{"mxfp8", 4}, Case{"nvfp4", 1},
                      Case{"nvfp4", 2}, Case{"nvfp4", 4},
                      // Stage 07: stage 06 in each TP group of a D × T mesh
                      // (D 2 × T 2 at N = 4), or D 2 alone.
                      Case{"tensorwise", 4, "07_fsdp_tp"},
                      Case{"rowwise", 2, "07_fsdp_tp", "--dp 2"}, Case{"rowwise", 4, "07_fsdp_tp"},
                      Case{"block128", 4, "07_fsdp_tp"}, Case{"mxfp8", 4, "07_fsdp_tp"},
                      Case{"nvfp4", 4, "07_fsdp_tp"}, Case{"nvfp4", 2, "07_fsdp_tp", "--dp 2"},
                      // and its weights gathered as FP8.
                      Case{"tensorwise", 2, "07_fsdp_tp", "--dp 2 --fp8-weight-gather"},
                      Case{"tensorwise", 4, "07_fsdp_tp", "--fp8-weight-gather"},
                      // The last of the two blocks kept out of the recipe (--fp8-keep-last 1):
                      // the reference keeps it out too.
                      Case{"nvfp4", 1, "06_fp8", "", 1}, Case{"nvfp4", 2, "06_fp8", "", 1},
                      Case{"nvfp4", 4, "06_fp8", "", 1}, Case{"rowwise", 2, "06_fp8", "", 1},
                      Case{"nvfp4", 1, "07_fsdp_tp", "", 1},
                      Case{"nvfp4", 2, "07_fsdp_tp", "--dp 2", 1},
                      Case{"nvfp4", 4, "07_fsdp_tp", "", 1}, Case{"mxfp8", 4, "07_fsdp_tp", "", 1},
                      Case{"tensorwise", 4, "07_fsdp_tp", "--fp8-weight-gather", 1}),
    [](const auto& p) {
      return fmt::format("{}_{}_np{}_{}", std::string_view(p.param.stage).substr(0, 2),
                         p.param.recipe, p.param.ranks, p.index);
    });

// --fp8-keep-last keeps the last blocks' linear layers out of the recipe (06_fp8/layers.h):
// their GEMMs are stage 05's bf16 ones. Checked three ways that fail if the flag is ignored.
// (1) Keeping every block is the bf16 recipe itself: every step's loss and gradient norm equal a
// --dtype bf16 run's bit for bit, on stage 06 and on stage 07 (whose weights then travel fp32,
// the dtype they are stored in under fp8, with no amax, --fp8-weight-gather or not). (2) With
// one of two blocks kept under nvfp4, --check compares with a reference that keeps that block
// out as well (common/reference.h, LowpEmulation::keep_last): the kept block's gradients agree
// with it as bf16 agrees with double (measured cosine ≥ 0.9994 at N = 2, against 0.987-0.992 for
// the quantized block's), so a stage that quantized it, or a reference that did, would sit at
// the quantized block's distance; the quantized block stays there (the contrast is real). On the
// language model, whose cross-entropy spreads the quantization further than the blocks' loss.
TEST(Fp8Recipes, KeptBlocksRunTheUnquantizedGemms) {
  const std::string sizes =
      "--hidden 128 --heads 4 --ffn 128 --seq 8 --batch 4 --layers 2 --steps 2";
  auto steps = [](const nlohmann::json& j) {
    std::vector<std::pair<double, double>> out;
    for (const auto& s : j.at("steps")) out.emplace_back(s.at("loss"), s.at("grad_norm"));
    return out;
  };
  for (const auto& [stage, n] : {std::pair{"06_fp8", 2}, std::pair{"07_fsdp_tp", 4}}) {
    const json bf16 = test::run_json(stage, n, sizes + " --dtype bf16");
    ASSERT_TRUE(bf16.contains("steps")) << stage;
    for (const char* recipe : {"tensorwise --fp8-weight-gather", "nvfp4"}) {
      if (std::string_view(stage) == "06_fp8" && std::string_view(recipe) != "nvfp4") continue;
      const json kept = test::run_json(
          stage, n, fmt::format("{} --dtype fp8 --fp8-recipe {} --fp8-keep-last 2", sizes, recipe));
      ASSERT_TRUE(kept.contains("steps")) << stage << " " << recipe;
      EXPECT_EQ(steps(kept), steps(bf16)) << stage << " " << recipe;
    }
  }
  const json one = test::run_json(
      "06_fp8", 2, sizes + " --task lm --dtype fp8 --fp8-recipe nvfp4 --fp8-keep-last 1 --check");
  ASSERT_TRUE(one.contains("check"));
  double kept_min = 1.0, quantized_max = 0.0;
  int kept_rows = 0, quantized_rows = 0;
  for (const auto& row : one["check"].at("tensors")) {
    const std::string name = row.at("tensor");
    const double cosine = row.at("cosine");
    if (name.starts_with("layers.1.")) {
      kept_min = std::min(kept_min, cosine);
      ++kept_rows;
    } else if (name.starts_with("layers.0.w")) {
      quantized_max = std::max(quantized_max, cosine);
      ++quantized_rows;
    }
  }
  EXPECT_EQ(kept_rows, 9);
  EXPECT_EQ(quantized_rows, 7);
  EXPECT_GE(kept_min, 0.998) << "the kept block's gradients against the emulation";
  EXPECT_LT(quantized_max, 0.998) << "the quantized block's";
  EXPECT_TRUE(one["check"].at("pass").get<bool>());
}

// --fp8-keep-last is a number of the last blocks, 0 to L, and means something only where FP8
// GEMMs run: anything else is one line naming the flag and its rule (exit 2), on every stage
// that takes it, before a rank builds anything.
TEST(Fp8Recipes, KeepLastOutsideItsRangeIsRefusedOnce) {
  for (const char* stage : {"06_fp8", "07_fsdp_tp"}) {
    for (const char* n : {"3", "-1"})
      test::expect_refused_once(
          stage, 2, fmt::format("--layers 2 --dtype fp8 --fp8-recipe nvfp4 --fp8-keep-last {}", n),
          fmt::format("--fp8-keep-last {}: the number of last blocks kept out of the recipe must "
                      "lie in [0, --layers 2]",
                      n));
    test::expect_refused_once(stage, 2, "--layers 2 --dtype bf16 --fp8-keep-last 1",
                              "--fp8-keep-last 1: keeps blocks out of the FP8 GEMMs, which "
                              "--dtype bf16 does not run");
    // Parsed strictly, as every numeric flag (common/cli_flags.h).
    test::expect_refused_once(stage, 2, "--layers 2 --dtype fp8 --fp8-keep-last 2.5",
                              "--fp8-keep-last '2.5': not an integer");
  }
}

TEST(Fp8Recipes, ABlockAShardWouldCutIsRefusedOnce) {
  // H = 256 over 4 ranks: NH·Dh/N = 64 (Wq's columns, Wo's rows) is half a block.
  test::expect_refused_once(
      "06_fp8", 4,
      "--hidden 256 --heads 4 --ffn 512 --seq 8 --batch 2 --layers 1 --fp8-recipe block128",
      "--fp8-recipe block128");
  // The dry run states the same rule.
  test::expect_refused_once("06_fp8", 4,
                            "--hidden 256 --heads 4 --ffn 512 --seq 8 --batch 2 --layers 1 "
                            "--fp8-recipe block128 --dry-run",
                            "a multiple of 128");
  // mxfp8's 32-blocks: H = 192 over 4 ranks leaves NH·Dh/N = 48 per rank.
  test::expect_refused_once(
      "06_fp8", 4,
      "--hidden 192 --heads 4 --ffn 512 --seq 8 --batch 2 --layers 1 --fp8-recipe mxfp8",
      "--fp8-recipe mxfp8");
  test::expect_refused_once("06_fp8", 4,
                            "--hidden 192 --heads 4 --ffn 512 --seq 8 --batch 2 --layers 1 "
                            "--fp8-recipe mxfp8 --dry-run",
                            "a multiple of 32");
  // nvfp4's 16-blocks: H = 96 over 4 ranks leaves 24 per rank.
  test::expect_refused_once(
      "06_fp8", 4,
      "--hidden 96 --heads 4 --ffn 512 --seq 8 --batch 2 --layers 1 --fp8-recipe nvfp4",
      "a multiple of 16");
  // nvfp4's codes travel two to a byte along H, on one rank too.
  test::expect_refused_once("06_fp8", 1,
                            "--hidden 9 --heads 3 --ffn 8 --seq 8 --batch 2 --layers 1 "
                            "--rope-theta 0 --fp8-recipe nvfp4",
                            "H must be even");
  // rowwise has no block to cut: the same mesh runs.
  test::TempDir dir;
  const auto r = run_stage("06_fp8", 4,
                           "--hidden 256 --heads 4 --ffn 512 --seq 8 --batch 2 --layers 1 --steps "
                           "1 --fp8-recipe rowwise",
                           dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

// On a GPU every recipe runs the cpu's code through the cuda ops (the casts bit for bit, the
// dequantized operands multiplied by cuBLAS in fp32) and passes --check against the same
// emulating reference; scripts/gpu-validate.sh runs np 2 too.
TEST(Fp8Recipes, OnCudaEachRecipePassesItsCheck) {
  TPX_REQUIRE_GPU();
  test::TempDir dir;
  for (const char* recipe : {"rowwise", "block128", "mxfp8", "nvfp4"}) {
    const auto r = run_stage(
        "06_fp8", 1,
        fmt::format("{} --device cuda --fp8-recipe {} --check", check_sizes(recipe), recipe), dir);
    EXPECT_EQ(r.exit_code, 0) << recipe << r.out << r.err;
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << recipe << r.out;
    // The header says how the GEMMs multiply: on Hopper rowwise and block128 through cuBLASLt's
    // scale modes, mxfp8 and nvfp4 (and everything on another GPU) dequantized.
    const lowp::Recipe rc = *lowp::parse_recipe(recipe);
    const std::string words =
        lowp::native::gemm_words(rc, ops::scaled_gemm_problem(Device::cuda, rc).empty());
    EXPECT_NE(r.out.find(fmt::format("(--fp8-recipe {}: {})", recipe, words)), std::string::npos)
        << recipe << r.out;
  }
}

// The comm counts of a step at N = 2: tensorwise's eight MAX all-reduces of k ∈ {4,2,3,2,3,2,2,2}
// fp32 amaxes per layer (payload and bus 4k each at N = 2) are gone under rowwise and block128,
// and each of the six FP8 gathers per layer carries its chunk's scales in a second ring of N − 1
// transfers: S·B/N rows of 1 (rowwise) or H/128 (block128) fp32 scales, or H/32 (mxfp8) E8M0
// scales of one byte.
TEST(Fp8Recipes, StepBytesFollowTheFormula) {
  const std::int64_t H = 512, S = 8, B = 2, L = 2, N = 2;
  const std::string args = fmt::format(
      "--hidden {} --heads 4 --ffn 512 --seq {} --batch {} --layers {} --steps 1", H, S, B, L);
  auto step = [&](const char* recipe) {
    const json j = test::run_json("06_fp8", int(N), args + " --fp8-recipe " + recipe);
    return j.empty() ? json::object() : j.at("steps").at(0);
  };
  const json tw = step("tensorwise"), rw = step("rowwise"), bl = step("block128"),
             mx = step("mxfp8"), nv = step("nvfp4");
  ASSERT_FALSE(tw.empty() || rw.empty() || bl.empty() || mx.empty() || nv.empty());
  auto get = [](const json& s, const char* key) { return s.at(key).get<std::int64_t>(); };
  const std::int64_t amax = L * 4 * (4 + 2 + 3 + 2 + 3 + 2 + 2 + 2);  // payload = bus at N = 2
  const std::int64_t rows = S * B / N;
  for (const auto& [s, per_row, bytes] : {std::tuple{rw, std::int64_t{1}, 4},
                                          std::tuple{bl, H / 128, 4}, std::tuple{mx, H / 32, 1}}) {
    const std::int64_t scales = L * 6 * (N - 1) * rows * per_row * bytes;
    for (const char* key : {"comm_payload_bytes", "comm_bus_bytes"})
      EXPECT_EQ(get(s, key), get(tw, key) - amax + scales) << key;
    EXPECT_EQ(get(s, "comm_calls"), get(tw, "comm_calls") - L * 8 + L * 6 * (N - 1));
  }
  // nvfp4 keeps eight amax all-reduces per layer, the tensor scales', k ∈ {4,2,3,2,10,3,7,3}; its
  // gathers move half a byte per element (E2M1 packed) and one UE4M3 byte per 16 of a row.
  {
    const std::int64_t nv_amax = L * 4 * (4 + 2 + 3 + 2 + 10 + 3 + 7 + 3);
    const std::int64_t half_codes = L * 6 * (N - 1) * (S * B * H / N) / 2;
    const std::int64_t scales = L * 6 * (N - 1) * rows * (H / 16);
    for (const char* key : {"comm_payload_bytes", "comm_bus_bytes"})
      EXPECT_EQ(get(nv, key), get(tw, key) - amax + nv_amax - half_codes + scales) << key;
    EXPECT_EQ(get(nv, "comm_calls"), get(tw, "comm_calls") + L * 6 * (N - 1));
  }
  // And tensorwise itself is the chapter's formula (06_fp8/traffic.h).
  BlockConfig c;
  c.hidden = H;
  c.heads = 4;
  c.ffn = 512;
  c.seq = S;
  c.batch = B;
  c.layers = L;
  c.task = Task::block;
  EXPECT_EQ(get(tw, "comm_bus_bytes"), std::int64_t(async_fp8::traffic(c, int(N)).bus));
  EXPECT_EQ(get(rw, "comm_bus_bytes"),
            std::int64_t(async_fp8::recipe_traffic(c, int(N), 0, Recipe::rowwise).bus));
  EXPECT_EQ(get(bl, "comm_bus_bytes"),
            std::int64_t(async_fp8::recipe_traffic(c, int(N), 0, Recipe::block128).bus));
  EXPECT_EQ(get(mx, "comm_bus_bytes"),
            std::int64_t(async_fp8::recipe_traffic(c, int(N), 0, Recipe::mxfp8).bus));
  EXPECT_EQ(get(nv, "comm_bus_bytes"),
            std::int64_t(async_fp8::recipe_traffic(c, int(N), 0, Recipe::nvfp4).bus));
  // --fp8-keep-last K: a kept layer moves stage 05's bf16 bytes (no codes, no scales, no amax),
  // the others the recipe's, so a step of K kept layers of L is the quantized step moved K/L of
  // the way to a --dtype bf16 step (stage 05's), in every count; and the formula says so.
  const json bf = test::run_json("06_fp8", int(N), args + " --dtype bf16").at("steps").at(0);
  for (const char* recipe : {"nvfp4", "mxfp8"}) {
    const json q = step(recipe);
    for (std::int64_t keep = 1; keep <= L; ++keep) {
      const json k = step(fmt::format("{} --fp8-keep-last {}", recipe, keep).c_str());
      ASSERT_FALSE(k.empty()) << recipe << keep;
      for (const char* key : {"comm_payload_bytes", "comm_bus_bytes", "comm_calls"})
        EXPECT_EQ(L * get(k, key), L * get(q, key) + keep * (get(bf, key) - get(q, key)))
            << recipe << " keep " << keep << " " << key;
      EXPECT_EQ(get(k, "comm_bus_bytes"),
                std::int64_t(async_fp8::recipe_traffic(c, int(N), 0, *lowp::parse_recipe(recipe),
                                                       async_fp8::Fp8Weights::kept, keep)
                                 .bus));
    }
  }
}

// Stage 07 under each recipe: a step moves what its dry run says (stage 06's recipe_traffic inside
// the TP group on B / D, the weights requantized for backward under tensorwise, plus FSDP's fp32
// gathers and reduce-scatters over DP), on D 2 × T 2, and saves what its dry run says (the row
// and block recipes keep a column input's bf16 shard, tensorwise its FP8 one).
TEST(Fp8Recipes, Stage07StepBytesAreItsDryRuns) {
  const std::string args =
      "--hidden 128 --heads 4 --ffn 256 --seq 8 --batch 4 --layers 2 --dtype fp8 --dp 2";
  // And with the last block kept out of the recipe (--fp8-keep-last 1): its TP bytes stage 05's,
  // its FSDP gathers fp32 under --fp8-weight-gather too, a recomputed kept block counted once more;
  // under tensorwise it saves its column inputs' bf16 shards where the others save FP8 codes.
  for (const char* recipe : {"tensorwise", "rowwise", "mxfp8", "nvfp4", "nvfp4 --fp8-keep-last 1",
                             "tensorwise --fp8-weight-gather --fp8-keep-last 1",
                             "mxfp8 --fp8-keep-last 1 --recompute full",
                             "tensorwise --fp8-keep-last 1 --recompute selective"}) {
    const std::string flags = fmt::format("{} --fp8-recipe {}", args, recipe);
    const json real = test::run_json("07_fsdp_tp", 4, flags + " --steps 1");
    const json dry = test::run_json("07_fsdp_tp", 4, flags + " --dry-run");
    ASSERT_TRUE(real.contains("steps") && dry.contains("step")) << recipe;
    for (const char* key :
         {"comm_payload_bytes", "comm_bus_bytes", "comm_calls", "dp_payload_bytes", "dp_bus_bytes"})
      EXPECT_EQ(dry["step"].at(key), real["steps"].at(0).at(key)) << recipe << " " << key;
    EXPECT_EQ(dry.at("saved_activation_bytes"), real.at("saved_activation_bytes")) << recipe;
    EXPECT_GT(dry["step"].at("comm_bus_bytes").get<std::int64_t>(),
              dry["step"].at("dp_bus_bytes").get<std::int64_t>())
        << recipe << ": the TP group moves bytes too";
  }
}

// --fp8-weight-gather: FSDP gathers the weight matrices as E4M3 codes under one scale per matrix
// agreed over the mesh, and the GEMMs use them as gathered. The scale is stage 06's tensorwise one
// (fmax over the whole weight's amax), so the codes are those stage 06 makes from the gathered
// fp32 weight: every step's loss and gradient norm equal the fp32 gather's bit for bit. The DP
// group's bytes are the formula's (07_fsdp_tp/traffic.h) in both, the matrices at 1 byte an
// element against 4, plus the amax all-reduces; and the flag is refused where it has no meaning.
TEST(Fp8Recipes, Stage07GathersFp8WeightsWithStage06sCodes) {
  BlockConfig c;
  c.hidden = 128;
  c.heads = 4;
  c.ffn = 256;
  c.seq = 8;
  c.batch = 4;
  c.layers = 2;
  c.task = Task::block;
  c.dtype = DType::e4m3;
  const std::string args = fmt::format(
      "--task block --hidden {} --heads {} --ffn {} --seq {} --batch {} --layers {} --steps 3 "
      "--dtype fp8 --dp 2",
      c.hidden, c.heads, c.ffn, c.seq, c.batch, c.layers);
  const json fp32 = test::run_json("07_fsdp_tp", 4, args);
  const json fp8 = test::run_json("07_fsdp_tp", 4, args + " --fp8-weight-gather");
  ASSERT_TRUE(fp32.contains("steps") && fp8.contains("steps"));
  ASSERT_EQ(fp32["steps"].size(), 3u);
  ASSERT_EQ(fp8["steps"].size(), 3u);
  for (std::size_t s = 0; s < 3; ++s) {
    const json &a = fp32["steps"][s], &b = fp8["steps"][s];
    EXPECT_EQ(a.at("loss").get<double>(), b.at("loss").get<double>()) << "step " << s;
    EXPECT_EQ(a.at("grad_norm").get<double>(), b.at("grad_norm").get<double>()) << "step " << s;
    EXPECT_EQ(a.at("dp_payload_bytes").get<std::uint64_t>(),
              fsdp::fsdp_traffic(c, 2, 2, 1, false).payload);
    EXPECT_EQ(b.at("dp_payload_bytes").get<std::uint64_t>(),
              fsdp::fsdp_traffic(c, 2, 2, 1, true).payload);
    EXPECT_EQ(b.at("dp_bus_bytes").get<std::uint64_t>(), fsdp::fsdp_traffic(c, 2, 2, 1, true).bus);
  }
  // Per layer and step two gathers of each rank's part: the seven matrices' shards (rows split
  // over D = 2) at 4 bytes, against 1 byte and the 7 amaxes' all-reduce over the 4 ranks.
  const std::uint64_t H = 128, F = 256, T = 2, D = 2, L = 2;
  const std::uint64_t matrix_elems =
      (H * (H / T) * 3 + (H / T) * H + H * (F / T) * 2 + (F / T) * H) / D;  // one rank's shard
  const std::uint64_t drop = L * 2 * D * matrix_elems * (4 - 1), amax = L * 2 * 7 * 4;
  EXPECT_EQ(fp32["steps"][0].at("dp_payload_bytes").get<std::uint64_t>() - drop + amax,
            fp8["steps"][0].at("dp_payload_bytes").get<std::uint64_t>());
  test::expect_refused_once("07_fsdp_tp", 2, "--fp8-weight-gather", "--dtype fp8");
  test::expect_refused_once("07_fsdp_tp", 2, "--fp8-weight-gather --dtype fp8 --fp8-recipe rowwise",
                            "--fp8-recipe tensorwise");
}

/// The [rows, cols] matrix m transposed.
std::vector<float> transposed(const std::vector<float>& m, std::int64_t rows, std::int64_t cols) {
  std::vector<float> t(m.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      t[std::size_t(c * rows + r)] = m[std::size_t(r * cols + c)];
  return t;
}

// The dump's layer-0 weight codes and scales are common/lowp.h's quantizer applied to the
// dumped fp32 weight W [in, out], as the forward GEMM takes it: Wᵀ [out, in], K = in along the
// blocks, bit for bit. At N = 1 the one shard is the whole weight, codes and scales. At N = 2
// the shards' codes, gathered, are still the whole weight's wherever no scale spans two shards:
// every weight under block128 (aligned 128-blocks), the column weights under rowwise (a row of
// Wᵀ is an output column, whole on its rank); the row weights' rows under rowwise are cut at
// in/N, so their scales are the shards' own and are not compared. mxfp8's E8M0 scales are
// compared as bytes (aligned 32-blocks, as block128's), and so are nvfp4's UE4M3 scales and its
// E2M1 codes (one to a byte): its tensor scale is agreed over the group, so the shards' codes are
// the whole weight's.
TEST(Fp8Recipes, DumpedWeightCodesAndScalesAreTheQuantizers) {
  for (const int n : {1, 2})
    for (const Recipe recipe : {Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4}) {
      const std::string name(lowp::to_string(recipe));
      test::TempDir dir;
      const auto r = run_stage("06_fp8", n,
                               fmt::format("--hidden 256 --heads 4 --ffn 512 --seq 8 --batch 2 "
                                           "--layers 1 --steps 1 --fp8-recipe {} --dump {}",
                                           name, (dir / "d").string()),
                               dir);
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      const json cfg = json::parse(test::read_file(dir / "d" / "config.json"));
      EXPECT_EQ(cfg.at("fp8_recipe").get<std::string>(), name);
      for (const std::string w : {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}) {
        const bool row_layer = w == "wo" || w == "w_down";
        if (n > 1 && recipe == Recipe::rowwise && row_layer) continue;
        const std::string what = fmt::format("{} np {} {}", name, n, w);
        const NpyArray master = read_npy(dir / "d" / fmt::format("layers.0.{}.npy", w));
        const NpyBytes codes = read_npy_bytes(dir / "d" / fmt::format("fp8/layers.0.{}.npy", w));
        // The scales: fp32 values, or mxfp8's E8M0 and nvfp4's UE4M3 codes as bytes.
        const std::filesystem::path scale_path =
            dir / "d" / fmt::format("fp8/layers.0.{}.scale.npy", w);
        const bool e8m0 = recipe == Recipe::mxfp8 || recipe == Recipe::nvfp4;
        const NpyArray scales = e8m0 ? NpyArray{} : read_npy(scale_path);
        const NpyBytes scale_codes = e8m0 ? read_npy_bytes(scale_path) : NpyBytes{};
        const std::vector<std::int64_t>& scale_shape = e8m0 ? scale_codes.shape : scales.shape;
        ASSERT_EQ(master.shape.size(), 2u);
        const std::int64_t in = master.shape[0], out = master.shape[1];
        const std::vector<float> wt = transposed(master.data, in, out);
        const lowp::Quantized q = lowp::quantize(wt.data(), out, in, recipe, lowp::Operand::weight);
        EXPECT_EQ(codes.shape, master.shape) << what;
        ASSERT_EQ(codes.data.size(), q.codes.size()) << what;
        std::int64_t differ = 0;
        for (std::int64_t i = 0; i < in; ++i)
          for (std::int64_t o = 0; o < out; ++o)
            differ += codes.data[std::size_t(i * out + o)] != q.codes[std::size_t(o * in + i)];
        EXPECT_EQ(differ, 0) << what << ": codes differ";
        // nvfp4's tensor scale: the whole weight's s_enc, agreed by the ranks.
        const std::filesystem::path tensor_scale =
            dir / "d" / fmt::format("fp8/layers.0.{}.tensor_scale.npy", w);
        if (recipe == Recipe::nvfp4) {
          EXPECT_EQ(read_npy(tensor_scale).data, std::vector<float>{q.tensor_scale}) << what;
        } else {
          EXPECT_FALSE(std::filesystem::exists(tensor_scale)) << what;
        }
        if (n > 1) {
          EXPECT_EQ(scale_shape.at(0), n) << what;  // one set of scales per rank
          continue;
        }
        EXPECT_EQ(scale_shape, (std::vector<std::int64_t>{1, q.scale_rows, q.scale_cols})) << what;
        if (e8m0)
          EXPECT_EQ(scale_codes.data, q.scale_codes) << what;
        else
          EXPECT_EQ(scales.data, q.scales) << what;
      }
      // The gathered input: one scale per row (rowwise), per 128 of a row (block128) or per 32
      // (mxfp8) of each rank's [S/N·B, H] shard.
      const std::int64_t per_row = recipe == Recipe::rowwise    ? 1
                                   : recipe == Recipe::block128 ? 2
                                   : recipe == Recipe::mxfp8    ? 8
                                                                : 16;
      const std::filesystem::path input_scales = dir / "d" / "fp8/layers.0.qkv_in.scale.npy";
      EXPECT_EQ(recipe == Recipe::mxfp8 || recipe == Recipe::nvfp4
                    ? read_npy_bytes(input_scales).shape
                    : read_npy(input_scales).shape,
                (std::vector<std::int64_t>{n, 16 / n, per_row}));
    }
}

/// ‖got − want‖ / ‖want‖.
double relative_distance(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff += (double(got.at(i)) - want[i]) * (double(got.at(i)) - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

// The reference that emulates a recipe (common/reference.h, LowpEmulation) quantizes the GEMMs'
// operands as the stage does: the stage's first-step output and input gradient (one layer, the
// block task, so that little lies between the quantizers and the compared tensors) are nearer to
// the emulation of the stage's own recipe than to the plain double reference, and nearer than to
// the emulation of another recipe (a reference that quantizes differently from the stage).
// tensorwise too: its scale agreed over the group is the reference's whole-tensor one. The
// distance left is the stage's bf16 activations between the GEMMs and the FP8 roundings they flip
// (common/stage.cc, kFp8Check): measured, the own recipe's distance is 0.4–0.7 of the others'.
TEST(Fp8Recipes, TheStageIsNearestToTheEmulationOfItsOwnRecipe) {
  BlockConfig c;
  c.hidden = 512;
  c.heads = 4;
  c.ffn = 512;
  c.seq = 8;
  c.batch = 2;
  c.layers = 1;
  c.task = Task::block;
  const int n = 2;
  for (const Recipe recipe :
       {Recipe::tensorwise, Recipe::rowwise, Recipe::block128, Recipe::mxfp8, Recipe::nvfp4}) {
    const std::string name(lowp::to_string(recipe));
    test::TempDir dir;
    const auto r = run_stage(
        "06_fp8", n,
        fmt::format("--task block --hidden {} --heads {} --ffn {} --seq {} --batch {} --layers {} "
                    "--steps 1 --fp8-recipe {} --dump {}",
                    c.hidden, c.heads, c.ffn, c.seq, c.batch, c.layers, name, (dir / "d").string()),
        dir);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const std::vector<float> out = read_npy(dir / "d" / "output.npy").data;
    const std::vector<float> grad = read_npy(dir / "d" / "input.grad.npy").data;
    auto distances = [&](const ReferenceRun& want) {
      return std::pair{relative_distance(out, want.output),
                       relative_distance(grad, want.input_grad)};
    };
    const auto own = distances(reference_run_lowp(c, 1, {recipe, n}));
    const Recipe other = recipe == Recipe::rowwise ? Recipe::block128 : Recipe::rowwise;
    const std::vector<std::pair<std::string, std::pair<double, double>>> wrong{
        {"the plain reference", distances(reference_run(c, 1))},
        {std::string(lowp::to_string(other)), distances(reference_run_lowp(c, 1, {other, n}))}};
    for (const auto& [what, d] : wrong) {
      EXPECT_LT(own.first, 0.8 * d.first) << name << " output against " << what;
      EXPECT_LT(own.second, 0.8 * d.second) << name << " input gradient against " << what;
    }
  }
}

// Stage 07 under a row or block recipe: each DP replica quantizes the weight-gradient GEMMs'
// operands along its own tokens (its B / D batch columns), and the reduce-scatter sums the
// replicas' products. The emulation that does the same (LowpEmulation::replicas = D) is nearer to
// the stage's first-step weight gradients than the one that quantizes all tokens together (the
// single-replica stage 06's), on a mesh of D = 4 replicas of one TP rank each, 32 tokens each
// (measured: 0.67 of the distance under rowwise, 0.76 under block128, 0.58 under nvfp4, whose
// tensor scale is a replica's for every token operand).
TEST(Fp8Recipes, Stage07QuantizesEachReplicasTokensApart) {
  BlockConfig c;
  c.hidden = 128;
  c.heads = 4;
  c.ffn = 256;
  c.seq = 16;
  c.batch = 8;
  c.layers = 1;
  c.task = Task::block;
  const int d = 4;
  for (const Recipe recipe : {Recipe::rowwise, Recipe::block128, Recipe::nvfp4}) {
    const std::string name(lowp::to_string(recipe));
    test::TempDir dir;
    const auto r = run_stage(
        "07_fsdp_tp", d,
        fmt::format("--task block --hidden {} --heads {} --ffn {} --seq {} --batch {} --layers {} "
                    "--steps 1 --dtype fp8 --fp8-recipe {} --dp {} --dump {}",
                    c.hidden, c.heads, c.ffn, c.seq, c.batch, c.layers, name, d,
                    (dir / "d").string()),
        dir);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    // Every weight's gradient, one vector, and the same from a reference.
    std::vector<float> got;
    for (const char* w : {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}) {
      const std::vector<float> g =
          read_npy(dir / "d" / fmt::format("layers.0.{}.grad.npy", w)).data;
      got.insert(got.end(), g.begin(), g.end());
    }
    auto distance = [&](int replicas) {
      const ReferenceRun ref =
          reference_run_lowp(c, 1, {.recipe = recipe, .ranks = 1, .replicas = replicas});
      std::vector<double> want;
      for (const Param p : {Param::wq, Param::wk, Param::wv, Param::wo, Param::w_gate, Param::w_up,
                            Param::w_down}) {
        const auto& g = ref.grads.at(0)[static_cast<std::size_t>(p)];
        want.insert(want.end(), g.begin(), g.end());
      }
      return relative_distance(got, want);
    };
    const double own = distance(d), together = distance(1);
    EXPECT_LT(own, 0.85 * together) << name << ": " << own << " against " << together;
  }
}

// The first step's weight gradients of a run of `stage` on `n` ranks with `flags` (the block task,
// nvfp4) under config c, layer by layer (every weight's gradient in one vector), and its input
// gradient; their distances ‖got − want‖ / ‖want‖ from a reference emulating nvfp4 as
// `emulation` says, the stage's bf16 stores included (as --check's).
struct Nvfp4Grads {
  BlockConfig c;
  std::vector<std::vector<float>> layers;
  std::vector<float> input_grad;

  static constexpr std::array kWeights{Param::wq,     Param::wk,   Param::wv,    Param::wo,
                                       Param::w_gate, Param::w_up, Param::w_down};

  Nvfp4Grads(const BlockConfig& config, const char* stage, int n, const std::string& flags)
      : c(config) {
    test::TempDir dir;
    const auto r = run_stage(
        stage, n,
        fmt::format("--task block --hidden {} --heads {} --ffn {} --seq {} --batch {} --layers {} "
                    "--steps 1 --dtype fp8 --fp8-recipe nvfp4 {} --dump {}",
                    c.hidden, c.heads, c.ffn, c.seq, c.batch, c.layers, flags,
                    (dir / "d").string()),
        dir);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    if (r.exit_code == 0) input_grad = read_npy(dir / "d" / "input.grad.npy").data;
    for (std::int64_t l = 0; l < c.layers && r.exit_code == 0; ++l) {
      std::vector<float>& got = layers.emplace_back();
      for (const Param p : kWeights) {
        const std::vector<float> g =
            read_npy(dir / "d" / fmt::format("layers.{}.{}.grad.npy", l, param_name(p))).data;
        got.insert(got.end(), g.begin(), g.end());
      }
    }
  }
  /// Layer by layer, then the input gradient's.
  std::vector<double> distances(const LowpEmulation& emulation) const {
    const ReferenceRun ref = reference_run_lowp(c, 1, emulation);
    std::vector<double> out;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      std::vector<double> want;
      for (const Param p : kWeights) {
        const auto& g = ref.grads.at(l)[static_cast<std::size_t>(p)];
        want.insert(want.end(), g.begin(), g.end());
      }
      out.push_back(relative_distance(layers[l], want));
    }
    out.push_back(relative_distance(input_grad, ref.input_grad));
    return out;
  }
};

BlockConfig nvfp4_block(std::int64_t layers) {
  BlockConfig c;
  c.hidden = 128;
  c.heads = 4;
  c.ffn = 256;
  c.seq = 16;
  c.batch = 4;
  c.layers = layers;
  c.task = Task::block;
  c.dtype = DType::e4m3;
  return c;
}

// nvfp4 passes both weight-gradient operands through the random Hadamard transform along the
// tokens before it quantizes them (lowp::hadamard_rows). The stage's first-step weight gradients
// are nearer to the emulation that does the same than to the one that leaves the transform out
// (LowpEmulation::hadamard), on the block at N = 2: measured 0.024 against 0.187 in
// ‖got − want‖ / ‖want‖.
TEST(Fp8Recipes, Nvfp4TransformsTheWeightGradientOperands) {
  const int n = 2;
  const Nvfp4Grads run(nvfp4_block(1), "06_fp8", n, "");
  ASSERT_EQ(run.layers.size(), 1u);
  const double own =
      run.distances({.recipe = Recipe::nvfp4, .ranks = n, .bf16_tokens = true}).at(0);  // layer 0
  const double without =
      run.distances({.recipe = Recipe::nvfp4, .ranks = n, .bf16_tokens = true, .hadamard = false})
          .at(0);
  EXPECT_LT(own, 0.5 * without) << own << " against " << without;
}

// nvfp4 rounds the gradient operands stochastically (lowp::e2m1_encode_stochastic), each element
// with random bits of its place in the tensor and of the backward's number in the run
// (lowp::gradient_stream): the reference draws the same bits, so the stage's weight gradients are
// nearer to the emulation that rounds them so than to one that rounds them to nearest
// (LowpEmulation::stochastic), layer by layer (the numbering runs over the layers, the last
// first): stage 06 on 1 and 2 ranks (a rank's shard of the features or of the tokens), and stage
// 07 on D 2 × T 2 (each replica's tokens numbered from 0). The noise the rounding adds and the
// reference takes away again is what the distance to the nearest-rounding emulation measures.
TEST(Fp8Recipes, Nvfp4RoundsGradientsWithTheReferencesRandomBits) {
  struct Mesh {
    const char* stage;
    int n;
    std::string flags;
    int tp, dp;
  };
  for (const Mesh& m : {Mesh{"06_fp8", 1, "", 1, 1}, Mesh{"06_fp8", 2, "", 2, 1},
                        Mesh{"07_fsdp_tp", 4, "--dp 2", 2, 2}}) {
    SCOPED_TRACE(fmt::format("{} at N = {} {}", m.stage, m.n, m.flags));
    const Nvfp4Grads run(nvfp4_block(2), m.stage, m.n, m.flags);
    ASSERT_EQ(run.layers.size(), 2u);
    const LowpEmulation same{
        .recipe = Recipe::nvfp4, .ranks = m.tp, .replicas = m.dp, .bf16_tokens = true};
    LowpEmulation nearest = same;
    nearest.stochastic = false;
    const std::vector<double> own = run.distances(same), rne = run.distances(nearest);
    for (std::size_t l = 0; l < own.size(); ++l)
      EXPECT_LT(own[l], 0.6 * rne[l])
          << (l + 1 < own.size() ? fmt::format("layer {}", l) : std::string("input gradient"))
          << ": " << own[l] << " against " << rne[l];
  }
}

}  // namespace
}  // namespace tpx
