// The ring primitives of common/ring.h under mpirun (N = 1, 2, 3, 4), each against the bulk
// collective followed (or preceded) by the whole GEMM:
//   - all_gather_gemm: the gathered input equals MPI's all-gather bit for bit; the outputs equal
//     the whole GEMM to 1e-6 relative (row chunks of one GEMM; the test prints whether they were
//     bitwise equal, which depends on the BLAS's blocking);
//   - gemm_reduce_scatter: equal to GEMM + reduce-scatter within fp32 summation-order tolerance;
//   - accounting: N − 1 transfers per primitive, the bulk collective's bus bytes, every step in
//     the flight recorder and on the trace's comm lane under its ring-step name (send/recv) or
//     every pull on the copy lane (copy engine).
// Every test runs over both transports, stage 04's and stage 05's.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "05_copy_engine_async_tp/copy_engine.h"
#include "common/comm/communicator.h"
#include "common/ops.h"
#include "common/ring.h"
#include "common/tp.h"
#include "test_mpi.h"
#include "test_util.h"

namespace tpx {
namespace {

/// max |got − want| / max |want|.
double rel_error(const Tensor& got, const Tensor& want) {
  const auto g = got.f32(), w = want.f32();
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    err = std::max(err, std::abs(double(g[i]) - double(w[i])));
    scale = std::max(scale, std::abs(double(w[i])));
  }
  return scale > 0 ? err / scale : err;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

/// What moves the chunks: stage 04's ring of send/recv or stage 05's copy-engine pulls.
enum class Mover { send_recv, copy_engine };

/// Every test runs over both transports: stage 04's ring of send/recv and stage 05's copy-engine
/// pulls from symmetric memory.
class Ring : public ::testing::TestWithParam<Mover> {
 protected:
  void SetUp() override {
    CommOptions o;
    o.kind = CommKind::mpi;
    o.timeout_s = 60;  // a hang becomes an abort with a diagnosis
    comm_ = make_communicator(o, Device::cpu);
    n_ = comm_->size();
    r_ = comm_->rank();
    if (p2p())
      transport_ = std::make_unique<P2PTransport>(*comm_, Device::cpu, trace_);
    else
      transport_ = std::make_unique<CopyEngineTransport>(r_, n_, Device::cpu,
                                                         SymmetricOptions{.timeout_s = 60,
                                                                          .fault_rank = -1,
                                                                          .fault_signal = -1,
                                                                          .delay_us = 0,
                                                                          .delay_seed = 1,
                                                                          .group = {}},
                                                         trace_);
  }
  bool p2p() const { return GetParam() == Mover::send_recv; }

  /// The traffic of the primitives since the last call: the communicator's (send/recv) and the
  /// transport's own (pulls).
  CommStats take_traffic() {
    CommStats s = comm_->take_stats();
    const CommStats t = transport_->take_stats();
    s.payload_bytes += t.payload_bytes;
    s.bus_bytes += t.bus_bytes;
    s.calls += t.calls;
    return s;
  }

  /// The name of transfer k (1-based) of a primitive for `role`: a ring step on the comm lane
  /// ("qkv AG step 1/4") or a pull on the copy lane ("qkv pull 1/3").
  std::string transfer(const std::string& role, const char* kind, int k) const {
    return p2p() ? fmt::format("{} {} step {}/{}", role, kind, k, n_)
                 : fmt::format("{} pull {}/{}", role, k, n_ - 1);
  }
  void TearDown() override {
    transport_.reset();  // drains the comm stream before the communicator goes
    comm_.reset();
  }

  RingContext ctx() { return {.transport = *transport_, .trace = trace_, .compute = DType::f32}; }

  /// The transfers whose names contain `what`: ring steps in the flight recorder (each one's
  /// comm-lane span carries the same name, ring.cc), or pulls on the trace's copy lane.
  int transfers(const std::string& what) const {
    int n = 0;
    if (p2p()) {
      for (const OpRecord& r : comm_->recorder().snapshot())
        if (std::string(r.what).find(what) != std::string::npos) ++n;
    } else {
      for (const std::string& name : trace_.span_names(Lane::copy))
        if (name.find(what) != std::string::npos) ++n;
    }
    return n;
  }

