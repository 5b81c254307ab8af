// CUDA streams and events behind tpx::Stream / tpx::Event (common/stream.h). Handles travel as
// void* (cudaStream_t / cudaEvent_t) so that common/stream.cc needs no CUDA header; owning
// handles are shared_ptr<void> whose deleter destroys the native object.
//
// defines: tpx::cuda::create_stream, synchronize_stream, create_event, record_event, wait_event,
//          synchronize_event, event_ready
#pragma once

#include <memory>

namespace tpx::cuda {

/// A new non-blocking stream (cudaStreamNonBlocking) on the current device.
std::shared_ptr<void> create_stream();
/// Blocks the host until `stream` (nullptr = the legacy default stream) has drained.
void synchronize_stream(void* stream);

/// A new event without timing (cudaEventDisableTiming: cheapest to record and wait on).
std::shared_ptr<void> create_event();
/// Records `event` on `stream` (nullptr = default stream).
void record_event(void* event, void* stream);
/// Makes `stream` wait on the device for `event`; the host does not block.
void wait_event(void* event, void* stream);
/// Blocks the host until `event` has completed.
void synchronize_event(void* event);
/// True once `event` has completed (or was never recorded).
bool event_ready(void* event);

}  // namespace tpx::cuda
