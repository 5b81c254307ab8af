// Communicator::all_to_all_v and all_to_all_counts under mpirun -np 1, 2 and 4: ragged counts
// (zeros included, and the skewed case of every rank sending everything to rank 0) from a table
// every rank computes alike, each received row checked against the value its sender wrote for
// this rank (a number naming the sender, the receiver, the row and the column, exact in f32), the
// accounting against the formula of communicator.h, the flight recorder's records, and the
// refusals of inconsistent arguments.
//
// Every rank runs every test in the same order and reaches every collective.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "common/check.h"
#include "common/comm/communicator.h"
#include "test_job_comm.h"
#include "test_mpi.h"

namespace tpx {
namespace {

constexpr std::int64_t kCols = 3;

/// The rows rank s sends rank d under pattern `seed`: 0 … 5 from a hash, with rank s sending
/// nothing to rank s + 1; seed 0 is the skew (every rank sends 7 rows to rank 0, none elsewhere).
std::int64_t rows(int seed, int s, int d, int n) {
  if (seed == 0) return d == 0 ? 7 : 0;
  if (n > 1 && d == (s + 1) % n) return 0;
  const std::uint32_t h = static_cast<std::uint32_t>(seed * 7919 + s * 131 + d * 17) * 2654435761u;
  return static_cast<std::int64_t>((h >> 13) % 6);
}

/// The value rank s writes at column c of its i-th row for rank d.
float value(int s, int d, std::int64_t i, std::int64_t c) {
  return float(10000 * s + 1000 * d + 10 * i + c);
}

class AllToAllArgs : public ::testing::Test {
 protected:
  void SetUp() override {
    comm_ = test::job_communicator();
    n_ = comm_->size();
    r_ = comm_->rank();
  }

