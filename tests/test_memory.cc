// The per-rank memory estimate (common/memory.h) against what training really takes: for stages
// 01 to 04 under mpirun -np 1 and 2, train() runs in-process and the cpu allocator's
// measured high-water mark must be within 10 % of the estimate, at the default config and at
// configs whose peak comes from elsewhere (long sequences: the attention probabilities), with
// fused attention (the default) and --attention naive, with GQA under full recompute, and under
// selective recompute and full recompute of every second layer. The
// saved-activation term must equal what
// training reports, byte for byte. At a long-sequence GPU config the fused estimate must fit
// an 80 GiB GPU where the naive one cannot. Sizes too large for 64
// bits must throw, never wrap; huge-but-representable configs must be estimated at once. And the
// host's available memory must be a plausible number.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "01_baseline/layers.h"
#include "02_megatron_tp/layers.h"
#include "03_sequence_parallel/layers.h"
#include "04_overlap_ring/layers.h"
#include "06_fp8/flags.h"
#include "06_fp8/layers.h"
#include "07_fsdp_tp/flags.h"
#include "07_fsdp_tp/layers.h"
#include "07_fsdp_tp/memory.h"
#include "09_pipeline_parallel/memory.h"
#include "common/checked.h"
#include "common/memory.h"
#include "common/ops.h"
#include "common/trainer.h"
#include "test_mpi.h"

