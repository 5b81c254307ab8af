// A caching allocator for device memory. cudaMalloc/cudaFree are slow and cudaFree synchronises
// the device, so freed blocks are kept in free lists and handed out again.
//
// Size classes: 512 B granularity up to 1 MiB, above that 8 classes per power of two (at most
// 12.5 % waste). Every block comes from its own cudaMalloc, so it is 256-byte aligned (what
// cuBLASLt and 16-byte vector loads want).
//
// Streams. A block belongs to the stream that allocated it (cuda::current_stream() at the time;
// nullptr is the legacy default stream), and there is one free list per (stream, size class):
// allocate() hands out only blocks freed on the current stream. Reuse on the owning stream is
// safe without any synchronisation: the stream runs the new user's kernels after the old user's.
//
// A block used by work on another stream must be announced with record_stream(ptr, stream) (the
// stream that owns it needs no announcement). When such a block is freed, an event is recorded on
// each announced stream and the block waits on a pending list; it joins its stream's free list
// only once all those events have completed (checked, without blocking, at every allocate() and
// release_cached()). So the block is never handed out while a kernel of another stream that was
// issued before the free may still touch it. This is the rule of PyTorch's CUDA caching
// allocator and its Tensor.record_stream(). Work issued after the free cannot be covered: a
// tensor must be held while work that uses it is issued.
//
// Blocks cached for a stream stay on its list until release_cached() (or an out-of-memory
// retry), also after the stream is destroyed: a program creates its streams once and keeps them.
//
// Out of memory: the cached blocks of every stream, and pending blocks whose events have
// completed, go back to the driver and cudaMalloc is retried; if it fails again, the allocator
// waits for the pending blocks' events, frees those blocks too and tries once more.
//
// TPX_EXACT_ALLOC=1 in the environment turns the cache off for debugging: every block is a
// cudaMalloc of exactly the bytes asked for and is cudaFree'd when it is freed (which waits for
// the device, so no stream can still use it). compute-sanitizer's memcheck then sees an access
// one element past a tensor, which a rounded-up, reused block would hide. Slow; not for timing.
//
// defines: tpx::cuda::CachingAllocator
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/tensor.h"

namespace tpx::cuda {

class CachingAllocator final : public Allocator {
 public:
  CachingAllocator();
  ~CachingAllocator() override;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// A block for the calling thread's current stream.
  void* allocate(std::size_t bytes) override;
  /// Returns the block to its stream's free list, or (after record_stream) to the pending list.
  /// Never throws: a failure to record the events frees the block instead (cudaFree waits for
  /// the device).
  void deallocate(void* ptr, std::size_t bytes) override;
  /// Bytes handed out and not yet returned (as requested, not rounded), and their high-water mark.
  /// A pending block is no longer in use (it counts in reserved_bytes()).
  MemoryStats stats() const override;
  void reset_peak() override;
  /// Work on `stream` (a cudaStream_t; nullptr = legacy default stream) uses the live block at
  /// `ptr`. Ignored for the block's own stream and for pointers this allocator did not hand out.
  void record_stream(void* ptr, void* stream) override;

  /// Bytes obtained from cudaMalloc: in use (rounded), pending and cached.
  std::size_t reserved_bytes() const;
  /// Returns every cached block, of every stream, to the driver, and pending blocks whose events
  /// have completed; pending blocks still in use by a stream are kept.
  void release_cached();

  /// The size class a request of `bytes` is served from.
  static std::size_t size_class(std::size_t bytes);

 private:
  /// A block handed out: its stream, and the other streams recorded as using it.
  struct Live {
    void* stream = nullptr;
    std::vector<void*> uses;
  };
  /// A freed block waiting for the events recorded on the streams that used it.
  struct Pending {
    void* ptr = nullptr;
    std::size_t size = 0;  // size class
    void* stream = nullptr;
    std::vector<void*> events;  // cudaEvent_t, not yet completed
  };
  using FreeKey = std::pair<void*, std::size_t>;  // (stream, size class)

  /// Moves pending blocks whose events have all completed to their free lists. With `wait`,
  /// blocks the host until every pending block's events have completed.
  void process_pending_locked(bool wait);
  void release_cached_locked(bool wait);
  void* malloc_locked(std::size_t size, std::size_t bytes);

  bool exact_ = false;  // TPX_EXACT_ALLOC=1: no rounding, no cache
  mutable std::mutex mutex_;
  std::map<FreeKey, std::vector<void*>> free_;  // cached blocks, per (stream, size class)
  std::unordered_map<void*, Live> live_;        // blocks handed out
  std::vector<Pending> pending_;
  std::vector<void*> events_;  // idle cudaEvent_t (cudaEventDisableTiming), for reuse
  MemoryStats stats_;
  std::size_t reserved_ = 0;
};

}  // namespace tpx::cuda
