// The device side of Stream and Event (common/stream.h) on an asynchronous device: its streams,
// its events and the calling thread's current stream. Stream and Event reach the device only
// through it, so their protocol (the host lanes' threads, counters and snapshots in stream.cc)
// can run against either of two devices:
//
//   the CUDA runtime   cudaStream_t / cudaEvent_t (common/cuda/stream.cc), what every stage uses
//                      with --device cuda;
//   a simulated device a test's stand-in whose streams are threads that run behind the host, as
//                      a GPU's do (tests/sim_device.h): the cpu's own default stream runs inline,
//                      so only such a device lets a cpu machine see a lane that reads before the
//                      compute stream has written.
//
// defines: tpx::DeviceQueues, tpx::device_queues(), tpx::ScopedDeviceQueues
#pragma once

#include <memory>

namespace tpx {

/// Handles travel as void* (cudaStream_t / cudaEvent_t on cuda); owning handles are
/// shared_ptr<void> whose deleter destroys the native object. A null stream is the device's
/// default stream, the compute stream of the stages.
class DeviceQueues {
 public:
  virtual ~DeviceQueues() = default;

  /// Binds the calling thread to the device (a host lane's thread, before it issues anything).
  virtual void bind_thread() = 0;
  /// A new stream that runs concurrently with the others (cuda: non-blocking).
  virtual std::shared_ptr<void> create_stream() = 0;
  /// Blocks the host until everything issued on `stream` so far is done.
  virtual void synchronize_stream(void* stream) = 0;
  /// A new event, complete until it is first recorded.
  virtual std::shared_ptr<void> create_event() = 0;
  /// Records `event` at the point `stream` has reached in its issue order (re-recording moves it).
  virtual void record_event(void* event, void* stream) = 0;
  /// Makes `stream`'s later work wait for the point `event` was last recorded at before this
  /// call; the host does not block.
  virtual void wait_event(void* event, void* stream) = 0;
  /// Blocks the host until `event`'s last recorded point is reached.
  virtual void synchronize_event(void* event) = 0;
  /// True once `event`'s last recorded point is reached.
  virtual bool event_ready(void* event) = 0;
  /// The stream the calling thread issues on (null: the default stream).
  virtual void* current_stream() = 0;
  virtual void set_current_stream(void* stream) = 0;
};

/// The device behind Device::cuda: a simulated one while a ScopedDeviceQueues holds it, else the
/// CUDA runtime; fails in a build without the CUDA backend.
DeviceQueues& device_queues();

/// Puts `queues` behind Device::cuda for its lifetime (tests). Every Stream and Event made
/// meanwhile must be gone before it ends.
class ScopedDeviceQueues {
 public:
  explicit ScopedDeviceQueues(DeviceQueues& queues);
  ~ScopedDeviceQueues();
  ScopedDeviceQueues(const ScopedDeviceQueues&) = delete;
  ScopedDeviceQueues& operator=(const ScopedDeviceQueues&) = delete;

 private:
  DeviceQueues* previous_;
};

}  // namespace tpx
