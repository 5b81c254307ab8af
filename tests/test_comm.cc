// The Communicator under mpirun -np 1, 2 and 4: every collective against hand-computed results
// (rank r contributes r·1000 + i, so sums and concatenations are exact in f32), a sendrecv ring,
// the rejection of sums on non-f32 tensors, the accounting after each op against the nccl-tests
// formulas, and the flight recorder's contents.
//
// Every rank runs every test in the same order; the tests avoid early returns between collectives
// so that a failed expectation cannot leave the ranks out of step.
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/comm/communicator.h"
#include "common/comm/watchdog.h"
#include "common/comm/zero_cta.h"
#include "common/ops.h"
#include "common/stage.h"
#include "test_cuda.h"
#include "test_job_comm.h"
#if TPX_WITH_CUDA
#include "common/cuda/device.h"
#endif

namespace tpx {
namespace {

class Comm : public ::testing::Test {
 protected:
  void SetUp() override {
    comm_ = test::job_communicator();
    n_ = comm_->size();
    r_ = comm_->rank();
  }

  /// What rank `rank` contributes at element i: exact in f32 for the sizes here.
  static float val(int rank, int i) { return 1000.0f * float(rank) + float(i); }

  /// A cpu f32 tensor holding base + i at element i.
  static Tensor iota(Tensor::Shape shape, float base) {
    Tensor t = Tensor::empty(std::move(shape));
    auto v = t.f32();
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = base + float(i);
    return t;
  }

  void expect_stats(std::uint64_t payload, std::uint64_t bus, std::uint64_t calls) {
    const CommStats s = comm_->take_stats();
    EXPECT_EQ(s.payload_bytes, payload);
    EXPECT_EQ(s.bus_bytes, bus);
    EXPECT_EQ(s.calls, calls);
  }

