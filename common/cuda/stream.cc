// CUDA streams and events (see stream.h).
#include "stream.h"

#include <cuda_runtime_api.h>

#include "check.h"
#include "device.h"

namespace tpx::cuda {

std::shared_ptr<void> create_stream() {
  ensure_initialized();
  cudaStream_t s = nullptr;
  TPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Destruction must not throw (it may run during unwinding); errors are ignored there.
  return {s, [](void* p) { cudaStreamDestroy(static_cast<cudaStream_t>(p)); }};
}

void synchronize_stream(void* stream) {
  ensure_initialized();  // binds this thread to the device (device.h)
  TPX_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

std::shared_ptr<void> create_event() {
  ensure_initialized();
  cudaEvent_t e = nullptr;
  TPX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return {e, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); }};
}

void record_event(void* event, void* stream) {
  ensure_initialized();  // binds this thread to the device (device.h)
  TPX_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

void wait_event(void* event, void* stream) {
  ensure_initialized();  // binds this thread to the device (device.h)
  TPX_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

void synchronize_event(void* event) {
  ensure_initialized();  // binds this thread to the device (device.h)
  TPX_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

bool event_ready(void* event) {
  ensure_initialized();  // binds this thread to the device (device.h)
  const cudaError_t rc = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (rc == cudaErrorNotReady) {
    (void)cudaGetLastError();  // NotReady is a status, not a sticky error; clear it
    return false;
  }
  TPX_CUDA_CHECK(rc);
  return true;
}

}  // namespace tpx::cuda