  std::unique_ptr<Communicator> comm_;
  Stream stream_;
  int n_ = 1, r_ = 0;
};

class AllToAll : public AllToAllArgs, public ::testing::WithParamInterface<int> {};

TEST_P(AllToAll, RowsArriveFromEverySenderInOrderAndAreCountedByTheFormula) {
  const int seed = GetParam();
  std::vector<std::int64_t> send_rows(static_cast<std::size_t>(n_)),
      want_recv(static_cast<std::size_t>(n_));
  for (int d = 0; d < n_; ++d) send_rows[std::size_t(d)] = rows(seed, r_, d, n_);
  for (int s = 0; s < n_; ++s) want_recv[std::size_t(s)] = rows(seed, s, r_, n_);

  const std::vector<std::int64_t> recv_rows = comm_->all_to_all_counts(send_rows, "counts");
  EXPECT_EQ(recv_rows, want_recv);

  const std::int64_t n_send = std::accumulate(send_rows.begin(), send_rows.end(), std::int64_t(0));
  const std::int64_t n_recv = std::accumulate(want_recv.begin(), want_recv.end(), std::int64_t(0));
  const Tensor send = Tensor::empty({n_send, kCols});
  {
    std::int64_t at = 0;
    for (int d = 0; d < n_; ++d)
      for (std::int64_t i = 0; i < send_rows[std::size_t(d)]; ++i, ++at)
        for (std::int64_t c = 0; c < kCols; ++c)
          send.f32()[std::size_t(at * kCols + c)] = value(r_, d, i, c);
  }
  const Tensor recv = Tensor::zeros({n_recv, kCols});
  comm_->all_to_all_v(send, send_rows, recv, want_recv, stream_, "rows");
  std::int64_t at = 0;
  for (int s = 0; s < n_; ++s)
    for (std::int64_t i = 0; i < want_recv[std::size_t(s)]; ++i, ++at)
      for (std::int64_t c = 0; c < kCols; ++c)
        EXPECT_EQ(recv.f32()[std::size_t(at * kCols + c)], value(s, r_, i, c))
            << "row " << i << " from rank " << s << " column " << c;

  // The counts: 4 B per rank, 4 (N − 1) B leave the rank. The rows: 12 B each, all of them in
  // the payload, those for other ranks on the bus.
  std::uint64_t away = 0;
  for (int d = 0; d < n_; ++d)
    if (d != r_) away += std::uint64_t(send_rows[std::size_t(d)]);
  const CommStats st = comm_->take_stats();
  EXPECT_EQ(st.calls, 2u);
  EXPECT_EQ(st.payload_bytes, 4u * std::uint64_t(n_) + 12u * std::uint64_t(n_send));
  EXPECT_EQ(st.bus_bytes, 4u * std::uint64_t(n_ - 1) + 12u * away);

  const auto ops = comm_->recorder().snapshot();
  ASSERT_EQ(ops.size(), 2u);
  EXPECT_EQ(ops[0].op, CommOp::all_to_all);
  EXPECT_EQ(ops[0].dtype, DType::i32);
  EXPECT_EQ(ops[0].count, n_);
  EXPECT_EQ(ops[0].bytes, 4u * std::uint64_t(n_));
  EXPECT_EQ(std::string_view(ops[0].what), "counts");
  EXPECT_EQ(ops[1].op, CommOp::all_to_all);
  EXPECT_EQ(ops[1].dtype, DType::f32);
  EXPECT_EQ(ops[1].count, n_send * kCols);
  EXPECT_EQ(ops[1].bytes, 12u * std::uint64_t(n_send));
  EXPECT_EQ(std::string_view(ops[1].what), "rows");
  for (const auto& op : ops) EXPECT_EQ(op.state, OpState::done);
  EXPECT_EQ(describe_op(ops[1]).rfind("all_to_all fp32[", 0), 0u) << describe_op(ops[1]);
}

INSTANTIATE_TEST_SUITE_P(Patterns, AllToAll, ::testing::Values(0, 1, 2, 3));

TEST_F(AllToAllArgs, InconsistentArgumentsAreRefusedBeforeAnyTransfer) {
  const std::vector<std::int64_t> one(static_cast<std::size_t>(n_), 1),
      short_counts(static_cast<std::size_t>(n_) + 1, 0);
  const Tensor t = Tensor::zeros({n_, kCols});
  // Wrong number of counts, counts that do not sum to the rows, a negative count, row shapes or
  // dtypes that differ: each a tpx::Error on every rank, and nothing recorded or counted.
  EXPECT_THROW(comm_->all_to_all_v(t, short_counts, t, one, stream_), Error);
  EXPECT_THROW(comm_->all_to_all_v(t, one, Tensor::zeros({n_ + 1, kCols}), one, stream_), Error);
  std::vector<std::int64_t> negative = one;
  negative[0] = -1;
  EXPECT_THROW(comm_->all_to_all_v(t, negative, t, one, stream_), Error);
  EXPECT_THROW(comm_->all_to_all_counts(negative), Error);
  EXPECT_THROW(comm_->all_to_all_v(t, one, Tensor::zeros({n_, kCols + 1}), one, stream_), Error);
  EXPECT_THROW(comm_->all_to_all_v(t, one, Tensor::zeros({n_, kCols}, DType::i32), one, stream_),
               Error);
  EXPECT_THROW(comm_->all_to_all_v(t, one, Tensor(), one, stream_), Error);
  EXPECT_TRUE(comm_->recorder().snapshot().empty());
  EXPECT_EQ(comm_->take_stats().calls, 0u);
}

/// A backend with every op but the all-to-all, as NCCL is: the refusal comes from the
/// Communicator itself, before anything is recorded or counted.
class NoAllToAll final : public Communicator {
 public:
  NoAllToAll(int rank, int size, const CommOptions& o) : Communicator(rank, size, o) {}
  std::string name() const override { return "a test backend"; }

 protected:
  void do_all_gather(const Tensor&, const Tensor&, const Stream&) override { unused(); }
  void do_reduce_scatter(const Tensor&, const Tensor&, const Stream&) override { unused(); }
  void do_all_reduce(const Tensor&, const Stream&, bool) override { unused(); }
  void do_broadcast(const Tensor&, int, const Stream&) override { unused(); }
  void do_sendrecv(const Tensor&, int, const Tensor&, int, const Stream&) override { unused(); }
  void do_barrier() override { unused(); }
  bool accepts(Device) const override { return true; }

 private:
  [[noreturn]] static void unused() { fail("not used by the test"); }
};

TEST_F(AllToAllArgs, ABackendWithoutItRefusesOnEveryRankBeforeAnyTransfer) {
  CommOptions o;
  o.monitor = make_comm_monitor(o);
  NoAllToAll c(r_, n_, o);
  const std::vector<std::int64_t> one(static_cast<std::size_t>(n_), 1);
  const Tensor t = Tensor::zeros({n_, kCols});
  for (int op = 0; op < 2; ++op) {
    try {
      if (op == 0)
        c.all_to_all_counts(one);
      else
        c.all_to_all_v(t, one, t, one, stream_);
      ADD_FAILURE() << "op " << op << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string_view(e.what()).find("a test backend has no all-to-all yet"),
                std::string_view::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(c.recorder().snapshot().empty());
  EXPECT_EQ(c.take_stats().calls, 0u);
}

}  // namespace
}  // namespace tpx
