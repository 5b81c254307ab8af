// Stage 01 on the GPU against stage 01 on the CPU, in-process on the same seed: the output, the
// input gradient and every weight gradient of the first step, and the loss after each of 5 SGD
// steps; fp32 to the --check tolerance, bf16 GEMMs to a looser one (justified below). Skips with
// the reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "01_baseline/layers.h"
#include "common/model.h"
#include "common/ops.h"
#include "test_cuda.h"

namespace tpx {
namespace {

/// max |got − want| / max |want|, as --check reports it.
double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    err = std::isnan(got[i]) ? INFINITY : std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return scale > 0 ? err / scale : err;
}

void compare_runs(const ReferenceRun& got, const ReferenceRun& want, double tol) {
  EXPECT_LE(rel_err(got.output, want.output), tol) << "output";
  EXPECT_LE(rel_err(got.input_grad, want.input_grad), tol) << "input.grad";
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (std::size_t l = 0; l < want.grads.size(); ++l)
    for (Param p : kAllParams) {
      const auto i = static_cast<std::size_t>(p);
      EXPECT_LE(rel_err(got.grads[l][i], want.grads[l][i]), tol)
          << fmt::format("layers.{}.{}.grad", l, param_name(p));
    }
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (std::size_t s = 0; s < want.losses.size(); ++s)
    EXPECT_LE(std::abs(got.losses[s] - want.losses[s]), tol * std::abs(want.losses[s]))
        << "loss after " << s << " SGD steps";
}

BlockConfig small_config() {
  BlockConfig c;
  c.hidden = 64;
  c.heads = 4;
  c.ffn = 128;
  c.seq = 32;
  c.batch = 2;
  c.layers = 2;
  c.lr = 1.0;
  c.seed = 77;
  return c;
}

constexpr int kSteps = 5;

TEST(Stage01, Fp32MatchesCpu) {
  TPX_REQUIRE_GPU();
  BlockConfig c = small_config();
  const ReferenceRun cpu = baseline::run_reference(c, kSteps);
  c.device = Device::cuda;
  const ReferenceRun gpu = baseline::run_reference(c, kSteps);
  compare_runs(gpu, cpu, 1e-5);
}

// With --dtype bf16 every GEMM (attention's included) multiplies bf16-rounded operands (8
// significant bits: unit roundoff u = 2^-8 ≈ 3.9e-3) with fp32 sums; forward and backward through
// two layers chain about ten such GEMMs per value, so errors of a few u (around 1e-2) relative to
// each tensor's largest value are expected. 3e-2 ≈ 8u (the stage's bf16 --check tolerance) still
// fails any real bug by far.
TEST(Stage01, Bf16CloseToCpu) {
  TPX_REQUIRE_GPU();
  BlockConfig c = small_config();
  const ReferenceRun cpu = baseline::run_reference(c, kSteps);
  c.device = Device::cuda;
  c.dtype = DType::bf16;
  const ReferenceRun gpu = baseline::run_reference(c, kSteps);
  compare_runs(gpu, cpu, 3e-2);
}

TEST(Stage01, OddSizesMatchCpu) {
  TPX_REQUIRE_GPU();
  BlockConfig c = small_config();  // scalar kernel paths: S, H, F not multiples of 4
  c.hidden = 54;
  c.heads = 3;
  c.ffn = 70;
  c.seq = 23;
  c.batch = 1;
  const ReferenceRun cpu = baseline::run_reference(c, kSteps);
  c.device = Device::cuda;
  const ReferenceRun gpu = baseline::run_reference(c, kSteps);
  compare_runs(gpu, cpu, 1e-5);
}

}  // namespace
}  // namespace tpx
