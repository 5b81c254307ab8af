#include "allocator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "check.h"
#include "device.h"

namespace tpx::cuda {
namespace {

cudaEvent_t as_event(void* e) {
  return static_cast<cudaEvent_t>(e);
}
cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

}  // namespace

std::size_t CachingAllocator::size_class(std::size_t bytes) {
  constexpr std::size_t kSmall = 512, kLarge = std::size_t{1} << 20;
  if (bytes <= kLarge) return std::max<std::size_t>(kSmall, (bytes + kSmall - 1) / kSmall * kSmall);
  const std::size_t step = std::bit_floor(bytes) / 8;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::CachingAllocator() {
  const char* exact = std::getenv("TPX_EXACT_ALLOC");
  exact_ = exact != nullptr && std::string_view(exact) == "1";
}

CachingAllocator::~CachingAllocator() {
  // Runs at exit, possibly after the CUDA runtime has shut down: errors are ignored.
  for (auto& [key, blocks] : free_)
    for (void* p : blocks) (void)cudaFree(p);
  for (Pending& p : pending_) {
    for (void* e : p.events) (void)cudaEventDestroy(as_event(e));
    (void)cudaFree(p.ptr);
  }
  for (void* e : events_) (void)cudaEventDestroy(as_event(e));
}

void* CachingAllocator::allocate(std::size_t bytes) {
  const std::size_t cls = exact_ ? std::max<std::size_t>(bytes, 1) : size_class(bytes);
  void* const stream = current_stream();
  std::lock_guard lock(mutex_);
  if (!pending_.empty()) process_pending_locked(/*wait=*/false);
  void* ptr = nullptr;
  if (auto it = free_.find({stream, cls}); it != free_.end() && !it->second.empty()) {
    ptr = it->second.back();  // last in, first out: the block most likely still in L2
    it->second.pop_back();
  } else {
    ptr = malloc_locked(cls, bytes);
  }
  live_[ptr] = Live{stream, {}};
  stats_.current += bytes;
  stats_.peak = std::max(stats_.peak, stats_.current);
  return ptr;
}

void* CachingAllocator::malloc_locked(std::size_t size, std::size_t bytes) {
  void* ptr = nullptr;
  cudaError_t rc = cudaMalloc(&ptr, size);
  // Out of memory: give the cache back to the driver and try again; then also wait for the
  // blocks held back for other streams, and try once more.
  for (int attempt = 0; rc == cudaErrorMemoryAllocation && attempt < 2; ++attempt) {
    (void)cudaGetLastError();
    const bool wait = attempt == 1;
    if (wait && pending_.empty()) break;
    release_cached_locked(wait);
    rc = cudaMalloc(&ptr, size);
  }
  if (rc == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    fail(fmt::format("out of device memory allocating {} bytes ({} in use, {} reserved)", bytes,
                     stats_.current, reserved_));
  }
  TPX_CUDA_CHECK(rc);
  reserved_ += size;
  return ptr;
}

void CachingAllocator::deallocate(void* ptr, std::size_t bytes) {
  const std::size_t cls = exact_ ? std::max<std::size_t>(bytes, 1) : size_class(bytes);
  std::lock_guard lock(mutex_);
  stats_.current -= bytes;
  const auto it = live_.find(ptr);
  if (it == live_.end()) return;  // not from this allocator: not ours to cache
  if (exact_) {                   // no cache: back to the driver (cudaFree waits for the device)
    live_.erase(it);
    reserved_ -= cls;
    if (cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
    return;
  }
  const Live block = std::move(it->second);
  live_.erase(it);
  if (block.uses.empty()) {  // only its own stream used it: reusable there at once
    free_[{block.stream, cls}].push_back(ptr);
    return;
  }

  // Other streams used it: an event on each, and the block waits until they have all passed.
  // This runs in destructors and must not throw; the thread may never have used the device.
  try {
    ensure_initialized();
  } catch (...) {
  }
  Pending held{ptr, cls, block.stream, {}};
  bool recorded = true;
  for (void* s : block.uses) {
    cudaEvent_t e = nullptr;
    if (!events_.empty()) {
      e = as_event(events_.back());
      events_.pop_back();
    } else if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      recorded = false;
      break;
    }
    held.events.push_back(e);
    if (cudaEventRecord(e, as_stream(s)) != cudaSuccess) {  // e.g. the stream was destroyed
      (void)cudaGetLastError();
      recorded = false;
      break;
    }
  }
  if (recorded) {
    pending_.push_back(std::move(held));
    return;
  }
  // No events: wait for the whole device instead (the streams may be gone). If even that fails
  // the context is broken and the block is never handed out again.
  events_.insert(events_.end(), held.events.begin(), held.events.end());
  if (cudaDeviceSynchronize() != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  free_[{block.stream, cls}].push_back(ptr);
}

void CachingAllocator::record_stream(void* ptr, void* stream) {
  std::lock_guard lock(mutex_);
  const auto it = live_.find(ptr);
  if (it == live_.end() || it->second.stream == stream) return;
  auto& uses = it->second.uses;
  if (std::find(uses.begin(), uses.end(), stream) == uses.end()) uses.push_back(stream);
}

void CachingAllocator::process_pending_locked(bool wait) {
  for (std::size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    while (!p.events.empty()) {
      const cudaEvent_t e = as_event(p.events.back());
      if (wait) {
        TPX_CUDA_CHECK(cudaEventSynchronize(e));
      } else if (const cudaError_t rc = cudaEventQuery(e); rc == cudaErrorNotReady) {
        (void)cudaGetLastError();  // NotReady is a status, not a sticky error; clear it
        break;
      } else {
        TPX_CUDA_CHECK(rc);
      }
      p.events.pop_back();
      events_.push_back(e);
    }
    if (p.events.empty()) {  // every stream that used it has passed the free
      free_[{p.stream, p.size}].push_back(p.ptr);
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
    } else {
      ++i;
    }
  }
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  MemoryStats s = stats_;
  s.reserved = reserved_;
  return s;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak = stats_.current;
}

std::size_t CachingAllocator::reserved_bytes() const {
  std::lock_guard lock(mutex_);
  return reserved_;
}

void CachingAllocator::release_cached() {
  std::lock_guard lock(mutex_);
  release_cached_locked(/*wait=*/false);
}

void CachingAllocator::release_cached_locked(bool wait) {
  process_pending_locked(wait);
  for (auto& [key, blocks] : free_) {
    while (!blocks.empty()) {
      TPX_CUDA_CHECK(cudaFree(blocks.back()));
      blocks.pop_back();
      reserved_ -= key.second;
    }
  }
  free_.clear();  // drops the lists of streams that may no longer exist
}

}  // namespace tpx::cuda
