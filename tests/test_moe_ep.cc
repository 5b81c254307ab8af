// The expert-parallel MoE MLP (common/moe_ep.h) under mpirun -np 1, 2 and 4 (EP = the number of
// ranks) against common/moe.h's single-process forward and backward over all tokens: every rank
// makes the same random case, holds an uneven slice of the tokens and E/EP experts, and compares
// its routing and drops (exactly), its output and input gradient, its experts' weight gradients,
// and (summed over the ranks) the router's and shared experts' gradients and L_aux (double: 1e-12
// relative to the largest element; float: 1e-5), under balanced and skewed routing (a bias making
// every token choose expert 0), dropless and with capacity drops, softmax and sigmoid routers.
// The communicator's bytes for the pass are checked against moe_ep.h's formula with the
// per-destination counts taken from the single-process routing. E not divisible by EP is refused.
// The cases marked "ops" run the layer on tensors (moe_ep_ops_forward/backward, what stage 10
// runs on either device) on the cpu, through the same checks.
//
// Every rank runs every test in the same order and reaches every collective.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/check.h"
#include "common/comm/communicator.h"
#include "common/moe.h"
#include "common/moe_ep.h"
#include "common/stream.h"
#include "common/trace.h"
#include "test_job_comm.h"
#include "test_mpi.h"

namespace tpx {
namespace {

using I = std::int64_t;

struct Case {
  MoeRouter router;
  double capacity;    ///< 0: dropless
  double aux;         ///< W of L_aux
  I shared;           ///< SF
  bool skew;          ///< a bias that sends every token to expert 0 first
  bool f32;           ///< float instead of double
  int chunks = 1;     ///< MoeEpOverlap's cut
  bool lane = false;  ///< the chunks' exchanges on a lane of their own (overlapped)
  bool ops = false;   ///< the layer on tensors (moe_ep_ops_forward, float), not the host path's
};

std::string describe(const Case& c) {
  return fmt::format(
      "{}_{}_{}_aux{}_shared{}_{}{}", c.router == MoeRouter::softmax ? "softmax" : "sigmoid",
      c.capacity > 0 ? "drop" : "dropless", c.skew ? "skewed" : "balanced", c.aux > 0 ? 1 : 0,
      c.shared > 0 ? 1 : 0, c.f32 ? (c.ops ? "ops" : "f32") : "f64",
      c.chunks > 1 ? fmt::format("_chunks{}{}", c.chunks, c.lane ? "_lane" : "") : "");
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return describe(i.param);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << describe(c);
}

constexpr I kTokens = 13, kHidden = 6, kExperts = 4, kTopk = 2, kFfn = 5;

class MoeEp : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    comm_ = test::job_communicator();
    n_ = comm_->size();
    r_ = comm_->rank();
  }

  /// Σ over the ranks of each rank's `v` (all of one size), in rank order.
  template <class V>
  V sum_over_ranks(const V& v) {
    using T = typename V::value_type;
    V all(v.size() * std::size_t(n_)), sum(v.size(), T(0));
    comm_->all_gather_report(std::as_bytes(std::span(v)), std::as_writable_bytes(std::span(all)),
                             "a gradient to compare");
    for (std::size_t q = 0; q < std::size_t(n_); ++q)
      for (std::size_t i = 0; i < v.size(); ++i) sum[i] += all[q * v.size() + i];
    return sum;
  }

  template <class T>
  void run(const Case& c);

  std::unique_ptr<Communicator> comm_;
  Stream stream_;
  int n_ = 1, r_ = 0;
};

/// max |got − want| ≤ tol · max |want| (and the sizes agree).
template <class T>
void expect_close(std::span<const T> got, std::span<const T> want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0, scale = 1e-300;
  for (std::size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::abs(double(want[i])));
  }
  EXPECT_LE(err, tol * scale) << what << ": max error " << err << " of max " << scale;
}

template <class T>
std::span<const T> part(const HostVector<T>& v, I begin, I count) {
  return std::span<const T>(v).subspan(std::size_t(begin), std::size_t(count));
}

/// A host vector as a cpu tensor of `shape` (undefined when empty).
Tensor tensor_of(const HostVector<float>& v, Tensor::Shape shape) {
  if (v.empty()) return {};
  const Tensor t = Tensor::empty(std::move(shape), DType::f32);
  std::copy(v.begin(), v.end(), t.data<float>());
  return t;
}

