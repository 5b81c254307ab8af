// The block as Llama 3 trains it, on every stage, from the outside as a user runs it:
//   - grouped-query attention (--kv-heads), the rotary embedding (--rope-theta) and full
//     activation recompute (--recompute) pass --check at N = 2 … 4 (and stage 02 at N = 1) with
//     NKV = NH, NH/2 and N, RoPE on and off, recompute none and full (every pair of values on
//     every stage and N, every combination on stage 03 at N = 2); each run's --dump equals stage 01's with the same flags
//     to 1e-5 of each tensor's scale;
//   - on the cpu, every --recompute policy (selective, full on every 2nd layer, full) gives bit for
//     bit the gradients and losses of none, at N = 2, 3 (and stage 02 at N = 1), and saves what the chapter's table
//     says, in that order, with the allocator's peak following; the repeated bus bytes and
//     recomputed FLOPs equal their formulas;
//   - saved-activation bytes, bus bytes (the forward's traffic counted twice under recompute) and
//     GEMM FLOPs equal the chapters' formulas, with NKV = NH and NKV < NH;
//   - bad combinations end every rank with exit 2 before a step runs, and one line printed once.
#include <cmath>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/npy.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using nlohmann::json;

/// Sizes that every rank count 1 … 4 divides with every NKV below: NH = 24 query heads of D = 4
/// (even, for RoPE's pairs), NH/2 = 12 KV heads, F = 48, S = 24.
struct Sizes {
  std::int64_t H = 96, NH = 24, F = 48, S = 24, B = 2, L = 2;
  std::string args() const {
    return fmt::format("--hidden {} --heads {} --ffn {} --seq {} --batch {} --layers {}", H, NH, F,
                       S, B, L);
  }
  std::int64_t D() const { return H / NH; }
};

/// The Llama-block flags of one run.
struct Block {
  std::int64_t kv_heads;
  double rope_theta;  ///< 0: off
  bool recompute;
  std::string args() const {
    return fmt::format("--kv-heads {} --rope-theta {} --recompute {}", kv_heads, rope_theta,
                       recompute ? "full" : "none");
  }
};

void PrintTo(const Block& b, std::ostream* os) {
  *os << b.args();
}

constexpr std::int64_t kFloat = 4;

using test::run_stage;

/// The tensors every stage dumps (the first step's, before any update).
std::vector<std::string> dump_names(const Sizes& z) {
  std::vector<std::string> names = {"output", "input.grad", "loss"};
  for (int l = 0; l < z.L; ++l)
    for (const char* p : {"norm1", "wq", "wk", "wv", "wo", "norm2", "w_gate", "w_up", "w_down"})
      names.push_back(fmt::format("layers.{}.{}.grad", l, p));
  return names;
}

/// Expects every dumped tensor in `got` within rtol · max|want| of `want`'s (rtol 0: bit for bit).
void expect_dumps_close(const std::filesystem::path& want_dir, const std::filesystem::path& got_dir,
                        const Sizes& z, double rtol, const std::string& what) {
  for (const auto& name : dump_names(z)) {
    const NpyArray want = read_npy(want_dir / (name + ".npy"));
    const NpyArray got = read_npy(got_dir / (name + ".npy"));
    ASSERT_EQ(got.shape, want.shape) << name << " " << what;
    double scale = 0.0, err = 0.0;
    for (std::size_t i = 0; i < want.data.size(); ++i) {
      scale = std::max(scale, std::abs(double(want.data[i])));
      err = std::max(err, std::abs(double(got.data[i]) - double(want.data[i])));
    }
    if (rtol == 0)
      EXPECT_EQ(got.data, want.data) << name << " differs: " << what;
    else
      EXPECT_LE(err, rtol * scale) << name << ": " << what;
  }
}

// --- --check and dumps against stage 01 on every stage and rank count --------------------------

struct Case {
  std::string stage;
  int ranks;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.stage << " -np " << c.ranks;
}

