// Stages 02 and 03 shard by shard, under mpirun -np 1, 2 and 4: after one forward + backward on
// this rank's shard, each local tensor (output, input gradient, every parameter gradient) equals
// the matching slice of stage 01's full tensor, computed in-process from the same seed. No gather
// is involved, so a wrong shard cannot hide behind a wrong gather.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "01_baseline/layers.h"
#include "02_megatron_tp/layers.h"
#include "03_sequence_parallel/layers.h"
#include "common/block.h"
#include "common/model.h"
#include "common/ops.h"
#include "common/tp.h"
#include "test_mpi.h"

namespace tpx {
namespace {

using test::world_rank;
using test::world_size;

/// Small enough for the suite, divisible by 1, 2 and 4 everywhere a stage splits.
BlockConfig small_config() {
  BlockConfig c;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  c.seq = 16;
  c.batch = 2;
  c.layers = 2;
  c.steps = 1;
  return c;
}

using Factory = std::function<std::unique_ptr<Parallelism>(const RunContext&)>;

struct StageCase {
  std::string name;
  Factory make;
};

/// This rank's tensors after the first forward + backward.
struct FirstStep {
  Model model;
  Tensor output, input_grad;
  double loss = 0;
};

FirstStep first_step(const BlockConfig& c, Parallelism& par) {
  FirstStep r;
  const Sharding sh = par.sharding();
  r.model = make_model(c, sh);
  std::vector<BlockActivations> acts(static_cast<std::size_t>(c.layers));
  Tensor y = r.model.input;
  for (std::size_t l = 0; l < acts.size(); ++l)
    y = block_forward(c, r.model.params[l], y, par, acts[l]);
  const double count = double(c.seq * c.batch * c.hidden);
  const double mine = (sh.sequence || sh.rank == 0) ? ops::mse_loss_sum(y, r.model.target) : 0.0;
  r.loss = 0.5 * par.sum_over_ranks(mine) / count;
  Tensor dy = Tensor::empty(y.shape());
  ops::mse_loss_backward(y, r.model.target, 1.0 / count, dy);
  for (std::size_t l = acts.size(); l-- > 0;)
    dy = block_backward(c, r.model.params[l], acts[l], dy, par, r.model.grads[l]);
  r.output = y;
  r.input_grad = dy;
  return r;
}

/// Max |local − full[window]| / max |full|: the local [rows, cols] block of a full
/// [.., full_cols] matrix starting at (row0, col0).
double window_error(const Tensor& local, const std::vector<double>& full, std::int64_t full_cols,
                    std::int64_t row0, std::int64_t col0) {
  const auto got = local.f32();
  const std::int64_t rows = local.rows(), cols = local.cols();
  double scale = 0, err = 0;
  for (double v : full) scale = std::max(scale, std::abs(v));
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      const double want = full[static_cast<std::size_t>((row0 + i) * full_cols + col0 + j)];
      err = std::max(err, std::abs(double(got[static_cast<std::size_t>(i * cols + j)]) - want));
    }
  return scale > 0 ? err / scale : err;
}

/// Bit-identical shape and values: a gather only moves numbers.
bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  const auto x = a.f32(), y = b.f32();
  return std::equal(x.begin(), x.end(), y.begin());
}

constexpr double kRtol = 1e-5;

class TpShards : public testing::TestWithParam<StageCase> {
 protected:
  void SetUp() override {
    options_.config = small_config();
    par_ = GetParam().make(RunContext{options_, world_rank(), world_size(), trace_});
  }
  StageOptions options_;
  Trace trace_;
  std::unique_ptr<Parallelism> par_;
};