HostVector<float> values_of(const Tensor& t) {
  if (!t.defined()) return {};
  return HostVector<float>(t.data<float>(), t.data<float>() + t.numel());
}

/// The layer on tensors (moe_ep_ops_forward, moe_ep_ops_backward) on the cpu, its results in
/// the host path's structs, so that one set of checks reads both.
void run_on_tensors(const MoeShape& m, const MoeWeights<float>& w, const std::vector<float>& x,
                    const std::vector<float>& bias, const std::vector<float>& dy,
                    Communicator& comm, const MoeEpOverlap& overlap, MoeEpForward<float>& f,
                    MoeGrads<float>& g, CommStats& fwd, CommStats& bwd) {
  const I H = m.hidden, E = m.experts, El = E / comm.size(), FE = m.expert_ffn, SF = m.shared_ffn,
          n = m.tokens, k = m.topk;
  MoeTensors wt;
  wt.router = tensor_of(w.router, {H, E});
  wt.w_gate = tensor_of(w.w_gate, {El, H, FE});
  wt.w_up = tensor_of(w.w_up, {El, H, FE});
  wt.w_down = tensor_of(w.w_down, {El, FE, H});
  wt.shared_gate = tensor_of(w.shared_gate, {H, SF});
  wt.shared_up = tensor_of(w.shared_up, {H, SF});
  wt.shared_down = tensor_of(w.shared_down, {SF, H});
  const Tensor xt = tensor_of(HostVector<float>(x.begin(), x.end()), {n, H});
  const Tensor dyt = tensor_of(HostVector<float>(dy.begin(), dy.end()), {n, H});
  const Tensor b = tensor_of(HostVector<float>(bias.begin(), bias.end()), {E});
  const Stream here(Device::cpu);
  const MoeEpOpsForward t = moe_ep_ops_forward(m, wt, xt, b, comm, here, nullptr, overlap);
  fwd = comm.take_stats();
  const MoeTensorGrads gt = moe_ep_ops_backward(m, wt, xt, t, dyt, comm, here, nullptr, overlap);
  bwd = comm.take_stats();
  f.y = values_of(t.y);
  f.aux_loss = float(t.aux_loss);
  f.routed_all = t.routed_all;
  f.tokens_all = t.tokens_all;
  f.routing.kept = t.kept;
  f.routing.expert.assign(t.expert.data<std::int32_t>(), t.expert.data<std::int32_t>() + n * k);
  f.routing.weight = values_of(t.weight);
  f.send_rows.assign(std::size_t(comm.size()), 0);
  for (const MoeEpChunk& ch : t.chunks)
    for (std::size_t d = 0; d < ch.send_rows.size(); ++d) f.send_rows[d] += ch.send_rows[d];
  g.x = values_of(gt.x);
  const auto from = moe_tensors(gt.w);
  const auto into = moe_tensors(g.w);
  for (std::size_t p = 0; p < from.size(); ++p) *into[p] = values_of(*from[p]);
}