/// Six runs per stage and rank count that together take every pair of values of any two flags
/// (a pairwise covering of NKV ∈ {NH, NH/2, N} × RoPE on/off × recompute none/full): NKV = N is
/// one KV head per rank; RoPE runs at Llama 3's θ and at another.
std::vector<Block> blocks_for(const Sizes& z, int n) {
  return {{z.NH, 500000, false}, {z.NH, 0, true},   {z.NH / 2, 10000, true},
          {z.NH / 2, 0, false},  {n, 500000, true}, {n, 0, false}};
}

class LlamaBlock : public testing::TestWithParam<Case> {};

TEST_P(LlamaBlock, ChecksAndDumpsEqualStage01WithTheSameFlags) {
  const auto [stage, n] = GetParam();
  const Sizes z;
  // Stage 06 in fp32 is stage 05 with its FP8 machinery off: the dump comparison needs fp32;
  // its FP8 recipe is checked by FP8's own tolerances below.
  const std::string dtype = stage == "06_fp8" ? " --dtype fp32" : "";
  for (const Block& b : blocks_for(z, n)) {
    test::TempDir dir;
    const std::string flags = z.args() + " " + b.args() + " --steps 3";
    const auto ref = test::stage01_reference(flags);
    ASSERT_FALSE(ref.empty());
    const auto r =
        run_stage(stage, n, flags + dtype + " --check --dump " + (dir / "got").string(), dir);
    ASSERT_EQ(r.exit_code, 0) << b.args() << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(fmt::format("NKV {}", b.kv_heads)), std::string::npos) << r.out;
    expect_dumps_close(ref / "dump", dir / "got", z, 1e-5, b.args());
    const json cfg = json::parse(test::read_file(dir / "got" / "config.json"));
    EXPECT_EQ(cfg.at("kv_heads").get<std::int64_t>(), b.kv_heads);
    EXPECT_EQ(cfg.at("rope_theta").get<double>(), b.rope_theta);
    EXPECT_EQ(cfg.at("recompute").get<std::string>(), b.recompute ? "full" : "none");
  }
  if (stage == "06_fp8") {  // and its default, FP8, with GQA, RoPE and recompute
    test::TempDir dir;
    const Block b{n, 500000, true};
    const auto r = run_stage(stage, n, z.args() + " " + b.args() + " --steps 3 --check", dir);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  }
}

