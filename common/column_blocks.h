// Ulysses' packing (stage 08, --cp-method ulysses): a tensor x seen as a row-major matrix
// [m, n·c] (m rows of its last dimension, n·c columns) and the same elements as n blocks [m, c]
// one after another, block r holding columns r·c … (r + 1)·c − 1 of every row. Before an
// all-to-all block r is what goes to CP rank r (split: blocks ← x); after it, block r is what
// came from rank r and goes back into its columns (join: x ← blocks).
//
// The index map below is the one description of that layout: the cpu copies of
// ops::split_columns / join_columns (common/ops.cc) and the cuda kernel
// (common/cuda/column_blocks.cu) both call it, and tests/test_column_blocks.cc checks it
// against the layout written out as loops.
//
// defines: tpx::hd::column_block_source
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace tpx::hd {

/// Element e of the blocks (block r = e / (m·c), row i, column k within it) is element
/// i·(n·c) + r·c + k of x. A bijection of [0, m·n·c); runs of c consecutive e map to runs of c
/// consecutive elements of x (one row of one block).
TPX_HD inline std::int64_t column_block_source(std::int64_t e, std::int64_t m, std::int64_t c,
                                               std::int64_t n) {
  const std::int64_t block = m * c;
  const std::int64_t r = e / block, within = e - r * block;
  const std::int64_t i = within / c, k = within - i * c;
  return i * (n * c) + r * c + k;
}

}  // namespace tpx::hd