template <class T>
void MoeEp::run(const Case& c) {
  const double tol = c.f32 ? 1e-5 : 1e-12;
  MoeShape m;
  m.tokens = kTokens;
  m.hidden = kHidden;
  m.experts = kExperts;
  m.topk = kTopk;
  m.expert_ffn = kFfn;
  m.shared_ffn = c.shared;
  m.router = c.router;
  m.capacity_factor = c.capacity;
  m.aux_loss_weight = c.aux;
  const I H = kHidden, E = kExperts, k = kTopk, FE = kFfn, SF = c.shared, El = E / n_;

  // The same case on every rank.
  std::mt19937_64 gen(1234);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  auto fill = [&](I count, double scale = 1.0) {
    HostVector<T> v(static_cast<std::size_t>(count));
    for (T& x : v) x = T(scale * u(gen));
    return v;
  };
  MoeWeights<T> w;
  w.router = fill(H * E);
  w.w_gate = fill(E * H * FE, 0.5);
  w.w_up = fill(E * H * FE, 0.5);
  w.w_down = fill(E * FE * H, 0.5);
  w.shared_gate = fill(H * SF, 0.5);
  w.shared_up = fill(H * SF, 0.5);
  w.shared_down = fill(SF * H, 0.5);
  const HostVector<T> x = fill(kTokens * H), dy = fill(kTokens * H);
  std::vector<T> bias;
  if (c.skew) {
    bias.assign(std::size_t(E), T(0));
    bias[0] = T(2);  // above any score: expert 0 is every token's first choice
  }

  const MoeForward<T> ref = moe_forward<T>(m, w, x, bias);
  const MoeGrads<T> gref = moe_backward<T>(m, w, x, ref, dy);
  if (c.skew) {
    EXPECT_EQ(ref.routing.routed_per_expert[0], kTokens);
  }
  const I drops = std::count(ref.routing.kept.begin(), ref.routing.kept.end(), 0);
  if (c.capacity > 0 && c.skew) {
    EXPECT_GT(drops, 0) << "the case must drop";
  }
  if (c.capacity == 0) {
    EXPECT_EQ(drops, 0);
  }

  // This rank: tokens [lo, hi) and experts [r·E/EP, (r+1)·E/EP).
  auto lo_of = [&](I q) { return q * kTokens / n_; };
  const I lo = lo_of(r_), hi = lo_of(r_ + 1), nt = hi - lo;
  MoeShape mr = m;
  mr.tokens = nt;
  MoeWeights<T> wr = w;
  wr.w_gate.assign(w.w_gate.begin() + r_ * El * H * FE, w.w_gate.begin() + (r_ + 1) * El * H * FE);
  wr.w_up.assign(w.w_up.begin() + r_ * El * H * FE, w.w_up.begin() + (r_ + 1) * El * H * FE);
  wr.w_down.assign(w.w_down.begin() + r_ * El * FE * H, w.w_down.begin() + (r_ + 1) * El * FE * H);
  const std::vector<T> xr(x.begin() + lo * H, x.begin() + hi * H),
      dyr(dy.begin() + lo * H, dy.begin() + hi * H);

  comm_->take_stats();
  Trace trace(Trace::Mode::keep);
  const Stream lane = Stream::create(Device::cpu);
  const MoeEpOverlap overlap{.chunks = c.chunks, .lane = c.lane ? &lane : nullptr, .trace = &trace};
  MoeEpForward<T> f;
  MoeGrads<T> g;
  CommStats fwd, bwd;
  if constexpr (std::is_same_v<T, float>) {
    if (c.ops) run_on_tensors(mr, wr, xr, bias, dyr, *comm_, overlap, f, g, fwd, bwd);
  }
  if (!c.ops) {
    f = moe_ep_forward<T>(mr, wr, xr, bias, *comm_, stream_, nullptr, overlap);
    fwd = comm_->take_stats();
    g = moe_ep_backward<T>(mr, wr, xr, f, dyr, *comm_, stream_, nullptr, overlap);
    bwd = comm_->take_stats();
  }
  // The exchanges on the EP lane in the order every rank issues them: with a lane, chunk c + 1's
  // dispatch before chunk c's combine (forward, then backward).
  // (Without a token group the counts' all-gather runs over the EP group too, before them.)
  std::vector<std::string> order = {"moe counts all-gather"};
  const int chunks = c.chunks;
  for (int pass = 0; pass < 2; ++pass) {
    auto add = [&](const char* what, int q) {
      order.push_back(fmt::format("moe {} {}/{}", what, q, chunks));
    };
    if (!c.lane || c.chunks == 1) {
      for (int q = 1; q <= c.chunks; ++q) {
        add("dispatch", q);
        add("combine", q);
      }
      continue;
    }
    add("dispatch", 1);
    for (int q = 1; q <= c.chunks; ++q) {
      if (q + 1 <= c.chunks) add("dispatch", q + 1);
      add("combine", q);
    }
  }
  EXPECT_EQ(trace.span_names(Lane::ep_comm), order);

  // The routing and the drops: exactly the single-process ones for these tokens.
  EXPECT_EQ(f.tokens_all, kTokens);
  EXPECT_EQ(f.routed_all, ref.routing.routed_per_expert);
  for (I a = 0; a < nt * k; ++a) {
    EXPECT_EQ(f.routing.expert[std::size_t(a)], ref.routing.expert[std::size_t(lo * k + a)]) << a;
    EXPECT_EQ(f.routing.kept[std::size_t(a)], ref.routing.kept[std::size_t(lo * k + a)]) << a;
    // (On tensors the logits are a GEMM's, summed in another order than moe_logits's loop.)
    if (c.ops)
      EXPECT_NEAR(f.routing.weight[std::size_t(a)], ref.routing.weight[std::size_t(lo * k + a)],
                  tol)
          << a;
    else
      EXPECT_EQ(f.routing.weight[std::size_t(a)], ref.routing.weight[std::size_t(lo * k + a)]) << a;
  }
  expect_close<T>(f.y, part(ref.y, lo * H, nt * H), tol, "y");
  expect_close<T>(g.x, part(gref.x, lo * H, nt * H), tol, "dx");
  expect_close<T>(g.w.w_gate, part(gref.w.w_gate, r_ * El * H * FE, El * H * FE), tol, "dw_gate");
  expect_close<T>(g.w.w_up, part(gref.w.w_up, r_ * El * H * FE, El * H * FE), tol, "dw_up");
  expect_close<T>(g.w.w_down, part(gref.w.w_down, r_ * El * FE * H, El * FE * H), tol, "dw_down");
  expect_close<T>(sum_over_ranks(g.w.router), gref.w.router, tol, "d router");
  expect_close<T>(sum_over_ranks(g.w.shared_gate), gref.w.shared_gate, tol, "d shared_gate");
  expect_close<T>(sum_over_ranks(g.w.shared_up), gref.w.shared_up, tol, "d shared_up");
  expect_close<T>(sum_over_ranks(g.w.shared_down), gref.w.shared_down, tol, "d shared_down");
  const std::vector<T> aux = sum_over_ranks(std::vector<T>{f.aux_loss});
  EXPECT_NEAR(double(aux[0]), double(ref.aux_loss),
              tol * std::max(1.0, std::abs(double(ref.aux_loss))));

  // The bytes, from the single-process routing: n[s][d] = kept assignments of rank s's tokens to
  // rank d's experts; Σ_d n[r][d] = T_r·k − rank r's drops.
  std::vector<std::vector<std::uint64_t>> nsd(std::size_t(n_),
                                              std::vector<std::uint64_t>(std::size_t(n_), 0));
  for (int q = 0; q < n_; ++q)
    for (I a = lo_of(q) * k; a < lo_of(q + 1) * k; ++a)
      if (ref.routing.kept[std::size_t(a)])
        ++nsd[std::size_t(q)][std::size_t(ref.routing.expert[std::size_t(a)] / El)];
  std::uint64_t my_drops = 0;
  for (I a = lo * k; a < hi * k; ++a) my_drops += ref.routing.kept[std::size_t(a)] ? 0 : 1;
  std::uint64_t out_all = 0;
  for (int q = 0; q < n_; ++q) out_all += nsd[std::size_t(r_)][std::size_t(q)];
  EXPECT_EQ(out_all, std::uint64_t(nt * k) - my_drops);
  EXPECT_EQ(f.send_rows, std::vector<I>(nsd[std::size_t(r_)].begin(), nsd[std::size_t(r_)].end()));
  // The communicator's counts are moe_ep.h's formula (moe_ep_traffic) of these rows.
  const MoeEpTraffic want = moe_ep_traffic(nsd, r_, E, std::uint64_t(H) * sizeof(T), 0, c.chunks);
  EXPECT_EQ(fwd.calls, want.forward.calls);
  EXPECT_EQ(fwd.payload_bytes, want.forward.payload);
  EXPECT_EQ(fwd.bus_bytes, want.forward.bus);
  EXPECT_EQ(bwd.calls, want.backward.calls);
  EXPECT_EQ(bwd.payload_bytes, want.backward.payload);
  EXPECT_EQ(bwd.bus_bytes, want.backward.bus);
  std::size_t all_to_alls = 0;
  for (const auto& op : comm_->recorder().snapshot()) all_to_alls += op.op == CommOp::all_to_all;
  EXPECT_EQ(all_to_alls, 5u * std::size_t(c.chunks));  // counts, dispatch, combine; twice back
}

