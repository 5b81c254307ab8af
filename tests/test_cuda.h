// What the CUDA tests share: the visible skip where no GPU can run them, and moving tensors
// between the host and the device.
//
// defines: TPX_REQUIRE_GPU, tpx::test::expect_gpu, tpx::test::on_gpu, tpx::test::on_cpu,
//          tpx::test::gpu_empty
#pragma once

#include <cstdlib>
#include <string_view>
#include <utility>

#include <gtest/gtest.h>

#include "common/ops.h"
#include "common/tensor.h"

/// Skips the calling test (GTEST_SKIP, visible in ctest's summary) with the reason no GPU is
/// usable. With TPX_EXPECT_GPU=1 in the environment (a machine that has a GPU) it fails the test
/// instead: there a missing GPU means a broken driver or an empty CUDA_VISIBLE_DEVICES, and a run
/// whose GPU tests all skipped must not read as a pass.
#define TPX_REQUIRE_GPU()                                                                      \
  do {                                                                                         \
    if (const auto why = ::tpx::ops::device_problem(::tpx::Device::cuda); !why.empty()) {      \
      if (::tpx::test::expect_gpu()) FAIL() << "TPX_EXPECT_GPU=1, but no usable GPU: " << why; \
      GTEST_SKIP() << "no usable GPU: " << why;                                                \
    }                                                                                          \
  } while (0)

namespace tpx::test {

/// TPX_EXPECT_GPU=1: GPU tests fail instead of skipping when no GPU is usable.
inline bool expect_gpu() {
  const char* v = std::getenv("TPX_EXPECT_GPU");
  return v != nullptr && std::string_view(v) == "1";
}

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
