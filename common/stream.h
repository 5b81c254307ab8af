// Streams and events, backend-neutral. On the cpu backend work runs synchronously when it is
// issued, so a Stream is only a name for a lane and Events are already complete; on cuda they wrap
// cudaStream_t / cudaEvent_t (common/cuda/).
//
// defines: tpx::Stream, tpx::Event
#pragma once

#include <memory>

#include "tensor.h"

namespace tpx {

class Stream {
 public:
  /// The device's default stream (cpu: the calling thread).
  explicit Stream(Device device = Device::cpu);
  /// A new non-blocking stream on `device`.
  static Stream create(Device device);

  Device device() const { return device_; }
  /// The native handle (cudaStream_t on cuda, nullptr on cpu).
  void* native() const { return handle_ ? handle_.get() : nullptr; }
  /// Blocks the host until everything issued on the stream is done.
  void synchronize() const;

 private:
  Device device_;
  std::shared_ptr<void> handle_;  // owns the native stream; null for default streams
};

class Event {
 public:
  explicit Event(Device device = Device::cpu);
  /// Marks the point in `s` reached by the work issued so far.
  void record(const Stream& s);
  /// Makes `s` wait (on the device, not the host) until the recorded point is reached.
  void wait(const Stream& s) const;
  /// Blocks the host until the recorded point is reached.
  void synchronize() const;
  /// True once the recorded point is reached.
  bool ready() const;

 private:
  Device device_;
  std::shared_ptr<void> handle_;  // cudaEvent_t on cuda
};

}  // namespace tpx
