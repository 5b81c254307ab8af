// A caching allocator for device memory. cudaMalloc/cudaFree are slow and cudaFree synchronises
// the device, so freed blocks are kept in free lists, one per size class, and handed out again.
//
// Size classes: 512 B granularity up to 1 MiB, above that 8 classes per power of two (at most
// 12.5 % waste). Every block comes from its own cudaMalloc, so it is 256-byte aligned (what
// cuBLASLt and 16-byte vector loads want).
//
// Reuse is safe for work issued on one stream (the stream orders the old user's kernels before
// the new user's). A tensor used on another stream must be kept alive until that stream's work is
// known to be complete (an Event), exactly as with any stream-ordered pool.
//
// defines: tpx::cuda::CachingAllocator
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/tensor.h"

namespace tpx::cuda {

class CachingAllocator final : public Allocator {
 public:
  CachingAllocator() = default;
  ~CachingAllocator() override;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  void* allocate(std::size_t bytes) override;
  void deallocate(void* ptr, std::size_t bytes) override;
  /// Bytes handed out and not yet returned (as requested, not rounded), and their high-water mark.
  MemoryStats stats() const override;
  void reset_peak() override;

  /// Bytes obtained from cudaMalloc: in use (rounded) plus cached.
  std::size_t reserved_bytes() const;
  /// Returns every cached block to the driver.
  void release_cached();

  /// The size class a request of `bytes` is served from.
  static std::size_t size_class(std::size_t bytes);

 private:
  void release_cached_locked();

  mutable std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;  // size class -> cached blocks
  MemoryStats stats_;
  std::size_t reserved_ = 0;
};

}  // namespace tpx::cuda
