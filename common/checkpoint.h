// Checkpoints: the primitives of the on-disk format (DESIGN.md, "Checkpoints").
//
// A checkpoint is a directory DIR/step-<N>/ with each rank's shard files and one index.json that
// names every tensor's global shape, dtype and each shard's file, byte offset, global ranges and
// checksum. This file holds what the format is built on: the checksum every shard carries and
// the overlap of two parts of one global tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace tpx {

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, initial value and final xor 0xFFFFFFFF) of
// `n` bytes. `crc` continues an earlier call: crc32(b, n2, crc32(a, n1)) is the CRC of a then b,
// so a shard written in pieces has the checksum of its whole bytes.
std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0);

// One dimension of the part of a global tensor a shard covers: indices [start, start + length).
struct IndexRange {
  std::int64_t start = 0;
  std::int64_t length = 0;
  bool operator==(const IndexRange&) const = default;
};

// The box two parts of one global tensor share, dimension by dimension, or nothing when they are
// disjoint (or their ranks differ). Reshard reads, of each shard, the box it shares with the part
// a rank now owns.
std::optional<std::vector<IndexRange>> overlap(const std::vector<IndexRange>& a,
                                               const std::vector<IndexRange>& b);

}  // namespace tpx