  std::unique_ptr<Communicator> comm_;
  Stream stream_;
  int n_ = 1, r_ = 0;
};

TEST_F(Comm, NameSaysHostMemory) {
  EXPECT_EQ(comm_->name(), "mpi (host memory)");
  int world = 0, rank = -1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  EXPECT_EQ(n_, world);
  EXPECT_EQ(r_, rank);
  EXPECT_EQ(comm_->timeout(), 60.0);
}

TEST_F(Comm, AllGatherConcatenatesInRankOrder) {
  const Tensor in = iota({2, 3}, 1000.0f * float(r_));
  const Tensor out = Tensor::zeros({2 * n_, 3});
  comm_->all_gather(in, out, stream_);
  const auto v = out.f32();
  ASSERT_EQ(v.size(), std::size_t(6 * n_));
  for (int q = 0; q < n_; ++q)
    for (int i = 0; i < 6; ++i) EXPECT_EQ(v[std::size_t(q * 6 + i)], val(q, i));
  // payload = the gathered buffer, 6N floats; bus = payload·(N−1)/N = 24·(N−1) bytes.
  expect_stats(24u * n_, 24u * (n_ - 1), 1);
}

TEST_F(Comm, AllGatherMovesBf16Bits) {
  const Tensor in = Tensor::empty({4}, DType::bf16);
  auto* p = in.data<std::uint16_t>();
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint16_t>(0x3f80 + 16 * r_ + i);
  const Tensor out = Tensor::empty({4 * n_}, DType::bf16);
  comm_->all_gather(in, out, stream_);
  const auto* q = out.data<std::uint16_t>();
  for (int rank = 0; rank < n_; ++rank)
    for (int i = 0; i < 4; ++i) EXPECT_EQ(q[rank * 4 + i], 0x3f80 + 16 * rank + i);
  expect_stats(8u * n_, 8u * (n_ - 1), 1);
}

TEST_F(Comm, ReduceScatterSumsAndKeepsThisRanksSlice) {
  // in[j] = r·1000 + j on rank r, j < 6N; this rank keeps j in [6r, 6r + 6) of the sum.
  const Tensor in = iota({2 * n_, 3}, 1000.0f * float(r_));
  const Tensor out = Tensor::zeros({2, 3});
  comm_->reduce_scatter(in, out, stream_);
  const auto v = out.f32();
  const float rank_sum = 1000.0f * float(n_ * (n_ - 1) / 2);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(v[std::size_t(i)], rank_sum + float(n_ * (6 * r_ + i)));
  // payload = the full pre-reduce buffer, 6N floats.
  expect_stats(24u * n_, 24u * (n_ - 1), 1);
}

TEST_F(Comm, AllReduceSumsInPlace) {
  const Tensor t = iota({5}, 1000.0f * float(r_));
  comm_->all_reduce(t, stream_);
  const auto v = t.f32();
  for (int i = 0; i < 5; ++i)
    EXPECT_EQ(v[std::size_t(i)], 1000.0f * float(n_ * (n_ - 1) / 2) + float(n_ * i));
  // 20 B payload; bus = 20·2(N−1)/N rounded down: N=1 → 0, N=2 → 20, N=3 → 26, N=4 → 30.
  const std::uint64_t bus[] = {0, 0, 20, 26, 30};
  ASSERT_LE(n_, 4);
  expect_stats(20, bus[n_], 1);
}

TEST_F(Comm, AllReduceMaxTakesEachElementsLargestInPlace) {
  // Element i is largest on rank i mod N (and negative elsewhere), so no rank's vector wins whole.
  const Tensor t = Tensor::empty({5});
  for (int i = 0; i < 5; ++i)
    t.f32()[std::size_t(i)] = i % n_ == r_ ? float(10 * i + 1) : -float(r_ + 1) * 100.0f;
  comm_->all_reduce_max(t, stream_);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(t.f32()[std::size_t(i)], float(10 * i + 1)) << i;
  const std::uint64_t bus[] = {0, 0, 20, 26, 30};
  ASSERT_LE(n_, 4);
  expect_stats(20, bus[n_], 1);
  EXPECT_EQ(comm_->recorder().snapshot().back().op, CommOp::all_reduce_max);
}

TEST_F(Comm, BroadcastFromEveryRoot) {
  for (int root = 0; root < n_; ++root) {
    const Tensor t = r_ == root ? iota({4}, 1000.0f * float(root)) : iota({4}, -100.0f);
    comm_->broadcast(t, root, stream_);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(t.f32()[std::size_t(i)], val(root, i));
    expect_stats(16, n_ > 1 ? 16 : 0, 1);
  }
}

TEST_F(Comm, SendRecvRing) {
  const int dst = (r_ + 1) % n_, src = (r_ + n_ - 1) % n_;
  const Tensor send = iota({3}, 1000.0f * float(r_));
  const Tensor recv = Tensor::zeros({3});
  comm_->sendrecv(send, dst, recv, src, stream_);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(recv.f32()[std::size_t(i)], val(src, i));
  // P2P: payload = bytes sent; bus counts them unless the destination is this rank (N = 1).
  expect_stats(12, n_ > 1 ? 12 : 0, 1);
}

TEST_F(Comm, SendOnlyAndReceiveOnly) {
  // Ranks pair up (0→1, 2→3); a rank without a partner calls with neither tensor.
  const bool sender = r_ % 2 == 0 && r_ + 1 < n_, receiver = r_ % 2 == 1;
  const Tensor send = sender ? iota({8}, 7.0f + float(r_)) : Tensor();
  const Tensor recv = receiver ? Tensor::zeros({8}) : Tensor();
  comm_->sendrecv(send, r_ + 1, recv, r_ - 1, stream_);
  if (receiver) {
    for (int i = 0; i < 8; ++i)
      EXPECT_EQ(recv.f32()[std::size_t(i)], 7.0f + float(r_ - 1) + float(i));
  }
  expect_stats(sender ? 32 : 0, sender ? 32 : 0, 1);
}

TEST_F(Comm, BarrierCountsACallAndNoBytes) {
  comm_->barrier();
  comm_->barrier();
  expect_stats(0, 0, 2);
}

TEST_F(Comm, StatsAccumulateUntilTaken) {
  const Tensor t = iota({8}, 0.0f);          // 32 B
  const Tensor g = Tensor::empty({8 * n_});  // gathered: 32N B
  comm_->all_reduce(t, stream_);             // bus 32·2(N−1)/N
  comm_->all_gather(t, g, stream_);          // bus 32(N−1)
  const std::uint64_t ar_bus = 64u * (n_ - 1) / n_;
  expect_stats(32 + 32u * n_, ar_bus + 32u * (n_ - 1), 2);
  expect_stats(0, 0, 0);  // taken: reset
}

TEST_F(Comm, RejectsSumsOfFp8AndMaximaOfBf16) {
  const Tensor q = Tensor::empty({4 * n_}, DType::e4m3);
  const Tensor part = Tensor::empty({4}, DType::e4m3);
  try {
    comm_->all_reduce(q, stream_);
    ADD_FAILURE() << "all_reduce of fp8 did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce reduces f32 and bf16 tensors only"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(comm_->reduce_scatter(q, part, stream_), Error);
  EXPECT_THROW(comm_->all_reduce_max(Tensor::empty({4}, DType::bf16), stream_), Error);
  // Rejected before anything was issued: nothing recorded, nothing counted.
  EXPECT_EQ(comm_->recorder().next_seq(), 0u);
  expect_stats(0, 0, 0);
}

// bf16 sums (the mixed-precision recipe's activation reductions): 2 bytes an element on the wire,
// each hop adding in fp32 and rounding once. The values are small integers, exact in bf16 whatever
// the order of the hops, so the sums are known exactly.
TEST_F(Comm, SumsBf16InTwoBytesAnElement) {
  const std::int64_t len = 4 * n_;
  auto bf16_of = [](const std::vector<float>& v) {
    Tensor t = Tensor::empty({std::int64_t(v.size())}, DType::bf16);
    for (std::size_t i = 0; i < v.size(); ++i) t.data<std::uint16_t>()[i] = bf16_bits(v[i]);
    return t;
  };
  std::vector<float> mine(static_cast<std::size_t>(len));
  for (std::int64_t i = 0; i < len; ++i) mine[std::size_t(i)] = float(r_ + 1) + float(i % 4);
  const Tensor t = bf16_of(mine);
  comm_->all_reduce(t, stream_);
  for (std::int64_t i = 0; i < len; ++i) {
    const float want = float(n_ * (n_ + 1) / 2) + float(n_) * float(i % 4);
    EXPECT_EQ(bf16_value(t.data<std::uint16_t>()[i]), want) << "element " << i;
  }
  expect_stats(std::uint64_t(len) * 2, std::uint64_t(len) * 2 * 2 * (n_ - 1) / n_, 1);

  const Tensor part = Tensor::empty({4}, DType::bf16);
  comm_->reduce_scatter(bf16_of(mine), part, stream_);
  for (std::int64_t i = 0; i < 4; ++i) {
    const std::int64_t g = r_ * 4 + i;  // this rank's chunk of the full tensor
    const float want = float(n_ * (n_ + 1) / 2) + float(n_) * float(g % 4);
    EXPECT_EQ(bf16_value(part.data<std::uint16_t>()[i]), want) << "element " << g;
  }
}

TEST_F(Comm, RejectsMismatchedShapesAndRanks) {
  const Tensor in = Tensor::empty({2, 3});
  EXPECT_THROW(comm_->all_gather(in, Tensor::empty({2 * n_ + 1, 3}), stream_), Error);
  EXPECT_THROW(comm_->all_gather(in, Tensor::empty({2 * n_, 3}, DType::bf16), stream_), Error);
  EXPECT_THROW(comm_->reduce_scatter(Tensor::empty({2 * n_, 3}), Tensor::empty({3, 3}), stream_),
               Error);
  EXPECT_THROW(comm_->broadcast(in, n_, stream_), Error);
  EXPECT_THROW(comm_->broadcast(in, -1, stream_), Error);
  EXPECT_THROW(comm_->sendrecv(in, n_, Tensor(), 0, stream_), Error);
  EXPECT_THROW(comm_->sendrecv(Tensor(), 0, in, -1, stream_), Error);
  EXPECT_THROW(comm_->all_reduce(Tensor(), stream_), Error);
  EXPECT_EQ(comm_->recorder().next_seq(), 0u);
}

TEST_F(Comm, FlightRecorderHoldsEveryOp) {
  const Tensor t = iota({4}, 1.0f);  // 16 B
  const Tensor g = Tensor::empty({4 * n_});
  const Tensor part = Tensor::empty({1});
  const Tensor full = Tensor::empty({n_});
  comm_->all_gather(t, g, stream_);
  comm_->reduce_scatter(full, part, stream_);
  comm_->all_reduce(t, stream_);
  comm_->broadcast(t, n_ - 1, stream_);
  comm_->sendrecv(t, (r_ + 1) % n_, g.slice0(0, 4), (r_ + n_ - 1) % n_, stream_);
  comm_->barrier();

  const auto ops = comm_->recorder().snapshot();
  ASSERT_EQ(ops.size(), 6u);
  const CommOp want_op[] = {CommOp::all_gather, CommOp::reduce_scatter, CommOp::all_reduce,
                            CommOp::broadcast,  CommOp::sendrecv,       CommOp::barrier};
  const std::uint64_t want_bytes[] = {16u * n_, 4u * n_, 16, 16, 16, 0};
  for (std::size_t i = 0; i < ops.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(ops[i].seq, i);
    EXPECT_EQ(ops[i].op, want_op[i]);
    EXPECT_EQ(ops[i].bytes, want_bytes[i]);
    EXPECT_EQ(ops[i].state, OpState::done);
    EXPECT_LE(ops[i].enqueue_s, ops[i].start_s);
    EXPECT_LE(ops[i].start_s, ops[i].end_s);
    if (i > 0) {
      EXPECT_LE(ops[i - 1].end_s, ops[i].enqueue_s);
    }
  }
  EXPECT_EQ(ops[0].count, 4 * n_);
  EXPECT_EQ(ops[3].peer, n_ - 1);  // broadcast root
  EXPECT_EQ(ops[4].peer, (r_ + 1) % n_);
  EXPECT_EQ(ops[4].src, (r_ + n_ - 1) % n_);
  EXPECT_FALSE(comm_->recorder().oldest_in_flight().has_value());
}

TEST_F(Comm, ReportGathersConcatenateInRankOrderInTheReportLaneUncounted) {
  // Five bytes from each rank (not a whole float), and a double: every rank's, in rank order.
  std::vector<std::byte> mine(5), all(std::size_t(5 * n_));
  for (int i = 0; i < 5; ++i) mine[std::size_t(i)] = std::byte(16 * r_ + i);
  comm_->all_gather_report(mine, all, "bytes for a report");
  for (int q = 0; q < n_; ++q)
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(all[std::size_t(q * 5 + i)], std::byte(16 * q + i))
          << "rank " << q << " byte " << i;
  const std::vector<double> sums = comm_->all_gather_report(0.5 + r_, "a number");
  ASSERT_EQ(sums.size(), std::size_t(n_));
  for (int q = 0; q < n_; ++q) EXPECT_EQ(sums[std::size_t(q)], 0.5 + q);
  expect_stats(0, 0, 0);  // the report's traffic, not the step's
  // Recorded (with more than one rank) as all-gathers of the group's report lane, done.
  const auto ops = comm_->recorder().snapshot();
  ASSERT_EQ(ops.size(), n_ > 1 ? 2u : 0u);
  const std::uint64_t bytes[] = {5u * n_, 8u * n_};
  const char* what[] = {"bytes for a report", "a number"};
  for (std::size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(ops[i].op, CommOp::all_gather);
    EXPECT_EQ(ops[i].bytes, bytes[i]);
    EXPECT_EQ(ops[i].state, OpState::done);
    EXPECT_EQ(std::string_view(ops[i].what), what[i]);
    EXPECT_TRUE(std::string_view(ops[i].group).ends_with(" report")) << ops[i].group;
  }
  std::vector<std::byte> wrong(std::size_t(5 * n_ + 1));
  EXPECT_THROW(comm_->all_gather_report(mine, wrong, "a wrong size"), Error);
}

TEST(CommFault, SkippedOpIsRecordedAndNotCounted) {
  // Every rank skips its op #1, so the ranks stay in step and nothing hangs. On one rank the op
  // has no peer that could miss it: it runs, and the monitor says the fault did not fire.
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  CommOptions o;
  o.fault_rank = rank;
  o.fault_seq = 1;
  o.monitor = make_comm_monitor(o);
  auto comm = make_communicator(o, Device::cpu);
  const bool peers = comm->size() > 1;
  const Stream s;
  const Tensor t = Tensor::empty({4});
  for (int i = 0; i < 3; ++i) {
    ops::fill(t, 1.0f);
    comm->all_reduce(t, s);
    EXPECT_EQ(t.f32()[0], i == 1 ? 1.0f : float(comm->size())) << "op " << i;
  }
  const auto ops = comm->recorder().snapshot();
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[0].state, OpState::done);
  EXPECT_EQ(ops[1].state, peers ? OpState::skipped : OpState::done);
  EXPECT_EQ(ops[2].state, OpState::done);
  EXPECT_EQ(comm->take_stats().calls, peers ? 2u : 3u);
  // Every rank skipped the same op, so no rank could notice: what a run that gets to its end
  // with a fault flag reports.
  const std::string report = o.monitor->fault_report();
  EXPECT_EQ(report.rfind(fmt::format("--fault-skip-collective {}:1 ", rank), 0), 0u) << report;
  EXPECT_NE(report.find(peers ? "the job still ran to its end" : "no other rank taking part"),
            std::string::npos)
      << report;
  o.monitor->barrier();
}

TEST(CommFault, AOneRankAllGatherStillGathersWhenItsFaultComes) {
  // A one-rank group's all-gather must produce its output (its input) even when a fault flag
  // names it; only an op another rank takes part in is skipped.
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  CommOptions o;
  o.group = RankGroup::split(rank, 0, "one-rank group");
  o.fault_rank = rank;
  o.fault_seq = 0;
  o.monitor = make_comm_monitor(o);
  auto comm = make_communicator(o, Device::cpu);
  const Stream s;
  const Tensor mine = Tensor::empty({2}), all = Tensor::empty({2});
  ops::fill(mine, 3.0f);
  ops::fill(all, -1.0f);
  comm->all_gather(mine, all, s);
  EXPECT_EQ(all.f32()[0], 3.0f);
  EXPECT_EQ(all.f32()[1], 3.0f);
  EXPECT_EQ(comm->recorder().snapshot().at(0).state, OpState::done);
  EXPECT_NE(o.monitor->fault_report().find("did not fire"), std::string::npos)
      << o.monitor->fault_report();
}

TEST(CommFactory, NcclOnCpuIsAConfigError) {
  CommOptions o;
  o.kind = CommKind::nccl;
  try {
    make_communicator(o, Device::cpu);
    ADD_FAILURE() << "--comm nccl on cpu did not throw";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--device cuda"), std::string::npos) << e.what();
  }
}

TEST(CommFactory, AutoOnCpuIsMpi) {
  auto comm = make_communicator(CommOptions{}, Device::cpu);
  EXPECT_EQ(comm->name(), "mpi (host memory)");
}

/// Every collective on cuda tensors through `comm`, checked on the host.
void check_cuda_collectives(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  auto val = [](int rank, int i) { return 1000.0f * float(rank) + float(i); };
  auto on_gpu = [&](Tensor::Shape shape, int rank) {
    Tensor host = Tensor::empty(std::move(shape));
    for (std::size_t i = 0; i < host.f32().size(); ++i) host.f32()[i] = val(rank, int(i));
    return ops::to_device(host, Device::cuda);
  };
  auto host = [](const Tensor& t) { return ops::to_device(t, Device::cpu); };
  const Stream s = Stream::create(Device::cuda);  // not the default stream: ordering matters

  const Tensor sum = on_gpu({6}, r);
  comm.all_reduce(sum, s);
  const Tensor cat = Tensor::empty({6 * n}, DType::f32, Device::cuda);
  comm.all_gather(on_gpu({6}, r), cat, s);
  const Tensor part = Tensor::empty({2}, DType::f32, Device::cuda);
  comm.reduce_scatter(on_gpu({2 * n}, r), part, s);
  const Tensor bc = on_gpu({3}, r);
  comm.broadcast(bc, n - 1, s);
  const Tensor ring = Tensor::empty({4}, DType::f32, Device::cuda);
  comm.sendrecv(on_gpu({4}, r), (r + 1) % n, ring, (r + n - 1) % n, s);
  // The ragged all-to-all: d + 1 rows of 2 to rank d (row j of them 100·d + j), r + 1 rows from
  // every rank (NCCL: a group of sends and receives; MPI: staged through the host).
  std::vector<std::int64_t> send_rows, recv_rows;
  Tensor a2a_host = Tensor::empty({n * (n + 1) / 2, 2});
  for (int d = 0, row = 0; d < n; ++d) {
    send_rows.push_back(d + 1);
    recv_rows.push_back(r + 1);
    for (int j = 0; j <= d; ++j, ++row)
      for (int c = 0; c < 2; ++c)
        a2a_host.f32()[std::size_t(row * 2 + c)] = val(r, 100 * d + j) + 0.5f * float(c);
  }
  const Tensor a2a = Tensor::empty({n * (r + 1), 2}, DType::f32, Device::cuda);
  comm.all_to_all_v(ops::to_device(a2a_host, Device::cuda), send_rows, a2a, recv_rows, s,
                    "a test's all-to-all");
  s.synchronize();
  const Tensor got = host(a2a);
  for (int q = 0; q < n; ++q)
    for (int j = 0; j <= r; ++j)
      for (int c = 0; c < 2; ++c)
        EXPECT_EQ(got.f32()[std::size_t((q * (r + 1) + j) * 2 + c)],
                  val(q, 100 * r + j) + 0.5f * float(c))
            << "from " << q << " row " << j;

  const float ranks = 1000.0f * float(n * (n - 1) / 2);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(host(sum).f32()[std::size_t(i)], ranks + float(n * i));
  for (int q = 0; q < n; ++q)
    for (int i = 0; i < 6; ++i) EXPECT_EQ(host(cat).f32()[std::size_t(q * 6 + i)], val(q, i));
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(host(part).f32()[std::size_t(i)], ranks + float(n * (2 * r + i)));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(host(bc).f32()[std::size_t(i)], val(n - 1, i));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(host(ring).f32()[std::size_t(i)], val((r + n - 1) % n, i));
  comm.barrier();
  EXPECT_EQ(comm.take_stats().calls, 7u);
}

TEST(CommCuda, HostStagedMpi) {
  TPX_REQUIRE_GPU();
  // The path for ranks sharing one GPU.
  CommOptions o;
  o.kind = CommKind::mpi;
  auto comm = make_communicator(o, Device::cuda);
  EXPECT_EQ(comm->name().rfind("mpi (host-staged", 0), 0u) << comm->name();
  check_cuda_collectives(*comm);
}

TEST(CommCuda, AutoPicksNcclOnlyWithOneGpuPerRank) {
  TPX_REQUIRE_GPU();
  auto comm = make_communicator(CommOptions{}, Device::cuda);
  const bool staged = comm->name().rfind("mpi (host-staged", 0) == 0;
  if (!TPX_WITH_NCCL) {
    EXPECT_TRUE(staged) << comm->name();
  } else if (staged) {
    // Ranks share a GPU: auto fell back to host staging, and NCCL is refused outright.
    EXPECT_NE(comm->name().find("share a GPU"), std::string::npos) << comm->name();
    CommOptions nccl;
    nccl.kind = CommKind::nccl;
    try {
      make_communicator(nccl, Device::cuda);
      ADD_FAILURE() << "--comm nccl with a shared GPU did not throw";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("one GPU per rank"), std::string::npos) << e.what();
    }
  } else {
    EXPECT_EQ(comm->name(), "nccl (device memory)");
  }
  check_cuda_collectives(*comm);
}

TEST(CommZeroCta, RefusesTheCpuInOneLine) {
  try {
    make_zero_cta_comm(CommOptions{}, Device::cpu);
    ADD_FAILURE() << "a zero-CTA communicator for cpu tensors";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--device cuda"), std::string::npos) << e.what();
  }
}

TEST(CommCuda, ZeroCtaAllGatherInPlaceInItsWindow) {
  TPX_REQUIRE_GPU();
  std::unique_ptr<ZeroCtaComm> z;
  try {
    z = make_zero_cta_comm(CommOptions{}, Device::cuda);
  } catch (const ConfigError& e) {
    // Every rank refuses alike: ranks sharing a GPU, or an NCCL without the zero-CTA policy.
    const std::string why = e.what();
    EXPECT_TRUE(why.find("one GPU per rank") != std::string::npos ||
                why.find("NCCL >= 2.28") != std::string::npos ||
                why.find("no NCCL") != std::string::npos)
        << why;
    GTEST_SKIP() << "zero-CTA all-gather cannot run here: " << why;
  }
  Communicator& comm = z->comm();
  const int n = comm.size(), r = comm.rank();
  EXPECT_NE(comm.name().find("zero-CTA"), std::string::npos) << comm.name();
  const Stream s = Stream::create(Device::cuda);
  // Twice, the second larger: the window is replaced (collectively) and gathered into again.
  for (const std::int64_t len : {std::int64_t{1000}, std::int64_t{5000}}) {
    const Tensor full = z->window({len * n}, DType::f32);
    Tensor mine = Tensor::empty({len});
    for (std::int64_t i = 0; i < len; ++i) mine.f32()[std::size_t(i)] = float(r * 100000 + i);
    const Tensor own = full.slice0(r * len, (r + 1) * len);
    ops::copy(ops::to_device(mine, Device::cuda), own);
    ops::synchronize(Device::cuda);
    comm.all_gather(own, full, s);  // in place: the own chunk is already in its rows
    s.synchronize();
    const Tensor host = ops::to_device(full, Device::cpu);
    int wrong = 0;
    for (int q = 0; q < n; ++q)
      for (std::int64_t i = 0; i < len; ++i)
        wrong += host.f32()[std::size_t(q * len + i)] != float(q * 100000 + i) ? 1 : 0;
    EXPECT_EQ(wrong, 0) << "of " << len * n << " gathered values";
    const CommStats st = comm.take_stats();
    EXPECT_EQ(st.calls, 1u);
    EXPECT_EQ(st.payload_bytes, std::uint64_t(len * n * 4));
  }
}

#if TPX_WITH_CUDA
TEST(CommCuda, InputDroppedRightAfterTheCallIsNotReused) {
  TPX_REQUIRE_GPU();
  // The caching allocator is not stream-aware. The op below waits on the device for a long queue
  // of work on `s`; its input is dropped as soon as the call returns, and the next allocation of
  // that size is written at once on the default stream, which waits neither for `s` nor for the
  // communicator's stream. Unless the communicator keeps its tensors until the op is done, the
  // gather reads that block after it was overwritten with -1.
  auto comm = make_communicator(CommOptions{}, Device::cuda);
  const int n = comm->size(), r = comm->rank();
  constexpr std::int64_t kLen = 1024;
  const Stream s = Stream::create(Device::cuda);
  const Tensor busy = Tensor::empty({std::int64_t{1} << 26}, DType::f32, Device::cuda);  // 256 MiB
  const Tensor out = Tensor::empty({kLen * n}, DType::f32, Device::cuda);
  {
    cuda::StreamGuard on_s(s.native());
    for (int i = 0; i < 50; ++i) ops::fill(busy, float(i));
    const Tensor in = Tensor::empty({kLen}, DType::f32, Device::cuda);
    ops::fill(in, float(r + 1));
    comm->all_gather(in, out, s);
  }
  const Tensor other = Tensor::empty({kLen}, DType::f32, Device::cuda);
  ops::fill(other, -1.0f);
  s.synchronize();
  const Tensor host = ops::to_device(out, Device::cpu);
  int wrong = 0;
  for (int q = 0; q < n; ++q)
    for (std::int64_t i = 0; i < kLen; ++i)
      wrong += host.f32()[std::size_t(q * kLen + i)] != float(q + 1) ? 1 : 0;
  EXPECT_EQ(wrong, 0) << "of " << kLen * n << " gathered values (" << comm->name() << ")";
  ops::synchronize(Device::cuda);
}
#endif

}  // namespace
}  // namespace tpx

/// Prints failed assertions with the rank that saw them.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
};

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    // One rank's progress report is enough; the others print only their failures.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  const int mine = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
