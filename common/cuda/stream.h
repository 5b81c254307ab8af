// The CUDA runtime's streams and events behind tpx::Stream / tpx::Event (common/stream.h), as
// common/device_queues.h describes them: cudaStream_t / cudaEvent_t travel as void*, so that
// common/stream.cc needs no CUDA header.
//
// defines: tpx::cuda::runtime_queues
#pragma once

#include "common/device_queues.h"

namespace tpx::cuda {

/// The CUDA runtime as a DeviceQueues: non-blocking streams (cudaStreamNonBlocking), events
/// without timing (cudaEventDisableTiming: cheapest to record and wait on), and the calling
/// thread's current stream of device.h (null: the legacy default stream).
DeviceQueues& runtime_queues();

}  // namespace tpx::cuda
