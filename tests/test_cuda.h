// What the CUDA tests share: the visible skip where no GPU can run them, and moving tensors
// between the host and the device.
//
// defines: TPX_REQUIRE_GPU, tpx::test::on_gpu, tpx::test::on_cpu, tpx::test::gpu_empty
#pragma once

#include <utility>

#include <gtest/gtest.h>

#include "common/ops.h"
#include "common/tensor.h"

/// Skips the calling test (GTEST_SKIP, visible in ctest's summary) with the reason no GPU is
/// usable.
#define TPX_REQUIRE_GPU()                                                               \
  do {                                                                                  \
    if (const auto why = ::tpx::ops::device_problem(::tpx::Device::cuda); !why.empty()) \
      GTEST_SKIP() << "no usable GPU: " << why;                                         \
  } while (0)

namespace tpx::test {

inline Tensor on_gpu(const Tensor& host) {
  return ops::to_device(host, Device::cuda);
}
inline Tensor on_cpu(const Tensor& t) {
  return ops::to_device(t, Device::cpu);
}
inline Tensor gpu_empty(Tensor::Shape shape, DType d = DType::f32) {
  return Tensor::empty(std::move(shape), d, Device::cuda);
}

}  // namespace tpx::test
