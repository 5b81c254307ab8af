#include "allocator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>

#include <fmt/format.h>

#include "check.h"

namespace tpx::cuda {

std::size_t CachingAllocator::size_class(std::size_t bytes) {
  constexpr std::size_t kSmall = 512, kLarge = std::size_t{1} << 20;
  if (bytes <= kLarge) return std::max<std::size_t>(kSmall, (bytes + kSmall - 1) / kSmall * kSmall);
  const std::size_t step = std::bit_floor(bytes) / 8;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::~CachingAllocator() {
  // Runs at exit, possibly after the CUDA runtime has shut down: errors are ignored.
  for (auto& [size, blocks] : free_)
    for (void* p : blocks) (void)cudaFree(p);
}

void* CachingAllocator::allocate(std::size_t bytes) {
  const std::size_t cls = size_class(bytes);
  std::lock_guard lock(mutex_);
  void* ptr = nullptr;
  if (auto it = free_.find(cls); it != free_.end() && !it->second.empty()) {
    ptr = it->second.back();
    it->second.pop_back();
  } else {
    cudaError_t rc = cudaMalloc(&ptr, cls);
    if (rc == cudaErrorMemoryAllocation) {  // give the cache back to the driver and try again
      (void)cudaGetLastError();
      release_cached_locked();
      rc = cudaMalloc(&ptr, cls);
    }
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      fail(fmt::format("out of device memory allocating {} bytes ({} in use, {} reserved)", bytes,
                       stats_.current, reserved_));
    }
    TPX_CUDA_CHECK(rc);
    reserved_ += cls;
  }
  stats_.current += bytes;
  stats_.peak = std::max(stats_.peak, stats_.current);
  return ptr;
}

void CachingAllocator::deallocate(void* ptr, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  free_[size_class(bytes)].push_back(ptr);
  stats_.current -= bytes;
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
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
  release_cached_locked();
}

void CachingAllocator::release_cached_locked() {
  for (auto& [size, blocks] : free_) {
    for (void* p : blocks) TPX_CUDA_CHECK(cudaFree(p));
    reserved_ -= size * blocks.size();
    blocks.clear();
  }
}

}  // namespace tpx::cuda
