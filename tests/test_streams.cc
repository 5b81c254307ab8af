// Streams and events on the cpu backend (common/stream.h): a created stream runs its work in
// order on its own thread, concurrently with the caller; events order one lane after another; a
// task keeps the tensors it captured, so memory freed by the caller is not reused under it; a
// failing task fails its stream and the events recorded after it. (The cuda side is tested in
// test_cuda_streams.cc.) And the one measure of overlap built on the lanes' spans: exposed comm.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/ops.h"
#include "common/stream.h"
#include "common/trace.h"
#include "test_util.h"

namespace tpx {
namespace {

using namespace std::chrono_literals;

TEST(CpuStream, RunsWorkInIssueOrderOnItsOwnThread) {
  const Stream s = Stream::create(Device::cpu);
  std::vector<int> order;  // touched only by the stream's thread until synchronize()
  std::thread::id worker;
  for (int i = 0; i < 100; ++i)
    s.run([&order, &worker, i] {
      order.push_back(i);
      worker = std::this_thread::get_id();
    });
  s.synchronize();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[std::size_t(i)], i);
  EXPECT_NE(worker, std::this_thread::get_id());
}

TEST(CpuStream, DefaultStreamRunsInline) {
  const Stream s(Device::cpu);
  std::thread::id ran;
  s.run([&] { ran = std::this_thread::get_id(); });
  EXPECT_EQ(ran, std::this_thread::get_id());
  EXPECT_TRUE(s.is_default());
}

TEST(CpuStream, RunReturnsBeforeTheWorkIsDone) {
  // The caller goes on while the stream works: both lanes run at the same time.
  const Stream s = Stream::create(Device::cpu);
  std::atomic<bool> release{false}, started{false};
  s.run([&] {
    started = true;
    while (!release) std::this_thread::yield();
  });
  while (!started) std::this_thread::yield();  // the stream is busy, and we are still here
  Event e(Device::cpu);
  e.record(s);
  EXPECT_FALSE(e.ready());
  release = true;
  e.synchronize();
  EXPECT_TRUE(e.ready());
}

TEST(CpuEvent, OrdersAConsumerStreamAfterAProducerStream) {
  const Stream producer = Stream::create(Device::cpu), consumer = Stream::create(Device::cpu);
  const Tensor t = Tensor::zeros({1024});
  const Tensor out = Tensor::zeros({1024});
  std::atomic<bool> release{false};
  producer.run([&] {
    while (!release) std::this_thread::yield();  // hold the producer back
    ops::fill(t, 3.0f);
  });
  Event made(Device::cpu);
  made.record(producer);
  made.wait(consumer);
  consumer.run([t, out] { ops::add(t, t, out); });
  std::this_thread::sleep_for(20ms);
  Event consumed(Device::cpu);
  consumed.record(consumer);
  EXPECT_FALSE(consumed.ready()) << "the consumer ran before the producer's event";
  release = true;
  consumer.synchronize();
  for (const float v : out.f32()) ASSERT_EQ(v, 6.0f);
}

TEST(CpuEvent, WaitOnTheDefaultStreamBlocksTheCaller) {
  const Stream s = Stream::create(Device::cpu);
  std::atomic<int> value{0};
  s.run([&] {
    std::this_thread::sleep_for(30ms);
    value = 1;
  });
  Event e(Device::cpu);
  e.record(s);
  e.wait(Stream(Device::cpu));
  EXPECT_EQ(value.load(), 1);
}

TEST(CpuEvent, RunAfterComputeReturnsTheEndOfTheLanesWork) {
  const Stream lane = Stream::create(Device::cpu);
  std::atomic<int> value{0};
  const Event done = run_after_compute(lane, {}, [&] {
    std::this_thread::sleep_for(30ms);
    value = 1;
  });
  done.synchronize();
  EXPECT_EQ(value.load(), 1);
  EXPECT_TRUE(done.ready());
}

TEST(CpuEvent, AHostLaneRunsItsWorkOnItsOwnThread) {
  const Stream lane = Stream::create_host_lane(Device::cpu);
  std::atomic<bool> release{false};
  std::thread::id ran_on;
  lane.run([&] {
    ran_on = std::this_thread::get_id();
    while (!release) std::this_thread::yield();  // blocks the lane, not the caller
    lane.synchronize();  // as MPI does before staging: must not wait for this very task
  });
  Event done(Device::cpu);
  done.record(lane);
  EXPECT_FALSE(done.ready());
  release = true;
  done.synchronize();
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(CpuEvent, NeverRecordedIsComplete) {
  const Event e(Device::cpu);
  EXPECT_TRUE(e.ready());
  e.synchronize();
  e.wait(Stream::create(Device::cpu));
}

TEST(CpuStream, AFreedTensorIsNotReusedWhileATaskStillReadsIt) {
  // The task holds its own handle: dropping the caller's and allocating (and scribbling over) as
  // much memory again cannot touch what the stream will read.
  const Stream s = Stream::create(Device::cpu);
  std::atomic<bool> release{false};
  Tensor src = test::random_tensor({4096}, 7);
  const std::vector<double> want = test::to_doubles(src);
  const Tensor dst = Tensor::zeros({4096});
  s.run([&release] {
    while (!release) std::this_thread::yield();
  });
  s.run([src, dst] { ops::copy(src, dst); });
  const void* old = src.raw();
  src = Tensor();  // the caller's handle is gone
  std::vector<Tensor> others;
  for (int i = 0; i < 8; ++i) {
    others.push_back(Tensor::empty({4096}));
    EXPECT_NE(others.back().raw(), old) << "the memory was handed out again";
    ops::fill(others.back(), -1.0f);
  }
  release = true;
  s.synchronize();
  EXPECT_EQ(test::to_doubles(dst), want);
}

TEST(CpuStream, AFailingTaskFailsTheStreamAndItsLaterEvents) {
  const Stream s = Stream::create(Device::cpu);
  bool ran_after = false;
  s.run([] { throw std::runtime_error("boom"); });
  s.run([&] { ran_after = true; });
  Event e(Device::cpu);
  e.record(s);
  EXPECT_THROW(e.synchronize(), std::runtime_error);
  EXPECT_THROW(s.synchronize(), std::runtime_error);
  EXPECT_FALSE(ran_after) << "work after a failure must be skipped";
}

TEST(CpuStream, DroppingTheLastHandleFinishesTheQueue) {
  std::atomic<int> count{0};
  {
    const Stream s = Stream::create(Device::cpu);
    for (int i = 0; i < 10; ++i) s.run([&] { ++count; });
  }
  EXPECT_EQ(count.load(), 10);
}

TEST(ExposedComm, IsCommTimeNoComputeSpanCovers) {
  // Hand-placed spans (ms after t0):  comm [0, 10) [20, 30) [40, 50) (the last not counted),
  // compute [5, 25) [28, 29). Exposed: [0, 5) + [25, 28) + [29, 30) = 9 ms.
  Trace trace(Trace::Mode::keep);
  const auto t0 = Trace::Clock::now();
  auto at = [t0](int ms) { return t0 + std::chrono::milliseconds(ms); };
  trace.record("a", Lane::comm, at(0), at(10));
  trace.record("b", Lane::comm, at(20), at(30));
  trace.record("report", Lane::comm, at(40), at(50), /*counted=*/false);
  trace.record("gemm", Lane::compute, at(5), at(25));
  trace.record("add", Lane::compute, at(28), at(29));
  trace.record("forward", Lane::phase, at(0), at(50));  // a phase is not compute
  EXPECT_NEAR(trace.exposed_comm_ms(at(0), at(50)), 9.0, 1e-9);
  // Clipped to the window: [25, 28) + [29, 30) of [22, 30).
  EXPECT_NEAR(trace.exposed_comm_ms(at(22), at(30)), 4.0, 1e-9);
  // Copy lanes (the copy engine of later stages) count as communication too.
  trace.record("pull", Lane::copy, at(60), at(70));
  EXPECT_NEAR(trace.exposed_comm_ms(at(55), at(75)), 10.0, 1e-9);
}

TEST(ExposedComm, AMeasuringTraceForgetsPastSteps) {
  Trace trace(Trace::Mode::measure);
  const auto t0 = Trace::Clock::now();
  auto at = [t0](int ms) { return t0 + std::chrono::milliseconds(ms); };
  trace.record("a", Lane::comm, at(0), at(10));
  EXPECT_NEAR(trace.exposed_comm_ms(at(0), at(10)), 10.0, 1e-9);
  EXPECT_EQ(trace.exposed_comm_ms(at(0), at(10)), 0.0) << "the step's spans were kept";
  Trace off(Trace::Mode::off);
  off.record("a", Lane::comm, at(0), at(10));
  EXPECT_EQ(off.exposed_comm_ms(at(0), at(10)), 0.0);
}

}  // namespace
}  // namespace tpx
