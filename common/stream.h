// Streams and events, backend-neutral: the lanes on which a rank's work runs, and the marks by
// which one lane waits for another.
//
// A Stream is an in-order queue of work. Work issued on two different streams may run at the
// same time; an Event recorded on one stream and waited on by another orders them.
//
//   cpu   The default stream is the calling thread: work runs at once, inline. A created stream
//         owns a thread that runs its queue in order, so a GEMM issued on the default stream and
//         a transfer issued on a created stream really run at the same time. Events are counters
//         guarded by a mutex: record() enqueues a mark, wait() enqueues (or, on the default
//         stream, performs) a blocking wait for it.
//   cuda  cudaStream_t / cudaEvent_t, reached through common/device_queues.h (the CUDA runtime;
//         in tests, a simulated device whose streams run behind the host). run() issues the
//         work's kernels on the stream from the calling thread; the GPU runs them
//         asynchronously. A host lane (create_host_lane) is the cpu's thread and counters around
//         a cuda stream of its own: for work that blocks the thread running it (a host-staged
//         transfer in MPI).
//
// Memory: a cpu task keeps the tensors it captured alive until it has run (captures are shared
// handles), so their memory cannot be reused early. A cuda tensor used on a stream other than the
// one that allocated it must be announced with record_stream(), so that the caching allocator
// holds its block back until that stream has passed the point where the tensor was freed.
//
// defines: tpx::Stream, tpx::Event, tpx::record_stream, tpx::run_after_compute
#pragma once

#include <functional>
#include <initializer_list>
#include <memory>

#include "tensor.h"

namespace tpx {

class Stream {
 public:
  /// The device's default stream (cpu: the calling thread, inline).
  explicit Stream(Device device = Device::cpu);
  /// A new stream on `device` that runs concurrently with the others (cpu: with its own thread).
  static Stream create(Device device);
  /// A stream whose work runs in order on a host thread of its own, for work that blocks the
  /// thread that issues it (a host-staged transfer waits in MPI). cpu: the same as create().
  /// cuda: the thread issues the work's kernels and copies on a cuda stream of its own, so the
  /// calling thread goes on issuing compute meanwhile. An event recorded on such a lane completes
  /// once the lane's thread has reached it and the device has done what was issued before it;
  /// waiting on that event from another stream blocks the calling thread until the lane's thread
  /// has reached the mark (then the device waits for the rest), and waiting on another stream's
  /// event from the lane orders the lane's later work after the point recorded at the call.
  static Stream create_host_lane(Device device);

  Device device() const { return device_; }
  /// True for the default stream.
  bool is_default() const { return !handle_; }
  /// The native handle (cudaStream_t on cuda, nullptr on cpu); a host lane's cuda stream.
  void* native() const { return native_; }
  /// True for a stream made by create_host_lane() on cuda (on the cpu every created stream is one).
  bool is_cuda_host_lane() const { return device_ == Device::cuda && host_lane_; }

  /// Runs `work` in order after the work issued on this stream before it. cpu: a created stream
  /// runs it later on its own thread and run() returns at once; the default stream runs it now.
  /// cuda: runs it now on the calling thread, with every op it issues going to this stream.
  /// An exception thrown by work on a cpu stream's thread fails the stream: later work on it is
  /// skipped, and synchronize() (and every event recorded after the failure) rethrows it.
  void run(std::function<void()> work) const;
  /// Blocks the host until everything issued on the stream is done; rethrows a failure. Called
  /// by a task of a created cpu stream or a host lane on its own stream (MPI drains the stream it
  /// was given before staging a cuda tensor), it waits for what the task issued so far (cuda:
  /// the lane's cuda stream), not for the queue behind the task, which cannot finish before it.
  void synchronize() const;

  /// Two handles to the same stream compare equal.
  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.handle_ == b.handle_;
  }

 private:
  friend class Event;
  Device device_;
  std::shared_ptr<void> handle_;  // owns the native stream / the cpu queue; null for default
  void* native_ = nullptr;        // the cudaStream_t work is issued on (cuda only)
  bool host_lane_ = false;        // cuda: handle_ is a host lane (a queue and its cuda stream)
};

class Event {
 public:
  explicit Event(Device device = Device::cpu);
  /// Marks the point in `s` reached by the work issued on it so far (re-recording moves the mark).
  void record(const Stream& s);
  /// Makes `s` wait until the point last recorded (before this call) is reached; the host does
  /// not block unless `s` is the cpu default stream. An event never recorded is complete.
  void wait(const Stream& s) const;
  /// Blocks the host until the recorded point is reached; rethrows a failure of the stream.
  void synchronize() const;
  /// True once the recorded point is reached.
  bool ready() const;

 private:
  Device device_;
  std::shared_ptr<void> handle_;  // cudaEvent_t on cuda; the counters on cpu
  std::shared_ptr<void> host_;    // cuda: the counters of records made by a host lane's thread
};

/// Declares that work issued on `s` uses `t`: when t's memory is freed, the allocator does not
/// hand it out again before `s` has passed that point. No-op on the cpu (tasks hold their
/// tensors) and for the stream that allocated the tensor.
void record_stream(const Tensor& t, const Stream& s);

/// Hands `work` to `lane` behind everything issued so far on the device's default (compute)
/// stream, the one hand-off every comm lane of the stages makes: `lane` first waits for a mark
/// recorded on the compute stream now (what the work reads has been written, what it writes is no
/// longer read), each tensor of `uses` is announced on `lane` (record_stream), then `work` runs on
/// `lane`. Returns the event recorded on `lane` after the work. On the cpu the compute stream runs
/// inline, so a hand-off that forgot the mark would still be right there; on cuda it would read
/// what the compute stream has not written yet: one function, so that no call site can forget.
Event run_after_compute(const Stream& lane, std::initializer_list<Tensor> uses,
                        std::function<void()> work);

}  // namespace tpx
