// The CUDA runtime's streams and events (see stream.h).
#include "stream.h"

#include <cuda_runtime_api.h>

#include "check.h"
#include "device.h"

namespace tpx::cuda {
namespace {

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}
cudaEvent_t as_event(void* e) {
  return static_cast<cudaEvent_t>(e);
}

// Every call binds the calling thread to the device first (device.h): a host lane's thread or
// the watchdog's may make its first CUDA call here.
class RuntimeQueues final : public DeviceQueues {
 public:
  void bind_thread() override { ensure_initialized(); }

  std::shared_ptr<void> create_stream() override {
    ensure_initialized();
    cudaStream_t s = nullptr;
    TPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Destruction must not throw (it may run during unwinding); errors are ignored there.
    return {s, [](void* p) { cudaStreamDestroy(as_stream(p)); }};
  }

  void synchronize_stream(void* stream) override {
    ensure_initialized();
    TPX_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }

  std::shared_ptr<void> create_event() override {
    ensure_initialized();
    cudaEvent_t e = nullptr;
    TPX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return {e, [](void* p) { cudaEventDestroy(as_event(p)); }};
  }

  void record_event(void* event, void* stream) override {
    ensure_initialized();
    TPX_CUDA_CHECK(cudaEventRecord(as_event(event), as_stream(stream)));
  }

  void wait_event(void* event, void* stream) override {
    ensure_initialized();
    TPX_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0));
  }

  void synchronize_event(void* event) override {
    ensure_initialized();
    TPX_CUDA_CHECK(cudaEventSynchronize(as_event(event)));
  }

  bool event_ready(void* event) override {
    ensure_initialized();
    const cudaError_t rc = cudaEventQuery(as_event(event));
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();  // NotReady is a status, not a sticky error; clear it
      return false;
    }
    TPX_CUDA_CHECK(rc);
    return true;
  }

  void* current_stream() override { return cuda::current_stream(); }
  void set_current_stream(void* stream) override { cuda::set_current_stream(stream); }
};

}  // namespace

DeviceQueues& runtime_queues() {
  static RuntimeQueues queues;
  return queues;
}

}  // namespace tpx::cuda
