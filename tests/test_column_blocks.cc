// Ulysses' packing (stage 08, --cp-method ulysses): the index map of common/column_blocks.h,
// which the cpu copies and the cuda kernel (common/cuda/column_blocks.cu) both call, against
// the layout written out here as loops (block r = columns r·c … (r + 1)·c − 1 of every row of
// x [m, n·c]); ops::split_columns / join_columns on the cpu against the same loops, for fp32
// and bf16; and on a GPU, the kernel bit for bit against the cpu op. The map is the device's
// own code (a host/device function): the GPU run checks only the kernel's launch around it.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "common/column_blocks.h"
#include "common/ops.h"
#include "common/tensor.h"
#include "test_cuda.h"

namespace tpx {
namespace {

using I = std::int64_t;

/// The packing as the layout says it: for each block r, row i, column k within the block.
std::vector<I> reference_sources(I m, I c, I n) {
  std::vector<I> src(static_cast<std::size_t>(m * c * n));
  for (I r = 0; r < n; ++r)
    for (I i = 0; i < m; ++i)
      for (I k = 0; k < c; ++k)
        src[static_cast<std::size_t>((r * m + i) * c + k)] = i * n * c + r * c + k;
  return src;
}

using Shape = std::tuple<I, I, I>;  // m, c, n
const std::vector<Shape> kShapes = {{1, 1, 1},   {1, 1, 4}, {7, 3, 2},  {5, 8, 4},
                                    {24, 16, 2}, {3, 1, 8}, {16, 64, 3}};

TEST(ColumnBlocks, IndexMapIsTheLayout) {
  for (const auto& [m, c, n] : kShapes) {
    const std::vector<I> want = reference_sources(m, c, n);
    std::vector<int> hits(want.size(), 0);
    for (I e = 0; e < m * c * n; ++e) {
      const I x = hd::column_block_source(e, m, c, n);
      ASSERT_EQ(x, want[static_cast<std::size_t>(e)])
          << "m " << m << " c " << c << " n " << n << " e " << e;
      ++hits[static_cast<std::size_t>(x)];
    }
    for (std::size_t x = 0; x < hits.size(); ++x)
      ASSERT_EQ(hits[x], 1) << "element " << x << " of x read " << hits[x] << " times";
  }
}

/// x [m, n·c] filled with distinct values (exact in bf16 too: small integers).
Tensor numbered(I m, I c, I n, DType dtype) {
  const Tensor f = Tensor::empty({m, n * c});
  auto v = f.f32();
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 251) - 125.0f;
  if (dtype == DType::f32) return f;
  const Tensor b = Tensor::empty(f.shape(), dtype);
  ops::cast(f, b);
  return b;
}

TEST(ColumnBlocks, CpuSplitAndJoinFollowTheLayout) {
  for (const DType dtype : {DType::f32, DType::bf16})
    for (const auto& [m, c, n] : kShapes) {
      SCOPED_TRACE(testing::Message()
                   << to_string(dtype) << " m " << m << " c " << c << " n " << n);
      const Tensor x = numbered(m, c, n, dtype);
      const Tensor blocks = Tensor::empty({m * n * c}, dtype);
      ops::split_columns(x, n, blocks);
      const std::vector<I> src = reference_sources(m, c, n);
      const std::size_t es = dtype_size(dtype);
      const auto* xb = static_cast<const unsigned char*>(x.raw());
      const auto* bb = static_cast<const unsigned char*>(blocks.raw());
      for (std::size_t e = 0; e < src.size(); ++e)
        ASSERT_EQ(std::memcmp(bb + e * es, xb + static_cast<std::size_t>(src[e]) * es, es), 0)
            << "block element " << e;
      const Tensor back = Tensor::empty(x.shape(), dtype);
      ops::join_columns(blocks, n, back);
      EXPECT_EQ(std::memcmp(back.raw(), x.raw(), x.nbytes()), 0) << "join ∘ split is not x";
    }
}

TEST(ColumnBlocks, RefusesWhatItCannotSplit) {
  const Tensor x = Tensor::empty({4, 6});
  EXPECT_ANY_THROW(ops::split_columns(x, 4, Tensor::empty({24})));  // 6 columns in 4 blocks
  EXPECT_ANY_THROW(ops::split_columns(x, 2, Tensor::empty({20})));
  EXPECT_ANY_THROW(ops::split_columns(x, 2, Tensor::empty({24}, DType::bf16)));
}

TEST(ColumnBlocks, CudaKernelMatchesCpu) {
  TPX_REQUIRE_GPU();
  for (const DType dtype : {DType::f32, DType::bf16})
    for (const auto& [m, c, n] : kShapes) {
      SCOPED_TRACE(testing::Message()
                   << to_string(dtype) << " m " << m << " c " << c << " n " << n);
      const Tensor x = numbered(m, c, n, dtype);
      const Tensor blocks = Tensor::empty({m * n * c}, dtype);
      ops::split_columns(x, n, blocks);
      const Tensor gx = ops::to_device(x, Device::cuda);
      const Tensor gblocks = Tensor::empty(blocks.shape(), dtype, Device::cuda);
      ops::split_columns(gx, n, gblocks);
      const Tensor got = Tensor::empty(blocks.shape(), dtype);
      ops::copy(gblocks, got);
      EXPECT_EQ(std::memcmp(got.raw(), blocks.raw(), blocks.nbytes()), 0) << "split";
      const Tensor gback = Tensor::empty(x.shape(), dtype, Device::cuda);
      ops::join_columns(gblocks, n, gback);
      const Tensor back = Tensor::empty(x.shape(), dtype);
      ops::copy(gback, back);
      EXPECT_EQ(std::memcmp(back.raw(), x.raw(), x.nbytes()), 0) << "join";
    }
}

}  // namespace
}  // namespace tpx
