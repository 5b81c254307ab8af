// The cpu side of Stream/Event; cuda streams and events are created and driven by the functions
// in common/cuda/stream.h (the CUDA backend).
#include "stream.h"

#include "check.h"
#if TPX_WITH_CUDA
#include "cuda/stream.h"
#endif

namespace tpx {

Stream::Stream(Device device) : device_(device) {}

Stream Stream::create(Device device) {
  Stream s(device);
#if TPX_WITH_CUDA
  if (device == Device::cuda) s.handle_ = cuda::create_stream();
#else
  TPX_CHECK(device == Device::cpu, "this build has no CUDA backend");
#endif
  return s;
}

void Stream::synchronize() const {
#if TPX_WITH_CUDA
  if (device_ == Device::cuda) cuda::synchronize_stream(native());
#endif
}

Event::Event(Device device) : device_(device) {
#if TPX_WITH_CUDA
  if (device == Device::cuda) handle_ = cuda::create_event();
#else
  TPX_CHECK(device == Device::cpu, "this build has no CUDA backend");
#endif
}

void Event::record([[maybe_unused]] const Stream& s) {
#if TPX_WITH_CUDA
  if (device_ == Device::cuda) cuda::record_event(handle_.get(), s.native());
#endif
}

void Event::wait([[maybe_unused]] const Stream& s) const {
#if TPX_WITH_CUDA
  if (device_ == Device::cuda) cuda::wait_event(handle_.get(), s.native());
#endif
}

void Event::synchronize() const {
#if TPX_WITH_CUDA
  if (device_ == Device::cuda) cuda::synchronize_event(handle_.get());
#endif
}

bool Event::ready() const {
#if TPX_WITH_CUDA
  if (device_ == Device::cuda) return cuda::event_ready(handle_.get());
#endif
  return true;
}

}  // namespace tpx