/// Every stage at N = 2, 3, 4, and stage 02 at N = 1 too (one rank of the TP machinery, the
/// same code path that stages 03–06 take at N = 1).
std::vector<Case> all_cases() {
  std::vector<Case> cases = {{"01_baseline", 1}, {"02_megatron_tp", 1}};
  for (const char* stage : {"02_megatron_tp", "03_sequence_parallel", "04_overlap_ring",
                            "05_copy_engine_async_tp", "06_fp8"})
    for (int n : {2, 3, 4}) cases.push_back({stage, n});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(stages, LlamaBlock, testing::ValuesIn(all_cases()), [](const auto& p) {
  return fmt::format("{}_np{}", p.param.stage.substr(0, 2), p.param.ranks);
});

// Every combination of the three flags on the sequence-parallel stage, where recompute repeats
// the most collectives and RoPE runs after the gather.
class LlamaFactorial : public testing::TestWithParam<Block> {};

TEST_P(LlamaFactorial, SequenceParallelChecksAtTwoRanks) {
  const Sizes z;
  test::TempDir dir;
  const auto r = run_stage("03_sequence_parallel", 2,
                           z.args() + " " + GetParam().args() + " --steps 3 --check", dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
}

std::vector<Block> factorial() {
  std::vector<Block> blocks;
  const Sizes z;
  for (std::int64_t kv : {z.NH, z.NH / 2, std::int64_t{2}})
    for (double theta : {0.0, 500000.0})
      for (bool recompute : {false, true}) blocks.push_back({kv, theta, recompute});
  return blocks;
}

INSTANTIATE_TEST_SUITE_P(flags, LlamaFactorial, testing::ValuesIn(factorial()), [](const auto& p) {
  return fmt::format("kv{}_rope{}_{}", p.param.kv_heads, p.param.rope_theta > 0 ? "on" : "off",
                     p.param.recompute ? "full" : "none");
});

// --- recompute: the same numbers, the chapters' bytes ------------------------------------------

/// Bytes of one layer's saved activations on one rank (the chapters' formula; fused attention):
/// x, h, x2, h2 [S/N or S, B, H] and rstd1, rstd2 [S·B (/N)] — split by N only under sequence
/// parallelism —; q, a [S, B, H/N]; k, v [S, B, NKV·D/N]; gate, up, s [S, B, F/N]; the
/// log-sum-exp [B, NH/N, S]. All fp32, except that stage 06 keeps h and h2 as FP8 (a byte each).
std::int64_t layer_saved_bytes(const Sizes& z, std::int64_t kv, std::int64_t n, bool sp, bool fp8) {
  // Stage 06 runs inside the bf16 recipe: its activations take e = 2 bytes (h and h2 are kept as
  // FP8 codes, 1 byte); the statistics (rstd, lse) stay fp32 everywhere.
  const std::int64_t e = fp8 ? 2 : kFloat;
  const std::int64_t tokens = z.S * z.B, seq_div = sp ? n : 1;
  const std::int64_t stream = e * 2 * tokens * z.H / seq_div + kFloat * 2 * tokens / seq_div;
  const std::int64_t split =
      e * (2 * tokens * z.H + 2 * tokens * kv * z.D() + 3 * tokens * z.F) / n +
      kFloat * z.B * z.NH * z.S / n;
  const std::int64_t h_h2 = 2 * tokens * z.H / seq_div * (fp8 ? 1 : kFloat);
  return stream + split + h_h2;
}

/// Full recompute keeps each layer's input x and, while a block's backward runs, the rest of
/// that block's activations: L·x + (layer − x).
std::int64_t saved_bytes(const Sizes& z, std::int64_t kv, std::int64_t n, bool sp, bool recompute,
                         bool fp8 = false) {
  const std::int64_t layer = layer_saved_bytes(z, kv, n, sp, fp8);
  const std::int64_t x = (fp8 ? 2 : kFloat) * z.S * z.B * z.H / (sp ? n : 1);
  return recompute ? z.L * x + (layer - x) : z.L * layer;
}

/// Bus bytes per rank and step (nccl-tests convention) of stages 02 and 03: per layer, stage 02
/// all-reduces the [S, B, H] stream twice in forward and twice in backward; stage 03 all-gathers
/// twice and reduce-scatters twice in forward, and in backward all-gathers twice, re-gathers twice
/// and reduce-scatters twice, plus the norm gains' all-reduce. Under full recompute the forward's
/// collectives run a second time. GQA changes none of it: the collectives move the stream.
std::uint64_t bus_bytes(const Sizes& z, std::int64_t n, bool sp, bool recompute) {
  const std::int64_t stream = kFloat * z.S * z.B * z.H, gains = kFloat * 2 * z.H;
  const std::int64_t forward = sp ? 4 : 2, backward = sp ? 6 : 2;
  const std::int64_t ops = forward * (recompute ? 2 : 1) + backward;
  if (!sp) return std::uint64_t(z.L * ops * stream * 2 * (n - 1) / n);
  return std::uint64_t(z.L * (ops * stream * (n - 1) / n + gains * 2 * (n - 1) / n));
}

/// GEMM FLOPs of a step on one rank: per layer forward 2·S·B·(2H² + 2H·NKV·D + 3HF) for the seven
/// linears plus 2·2·B·S²·H for QKᵀ and PV; backward twice the forward; 1/N per rank.
double model_flops(const Sizes& z, std::int64_t kv, std::int64_t n) {
  const double t = double(z.S * z.B), h = double(z.H), f = double(z.F), s = double(z.S);
  const double fwd =
      2 * t * (2 * h * h + 2 * h * double(kv * z.D()) + 3 * h * f) + 4 * double(z.B) * s * s * h;
  return 3 * fwd * double(z.L) / double(n);
}

/// A --recompute policy: its flags, and the layers it recomputes in full (of L).
struct Policy {
  std::string name, flags;
  std::int64_t every = 0;  ///< full recompute of layers l % every == 0; 0: none / selective
  bool selective = false;
  std::int64_t recomputed(std::int64_t layers) const {
    return every > 0 ? (layers + every - 1) / every : 0;
  }
};

const std::vector<Policy> kPolicies = {{"none", "--recompute none"},
                                       {"selective", "--recompute selective", 0, true},
                                       {"full2", "--recompute full --recompute-every 2", 2},
                                       {"full", "--recompute full", 1}};

/// Saved bytes per rank under a policy (the chapter's table): a recomputed layer keeps its input
/// x, the others all of `layer`; selective keeps `layer − cheap` everywhere (cheap: h and h2 as
/// the stage keeps them, rstd1, rstd2, s); and while one block's backward runs, what its
/// recompute made again: layer − x (full) or cheap (selective).
std::int64_t policy_saved_bytes(const Sizes& z, std::int64_t kv, std::int64_t n, bool sp, bool fp8,
                                const Policy& p) {
  const std::int64_t layer = layer_saved_bytes(z, kv, n, sp, fp8);
  const std::int64_t tokens = z.S * z.B / (sp ? n : 1), e = fp8 ? 2 : kFloat;
  const std::int64_t x = e * tokens * z.H;
  const std::int64_t cheap =
      2 * tokens * z.H * (fp8 ? 1 : kFloat) + 2 * kFloat * tokens + e * z.S * z.B * z.F / n;
  if (p.selective) return z.L * (layer - cheap) + cheap;
  const std::int64_t r = p.recomputed(z.L);
  return r == 0 ? z.L * layer : (z.L - r) * layer + r * x + (layer - x);
}

/// Bus bytes of one layer's forward collectives on one rank: what a recomputed layer moves again.
/// 02: two all-reduces of the stream; 03: two all-gathers and two reduce-scatters; 04, 05: those
/// four as N − 1 ring transfers of one [S/N, B, H] chunk; 06: the two gathers of FP8 codes (a
/// byte each), the two reduce-scatters (bf16: stage 06 runs inside the bf16 recipe) and the
/// forward's four MAX all-reduces of k amaxes, k ∈ {4, 2, 3, 2}.
std::uint64_t forward_bus_bytes(const std::string& s, const Sizes& z, std::int64_t n) {
  const std::int64_t elems = z.S * z.B * z.H, stream = kFloat * elems;
  if (s == "01") return 0;
  if (s == "02") return std::uint64_t(2 * (stream * 2 * (n - 1) / n));
  if (s == "03") return std::uint64_t(4 * (stream * (n - 1) / n));
  if (s == "04" || s == "05") return std::uint64_t(4 * (n - 1) * (stream / n));
  std::int64_t amax = 0;
  for (std::int64_t k : {4, 2, 3, 2}) amax += kFloat * k * 2 * (n - 1) / n;
  return std::uint64_t(2 * (n - 1) * (elems / n) + 2 * (n - 1) * (2 * elems / n) + amax);
}

class RecomputePolicies : public testing::TestWithParam<Case> {};

TEST_P(RecomputePolicies, SameBitsAsNoneAndTheChaptersBytes) {
  const auto [stage, n] = GetParam();
  const Sizes z{.L = 4};  // four layers: "every 2" recomputes two of them
  const std::int64_t kv = z.NH / 2;
  const std::string s = stage.substr(0, 2);
  const bool sp = s != "01" && s != "02", fp8 = s == "06";
  test::TempDir dir;
  std::map<std::string, json> runs;
  for (const Policy& p : kPolicies) {
    const auto r = run_stage(
        stage, n,
        fmt::format("{} --kv-heads {} {} --steps 3 --json {} --dump {}", z.args(), kv, p.flags,
                    (dir / (p.name + ".json")).string(), (dir / p.name).string()),
        dir);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    runs[p.name] = json::parse(test::read_file(dir / (p.name + ".json")));
    if (p.name != "none")
      expect_dumps_close(dir / "none", dir / p.name, z, 0.0, p.name + " against none");
  }
  const json& none = runs["none"];
  for (const Policy& p : kPolicies) {
    const json& j = runs[p.name];
    ASSERT_EQ(j.at("steps").size(), none.at("steps").size());
    for (std::size_t i = 0; i < none.at("steps").size(); ++i)
      EXPECT_EQ(j["steps"][i].at("loss").get<double>(), none["steps"][i].at("loss").get<double>())
          << p.name << " step " << i;
    EXPECT_EQ(j.at("saved_activation_bytes").get<std::int64_t>(),
              policy_saved_bytes(z, kv, n, sp, fp8, p))
        << p.name;
    const std::int64_t r = p.recomputed(z.L);
    EXPECT_EQ(j.at("recomputed_layers").get<std::int64_t>(), r) << p.name;
    EXPECT_DOUBLE_EQ(j.at("flops_per_step_per_rank").get<double>(), model_flops(z, kv, n));
    EXPECT_DOUBLE_EQ(j.at("recompute_flops_per_step_per_rank").get<double>(),
                     model_flops(z, kv, n) / 3 * double(r) / double(z.L))
        << p.name;
    const auto repeated = std::uint64_t(r) * forward_bus_bytes(s, z, n);
    for (std::size_t i = 0; i < j.at("steps").size(); ++i) {
      const json& row = j["steps"][i];
      EXPECT_EQ(row.at("recompute_bus_bytes").get<std::uint64_t>(), repeated) << p.name;
      EXPECT_EQ(row.at("comm_bus_bytes").get<std::uint64_t>(),
                none["steps"][i].at("comm_bus_bytes").get<std::uint64_t>() + repeated)
          << p.name;
    }
    if (s == "02" || s == "03") {  // and the whole step's bytes, from the chapters' formula
      EXPECT_EQ(j["steps"][0].at("comm_bus_bytes").get<std::uint64_t>(),
                bus_bytes(z, n, sp, false) + repeated);
    }
  }
  // The policies order by what they keep, and the allocator's peak follows.
  auto saved = [&](const char* p) { return runs[p].at("saved_activation_bytes").get<double>(); };
  auto peak = [&](const char* p) {
    std::uint64_t m = 0;
    for (const json& row : runs[p].at("steps"))
      m = std::max(m, row.at("peak_bytes").get<std::uint64_t>());
    return m;
  };
  EXPECT_GT(saved("none"), saved("selective"));
  EXPECT_GT(saved("none"), saved("full2"));
  EXPECT_GT(saved("full2"), saved("full"));
  EXPECT_GT(peak("none"), peak("selective"));
  EXPECT_GT(peak("none"), peak("full2"));
  EXPECT_GT(peak("full2"), peak("full"));
}

std::vector<Case> policy_cases() {
  std::vector<Case> cases = {{"01_baseline", 1}, {"02_megatron_tp", 1}};
  for (const char* stage : {"02_megatron_tp", "03_sequence_parallel", "04_overlap_ring",
                            "05_copy_engine_async_tp", "06_fp8"})
    for (int n : {2, 3}) cases.push_back({stage, n});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(stages, RecomputePolicies, testing::ValuesIn(policy_cases()),
                         [](const auto& p) {
                           return fmt::format("{}_np{}", p.param.stage.substr(0, 2), p.param.ranks);
                         });

// GQA shrinks Wk, Wv, k and v, and nothing that moves between TP ranks: the bus bytes at NKV < NH
// equal those at NKV = NH; FLOPs and saved bytes follow the formulas at both.
TEST(GroupedQueryAttention, BytesAndFlopsAtNkvEqualAndBelowNh) {
  const Sizes z;
  const int n = 2;
  for (const char* stage : {"02_megatron_tp", "03_sequence_parallel"}) {
    const bool sp = std::string(stage) == "03_sequence_parallel";
    std::map<std::int64_t, std::uint64_t> bus;
    for (std::int64_t kv : {z.NH, z.NH / 4}) {
      test::TempDir dir;
      const auto r =
          run_stage(stage, n,
                    fmt::format("{} {} --steps 2 --json {}", z.args(),
                                Block{kv, 500000, false}.args(), (dir / "s.json").string()),
                    dir);
      ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
      const json j = json::parse(test::read_file(dir / "s.json"));
      EXPECT_EQ(j.at("config").at("kv_heads").get<std::int64_t>(), kv);
      EXPECT_EQ(j.at("saved_activation_bytes").get<std::int64_t>(),
                saved_bytes(z, kv, n, sp, false))
          << stage << " NKV " << kv;
      EXPECT_DOUBLE_EQ(j.at("flops_per_step_per_rank").get<double>(), model_flops(z, kv, n));
      bus[kv] = j.at("steps")[1].at("comm_bus_bytes").get<std::uint64_t>();
      EXPECT_EQ(bus[kv], bus_bytes(z, n, sp, false));
    }
    EXPECT_EQ(bus[z.NH], bus[z.NH / 4]) << stage;
  }
}

// --- bad combinations ---------------------------------------------------------------------------

struct Bad {
  std::string stage;
  int ranks;
  std::string args;
  std::string says;  ///< a piece of the one line the job prints
};

void PrintTo(const Bad& b, std::ostream* os) {
  *os << b.stage << " -np " << b.ranks << " " << b.args;
}

class BadFlags : public testing::TestWithParam<Bad> {};

TEST_P(BadFlags, OneLineOnEveryRankAndExit2) {
  const Bad& b = GetParam();
  const std::string sizes =
      b.args.find("--hidden") == std::string::npos ? "--hidden 64 --heads 8 " : "";
  const auto r =
      test::expect_refused_once(b.stage, b.ranks, sizes + "--ffn 64 --seq 8 " + b.args, b.says);
  EXPECT_EQ(r.out.find("step"), std::string::npos) << "no step may run:\n" << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    flags, BadFlags,
    testing::Values(
        Bad{"01_baseline", 1, "--kv-heads 3", "--kv-heads (3) must divide --heads (8)"},
        Bad{"02_megatron_tp", 2, "--kv-heads 3", "--kv-heads (3) must divide --heads (8)"},
        Bad{"02_megatron_tp", 4, "--kv-heads 2", "--kv-heads (2) is not a multiple of 4"},
        Bad{"03_sequence_parallel", 4, "--kv-heads 2", "--kv-heads (2) is not a multiple of 4"},
        Bad{"05_copy_engine_async_tp", 4, "--kv-heads 1", "--kv-heads (1) is not a multiple of 4"},
        Bad{"02_megatron_tp", 2, "--rope-theta -1", "--rope-theta must be non-negative"},
        Bad{"01_baseline", 1, "--kv-heads 0", "--kv-heads must be positive"},
        Bad{"02_megatron_tp", 2, "--hidden 24 --heads 8", "head dim H/NH must be even"},
        Bad{"03_sequence_parallel", 2, "--recompute some", "--recompute"},
        Bad{"02_megatron_tp", 2, "--recompute-every 2", "--recompute-every chooses the layers"},
        Bad{"02_megatron_tp", 2, "--recompute selective --recompute-every 1",
            "--recompute-every chooses the layers"},
        Bad{"03_sequence_parallel", 2, "--layers 2 --recompute full --recompute-every 3",
            "--recompute-every must be 1"},
        Bad{"01_baseline", 1, "--recompute full --recompute-every 0",
            "--recompute-every must be 1"}),
    [](const auto& p) { return fmt::format("case{}", p.index); });

}  // namespace
}  // namespace tpx
