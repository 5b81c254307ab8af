// SymmetricMemory on the cpu under mpirun (N = 1, 2, 4):
//   - a pull copies exactly the peer's bytes at the offset, and is counted (0 bytes from itself);
//   - the ready/done protocol over 300 uses of one buffer, with random delays on the copy lane:
//     every consumer reads exactly the value of the use it waited for (no torn read, no stale
//     signal), and the generations count up without ever being reset;
//   - generation 0 is reached at once; views and pulls outside the buffer are errors.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <mpi.h>

#include <gtest/gtest.h>

#include "05_copy_engine_async_tp/symmetric_memory.h"
#include "common/check.h"
#include "test_mpi.h"

namespace tpx {
namespace {

class Symmetric : public ::testing::Test {
 protected:
  void SetUp() override {
    MPI_Comm_rank(MPI_COMM_WORLD, &r_);
    MPI_Comm_size(MPI_COMM_WORLD, &n_);
  }
  std::unique_ptr<SymmetricMemory> make(std::size_t bytes, int delay_us = 0) {
    const SymmetricOptions o{.timeout_s = 60,
                             .fault_rank = -1,
                             .fault_signal = -1,
                             .delay_us = delay_us,
                             .delay_seed = 7,
                             .group = {}};
    return make_symmetric_memory(Device::cpu, bytes, o, Trace::off());
  }
  int r_ = 0, n_ = 1;
};

TEST_F(Symmetric, PullCopiesThePeersBytesAtTheOffset) {
  constexpr std::int64_t kCount = 64;
  auto mem = make(2 * kCount * sizeof(float));
  // Rank r's buffer holds 1000·r + i in its second half.
  const Tensor mine = mem->local({kCount}, DType::f32, kCount * sizeof(float));
  for (std::int64_t i = 0; i < kCount; ++i) mine.f32()[i] = float(1000 * r_ + i);
  mem->barrier();
  mem->take_stats();
  std::vector<Tensor> got;
  for (int p = 0; p < n_; ++p) {
    got.push_back(Tensor::empty({kCount}));
    mem->pull(p, kCount * sizeof(float), got.back(), mem->copy_stream(), "test pull");
  }
  mem->copy_stream().synchronize();
  for (int p = 0; p < n_; ++p)
    for (std::int64_t i = 0; i < kCount; ++i)
      ASSERT_EQ(got[std::size_t(p)].f32()[i], float(1000 * p + i))
          << "peer " << p << " element " << i;
  const CommStats s = mem->take_stats();
  EXPECT_EQ(s.calls, std::uint64_t(n_));
  EXPECT_EQ(s.bus_bytes, std::uint64_t(n_ - 1) * kCount * sizeof(float));
  mem->barrier();  // nobody frees while a peer may still pull
}

TEST_F(Symmetric, ReadyDoneProtocolOverManyUsesWithDelays) {
  // Every rank publishes use k (its buffer filled with k·N + rank), signals ready(k) to each
  // peer, and pulls each peer's use k after waiting for its ready(k), then signals done(k). Use
  // k + 1 overwrites the buffer only after done(k) from every peer.
  constexpr std::int64_t kCount = 256;
  constexpr int kUses = 300;
  auto mem = make(kCount * sizeof(float), /*delay_us=*/40);
  const Stream& copy = mem->copy_stream();
  const Tensor mine = mem->local({kCount}, DType::f32, 0);
  std::vector<Tensor> got;
  for (int p = 0; p < n_; ++p) got.push_back(Tensor::zeros({kCount}));
  for (int k = 1; k <= kUses; ++k) {
    for (int p = 0; p < n_; ++p)
      if (p != r_) mem->wait(p, Signal::done, std::uint64_t(k - 1), Stream(), "test publish");
    for (float& v : mine.f32()) v = float(k * n_ + r_);  // exact: small integers
    for (int p = 0; p < n_; ++p)
      if (p != r_) mem->signal(p, Signal::ready, Stream(), "test publish");
    for (int p = 0; p < n_; ++p) {
      if (p == r_) continue;
      mem->wait(p, Signal::ready, std::uint64_t(k), copy, "test pull");
      mem->pull(p, 0, got[std::size_t(p)], copy, "test pull");
      mem->signal(p, Signal::done, copy, "test pull");
    }
    copy.synchronize();
    for (int p = 0; p < n_; ++p) {
      if (p == r_) continue;
      const auto g = got[std::size_t(p)].f32();
      for (std::size_t i = 0; i < g.size(); ++i)
        ASSERT_EQ(g[i], float(k * n_ + p)) << "use " << k << " from peer " << p << " element " << i;
    }
  }
  for (int p = 0; p < n_; ++p)
    if (p != r_) {
      EXPECT_EQ(mem->sent(p, Signal::ready), std::uint64_t(kUses));
      EXPECT_EQ(mem->sent(p, Signal::done), std::uint64_t(kUses));
    }
  mem->barrier();
}

TEST_F(Symmetric, GenerationZeroAndBoundsChecks) {
  auto mem = make(64);
  mem->wait((r_ + 1) % n_, Signal::ready, 0, Stream(), "nothing to wait for");  // returns at once
  EXPECT_THROW(mem->local({17}, DType::f32, 0), Error);
  EXPECT_THROW(mem->local({16}, DType::f32, 4), Error);
  const Tensor big = Tensor::empty({32});
  EXPECT_THROW(mem->pull(0, 0, big, mem->copy_stream(), "too big"), Error);
  EXPECT_THROW(mem->signal(n_, Signal::ready, Stream(), "no such rank"), Error);
  mem->barrier();
}

}  // namespace
}  // namespace tpx
