// The cpu side of Stream/Event (a thread per created stream, counters for events), the cuda
// host lane (the same thread and counters around a device stream) and the dispatch to the
// device's streams and events (common/device_queues.h: the CUDA runtime, or a test's simulated
// device).
#include "stream.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "check.h"
#include "device_queues.h"
#if TPX_WITH_CUDA
#include "cuda/stream.h"
#endif

namespace tpx {
namespace {

/// A created cpu stream: an in-order queue drained by its own thread. The thread shares the
/// queue's state, so the last handle may even be dropped by a task running on that thread.
class CpuQueue {
 public:
  CpuQueue() : state_(std::make_shared<State>()) {
    worker_ = std::thread([state = state_] { state->drain(); });
  }
  ~CpuQueue() {
    {
      std::lock_guard lock(state_->mutex);
      state_->stopping = true;
    }
    state_->wake.notify_all();
    if (worker_.get_id() == std::this_thread::get_id())
      worker_.detach();  // it finishes the queue and exits on its own
    else
      worker_.join();
  }
  CpuQueue(const CpuQueue&) = delete;
  CpuQueue& operator=(const CpuQueue&) = delete;

  /// Queues `work`. A `mark` (an event's record) runs even after the stream failed, with the
  /// failure as its argument, so that nobody waits forever on a failed stream's events.
  void push(std::function<void(std::exception_ptr)> work, bool mark) {
    {
      std::lock_guard lock(state_->mutex);
      state_->tasks.push_back({std::move(work), mark});
      ++state_->issued;
    }
    state_->wake.notify_all();
  }

  /// True on the queue's own thread (inside a task it runs).
  bool on_worker() const { return worker_.get_id() == std::this_thread::get_id(); }

  void synchronize() {
    State& st = *state_;
    std::unique_lock lock(st.mutex);
    const std::uint64_t target = st.issued;
    st.idle.wait(lock, [&] { return st.done >= target; });
    if (st.error) std::rethrow_exception(st.error);
  }

 private:
  struct Task {
    std::function<void(std::exception_ptr)> work;
    bool mark = false;
  };

  struct State {
    std::mutex mutex;
    std::condition_variable wake, idle;
    std::deque<Task> tasks;
    std::uint64_t issued = 0, done = 0;
    std::exception_ptr error;  // the first failure; sticky
    bool stopping = false;

    void drain() {
      for (;;) {
        Task task;
        std::exception_ptr failed;
        {
          std::unique_lock lock(mutex);
          wake.wait(lock, [&] { return stopping || !tasks.empty(); });
          if (tasks.empty()) return;  // stopping, and everything issued has run
          task = std::move(tasks.front());
          tasks.pop_front();
          failed = error;
        }
        std::exception_ptr thrown;
        if (!failed || task.mark) {
          try {
            task.work(failed);
          } catch (...) {
            thrown = std::current_exception();
          }
        }
        task.work = nullptr;  // release the task's captures before it counts as done
        {
          std::lock_guard lock(mutex);
          if (thrown && !error) error = thrown;
          ++done;
        }
        idle.notify_all();
      }
    }
  };

  std::shared_ptr<State> state_;
  std::thread worker_;
};

/// A cpu event: generation counters. record() takes the next generation; the mark completes it.
struct CpuEvent {
  std::mutex mutex;
  std::condition_variable reached;
  std::uint64_t recorded = 0, completed = 0;
  std::exception_ptr error;  // the failure of the stream that should have reached the mark

