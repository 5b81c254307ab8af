// The mixed-precision recipe (--dtype bf16; DESIGN.md, "Mixed precision") on the cpu backend:
//  - the recipe itself: one block's bf16 forward and backward equal, bit for bit, the fp32 ops
//    composed here with a rounding to bf16 at exactly the documented points (the block's input,
//    every weight's compute copy, every op's activation output, every activation gradient), and
//    a re-computation that leaves one of those roundings out differs;
//  - --check passes on every stage at N = 1 … 4, and 20 steps' losses track the fp32 run's;
//  - the bytes: stages 02–05 move half their fp32 bus bytes (the norm gains' fp32 gradient
//    all-reduce apart), stage 06's FP8 gathers half of stage 05's bf16 ones, and the saved
//    activations take half their fp32 bytes (the fp32 statistics apart).
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "01_baseline/layers.h"
#include "common/block.h"
#include "common/model.h"
#include "common/ops.h"
#include "common/trainer.h"
#include "test_util.h"

namespace tpx {
namespace {

using json = nlohmann::json;

// --- the recipe, bit for bit ---------------------------------------------------------------------

/// A tiny Llama block: GQA (2 query heads per KV head), RoPE, one layer, one step.
BlockConfig tiny() {
  BlockConfig c;
  c.hidden = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 64;
  c.seq = 8;
  c.batch = 2;
  c.layers = 1;
  c.steps = 1;
  c.dtype = DType::bf16;
  return c;
}

Tensor f32_like(const Tensor& t) {
  return Tensor::empty(t.shape(), DType::f32, t.device());
}

/// Which rounding point the re-computation leaves out (none: the documented recipe).
enum class Skip { none, normalized_h, attention_output, swiglu_product, ds_gradient };

/// The documented recipe written out with fp32 ops on fp32 tensors: R(t) rounds t to its nearest
/// bf16 value (ties to even) in place, at exactly the points DESIGN.md names.
struct Recomputed {
  std::vector<float> output, input_grad;
  std::array<std::vector<float>, kNumParams> grads;
};

Recomputed recompute(const BlockConfig& c, const Model& m, Skip skip) {
  auto R = [](const Tensor& t) {
    for (float& v : t.f32()) v = bf16_value(bf16_bits(v));
    return t;
  };
  auto copy = [](const Tensor& t) {
    Tensor out = f32_like(t);
    ops::copy(t, out);
    return out;
  };
  auto rows = [](const Tensor& t) { return Tensor::empty({t.rows()}); };
  auto gemm = [](const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor::Shape shape,
                 float beta = 0.0f, Tensor into = Tensor()) {
    if (!into.defined()) into = Tensor::empty(std::move(shape));
    ops::gemm(a, ta, b, tb, into, 1.0f, beta);
    return into;
  };
  const LayerParams& p = m.params[0];
  const std::int64_t s = c.seq, b = c.batch, h = c.hidden, f = c.ffn, kv = c.kv_dim();
  const std::int64_t nh = c.heads, nkv = c.kv_heads_or_heads();
  // The compute copies of the seven matrices; the gains stay fp32.
  LayerParams w;
  for (Param q : kAllParams) w[q] = param_split(q) == Split::replicated ? p[q] : R(copy(p[q]));

  // Forward.
  const Tensor x = R(copy(m.input));
  const Tensor hh = f32_like(x), rstd1 = rows(x);
  ops::rmsnorm_forward(x, w[Param::norm1], hh, rstd1);
  if (skip != Skip::normalized_h) R(hh);
  const Tensor q = R(gemm(hh, false, w[Param::wq], false, {s, b, h}));
  const Tensor k = R(gemm(hh, false, w[Param::wk], false, {s, b, kv}));
  const Tensor v = R(gemm(hh, false, w[Param::wv], false, {s, b, kv}));
  ops::rope_forward(q, nh, c.rope_theta);
  ops::rope_forward(k, nkv, c.rope_theta);
  R(q);
  R(k);
  const Tensor a = f32_like(q), lse = Tensor::empty({b, nh, s});
  ops::attention_fused_forward(q, k, v, nh, a, lse);
  if (skip != Skip::attention_output) R(a);
  const Tensor o = R(gemm(a, false, w[Param::wo], false, {s, b, h}));
  const Tensor x2 = f32_like(x);
  ops::add(x, o, x2);
  R(x2);
  const Tensor h2 = f32_like(x), rstd2 = rows(x);
  ops::rmsnorm_forward(x2, w[Param::norm2], h2, rstd2);
  R(h2);
  const Tensor gate = R(gemm(h2, false, w[Param::w_gate], false, {s, b, f}));
  const Tensor up = R(gemm(h2, false, w[Param::w_up], false, {s, b, f}));
  const Tensor sw = f32_like(gate);
  ops::swiglu_forward(gate, up, sw);
  if (skip != Skip::swiglu_product) R(sw);
  const Tensor d = R(gemm(sw, false, w[Param::w_down], false, {s, b, h}));
  const Tensor y = f32_like(x);
  ops::add(x2, d, y);
  R(y);

  // The loss's gradient, then backward; weight gradients are fp32, never rounded.
  const Tensor dy = f32_like(y);
  ops::mse_loss_backward(y, m.target, 1.0 / double(s * b * h), dy);
  R(dy);
  Recomputed out;
  auto keep = [](const Tensor& t) { return std::vector<float>(t.f32().begin(), t.f32().end()); };
  auto wgrad = [&](const Tensor& in, const Tensor& g, Param which) {
    out.grads[std::size_t(which)] = keep(gemm(in, true, g, false, p[which].shape()));
  };
  const Tensor ds = gemm(dy, false, w[Param::w_down], true, {s, b, f});
  if (skip != Skip::ds_gradient) R(ds);
  wgrad(sw, dy, Param::w_down);
  const Tensor dgate = f32_like(gate), dup = f32_like(up);
  ops::swiglu_backward(ds, gate, up, dgate, dup);
  R(dgate);
  R(dup);
  wgrad(h2, dgate, Param::w_gate);
  wgrad(h2, dup, Param::w_up);
  // dh2 = dgate·Wgᵀ, then += dup·Wuᵀ: the second GEMM reads the rounded first and rounds again.
  const Tensor dh2 = R(gemm(dgate, false, w[Param::w_gate], true, {s, b, h}));
  R(gemm(dup, false, w[Param::w_up], true, {}, 1.0f, dh2));
  const Tensor dx2 = f32_like(x), dg2 = Tensor::empty({h});
  ops::rmsnorm_backward(dh2, x2, w[Param::norm2], rstd2, dx2, dg2);
  R(dx2);
  ops::accumulate(dy, dx2);
  R(dx2);
  out.grads[std::size_t(Param::norm2)] = keep(dg2);
  const Tensor da = R(gemm(dx2, false, w[Param::wo], true, {s, b, h}));
  wgrad(a, dx2, Param::wo);
  const Tensor dq = f32_like(q), dk = f32_like(k), dv = f32_like(v);
  ops::attention_fused_backward(da, q, k, v, a, lse, nh, dq, dk, dv);
  R(dq);
  R(dk);
  R(dv);
  ops::rope_backward(dq, nh, c.rope_theta);
  ops::rope_backward(dk, nkv, c.rope_theta);
  R(dq);
  R(dk);
  wgrad(hh, dq, Param::wq);
  wgrad(hh, dk, Param::wk);
  wgrad(hh, dv, Param::wv);
  const Tensor dh = R(gemm(dq, false, w[Param::wq], true, {s, b, h}));
  R(gemm(dk, false, w[Param::wk], true, {}, 1.0f, dh));
  R(gemm(dv, false, w[Param::wv], true, {}, 1.0f, dh));
  const Tensor dx = f32_like(x), dg1 = Tensor::empty({h});
  ops::rmsnorm_backward(dh, x, w[Param::norm1], rstd1, dx, dg1);
  R(dx);
  ops::accumulate(dx2, dx);
  R(dx);
  out.grads[std::size_t(Param::norm1)] = keep(dg1);
  out.output = keep(y);
  out.input_grad = keep(dx);
  return out;
}

/// Every value of the library's bf16 run equals the re-computation's, bit for bit (else the
/// first that differs, named).
std::string first_difference(const Snapshot& got, const Recomputed& want) {
  auto diff = [](const std::string& name, const std::vector<float>& g,
                 const std::vector<float>& w) -> std::string {
    if (g.size() != w.size()) return fmt::format("{}: {} vs {} values", name, g.size(), w.size());
    for (std::size_t i = 0; i < g.size(); ++i)
      if (std::bit_cast<std::uint32_t>(g[i]) != std::bit_cast<std::uint32_t>(w[i]))
        return fmt::format("{}[{}]: {} vs {}", name, i, g[i], w[i]);
    return {};
  };
  if (auto d = diff("output", got.output, want.output); !d.empty()) return d;
  if (auto d = diff("input.grad", got.input_grad, want.input_grad); !d.empty()) return d;
  for (Param q : kAllParams) {
    const auto i = std::size_t(q);
    if (auto d = diff(std::string(param_name(q)) + ".grad", got.grads[0][i], want.grads[i]);
        !d.empty())
      return d;
  }
  return {};
}

Snapshot library_run(const BlockConfig& c) {
  baseline::SerialLinears serial(c.dtype);
  Trace off;
  return train(c, serial, /*snapshot=*/true, off).first;
}

TEST(MixedPrecision, RecipeIsBitExact) {
  const BlockConfig c = tiny();
  const Snapshot got = library_run(c);
  const Model m = make_model(c, Sharding{});
  EXPECT_EQ(first_difference(got, recompute(c, m, Skip::none)), "");
  // Its values are bf16 where the recipe stores bf16 and not where it keeps fp32.
  auto all_bf16 = [](const std::vector<float>& v) {
    for (float x : v)
      if ((std::bit_cast<std::uint32_t>(x) & 0xFFFFu) != 0) return false;
    return true;
  };
  EXPECT_TRUE(all_bf16(got.output));
  EXPECT_TRUE(all_bf16(got.input_grad));
  EXPECT_FALSE(all_bf16(got.grads[0][std::size_t(Param::wq)]));  // an fp32 weight gradient
}

TEST(MixedPrecision, AMovedRoundingIsCaught) {
  const BlockConfig c = tiny();
  const Snapshot got = library_run(c);
  const Model m = make_model(c, Sharding{});
  for (Skip skip :
       {Skip::normalized_h, Skip::attention_output, Skip::swiglu_product, Skip::ds_gradient})
    EXPECT_NE(first_difference(got, recompute(c, m, skip)), "")
        << "leaving out rounding point " << int(skip) << " went unnoticed";
}

TEST(MixedPrecision, TheUpdateWritesTheComputeCopiesAndTheyAreMadeOnce) {
  // The bf16 compute copies are made from the masters once; every update pass then writes them.
  // After each of three updates (SGD and AdamW, random gradients) every copy equals bf16 of its
  // master, and a later make_compute_copies keeps the same tensors (no new pass over the
  // masters). Stale copies (an update that leaves them alone) fail the first check.
  for (const Optimizer opt : {Optimizer::sgd, Optimizer::adamw}) {
    BlockConfig c = tiny();
    c.task = Task::lm;
    c.vocab = 40;
    c.optimizer = opt;
    c.lr = opt == Optimizer::sgd ? 0.5 : 1e-2;
    Model m = make_model(c, Sharding{});
    training::Moments moments = training::make_moments(c, m);
    std::vector<LayerParams> copies;
    LmParams lm_copies;
    training::make_compute_copies(c, m, copies);
    training::lm_compute_copies(c, m, lm_copies);
    const void* made = copies[0][Param::wq].raw();
    const void* made_out = lm_copies.w_out.raw();
    std::uint32_t seed = 5;
    auto randomize = [&seed](const Tensor& g) {
      const Tensor r = test::random_tensor(g.shape(), seed++, 0.0, 0.1);
      ops::copy(r, g);
    };
    for (int t = 1; t <= 3; ++t) {
      for (Param p : kAllParams) randomize(m.grads[0][p]);
      for (const Tensor* g : m.lm_grads.all()) randomize(*g);
      training::update(c, m, moments, t, copies, lm_copies);
      for (Param p : kAllParams) {
        const Tensor& copy = copies[0][p];
        if (param_split(p) == Split::replicated) {
          EXPECT_EQ(copy.raw(), m.params[0][p].raw()) << "a norm gain computes with its master";
          continue;
        }
        ASSERT_EQ(copy.dtype(), DType::bf16);
        const auto master = m.params[0][p].f32();
        for (std::size_t i = 0; i < master.size(); ++i)
          ASSERT_EQ(copy.data<std::uint16_t>()[i], bf16_bits(master[i]))
              << "step " << t << ", " << param_name(p) << "[" << i << "]";
      }
      const auto w_out = m.lm.w_out.f32();
      for (std::size_t i = 0; i < w_out.size(); ++i)
        ASSERT_EQ(lm_copies.w_out.data<std::uint16_t>()[i], bf16_bits(w_out[i]))
            << "step " << t << ", w_out[" << i << "]";
      training::make_compute_copies(c, m, copies);
      training::lm_compute_copies(c, m, lm_copies);
      EXPECT_EQ(copies[0][Param::wq].raw(), made) << "the copies were made again";
      EXPECT_EQ(lm_copies.w_out.raw(), made_out) << "the output layer's copy was made again";
    }
  }
}

// --- the stages --------------------------------------------------------------------------------

using test::run_stage;

json run_json(const std::string& stage, int n, const std::string& args) {
  test::TempDir dir;
  const auto r = run_stage(stage, n, args + " --json " + (dir / "s.json").string(), dir);
  EXPECT_EQ(r.exit_code, 0) << stage << " -np " << n << " " << args << "\n" << r.out << r.err;
  if (r.exit_code != 0) return json::object();
  return json::parse(test::read_file(dir / "s.json"));
}

struct StageCase {
  std::string stage;
  int n;
};
void PrintTo(const StageCase& c, std::ostream* os) {
  *os << c.stage << " np " << c.n;
}

class Bf16Stage : public testing::TestWithParam<StageCase> {};

TEST_P(Bf16Stage, PassesCheckAgainstTheReference) {
  const auto& [stage, n] = GetParam();
  test::TempDir dir;
  // Sizes every N = 1 … 4 divides (12 heads of D = 16).
  const auto r = run_stage(
      stage, n, "--hidden 192 --heads 12 --ffn 768 --seq 96 --dtype bf16 --steps 3 --check", dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("\nPASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tolerance 3e-02"), std::string::npos) << r.out;  // 2^-5, stage.cc
}

std::vector<StageCase> stage_cases() {
  std::vector<StageCase> cases = {{"01_baseline", 1}};
  for (const char* stage : {"02_megatron_tp", "03_sequence_parallel", "04_overlap_ring",
                            "05_copy_engine_async_tp", "06_fp8"})
    for (int n : {1, 2, 3, 4}) cases.push_back({stage, n});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Stages, Bf16Stage, testing::ValuesIn(stage_cases()), [](const auto& p) {
  return p.param.stage.substr(0, 2) + "_np" + std::to_string(p.param.n);
});

// 20 steps of SGD at the default config on stage 03 (N = 2): the bf16 losses stay within 0.1 % of
// the fp32 ones and fall by the same amount within a tenth. The loss, 0.5·mean((y − t)²) ≈ 1,
// averages S·B·H = 65536 squared errors; bf16's roundings perturb each y by at most u|y|
// (u = 2^-8) with no preferred sign, so they move the mean by far less than u, while the
// 20 updates lower it by about 3e-3. A run whose bf16 updates or gradients were wrong would not
// fall with fp32.
TEST(MixedPrecision, LossesTrackFp32OverTwentySteps) {
  const std::string args = "--steps 20";
  const json f32 = run_json("03_sequence_parallel", 2, args);
  const json bf16 = run_json("03_sequence_parallel", 2, args + " --dtype bf16");
  ASSERT_TRUE(f32.contains("steps") && bf16.contains("steps"));
  ASSERT_EQ(f32["steps"].size(), 20u);
  ASSERT_EQ(bf16["steps"].size(), 20u);
  const double drop =
      f32["steps"][0]["loss"].get<double>() - f32["steps"][19]["loss"].get<double>();
  ASSERT_GT(drop, 0.0);
  for (std::size_t i = 0; i < 20; ++i) {
    const double a = f32["steps"][i]["loss"].get<double>(),
                 b = bf16["steps"][i]["loss"].get<double>();
    EXPECT_NEAR(b, a, 1e-3 * a) << "step " << i;
  }
  // And it learns as fp32 does: the same drop within a tenth.
  const double drop16 =
      bf16["steps"][0]["loss"].get<double>() - bf16["steps"][19]["loss"].get<double>();
  EXPECT_NEAR(drop16, drop, 0.1 * drop);
}

/// One step's bus bytes of a run.
std::uint64_t bus(const json& j) {
  return j.at("steps").at(0).at("comm_bus_bytes").get<std::uint64_t>();
}

// Default config: L = 2, S = 128, B = 2, H = 256.
constexpr std::uint64_t kL = 2, kS = 128, kB = 2, kH = 256;

TEST(MixedPrecision, Bf16MovesHalfTheBytes) {
  for (int n : {2, 4}) {
    const std::uint64_t N = std::uint64_t(n);
    for (const char* stage :
         {"02_megatron_tp", "03_sequence_parallel", "04_overlap_ring", "05_copy_engine_async_tp"}) {
      const std::uint64_t f = bus(run_json(stage, n, "--steps 1"));
      const std::uint64_t b = bus(run_json(stage, n, "--steps 1 --dtype bf16"));
      // Under sequence parallelism the two norm gains' gradients are all-reduced in fp32 (weight
      // gradients keep fp32): L·2·H·4 bytes, ring all-reduce bus factor 2(N−1)/N.
      const bool sp = std::string(stage) != "02_megatron_tp";
      const std::uint64_t gains = sp ? kL * 2 * kH * 4 * 2 * (N - 1) / N : 0;
      EXPECT_EQ(b - gains, (f - gains) / 2) << stage << " np " << n << ": " << f << " vs " << b;
    }
    // Stage 06: every all-gather moves FP8 codes, 1 byte against stage 05's 2. Per layer
    // stage 05 gathers six [S, B, H] tensors (h, h2 forward; h, h2 again and the two row
    // gradients backward): 6·S·B·H·2·(N−1)/N bus bytes, of which 06 moves half. Stage 06 adds
    // the amax MAX all-reduces: 20 floats a layer (4 + 3 + 2 + 2 forward, 3 + 2 + 2 + 2
    // backward).
    const std::uint64_t b05 = bus(run_json("05_copy_engine_async_tp", n, "--steps 1 --dtype bf16"));
    const std::uint64_t b06 = bus(run_json("06_fp8", n, "--steps 1"));
    const std::uint64_t gathers05 = kL * 6 * kS * kB * kH * 2 * (N - 1) / N;
    const std::uint64_t amax = kL * 20 * 4 * 2 * (N - 1) / N;
    EXPECT_EQ(b05 - b06, gathers05 / 2 - amax) << "np " << n << ": " << b05 << " vs " << b06;
  }
}

TEST(MixedPrecision, SavedActivationsTakeHalfTheBytes) {
  for (int n : {1, 2}) {
    const std::uint64_t N = std::uint64_t(n);
    const json f = run_json("03_sequence_parallel", n, "--steps 1");
    const json b = run_json("03_sequence_parallel", n, "--steps 1 --dtype bf16");
    // What stays fp32: per layer the two RMSNorm statistics [S/N·B] and the fused attention's
    // lse [B, NH/N, S] (NH = 8).
    const std::uint64_t stats = kL * 4 * (2 * kS / N * kB + kB * 8 / N * kS);
    const auto fb = f.at("saved_activation_bytes").get<std::uint64_t>();
    const auto bb = b.at("saved_activation_bytes").get<std::uint64_t>();
    EXPECT_EQ(bb - stats, (fb - stats) / 2) << "np " << n << ": " << fb << " vs " << bb;
    // (The memory estimate's terms against the measured peak, bf16 included: test_memory.)
  }
}

}  // namespace
}  // namespace tpx
