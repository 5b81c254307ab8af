// Stage 06's scales under mpirun (N = 1, 2, 4): the ranks quantize their own shards, yet every
// rank's scale for a tensor is the same number, 448 / max |x| over the whole logical tensor
// (fp32), because the shards agree on the amax with a MAX all-reduce first. Checked for a column
// input (a sequence shard, whose scale the gathered chunks carry) and for the column weights.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "06_fp8/layers.h"
#include "common/fp8.h"
#include "common/ops.h"
#include "test_mpi.h"

namespace tpx {
namespace {

using test::world_rank;
using test::world_size;

/// Every rank's value of `x`, in rank order.
std::vector<float> all_ranks(float x) {
  std::vector<float> all(static_cast<std::size_t>(world_size()));
  MPI_Allgather(&x, 1, MPI_FLOAT, all.data(), 1, MPI_FLOAT, MPI_COMM_WORLD);
  return all;
}

float max_abs(const Tensor& t) {
  float m = 0;
  for (const float v : t.f32()) m = std::max(m, std::abs(v));
  return m;
}

/// A [rows, cols] tensor whose values, and so whose max |x|, differ from rank to rank.
Tensor rank_values(std::int64_t rows, std::int64_t cols, float salt) {
  Tensor t = Tensor::empty({rows, cols});
  const int r = world_rank();
  for (std::size_t i = 0; i < t.f32().size(); ++i)
    t.f32()[i] = std::sin(float(i) * 0.37f + salt) * float(r + 1) * (1.0f + salt);
  return t;
}

TEST(Fp8Scales, EveryRankHoldsTheScaleOfTheWholeTensor) {
  StageOptions options;
  options.config = {.hidden = 32,
                    .heads = 4,
                    .ffn = 64,
                    .seq = 8,
                    .batch = 1,
                    .layers = 1,
                    .steps = 1,
                    .lr = 1.0,
                    .seed = 1,
                    .device = Device::cpu,
                    .dtype = DType::e4m3};
  Trace trace;
  const int n = world_size();
  auto par = async_fp8::make_fp8_async_tp(RunContext{options, world_rank(), n, trace});
  const std::int64_t H = options.config.hidden, rows = options.config.seq / n;
  const Tensor h = rank_values(rows, H, 0.5f);  // a sequence shard [S/N, H]
  std::vector<Tensor> w;                        // column shards [H, 3H/N / 3]
  for (int j = 0; j < 3; ++j) w.push_back(rank_values(H, H / n, float(j)));
  const ColumnResult r = par->column_forward(h, w, "qkv");

  // The saved input is the FP8 shard; its scale is the whole input's, on every rank.
  ASSERT_TRUE(is_fp8(r.saved.dtype()));
  const float scale = r.saved.scale().f32()[0];
  const std::vector<float> maxima = all_ranks(max_abs(h)), scales = all_ranks(scale);
  const float amax = *std::max_element(maxima.begin(), maxima.end());
  for (int q = 0; q < n; ++q) EXPECT_EQ(scales[std::size_t(q)], 448.0f / amax) << "rank " << q;
  if (n > 1) {
    // The shards really differ: a local amax would have given different scales.
    EXPECT_NE(*std::min_element(maxima.begin(), maxima.end()), amax);
  }

  // The weights, and the gathered chunks of the other ranks: y[j] = AG(h)·W[j] must be the
  // product of the dequantized operands under the scales of the whole tensors, which this test
  // computes from every rank's values (a rank quantizing with its own amax would differ).
  std::vector<float> h_full(static_cast<std::size_t>(rows * n * H));
  MPI_Allgather(h.f32().data(), int(rows * H), MPI_FLOAT, h_full.data(), int(rows * H), MPI_FLOAT,
                MPI_COMM_WORLD);
  auto dequantized = [](float x, float s) {
    return fp8::decode(fp8::encode(x * s, DType::e4m3), DType::e4m3) / s;
  };
  for (std::size_t j = 0; j < w.size(); ++j) {
    const std::vector<float> wmax = all_ranks(max_abs(w[j]));
    const float sw = 448.0f / *std::max_element(wmax.begin(), wmax.end());
    const float sh = 448.0f / amax;
    double err = 0, ymax = 0;
    // The output is an activation: under --dtype fp8 it is stored in bf16 (the recipe's storage),
    // rounded once to within u = 2^-8 of itself.
    const Tensor y32 = Tensor::empty(r.y[j].shape());
    ops::cast(r.y[j], y32);
    const auto y = y32.f32();
    for (std::int64_t i = 0; i < rows * n; ++i)
      for (std::int64_t c = 0; c < H / n; ++c) {
        double want = 0;
        for (std::int64_t k = 0; k < H; ++k)
          want += double(dequantized(h_full[std::size_t(i * H + k)], sh)) *
                  double(dequantized(w[j].f32()[std::size_t(k * (H / n) + c)], sw));
        err = std::max(err, std::abs(double(y[std::size_t(i * (H / n) + c)]) - want));
        ymax = std::max(ymax, std::abs(want));
      }
    EXPECT_LE(err, (0x1p-8 + 1e-5) * ymax) << "y[" << j << "]";
  }
}

}  // namespace
}  // namespace tpx