  /// The generation a new record() takes.
  std::uint64_t next() {
    std::lock_guard lock(mutex);
    return ++recorded;
  }
  /// The generation of the last record(): what a wait made now waits for.
  std::uint64_t last() {
    std::lock_guard lock(mutex);
    return recorded;
  }
  /// True once the last record() is reached.
  bool reached_last() {
    std::lock_guard lock(mutex);
    return completed >= recorded;
  }
  void complete(std::uint64_t generation, std::exception_ptr failed) {
    {
      std::lock_guard lock(mutex);
      completed = std::max(completed, generation);
      if (failed) error = std::move(failed);
    }
    reached.notify_all();
  }
  void wait_for(std::uint64_t generation) {
    // The waiter has nothing else to do, and a mark is usually near (a ring step's transfer), so
    // poll for a short while before sleeping: waking from a condition variable costs tens of
    // microseconds, a ring step on small chunks not much more. yield() lends the core to any
    // other runnable thread meanwhile (on a machine with fewer cores than lanes, the comm lane).
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    std::unique_lock lock(mutex);
    while (completed < generation && std::chrono::steady_clock::now() < until) {
      lock.unlock();
      std::this_thread::yield();
      lock.lock();
    }
    reached.wait(lock, [&] { return completed >= generation; });
    if (error) std::rethrow_exception(error);
  }
};

CpuQueue& queue(const std::shared_ptr<void>& h) {
  return *static_cast<CpuQueue*>(h.get());
}
CpuEvent& cpu_event(const std::shared_ptr<void>& h) {
  return *static_cast<CpuEvent*>(h.get());
}

/// A cuda host lane: a cpu queue whose thread issues the work onto `stream`. `aux` only waits
/// and records: it takes the snapshot of another stream's event at the moment the lane waits on
/// it, for the lane's thread to wait on when it gets there. The queue is declared last, so it is
/// destroyed first: its thread finishes the issued work before the streams go.
struct CudaHostLane {
  std::shared_ptr<void> stream = device_queues().create_stream();
  std::shared_ptr<void> aux = device_queues().create_stream();
  CpuQueue queue;
};
CudaHostLane& host_lane(const std::shared_ptr<void>& h) {
  return *static_cast<CudaHostLane*>(h.get());
}

/// The calling thread's current device stream set to `stream` for a scope: what the work's ops
/// issue on.
class CurrentStream {
 public:
  CurrentStream(DeviceQueues& q, void* stream) : q_(q), previous_(q.current_stream()) {
    q_.set_current_stream(stream);
  }
  ~CurrentStream() { q_.set_current_stream(previous_); }
  CurrentStream(const CurrentStream&) = delete;
  CurrentStream& operator=(const CurrentStream&) = delete;

