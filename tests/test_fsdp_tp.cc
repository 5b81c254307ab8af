// Stage 07 (FSDP × TP) as a user runs it, under mpirun:
//  - --check passes and the dumps equal stage 01's (whole model, whole batch) to 1e-5 on every
//    mesh the chapter names — 1, D 2 × TP 1, D 1 × TP 2, 2 × 2, 2 × 3, 3 × 2 — under SGD and
//    AdamW, and with a dim 0 that D does not divide (FSDP2's padding);
//  - the DP bytes of a step equal chapter 7's formula and the TP bytes equal stage 05's at the
//    same TP on the replica's B / D;
//  - the trace shows layer l+1's weight gather beside layer l's compute, and a gradient
//    reduce-scatter beside an earlier layer's backward;
//  - per-rank parameters, gradients and optimizer state fall as 1 / (T·D);
//  - the language model's ends (--task lm) are sharded like the layers: --check passes and the
//    dumps (embedding and output layer whole, unpadded) equal stage 01's on D 2 and D 2 × T 2
//    with a vocabulary T and D do not divide, fp32 and bf16; their DP bytes are two gathers'
//    and two reduce-scatters' of their shards; their estimated bytes fall as 1 / (T·D) and the
//    estimate, their gathered copies included, holds the measured peak;
//  - bad input is exit 2 on every rank and one line, printed once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/config.h"
#include "common/npy.h"
#include "common/traffic.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using json = nlohmann::json;
using test::expect_dumps_close;
using test::run_json;
using test::run_stage;

/// Sizes every mesh below divides: H = 96 (NH = 6, NKV = 6: whole heads at T = 1, 2, 3),
/// F = 192, S = 24, B = 6 (B / D whole at D = 1, 2, 3), two layers.
struct Sizes : test::Sizes {
  Sizes() {
    NH = 6;
    B = 6;
  }
};

struct Mesh {
  int ranks, dp;
  std::string optimizer;
};
void PrintTo(const Mesh& m, std::ostream* os) {
  *os << "np " << m.ranks << " dp " << m.dp << " " << m.optimizer;
}

class FsdpMesh : public testing::TestWithParam<Mesh> {};

TEST_P(FsdpMesh, ChecksAndDumpsEqualStage01) {
  const auto& [n, dp, optimizer] = GetParam();
  const Sizes z;
  const std::string opt =
      optimizer == "adamw" ? " --optimizer adamw --lr 1e-3" : " --optimizer sgd";
  test::TempDir dir;
  const auto ref = test::stage01_reference(z.args() + opt + " --steps 2");
  ASSERT_FALSE(ref.empty());
  const auto r = run_stage("07_fsdp_tp", n,
                           fmt::format("{}{} --dp {} --steps 2 --check --dump {}", z.args(), opt,
                                       dp, (dir / "07").string()),
                           dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(fmt::format("mesh D {} × TP {}", dp, n / dp)), std::string::npos) << r.out;
  expect_dumps_close(ref / "dump", dir / "07", 1e-5, fmt::format("np {} dp {}", n, dp));
  // The dump's config names the stage's own flags, numbers as numbers.
  const json cfg = json::parse(test::read_file(dir / "07" / "config.json"));
  EXPECT_EQ(cfg.at("dp").get<std::int64_t>(), dp) << cfg.dump();
}

INSTANTIATE_TEST_SUITE_P(Meshes, FsdpMesh,
                         testing::Values(Mesh{1, 1, "sgd"}, Mesh{2, 2, "sgd"}, Mesh{2, 1, "sgd"},
                                         Mesh{4, 2, "sgd"}, Mesh{6, 2, "sgd"}, Mesh{6, 3, "sgd"},
                                         Mesh{2, 2, "adamw"}, Mesh{4, 2, "adamw"},
                                         Mesh{6, 3, "adamw"}),
                         [](const auto& p) {
                           return fmt::format("np{}_dp{}_{}", p.param.ranks, p.param.dp,
                                              p.param.optimizer);
                         });