// moe_ep_traffic on rows worked out by hand: EP 2, rank 0 sends 3 rows to itself and 1 to rank
// 1 and receives 2 from rank 1 (n = [[3, 1], [2, 4]]), E 4, rows of 8 bytes. Forward: the counts'
// all_gather 2·(4 + 1)·4 = 40 bytes (bus 20), the counts' all_to_all 4·4 = 16 (bus 4·(4 − 2) =
// 8), dispatch 4 rows out and combine 5 in, 72 bytes (bus: the 1 + 2 that cross, 24); backward
// the two exchanges again. Balanced rows: T_r·k / EP each.
TEST(MoeEpTraffic, TheFormulaOnRowsWorkedOutByHand) {
  const std::vector<std::vector<std::uint64_t>> n{{3, 1}, {2, 4}};
  const MoeEpTraffic t = moe_ep_traffic(n, 0, 4, 8);
  EXPECT_EQ(t.forward.payload, 40u + 16u + 72u);
  EXPECT_EQ(t.forward.bus, 20u + 8u + 24u);
  EXPECT_EQ(t.forward.calls, 4u);
  EXPECT_EQ(t.backward.payload, 72u);
  EXPECT_EQ(t.backward.bus, 24u);
  EXPECT_EQ(t.backward.calls, 2u);
  const MoeEpTraffic other = moe_ep_traffic(n, 1, 4, 8);  // rank 1: 6 rows out, 5 in, 3 cross
  EXPECT_EQ(other.backward.payload, 11u * 8u);
  EXPECT_EQ(other.backward.bus, 3u * 8u);
  EXPECT_EQ(moe_balanced_rows(2, 6, 2), (std::vector<std::vector<std::uint64_t>>{{6, 6}, {6, 6}}));
  EXPECT_THROW(moe_balanced_rows(4, 3, 1), std::runtime_error);  // 3 rows over 4 ranks
  EXPECT_THROW(moe_ep_traffic(n, 0, 3, 8), std::runtime_error);  // E not a multiple of EP
}

