// A std::vector whose bytes come from the cpu backend's allocator (allocator_for(Device::cpu)),
// so that a stage's host-side state — stage 10's experts, their gradients, moments and what their
// backward keeps — is in the step table's peak and in the memory estimate's measurements as a
// tensor's bytes are.
//
// defines: tpx::HostAllocator, tpx::HostVector, tpx::release()
#pragma once

#include <cstddef>
#include <vector>

#include "tensor.h"

namespace tpx {

template <class T>
struct HostAllocator {
  using value_type = T;
  HostAllocator() = default;
  template <class U>
  HostAllocator(const HostAllocator<U>& /*other*/) {}  // NOLINT: rebinding, as std::allocator
  T* allocate(std::size_t n) {
    return static_cast<T*>(allocator_for(Device::cpu).allocate(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) { allocator_for(Device::cpu).deallocate(p, n * sizeof(T)); }
  friend bool operator==(const HostAllocator&, const HostAllocator&) { return true; }
};

template <class T>
using HostVector = std::vector<T, HostAllocator<T>>;

/// Lets v's memory go now. (`v = {}` would not: it assigns an empty list and keeps the capacity.)
template <class T>
void release(HostVector<T>& v) {
  HostVector<T>().swap(v);
}

}  // namespace tpx
