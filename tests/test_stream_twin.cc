// Stream and Event's cuda protocol on the cpu: the code of common/stream.cc that runs for
// Device::cuda, against a simulated device whose streams run behind the host as a GPU's do
// (tests/sim_device.h, put behind Device::cuda by ScopedDeviceQueues). The cpu backend cannot
// show what these check, because its default stream runs inline:
//   - the default (compute) stream really runs behind the host;
//   - run_after_compute makes a lane, plain or host lane, wait for what the compute stream had
//     issued before the hand-off (stage 08's all-gather once read K/V before they were written,
//     on a GPU only);
//   - a host lane runs blocking work (an MPI transfer) on its own thread, the calling thread goes
//     on issuing, and an event recorded behind that work orders the compute stream after it;
//   - a host lane that waits on an event waits for the point the event was recorded at when the
//     wait was issued, even if the event is recorded again before the lane's thread gets there
//     (the snapshot on the lane's aux stream);
//   - a failure on a host lane's thread reaches whoever waits behind it instead of hanging them.
// tests/test_cuda_streams.cc checks the same on a GPU.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/device_queues.h"
#include "common/stream.h"
#include "sim_device.h"

namespace tpx {
namespace {

using namespace std::chrono_literals;
using test::SimDevice;

class StreamTwin : public testing::Test {
 protected:
  /// Polls `e` for up to five seconds: whether it was reached by then.
  static bool reached_soon(const Event& e) {
    for (int i = 0; i < 500 && !e.ready(); ++i) std::this_thread::sleep_for(10ms);
    return e.ready();
  }

  SimDevice sim;
  ScopedDeviceQueues use{sim};
};

TEST_F(StreamTwin, TheDefaultStreamRunsBehindTheHost) {
  std::atomic<int> x{0};
  {
    SimDevice::Gate gate(sim, nullptr);
    sim.launch([&] { x = 1; });
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(x.load(), 0) << "a kernel behind a closed gate ran";
    gate.open();
  }
  Stream(Device::cuda).synchronize();
  EXPECT_EQ(x.load(), 1);
}

class RunAfterCompute : public StreamTwin, public testing::WithParamInterface<bool> {};

TEST_P(RunAfterCompute, TheLaneWaitsForTheComputeStreamsWrites) {
  const bool host_lane = GetParam();
  const Stream lane =
      host_lane ? Stream::create_host_lane(Device::cuda) : Stream::create(Device::cuda);
  EXPECT_EQ(lane.is_cuda_host_lane(), host_lane);
  std::atomic<int> t{1}, out{-1};
  Event done(Device::cuda);
  {
    SimDevice::Gate gate(sim, nullptr);  // the compute stream is held here
    sim.launch([&] { t = 7; });          // written behind the gate
    done = run_after_compute(lane, {}, [&] { sim.launch([&] { out = t.load(); }); });
    std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(done.ready()) << "the lane's work ended while the compute stream was held";
    EXPECT_EQ(out.load(), -1) << "the lane read before the compute stream wrote";
    gate.open();
    done.synchronize();
  }
  EXPECT_EQ(out.load(), 7);
}

INSTANTIATE_TEST_SUITE_P(Lanes, RunAfterCompute, testing::Bool(), [](const auto& p) {
  return std::string(p.param ? "HostLane" : "Stream");
});

TEST_F(StreamTwin, AHostLaneRunsBlockingWorkOnItsOwnThreadInTheStreamsOrder) {
  const Stream lane = Stream::create_host_lane(Device::cuda);
  const Stream compute(Device::cuda);
  std::atomic<bool> release{false};
  std::atomic<int> x{0}, y{0};
  std::atomic<std::thread::id> lane_thread{};
  const int bound_before = sim.bound();
  const auto t0 = std::chrono::steady_clock::now();
  lane.run([&] {  // blocks its thread, as a host-staged MPI transfer does
    lane_thread = std::this_thread::get_id();
    while (!release) std::this_thread::sleep_for(100us);
    sim.launch([&] { x = 1; });  // on the lane's own stream
  });
  Event sent(Device::cuda);
  sent.record(lane);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "run() waited for the lane's work";
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(sent.ready()) << "an event behind the lane's blocked work was reached";
  release = true;
  sent.wait(compute);  // the compute stream after the lane's work
  sim.launch([&] { y = x.load() + 1; });
  compute.synchronize();
  EXPECT_EQ(y.load(), 2);
  EXPECT_NE(lane_thread.load(), std::this_thread::get_id());
  EXPECT_GT(sim.bound(), bound_before) << "the lane's thread never bound the device";
}

TEST_F(StreamTwin, AHostLaneWaitsForThePointRecordedWhenItWaited) {
  const Stream lane = Stream::create_host_lane(Device::cuda);
  const Stream compute(Device::cuda);
  std::atomic<bool> release{false};
  std::atomic<int> a{0}, b{-1};
  lane.run([&] {  // the lane's thread is busy until the event has been recorded again
    while (!release) std::this_thread::sleep_for(100us);
  });
  Event written(Device::cuda), copied(Device::cuda);
  SimDevice::Gate first(sim, nullptr);
  sim.launch([&] { a = 1; });
  written.record(compute);
  written.wait(lane);  // the lane's later work waits for a = 1, and for nothing after it
  lane.run([&] { sim.launch([&] { b = a.load(); }); });
  copied.record(lane);
  SimDevice::Gate second(sim, nullptr);
  sim.launch([&] { a = 2; });
  written.record(compute);  // recorded again: only later waits wait for this point
  release = true;
  first.open();
  EXPECT_TRUE(reached_soon(copied))
      << "the lane waited for the event's later record (held behind a closed gate)";
  EXPECT_EQ(b.load(), 1);
  second.open();
  compute.synchronize();
  EXPECT_EQ(a.load(), 2);
}

TEST_F(StreamTwin, AFailureOnAHostLaneReachesEveryoneWaitingBehindIt) {
  // A transfer that throws on the lane's thread (an MPI error) must not leave the compute
  // stream, or the host, waiting for an event that will never be recorded.
  const Stream lane = Stream::create_host_lane(Device::cuda);
  bool ran_after = false;
  lane.run([] { throw std::runtime_error("transfer failed"); });
  lane.run([&] { ran_after = true; });
  Event received(Device::cuda);
  received.record(lane);
  EXPECT_THROW(received.wait(Stream(Device::cuda)), std::runtime_error);
  EXPECT_THROW(received.synchronize(), std::runtime_error);
  EXPECT_THROW(lane.synchronize(), std::runtime_error);
  EXPECT_FALSE(ran_after) << "work after a failure must be skipped";
}

}  // namespace
}  // namespace tpx