  Trace trace_{Trace::Mode::keep};
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<ChunkTransport> transport_;
  int n_ = 1, r_ = 0;
};

// Sizes: chunk rows n = 3 tokens × B = 2, so the GEMMs see 6-row chunks of an [N·3, 2, in] input.
constexpr std::int64_t kTokens = 3, kBatch = 2;

TEST_P(Ring, AllGatherGemmEqualsAllGatherThenGemm) {
  const std::int64_t in = 40;
  const Tensor x = test::random_tensor({kTokens, kBatch, in}, 100 + std::uint32_t(r_));
  // Q, K, V-like: three weights sharing each gathered chunk; the same on every rank.
  const std::array w{test::random_tensor({in, 24}, 1), test::random_tensor({in, 16}, 2),
                     test::random_tensor({in, 8}, 3)};
  std::vector<Tensor> out;
  for (const Tensor& wi : w) out.push_back(Tensor::empty({n_ * kTokens, kBatch, wi.dim(1)}));
  take_traffic();

  const Tensor gathered = all_gather_gemm(ctx(), x, w, /*trans_w=*/false, out, "qkv");
  const CommStats ring = take_traffic();

  const Tensor full = Tensor::empty({n_ * kTokens, kBatch, in});
  comm_->all_gather(x, full, Stream());
  const CommStats bulk = comm_->take_stats();
  EXPECT_TRUE(bitwise_equal(gathered, full)) << "the ring gathered other bytes than MPI";

  bool bitwise = true;
  for (std::size_t j = 0; j < w.size(); ++j) {
    const Tensor want = Tensor::empty(out[j].shape());
    ops::gemm(full, false, w[j], false, want);
    EXPECT_LE(rel_error(out[j], want), 1e-6) << "weight " << j;
    bitwise = bitwise && bitwise_equal(out[j], want);
  }
  if (r_ == 0)
    std::cout << fmt::format("[ info     ] N = {}: AG+GEMM outputs {} the whole GEMM's\n", n_,
                             bitwise ? "are bitwise equal to" : "differ in the last bits from");

  EXPECT_EQ(ring.calls, std::uint64_t(n_ - 1));
  EXPECT_EQ(ring.bus_bytes, bulk.bus_bytes);
  EXPECT_EQ(transfers(p2p() ? "qkv AG step" : "qkv pull"), n_ - 1);
  for (int i = 1; i < n_; ++i) EXPECT_EQ(transfers(transfer("qkv", "AG", i)), 1) << "step " << i;
}

TEST_P(Ring, AllGatherGemmOnTransposedWeights) {
  // The row-parallel backward: da = AG(dy) · Wᵀ with W [in/N, out].
  const std::int64_t out_cols = 32, in_rows = 12;
  const Tensor dy = test::random_tensor({kTokens, kBatch, out_cols}, 200 + std::uint32_t(r_));
  const std::array w{test::random_tensor({in_rows, out_cols}, 7)};
  const std::array da{Tensor::empty({n_ * kTokens, kBatch, in_rows})};
  const Tensor gathered = all_gather_gemm(ctx(), dy, w, /*trans_w=*/true, da, "o bwd");
  const Tensor want = Tensor::empty(da[0].shape());
  ops::gemm(gathered, false, w[0], true, want);
  EXPECT_LE(rel_error(da[0], want), 1e-6);
  // Chunk r of the gathered tensor is this rank's own input.
  EXPECT_TRUE(bitwise_equal(gathered.slice0(r_ * kTokens, (r_ + 1) * kTokens), dy));
}

TEST_P(Ring, GemmReduceScatterEqualsGemmThenReduceScatter) {
  // Two terms summed (the column-parallel backward: Σ dy[j] · W[j]ᵀ), with transposed weights,
  // and the plain row-parallel forward with one term.
  const std::int64_t h = 20;
  for (const bool trans : {false, true}) {
    const std::array a{test::random_tensor({n_ * kTokens, kBatch, 36}, 300 + std::uint32_t(r_)),
                       test::random_tensor({n_ * kTokens, kBatch, 12}, 400 + std::uint32_t(r_))};
    const std::array w{trans ? test::random_tensor({h, 36}, 11) : test::random_tensor({36, h}, 11),
                       trans ? test::random_tensor({h, 12}, 12) : test::random_tensor({12, h}, 12)};
    take_traffic();
    int tail_calls = 0;
    const Tensor got = gemm_reduce_scatter(
        ctx(), a, w, trans, "down", {.gather = nullptr, .before_last_wait = [&] { ++tail_calls; }});
    const CommStats ring = take_traffic();

    const Tensor partial = Tensor::empty({n_ * kTokens, kBatch, h});
    ops::gemm(a[0], false, w[0], trans, partial);
    ops::gemm(a[1], false, w[1], trans, partial, 1.0f, 1.0f);
    const Tensor want = Tensor::empty({kTokens, kBatch, h});
    comm_->reduce_scatter(partial, want, Stream());
    const CommStats bulk = comm_->take_stats();

    ASSERT_EQ(got.shape(), want.shape());
    // Each element is a sum over N ranks of K-term dot products: fp32 summation order only.
    EXPECT_LE(rel_error(got, want), 1e-5) << "trans_w " << trans;
    EXPECT_EQ(tail_calls, 1);
    EXPECT_EQ(ring.calls, std::uint64_t(n_ - 1));
    EXPECT_EQ(ring.bus_bytes, bulk.bus_bytes);
  }
  EXPECT_EQ(transfers(p2p() ? "down RS step" : "down pull"), 2 * (n_ - 1));
}

TEST_P(Ring, AllGatherQueuedStepByStepFillsEveryChunk) {
  const Tensor x = test::random_tensor({kTokens, kBatch, 8}, 500 + std::uint32_t(r_));
  const auto g = transport_->gather(ctx(), x, "re-gather", /*queued=*/0);
  transport_->synchronize();
  EXPECT_EQ(transfers(p2p() ? "re-gather AG step" : "re-gather pull"), 0)
      << "nothing may be queued yet";
  int queued = 0;
  while (g->advance()) ++queued;
  EXPECT_EQ(queued, n_ - 1);
  g->wait_all();
  const Tensor full = Tensor::empty({n_ * kTokens, kBatch, 8});
  comm_->all_gather(x, full, Stream());
  EXPECT_TRUE(bitwise_equal(g->full(), full));
}

TEST_P(Ring, ReduceScatterCarriesAGatherAndTailWorkAlong) {
  // The column-parallel backward's schedule: dX by GEMM+RS, the re-gather of its input
  // interleaved, dW in the tail, against the bulk collectives.
  const std::int64_t in = 16, out = 10;
  const Tensor h = test::random_tensor({kTokens, kBatch, in}, 700 + std::uint32_t(r_));
  const std::array dy{test::random_tensor({n_ * kTokens, kBatch, out}, 800 + std::uint32_t(r_))};
  const std::array w{test::random_tensor({in, out}, 17)};
  const Tensor dw = Tensor::empty({in, out});
  const auto g = transport_->gather(ctx(), h, "qkv re-gather", /*queued=*/1);
  const AlongTheRing along{.gather = g.get(), .before_last_wait = [&] {
                             g->wait_all();
                             ops::gemm(g->full(), true, dy[0], false, dw);
                           }};
  const Tensor dx = gemm_reduce_scatter(ctx(), dy, w, /*trans_w=*/true, "qkv dX", along);

  const Tensor full_h = Tensor::empty({n_ * kTokens, kBatch, in});
  comm_->all_gather(h, full_h, Stream());
  const Tensor want_dw = Tensor::empty({in, out});
  ops::gemm(full_h, true, dy[0], false, want_dw);
  EXPECT_LE(rel_error(dw, want_dw), 1e-6);
  const Tensor partial = Tensor::empty({n_ * kTokens, kBatch, in});
  ops::gemm(dy[0], false, w[0], true, partial);
  const Tensor want_dx = Tensor::empty({kTokens, kBatch, in});
  comm_->reduce_scatter(partial, want_dx, Stream());
  EXPECT_LE(rel_error(dx, want_dx), 1e-5);
  if (!p2p()) return;  // the copy engine pulls whichever chunk is ready: no fixed interleave
  // The comm lane took the two rings in turn: re-gather 1, dX 1, re-gather 2, dX 2, ...
  std::vector<std::string> order;
  for (const OpRecord& rec : comm_->recorder().snapshot())
    if (rec.what[0] != '\0') order.emplace_back(rec.what);
  std::vector<std::string> want;
  for (int k = 1; k < n_; ++k) {
    want.push_back(fmt::format("qkv re-gather AG step {}/{}", k, n_));
    want.push_back(fmt::format("qkv dX RS step {}/{}", k, n_));
  }
  EXPECT_EQ(order, want);
}

TEST_P(Ring, ExposedCommIsTheCommNotCoveredByCompute) {
  // The trace saw this rank's spans: whatever the overlap, exposed comm lies between 0 and the
  // comm lane's busy time, and the window before any span exposes nothing.
  const Tensor x = test::random_tensor({kTokens, kBatch, 64}, 600 + std::uint32_t(r_));
  const std::array w{test::random_tensor({64, 64}, 13)};
  const std::array y{Tensor::empty({n_ * kTokens, kBatch, 64})};
  const auto t0 = Trace::Clock::now();
  all_gather_gemm(ctx(), x, w, false, y, "mlp");
  const auto t1 = Trace::Clock::now();
  const double exposed = trace_.exposed_comm_ms(t0, t1);
  EXPECT_GE(exposed, 0.0);
  const double window = std::chrono::duration<double, std::milli>(t1 - t0).count();
  EXPECT_LE(exposed, window);
  EXPECT_EQ(trace_.exposed_comm_ms(t0 - std::chrono::seconds(10), t0), 0.0);
  if (n_ == 1) {
    EXPECT_EQ(exposed, 0.0);  // no transfers at all
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, Ring, ::testing::Values(Mover::send_recv, Mover::copy_engine),
                         [](const ::testing::TestParamInfo<Mover>& i) {
                           return i.param == Mover::send_recv ? "SendRecv" : "CopyEngine";
                         });

}  // namespace
}  // namespace tpx