TEST_P(TpShards, LocalShardsEqualSlicesOfStage01) {
  const BlockConfig& c = options_.config;
  const Sharding sh = par_->sharding();
  ASSERT_TRUE(sh.weights);
  const FirstStep got = first_step(c, *par_);
  const ReferenceRun want = baseline::run_reference(c, 1);

  // Activations: the whole [S, B, H] (stage 02) or rows [r·S/N, (r+1)·S/N) of it (stage 03).
  const std::int64_t seq_local = sh.sequence ? c.seq / sh.world : c.seq;
  EXPECT_EQ(got.output.dim(0), seq_local);
  const std::int64_t row0 = sh.sequence ? sh.rank * seq_local * c.batch : 0;
  EXPECT_LE(window_error(got.output, want.output, c.hidden, row0, 0), kRtol) << "output";
  EXPECT_LE(window_error(got.input_grad, want.input_grad, c.hidden, row0, 0), kRtol)
      << "input grad";
  EXPECT_NEAR(got.loss, want.losses.at(0), kRtol * want.losses.at(0));

  // Weights: column shards are [in, out/N] at column r·out/N, row shards [in/N, out] at row
  // r·in/N, norm gains whole (stage 03 all-reduces their per-token-shard gradients).
  for (std::size_t l = 0; l < got.model.grads.size(); ++l)
    for (Param p : kAllParams) {
      const Tensor& g = got.model.grads[l][p];
      const auto full = param_shape(p, c);
      const std::int64_t full_cols = full.back();
      std::int64_t r0 = 0, c0 = 0;
      switch (param_split(p)) {
        case Split::columns:
          EXPECT_EQ(g.dim(1) * sh.world, full[1]);
          c0 = sh.rank * g.dim(1);
          break;
        case Split::rows:
          EXPECT_EQ(g.dim(0) * sh.world, full[0]);
          r0 = sh.rank * g.dim(0);
          break;
        case Split::replicated:
          EXPECT_EQ(g.numel(), full[0]);
          break;
      }
      const auto& ref = want.grads[l][static_cast<std::size_t>(p)];
      const Tensor m = param_split(p) == Split::replicated ? g.reshape({1, g.numel()}) : g;
      EXPECT_LE(window_error(m, ref, full_cols, r0, c0), kRtol)
          << "layers." << l << "." << param_name(p) << ".grad on rank " << sh.rank;
    }
}

TEST_P(TpShards, GathersRebuildTheFullTensorsOnRankZero) {
  const BlockConfig& c = options_.config;
  const Sharding sh = par_->sharding();
  const Model local = make_model(c, sh);
  const Model full = make_model(c, Sharding{});
  const Tensor input = par_->gather_activation(local.input);
  for (std::size_t l = 0; l < local.params.size(); ++l)
    for (Param p : kAllParams) {
      const Tensor g = par_->gather_param(p, local.params[l][p]);
      // Every rank takes part in every gather; only rank 0 compares (no early return before a
      // collective, or the other ranks would wait for it).
      if (sh.rank == 0) {
        EXPECT_TRUE(same_values(g, full.params[l][p])) << "layers." << l << "." << param_name(p);
      }
    }
  if (sh.rank == 0) {
    EXPECT_TRUE(same_values(input, full.input)) << "input";
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, TpShards,
                         testing::Values(StageCase{"megatron", megatron::make_megatron},
                                         StageCase{"sequence_parallel",
                                                   sp::make_sequence_parallel}),
                         [](const auto& p) { return p.param.name; });

TEST(TpSplit, RejectsSizesTheRanksCannotSplit) {
  BlockConfig c;
  c.hidden = 48;
  c.heads = 6;
  c.ffn = 96;
  c.seq = 12;
  EXPECT_NO_THROW(check_tp_split(c, 3, /*sequence=*/true));
  c.seq = 16;  // 3 ranks cannot share 16 tokens, but tensor parallelism alone does not split S
  EXPECT_NO_THROW(check_tp_split(c, 3, /*sequence=*/false));
  EXPECT_THROW(check_tp_split(c, 3, /*sequence=*/true), ConfigError);
  c.heads = 4;  // whole heads per rank
  c.hidden = 64;
  EXPECT_THROW(check_tp_split(c, 3, /*sequence=*/false), ConfigError);
  try {
    check_tp_split(c, 3, /*sequence=*/true);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--heads (4)"), std::string::npos) << what;
    EXPECT_NE(what.find("--seq (16)"), std::string::npos) << what;
    EXPECT_EQ(what.find("--ffn"), std::string::npos) << what;  // 96 splits over 3
    EXPECT_EQ(what.find('\n'), std::string::npos) << "one line: " << what;
  }
}

}  // namespace
}  // namespace tpx