 private:
  DeviceQueues& q_;
  void* previous_;
};

std::atomic<DeviceQueues*> installed_queues{nullptr};  // a test's simulated device, if any

}  // namespace

DeviceQueues& device_queues() {
  if (DeviceQueues* q = installed_queues.load()) return *q;
#if TPX_WITH_CUDA
  return cuda::runtime_queues();
#else
  fail("this build has no CUDA backend");
#endif
}

ScopedDeviceQueues::ScopedDeviceQueues(DeviceQueues& queues)
    : previous_(installed_queues.exchange(&queues)) {}
ScopedDeviceQueues::~ScopedDeviceQueues() {
  installed_queues.store(previous_);
}

Stream::Stream(Device device) : device_(device) {}

Stream Stream::create(Device device) {
  Stream s(device);
  if (device == Device::cpu) {
    s.handle_ = std::make_shared<CpuQueue>();
    return s;
  }
  s.handle_ = device_queues().create_stream();
  s.native_ = s.handle_.get();
  return s;
}

Stream Stream::create_host_lane(Device device) {
  if (device == Device::cpu) return create(device);  // every created cpu stream is one
  Stream s(device);
  auto lane = std::make_shared<CudaHostLane>();
  s.native_ = lane->stream.get();
  s.handle_ = std::move(lane);
  s.host_lane_ = true;
  return s;
}

void Stream::run(std::function<void()> work) const {
  if (device_ == Device::cuda) {
    if (host_lane_) {  // the lane's thread binds the device and issues on the lane's stream
      host_lane(handle_).queue.push(
          [stream = native_, w = std::move(work)](const std::exception_ptr&) {
            DeviceQueues& q = device_queues();
            q.bind_thread();
            CurrentStream issue_on(q, stream);
            w();
          },
          false);
      return;
    }
    CurrentStream issue_on(device_queues(), native());
    work();
    return;
  }
  if (is_default()) {
    work();
    return;
  }
  queue(handle_).push([w = std::move(work)](const std::exception_ptr&) { w(); }, false);
}

void Stream::synchronize() const {
  if (device_ == Device::cuda) {
    // Everything issued, then done. A task of the lane that synchronizes its own stream (MPI
    // staging a cuda tensor drains the stream it was given) waits for the cuda stream only: the
    // queue behind it cannot finish before it does.
    if (host_lane_ && !host_lane(handle_).queue.on_worker()) host_lane(handle_).queue.synchronize();
    device_queues().synchronize_stream(native());
    return;
  }
  if (!is_default() && !queue(handle_).on_worker()) queue(handle_).synchronize();
}

Event::Event(Device device) : device_(device) {
  if (device == Device::cpu) {
    handle_ = std::make_shared<CpuEvent>();
    return;
  }
  handle_ = device_queues().create_event();
  host_ = std::make_shared<CpuEvent>();
}

void Event::record(const Stream& s) {
  TPX_CHECK(s.device() == device_, "an event on {} recorded on a stream on {}", to_string(device_),
            to_string(s.device()));
  if (device_ == Device::cuda) {
    // The host counters say whether the cuda record has been made: at once from the calling
    // thread, or when a host lane's thread reaches the mark (an event recorded on a host lane is
    // not recorded elsewhere before that mark is reached).
    CpuEvent& host = cpu_event(host_);
    const std::uint64_t generation = host.next();
    if (!s.is_cuda_host_lane()) {
      device_queues().record_event(handle_.get(), s.native());
      host.complete(generation, nullptr);
      return;
    }
    host_lane(s.handle_).queue.push(
        [event = handle_, state = host_, stream = s.native(),
         generation](std::exception_ptr failed) {
          if (!failed) try {
              DeviceQueues& q = device_queues();
              q.bind_thread();
              q.record_event(event.get(), stream);
            } catch (...) {
              failed = std::current_exception();
            }
          static_cast<CpuEvent*>(state.get())->complete(generation, std::move(failed));
        },
        true);
    return;
  }
  CpuEvent& e = cpu_event(handle_);
  const std::uint64_t generation = e.next();
  if (s.is_default()) {
    e.complete(generation, nullptr);  // the default stream has done everything issued on it
    return;
  }
  queue(s.handle_).push(
      [state = handle_, generation](std::exception_ptr failed) {
        static_cast<CpuEvent*>(state.get())->complete(generation, std::move(failed));
      },
      true);
}

void Event::wait(const Stream& s) const {
  TPX_CHECK(s.device() == device_, "an event on {} waited on by a stream on {}", to_string(device_),
            to_string(s.device()));
  if (device_ == Device::cuda) {
    CpuEvent& host = cpu_event(host_);
    const std::uint64_t target = host.last();
    host.wait_for(target);  // a host lane's record made (at once for any other stream's)
    DeviceQueues& q = device_queues();
    if (!s.is_cuda_host_lane()) {
      q.wait_event(handle_.get(), s.native());
      return;
    }
    // The point recorded now, for the lane's thread to wait on when it gets there (the event
    // may be recorded again meanwhile): aux waits for it and records a snapshot.
    CudaHostLane& lane = host_lane(s.handle_);
    q.wait_event(handle_.get(), lane.aux.get());
    std::shared_ptr<void> snapshot = q.create_event();
    q.record_event(snapshot.get(), lane.aux.get());
    lane.queue.push(
        [snapshot, stream = s.native()](const std::exception_ptr&) {
          DeviceQueues& lane_q = device_queues();
          lane_q.bind_thread();
          lane_q.wait_event(snapshot.get(), stream);
        },
        false);
    return;
  }
  CpuEvent& e = cpu_event(handle_);
  const std::uint64_t target = e.last();
  if (target == 0) return;
  if (s.is_default()) {
    e.wait_for(target);
    return;
  }
  queue(s.handle_).push(
      [state = handle_, target](const std::exception_ptr&) {
        static_cast<CpuEvent*>(state.get())->wait_for(target);
      },
      false);
}

void Event::synchronize() const {
  if (device_ == Device::cuda) {
    CpuEvent& host = cpu_event(host_);
    const std::uint64_t target = host.last();
    host.wait_for(target);
    device_queues().synchronize_event(handle_.get());
    return;
  }
  CpuEvent& e = cpu_event(handle_);
  const std::uint64_t target = e.last();
  e.wait_for(target);
}

bool Event::ready() const {
  if (device_ == Device::cuda)
    return cpu_event(host_).reached_last() && device_queues().event_ready(handle_.get());
  return cpu_event(handle_).reached_last();
}

void record_stream(const Tensor& t, const Stream& s) {
  if (t.device() != Device::cuda || s.device() != Device::cuda) return;
  allocator_for(Device::cuda).record_stream(t.storage_ptr(), s.native());
}

Event run_after_compute(const Stream& lane, std::initializer_list<Tensor> uses,
                        std::function<void()> work) {
  Event ready(lane.device());
  ready.record(Stream(lane.device()));
  ready.wait(lane);
  for (const Tensor& t : uses) record_stream(t, lane);
  lane.run(std::move(work));
  Event done(lane.device());
  done.record(lane);
  return done;
}

}  // namespace tpx