TEST(Fsdp, PadsADim0ThatDDoesNotDivide) {
  // H = 64, F = 128 at D = 3: every weight's 64 or 128 rows split 22 + 22 + 20 (or 43 + 43 + 42),
  // the gains' 64 likewise; the padding rows must neither move nor disturb anything.
  test::TempDir dir;
  const auto r =
      run_stage("07_fsdp_tp", 3,
                "--hidden 64 --heads 4 --ffn 128 --seq 16 --batch 3 --dp 3 --steps 3 --check "
                "--optimizer adamw --lr 1e-3",
                dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
}

/// One rank's DP bus bytes of a step (chapter 7): per layer two gathers of the layer's padded
/// flat shard (at e bytes an element: the compute copies; the norm gains stay fp32) and one fp32
/// reduce-scatter of its gradients, each (D−1)/D of D shards on the bus.
std::uint64_t dp_bus(const Sizes& z, int t, int d, bool bf16) {
  auto shard = [&](std::int64_t rows, std::int64_t cols) {  // ⌈rows/D⌉ · cols elements
    return (rows + d - 1) / d * cols;
  };
  const std::int64_t kv = z.H;  // NKV = NH
  const std::int64_t matrices = shard(z.H, z.H / t) + 2 * shard(z.H, kv / t) + shard(z.H / t, z.H) +
                                2 * shard(z.H, z.F / t) + shard(z.F / t, z.H);
  const std::int64_t gains = 2 * shard(z.H, 1);
  const std::int64_t e = bf16 ? 2 : 4;
  const std::int64_t gather = e * matrices + 4 * gains;  // one rank's part
  const std::int64_t reduce = 4 * (matrices + gains);
  return std::uint64_t(z.L * (2 * gather + reduce) * (d - 1));
}

TEST(Fsdp, DpBytesAreTheChaptersAndTpBytesAreStage05s) {
  const Sizes z;
  struct Split {
    int n, d;
    bool bf16;
  };
  for (const Split& s : {Split{2, 2, false}, Split{4, 2, false}, Split{4, 2, true},
                         Split{6, 3, false}, Split{6, 2, true}}) {
    const int t = s.n / s.d;
    const std::string dtype = s.bf16 ? " --dtype bf16" : "";
    const json j =
        run_json("07_fsdp_tp", s.n, fmt::format("{} --dp {} --steps 2{}", z.args(), s.d, dtype));
    ASSERT_TRUE(j.contains("steps"));
    Sizes replica = z;
    replica.B = z.B / s.d;
    const json tp = run_json("05_copy_engine_async_tp", t, replica.args() + " --steps 2" + dtype);
    ASSERT_TRUE(tp.contains("steps"));
    for (std::size_t i = 0; i < 2; ++i) {
      const json& row = j["steps"][i];
      const auto dp = row.at("dp_bus_bytes").get<std::uint64_t>();
      EXPECT_EQ(dp, dp_bus(z, t, s.d, s.bf16)) << "np " << s.n << " dp " << s.d << dtype;
      EXPECT_EQ(row.at("comm_bus_bytes").get<std::uint64_t>() - dp,
                tp["steps"][i].at("comm_bus_bytes").get<std::uint64_t>())
          << "np " << s.n << " dp " << s.d << dtype << ": the TP bytes";
    }
  }
}

TEST(Fsdp, TraceShowsThePrefetchAndTheReduceScatterInFlight) {
  Sizes z;
  z.L = 3;
  test::TempDir dir;
  const auto path = dir / "t.json";
  const auto r = run_stage(
      "07_fsdp_tp", 2, fmt::format("{} --dp 2 --steps 2 --trace {}", z.args(), path.string()), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const json t = json::parse(test::read_file(path));
  struct Span {
    std::string name;
    double t0, t1;
  };
  std::vector<Span> compute, dp, phases;
  for (const json& e : t.at("traceEvents")) {
    if (e.value("ph", "") != "X" || e.at("pid").get<int>() != 0) continue;
    const Span s{e.at("name").get<std::string>(), e.at("ts").get<double>(),
                 e.at("ts").get<double>() + e.at("dur").get<double>()};
    const int lane = e.at("tid").get<int>();
    if (lane == 0) compute.push_back(s);
    if (lane == 4) dp.push_back(s);
    if (lane == 3) phases.push_back(s);
  }
  ASSERT_FALSE(dp.empty()) << "no span on the dp comm lane";
  auto find = [](const std::vector<Span>& v, const std::string& name) {
    return std::find_if(v.begin(), v.end(), [&](const Span& s) { return s.name == name; });
  };
  // The schedule, read from the trace: layer 1's gather is on the DP-comm lane while layer 0's
  // forward is still computing (prefetched when layer 0 asked for its weights), and the last
  // layer's gradient reduce-scatter is on it while the next layer down is still in backward.
  // (How much of it physically overlaps depends on the cores: on a 2-core machine the ranks'
  // lane threads and compute threads take turns.)
  const auto g1 = find(dp, "layer 1 weights all-gather");
  const auto out1 = find(compute, "layer 1 weights copy-out");
  const auto fwd = find(phases, "forward");
  ASSERT_TRUE(g1 != dp.end() && out1 != compute.end() && fwd != phases.end());
  double layer0_end = 0;  // the last compute span of layer 0's forward
  for (const Span& c : compute)
    if (c.t0 >= fwd->t0 && c.t1 <= out1->t0) layer0_end = std::max(layer0_end, c.t1);
  // Prefetched: queued (the mark on the DP-comm lane) while layer 0's forward still computes.
  // When the lane thread starts it depends on the cores; when it was queued does not.
  const auto q1 = find(dp, "layer 1 weights all-gather queued");
  ASSERT_TRUE(q1 != dp.end()) << "no queued mark for layer 1's gather";
  EXPECT_LT(q1->t0, layer0_end) << "layer 1's weights were not gathered during layer 0's forward";
  // The last layer's reduce-scatter issued (its queued mark, as the gather's) while the layers
  // below it are still in backward; when the lane thread runs it depends on the cores again.
  ASSERT_TRUE(find(dp, "layer 2 grads reduce-scatter") != dp.end());
  const auto rs2 = find(dp, "layer 2 grads reduce-scatter queued");
  const auto bwd = find(phases, "backward");
  ASSERT_TRUE(rs2 != dp.end() && bwd != phases.end()) << "no queued mark for layer 2's reduction";
  EXPECT_LT(rs2->t0, bwd->t1) << "layer 2's gradients were reduced after backward ended";
  const bool later_compute = std::any_of(compute.begin(), compute.end(), [&](const Span& c) {
    return c.t0 >= rs2->t0 && c.t1 <= bwd->t1 && c.name.find("bwd") != std::string::npos;
  });
  EXPECT_TRUE(later_compute) << "no backward op of an earlier layer after layer 2's reduce-scatter "
                                "was issued";
}

TEST(Fsdp, MemoryEstimateHoldsAndShardsFallWithD) {
  // The header's estimate against the allocator's measured peak at D = 1, 2, 4 (TP = 1 and 2),
  // and the sharded terms of --json falling as 1/D.
  Sizes z;
  z.B = 4;
  std::uint64_t params_d1 = 0;
  for (const auto& [n, d] : std::vector<std::pair<int, int>>{{1, 1}, {2, 2}, {4, 4}, {4, 2}}) {
    const json j = run_json("07_fsdp_tp", n, fmt::format("{} --dp {} --steps 2", z.args(), d));
    ASSERT_TRUE(j.contains("steps"));
    const double est = j.at("memory_estimate_bytes").get<double>();
    const double peak = j["steps"][1].at("peak_bytes").get<double>();
    EXPECT_GE(est / peak, 0.9) << "np " << n << " dp " << d;
    EXPECT_LE(est / peak, 1.1) << "np " << n << " dp " << d;
    const auto params = j.at("memory_terms").at("parameters").get<std::uint64_t>();
    if (n == 1) params_d1 = params;
    if (n == d) {  // TP = 1: every parameter's 96 or 192 rows split evenly, no padding
      EXPECT_EQ(params * std::uint64_t(d), params_d1) << "D " << d;
    }
    EXPECT_EQ(j.at("memory_terms").contains("unsharded layers (FSDP)"), d > 1);
  }
}

// --- the language model's ends ------------------------------------------------------------------

/// The language model on synthetic ids at V = 101: padded to 102 at T = 2, and each TP rank's 51
/// (or 101) embedding rows split 26 + 25 (51 + 50, 34 + 34 + 33) over D.
constexpr const char* kLm = " --task lm --data synthetic --vocab 101";

struct LmMesh {
  int ranks, dp;
  std::string extra;  ///< dtype, optimizer
};
void PrintTo(const LmMesh& m, std::ostream* os) {
  *os << "np " << m.ranks << " dp " << m.dp << " " << m.extra;
}

class FsdpLm : public testing::TestWithParam<LmMesh> {};

// The ends' shards are gathered, used and reduce-scattered like a layer's: every gradient,
// embedding, final gain and output layer included, passes --check, and the dumps written from
// rank 0 (the shards gathered over D, then over T, the padding dropped) equal stage 01's: to
// 1e-5 in fp32; in bf16 to 5e-4 when T = 1 (the same roundings but for the order the DP
// reduce-scatter adds in fp32), and the check's own tolerance when TP's bf16 partial sums join.
TEST_P(FsdpLm, ChecksAndDumpsEqualStage01) {
  const auto& [n, dp, extra] = GetParam();
  const Sizes z;
  test::TempDir dir;
  const std::string common = fmt::format("{}{} {} --steps 2", z.args(), kLm, extra);
  const auto ref = test::stage01_reference(common);
  ASSERT_FALSE(ref.empty());
  const auto r = run_stage(
      "07_fsdp_tp", n,
      fmt::format("{} --dp {} --check --dump {}", common, dp, (dir / "07").string()), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  for (const char* name : {"embedding.grad", "norm_f.grad", "w_out.grad"})
    EXPECT_NE(r.out.find(name), std::string::npos) << name << " is not checked\n" << r.out;
  const NpyArray e = read_npy(dir / "07" / "embedding.npy"), w = read_npy(dir / "07" / "w_out.npy");
  EXPECT_EQ(e.shape, (std::vector<std::int64_t>{101, z.H}));
  EXPECT_EQ(w.shape, (std::vector<std::int64_t>{z.H, 101}));
  const bool bf16 = extra.find("bf16") != std::string::npos;
  if (!bf16 || n == dp)
    expect_dumps_close(ref / "dump", dir / "07", bf16 ? 5e-4 : 1e-5,
                       fmt::format("np {} dp {} {}", n, dp, extra));
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, FsdpLm,
    testing::Values(LmMesh{2, 2, ""}, LmMesh{4, 2, ""}, LmMesh{4, 2, "--optimizer adamw --lr 1e-3"},
                    LmMesh{3, 3, "--optimizer adamw --lr 1e-3"}, LmMesh{2, 2, "--dtype bf16"},
                    LmMesh{4, 2, "--dtype bf16 --optimizer adamw --lr 1e-3"}),
    [](const auto& p) { return fmt::format("np{}_dp{}_{}", p.param.ranks, p.param.dp, p.index); });

TEST(Fsdp, PadsTheLanguageModelsEndsThatDDoesNotDivide) {
  // H = 64 at D = 3: the final gain's and W_out's 64 rows split 22 + 22 + 20, the embedding's
  // 101 rows 34 + 34 + 33.
  test::TempDir dir;
  const auto r =
      run_stage("07_fsdp_tp", 3,
                std::string("--hidden 64 --heads 4 --ffn 128 --seq 16 --batch 3 --dp 3 --steps 3 "
                            "--check --optimizer adamw --lr 1e-3") +
                    kLm,
                dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
}

TEST(Fsdp, LmEndsDpBytesAreTwoGathersAndTwoReduceScattersOfTheirShards) {
  // --task lm minus --task block: the ends' DP bytes, by hand and by lm_grads_traffic() (what
  // --dry-run reports), and their four calls (the TP group's calls: the ends' on the ring).
  const Sizes z;
  struct Split {
    int n, d;
    bool bf16;
  };
  for (const Split& s : {Split{2, 2, false}, Split{4, 2, false}, Split{4, 2, true},
                         Split{3, 3, false}, Split{6, 2, true}}) {
    const int t = s.n / s.d;
    const std::string args =
        fmt::format("{} --dp {} --steps 1{}", z.args(), s.d, s.bf16 ? " --dtype bf16" : "");
    const json lm = run_json("07_fsdp_tp", s.n, args + kLm);
    const json block = run_json("07_fsdp_tp", s.n, args + " --task block");
    ASSERT_TRUE(lm.contains("steps") && block.contains("steps"));
    const json &a = lm["steps"][0], &b = block["steps"][0];
    auto diff = [&](const char* key) {
      return a.at(key).get<std::uint64_t>() - b.at(key).get<std::uint64_t>();
    };
    const std::string where = fmt::format("np {} dp {}{}", s.n, s.d, s.bf16 ? " bf16" : "");
    const auto [payload, bus] = test::lm_ends_dp_bytes(z.H, 101, t, s.d, 1, s.bf16);
    EXPECT_EQ(diff("dp_payload_bytes"), payload) << where;
    EXPECT_EQ(diff("dp_bus_bytes"), bus) << where;
    BlockConfig c;
    c.hidden = z.H, c.heads = z.NH, c.ffn = z.F, c.seq = z.S, c.batch = z.B, c.layers = z.L;
    c.task = Task::lm;
    c.vocab = 101;
    c.dtype = s.bf16 ? DType::bf16 : DType::f32;
    const Traffic ends = lm_grads_traffic(c, t, s.d, true, true);
    EXPECT_EQ(ends.payload, payload) << where;
    EXPECT_EQ(ends.bus, bus) << where;
    BlockConfig replica = c;
    replica.batch /= s.d;
    EXPECT_EQ(diff("comm_calls"), ends.calls + lm_traffic(replica, t, 0, TpLayout::ring).calls)
        << where;
  }
}

TEST(Fsdp, LmEndsBytesFallWithDAndTheEstimateHoldsThePeak) {
  // The estimate's embedding and output-layer terms are the rank's shards, ⌈rows/D⌉ of each
  // tensor (value and gradient, fp32), at the tutorial's block (H 256, S 128), where the blocks'
  // moments hold more than the ends' gathered copies: 1/D of D = 1's. And where the ends are
  // most of the memory (V = 16384, H = 32), the estimate, their gathered copies and unsharded
  // gradients included, is within 10 % of the allocator's measured peak (without them it is
  // some 23 % below at D = 2, 40 % at D = 4).
  constexpr std::int64_t V = 4096, H = 256;
  std::uint64_t embedding_d1 = 0, output_d1 = 0;
  for (const int d : {1, 2, 4}) {
    const json j = run_json(
        "07_fsdp_tp", d,
        fmt::format("--hidden {} --heads 8 --ffn 1024 --seq 128 --batch 4 --layers 2 --dp {} "
                    "--steps 1 --task lm --data synthetic --vocab {}",
                    H, d, V));
    ASSERT_TRUE(j.contains("steps"));
    const auto embedding = j.at("memory_terms").at("embedding").get<std::uint64_t>();
    const auto output = j.at("memory_terms").at("output layer").get<std::uint64_t>();
    EXPECT_EQ(embedding, std::uint64_t((V + d - 1) / d * H * 4 * 2)) << "D " << d;
    EXPECT_EQ(output, std::uint64_t((H + d - 1) / d * (V + 1) * 4 * 2)) << "D " << d;
    if (d == 1) embedding_d1 = embedding, output_d1 = output;
    EXPECT_EQ(embedding * std::uint64_t(d), embedding_d1) << "D " << d;
    EXPECT_EQ(output * std::uint64_t(d), output_d1) << "D " << d;
  }
  for (const int d : {2, 4}) {
    const json j =
        run_json("07_fsdp_tp", d,
                 fmt::format("--hidden 32 --heads 4 --ffn 64 --seq 32 --batch 4 --layers 1 --dp {} "
                             "--steps 2 --task lm --data synthetic --vocab 16384",
                             d));
    ASSERT_TRUE(j.contains("steps"));
    // The allocator does not see MPI's own staging of the reduce-scatter (a term of rank 0's
    // estimate at D > 2, for the host's peak), so it is left out of what is compared with it.
    const json& terms = j.at("memory_terms");
    const double est = j.at("memory_estimate_bytes").get<double>() -
                       terms.value("MPI reduce-scatter staging", 0.0);
    const double peak = j["steps"][1].at("peak_bytes").get<double>();
    EXPECT_GE(est / peak, 0.9) << "D " << d << ": " << j.at("memory_terms").dump();
    EXPECT_LE(est / peak, 1.1) << "D " << d << ": " << j.at("memory_terms").dump();
  }
}

TEST(Fsdp, BadMeshesAreOneLineOnEveryRank) {
  const Sizes z;
  struct Bad {
    int n;
    std::string args, words;
  };
  for (const Bad& b :
       {Bad{3, "--dp 2", "must divide the 3 ranks"}, Bad{4, "--dp 4", "must divide --batch 6"},
        Bad{2, "--dp -1", "must be a positive number"}})
    test::expect_refused_once("07_fsdp_tp", b.n, z.args() + " --steps 1 " + b.args, b.words);
  test::expect_refused_once("05_copy_engine_async_tp", 2, z.args() + " --steps 1 --dp 2", "--dp");
}

}  // namespace
}  // namespace tpx