TEST_P(MoeEp, EqualsTheSingleProcessLayerOverAllTokens) {
  if (GetParam().f32)
    run<float>(GetParam());
  else
    run<double>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeEp,
    ::testing::Values(Case{MoeRouter::softmax, 0.0, 0.0, 0, false, false},
                      Case{MoeRouter::softmax, 1.0, 0.01, 8, false, false},
                      Case{MoeRouter::softmax, 1.0, 0.01, 0, true, false},
                      Case{MoeRouter::softmax, 0.0, 0.0, 8, true, false},
                      Case{MoeRouter::sigmoid, 0.0, 0.02, 8, true, false},
                      Case{MoeRouter::sigmoid, 1.25, 0.0, 0, true, false},
                      Case{MoeRouter::sigmoid, 1.0, 0.01, 8, false, false},
                      Case{MoeRouter::softmax, 1.0, 0.01, 8, true, true},
                      // Cut into chunks, with and without the lane.
                      Case{MoeRouter::softmax, 1.0, 0.01, 8, false, false, 3, true},
                      Case{MoeRouter::sigmoid, 1.25, 0.0, 0, true, false, 2, false},
                      Case{MoeRouter::softmax, 0.0, 0.01, 8, true, true, 4, true},
                      // More chunks than a rank has tokens: empty ones.
                      Case{MoeRouter::softmax, 1.0, 0.01, 0, false, false, 9, true},
                      // The layer on tensors (stage 10's, either device), here on the cpu.
                      Case{MoeRouter::softmax, 1.0, 0.01, 8, false, true, 1, false, true},
                      Case{MoeRouter::sigmoid, 1.25, 0.02, 8, true, true, 1, false, true},
                      Case{MoeRouter::sigmoid, 0.0, 0.0, 0, true, true, 1, false, true},
                      Case{MoeRouter::softmax, 1.0, 0.01, 8, true, true, 3, true, true},
                      Case{MoeRouter::softmax, 1.0, 0.01, 0, false, true, 9, true, true}),
    case_name);

class MoeEpRefusal : public MoeEp {};

TEST_F(MoeEpRefusal, ExpertsNotDivisibleByEpAreRefusedBeforeAnyCommunication) {
  try {
    moe_ep_check(6, 4);
    ADD_FAILURE() << "6 experts over 4 EP ranks accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--experts (6) must be divisible by --ep (4): each EP rank holds E/EP whole experts");
  }
  EXPECT_NO_THROW(moe_ep_check(8, 4));
  if (n_ > 1) {
    // Three experts over 2 or 4 ranks: the layer refuses on every rank, before any op.
    MoeShape m;
    m.tokens = 2;
    m.hidden = 2;
    m.experts = 3;
    m.topk = 1;
    m.expert_ffn = 2;
    const MoeWeights<double> w;
    const std::vector<double> x(4, 0.5), none;
    EXPECT_THROW(moe_ep_forward<double>(m, w, x, none, *comm_, stream_), ConfigError);
    EXPECT_TRUE(comm_->recorder().snapshot().empty());
  }
}

}  // namespace
}  // namespace tpx
