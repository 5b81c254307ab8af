// A simulated asynchronous device for the cpu: the stand-in that common/device_queues.h lets a
// test put behind Device::cuda, so that Stream and Event's cuda protocol (common/stream.cc: the
// host lanes, their snapshots and counters) runs on a machine without a GPU.
//
// Its streams behave as CUDA's do where the protocol depends on it: each stream (the default one
// too) is a thread of its own that runs its operations in issue order, behind the host that
// issues them; an event's record marks the point its stream has reached in its issue order, a
// wait makes a stream's later operations wait for the point last recorded before the wait was
// issued (re-recording moves the mark only for later waits), an event never recorded is
// complete. A test issues "kernels" with launch() on the calling thread's current stream and
// holds a stream at a point with a Gate.
//
// defines: tpx::test::SimDevice, tpx::test::SimDevice::Gate
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/device_queues.h"

namespace tpx::test {

class SimDevice final : public DeviceQueues {
 public:
  SimDevice() : default_(std::make_shared<Queue>()) {}
  SimDevice(const SimDevice&) = delete;
  SimDevice& operator=(const SimDevice&) = delete;

  /// Runs `kernel` on the calling thread's current stream, after what was issued there before.
  void launch(std::function<void()> kernel) { queue(current_stream()).push(std::move(kernel)); }

  /// Holds a stream at the point where it is made until open() (or its destructor, so that a
  /// failed check never leaves a stream blocked).
  class Gate {
   public:
    Gate(SimDevice& device, void* stream) {
      device.queue(stream).push([state = state_] {
        std::unique_lock lock(state->mutex);
        state->changed.wait(lock, [&] { return state->open; });
      });
    }
    ~Gate() { open(); }
    Gate(const Gate&) = delete;
    Gate& operator=(const Gate&) = delete;
    void open() {
      {
        std::lock_guard lock(state_->mutex);
        state_->open = true;
      }
      state_->changed.notify_all();
    }

   private:
    struct State {
      std::mutex mutex;
      std::condition_variable changed;
      bool open = false;
    };
    std::shared_ptr<State> state_ = std::make_shared<State>();
  };

  // --- DeviceQueues ----------------------------------------------------------------------------

  void bind_thread() override { ++bound_; }

  std::shared_ptr<void> create_stream() override {
    auto* q = new Queue;
    return {q, [](void* p) { delete static_cast<Queue*>(p); }};
  }

  void synchronize_stream(void* stream) override { queue(stream).drain(); }

  /// Events live as long as the device: a wait already issued on a stream still reads an event
  /// whose handle is gone (CUDA allows destroying an event a stream waits on).
  std::shared_ptr<void> create_event() override {
    std::lock_guard lock(events_mutex_);
    events_.push_back(std::make_unique<Event>());
    return {events_.back().get(), [](void*) {}};
  }

  void record_event(void* event, void* stream) override {
    Event& e = as_event(event);
    std::uint64_t generation = 0;
    {
      std::lock_guard lock(e.mutex);
      generation = ++e.recorded;
      e.reached.push_back(false);
    }
    queue(stream).push([&e, generation] {
      {
        std::lock_guard lock(e.mutex);
        e.reached[generation - 1] = true;
      }
      e.changed.notify_all();
    });
  }

  void wait_event(void* event, void* stream) override {
    Event& e = as_event(event);
    std::uint64_t target = 0;
    {
      std::lock_guard lock(e.mutex);
      target = e.recorded;
    }
    if (target > 0) queue(stream).push([&e, target] { e.wait_for(target); });
  }

  void synchronize_event(void* event) override {
    Event& e = as_event(event);
    std::uint64_t target = 0;
    {
      std::lock_guard lock(e.mutex);
      target = e.recorded;
    }
    if (target > 0) e.wait_for(target);
  }

  bool event_ready(void* event) override {
    Event& e = as_event(event);
    std::lock_guard lock(e.mutex);
    return e.recorded == 0 || e.reached[e.recorded - 1];
  }

  void* current_stream() override { return tls_stream(); }
  void set_current_stream(void* stream) override { tls_stream() = stream; }

  /// How many times a thread was bound to the device (every host lane task binds its thread).
  int bound() const { return bound_.load(); }

 private:
  /// A stream: its operations run in issue order on a thread of its own.
  class Queue {
   public:
    Queue() : worker_([this] { run(); }) {}
    ~Queue() {
      {
        std::lock_guard lock(mutex_);
        stopping_ = true;
      }
      changed_.notify_all();
      worker_.join();
    }
    Queue(const Queue&) = delete;
    Queue& operator=(const Queue&) = delete;

    void push(std::function<void()> op) {
      {
        std::lock_guard lock(mutex_);
        ops_.push_back(std::move(op));
        ++issued_;
      }
      changed_.notify_all();
    }
    /// Blocks until what was issued before the call has run.
    void drain() {
      std::unique_lock lock(mutex_);
      const std::uint64_t target = issued_;
      changed_.wait(lock, [&] { return done_ >= target; });
    }

   private:
    void run() {
      std::unique_lock lock(mutex_);
      for (;;) {
        changed_.wait(lock, [&] { return stopping_ || !ops_.empty(); });
        if (ops_.empty()) return;
        std::function<void()> op = std::move(ops_.front());
        ops_.pop_front();
        lock.unlock();
        op();
        lock.lock();
        ++done_;
        changed_.notify_all();
      }
    }

    std::mutex mutex_;
    std::condition_variable changed_;
    std::deque<std::function<void()>> ops_;
    std::uint64_t issued_ = 0, done_ = 0;
    bool stopping_ = false;
    std::thread worker_;  // last: it starts once the state above exists
  };

  /// An event: the records made, and which of them their streams have reached.
  struct Event {
    std::mutex mutex;
    std::condition_variable changed;
    std::uint64_t recorded = 0;
    std::vector<bool> reached;  // reached[g − 1]: record g's point was passed

    void wait_for(std::uint64_t generation) {
      std::unique_lock lock(mutex);
      changed.wait(lock, [&] { return reached[generation - 1]; });
    }
  };

  static Event& as_event(void* e) { return *static_cast<Event*>(e); }
  Queue& queue(void* stream) { return stream ? *static_cast<Queue*>(stream) : *default_; }
  static void*& tls_stream() {
    thread_local void* stream = nullptr;
    return stream;
  }

  std::mutex events_mutex_;
  std::vector<std::unique_ptr<Event>> events_;
  std::atomic<int> bound_{0};
  std::shared_ptr<Queue> default_;  // the default (compute) stream; last, so stopped first
};

}  // namespace tpx::test