namespace tpx {
namespace {

using test::world_rank;
using test::world_size;

using Factory = std::function<std::unique_ptr<Parallelism>(const RunContext&)>;

struct Stage {
  std::string name;
  Factory make;
};

struct Sizes {
  std::string name;
  BlockConfig config;
};

/// The tutorial's default config (H 256, NH 8, F 1024, S 128, B 2, L 2), two steps.
Sizes default_sizes() {
  BlockConfig c;
  c.steps = 2;
  return {"default", c};
}

/// Long sequence, narrow model: B·NH·S² probabilities outweigh every [S, B, H] and [S, B, F].
Sizes long_sequence(int steps) {
  BlockConfig c;
  c.hidden = 64;
  c.heads = 4;
  c.ffn = 128;
  c.seq = 512;
  c.batch = 1;
  c.layers = 2;
  c.steps = steps;
  return {fmt::format("long_sequence_{}_steps", steps), c};
}

/// Wide MLP, many tokens, one layer: the [S, B, F] tensors of the MLP backward dominate.
Sizes wide_mlp() {
  BlockConfig c;
  c.hidden = 64;
  c.heads = 4;
  c.ffn = 1024;
  c.seq = 64;
  c.batch = 8;
  c.layers = 1;
  c.steps = 2;
  return {"wide_mlp", c};
}

struct Case {
  Stage stage;
  Sizes sizes;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.stage.name << " " << c.sizes.name;
}

class MeasuredPeak : public testing::TestWithParam<Case> {};

TEST_P(MeasuredPeak, EstimateIsWithinTenPercentOfTheAllocatorsPeak) {
  const auto& [stage, sizes] = GetParam();
  StageOptions options;
  options.config = sizes.config;
  const BlockConfig& c = options.config;
  Trace trace;
  const std::unique_ptr<Parallelism> par =
      stage.make(RunContext{options, world_rank(), world_size(), trace});
  const Sharding sh = par->sharding();

  const MemoryEstimate estimate = estimate_training_memory(c, sh);
  Allocator& alloc = allocator_for(Device::cpu);
  alloc.reset_peak();
  const std::size_t before = alloc.stats().current;
  const TrainResult r = train(c, *par, /*snapshot=*/false, trace);
  const std::size_t measured = alloc.stats().peak - before;
  ASSERT_EQ(r.rows.size(), static_cast<std::size_t>(c.steps)) << r.diverged;

  const double ratio = double(estimate.total()) / double(measured);
  fmt::print("[ memory   ] {} {} rank {}/{}: estimate {} B, measured peak {} B (ratio {:.4f})\n",
             stage.name, sizes.name, sh.rank, sh.world, estimate.total(), measured, ratio);
  fmt::print("[ memory   ]   {}\n", estimate.describe());
  EXPECT_GE(ratio, 0.9) << estimate.describe();
  EXPECT_LE(ratio, 1.1) << estimate.describe();
  EXPECT_EQ(estimate.term("saved activations").bytes, r.saved_activation_bytes);
}

const Stage kBaseline{"baseline", [](const RunContext& ctx) -> std::unique_ptr<Parallelism> {
                        return std::make_unique<baseline::SerialLinears>(ctx.options.config.dtype);
                      }};
const Stage kMegatron{"megatron", megatron::make_megatron};
const Stage kSequenceParallel{"sequence_parallel", sp::make_sequence_parallel};
const Stage kOverlapRing{"overlap_ring", ring::make_overlap_ring};
const Stage kFp8{"fp8", [](const RunContext& ctx) { return async_fp8::make_fp8_async_tp(ctx); }};
/// Stage 07 with every rank its own DP replica (D = the ranks, TP = 1): FSDP at its fullest.
const Stage kFsdp{"fsdp", [](const RunContext& ctx) {
                    StageOptions o = ctx.options;
                    auto flags = std::make_shared<fsdp::DataParallelFlags>();
                    flags->dp = ctx.world;
                    o.flag_groups.push_back(flags);
                    return fsdp::make_fsdp_tp(RunContext{o, ctx.rank, ctx.world, ctx.trace});
                  }};

/// Stage 07 as kFsdp under --dtype fp8 --fp8-weight-gather: the weights gathered as E4M3 codes.
const Stage kFsdpFp8Gather{
    "fsdp_fp8_gather", [](const RunContext& ctx) {
      StageOptions o = ctx.options;
      auto flags = std::make_shared<fsdp::DataParallelFlags>();
      flags->dp = ctx.world;
      auto gather = std::make_shared<fsdp::Fp8GatherFlags>();
      gather->fp8_weight_gather = true;
      o.flag_groups.push_back(flags);
      o.flag_groups.push_back(gather);
      return fsdp::make_fsdp_tp(RunContext{o, ctx.rank, ctx.world, ctx.trace});
    }};

/// Stage 06 under --fp8-recipe `word`.
Stage fp8_recipe(const std::string& word) {
  return {"fp8_" + word, [word](const RunContext& ctx) {
            StageOptions o = ctx.options;
            auto flags = std::make_shared<async_fp8::Fp8RecipeFlags>();
            flags->word = word;
            o.flag_groups.push_back(flags);
            return async_fp8::make_fp8_async_tp(RunContext{o, ctx.rank, ctx.world, ctx.trace});
          }};
}

/// `z` with stage 06's --dtype fp8.
Sizes in_fp8(Sizes z) {
  z.config.dtype = DType::e4m3;
  return z;
}

/// `z` under --dtype bf16 (bf16 activations, the weights' bf16 compute copies).
Sizes in_bf16(Sizes z) {
  z.config.dtype = DType::bf16;
  z.name += "_bf16";
  return z;
}

/// `z` with --attention naive (the probabilities [B, NH/N, S, S] kept for backward).
Sizes naive(Sizes z) {
  z.config.attention = Attention::naive;
  z.name += "_naive";
  return z;
}

/// `z` with grouped-query attention (NKV = 2: k and v a quarter of q at NH = 8, half at NH = 4)
/// and --recompute full (each layer's input kept, one block's activations again in backward).
Sizes gqa_recomputed(Sizes z) {
  z.config.kv_heads = 2;
  z.config.recompute = Recompute::full;
  z.name += "_gqa_recompute";
  return z;
}

/// `z` under --optimizer adamw (two fp32 moments per parameter).
Sizes adamw(Sizes z) {
  z.config.optimizer = Optimizer::adamw;
  z.config.lr = 1e-3;
  z.name += "_adamw";
  return z;
}

/// `z` under --recompute selective (the cheap ops' outputs dropped and made again).
Sizes selective(Sizes z) {
  z.config.recompute = Recompute::selective;
  z.name += "_selective";
  return z;
}

/// `z` with three layers under --recompute full --recompute-every 2 (layers 0 and 2 recomputed,
/// layer 1 keeping everything).
Sizes every_second(Sizes z) {
  z.config.layers = 3;
  z.config.recompute = Recompute::full;
  z.config.recompute_every = 2;
  z.name += "_full_every_2";
  return z;
}

/// Every tensor-parallel stage on the sizes that move its peak most; each further variation on one
/// of them in turn (the estimate's terms are the same functions of the sizes on every stage, and
/// each stage's sharding of them is already covered by the first group).
std::vector<Case> all_cases() {
  const Stage tp_stages[] = {kBaseline, kMegatron, kSequenceParallel, kOverlapRing};
  std::vector<Case> cases;
  auto each_stage = [&](const std::vector<Sizes>& all) {
    for (const Stage& st : tp_stages)
      for (const Sizes& z : all) cases.push_back({st, z});
  };
  auto in_turn = [&](const std::vector<Sizes>& all) {
    for (std::size_t i = 0; i < all.size(); ++i) cases.push_back({tp_stages[i % 4], all[i]});
  };
  each_stage({default_sizes(), naive(long_sequence(2)), gqa_recomputed(default_sizes()),
              selective(default_sizes()), every_second(default_sizes()), adamw(wide_mlp())});
  in_turn({long_sequence(1), long_sequence(2), wide_mlp(), naive(default_sizes()),
           naive(long_sequence(1)), gqa_recomputed(naive(long_sequence(2))),
           gqa_recomputed(wide_mlp()), selective(naive(long_sequence(2))),
           every_second(long_sequence(2)), adamw(default_sizes())});
  each_stage({in_bf16(default_sizes()), in_bf16(naive(long_sequence(2)))});
  in_turn({in_bf16(long_sequence(2)), in_bf16(wide_mlp()), in_bf16(naive(default_sizes())),
           in_bf16(gqa_recomputed(default_sizes())), in_bf16(selective(default_sizes())),
           in_bf16(adamw(wide_mlp()))});
  for (const Sizes& z :
       {default_sizes(), wide_mlp(), adamw(default_sizes()), in_bf16(default_sizes()),
        selective(default_sizes()), gqa_recomputed(default_sizes()), naive(long_sequence(2))}) {
    Sizes two = z;  // B = 2: one sequence per replica at D = 2
    two.config.batch = std::max<std::int64_t>(two.config.batch, 2);
    cases.push_back({kFsdp, two});
  }
  for (const Sizes& z : {default_sizes(), long_sequence(1), wide_mlp(),
                         gqa_recomputed(default_sizes()), selective(default_sizes())})
    cases.push_back({kFp8, in_fp8(z)});
  // Stage 06 under the row and block recipes: the column inputs' bf16 shards kept, no FP8
  // weights, and the moment of a column layer's weight-gradient GEMMs, whose operands the
  // recipe's emulation copies (06_fp8/layers.cc, "recipe emulation"; nvfp4's Hadamard
  // transforms copy them once more).
  for (const char* word : {"rowwise", "block128", "nvfp4"})
    for (const Sizes& z : {default_sizes(), selective(default_sizes())})
      cases.push_back({fp8_recipe(word), in_fp8(z)});
  // Stage 07 under FP8, its weights gathered as fp32 masters or as E4M3 codes.
  for (const Sizes& z : {default_sizes(), wide_mlp()}) {
    Sizes two = in_fp8(z);
    two.name += "_fp8";
    two.config.batch = std::max<std::int64_t>(two.config.batch, 2);
    cases.push_back({kFsdp, two});
    cases.push_back({kFsdpFp8Gather, two});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stages, MeasuredPeak, testing::ValuesIn(all_cases()), [](const auto& p) {
  return p.param.stage.name + "_" + p.param.sizes.name;
});

// --- the terms against the chapters' formulas, computed here -------------------------------------

constexpr std::uint64_t kFloat = 4;

// Under the row and block recipes the block keeps the bf16 shards of its column inputs and no FP8
// copy of a weight (BlockConfig::fp8_codes_kept, set by async_fp8::recipe_memory_dimension): the
// estimate's saved activations are the bytes the run saved, under each recipe and recompute mode,
// and it has no "FP8 weights" term; tensorwise keeps both.
TEST(MemoryTerms, RecipesKeepTheirColumnInputsInBf16) {
  for (const char* word : {"tensorwise", "rowwise", "block128", "mxfp8", "nvfp4"})
    for (const Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
      StageOptions options;
      options.config = in_fp8(default_sizes()).config;
      options.config.hidden = 256;  // 128 per rank at N = 2: whole 128-blocks
      options.config.heads = 4;
      options.config.ffn = 256;
      options.config.steps = 1;
      options.config.recompute = r;
      Trace trace;
      const std::unique_ptr<Parallelism> par =
          fp8_recipe(word).make(RunContext{options, world_rank(), world_size(), trace});
      const MemoryEstimate e = estimate_training_memory(options.config, par->sharding());
      const TrainResult run = train(options.config, *par, /*snapshot=*/false, trace);
      SCOPED_TRACE(fmt::format("{} recompute {}", word, recompute_flag(r)));
      EXPECT_EQ(e.term("saved activations").bytes, run.saved_activation_bytes) << e.describe();
      const bool tensorwise = std::string_view(word) == "tensorwise";
      EXPECT_EQ(e.describe().find("FP8 weights") != std::string::npos, tensorwise) << e.describe();
    }
}

TEST(MemoryTerms, ParametersTargetAndSavedFollowTheShardings) {
  for (const Attention attention : {Attention::fused, Attention::naive}) {
    BlockConfig c;  // H 256, NH 8, F 1024, S 128, B 2, L 2
    c.attention = attention;
    const std::uint64_t H = 256, NH = 8, F = 1024, S = 128, B = 2, L = 2;
    // What attention keeps: the lse [B, NH, S] (fused) or the probabilities [B, NH, S, S].
    const std::uint64_t attn = attention == Attention::fused ? B * NH * S : B * NH * S * S;
    for (const std::uint64_t n : {1, 2, 4}) {
      const Sharding tp{.rank = 0, .world = int(n), .weights = true, .sequence = false};
      const Sharding sp{.rank = 0, .world = int(n), .weights = true, .sequence = true};
      // Norm gains replicated; the seven weights split N ways.
      const std::uint64_t params = L * kFloat * (2 * H + (4 * H * H + 3 * H * F) / n);
      // 01: x, h, x2, h2, q, k, v, a [S,B,H]; rstd1, rstd2 [S·B]; gate, up, s [S,B,F]; attn.
      const std::uint64_t base = 8 * S * B * H + 2 * S * B + 3 * S * B * F + attn;
      const std::uint64_t replicated = 4 * S * B * H + 2 * S * B;
      for (const Sharding& sh : {tp, sp}) {
        const MemoryEstimate e = estimate_training_memory(c, sh);
        EXPECT_EQ(e.term("parameters").bytes, params);
        EXPECT_EQ(e.term("gradients").bytes, params);
        EXPECT_EQ(e.term("target").bytes, kFloat * S * B * H / (sh.sequence ? n : 1));
        const std::uint64_t saved = sh.sequence
                                        ? L * kFloat * base / n
                                        : L * kFloat * (replicated + (base - replicated) / n);
        EXPECT_EQ(e.term("saved activations").bytes, saved) << "N " << n << " sp " << sh.sequence;
      }
    }
    const MemoryEstimate one = estimate_training_memory(c, Sharding{});
    EXPECT_EQ(one.term("parameters").bytes, L * kFloat * (2 * H + 4 * H * H + 3 * H * F));
  }
}

// A Llama-7B-sized block at a long sequence on one GPU: H 4096, NH 32, F 11008, S 8192, B 1,
// FSDP × TP: of the parameters, gradients and optimizer state a rank keeps 1/(T·D) of the seven
// matrices and 1/D of the norm gains (replicated over TP, sharded over DP; here every dim 0
// divides, so no padding); the activations are 1/(T·D) of the model's under sequence
// parallelism; and D = 1 adds no FSDP term.
// Chapter 9's saved-activations term of a pipeline rank, term by term: under --recompute none a
// live (micro-batch, layer) pair keeps saved_layer bytes; under full, x (its micro-batch's block
// input, [S, B/M, H] fp32) for every live pair, the rest of saved_layer only for the live pairs
// whose layer is not recomputed (live_kept), and one block whole again during its backward.
TEST(MemoryTerms, PipelineSavedActivationsFollowChapterNinesFormula) {
  BlockConfig c;  // H 256, NH 8, F 1024, S 128, B 2, L 2
  c.batch = 8;
  constexpr std::uint64_t kMicrobatches = 4, kLive = 6;
  const std::uint64_t x = kFloat * std::uint64_t(c.seq) * (std::uint64_t(c.batch) / kMicrobatches) *
                          std::uint64_t(c.hidden);
  pp::PipelineMemory held{.layers = 1, .microbatches = int(kMicrobatches)};
  held.live_layers = held.live_passes = std::int64_t(kLive);
  auto estimate = [&] {
    return estimate_training_memory(c,
                                    Sharding{.pp = 2, .dimensions = {pp::memory_dimension(held)}});
  };
  const std::uint64_t none = estimate().term("saved activations").bytes;
  ASSERT_EQ(none % kLive, 0u);
  const std::uint64_t saved_layer = none / kLive;
  ASSERT_GT(saved_layer, x);
  c.recompute = Recompute::full;
  for (const std::uint64_t kept : {0u, 2u, 6u}) {
    held.live_kept_layers = std::int64_t(kept);
    EXPECT_EQ(estimate().term("saved activations").bytes,
              x * kLive + (saved_layer - x) * kept + (saved_layer - x))
        << "live_kept " << kept;
  }
}

TEST(MemoryTerms, FsdpKeepsTwoReductionsInFlightAndAllocatesTheThirdBeforeWaiting) {
  // One layer's parameters, T 1: the nine tensors' rows split evenly over D = 2 and 4, so the
  // gathered buffer (g), the reduce-scatter buffer (r) and the layer's fp32 gradients are the
  // layer's elements · 4 bytes each (fp32), the unsharded copy its weights and gradients.
  BlockConfig c;
  c.batch = 4;
  constexpr std::uint64_t H = 256, F = 1024;
  const std::uint64_t layer = kFloat * (2 * H + 4 * H * H + 3 * H * F);  // g = r = fp32 grads
  // While layer l's backward runs: its weights and gradients (2 · layer), its gathered buffer and
  // that of l − 1 (l > 0), and the reduce-scatters of l + 1 and l + 2 that exist; its own joins
  // them when its gradients go out, less the temporaries backward no longer holds.
  for (const int layers : {1, 2, 3, 4, 6}) {
    c.layers = layers;
    std::uint64_t in_flight = 0;
    for (int l = 0; l < layers; ++l)
      in_flight =
          std::max(in_flight, layer * std::uint64_t((l > 0 ? 2 : 1) + std::min(2, layers - 1 - l)));
    for (const int d : {2, 4}) {
      const Sharding s{.dp = d, .dimensions = {fsdp::memory_dimension()}};
      const MemoryEstimate e = estimate_training_memory(c, s);
      const std::uint64_t during = 2 * layer + in_flight;
      const std::uint64_t temporaries = e.term("largest temporaries").bytes;
      const std::uint64_t going_out =
          during + layer > temporaries ? during + layer - temporaries : 0;
      EXPECT_EQ(e.term("unsharded layers (FSDP)").bytes, std::max(during, going_out))
          << "L " << layers << " D " << d;
    }
  }
  // The MPI reduce-scatter's staging: the whole reduced input of a layer's gradients, on the
  // first rank of a DP×CP group of more than two ranks only.
  c.layers = 4;
  for (const int d : {2, 4})
    for (const bool first : {false, true}) {
      const Sharding s{.dp = d, .dimensions = {fsdp::memory_dimension(first)}};
      const MemoryEstimate e = estimate_training_memory(c, s);
      const bool staged = std::ranges::any_of(
          e.terms, [](const MemoryTerm& m) { return m.name == "MPI reduce-scatter staging"; });
      EXPECT_EQ(staged, first && d > 2) << "D " << d << " first " << first;
      if (staged) {
        EXPECT_EQ(e.term("MPI reduce-scatter staging").bytes, layer) << "D " << d;
      }
    }
}

TEST(MemoryTerms, FsdpShardsFallAsOneOverTD) {
  BlockConfig c;  // H 256, NH 8, F 1024, S 128, B 2 → B 4 so that D = 4 divides it
  c.batch = 4;
  c.optimizer = Optimizer::adamw;
  const MemoryEstimate one = estimate_training_memory(c, Sharding{});
  for (const int t : {1, 2, 4})
    for (const int d : {1, 2, 4}) {
      const Sharding s{.rank = 0,
                       .world = t,
                       .weights = true,
                       .sequence = true,
                       .dp = d,
                       .dimensions = {fsdp::memory_dimension()}};
      const MemoryEstimate e = estimate_training_memory(c, s);
      for (const char* term : {"parameters", "gradients", "optimizer state"}) {
        const std::uint64_t copies = std::string(term) == "optimizer state" ? 2 : 1;
        const std::uint64_t gains = copies * 2 * 2 * 256 * kFloat;  // L · 2 gains · H · 4 B
        EXPECT_EQ(e.term(term).bytes,
                  (one.term(term).bytes - gains) / std::uint64_t(t * d) + gains / std::uint64_t(d))
            << term << " at T " << t << " D " << d;
      }
      EXPECT_EQ(e.term("saved activations").bytes * std::uint64_t(t * d),
                one.term("saved activations").bytes)
          << "T " << t << " D " << d;
      const bool fsdp_term = std::ranges::any_of(
          e.terms, [](const MemoryTerm& m) { return m.name == "unsharded layers (FSDP)"; });
      EXPECT_EQ(fsdp_term, d > 1) << "T " << t << " D " << d;
    }
}

/// A Llama-sized block (H 4096, NH 32, F 11008) on one sequence of 8192 tokens, bf16 on cuda.
BlockConfig long_sequence_on_cuda() {
  BlockConfig c;
  c.hidden = 4096;
  c.heads = 32;
  c.ffn = 11008;
  c.seq = 8192;
  c.batch = 1;
  c.device = Device::cuda;
  c.dtype = DType::bf16;
  return c;
}

// bf16 on cuda. At L = 1 the estimate is 5.4 GiB with fused attention and 28.1 GiB with naive:
// naive keeps the probabilities, B·NH·S²·4 = 8 GiB per layer, and its backward's dP, bf16 P and
// dS add 16 GiB of scratch; fused keeps B·NH·S·4 = 1 MiB of lse and its backward's only scratch
// is Δ, as small. Each further layer adds 10.9 GiB with naive, 2.9 GiB with fused, so at L = 6
// naive needs more than an 80 GiB H100 has while fused stays far below.
TEST(MemoryTerms, FusedAttentionFitsALongSequenceOnOneGpu) {
  BlockConfig c = long_sequence_on_cuda();
  constexpr std::uint64_t GiB = std::uint64_t{1} << 30;
  const std::uint64_t B = 1, NH = 32, S = 8192;
  for (const std::int64_t layers : {1, 6}) {
    c.layers = layers;
    c.attention = Attention::fused;
    const MemoryEstimate fused = estimate_training_memory(c, Sharding{});
    c.attention = Attention::naive;
    const MemoryEstimate naive = estimate_training_memory(c, Sharding{});
    fmt::print("[ memory   ] L {} fused: {}\n[ memory   ] L {} naive: {}\n", layers,
               fused.describe(), layers, naive.describe());
    EXPECT_LT(fused.total(), 60 * GiB) << "L " << layers;
    if (layers == 6) {
      EXPECT_GT(naive.total(), 80 * GiB);
    }
    EXPECT_EQ(naive.term("saved activations").bytes - fused.term("saved activations").bytes,
              std::uint64_t(layers) * kFloat * (B * NH * S * S - B * NH * S));
  }
}

// Naive attention on cuda under the recipe reads the bf16 q, k, v and dO as they are stored (no
// fp32 copies, common/ops.cc's attention_native); its backward's scratch is dP in fp32, a bf16
// copy of P and dS in bf16, and, with grouped-query attention (g = NH / NKV > 1), the group's
// dK and dV summed in fp32 (common/cuda/ops.cc). At S = 8192 with one step that backward is the
// largest moment, on top of the tensors block_backward holds then (all bf16):
//   temporaries = y, dout, ds, dgate, dup, dh2, dx2, da, dq, dk, dv
//               + B·NH·S²·(4 + 2 + 2) + (g > 1 ? 2 · S·B·NKV·D·4 : 0)
TEST(MemoryTerms, CudaNaiveAttentionBackwardScratch) {
  BlockConfig c = long_sequence_on_cuda();
  c.layers = 1;
  c.steps = 1;
  c.attention = Attention::naive;
  const std::uint64_t S = 8192, B = 1, H = 4096, F = 11008, NH = 32, D = 128;
  for (const std::int64_t kv_heads : {32, 8}) {
    c.kv_heads = kv_heads;
    const MemoryEstimate e = estimate_training_memory(c, Sharding{});
    const std::uint64_t NKV = std::uint64_t(kv_heads);
    const std::uint64_t stream = S * B * H * 2, mlp = S * B * F * 2, q = S * B * H * 2,
                        kv = S * B * NKV * D * 2;
    const std::uint64_t held = 4 * stream + 3 * mlp + 2 * q + 2 * kv;
    const std::uint64_t scratch =
        B * NH * S * S * (4 + 2 + 2) + (NKV < NH ? 2 * S * B * NKV * D * 4 : 0);
    EXPECT_EQ(e.term("largest temporaries").bytes, held + scratch) << "NKV " << kv_heads;
  }
}

// --- sizes too large ---------------------------------------------------------------------------

TEST(MemoryOverflow, SequenceTooLongThrowsInsteadOfWrapping) {
  BlockConfig c;
  c.seq = 4611686018427387903;  // 2^62 − 1: S·S, S·B·H and their bytes overflow 64 bits
  for (const Sharding& sh :
       {Sharding{}, Sharding{.rank = 0, .world = 1, .weights = true, .sequence = true}})
    EXPECT_THROW(estimate_training_memory(c, sh), SizeOverflow);
  EXPECT_THROW(snapshot_bytes(c), SizeOverflow);
}

TEST(MemoryOverflow, HugeModelIsEstimatedAtOnceAndNotWrapped) {
  BlockConfig c;
  c.layers = 100000;
  c.hidden = 65536;
  c.ffn = 262144;
  c.seq = 8192;
  const auto t0 = std::chrono::steady_clock::now();
  const MemoryEstimate e = estimate_training_memory(c, Sharding{});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 0.1);
  fmt::print("[ memory   ] huge: {} ({:.3f} ms)\n", e.describe(), seconds * 1e3);
  // In long double (64-bit mantissa on x86, exact here), independently of the 64-bit arithmetic.
  const long double H = 65536, F = 262144, L = 100000;
  const long double params = L * 4 * (2 * H + 4 * H * H + 3 * H * F);
  EXPECT_EQ(static_cast<long double>(e.term("parameters").bytes), params);
  EXPECT_GT(e.total(), std::uint64_t{1} << 40);  // > 1 TiB
  EXPECT_GE(static_cast<long double>(e.total()), 2 * params);
  EXPECT_GT(snapshot_bytes(c), std::uint64_t{1} << 40);
}

TEST(MemoryOverflow, TotalOfTermsThatDoNotFitThrows) {
  MemoryEstimate e;
  e.terms = {{"a", std::uint64_t{1} << 63}, {"b", std::uint64_t{1} << 63}};
  EXPECT_THROW((void)e.total(), SizeOverflow);
}

// --- what the host has ---------------------------------------------------------------------------

/// MemTotal of /proc/meminfo in bytes, read here independently of the library.
std::uint64_t mem_total() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  std::uint64_t kib = 0;
  while (in >> key >> kib >> unit)
    if (key == "MemTotal:") return kib * 1024;
  return 0;
}

TEST(MemoryAvailable, HostMemoryIsPositiveAndBelowTheTotal) {
  const std::uint64_t total = mem_total();
  if (total == 0) GTEST_SKIP() << "no /proc/meminfo";
  const std::uint64_t available = ops::memory_available(Device::cpu);
  fmt::print("[ memory   ] host: {} B available of {} B\n", available, total);
  EXPECT_GT(available, 0u);
  EXPECT_LT(available, total);
}

}  // namespace
}  // namespace tpx
