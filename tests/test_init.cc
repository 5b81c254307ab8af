// The counter-based initialiser: any window of a tensor generated alone equals that window of the
// full tensor, so every rank's shard from make_model() is the slice of the unsharded model.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/init.h"
#include "common/model.h"
#include "test_util.h"

namespace tpx {
namespace {

using I = std::int64_t;

TEST(FillNormal, AWindowEqualsTheSliceOfTheFullTensor) {
  const I rows = 12, cols = 10;
  const std::uint64_t seed = 17, id = 5;
  Tensor full = Tensor::empty({rows, cols});
  fill_normal(full, seed, id, Window{cols, 0, 0}, 0.5, 2.0);
  const auto F = full.f32();

  for (const auto& [r0, c0, nr, nc] : std::vector<std::array<I, 4>>{
           {0, 0, 12, 5}, {0, 5, 12, 5}, {3, 2, 4, 7}, {11, 9, 1, 1}, {6, 0, 6, 10}}) {
    Tensor part = Tensor::empty({nr, nc});
    fill_normal(part, seed, id, Window{cols, r0, c0}, 0.5, 2.0);
    const auto P = part.f32();
    for (I r = 0; r < nr; ++r)
      for (I c = 0; c < nc; ++c)
        ASSERT_EQ(P[static_cast<std::size_t>(r * nc + c)],
                  F[static_cast<std::size_t>((r0 + r) * cols + c0 + c)])
            << "window at (" << r0 << ", " << c0 << "), element (" << r << ", " << c << ")";
  }
  // Every value is mean + std·normal_at(seed, id, row-major index of the full tensor).
  EXPECT_EQ(F[37], static_cast<float>(0.5 + 2.0 * normal_at(seed, id, 37)));
}

TEST(FillNormal, RowsOfAThreeDimensionalTensorAreTheLeadingDims) {
  // A [S, B, H] sequence shard starting at position s0 is rows s0·B .. of the [S·B, H] matrix.
  const I S = 6, B = 2, H = 4, s0 = 2, sl = 3;
  Tensor full = Tensor::empty({S, B, H});
  fill_normal(full, 3, 1, Window{H, 0, 0}, 0.0, 1.0);
  Tensor shard = Tensor::empty({sl, B, H});
  fill_normal(shard, 3, 1, Window{H, s0 * B, 0}, 0.0, 1.0);
  const auto F = full.f32(), P = shard.f32();
  for (std::size_t i = 0; i < P.size(); ++i)
    EXPECT_EQ(P[i], F[static_cast<std::size_t>(s0 * B * H) + i]) << i;
}

TEST(FillNormal, RejectsAWindowPastTheColumns) {
  Tensor t = Tensor::empty({2, 4});
  EXPECT_THROW(fill_normal(t, 1, 1, Window{6, 0, 3}, 0.0, 1.0), Error);
}

// Seed, tensor id and index each change the value; the values look standard normal.
TEST(NormalAt, IsAPureFunctionOfSeedIdAndIndexWithStandardNormalMoments) {
  EXPECT_EQ(normal_at(1, 2, 3), normal_at(1, 2, 3));
  EXPECT_NE(normal_at(1, 2, 3), normal_at(2, 2, 3));
  EXPECT_NE(normal_at(1, 2, 3), normal_at(1, 3, 3));
  EXPECT_NE(normal_at(1, 2, 3), normal_at(1, 2, 4));

  constexpr int n = 200000;
  double sum = 0, sum2 = 0, sum4 = 0;
  int beyond3 = 0;
  for (int i = 0; i < n; ++i) {
    const double v = normal_at(1234, 7, static_cast<std::uint64_t>(i));
    ASSERT_TRUE(std::isfinite(v)) << i;
    sum += v;
    sum2 += v * v;
    sum4 += v * v * v * v;
    beyond3 += std::abs(v) > 3.0;
  }
  const double mean = sum / n, var = sum2 / n - mean * mean;
  // Standard errors at n = 2e5: mean 2.2e-3, variance 3.2e-3, fourth moment 1.1e-2 (of 3), and
  // P(|z| > 3) = 2.7e-3 (count 540 ± 23). The bounds are ~5 standard errors.
  EXPECT_NEAR(mean, 0.0, 0.012);
  EXPECT_NEAR(var, 1.0, 0.016);
  EXPECT_NEAR(sum4 / n, 3.0, 0.06);
  EXPECT_NEAR(beyond3, 540, 120);
}

BlockConfig shard_config() {
  BlockConfig c;
  c.hidden = 16;
  c.heads = 4;
  c.ffn = 32;
  c.seq = 8;
  c.batch = 2;
  c.layers = 2;
  c.seed = 2718;
  return c;
}

/// Rows [r0, r0 + nr) and columns [c0, c0 + nc) of a [rows, cols] tensor seen as a matrix.
std::vector<float> block_of(const Tensor& t, I r0, I nr, I c0, I nc) {
  const I cols = t.cols();
  const auto v = t.f32();
  std::vector<float> out;
  for (I r = r0; r < r0 + nr; ++r)
    for (I c = c0; c < c0 + nc; ++c) out.push_back(v[static_cast<std::size_t>(r * cols + c)]);
  return out;
}

std::vector<float> values(const Tensor& t) {
  return {t.f32().begin(), t.f32().end()};
}

class MakeModelShards : public ::testing::TestWithParam<int> {};

TEST_P(MakeModelShards, EveryShardIsTheSliceOfTheFullModel) {
  const int world = GetParam();
  const BlockConfig c = shard_config();
  const Model full = make_model(c, Sharding{});
  const I S = c.seq / world;
  for (int rank = 0; rank < world; ++rank) {
    const Model m = make_model(c, Sharding{rank, world, /*weights=*/true, /*sequence=*/true});
    const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(world);
    ASSERT_EQ(m.input.shape(), (Tensor::Shape{S, c.batch, c.hidden})) << where;
    EXPECT_EQ(values(m.input), values(full.input.slice0(rank * S, (rank + 1) * S))) << where;
    EXPECT_EQ(values(m.target), values(full.target.slice0(rank * S, (rank + 1) * S))) << where;
    ASSERT_EQ(m.params.size(), full.params.size());
    ASSERT_EQ(m.grads.size(), full.params.size());
    for (std::size_t l = 0; l < full.params.size(); ++l)
      for (Param p : kAllParams) {
        const Tensor& whole = full.params[l][p];
        const Tensor& shard = m.params[l][p];
        const std::string name =
            where + " layers." + std::to_string(l) + "." + std::string(param_name(p));
        EXPECT_EQ(m.grads[l][p].shape(), shard.shape()) << name;
        switch (p) {
          case Param::norm1:
          case Param::norm2:  // replicated
            ASSERT_EQ(shard.shape(), whole.shape()) << name;
            EXPECT_EQ(values(shard), values(whole)) << name;
            break;
          case Param::wo:
          case Param::w_down: {  // row-parallel: the `in` dim is split
            const I rows = whole.dim(0) / world;
            ASSERT_EQ(shard.shape(), (Tensor::Shape{rows, whole.dim(1)})) << name;
            EXPECT_EQ(values(shard), block_of(whole, rank * rows, rows, 0, whole.dim(1))) << name;
            break;
          }
          default: {  // column-parallel: the `out` dim is split
            const I cols = whole.dim(1) / world;
            ASSERT_EQ(shard.shape(), (Tensor::Shape{whole.dim(0), cols})) << name;
            EXPECT_EQ(values(shard), block_of(whole, 0, whole.dim(0), rank * cols, cols)) << name;
          }
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(World, MakeModelShards, ::testing::Values(2, 4));

// DESIGN.md: weights ~ N(0, 0.02²), gains = 1, input and target ~ N(0, 1), all distinct tensors.
TEST(MakeModel, DistributionsFollowTheDesign) {
  BlockConfig c = shard_config();
  c.hidden = 64;
  c.ffn = 128;
  c.seq = 32;
  const Model m = make_model(c, Sharding{});
  auto stats = [](const Tensor& t) {
    double s = 0, s2 = 0;
    for (float v : t.f32()) {
      s += v;
      s2 += double(v) * v;
    }
    const double n = double(t.numel());
    return std::pair{s / n, std::sqrt(s2 / n - (s / n) * (s / n))};
  };
  for (const Tensor* t : {&m.input, &m.target}) {  // 4096 samples: std error of std ~0.011
    const auto [mean, sd] = stats(*t);
    EXPECT_NEAR(mean, 0.0, 0.06);
    EXPECT_NEAR(sd, 1.0, 0.06);
  }
  EXPECT_NE(values(m.input), values(m.target));
  for (const auto& layer : m.params)
    for (Param p : kAllParams) {
      if (param_split(p) == Split::replicated) {
        for (float v : layer[p].f32()) EXPECT_EQ(v, 1.0f) << param_name(p);
        continue;
      }
      const auto [mean, sd] = stats(layer[p]);  // >= 4096 samples
      EXPECT_NEAR(mean, 0.0, 0.0015) << param_name(p);
      EXPECT_NEAR(sd, 0.02, 0.0015) << param_name(p);
    }
  EXPECT_NE(values(m.params[0][Param::wq]), values(m.params[0][Param::wk]));
  EXPECT_NE(values(m.params[0][Param::wq]), values(m.params[1][Param::wq]));
}

TEST(MakeModel, RejectsABadSharding) {
  EXPECT_THROW(make_model(shard_config(), Sharding{2, 2, true, true}), Error);
  EXPECT_THROW(make_model(shard_config(), Sharding{0, 0, true, true}), Error);
}

}  // namespace
}  // namespace tpx
